"""The state tracker by example: duplicates, tiers, losses, parents, hash forms, the cap, the table."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.records import Record, Stream, events_lost, source_reset
from bridge.state import BlockTable, Head, StateDelta, StateTracker, block_id
from tests.support.strategies import examples

A = Stream("llama-a", 0)
B = Stream("llama-b", 0)


def stored(hashes: list[Any], parent: Any = None, medium: str | None = "GPU", group: int | None = None) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(2 * len(hashes))),
        "block_size": 2,
        "medium": medium,
    }
    if group is not None:
        ev["group_idx"] = group
    return ev


def removed(hashes: list[Any], medium: str | None = "GPU", group: int | None = None) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    if group is not None:
        ev["group_idx"] = group
    return ev


CLEARED = {"type": "AllBlocksCleared"}


class Feed:
    """One stream's records, numbered like the sequencer does."""

    def __init__(self, tracker: StateTracker, stream: Stream = A, epoch: int = 1) -> None:
        self.tracker, self.stream, self.epoch, self.seq = tracker, stream, epoch, 0

    def batch(self, *events: dict[str, Any]) -> StateDelta:
        rec = Record(stream=self.stream, epoch=self.epoch, seq=self.seq, events=list(events))
        self.seq += 1
        return self.tracker.apply(rec)

    def reset(self) -> StateDelta:
        self.epoch += 1
        self.seq = 0
        return self.tracker.apply(source_reset(self.stream, self.epoch, "publisher_restart", 0.0))

    def lost(self, n: int) -> StateDelta:
        rec = events_lost(self.stream, self.epoch, self.seq, self.seq + n - 1, "unrecoverable", 0.0)
        self.seq += n
        return self.tracker.apply(rec)


def cleared_keys(d: StateDelta) -> set[tuple[str | None, int | None, int]]:
    return {(c.medium, c.group_idx, k) for c in d.cleared for k in c.blocks}


# -- sketch item 3: duplicates ----------------------------------------------------------------------


def test_two_stores_and_one_remove_leave_count_one() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([7]))
    d = f.batch(stored([7]))
    assert [(c.block, c.count) for c in d.changes] == [(7, 2)]
    assert t.count(A, "GPU", None, 7) == 2
    d = f.batch(removed([7]))
    assert t.count(A, "GPU", None, 7) == 1
    # the remaining copy is still described in full (a compacted topic rewrites the whole value)
    assert [(c.block, c.count) for c in d.changes] == [(7, 1)]
    assert d.changes[0].fact is not None and d.changes[0].fact.hash == 7
    assert t.version(A, "GPU", None, 7) == (1, 2)
    d = f.batch(removed([7]))
    assert [(c.block, c.count, c.fact) for c in d.changes] == [(7, 0, None)]
    assert t.count(A, "GPU", None, 7) == 0 and t.version(A, "GPU", None, 7) is None
    d = f.batch(removed([7]))  # a remove of an absent block: a counted no-op, never below 0
    assert d.changes == [] and d.absent_removals == 1 and t.stats.absent_removals == 1
    assert t.count(A, "GPU", None, 7) == 0
    assert t.head(A) == t.head(A) and t.head(A).live == 0  # type: ignore[union-attr]


def test_changes_are_net_per_record() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([1]))
    d = f.batch(stored([2]), removed([2]), removed([1]), stored([1]), stored([1]))
    # 2 came and went within the record: no sink ever had it; 1 ended with two copies
    assert [(c.block, c.count) for c in d.changes] == [(1, 2)]
    assert t.version(A, "GPU", None, 1) == (1, 1)


# -- sketch item 4: tiers and groups ----------------------------------------------------------------


def test_a_remove_on_one_tier_leaves_the_other_tiers() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([5], medium="GPU"), stored([5], medium="CPU"), stored([5], medium="GPU", group=1))
    d = f.batch(removed([5], medium="CPU"))
    assert [(c.medium, c.group_idx, c.block, c.count) for c in d.changes] == [("CPU", None, 5, 0)]
    assert t.count(A, "GPU", None, 5) == 1 and t.count(A, "CPU", None, 5) == 0 and t.count(A, "GPU", 1, 5) == 1
    f.batch(removed([5], medium="GPU", group=1))
    assert sorted((m or "", g or 0, k, c) for m, g, k, c, _v in t.entries(A)) == [("GPU", 0, 5, 1)]
    d = f.batch(CLEARED)  # no medium: every tier
    assert d.clear and cleared_keys(d) == {("GPU", None, 5)} and t.head(A).live == 0  # type: ignore[union-attr]


def test_every_hash_form_names_one_block() -> None:
    digest = bytes(range(24)) + (2**64 - 3).to_bytes(8, "big")
    assert block_id(2**64 - 3) == block_id(-3) == block_id(digest) == 2**64 - 3
    assert block_id(True) is None and block_id("ab") is None and block_id(2**64) is None and block_id(b"") is None
    # a 64-bit hash, signed or unsigned: from -2**63 (its two's complement) up to 2**64 - 1
    assert block_id(-(2**63)) == 2**63 and block_id(2**64 - 1) == 2**64 - 1 and block_id(-(2**63) - 1) is None
    t = StateTracker()
    f = Feed(t)
    d = f.batch(stored([digest]), stored([-3]))
    assert t.count(A, "GPU", None, 2**64 - 3) == 2
    assert d.changes[0].fact is not None and d.changes[0].fact.hash == -3  # the latest store, as sent
    f.batch(removed([2**64 - 3]), removed([digest]))
    assert t.count(A, "GPU", None, -3) == 0


# -- sketch item 6: EventsLost ----------------------------------------------------------------------


def test_events_lost_clears_and_complete_returns_at_the_next_clear() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([1, 2, 3]))
    assert t.head(A).complete  # type: ignore[union-attr]
    d = f.lost(3)
    assert d.clear and cleared_keys(d) == {("GPU", None, k) for k in (1, 2, 3)}
    assert not d.head.complete and d.head.live == 0 and d.head.seq == 3
    # what follows is tracked (a subset of the truth), still incomplete: never a false positive
    d = f.batch(stored([4]), removed([1]))
    assert not d.head.complete and d.absent_removals == 1 and t.count(A, "GPU", None, 1) == 0
    d = f.batch(CLEARED)
    assert d.head.complete and cleared_keys(d) == {("GPU", None, 4)}
    f.lost(1)
    d = f.reset()
    assert d.head.complete and d.head.epoch == 2 and d.head.seq == -1 and d.clear


def test_a_stream_joined_late_is_incomplete_until_a_clear() -> None:
    t = StateTracker()
    t.apply(Record(stream=A, epoch=4, seq=17, events=[stored([1])]))
    assert not t.head(A).complete  # type: ignore[union-attr]
    t.apply(Record(stream=B, epoch=4, seq=0, events=[stored([1])]))  # seq 0 follows an empty cache
    assert t.head(B).complete  # type: ignore[union-attr]
    # a new epoch without its SourceReset (not expected from the sequencer): a clear
    d = t.apply(Record(stream=B, epoch=5, seq=2, events=[]))
    assert d.clear and not d.head.complete and cleared_keys(d) == {("GPU", None, 1)}


def test_undecoded_batches_make_the_stream_unknown() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([1]))
    d = t.apply(Record(stream=A, epoch=1, seq=1, payload=b"x", event_count=3))
    assert d.clear and not d.head.complete and t.stats.undecoded_batches == 1
    # one bad event among good ones (it may have been a removal): unknown too, the rest kept out
    f.seq = 2
    t.apply(Record(stream=A, epoch=1, seq=2, events=[CLEARED]))
    d = t.apply(Record(stream=A, epoch=1, seq=3, events=[stored([2])], bad_events=1))
    assert d.clear and not d.head.complete and t.count(A, "GPU", None, 2) == 0 and t.stats.undecoded_batches == 2


def test_rocm_atom_moves_and_medium_clears_make_the_stream_unknown_until_a_full_clear() -> None:
    """ROCm ATOM (#1316): a BlockTransferred moves blocks between media, an AllBlocksCleared with a
    medium clears only that one; the tracker cannot apply either exactly, so the state is cleared
    and incomplete (never a complete state that differs from the engine's cache, I6) until a full
    clear. vLLM #50732's BlockInactive (a block still cached) changes nothing."""
    t = StateTracker()
    f = Feed(t)
    f.batch(CLEARED, stored([1, 2]))
    d = f.batch({"type": "BlockInactive", "block_hashes": [1], "medium": "GPU"})
    assert not d.clear and d.head.complete and t.count(A, "GPU", None, 1) == 1
    d = f.batch({"type": "BlockTransferred", "block_hashes": [1], "from_medium": "GPU", "to_medium": "CPU"})
    assert d.clear and not d.head.complete
    f.batch(CLEARED, stored([3]))
    d = f.batch({"type": "AllBlocksCleared", "medium": "CPU"}, stored([4]))
    assert d.clear and not d.head.complete and t.count(A, "GPU", None, 4) == 1
    d = f.batch({"type": "AllBlocksCleared", "medium": None})
    assert d.head.complete


def test_a_redelivered_record_changes_nothing() -> None:
    t = StateTracker()
    rec = Record(stream=A, epoch=1, seq=0, events=[stored([1])])
    t.apply(rec)
    d = t.apply(rec)
    assert d.stale and not d.changes and t.count(A, "GPU", None, 1) == 1 and t.stats.stale_records == 1


def test_a_reset_of_many_blocks_enumerates_every_key_without_copying() -> None:
    t = StateTracker()
    f = Feed(t)
    n = 20_000
    f.batch(stored(list(range(n))), stored(list(range(n // 2)), medium="CPU"))
    d = f.reset()
    assert sum(len(c.blocks) for c in d.cleared) == n + n // 2
    assert cleared_keys(d) == {("GPU", None, k) for k in range(n)} | {("CPU", None, k) for k in range(n // 2)}
    assert any(isinstance(c.blocks, BlockTable) for c in d.cleared)
    assert t.total == 0 and d.head.generation == 2 and list(t.entries(A)) == []  # the fresh start, then the reset


def test_a_clear_enumerates_blocks_removed_earlier_in_its_record() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([1, 2]))
    d = f.batch(removed([1]), stored([3]), CLEARED, stored([4]), CLEARED, stored([5]))
    assert cleared_keys(d) == {("GPU", None, 1), ("GPU", None, 2), ("GPU", None, 3)}
    assert [(c.block, c.count) for c in d.changes] == [(5, 1)]
    assert d.head.generation == 3  # the fresh start, then two clears


# -- sketch item 11: parents first ------------------------------------------------------------------


def test_changes_come_parents_first() -> None:
    t = StateTracker()
    f = Feed(t)
    # the child is touched first (stored, with its parent named), then the chain above it
    d = f.batch(stored([30], parent=20), stored([10, 20], parent=None), stored([40], parent=30))
    order = [c.block for c in d.changes]
    assert order == [10, 20, 30, 40]
    facts = {c.block: c.fact for c in d.changes}
    assert facts[20] is not None and facts[20].parent == 10 and facts[20].token_ids == [2, 3]
    assert facts[10] is not None and facts[10].parent is None and facts[10].token_ids == [0, 1]
    # a parent in another tier is another block: no reordering across tiers; a cycle terminates
    d = f.batch(stored([50], parent=60, medium="CPU"), stored([60], parent=50, medium="CPU"))
    assert sorted(c.block for c in d.changes) == [50, 60]


@given(st.permutations(list(range(8))))
def test_any_touch_order_comes_out_parents_first(order: list[int]) -> None:
    t = StateTracker()
    f = Feed(t)
    chain = [100 + i for i in range(8)]
    d = f.batch(*(stored([chain[i]], parent=chain[i - 1] if i else None) for i in order))
    pos = {c.block: n for n, c in enumerate(d.changes)}
    assert all(pos[chain[i - 1]] < pos[chain[i]] for i in range(1, 8))


# -- the cap ----------------------------------------------------------------------------------------


def test_the_cap_switches_the_stream_that_exceeds_it_off_and_back_on() -> None:
    t = StateTracker(max_entries=5)
    fa, fb = Feed(t, A), Feed(t, B)
    fa.batch(stored([1, 2, 3]))
    fb.batch(stored([1, 2]))
    assert t.total == 5
    d = fb.batch(stored([3]), stored([4]))  # b would hold the sixth entry
    assert d.switched_off and d.clear and cleared_keys(d) >= {("GPU", None, 1), ("GPU", None, 2)}
    assert d.changes == []
    assert d.head == t.head(B) and not d.head.complete and not d.head.tracking and d.head.live == 0
    assert t.total == 3 and t.count(A, "GPU", None, 3) == 1 and t.stats.switched_off == 1
    # b's records keep flowing: its head advances, nothing is tracked
    d = fb.batch(stored([9]))
    assert not d.head.tracking and d.head.seq == 2 and d.changes == [] and t.total == 3
    # its next clear switches it back on (there is room), complete again
    d = fb.batch(CLEARED, stored([7]))
    assert d.switched_on and d.head.tracking and d.head.complete and t.count(B, "GPU", None, 7) == 1
    # no room at b's reset: it stays off
    fa.batch(stored([4]))
    assert t.total == 5
    d = fb.batch(stored([8]))
    assert d.switched_off and cleared_keys(d) >= {("GPU", None, 7)} and t.total == 4
    fa.batch(stored([5]))
    assert t.total == 5
    d = fb.reset()
    assert not d.switched_on and not d.head.tracking and not d.head.complete
    # a stream first seen while the tracker is full starts off
    d = t.apply(Record(stream=Stream("c", 0), epoch=1, seq=0, events=[stored([1])]))
    assert d.switched_off and not d.head.tracking and t.total == 5


# -- the table ----------------------------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 300) | st.sampled_from([0, 2**64 - 1, 2**63])), max_size=2000))
def test_the_table_is_a_multiset(ops: list[tuple[bool, int]]) -> None:
    table, ref, vers = BlockTable(), dict[int, int](), dict[int, int]()
    for seq, (add, k) in enumerate(ops):
        if add:
            assert table.add(k, seq + 1) == ref.get(k, 0) + 1
            ref[k] = ref.get(k, 0) + 1
            vers[k] = seq + 1
        else:
            c, _fact = table.remove(k, seq + 1)
            assert c == (ref[k] - 1 if k in ref else -1)
            if k in ref:
                ref[k] -= 1
                vers[k] = seq + 1
                if not ref[k]:
                    del ref[k]
        assert len(table) == len(ref)
    assert {k: c for k, c, _v in table.items()} == ref  # each live block once, old arrays or new
    assert {k: table.version(k) for k in ref} == {k: vers[k] for k in ref}
    assert all(k in table and table.count(k) == c for k, c in ref.items())
    assert len(table) <= table.cap * 0.7 + 1


def test_a_growing_table_moves_a_few_slots_per_change() -> None:
    """No single change copies the whole table: the one past the load limit allocates the larger
    arrays, and each change after it moves MOVE_STEP old slots, until none is left."""
    from bridge.state import MOVE_STEP

    table = BlockTable()
    k = 0
    while table._old is None:
        k += 1
        table.add(k * 7919, 1)
    old_cap = table._old[2]
    assert table._cursor == 0 and len(table) == k and all(table.count(i * 7919) == 1 for i in range(1, k + 1))
    changes = 0
    while table._old is not None:
        before = table._cursor
        table.add(10**9 + changes, 2)
        changes += 1
        assert table._old is None or table._cursor - before == MOVE_STEP
    assert changes == -(-old_cap // MOVE_STEP) and sorted(table) == sorted(
        [i * 7919 for i in range(1, k + 1)] + [10**9 + c for c in range(changes)]
    )


def test_versions_widen_past_32_bits() -> None:
    t = StateTracker()
    t.apply(Record(stream=A, epoch=1, seq=5, events=[stored([1])]))
    big = 2**40
    t.apply(Record(stream=A, epoch=1, seq=big, events=[stored([2])]))
    t.apply(Record(stream=A, epoch=1, seq=2**64 - 2, events=[stored([3])]))
    assert t.version(A, "GPU", None, 1) == (1, 5)
    assert t.version(A, "GPU", None, 2) == (1, big)
    assert t.version(A, "GPU", None, 3) == (1, 2**64 - 2)


def test_malformed_events_are_counted_and_skipped() -> None:
    t = StateTracker()
    f = Feed(t)
    d = f.batch(
        {"type": "BlockStored", "block_hashes": 5},
        {"type": "BlockStored", "block_hashes": [1], "medium": ["GPU"]},
        {"type": "BlockStored", "block_hashes": [1], "group_idx": "0"},
        {"type": "BlockStored", "block_hashes": ["x", 2]},
    )
    assert [c.block for c in d.changes] == [2]
    assert t.stats.bad_events == 3 and t.stats.bad_hashes == 1


def test_an_event_type_the_bridge_does_not_know_leaves_the_state_incomplete() -> None:
    """breaker65: a newer engine's event type left the state complete, although it may change the
    cache (an eviction of a new kind). What it did is unknown: the stream's state is cleared and
    incomplete until its next reset or full clear (I6). BlockInactive (a block still cached) is
    known to change nothing."""
    t = StateTracker()
    f = Feed(t)
    f.batch({"type": "BlockStored", "block_hashes": [1, 2]})
    f.batch({"type": "BlockInactive", "block_hashes": [1], "medium": "GPU"})
    head = t.head(f.stream)
    assert head is not None and head.complete
    d = f.batch({"type": "SomethingNew", "block_hashes": [3]})
    head = t.head(f.stream)
    assert d.clear and head is not None and not head.complete


def test_a_forgotten_stream_gives_its_blocks_and_room_back() -> None:
    t = StateTracker(max_entries=3)
    Feed(t, A).batch(stored([1, 2]))
    Feed(t, B).batch(stored([1]))
    cleared = t.forget(A)
    assert {k for c in cleared for k in c.blocks} == {1, 2} and t.total == 1 and t.head(A) is None
    assert t.forget(A) == []


# -- a restarted bridge: seeded from what a sink holds --------------------------------------------


def test_a_fresh_stream_clears_what_a_sink_may_hold_in_a_new_generation() -> None:
    t = StateTracker(generation_base=5000)
    d = t.apply(Record(stream=A, epoch=3, seq=40, events=[stored([1])]))
    assert d.clear and d.cleared == [] and d.head.generation == 5001 and not d.head.complete


def test_a_tracker_seeded_from_the_documents_goes_on_like_the_original() -> None:
    from bridge.state_docs import StateFormat, head_of, parse, seed_entry

    fmt = StateFormat()
    first = StateTracker()
    f = Feed(first)
    docs: dict[tuple[Any, Any, int], bytes] = {}
    for d in (f.batch(stored([1, 2, 3]), stored([2], medium="CPU")), f.batch(stored([2]), removed([3])), f.batch(stored([2]))):
        for c in d.changes:
            if c.count:
                docs[(c.medium, c.group_idx, c.block)] = fmt.entry(A, d.head, c)
            else:
                docs.pop((c.medium, c.group_idx, c.block), None)
    head = head_of(parse(fmt.head(A, first.head(A), 7)) or {})  # type: ignore[arg-type]
    assert head is not None
    entries = [seed_entry(parse(v) or {}) for v in docs.values()]
    second = StateTracker()
    assert second.seed(A, head, [e for e in entries if e is not None])
    assert sorted(second.entries(A)) == sorted(first.entries(A)) and second.head(A) == first.head(A)
    assert second.count(A, "GPU", None, 2) == 3  # counts above 1 come back with their facts
    # the records up to the head come again (a checkpoint below it): stale
    assert second.apply(Record(stream=A, epoch=1, seq=2, events=[stored([2])])).stale
    # and the next ones change both alike, the facts of counts above 1 included
    nxt = [removed([2]), removed([2]), stored([9])]
    a, b = (t.apply(Record(stream=A, epoch=1, seq=3, events=nxt)) for t in (first, second))
    assert a.changes == b.changes and a.head == b.head and a.changes[0].fact is not None


def test_seeding_past_the_cap_or_a_known_stream_is_refused() -> None:
    t = StateTracker(max_entries=2)
    head = Head(epoch=1, generation=3, seq=5, complete=True, live=3)
    entries = [("GPU", None, k, 1, 5, None) for k in (1, 2, 3)]
    assert not t.seed(A, head, entries) and t.head(A) is None and t.total == 0
    assert t.seed(A, head, entries[:2]) and t.total == 2
    assert not t.seed(A, head, entries[:1])  # already tracked


def test_a_seeded_entry_ahead_of_its_head_is_not_applied_twice() -> None:
    """A sink read back with entries written after its head (a write cut between its entries and
    its head): the records since the head come again, and change only the blocks not that new."""
    head = Head(epoch=1, generation=3, seq=4, complete=True, live=2)
    t = StateTracker()
    # block 1 holds record 5 already (count 2); block 2 is as of the head (seq 3)
    assert t.seed(A, head, [("GPU", None, 1, 2, 5, None), ("GPU", None, 2, 1, 3, None)])
    d = t.apply(Record(stream=A, epoch=1, seq=5, events=[stored([1, 2]), removed([1]), stored([1])]))
    assert t.count(A, "GPU", None, 1) == 2 and t.count(A, "GPU", None, 2) == 2
    assert [(c.block, c.count) for c in d.changes] == [(2, 2)]
    # past the newest seeded entry, every block counts again
    t.apply(Record(stream=A, epoch=1, seq=6, events=[stored([1])]))
    assert t.count(A, "GPU", None, 1) == 3


def test_a_fact_read_back_from_a_token_hashing_sink_keeps_its_token_hashes() -> None:
    from bridge.state_docs import StateFormat, parse, seed_entry

    fmt = StateFormat("hash", b"k" * 16)
    t = StateTracker()
    d = Feed(t).batch(stored([7]), stored([7]))
    doc = parse(fmt.entry(A, d.head, d.changes[0])) or {}
    assert doc["count"] == 2 and len(doc["token_hashes"]) == 1 and "token_ids" not in doc
    entry = seed_entry(doc)
    assert entry is not None and entry[5] is not None
    again = StateTracker()
    assert again.seed(A, d.head, [entry])
    d = again.apply(Record(stream=A, epoch=1, seq=2, events=[removed([7])]))
    assert (parse(fmt.entry(A, d.head, d.changes[0])) or {})["token_hashes"] == doc["token_hashes"]


def test_versions_stay_4_bytes_up_to_2_32_minus_1_and_a_larger_one_widens_them() -> None:
    table = BlockTable()
    table.add(1, 2**32 - 1)
    assert table.vers.typecode == "I" and table.version(1) == 2**32 - 1
    table.add(2, 2**32)
    assert table.vers.itemsize == 8 and table.version(1) == 2**32 - 1 and table.version(2) == 2**32


def test_a_table_says_which_blocks_it_holds_and_the_bytes_of_its_arrays_while_it_grows() -> None:
    table = BlockTable()
    assert table.nbytes() == table.cap * (8 + 4) and 0 not in table and "a" not in table
    k = 0
    while table._old is None:
        k += 1
        table.add(k * 7919, 1)
    old_cap = table._old[2]
    assert table.nbytes() == table.cap * (8 + 4) + old_cap * (8 + 4) + old_cap  # (and a flag per old slot)
    assert all(i * 7919 in table for i in range(1, k + 1))  # (most still in the old arrays)
    assert 7919 * (k + 1) not in table and -7919 not in table and True not in table and "7919" not in table


def test_while_growing_a_block_whose_probe_wraps_past_the_old_arrays_end_is_found_there() -> None:
    """During incremental growth the old arrays are still read: a block stored at old slot 0
    after its probe wrapped from the last slot is found (count, version), and an absent id
    whose probe wraps the same way is absent, not an error."""
    table = BlockTable()
    cap = table.cap
    first, wrapped = cap - 1, 2 * cap - 1  # both at home in the last slot: the second wraps to slot 0
    table.add(first, 1)
    table.add(wrapped, 2)
    k = 1
    while table._old is None:  # fill the middle slots until growth starts (nothing moved yet)
        table.add(k, 3)
        k += 1
    assert table._old[0][0] == wrapped  # still in the old arrays, at slot 0
    assert wrapped in table and table.count(wrapped) == 1 and table.version(wrapped) == 2
    absent = 3 * table._old[2] - 1
    assert absent not in table and table.count(absent) == 0 and table.version(absent) == 0


def test_while_growing_a_block_stored_again_before_it_moved_counts_every_copy() -> None:
    """A block still in the old arrays, stored again while the table grows: one more copy (two, or
    three for one stored twice before), at the new version, and still one entry; when growth ends
    each block is there once, at its count and version."""
    table = BlockTable(1001)
    table.add(600, 1)
    table.add(600, 2)  # twice before growth starts
    k = 0
    while table._old is None:
        k += 1
        if k != 600:
            table.add(k, 1)
    n = len(table)
    assert table._old[2] == 1001 and not any(table._moved)  # ids at their home slots, none moved yet
    assert table.add(500, 7) == 2 and table.add(600, 8) == 3 and len(table) == n
    assert (table.count(500), table.version(500), table.count(600), table.version(600)) == (2, 7, 3, 8)
    new = 10**6
    while table._old is not None:
        new += 1
        table.add(new, 9)
    held = {k: (c, v) for k, c, v in table.items()}
    assert len(held) == len(table) == n + new - 10**6 and len(list(table)) == len(held)  # each block once
    assert held[500] == (2, 7) and held[600] == (3, 8) and held[1] == (1, 1)
    assert table.remove(600, 10) == (2, None) and table.remove(500, 11)[0] == 1 and table.count(500) == 1


def test_a_block_s_own_tokens_are_its_share_of_its_event_s_tokens() -> None:
    """One block stored alone owns all of its event's tokens (no block_size needed); several own a
    block_size slice each (a size of 1 too); without a usable block_size, none can be told apart."""
    t = StateTracker()
    d = Feed(t).batch(
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [5, 6, 7]},
        {"type": "BlockStored", "block_hashes": [2, 3], "token_ids": [8, 9], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [4, 5], "token_ids": [1, 2, 3, 4]},
        {"type": "BlockStored", "block_hashes": [6, 7], "token_ids": [1, 2, 3, 4], "block_size": "2"},
        {"type": "BlockStored", "block_hashes": [8, 9], "token_ids": [1, 2, 3, 4], "block_size": 0},
    )
    own = {c.block: c.fact.token_ids for c in d.changes if c.fact is not None}
    assert own == {1: [5, 6, 7], 2: [8], 3: [9], 4: [], 5: [], 6: [], 7: [], 8: [], 9: []}


def test_a_block_stored_again_after_its_probe_wrapped_to_slot_0_is_one_block_with_two_copies() -> None:
    table = BlockTable()
    last = table.cap - 1
    table.add(last, 1)
    table.add(last + table.cap, 2)  # at home in the last slot too: wraps to slot 0
    assert table.add(last + table.cap, 3) == 2 and len(table) == 2 and table.count(last + table.cap) == 2
    assert sorted(table) == [last, last + table.cap]


def test_a_table_grows_when_a_block_would_take_it_past_load_0_7() -> None:
    """The memory promise (module docstring): at most 70% of a table's slots are used; the block
    past that starts its growth (larger arrays), not the one after it."""
    table = BlockTable(1001)
    for k in range(700):
        table.add(k, 1)
    assert table.nbytes() == 1001 * (8 + 4) and table._old is None
    table.add(700, 1)
    assert table._old is not None and table.nbytes() > 1001 * (8 + 4 + 8 + 4)


def test_a_block_s_fact_keeps_what_its_event_said_of_it_and_drops_what_is_malformed() -> None:
    t = StateTracker()
    d = Feed(t).batch(
        {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            "token_ids": [1, 2, 3, 4],
            "block_size": 2,
            "lora_id": 3,
            "lora_name": "adapter",
            "extra_keys": [["a"], ["b"]],
        },
        {
            "type": "BlockStored",
            "block_hashes": [3, 4],
            "token_ids": [1, 2, 3, 4],
            "block_size": 2.0,
            "lora_id": "3",
            "lora_name": 3,
            "extra_keys": [["a"]],  # not one per block: whose is it?
        },
    )
    facts = {c.block: c.fact for c in d.changes if c.fact is not None}
    said = [(f.block_size, f.lora_id, f.lora_name, f.extra_keys) for f in (facts[1], facts[2])]
    assert said == [(2, 3, "adapter", ["a"]), (2, 3, "adapter", ["b"])]
    dropped = [(f.block_size, f.lora_id, f.lora_name, f.extra_keys) for f in (facts[3], facts[4])]
    assert dropped == [(None, None, None, None)] * 2


def test_queries_of_an_unknown_stream_tier_or_hash_find_nothing() -> None:
    t = StateTracker()
    Feed(t).batch(stored([1]))
    for stream, medium, h in ((B, "GPU", 1), (A, "CPU", 1), (A, "GPU", "not a hash"), (A, "GPU", 2)):
        assert t.version(stream, medium, None, h) is None and t.count(stream, medium, None, h) == 0
    assert t.version(A, "GPU", None, 1) == (1, 0) and t.count(A, "GPU", None, 1) == 1


def test_while_growing_removals_move_slots_too_and_find_blocks_not_moved_yet() -> None:
    """Every change moves MOVE_STEP old slots, a removal as much as a store: growth ends after as
    many removals as it would after stores. A block still in the old arrays is removed from there
    (gone, or one copy fewer)."""
    from bridge.state import MOVE_STEP

    table = BlockTable(1001)
    table.add(999, 1)
    table.add(999, 2)  # two copies, at home in old slot 999: moved last
    k = 0
    while table._old is None:
        k += 1
        table.add(k, 1)
    n, old_cap = len(table), table._old[2]
    assert table.remove(600, 5) == (0, None) and 600 not in table and len(table) == n - 1
    assert table.remove(999, 6) == (1, None) and table.count(999) == 1 and table.version(999) == 6
    removals = 2
    while table._old is not None:
        removals += 1
        assert table.remove(removals, 7) == (0, None)
    assert removals == -(-old_cap // MOVE_STEP) and table.nbytes() == table.cap * (8 + 4)
    assert len(table) == n - removals + 1 and table.count(999) == 1 and sorted(table) == sorted(set(table))


def test_a_block_at_slot_0_is_removed() -> None:
    table = BlockTable()
    table.add(0, 1)
    table.add(table.cap, 2)  # at home in slot 0 too: probes on to slot 1
    assert table.remove(0, 3) == (0, None) and table.remove(table.cap, 4) == (0, None) and len(table) == 0


def test_a_removal_keeps_versions_4_bytes_up_to_2_32_minus_1_and_widens_them_past_it() -> None:
    """Versions widen at the first change past 2**32 - 1, a removal (of one copy of two) too; while
    the table grows, of a block still in its old arrays."""
    table = BlockTable()
    table.add(1, 1)
    table.add(1, 2)
    assert table.remove(1, 2**32 - 1) == (1, None) and table.vers.typecode == "I" and table.version(1) == 2**32 - 1
    table = BlockTable(1001)
    table.add(999, 1)
    table.add(999, 2)
    k = 0
    while table._old is None:
        k += 1
        table.add(k, 1)
    n = len(table)
    assert table._old[1][999] and not table._moved[999]  # still in the old arrays
    assert table.remove(999, 2**32) == (1, None) and table.vers.itemsize == 8
    assert table.count(999) == 1 and table.version(999) == 2**32 and len(table) == n
    assert table._old is None and sorted(table) == sorted(set(table)) and len(list(table)) == n


def test_removing_the_block_in_the_last_slot_keeps_the_one_that_wrapped_past_it_reachable() -> None:
    table = BlockTable()
    last = table.cap - 1
    table.add(last, 1)
    table.add(last + table.cap, 2)  # at home in the last slot too: wrapped to slot 0
    assert table.remove(last, 3) == (0, None)
    assert last + table.cap in table and table.count(last + table.cap) == 1 and table.version(last + table.cap) == 2
    assert table.remove(last + table.cap, 4) == (0, None) and len(table) == 0


def test_a_stream_first_seen_while_the_tracker_is_full_is_off_from_its_first_record_counted_once() -> None:
    t = StateTracker(max_entries=1)
    Feed(t, A).batch(stored([1]))
    d = Feed(t, B).batch()  # no store: off all the same
    assert d.switched_off and not d.head.tracking and not d.head.complete and t.stats.switched_off == 1
    d = Feed(t, Stream("c", 0)).batch(stored([2]))
    assert d.switched_off and not d.head.tracking and d.changes == [] and t.stats.switched_off == 2 and t.total == 1


def test_a_batch_carrying_an_engine_snapshot_restarts_its_stream_from_it() -> None:
    """The seed (the engine's cache at the snapshot's cut and the batches since) replaces what
    the stream held, the batch's own events follow, and the stream is complete from there, even
    after a sink lost its state; the next record goes on from it."""
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([1, 2]), stored([9], medium="CPU"))
    f.lost(2)  # incomplete
    f.batch(stored([3]))
    t.invalidate(A)
    seed = Record(A, 1, 4, "StateSeeded", events=[stored([2]), stored([5])])
    d = t.apply(Record(A, 1, 4, events=[stored([2]), removed([5])], seed=seed))
    assert d.clear and cleared_keys(d) == {("GPU", None, 3)} and d.head.complete
    assert sorted((k, c) for _m, _g, k, c, _v in t.entries(A)) == [(2, 2)]
    f.seq = 5
    d = f.batch(stored([6]))
    assert not d.clear and d.head.complete and sorted(k for _m, _g, k, _c, _v in t.entries(A)) == [2, 6]
    fb = Feed(t, B)
    fb.batch(stored([1]))
    fb.lost(1)
    d = t.apply(Record(B, 1, 2, seed=Record(B, 1, 2, "StateSeeded", events=[stored([7])])))
    assert d.clear and cleared_keys(d) == set() and d.head.complete and [k for *_, k, _c, _v in t.entries(B)] == [7]
    d = t.apply(Record(B, 1, 3, seed=Record(B, 1, 3, "StateSeeded", events=[stored([8])])))
    assert cleared_keys(d) == {("GPU", None, 7)} and [k for *_, k, _c, _v in t.entries(B)] == [8]


def test_seeding_keeps_only_live_entries_with_a_block_id_the_first_of_a_key_given_twice() -> None:
    head = Head(epoch=1, generation=3, seq=5, complete=True, live=2)
    entries = [
        ("GPU", None, 1, 2, 4, None),
        ("GPU", None, 2, 0, 4, None),  # no copy left
        ("GPU", None, 3, -1, 4, None),
        ("GPU", None, -1, 1, 4, None),  # no 64-bit id
        ("GPU", None, 2**64, 1, 4, None),
        ("GPU", None, 1, 1, 5, None),  # again: the first stands
        ("GPU", None, 2**64 - 1, 1, 3, None),
        ("GPU", None, 0, 1, 3, None),
    ]
    t = StateTracker()
    assert t.seed(A, head, entries)
    assert sorted(t.entries(A)) == [("GPU", None, 0, 1, 3), ("GPU", None, 1, 2, 4), ("GPU", None, 2**64 - 1, 1, 3)]
    assert t.total == 3 and t.head(A) == Head(1, 3, 5, True, 3)


def test_a_stream_seeded_switched_off_stays_off_until_its_next_clear() -> None:
    t = StateTracker()
    off = Head(epoch=1, generation=3, seq=5, complete=False, live=0, tracking=False)
    assert t.seed(A, off, [("GPU", None, 1, 1, 4, None)])
    assert t.head(A) == off and list(t.entries(A)) == [] and t.streams_off() == 1
    d = t.apply(Record(A, 1, 6, events=[stored([2])]))
    assert not d.head.tracking and d.changes == [] and t.total == 0
    d = t.apply(Record(A, 1, 7, events=[CLEARED, stored([3])]))
    assert d.switched_on and d.head.tracking and d.head.complete and t.streams_off() == 0 and t.count(A, "GPU", None, 3) == 1


def test_a_tracker_s_bytes_are_those_of_its_tables_arrays() -> None:
    t = StateTracker()
    assert t.nbytes() == 0
    Feed(t).batch(stored([1]), stored([1], medium="CPU"))
    Feed(t, B).batch(stored([2]))
    assert t.nbytes() == 3 * BlockTable().nbytes() > 0


def test_a_table_keeps_its_arrays_until_under_load_0_2_then_is_rebuilt_at_load_0_5() -> None:
    table = BlockTable(1005)
    for k in range(600):
        table.add(k, 1)
    for k in range(399):
        table.remove(k, 2)
    assert table.cap == 1005 and len(table) == 201  # 20% of 1005 slots: not under it
    table.remove(399, 2)
    assert table.cap == 401 and table.nbytes() == 401 * (8 + 4)
    assert sorted(table) == list(range(400, 600)) and all(table.version(k) == 1 for k in range(400, 600))


def test_a_sink_s_entries_written_by_the_first_record_after_its_head_are_not_applied_twice() -> None:
    """A head written at a reset (seq -1) and an entry already holding the epoch's first batch
    (a write cut before the head's): that batch, delivered again, leaves the entry as it is."""
    t = StateTracker()
    assert t.seed(A, Head(epoch=2, generation=3, seq=-1, complete=True, live=0), [("GPU", None, 1, 1, 0, None)])
    d = t.apply(Record(A, 2, 0, events=[stored([1]), stored([2])]))
    assert t.count(A, "GPU", None, 1) == 1 and [(c.block, c.count) for c in d.changes] == [(2, 1)]


def test_after_a_clear_in_the_record_a_block_the_seeded_entry_held_back_is_stored_again() -> None:
    """Blocks a seeded entry already holds are left as they are, until a clear in the record: from
    there the block is stored like any other (the entry that held it is gone)."""
    head = Head(epoch=1, generation=3, seq=4, complete=True, live=1)
    for clear in ({"type": "BlockTransferred", "block_hashes": [1], "from_medium": "GPU", "to_medium": "CPU"}, CLEARED):
        t = StateTracker()
        assert t.seed(A, head, [("GPU", None, 1, 1, 5, None)])
        t.apply(Record(A, 1, 5, events=[stored([1]), clear, stored([1])]))
        assert t.count(A, "GPU", None, 1) == 1 and t.version(A, "GPU", None, 1) == (1, 5)


def test_removals_in_a_tier_that_holds_nothing_are_each_an_absent_removal() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([1]))
    d = f.batch(removed([1, 2, "not a hash"], medium="CPU"), removed([1]))
    assert d.absent_removals == 2 and t.stats.absent_removals == 2 and t.stats.bad_hashes == 1
    assert [(c.medium, c.block, c.count) for c in d.changes] == [("GPU", 1, 0)]


def test_while_growing_a_block_already_moved_is_listed_once_and_stored_again_as_a_second_copy() -> None:
    table = BlockTable(1001)
    k = 0
    while table._old is None:
        k += 1
        table.add(k, 1)
    n = len(table)
    table.add(10**6, 2)  # moves the first old slots (ids 1, 2, ... sit at their home slots)
    assert 0 < table._cursor < 1001
    listed = [b for b, _c, _v in table.items()]
    assert len(listed) == len(set(listed)) == n + 1
    assert table.add(1, 3) == 2 and table.count(1) == 2 and table.version(1) == 3 and len(table) == n + 1
    assert table.remove(1, 4) == (1, None) and table.remove(1, 5) == (0, None) and 1 not in table


def test_a_block_removed_twice_in_one_record_is_gone_once_and_one_absent_removal() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([1, 2]))
    d = f.batch(removed([1]), removed([1]))
    assert [(c.block, c.count, c.fact) for c in d.changes] == [(1, 0, None)] and d.absent_removals == 1
    d = f.batch(removed([2]), removed([2]), CLEARED)  # a clear after them still enumerates it
    assert cleared_keys(d) == {("GPU", None, 2)} and d.absent_removals == 1


def test_a_live_block_stored_again_then_removed_twice_in_one_record_is_gone() -> None:
    t = StateTracker()
    f = Feed(t)
    f.batch(stored([1]))
    d = f.batch(stored([1]), removed([1]), removed([1]))
    assert [(c.block, c.count, c.fact) for c in d.changes] == [(1, 0, None)] and t.count(A, "GPU", None, 1) == 0
