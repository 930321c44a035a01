"""The Redis block index's change per message (:func:`connectors.redis.index_delta`), against the
engine's cache as vLLM keeps it (:class:`tests.support.records.CacheModel`): from any counts
before, applying a delta (``max(c + step, floor)`` per copy, what the write script does) gives
what applying its events one by one gives."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from bridge.records import Record, Stream
from connectors.redis import IndexDelta, index_delta
from tests.support.records import CacheModel

EVENT = st.one_of(
    st.builds(
        lambda kind, hashes, medium: {"type": kind, "block_hashes": hashes, "medium": medium},
        st.sampled_from(["BlockStored", "BlockRemoved"]),
        st.lists(st.integers(0, 4), min_size=1, max_size=4),
        st.sampled_from(["GPU", "CPU", None]),
    ),
    st.just({"type": "AllBlocksCleared"}),
)


@given(
    before=st.lists(st.builds(lambda e: [e], EVENT), max_size=6),
    events=st.lists(EVENT, max_size=12),
)
def test_a_delta_applied_to_any_counts_equals_its_events_one_by_one(
    before: list[list[dict[str, Any]]], events: list[dict[str, Any]]
) -> None:
    stream = Stream("a", 0)
    model = CacheModel(str)
    for q, e in enumerate(before):
        model.apply(Record(stream=stream, epoch=1, seq=q, events=e))
    # the script's view: a count per copy field and a total per member
    fields = Counter({f"c:{m or '-'}:-:{h}": n for (h, m, _), n in model.copies.items() if n})
    delta = index_delta(events)
    if delta.clear:
        fields.clear()
    for _member, field, step, floor in delta.changes:
        fields[field] = max(fields[field] + step, floor)
    model.apply(Record(stream=stream, epoch=1, seq=len(before), events=events))
    want = Counter({f"c:{m or '-'}:-:{h}": n for (h, m, _), n in model.copies.items() if n})
    assert +fields == want
    members = {f.rsplit(":", 1)[1] for f, n in fields.items() if n > 0}
    assert members == model.blocks


def test_each_copy_gets_its_step_and_floor_and_members_are_named_by_their_hash() -> None:
    events: list[dict[str, Any]] = [
        {"type": "BlockStored", "block_hashes": [7, 7], "medium": "GPU"},  # two copies stored
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [b"\x01\xff"], "group_idx": 2},  # absent: floor 0
        {"type": "BlockStored", "block_hashes": ["h:1", -1]},
    ]
    assert index_delta(events) == IndexDelta(
        False,
        [
            ("7", "c:GPU:-:7", 1, 1),
            ("01ff", "c:-:2:01ff", -1, 0),
            ("h:1", "c:-:-:h:1", 1, 1),
            ("-1", "c:-:-:-1", 1, 1),
        ],
    )
    assert index_delta(events[3:], hash_hex=True).changes[1][0] == "ffffffffffffffff"
    assert index_delta([{"type": "BlockStored", "block_hashes": [True]}], hash_hex=True).changes[0][0] == "True"


def test_events_that_touch_no_block_change_nothing() -> None:
    other: list[dict[str, Any]] = [
        {"type": "Heartbeat", "block_hashes": [1]},
        {"type": "BlockStored"},
        {"type": "BlockRemoved", "block_hashes": None},
    ]
    assert index_delta(other) == IndexDelta(False, [])
    cleared = index_delta([{"type": "BlockStored", "block_hashes": [1]}, {"type": "AllBlocksCleared"}, *other])
    assert cleared == IndexDelta(True, [])
