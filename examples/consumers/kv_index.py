"""The block index a KV-aware router keeps from the bridge's output, shared by the example consumers.

``KvIndex.apply(record)`` takes one JSON record as the bridge writes it (``format: json``, event or
batch granularity, control records included) and keeps, per engine stream (source, dp_rank), the
blocks the engine holds, and across streams: block hash -> the streams holding it. The rules
(README, "Consuming the output"):

1. Deduplicate on (source, dp_rank, epoch, seq, index). The first copy of every record comes in
   order per stream, so a record at or below the last position applied is a copy: one position per
   stream is enough, no set of seen ids.
2. Ignore a record of an epoch older than the newest one seen for its stream.
3. ``SourceReset`` (and any record of a newer epoch): the engine restarted, drop the stream's blocks.
4. ``EventsLost``: the view misses changes: drop the stream's blocks (what is kept afterwards is
   never a block the engine does not hold) and mark it incomplete until the engine clears its cache
   (``AllBlocksCleared``) or restarts (``SourceReset``), or until you re-bootstrap it.
5. Residency counts per (stream, medium, hash): vLLM does not de-duplicate cached blocks and sends
   one ``BlockRemoved`` per physical block, so a hash stored twice stays until removed twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Stream = tuple[str, int]  # (source, dp_rank)
Hash = int | str  # int hashes (hash_format: int), or hex text (hash_format: hex, binary hashes)
LAST = 2**64  # EventsLost sorts after every event of its seq

Record = dict[str, Any]


def position(record: Record) -> tuple[int, int, int]:
    """Where ``record`` stands in its stream: (epoch, seq, sub), as the bridge orders it."""
    kind = record.get("type")
    # "index" first: an event record carries its event's own fields, which may include "events".
    if "index" in record:  # one event (event granularity)
        return record["epoch"], record["seq"], record["index"] + 1
    if "events" in record:  # a batch (batch granularity)
        return record["epoch"], record["seq"], 0
    if kind == "SourceReset":
        return record["epoch"], -1, 0
    return record["epoch"], record["seq"], LAST  # EventsLost (seq = its to_seq)


@dataclass
class StreamView:
    epoch: int
    pos: tuple[int, int, int]
    complete: bool
    why: str = ""  # why it is incomplete
    blocks: dict[Hash, Counter[str | None]] = field(default_factory=dict)  # hash -> medium -> count
    # After a state bootstrap: (medium, group_idx, block id) -> the (epoch, seq) the sweep read it at
    floors: dict[tuple[Any, Any, int], tuple[int, int]] = field(default_factory=dict)
    block_id: Callable[[Any], int | None] | None = None


class KvIndex:
    """Block hash -> the streams holding it, with per-stream residency counts and completeness."""

    def __init__(self) -> None:
        self.streams: dict[Stream, StreamView] = {}
        self.holders: dict[Hash, set[Stream]] = {}
        self.applied = self.duplicates = self.stale = 0

    # -- queries --------------------------------------------------------------------------------
    def streams_holding(self, block_hash: Hash) -> set[Stream]:
        return set(self.holders.get(block_hash, ()))

    def blocks(self, stream: Stream) -> set[Hash]:
        view = self.streams.get(stream)
        return set(view.blocks) if view else set()

    def incomplete(self) -> dict[Stream, str]:
        return {s: v.why for s, v in self.streams.items() if not v.complete}

    def summary(self) -> str:
        counts = f"{self.applied} records applied, {self.duplicates} duplicates and {self.stale} stale skipped"
        lines = [f"{len(self.holders)} distinct blocks; {counts}"]
        for (source, rank), v in sorted(self.streams.items()):
            state = "complete" if v.complete else f"INCOMPLETE ({v.why})"
            lines.append(f"  {source}/{rank} epoch {v.epoch} seq {v.pos[1]}: {len(v.blocks)} blocks, {state}")
        return "\n".join(lines)

    # -- a state bootstrap (README "State bootstrap") -------------------------------------------
    def seed(self, stream: Stream, state: Any) -> None:
        """Start ``stream`` from a bridge.bootstrap.StreamState (a sink's state, swept): its live
        blocks; records at or below its head are then duplicates, and a block event no newer than
        the version the sweep read for its key is skipped (the entry already holds it)."""
        from bridge.bootstrap import block_id  # only bootstrapping needs the bridge package

        old = self.streams.get(stream)
        if old is not None:
            self._clear(stream, old)
        epoch, slot, sub = state.applied
        view = StreamView(epoch, (epoch, slot - 1, sub), state.complete, "" if state.complete else "incomplete state")
        view.floors, view.block_id = dict(state.floor), block_id
        for doc in state.entries.values():
            h = doc["hash"]
            view.blocks.setdefault(h, Counter())[doc["medium"]] += int(doc["count"])
            self.holders.setdefault(h, set()).add(stream)
        self.streams[stream] = view

    # -- applying records -----------------------------------------------------------------------
    def apply(self, record: Record) -> None:
        stream: Stream = (record["source"], record["dp_rank"])
        pos, kind = position(record), record.get("type")
        view = self.streams.get(stream)
        if view is not None and pos[0] < view.epoch:
            self.stale += 1  # rule 2
            return
        if view is not None and pos <= view.pos:
            self.duplicates += 1  # rule 1
            return
        if view is None or pos[0] > view.epoch:  # rule 3: a new stream, or a new engine instance
            if view is not None:
                self._clear(stream, view)
            # Complete only from the epoch's start: a first record past it (the broker trimmed the
            # head, or the consumer started late) leaves what came before unknown.
            starts = kind == "SourceReset" or (pos[1] == 0 and pos[2] <= 1)
            view = self.streams[stream] = StreamView(pos[0], pos, starts, "" if starts else "joined mid-stream")
        view.pos = pos
        self.applied += 1
        if "index" in record:  # one event (its own fields may include "events")
            self._event(stream, view, record)
        elif "events" in record:  # a batch
            for event in record["events"]:
                self._event(stream, view, event)
        elif kind == "EventsLost":  # rule 4
            self._clear(stream, view)
            view.complete = False
            view.why = f"seqs {record['from_seq']}-{record['to_seq']} of epoch {view.epoch} lost ({record['reason']})"

    def _floored(self, view: StreamView, event: Record, h: Hash) -> bool:
        """A bootstrapped stream's entry already holds this event (read at or after its batch)."""
        assert view.block_id is not None
        floor = view.floors.get((event.get("medium"), event.get("group_idx"), view.block_id(h) or 0))
        return floor is not None and floor >= view.pos[:2]

    def _event(self, stream: Stream, view: StreamView, event: Record) -> None:
        kind, medium = event.get("type"), event.get("medium")
        if kind in ("BlockStored", "BlockRemoved") and view.floors:
            event = {**event, "block_hashes": [h for h in event["block_hashes"] if not self._floored(view, event, h)]}
        if kind == "BlockStored":
            for h in event["block_hashes"]:
                counts = view.blocks.setdefault(h, Counter())
                counts[medium] += 1
                self.holders.setdefault(h, set()).add(stream)
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                held = view.blocks.get(h)
                if held is None or held[medium] <= 0:
                    continue  # not held as far as we know (only after a loss): counts stay >= 0
                held[medium] -= 1
                if held[medium] == 0:
                    del held[medium]
                if not held:
                    del view.blocks[h]
                    self._unhold(h, stream)
        elif kind == "AllBlocksCleared":  # the engine's cache is empty: known exactly again
            self._clear(stream, view)
            view.complete, view.why = True, ""

    def _clear(self, stream: Stream, view: StreamView) -> None:
        for h in view.blocks:
            self._unhold(h, stream)
        view.blocks.clear()
        view.floors.clear()  # what the sweep read is gone with the blocks

    def _unhold(self, h: Hash, stream: Stream) -> None:
        holders = self.holders.get(h)
        if holders is not None:
            holders.discard(stream)
            if not holders:
                del self.holders[h]


# -- the examples' command line -------------------------------------------------------------------


def main(
    parser: argparse.ArgumentParser, consume: Callable[[KvIndex, argparse.Namespace, Callable[[], bool]], Awaitable[None]]
) -> None:
    """Parse the arguments, consume until Ctrl-C (or ``--seconds``), print the summary every
    ``--every`` seconds and at the end; ``--lookup HASH`` prints the streams holding a block."""
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: until Ctrl-C)")
    parser.add_argument("--every", type=float, default=5.0, help="print the summary this often")
    parser.add_argument("--lookup", action="append", default=[], help="a block hash: print the streams holding it")
    args = parser.parse_args()
    index, stopping = KvIndex(), asyncio.Event()
    end = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")

    async def report() -> None:
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), args.every)
            print(index.summary(), flush=True)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        printer = asyncio.create_task(report())
        await consume(index, args, lambda: stopping.is_set() or time.monotonic() > end)
        stopping.set()
        await printer
        for text in args.lookup:  # as text (hex hashes) or as a number (integer hashes)
            forms: list[Hash] = [text, int(text)] if text.lstrip("-").isdigit() else [text]
            holding = set().union(*(index.streams_holding(h) for h in forms))
            print(f"{text}: {sorted(holding) or 'held by no stream'}")

    asyncio.run(run())


def decode(body: bytes) -> Record:
    record: Record = json.loads(body)
    return record
