"""Redis entry ids: the bridge's ``connectors.redis.entry_id`` and the consumer's
``kv_consumer.redis.entry_position`` read each other back, in both layouts, and order as positions."""

from __future__ import annotations

import pytest

from bridge.formats import Envelope, Message, state_message
from bridge.records import Record, Stream, events_lost
from connectors.redis import entry_id, message_position
from kv_consumer.redis import MAX_SLOT, MAX_SUB, MAX_WIDE_SUB, SLOT_BITS, SUB_BITS, WIDE, WIDE_EPOCHS, entry_position

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


def test_epoch_0_ids_are_narrow_and_the_one_position_redis_refuses_becomes_0_1() -> None:
    assert entry_id((0, 0, 0)) == "0-1"  # Redis refuses 0-0 (a SourceReset opening epoch 0)
    assert entry_id((0, 1, 0)) == "1-0"
    assert entry_id((0, 2, 3)) == "2-3"
    assert entry_id((1, 0, 0)) == f"{1 << SLOT_BITS}-0"


def test_a_state_seeded_record_sorts_after_its_batchs_events_and_before_its_state_in_both_layouts() -> None:
    seeded = MAX_SUB - 1
    assert entry_id((5, 3, seeded)) == f"{(5 << SLOT_BITS) | 3}-{seeded}"  # narrow: the sub as it is
    wide = [entry_id((WIDE_EPOCHS, 3, sub)) for sub in (MAX_WIDE_SUB - 1 - 1, seeded, MAX_SUB)]
    assert wide == [f"{WIDE | WIDE_EPOCHS}-{(3 << SUB_BITS) | s}" for s in (MAX_WIDE_SUB - 2, MAX_WIDE_SUB - 1, MAX_WIDE_SUB)]


def test_the_last_position_of_each_part_fits_and_the_next_one_does_not() -> None:
    assert entry_position(entry_id((WIDE - 1, MAX_SLOT, 0))) == (WIDE - 1, MAX_SLOT, 0)
    assert entry_position(entry_id((WIDE_EPOCHS, 0, 0))) == (WIDE_EPOCHS, 0, 0)
    assert entry_position(entry_id((WIDE_EPOCHS, 7, MAX_WIDE_SUB - 1))) == (WIDE_EPOCHS, 7, MAX_WIDE_SUB - 1)
    for position in (
        (-1, 1, 0),
        (5, -1, 0),
        (5, 1, -1),
        (5, MAX_SLOT + 1, 0),
        (5, 1, MAX_SUB + 1),
        (WIDE, 1, 0),  # epoch >= 2**63
        (WIDE_EPOCHS, -1, 0),
        (WIDE_EPOCHS, MAX_SLOT + 1, 0),
        (WIDE_EPOCHS, 1, -1),
        (WIDE_EPOCHS, 1, MAX_WIDE_SUB),  # more events in a batch than a wide id has room for
    ):
        with pytest.raises(ValueError) as caught:
            entry_id(position)
        assert str(caught.value) == (
            f"position {position} does not fit a Redis entry id "
            f"(epoch < 2**63, slot <= {2**40 - 1}, at most {2**24 - 2} events in a batch)"
        )


def test_an_events_lost_takes_the_last_sub_of_its_slot_and_other_messages_their_own_position() -> None:
    stream = Stream("a", 0)
    lost = events_lost(stream, 7, 3, 9, "replay_unavailable", 0.0)
    lost_message = Message(lost, None, "EventsLost", b"", Envelope(lost, "EventsLost", ""))
    assert message_position(lost_message) == (*lost_message.position[:2], MAX_SUB)
    batch = Record(stream=stream, epoch=7, seq=10, events=[{"type": "BlockStored"}] * 2)
    for message in (Message(batch, None, "EventBatch", b"", Envelope(batch, "EventBatch", "")), state_message(batch)):
        assert message_position(message) == message.position
    event = Message(batch, 1, "BlockStored", b"", Envelope(batch, "BlockStored", ""))
    assert message_position(event) == event.position == (7, 11, 2)
