"""A publisher UUID adopted while continuity is in doubt (breaker31h F1): when the doubt ends with
the batches that carried it delivered in the epoch, the UUID is the epoch's for certain (what
records name and a checkpoint keeps), so that a bridge resumed from it knows the instance at
once, however far the engine's buffer slid or its clock stepped back meanwhile. A UUID known
only from a replay reply or a heartbeat is not made certain by the doubt's end (the replay is
answered by whoever holds its socket). Helpers: ``test_sequencer_uuid.py``."""

from __future__ import annotations

from bridge.sequencer import INSTANCE_CHANGED, Action, Duplicate, Lost, RequestReplay, Reset, StreamSequencer
from tests.unit.test_sequencer_uuid import A, B, C, delivered, feed, p, seqr, ts


def request(actions: list[Action]) -> RequestReplay:
    (req,) = [a for a in actions if isinstance(a, RequestReplay)]
    return req


def answer(s: StreamSequencer, req: RequestReplay, replies: list[tuple[int, bytes]], instance: bytes | None) -> list[Action]:
    out: list[Action] = []
    for seq, payload in replies:
        out += s.replayed(req.request_id, seq, payload, instance=instance)
    return out + s.replay_finished(req.request_id, complete=True)


def restart_shown_after_two_drops() -> tuple[StreamSequencer, list[Action]]:
    """Instance A delivered 0..1; the connection drops twice; B's live 3..6 come, published before
    the second drop: the restart opens epoch 1 still in doubt, B adopted unsure, and the replay
    of B's 0..2 (the replies under B too) verifies them: 0..6 go out in epoch 1."""
    s = seqr()
    feed(s, A, range(2))
    s.disconnected(now=10.0)
    s.disconnected(now=20.0)
    out = feed(s, B, range(3, 7))
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert s.in_doubt and s.instance == B and s.sure_instance is None  # (in doubt: not yet)
    return s, out


def test_a_uuid_adopted_in_doubt_is_certain_once_the_batches_it_carried_are_verified() -> None:
    s, out = restart_shown_after_two_drops()
    out = answer(s, request(out), [(n, p(B, n)) for n in range(3)], B)
    assert delivered(out) == [(1, n) for n in range(7)] and not s.in_doubt
    assert s.sure_instance == B and s.retired_instances == [A]


def test_a_bridge_resumed_after_it_keeps_the_instance_in_its_epoch_when_the_buffer_slid_and_the_clock_stepped_back() -> None:
    """The bridge is killed right after 0..6 went out (no further live message), resumed from
    what the checkpoint keeps (as the runtime builds it). B published on while it was away: its
    buffer no longer holds 7..21, and its clock stepped back (by the clock alone 22 would be
    another instance's). The kept UUID says B: 7..21 announced lost in epoch 1, 22.. delivered in
    it, no new epoch (before: epoch 2 opened, 0..6 announced lost again, 7..32 never settled)."""
    s, out = restart_shown_after_two_drops()
    answer(s, request(out), [(n, p(B, n)) for n in range(3)], B)
    epoch, at, fp, anchor = s.resume_point()
    r = StreamSequencer(
        can_replay=True,
        replay_on_start=True,
        ts_of=ts,
        epoch=epoch,
        delivered=at,
        delivered_fp=fp,
        anchor=anchor,
        instance=s.sure_instance,
        retired=s.retired_instances,
    )
    buffer = [(n, b"\xbb:%d" % (n - 20)) for n in range(22, 26)]  # (stamped before seq 6: the clock stepped back)
    out = answer(r, request(r.start()), buffer, B)
    out += answer(r, request(out), buffer, B)  # (the first reply above the start twice: the span left the buffer)
    assert not any(isinstance(a, Reset) for a in out) and r.epoch == 1
    assert [a for a in out if isinstance(a, Lost)] == [Lost(7, 21, "replay_buffer_exceeded", 1)]
    assert delivered(out) == [(1, n) for n in range(22, 26)]


def test_the_live_batches_presumed_continuous_make_their_uuid_certain_too() -> None:
    """The replay socket stays silent for ``max_attempts``: continuity is presumed and the batches
    waiting go out in the epoch, under the UUID they carried, which is certain from then on (as
    the next live message under it would make it)."""
    s, out = restart_shown_after_two_drops()
    req = request(out)
    for _ in range(s.max_attempts):
        assert s.sure_instance is None
        out = s.replay_finished(req.request_id, complete=False)
        if not s.in_doubt:
            break
        req = request(out)
    assert not s.in_doubt and s.sure_instance == B


def test_a_uuid_known_only_from_a_replay_reply_stays_unsure_when_the_doubt_ends() -> None:
    """Shown by a reply published before the second drop (B's seq 3), the new epoch opens in doubt
    with B adopted from the replay socket; the replay that verifies it delivers 0..3, but no live
    batch of B waited: B becomes certain only with its first live message."""
    s = seqr()
    feed(s, A, range(2))
    s.disconnected(now=10.0)
    probe = request(s.probe())
    s.disconnected(now=20.0)
    out = s.replayed(probe.request_id, 3, p(B, 3), instance=B)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)] and s.in_doubt
    out = answer(s, request(out), [(n, p(B, n)) for n in range(3)], B)
    assert delivered(out) == [(1, n) for n in range(4)] and not s.in_doubt
    assert s.instance == B and s.sure_instance is None
    assert delivered(feed(s, B, [4])) == [(1, 4)] and s.sure_instance == B


def test_a_reply_under_another_uuid_that_ends_the_doubt_does_not_make_the_live_uuid_certain() -> None:
    """B's live 3..6 wait in doubt; the replay is answered by another instance, C (it holds the
    replay socket now). C's reply ends the doubt, but nothing says B answered: B stays unsure.
    Before (breaker31y B3), B was made certain, C's next reply then made C certain as a restart
    known only from replies, and B's live 7 and 8 were dropped as copies, never delivered nor
    announced lost (I3)."""
    s, out = restart_shown_after_two_drops()
    out = answer(s, request(out), [(n, p(C, n)) for n in range(3)], C)
    assert s.sure_instance != B
    more = feed(s, B, [7, 8])
    assert not [a for a in more if isinstance(a, Duplicate)]
    assert s.sure_instance == B and s.instance == B
    rest = out + more
    for req in [a for a in rest if isinstance(a, RequestReplay)]:
        rest += answer(s, req, [(n, p(B, n)) for n in range(req.start, 9)], B)
    assert {7, 8} <= {seq for _, seq in delivered(rest)}


def test_a_stream_resumed_without_its_uuid_keeps_one_verified_only_by_replies_unsure() -> None:
    """Resumed from a checkpoint that kept no UUID (an earlier release), the start-up replay under
    B verifies the position: B is adopted, unsure (no live batch of it waited), and certain with its
    first live message. Nothing vouched for it before the start: a fresh sequencer has no live
    batch of its UUID waiting."""
    s, out = restart_shown_after_two_drops()
    answer(s, request(out), [(n, p(B, n)) for n in range(3)], B)
    epoch, at, fp, anchor = s.resume_point()
    r = StreamSequencer(
        can_replay=True, replay_on_start=True, ts_of=ts, epoch=epoch, delivered=at, delivered_fp=fp, anchor=anchor
    )
    out = answer(r, request(r.start()), [(n, p(B, n)) for n in range(at, at + 3)], B)
    assert not any(isinstance(a, Reset) for a in out) and r.epoch == epoch
    assert delivered(out) == [(epoch, at + 1), (epoch, at + 2)]
    assert r.sure_instance is None
    assert delivered(feed(r, B, [at + 3])) == [(epoch, at + 3)] and r.sure_instance == B


def test_a_reply_under_another_uuid_in_an_epoch_with_no_batch_to_compare_is_another_instance() -> None:
    """breaker36 B2: resumed from a checkpoint in an epoch with no batch delivered, the idle engine A
    known only by its heartbeat (adopted unsure, in doubt); A restarts (the drop is seen) and B
    publishes seq 0 while the bridge reconnects; the probe's replay is answered by B, under B's
    UUID. Nothing of the epoch to compare it with: before, B's seq 0 went out in A's epoch, and again
    in B's own once its live messages came (one instance in two epochs, I1). Now a reply under
    another UUID with nothing to compare is another instance's: B's epoch, once."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, epoch=5, delivered=-1)
    out = s.start()
    out += answer(s, request(out), [], None)
    out += s.heartbeat(0, A)
    out += s.disconnected(1999.0)
    req = [a for a in out + s.probe() if isinstance(a, RequestReplay)][-1]
    out += answer(s, req, [(0, p(B, 0))], B)
    for n in (1, 2):
        out += s.live(n, p(B, n), instance=B)
        for ask in [a for a in out if isinstance(a, RequestReplay) and a.request_id == s._replay]:
            out += answer(s, ask, [(q, p(B, q)) for q in range(max(ask.start, 0), n + 1)], B)
    epochs = {e for e, seq in delivered(out)}
    assert len(epochs) == 1 and epochs != {5}, delivered(out)
    assert sorted(seq for _, seq in delivered(out)) == [0, 1, 2]


def idle_engine_after_a_drop() -> tuple[StreamSequencer, list[Action]]:
    """A running stream: X delivered 0..4, restarted into A, which is idle (its heartbeat opened
    epoch 1: nothing delivered in it). The connection drops; the idle probe's replay is asked."""
    X = b"\x99" * 16
    s = seqr()
    feed(s, X, range(5))
    s.disconnected(now=999.0)
    assert [a for a in s.heartbeat(0, A) if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    s.disconnected(now=1999.0)
    return s, s.probe()


def serve(s: StreamSequencer, out: list[Action], by: bytes, published: int) -> list[Action]:
    """Every replay asked, answered by instance ``by`` (seqs 0..published-1), replies without a UUID."""
    done: list[Action] = []
    todo = [a for a in out if isinstance(a, RequestReplay)]
    while todo:
        req = todo.pop(0)
        top = published - 1 if req.until < 0 else min(req.until, published - 1)
        more = answer(s, req, [(n, p(by, n)) for n in range(max(req.start, 0), top + 1)], None)
        done += more
        todo += [a for a in more if isinstance(a, RequestReplay)]
    return done


def test_a_reply_without_a_uuid_in_an_epoch_with_nothing_to_compare_waits_for_a_uuid_to_decide() -> None:
    """breaker36 B2, replies without UUIDs: A restarted into B (the drop is seen), B published seq 0
    while the bridge reconnected, and the probe's replay is answered by B under no UUID. Nothing of
    epoch 1 to compare it with: before, B's seq 0 went out in A's epoch 1, then B's next messages
    opened epoch 2 and 0..2 went out again (one instance in two epochs, I1). Now the reply waits:
    B's heartbeat decides, and B's batches go out in B's epoch only, once each."""
    s, out = idle_engine_after_a_drop()
    out += serve(s, out, B, 1)
    assert not delivered(out) and s.in_doubt
    more = s.heartbeat(1, B)
    more += serve(s, more, B, 1)
    for n in (1, 2):
        more += s.live(n, p(B, n), ts(p(B, n)), B)
        more += serve(s, more, B, n + 1)
    out += more
    assert [a for a in out if isinstance(a, Reset)] == [Reset(2, INSTANCE_CHANGED)]
    assert delivered(out) == [(2, 0), (2, 1), (2, 2)]


def test_a_late_heartbeat_of_the_old_instance_that_does_not_cover_the_reply_decides_nothing() -> None:
    """breaker48 B1: as above, and A's last heartbeat (next seq 0, published before it died) is read
    after B's reply. It ended the doubt, B's replies went out in A's epoch, and B's own messages were
    then dead-lettered as not the engine's (I1). A heartbeat saying its instance published nothing up
    to the reply's seq tells nothing: B's message decides, and B has its own epoch."""
    s, out = idle_engine_after_a_drop()
    out += serve(s, out, B, 1)
    out += s.heartbeat(0, A)  # (late)
    assert s.in_doubt and not delivered(out)
    more = s.live(1, p(B, 1), ts(p(B, 1)), B)
    out += more + serve(s, more, B, 2)
    assert [a for a in out if isinstance(a, Reset)] == [Reset(2, INSTANCE_CHANGED)]
    assert delivered(out) == [(2, 0), (2, 1)]


def test_a_heartbeat_under_the_epochs_uuid_after_an_unattributed_reply_ends_the_doubt() -> None:
    """The control: A did not restart (the connection blipped), published seq 0 and answers the
    probe under no UUID. The reply waits; A's next heartbeat says A holds the engine now: the doubt
    ends, and the next probe delivers A's seq 0 in A's epoch, with no restart."""
    s, out = idle_engine_after_a_drop()
    out += serve(s, out, A, 1)
    assert not delivered(out) and s.in_doubt
    out += s.heartbeat(1, A)
    assert not s.in_doubt
    out += serve(s, out, A, 1)
    out += serve(s, s.probe(), A, 1)
    assert not [a for a in out if isinstance(a, (Reset, Lost))]
    assert delivered(out) == [(1, 0)] and s.epoch == 1


def idle_and_probed_after_a_drop(published: int, by: bytes) -> tuple[StreamSequencer, RequestReplay]:
    """A fresh stream whose engine A is idle (its heartbeat, next seq 0: A sure, nothing delivered);
    the connection drops, and the idle probe's replay is answered by ``by``'s 0..published-1 under
    no UUID (held: nothing of the epoch to compare with), its end marker not read yet."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts)
    (start,) = s.start()
    assert isinstance(start, RequestReplay)
    s.replay_finished(start.request_id, complete=True)
    s.heartbeat(0, A)
    s.disconnected(now=1999.0)
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    for n in range(published):
        assert s.replayed(probe.request_id, n, p(by, n)) == []
    return s, probe


def test_a_restart_shown_while_unattributed_replies_wait_announces_their_seqs_in_the_old_epoch() -> None:
    """breaker50 B1: A published 0..5 during the blip and answers the probe with them; before the
    replay ends, B's first message shows the restart. The replies were dropped with the replay and
    A's 0..5, which reached the bridge, were neither delivered nor announced (I3). Now its epoch
    announces them lost (it may have published them), and B's epoch fetches its own."""
    s, _ = idle_and_probed_after_a_drop(6, A)
    out = s.live(0, p(B, 0), ts(p(B, 0)), B)
    assert out[:2] == [Lost(0, 5, INSTANCE_CHANGED, 0), Reset(1, INSTANCE_CHANGED)]
    assert delivered(out) == [(1, 0)]


def test_a_late_live_batch_of_the_epochs_instance_below_an_unattributed_reply_does_not_end_the_doubt() -> None:
    """breaker50 B3: A's live seq 0, read late (queued before A died), comes after B's replies 0..1
    under no UUID. It ended the doubt: B's replies went out in A's epoch and B's own messages were
    dead-lettered as not the engine's (I1). A's batch is A's (its UUID): it goes out in A's epoch,
    but it says nothing of who answered; B's message decides."""
    s, probe = idle_and_probed_after_a_drop(2, B)
    out = s.live(0, p(A, 0), ts(p(A, 0)), A)
    assert delivered(out) == [(0, 0)] and s.in_doubt
    out += s.replayed(probe.request_id, 2, p(B, 2)) + s.replay_finished(probe.request_id, complete=True)
    more = s.live(3, p(B, 3), ts(p(B, 3)), B)
    more += serve(s, more, B, 4)
    out += more
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert [(e, n) for e, n in delivered(out) if e == 1] == [(1, n) for n in range(4)]
    assert [(e, n) for e, n in delivered(out) if e == 0] == [(0, 0)]


def test_once_a_reply_waits_unattributed_every_later_one_without_a_uuid_waits_too() -> None:
    """breaker52 B1: B's replies 0..3 wait (no UUID, nothing to compare); A's late live seq 2 is kept
    (it decides nothing); then B's replies 4 and 5 no longer met "nothing to compare" (A's batch was
    there), contradicted nothing, and took every reply waiting into A's epoch: B's 0..5 went out
    in it, and B's own messages were then dead-lettered (I1). Every later reply without a UUID now
    waits too, until a message under a UUID decides."""
    s, probe = idle_and_probed_after_a_drop(4, B)
    out = s.live(2, p(A, 2), ts(p(A, 2)), A)
    for n in (4, 5):
        out += s.replayed(probe.request_id, n, p(B, n))
    out += s.replay_finished(probe.request_id, complete=True)
    assert not [(e, n) for e, n in delivered(out) if n != 2]
    more = s.live(6, p(B, 6), ts(p(B, 6)), B)
    more += serve(s, more, B, 7)
    out += more
    assert [a for a in out if isinstance(a, Reset)] == [Reset(1, INSTANCE_CHANGED)]
    assert [(e, n) for e, n in delivered(out) if e == 1] == [(1, n) for n in range(7)]
    assert [(e, n) for e, n in delivered(out) if e == 0] == [(0, 2)]


def test_a_reply_at_the_seq_of_a_batch_held_under_the_epochs_uuid_compares_its_bytes() -> None:
    """breaker54 B3: A (sure from its heartbeat, next seq 6) answers the probe after a blip with
    0..7 under no UUID: they wait; A's live 6, read late, is held (it decides nothing). Every reply
    waited for ever after, the replays counted as telling nothing, and the fillable gap 0..5 was
    announced lost (I4). The reply at the held batch's seq tells by its bytes: the same, it is
    A's, and 0..7 go out in A's epoch."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts)
    (start,) = s.start()
    assert isinstance(start, RequestReplay)
    out = s.replay_finished(start.request_id, complete=True) + s.heartbeat(6, A)
    out += s.disconnected(now=1999.0)
    (probe,) = s.probe()
    assert isinstance(probe, RequestReplay)
    for n in range(8):
        out += s.replayed(probe.request_id, n, p(A, n))
    out += s.live(6, p(A, 6), ts(p(A, 6)), A)  # (6 <= 7: a late batch, perhaps)
    out += s.replay_finished(probe.request_id, complete=True)
    assert s.in_doubt and not delivered(out)
    for _ in range(3):  # the next probes, answered alike
        for ask in [a for a in s.probe() if isinstance(a, RequestReplay)]:
            for n in range(max(ask.start, 0), 8):
                out += s.replayed(ask.request_id, n, p(A, n))
            out += s.replay_finished(ask.request_id, complete=True)
    assert not [a for a in out if isinstance(a, Lost | Reset)], out
    assert delivered(out) == [(0, n) for n in range(8)]
