"""Issue 29's sequencing cases. A quiet engine is never left behind (16): what a stream needs after
a restart comes by the idle probe alone, without the engine publishing again. A stream whose
source is removed and added again keeps what it read and has not settled (17). A batch that
reached the bridge is never announced lost because the engine's clock stepped back (18).

Payloads are ``instance:seq`` and the engine ts is ``instance * 1e6 + seq`` (a later instance has
a later clock), as in ``test_sequencer_replay.py``; a test that needs other clocks stamps its
payloads by hand.
"""

from __future__ import annotations

from bridge.sequencer import Action, Deliver, Duplicate, Lost, RequestReplay, Reset, StreamSequencer
from tests.unit.test_sequencer_replay import only_request, p, seqr, settled


def answer(s: StreamSequencer, req: RequestReplay, replies: list[tuple[int, bytes]], complete: bool = True) -> list[Action]:
    """Serve ``req`` with the engine's buffer ``replies`` (from its start), as the replay client does."""
    out: list[Action] = []
    for seq, payload in replies:
        if seq < req.start:
            continue
        out += s.replayed(req.request_id, seq, payload)
        if 0 <= req.until <= seq:
            break
    return out + s.replay_finished(req.request_id, complete)


def test_the_idle_probe_goes_on_after_a_replay_opened_the_new_epoch() -> None:
    """A replay showed the restart and delivered the new instance's seq 0; the next replay goes
    silent. The engine publishes nothing more: the idle probe must still fetch its seqs 1 and 2
    (before the fix, no epoch position counted until a live message came: the probe asked nothing)."""
    s = seqr()
    answer(s, only_request(s.start()), [])
    s.live(0, p(0, 0))
    s.disconnected(now=0.5)
    req = only_request(s.live(1, p(0, 1)))  # the old instance's last batch, read late
    new = [(q, p(1, q)) for q in range(3)]  # the new instance, its seqs missed live
    out = s.replayed(req.request_id, 0, p(1, 0))
    assert Reset(1, "publisher_restart") in out and Deliver(0, p(1, 0), 1, replayed=True) in out
    assert settled(answer(s, only_request(out), [], complete=False)) == []  # silent, and nothing open is known
    probe = only_request(s.probe())
    assert [a for a in settled(answer(s, probe, new)) if isinstance(a, Deliver)] == [
        Deliver(1, p(1, 1), 1, replayed=True),
        Deliver(2, p(1, 2), 1, replayed=True),
    ]
    assert s.delivered == 2


def test_a_replay_answering_nothing_from_the_position_is_asked_from_zero() -> None:
    """No replay ever brought a batch (no gap needed one), so "nothing from seq 2 on" may be an
    engine whose buffer is off. The engine restarted and its new instance published seqs 0 and 1,
    missed live, then went quiet. Its buffer holds 0 and 1, below the stream's position: the
    probe must find them and open the new epoch (before the fix the stream stayed in doubt under
    the old epoch, asking from seq 2 for ever)."""
    s = seqr()
    answer(s, only_request(s.start()), [])
    for q in range(3):
        s.live(q, p(0, q))
    s.disconnected(now=2.5)
    new = [(q, p(1, q)) for q in range(2)]
    out: list[Action] = []
    for _ in range(4 * s.max_attempts):  # idle probes, every replay answered
        req = only_request(s.probe())
        while True:
            got = answer(s, req, new)
            out += got
            if not any(isinstance(a, RequestReplay) for a in got):
                break
            req = only_request(got)
        if s.epoch == 1 and s.delivered == 1:
            break
    assert settled(out) == [
        Reset(1, "publisher_restart"),
        Deliver(0, p(1, 0), 1, replayed=True),
        Deliver(1, p(1, 1), 1, replayed=True),
    ]
    assert not s.in_doubt


def test_a_stream_resumed_after_its_removal_settles_what_it_held() -> None:
    """0..2 live, 3 missed, 4 held above the gap; the source is removed while the replay is in
    flight (``detached``), the engine restarts, the source comes back (``disconnected``, then
    ``start``). The new instance answers: 4 reached the bridge and is delivered under the old
    epoch, 3 announced lost; the old replay's replies are ignored."""
    s = seqr()
    answer(s, only_request(s.start()), [])
    for q in range(3):
        s.live(q, p(0, q))
    old = only_request(s.live(4, p(0, 4)))
    s.detached()
    req = only_request(s.disconnected(now=4.5) + s.start())  # (the gap is asked for at once)
    assert req.request_id != old.request_id and s.replayed(old.request_id, 3, p(0, 3)) == []
    out: list[Action] = []
    new = [(q, p(1, q)) for q in range(2)]
    for _ in range(3):
        got = answer(s, req, new)
        out += got
        if s.epoch == 1 and s.delivered == 1:
            break
        req = only_request(got)
    assert settled(out) == [
        Lost(3, 3, "publisher_restart", 0),
        Deliver(4, p(0, 4), 0),
        Reset(1, "publisher_restart"),
        Deliver(0, p(1, 0), 1, replayed=True),
        Deliver(1, p(1, 1), 1, replayed=True),
    ]


def stamped_seqr(stamps: dict[bytes, float]) -> StreamSequencer:
    return StreamSequencer(can_replay=False, replay_on_start=False, ts_of=stamps.__getitem__)


def test_a_clock_stepping_back_right_after_a_restart_loses_nothing_received() -> None:
    """No replay endpoint. The old instance publishes 0..3 (ts 100..103); the new one shows with
    its seq 0 (ts 200), then its clock steps back: 1 and 2 are stamped 150 and 151, 3 is 201. All
    reached the bridge: delivered in the new epoch, nothing announced lost (before the fix 1 and 2
    were dropped as a late batch of the old instance, then announced lost as no_replay: I4)."""
    stamps = {p(0, q): 100.0 + q for q in range(4)} | {p(1, 0): 200.0, p(1, 1): 150.0, p(1, 2): 151.0, p(1, 3): 201.0}
    s = stamped_seqr(stamps)
    out: list[Action] = []
    for q in range(4):
        out += s.live(q, p(0, q))
    for q in range(4):
        out += s.live(q, p(1, q))
    assert settled(out)[4:] == [Reset(1, "publisher_restart")] + [Deliver(q, p(1, q), 1) for q in range(4)]


def test_a_late_batch_of_the_old_instance_is_still_told_by_its_clock() -> None:
    """Without replay: after the new instance's seq 0 (ts 200), the old instance's seq 4 (ts 104),
    read late, is not the new instance's (its next seq is 1, and it is stamped before the new
    instance's first): dropped, not delivered under the new epoch (I1)."""
    stamps = {p(0, q): 100.0 + q for q in range(5)} | {p(1, 0): 200.0, p(1, 1): 201.0}
    s = stamped_seqr(stamps)
    for q in range(4):
        s.live(q, p(0, q))
    s.live(0, p(1, 0))
    assert s.live(4, p(0, 4)) == [Duplicate(4)]
    assert s.live(1, p(1, 1)) == [Deliver(1, p(1, 1), 1)]
