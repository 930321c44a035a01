"""Redis entry ids: the bridge's ``connectors.redis.entry_id`` and the consumer's
``kv_consumer.redis.entry_position`` read each other back, in both layouts, and order as positions."""

from __future__ import annotations

from connectors.redis import entry_id
from kv_consumer.redis import MAX_SLOT, MAX_SUB, WIDE_EPOCHS, entry_position

POSITIONS = [
    (5, 0, 0),  # a SourceReset (narrow: an epoch of an earlier release)
    (5, 1, 0),
    (5, 3, MAX_SUB),  # an EventsLost: after everything of its slot
    (WIDE_EPOCHS - 1, MAX_SLOT, 7),  # the last narrow epoch
    (WIDE_EPOCHS, 1, 0),  # the first wide one
    (1_700_000_000_000_000, 12, 3),  # an epoch in microseconds
    (1_700_000_000_000_000, 12, MAX_SUB),
]


def test_every_entry_id_reads_back_as_its_position_as_text_or_bytes() -> None:
    for p in POSITIONS:
        e = entry_id(p)
        assert entry_position(e) == p == entry_position(e.encode()), e


def test_entry_ids_sort_as_their_positions() -> None:
    ids = [tuple(int(part) for part in entry_id(p).split("-")) for p in POSITIONS]
    assert sorted(range(len(ids)), key=ids.__getitem__) == sorted(range(len(POSITIONS)), key=POSITIONS.__getitem__)


def test_an_id_without_a_sub_reads_as_sub_0() -> None:
    assert entry_position(entry_id((5, 1, 0)).split("-")[0]) == (5, 1, 0)
