"""The sequencer at the edges of its rules: the head of a stream, the attempts a replay gets, the
disconnects counted since continuity came into doubt, and what a restart found by a replay
settles under the old epoch, carries into the new one, and forgets.

Payloads are ``instance:seq`` and the engine ts is ``instance * 1e6 + seq`` (a later instance has
a later clock), as in ``test_sequencer_replay.py`` and ``test_sequencer_instances.py``; a test
that needs other clocks stamps its payloads by hand.
"""

from __future__ import annotations

import pytest

from bridge.config import ReplayConfig
from bridge.sequencer import Action, Deliver, Duplicate, Gap, Lost, RequestReplay, Reset, StreamSequencer, fingerprint
from tests.unit.test_sequencer_replay import only_request, p, requests, seqr, settled, ts


def finish_silently(s: StreamSequencer, req: RequestReplay, times: int) -> list[Action]:
    """End ``times`` replays in a row without a reply or end marker, each retry the next one."""
    out: list[Action] = []
    for _ in range(times):
        got = s.replay_finished(req.request_id, complete=False)
        out += got
        if requests(got):
            req = only_request(got)
    return out


def stamped(stamps: dict[bytes, float]) -> StreamSequencer:
    return StreamSequencer(can_replay=True, replay_on_start=True, ts_of=stamps.__getitem__, max_attempts=3, clock_skew=0.25)


# -- the head of a stream ---------------------------------------------------------------------------


def test_a_stream_met_for_the_first_time_knows_of_nothing_published() -> None:
    """I4: nothing was seen, so nothing can be announced lost, even when the replay socket stays
    silent while continuity is in doubt."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, max_attempts=1)
    assert s.known_top == -1 and s.resume_point() == (0, -1, None, -1)
    s.start()
    s.disconnected()
    probe = only_request(s.probe())
    assert s.replay_finished(probe.request_id, complete=False) == []
    assert s.delivered == -1 and s.known_top == -1


def test_the_head_is_joined_late_only_while_nothing_of_the_stream_was_delivered() -> None:
    """Once a replay delivered seq 0 (the bridge was there from the start), a later jump is a
    gap to fetch, not a head published before the bridge joined."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    s.disconnected()
    probe = only_request(s.probe())
    assert s.replayed(probe.request_id, 0, p(0, 0)) == [Deliver(0, p(0, 0), 0, replayed=True)]
    assert s.replay_finished(probe.request_id, complete=True) == []
    out = s.live(5, p(0, 5))
    assert out[0] == Gap(1, 4) and not settled(out)
    assert (only_request(out).start, only_request(out).until) == (0, 4)


def test_after_a_restart_the_new_instances_missing_head_is_not_joined_late() -> None:
    """The bridge was there when the new instance started: its first seqs, unavailable from the
    replay socket, are lost as replay_unavailable in the new epoch, not as joined_late."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, max_attempts=2)
    for q in range(3):
        s.live(q, p(0, q))
    out = s.live(2, p(1, 2))  # the new instance, its 0 and 1 missed
    assert settled(out) == [Reset(1, "publisher_restart")]
    out = finish_silently(s, only_request(out), 2)
    assert settled(out) == [Lost(0, 1, "replay_unavailable", 1), Deliver(2, p(1, 2), 1)]


def test_a_jump_while_a_probe_is_in_flight_is_left_to_it() -> None:
    """The probe reads to the end of the engine's buffer: the live batch waits for its replies,
    no second replay is asked for and no new gap is counted."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    probe = only_request(s.probe())
    assert probe.until == -1
    assert s.live(5, p(0, 5)) == []
    out = s.replayed(probe.request_id, 2, p(0, 2)) + s.replayed(probe.request_id, 3, p(0, 3))
    out += s.replayed(probe.request_id, 4, p(0, 4)) + s.replayed(probe.request_id, 5, p(0, 5))
    assert settled(out) == [
        Deliver(3, p(0, 3), 0, replayed=True),
        Deliver(4, p(0, 4), 0, replayed=True),
        Deliver(5, p(0, 5), 0, replayed=True),  # (the live batch past the gap waits for its reply)
    ]


def test_without_a_fingerprint_the_one_early_reply_is_a_duplicate_and_not_kept() -> None:
    """Resumed without a fingerprint the replay starts at the checkpoint's seq itself: its reply
    is already delivered; nothing at or below ``delivered`` is ever held."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, delivered=3)
    assert s.resume_point() == (0, 3, None, -1)  # no fingerprint, so no seq it belongs to
    req = only_request(s.start())
    assert req.start == 3
    assert s.replayed(req.request_id, 3, b"three") == [Duplicate(3)]
    assert s.held == {}
    assert s.replayed(req.request_id, 4, b"four") == [Deliver(4, b"four", 0, replayed=True)]


def test_only_the_first_live_message_after_resuming_is_judged_against_the_checkpoint() -> None:
    """Resumed without a fingerprint, a first live seq at or below the checkpoint's is a restart
    (live seqs never repeat); once the stream has gone on, a seq at or below what was since settled
    is a duplicate (without a ts, verified by a replay: it could also be a new instance's)."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, delivered=5, known_top=10, max_held=0, max_attempts=1)
    req = only_request(s.live(6, b"six"))  # above the checkpoint: the same instance, presumably
    out = s.replay_finished(req.request_id, complete=False)
    assert out == [Lost(6, 10, "replay_unavailable", 0)]  # the old span settled, still in doubt
    out = s.live(8, b"eight")
    assert out[0] == Duplicate(8) and [type(a) for a in out[1:]] == [RequestReplay]
    assert s.epoch == 0


def test_a_verified_replays_later_replies_are_not_judged_again() -> None:
    """The replies of one replay come from one engine process: once its first reply verified the
    instance, a clock stepping back between two later ones is not a restart."""
    stamps = {p(0, 0): 0.0, p(0, 1): 1.0, p(0, 2): 10.0, p(0, 3): 5.0, p(0, 4): 11.0}
    s = stamped(stamps)
    for q in range(3):
        s.live(q, p(0, q))
    req = only_request(s.live(4, p(0, 4)))
    assert s.replayed(req.request_id, 2, p(0, 2)) == [Duplicate(2)]
    out = s.replayed(req.request_id, 3, p(0, 3)) + s.replayed(req.request_id, 4, p(0, 4))
    assert out == [Deliver(3, p(0, 3), 0, replayed=True), Deliver(4, p(0, 4), 0, replayed=True)]


# -- attempts -------------------------------------------------------------------------------------------


def test_the_default_attempts_are_the_configured_default() -> None:
    """A bare sequencer gives up a silent gap on the same attempt a default deployment does."""
    attempts = ReplayConfig().max_attempts
    s = StreamSequencer(can_replay=True, replay_on_start=True)
    s.live(0, b"0")
    req = only_request(s.live(2, b"2"))
    out = finish_silently(s, req, attempts - 1)
    assert not settled(out)
    assert settled(finish_silently(s, only_request(out[-1:]), 1)) == [Lost(1, 1, "replay_unavailable", 0), Deliver(2, b"2", 0)]


def test_a_new_gap_after_one_that_closed_gets_a_first_attempt() -> None:
    """The retried replay brought the missing seq: the gap closed, and the attempts it took do not
    count against the next one."""
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(2, p(0, 2)))
    retry = only_request(s.replay_finished(req.request_id, complete=False))
    assert retry.attempt == 1
    out = [a for q in range(3) for a in s.replayed(retry.request_id, q, p(0, q))]
    assert settled(out) == [Deliver(1, p(0, 1), 0, replayed=True), Deliver(2, p(0, 2), 0, replayed=True)]
    assert s.replay_finished(retry.request_id, complete=True) == []
    out = s.live(4, p(0, 4))
    assert out[0] == Gap(3, 3) and only_request(out).attempt == 0


def test_progress_after_silent_replays_starts_the_count_again() -> None:
    """Attempts count replays in a row that brought nothing: one that brought a batch resets them,
    so the gap's rest gets max_attempts silent replays of its own before it is given up."""
    s = seqr()
    s.live(0, p(0, 0))
    req = only_request(s.live(5, p(0, 5)))
    req = only_request(s.replay_finished(req.request_id, complete=False))
    assert req.attempt == 1
    out = s.replayed(req.request_id, 0, p(0, 0)) + s.replayed(req.request_id, 1, p(0, 1))
    out += s.replay_finished(req.request_id, complete=False)  # broke off after seq 1
    assert settled(out) == [Deliver(1, p(0, 1), 0, replayed=True)]
    req = only_request(out)
    assert req.attempt == 0
    out = finish_silently(s, req, 2)
    assert not settled(out) and only_request(out[-1:]).attempt == 2
    out = finish_silently(s, only_request(out[-1:]), 1)
    assert settled(out) == [Lost(2, 4, "replay_unavailable", 0), Deliver(5, p(0, 5), 0)]


def test_presumed_continuity_gives_the_gap_below_the_live_batches_attempts_of_its_own() -> None:
    """The silent attempts in doubt were about the instance; once continuity is presumed, the gap
    below the batches that waited is retried, not given up at once."""
    s = seqr()
    for q in range(2):
        s.live(q, p(0, q))
    s.disconnected()
    req = only_request(s.live(3, p(0, 3)))
    out = finish_silently(s, req, 3)
    assert not s.in_doubt and not settled(out)
    req = only_request(out[-1:])
    assert (req.start, req.until, req.attempt) == (1, 2, 1)
    out = finish_silently(s, req, 2)
    assert settled(out) == [Lost(2, 2, "replay_unavailable", 0), Deliver(3, p(0, 3), 0)]


def test_the_new_epochs_first_replay_is_a_first_attempt() -> None:
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    req = only_request(s.live(5, p(1, 5)))
    retry = only_request(s.replay_finished(req.request_id, complete=False))
    assert retry.attempt == 1
    out = s.replayed(retry.request_id, 2, p(1, 2))  # the anchor, from another instance
    assert Reset(1, "publisher_restart") in out
    again = only_request(out)
    assert (again.start, again.until, again.attempt) == (0, 5, 0)  # (to 5: set aside again, for the new instance to confirm)


def test_a_suspicion_of_the_old_epoch_does_not_carry_into_the_new_one() -> None:
    """A loss needs two attempts in a row starting above the same seq of the same instance: one
    replay of the new instance starting above its seq 0 is only a suspicion."""
    s = seqr()
    req = only_request(s.live(2, p(0, 2)))  # 0 and 1 missing
    out = s.replayed(req.request_id, 1, p(0, 1))  # the first reply skips 0: a suspicion
    out += s.replayed(req.request_id, 0, p(0, 0))
    assert [a.seq for a in settled(out)] == [0, 1, 2]
    out = s.live(2, p(1, 2))  # the new instance (0 and 1 missed), found on the live stream
    assert settled(out) == [Reset(1, "publisher_restart")]
    req = only_request(out)
    out = s.replayed(req.request_id, 1, p(1, 1))  # skips 0 too, once
    assert not [a for a in out if isinstance(a, Lost)]
    out += s.replay_finished(req.request_id, complete=True)
    out = s.replayed(only_request(out).request_id, 0, p(1, 0))
    assert settled(out) == [Deliver(0, p(1, 0), 1, replayed=True), Deliver(1, p(1, 1), 1), Deliver(2, p(1, 2), 1)]


# -- disconnects since continuity came into doubt ----------------------------------------------------------


def test_a_stream_resumed_in_doubt_and_disconnected_once_starts_its_new_epoch_verified() -> None:
    """Only one disconnect since the resume: the instance that showed is the one connected now."""
    fp = fingerprint(ts(p(0, 2)), p(0, 2))
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=4, delivered=2, delivered_fp=fp)
    s.disconnected(now=2e6)
    out = s.live(0, p(1, 0))  # below the checkpoint's seq with a later clock: a restart
    assert Reset(5, "publisher_restart") in out and not s.in_doubt
    assert s.live(1, p(1, 1)) == [Deliver(1, p(1, 1), 5)]


def test_two_disconnects_and_a_restart_reply_stamped_within_the_clock_skew_of_the_second() -> None:
    """The reply that shows the new instance was published after the second disconnect unless it
    is stamped before that notice by more than ``clock_skew``: only then is the instance
    connected now unknown, and the new epoch starts in doubt."""
    for stamp, doubt in ((19.75, False), (20.0, False), (19.7, True)):
        stamps = {p(0, q): float(q) for q in range(3)} | {p(1, 2): stamp, p(1, 3): 30.0}
        s = stamped(stamps)
        for q in range(3):
            s.live(q, p(0, q))
        s.disconnected(now=10.0)
        s.disconnected(now=20.0)
        req = only_request(s.live(3, p(1, 3)))
        out = s.replayed(req.request_id, 2, p(1, 2))  # the anchor, from another instance
        assert Reset(1, "publisher_restart") in out
        assert s.in_doubt is doubt, stamp


def test_after_a_restart_that_starts_in_doubt_the_next_one_counts_only_new_disconnects() -> None:
    """Instance 1 showed after two disconnects (its epoch starts in doubt); instance 2 then
    answers the replay with no disconnect since: it is the one connected now, verified."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, clock_skew=0.25)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    s.disconnected(now=3e6)  # instance 1 gone too (noticed late)
    out = s.live(0, p(1, 0))
    assert isinstance(out[0], Reset) and s.in_doubt
    out += s.live(1, p(2, 1))  # instance 2, stamped before that notice
    out = s.replayed(only_request(out).request_id, 0, p(2, 0))
    assert [a for a in out if isinstance(a, Reset)] == [Reset(2, "publisher_restart")]
    assert not s.in_doubt
    assert s.live(2, p(2, 2)) == [Deliver(2, p(2, 2), 2)]


@pytest.mark.parametrize("drops", [1, 2])
def test_disconnects_before_a_verified_instance_do_not_count_after_it(drops: int) -> None:
    """A blip, verified as the same instance, then more disconnects and a restart (its batch's ts
    unknown): one disconnect since the doubt began and the new epoch starts verified; two, and
    the instance connected now is not known either."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=lambda _b: None, clock_skew=0.25)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    req = only_request(s.live(3, p(0, 3)))
    assert s.replayed(req.request_id, 2, p(0, 2)) == [Deliver(3, p(0, 3), 0), Duplicate(2)]
    assert not s.in_doubt
    for n in range(drops):
        s.disconnected(now=20.0 + n)
    out = s.live(0, p(1, 0))
    assert Reset(1, "publisher_restart") in out and s.in_doubt is (drops > 1)


@pytest.mark.parametrize("drops", [1, 2])
def test_disconnects_before_a_restart_do_not_count_after_it(drops: int) -> None:
    """The restart showed after one disconnect (its epoch verified); then more disconnects and
    another restart: counted afresh."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=lambda _b: None, clock_skew=0.25)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    assert Reset(1, "publisher_restart") in s.live(0, p(1, 0)) and not s.in_doubt
    s.live(1, p(1, 1))
    for n in range(drops):
        s.disconnected(now=20.0 + n)
    assert Reset(2, "publisher_restart") in s.live(0, p(2, 0))
    assert s.in_doubt is (drops > 1)


# -- what a restart found by a replay settles, carries and forgets ----------------------------------------


def test_the_old_instances_highest_held_batch_is_delivered_when_the_new_ones_are_carried() -> None:
    """I4 for the old epoch, I1 for the new: held batches stamped before the revealing reply go
    out under the old epoch (all of them), those stamped after it move to the new one."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    req = only_request(s.live(4, p(0, 4)))
    s.live(6, p(0, 6))
    s.live(8, p(1, 8))  # the new instance's, read live
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert settled(out) == [
        Lost(3, 3, "publisher_restart", 0),
        Deliver(4, p(0, 4), 0),
        Lost(5, 5, "publisher_restart", 0),
        Deliver(6, p(0, 6), 0),
        Reset(1, "publisher_restart"),
    ]
    assert sorted(s.held) == [2] and s.waiting == {2, 8}  # (8 set aside again, for the new instance to confirm)


def test_a_held_batch_without_engine_ts_stays_the_old_instances() -> None:
    """Read live before anything was in doubt, a batch whose ts is unknown cannot be shown to be
    the new instance's: it is delivered under the old epoch."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=lambda b: None if b == b"x" else ts(b), max_attempts=3)
    for q in range(3):
        s.live(q, p(0, q))
    req = only_request(s.live(4, b"x"))
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert settled(out) == [Lost(3, 3, "publisher_restart", 0), Deliver(4, b"x", 0), Reset(1, "publisher_restart")]


def test_a_held_batch_stamped_with_the_revealing_replys_ts_at_a_lower_seq_is_the_old_instances() -> None:
    """Equal engine ts: only a higher seq than the revealing reply's makes it the new instance's."""
    stamps = {p(0, 0): 0.0, p(0, 1): 1.0, p(0, 2): 10.0, p(0, 4): 5.0, p(1, 5): 5.0}
    s = stamped(stamps)
    for q in range(3):
        s.live(q, p(0, q))
    req = only_request(s.live(4, p(0, 4)))
    out = s.replayed(req.request_id, 5, p(1, 5))  # the anchor's reply lost; 5 stamped before 2: another instance
    assert settled(out) == [Lost(3, 3, "publisher_restart", 0), Deliver(4, p(0, 4), 0), Reset(1, "publisher_restart")]


def test_the_new_instances_live_batches_past_the_bound_are_still_fetched_in_the_new_epoch() -> None:
    """Carried batches wait for the new epoch's replay from 0 up to the first of them; live seqs
    seen after them but not kept (past max_held) are fetched next, not forgotten."""
    s = seqr(max_held=2)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected()
    req = only_request(s.live(3, p(1, 3)))
    s.live(4, p(1, 4))
    s.live(5, p(1, 5))  # not kept
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert settled(out) == [Reset(1, "publisher_restart")]
    req = only_request(out)
    assert (req.start, req.until) == (0, 2)
    out = s.replayed(req.request_id, 0, p(1, 0)) + s.replayed(req.request_id, 1, p(1, 1)) + s.replayed(req.request_id, 2, p(1, 2))
    out += s.replay_finished(req.request_id, complete=True)
    assert [a.seq for a in settled(out)] == [0, 1, 2, 3, 4]
    req = only_request(out)
    assert req.until == 5
    out = s.replayed(req.request_id, 4, p(1, 4)) + s.replayed(req.request_id, 5, p(1, 5))
    assert settled(out) == [Deliver(5, p(1, 5), 1, replayed=True)]


def test_in_doubt_a_silent_socket_settles_the_new_epoch_up_to_its_highest_held_batch() -> None:
    """The restart was revealed by a replay (the new instance's later batches carried); then the
    connection drops and the replay socket stays silent: every held batch is delivered, the seqs
    between them lost, up to the highest."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    req = only_request(s.live(4, p(1, 4)))
    s.live(6, p(1, 6))
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert settled(out) == [Reset(1, "publisher_restart")]
    req = only_request(s.disconnected())
    out = finish_silently(s, req, 3)
    assert settled(out) == [
        Lost(0, 1, "replay_unavailable", 1),
        Deliver(2, p(1, 2), 1),
        Lost(3, 3, "replay_unavailable", 1),
        Deliver(4, p(1, 4), 1),
        Lost(5, 5, "replay_unavailable", 1),
        Deliver(6, p(1, 6), 1),
    ]


def test_when_the_new_epoch_starts_in_doubt_its_carried_batches_wait_unverified() -> None:
    """Two disconnects, the revealing reply stamped before the second: the carried batches are no
    more verified than the instance connected now."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    s.disconnected(now=3e6)
    req = only_request(s.live(4, p(1, 4)))
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert Reset(1, "publisher_restart") in out and s.in_doubt
    assert s.unverified == {4: p(1, 4)} and 4 not in s.held


def test_a_restart_found_by_a_replay_forgets_the_previous_epochs_clock_floor() -> None:
    """A live batch older than the first one that showed its epoch's instance is a late one of an
    earlier instance; that floor belongs to the epoch: a later instance with a slower clock (another
    host) is not judged by it."""
    stamps = {p(0, 0): 1.0, p(0, 1): 2.0, p(1, 0): 100.0, p(1, 1): 101.0, p(2, 0): 50.0, p(2, 1): 51.0, p(2, 2): 52.0}
    s = stamped(stamps)
    s.live(0, p(0, 0))
    s.live(1, p(0, 1))
    assert Reset(1, "publisher_restart") in s.live(0, p(1, 0))  # the floor of epoch 1: 100
    s.live(1, p(1, 1))
    probe = only_request(s.probe())
    out = s.replayed(probe.request_id, 1, p(2, 1))  # the anchor, other bytes: instance 2
    assert Reset(2, "publisher_restart") in out
    req = only_request(out)
    assert s.live(2, p(2, 2)) == []  # waits for seq 0, not dropped as older than 100
    out = s.replayed(req.request_id, 0, p(2, 0))
    assert settled(out) == [Deliver(0, p(2, 0), 2, replayed=True), Deliver(1, p(2, 1), 2), Deliver(2, p(2, 2), 2)]


def test_right_after_a_restart_the_resume_point_has_no_anchor() -> None:
    """Nothing of the new epoch delivered yet: a sequencer resumed from here has nothing to verify."""
    s = seqr()
    for q in range(3):
        s.live(q, p(0, q))
    req = only_request(s.live(5, p(1, 5)))
    s.replayed(req.request_id, 2, p(1, 2))
    assert s.resume_point() == (1, -1, None, -1)


def test_a_restart_revealed_at_seq_0_delivers_the_new_instances_waiting_batches_after_it() -> None:
    """Resumed at seq 0, the verifying reply shows a new instance: its seq 0 goes out first in the
    new epoch, and the live batch that waited behind it right after."""
    s = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, epoch=4, delivered=0, delivered_fp=fingerprint(ts(p(0, 0)), p(0, 0))
    )
    req = only_request(s.start())
    assert s.live(1, p(1, 1)) == []  # waits, unverified
    out = s.replayed(req.request_id, 0, p(1, 0))
    assert settled(out) == [Reset(5, "publisher_restart"), Deliver(0, p(1, 0), 5, replayed=True), Deliver(1, p(1, 1), 5)]


def test_every_unproven_batch_read_after_the_disconnect_is_announced_lost_under_the_old_epoch() -> None:
    """I1 before I4, and I3: batches stamped after the disconnect but before the reply that shows
    the new instance may come from an instance in between; none is delivered under the old epoch,
    and every one of them is inside its Lost, the highest included."""
    stamps = {p(0, 0): 0.0, p(0, 1): 1.0, p(0, 2): 2.0, b"a3": 11.0, b"a4": 12.0, p(1, 2): 20.0, p(1, 5): 30.0}
    s = stamped(stamps)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=10.0)
    req = only_request(s.live(3, b"a3"))
    s.live(4, b"a4")
    s.live(5, p(1, 5))
    out = s.replayed(req.request_id, 2, p(1, 2))
    assert settled(out)[:2] == [Lost(3, 4, "publisher_restart", 0), Reset(1, "publisher_restart")]
    assert s.held == {2: p(1, 2), 5: p(1, 5)} and s.unverified == {}
