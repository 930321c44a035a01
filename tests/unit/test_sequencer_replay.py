"""The sequencer when replays fail: silent or broken-off replays, exhausted attempts in and out of
doubt, empty replays that reveal a restart, and the head of a stream met late. Found missing by
mutation testing (tools/mutants.py).

Payloads are ``instance:seq`` and the engine ts is ``instance * 1e6 + seq`` (a later instance has
a later clock), as in ``test_sequencer_instances.py``.
"""

from __future__ import annotations

import pytest

from bridge.sequencer import Action, Deliver, Duplicate, Gap, Lost, RequestReplay, Reset, StreamSequencer, fingerprint


def p(instance: int, seq: int) -> bytes:
    return f"{instance}:{seq}".encode()


def ts(payload: bytes) -> float:
    instance, seq = payload.decode().split(":")
    return int(instance) * 1e6 + int(seq)


def requests(actions: list[Action]) -> list[RequestReplay]:
    return [a for a in actions if isinstance(a, RequestReplay)]


def settled(actions: list[Action]) -> list[Action]:
    """What reaches the sinks, in order (Deliver, Lost, Reset)."""
    return [a for a in actions if isinstance(a, Deliver | Lost | Reset)]


def only_request(actions: list[Action]) -> RequestReplay:
    (req,) = requests(actions)
    return req


def seqr(**kw: object) -> StreamSequencer:
    return StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, max_attempts=3, **kw)  # type: ignore[arg-type]


# -- attempts -------------------------------------------------------------------------------------


def test_retries_count_up_from_a_first_attempt_sent_at_once() -> None:
    """``attempt`` is how many tries came before (the runtime backs off before each retry)."""
    s = seqr()
    assert only_request(s.start()).attempt == 0
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(3, p(0, 3)))
    assert s.replaying
    attempts = [req.attempt]
    for _ in range(2):
        req = only_request(s.replay_finished(req.request_id, complete=False))
        attempts.append(req.attempt)
    assert attempts == [0, 1, 2]


def test_a_replay_that_breaks_off_right_at_the_next_seq_loses_only_that_batch() -> None:
    """The engine answers (its verification reply comes) but the connection drops before the next
    seq, every time (a batch over ingest.max_frame_bytes): that one batch is lost, no more."""
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(3, p(0, 3)))
    for attempt in range(3):
        out = s.replayed(req.request_id, 0, p(0, 0))  # the verification reply, then nothing
        out += s.replay_finished(req.request_id, complete=False)
        if attempt < 2:
            assert settled(out) == []
            req = only_request(out)
    assert settled(out) == [Lost(1, 1, "replay_unavailable", 0)]
    req = only_request(out)
    assert (req.start, req.until) == (0, 2)  # 2 is still fetched (from the anchor, which verifies)
    out = s.replayed(req.request_id, 0, p(0, 0)) + s.replayed(req.request_id, 2, p(0, 2))
    assert settled(out) == [Deliver(2, p(0, 2), 0, replayed=True), Deliver(3, p(0, 3), 0)]


def test_silent_replays_lose_the_span_below_the_lowest_held_batch_then_fetch_the_next_gap() -> None:
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(5, p(0, 5)))
    s.live(7, p(0, 7))
    for _ in range(3):
        out = s.replay_finished(req.request_id, complete=False)
        req = only_request(out)
        if not settled(out):
            assert req.until == 7  # up to the lowest held batch, and the one set aside (its reply confirms it)
    assert settled(out) == [Lost(1, 4, "replay_unavailable", 0), Deliver(5, p(0, 5), 0)]
    assert (req.start, req.until) == (5, 7)  # 6 is fetched, not given up with 1..4 (and 7 confirmed)
    assert req.attempt == 0  # a new gap: its first attempt goes out at once


def test_silent_replays_reach_a_gap_up_to_the_last_live_seq_not_kept() -> None:
    """Past max_held a live batch is not kept: its seq is still owed, and settled in turn."""
    s = seqr(max_held=1)
    s.live(0, p(0, 0))
    req = only_request(s.live(3, p(0, 3)))
    s.live(4, p(0, 4))  # not kept
    out: list[Action] = []
    untils = []
    for _ in range(6):
        got = s.replay_finished(req.request_id, complete=False)
        out += got
        if not requests(got):
            break
        req = only_request(got)
        untils.append(req.until)
    assert settled(out) == [Lost(1, 2, "replay_unavailable", 0), Deliver(3, p(0, 3), 0), Lost(4, 4, "replay_unavailable", 0)]
    assert not s.replaying and s.delivered == 4
    assert 4 in untils  # after 3: up to the last live seq, not to the end


# -- in doubt ---------------------------------------------------------------------------------------


def test_after_a_disconnect_an_open_gap_is_asked_for_at_once_and_a_replay_in_flight_is_dropped() -> None:
    s = seqr()
    s.live(0, p(0, 0))
    first = only_request(s.live(3, p(0, 3)))
    stale = only_request(s.replay_finished(first.request_id, complete=False))
    assert stale.attempt == 1
    fresh = only_request(s.disconnected())  # verification starts afresh: a first attempt
    assert fresh.request_id != stale.request_id and fresh.attempt == 0
    assert s.replayed(stale.request_id, 1, p(0, 1)) == []  # asked of the instance that went away
    assert s.replay_finished(stale.request_id, True) == []


def test_a_probe_in_flight_is_forgotten_at_a_disconnect() -> None:
    s = seqr()
    s.live(0, p(0, 0))
    probe = only_request(s.probe())
    assert s.disconnected() == []  # no gap: nothing to ask yet
    assert s.replayed(probe.request_id, 1, p(1, 1)) == []
    assert s.replay_finished(probe.request_id, True) == []
    assert not s.replaying


def test_in_doubt_a_silent_replay_socket_settles_the_old_gap_and_stays_in_doubt() -> None:
    """Nothing live since the disconnect: the old instance's gap is settled (what is held
    delivered, the rest up to the last seq it was seen to publish lost), continuity still unknown."""
    s = seqr(max_held=1)
    s.live(0, p(0, 0))
    s.live(3, p(0, 3))
    s.live(4, p(0, 4))  # not kept
    req = only_request(s.disconnected())
    for attempt in (1, 2):
        out = s.replay_finished(req.request_id, complete=False)
        assert settled(out) == []
        req = only_request(out)
        assert req.attempt == attempt
    out = s.replay_finished(req.request_id, complete=False)
    assert out == [Lost(1, 2, "replay_unavailable", 0), Deliver(3, p(0, 3), 0), Lost(4, 4, "replay_unavailable", 0)]
    assert s.in_doubt and not s.replaying


def test_in_doubt_a_silent_replay_socket_ends_in_presumed_continuity() -> None:
    """Live batches after a disconnect wait for verification; when the replay socket never
    answers, after max_attempts the instance is presumed the same (docs/concepts/correctness.md, "Instance detection")."""
    s = seqr()
    for q in range(2):
        s.live(q, p(0, q))
    s.disconnected()
    req = only_request(s.live(2, p(0, 2)))
    assert s.live(3, p(0, 3)) == []  # waits with the first
    for attempt in (1, 2):
        out = s.replay_finished(req.request_id, complete=False)
        assert settled(out) == []
        req = only_request(out)
        assert req.attempt == attempt
    out = s.replay_finished(req.request_id, complete=False)
    assert out == [Deliver(2, p(0, 2), 0), Deliver(3, p(0, 3), 0)]
    assert not s.in_doubt and s.epoch == 0 and s.known_top == 3


def test_an_empty_replay_while_live_batches_wait_unverified_is_a_new_instance() -> None:
    """The engine answered (end marker) with nothing from our last seq on: the instance that
    published it would still hold it, so the live batches since the disconnect are another's."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected()
    req = only_request(s.live(3, p(1, 3)))
    out = s.replay_finished(req.request_id, complete=True)
    assert settled(out) == [Lost(3, 3, "publisher_restart", 0), Reset(1, "publisher_restart")]
    assert only_request(out).start == 0


@pytest.mark.parametrize("max_attempts", [1, 3])
def test_an_empty_replay_asked_before_the_live_batches_waiting_now_is_not_a_new_instance(max_attempts: int) -> None:
    """Resumed in an epoch with nothing of it delivered (a removed stream's SourceReset handed on):
    the replay from 0 is answered (end marker, nothing buffered yet) before the engine publishes
    0..1, which are read live before that answer. Those were not published when the engine
    answered: no restart (nothing announced lost, no new epoch), and no attempt used up either
    (not delivered unverified): the next replay verifies them.
    (tests/integration/test_resume_faults.py, a source re-added after a restart, was flaky on it.)"""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, max_attempts=max_attempts, epoch=2, delivered=-1)
    req = only_request(s.start())
    assert req.start == 0 and s.in_doubt
    assert s.live(0, p(1, 0)) + s.live(1, p(1, 1)) == []  # wait, unverified, for the replay in flight
    out = s.replay_finished(req.request_id, complete=True)
    assert settled(out) == [] and s.epoch == 2
    req = only_request(out)  # asked again, now that they are known published
    out = s.replayed(req.request_id, 0, p(1, 0)) + s.replayed(req.request_id, 1, p(1, 1))
    out += s.replay_finished(req.request_id, complete=True)
    assert [(a.epoch, a.seq) for a in settled(out)] == [(2, 0), (2, 1)] and not s.in_doubt


def test_an_empty_replay_after_the_buffer_was_seen_to_work_is_a_new_instance() -> None:
    s = seqr()
    s.live(0, p(0, 0))
    probe = only_request(s.probe())
    s.replayed(probe.request_id, 0, p(0, 0))  # the buffer works: it holds our last seq
    assert settled(s.replay_finished(probe.request_id, complete=True)) == []
    req = only_request(s.live(2, p(1, 2)))  # a gap: 1 missing
    out = s.replay_finished(req.request_id, complete=True)  # and nothing from 0 on any more
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, "publisher_restart")]
    # Nothing of the new instance known yet: its own empty answer proves nothing more.
    out = s.replay_finished(only_request(out).request_id, complete=True)
    assert not [a for a in out if isinstance(a, Reset)] and s.epoch == 1


def test_an_empty_replay_from_an_engine_without_a_buffer_is_not_a_restart() -> None:
    """An engine whose replay socket never brought anything (its buffer is off): an empty answer
    proves nothing, and the gap is settled as unavailable instead."""
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(2, p(0, 2)))
    out: list[Action] = []
    for _ in range(3):
        got = s.replay_finished(req.request_id, complete=True)
        out += got
        if requests(got):
            req = only_request(got)
    assert settled(out) == [Lost(1, 1, "replay_unavailable", 0), Deliver(2, p(0, 2), 0)]


def test_a_second_disconnect_after_which_the_restart_shows_keeps_no_doubt() -> None:
    """Two disconnects, the new instance's first batch stamped after the second notice: the
    instance connected now is the one that showed; its epoch starts verified."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, clock_skew=0.25)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    s.disconnected(now=20.0)  # a blip
    out = s.live(0, p(1, 0))  # instance 1's clock is at 1e6: after both notices
    assert Reset(1, "publisher_restart") in out and not s.in_doubt
    assert settled(s.live(1, p(1, 1))) == [Deliver(1, p(1, 1), 1)]


# -- live batches ---------------------------------------------------------------------------------


def test_without_replay_on_start_the_head_of_a_new_stream_is_announced_joined_late() -> None:
    s = StreamSequencer(can_replay=True, replay_on_start=False)
    assert s.live(5, p(0, 5)) == [Lost(0, 4, "joined_late", 0), Deliver(5, p(0, 5), 0)]


def test_a_stream_joined_at_seq_1_without_replay_loses_seq_0_as_joined_late_only() -> None:
    s = StreamSequencer(can_replay=False, replay_on_start=False)
    assert s.live(1, p(0, 1)) == [Lost(0, 0, "joined_late", 0), Deliver(1, p(0, 1), 0)]


def test_only_the_head_of_a_stream_is_joined_late() -> None:
    s = StreamSequencer(can_replay=False, replay_on_start=False)
    assert s.live(0, p(0, 0)) == [Deliver(0, p(0, 0), 0)]
    assert s.live(3, p(0, 3)) == [Gap(1, 2), Lost(1, 2, "no_replay", 0), Deliver(3, p(0, 3), 0)]


def test_a_live_batch_resumed_at_the_checkpoint_seq_without_fingerprint_is_a_restart() -> None:
    """Nothing to compare with: a live seq at or below the checkpoint's, as the first message
    after a bridge restart, comes from a new instance (live seqs never repeat)."""
    for at in (0, 5):
        s = StreamSequencer(can_replay=True, replay_on_start=True, epoch=2, delivered=at)
        assert s.live(at, p(1, at))[0] == Reset(3, "publisher_restart")


def test_a_checkpoint_without_fingerprint_cannot_prove_a_restart() -> None:
    """A position saved with no fingerprint (ts and crc unknown) verifies nothing: the replay of
    the same instance is accepted, whatever its engine ts."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, epoch=2, delivered=3, delivered_fp=(None, None))
    req = only_request(s.start())
    out: list[Action] = []
    for q in range(req.start, 6):
        out += s.replayed(req.request_id, q, p(0, q))
    assert settled(out) == [Deliver(4, p(0, 4), 2, replayed=True), Deliver(5, p(0, 5), 2, replayed=True)]


def test_a_late_batch_of_an_earlier_instance_is_told_by_the_ts_in_its_payload() -> None:
    """As in test_sequencer_instances, but the caller does not pass the ts: it is read from the payload."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    assert isinstance(s.live(0, p(1, 0))[-2], Reset)
    assert s.live(3, p(0, 3)) == [Duplicate(3)]


def test_batches_of_the_new_instance_stamped_in_the_same_instant_are_all_delivered() -> None:
    stamp = {p(0, q): float(q) for q in range(3)} | {p(1, 0): 100.0, p(1, 1): 100.0}
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=stamp.__getitem__)
    for q in range(3):
        s.live(q, p(0, q))
    out = s.live(0, p(1, 0)) + s.live(1, p(1, 1))
    assert [(a.seq, a.epoch) for a in out if isinstance(a, Deliver)] == [(0, 1), (1, 1)]


def test_a_replayed_copy_of_a_held_batch_is_a_duplicate() -> None:
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(3, p(0, 3)))
    out = s.replayed(req.request_id, 0, p(0, 0)) + s.replayed(req.request_id, 3, p(0, 3))  # 1, 2 dropped
    assert out[-1] == Duplicate(3) and settled(out) == []


# -- restarts found by a replay -------------------------------------------------------------------


def test_the_reply_that_reveals_a_restart_is_kept_for_the_new_epoch() -> None:
    """I4: the batch whose reply showed the restart reached the bridge; it is never announced lost,
    even when the replays after it go silent."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    req = only_request(s.live(5, p(1, 5)))  # instance 1 passed our position unseen
    out = s.replayed(req.request_id, 2, p(1, 2))  # the anchor: other bytes
    assert Reset(1, "publisher_restart") in out
    req = only_request(out)
    for _ in range(3):
        got = s.replay_finished(req.request_id, complete=False)
        out += got
        if requests(got):
            req = only_request(got)
    delivered_new = [a.payload for a in out if isinstance(a, Deliver) and a.epoch == 1]
    lost_new = [(a.from_seq, a.to_seq) for a in out if isinstance(a, Lost) and a.epoch == 1]
    assert p(1, 2) in delivered_new
    assert all(not a <= 2 <= b for a, b in lost_new)


def test_a_fresh_streams_head_that_no_replay_brings_was_published_before_the_bridge_joined() -> None:
    s = seqr()
    req = only_request(s.live(5, p(0, 5)))
    for _ in range(3):
        out = s.replay_finished(req.request_id, complete=False)
        if requests(out):
            req = only_request(out)
    assert settled(out) == [Lost(0, 4, "joined_late", 0), Deliver(5, p(0, 5), 0)]


def test_a_gap_that_only_a_probes_replies_revealed_is_asked_for_again() -> None:
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    probe = only_request(s.probe())
    out = s.replayed(probe.request_id, 2, p(0, 2))  # the anchor
    out += s.replayed(probe.request_id, 4, p(0, 4))  # 3 dropped by the ROUTER
    out += s.replay_finished(probe.request_id, complete=True)
    req = only_request(out)
    assert req.until == 3 and s.known_top == 4
    out = s.replayed(req.request_id, 2, p(0, 2)) + s.replayed(req.request_id, 3, p(0, 3))
    assert settled(out) == [Deliver(3, p(0, 3), 0, replayed=True), Deliver(4, p(0, 4), 0)]


# -- live batches below what a replay brought ------------------------------------------------------


def replayed_ahead_of_live() -> StreamSequencer:
    """Live 0..2, then a probe delivered 3..5 from the replay socket: the live stream is behind."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    probe = only_request(s.probe())
    for q in range(2, 6):
        s.replayed(probe.request_id, q, p(0, q))
    s.replay_finished(probe.request_id, complete=True)
    assert s.delivered == 5 and s.known_top == 5 and s.last_live == 2
    return s


def test_a_late_live_copy_of_a_replayed_batch_is_a_duplicate() -> None:
    s = replayed_ahead_of_live()
    assert s.live(4, p(0, 4)) == [Duplicate(4)]
    assert s.epoch == 0


def test_a_live_seq_below_the_last_delivered_with_a_later_clock_is_a_new_instance() -> None:
    s = replayed_ahead_of_live()
    out = s.live(4, p(1, 4))  # above the last live seq, below the last delivered, stamped after it
    assert Reset(1, "publisher_restart") in out
    assert s.epoch == 1


def test_a_late_live_copy_stamped_in_the_same_instant_as_the_last_delivered_is_a_duplicate() -> None:
    stamp = {p(0, q): float(min(q, 4)) for q in range(6)}  # 4 and 5 in the same instant
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=stamp.__getitem__)
    for q in range(3):
        s.live(q, p(0, q))
    probe = only_request(s.probe())
    for q in range(2, 6):
        s.replayed(probe.request_id, q, p(0, q))
    assert s.live(4, p(0, 4)) == [Duplicate(4)]


def test_a_stream_recognises_the_late_live_copies_of_the_1024_batches_replayed_first() -> None:
    """A late live copy of a replayed batch is told by its bytes, for the first 1024 batches
    replayed above the live stream (the memory of a stream stays bounded). In doubt, a batch the
    stream cannot tell so (older bytes of another instance? its own?) is asked for by replay."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    s.live(0, p(0, 0))
    s.live(1, p(0, 1))
    req = only_request(s.live(3, p(0, 3)))  # the last seq live, above a gap: asked for from 1
    for q in range(1, 1030):  # from the last delivered (which verifies), 4..1029 above the live stream
        s.replayed(req.request_id, q, p(0, q))
    s.replay_finished(req.request_id, complete=True)
    assert s.delivered == 1029 and not s.replaying
    s.disconnected(now=2000.0)
    assert s.live(1027, p(0, 1027)) == [Duplicate(1027)]  # the 1024th replayed above it: a copy
    out = s.live(1028, p(0, 1028))  # the 1025th: not remembered (nor the last delivered): asked of the engine
    assert out[0] == Duplicate(1028) and len(requests(out)) == 1


@pytest.mark.parametrize("clock", [1.5, 2.0])
def test_in_doubt_a_late_batch_the_stream_cannot_tell_is_asked_for_by_a_first_attempt(clock: float) -> None:
    """A replay brought 2..3 ahead of the live stream; in doubt, after a probe that went silent
    (one attempt counted), a live seq 2 with other bytes and an earlier clock (or the same
    instant: not later) comes: not a copy, not provably another instance's. A replay asks whose
    it is: a new question, attempt 0."""
    stamp = {b"a0": 0.0, b"a1": 1.0, b"a2": 2.0, b"a3": 3.0, b"b2": clock}
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=stamp.__getitem__)
    s.live(0, b"a0")
    s.live(1, b"a1")
    probe = only_request(s.probe())
    for q in (1, 2, 3):
        s.replayed(probe.request_id, q, b"a%d" % q)
    s.replay_finished(probe.request_id, complete=True)
    s.disconnected(now=10.0)
    probe = only_request(s.probe())
    assert s.replay_finished(probe.request_id, complete=False) == [] and not s.replaying and s.in_doubt
    assert s.live(2, b"b2") == [Duplicate(2), RequestReplay(probe.request_id + 1, 3, 3, 0)]


# -- resuming ---------------------------------------------------------------------------------------


def test_a_sequencer_resumed_from_another_ones_resume_point_verifies_the_same_instance() -> None:
    """What a stream removed and added back (or a retired pipeline) starts from."""
    first = seqr()
    for q in range(4):
        first.live(q, p(0, q))
    point = first.resume_point()
    assert point == (0, 3, fingerprint(ts(p(0, 3)), p(0, 3)), 3)
    epoch, delivered, fp, anchor = point
    for instance, restarted in ((0, False), (1, True)):
        s = seqr(epoch=epoch, delivered=delivered, delivered_fp=fp, anchor=anchor)
        req = only_request(s.start())
        assert req.start == 3
        out = s.replayed(req.request_id, 3, p(instance, 3)) + s.replayed(req.request_id, 4, p(instance, 4))
        assert (Reset(1, "publisher_restart") in out) is restarted


def test_a_replay_that_brings_one_more_batch_each_time_is_never_given_up() -> None:
    """Progress is not failure: attempts count only replays that delivered nothing."""
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(6, p(0, 6)))
    out: list[Action] = []
    for q in range(1, 6):  # each replay: the verification reply and one new batch, then it breaks off
        got = s.replayed(req.request_id, q - 1, p(0, q - 1)) + s.replayed(req.request_id, q, p(0, q))
        got += s.replay_finished(req.request_id, complete=False)
        out += got
        if requests(got):
            req = only_request(got)
    assert not [a for a in out if isinstance(a, Lost)]
    assert [a.seq for a in out if isinstance(a, Deliver)] == [1, 2, 3, 4, 5, 6]


def test_after_a_disconnect_and_a_silent_probe_the_next_replay_is_a_first_attempt() -> None:
    for then in ("live", "probe"):
        s = seqr()
        s.live(0, p(0, 0))
        assert s.disconnected() == []  # no gap: nothing to ask
        probe = only_request(s.probe())
        assert probe.attempt == 0
        assert s.replay_finished(probe.request_id, complete=False) == []  # nothing waits: no retry
        req = only_request(s.live(1, p(0, 1)) if then == "live" else s.probe())
        assert req.attempt == 0, then


def test_a_reply_below_the_verification_point_is_a_duplicate() -> None:
    s = seqr()
    for q in range(4):
        s.live(q, p(0, q))
    probe = only_request(s.probe())
    assert probe.start == 3
    assert s.replayed(probe.request_id, 1, p(0, 1)) == [Duplicate(1)]


def test_in_doubt_with_nothing_held_the_whole_span_from_the_first_missing_seq_is_settled() -> None:
    s = seqr(max_held=0)  # nothing kept: every live batch past a gap is left to the replay
    s.live(0, p(0, 0))
    s.live(3, p(0, 3))
    req = only_request(s.disconnected())
    for _ in range(2):
        req = only_request(s.replay_finished(req.request_id, complete=False))
    assert s.replay_finished(req.request_id, complete=False) == [Lost(1, 3, "replay_unavailable", 0)]


def test_a_stream_resumed_in_doubt_counts_each_disconnect_since() -> None:
    """Resumed from a checkpoint (in doubt from the start), then two disconnects: the batch that
    shows the new instance was published before the second, so whoever is connected now is not
    known either, and the new epoch starts in doubt."""
    fp = fingerprint(ts(p(0, 2)), p(0, 2))
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=4, delivered=2, delivered_fp=fp)
    req = only_request(s.start())
    s.disconnected(now=10.0)
    s.disconnected(now=2e6)
    out = s.replayed(req.request_id, 2, p(1, 2))  # instance 1, stamped 1e6 + 2: before the second notice
    assert Reset(5, "publisher_restart") in out
    assert s.in_doubt


def test_a_fresh_stream_whose_first_live_seq_is_1_asks_for_seq_0_only() -> None:
    s = seqr()
    assert s.live(1, p(0, 1)) == [Gap(0, 0), RequestReplay(1, 0, 0, 0)]


def test_resumed_at_seq_0_without_fingerprint_the_replay_starts_one_early() -> None:
    """One early, at the checkpoint's seq: its reply shows the engine answering even when the next
    batch never comes."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, delivered=0)
    assert only_request(s.start()).start == 0


def test_a_reply_below_the_anchor_verifies_nothing() -> None:
    s = seqr()
    for q in range(4):
        s.live(q, p(0, q))
    s.disconnected()
    req = only_request(s.live(5, p(0, 5)))
    assert req.start == 3
    assert s.replayed(req.request_id, 1, p(0, 1)) == [Duplicate(1)]
    assert s.in_doubt and s.unverified == {5: p(0, 5)}


def test_a_reply_after_the_anchor_with_an_earlier_clock_is_another_instance() -> None:
    """The anchor's own reply lost (the ROUTER dropped it): the next reply, stamped before the
    anchor batch, cannot come from the instance that published it. Stamped in the same instant,
    it can."""
    for later_ts, restarted in ((12.0, True), (13.0, False)):
        stamp = {p(0, q): 10.0 + q for q in range(4)} | {p(0, 4): 13.0, p(1, 4): later_ts}
        s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=stamp.__getitem__)
        for q in range(4):
            s.live(q, p(0, q))
        probe = only_request(s.probe())
        assert probe.start == 3
        out = s.replayed(probe.request_id, 4, p(1, 4) if restarted else p(0, 4))
        assert (Reset(1, "publisher_restart") in out) is restarted


def test_a_replayed_seq_below_a_held_batch_stamped_in_the_same_instant_is_the_same_instance() -> None:
    stamp = {p(0, q): float(q) for q in range(5)} | {p(0, 5): 4.0, p(0, 6): 6.0}
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=stamp.__getitem__)
    s.live(0, p(0, 0))
    req = only_request(s.live(5, p(0, 5)))  # stamped with 4
    s.live(6, p(0, 6))  # (5 is confirmed: held)
    out = s.replayed(req.request_id, 0, p(0, 0))
    for q in range(1, 5):
        out += s.replayed(req.request_id, q, p(0, q))
    assert not [a for a in out if isinstance(a, Reset)]
    assert [a.seq for a in out if isinstance(a, Deliver)] == [1, 2, 3, 4, 5, 6]


def test_only_batches_stamped_before_the_disconnect_by_more_than_the_clock_skew_stay_the_old_instances() -> None:
    """Read after the disconnect, a batch is the old instance's only when its engine ts is before
    the notice by more than ``clock_skew`` (the engine's clock may be that far ahead)."""
    stamp = {p(0, 0): 1.0, p(0, 1): 9.7, p(0, 2): 9.75, p(0, 3): 9.8, p(1, 0): 100.0}
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=stamp.__getitem__, clock_skew=0.25)
    s.live(0, p(0, 0))
    s.disconnected(now=10.0)
    for q in (1, 2, 3):
        s.live(q, p(0, q))
    out = s.live(0, p(1, 0))
    assert settled(out) == [
        Deliver(1, p(0, 1), 0),  # 9.7 < 10.0 - 0.25
        Lost(2, 3, "publisher_restart", 0),  # 9.75 and 9.8: not before it by more than the skew
        Reset(1, "publisher_restart"),
        Deliver(0, p(1, 0), 1),
    ]


def test_a_silent_replay_for_batch_0_waiting_counts_as_an_attempt() -> None:
    """Resumed in an epoch with nothing delivered: batch 0 comes live, in doubt. The replay asked
    for it (batch 0 waiting: it can verify it) goes silent: that is an attempt, and with one
    allowed the instance is presumed the same."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, max_attempts=1, epoch=2, delivered=-1)
    req = only_request(s.live(0, p(0, 0)))
    assert s.replay_finished(req.request_id, complete=False) == [Deliver(0, p(0, 0), 2)]
    assert not s.in_doubt


def test_in_doubt_live_seqs_not_kept_above_the_settled_gap_are_verified_afresh() -> None:
    """Nothing is kept (``max_held`` 0). Seq 5, read after the disconnect, may be another
    instance's: when the replays stay silent, the old instance's gap (1..3) is settled and a replay
    is asked again for what came after it."""
    s = seqr(max_held=0)
    s.live(0, p(0, 0))
    s.live(3, p(0, 3))
    req = only_request(s.disconnected())
    assert s.live(5, p(1, 5)) == []  # (a replay is in flight)
    for _ in range(2):
        req = only_request(s.replay_finished(req.request_id, complete=False))
    out = s.replay_finished(req.request_id, complete=False)
    assert settled(out) == [Lost(1, 3, "replay_unavailable", 0)]
    req = only_request(out)
    assert (req.start, req.until) == (0, 5) and s.in_doubt  # (from the anchor, which verifies)


def test_batches_verified_above_a_gap_are_known_published() -> None:
    """Batches 4 and 5 came after the disconnect, above a gap (3). The anchor's reply verifies
    the instance and the replay breaks off: 4 and 5 are held, and known published by it."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected()
    req = only_request(s.live(4, p(0, 4)))
    s.live(5, p(0, 5))
    assert s.replayed(req.request_id, 2, p(0, 2)) == [Duplicate(2)]
    s.replay_finished(req.request_id, complete=False)
    assert not s.in_doubt and s.held == {4: p(0, 4), 5: p(0, 5)} and s.known_top == 5


def test_a_first_reply_below_a_held_batch_stamped_in_the_same_instant_is_the_same_instance() -> None:
    """The anchor's reply (3) was dropped: reply 4, the first, is compared with the held batch 5,
    stamped in the same instant: not a later clock, so not another instance."""
    stamp = {p(0, q): float(q) for q in range(5)} | {p(0, 5): 4.0, p(0, 6): 6.0}
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=stamp.__getitem__)
    for q in range(4):
        s.live(q, p(0, q))
    req = only_request(s.live(5, p(0, 5)))
    assert (req.start, req.until) == (3, 5)  # from the anchor to the batch past the gap (its reply confirms it)
    s.live(6, p(0, 6))  # (which confirms it too: held)
    out = s.replayed(req.request_id, 4, p(0, 4))
    assert out == [Deliver(4, p(0, 4), 0, replayed=True), Deliver(5, p(0, 5), 0), Deliver(6, p(0, 6), 0)]


def test_a_reply_dropped_right_after_the_verification_one_is_asked_again_never_announced_lost() -> None:
    """breaker78 B3 (I4): a ROUTER at its high-water mark drops replies, the first excepted. Each
    replay's verification reply (seq 1) came, then seq 2's went missing, then 3's: twice in a row
    was taken for a buffer that no longer holds 2 (replay_buffer_exceeded), though a buffer holds
    consecutive seqs and held 1. It is asked again, and delivered when its reply comes."""
    s = seqr()
    s.live(0, p(0, 0))
    s.live(1, p(0, 1))
    req = only_request(s.live(4, p(0, 4)))  # 2 and 3 missing
    for _ in range(2):  # (max_attempts 3: a third such answer would give up, replay_unavailable)
        out = s.replayed(req.request_id, 1, p(0, 1)) + s.replayed(req.request_id, 3, p(0, 3))
        out += s.replay_finished(req.request_id, complete=True)
        assert [a for a in settled(out) if isinstance(a, Lost | Reset)] == []
        req = only_request(out)
        assert req.start <= 2
    out = s.replayed(req.request_id, 1, p(0, 1)) + s.replayed(req.request_id, 2, p(0, 2))
    out += s.replayed(req.request_id, 3, p(0, 3)) + s.replayed(req.request_id, 4, p(0, 4))
    assert [(a.seq, a.payload) for a in settled(out)] == [(n, p(0, n)) for n in (2, 3, 4)]


def test_a_first_reply_past_the_start_twice_is_still_a_buffer_that_slid() -> None:
    """The other side of the rule above: with no reply below it, a replay whose first reply skips
    the seq needed, twice in a row, is a buffer that no longer holds it."""
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(4, p(0, 4)))  # the replay asks from 0, which verifies
    for attempt in range(2):
        out = s.replayed(req.request_id, 2, p(0, 2)) + s.replay_finished(req.request_id, complete=True)
        if attempt == 0:
            assert [a for a in settled(out) if isinstance(a, Lost)] == []
            req = only_request(out)
    assert [a for a in settled(out) if isinstance(a, Lost)] == [Lost(1, 1, "replay_buffer_exceeded", 0)]
