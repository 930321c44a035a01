"""When bytes decide: a replay in doubt answered by another instance than the epoch's, while live
batches without an engine ts wait (undecodable: no clock to compare). The answering instance's
replies sort the batches waiting into its own (the same seq and bytes) and not its own; a replay
that stops at the last seq asked for before that is done is followed by one for the rest, from its
last reply, which the next replay's first reply must repeat (``_SORTING`` in the sequencer).

Payloads are ``instance:seq`` (engine ts ``instance * 1e6 + seq``) or ``instance:seq:x`` (no ts).
"""

from __future__ import annotations

from bridge.sequencer import Action, Deliver, Duplicate, Lost, RequestReplay, Reset, StreamSequencer


def p(instance: int, seq: int, stamped: bool = True) -> bytes:
    return (f"{instance}:{seq}" if stamped else f"{instance}:{seq}:x").encode()


def ts(payload: bytes) -> float | None:
    parts = payload.decode().split(":")
    return int(parts[0]) * 1e6 + int(parts[1]) if len(parts) == 2 else None


def only_request(actions: list[Action]) -> RequestReplay:
    (req,) = [a for a in actions if isinstance(a, RequestReplay)]
    return req


def delivered(actions: list[Action]) -> list[tuple[int, bytes]]:
    return [(a.epoch, a.payload) for a in actions if isinstance(a, Deliver)]


def in_doubt_with_undecodable_batches() -> tuple[StreamSequencer, RequestReplay]:
    """Instance 0 delivered 0..2; the connection dropped; instance 1's seqs 3 and 4 came live
    without a ts, 4 after the verifying replay was asked for (it asks up to 3)."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(1, 3, False)))
    assert (req.start, req.until) == (2, 3)  # from the anchor (verifies), to the batch without a ts
    assert s.live(4, p(1, 4, False)) == []
    return s, req


def test_replies_of_another_instance_sort_the_batches_waiting_and_its_own_go_to_its_epoch() -> None:
    s, req = in_doubt_with_undecodable_batches()
    assert s.replayed(req.request_id, 2, p(1, 2)) == []  # not the anchor's bytes: another instance
    assert s.replayed(req.request_id, 3, p(1, 3, False)) == []  # 3 is its; 4 is not told yet
    out = s.replayed(req.request_id, 4, p(1, 4, False))  # 4 too: nothing left to sort
    assert out == [Reset(1, "publisher_restart"), RequestReplay(req.request_id + 1, 0, 1, 0)]
    assert s.held == {2: p(1, 2), 3: p(1, 3, False), 4: p(1, 4, False)} and not s.unverified
    nxt = out[-1]
    assert isinstance(nxt, RequestReplay)
    out = [a for q in (0, 1) for a in s.replayed(nxt.request_id, q, p(1, q))]
    assert delivered(out) == [(1, p(1, q, q < 2 or q == 2)) for q in range(5)]


def test_a_replay_cut_at_the_last_seq_asked_for_is_followed_by_one_for_the_rest_from_its_last_reply() -> None:
    """Seq 5 came live during the replay, which stops at 4 (past what it was asked for): the
    rest is asked of the same instance from its last reply, 4, which that replay must repeat."""
    s, req = in_doubt_with_undecodable_batches()
    for q in (2, 3):
        s.replayed(req.request_id, q, p(1, q, q == 2))
    assert s.live(5, p(1, 5, False)) == []
    assert s.replayed(req.request_id, 4, p(1, 4, False)) == []  # 5 waits to be told
    more = s.replay_finished(req.request_id, complete=True)
    assert more == [RequestReplay(req.request_id + 1, 4, 5, 0)]
    assert s.replayed(more[0].request_id, 4, p(1, 4, False)) == []  # the repeat: the same instance
    out = s.replayed(more[0].request_id, 5, p(1, 5, False))
    assert out[0] == Reset(1, "publisher_restart")
    assert s.held == {q: p(1, q, q == 2) for q in range(2, 6)}


def test_a_rest_answered_by_yet_another_instance_sorts_no_further() -> None:
    """The first reply of the replay for the rest is not the last reply repeated: another instance
    answers now. What the first one answered is its; the batch left unsorted is nobody's known:
    announced lost with the old epoch, its seq fetched again from the new instance."""
    s, req = in_doubt_with_undecodable_batches()
    for q in (2, 3):
        s.replayed(req.request_id, q, p(1, q, q == 2))
    s.live(5, p(1, 5, False))
    s.replayed(req.request_id, 4, p(1, 4, False))
    (more,) = s.replay_finished(req.request_id, complete=True)
    assert isinstance(more, RequestReplay)
    out = s.replayed(more.request_id, 4, p(2, 4, False))
    assert out == [
        Lost(3, 5, "publisher_restart", 0),
        Reset(1, "publisher_restart"),
        RequestReplay(more.request_id + 1, 0, -1, 0),
    ]
    assert s.held == {2: p(1, 2), 3: p(1, 3, False), 4: p(1, 4, False)} and not s.unverified


def test_a_replay_that_ends_at_the_engines_last_seq_while_sorting_sorts_no_further() -> None:
    """The answering instance's replay ended before the last seq asked for (at the engine's last):
    it never published the batch left unsorted, which is then not its."""
    s, req = in_doubt_with_undecodable_batches()
    s.replayed(req.request_id, 2, p(1, 2))
    out = s.replay_finished(req.request_id, complete=True)  # nothing from 3 on: 3 and 4 are not its
    assert out == [Lost(3, 4, "publisher_restart", 0), Reset(1, "publisher_restart"), RequestReplay(req.request_id + 1, 0, -1, 0)]
    assert s.held == {2: p(1, 2)} and not s.unverified


def test_the_new_instances_replies_count_once_against_max_held() -> None:
    """The replies kept for the verdict become the new epoch's batches: moved, not counted twice
    against ``max_held`` (5 here: three replies and the two batches waiting fit)."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, max_held=5)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(1, 3, False)))
    s.live(4, p(1, 4, False))
    for q in (2, 3, 4):
        s.replayed(req.request_id, q, p(1, q, q == 2))
    assert s.epoch == 1 and s.held == {2: p(1, 2), 3: p(1, 3, False), 4: p(1, 4, False)}


def test_a_reply_above_the_anchor_with_an_earlier_clock_is_a_new_instances_and_known_published() -> None:
    """A probe's first reply is seq 3, stamped before the batch delivered last: another instance's
    (restarted, its clock behind). Its reply opens the new epoch, which knows seq 3 published."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(1, q))
    (req,) = s.probe()
    assert isinstance(req, RequestReplay)
    out = s.replayed(req.request_id, 3, p(0, 3))
    assert out == [Reset(1, "publisher_restart"), RequestReplay(req.request_id + 1, 0, 2, 0)]
    assert s.held == {3: p(0, 3)} and s.known_top == 3


def test_the_rest_asked_for_reaches_the_last_batch_waiting_even_from_a_replay_stopped_at_its_last_seq() -> None:
    """The replay stopped exactly at the last seq it asked for (3), with 4, 5 and 6 unsorted (5
    and 6 came live during it): the rest is asked for from 3 to the last of them."""
    s, req = in_doubt_with_undecodable_batches()
    s.replayed(req.request_id, 2, p(1, 2))
    s.replayed(req.request_id, 3, p(1, 3, False))
    for q in (5, 6):
        s.live(q, p(1, q, False))
    assert s.replay_finished(req.request_id, complete=True) == [RequestReplay(req.request_id + 1, 3, 6, 0)]
    # That replay repeats 3 and ends there, at the engine's last seq: 4..6 are not the instance's.
    more = RequestReplay(req.request_id + 1, 3, 6, 0)
    assert s.replayed(more.request_id, 3, p(1, 3, False)) == []
    out = s.replay_finished(more.request_id, complete=True)
    assert out[:2] == [Lost(3, 6, "publisher_restart", 0), Reset(1, "publisher_restart")]
    assert s.held == {2: p(1, 2), 3: p(1, 3, False)} and not s.unverified


def test_a_replay_that_stops_before_the_reply_comparing_bytes_is_followed_by_a_probe_of_that_seq() -> None:
    """Instance 0's batches 3..5 came without a ts after the disconnect. The first replay went
    silent (an attempt counted); the second lost its anchor reply and stopped after 3, which
    told nothing yet (4 and 5, above it, have no ts to compare). The next asks for exactly the
    first batch waiting above its last reply, 4: a new question, attempt 0; its reply, the same
    bytes, shows the same instance."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(0, 3, False)))
    s.live(4, p(0, 4, False))
    s.live(5, p(0, 5, False))
    req = only_request(s.replay_finished(req.request_id, complete=False))
    assert req.attempt == 1
    assert s.replayed(req.request_id, 3, p(0, 3, False)) == []  # (its anchor reply, 2, was dropped)
    probe = only_request(s.replay_finished(req.request_id, complete=True))
    assert (probe.start, probe.until, probe.attempt) == (4, 4, 0)
    again = only_request(s.replay_finished(probe.request_id, complete=False))  # silent: the same question
    assert (again.start, again.until, again.attempt) == (4, 4, 1)
    probe = again
    out = s.replayed(probe.request_id, 4, p(0, 4, False))
    assert delivered(out) == [(0, p(0, q, False)) for q in (3, 4, 5)] and not s.in_doubt


def test_a_replay_asked_before_the_batches_waiting_came_does_not_count_as_an_attempt() -> None:
    """A probe in doubt asked when nothing waited; batch 3 came during it, which it could not
    verify: its silence is no attempt at verifying 3, so the next replay is still attempt 0."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    probe = only_request(s.probe())
    assert s.live(3, p(0, 3)) == []  # (a replay is in flight)
    req = only_request(s.replay_finished(probe.request_id, complete=False))
    assert (req.start, req.attempt) == (2, 0)


def test_a_resumed_stream_whose_replays_stay_silent_settles_everything_its_instance_published() -> None:
    """Resumed at seq 2 with seq 6 known published by the instance (a stream resumed in the same
    process): when no replay can verify the instance, the seqs it published and the stream never
    got are announced lost, and the stream stays in doubt (whoever comes next is verified)."""
    s = StreamSequencer(
        can_replay=True,
        replay_on_start=True,
        ts_of=ts,
        delivered=2,
        delivered_fp=(2.0, None),
        known_top=6,
        max_attempts=1,
    )
    req = only_request(s.start())
    assert s.replay_finished(req.request_id, complete=False) == [Lost(3, 6, "replay_unavailable", 0)]
    assert s.in_doubt and not s.replaying


def test_a_disconnect_while_replies_wait_for_a_verdict_asks_again_for_all_of_it() -> None:
    """Reply 3 waits for a verdict (4, above it, has no ts) when the connection drops again: the
    rest of the replay may now come from another instance. Its replies are dropped and the stream
    asks again, to the end (the seqs heard are owed); a reply of the replay before is ignored."""
    s, req = in_doubt_with_undecodable_batches()
    assert s.replayed(req.request_id, 3, p(1, 3, False)) == []  # (its anchor reply, 2, was dropped)
    again = only_request(s.disconnected(now=6.0))
    assert (again.start, again.until, again.attempt) == (2, -1, 0)
    assert s.replayed(req.request_id, 4, p(1, 4, False)) == []


def test_a_disconnect_while_sorting_ends_the_sort_with_what_the_answering_instance_answered() -> None:
    """The connection drops while instance 1's replies sort the batches waiting: the rest may come
    from another instance. What instance 1 answered opens its epoch (2 and 3 are its); 4, not
    sorted, is announced lost with the old epoch. The new epoch is in doubt: who is connected now
    is unknown."""
    s, req = in_doubt_with_undecodable_batches()
    s.replayed(req.request_id, 2, p(1, 2))
    s.replayed(req.request_id, 3, p(1, 3, False))
    out = s.disconnected(now=6.0)
    assert out[:2] == [Lost(3, 4, "publisher_restart", 0), Reset(1, "publisher_restart")]
    assert isinstance(out[-1], RequestReplay) and out[-1].start == 0
    assert s.held == {2: p(1, 2), 3: p(1, 3, False)} and not s.unverified and s.in_doubt


def test_a_replay_from_seq_1_that_answers_nothing_is_asked_again_from_seq_0() -> None:
    """Nothing from the anchor (seq 1) on, and no replay has shown the engine's buffer at work:
    a buffer that is off answers so, and so does a new instance not yet that far. Asked from seq
    0, a batch below the anchor would show the new instance."""

    def asked_from_0() -> tuple[StreamSequencer, RequestReplay]:
        s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
        s.live(0, p(0, 0))
        s.live(1, p(0, 1))
        s.disconnected(now=5.0)
        probe = only_request(s.probe())
        assert probe.start == 1
        again = only_request(s.replay_finished(probe.request_id, complete=True))
        assert (again.start, again.until) == (0, -1)
        return s, again

    s, again = asked_from_0()
    out = s.replayed(again.request_id, 0, p(1, 0))  # below 1: an instance that never published 1
    assert out[:2] == [Reset(1, "publisher_restart"), Deliver(0, p(1, 0), 1, True)]
    s, again = asked_from_0()
    assert s.replayed(again.request_id, 1, p(0, 1)) == [Duplicate(1)]  # 1 itself: the same instance
    assert s.epoch == 0 and not s.in_doubt


def test_a_batch_waiting_with_a_ts_is_sorted_by_the_clock_of_the_first_reply_not_by_bytes() -> None:
    """Instance 1's first reply (2) has a ts: the batches waiting that have one too are told by
    the clocks (4, stamped after that reply, is instance 1's), only 3, without one, by its reply's
    bytes. Once 3 is answered nothing is left to sort: the new epoch opens with 2, 3 and 4."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(1, 3, False)))
    assert s.live(4, p(1, 4)) == []
    assert s.replayed(req.request_id, 2, p(1, 2)) == []
    out = s.replayed(req.request_id, 3, p(1, 3, False))
    assert out[0] == Reset(1, "publisher_restart")
    assert s.held == {2: p(1, 2), 3: p(1, 3, False), 4: p(1, 4)} and not s.unverified


def test_the_new_epochs_floor_is_the_earliest_clock_among_the_answering_instances_replies() -> None:
    """A live batch stamped before the first batch known of the epoch's instance is an older
    instance's, read late; one stamped after its earliest reply known (2, at 1e6 + 2) is not, even
    if stamped before a later reply (4)."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(1, 3, False)))
    s.live(5, p(1, 5, False))
    for q in (2, 3, 4, 5):
        out = s.replayed(req.request_id, q, p(1, q, q % 2 == 0))
    assert out[0] == Reset(1, "publisher_restart")
    s.live(6, p(1, 3))  # stamped 1e6 + 3: after instance 1's first reply, before its reply 4
    assert s.held.get(6) == p(1, 3)  # its: kept (0 and 1 are being fetched), not dropped as late


def test_replies_kept_for_a_verdict_are_delivered_once_a_later_reply_gives_it() -> None:
    """Seq 3 was missed live, 4 came without a ts after the disconnect. The anchor's reply is
    dropped; reply 3 tells nothing yet (4, above it, has no ts) and is kept; reply 4, the same
    bytes as the batch waiting, shows the same instance: 3 and 4 go out, in order."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(4, p(0, 4, False)))
    assert (req.start, req.until) == (2, 4)
    assert s.replayed(req.request_id, 3, p(0, 3)) == []
    out = s.replayed(req.request_id, 4, p(0, 4, False))
    assert delivered(out) == [(0, p(0, 3)), (0, p(0, 4, False))] and not s.in_doubt


def test_replies_kept_for_a_verdict_count_against_max_held() -> None:
    """``max_held`` (3) bounds everything waiting: the batch waiting (6) and the replies kept for
    the verdict (3, 4); reply 5 is past the bound and not kept. When reply 6 shows the same
    instance, 3 and 4 go out; 5 is asked for again (it is still in the engine's buffer)."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, max_held=3)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(6, p(0, 6, False)))
    out = [a for q in (3, 4, 5, 6) for a in s.replayed(req.request_id, q, p(0, q, q != 6))]
    assert delivered(out) == [(0, p(0, 3)), (0, p(0, 4))] and s.held == {6: p(0, 6, False)}
    again = only_request(s.replay_finished(req.request_id, complete=True))
    assert again.start == 4  # from the last delivered (verifies), for 5


def test_a_reply_that_skips_the_seq_of_a_batch_waiting_without_a_ts_gives_no_verdict() -> None:
    """Batch 4 waits without a ts: only the reply of seq 4 can compare its bytes. The anchor's
    reply and reply 4 are dropped (a ROUTER under load): reply 3 tells nothing yet, and reply 5,
    past 4, cannot either. Nothing is delivered on the strength of it; the replay is asked again."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(4, p(0, 4, False)))
    assert s.replayed(req.request_id, 3, p(0, 3)) == []
    assert s.replayed(req.request_id, 5, p(0, 5)) == []  # 4 skipped: no verdict
    again = only_request(s.replay_finished(req.request_id, complete=True))
    assert (again.start, again.attempt) == (2, 1) and s.in_doubt and s.unverified == {4: p(0, 4, False)}


def test_a_reply_past_a_seq_where_nothing_waits_is_no_skip() -> None:
    """Batches 3 and 5 wait without a ts (4 was missed). Reply 3 matches 3 but tells nothing of 5;
    reply 5, past 4 where nothing waits, compares 5 itself: the same instance, 3 goes out and 5
    waits for 4."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(0, 3, False)))
    s.live(5, p(0, 5, False))
    assert s.replayed(req.request_id, 3, p(0, 3, False)) == []  # (the anchor's reply was dropped)
    out = s.replayed(req.request_id, 5, p(0, 5, False))
    assert delivered(out) == [(0, p(0, 3, False))] and not s.in_doubt and s.held == {5: p(0, 5, False)}


def test_a_probes_first_reply_past_the_seq_asked_for_tells_nothing() -> None:
    """The probe for 4 is answered first by 5 (4 left the engine's buffer): nothing compared 4."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(0, 3, False)))
    s.live(4, p(0, 4, False))
    assert s.replayed(req.request_id, 3, p(0, 3, False)) == []
    probe = only_request(s.replay_finished(req.request_id, complete=True))
    assert (probe.start, probe.until) == (4, 4)
    assert s.replayed(probe.request_id, 5, p(0, 5)) == [] and s.in_doubt


def test_a_stream_detached_while_replies_wait_for_a_verdict_owes_their_seqs() -> None:
    """The stream is removed (discovery) while reply 3 waits for a verdict: the replay goes with
    its task, the reply is dropped and its seq owed; added back, the next replay asks to the end
    (whatever the answering instance published of what it owes), not just up to the batches waiting."""
    s, req = in_doubt_with_undecodable_batches()
    assert s.replayed(req.request_id, 3, p(1, 3, False)) == []  # (the anchor's reply was dropped)
    s.detached()
    s.disconnected(now=6.0)
    assert not s.replaying and s.replayed(req.request_id, 4, p(1, 4, False)) == []
    probe = only_request(s.probe())
    assert (probe.start, probe.until) == (2, -1)


def test_replies_waiting_for_a_verdict_when_the_live_stream_shows_a_restart_are_not_the_new_epochs() -> None:
    """Reply 3 of instance 1 waits for a verdict when instance 2's seq 1 comes live (a seq going
    back: a restart). The new epoch's replay starts afresh: instance 1's reply is never taken as
    instance 2's batch."""
    s, req = in_doubt_with_undecodable_batches()
    assert s.replayed(req.request_id, 3, p(1, 3, False)) == []  # (the anchor's reply was dropped)
    out = s.live(1, p(2, 1))
    assert Reset(1, "publisher_restart") in out
    nxt = only_request(out)
    out = s.replayed(nxt.request_id, 0, p(2, 0))
    assert delivered(out) == [(1, p(2, 0)), (1, p(2, 1))] and s.held == {}


def answer(s: StreamSequencer, req: RequestReplay, engine: dict[int, bytes], complete: bool = True) -> list[Action]:
    """The engine's replay socket answers ``req`` from what it holds (``engine``: seq -> payload),
    from its start up to the last seq asked for (or all), then ends."""
    out: list[Action] = []
    for q in sorted(engine):
        if q >= req.start and (req.until < 0 or q <= req.until):
            out += s.replayed(req.request_id, q, engine[q])
    return out + s.replay_finished(req.request_id, complete)


def test_a_replay_that_stops_at_seq_0_asked_for_is_followed_by_one_for_the_rest() -> None:
    """Only seq 0 was delivered when the connection dropped; instance 1's batch 1 came live (with a
    ts). The verifying replay asks for 0 only: instance 1 answers it without a ts (not the
    anchor's bytes), which leaves 1 unsorted. The replay stopped at the last seq asked for, not at
    the engine's last: the rest is asked of the same instance, and its reply 1 sorts batch 1."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    s.live(0, p(0, 0))
    s.disconnected(now=5.0)
    req = only_request(s.live(1, p(1, 1)))
    assert (req.start, req.until) == (0, 0)
    assert s.replayed(req.request_id, 0, p(1, 0, False)) == []
    more = only_request(s.replay_finished(req.request_id, complete=True))
    assert (more.start, more.until) == (0, 1)
    out = answer(s, more, {0: p(1, 0, False), 1: p(1, 1)})
    assert out[0] == Reset(1, "publisher_restart") and not [a for a in out if isinstance(a, Lost)]
    assert delivered(out) == [(1, p(1, 0, False)), (1, p(1, 1))]


def test_a_replay_that_stops_after_reply_0_before_the_reply_comparing_bytes_probes_that_seq() -> None:
    """Resumed in an epoch with nothing delivered (seq -1): batch 1 came without a ts. Reply 0
    tells nothing yet; the replay ends there: the next replay asks for exactly seq 1 (a new
    question: attempt 0), whose reply, the same bytes, shows the same instance."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, epoch=2, delivered=-1)
    req = only_request(s.live(1, p(0, 1, False)))
    assert (req.start, req.until) == (0, 1)
    assert s.replayed(req.request_id, 0, p(0, 0)) == []
    probe = only_request(s.replay_finished(req.request_id, complete=True))
    assert (probe.start, probe.until, probe.attempt) == (1, 1, 0)
    assert s.replayed(probe.request_id, 1, p(0, 1, False)) == [Duplicate(1)] and not s.in_doubt
    out = answer(s, only_request(s.replay_finished(probe.request_id, complete=True)), {0: p(0, 0)})
    assert delivered(out) == [(2, p(0, 0)), (2, p(0, 1, False))]


def test_replies_read_without_a_verdict_are_asked_for_again_to_the_end() -> None:
    """Batch 4 waits without a ts; reply 3 tells nothing yet, reply 5 skipped 4: no verdict. The
    replies are dropped, but 5 is known published: the next replay asks to the end, not just up
    to the batch waiting, and 5 is delivered with the rest."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    engine = {q: p(0, q, q != 4) for q in range(6)}
    for q in range(3):
        s.live(q, engine[q])
    s.disconnected(now=5.0)
    req = only_request(s.live(4, engine[4]))
    assert s.replayed(req.request_id, 3, engine[3]) + s.replayed(req.request_id, 5, engine[5]) == []
    again = only_request(s.replay_finished(req.request_id, complete=True))
    assert (again.start, again.until) == (2, -1)
    out = answer(s, again, engine)
    assert [a.seq for a in out if isinstance(a, Deliver)] == [3, 4, 5] and not s.in_doubt


def test_a_replay_stopped_before_the_reply_comparing_bytes_probes_the_held_batch_first() -> None:
    """Batches 3 (no ts), 4, 6 (no ts) and 7 were held above a gap when the connection dropped.
    Replies 2 and 3 tell nothing yet (6 has no ts), then the replay stops: the next asks for
    exactly 6, the held batch without a ts above the last reply (not 3, answered already, nor 4,
    whose clock was compared); silent, it asks for 6 again."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    s.live(0, p(0, 0))
    s.live(1, p(0, 1))
    for q in (3, 4, 6, 7):  # (4 confirms 3, and 7 confirms 6: each came past a gap)
        s.live(q, p(0, q, q != 3 and q != 6))
    req = only_request(s.disconnected(now=5.0))
    assert (req.start, req.until) == (1, 6)
    assert s.replayed(req.request_id, 2, p(0, 2)) + s.replayed(req.request_id, 3, p(0, 3, False)) == []
    probe = only_request(s.replay_finished(req.request_id, complete=True))
    assert (probe.start, probe.until, probe.attempt) == (6, 6, 0)
    again = only_request(s.replay_finished(probe.request_id, complete=False))
    assert (again.start, again.until, again.attempt) == (6, 6, 1)
    assert s.replayed(again.request_id, 6, p(0, 6, False)) == [Duplicate(6)] and not s.in_doubt
    out = s.replay_finished(again.request_id, complete=True)
    while requests := [a for a in out if isinstance(a, RequestReplay)]:
        out = answer(s, requests[0], {q: p(0, q, q not in (3, 6)) for q in range(8)})
    assert s.delivered == 7 and not s.held


def test_a_new_instances_reply_read_past_max_held_is_settled_by_its_epoch() -> None:
    """Instance 1 answers (its reply 2 is not the anchor's bytes); its reply 3 sorts batch 3, then
    reply 5 (4 was dropped) comes past ``max_held`` and is not kept. Seq 5 is known published by
    instance 1: when it restarts in turn before the replay fetched it again, 5 is announced lost
    with instance 1's epoch, not forgotten."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, max_held=4)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(1, 3, False)))
    s.live(4, p(1, 4, False))
    for q in (2, 3):
        assert s.replayed(req.request_id, q, p(1, q, q == 2)) == []
    out = s.replayed(req.request_id, 5, p(1, 5))
    assert Reset(1, "publisher_restart") in out and s.held == {2: p(1, 2), 3: p(1, 3, False)}
    out = s.live(0, p(2, 0))  # instance 2: seq back to 0
    assert [a for a in out if isinstance(a, Lost) and a.epoch == 1] == [
        Lost(0, 1, "publisher_restart", 1),
        Lost(4, 5, "publisher_restart", 1),
    ]


def test_a_late_live_copy_of_a_new_instances_reply_is_told_by_its_bytes() -> None:
    """Instance 1's replies 2 and 3 opened its epoch (instance 2's batches 3 and 4, waiting, were
    announced lost with the old one); its head 0..1 was fetched and 0..3 delivered. After another
    disconnect, a late live copy of its batch 2 is a duplicate, known by its bytes: no replay is
    asked to tell whose it is."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(2, 3, False)))
    s.live(4, p(2, 4, False))
    s.replayed(req.request_id, 2, p(1, 2))
    s.replayed(req.request_id, 3, p(1, 3))
    more = only_request(s.replay_finished(req.request_id, complete=True))  # for 4, from 3
    s.replayed(more.request_id, 3, p(1, 3))
    out = s.replay_finished(more.request_id, complete=True)  # instance 1 never published 4
    assert out[:2] == [Lost(3, 4, "publisher_restart", 0), Reset(1, "publisher_restart")]
    head = only_request(out)
    out = s.replayed(head.request_id, 0, p(1, 0)) + s.replayed(head.request_id, 1, p(1, 1))
    out += s.replay_finished(head.request_id, complete=False)  # broken off after 1
    assert delivered(out) == [(1, p(1, q)) for q in range(4)] and not s.replaying
    s.disconnected(now=6.0)
    assert s.live(2, p(1, 2)) == [Duplicate(2)]


def test_a_replay_asked_to_the_end_that_ends_while_sorting_sorts_no_further() -> None:
    """Asked to the end marker (the replies of the replay before were dropped, their seqs owed),
    instance 1 answers 2 and 3, then the end marker comes: the engine's last seq is 3, so batch 4,
    unsorted, is not instance 1's (announced lost with the old epoch), and nothing more is asked of it."""
    s, req = in_doubt_with_undecodable_batches()
    s.replayed(req.request_id, 3, p(1, 3, False))  # (the anchor's reply was dropped)
    again = only_request(s.disconnected(now=6.0))
    assert again.until == -1
    s.replayed(again.request_id, 2, p(1, 2))
    s.replayed(again.request_id, 3, p(1, 3, False))
    out = s.replay_finished(again.request_id, complete=True)
    assert out[:2] == [Lost(3, 4, "publisher_restart", 0), Reset(1, "publisher_restart")]
    assert s.held == {2: p(1, 2), 3: p(1, 3, False)} and not s.unverified


def test_a_reply_that_skips_the_batch_waiting_right_after_reply_0_gives_no_verdict() -> None:
    """Nothing delivered in this epoch yet; batch 1 waits without a ts. Reply 0 tells nothing yet,
    reply 2 skipped 1 (the only reply that could compare its bytes): nothing goes out on the
    strength of it, and batch 1 still waits."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, epoch=2, delivered=-1)
    req = only_request(s.live(1, p(0, 1, False)))
    assert s.replayed(req.request_id, 0, p(0, 0)) == []
    assert s.replayed(req.request_id, 2, p(0, 2)) == []
    assert s.in_doubt and s.unverified == {1: p(0, 1, False)}


def test_batches_waiting_that_the_answering_instances_replies_repeat_are_its_with_a_ts_or_not() -> None:
    """Instance 1's batches 3 (with a ts) and 4 (without) came live after the disconnect; its reply 2
    is not the anchor's bytes (the replay asked up to 2 stops there; the rest is asked for), and its
    replies 3 and 4 repeat the batches waiting: both go to its epoch, nothing is announced lost."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=5.0)
    req = only_request(s.live(3, p(1, 3)))
    s.live(4, p(1, 4, False))
    assert s.replayed(req.request_id, 2, p(1, 2)) == []
    more = only_request(s.replay_finished(req.request_id, complete=True))  # stopped at 2, asked for
    assert (more.start, more.until) == (2, 4)
    out = [a for q in (2, 3, 4) for a in s.replayed(more.request_id, q, p(1, q, q != 4))]
    assert out[0] == Reset(1, "publisher_restart") and not [a for a in out if isinstance(a, Lost)]
    assert s.held == {2: p(1, 2), 3: p(1, 3), 4: p(1, 4, False)} and not s.unverified


def test_a_live_seq_not_kept_below_the_new_instances_first_batch_is_settled_by_the_old_epoch() -> None:
    """In doubt, with ``max_held`` 2: batch 4 (no ts) waits and reply 3 is kept for a verdict, so
    live 5 is not kept. Then instance 1's batch 6 is (the probe for 4 freed the room), and the
    probe's reply 4, instance 1's, shows the restart: 6 goes to instance 1's epoch; 5, read
    before it, may be the old instance's and is announced lost with the old epoch (3 and 4 too)."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts, max_held=2)
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected()
    req = only_request(s.live(4, p(0, 4, False)))
    assert s.replayed(req.request_id, 3, p(0, 3)) == []  # kept for a verdict (4 has no ts)
    assert s.live(5, p(0, 5)) == [] and 5 not in s.unverified  # past max_held
    probe = only_request(s.replay_finished(req.request_id, complete=True))
    assert (probe.start, probe.until) == (4, 4)
    s.live(6, p(1, 6))
    out = s.replayed(probe.request_id, 4, p(1, 4))
    assert [a for a in out if isinstance(a, Lost | Reset)] == [Lost(3, 5, "publisher_restart", 0), Reset(1, "publisher_restart")]
    assert s.held == {4: p(1, 4), 6: p(1, 6)}


def test_a_batch_waiting_that_a_reply_without_a_ts_cannot_sort_is_settled_by_both_epochs() -> None:
    """Instance 1's reply 0 has no ts (not the anchor's bytes): batch 1, waiting, cannot be compared
    with it by clock. The rest asked for repeats 0 and ends: 1 is announced lost with the old epoch,
    and owed by the new one, which settles it too when its instance restarts before it came again."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    s.live(0, p(0, 0))
    s.disconnected(now=5.0)
    req = only_request(s.live(1, p(1, 1)))
    s.replayed(req.request_id, 0, p(1, 0, False))
    more = only_request(s.replay_finished(req.request_id, complete=True))
    s.replayed(more.request_id, 0, p(1, 0, False))
    out = s.replay_finished(more.request_id, complete=True)
    assert out[:3] == [Lost(1, 1, "publisher_restart", 0), Reset(1, "publisher_restart"), Deliver(0, p(1, 0, False), 1, True)]
    out = s.live(0, p(2, 0))  # instance 2
    assert [a for a in out if isinstance(a, Lost)] == [Lost(1, 1, "publisher_restart", 1)]


def test_replies_dropped_without_a_verdict_are_owed_by_the_next_epoch_only() -> None:
    """Reply 3 waited for a verdict when the connection dropped again: it is dropped, its seq owed.
    Instance 2 then shows on the live stream: the old epoch announces 3 lost and instance 2's
    epoch owes it too (settled when instance 3 replaces it); instance 3's epoch, which delivered
    its seq 0, owes nothing of it when instance 4 comes."""
    s, req = in_doubt_with_undecodable_batches()
    s.replayed(req.request_id, 3, p(1, 3, False))  # (the anchor's reply was dropped)
    s.disconnected(now=6.0)
    assert Reset(1, "publisher_restart") in s.live(1, p(2, 1))
    out = s.live(0, p(3, 0))
    assert [a for a in out if isinstance(a, Lost)] == [Lost(0, 0, "publisher_restart", 1), Lost(2, 3, "publisher_restart", 1)]
    out = s.live(0, p(4, 0))
    assert [a for a in out if isinstance(a, Lost)] == [] and Reset(3, "publisher_restart") in out


def test_the_answering_instances_own_copy_of_a_seq_wins_over_a_batch_carried_at_it() -> None:
    """Resumed with nothing delivered: live 1 (instance 2's, stamped late) and 2 (no ts) wait
    while instance 1 answers the replay from 0. Its reply 1 differs from batch 1 waiting: instance 1
    is a new instance, and batch 1, stamped after instance 1's first reply, would be carried to its
    epoch; but instance 1's own copy of seq 1 is what goes out, and nothing else stays held."""
    s = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts, epoch=2, delivered=-1)
    req = only_request(s.start())
    assert s.live(1, p(2, 1)) + s.live(2, p(1, 2, False)) == []
    out = [a for q in (0, 1, 2) for a in s.replayed(req.request_id, q, p(1, q, q != 2))]
    assert out[0] == Reset(3, "publisher_restart")
    assert delivered(out) == [(3, p(1, 0)), (3, p(1, 1)), (3, p(1, 2, False))] and s.held == {}
