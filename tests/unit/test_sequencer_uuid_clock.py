"""A publisher UUID adopted in doubt against a clock that stepped back (seq_fuzz seed 750): the
replies under the UUID that the live batches waiting carried are that instance's, whatever their
engine timestamps say; the clocks only tell instances apart where no UUID does. (A UUID known
only from a reply stays unsure: ``test_sequencer_uuid_doubt.py``.) Helpers: ``test_sequencer_uuid.py``."""

from __future__ import annotations

from bridge.sequencer import INSTANCE_CHANGED, Lost, Reset
from tests.unit.test_sequencer_uuid import A, B, C, delivered, feed, p, seqr
from tests.unit.test_sequencer_uuid_doubt import answer, request


def test_a_reply_under_the_uuid_of_the_live_batches_waiting_is_their_instance_though_stamped_later() -> None:
    """A delivered 0..1; the connection drops twice; B's live seq 1 (stamped 1.0, before the
    second drop) opens epoch 1 in doubt, B adopted unsure. B's clock stepped back after its seq
    0: the reply of seq 0 under B is stamped 5.0, later than seq 1. By the clocks it is a later
    instance's; by the UUID it is B's, as seq 1 is. Both go out in epoch 1, B certain (before:
    seq 1 delivered in epoch 1 and seq 0 announced lost there, then seq 0 delivered in epoch 2:
    B spread over two epochs, I1 and I3)."""
    s = seqr()
    feed(s, A, range(2))
    s.disconnected(now=10.0)
    s.disconnected(now=20.0)
    out = s.live(1, p(B, 1), instance=B)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert s.in_doubt and s.sure_instance is None
    out = answer(s, request(out), [(0, b"\xbb:5")], B)
    assert not any(isinstance(a, (Reset, Lost)) for a in out)
    assert delivered(out) == [(1, 0), (1, 1)] and not s.in_doubt
    assert s.epoch == 1 and s.sure_instance == B
    assert delivered(feed(s, B, [2])) == [(1, 2)]


def test_a_reply_under_another_uuid_than_the_live_batches_is_still_judged_by_the_clocks() -> None:
    """The same, but the reply names C: it is not the live batches' instance, and nothing makes
    C or B certain from it; the clocks judge as without UUIDs (seq 0 stamped after seq 1: a later
    instance's), and B's seq 1 is not delivered under C's epoch."""
    s = seqr()
    feed(s, A, range(2))
    s.disconnected(now=10.0)
    s.disconnected(now=20.0)
    out = s.live(1, p(B, 1), instance=B)
    out = answer(s, request(out), [(0, b"\xcc:5")], C)
    assert s.epoch == 2 and s.sure_instance is None
    assert (2, 1) not in delivered(out) and (1, 1) in delivered(out)
