"""A new publisher UUID takes effect once confirmed (issue 29, breaker32 B1): one corrupt or forged
frame under another UUID (or under none, an 8-byte seq frame) must not end the epoch, retire the
engine's own UUID and drop its later batches. Out of doubt (no drop noticed: a restart drops the
connection first) such a frame waits until a second message or a replay reply under its UUID
confirms it, or a message or reply of the epoch's instance refutes it (dead-lettered). The model
with forged UUIDs and restarts nobody noticed is ``UuidModel.forge_uuid`` and
``restart_unnoticed`` in ``test_sequencer_model.py``. Helpers: ``test_sequencer_uuid.py``."""

from __future__ import annotations

import pytest

from bridge.sequencer import (
    INSTANCE_CHANGED,
    PUBLISHER_RESTART,
    Action,
    Deliver,
    Duplicate,
    Lost,
    RequestReplay,
    Reset,
    StreamSequencer,
    Suspect,
    fingerprint,
)
from tests.unit.test_sequencer_uuid import A, B, C, delivered, feed, p, seqr, ts

FORGED = b"f:99"  # (a ts the engine never stamped)


def requests(out: list[Action]) -> list[RequestReplay]:
    return [a for a in out if isinstance(a, RequestReplay)]


def suspects(out: list[Action]) -> list[int]:
    return [a.seq for a in out if isinstance(a, Suspect)]


def test_one_frame_under_another_uuid_is_no_restart_and_the_engine_goes_on() -> None:
    """Before: an immediate restart, A retired, and A's seq 3 dropped as a retired instance's. Now
    A's next batches go out while the replay about the frame decides (a message of A alone could
    be a late one, read interleaved with a genuine new instance's)."""
    s = seqr()
    feed(s, A, range(3))
    out = s.live(3, FORGED, instance=B)
    assert not [a for a in out if isinstance(a, Reset | Deliver)] and s.waiting == {3}
    (ask,) = requests(out)
    assert (ask.start, ask.until) == (2, 3)  # the epoch's last batch and the frame's seq: whoever holds the socket
    out = s.live(3, p(A, 3), instance=A) + s.live(4, p(A, 4), instance=A)
    assert delivered(out) == [(0, 3), (0, 4)] and not suspects(out) and s.waiting == {3}
    out = s.replayed(ask.request_id, 2, p(A, 2), instance=A)
    assert suspects(out) == [3] and s.epoch == 0 and s.sure_instance == A and s.retired_instances == [] and not s.waiting
    assert delivered(feed(s, A, [5])) == [(0, 5)]


def test_a_replay_socket_that_cannot_tell_while_the_engine_goes_on_refutes_it() -> None:
    s = seqr(max_attempts=2)
    feed(s, A, range(3))
    (ask,) = requests(s.live(3, FORGED, instance=B))
    s.live(3, p(A, 3), instance=A)
    (ask,) = requests(s.replay_finished(ask.request_id, complete=False))
    out = s.replay_finished(ask.request_id, complete=False)
    assert suspects(out) == [3] and s.epoch == 0 and not s.waiting


def test_without_replay_a_frame_the_engine_went_on_after_is_dead_lettered_after_64_of_its_messages() -> None:
    s = seqr(replay=False)
    feed(s, A, range(3))
    assert s.live(3, FORGED, instance=B) == []
    out = feed(s, A, range(3, 66))
    assert not suspects(out) and delivered(out) == [(0, n) for n in range(3, 66)]
    out = feed(s, A, [66])
    assert suspects(out) == [3] and delivered(out) == [(0, 66)] and s.epoch == 0 and s.retired_instances == []


def test_without_replay_a_new_instance_read_interleaved_with_the_old_ones_late_batches_loses_nothing() -> None:
    """breaker34 B3: a bound socket reads A5 B0 A6 B1 (B restarted, A's queue still draining).
    Before: B0 was dead-lettered on A6 and announced lost in B's epoch (I4). Now it waits for
    B's confirmation and goes out in B's epoch."""
    s = seqr(replay=False)
    out = feed(s, A, range(6)) + feed(s, B, [0]) + feed(s, A, [6]) + feed(s, B, [1]) + feed(s, A, [7]) + feed(s, B, [2])
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert not suspects(out) and not [a for a in out if isinstance(a, Lost)]
    assert delivered(out) == [(0, n) for n in range(7)] + [(1, 0), (1, 1), (1, 2)]
    assert out[next(i for i, a in enumerate(out) if isinstance(a, Reset)) - 1] == Deliver(6, p(A, 6), 0)


def test_a_gap_waiting_when_the_frame_came_is_fetched_once_it_is_settled() -> None:
    """breaker34 B1: the frame cancels the replay of a gap; the engine's heartbeats (no batch, no
    seq above the held ones) must not leave the gap open once the frame is settled."""
    s = seqr()
    out = feed(s, A, [0, 1, 3, 4])
    assert len(requests(out)) == 1  # (the gap's replay, which the frame cancels)
    (ask,) = requests(s.live(9, FORGED, instance=B))
    assert s.heartbeat(5, A) == []  # (the replay about the frame is in flight)
    out = s.replayed(ask.request_id, 1, p(A, 1), instance=A)
    assert suspects(out) == [9]
    (again,) = requests(out)
    out = [a for n in (1, 2, 3, 4) for a in s.replayed(again.request_id, n, p(A, n), instance=A)]
    assert delivered(out) == [(0, 2), (0, 3), (0, 4)]


def test_a_source_removed_and_added_again_confirms_no_frame_waiting() -> None:
    """breaker34 B2: adding the source again puts continuity in doubt (``disconnected``); that is
    no evidence of a restart, and must not confirm a frame read before the removal."""
    s = seqr()
    feed(s, A, range(3))
    s.live(3, FORGED, instance=B)
    s.detached()
    out = s.disconnected(now=10.0, readded=True)  # (set aside unconfirmed: see breaker52 B2 below)
    assert not [a for a in out if isinstance(a, Reset)] and not s.waiting
    out = s.live(3, p(A, 3), instance=A)
    assert delivered(out) == [(0, 3)] and s.epoch == 0 and s.sure_instance == A


def test_one_frame_without_a_uuid_on_a_uuid_stream_is_refuted_too() -> None:
    """An 8-byte seq frame where the engine sends 24 bytes (a corrupt frame, or a downgrade)."""
    s = seqr()
    feed(s, A, range(3))
    (ask,) = requests(s.live(3, FORGED))
    assert s.heartbeat(3, A) == []  # (the engine goes on: the replay decides)
    out = s.replayed(ask.request_id, 2, p(A, 2))  # (the epoch's last batch, replies without a UUID)
    assert suspects(out) == [3] and s.epoch == 0 and s.sure_instance == A


def test_the_replay_about_it_refutes_it_by_uuid_or_by_the_epochs_last_batch() -> None:
    for instance in (A, None):  # replies with the engine's UUID, or with none (the bytes decide)
        s = seqr()
        feed(s, A, range(3))
        (ask,) = requests(s.live(9, FORGED, instance=B))
        out = s.replayed(ask.request_id, 2, p(A, 2), instance=instance)
        assert suspects(out) == [9] and s.epoch == 0 and s.sure_instance == A
        (again,) = requests(out)  # the replay the stream needs goes on from its position
        assert again.start == 2 and again.until == -1
        assert not s.waiting


def test_an_engine_holding_nothing_at_its_seq_refutes_it() -> None:
    """The engine's buffer was seen at work and holds nothing from the frame's seq on: the one
    that published it would hold it (a frame far ahead, where the epoch's last batch left the
    buffer)."""
    s = seqr()
    feed(s, A, range(3))
    (probe,) = s.probe()
    s.replayed(probe.request_id, 2, p(A, 2), instance=A)
    s.replay_finished(probe.request_id, complete=True)
    (ask,) = requests(s.live(2**63, FORGED, instance=B))
    out = s.replay_finished(ask.request_id, complete=True)
    assert suspects(out) == [2**63] and s.epoch == 0 and not s.waiting


def test_a_restart_nobody_noticed_is_confirmed_by_the_new_instances_reply() -> None:
    """No drop noticed (a missed monitor event): the new instance's first message waits; its
    replay reply under its UUID (or, without UUIDs on replies, its own bytes at that seq)
    confirms it, and the new epoch fetches what it published from seq 0."""
    for instance in (B, None):
        s = seqr()
        feed(s, A, range(3))
        (ask,) = requests(s.live(1, p(B, 1), instance=B))
        assert (ask.start, ask.until) == (1, 2)
        out = s.replayed(ask.request_id, 1, p(B, 1), instance=instance)
        assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
        assert s.sure_instance == B and s.retired_instances == [A] and s.held == {1: p(B, 1)}
        (fetch,) = requests(out)
        assert fetch.start == 0
        out = s.replayed(fetch.request_id, 0, p(B, 0), instance=instance) + s.replayed(fetch.request_id, 1, p(B, 1), instance)
        assert delivered(out) == [(1, 0), (1, 1)]


def test_without_replay_the_next_message_under_its_uuid_confirms_it() -> None:
    s = seqr(replay=False)
    feed(s, A, range(3))
    assert s.live(0, p(B, 0), instance=B) == []
    out = s.live(1, p(B, 1), instance=B)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert delivered(out) == [(1, 0), (1, 1)]
    heartbeat = seqr(replay=False)
    feed(heartbeat, A, range(3))
    assert heartbeat.live(0, p(B, 0), instance=B) == []
    assert Reset(1, INSTANCE_CHANGED) in heartbeat.heartbeat(1, B) and heartbeat.delivered == 0


def test_a_replay_socket_that_cannot_tell_takes_it_on_its_word_after_max_attempts() -> None:
    s = seqr(max_attempts=3)
    feed(s, A, range(3))
    out = s.live(5, p(B, 5), instance=B)
    for _ in range(2):
        (ask,) = requests(out)
        out = s.replay_finished(ask.request_id, complete=False)  # (timed out)
        assert not [a for a in out if isinstance(a, Reset)]
    (ask,) = requests(out)
    assert ask.attempt == 2
    out = s.replay_finished(ask.request_id, complete=False)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)] and s.held == {5: p(B, 5)}


def test_a_drop_after_it_makes_it_a_restart_and_a_drop_before_it_needs_no_confirmation() -> None:
    """A restart drops the connection first: in doubt a new UUID is a restart at once (as
    before); a drop noticed while one waits confirms it the same way."""
    s = seqr()
    feed(s, A, range(3))
    s.live(0, p(B, 0), instance=B)
    out = s.disconnected(now=10.0)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)] and delivered(out) == [(1, 0)]
    t = seqr()
    feed(t, A, range(3))
    t.disconnected(now=10.0)
    assert [a for a in t.live(0, p(B, 0), instance=B) if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]


def test_without_replay_a_new_uuid_right_after_a_drop_is_a_restart_at_once() -> None:
    """breaker47 B2: without a replay endpoint a drop leaves no doubt to settle, yet it is what a
    restart shows first: B's seq 0 read right after it opens B's epoch at once (before, it waited
    for a second message, and a bridge stopped meanwhile announced it lost: I4). A message of A
    after the drop (a blip) and then one under B: B waits for its confirmation as out of doubt."""
    s = seqr(replay=False)
    feed(s, A, range(5))
    s.disconnected(now=10.0)
    assert not s.accept(5, p(A, 5), instance=A)  # (the fast path leaves the drop to live())
    out = s.live(0, p(B, 0), instance=B)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)] and delivered(out) == [(1, 0)]
    assert s.sure_instance == B and s.retired_instances == [A]
    t = seqr(replay=False)
    feed(t, A, range(5))
    t.disconnected(now=10.0)
    assert delivered(feed(t, A, [5])) == [(0, 5)]
    out = t.live(0, p(B, 0), instance=B)
    assert not [a for a in out if isinstance(a, Reset)] and t.waiting == {0}


def test_a_third_uuid_after_it_confirms_it_and_waits_in_its_place() -> None:
    """B came and went (one message) and C publishes now: B's epoch opens with its batch, and C
    waits for its own confirmation; a late message of A is a retired instance's."""
    s = seqr(replay=False)
    feed(s, A, range(3))
    s.live(0, p(B, 0), instance=B)
    out = s.live(0, p(C, 0), instance=C)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)] and delivered(out) == [(1, 0)]
    assert s.sure_instance == B and s.waiting == {0}
    assert s.live(3, p(A, 3), instance=A) == [Duplicate(3)]
    out = s.live(1, p(C, 1), instance=C)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(2, INSTANCE_CHANGED)] and delivered(out) == [(2, 0), (2, 1)]


def test_a_heartbeat_far_ahead_that_two_replays_refute_is_never_announced_lost() -> None:
    """breaker32 B3 (a forged or corrupt heartbeat): its next seq was taken as published, and the
    engine's next restart announced 3..2^63-2 lost (9.2e18 batches). Now it is a claim that the
    replay it asks for confirms (a reply at or past it) or, twice answered by the same instance to
    its end marker without it, refutes. A genuine one the engine restarts before fetching is still
    settled (announced lost) with the old epoch."""
    s = seqr()
    feed(s, A, range(3))
    (ask,) = s.heartbeat(2**63, A)
    assert isinstance(ask, RequestReplay) and ask.until == -1 and s.known_top == 2**63 - 1
    for _ in range(2):
        s.replayed(ask.request_id, 2, p(A, 2), instance=A)
        assert s.replay_finished(ask.request_id, complete=True) == []
        if _ == 0:
            (ask,) = s.probe()
            assert isinstance(ask, RequestReplay)
    assert s.known_top == 2
    out = feed(s, B, [0, 1])
    assert [a for a in out if isinstance(a, Lost)] == [] and Reset(1, INSTANCE_CHANGED) in out
    genuine = seqr()
    feed(genuine, A, range(3))
    genuine.heartbeat(6, A)  # 3..5 published, the replay not answered yet: the engine restarts
    genuine.disconnected(now=10.0)
    out = feed(genuine, B, [0])
    assert [a for a in out if isinstance(a, Lost)] == [Lost(3, 5, INSTANCE_CHANGED, 0)]


def test_a_new_instance_met_by_its_heartbeat_settles_what_it_said_it_published() -> None:
    """breaker35 B1: a heartbeat under a new UUID (next seq 50), confirmed by a reply under it or by
    a dropped connection: its epoch took nothing of what it said, and when it restarted before the
    tail was fetched, 0..49 were never announced (I3)."""
    for confirm in ("reply", "drop"):
        s = seqr()
        feed(s, A, range(3))
        (ask,) = s.heartbeat(50, B)
        out = s.replayed(ask.request_id, 49, p(B, 49), instance=B) if confirm == "reply" else s.disconnected(now=10.0)
        assert Reset(1, INSTANCE_CHANGED) in out and s.known_top >= 49
        s.disconnected(now=20.0)
        out = feed(s, C, [0])
        assert [(a.epoch, a.from_seq, a.to_seq) for a in out if isinstance(a, Lost)][-1:] == [(1, 0, 49)], (confirm, out)


def test_a_batch_set_aside_is_confirmed_by_a_drop_or_a_later_uuid_as_a_waiting_one_is() -> None:
    """breaker36 B3, no replay endpoint: B published one batch and died (a crash loop), read
    interleaved with A's last one, so B's was set aside; then the connection dropped (or not) and
    C came. Before, neither confirmed B: its seq 0 was never delivered nor announced, and 64
    messages later it was dead-lettered as forged. Now B gets its own epoch, before C's."""
    for drop in (True, False):
        s = seqr(replay=False)
        feed(s, A, range(6))
        out = s.live(0, p(B, 0), instance=B) + s.live(6, p(A, 6), instance=A)
        assert delivered(out) == [(0, 6)] and s.epoch == 0
        out = s.disconnected(2500.0) if drop else []
        assert delivered(out) == ([(1, 0)] if drop else [])
        out += feed(s, C, range(70))
        assert delivered(out) == [(1, 0)] + [(2, n) for n in range(70)] and not suspects(out), drop
        assert [a.reason for a in out if isinstance(a, Reset)] == [INSTANCE_CHANGED] * 2


def test_late_batches_of_an_older_instance_read_after_its_successors_first_do_not_end_its_epoch() -> None:
    """breaker36 B1: a stream met for the first time at an engine restart reads B's seq 0, then A's
    last two (published before A died; several connections into one bound socket are read in turn).
    Before, A's second batch confirmed A: a restart, B's UUID retired, and every later batch of the
    running engine dropped, nothing announced. Now a message under the waiting UUID stamped before
    the epoch's last batch confirms nothing: the replay, answered by B, decides; A's two batches are
    dead-lettered, and B goes on in its epoch."""
    s = seqr()  # (payloads carry their engine ts: B's batch 0 was stamped at 1000, A's last at 7 and 8)
    out = s.live(0, b"\xbb:1000", instance=B)
    assert delivered(out) == [(0, 0)]
    (ask,) = requests(s.live(7, b"\xaa:7", instance=A))
    out = s.live(8, b"\xaa:8", instance=A)
    assert not [a for a in out if isinstance(a, Reset | Deliver)] and s.epoch == 0 and s.retired_instances == []
    out = s.replayed(ask.request_id, 0, b"\xbb:1000", instance=B)  # the engine holding the socket: B
    assert sorted(suspects(out)) == [7, 8] and s.epoch == 0 and s.sure_instance == B
    assert delivered([a for n in range(1, 4) for a in s.live(n, b"\xbb:%d" % (1000 + n), instance=B)]) == [(0, 1), (0, 2), (0, 3)]


def test_the_uuid_whose_message_confirms_a_newcomer_gets_the_epoch_after_it() -> None:
    """breaker42 B1, no replay endpoint: a crash loop A -> B -> C read through one bound socket in
    turn: C:0, A:6, B:0, C:1, ... C:0 was set aside (A:6 after it), B:0 waited, and C:1 confirmed B.
    Before, C's set-aside batch took an epoch first, then B's epoch retired C, the running engine,
    and every later message of C was dropped. Now B gets epoch 1, C epoch 2, and C goes on."""
    s = seqr(replay=False)
    feed(s, A, range(6))
    out = [a for inst, seq in [(C, 0), (A, 6), (B, 0), (C, 1), (A, 7), (B, 1)] for a in s.live(seq, p(inst, seq), instance=inst)]
    out += feed(s, C, range(2, 41))
    assert [a.epoch for a in out if isinstance(a, Reset)] == [1, 2]
    assert [seq for epoch, seq in delivered(out) if epoch == 2] == list(range(41)) and s.sure_instance == C


def test_a_source_removed_and_added_again_confirms_nothing_set_aside_with_the_newcomer() -> None:
    """breaker42 B2: the breaker36 B1 burst (B:0, then A's late 7 and 8: A:8 set aside while the
    replay about A:7 is in flight), then discovery removes the source and adds it again. Before,
    the newcomer was forgotten but A:8 was not: the drop that follows confirmed A, retired B, the
    running engine, and dropped all of it. Now the re-adding confirms none of what waits."""
    s = seqr()
    s.live(0, b"\xbb:1000", instance=B)
    s.live(7, b"\xaa:7", instance=A)
    s.live(8, b"\xaa:8", instance=A)
    s.detached()
    out = s.disconnected(2000.0, readded=True)
    assert not [a for a in out if isinstance(a, Reset)] and s.retired_instances == []
    out = [a for n in range(1, 41) for a in s.live(n, b"\xbb:%d" % (1000 + n), instance=B)]
    for ask in requests(out):
        out += s.replayed(ask.request_id, 0, b"\xbb:1000", instance=B) + s.replay_finished(ask.request_id, complete=True)
    assert {seq for _, seq in delivered(out)} == set(range(1, 41)) and not [a for a in out if isinstance(a, Duplicate)]


def test_what_waits_with_a_newcomer_past_the_bound_is_not_kept_nor_dead_lettered() -> None:
    """breaker42 B3: an unnoticed restart to B, whose clock runs 100 s behind A's: B:0 waits, and
    B's next 30 batches, stamped before A's last, wait with it while the replay socket is silent.
    Before, past 16 the oldest were dead-lettered as not the engine's, then announced lost. Now the
    first 16 are kept and those past the bound are not (left in the engine's buffer, as live
    batches past max_held are): none is dead-lettered; B, confirmed by its replay once the socket
    answers (without a UUID: with B:0's very bytes), delivers what was kept. (Stamped before the
    epoch, B is never taken on its word: breaker68 Z12.)"""
    s = seqr(max_attempts=3)
    for n in range(6):
        s.live(n, b"\xaa:%d" % (1000 + n), instance=A)
    out = s.live(0, b"\xbb:900", instance=B)
    out += [a for n in range(1, 31) for a in s.live(n, b"\xbb:%d" % (900 + n), instance=B)]
    assert not suspects(out) and len(s._stash) == 16
    (ask,) = [a for a in requests(out) if a.request_id == s._replay]
    out += s.replay_finished(ask.request_id, complete=False)  # (a silent replay socket, once)
    (ask,) = [a for a in requests(out) if a.request_id == s._replay]
    out += s.replayed(ask.request_id, 0, b"\xbb:900")  # (then B answers, without a UUID)
    assert not suspects(out)
    assert [seq for epoch, seq in delivered(out) if epoch == 1][:17] == list(range(17))


def test_a_source_added_again_confirms_nothing_set_aside_for_another_uuid() -> None:
    """breaker47 B1: without replay, one frame under C, then A's own seq 5: C's frame is set aside
    for its UUID. Discovery removes the source and adds it again. Before, the drop that re-adding
    makes confirmed C: C's epoch opened with the frame, A was retired and A's 6..19 were dropped
    as a retired instance's, neither delivered nor announced lost (I3). Now adding it again is no
    evidence either way: the frame waits on, and A goes on in its epoch (the frame ages out under
    A's messages as before)."""
    s = seqr(replay=False)
    feed(s, A, range(5))
    s.live(5, FORGED, instance=C)
    s.live(5, p(A, 5), instance=A)
    s.detached()
    out = s.disconnected(100.0, readded=True)
    out += feed(s, A, range(6, 20))
    assert not [a for a in out if isinstance(a, Reset | Duplicate | Lost)] and s.retired_instances == []
    assert delivered(out) == [(0, n) for n in range(6, 20)]


def test_a_new_instances_batch_set_aside_goes_out_first_in_its_epoch_after_the_source_is_added_again() -> None:
    """breaker48 B2: without replay, B's seq 0 is read before A's drop is noticed, then A's late seq
    5: B:0 is set aside for B's UUID. Discovery removes the source and adds it again. Forgotten
    with the source (37def60), B:0 was announced lost when B's next message opened its epoch (I4:
    it had reached the bridge). Now it waits, and goes out first in B's epoch."""
    s = seqr(replay=False)
    feed(s, A, range(5))
    s.live(0, p(B, 0), instance=B)
    s.live(5, p(A, 5), instance=A)
    s.detached()
    out = s.disconnected(100.0, readded=True)
    out += feed(s, B, [1, 2])
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert not [a for a in out if isinstance(a, Lost)] and delivered(out) == [(1, 0), (1, 1), (1, 2)]


def test_a_new_uuid_waiting_for_its_confirmation_goes_out_first_in_its_epoch_after_the_source_is_added_again() -> None:
    """breaker52 B2: without replay, B's seq 0 waits for its confirmation (no drop noticed); discovery
    removes the source and adds it again. The waiting frame was forgotten, and B:0, which had
    reached the bridge, was announced lost when B's next message opened its epoch (I4). It is set
    aside now, unconfirmed by the re-adding, and goes out first once B's message confirms it."""
    s = seqr(replay=False)
    feed(s, A, range(5))
    assert s.live(0, p(B, 0), instance=B) == [] and s.waiting == {0}
    s.detached()
    out = s.disconnected(None, readded=True) + s.start()
    assert not [a for a in out if isinstance(a, Reset)]
    out += feed(s, B, [1, 2])
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert not [a for a in out if isinstance(a, Lost)] and delivered(out) == [(1, 0), (1, 1), (1, 2)]


def test_a_frame_kept_across_a_re_add_is_never_confirmed_by_a_later_drop() -> None:
    """breaker54 B2: without replay, B's seq 0 waits; the source is removed and added again (B:0 kept,
    unconfirmed); B dies and C starts, and C's first message, right after the re-add, opened C's
    epoch. A blip then confirmed B:0 as a crash loop's instance: B got an epoch after C's, and C,
    the running engine, was retired, every later batch of it dropped (I1, I3). C, taking the epoch
    at once, came after B: B's epoch comes first, with B:0 (a crash loop), and a later drop
    confirms nothing of what is gone."""
    s = seqr(replay=False)
    feed(s, A, range(5))
    s.live(0, p(B, 0), instance=B)
    s.detached()
    out = s.disconnected(None, readded=True)
    out += feed(s, C, range(4))
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED), Reset(2, INSTANCE_CHANGED)]
    assert delivered(out) == [(1, 0), *((2, n) for n in range(4))]
    out = s.disconnected(now=10.0) + feed(s, C, range(4, 8))
    assert not [a for a in out if isinstance(a, Reset | Duplicate)] and C not in s.retired_instances
    assert delivered(out) == [(2, n) for n in range(4, 8)]


def b0_kept_across_a_re_add(published: int) -> tuple[StreamSequencer, list[Action], RequestReplay]:
    """A delivered 0..``published``-1; B's seq 0 waits (the drop not seen), and the source is removed
    and added again (B:0 kept): the sequencer, what the re-add said, and the replay it asks next."""
    s = seqr()
    feed(s, A, range(published))
    s.live(0, p(B, 0), instance=B)
    s.detached()
    out = s.disconnected(None, readded=True)
    return s, out, [a for a in out + s.probe() if isinstance(a, RequestReplay)][-1]


def test_a_frame_kept_across_a_re_add_goes_out_first_when_a_reply_under_its_uuid_opens_its_epoch() -> None:
    """breaker54 B1: B's seq 0 waits (the drop not seen), the source is removed and added again, and
    the start-up replay is answered under B's UUID before B's next live message, its buffer past
    seq 0: B's epoch opened with 0..4 announced lost though B:0 had reached the bridge (I4), and
    B:0 was later dead-lettered as not its engine's. It goes out first in B's epoch now."""
    s, out, ask = b0_kept_across_a_re_add(5)
    out += s.replayed(ask.request_id, 5, p(B, 5), instance=B)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    for req in [a for a in out if isinstance(a, RequestReplay) and a.request_id == s._replay]:
        out += s.replayed(req.request_id, 5, p(B, 5), instance=B) + s.replay_finished(req.request_id, complete=True)
    assert (1, 0) in delivered(out), out
    assert not [a for a in out if isinstance(a, Lost) and a.epoch == 1 and a.from_seq <= 0 <= a.to_seq], out


def test_frames_of_two_uuids_kept_across_re_adds_get_their_epochs_in_turn_without_failing() -> None:
    """breaker56 B1: frames of B and C kept across re-adds, aged 63 under the engine's messages; a new
    UUID D takes the epoch at once. Delivering B's frame went through live(), whose aging
    dead-lettered C's meanwhile, and the loop then raised IndexError on C's empty group: every
    action decided was lost and the stream's task failed (I5). Each group is taken out first."""
    D = b"\xdd" * 16
    s = seqr(replay=False)
    feed(s, A, range(3))
    s._stash = [(B, (0, p(B, 0), None), 63), (C, (0, p(C, 0), None), 63)]
    s._readded = {B, C}
    assert s.disconnected(now=10.0) == []  # (a drop confirms nothing kept across a re-add)
    out = s.live(0, p(D, 0), instance=D)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(n, INSTANCE_CHANGED) for n in (1, 2, 3)]
    assert delivered(out) == [(1, 0), (2, 0), (3, 0)] and not suspects(out)


def test_a_reply_under_a_new_uuid_gives_frames_kept_across_a_re_add_their_epochs_first() -> None:
    """breaker56 B2: B's seq 0 waits, the source is removed and added again (B:0 kept), B dies and C
    runs; the start-up replay, answered under C's UUID, opened C's epoch at once, and B:0 aged out
    under C's messages, dead-lettered: neither delivered nor announced (I3). A new UUID taking the
    epoch at once by a reply came after it, as by a live message: B's epoch comes first."""
    s, out, ask = b0_kept_across_a_re_add(3)
    out += s.replayed(ask.request_id, 0, p(C, 0), instance=C)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED), Reset(2, INSTANCE_CHANGED)]
    assert delivered(out) == [(1, 0), (2, 0)] and s.sure_instance in (C, None) and s.instance == C


def serve(s: StreamSequencer, out: list[Action], buffer: dict[int, bytes], instance: bytes | None) -> list[Action]:
    """The engine answers every replay the sequencer asks for (the one in flight), from ``buffer``."""
    got: list[Action] = []
    pending = requests(out)
    while pending:
        req = pending.pop(0)
        if req.request_id != s._replay:
            continue
        more: list[Action] = []
        for n in sorted(q for q in buffer if q >= req.start and (req.until < 0 or q <= req.until)):
            more += s.replayed(req.request_id, n, buffer[n], instance=instance)
        more += s.replay_finished(req.request_id, complete=True)
        got += more
        pending += requests(more)
    return got


def test_a_late_frame_of_an_instance_before_the_one_that_took_the_epoch_after_two_drops_retires_nothing() -> None:
    """breaker58 B1: A delivered 0..2; the connection drops twice; C, idle, shows by its heartbeat
    (no ts to date it: its epoch opens still in the drops' doubt). B ran between the drops: its
    seq 0 is read only now. Taken for a restart at once (a new UUID in doubt), it opened an epoch
    after C's and retired C, the running engine: every later batch and reply of C was dropped as
    a retired instance's, never delivered nor announced (I3). It waits as a newcomer now, and
    C's reply at its seq refutes it."""
    s = seqr()
    feed(s, A, range(3))
    s.disconnected(now=10.0)
    s.disconnected(now=20.0)
    out = s.heartbeat(0, C)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    out += s.live(0, p(B, 0), instance=B)
    out += feed(s, C, range(4))
    out += serve(s, out, {n: p(C, n) for n in range(4)}, C)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert C not in s.retired_instances and s.instance == C
    assert delivered(out) == [(1, n) for n in range(4)] and suspects(out) == [0]


def test_a_frame_kept_across_two_re_adds_goes_out_in_its_epoch_when_a_new_uuid_takes_over() -> None:
    """breaker58 B3: B's seq 0 waits for its confirmation; discovery removes and adds the source
    twice (no drop time: a pipeline added again has no clock sample yet). C's first message then
    takes the epoch at once, and B's epoch comes first, with B:0 (57e414d). But B's epoch opened
    in the two drops' doubt, B:0 waited there unverified, and C's restart, unable to date it,
    announced it lost in B's own epoch (I4: it had reached the bridge under B's UUID). A batch
    read under the UUID its epoch was opened for is that epoch's."""
    s = seqr()
    feed(s, A, range(3))
    s.live(0, p(B, 0), instance=B)
    for _ in range(2):
        s.detached()
        s.disconnected(None, readded=True)
        s.start()
    out = s.live(0, p(C, 0), instance=C)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED), Reset(2, INSTANCE_CHANGED)]
    assert delivered(out) == [(1, 0), (2, 0)]
    assert not [a for a in out if isinstance(a, Lost)]


def test_a_live_uuid_other_than_the_replies_a_fresh_epoch_was_built_from_is_no_first_contact() -> None:
    """breaker58 walk, seed 407: met for the first time, the start-up replay is answered by C (its
    seq 0, under C's UUID); then B's 0..1, an instance before C whose last batches were still
    queued, are read. B's seq 0 was dropped as a copy, and its UUID taken as the epoch's at first
    contact: B's seq 1 went out in the epoch of C's seq 0 (I1). C's replies name the epoch's
    instance now (unsure: the replay socket answered), so B's frames wait as newcomers, and C's
    replies refute them."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=lambda payload: None)
    out = serve(s, s.start(), {0: p(C, 0)}, C)
    out += s.live(0, p(B, 0), instance=B)
    out += serve(s, out, {0: p(C, 0)}, C)
    got = s.live(1, p(B, 1), instance=B)
    out += got + serve(s, got, {0: p(C, 0)}, C)
    assert [a.payload for a in out if isinstance(a, Deliver)] == [p(C, 0)]
    assert suspects(out) == [0, 1] and s.instance == C and not s.retired_instances


def stamped(instance: bytes, seq: int) -> bytes:
    """Instance ``instance``'s batch ``seq`` on one engine clock: A, B, C and D in turn, each
    thousands of seconds after the one before."""
    return b"%s:%d" % (instance[:1], 1000 * (instance[0] - 0xA9) + seq)


def test_a_late_frame_of_an_instance_before_the_epochs_confirms_nothing_by_its_dead_connection() -> None:
    """breaker59 X2: engines connect into one bound socket. B delivered 0..2 and crashed; C ran, and
    died on a lost host (its connection not closed yet); D runs now, its 0..3 delivered in epoch 1.
    C's seq 0, stamped before D's first batch, is read late from C's own pipe and waits; then the
    drop of C's connection is noticed. It confirmed C's frame at once: an epoch after D's, D
    retired, every later batch of D dropped, never delivered nor announced (I3). A frame older
    than the epoch's instance is confirmed by nothing but the replay, which D answers."""
    D = b"\xdd" * 16
    s = seqr(clock_skew=0.25)
    out = [a for n in range(3) for a in s.live(n, stamped(B, n), instance=B)]
    out += s.disconnected(now=ts(stamped(B, 2)) + 0.5)
    out += [a for n in range(4) for a in s.live(n, stamped(D, n), instance=D)]
    engine = {n: stamped(D, n) for n in range(8)}
    out += serve(s, out, engine, D)
    got = s.live(0, stamped(C, 0), instance=C) + s.disconnected(now=ts(stamped(D, 3)) + 0.5)
    got += s.live(1, stamped(C, 1), instance=C)
    got += [a for n in range(4, 8) for a in s.live(n, stamped(D, n), instance=D)]
    out += got + serve(s, got, engine, D)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert D not in s.retired_instances and s.instance == D
    assert [seq for epoch, seq in delivered(out) if epoch == 1] == list(range(8))
    assert sorted(suspects(out)) == [0, 1]


def test_a_late_heartbeat_of_an_instance_before_a_replays_restart_is_no_first_contact() -> None:
    """breaker59 X3: resumed at A's seq 2 (its UUID not kept); B ran and died, C runs. The start-up
    replay is answered by C (its seq 2 differs: a restart, epoch 1, without C's UUID), then B's
    late heartbeat and seqs 0..1 are read before C answers from seq 0. B's heartbeat was a first
    contact, B certain, and B's batches went out in epoch 1 before C's seq 2, C's in epoch 2
    again (I1). The replies' UUID names epoch 1's instance now: B waits as a newcomer, its frames
    stamped before C's first are set aside with it, and C's reply refutes them."""
    last = stamped(A, 2)
    s = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, delivered=2, delivered_fp=fingerprint(ts(last), last)
    )
    engine = {n: stamped(C, n) for n in range(6)}
    (first,) = s.start()
    assert isinstance(first, RequestReplay)
    out: list[Action] = []
    for n in (2, 3):
        out += s.replayed(first.request_id, n, engine[n], instance=C)
    out += s.replay_finished(first.request_id, complete=True)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, PUBLISHER_RESTART)]
    got = s.heartbeat(0, B) + s.live(0, stamped(B, 0), instance=B) + s.live(1, stamped(B, 1), instance=B)
    out += got + serve(s, out + got, {n: engine[n] for n in range(4)}, C)
    got = [a for n in (4, 5) for a in s.live(n, engine[n], instance=C)]
    out += got + serve(s, got, engine, C)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, PUBLISHER_RESTART)]
    assert [a.payload for a in out if isinstance(a, Deliver)] == [engine[n] for n in range(6)]
    assert sorted(suspects(out)) == [0, 1] and B not in s.retired_instances


def test_a_seq_the_epochs_heartbeat_claimed_that_no_replay_brings_after_a_restart_is_announced_lost() -> None:
    """The sequencer model (UuidReplayModel): C, known by its heartbeats, says it published seq 0,
    which the bridge never read; C restarts, and the new instance answers every replay with
    nothing (before any replay showed the buffer at work). C's seq 0 was never announced: the
    idle probes went on for ever (I3). A replay to the end asked after such a heartbeat, answered
    with nothing, shows another instance, as for a batch read live."""
    s = seqr()
    out = feed(s, A, range(2))
    out += s.heartbeat(3, A)  # (A says it published seq 2, which the bridge did not read)
    out += s.disconnected(now=10.0)  # (A restarts; the new instance publishes nothing)
    for _ in range(2 * s.max_attempts):
        asks = [a for a in requests(out) if a.request_id == s._replay] or requests(s.probe())
        out += s.replay_finished(asks[-1].request_id, complete=True)
    assert Lost(2, 2, PUBLISHER_RESTART, 0) in out, out


def test_late_frames_of_two_earlier_instances_open_no_epoch_after_the_one_that_showed_first() -> None:
    """breaker61 Y1 (walk seed 78): A delivered 0..2; the source is added again and A's drop is
    noticed with no engine time (a pipeline added again has no clock sample): D's 0..1 open epoch
    1 in doubt, nothing delivered in it yet. Then late frames of B and C, which ran before D, are
    read: C's third UUID confirmed B, and B and C got epochs after D's, D retired, its later
    batches dropped (I3, I4). The frame that showed D bounds the epoch: B and C predate it."""
    D = b"\xdd" * 16
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25)
    out = [a for n in range(3) for a in s.live(n, stamped(A, n), instance=A)]
    s.detached()
    out += s.disconnected(None, readded=True) + s.start() + s.disconnected(None)
    if s._replay is not None:
        out += s.replay_finished(s._replay, complete=False)
    engine = {n: stamped(D, n) for n in range(6)}
    got = [a for n in (0, 1) for a in s.live(n, engine[n], instance=D)]
    got += s.live(1, stamped(B, 1), instance=B) + s.live(1, stamped(C, 1), instance=C)
    out += got + serve(s, out + got, {n: engine[n] for n in (0, 1)}, D)
    got = [a for n in range(2, 6) for a in s.live(n, engine[n], instance=D)]
    out += got + serve(s, got, engine, D)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert D not in s.retired_instances and s.instance == D
    assert [seq for epoch, seq in delivered(out) if epoch == 1] == list(range(6))


@pytest.mark.parametrize("heartbeat", [False, True], ids=["batch", "heartbeat first"])
def test_a_late_frame_of_an_earlier_instance_is_no_first_contact_in_an_epoch_replies_delivered(heartbeat: bool) -> None:
    """breaker61 Y2, Y3 (walk seeds 142, 94, 209): resumed in epoch 1 with nothing delivered and no
    UUID kept; the start-up replay, its replies without a UUID, delivers D's 0..1. Then B's late
    seq 9, stamped before D's first batch, is read (Y3: after B's late heartbeat). It was a first
    contact: delivered in epoch 1 beside D's batches, B's UUID adopted, and D's next seqs went to
    another epoch (I1). It is an earlier instance's now, dropped, and a heartbeat with no ts to
    compare names no instance in an epoch that has batches."""
    D = b"\xdd" * 16
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=1, delivered=-1)
    engine = {n: stamped(D, n) for n in range(5)}
    out = serve(s, s.start(), {0: engine[0], 1: engine[1]}, None)
    if heartbeat:
        out += s.heartbeat(10, B)
    out += s.live(9, stamped(B, 9), instance=B)
    got = [a for n in range(2, 5) for a in s.live(n, engine[n], instance=D)]
    out += got + serve(s, got, engine, None)
    assert not [a for a in out if isinstance(a, Reset)]
    assert [a.payload for a in out if isinstance(a, Deliver)] == [engine[n] for n in range(5)]
    assert s.instance == D


def test_a_corrupt_ts_on_an_epochs_first_batch_drops_none_of_its_instances_next_batches() -> None:
    """breaker62 Z1: met for the first time; the start-up replay, its replies without a UUID, brings
    seq 0 with a corrupt (finite) ts far ahead, then seq 1. Every live batch under the engine's UUID
    then predated that first ts: dropped as an earlier instance's at every first contact, none
    delivered (I4), for as long as the stream stayed busy. The epoch's next seq is never taken
    for an earlier instance's there."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25)
    out = serve(s, s.start(), {0: b"\xaa:1000000000000", 1: stamped(A, 1)}, None)
    out += [a for n in range(2, 12) for a in s.live(n, stamped(A, n), instance=A)]
    assert [seq for _, seq in delivered(out)] == list(range(12)) and s.instance == A


def test_batches_read_under_the_epochs_uuid_never_go_to_a_new_instance_whose_clock_runs_behind() -> None:
    """breaker62 Z4 (a clock-skew walk, seed 35): B delivered 0..13 (the checkpoint kept B's
    UUID); after a re-add and drops, C's 0..5 are read in doubt under C's UUID and wait. C then
    restarts into D, whose host clock runs 2.2 s behind C's, and D answers the replay under its
    UUID: the restart its reply shows carried C's 1..5 into D's epoch, being stamped after D's
    reply (I1, though every message names its UUID). Batches read under the epoch's UUID are
    never carried to replies under another."""
    D = b"\xdd" * 16

    def at(instance: bytes, seq: int, base: float) -> bytes:
        return b"%s:%.3f" % (instance[:1], base + seq * 0.1)

    last = at(B, 13, 1000.0)
    s = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, max_held=8, max_attempts=3,
        delivered=13, delivered_fp=fingerprint(ts(last), last), instance=B,
    )  # fmt: skip
    s.start()
    s.detached()
    s.disconnected(None, readded=True)
    (first,) = s.start()
    assert isinstance(first, RequestReplay)
    out = s.disconnected(None)
    out += s.live(0, at(C, 0, 1007.164), instance=C)
    (ask,) = requests(out)
    out += [a for n in (1, 2, 3) for a in s.live(n, at(C, n, 1007.164), instance=C)]
    out += s.disconnected(None) + s.replay_finished(first.request_id, complete=False)
    out += [a for n in (4, 5) for a in s.live(n, at(C, n, 1007.164), instance=C)]
    out += s.disconnected(None)
    engine = {n: at(D, n, 1004.989) for n in (0, 1)}
    got = s.replayed(ask.request_id, 0, engine[0], instance=D) + s.replayed(ask.request_id, 1, engine[1], instance=D)
    got += s.replay_finished(ask.request_id, complete=True)
    out += got + serve(s, got, engine, D)
    new = max(a.epoch for a in out if isinstance(a, Reset))
    assert [a.payload for a in out if isinstance(a, Deliver) and a.epoch == new] == [engine[0], engine[1]]


def _instances_per_epoch(out: list[Action]) -> dict[int, set[bytes]]:
    epochs: dict[int, set[bytes]] = {}
    for a in out:
        if isinstance(a, Deliver):
            epochs.setdefault(a.epoch, set()).add(a.payload.split(b":")[0])
    return epochs


def test_replies_under_another_uuid_than_the_one_an_epoch_was_opened_for_are_another_instances() -> None:
    """breaker63 Z5 (walk62 --skew seed 11): after flaps, B's live seq 3 (UUID 7) opens epoch 1 for
    B in doubt, waiting. B restarts into C (UUID 8), whose host clock runs 1.2 s behind B's, and C
    answers the replay of 0..2 under its UUID: compared by clocks alone (C's stamped before B's
    seq 3), it was B's, and C's 0..1 went out in B's epoch, before B's 3 (I1, though every message
    names its UUID). A reply under another UUID than the one the epoch was opened for is another
    instance's."""
    base = {6: 1008.0, 7: 1010.103, 8: 1009.175}

    def at(i: int, q: int) -> bytes:
        return b"%d:%d:%.3f" % (i, q, base[i] + q * 0.1)

    s = StreamSequencer(
        can_replay=True, replay_on_start=True, max_held=8, max_attempts=3, clock_skew=0.25,
        ts_of=lambda b: float(b.split(b":")[-1]),
    )  # fmt: skip
    uid = {i: bytes([i]) * 16 for i in base}
    out = s.start()
    out += [a for q in range(6) for a in s.live(q, at(6, q), instance=uid[6])]
    out += s.live(0, at(7, 0), instance=uid[7])
    for _ in range(2):
        s.detached()
        out += s.disconnected(None, readded=True) + s.start()
    out += s.live(3, at(7, 3), instance=uid[7])
    s.detached()
    out += s.disconnected(None, readded=True) + s.start() + s.disconnected(None)
    engine = {q: at(8, q) for q in range(4)}
    got = serve(s, out, {0: engine[0], 1: engine[1]}, uid[8])
    got += s.live(2, engine[2], instance=uid[8]) + s.live(3, engine[3], instance=uid[8])
    out += got + serve(s, got, engine, uid[8])
    assert all(len(instances) == 1 for instances in _instances_per_epoch(out).values()), _instances_per_epoch(out)


def test_a_retired_uuids_replies_go_into_no_epoch_even_while_the_epochs_uuid_is_unsure() -> None:
    """breaker63 Z6 (walk59 --corrupt seed 262): met in doubt, C's 0..1 (UUID 3) are read, then B's
    late frames (UUID 2, the instance before C): B opens epoch 1 and C's UUID is retired (the open
    limit in limits.md). C's replay socket then answers under UUID 3: a retired UUID's replies
    were dropped only while the epoch's UUID was certain, so C's 3..14 went out in B's epoch (I1).
    A retired instance's reply is never taken."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, max_held=8, max_attempts=3, ts_of=ts, clock_skew=0.25)
    uid = {i: bytes([i]) * 16 for i in (2, 3)}

    def at(i: int, q: int) -> bytes:
        return b"%d:%d" % (i, i * 1000 + q)

    def flap() -> list[Action]:
        s.detached()
        return s.disconnected(None, readded=True) + s.start()

    out = s.disconnected(None)
    (first,) = requests(flap())
    out += s.disconnected(None) + s.replay_finished(first.request_id, complete=True)
    out += s.live(0, at(3, 0), instance=uid[3]) + s.live(1, at(3, 1), instance=uid[3])
    out += s.live(0, at(2, 0), instance=uid[2]) + s.heartbeat(1, uid[2]) + s.live(1, at(2, 1), instance=uid[2])
    out += s.disconnected(None) + s.live(2, at(2, 2), instance=uid[2])
    out += [a for q in range(2, 15) for a in s.live(q, at(3, q), instance=uid[3])]
    ask = requests(flap())[-1]
    out += [a for q in range(3, 15) for a in s.replayed(ask.request_id, q, at(3, q), instance=uid[3])]
    out += s.replay_finished(ask.request_id, complete=True)
    assert all(len(instances) == 1 for instances in _instances_per_epoch(out).values()), _instances_per_epoch(out)


@pytest.mark.parametrize("late", ["frame", "frame past the buffer", "heartbeat"])
@pytest.mark.parametrize("reply_uuid", [True, False], ids=["replies with a UUID", "replies without"])
def test_a_late_message_read_before_anything_is_delivered_is_bounded_by_the_batches_waiting(reply_uuid: bool, late: str) -> None:
    """breaker62 Z3 (walk seeds 794, 811): resumed with nothing delivered, the start-up replay in
    flight. The running engine C's 0..1 are read and wait, C's UUID adopted in doubt; then a late
    frame of B, the instance before C, stamped long before them. With no batch delivered in the
    epoch nothing bounded it: a restart at once, an epoch for B after C's, C retired and every
    later batch of the running engine dropped (I3, I4). The first batch waiting under the
    epoch's UUID bounds it now: it waits for the replay, which C answers, and is refuted.
    breaker67 Z9: B ran long, its frame's seq (5000) past C's buffer: C's end marker refutes it
    (it counted as a silent answer, and B got its epoch after max_attempts). Z8: B's late idle
    heartbeat, which has no ts to compare, waits as a newcomer too (it was a restart at once)."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=0, delivered=-1)
    engine = {n: stamped(C, n) for n in range(10)}
    out = s.start()
    got = [a for n in (0, 1) for a in s.live(n, engine[n], instance=C)]
    if late == "heartbeat":
        got += s.heartbeat(8, B)
    else:
        seq = 5000 if late == "frame past the buffer" else 0
        got += s.live(seq, stamped(B, seq), instance=B)
    # C idle meanwhile: its replay socket holds 0..1 (past B's seq 5000: its end marker alone)
    out += got + serve(s, out + got, {n: engine[n] for n in (0, 1)}, C if reply_uuid else None)
    got = [a for n in range(2, 10) for a in s.live(n, engine[n], instance=C)]
    out += got + serve(s, got, engine, C if reply_uuid else None)
    assert not [a for a in out if isinstance(a, Reset | Lost)]
    assert delivered(out) == [(0, n) for n in range(10)] and s.instance == C and C not in s.retired_instances
    # B's frame, dead-lettered: its engine answered with C's batch at its seq, or nothing there
    assert suspects(out) == {"frame": [0], "frame past the buffer": [5000], "heartbeat": []}[late]


@pytest.mark.parametrize(
    ("late", "drop"), [((4, 5), False), ((4, 5), True), ((5, 6), False)], ids=["refuted", "set aside by a drop", "after a hole"]
)
@pytest.mark.parametrize("reply_uuid", [True, False], ids=["replies with a UUID", "replies without"])
def test_the_epochs_own_next_seqs_refuted_as_a_late_newcomer_are_announced_lost_in_it(
    reply_uuid: bool, late: tuple[int, int], drop: bool
) -> None:
    """breaker67 Z7: resumed in epoch 5 with B's 0..3 delivered (B's UUID not kept: replies opened
    the epoch). B published 4 and 5, then restarted into C; C's 10 and 11 are read first, then
    B's 4 and 5, stamped long before them. Bounded by C's waiting batches (6625de0), B's frames
    wait as a newcomer that C's replay refutes: dead-lettered, and epoch 5 ended at seq 3 with
    no EventsLost for 4..5, which its instance published (I3). With the epoch's UUID unsure,
    refuted seqs that follow what it delivered are settled by it: announced lost there.
    breaker68 Z13: also when a drop set them aside before the replay could refute them, and when
    B's seq 4 was lost in flight (5 and 6 read): they are stamped after the epoch's last batch."""
    fp = fingerprint(ts(stamped(B, 3)), stamped(B, 3))
    s = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=5, delivered=3, delivered_fp=fp, anchor=3
    )
    engine = {n: stamped(C, n) for n in range(17)}
    out = s.start()
    got = [a for n in (10, 11) for a in s.live(n, engine[n], instance=C)]
    got += [a for n in late for a in s.live(n, stamped(B, n), instance=B)]
    if drop:
        got += s.disconnected(None)
    got += [a for n in (12, 13) for a in s.live(n, engine[n], instance=C)]
    out += got + serve(s, out + got, {n: engine[n] for n in range(14)}, C if reply_uuid else None)
    got = [a for n in range(14, 17) for a in s.live(n, engine[n], instance=C)]
    out += got + serve(s, got, engine, C if reply_uuid else None)
    lost_in_5 = [(a.from_seq, a.to_seq) for a in out if isinstance(a, Lost) and a.epoch == 5]
    b_delivered = [seq for epoch, seq in delivered(out) if epoch == 5]
    for seq in late:
        assert seq in b_delivered or any(lo <= seq <= hi for lo, hi in lost_in_5), (seq, lost_in_5, b_delivered)
    assert [a.epoch for a in out if isinstance(a, Reset)] == [6]
    assert [seq for epoch, seq in delivered(out) if epoch == 6] == list(range(17))


def silent(s: StreamSequencer, times: int) -> list[Action]:
    """The replay in flight, and each one asked again after it, end without an answer ``times`` times."""
    out: list[Action] = []
    for _ in range(times):
        if s._replay is None:
            break
        out += s.replay_finished(s._replay, complete=False)
    return out


@pytest.mark.parametrize("late", ["frame", "heartbeat"])
@pytest.mark.parametrize("reply_uuid", [True, False], ids=["replies with a UUID", "replies without"])
def test_a_late_message_older_than_the_epoch_is_never_taken_on_its_word(reply_uuid: bool, late: str) -> None:
    """breaker68 Z12: as Z3, but the replays about B's late frame (or heartbeat) all time out while
    C is idle: B was taken on its word after max_attempts, an epoch opened for it after C's, C
    retired and its next batches dropped (I3, I4). A message older than the epoch's instance is
    confirmed by its replay only: refuted instead, and C goes on in its epoch."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=0, delivered=-1, max_attempts=3)
    engine = {n: stamped(C, n) for n in range(6)}
    out = s.start() + [a for n in (0, 1) for a in s.live(n, engine[n], instance=C)]
    out += s.heartbeat(1, B) if late == "heartbeat" else s.live(0, stamped(B, 0), instance=B)
    out += silent(s, 3)
    out += serve(s, out, {n: engine[n] for n in (0, 1)}, C if reply_uuid else None)
    got = [a for n in range(2, 6) for a in s.live(n, engine[n], instance=C)]
    out += got + serve(s, got, engine, C if reply_uuid else None)
    assert not [a for a in out if isinstance(a, Reset)] and C not in s.retired_instances
    assert delivered(out) == [(0, n) for n in range(6)]


@pytest.mark.parametrize("reply_uuid", [True, False], ids=["replies with a UUID", "replies without"])
def test_a_genuine_instance_refuted_while_its_replay_was_silent_is_known_by_its_bytes(reply_uuid: bool) -> None:
    """breaker68 Z10/Z11 against Z12's rule: D, a genuine restart whose clock runs 3 s behind C's,
    is refuted while its replay socket stays silent. When the socket answers with D's own bytes
    (without a UUID), those bytes name D: the restart is D's, and C's batches waiting stay in C's
    epoch (not carried into D's by the clock, which would mix instances, I1)."""
    D = b"\xdd" * 16
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=0, delivered=-1, max_attempts=3)
    c = {n: b"\xcc:%.3f" % (1000 + n * 0.05) for n in range(3)}
    d = {n: b"\xdd:%.3f" % (997.4 + n * 0.05) for n in range(6)}
    out = s.start() + [a for n in range(3) for a in s.live(n, c[n], instance=C)]
    out += s.live(0, d[0], instance=D) + s.live(1, d[1], instance=D)
    out += silent(s, 3)
    assert suspects(out) == [0, 1]  # (refuted: stamped before C's, and nothing answered)
    out += serve(s, out, {0: d[0], 1: d[1]}, D if reply_uuid else None)
    got = [a for n in range(2, 6) for a in s.live(n, d[n], instance=D)]
    out += got + serve(s, got, d, D if reply_uuid else None)
    epochs = _instances_per_epoch(out)
    assert all(len(who) == 1 for who in epochs.values()), epochs
    assert [seq for epoch, seq in delivered(out) if epoch == s.epoch] == list(range(6)) and s.instance == D


def test_an_instance_adopted_in_doubt_before_a_reply_showed_the_next_one_is_retired_once_that_one_is_read_live() -> None:
    """breaker68 Z14: resumed in epoch 5, B's 4..5 read in doubt (B adopted, unsure); B restarts
    into C, whose clock runs 2.5 s behind; two drops. C's reply (under C) opens epoch 6; then
    live C:0, and B's last frame B:6, read late and stamped within clock_skew of C's first. B:6
    opened epoch 7 for B, C was retired, and C's 1..5 were dropped (I1, I3). Once C is read
    live, B's UUID is an earlier instance's: B:6 is dropped."""
    b = {n: b"\xbb:%.1f" % (1000 + n * 0.1) for n in range(7)}
    c = {n: b"\xcc:%.1f" % (1001.1 + n * 0.1) for n in range(6)}
    s = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=1.0, max_attempts=3,
        epoch=5, delivered=0, delivered_fp=fingerprint(ts(b[0]), b[0]), anchor=0,
    )  # fmt: skip
    out = s.start() + s.live(4, b[4], instance=B) + s.live(5, b[5], instance=B)
    out += s.disconnected(None) + s.disconnected(None)
    out += serve(s, out, {0: c[0]}, C)
    out += s.live(0, c[0], instance=C) + s.live(6, b[6], instance=B)
    for n in range(1, 6):
        got = s.live(n, c[n], instance=C)
        out += got + serve(s, got, c, C)
    assert [a.epoch for a in out if isinstance(a, Reset)] == [6] and C not in s.retired_instances and B in s.retired_instances
    assert [seq for epoch, seq in delivered(out) if epoch == 6] == list(range(6))


def test_the_engines_own_batch_under_a_corrupt_uuid_never_names_a_restart_by_its_bytes() -> None:
    """breaker69 Z15: B (UUID sure, replies without one) delivered 0..4; its batch 5 is read
    under a corrupt UUID X and refuted by B's replay. When a later replay brought B:5 again (no
    UUID), its bytes named X: a certain restart, B retired and its later batches dropped. Bytes
    name a UUID only while the epoch's is unsure."""
    X = b"\xbb" * 15 + b"X"
    s = seqr(clock_skew=1.0)
    b = {n: b"\xbb:%.2f" % (1000 + n * 0.05) for n in range(20)}
    out = [a for n in range(5) for a in s.live(n, b[n], instance=B)]
    got = s.live(5, b[5], instance=X)
    out += got + serve(s, got, {n: b[n] for n in range(6)}, None)
    for n in range(6, 9):
        got = s.live(n, b[n], instance=B)
        out += got + serve(s, got, {k: b[k] for k in range(n + 1)}, None)
    got = s.disconnected(None)
    out += got + serve(s, got, {k: b[k] for k in range(9)}, None)
    for n in range(9, 20):
        got = s.live(n, b[n], instance=B)
        out += got + serve(s, got, {k: b[k] for k in range(n + 1)}, None)
    out += serve(s, s.probe(), b, None)
    assert not [a for a in out if isinstance(a, Reset)] and B not in s.retired_instances and s.instance == B
    assert sorted({seq for _, seq in delivered(out)}) == list(range(20)) and suspects(out) == [5]


@pytest.mark.parametrize("then", ["drop", "heartbeat"])
def test_a_late_heartbeat_met_before_anything_is_delivered_is_confirmed_by_its_replay_only(then: str) -> None:
    """breaker69 Z16: as Z12 with B's late heartbeat, then the drop of B's dead connection (or a
    second late heartbeat of B): it confirmed B at once, C was retired and none of C's batches
    was delivered (I3, I4)."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=0, delivered=-1, max_attempts=3)
    engine = {n: stamped(C, n) for n in range(6)}
    out = s.start() + [a for n in (0, 1) for a in s.live(n, engine[n], instance=C)]
    out += s.heartbeat(1, B)
    out += s.disconnected(None) if then == "drop" else s.heartbeat(1, B)
    out += serve(s, out, {n: engine[n] for n in (0, 1)}, C)
    got = [a for n in range(2, 6) for a in s.live(n, engine[n], instance=C)]
    out += got + serve(s, got, engine, C)
    assert not [a for a in out if isinstance(a, Reset)] and C not in s.retired_instances
    assert delivered(out) == [(0, n) for n in range(6)]


def test_the_epochs_own_late_frames_aged_out_of_the_stash_are_announced_lost_in_it() -> None:
    """breaker69 Z17: as Z13's drop case, but C publishes 64 batches while the start-up replay is
    slow: B's 4 and 5, set aside by the drop, age out of the stash (dead-lettered) before the
    epoch ends, and epoch 5 ended with no EventsLost for them (I3). Aged out while the epoch's
    UUID is unsure, frames it may own are owed by it as refuted ones are."""
    fp = fingerprint(ts(stamped(B, 3)), stamped(B, 3))
    s = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, clock_skew=0.25, epoch=5, delivered=3, delivered_fp=fp, anchor=3
    )
    engine = {n: stamped(C, n) for n in range(90)}
    out = s.start()
    out += [a for n in (10, 11) for a in s.live(n, engine[n], instance=C)]
    out += [a for n in (4, 5) for a in s.live(n, stamped(B, n), instance=B)]
    out += s.disconnected(None)
    out += [a for n in range(12, 90) for a in s.live(n, engine[n], instance=C)]  # (the replay is slow)
    out += serve(s, out, engine, C)
    lost_in_5 = [(a.from_seq, a.to_seq) for a in out if isinstance(a, Lost) and a.epoch == 5]
    assert all(any(lo <= seq <= hi for lo, hi in lost_in_5) for seq in (4, 5)), lost_in_5


@pytest.mark.parametrize("fresh", [False, True], ids=["resumed", "first met"])
def test_a_busy_engine_whose_heartbeat_came_first_is_delivered_as_it_publishes(fresh: bool) -> None:
    """breaker71 Z21: replies carry no UUID. The engine's idle heartbeat (next=2) is read before the
    start-up replay, which brings its 0..1; then it publishes 2..9, each read live, every replay
    served in full. Each reply waited for a heartbeat to say whose it was (a live batch of the
    UUID adopted in doubt did not), so the stream stayed in doubt and delivered nothing. A reply
    with the very bytes of a batch read live under that UUID is its instance's."""
    E = b"\xee" * 16
    resumed = {} if fresh else {"epoch": 16, "delivered": -1}
    s = StreamSequencer(can_replay=True, replay_on_start=True, max_held=8, max_attempts=3, ts_of=ts, clock_skew=0.25, **resumed)
    engine = {n: b"\xee:%d" % (5000 + n) for n in range(10)}
    out = s.start() + s.heartbeat(2, E)
    out += serve(s, out, {0: engine[0], 1: engine[1]}, None)
    for n in range(2, 10):
        got = s.live(n, engine[n], instance=E)
        out += got + serve(s, got, {k: engine[k] for k in range(n + 1)}, None)
    out += serve(s, s.probe(), engine, None)
    assert [seq for _, seq in delivered(out)] == list(range(10)) and not s.in_doubt


def test_undecodable_bytes_alike_in_two_instances_name_no_replier() -> None:
    """breaker73 Z23 (new in 2195a96): resumed with nothing delivered, replies without a UUID. The
    new instance N's heartbeat comes first; the old instance O still answers the replay socket.
    N's seq 0 and O's are the same undecodable bytes (no ts). O's reply at 0 matched N's batch
    waiting, so O was taken for N: O's 1..3 went into N's epoch (I1) and N's own 1..3 were
    dropped as copies (I3). Bytes without a ts name no instance."""
    O_, N_ = b"\x11" * 16, b"\x12" * 16

    def pay(who: bytes, q: int) -> bytes:
        return b"U" if q == 0 else b"%s:%d:%d" % (who[:1], q, (1000 if who == O_ else 5000) + q)

    def ts_of(b: bytes) -> float | None:
        parts = b.split(b":")
        return float(parts[2]) if len(parts) > 2 else None

    s = StreamSequencer(
        can_replay=True, replay_on_start=True, max_held=8, max_attempts=3, ts_of=ts_of, clock_skew=0.25,
        epoch=16, delivered=-1, retired=[b"\x0f" * 16, b"\x10" * 16],
    )  # fmt: skip
    old, new = {q: pay(O_, q) for q in range(4)}, {q: pay(N_, q) for q in range(5)}
    out = s.start() + s.heartbeat(0, N_)
    out += serve(s, out, old, None)  # O still answers the start-up replay
    got = s.live(0, new[0], instance=N_)
    out += got + serve(s, got, old, None)
    got = s.probe()
    out += got + serve(s, got, old, None)
    for q in range(1, 5):
        got = s.live(q, new[q], instance=N_)
        out += got + serve(s, got, {k: new[k] for k in range(q + 1)}, None)
    for _ in range(3):
        got = s.probe()
        out += got + serve(s, got, new, None)
    got = s.heartbeat(5, N_) + s.probe()
    out += got + serve(s, got, new, None)
    delivered_payloads = [a.payload for a in out if isinstance(a, Deliver)]
    assert not [p for p in delivered_payloads if p.startswith(b"\x11:")], delivered_payloads  # nothing of O's (I1)
    lost = [(a.from_seq, a.to_seq) for a in out if isinstance(a, Lost)]
    for q in range(1, 5):  # N's own: delivered, or announced lost (I3)
        assert new[q] in delivered_payloads or any(lo <= q <= hi for lo, hi in lost), (q, delivered_payloads, lost)
