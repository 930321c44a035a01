"""Instance identity from the wire (vLLM #57789): the publisher UUID decides epochs where it is
sent; streams without one keep the inference of ``test_sequencer_instances.py``. The compound
model with UUIDs (and an upgrade from none) is ``UuidModel`` in ``test_sequencer_model.py``."""

from __future__ import annotations

from bridge.sequencer import (
    INSTANCE_CHANGED,
    PUBLISHER_RESTART,
    Action,
    Deliver,
    Duplicate,
    Gap,
    Lost,
    RequestReplay,
    Reset,
    StreamSequencer,
    fingerprint,
)

A, B, C = b"\xaa" * 16, b"\xbb" * 16, b"\xcc" * 16


def p(instance: bytes | None, seq: int) -> bytes:
    return b"%s:%d" % ((instance or b"-")[:1], seq)


def ts(payload: bytes) -> float:
    return float(payload.split(b":")[1])


def seqr(*, replay: bool = True, **kw: object) -> StreamSequencer:
    return StreamSequencer(can_replay=replay, replay_on_start=False, ts_of=ts, **kw)  # type: ignore[arg-type]


def feed(s: StreamSequencer, instance: bytes | None, seqs: range | list[int]) -> list[Action]:
    out: list[Action] = []
    for n in seqs:
        out += s.live(n, p(instance, n), instance=instance)
    return out


def delivered(actions: list[Action]) -> list[tuple[int, int]]:
    return [(a.epoch, a.seq) for a in actions if isinstance(a, Deliver)]


def test_a_new_uuid_is_a_certain_restart_even_when_its_seq_continues() -> None:
    """Inference would take seq 3 after 2 for the same instance (kthena #1541); the UUID says not."""
    s = seqr()
    out = feed(s, A, range(3))
    out += s.live(3, p(B, 3), instance=B)  # (waits for its confirmation: its next message here)
    out += s.live(4, p(B, 4), instance=B)
    resets = [a for a in out if isinstance(a, Reset)]
    assert resets == [Reset(1, INSTANCE_CHANGED)]
    # The new instance's head (0..2) is fetched by replay in the new epoch, seq 3 and 4 wait for it.
    assert isinstance(out[-1], RequestReplay) and out[-1].start == 0
    assert delivered(out) == [(0, 0), (0, 1), (0, 2)] and s.held == {3: p(B, 3), 4: p(B, 4)}


def test_a_new_uuid_from_seq_0_opens_the_new_epoch_and_delivers_it() -> None:
    s = seqr(replay=False)
    out = feed(s, A, range(2)) + feed(s, B, range(2))
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert delivered(out) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_seq_going_back_under_the_same_uuid_is_not_a_restart() -> None:
    s = seqr()
    out = feed(s, A, range(5)) + feed(s, A, [2, 4])
    assert not any(isinstance(a, Reset) for a in out)
    assert out[-2:] == [Duplicate(2), Duplicate(4)] and s.epoch == 0
    # Without a UUID the same seqs are a restart, inferred.
    t = seqr()
    assert [a for a in feed(t, None, [0, 1, 2, 3, 4, 2]) if isinstance(a, Reset)] == [Reset(1, PUBLISHER_RESTART)]


def test_a_retired_uuid_never_reaches_the_new_epoch() -> None:
    """A late message of the instance gone (or a second publisher on one stream) is dropped."""
    s = seqr(replay=False)
    out = feed(s, A, range(2)) + feed(s, B, range(2))
    late = s.live(2, p(A, 2), instance=A)
    assert late == [Duplicate(2)] and s.epoch == 1 and s.instance == B
    # ...and the epoch goes on under B as if nothing came.
    assert delivered(out + late + feed(s, B, [2])) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]


def test_an_upgrade_to_a_uuid_is_a_certain_restart() -> None:
    """A publisher that starts sending a UUID was restarted (upgraded): the epoch of the one
    without ends, whatever the new seqs, and from then on the UUID decides."""
    s = seqr(replay=False)
    out = feed(s, None, range(4)) + feed(s, A, [4, 5])
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert [a for a in out if isinstance(a, Lost)] == [Lost(0, 3, "no_replay", 1)]  # the new head, never seen
    assert delivered(out)[-2:] == [(1, 4), (1, 5)] and s.instance == A
    # Going back to none (a downgrade) is a restart too.
    assert [a for a in feed(s, None, [0, 1]) if isinstance(a, Reset)] == [Reset(2, INSTANCE_CHANGED)]


def test_the_first_uuid_of_a_fresh_stream_is_adopted_without_restart() -> None:
    s = seqr(replay=False)
    out = feed(s, A, [0, 1])
    assert not any(isinstance(a, Reset) for a in out) and s.instance == A


def test_a_uuid_ends_doubt_at_once_after_a_reconnect() -> None:
    """After a dropped connection, inference holds live batches until a replay verifies the
    instance; a message under the epoch's UUID proves it, so it is delivered at once."""
    s = seqr()
    feed(s, A, range(3))
    s.disconnected(100.0)
    assert s.in_doubt
    out = s.live(3, p(A, 3), instance=A)
    assert delivered(out) == [(0, 3)] and not s.in_doubt
    # Without a UUID the same batch waits for the verifying replay.
    t = seqr()
    feed(t, None, range(3))
    t.disconnected(100.0)
    out = t.live(3, p(None, 3))
    assert delivered(out) == [] and any(isinstance(a, RequestReplay) for a in out)


def test_a_resumed_stream_verifies_its_first_uuid_by_replay() -> None:
    """A checkpoint that kept no UUID (an older file, an instance adopted in doubt): the first one
    met after a bridge restart is not taken on trust."""
    last = p(A, 5)
    s = seqr(delivered=5, delivered_fp=fingerprint(ts(last), last), epoch=7)
    out = s.live(6, p(A, 6), instance=A)
    assert delivered(out) == [] and isinstance(out[-1], RequestReplay) and s.in_doubt
    out = s.replayed(out[-1].request_id, 5, last) + s.replayed(out[-1].request_id, 6, p(A, 6))
    assert delivered(out) == [(7, 6)] and not s.in_doubt
    assert delivered(s.live(7, p(A, 7), instance=A)) == [(7, 7)]


def test_a_stream_resumed_with_its_uuid_knows_its_instance_at_the_first_message() -> None:
    """The checkpoint kept the epoch's UUID: a live message under it ends the doubt at once, with
    no replay to verify; the gap up to it is still fetched."""
    last = p(A, 5)
    s = seqr(delivered=5, delivered_fp=fingerprint(ts(last), last), epoch=7, instance=A)
    assert s.sure_instance == A and s.in_doubt
    out = s.live(6, p(A, 6), instance=A)
    assert delivered(out) == [(7, 6)] and not s.in_doubt and not any(isinstance(a, RequestReplay) for a in out)
    out = s.live(9, p(A, 9), instance=A)
    assert isinstance(out[-1], RequestReplay) and (out[-1].start, out[-1].until) == (6, 9)  # (9: its reply confirms it)


def test_a_restart_while_the_bridge_was_away_is_certain_without_a_replay_endpoint() -> None:
    """No replay endpoint (KAITO's default): a checkpoint without the UUID cannot tell the new
    instance's seq 8 from the old one's; with it, the UUID says restart, and nothing of the new
    instance goes under the old epoch (I1)."""
    last = p(A, 5)
    before = seqr(replay=False, delivered=5, delivered_fp=fingerprint(ts(last), last), epoch=7)
    assert delivered(before.live(8, p(B, 8), instance=B)) == [(7, 8)]  # (what happens without it)
    s = seqr(replay=False, delivered=5, delivered_fp=fingerprint(ts(last), last), epoch=7, instance=A)
    out = s.live(8, p(B, 8), instance=B) + s.live(9, p(B, 9), instance=B)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(8, INSTANCE_CHANGED)]
    assert delivered(out) == [(8, 8), (8, 9)] and s.epoch == 8 and s.sure_instance == B
    assert [(a.epoch, a.from_seq, a.to_seq) for a in out if isinstance(a, Lost)] == [(8, 0, 7)]
    assert s.retired_instances == [A]


def test_a_stream_resumed_with_retired_uuids_drops_their_late_messages() -> None:
    s = seqr(replay=False, delivered=2, epoch=3, instance=B, retired=[A, C])
    assert s.live(9, p(A, 9), instance=A) == [Duplicate(9)]
    assert s.epoch == 3 and s.retired_instances == [A, C]
    assert delivered(s.live(3, p(B, 3), instance=B)) == [(3, 3)]


def test_heartbeats_carry_the_uuid_and_the_next_seq() -> None:
    s = seqr()
    feed(s, A, range(3))
    assert s.heartbeat(3, A) == []  # nothing missed
    out = s.heartbeat(6, A)  # 3..5 were published and never seen: fetched
    assert len(out) == 1 and isinstance(out[0], RequestReplay) and out[0].until == -1  # (from 2: it verifies)
    t = seqr(replay=False)
    feed(t, A, range(3))
    assert t.heartbeat(0, B) == []  # a new instance, quiet so far: confirmed by its next message
    assert t.heartbeat(0, B) == [Reset(1, INSTANCE_CHANGED)]
    assert delivered(feed(t, B, [0])) == [(1, 0)]


def test_gap_under_the_same_uuid_is_repaired_by_replay() -> None:
    s = seqr()
    out = feed(s, A, [0, 1, 4])
    assert Gap(2, 3) in out and s.waiting == {4}
    req = next(a for a in out if isinstance(a, RequestReplay))
    out = [a for n in (1, 2, 3, 4) for a in s.replayed(req.request_id, n, p(A, n))]
    assert delivered(out) == [(0, 2), (0, 3), (0, 4)]


def test_a_replay_answered_under_a_new_uuid_is_a_certain_restart() -> None:
    """An idle engine restarted: its probe's replay answers under a new UUID before any live
    message does."""
    s = seqr()
    feed(s, A, range(3))
    req = s.probe()[0]
    assert isinstance(req, RequestReplay)
    out = s.replayed(req.request_id, 0, p(B, 0), instance=B)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert delivered(out) == [(1, 0)] and s.instance == B
    assert Deliver(0, p(B, 0), 1, True) in out  # (a replayed batch)
    nxt = out[-1]
    assert isinstance(nxt, RequestReplay)
    # A reply of the retired instance to the old request is ignored; the new one's go on.
    assert s.replayed(req.request_id, 2, p(A, 2), instance=A) == []
    assert delivered(s.replayed(nxt.request_id, 1, p(B, 1), instance=B)) == [(1, 1)]


def test_a_replay_under_the_epochs_uuid_needs_no_verification() -> None:
    s = seqr()
    feed(s, A, range(3))
    s.disconnected(10.0)
    out = s.live(5, p(A, 5), instance=A)  # the same instance, for certain: the gap is fetched
    req = next(a for a in out if isinstance(a, RequestReplay))
    out = [a for n in (3, 4, 5) for a in s.replayed(req.request_id, n, p(A, n), instance=A)]
    assert delivered(out) == [(0, 3), (0, 4), (0, 5)] and not s.in_doubt


def test_a_stream_remembers_the_64_uuids_retired_last() -> None:
    """Each instance gone is retired; past 64, the oldest is forgotten (a crash-looping engine must
    not grow a stream's memory without bound)."""
    uuids = [bytes([i]) * 16 for i in range(100, 166)]
    s = seqr(replay=False)
    for n, uuid in enumerate(uuids):
        s.live(2 * n, p(uuid, 2 * n), instance=uuid)
        s.live(2 * n + 1, p(uuid, 2 * n + 1), instance=uuid)  # (its second message confirms it)
    assert s.sure_instance == uuids[-1]
    assert s.retired_instances == uuids[1:-1]  # 65 retired: the first forgotten


def test_a_kept_uuid_is_certain_only_with_a_batch_to_verify_a_replay_against() -> None:
    """Without the fingerprint of the batch delivered last, the replay that ends the doubt is
    taken on trust, and a UUID kept would contradict that: it is met afresh."""
    last = p(A, 5)
    kept = seqr(delivered=5, delivered_fp=fingerprint(ts(last), last), epoch=7, instance=A, retired=[B])
    assert kept.sure_instance == A and kept.retired_instances == [B]
    afresh = seqr(delivered=5, epoch=7, instance=A, retired=[B])
    assert afresh.sure_instance is None and afresh.retired_instances == [B]


def test_a_heartbeat_is_first_contact_with_an_instance_and_one_from_a_retired_uuid_is_ignored() -> None:
    s = seqr()
    assert s.heartbeat(0, A) == []  # nothing published yet, nothing missed
    assert s.sure_instance == A  # known for certain from its first heartbeat
    resumed = seqr(replay=True, delivered=2, epoch=3, instance=B, retired=[A])
    assert resumed.heartbeat(50, A) == []  # a late heartbeat of an instance gone: no gap to fetch
    assert resumed.epoch == 3 and resumed.retired_instances == [A]


def test_what_a_heartbeat_says_of_the_seqs_below_it() -> None:
    """Everything below a heartbeat's next seq was published: what the stream has not seen is
    fetched (from the last seq delivered, which it verifies), only with a replay endpoint, and a
    heartbeat without a UUID where the epoch's instance sent one shows a new instance."""
    assert seqr().heartbeat(0, A) == []  # nothing published yet
    assert seqr().heartbeat(1, A) == [RequestReplay(1, 0, -1, 0)]  # seq 0 was, and never seen
    s = seqr()
    feed(s, A, range(3))
    assert s.heartbeat(4, A) == [RequestReplay(1, 2, -1, 0)]  # seq 3 missed
    t = seqr(replay=False)
    feed(t, A, range(3))
    assert t.heartbeat(6, A) == []  # without replay the next batch shows the gap
    u = seqr()
    feed(u, A, range(3))
    assert u.heartbeat(3, None) == [RequestReplay(1, 2, 2, 0)]  # (whose is seq 2 now?)
    assert u.heartbeat(3, None) == [Reset(1, INSTANCE_CHANGED), RequestReplay(2, 0, -1, 0)]  # its second: confirmed


def test_a_heartbeat_under_the_epochs_uuid_ends_the_doubt_and_one_without_a_uuid_proves_nothing() -> None:
    s = seqr()
    feed(s, A, range(3))
    s.disconnected(now=10.0)
    assert s.in_doubt and s.heartbeat(3, A) == [] and not s.in_doubt
    anonymous = seqr()
    feed(anonymous, None, range(3))
    anonymous.disconnected(now=10.0)
    assert anonymous.heartbeat(10, None) == [] and anonymous.in_doubt  # (no replay asked either)


def test_a_uuid_adopted_in_doubt_is_retired_when_another_comes() -> None:
    s = seqr()
    s.disconnected(now=10.0)
    feed(s, B, [0])  # adopted in doubt, not verified yet
    assert s.instance == B and s.sure_instance is None
    out = feed(s, C, [0, 1])
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert s.retired_instances == [B] and s.sure_instance == C
    assert s.live(1, p(B, 1), instance=B) == [Duplicate(1)]  # a late message of it is dropped


def test_a_gap_under_the_same_uuid_without_replay_is_announced_lost_and_what_is_past_it_delivered() -> None:
    t = seqr(replay=False)
    out = feed(t, A, [0, 1, 4])
    assert out[2:] == [Gap(2, 3), Lost(2, 3, "no_replay", 0), Deliver(4, p(A, 4), 0)]
    assert feed(t, A, [4, 3]) == [Duplicate(4), Duplicate(3)]  # (a copy, and a seq announced lost)


def test_the_engine_ts_of_the_message_that_shows_a_new_uuid_numbers_the_new_epoch() -> None:
    """Every bridge reading the engine numbers the new epoch alike from what showed it: the live
    message's engine ts (one that is not a finite number says nothing: unknown)."""
    shown: list[float | None] = []

    def next_epoch(epoch: int, shown_at: float | None) -> int:
        shown.append(shown_at)
        return epoch + 1

    s = seqr(next_epoch=next_epoch)
    feed(s, A, range(3))
    s.live(3, p(B, 3), 7.5, instance=B)
    s.live(4, p(B, 4), 8.5, instance=B)  # (confirms it: the first one's ts numbers the epoch)
    s.live(0, p(C, 0), float("nan"), instance=C)
    s.live(1, p(C, 1), 9.5, instance=C)
    assert shown == [7.5, None]


def test_a_heartbeats_new_uuid_is_known_for_certain_at_once() -> None:
    s = seqr(replay=False)
    feed(s, A, range(3))
    assert s.heartbeat(0, B) == [] and s.sure_instance == A  # (one heartbeat could be a corrupt frame)
    assert s.heartbeat(0, B) == [Reset(1, INSTANCE_CHANGED)]
    assert s.sure_instance == B and s.retired_instances == [A]


def test_a_heartbeat_makes_the_seqs_below_it_the_instances_to_settle_when_it_restarts() -> None:
    """Without replay nothing is fetched, but the seqs a heartbeat says were published are the
    instance's: when another instance comes, the old epoch announces them lost (I3). A heartbeat
    without a UUID says nothing of whose they are."""
    s = seqr(replay=False)
    feed(s, A, range(3))
    assert s.heartbeat(6, A) == [] and s.known_top == 5
    out = feed(s, B, [0, 1])
    assert out[:2] == [Lost(3, 5, INSTANCE_CHANGED, 0), Reset(1, INSTANCE_CHANGED)]
    anonymous = seqr(replay=False)
    feed(anonymous, None, range(3))
    assert anonymous.heartbeat(6, None) == [] and anonymous.known_top == 2


def test_the_replay_a_heartbeat_asks_for_is_a_first_attempt() -> None:
    """Replays that told nothing in doubt (the engine answered none) count attempts; a heartbeat
    under the epoch's UUID ends the doubt, and the tail it shows is fetched afresh: attempt 0."""
    s = seqr()
    feed(s, A, range(3))
    s.disconnected(now=10.0)
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    (again,) = s.replay_finished(probe.request_id, complete=True)  # nothing from seq 2: from seq 0
    assert isinstance(again, RequestReplay) and again.start == 0
    assert s.replay_finished(again.request_id, complete=True) == []
    assert not s.replaying and s.in_doubt
    out = s.heartbeat(6, A)
    assert not s.in_doubt and out == [RequestReplay(again.request_id + 1, 2, -1, 0)]


def test_a_late_joiner_met_by_its_heartbeat_announces_the_head_it_missed_as_joined_late() -> None:
    """A stream first met through a heartbeat knows its instance for certain; its first live batch
    above seq 0 is the bridge joining late: the head is lost as ``joined_late``, no gap shown. Past
    the head, a gap is an ordinary one (without replay: lost as ``no_replay``)."""
    s = seqr(replay=False)
    assert s.heartbeat(2, A) == [] and s.sure_instance == A
    assert s.live(1, p(A, 1), instance=A) == [Lost(0, 0, "joined_late", 0), Deliver(1, p(A, 1), 0)]
    t = seqr(replay=False)
    t.heartbeat(1, A)
    assert delivered(feed(t, A, [0])) == [(0, 0)]
    assert feed(t, A, [3]) == [Gap(1, 2), Lost(1, 2, "no_replay", 0), Deliver(3, p(A, 3), 0)]


def test_under_the_same_uuid_a_gap_is_shown_once_and_a_late_live_batch_filling_it_releases_those_held() -> None:
    """Seq 2 missed: one gap, whatever comes above it while the replay is in flight; seq 2 read
    late on the live stream (interleaving, not a restart under the UUID) fills it, and the batches
    held above it go out behind it."""
    s = seqr()
    out = feed(s, A, [0, 1, 3, 5])
    assert [a for a in out if isinstance(a, Gap)] == [Gap(2, 2)] and len([a for a in out if isinstance(a, RequestReplay)]) == 1
    assert delivered(s.live(2, p(A, 2), instance=A)) == [(0, 2), (0, 3)] and s.waiting == {5}


def test_a_resumed_streams_replay_answered_under_its_uuid_is_trusted_without_its_anchor() -> None:
    """Resumed with its UUID (certain): the replay that starts it may lose the anchor's reply
    (seq 5); a reply under the epoch's UUID is this instance's all the same, whatever its clock:
    doubt ends and the replies are delivered, no verification by bytes or clocks."""
    last = p(A, 5)
    s = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, delivered=5, delivered_fp=fingerprint(ts(last), last), instance=A
    )
    (req,) = s.start()
    assert isinstance(req, RequestReplay) and req.start == 5 and s.in_doubt
    stepped_back = b"\xaa:1"  # stamped before seq 5: by its clock, another instance; by its UUID, this one
    out = s.replayed(req.request_id, 6, stepped_back, instance=A)
    assert out == [Deliver(6, stepped_back, 0, True)] and not s.in_doubt
    assert s.replayed(req.request_id, 7, p(A, 7), instance=A) == [Deliver(7, p(A, 7), 0, True)]
    assert s.disconnected(now=10.0) == [] and s.in_doubt  # nothing waits for a verdict: nothing to ask again


def test_a_replay_answered_under_a_new_uuid_above_seq_0_knows_the_instance_and_its_seqs() -> None:
    """The new instance answers with its seq 3 first (its 0..2 left its buffer, or are asked for
    next): its UUID is certain at once, seq 3 is known published by it, and kept for its epoch."""
    s = seqr()
    feed(s, A, range(3))
    (req,) = s.probe()
    assert isinstance(req, RequestReplay)
    out = s.replayed(req.request_id, 3, p(B, 3), instance=B)
    assert out[0] == Reset(1, INSTANCE_CHANGED) and isinstance(out[-1], RequestReplay) and out[-1].start == 0
    assert s.sure_instance == B and s.retired_instances == [A]
    assert s.held == {3: p(B, 3)} and s.known_top == 3


def test_a_first_reply_past_a_seq_delivered_live_meanwhile_is_not_a_second_skip() -> None:
    """The first replay's first reply skips 1..2 (a first time: asked again, nothing lost). During
    the second, seq 1 comes live under the same UUID and is delivered; its first reply, 3, skips 2,
    which no replay had skipped before: still nothing is lost, 2 is asked for again."""
    s = seqr()
    feed(s, A, [0])
    out = s.live(5, p(A, 5), instance=A)
    (req,) = [a for a in out if isinstance(a, RequestReplay)]
    out = s.replayed(req.request_id, 0, p(A, 0), instance=A) + s.replayed(req.request_id, 3, p(A, 3), instance=A)
    out += s.replayed(req.request_id, 5, p(A, 5), instance=A)  # (which confirms the live batch 5)
    out += s.replay_finished(req.request_id, complete=True)
    (req,) = [a for a in out if isinstance(a, RequestReplay)]
    assert (req.start, req.until, req.attempt) == (0, 2, 1)
    assert delivered(s.live(1, p(A, 1), instance=A)) == [(0, 1)]
    out = s.replayed(req.request_id, 0, p(A, 0), instance=A) + s.replayed(req.request_id, 3, p(A, 3), instance=A)
    out += s.replay_finished(req.request_id, complete=True)
    assert not [a for a in out if isinstance(a, Lost)]
    (req,) = [a for a in out if isinstance(a, RequestReplay)]
    assert (req.start, req.until) == (1, 2)


def test_an_instance_that_published_nothing_has_nothing_announced_lost_when_it_goes() -> None:
    """Instance B shows only by heartbeats before anything (next seq 0; confirmed by its second),
    then C replaces it (at once, right after a disconnect): B's epoch opened and closed with nothing published, so
    nothing of it is announced lost."""
    s = seqr(replay=False)
    feed(s, A, range(3))
    assert s.heartbeat(0, instance=B) == [] and s.heartbeat(0, instance=B) == [Reset(1, INSTANCE_CHANGED)]
    assert s.disconnected() == [] and not s.in_doubt  # (without replay nothing is in doubt)
    assert s.heartbeat(0, instance=C) == [Reset(2, INSTANCE_CHANGED)]  # (right after the drop: at once)
    assert s.heartbeat(0, instance=C) == [] and s.heartbeat(0, instance=b"\xdd" * 16) == []
    assert s.heartbeat(0, instance=b"\xdd" * 16) == [Reset(3, INSTANCE_CHANGED)]  # nor of C's


def test_an_instance_gone_by_an_empty_replay_is_retired() -> None:
    """The replay socket answered under A (its buffer works), then nothing from our position on: A
    restarted. A late live message under A is dropped, never taken into the new epoch."""
    s = seqr()
    feed(s, A, range(3))
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    s.replayed(probe.request_id, 2, p(A, 2), instance=A)
    s.replay_finished(probe.request_id, complete=True)
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    assert Reset(1, PUBLISHER_RESTART) in s.replay_finished(probe.request_id, complete=True)
    assert s.live(3, p(A, 3), instance=A) == [Duplicate(3)]
    assert s.retired_instances == [A]


def test_an_epoch_without_a_uuid_retires_none_when_it_ends() -> None:
    """A, then messages without a UUID (a publisher that sends none: a certain restart), then B:
    only A is retired; the epoch without a UUID leaves nothing to retire."""
    s = seqr()
    feed(s, A, range(3))
    assert Reset(1, INSTANCE_CHANGED) in feed(s, None, [0, 1])
    assert Reset(2, INSTANCE_CHANGED) in feed(s, B, [0, 1])
    assert s.retired_instances == [A]


def test_a_reply_under_the_uuid_the_epochs_replies_came_under_is_not_another_instance_by_its_clock() -> None:
    """breaker120 3 (7 of 7): every batch of the epoch came by replay, under UUID U (the epoch's
    instance unsure: the live publisher may be another). U's clock then stepped back and its buffer
    slid past the next seq: the next replay's first reply, a later seq with an earlier ts than the
    one delivered last, was taken for another instance (a new epoch, 0..12 announced lost in it).
    A reply under U is U's, whoever holds the socket: the seqs that left its buffer are lost in the
    same epoch, and nothing restarts."""
    stamps: dict[bytes, float] = {}
    u = b"\x01" * 16

    def stamped(seq: int, at: float) -> bytes:
        payload = f"U:{seq}".encode()
        stamps[payload] = at
        return payload

    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=stamps.get, clock_skew=0.25)
    (req,) = [a for a in s.start() if isinstance(a, RequestReplay)]
    out: list[Action] = []
    for q in range(6):
        out += s.replayed(req.request_id, q, stamped(q, 1000.0 + q), u)
    out += s.replay_finished(req.request_id, complete=True)
    assert [a.seq for a in out if isinstance(a, Deliver)] == list(range(6))
    epoch = s.epoch
    pending = [a for a in s.probe() if isinstance(a, RequestReplay)]
    while pending and len(out) < 200:
        r = pending.pop(0)
        step: list[Action] = []
        for q in range(13, 24):  # (6..12 left the buffer; the clock stepped back 100 s)
            if q >= r.start:
                step += s.replayed(r.request_id, q, stamped(q, 900.0 + q), u)
        step += s.replay_finished(r.request_id, complete=True)
        out += step
        pending += [a for a in step if isinstance(a, RequestReplay)]
    assert not [a for a in out if isinstance(a, Reset)], out
    assert s.epoch == epoch
    assert [(a.from_seq, a.to_seq) for a in out if isinstance(a, Lost)] == [(6, 12)]
    assert [a.seq for a in out if isinstance(a, Deliver)] == [*range(6), *range(13, 24)]
