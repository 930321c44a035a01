"""The state bootstrap as a model: any cut, writes interleaved with the sweep, equals the tracker.

A stream's records (stores with duplicates on two tiers, removals of held and absent blocks,
``AllBlocksCleared``, engine restarts with and without their ``SourceReset``, ``EventsLost``) go
through a :class:`StateTracker`; a model sink keeps what a sink writes: the output messages (one
per event, as json decodes them) and the state documents of :mod:`bridge.state_docs`, its clears
applied as a purge of the stream's keys (Redis, NATS) or as tombstones of the keys a delta lists
(Kafka). The bridge may restart between records: rebuilt from the sink's documents
(``StateTracker.seed``, what ``read_state`` gives it; the records since its head come again and
are stale) or afresh (a new generation; the tombstone sink keeps the old keys, which a consumer
must leave out by their generation).

A consumer bootstraps after any record: it reads the head, then sweeps the keys in order while
the sink goes on writing between two keys (each key read as it is when the sweep reaches it; a
key written behind the sweep is missed), reads the head again (starts over if a clear ran), and
follows the messages from the head's ``next``. Once it has read every message, its blocks equal
the tracker's and its ``complete`` the tracker's head's.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bridge.records import Record, Stream, events_lost, source_reset
from bridge.state import StateDelta, StateTracker
from bridge.state_docs import StateFormat, entry_key, parse, seed_of
from kv_consumer.state import StreamState, block_id, follows_head, is_head, position
from tests.support.strategies import examples

EXAMPLES = examples(int(os.environ.get("KV_MODEL_EXAMPLES", "300")))
S = Stream("llama-a", 0)
FORMAT = StateFormat()
IDS = [1, 2, 3, 4, 2**63, 2**64 - 1]


class ModelSink:
    """What a sink holds of one stream: its messages and its state documents."""

    def __init__(self, purge: bool) -> None:
        self.purge = purge
        self.log: list[dict[str, Any]] = []
        self.kv: dict[str, bytes] = {}

    def write(self, record: Record, delta: StateDelta) -> None:
        base = {"source": S.source, "dp_rank": S.dp_rank, "epoch": record.epoch, "seq": record.seq}
        if record.kind != "batch":
            self.log.append({**base, **record.control()})
        else:
            for i, ev in enumerate(record.events):
                self.log.append(msgspec.json.decode(msgspec.json.encode({**base, "index": i, **ev})))
        if delta.stale:
            return
        if delta.clear:
            if self.purge:
                self.kv = {k: v for k, v in self.kv.items() if k == "_head"}
            for tier in delta.cleared:
                for k in tier.blocks:
                    self.kv.pop(entry_key(tier.medium, tier.group_idx, k), None)
        for c in delta.changes:
            key = entry_key(c.medium, c.group_idx, c.block)
            if c.count:
                self.kv[key] = FORMAT.entry(S, delta.head, c)
            else:
                self.kv.pop(key, None)
        self.kv["_head"] = FORMAT.head(S, delta.head, len(self.log))

    def read_state(self) -> tuple[Any, list[Any]] | None:
        """What ``read_state`` gives a restarted bridge."""
        if "_head" not in self.kv:
            return None
        return seed_of(parse(self.kv["_head"]) or {}, [parse(v) or {} for k, v in self.kv.items() if k != "_head"])


@st.composite
def event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["BlockStored"] * 3 + ["BlockRemoved"] * 2 + ["AllBlocksCleared"]))
    if kind == "AllBlocksCleared":
        return {"type": kind}
    hashes = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=3))
    ev: dict[str, Any] = {"type": kind, "block_hashes": hashes, "medium": draw(st.sampled_from(["GPU", "CPU"])), "group_idx": 0}
    if kind == "BlockStored":
        ev.update(parent_block_hash=None, token_ids=list(range(len(hashes) * 2)), block_size=2)
    return ev


step = st.one_of(
    st.tuples(st.just("batch"), st.lists(event(), min_size=1, max_size=4)),
    st.tuples(st.just("restart"), st.booleans()),
    st.tuples(st.just("lost"), st.integers(1, 3)),
    st.tuples(st.just("bridge"), st.sampled_from(["rebuilt", "fresh"])),
)


class World:
    """The engine's records, the bridge's tracker and the sink, one step at a time; ``truth`` is
    the engine's cache as the delivered records tell it (copies per key)."""

    def __init__(self, purge: bool) -> None:
        self.sink = ModelSink(purge)
        self.tracker = StateTracker(generation_base=1000)
        self.epoch, self.seq = 1, 0
        self.records: list[Record] = []
        self.restarts = 0
        self.fresh = False  # the bridge restarted without rebuilding its state
        self.truth: dict[tuple[Any, Any, int], int] = {}

    def deliver(self, record: Record) -> None:
        self.records.append(record)
        self.sink.write(record, self.tracker.apply(record))
        if record.kind == "SourceReset" or (len(self.records) > 1 and self.records[-2].epoch != record.epoch):
            self.truth.clear()  # a new engine instance starts empty (a loss changes nothing the engine holds)
        for ev in record.events:
            if ev["type"] == "AllBlocksCleared":
                self.truth.clear()
                continue
            for h in ev["block_hashes"]:
                key = (ev["medium"], ev["group_idx"], h)
                n = self.truth.get(key, 0) + (1 if ev["type"] == "BlockStored" else -1)
                if n > 0:
                    self.truth[key] = n
                else:
                    self.truth.pop(key, None)

    def step(self, op: tuple[str, Any]) -> None:
        kind, arg = op
        if kind == "batch":
            self.deliver(Record(stream=S, epoch=self.epoch, seq=self.seq, events=arg))
            self.seq += 1
        elif kind == "restart":
            self.epoch, self.seq = self.epoch + 1, 0
            if arg:
                self.deliver(source_reset(S, self.epoch, "publisher_restart", 0.0))
        elif kind == "lost" and self.seq:
            self.deliver(events_lost(S, self.epoch, self.seq, self.seq + arg - 1, "unrecoverable", 0.0))
            self.seq += arg
        elif kind == "bridge":
            self.restarts += 1
            self.fresh = self.fresh or arg == "fresh"
            self.tracker = StateTracker(generation_base=1000 * (self.restarts + 1))
            held = self.sink.read_state() if arg == "rebuilt" else None
            if held is not None:
                assert self.tracker.seed(S, *held)
                # it resumes from a checkpoint below its head: the last records come again, stale
                for record in self.records[-3:]:
                    delta = self.tracker.apply(record)
                    assert delta.stale and not delta.changes and not delta.clear
                    self.sink.write(record, delta)


def sweep(world: World, ops: list[tuple[str, Any]], moves: list[int]) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """A consumer's sweep while ``ops`` go on (``moves[i]`` of them before key i is read): the head
    read first, each key as it is when reached, a key written behind the sweep missed; None when
    the head read again shows a clear (another generation): the consumer starts over."""
    kv = world.sink.kv
    if "_head" not in kv:
        return None
    head = msgspec.json.decode(kv["_head"])
    docs: list[dict[str, Any]] = []
    cursor = ""
    i = 0
    while True:
        for _ in range(moves[i % len(moves)] if moves else 0):
            if ops:
                world.step(ops.pop(0))
        i += 1
        kv = world.sink.kv
        later = sorted(k for k in kv if k > cursor and k != "_head")
        if not later:
            break
        cursor = later[0]
        docs.append(msgspec.json.decode(kv[cursor]))
    again = msgspec.json.decode(world.sink.kv["_head"])
    if (again["epoch"], again["gen"]) != (head["epoch"], head["gen"]):
        return None
    return head, docs


STORE = {"type": "BlockStored", "block_hashes": [1], "medium": "GPU", "group_idx": 0, "token_ids": [0, 1], "block_size": 2}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    purge=st.booleans(),
    before=st.lists(step, min_size=1, max_size=14),
    during=st.lists(step, min_size=1, max_size=10),
    moves=st.lists(st.integers(0, 2), min_size=1, max_size=6),
)
@example(purge=True, before=[("batch", [STORE])], during=[("batch", [{**STORE, "block_hashes": [2]}])], moves=[1])
@example(  # a rebuild after a fresh start must leave out the entries the tombstone sink kept from before it
    purge=False,
    before=[
        ("batch", [STORE]),
        ("bridge", "fresh"),
        ("batch", [{**STORE, "block_hashes": [2]}]),
        ("batch", [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}]),
        ("bridge", "rebuilt"),
        ("batch", [STORE]),
        ("batch", [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}]),
    ],
    during=[("batch", [STORE])],
    moves=[0],
)
def test_a_bootstrap_at_any_cut_equals_the_tracker(
    purge: bool, before: list[tuple[str, Any]], during: list[tuple[str, Any]], moves: list[int]
) -> None:
    world = World(purge)
    for op in before:
        world.step(op)
    ops = list(during)
    swept = sweep(world, ops, moves)
    for op in ops:  # what the sweep did not wait for
        world.step(op)
    if swept is None:
        return  # no head yet, or a clear during the sweep: a consumer starts over (tested below)
    head, docs = swept
    state = StreamState(head, docs)
    for message in world.sink.log[head["next"] :]:
        state.apply(message)
    check(state, world)


def check(state: StreamState, world: World) -> None:
    """Never a block the engine lacks; exact when complete; as complete as the tracker, unless
    the bridge started afresh (it then knows less than a consumer that followed every message)."""
    __tracebackhide__ = True
    mine = state.blocks()
    assert all(world.truth.get(k, 0) >= n for k, n in mine.items()), (mine, world.truth)
    if state.complete:
        assert mine == world.truth
    head = world.tracker.head(S)
    if head is not None and not world.fresh:
        assert state.complete == head.complete
        assert mine == {(m, g, k): c for m, g, k, c, _ in world.tracker.entries(S)}


@settings(max_examples=EXAMPLES, deadline=None)
@given(purge=st.booleans(), before=st.lists(step, max_size=14))
def test_a_sweep_between_writes_equals_the_tracker(purge: bool, before: list[tuple[str, Any]]) -> None:
    """No writes during the sweep (a fresh start leaves the tombstone sink's old keys behind:
    their generation excludes them)."""
    world = World(purge)
    for op in before:
        world.step(op)
    swept = sweep(world, [], [])
    if swept is None:
        return
    head, docs = swept
    state = StreamState(head, docs)
    for message in world.sink.log[head["next"] :]:
        state.apply(message)
    check(state, world)


def test_position_orders_the_messages_of_a_stream() -> None:
    reset = {"type": "SourceReset", "epoch": 2, "seq": 0}
    batch = {"epoch": 2, "seq": 0, "events": []}
    first, second = ({"epoch": 2, "seq": 0, "index": i, "type": "BlockStored"} for i in (0, 1))
    lost = {"type": "EventsLost", "epoch": 2, "seq": 0, "from_seq": 0, "to_seq": 0}
    assert position(reset) < position(batch) < position(first) < position(second) < position(lost)


def test_block_ids_of_every_hash_form() -> None:
    assert block_id(5) == 5 and block_id(-1) == 2**64 - 1 and block_id("ffffffffffffffff") == 2**64 - 1
    assert block_id(bytes(24) + (7).to_bytes(8, "big")) == 7 and block_id((bytes(24) + b"\0" * 7 + b"\x07").hex()) == 7
    assert block_id(True) is None or block_id(True) == 1  # bools are ints in Python; never sent as hashes
    assert block_id("") is None and block_id(None) is None and block_id(2**64) is None


def test_block_ids_at_the_edges_of_each_form() -> None:
    assert block_id(-(2**63)) == 2**63 and block_id(-(2**63) - 1) is None  # a signed 64-bit int, and below it
    assert block_id(2**64 - 1) == 2**64 - 1
    assert block_id(b"\xff" * 24 + (2**56 + 7).to_bytes(8, "big")) == 2**56 + 7  # a digest's low 64 bits
    assert block_id(b"") is None and block_id("not hex") is None


def test_the_positions_of_each_message_form() -> None:
    assert position({"type": "SourceReset", "epoch": 2, "seq": 0}) == (2, 0, 0)
    assert position({"epoch": 2, "seq": 4, "events": []}) == (2, 5, 0)
    assert position({"epoch": 2, "seq": 4, "index": 0, "type": "BlockStored", "events": 1}) == (2, 5, 1)
    assert position({"type": "EventsLost", "epoch": 2, "seq": 4}) == (2, 5, 2**64)


def stored(*hashes: int, parent: int | None = None, medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, "medium": medium}


def removed(*hashes: int, medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def batch_msg(epoch: int, seq: int, *events: dict[str, Any]) -> dict[str, Any]:
    return {"epoch": epoch, "seq": seq, "events": list(events)}


def entry(block: int, *, seq: int, count: int = 1, epoch: int = 3, gen: int = 0) -> dict[str, Any]:
    return {
        "medium": "GPU",
        "group_idx": None,
        "block": format(block, "016x"),
        "epoch": epoch,
        "gen": gen,
        "seq": seq,
        "count": count,
    }


HEAD = {"epoch": 3, "gen": 0, "seq": 5, "live": 2, "complete": True}


def test_a_stream_followed_from_its_first_message_has_no_state_until_its_reset() -> None:
    s = StreamState()
    assert (s.complete, s.why, s.seq, s.blocks(), s.ready) == (False, "no state", -1, {}, True)
    assert s.apply({"type": "SourceReset", "epoch": 0, "seq": 0})
    assert (s.complete, s.why, s.seq) == (True, "", -1)
    assert s.apply(batch_msg(0, 0, stored(1, 2)))
    assert s.blocks() == {("GPU", None, 1): 1, ("GPU", None, 2): 1} and s.seq == 0
    assert not s.apply(batch_msg(0, 0, stored(1, 2)))  # a copy
    assert s.blocks() == {("GPU", None, 1): 1, ("GPU", None, 2): 1}


def test_a_state_from_its_head_keeps_the_newest_entry_of_each_key_of_the_head_s_generation() -> None:
    entries = [
        entry(1, seq=4),
        entry(1, seq=2, count=3),  # an older version of the same key, read later: left out
        entry(2, seq=1, count=2),
        entry(2, seq=6, count=0),  # the newest version of 2 says it is gone
        entry(3, seq=7, gen=1),  # another generation
        entry(4, seq=1, epoch=2),  # another epoch
        {"medium": "GPU", "block": "zz", "epoch": 3, "gen": 0, "seq": 9, "count": 0},  # unreadable
        {"medium": "GPU", "epoch": 3, "gen": 0, "seq": 9, "count": 0},  # no block
        {k: v for k, v in entry(6, seq=2).items() if k != "count"},  # no count: not live
    ]
    s = StreamState(HEAD, entries)
    assert s.blocks() == {("GPU", None, 1): 1}
    assert (s.complete, s.why, s.seq) == (True, "", 5)
    assert s.ready_at == (3, 6) and not s.ready  # entry 2 was read at seq 6, after the head
    assert not s.apply(batch_msg(3, 5, stored(9)))  # at the head: in the state already
    assert s.apply(batch_msg(3, 6, removed(2), stored(5)))
    assert s.ready
    assert s.blocks() == {("GPU", None, 1): 1, ("GPU", None, 5): 1}  # 2 was read at seq 6: not removed again


def test_an_incomplete_head_says_so_until_the_engine_clears() -> None:
    s = StreamState({**HEAD, "complete": False}, [entry(1, seq=4)])
    assert (s.complete, s.why) == (False, "incomplete state")
    assert s.apply(batch_msg(3, 6, {"type": "AllBlocksCleared"}, stored(8)))
    assert (s.complete, s.why, s.blocks()) == (True, "", {("GPU", None, 8): 1})


@pytest.mark.parametrize(
    "event",
    [{"type": "SomethingNew", "block_hashes": [1]}, {"type": "AllBlocksCleared", "medium": "CPU"}],
    ids=["new type", "one medium"],
)
def test_an_event_the_consumer_cannot_apply_leaves_the_state_incomplete(event: dict[str, Any]) -> None:
    """As the bridge's own state: a newer engine's event type, or a clear of one medium, may have
    changed the cache in a way that cannot be applied exactly. The state is unknown until the
    engine's next full clear or restart, and says so."""
    s = StreamState(HEAD, [entry(1, seq=4)])
    assert s.apply(batch_msg(3, 6, event, stored(8)))
    assert not s.complete and "cannot be applied" in s.why and s.blocks() == {("GPU", None, 8): 1}
    assert s.apply(batch_msg(3, 7, {"type": "AllBlocksCleared"}, stored(9)))
    assert (s.complete, s.blocks()) == (True, {("GPU", None, 9): 1})


def test_events_change_only_keys_the_sweep_read_before_them_and_counts_never_go_below_zero() -> None:
    s = StreamState(HEAD, [entry(1, seq=4), entry(2, seq=7)])
    changes: list[tuple[Any, bool]] = []
    s.watch = lambda key, held: changes.append((key[2], held))
    assert s.apply(batch_msg(3, 6, stored(1), removed(2), stored(10, 11, parent=9), removed(12), {"type": "BlockInactive"}))
    assert s.blocks() == {("GPU", None, 1): 2, ("GPU", None, 2): 1, ("GPU", None, 10): 1, ("GPU", None, 11): 1}
    assert s.entries[("GPU", None, 10)]["parent"] == 9 and s.entries[("GPU", None, 11)]["parent"] == 10
    assert (s.entries[("GPU", None, 1)]["epoch"], s.entries[("GPU", None, 1)]["seq"]) == (3, 6)
    assert changes == [(10, True), (11, True)]
    assert s.apply(batch_msg(3, 7))
    assert s.apply(batch_msg(3, 8, removed(1), removed(1), removed(1), removed(2), {"type": "BlockStored", "block_hashes": 5}))
    assert s.blocks() == {("GPU", None, 10): 1, ("GPU", None, 11): 1}
    assert changes[2:] == [(1, False), (2, False)]
    assert s.apply(batch_msg(3, 9, stored(None, 20)))  # type: ignore[arg-type]  # an unreadable hash is skipped
    assert ("GPU", None, 20) in s.blocks() and len(s.blocks()) == 3
    assert s.apply({"type": "EventsLost", "epoch": 3, "seq": 9, "from_seq": 9, "to_seq": 9, "reason": "replay_unavailable"})
    assert s.blocks() == {} and not s.complete and s.why == "seqs 9-9 of epoch 3 lost (replay_unavailable)"
    assert changes[4] == (20, True) and sorted(changes[5:]) == [(10, False), (11, False), (20, False)]


def test_a_newer_epoch_without_its_reset_is_complete_only_from_its_first_batch_s_first_event() -> None:
    s = StreamState(HEAD, [entry(1, seq=4)])
    assert not s.apply(batch_msg(2, 9, stored(7)))  # an older epoch: stale
    assert s.apply({"epoch": 4, "seq": 0, "index": 0, **stored(7)})
    assert (s.complete, s.blocks()) == (True, {("GPU", None, 7): 1})
    s = StreamState(HEAD, [entry(1, seq=4)])
    assert s.apply({"epoch": 4, "seq": 0, "index": 1, **stored(7)})  # its second event: the first was missed
    assert (s.complete, s.why) == (False, "joined mid-stream")
    s = StreamState(HEAD, [entry(1, seq=4)])
    assert s.apply(batch_msg(4, 2, stored(7)))
    assert (s.complete, s.why, s.epoch) == (False, "joined mid-stream", 4)


def test_a_seq_missing_between_two_batch_records_makes_the_state_incomplete() -> None:
    """At batch granularity every seq has a record, or an EventsLost covering it: one missing is a
    record the sink lost before it was read (retention, maxlen, a purge), so the state is no longer
    the engine's cache. An event record's seq may be missing legitimately (a batch whose events were
    all filtered out), so event granularity is not checked."""
    s = StreamState(HEAD, [entry(1, seq=4)])
    assert s.apply(batch_msg(3, 6, stored(2)))
    assert s.complete
    assert s.apply(batch_msg(3, 9, stored(3)))
    assert (s.complete, s.why) == (False, "seqs 7-8 of epoch 3 missing from what the sink holds")
    assert s.blocks() == {("GPU", None, 3): 1}  # what it held is dropped, as for an EventsLost
    assert s.apply(batch_msg(3, 10, {"type": "AllBlocksCleared"}, stored(4)))
    assert (s.complete, s.blocks()) == (True, {("GPU", None, 4): 1})
    e = StreamState(HEAD, [])
    assert e.apply({"epoch": 3, "seq": 6, "index": 0, **stored(7)})
    assert e.apply({"epoch": 3, "seq": 9, "index": 0, **stored(8)})
    assert e.complete


def test_a_record_of_another_stream_is_not_applied_to_a_state_whose_head_names_its_stream() -> None:
    """Two sources whose names give one subject (``llama.a``, ``llama_a``) interleave their records
    there until the bridge notices: a follower of one applies only its own stream's."""
    s = StreamState({**HEAD, "source": "llama.a", "dp_rank": 0}, [])
    mine = {"source": "llama.a", "dp_rank": 0}
    assert not s.apply({**batch_msg(3, 6, stored(1)), "source": "llama_a", "dp_rank": 0})
    assert not s.apply({**batch_msg(3, 6, stored(1)), "source": "llama.a", "dp_rank": 1})
    assert s.apply({**batch_msg(3, 6, stored(2)), **mine})
    assert s.apply({**batch_msg(3, 7, stored(3)), **mine})
    assert (s.complete, s.blocks()) == (True, {("GPU", None, 2): 1, ("GPU", None, 3): 1})


def test_an_event_record_is_told_by_its_index_even_with_a_field_named_events() -> None:
    s = StreamState(HEAD, [])
    assert s.apply({"epoch": 3, "seq": 6, "index": 0, **stored(7), "events": [stored(8)]})
    assert s.blocks() == {("GPU", None, 7): 1}


def test_an_incomplete_head_of_epoch_0_is_an_incomplete_state_not_none() -> None:
    assert StreamState({**HEAD, "epoch": 0, "complete": False}).why == "incomplete state"


def test_a_head_is_told_from_an_entry_and_from_garbage() -> None:
    assert is_head(HEAD)
    assert not is_head(entry(1, seq=4)) and not is_head({**HEAD, "seq": "x"}) and not is_head({**HEAD, "live": None})


def test_a_head_that_does_not_say_complete_is_not() -> None:
    head = {k: v for k, v in HEAD.items() if k != "complete"}
    assert StreamState(head).complete is False


def test_after_a_clear_the_sweep_s_versions_no_longer_hold_events_back() -> None:
    """The sweep read block 2 at seq 9; a loss at seq 6 clears the state (the sink's too): from
    there the stream's own messages rebuild it, block 2's store at seq 7 included."""
    s = StreamState(HEAD, [entry(2, seq=9)])
    assert s.apply({"type": "EventsLost", "epoch": 3, "seq": 6, "from_seq": 6, "to_seq": 6, "reason": "x"})
    assert s.apply(batch_msg(3, 7, stored(2)))
    assert s.blocks() == {("GPU", None, 2): 1}


def test_a_newer_epoch_read_from_its_first_batch_is_complete() -> None:
    s = StreamState(HEAD, [entry(1, seq=4)])
    assert s.apply(batch_msg(4, 0, stored(7)))
    assert (s.complete, s.why, s.blocks()) == (True, "", {("GPU", None, 7): 1})


def test_a_block_stored_twice_and_removed_once_stays_with_the_removal_s_version() -> None:
    s = StreamState(HEAD, [])
    assert s.apply(batch_msg(3, 6, stored(1), stored(1)))
    assert s.apply(batch_msg(3, 7, removed(1)))
    assert s.blocks() == {("GPU", None, 1): 1}
    assert (s.entries[("GPU", None, 1)]["epoch"], s.entries[("GPU", None, 1)]["seq"]) == (3, 7)


HEAD_AT_19 = {"source": "a", "dp_rank": 0, "epoch": 7, "gen": 1, "seq": 19, "live": 3, "complete": True, "next": 80}


def _headers(source: str = "a", rank: str = "0", epoch: str = "7", seq: str = "19", kind: str = "EventBatch") -> dict[str, str]:
    return {"source": source, "dp_rank": rank, "epoch": epoch, "seq": seq, "type": kind}


@pytest.mark.parametrize(
    ("headers", "follows"),
    [
        (_headers(), True),
        (_headers(seq="12"), True),  # a batch with no event at event granularity leaves no message
        (_headers(kind="EventsLost"), True),
        ({**_headers(), "index": "3"}, True),
        (_headers(seq="20"), False),  # a later one of its own: written since, in a stream created again
        (_headers(source="b"), False),
        (_headers(rank="1"), False),
        (_headers(epoch="6"), False),
        ({}, False),
    ],
)
def test_a_heads_next_is_followed_only_after_a_message_it_can_have_been_written_after(
    headers: dict[str, str], follows: bool
) -> None:
    """breaker88 B1, B2: a consumer followed the head's ``next`` into an events stream or topic
    lost and created again (the old offsets hold other messages, or none) and ended complete but
    wrong. The message right before ``next`` must be one of the head's stream and epoch, at or
    below it (the Go library's FollowsHead: same cases)."""
    assert follows_head(HEAD_AT_19, headers) is follows
    reset = {**HEAD_AT_19, "epoch": 8, "seq": -1, "live": 0}
    assert follows_head(reset, _headers(epoch="8", seq="0", kind="SourceReset"))
