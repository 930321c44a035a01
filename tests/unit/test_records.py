"""Records (bridge.records): their positions along a stream and the bodies of control records."""

from __future__ import annotations

from bridge.records import Record, Stream, events_lost, source_reset

STREAM = Stream("engine", 0)


def test_positions_order_a_reset_before_its_epoch_s_first_batch_and_a_loss_at_its_seq() -> None:
    reset = source_reset(STREAM, 5, "publisher_restart", 1.0)
    first = Record(stream=STREAM, epoch=5, seq=0)
    lost = events_lost(STREAM, 5, 1, 3, "replay_unavailable", 1.0)
    assert [r.position for r in (reset, first, lost)] == [(5, 0), (5, 1), (5, 4)]


def test_control_bodies_name_a_reason_even_when_none_was_given() -> None:
    assert source_reset(STREAM, 5, "bridge_restart", 1.0).control() == {"type": "SourceReset", "reason": "bridge_restart"}
    bare = Record(stream=STREAM, epoch=5, seq=0, kind="SourceReset")
    assert bare.control() == {"type": "SourceReset", "reason": "publisher_restart"}
    lost = Record(stream=STREAM, epoch=5, seq=3, kind="EventsLost", from_seq=1)
    assert lost.control() == {"type": "EventsLost", "from_seq": 1, "to_seq": 3, "count": 3, "reason": "unrecoverable"}
