"""Replies under a publisher UUID against what the clocks and the replay in flight say (seq_fuzz
seeds 750 and 738). A UUID adopted in doubt: the replies under the UUID that the live batches
waiting carried are that instance's, whatever their engine timestamps say; the clocks only tell
instances apart where no UUID does (a UUID known only from a reply stays unsure:
``test_sequencer_uuid_doubt.py``). A replay answered under a new UUID: the replay asked of the
new instance next brings everything the one given up would have. Helpers: ``test_sequencer_uuid.py``."""

from __future__ import annotations

from bridge.sequencer import INSTANCE_CHANGED, Action, Lost, RequestReplay, Reset, StreamSequencer, fingerprint
from tests.unit.test_sequencer_uuid import A, B, C, delivered, feed, p, seqr, ts
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


def test_a_startup_replay_answered_by_a_new_instance_leaves_none_of_its_replies_unfetched() -> None:
    """Resumed at A's seq 1 (A certain); the engine is B now, which published 0..5 while the bridge
    was away and stays quiet. The start-up replay (from seq 1, to the end) answers under B: a
    certain restart at its first reply, epoch 1, and B is asked for its head from seq 0. The
    rest of the first replay (2..5) is dropped with it: the replay asked next must bring them
    (before: it asked for 0..0 only, and 2..5 were neither delivered nor announced lost until a
    live message or the idle probe, I3 with ``replay.idle_probe: 0``)."""
    last = p(A, 1)
    s = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, delivered=1, delivered_fp=fingerprint(ts(last), last), instance=A
    )
    buffer = {n: p(B, n) for n in range(6)}
    (first,) = s.start()
    assert isinstance(first, RequestReplay) and first.start == 1 and first.until == -1
    out: list[Action] = s.replayed(first.request_id, 1, buffer[1], instance=B)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    pending = [a for a in out if isinstance(a, RequestReplay)]
    for n in range(2, 6):  # (read after the follow-up was asked for: dropped)
        assert s.replayed(first.request_id, n, buffer[n], instance=B) == []
    out += s.replay_finished(first.request_id, complete=True)
    while pending:  # the engine serves every request the sequencer makes, as B's buffer holds it
        req = pending.pop(0)
        top = max(buffer) if req.until < 0 else req.until
        got: list[Action] = []
        for n in range(req.start, top + 1):
            got += s.replayed(req.request_id, n, buffer[n], instance=B)
        got += s.replay_finished(req.request_id, complete=True)
        out += got
        pending += [a for a in got if isinstance(a, RequestReplay)]
    assert delivered(out) == [(1, n) for n in range(6)]
    assert not any(isinstance(a, Lost) for a in out) and not s.replaying
