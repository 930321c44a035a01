"""State bootstrap for consumers: an engine stream's live blocks from a sink's state, then its events.

The algorithm is the same for every sink (README "State bootstrap"); each connector module has the
function that reads its sink (``connectors.redis.bootstrap``, ``connectors.nats.bootstrap``,
``connectors.kafka.bootstrap``). This module is the sink-independent part, pure and dependency-free:

1. Read the stream's head ``H`` (a document of :mod:`bridge.state_docs`).
2. Sweep its entries (newest value per key) and read the head again: if its (epoch, gen) moved, a
   clear ran during the sweep: start over. Entries of another (epoch, gen) than ``H`` are left
   out (a sink that cannot delete key by key leaves them behind a clear; a write cut short by a
   crash may leave some of a generation no head names).
3. Follow the stream's messages from ``H["next"]`` with :meth:`StreamState.apply`: a message at or
   below ``H`` or below the last one applied is skipped (copies); ``SourceReset``,
   ``AllBlocksCleared`` and ``EventsLost`` drop every entry (``EventsLost``: incomplete); a block
   event at (epoch, seq) changes a key only if that is newer than the version the sweep read for
   it (entries read after ``H`` already hold later changes); counts never go below 0.
4. The state is exact once every message of the newest batch the sweep read a version of is
   applied (see :attr:`StreamState.ready`); before that it may lag, never hold a block of
   another epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Document = Mapping[str, Any]
Key = tuple[Any, Any, int]  # (medium, group_idx, 64-bit block id)
_U64 = (1 << 64) - 1
_LAST = 1 << 64


def block_id(value: object) -> int | None:
    """The 64-bit id of a block hash as a consumer reads it: an int (either sign), 16 hex digits
    (``hash_format: hex``), or the hex of a binary digest (its low 64 bits); None otherwise."""
    if type(value) is int:
        return value & _U64 if -(1 << 63) <= value <= _U64 else None
    if isinstance(value, str) and value:
        try:
            n = int(value, 16)
        except ValueError:
            return None
        return n & _U64
    if isinstance(value, bytes | bytearray) and value:
        return int.from_bytes(bytes(value)[-8:], "big")
    return None


def position(message: Document) -> tuple[int, int, int]:
    """(epoch, slot, sub) of one message of the bridge's output (a JSON or msgpack record, event
    or batch granularity), in the bridge's order: a ``SourceReset`` first, then each seq's batch or
    events, an ``EventsLost`` after the events of its ``to_seq``."""
    epoch = int(message["epoch"])
    kind = message.get("type")
    if "index" in message:
        return epoch, int(message["seq"]) + 1, int(message["index"]) + 1
    if "events" in message:
        return epoch, int(message["seq"]) + 1, 0
    if kind == "SourceReset":
        return epoch, 0, 0
    return epoch, int(message["seq"]) + 1, _LAST


class StreamState:
    """One engine stream's live blocks, as a consumer rebuilds them (see the module docstring).

    ``entries``: (medium, group_idx, block id) -> the entry document (with its ``count``; block
    events applied here add or update ``count``, ``hash``, ``parent``, ``epoch`` and ``seq``).
    """

    def __init__(self, head: Document, entries: Iterable[Document]) -> None:
        self.head = dict(head)
        self.epoch = int(head["epoch"])
        self.complete = bool(head.get("complete", False))
        # Everything at or below the head is in the entries already.
        self.applied: tuple[int, int, int] = (self.epoch, int(head["seq"]) + 1, _LAST)
        self.entries: dict[Key, dict[str, Any]] = {}
        self.floor: dict[Key, tuple[int, int]] = {}  # version the sweep read, per key
        generation = (self.epoch, int(head["gen"]))
        newest = (self.epoch, int(head["seq"]))
        for doc in entries:
            if (int(doc["epoch"]), int(doc["gen"])) != generation:
                continue  # left behind by a clear the sink could not apply key by key, or by a write cut short
            try:
                key: Key = (doc.get("medium"), doc.get("group_idx"), int(doc["block"], 16))
            except (KeyError, TypeError, ValueError):
                continue
            version = (int(doc["epoch"]), int(doc["seq"]))
            if key in self.floor and self.floor[key] >= version:
                continue  # newest per key
            self.floor[key] = version
            newest = max(newest, version)
            if int(doc.get("count", 0)) > 0:
                self.entries[key] = dict(doc)
            else:
                self.entries.pop(key, None)
        self.ready_at: tuple[int, int] = newest
        """The state is exact once a message at or past this (epoch, seq) was applied."""

    def blocks(self) -> dict[Key, int]:
        """(medium, group_idx, block id) -> residency count, of every live block."""
        return {k: int(d["count"]) for k, d in self.entries.items()}

    @property
    def ready(self) -> bool:
        """A message of the newest batch the sweep read a version of, or of a later one, was
        applied: exact once that batch's other messages are too (event granularity: read on to
        a later batch, or to the end of what the sink holds)."""
        return self.applied[:2] >= (self.ready_at[0], self.ready_at[1] + 1)

    def _clear(self, epoch: int, complete: bool) -> None:
        self.entries.clear()
        self.floor.clear()
        self.epoch = epoch
        self.complete = complete

    def apply(self, message: Document) -> bool:
        """Apply one message of the stream's output, in the order read; False when it was skipped
        (a copy, or already in the state)."""
        pos = position(message)
        if pos <= self.applied or pos[0] < self.epoch:
            return False
        self.applied = pos
        epoch, seq = pos[0], pos[1] - 1
        kind = message.get("type")
        if epoch > self.epoch and kind != "SourceReset":
            # A newer epoch without its reset: known only if it starts at its first batch's first event.
            self._clear(epoch, pos[1] == 1 and pos[2] <= 1)
        if kind == "SourceReset":
            self._clear(epoch, True)
            return True
        if kind == "EventsLost":
            self._clear(epoch, False)
            return True
        events = message.get("events")
        for event in events if isinstance(events, list) else (message,):
            self._event(event, epoch, seq)
        return True

    def _event(self, event: Document, epoch: int, seq: int) -> None:
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            self._clear(epoch, True)
            return
        stored = kind == "BlockStored"
        if not stored and kind != "BlockRemoved":
            return
        hashes = event.get("block_hashes")
        if not isinstance(hashes, list):
            return
        medium, group = event.get("medium"), event.get("group_idx")
        version = (epoch, seq)
        for i, h in enumerate(hashes):
            k = block_id(h)
            if k is None:
                continue
            key: Key = (medium, group, k)
            floor = self.floor.get(key)
            if floor is not None and floor >= version:
                continue  # the sweep read this key at or after this record
            doc = self.entries.get(key)
            if stored:
                if doc is None:
                    parent = hashes[i - 1] if i else event.get("parent_block_hash")
                    doc = self.entries[key] = {"medium": medium, "group_idx": group, "block": format(k, "016x")}
                    doc.update(hash=h, parent=parent, count=0)
                doc["count"] = int(doc["count"]) + 1
                doc["epoch"], doc["seq"] = epoch, seq
            elif doc is not None:
                doc["count"] = int(doc["count"]) - 1
                doc["epoch"], doc["seq"] = epoch, seq
                if doc["count"] <= 0:
                    del self.entries[key]


__all__ = ["StreamState", "block_id", "position"]
