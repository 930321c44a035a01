"""A live seq ahead of everything its instance is known to have published (issue 29, breaker31x
B2): set aside until a later live seq or a reply confirms it, dead-lettered (a Suspect) when the
engine shows it never published it; never a restart, never a loss reaching it."""

from __future__ import annotations

from bridge.sequencer import Action, Deliver, Duplicate, Gap, Lost, RequestReplay, Reset, StreamSequencer, Suspect

A = b"A" * 16
FAR = 2**63  # a flipped high bit


def p(seq: int, tag: str = "") -> bytes:
    return f"{seq}{tag}".encode()


def ts(payload: bytes) -> float:
    """The engine clock: one tick per seq; a forged batch is stamped now, like the engine's next."""
    text = payload.decode()
    return 100.0 if text.endswith("forged") else float(text)


def seqr() -> StreamSequencer:
    return StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)


def only_request(out: list[Action]) -> RequestReplay:
    (req,) = [a for a in out if isinstance(a, RequestReplay)]
    return req


def delivered(out: list[Action]) -> list[int]:
    return [a.seq for a in out if isinstance(a, Deliver)]


def serve(s: StreamSequencer, req: RequestReplay, top: int, instance: bytes | None = None) -> list[Action]:
    """The engine answers from its buffer (every seq up to ``top``), then its end marker."""
    out: list[Action] = []
    for q in range(req.start, top + 1):
        out += s.replayed(req.request_id, q, p(q), instance)
        if 0 <= req.until <= q:
            break
    return out + s.replay_finished(req.request_id, complete=True)


def test_a_seq_far_ahead_does_not_make_the_engines_next_seq_a_restart() -> None:
    """The breaker's case: 0..3, then one frame at 2**63, then the engine's own 4 and 5. The
    engine's next seq is read in doubt (below a batch read before it: one instance never
    publishes so); the replay verifies the instance, which went on below that batch: it is a
    Suspect, and 4, 5 go out in the same epoch with nothing lost."""
    s = seqr()
    for q in range(4):
        s.live(q, p(q))
    out = s.live(FAR, p(FAR, "forged"))
    assert out[0] == Gap(4, FAR - 1) and only_request(out).until == FAR and s.waiting == {FAR}
    out = s.live(4, p(4))
    assert not delivered(out) and s.in_doubt and not [a for a in out if isinstance(a, Reset)]
    out = serve(s, only_request(out), 4) + s.live(5, p(5))
    assert [a for a in out if isinstance(a, Suspect)] == [
        Suspect(FAR, p(FAR, "forged"), "live seq 9223372036854775808 is ahead of its engine: the same instance went on below it")
    ]
    assert delivered(out) == [4, 5] and s.epoch == 0 and not [a for a in out if isinstance(a, Lost | Reset)]
    assert not s.waiting and s.last_live == 5


def test_a_seq_far_ahead_is_dead_lettered_after_two_replays_that_hold_nothing_past_the_engines_last() -> None:
    """Under the epoch's UUID a seq below another proves nothing (seqs may interleave): the
    engine's own batches go out as they come, and two replays, read to where the frame claims to
    be, both hold nothing that far: a Suspect (one could have lost that reply under load)."""
    s = seqr()
    for q in range(4):
        s.live(q, p(q), instance=A)
    req = only_request(s.live(FAR, p(FAR, "forged"), instance=A))
    assert delivered(s.live(4, p(4), instance=A) + s.live(5, p(5), instance=A)) == [4, 5]
    out = serve(s, req, 5, A)
    assert not [a for a in out if isinstance(a, Suspect)] and s.waiting == {FAR}
    out = serve(s, only_request(out), 5, A)
    (suspect,) = [a for a in out if isinstance(a, Suspect)]
    assert suspect.seq == FAR and "two replays hold nothing past seq 5" in suspect.detail
    assert not [a for a in out if isinstance(a, Lost | Reset | RequestReplay)] and not s.waiting
    assert delivered(s.live(6, p(6), instance=A)) == [6]


def test_a_real_gap_is_confirmed_by_the_reply_at_the_seq_past_it() -> None:
    """The common case costs nothing more: the replay asked for the gap brings the batch past it
    too, with the same bytes."""
    s = seqr()
    s.live(0, p(0))
    req = only_request(s.live(3, p(3)))
    assert (req.start, req.until) == (0, 3)
    out = serve(s, req, 3)
    assert delivered(out) == [1, 2, 3] and not [a for a in out if isinstance(a, Suspect | Lost)]


def test_a_reply_at_its_seq_with_other_bytes_makes_it_a_suspect_and_the_engines_batch_goes_out() -> None:
    s = seqr()
    s.live(0, p(0))
    req = only_request(s.live(2, p(2, "forged")))
    out = serve(s, req, 2)
    assert [a.seq for a in out if isinstance(a, Suspect)] == [2]
    assert [a.payload for a in out if isinstance(a, Deliver)] == [p(1), p(2)]


def test_another_live_batch_at_its_seq_makes_it_a_suspect_and_waits_in_its_place() -> None:
    s = seqr()
    s.live(0, p(0))
    s.live(2, p(2, "forged"))
    out = s.live(2, p(2))
    assert [a.seq for a in out if isinstance(a, Suspect)] == [2] and s.waiting == {2}


def test_a_live_seq_past_it_confirms_it() -> None:
    s = seqr()
    s.live(0, p(0))
    req = only_request(s.live(2, p(2)))
    assert s.live(3, p(3)) == [] and s.waiting == {2, 3} and set(s.held) == {2, 3}
    out = s.replayed(req.request_id, 0, p(0)) + s.replayed(req.request_id, 1, p(1))
    assert delivered(out) == [1, 2, 3]


def test_the_same_live_frame_twice_is_a_duplicate_not_a_restart() -> None:
    s = seqr()
    s.live(0, p(0))
    s.live(2, p(2))
    assert s.live(2, p(2)) == [Duplicate(2)] and s.epoch == 0 and 2 in s.held


def test_replays_that_cannot_tell_leave_it_waiting_and_deliver_nothing_unconfirmed() -> None:
    """Between the two replays that refute it, replays that tell nothing (no end, fewer than
    max_attempts in a row): nothing unconfirmed goes out, nothing is announced lost up to it."""
    s = seqr()
    s.live(0, p(0))
    req = only_request(s.live(FAR, p(FAR, "forged")))
    req = only_request(serve(s, req, 0))  # the first that holds nothing past 0
    for _ in range(s.max_attempts - 1):
        out = s.replay_finished(req.request_id, complete=False)
        assert not delivered(out) and not [a for a in out if isinstance(a, Lost) and a.to_seq >= FAR - 1]
        req = only_request(out)
    assert s.waiting == {FAR}
    out = serve(s, req, 0)
    assert [a.seq for a in out if isinstance(a, Suspect)] == [FAR] and not s.waiting


def test_a_replay_socket_that_never_ends_a_reply_takes_it_on_its_word() -> None:
    """max_attempts replays in a row without an end: nothing can be told, and a quiet engine must
    not keep its last batch: as any batch above a gap (its span lost, it delivered)."""
    s = seqr()
    s.live(0, p(0))
    req = only_request(s.live(3, p(3)))
    out: list[Action] = []
    for _ in range(s.max_attempts):
        out = s.replay_finished(req.request_id, complete=False)
        if not delivered(out):
            req = only_request(out)
    assert [a for a in out if isinstance(a, Lost | Deliver)] == [Lost(1, 2, "replay_unavailable", 0), Deliver(3, p(3), 0)]


def test_a_silent_replay_socket_never_takes_it_on_its_word_once_the_live_stream_went_on_below_it() -> None:
    """breaker32 B3 (a forged frame and a replay socket that never answers): the engine's next
    seq, read after it, already contradicts it; the presumption of continuity that ends the
    doubt makes it a Suspect, and the engine's batches go out in one epoch."""
    s = seqr()
    for q in range(3):
        s.live(q, p(q))
    s.live(FAR, p(FAR, "forged"))
    out = s.live(3, p(3))
    out += s.live(4, p(4))
    for _ in range(3 * s.max_attempts):
        if not s.replaying:
            break
        (req,) = [a for a in out if isinstance(a, RequestReplay)][-1:]
        out += s.replay_finished(req.request_id, complete=False)
    assert [a.seq for a in out if isinstance(a, Suspect)] == [FAR]
    assert delivered(out) == [3, 4] and not [a for a in out if isinstance(a, Lost | Reset)] and not s.waiting


def test_a_dropped_connection_takes_it_as_read_before_the_drop() -> None:
    """What the instance connected before the drop showed: held, as any batch read then (a live
    seq at or below it is then another instance's). (Docs: "A seq ahead of the engine".)"""
    s = seqr()
    s.live(0, p(0))
    s.live(2, p(2))
    s.disconnected(now=10.0)
    assert set(s.held) == {2} and s.last_live == 2


def test_a_restart_shown_live_settles_it_with_the_old_instance() -> None:
    """Read before the seq that went back: the old instance's, delivered under its epoch (I4).
    (One a replay shows to be the new instance's, by the clocks, waits again in the new epoch:
    test_sequencer_edges.py.)"""
    s = seqr()
    for q in range(3):
        s.live(q, p(q))
    s.live(5, p(5))
    out = s.live(0, p(0))  # 0 <= last live (2): a restart
    assert out[:3] == [Lost(3, 4, "publisher_restart", 0), Deliver(5, p(5), 0), Reset(1, "publisher_restart")]
