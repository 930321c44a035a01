"""The block index a KV-aware router keeps from the bridge's output.

:meth:`KvIndex.apply` takes one record as the bridge writes it (``format: json`` decoded, event or
batch granularity, control records included) and keeps, per engine stream (source, dp_rank), a
:class:`~kv_consumer.state.StreamState` (the blocks the engine holds, with residency counts, and
whether that is complete), and across streams: block -> the streams holding it. The rules are
:class:`StreamState`'s (its module docstring): copies and stale epochs skipped by
:func:`~kv_consumer.state.position`, a restart or a loss drops the stream's blocks, a loss marks
the stream incomplete until the engine clears its cache or restarts, or until it is bootstrapped
again with :meth:`KvIndex.seed`.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from .state import Key, Record, StreamState, block_id, position

Stream = tuple[str, int]  # (source, dp_rank)
Hash = int | str  # int hashes (hash_format: int), or hex text (hash_format: hex, binary hashes)


class KvIndex:
    """Block -> the streams holding it, with per-stream residency counts and completeness.

    ``streams``: (source, dp_rank) -> its :class:`StreamState`. ``holders``: 64-bit block id
    (:func:`~kv_consumer.state.block_id`) -> the streams holding it in any medium. ``applied``,
    ``duplicates`` and ``stale`` count the records applied and skipped."""

    def __init__(self) -> None:
        self.streams: dict[Stream, StreamState] = {}
        self.holders: dict[int, set[Stream]] = {}
        self._held: Counter[tuple[Stream, int]] = Counter()  # (stream, block id) -> entries (media, groups)
        self.applied = self.duplicates = self.stale = 0

    # -- queries --------------------------------------------------------------------------------
    def streams_holding(self, block_hash: Hash) -> set[Stream]:
        """The streams holding ``block_hash`` (an int, or hex text), in any medium."""
        k = block_id(block_hash)
        return set(self.holders.get(k, ())) if k is not None else set()

    def blocks(self, stream: Stream) -> set[Hash]:
        """The hashes ``stream`` holds, as the bridge wrote them."""
        state = self.streams.get(stream)
        return {doc["hash"] for doc in state.entries.values()} if state else set()

    def residency(self, stream: Stream) -> Counter[tuple[Hash, str | None]]:
        """(hash, medium) -> copies ``stream`` holds (groups added up)."""
        state = self.streams.get(stream)
        out: Counter[tuple[Hash, str | None]] = Counter()
        for doc in state.entries.values() if state else ():
            out[doc["hash"], doc["medium"]] += int(doc["count"])
        return out

    def incomplete(self) -> dict[Stream, str]:
        """The streams whose blocks may miss some, and why."""
        return {s: v.why for s, v in self.streams.items() if not v.complete}

    def summary(self) -> str:
        counts = f"{self.applied} records applied, {self.duplicates} duplicates and {self.stale} stale skipped"
        lines = [f"{len(self.holders)} distinct blocks; {counts}"]
        for (source, rank), v in sorted(self.streams.items()):
            state = "complete" if v.complete else f"INCOMPLETE ({v.why})"
            lines.append(f"  {source}/{rank} epoch {v.epoch} seq {v.seq}: {len(v.entries)} blocks, {state}")
        return "\n".join(lines)

    def snapshot(self) -> dict[str, Any]:
        """The whole index as one JSON-able document (the example consumers' ``--json``, the same
        as the Go consumer's): per stream its position, completeness and blocks (hashes as
        written), and block id (decimal text) -> the streams holding it. For tests and small
        setups: it holds every block."""
        streams = [
            {
                "source": source,
                "dp_rank": rank,
                "epoch": v.epoch,
                "applied": list(v.applied),
                "complete": v.complete,
                "why": v.why,
                "blocks": [{"hash": d["hash"], "medium": d["medium"], "count": int(d["count"])} for d in v.entries.values()],
            }
            for (source, rank), v in self.streams.items()
        ]
        holders = {str(k): sorted(f"{s}/{r}" for s, r in held) for k, held in self.holders.items()}
        counts = {"applied": self.applied, "duplicates": self.duplicates, "stale": self.stale}
        return {**counts, "streams": streams, "holders": holders}

    # -- changes --------------------------------------------------------------------------------
    def seed(self, stream: Stream, state: StreamState) -> None:
        """Start ``stream`` from ``state`` (a state bootstrap): its live blocks; records at or
        below its head are then copies, and a block event no newer than the version the sweep
        read for its key is skipped (the entry already holds it)."""
        old = self.streams.get(stream)
        if old is not None:
            for key in old.entries:
                self._watch(stream, key, False)
            old.watch = None
        for key in state.entries:
            self._watch(stream, key, True)
        state.watch = lambda key, held: self._watch(stream, key, held)
        self.streams[stream] = state

    def apply(self, record: Record) -> None:
        """Apply one record of any stream, in the order read per stream."""
        stream: Stream = (record["source"], int(record["dp_rank"]))
        state = self.streams.get(stream)
        if state is None:
            state = StreamState()
            state.watch = lambda key, held: self._watch(stream, key, held)
            self.streams[stream] = state
        if position(record)[0] < state.epoch:
            self.stale += 1
        elif state.apply(record):
            self.applied += 1
        else:
            self.duplicates += 1

    def _watch(self, stream: Stream, key: Key, held: bool) -> None:
        k = (stream, key[2])
        if held:
            self._held[k] += 1
            if self._held[k] == 1:
                self.holders.setdefault(key[2], set()).add(stream)
            return
        self._held[k] -= 1
        if self._held[k] <= 0:
            del self._held[k]
            holders = self.holders.get(key[2])
            if holders is not None:
                holders.discard(stream)
                if not holders:
                    del self.holders[key[2]]


def decode(body: bytes | str) -> Record:
    """One record of a ``format: json`` sink."""
    record: Record = json.loads(body)
    return record


__all__ = ["Hash", "KvIndex", "Stream", "decode"]
