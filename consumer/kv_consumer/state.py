"""The ordering and dedup rule, and one engine stream's live blocks as a consumer rebuilds them.

Pure and dependency-free. The bridge writes each engine stream (source, dp_rank) in order of
:func:`position`; a record at or below the last position applied to a stream is a copy (a re-sent
write, a bridge restart), and a record of an older epoch than the stream's newest is stale. One
position per stream is enough: no set of seen ids.

:class:`StreamState` applies the records of one stream (and is what a state bootstrap starts from):

1. A sink with ``state.enabled`` keeps each stream's head ``H`` and one entry per live block
   (the bootstrap readers in :mod:`kv_consumer.redis`, :mod:`kv_consumer.kafka` and
   :mod:`kv_consumer.nats` read them: head, sweep of the entries, head again; a clear that ran
   during the sweep makes them start over). Entries of another (epoch, gen) than ``H`` are left
   out (a sink that cannot delete key by key leaves them behind a clear; a write cut short by a
   crash may leave some of a generation no head names).
2. Follow the stream's messages from ``H["next"]`` with :meth:`StreamState.apply`: a message at or
   below ``H`` or below the last one applied is skipped (copies); ``SourceReset``,
   ``AllBlocksCleared`` and ``EventsLost`` drop every entry (``EventsLost``: incomplete until the
   engine clears its cache or restarts); ``StateSeeded`` (experimental engine snapshots) says the
   sink's state was re-seeded complete at its (epoch, seq): the stream's state here stays as it
   is, marked incomplete with :attr:`StreamState.rebootstrap` set: bootstrap again from the sink's
   state to have it complete; a block event at (epoch, seq) changes a key only if that
   is newer than the version the sweep read for it (entries read after ``H`` already hold later
   changes); counts never go below 0. Residency counts are per (medium, group_idx, block): vLLM
   does not de-duplicate cached blocks and sends one ``BlockRemoved`` per physical block, so a
   hash stored twice stays until removed twice.
3. The state is exact once every message of the newest batch the sweep read a version of is
   applied (see :attr:`StreamState.ready`); before that it may lag, never hold a block of
   another epoch.

A stream followed from its first message, without a state, starts from :data:`NO_HEAD`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Document = Mapping[str, Any]
Record = dict[str, Any]  # one record of the bridge's output, decoded
Key = tuple[Any, Any, int]  # (medium, group_idx, 64-bit block id)
U64 = (1 << 64) - 1
LAST = 1 << 64  # an EventsLost sorts after every event of its seq
NO_HEAD: Document = {"epoch": -1, "gen": 0, "seq": -1, "complete": False}
"""The head of a stream without state: nothing applied, nothing known."""


def block_id(value: object) -> int | None:
    """The 64-bit id of a block hash as a consumer reads it: an int (either sign), 16 hex digits
    (``hash_format: hex``), or the hex of a binary digest (its low 64 bits); None otherwise."""
    if type(value) is int:
        return value & U64 if -(1 << 63) <= value <= U64 else None
    if isinstance(value, str) and value:
        try:
            n = int(value, 16)
        except ValueError:
            return None
        return n & U64
    if isinstance(value, bytes | bytearray) and value:
        return int.from_bytes(bytes(value)[-8:], "big")
    return None


def position(message: Document) -> tuple[int, int, int]:
    """(epoch, slot, sub) of one message of the bridge's output (a JSON or msgpack record, event
    or batch granularity), in the bridge's order: slot = seq + 1, with the epoch's ``SourceReset``
    at slot 0; sub = the event's index + 1 (event granularity), 0 (a batch), or after every event
    of its seq (an ``EventsLost``, whose seq is its ``to_seq``).

    Deduplicate on this, not on (epoch, seq, index): at batch granularity a ``SourceReset`` and its
    epoch's first batch share seq 0 and have no index. An event record is told by its ``index``
    first (its own fields may include one named ``events``)."""
    epoch = int(message["epoch"])
    kind = message.get("type")
    if "index" in message:
        return epoch, int(message["seq"]) + 1, int(message["index"]) + 1
    if "events" in message:
        return epoch, int(message["seq"]) + 1, 0
    if kind == "SourceReset":
        return epoch, 0, 0
    return epoch, int(message["seq"]) + 1, LAST


def follows_head(head: Document, headers: Mapping[str, Any]) -> bool:
    """Whether the message right before a head's ``next`` (given by its headers, as text) can be
    what the head was written after: a message of the head's stream and epoch, at or below the
    head's position. Anything else (another stream's message, a later one of its own, none) means
    the sink's events are not those the head counts (a topic or stream lost, created again and
    written since): follow the stream from its start, where the copies are skipped."""
    try:
        if (str(headers["source"]), str(headers["dp_rank"])) != (str(head["source"]), str(head["dp_rank"])):
            return False
        epoch = int(head["epoch"])
        return int(headers["epoch"]) == epoch and position(headers) <= (epoch, int(head["seq"]) + 1, LAST)
    except (KeyError, TypeError, ValueError):
        return False


def parse(value: bytes | str) -> dict[str, Any] | None:
    """A state document (a head or an entry, JSON), or None when it is not one."""
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def is_head(doc: Document) -> bool:
    """Whether ``doc`` is a well-formed head document."""
    try:
        int(doc["epoch"]), int(doc["gen"]), int(doc["seq"]), int(doc["live"]), bool(doc["complete"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


class StreamState:
    """One engine stream's live blocks (see the module docstring).

    ``entries``: (medium, group_idx, block id) -> the entry document (with its ``count``; block
    events applied here add or update ``count``, ``hash``, ``parent``, ``epoch`` and ``seq``).
    ``why``: why it is incomplete (empty when complete). ``watch``, when set, is called with a key
    and True when an entry appears, False when it goes.
    """

    def __init__(self, head: Document = NO_HEAD, entries: Iterable[Document] = ()) -> None:
        self.head = dict(head)
        self.epoch = int(head["epoch"])
        self.complete = bool(head.get("complete", False))
        self.why = "" if self.complete else ("no state" if self.epoch < 0 else "incomplete state")
        # A StateSeeded record was applied: the sink holds the stream's state complete from there
        # on; bootstrap again (the state here is only what the messages brought).
        self.rebootstrap = False
        self.watch: Callable[[Key, bool], None] | None = None
        # Everything at or below the head is in the entries already.
        self.applied: tuple[int, int, int] = (self.epoch, int(head["seq"]) + 1, LAST)
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

    @property
    def seq(self) -> int:
        """The seq of the last message applied (-1: the epoch's ``SourceReset``, or nothing)."""
        return self.applied[1] - 1

    def blocks(self) -> dict[Key, int]:
        """(medium, group_idx, block id) -> residency count, of every live block."""
        return {k: int(d["count"]) for k, d in self.entries.items()}

    @property
    def ready(self) -> bool:
        """A message of the newest batch the sweep read a version of, or of a later one, was
        applied: exact once that batch's other messages are too (event granularity: read on to
        a later batch, or to the end of what the sink holds)."""
        return self.applied[:2] >= (self.ready_at[0], self.ready_at[1] + 1)

    def _clear(self, epoch: int, complete: bool, why: str = "") -> None:
        if self.watch is not None:
            for key in self.entries:
                self.watch(key, False)
        self.entries.clear()
        self.floor.clear()
        self.epoch = epoch
        self.complete = complete
        self.why = "" if complete else why
        self.rebootstrap = False  # (cleared: nothing to bootstrap again for)

    def apply(self, message: Document) -> bool:
        """Apply one message of the stream's output, in the order read; False when it was skipped
        (a copy, already in the state, or, with a head that names its stream, another stream's)."""
        pos = position(message)
        if pos <= self.applied or pos[0] < self.epoch:
            return False
        source = self.head.get("source")
        if (
            source is not None
            and "source" in message
            and (message["source"], message.get("dp_rank"))
            != (
                source,
                self.head.get("dp_rank"),
            )
        ):
            return False  # another stream's record where this one's are read (two sources sharing a subject)
        if pos[2] == 0 and pos[0] == self.applied[0] and pos[1] > self.applied[1] + 1 and "events" in message:
            # At batch granularity every seq has its record, or an EventsLost that covers it: a seq
            # skipped between two records read is one the sink no longer held (trimmed unread).
            missing = f"seqs {self.applied[1]}-{pos[1] - 2} of epoch {pos[0]} missing from what the sink holds"
            self._clear(pos[0], False, missing)
        self.applied = pos
        epoch, seq = pos[0], pos[1] - 1
        kind = message.get("type")
        if epoch > self.epoch and kind != "SourceReset":
            # A newer epoch without its reset: known only if it starts at its first batch's first event.
            self._clear(epoch, pos[1] == 1 and pos[2] <= 1, "joined mid-stream")
        if kind == "SourceReset":
            self._clear(epoch, True)
            return True
        if kind == "StateSeeded":
            if not self.complete:
                self.rebootstrap = True
                self.why = f"the bridge re-seeded the state from an engine snapshot at ({epoch}, {seq}): bootstrap again"
            return True
        if kind == "EventsLost":
            lost = f"seqs {message.get('from_seq')}-{message.get('to_seq')} of epoch {epoch} lost ({message.get('reason')})"
            self._clear(epoch, False, lost)
            return True
        events = message.get("events")
        # An event record is told by its index: its own fields may include one named "events".
        for event in events if "index" not in message and isinstance(events, list) else (message,):
            self._event(event, epoch, seq)
        return True

    def _event(self, event: Document, epoch: int, seq: int) -> None:
        kind = event.get("type")
        if kind == "AllBlocksCleared" and event.get("medium") is None:
            self._clear(epoch, True)
            return
        stored = kind == "BlockStored"
        if kind == "BlockInactive":
            return  # (a block still cached: no change)
        if not stored and kind != "BlockRemoved":
            # A clear of one medium, a move between media, or a newer engine's event type: what
            # it did to the cache cannot be applied exactly (as the bridge's own state does).
            self._clear(epoch, False, f"a {kind} event at ({epoch}, {seq}) cannot be applied: the state is unknown")
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
                    if self.watch is not None:
                        self.watch(key, True)
                doc["count"] = int(doc["count"]) + 1
                doc["epoch"], doc["seq"] = epoch, seq
            elif doc is not None:
                doc["count"] = int(doc["count"]) - 1
                doc["epoch"], doc["seq"] = epoch, seq
                if doc["count"] <= 0:
                    del self.entries[key]
                    if self.watch is not None:
                        self.watch(key, False)


def swept(head: Document, entries: Sequence[Document], doubt: str = "", *, counted: bool = True) -> StreamState:
    """The state a bootstrap read: ``head`` and the ``entries`` of one sweep, incomplete (with the
    reason in ``why``) when the sink cannot hold what the head says: ``doubt`` (why not, found by
    the reader), or, when ``counted`` (no write overlapped the sweep, so nothing the head covers
    was removed by a later write), fewer entries of the head's generation than its ``live``
    count: entries lost outside the bridge (a topic's retention, a bucket or hash trimmed by hand)."""
    if counted and not doubt:
        generation = (head.get("epoch"), head.get("gen"))
        found = sum(1 for d in entries if (d.get("epoch"), d.get("gen")) == generation)
        live = head.get("live", 0)
        if isinstance(live, int) and found < live:
            doubt = f"the sink holds {found} entries where the head counts {live}"
    if not doubt:
        return StreamState(head, entries)
    state = StreamState({**head, "complete": False}, entries)
    if head.get("complete"):
        state.why = f"the sink may have lost entries: {doubt}"
    return state


__all__ = [
    "LAST",
    "NO_HEAD",
    "Document",
    "Key",
    "Record",
    "StreamState",
    "block_id",
    "follows_head",
    "is_head",
    "parse",
    "position",
    "swept",
]
