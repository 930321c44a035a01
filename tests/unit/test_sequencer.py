"""The sequencer, case by case: gaps, duplicates, restarts, replay verification, losses, epochs.

The compound-fault model (an engine that fails in every way at once, I1-I4 after every step) is
``test_sequencer_model.py``; here each test pins one behaviour of ``bridge.sequencer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.sequencer import (
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
from tests.support.strategies import examples


@dataclass
class Engine:
    """A publisher: seqs from 0 per instance, a replay buffer of the last ``buffer`` messages."""

    buffer: int
    instance: int = 0
    next_seq: int = 0
    history: list[int] = field(default_factory=list)

    def publish(self) -> tuple[int, bytes]:
        seq = self.next_seq
        self.next_seq += 1
        self.history.append(seq)
        return seq, payload_of(self.instance, seq)

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        kept = self.history[-self.buffer :]
        return [(s, payload_of(self.instance, s)) for s in kept if s >= start]

    def restart(self) -> None:
        self.instance += 1
        self.next_seq = 0
        self.history = []


@dataclass
class Sink:
    """What downstream sees, checked as it arrives: each Deliver/Lost in the current epoch, every
    epoch's batches from one engine instance."""

    epoch: int = 0
    seen: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)
    payload_instance: dict[int, str] = field(default_factory=dict)

    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Reset):
                assert a.epoch == self.epoch + 1
                self.epoch = a.epoch
            elif isinstance(a, Deliver):
                assert a.epoch == self.epoch, (a, self.epoch)
                inst, seq = a.payload.decode().split(":")
                # Every delivered batch of an epoch comes from one engine instance.
                assert self.payload_instance.setdefault(a.epoch, inst) == inst
                assert seq == str(a.seq)
                self.seen.setdefault(a.epoch, []).append(("d", a.seq, a.seq))
            elif isinstance(a, Lost):
                assert a.epoch == self.epoch, (a, self.epoch)
                assert a.from_seq <= a.to_seq
                self.seen.setdefault(a.epoch, []).append(("l", a.from_seq, a.to_seq))

    def check_contiguous(self, epoch: int, upto: int, start: int = 0) -> None:
        covered: list[int] = []
        for _kind, a, b in self.seen.get(epoch, []):
            covered.extend(range(a, b + 1))
        assert covered == list(range(start, upto + 1)), (epoch, covered[:50])


def payload_of(instance: int, seq: int) -> bytes:
    return f"{instance}:{seq}".encode()


def ts_of(payload: bytes) -> float:
    """The model's engine ts: distinct per (instance, seq), like a wall clock across restarts."""
    inst, seq = payload.decode().split(":")
    return int(inst) * 1e6 + int(seq)


def same_ts(_payload: bytes) -> float:
    """An engine ts that cannot tell two batches apart: only their CRC can."""
    return 1.5


def fp_of(instance: int, seq: int) -> tuple[float | None, int | None]:
    payload = payload_of(instance, seq)
    return fingerprint(ts_of(payload), payload)


def serve(seqr: StreamSequencer, req: RequestReplay, replies: list[tuple[int, bytes]], complete: bool = True) -> list[Action]:
    """Feed ``replies`` to the replay ``req`` and end it."""
    out: list[Action] = []
    for s, p in replies:
        out += seqr.replayed(req.request_id, s, p)
    out += seqr.replay_finished(req.request_id, complete)
    return out


def requests(actions: list[Action]) -> list[RequestReplay]:
    return [a for a in actions if isinstance(a, RequestReplay)]


def delivered(actions: list[Action]) -> list[tuple[int, int]]:
    """(seq, epoch) of every Deliver."""
    return [(a.seq, a.epoch) for a in actions if isinstance(a, Deliver)]


def lost(actions: list[Action]) -> list[Lost]:
    return [a for a in actions if isinstance(a, Lost)]


# -- ported --------------------------------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.booleans(), max_size=200), st.integers(5, 400))
def test_losses_only_when_buffer_lost_them(drops: list[bool], buffer: int) -> None:
    """With replay always answered, nothing is lost unless it left the engine's buffer."""
    engine = Engine(buffer=buffer)
    seqr = StreamSequencer(can_replay=True, replay_on_start=True)
    sink = Sink()
    for dropped in [*drops, False]:
        seq, payload = engine.publish()
        if dropped:
            continue
        actions = seqr.live(seq, payload)
        while actions:
            sink.apply(actions)
            reqs = requests(actions)
            actions = []
            for req in reqs:
                actions += serve(seqr, req, engine.replay(req.start))
    lost_spans = [(a, b) for kind, a, b in sink.seen.get(0, []) if kind == "l"]
    sink.check_contiguous(0, engine.next_seq - 1)
    assert sink.epoch == 0
    if len(drops) < buffer:
        assert not lost_spans


def test_restart_resets_epoch_and_replays_new_beginning() -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=True)
    assert seqr.live(0, b"a") == [Deliver(0, b"a", 0)]
    assert seqr.live(1, b"b") == [Deliver(1, b"b", 0)]
    actions = seqr.live(1, b"x")  # restarted engine, first live seq 1 (slow joiner)
    assert actions[0] == Reset(1, "publisher_restart")
    assert actions[1] == Gap(0, 0)
    req = actions[2]
    assert isinstance(req, RequestReplay) and req.start == 0
    out = serve(seqr, req, [(0, b"y"), (1, b"x")])
    assert out[:2] == [Deliver(0, b"y", 1, replayed=True), Deliver(1, b"x", 1)]


def test_duplicates_from_replay_overlap_are_dropped() -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=True)
    actions = seqr.live(2, b"2")
    (req,) = requests(actions)
    out: list[Action] = []
    for s in range(0, 4):
        out += seqr.replayed(req.request_id, s, str(s).encode())
    assert delivered(out) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert [a.seq for a in out if isinstance(a, Duplicate)] == [2]  # held live copy already went out
    assert seqr.live(3, b"3") == [Duplicate(3)]


def test_no_replay_announces_gap_as_lost() -> None:
    seqr = StreamSequencer(can_replay=False, replay_on_start=False)
    # Joined mid-stream: nothing asked for; the head it never saw is announced as joined_late.
    assert seqr.live(5, b"5") == [Lost(0, 4, "joined_late", 0), Deliver(5, b"5", 0)]
    actions = seqr.live(9, b"9")
    assert actions == [Gap(6, 8), Lost(6, 8, "no_replay", 0), Deliver(9, b"9", 0)]


def test_resume_from_checkpoint() -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, epoch=3, delivered=41)
    actions = seqr.live(50, b"50")
    (req,) = requests(actions)
    # One early: its reply verifies the instance; to the batch waiting, whose bytes its reply
    # compares (it has no ts).
    assert req.start == 41 and req.until == 50 and seqr.epoch == 3
    assert not delivered(actions)  # held, unverified, until the replay answers
    seqr2 = StreamSequencer(can_replay=True, replay_on_start=True, epoch=3, delivered=41)
    actions = seqr2.live(2, b"2")  # below the checkpoint: the engine restarted meanwhile
    assert actions[0] == Reset(4, "publisher_restart")


def test_gap_beyond_buffer_is_one_lost_after_confirmation() -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=True)
    seqr.live(0, b"0")
    actions = seqr.live(100, b"100")
    (req,) = requests(actions)
    out = seqr.replayed(req.request_id, 60, b"60")  # the buffer starts at 60
    assert not lost(out)
    out = seqr.replay_finished(req.request_id, True)
    assert not lost(out)
    (req2,) = requests(out)
    out = seqr.replayed(req2.request_id, 61, b"61")  # again above the start: the span is gone
    # 60 reached the bridge (held from the first attempt): delivered, not lost (I4).
    assert lost(out) == [Lost(1, 59, "replay_buffer_exceeded", 0)]
    assert delivered(out) == [(60, 0), (61, 0)]


def test_replay_reveals_restart_hidden_by_higher_seqs() -> None:
    """The engine restarted and passed our position unseen: the replay's first (verify) reply tells."""
    engine = Engine(buffer=100)
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    sink = Sink()
    for _ in range(3):
        sink.apply(seqr.live(*engine.publish()))
    engine.restart()
    for _ in range(5):
        engine.publish()  # all missed
    actions = seqr.live(*engine.publish())  # seq 5 > last live 2: looks like a plain gap
    sink.apply(actions)
    (req,) = requests(actions)
    assert req.start == 2  # one early, to verify
    out: list[Action] = []
    for s, p in engine.replay(req.start):
        out += seqr.replayed(req.request_id, s, p)
    sink.apply(out)
    assert Reset(1, "publisher_restart") in out
    (req2,) = requests(out)
    assert req2.start == 0
    out = serve(seqr, req2, engine.replay(0))
    sink.apply(out)
    assert seqr.epoch == 1
    sink.check_contiguous(1, 5)
    assert sink.payload_instance == {0: "0", 1: "1"}


@pytest.mark.parametrize("dropped", [False, True], ids=["live connection up", "after a drop"])
def test_a_restart_shown_by_the_replay_alone_is_marked(dropped: bool) -> None:
    """breaker108 G1: a replay socket that is another engine's contradicts the delivered batch at a
    gap, which reads as a restart the live connection never showed (nothing on the wire tells the
    two apart). The epoch is marked (``shown_by_replay``) so the bridge can say so; after a drop
    of the live connection a restart is expected, and nothing is marked."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    for s in range(3):
        seqr.live(s, payload_of(0, s))
    if dropped:
        seqr.disconnected()
    (req,) = requests(seqr.live(5, payload_of(1, 5)))
    out = seqr.replayed(req.request_id, 2, payload_of(1, 2))
    assert Reset(1, "publisher_restart") in out, out
    assert seqr.shown_by_replay == (None if dropped else 1)


@pytest.mark.parametrize("dropped", [False, True], ids=["no drop since the start", "after a drop"])
def test_a_restart_shown_by_the_replay_alone_after_a_start_from_a_checkpoint_is_marked(dropped: bool) -> None:
    """breaker116 6: a replay_endpoint changed to another engine's comes with a restart of the
    bridge, which resumes from its checkpoint in doubt: the restart that replay showed was not
    marked, and nothing was logged (3 of 3). Marked now, as one at start (the engine may have
    restarted while the bridge was down); a drop seen since the start still expects a restart."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, epoch=2, delivered=6, delivered_fp=fp_of(0, 6), ts_of=ts_of)
    (req,) = seqr.start()
    if dropped:
        seqr.disconnected()
    out = seqr.replayed(req.request_id, 6, payload_of(1, 6))  # another batch at the checkpoint's seq
    out += seqr.replayed(req.request_id, 7, payload_of(1, 7))
    assert any(isinstance(a, Reset) and a.reason == "publisher_restart" for a in out), out
    assert seqr.shown_by_replay == (None if dropped else seqr.epoch)
    assert seqr.shown_at_start is not dropped


def test_restart_found_by_replay_announces_no_loss_past_what_the_old_instance_published() -> None:
    """The old epoch's tail ends at the last seq its instance was seen to publish (``_restart``):
    a live batch the replay proves to be the new instance's does not extend it."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    for s in range(3):
        seqr.live(s, payload_of(0, s))
    (req,) = requests(seqr.live(5, payload_of(1, 5)))  # the new instance, no disconnect seen
    out = seqr.replayed(req.request_id, 2, payload_of(1, 2))
    assert out[0] == Reset(1, "publisher_restart"), out


def test_resume_verifies_checkpoint_position() -> None:
    engine = Engine(buffer=100)
    for _ in range(10):
        engine.publish()
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, epoch=2, delivered=6, delivered_fp=fp_of(0, 6), ts_of=ts_of)
    (req,) = seqr.start()
    assert isinstance(req, RequestReplay) and req.start == 6 and req.until == -1
    out: list[Action] = []
    for s, p in engine.replay(req.start):
        out += seqr.replayed(req.request_id, s, p)
    assert delivered(out) == [(7, 2), (8, 2), (9, 2)]
    assert seqr.epoch == 2


def test_idle_probe_fetches_a_dropped_tail() -> None:
    engine = Engine(buffer=100)
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    sink = Sink()
    for _ in range(5):
        sink.apply(seqr.live(*engine.publish()))
    engine.publish()  # seq 5 never arrives live, and the engine goes quiet
    (req,) = seqr.probe()
    assert isinstance(req, RequestReplay) and req.start == 4 and req.until == -1
    out = serve(seqr, req, engine.replay(req.start))
    sink.apply(out)
    assert delivered(out) == [(5, 0)]
    assert seqr.probe() and seqr.delivered == 5


# -- instances and epochs ------------------------------------------------------------------------


def test_resumed_live_seq_at_checkpoint_with_other_bytes_is_a_restart() -> None:
    """(a) Same seq and engine ts as the checkpoint's batch, other bytes: another instance."""
    seqr = StreamSequencer(
        can_replay=True, replay_on_start=True, epoch=2, delivered=5, delivered_fp=fingerprint(1.5, b"old:5"), ts_of=same_ts
    )
    actions = seqr.live(5, b"new:5")
    assert actions[0] == Reset(3, "publisher_restart")
    assert actions[1:] == [Gap(0, 4), RequestReplay(1, 0, 4, 0)]
    assert seqr.held == {5: b"new:5"}


def test_resumed_live_seq_at_checkpoint_with_same_bytes_is_a_duplicate() -> None:
    """(a) The checkpoint's batch again, byte for byte: the same instance, nothing new."""
    seqr = StreamSequencer(
        can_replay=True, replay_on_start=True, epoch=2, delivered=5, delivered_fp=fingerprint(1.5, b"old:5"), ts_of=same_ts
    )
    assert seqr.live(5, b"old:5") == [Duplicate(5)]
    assert seqr.epoch == 2 and seqr.delivered == 5


def test_restart_found_by_replay_verification_at_checkpoint_seq_0() -> None:
    """(b) Resumed at seq 0: the replay's copy of seq 0 differs, so the engine restarted."""
    engine = Engine(buffer=100)
    engine.restart()  # the instance that published the checkpoint's batch is gone
    for _ in range(3):
        engine.publish()
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, epoch=4, delivered=0, delivered_fp=fp_of(0, 0), ts_of=ts_of)
    (req,) = seqr.start()
    assert isinstance(req, RequestReplay)
    assert req.start == 0  # from the checkpoint's seq itself, to verify it
    out: list[Action] = []
    for s, p in engine.replay(req.start):
        out += seqr.replayed(req.request_id, s, p)
    out += seqr.replay_finished(req.request_id, True)
    assert out[0] == Reset(5, "publisher_restart")
    assert out[1] == Deliver(0, payload_of(1, 0), 5, replayed=True)
    (req2,) = requests(out)
    out = serve(seqr, req2, engine.replay(req2.start))
    assert delivered(out) == [(1, 5), (2, 5)]
    assert not any(isinstance(a, Reset | Lost) for a in out)


def test_same_instance_at_checkpoint_seq_0_is_verified() -> None:
    """(b) The counterpart: seq 0 replayed with the same bytes, the epoch goes on."""
    engine = Engine(buffer=100)
    for _ in range(3):
        engine.publish()
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, epoch=4, delivered=0, delivered_fp=fp_of(0, 0), ts_of=ts_of)
    (req,) = seqr.start()
    assert isinstance(req, RequestReplay)
    out = serve(seqr, req, engine.replay(req.start))
    assert out[0] == Duplicate(0)
    assert delivered(out) == [(1, 4), (2, 4)]
    assert not any(isinstance(a, Reset | Lost) for a in out)


@pytest.mark.parametrize("max_attempts", [2, 3, 5])
def test_lost_on_exactly_the_last_silent_replay(max_attempts: int) -> None:
    """(c) A silent replay is retried; the span is declared lost on the max_attempts-th, not before."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, max_attempts=max_attempts)
    seqr.live(0, b"0")
    (req,) = requests(seqr.live(5, b"5"))
    for attempt in range(1, max_attempts):
        out = seqr.replay_finished(req.request_id, complete=False)
        assert not lost(out) and not delivered(out), attempt
        (req,) = requests(out)
        assert req.attempt == attempt and req.start == 0
    out = seqr.replay_finished(req.request_id, complete=False)
    assert out == [Lost(1, 4, "replay_unavailable", 0), Deliver(5, b"5", 0)]
    assert not seqr.replaying


def test_old_instance_settled_under_old_epoch_before_reset() -> None:
    """(d) Held batches delivered, the rest of the old instance's tail (up to the highest seq
    seen live, past max_held) lost, all under the old epoch and before the Reset."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, max_held=2)
    seqr.live(0, b"0")
    seqr.live(3, b"3")
    seqr.live(4, b"4")
    seqr.live(6, b"6")  # past max_held: not kept
    seqr.live(7, b"7")
    assert sorted(seqr.held) == [3, 4]
    actions = seqr.live(0, b"new0")  # the engine restarted
    reset = actions.index(Reset(1, "publisher_restart"))
    assert actions[:reset] == [
        Lost(1, 2, "publisher_restart", 0),
        Deliver(3, b"3", 0),
        Deliver(4, b"4", 0),
        Lost(5, 7, "publisher_restart", 0),
    ]
    assert actions[reset + 1 :] == [Deliver(0, b"new0", 1)]


def test_old_instance_held_batches_settled_before_reset_found_by_replay() -> None:
    """(d) The same when the replay's verification reveals the restart: the old instance's held
    batches and tail go out under the old epoch first; the new instance's live batch moves on."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, max_held=2, ts_of=ts_of)
    seqr.live(0, payload_of(0, 0))
    seqr.live(1, payload_of(0, 1))
    (req,) = requests(seqr.live(4, payload_of(0, 4)))  # 2..3 missing
    seqr.live(5, payload_of(0, 5))
    seqr.live(7, payload_of(0, 7))  # past max_held
    out = seqr.replayed(req.request_id, 1, payload_of(1, 1))  # the anchor, from another instance
    reset = out.index(Reset(1, "publisher_restart"))
    assert out[:reset] == [
        Lost(2, 3, "publisher_restart", 0),
        Deliver(4, payload_of(0, 4), 0),
        Deliver(5, payload_of(0, 5), 0),
        Lost(6, 7, "publisher_restart", 0),
    ]
    assert all(a.epoch == 1 for a in out[reset:] if isinstance(a, Deliver | Lost))


def test_old_instance_tail_in_doubt_reaches_the_last_seq_seen_live() -> None:
    """(d) In doubt (after a disconnect) live batches wait unverified, past max_held not even kept;
    when the live stream then shows a restart, the old epoch's Lost still runs up to the highest
    seq seen live (unverified batches cannot be proven the old instance's: lost, not delivered)."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, max_held=2)
    seqr.live(0, b"0")
    seqr.disconnected()
    for s in (1, 2, 3, 4):  # 3 and 4 past max_held
        seqr.live(s, str(s).encode())
    assert sorted(seqr.unverified) == [1, 2]
    actions = seqr.live(0, b"new0")
    assert actions == [Lost(1, 4, "publisher_restart", 0), Reset(1, "publisher_restart"), Deliver(0, b"new0", 1)]


def test_live_next_seq_drains_held_without_replay() -> None:
    """(e) Held seqs above a gap (from a replay that lost a reply), then the missing seq arrives
    live: delivered at once with the held ones, no new replay."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    for s in range(3):
        seqr.live(s, payload_of(0, s))
    (req,) = seqr.probe()
    assert isinstance(req, RequestReplay)
    out = seqr.replayed(req.request_id, 2, payload_of(0, 2))  # the anchor
    out += seqr.replayed(req.request_id, 4, payload_of(0, 4))  # 3 dropped by the ROUTER
    out += seqr.replayed(req.request_id, 5, payload_of(0, 5))
    assert not delivered(out) and sorted(seqr.held) == [4, 5]
    actions = seqr.live(3, payload_of(0, 3))
    assert actions == [Deliver(3, payload_of(0, 3), 0), Deliver(4, payload_of(0, 4), 0), Deliver(5, payload_of(0, 5), 0)]
    assert not seqr.held
    assert seqr.replay_finished(req.request_id, True) == []  # nothing left to ask for


def test_same_seq_contradiction_with_earlier_reply_ts_loses_nothing_silently() -> None:
    """Found by test_hostile_input (ops: disconnect, live 0, reply 0 with other bytes). With clocks
    that differ between engine hosts, ts order need not follow instance order."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts_of)
    assert seqr.disconnected() == []
    assert seqr.live(0, payload_of(1, 0)) == [RequestReplay(1, 0, -1, 0)]
    out = seqr.replayed(1, 0, payload_of(0, 0))
    settled = [a for a in out if isinstance(a, Deliver) and a.payload == payload_of(1, 0)]
    settled += [a for a in out if isinstance(a, Lost) and a.from_seq <= 0 <= a.to_seq]
    assert settled or (0 in seqr.held and seqr.delivered < 0), (out, seqr.held)
    assert all(s > seqr.delivered for s in seqr.held), (seqr.delivered, seqr.held)


@pytest.mark.parametrize("with_ts", [True, False], ids=["ts", "no_ts"])
def test_after_disconnect_next_live_seq_waits_for_verification_restart(with_ts: bool) -> None:
    """(f) Case 7: the new instance's first seq seen is exactly the old last + 1. Held until the
    replay's anchor reply (other bytes) shows the restart; the new epoch gets the held batch."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of if with_ts else lambda _p: None)
    for s in range(4):
        seqr.live(s, payload_of(0, s))
    assert seqr.disconnected() == []
    actions = seqr.live(4, payload_of(1, 4))
    # From the last delivered seq, to verify it; without a ts, to the batch waiting too.
    assert actions == [RequestReplay(1, 3, 3 if with_ts else 4, 0)]
    assert seqr.unverified == {4: payload_of(1, 4)}
    out = seqr.replayed(1, 3, payload_of(1, 3))
    if not with_ts:
        # Nothing tells yet whose the batch waiting is (it could be a late batch of the old
        # instance): the reply of its seq does, by its bytes.
        assert out == []
        out = seqr.replayed(1, 4, payload_of(1, 4))
    assert out[0] == Reset(1, "publisher_restart")
    (req,) = requests(out)
    assert req.start == 0
    out = serve(seqr, req, [(s, payload_of(1, s)) for s in range(5)])
    assert delivered(out) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]
    assert [a.payload for a in out if isinstance(a, Deliver)][-1] == payload_of(1, 4)


@pytest.mark.parametrize("with_ts", [True, False], ids=["ts", "no_ts"])
def test_after_disconnect_next_live_seq_waits_for_verification_same(with_ts: bool) -> None:
    """(f) Case 7, same instance: the anchor reply matches, the held batch goes out in the same epoch."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of if with_ts else lambda _p: None)
    for s in range(4):
        seqr.live(s, payload_of(0, s))
    seqr.disconnected()
    assert seqr.live(4, payload_of(0, 4)) == [RequestReplay(1, 3, 3 if with_ts else 4, 0)]
    out = seqr.replayed(1, 3, payload_of(0, 3))
    assert out == [Deliver(4, payload_of(0, 4), 0), Duplicate(3)]
    assert seqr.replay_finished(1, True) == []
    assert seqr.epoch == 0 and not seqr.in_doubt


def test_replay_above_start_twice_loses_only_what_is_not_held() -> None:
    """(g) The buffer slid past the gap: two attempts in a row start above it. Seqs the bridge
    holds in that span (live or from the first attempt) are delivered; only the others are lost."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    seqr.live(0, payload_of(0, 0))
    (req,) = requests(seqr.live(3, payload_of(0, 3)))  # held, live
    seqr.live(8, payload_of(0, 8))
    out = seqr.replayed(req.request_id, 5, payload_of(0, 5))  # first reply above the start
    out += seqr.replayed(req.request_id, 6, payload_of(0, 6))
    out += seqr.replay_finished(req.request_id, False)
    assert not lost(out)
    (req2,) = requests(out)
    out = seqr.replayed(req2.request_id, 7, payload_of(0, 7))  # above the same start again
    assert lost(out) == [Lost(1, 2, "replay_buffer_exceeded", 0), Lost(4, 4, "replay_buffer_exceeded", 0)]
    assert delivered(out) == [(3, 0), (5, 0), (6, 0), (7, 0)]
    # 8 came live past a gap: it waits for the reply at its seq, which confirms it.
    assert delivered(seqr.replayed(req2.request_id, 8, payload_of(0, 8))) == [(8, 0)]


def test_single_replay_above_start_is_not_a_loss() -> None:
    """(g) Once is not enough: the ROUTER may have dropped the first replies."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    seqr.live(0, payload_of(0, 0))
    (req,) = requests(seqr.live(4, payload_of(0, 4)))
    out = seqr.replayed(req.request_id, 2, payload_of(0, 2))
    out += seqr.replay_finished(req.request_id, True)
    (req2,) = requests(out)
    out = serve(seqr, req2, [(s, payload_of(0, s)) for s in range(0, 5)])
    assert not lost(out)
    assert delivered(out) == [(1, 0), (2, 0), (3, 0), (4, 0)]


def test_next_epoch_numbers_the_new_epoch() -> None:
    """(h) The epoch after a restart is whatever next_epoch says."""
    calls: list[tuple[int, float | None]] = []

    def next_epoch(epoch: int, shown_at: float | None) -> int:
        calls.append((epoch, shown_at))
        return epoch + 1000

    ts = {b"a": 1.0, b"b": 2.0, b"c": 3.5}  # engine ts; b"d": not decodable
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, epoch=7, next_epoch=next_epoch, ts_of=ts.get)
    seqr.live(0, b"a")
    seqr.live(1, b"b")
    actions = seqr.live(0, b"c")
    assert actions == [Reset(1007, "publisher_restart"), Deliver(0, b"c", 1007)]
    assert calls == [(7, 3.5)] and seqr.epoch == 1007 and seqr.position == (1007, 0)  # the ts of what showed it
    assert seqr.live(0, b"d")[0] == Reset(2007, "publisher_restart")
    assert calls == [(7, 3.5), (1007, None)]
