"""The state tracker as a model: a reference multiset per stream, checked after every record.

Streams receive batches (stores with duplicates, removals of present and absent blocks, clears,
unknown and malformed events) over several tiers and groups, with every hash form (u64, i64,
32-byte digests whose low 64 bits name the same block), plus SourceResets, EventsLost,
re-delivered (stale) records, and a cap that switches streams off. After every record the tracker
equals the reference (counts, versions, heads) and a sink that applies the deltas (per-key deletes
from ``cleared``, then ``changes``) equals the tracker.

The sink can lose its state at any step (I6): wiped (a restart without persistence, a deleted key
or bucket) or put back to an older snapshot (a restart from an older RDB file). The runtime is told
(``StateTracker.invalidate``, as it is when a connector reports the loss): the stream's next record
clears the sink whole into a new generation, incomplete until the engine's next reset. The sink can
also stall (an OOM: the tracker goes on, the deltas wait) and then refuse the first record it holds
for itself: it writes none of the stream's changes until the next clear (as bridge.sink does), and
the tracker clears the stream at its next record only if it applied no clear since the refused one.
Whatever the sink holds, a head it marks complete equals the engine's cache at that head.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from bridge.records import Record, Stream, events_lost, source_reset
from bridge.state import BlockFact, Head, StateDelta, StateTracker, block_id
from tests.support.strategies import examples

EXAMPLES = examples(int(os.environ.get("KV_MODEL_EXAMPLES", "300")))
U64 = (1 << 64) - 1
STREAMS = [Stream("a", 0), Stream("a", 1), Stream("b", 0)]
MEDIA = [None, "GPU", "CPU"]
GROUPS = [None, 0, 1]
IDS = [0, 1, 2, 3, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]

Key = tuple[str | None, int | None, int]


PREFIXES = [bytes(24), bytes(range(24)), b"\xff" * 24]


def send_as(k: int, form: int) -> Any:
    """Block id ``k`` in one of the ways an engine sends it: u64, i64, 32-byte digest."""
    if form == 0:
        return k
    if form == 1:
        return k - (1 << 64) if k >= 1 << 63 else k
    return PREFIXES[form - 2] + k.to_bytes(8, "big")


hashes = st.lists(st.builds(send_as, st.sampled_from(IDS), st.integers(0, 1 + len(PREFIXES))), min_size=1, max_size=5)


@st.composite
def block_event(draw: st.DrawFn) -> dict[str, Any]:
    kinds = ["BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved", "AllBlocksCleared", "BlockInactive", "Other"]
    kind = draw(st.sampled_from(kinds))
    if kind in ("AllBlocksCleared", "Other"):
        return {"type": kind}
    ev: dict[str, Any] = {"type": kind, "block_hashes": draw(hashes)}
    medium, group = draw(st.sampled_from(MEDIA)), draw(st.sampled_from(GROUPS))
    if medium is not None or draw(st.booleans()):
        ev["medium"] = medium
    if group is not None or draw(st.booleans()):
        ev["group_idx"] = group
    if kind == "BlockStored":
        n = len(ev["block_hashes"])
        ev["parent_block_hash"] = draw(st.none() | st.sampled_from(IDS))
        ev["block_size"] = 2
        ev["token_ids"] = list(range(2 * n))
        ev["extra_keys"] = [[i] for i in range(n)]
    if draw(st.integers(0, 20)) == 0:
        ev["block_hashes"].append("not a hash")
    return ev


@dataclass
class Ref:
    """The reference state of one stream."""

    epoch: int = 0
    seq: int = -1
    generation: int = 0
    complete: bool = False
    tracking: bool = True
    counts: Counter[Key] = field(default_factory=Counter)
    versions: dict[Key, int] = field(default_factory=dict)  # live key -> seq of its last change


class StateModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[str, Ref] = {}
        self.next_seq = {s.key: 0 for s in STREAMS}
        self.epoch = {s.key: 1 for s in STREAMS}
        self.sink: dict[str, dict[Key, tuple[int, BlockFact | None, int]]] = {s.key: {} for s in STREAMS}
        self.sink_head: dict[str, Head | None] = {s.key: None for s in STREAMS}
        # What the sink held after each record (its entries and head), to put it back to (a snapshot)
        self.snapshots: dict[str, list[tuple[dict[Key, tuple[int, BlockFact | None, int]], Head | None]]] = {
            s.key: [] for s in STREAMS
        }
        self.truth: dict[tuple[str, int, int, int], dict[Key, int]] = {}  # the engine's cache at each head
        self.lost: set[str] = set()  # streams whose sink lost its state, until their next record
        self.cleared_at: dict[str, tuple[int, int]] = {}  # the position of each stream's last clear (the reference's)
        # The sink's side: deltas of streams it holds back (stalled), and streams whose changes it
        # writes none of until the next clear (it lost or was refused one).
        self.stalled: set[str] = set()
        self.pending: dict[str, list[tuple[tuple[int, int], StateDelta]]] = {s.key: [] for s in STREAMS}
        self.gone: set[str] = set()
        self.history: list[Record] = []
        self.cap: int | None = None
        self.tracker = StateTracker()

    @initialize(cap=st.none() | st.integers(1, 12))
    def setup(self, cap: int | None) -> None:
        self.cap = cap
        self.tracker = StateTracker(max_entries=cap)

    # -- the reference --------------------------------------------------------------------------
    def total(self) -> int:
        return sum(len(+r.counts) for r in self.refs.values())

    def room(self) -> bool:
        return self.cap is None or self.total() < self.cap

    def ref_clear(self, r: Ref) -> None:
        r.counts.clear()
        r.versions.clear()
        r.generation += 1

    def ref_restart(self, r: Ref) -> None:
        r.complete = True
        if not r.tracking and self.room():
            r.tracking = True

    def ref_apply(self, rec: Record) -> None:
        key = rec.stream.key
        fresh = key not in self.refs
        r = self.refs.setdefault(key, Ref(epoch=rec.epoch))
        if fresh and not self.room():
            r.tracking = False
        if fresh:
            self.ref_clear(r)  # a sink may hold an earlier process's state of it: a new generation
        new_epoch = rec.epoch != r.epoch
        r.epoch = rec.epoch
        if key in self.lost and not fresh:  # cleared whole into a new generation, incomplete
            self.ref_clear(r)
            r.complete = False
        if rec.kind == "SourceReset":
            self.ref_clear(r)
            self.ref_restart(r)
            r.seq = -1
            return
        if rec.kind == "EventsLost":
            self.ref_clear(r)
            r.complete = False
            r.seq = rec.seq
            return
        r.seq = rec.seq
        if fresh or new_epoch:
            if new_epoch and not fresh:
                self.ref_clear(r)
            if rec.seq == 0:
                self.ref_restart(r)
            else:
                r.complete = False
        for ev in rec.events:
            if ev["type"] == "AllBlocksCleared":
                self.ref_clear(r)
                self.ref_restart(r)
                continue
            if ev["type"] == "BlockInactive":
                continue  # (a block still cached: no change)
            if ev["type"] not in ("BlockStored", "BlockRemoved"):
                self.ref_clear(r)  # (a type the bridge does not know: what it did to the cache is unknown)
                r.complete = False
                continue
            if not r.tracking:
                continue
            for h in ev["block_hashes"]:
                k = block_id(h)
                if k is None:
                    continue
                bk = (ev.get("medium"), ev.get("group_idx"), k)
                if ev["type"] == "BlockStored":
                    r.counts[bk] += 1
                    r.versions[bk] = rec.seq
                    if r.counts[bk] == 1 and self.cap is not None and self.total() > self.cap:
                        self.ref_clear(r)
                        r.tracking = False
                        r.complete = False
                        break
                elif r.counts[bk] > 0:
                    r.counts[bk] -= 1
                    r.versions[bk] = rec.seq
                    if not r.counts[bk]:
                        del r.counts[bk]
                        del r.versions[bk]

    # -- the sink that applies deltas ------------------------------------------------------------
    def sink_apply(self, d: StateDelta, whole: bool) -> None:
        entries = self.sink[d.stream.key]
        if d.clear and whole:
            # A sink that lost its state may hold keys the tracker never listed (an older
            # snapshot's, what a refused record removed): a new generation, whatever the
            # connector keeps of the old one, which no head names any more.
            entries.clear()
        elif d.clear:
            for tier in d.cleared:
                for k in tier.blocks:
                    entries.pop((tier.medium, tier.group_idx, k), None)
            assert not entries, f"a clear left keys its enumeration missed: {sorted(entries)[:5]}"
        for c in d.changes:
            key = (c.medium, c.group_idx, c.block)
            if c.count == 0:
                assert c.fact is None
                entries.pop(key, None)
            else:
                assert c.fact is not None, c
                assert block_id(c.fact.hash) == c.block
                assert (c.fact.medium, c.fact.group_idx) == (c.medium, c.group_idx)
                entries[key] = (c.count, c.fact, d.head.seq)

    # -- driving --------------------------------------------------------------------------------
    def deliver(self, rec: Record) -> None:
        before = self.tracker.head(rec.stream)
        delta = self.tracker.apply(rec)
        assert not delta.stale
        key = rec.stream.key
        generation = self.refs[key].generation if key in self.refs else None
        self.ref_apply(rec)
        self.lost.discard(key)
        r = self.refs[key]
        if r.generation != generation:
            self.cleared_at[key] = rec.position
        self.truth[(key, delta.head.epoch, delta.head.seq, delta.head.generation)] = dict(r.counts)
        self.pending[key].append((rec.position, delta))
        if key not in self.stalled:
            self.flush(key)
        if delta.switched_off and not delta.switched_on:
            assert not r.tracking
        if before is not None and before.tracking and not r.tracking:
            assert delta.switched_off
        self.history.append(rec)

    def flush(self, key: str) -> None:
        """The sink writes the deltas it holds of stream ``key``, skipping, while it is gone, each
        one up to the next clear (bridge.sink's ``_state_gone``)."""
        for _position, d in self.pending[key]:
            whole = key in self.gone
            if whole and not d.clear:
                continue
            self.gone.discard(key)
            self.sink_apply(d, whole)
            self.sink_head[key] = d.head
            self.snapshots[key].append((dict(self.sink[key]), d.head))
        self.pending[key].clear()

    @rule(s=st.sampled_from(STREAMS))
    def sink_stalls(self, s: Stream) -> None:
        """The sink stops writing the stream for a while (an OOM): the tracker goes on."""
        self.stalled.add(s.key)

    @rule(s=st.sampled_from(STREAMS))
    def sink_writes(self, s: Stream) -> None:
        self.stalled.discard(s.key)
        self.flush(s.key)

    @precondition(lambda self: any(self.pending.values()))
    @rule(i=st.integers(0, 10**6))
    def sink_refuses(self, i: int) -> None:
        """I6 fault: the sink refuses the first record it holds of a stream for itself; it writes
        none of the stream's changes until the next clear, and the runtime tells the tracker."""
        keys = [k for k, p in self.pending.items() if p]
        key = keys[i % len(keys)]
        position, _refused = self.pending[key].pop(0)
        self.gone.add(key)
        self.tracker.invalidate(next(s for s in STREAMS if s.key == key), position)
        if self.cleared_at.get(key, (-1, -1)) <= position:
            self.lost.add(key)  # the tracker clears the stream at its next record

    @rule(s=st.sampled_from(STREAMS), events=st.lists(block_event(), max_size=6), skip=st.integers(0, 3))
    def batch(self, s: Stream, events: list[dict[str, Any]], skip: int) -> None:
        seq = self.next_seq[s.key]
        if skip == 3 and seq:  # a gap, announced like the sequencer does
            self.deliver(events_lost(s, self.epoch[s.key], seq, seq + 2, "unrecoverable", 0.0))
            seq += 3
        self.next_seq[s.key] = seq + 1
        self.deliver(Record(stream=s, epoch=self.epoch[s.key], seq=seq, events=events))

    @rule(s=st.sampled_from(STREAMS), announced=st.booleans())
    def restart(self, s: Stream, announced: bool) -> None:
        self.epoch[s.key] += 1
        self.next_seq[s.key] = 0
        if announced:
            self.deliver(source_reset(s, self.epoch[s.key], "publisher_restart", 0.0))

    @rule(s=st.sampled_from(STREAMS), first=st.integers(0, 2))
    def joined_late(self, s: Stream, first: int) -> None:
        """A new epoch whose first batches were missed: its first record is above seq 0."""
        self.epoch[s.key] += 1
        self.next_seq[s.key] = first

    @precondition(lambda self: bool(self.history))
    @rule(s=st.sampled_from(STREAMS), older=st.booleans(), i=st.integers(0, 10**6))
    def sink_loses_its_state(self, s: Stream, older: bool, i: int) -> None:
        """I6 fault: the sink's state is wiped, or put back to what it held after an earlier record."""
        key = s.key
        snapshots = self.snapshots[key]
        if older and snapshots:
            entries, head = snapshots[i % len(snapshots)]
            self.sink[key], self.sink_head[key] = dict(entries), head
        else:
            self.sink[key], self.sink_head[key] = {}, None
        self.tracker.invalidate(s)  # what the runtime does when the connector reports the loss
        self.gone.add(key)  # (bridge.sink: none of the changes it holds are written, up to a clear)
        if key in self.refs:
            self.lost.add(key)

    @precondition(lambda self: bool(self.history))
    @rule(i=st.integers(0, 10**6))
    def redeliver(self, i: int) -> None:
        rec = self.history[i % len(self.history)]
        head = self.tracker.head(rec.stream)
        delta = self.tracker.apply(rec)
        assert delta.stale and not delta.changes and not delta.clear
        assert self.tracker.head(rec.stream) == head

    # -- checks ---------------------------------------------------------------------------------
    @invariant()
    def a_complete_head_in_the_sink_is_true(self) -> None:
        """I6: whatever the sink holds (lost, put back), a head it marks complete equals the
        engine's cache at that head."""
        for s in STREAMS:
            head = self.sink_head[s.key]
            if head is not None and head.complete:
                held = {bk: c for bk, (c, _f, _v) in self.sink[s.key].items()}
                assert held == self.truth[(s.key, head.epoch, head.seq, head.generation)]

    @invariant()
    def equals_reference(self) -> None:
        for s in STREAMS:
            r = self.refs.get(s.key)
            head = self.tracker.head(s)
            if r is None:
                assert head is None
                continue
            assert head is not None
            got = {(m, g, k): (c, v) for m, g, k, c, v in self.tracker.entries(s)}
            want = {bk: (c, r.versions[bk]) for bk, c in r.counts.items()}
            assert got == want
            for (m, g, k), (c, v) in want.items():
                assert self.tracker.count(s, m, g, k) == c
                assert self.tracker.version(s, m, g, k) == (r.epoch, v)
            assert (head.epoch, head.seq, head.generation) == (r.epoch, r.seq, r.generation)
            assert head.tracking == r.tracking
            assert head.complete == (r.complete and r.tracking)
            assert head.live == len(want)
            if s.key in self.lost or s.key in self.gone or self.pending[s.key]:
                continue  # the sink's state is what it lost to (until the next clear), or behind
            sink = self.sink[s.key]
            assert {bk: c for bk, (c, _f, _v) in sink.items()} == dict(r.counts)
            assert {bk: v for bk, (_c, _f, v) in sink.items()} == r.versions
        assert self.tracker.total == self.total()
        if self.cap is not None:
            assert self.tracker.total <= self.cap


StateModel.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    derandomize=os.environ.get("CI") == "true",
    suppress_health_check=[HealthCheck.too_slow],
)
TestStateModel = StateModel.TestCase
