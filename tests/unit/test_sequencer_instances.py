"""How the sequencer tells engine instances apart around disconnects (found by review scripts).

Payloads are ``instance:seq`` and the engine ts is ``instance * 1e6 + seq`` (a later instance
has a later clock), as in the model test; the bridge's clock is given to ``disconnected``.
"""

from __future__ import annotations

import math
import zlib

import pytest

from bridge.sequencer import Action, Deliver, Duplicate, Lost, RequestReplay, Reset, StreamSequencer, fingerprint
from tests.unit.test_sequencer_newcomer import serve


def p(instance: int, seq: int) -> bytes:
    return f"{instance}:{seq}".encode()


def ts(payload: bytes) -> float:
    instance, seq = payload.decode().split(":")
    return int(instance) * 1e6 + int(seq)


def delivered(actions: list[Action]) -> list[tuple[int, bytes]]:
    return [(a.epoch, a.payload) for a in actions if isinstance(a, Deliver)]


def seqr(**kw: object) -> StreamSequencer:
    return StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, clock_skew=0.25, **kw)  # type: ignore[arg-type]


def test_batches_published_before_the_disconnect_but_read_after_it_stay_the_old_instances() -> None:
    """A stream waiting on a full sink reads its queue late: the old instance's last batches come
    after the disconnect was noticed. Stamped before it, they are delivered under the old epoch
    when the new instance shows, not announced lost."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)  # instance 0's clock is at 0..4: all before the notice
    out = s.live(3, p(0, 3)) + s.live(4, p(0, 4))
    assert delivered(out) == [] and set(s.unverified) == {3, 4}
    out = s.live(0, p(1, 0))  # the new instance, seq back to 0
    assert delivered(out) == [(0, p(0, 3)), (0, p(0, 4)), (1, p(1, 0))]
    assert not [a for a in out if isinstance(a, Lost)]


def test_batches_stamped_after_the_disconnect_cannot_be_proven_and_are_announced_lost() -> None:
    """An instance in between (up after the notice, gone before a replay could tell) is not
    delivered under the old epoch: its batches are announced lost there."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=0.5e6)
    s.live(3, p(1, 3))  # instance 1 went on at seq 3, then died too
    out = s.live(0, p(2, 0))
    assert out[0] == Lost(3, 3, "publisher_restart", 0) and isinstance(out[1], Reset)
    assert delivered(out) == [(1, p(2, 0))]


def test_a_second_disconnect_keeps_the_next_epoch_in_doubt() -> None:
    """Two restarts in a row, each instance's last batch read after its own disconnect: the batch
    that shows instance 1 was published before the second notice, so the new epoch starts in
    doubt and instance 2's batches are not delivered in instance 1's epoch unverified."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    s.disconnected(now=1e6 + 10.0)  # instance 1 gone too
    out = s.live(0, p(1, 0))  # instance 1's batch, read late: the restart shows
    assert isinstance(out[0], Reset) and s.in_doubt
    out += s.live(1, p(2, 1))  # instance 2 (its seq 0 missed while the bridge reconnected)
    assert delivered(out) == []
    (req,) = [a for a in out if isinstance(a, RequestReplay)]
    out = s.replayed(req.request_id, 0, p(2, 0))  # instance 2 answers: not instance 1
    assert [a for a in out if isinstance(a, Reset)] == [Reset(2, "publisher_restart")]
    assert all(epoch == 2 for epoch, payload in delivered(out) if payload.startswith(b"2:"))


def test_a_late_batch_of_an_earlier_instance_after_a_restart_is_not_the_new_ones() -> None:
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    assert isinstance(s.live(0, p(1, 0))[-2], Reset)
    out = s.live(3, p(0, 3), ts(p(0, 3)))  # instance 0's, read after instance 1 showed
    assert out == [Duplicate(3)]
    assert delivered(s.live(1, p(1, 1))) == [(1, p(1, 1))]


def test_the_last_batch_sent_twice_is_a_duplicate_not_a_restart() -> None:
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    assert s.live(2, p(0, 2)) == [Duplicate(2)]
    assert s.epoch == 0
    assert isinstance(s.live(2, p(9, 2))[0], Reset)  # the same seq with other bytes is one


def test_a_non_finite_ts_is_unknown_not_a_mismatch() -> None:
    """NaN never equals itself: a batch with ts NaN at the anchor must still verify as itself."""
    nan = b"nan"
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=lambda b: math.nan if b == nan else ts(b))
    s.live(0, p(0, 0))
    s.live(1, nan)
    (req,) = [a for a in s.live(3, p(0, 3)) if isinstance(a, RequestReplay)]
    assert req.start == 1  # verifies at the NaN batch
    out = s.replayed(req.request_id, 1, nan) + s.replayed(req.request_id, 2, p(0, 2)) + s.replayed(req.request_id, 3, p(0, 3))
    assert not [a for a in out if isinstance(a, Reset)]
    assert delivered(out) == [(0, p(0, 2)), (0, p(0, 3))]
    resumed = StreamSequencer(
        can_replay=True, replay_on_start=True, delivered=1, delivered_fp=(math.inf, None), ts_of=lambda _b: math.inf
    )
    (req,) = resumed.start()
    assert not [a for a in resumed.replayed(req.request_id, 1, b"x") if isinstance(a, Reset)]


# -- resumed just before a batch known published but not known delivered ---------------------------


def resumed_before_first(seq: int = 3) -> StreamSequencer:
    """Resumed from a checkpoint's ``opened`` entry: the epoch's first batch (``seq``) was saved
    before it went out, but no sink is known to have it: the anchor is one ahead of delivered."""
    first = p(0, seq)
    return StreamSequencer(
        can_replay=True,
        replay_on_start=True,
        ts_of=ts,
        clock_skew=0.25,
        epoch=7,
        delivered=seq - 1,
        delivered_fp=(ts(first), zlib.crc32(first)),
        anchor=seq,
        next_epoch=lambda e, _shown_at: e + 1,
    )


def test_a_batch_known_published_but_not_delivered_is_delivered_again_once_verified() -> None:
    s = resumed_before_first()
    (req,) = [a for a in s.start() if isinstance(a, RequestReplay)]
    assert req.start == 3  # the verification point is the batch itself
    out = s.replayed(req.request_id, 3, p(0, 3)) + s.replayed(req.request_id, 4, p(0, 4))
    assert delivered(out) == [(7, p(0, 3)), (7, p(0, 4))]
    assert not [a for a in out if isinstance(a, Reset | Lost | Duplicate)]


def test_a_batch_known_published_but_answered_by_another_instance_is_announced_lost() -> None:
    s = resumed_before_first()
    (req,) = [a for a in s.start() if isinstance(a, RequestReplay)]
    out = s.replayed(req.request_id, 3, p(1, 3))  # the engine restarted while the bridge was away
    # The old instance's batch, in its own epoch, before the new epoch opens; then the new
    # instance's history is fetched from its start.
    assert out[:2] == [Lost(3, 3, "publisher_restart", 7), Reset(8, "publisher_restart")]
    (again,) = [a for a in out if isinstance(a, RequestReplay)]
    assert (again.start, again.until) == (0, 2) and delivered(out) == []


def test_a_batch_known_published_that_left_the_buffer_is_asked_again_then_announced_lost() -> None:
    s = resumed_before_first()
    (req,) = [a for a in s.start() if isinstance(a, RequestReplay)]
    # The buffer slid past 3 (the same instance's clock): asked once more, then given up.
    out = s.replayed(req.request_id, 9, p(0, 9)) + s.replay_finished(req.request_id, complete=True)
    assert delivered(out) == [] and [(a.start, a.attempt) for a in out if isinstance(a, RequestReplay)] == [(3, 1)]
    (again,) = [a for a in out if isinstance(a, RequestReplay)]
    out = s.replayed(again.request_id, 9, p(0, 9))
    assert out[0] == Lost(3, 8, "replay_buffer_exceeded", 7) and delivered(out) == [(7, p(0, 9))]


def test_a_batch_known_published_is_announced_lost_even_when_the_new_instance_shows_live_first() -> None:
    """The new instance's live batch waits (in doubt) and is carried into the new epoch; the old
    instance's batch at the anchor is still settled in its own epoch (found by mutation review)."""
    s = resumed_before_first()
    (req,) = [a for a in s.start() if isinstance(a, RequestReplay)]
    assert s.live(4, p(1, 4)) == []  # unverified
    out = s.replayed(req.request_id, 3, p(1, 3))
    assert out[:2] == [Lost(3, 3, "publisher_restart", 7), Reset(8, "publisher_restart")]
    assert s.known_top >= s.delivered


def test_a_restart_within_a_second_is_seen_by_the_earlier_seq_with_a_later_clock() -> None:
    """Instance A: 0 live, 1..5 from a probe's replay (anchor 5, ts 1000.5). A crashes; B is up
    0.3 s later, its 0 and 5 lost on the live socket. B's 1..4 are earlier seqs than the anchor
    with a later clock: another instance, however close the clocks (the next seq, 6, would
    otherwise go out in A's epoch and the anchor move past every check: I1)."""
    stamps: dict[bytes, float] = {}

    def stamped(name: str, seq: int, at: float) -> bytes:
        payload = f"{name}:{seq}".encode()
        stamps[payload] = at
        return payload

    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=stamps.get)
    out = list(s.live(0, stamped("A", 0, 1000.0)))
    (req,) = [a for a in s.probe() if isinstance(a, RequestReplay)]
    for q in range(1, 6):
        out += s.replayed(req.request_id, q, stamped("A", q, 1000.0 + 0.1 * q))
    out += s.replay_finished(req.request_id, complete=True)
    for q in (1, 2, 3, 4, 6):
        out += s.live(q, stamped("B", q, 1000.8 + 0.01 * q))
    assert [a for a in out if isinstance(a, Reset)], "B was taken for A"
    assert not [a for a in out if isinstance(a, Deliver) and a.payload.startswith(b"B") and a.epoch == 0]


def test_a_late_live_copy_of_a_replayed_batch_is_a_duplicate_even_when_the_clock_stepped_back() -> None:
    """1..4 come by replay (above the live stream), their live copies later. The engine clock
    stepped back 0.5 s between 2 and 3, so the copy of 2 is an earlier seq than the anchor (4)
    with a later clock, which alone reads as another instance. Its bytes are those replayed:
    the same batch, not a restart (the same instance in two epochs: I1)."""
    stamps = {b"A:0": 100.0, b"A:1": 100.1, b"A:2": 100.2, b"A:3": 99.8, b"A:4": 99.9}
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=stamps.get)
    out = list(s.live(0, b"A:0"))
    (req,) = [a for a in s.probe() if isinstance(a, RequestReplay)]
    for q in range(1, 5):
        out += s.replayed(req.request_id, q, f"A:{q}".encode())
    out += s.replay_finished(req.request_id, complete=True)
    out += s.live(2, b"A:2")
    assert out[-1] == Duplicate(2)
    assert not [a for a in out if isinstance(a, Reset)] and s.epoch == 0


def test_a_late_batch_of_the_old_instance_after_a_replay_showed_the_restart_is_not_the_new_ones() -> None:
    """The replay that shows the new instance sets the new epoch's floor: a batch of the old
    instance still in the live queue (read after the SourceReset, above the new instance's top)
    is older than the new instance's first batch known, never delivered under its epoch (I1)."""
    s = seqr()
    for q in range(10):
        s.live(q, p(0, q))
    s.disconnected(now=11.5)
    (req,) = [a for a in s.live(10, p(0, 10)) if isinstance(a, RequestReplay)]  # late, read after the drop
    out = s.replayed(req.request_id, 9, p(1, 9)) + s.replay_finished(req.request_id, complete=True)
    assert [a for a in out if isinstance(a, Reset)]
    for _ in range(3):
        reqs = [a for a in out if isinstance(a, RequestReplay)]
        if not s.replaying:
            break
        r = reqs[-1]
        out += [x for q in range(r.start, 10) for x in s.replayed(r.request_id, q, p(1, q))]
        out += s.replay_finished(r.request_id, complete=True)
    out += s.live(11, p(0, 11))  # the old instance's, still in the queue
    assert out[-1] == Duplicate(11)
    out += s.live(10, p(1, 10))
    assert [a.payload for a in out if isinstance(a, Deliver) and a.epoch == 1] == [p(1, q) for q in range(11)]


def test_an_undecodable_late_batch_of_the_old_instance_never_goes_out_in_the_new_epoch() -> None:
    """No ts (undecodable batches): the old instance's last batch is read only after the
    disconnect; then the new instance answers the verifying replay. The reply of that seq
    shows by its bytes that the batch is not the new instance's; without a clock nothing tells
    the old instance's from one that came and went in between, so its seq is announced lost with
    the old epoch, and the new epoch delivers the new instance's own batch of that seq."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=lambda _p: None)
    assert s.live(0, p(0, 0)) == [Deliver(0, p(0, 0), 0)]
    s.disconnected()
    (req,) = s.live(1, p(0, 1))
    assert isinstance(req, RequestReplay) and req.until == 1  # to the batch waiting: its reply compares bytes
    out = s.replayed(req.request_id, 0, p(1, 0))  # the anchor's seq, other bytes: another instance
    assert out == []  # but whose is the batch waiting?
    out = s.replayed(req.request_id, 1, p(1, 1))
    assert out[:3] == [Lost(1, 1, "publisher_restart", 0), Reset(1, "publisher_restart"), Deliver(0, p(1, 0), 1, True)]
    assert [a.payload for a in out if isinstance(a, Deliver) and a.epoch == 1] == [p(1, 0), p(1, 1)]


def test_an_undecodable_batch_waiting_is_the_new_instances_when_its_reply_has_the_same_bytes() -> None:
    """The same, but the batch read after the disconnect is the new instance's own: the reply of
    its seq has the same bytes, so it goes on in the new epoch and nothing is lost."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=lambda _p: None)
    s.live(0, p(0, 0))
    s.disconnected()
    (req,) = s.live(1, p(1, 1))
    out = s.replayed(req.request_id, 0, p(1, 0)) + s.replayed(req.request_id, 1, p(1, 1))
    assert out[:3] == [Reset(1, "publisher_restart"), Deliver(0, p(1, 0), 1, True), Deliver(1, p(1, 1), 1, True)]
    assert not [a for a in out if isinstance(a, Lost)]


def test_an_undecodable_stream_is_told_a_new_instance_by_a_replay_of_what_it_read() -> None:
    """No ts at all and no fingerprint (resumed from a checkpoint at 5); the answer ends below the
    batch read before it was asked for (8): the replies that would compare bytes may have been
    dropped under load, so the bridge asks for exactly that seq. The first reply of a fresh
    DEALER is never dropped: "nothing" means the instance answering never published it."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=lambda _p: None, max_attempts=3, delivered=5)
    (req,) = [a for a in s.live(8, p(0, 8)) if isinstance(a, RequestReplay)]
    assert req.until == 8  # to the batch waiting: its reply would compare bytes
    out = [x for q in (5, 6) for x in s.replayed(req.request_id, q, p(1, q))] + s.replay_finished(req.request_id, complete=True)
    assert out == [RequestReplay(2, 8, 8, 0)]
    out = s.replay_finished(2, complete=True)  # nothing from 8 on
    assert out == [Lost(6, 8, "publisher_restart", 0), Reset(1, "publisher_restart"), RequestReplay(3, 0, -1, 0)]


def test_an_undecodable_batch_asked_for_again_with_the_same_bytes_is_the_same_instances() -> None:
    """The same, but the engine (one instance, a connection blip) only dropped the replies under
    load: the batch asked for comes back with the same bytes, and it is delivered in its epoch."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=lambda _p: None, max_attempts=3, delivered=5)
    (req,) = [a for a in s.live(8, p(0, 8)) if isinstance(a, RequestReplay)]
    out = [x for q in (5, 6) for x in s.replayed(req.request_id, q, p(0, q))] + s.replay_finished(req.request_id, complete=True)
    (probe,) = out
    assert isinstance(probe, RequestReplay) and probe.start == probe.until == 8
    out = s.replayed(probe.request_id, 8, p(0, 8)) + s.replay_finished(probe.request_id, complete=True)
    assert not [a for a in out if isinstance(a, Reset | Lost)] and s.epoch == 0 and not s.in_doubt
    (req,) = [a for a in out if isinstance(a, RequestReplay)]  # the gap below 8, from the same instance
    out = [x for q in (6, 7, 8) for x in s.replayed(req.request_id, q, p(0, q))]
    out += s.replay_finished(req.request_id, complete=True)
    assert [(a.seq, a.epoch) for a in out if isinstance(a, Deliver)] == [(6, 0), (7, 0), (8, 0)]


def restarted(older_top: int, new_top: int) -> StreamSequencer:
    """Instance 0 published 0..older_top, then instance 1 showed (its 0), and went on to new_top."""
    s = seqr()
    for q in range(older_top + 1):
        s.live(q, p(0, q))
    assert isinstance(s.live(0, p(1, 0))[-2], Reset)
    for q in range(1, new_top + 1):
        assert delivered(s.live(q, p(1, q))) == [(1, p(1, q))]
    return s


STEPPED_BACK = 5.0  # an engine ts below the one that showed instance 1 (1e6): its clock stepped back


def test_after_a_restart_a_seq_at_or_below_the_older_instances_last_is_this_instances() -> None:
    """The older instance's seqs only grow on its connection: a batch stamped before this epoch's
    first, at or below the last one read of the older instance, is this instance's (clock stepped
    back), here above a gap: held, and asked for by replay, not dropped as a late batch."""
    s = restarted(older_top=2, new_top=0)
    out = s.live(2, p(1, 2), STEPPED_BACK)
    assert Duplicate(2) not in out and 2 in s.waiting
    assert [a.start for a in out if isinstance(a, RequestReplay)] == [0]


def test_after_a_restart_this_instances_next_seq_with_a_clock_stepped_back_is_delivered() -> None:
    s = restarted(older_top=2, new_top=3)
    assert delivered(s.live(4, p(1, 4), STEPPED_BACK)) == [(1, p(1, 4))]
    s = restarted(older_top=0, new_top=1)  # the older instance's next would be 1, not 2
    assert delivered(s.live(2, p(1, 2), STEPPED_BACK)) == [(1, p(1, 2))]


def test_after_a_restart_a_batch_that_is_the_next_of_both_instances_is_taken_for_the_older_ones() -> None:
    """Seq 3 follows this instance's 2 and the older instance's 2 alike; stamped before this
    epoch's first batch, it is the older instance's late batch: dropped, not delivered."""
    s = restarted(older_top=2, new_top=2)
    assert s.live(3, p(0, 3), STEPPED_BACK) == [Duplicate(3)]
    s = restarted(older_top=2, new_top=0)
    assert s.live(5, p(0, 5), STEPPED_BACK) == [Duplicate(5)]  # neither's next: the older one's, read late


def test_after_a_replay_showed_the_restart_a_late_old_batch_is_dropped_even_as_the_next_seq() -> None:
    """A restart shown by a replay leaves the older instance's last live seq unknown: then every
    live batch stamped before the new epoch's first is the older one's, read late, even one whose
    seq is the new instance's next (were it the new one's, with its clock stepped back, the gap
    it leaves is fetched by replay)."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=3.5)
    (req,) = [a for a in s.live(5, p(1, 5)) if isinstance(a, RequestReplay)]
    out = s.replayed(req.request_id, 2, p(1, 2))  # the anchor's seq, other bytes: instance 1
    out += [a for q in (3, 4) for a in s.replayed(req.request_id, q, p(1, q))] + s.replay_finished(req.request_id, True)
    assert [a for a in out if isinstance(a, Reset)] and s.epoch == 1 and s.last_live == 5
    assert s.live(6, p(0, 6)) == [Duplicate(6)]  # instance 0's, stamped 6: before instance 1's first
    assert s.live(4, p(0, 4)) == [Duplicate(4)]  # and one below it: still unknown, still instance 0's
    s.live(6, p(1, 6))
    assert s.held.get(6) == p(1, 6)  # instance 1's own: kept for its epoch (0..1 are being fetched)


def test_after_a_restart_a_batch_stamped_at_the_epochs_first_is_this_instances() -> None:
    """Only a batch stamped *before* the batch that showed this epoch's instance can be an older
    instance's; one stamped at the same instant, above a gap, is held and the gap fetched."""
    s = restarted(older_top=2, new_top=0)
    out = s.live(5, p(1, 5), 1e6)
    assert Duplicate(5) not in out and 5 in s.waiting


def test_the_older_instances_late_batches_raise_its_last_seq_known() -> None:
    """Instance 0 was seen up to seq 0 only; its late batch 3 (stamped before instance 1's first)
    is dropped, and from then on a batch stamped so at or below 3 is instance 1's, its clock
    stepped back (the older instance's seqs only grow): held above the gap, not dropped."""
    s = restarted(older_top=0, new_top=0)
    assert s.live(3, p(0, 3), STEPPED_BACK) == [Duplicate(3)]
    out = s.live(2, p(1, 2), STEPPED_BACK)
    assert Duplicate(2) not in out and 2 in s.waiting


def test_disconnects_count_from_the_last_verification_not_from_the_first_doubt() -> None:
    """A disconnect, then a replay that verifies the same instance (doubt over), then another
    disconnect: one disconnect since continuity was last known, not two. A restart shown then
    opens the new epoch out of doubt, its first batch delivered at once (here one without a ts:
    nothing says it was published before the second disconnect, which one more would need)."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=lambda b: None if b[:1] == b"1" else ts(b))
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    (req,) = s.probe()
    assert isinstance(req, RequestReplay)
    s.replayed(req.request_id, 2, p(0, 2))
    s.replay_finished(req.request_id, complete=True)
    assert not s.in_doubt
    s.disconnected(now=20.0)
    out = s.live(0, p(1, 0))  # a new instance's seq 0
    assert isinstance(out[0], Reset) and not s.in_doubt and delivered(out) == [(1, p(1, 0))]


def test_a_stream_detached_with_nothing_unread_knows_of_nothing_more_published() -> None:
    s = seqr()
    s.detached()
    assert s.known_top == -1


@pytest.mark.parametrize(
    ("reference", "payload", "restart"),
    [
        ((2, 10.0), b"b2@11", True),  # at the reference's seq, a later clock: another instance
        ((2, 10.0), b"b2@10", False),  # the same instant is not later
        ((2, 10.0), b"b2@5", False),  # an earlier clock (compared with the reference's ts, not its seq)
        ((2, 10.0), b"b2x", False),  # no ts: nothing to compare
        ((1, 1e6), b"b2@2000000", False),  # above the reference's seq: its clock bounds nothing
        ((2, -math.inf), b"b2@5", False),  # a ts that is not a finite number says nothing
    ],
)
def test_below_an_anchor_without_a_ts_an_earlier_batchs_ts_tells_a_later_instance(
    reference: tuple[int, float], payload: bytes, restart: bool
) -> None:
    """Resumed without replay at seq 3, whose batch had no ts (only its CRC kept); the pipeline
    gave the ts of an earlier batch of the epoch (``reference``). A live batch at or below that
    seq stamped after it is another instance's; anything else proves nothing (a duplicate)."""
    s = StreamSequencer(
        can_replay=False,
        replay_on_start=False,
        ts_of=lambda b: None if b.endswith(b"x") else float(b.split(b"@")[1]),
        delivered=3,
        delivered_fp=(None, zlib.crc32(b"a3x")),
    )
    s.reference(*reference)
    out = s.live(2, payload)
    assert (Reset(1, "publisher_restart") in out) is restart
    assert restart or out == [Duplicate(2)]


def test_live_seqs_not_kept_in_doubt_are_the_old_instances_once_it_is_verified() -> None:
    """Seqs 4..9, read in doubt past ``max_held``, become the verified instance's (the anchor's
    reply verified it). When a replay then shows instance 1, they are announced lost with the old
    epoch, and not owed by instance 1's: when it restarts too, its epoch announces lost only what
    instance 1 was seen to publish (up to 3)."""
    s = seqr(max_held=1)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    out = s.live(3, p(0, 3))
    for q in range(4, 10):
        out += s.live(q, p(0, q))
    (req,) = [a for a in out if isinstance(a, RequestReplay)]
    out = s.replayed(req.request_id, 2, p(0, 2)) + s.replay_finished(req.request_id, complete=True)
    assert delivered(out) == [(0, p(0, 3))] and not s.in_doubt
    (req,) = [a for a in out if isinstance(a, RequestReplay)]
    out = s.replayed(req.request_id, 3, p(1, 3))  # not the bytes delivered at 3: instance 1
    assert [a for a in out if isinstance(a, Lost | Reset)] == [Lost(4, 9, "publisher_restart", 0), Reset(1, "publisher_restart")]
    out = s.live(0, p(2, 0))  # instance 2, before instance 1's head was fetched
    assert [a for a in out if isinstance(a, Lost)] == [Lost(0, 2, "publisher_restart", 1)]
    assert delivered(out) == [(1, p(1, 3)), (2, p(2, 0))]


def test_a_restart_a_replay_shows_with_the_new_instances_batches_waiting_loses_nothing_of_the_old() -> None:
    """Verified once after a disconnect, then a second one: instance 1's batch 5 comes live (its
    clock after the reply that shows it), and its reply 2 is not the anchor's bytes. Nothing was
    read past ``max_held``: 3..4 are instance 1's (its epoch fetches them), not the old one's to
    announce lost."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    s.replayed(probe.request_id, 2, p(0, 2))  # the same instance
    s.replay_finished(probe.request_id, complete=True)
    assert not s.in_doubt
    s.disconnected(now=20.0)
    (req,) = s.live(5, p(1, 5))
    assert isinstance(req, RequestReplay)
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert [a for a in out if isinstance(a, Lost | Reset)] == [Reset(1, "publisher_restart")]
    assert s.held == {2: p(1, 2), 5: p(1, 5)}


def test_a_live_batch_at_the_checkpoints_seq_with_other_bytes_is_a_new_instance() -> None:
    """Resumed with the fingerprint of the batch delivered last (seq 5): the same bytes live are
    that batch again; other bytes at that seq are a new instance's."""
    fp = fingerprint(ts(p(0, 5)), p(0, 5))
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, epoch=2, delivered=5, delivered_fp=fp)
    assert s.live(5, p(0, 5)) == [Duplicate(5)]
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, epoch=2, delivered=5, delivered_fp=fp)
    assert Reset(3, "publisher_restart") in s.live(5, p(1, 5))


def test_a_batch_waiting_older_than_the_new_instances_reply_is_the_old_ones_only() -> None:
    """After a disconnect, instance 0's batch 3 and instance 1's batch 5 came live; instance 1's
    reply 2 shows the restart. By the clocks, 3 is the old instance's (announced lost with its
    epoch: published after the disconnect, it cannot be proven) and 5 the new one's: the new
    epoch owes nothing of the old, and asks only for its head, up to its reply 2."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected()
    (req,) = s.live(3, p(0, 3))
    assert isinstance(req, RequestReplay)
    s.live(5, p(1, 5))
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert out == [Lost(3, 3, "publisher_restart", 0), Reset(1, "publisher_restart"), RequestReplay(req.request_id + 1, 0, 1, 0)]
    assert s.held == {2: p(1, 2), 5: p(1, 5)}


def test_live_seqs_not_kept_when_a_replay_shows_a_restart_are_settled_by_both_epochs() -> None:
    """After a disconnect, batch 3 (instance 0's, by its clock) waits and 4..5 come past
    ``max_held``, not kept: whose they are is unknown. Instance 1's reply 2 shows the restart: 3..5
    are announced lost with the old epoch, and owed by the new one, which settles them too when
    its instance restarts before they came again (and the epoch after it owes none of them)."""
    s = seqr(max_held=1)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected()
    (req,) = s.live(3, p(0, 3))
    assert isinstance(req, RequestReplay)
    assert s.live(4, p(1, 4)) + s.live(5, p(1, 5)) == []
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert [a for a in out if isinstance(a, Lost | Reset)] == [Lost(3, 5, "publisher_restart", 0), Reset(1, "publisher_restart")]
    out = s.live(0, p(2, 0))
    assert [a for a in out if isinstance(a, Lost | Deliver) and a.epoch == 1] == [
        Lost(0, 1, "publisher_restart", 1),
        Deliver(2, p(1, 2), 1),
        Lost(3, 5, "publisher_restart", 1),
    ]
    out = s.live(0, p(3, 0))  # instance 3: instance 2 published only its seq 0, and owed nothing
    assert [a for a in out if isinstance(a, Lost)] == []


def test_a_new_instance_an_empty_replay_shows_is_not_held_to_the_previous_instances_clock() -> None:
    """Instance 3 replaced instance 2 on the live stream (its first batch is its epoch's floor);
    later an empty answer shows a restart again. Instance 1 (a host whose clock is behind) is then
    this epoch's: its batches are not taken for late ones of an instance before it."""
    s = seqr()
    for q in range(3):
        s.live(q, p(2, q))
    assert Reset(1, "publisher_restart") in s.live(0, p(3, 0)) + s.live(1, p(3, 1))
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    s.replayed(probe.request_id, 1, p(3, 1))  # the buffer works
    s.replay_finished(probe.request_id, complete=True)
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    out = s.replay_finished(probe.request_id, complete=True)
    assert Reset(2, "publisher_restart") in out  # nothing from 1 on
    (ask,) = [a for a in out if isinstance(a, RequestReplay)]
    assert s.live(0, p(1, 0)) == []  # (it waits for the new instance's replay: see the next test)
    out = s.replayed(ask.request_id, 0, p(1, 0)) + s.replay_finished(ask.request_id, complete=True)
    assert delivered(out) == [(2, p(1, 0))]


def test_a_late_batch_read_before_the_replay_of_an_instance_an_empty_answer_showed_is_not_its() -> None:
    """breaker59 X1: instance 0 delivered 0..2; instance 1 ran and died while the stream read its
    queue late, and instance 2 runs now. The idle probe's replay answers nothing from seq 2: a
    restart, and the replay from seq 0 is asked. Instance 1's seq 0 is read before it answers:
    it went out as the new epoch's first batch, and instance 2's reply at seq 0 was dropped as a
    copy, unchecked: epoch 1 held two instances (I1), and instance 2's seq 0 was neither
    delivered nor announced (I3). The new epoch waits in doubt for that replay now."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25)
    out = serve(s, s.start(), {0: p(0, 0), 1: p(0, 1)}, None)
    out += s.live(2, p(0, 2))
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    got = s.replay_finished(probe.request_id, complete=True)
    assert Reset(1, "publisher_restart") in got
    got += s.live(0, p(1, 0))
    out += got + serve(s, got, {0: p(2, 0), 1: p(2, 1)}, None)
    for q in (2, 3):
        got = s.live(q, p(2, q))
        out += got + serve(s, got, {n: p(2, n) for n in range(q + 1)}, None)
    epochs: dict[int, set[bytes]] = {}
    for epoch, payload in delivered(out):
        epochs.setdefault(epoch, set()).add(payload.split(b":")[0])
    assert all(len(instances) == 1 for instances in epochs.values()), epochs
    assert [payload for _, payload in delivered(out) if payload.startswith(b"2:")] == [p(2, q) for q in range(4)]


def test_after_a_restart_a_replay_shows_a_late_batch_of_an_older_instance_is_not_the_new_ones() -> None:
    """Instance 3 replaced instance 2 on the live stream; then a probe's reply shows instance 4.
    A late live batch of instance 3, stamped before instance 4's reply, is dropped: it is not
    instance 4's, whatever instance 2's last seq was."""
    s = seqr()
    for q in range(3):
        s.live(q, p(2, q))
    for q in range(3):
        s.live(q, p(3, q))
    assert s.epoch == 1
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    assert Reset(2, "publisher_restart") in s.replayed(probe.request_id, 2, p(4, 2))
    assert s.live(1, p(3, 1)) == [Duplicate(1)]
    assert s.held == {2: p(4, 2)}


def test_held_replies_stamped_after_the_batch_that_shows_a_new_instance_are_its_and_known_published() -> None:
    """A probe brought 4, 6 and 7 above the live stream (held: 3 and 5 missing). Live 3, stamped
    after 4, shows a new instance; 6 and 7, stamped after 3, are its: carried to its epoch, which
    knows it published up to 7."""
    stamp = {b"a0": 0.0, b"a1": 1.0, b"a2": 2.0, b"a4": 10.0, b"b3": 20.0, b"b6": 30.0, b"b7": 40.0}
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=stamp.get)
    for q in range(3):
        s.live(q, b"a%d" % q)
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    for q, payload in ((2, b"a2"), (4, b"a4"), (6, b"b6"), (7, b"b7")):
        s.replayed(probe.request_id, q, payload)
    s.replay_finished(probe.request_id, complete=True)
    out = s.live(3, b"b3")
    assert [a for a in out if isinstance(a, Lost | Deliver | Reset)] == [
        Lost(3, 3, "publisher_restart", 0),
        Deliver(4, b"a4", 0),
        Reset(1, "publisher_restart"),
    ]
    assert s.held == {3: b"b3", 6: b"b6", 7: b"b7"} and s.known_top == 7


def test_a_new_instances_own_live_batch_below_what_its_replay_brought_is_its() -> None:
    """Instance 0's batches 3..5 were replayed ahead of its live stream; then an empty answer showed
    a restart. Instance 1's replay brings 0..2 and 4 (3 dropped), then its live batch 3 comes: it
    is instance 1's (the copies instance 0's replay left are not compared with it)."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    for q in range(2, 6):
        s.replayed(probe.request_id, q, p(0, q))
    s.replay_finished(probe.request_id, complete=True)
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    out = s.replay_finished(probe.request_id, complete=True)  # nothing from 5 on: a restart
    assert Reset(1, "publisher_restart") in out
    (req,) = [a for a in out if isinstance(a, RequestReplay)]
    for q in (0, 1, 2, 4):
        s.replayed(req.request_id, q, p(1, q))
    s.replay_finished(req.request_id, complete=True)
    assert s.live(3, p(1, 3)) == [Deliver(3, p(1, 3), 1), Deliver(4, p(1, 4), 1)] and s.epoch == 1


@pytest.mark.parametrize("uuids", [False, True], ids=["no UUID", "UUIDs"])
def test_late_batches_of_an_instance_gone_before_a_restart_a_replay_showed_stay_out_of_its_epoch(uuids: bool) -> None:
    """breaker58 B2: instance 0 delivered 0..2; instance 1 ran and died while the stream read its
    queue late (instance 1's 0..2 still in it), and instance 2 runs now. The idle probe's replay
    answers nothing from seq 2: a restart, and the replay from seq 0 delivers instance 2's 0..1 in
    epoch 1. Then instance 1's batches are read: with no batch showing the new instance, its epoch
    had no clock floor, and instance 1's seq 2 went out in epoch 1 (with UUIDs, the first one read,
    dropped, still gave the epoch its UUID). Instance 2's next live batch then opened epoch 2 and
    its 0..2 went out again (I1). Stamped before the epoch's first batch, they are an earlier
    instance's now, and their UUID is not the epoch's."""
    ids = {n: bytes([n + 1]) * 16 if uuids else None for n in range(3)}
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25)

    out = serve(s, s.start(), {0: p(0, 0), 1: p(0, 1)}, ids[0])
    out += s.live(2, p(0, 2), instance=ids[0])
    now = {0: p(2, 0), 1: p(2, 1)}
    out += serve(s, s.probe(), now, ids[2])
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, "publisher_restart")]
    for q in range(3):
        out += s.live(q, p(1, q), instance=ids[1])
    now[2] = p(2, 2)
    got = s.live(2, p(2, 2), instance=ids[2])
    out += got + serve(s, got, now, ids[2])
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, "publisher_restart")]
    assert [d for d in delivered(out) if d[0] == 1] == [(1, p(2, q)) for q in range(3)]


def _restart_then_clock_back(
    answerer: str, answers_held: bool = True, silent: frozenset[int] = frozenset()
) -> tuple[StreamSequencer, list[Action]]:
    """Instance A: 0..5 delivered live. The connection drops; B restarts and publishes 0 and 1
    unseen (ts 2000.0, 2000.1), then its clock steps back 3 s: its live 2..4 (ts 1997.2..) show
    the restart and wait for 0..1. The replay is answered by ``answerer``: B itself, or C, an
    instance after B (its 0..1 stamped later than B's 2..4, its 2 other bytes, or none when
    ``answers_held`` is false: C has not published that far). ``silent``: the replays (counted
    from 0) that get no reply and no end marker (timed out)."""
    stamps: dict[bytes, float] = {}

    def stamped(name: str, seq: int, at: float) -> bytes:
        payload = f"{name}:{seq}".encode()
        stamps[payload] = at
        return payload

    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=stamps.get, clock_skew=0.25)
    out: list[Action] = []
    for q in range(6):
        out += s.live(q, stamped("A", q, 1000.0 + q))
    out += s.disconnected(1006.0)
    b = {q: stamped("B", q, 2000.0 + 0.1 * q if q < 2 else 1997.0 + 0.1 * q) for q in range(5)}
    for q in (2, 3, 4):
        out += s.live(q, b[q])
    published = b if answerer == "B" else {q: stamped("C", q, 2001.0 + 0.1 * q) for q in range(3 if answers_held else 2)}
    pending = [a for a in out if isinstance(a, RequestReplay)]
    served = 0
    while pending:
        req = pending.pop(0)
        step: list[Action] = []
        for q in sorted(published) if served not in silent else ():
            if q < req.start:
                continue
            step += s.replayed(req.request_id, q, published[q])
            if 0 <= req.until <= q:
                break
        step += s.replay_finished(req.request_id, complete=served not in silent)
        served += 1
        out += step
        pending += [a for a in step if isinstance(a, RequestReplay)]
        if len(out) > 200:
            break
    return s, out


@pytest.mark.parametrize("silent", [frozenset(), frozenset({1}), frozenset({1, 2})])
def test_an_engine_clock_stepped_back_right_after_a_restart_keeps_the_new_instance_in_one_epoch(
    silent: frozenset[int],
) -> None:
    """breaker119 3 (8 of 8 runs, NTP steps of 0.2 to 2 s): the replay's 0..1, stamped later than
    the live 2..4 they fill the gap below, were taken for a third instance: 0..1 announced lost,
    and B's 0..7 delivered again in another epoch (I1, I2). Only the clocks said so: the reply at
    seq 2, asked for alone, has B's very bytes, so 0..1 are B's. That request timing out is asked
    again, as any replay (breaker120 1: after one timeout the clocks decided, 4 of 4)."""
    s, out = _restart_then_clock_back("B", silent=silent)
    assert [a.reason for a in out if isinstance(a, Reset)] == ["publisher_restart"]
    assert not [a for a in out if isinstance(a, Lost)]
    assert [(a.seq, a.payload) for a in out if isinstance(a, Deliver) and a.epoch == s.epoch] == [
        (q, f"B:{q}".encode()) for q in range(5)
    ]


@pytest.mark.parametrize("answers_held", [True, False])
def test_replies_stamped_after_the_batches_waiting_are_still_another_instances_when_the_bytes_differ(answers_held: bool) -> None:
    """The same, but C (after B) answers: its reply at seq 2 has other bytes, or it has none
    (it has not got that far): a third instance, as the clocks said."""
    s, out = _restart_then_clock_back("C", answers_held)
    assert [a.reason for a in out if isinstance(a, Reset)] == ["publisher_restart", "publisher_restart"]
    by_epoch: dict[int, set[bytes]] = {}
    for a in out:
        if isinstance(a, Deliver):
            by_epoch.setdefault(a.epoch, set()).add(a.payload[:1])
    assert all(len(names) == 1 for names in by_epoch.values()), by_epoch  # I1
    assert by_epoch[s.epoch] == {b"C"}
