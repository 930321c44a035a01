"""The live blocks of every stream, kept from the delivered records: what a state bootstrap publishes.

Pure: no sockets, no asyncio, no clock. One :class:`StateTracker` is applied once per delivered
record, in stream order (after the sequencer), and returns a :class:`StateDelta` per record: what
the sinks' state writers must change so their state equals the tracker's after that record.

What is kept, per stream and per (medium, group) *tier*:

- the live blocks with their residency counts: vLLM does not de-duplicate cached blocks and sends
  one ``BlockRemoved`` per physical block, so two stores and one remove leave count 1; a remove of
  an absent block is a no-op (counted), counts never go below 0;
- the version of each block, the (epoch, seq) of the batch that last changed it. Every epoch
  starts empty (a ``SourceReset`` clears the stream), so every live block of a stream has the
  stream's epoch: only the seq is stored per block;
- a per-stream :class:`Head`: epoch, generation (raised by every clear), seq, ``complete``, the
  live block count, and whether the stream is tracked at all.

Block ids. An entry is keyed by a 64-bit id: unsigned 64-bit hashes as they are, signed ones in
two's complement, binary hashes (32-byte digests) by their low 64 bits, read big-endian, which is
what vLLM's ``maybe_convert_block_hash`` sends when integer hashes are on, so one block has one id
in both forms. Two distinct live blocks of one tier share an id with probability about
``n**2 / 2**65`` (3e-8 for 10^6 live blocks; vLLM's integer form already has these odds). The
hash as sent travels in each delta's :class:`BlockFact`.

Clears. ``SourceReset`` and ``AllBlocksCleared`` (which has no medium: every tier) empty the stream
and make it ``complete``; so does a batch that carries a seed (``Record.seed``, from an engine
snapshot: its events, the whole cache, are applied after the clear, then the batch's own);
``EventsLost`` empties it and marks it incomplete, so the state never holds a block the engine may
have dropped in the lost span (it may miss blocks stored in it: a subset, never a false positive). A
stream first seen mid-way (a batch above seq 0 with no reset before it) is incomplete too.
``complete`` returns at the next reset or clear. A clear's delta enumerates the keys that were live
(for per-key tombstones) without copying them.

Memory. Each tier is an open-addressing table (linear probing, backward-shift deletion) of two
parallel arrays: the ids (``array('Q')``, 8 bytes) and the seq + 1 of each block's version
(``array('I')``, 4 bytes; 0 marks an empty slot; widened to 8 bytes for a tier whose seq passes
2**32 - 2, 497 days of 100 batches a second). The table grows by 1.3x at load 0.7, so the load
stays in 0.54..0.7: 17-22.3 bytes per live block. Counts above 1 (rare) and, for them, the block's
fact live in a side dict. No tokens or parents are kept in memory.

The cap. ``max_entries`` bounds the live entries of the whole tracker. A block store that takes
the total past it switches the storing stream's state off: its entries are dropped (the delta
clears them), its head says ``tracking=False, complete=False``, and ``StateDelta.switched_off``
tells the caller to count and log it; the stream's records keep flowing and its head keeps
advancing. At its next ``SourceReset`` or ``AllBlocksCleared`` (when it is empty and complete
again) it is switched back on if the tracker is below the cap, and switched off again if it
fills past it.

Ordering. A delta's changes come parents first (when a parent and its child change in the same
record and tier), so a sink that writes them in order never writes a child before its parent.
Versions are per record: a change carries the (epoch, seq) of its record, and reflects the block
after the whole batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import msgspec

from .records import Event, Record, Stream

U64 = (1 << 64) - 1
MAX_LOAD = 0.7
GROWTH = 1.3
MIN_LOAD = 0.2  # a table this empty is rebuilt smaller (to MID_LOAD)
MID_LOAD = 0.5
MOVE_STEP = 64  # old slots moved per change while a table grows (see BlockTable)
_MIN_SIZE = 7
_NARROW = "I"  # 4-byte unsigned
_NARROW_MAX = (1 << 32) - 1
assert array(_NARROW).itemsize == 4 and array("Q").itemsize == 8

Tier = tuple[str | None, int | None]
"""(medium, group_idx) as the engine sent them; None (not sent) is a tier of its own."""


def block_id(block_hash: object) -> int | None:
    """The 64-bit id of a block hash as sent; None for a value that is no block hash.

    Integers (unsigned or signed 64-bit) become their two's complement; bytes their low 64 bits,
    big-endian, as vLLM's ``maybe_convert_block_hash`` does.
    """
    t = type(block_hash)
    if t is int:
        h: int = block_hash  # type: ignore[assignment]
        return h & U64 if -(1 << 63) <= h <= U64 else None
    if t is bytes or t is bytearray or t is memoryview:
        raw = bytes(block_hash)  # type: ignore[call-overload]
        return int.from_bytes(raw[-8:], "big") if raw else None
    return None


def _size_for(n: int, load: float) -> int:
    return max(_MIN_SIZE, int(n / load) + 1) | 1  # odd: ids that share low bits still spread


class BlockTable:
    """One tier's live blocks: id -> (count, seq of the last change). See the module docstring.

    ``seq`` values are passed and returned as stored: the record's seq + 1 (0 marks a free slot).

    Growth is incremental: past its load limit the table allocates the larger arrays and moves
    ``MOVE_STEP`` slots of the old ones with each later change, so no single change pays for
    copying the whole table (0.4 s at 10^6 blocks). Meanwhile a block is in exactly one of the
    two: the old arrays are only read, their moved (or removed) slots flagged in ``_moved``, so
    their probe runs stay intact.
    """

    __slots__ = ("_cursor", "_limit", "_moved", "_old", "_vmax", "cap", "ids", "multi", "n", "vers")

    def __init__(self, capacity: int = _MIN_SIZE) -> None:
        self._alloc(max(_MIN_SIZE, capacity), _NARROW)
        self.n = 0
        # id -> [count, fact] for the blocks stored more than once (count >= 2)
        self.multi: dict[int, list[Any]] = {}
        self._old: tuple[array[int], array[int], int] | None = None  # (ids, vers, cap) being moved
        self._moved = bytearray()
        self._cursor = 0

    def _alloc(self, cap: int, code: str) -> None:
        self.cap = cap
        # Repetition allocates exactly; array(code, bytes) over-allocates by 1/16.
        self.ids = array("Q", [0]) * cap
        self.vers = array(code, [0]) * cap
        self._vmax = _NARROW_MAX if code == _NARROW else U64
        self._limit = int(cap * MAX_LOAD)

    def __len__(self) -> int:
        return self.n

    def __contains__(self, k: object) -> bool:
        return type(k) is int and (self._slot(k) >= 0 or self._old_slot(k) >= 0)

    def nbytes(self) -> int:
        """Bytes held by the arrays (the side dict not included), the old ones while moving."""
        total = self.ids.itemsize * len(self.ids) + self.vers.itemsize * len(self.vers)
        if self._old is not None:
            ids, vers, _ = self._old
            total += ids.itemsize * len(ids) + vers.itemsize * len(vers) + len(self._moved)
        return total

    # -- lookups --------------------------------------------------------------------------------
    def _slot(self, k: int) -> int:
        """The slot of ``k`` in the current arrays, or -1."""
        ids, vers, cap = self.ids, self.vers, self.cap
        i = k % cap
        while vers[i]:
            if ids[i] == k:
                return i
            i += 1
            if i == cap:
                i = 0
        return -1

    def _old_slot(self, k: int) -> int:
        """The slot of ``k`` in the old arrays while growing (not moved yet), or -1."""
        if self._old is None:
            return -1
        ids, vers, cap = self._old
        moved = self._moved
        i = k % cap
        while vers[i]:
            if ids[i] == k and not moved[i]:
                return i
            i += 1
            if i == cap:
                i = 0
        return -1

    def count(self, k: int) -> int:
        if self._slot(k) < 0 and self._old_slot(k) < 0:
            return 0
        m = self.multi.get(k)
        return 1 if m is None else int(m[0])

    def version(self, k: int) -> int:
        """The stored seq + 1 of ``k``'s last change; 0 when absent."""
        i = self._slot(k)
        if i >= 0:
            return self.vers[i]
        j = self._old_slot(k)
        return 0 if j < 0 or self._old is None else self._old[1][j]

    def __iter__(self) -> Iterator[int]:
        """The live ids, in table order."""
        for k, _c, _v in self.items():
            yield k

    def items(self) -> Iterator[tuple[int, int, int]]:
        """(id, count, stored seq + 1) of every live block, in table order."""
        multi = self.multi
        for k, v in zip(self.ids, self.vers, strict=True):
            if v:
                m = multi.get(k)
                yield k, (1 if m is None else int(m[0])), v
        if self._old is not None:
            ids, vers, _ = self._old
            for k, v, gone in zip(ids, vers, self._moved, strict=True):
                if v and not gone:
                    m = multi.get(k)
                    yield k, (1 if m is None else int(m[0])), v

    # -- changes --------------------------------------------------------------------------------
    def add(self, k: int, ver: int) -> int:
        """One more copy of ``k``, changed at ``ver``; the new count."""
        if ver > self._vmax:
            self._widen()
        if self._old is not None:
            self._move_some()
            j = self._old_slot(k)
            if j >= 0:
                self._moved[j] = 1  # it moves now, with its new version
                self._put(k, ver)
                m = self.multi.get(k)
                if m is None:
                    self.multi[k] = [2, None]
                    return 2
                m[0] += 1
                return int(m[0])
        ids, vers, cap = self.ids, self.vers, self.cap
        i = k % cap
        while True:
            v = vers[i]
            if not v:
                break
            if ids[i] == k:
                vers[i] = ver
                m = self.multi.get(k)
                if m is None:
                    self.multi[k] = [2, None]
                    return 2
                m[0] += 1
                return int(m[0])
            i += 1
            if i == cap:
                i = 0
        if self.n >= self._limit and self._old is None:
            self._grow()
        self._put(k, ver)
        self.n += 1
        return 1

    def _put(self, k: int, ver: int) -> None:
        """Write ``k`` into a free slot of the current arrays (it is in none)."""
        ids, vers, cap = self.ids, self.vers, self.cap
        i = k % cap
        while vers[i]:
            i += 1
            if i == cap:
                i = 0
        ids[i] = k
        vers[i] = ver

    def remove(self, k: int, ver: int) -> tuple[int, BlockFact | None]:
        """One copy of ``k`` fewer, changed at ``ver``: (new count, the fact kept for it when
        it stays live); (-1, None) when ``k`` is absent (nothing changes)."""
        if self._old is not None:
            self._move_some()
        i = self._slot(k)
        j = -1 if i >= 0 else self._old_slot(k)
        if i < 0 and j < 0:
            return -1, None
        m = self.multi.get(k)
        if m is not None:
            if ver > self._vmax:
                self._widen()
                i, j = self._slot(k), -1
            if j >= 0:
                self._moved[j] = 1
                self._put(k, ver)
            else:
                self.vers[i] = ver
            m[0] -= 1
            if m[0] == 1:
                del self.multi[k]
            return int(m[0]), m[1]
        if j >= 0:
            self._moved[j] = 1
            self.n -= 1
        else:
            self._delete(i)
        return 0, None

    def _delete(self, i: int) -> None:
        """Empty slot ``i``, shifting back the entries of its probe run (no tombstones)."""
        ids, vers, cap = self.ids, self.vers, self.cap
        j = i
        while True:
            j += 1
            if j == cap:
                j = 0
            v = vers[j]
            if not v:
                break
            kj = ids[j]
            h = kj % cap
            # kj stays when its home slot lies cyclically in (i, j]
            if (i < h <= j) if i <= j else (h > i or h <= j):
                continue
            ids[i] = kj
            vers[i] = v
            i = j
        ids[i] = 0
        vers[i] = 0
        self.n -= 1
        if self.n < self.cap * MIN_LOAD and self.cap > 64 and self._old is None:
            self._rebuild(_size_for(self.n, MID_LOAD))

    def _widen(self) -> None:
        self._finish()
        self.vers = array("Q", self.vers.tolist())  # from a list: allocated exactly
        self._vmax = U64

    def _grow(self) -> None:
        """Start moving to arrays sized for 1.3x the blocks (see the class docstring)."""
        self._old = (self.ids, self.vers, self.cap)
        self._moved = bytearray(self.cap)
        self._cursor = 0
        self._alloc(_size_for(self.n + 1, MAX_LOAD / GROWTH), self.vers.typecode)

    def _move_some(self, step: int = 0) -> None:
        """Move the next ``MOVE_STEP`` old slots (all of them with ``step`` -1)."""
        assert self._old is not None
        ids, vers, cap = self._old
        moved, cursor = self._moved, self._cursor
        stop = cap if step < 0 else min(cap, cursor + MOVE_STEP)
        put = self._put
        for c in range(cursor, stop):
            if vers[c] and not moved[c]:
                put(ids[c], vers[c])
                moved[c] = 1
        self._cursor = stop
        if stop == cap:
            self._old = None
            self._moved = bytearray()

    def _finish(self) -> None:
        if self._old is not None:
            self._move_some(-1)

    def _rebuild(self, cap: int) -> None:
        """Shrink at once (rare, and the table is small by then: see MIN_LOAD)."""
        self._finish()
        old_ids, old_vers = self.ids, self.vers
        self._alloc(cap, old_vers.typecode)
        put = self._put
        for k, v in zip(old_ids, old_vers, strict=True):
            if v:
                put(k, v)


# -- what a record changes ------------------------------------------------------------------------


class BlockFact(msgspec.Struct, frozen=True, gc=False):
    """What the engine said of one block when it stored it (its own tokens, its parent)."""

    hash: int | bytes
    parent: int | bytes | None
    token_ids: list[int]
    block_size: int | None
    medium: str | None
    group_idx: int | None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: object = None
    token_hashes: list[object] | None = None
    """Read back from a sink that writes ``token_ids: hash`` (its tokens are not kept anywhere)."""


class EntryChange(msgspec.Struct, frozen=True, gc=False):
    """One block's new state: ``count`` 0 means gone (a delete or tombstone), else its ``fact``.

    Its version is the delta's ``(head.epoch, head.seq)``.
    """

    medium: str | None
    group_idx: int | None
    block: int
    count: int
    fact: BlockFact | None


class ClearedTier(msgspec.Struct, frozen=True):
    """Blocks a clear removed from one tier (ids; a tier may appear twice): what a sink that
    deletes key by key must delete. ``blocks`` is the tier's detached table, or a list."""

    medium: str | None
    group_idx: int | None
    blocks: Collection[int]


class Head(msgspec.Struct, frozen=True):
    """A stream's state as of its last record (the sinks add the position that follows it).

    ``seq``: the last record's seq (an ``EventsLost``'s ``to_seq``), -1 after a ``SourceReset``
    (nothing of the epoch yet): the state reflects every record at or below ``(epoch, seq + 1)``.
    ``generation`` rises at every clear, and starts above any earlier process's (see StateTracker).
    """

    epoch: int
    generation: int
    seq: int
    complete: bool
    live: int
    tracking: bool = True


class StateDelta(msgspec.Struct):
    """What one record changes in its stream's state, to be applied in this order: when ``clear``,
    every entry of the stream goes (``cleared`` lists the ones that were live, for sinks that
    delete key by key); then ``changes``; then ``head``."""

    stream: Stream
    head: Head
    clear: bool = False
    cleared: list[ClearedTier] = msgspec.field(default_factory=list)
    changes: list[EntryChange] = msgspec.field(default_factory=list)
    switched_off: bool = False
    switched_on: bool = False
    absent_removals: int = 0
    stale: bool = False
    """The record was at or below the stream's last position: nothing applied (a re-delivery)."""


SeedEntry = tuple[str | None, int | None, int, int, int, "BlockFact | None"]
"""One live entry a sink holds: (medium, group_idx, block id, count, seq of its last change, fact)."""


_UNCHANGING = frozenset({"BlockInactive"})
"""Event types known to change no block's presence (``BlockInactive``: a block still cached).
Any other type the tracker does not know (a newer engine's) may have: the state is unknown (I6)."""


class TrackerStats(msgspec.Struct):
    """Counters since the tracker was made, for metrics."""

    absent_removals: int = 0
    bad_events: int = 0
    bad_hashes: int = 0
    stale_records: int = 0
    undecoded_batches: int = 0
    switched_off: int = 0


class _StreamState:
    __slots__ = (
        "ahead",
        "cleared_at",
        "complete",
        "epoch",
        "generation",
        "live",
        "lost",
        "position",
        "seq",
        "tiers",
        "tracking",
    )

    def __init__(self, epoch: int, generation: int) -> None:
        self.epoch = epoch
        self.generation = generation
        self.seq = -1
        # The highest seq a seeded entry holds, when above the head (a sink's read-back may hold
        # entries written after its head): records up to it skip the blocks already that new.
        self.ahead = -1
        self.lost = False  # a sink could not write a change: the next record clears the stream
        self.cleared_at = (-1, -1)  # the position of the last record that cleared it (see invalidate)
        self.position = (epoch, -1)
        self.complete = False
        self.tracking = True
        self.live = 0
        self.tiers: dict[Tier, BlockTable] = {}

    def head(self) -> Head:
        return Head(self.epoch, self.generation, self.seq, self.complete and self.tracking, self.live, self.tracking)


def _fact(event: Event, i: int, n: int, medium: str | None, group: int | None) -> BlockFact:
    hashes = event["block_hashes"]
    tokens = event.get("token_ids")
    size = event.get("block_size")
    if not isinstance(tokens, list):
        own: list[int] = []
    elif n == 1:
        own = tokens
    elif type(size) is int and size > 0:
        own = tokens[i * size : (i + 1) * size]
    else:
        own = []
    extra = event.get("extra_keys")
    lora_name = event.get("lora_name")
    lora_id = event.get("lora_id")
    return BlockFact(
        hash=hashes[i],
        parent=hashes[i - 1] if i else event.get("parent_block_hash"),
        token_ids=own,
        block_size=size if type(size) is int else None,
        medium=medium,
        group_idx=group,
        lora_id=lora_id if type(lora_id) is int else None,
        lora_name=lora_name if isinstance(lora_name, str) else None,
        extra_keys=extra[i] if isinstance(extra, list) and len(extra) == n else None,
    )


class _Pending:
    """One block touched by the record being applied."""

    __slots__ = ("count", "existed", "source")

    def __init__(self, count: int, existed: bool, source: object) -> None:
        self.count = count
        self.existed = existed
        self.source = source  # a BlockFact, (event, index, n) of its last store, or None


class StateTracker:
    """The live blocks of every stream; :meth:`apply` each delivered record once, in order."""

    def __init__(self, max_entries: int | None = None, generation_base: int = 0) -> None:
        self.max_entries = max_entries
        # Generations of streams first met here start at this number (the runtime passes the
        # clock in ms): above any generation an earlier process wrote, rebuilt or not.
        self.generation_base = generation_base
        self.total = 0
        self.stats = TrackerStats()
        self._streams: dict[str, _StreamState] = {}

    # -- queries --------------------------------------------------------------------------------
    def head(self, stream: Stream) -> Head | None:
        st = self._streams.get(stream.key)
        return None if st is None else st.head()

    def count(self, stream: Stream, medium: str | None, group_idx: int | None, block_hash: object) -> int:
        """The residency count of a block (by its hash as sent or its id)."""
        table = self._table(stream, medium, group_idx)
        k = block_id(block_hash)
        return 0 if table is None or k is None else table.count(k)

    def version(self, stream: Stream, medium: str | None, group_idx: int | None, block_hash: object) -> tuple[int, int] | None:
        """(epoch, seq) of the record that last changed a live block; None when it is absent."""
        table = self._table(stream, medium, group_idx)
        k = block_id(block_hash)
        v = 0 if table is None or k is None else table.version(k)
        if not v:
            return None
        return (self._streams[stream.key].epoch, v - 1)

    def entries(self, stream: Stream) -> Iterator[tuple[str | None, int | None, int, int, int]]:
        """(medium, group_idx, block id, count, seq of the last change) of every live block."""
        st = self._streams.get(stream.key)
        if st is None:
            return
        for (medium, group), table in st.tiers.items():
            for k, c, v in table.items():
                yield medium, group, k, c, v - 1

    def invalidate(self, stream: Stream, after: tuple[int, int] | None = None) -> None:
        """A sink could not write a change of ``stream`` (refused for itself): what it holds may
        differ from the tracker from now on. The stream's next record clears it everywhere (a new
        generation) and makes it incomplete until the engine's next reset or clear.

        ``after``: the position of the first record whose change the sink could not write. A
        record past it that this tracker applied already cleared the stream: the sink writes
        that clear next (a new generation: what it held before no longer counts) and the changes
        since, so its state is the tracker's again, and nothing is cleared (a refusal the sink
        learns of late, after the engine's clear, would keep the state incomplete until the one
        after it)."""
        st = self._streams.get(stream.key)
        if st is not None and (after is None or st.cleared_at <= after):
            st.lost = True

    def streams_off(self) -> int:
        """Streams whose state is switched off (the cap)."""
        return sum(1 for st in self._streams.values() if not st.tracking)

    def nbytes(self) -> int:
        """Bytes held by the tables' arrays (side dicts not included)."""
        return sum(t.nbytes() for st in self._streams.values() for t in st.tiers.values())

    def forget(self, stream: Stream) -> list[ClearedTier]:
        """Stop tracking a stream that is gone (its source removed): what it held, by tier."""
        st = self._streams.pop(stream.key, None)
        if st is None:
            return []
        self.total -= st.live
        return [ClearedTier(m, g, t) for (m, g), t in st.tiers.items() if t.n]

    def seed(self, stream: Stream, head: Head, entries: Iterable[SeedEntry]) -> bool:
        """Start ``stream`` from the state a sink holds (a restarted bridge rebuilding its tables):
        its head and live entries ``(medium, group_idx, block id, count, seq of the last change,
        fact)`` (the fact is kept only for counts above 1). Records at or below the head's position
        are then stale. False, and nothing kept, when the entries would take the tracker past
        ``max_entries`` or the stream is already tracked: its first record then clears the sink's
        state (a fresh start)."""
        if stream.key in self._streams:
            return False
        st = _StreamState(head.epoch, head.generation)
        st.seq = head.seq
        st.position = (head.epoch, head.seq + 1)
        st.complete = head.complete
        st.tracking = head.tracking
        cap = self.max_entries
        live = 0
        for medium, group, k, count, seq, fact in entries if head.tracking else ():
            if count <= 0 or not 0 <= k <= U64:
                continue
            tier = (medium, group)
            table = st.tiers.get(tier)
            if table is None:
                table = st.tiers[tier] = BlockTable()
            if table.count(k):
                continue  # a key given twice: the first stands
            for _ in range(count):
                table.add(k, seq + 1)
            if count > 1:
                table.multi[k][1] = fact
            live += 1
            if cap is not None and self.total + live > cap:
                return False
        st.live = live
        self.total += live
        newest = max((v - 1 for t in st.tiers.values() for _k, _c, v in t.items()), default=-1)
        st.ahead = newest if newest > head.seq else -1
        self._streams[stream.key] = st
        return True

    def _table(self, stream: Stream, medium: str | None, group: int | None) -> BlockTable | None:
        st = self._streams.get(stream.key)
        return None if st is None else st.tiers.get((medium, group))

    # -- applying records -----------------------------------------------------------------------
    def apply(self, record: Record) -> StateDelta:
        """Apply one delivered record; what the sinks' state must change (see StateDelta)."""
        st = self._streams.get(record.stream.key)
        fresh = st is None
        if st is None:
            st = self._streams[record.stream.key] = _StreamState(record.epoch, self.generation_base)
        elif record.position <= st.position:
            self.stats.stale_records += 1
            return StateDelta(record.stream, st.head(), stale=True)
        delta = StateDelta(record.stream, st.head())
        if fresh and not self._room():
            st.tracking = False  # a new stream while the tracker is full: off from the start
            delta.switched_off = True
            self.stats.switched_off += 1
        position = record.position
        pending: dict[tuple[Tier, int], _Pending] = {}
        new_epoch = record.epoch != st.epoch
        st.epoch = record.epoch
        st.position = position
        if fresh or st.lost:
            # Not rebuilt (see seed): a sink may hold this stream's state from an earlier process,
            # which this tracker cannot change key by key; or a sink refused a change (see
            # invalidate). Clear it (a new generation), incomplete unless the record restarts it.
            self._clear(st, delta, pending)
            if st.lost:
                st.lost = st.complete = False
        if record.kind == "SourceReset":
            self._clear(st, delta, pending)
            self._restart(st, delta)
            st.seq = -1  # nothing of the new epoch yet
        elif record.kind == "EventsLost":
            self._clear(st, delta, pending)
            st.complete = False
            st.seq = record.seq
        else:
            st.seq = record.seq
            seed = record.seed
            if seed is not None:
                # Seeded from an engine snapshot (bridge.snapshot): the engine's cache at the
                # snapshot's cut and the batches since, then this batch: complete from here.
                self._clear(st, delta, pending)
                st.lost = False
                self._restart(st, delta)
                self._events(st, seed, delta, pending)
            elif fresh or new_epoch:
                # No reset opened this epoch here: only a batch at seq 0 follows an empty cache.
                if new_epoch and not fresh:
                    self._clear(st, delta, pending)
                if record.seq == 0:
                    self._restart(st, delta)
                else:
                    st.complete = False
            if (record.n_events and not record.events) or record.bad_events:
                # Events not decoded (all, or some: a lost one may be a removal): the stream is unknown.
                self.stats.undecoded_batches += 1
                self._clear(st, delta, pending)
                st.complete = False
            else:
                self._events(st, record, delta, pending)
        delta.changes = self._changes(pending)
        delta.head = st.head()
        if delta.clear:
            st.cleared_at = position
        return delta

    def _room(self) -> bool:
        return self.max_entries is None or self.total < self.max_entries

    def _restart(self, st: _StreamState, delta: StateDelta) -> None:
        """The stream is known empty (a reset or a clear): complete, and tracked if there is room."""
        st.complete = True
        if not st.tracking and self._room():
            st.tracking = True
            delta.switched_on = True

    def _clear(self, st: _StreamState, delta: StateDelta, pending: dict[tuple[Tier, int], _Pending]) -> None:
        if not delta.clear:
            # What sinks may hold: the live blocks, and those the record removed before the clear.
            # (A later clear in the same record removes only blocks added since the first one,
            # which no sink has seen: nothing to enumerate.)
            delta.cleared = [ClearedTier(m, g, t) for (m, g), t in st.tiers.items() if t.n]
            removed: dict[Tier, list[int]] = {}
            for (tier, k), p in pending.items():
                if p.existed and p.count == 0:
                    removed.setdefault(tier, []).append(k)
            delta.cleared += [ClearedTier(m, g, ids) for (m, g), ids in removed.items()]
        delta.clear = True
        self.total -= st.live
        st.live = 0
        st.tiers = {}
        st.ahead = -1
        # Above every generation an earlier process may have left in a sink (a write a crash cut
        # after its clear, which no head covers): at least this process's base.
        st.generation = max(st.generation + 1, self.generation_base)
        pending.clear()

    def _switch_off(self, st: _StreamState, delta: StateDelta, pending: dict[tuple[Tier, int], _Pending]) -> None:
        self._clear(st, delta, pending)
        st.tracking = False
        st.complete = False
        delta.switched_off = True
        self.stats.switched_off += 1

    def _events(self, st: _StreamState, record: Record, delta: StateDelta, pending: dict[tuple[Tier, int], _Pending]) -> None:
        stats = self.stats
        ver = record.seq + 1
        cap = self.max_entries
        # Blocks whose seeded entry already holds this record (or a later one): left as they are.
        ahead: set[tuple[Tier, int]] | None = None
        if st.ahead >= 0:
            if st.ahead >= record.seq:
                ahead = set()
            else:
                st.ahead = -1
        for event in record.events:
            kind = event.get("type")
            if kind == "AllBlocksCleared" and event.get("medium") is None:
                self._clear(st, delta, pending)
                self._restart(st, delta)
                ahead = None  # the seeded entries are gone
                continue
            stored = kind == "BlockStored"
            if kind in _UNCHANGING:
                continue
            if kind == "AllBlocksCleared" or not (stored or kind == "BlockRemoved"):
                # ROCm ATOM's moves between media, and its clear of one medium: block changes this
                # tracker keeps no facts to apply exactly (what moved, what else a medium held); a
                # newer engine's event type may change the cache in a way it cannot know. The
                # stream's state is unknown until its next reset or full clear (I6).
                self._clear(st, delta, pending)
                st.complete = False
                ahead = None
                continue
            if not st.tracking:
                continue
            hashes = event.get("block_hashes")
            medium = event.get("medium")
            group = event.get("group_idx")
            if (
                not isinstance(hashes, list)
                or not (medium is None or type(medium) is str)
                or not (group is None or type(group) is int)
            ):
                stats.bad_events += 1
                continue
            tier: Tier = (medium, group)
            table = st.tiers.get(tier)
            if table is None:
                if not stored:
                    # Nothing is live in this tier: every removal is of an absent block.
                    n_absent = sum(1 for h in hashes if block_id(h) is not None)
                    delta.absent_removals += n_absent
                    stats.absent_removals += n_absent
                    stats.bad_hashes += len(hashes) - n_absent
                    continue
                table = st.tiers[tier] = BlockTable()
            n = len(hashes)
            for i, h in enumerate(hashes):
                k = h if type(h) is int and 0 <= h <= U64 else block_id(h)
                if k is None:
                    stats.bad_hashes += 1
                    continue
                p = pending.get((tier, k))
                if ahead is not None and p is None and ((tier, k) in ahead or table.version(k) >= ver):
                    ahead.add((tier, k))
                    continue
                if stored:
                    c = table.add(k, ver)
                    source: object = (event, i, n)
                    if c == 1:
                        st.live += 1
                        self.total += 1
                        if cap is not None and self.total > cap:
                            self._switch_off(st, delta, pending)
                            break
                    else:
                        m = table.multi[k]
                        m[1] = _fact(event, i, n, medium, group)
                        source = m[1]
                else:
                    c, source = table.remove(k, ver)
                    if c < 0:
                        delta.absent_removals += 1
                        stats.absent_removals += 1
                        continue
                    if c == 0:
                        st.live -= 1
                        self.total -= 1
                if p is None:
                    pending[(tier, k)] = _Pending(c, (c - 1 if stored else c + 1) > 0, source)
                else:
                    p.count = c
                    p.source = source

    def _changes(self, pending: dict[tuple[Tier, int], _Pending]) -> list[EntryChange]:
        changes: dict[tuple[Tier, int], EntryChange] = {}
        for key, p in pending.items():
            if p.count <= 0 and not p.existed:
                continue  # stored and removed within the record: no sink ever had it
            fact: BlockFact | None = None
            if p.count > 0:
                src = p.source
                if isinstance(src, tuple):
                    event, i, n = src
                    fact = _fact(event, i, n, key[0][0], key[0][1])
                elif isinstance(src, BlockFact):
                    fact = src
            changes[key] = EntryChange(key[0][0], key[0][1], key[1], p.count, fact)
        # Mostly the first-touch order is already parents first: check before sorting.
        order: dict[object, int] = {key: i for i, key in enumerate(changes)}
        for i, (key, c) in enumerate(changes.items()):
            f = c.fact
            if f is not None and f.parent is not None and order.get((key[0], block_id(f.parent)), -1) > i:
                return _parents_first(changes)
        return list(changes.values())


def _parents_first(changes: dict[tuple[Tier, int], EntryChange]) -> list[EntryChange]:
    """``changes`` in their order, except that a block's parent (same tier) comes before it."""
    out: list[EntryChange] = []
    done: set[tuple[Tier, int]] = set()
    for key in changes:
        chain: list[tuple[Tier, int]] = []
        k: tuple[Tier, int] | None = key
        while k is not None and k not in done and k in changes:
            done.add(k)
            chain.append(k)
            fact = changes[k].fact
            parent = None if fact is None or fact.parent is None else block_id(fact.parent)
            k = None if parent is None else (k[0], parent)
        out.extend(changes[c] for c in reversed(chain))
    return out
