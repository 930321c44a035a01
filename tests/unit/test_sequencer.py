"""The sequencer against a model engine: every batch delivered once, in order, or announced lost."""

from __future__ import annotations

from dataclasses import dataclass, field

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
)


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
        return seq, f"{self.instance}:{seq}".encode()

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        kept = self.history[-self.buffer :]
        return [(s, f"{self.instance}:{s}".encode()) for s in kept if s >= start]

    def restart(self) -> None:
        self.instance += 1
        self.next_seq = 0
        self.history = []


@dataclass
class Sink:
    """What downstream sees, checked as it arrives."""

    epoch: int = 0
    seen: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)
    payload_instance: dict[int, str] = field(default_factory=dict)

    def apply(self, actions: list[Action], seqr: StreamSequencer) -> None:
        for a in actions:
            if isinstance(a, Reset):
                assert a.epoch == self.epoch + 1
                self.epoch = a.epoch
            elif isinstance(a, Deliver):
                inst = a.payload.decode().split(":")[0]
                # Every delivered batch of an epoch comes from one engine instance.
                assert self.payload_instance.setdefault(self.epoch, inst) == inst
                assert a.payload.decode().split(":")[1] == str(a.seq)
                self.seen.setdefault(self.epoch, []).append(("d", a.seq, a.seq))
            elif isinstance(a, Lost):
                assert a.from_seq <= a.to_seq
                self.seen.setdefault(self.epoch, []).append(("l", a.from_seq, a.to_seq))

    def check_contiguous(self, epoch: int, upto: int, start: int = 0) -> None:
        covered: list[int] = []
        for _kind, a, b in self.seen.get(epoch, []):
            covered.extend(range(a, b + 1))
        assert covered == list(range(start, upto + 1)), (epoch, covered[:50])


def ts_of(payload: bytes) -> float:
    """The model's engine ts: distinct per (instance, seq), like a wall clock across restarts."""
    inst, seq = payload.decode().split(":")
    return int(inst) * 1e6 + int(seq)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("pub"), st.booleans(), st.booleans()),  # (delivered live?, ...)
        st.tuples(st.just("restart"), st.just(False), st.just(False)),
        st.tuples(st.just("replay_fail"), st.booleans(), st.booleans()),  # silent / drop first reply
    ),
    max_size=120,
)


def run(scenario: list[tuple[str, bool, bool]], buffer: int, max_held: int) -> tuple[Sink, StreamSequencer, Engine]:
    engine = Engine(buffer=buffer)
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, max_held=max_held, max_attempts=3, ts_of=ts_of)
    sink = Sink()
    pending: list[RequestReplay] = []
    fail_next: list[str] = []

    def handle(actions: list[Action]) -> None:
        sink.apply(actions, seqr)
        pending.extend(a for a in actions if isinstance(a, RequestReplay))

    def serve() -> None:
        while pending:
            req = pending.pop(0)
            mode = fail_next.pop(0) if fail_next else "ok"
            replies = engine.replay(req.start)
            if mode == "silent":
                handle(seqr.replay_finished(req.request_id, complete=False))
                continue
            if mode == "drop_first" and replies:
                replies = replies[1:]
            for seq, payload in replies:
                handle(seqr.replayed(req.request_id, seq, payload))
            handle(seqr.replay_finished(req.request_id, complete=True))

    must_see = False
    for op, a, b in scenario:
        if op == "pub":
            seq, payload = engine.publish()
            if a or b or must_see:  # dropped live with probability 1/4
                handle(seqr.live(seq, payload))
                must_see = False
        elif op == "restart":
            # The restarted engine's ROUTER never answers what the old one was asked.
            while pending:
                handle(seqr.replay_finished(pending.pop(0).request_id, complete=False))
            engine.restart()
            # Without an epoch id on the wire, a restart shows only as a live seq at or below the
            # last one seen: the model lets the bridge see the new instance's first message.
            must_see = seqr.last_live is not None
        else:
            fail_next.append("silent" if a else "drop_first")
        if b:
            serve()
    # Quiesce: one reliable message, all replays succeed.
    fail_next.clear()
    seq, payload = engine.publish()
    handle(seqr.live(seq, payload))
    serve()
    return sink, seqr, engine


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 50), st.integers(1, 30))
def test_every_batch_once_in_order_or_announced(scenario: list[tuple[str, bool, bool]], buffer: int, max_held: int) -> None:
    sink, seqr, engine = run(scenario, buffer, max_held)
    # Past epochs: contiguous from 0 up to where they stopped (lost or delivered); current: up to last.
    for epoch, items in sink.seen.items():
        seqs = [s for _kind, a, b in items for s in range(a, b + 1)]
        assert seqs == sorted(seqs) and len(seqs) == len(set(seqs)), (epoch, items)
        assert seqs[0] == 0
    sink.check_contiguous(sink.epoch, engine.next_seq - 1)
    assert seqr.delivered == engine.next_seq - 1
    assert not seqr.held


@settings(max_examples=200, deadline=None)
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
            sink.apply(actions, seqr)
            requests = [a for a in actions if isinstance(a, RequestReplay)]
            actions = []
            for req in requests:
                for s, p in engine.replay(req.start):
                    actions += seqr.replayed(req.request_id, s, p)
                actions += seqr.replay_finished(req.request_id, True)
    lost = [(a, b) for kind, a, b in sink.seen.get(0, []) if kind == "l"]
    sink.check_contiguous(0, engine.next_seq - 1)
    if len(drops) < buffer:
        assert not lost


def test_restart_resets_epoch_and_replays_new_beginning() -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=True)
    assert [type(a) for a in seqr.live(0, b"a")] == [Deliver]
    assert [type(a) for a in seqr.live(1, b"b")] == [Deliver]
    actions = seqr.live(1, b"x")  # restarted engine, first live seq 1 (slow joiner)
    assert isinstance(actions[0], Reset) and actions[0].epoch == 1
    assert isinstance(actions[1], Gap) and (actions[1].from_seq, actions[1].to_seq) == (0, 0)
    req = actions[2]
    assert isinstance(req, RequestReplay) and req.start == 0


def test_duplicates_from_replay_overlap_are_dropped() -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=True)
    actions = seqr.live(2, b"2")
    req = next(a for a in actions if isinstance(a, RequestReplay))
    out = []
    for s in range(0, 4):
        out += seqr.replayed(req.request_id, s, str(s).encode())
    assert [a.seq for a in out if isinstance(a, Deliver)] == [0, 1, 2, 3]
    assert [a.seq for a in out if isinstance(a, Duplicate)] == [2]  # held live copy already went out
    assert [type(a) for a in seqr.live(3, b"3")] == [Duplicate]


def test_no_replay_announces_gap_as_lost() -> None:
    seqr = StreamSequencer(can_replay=False, replay_on_start=False)
    assert [type(a) for a in seqr.live(5, b"5")] == [Deliver]  # joined mid-stream: nothing asked for
    actions = seqr.live(9, b"9")
    assert Lost(6, 8, "no_replay") in actions


def test_resume_from_checkpoint() -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, epoch=3, delivered=41)
    actions = seqr.live(50, b"50")
    req = next(a for a in actions if isinstance(a, RequestReplay))
    assert req.start == 42 and seqr.epoch == 3
    seqr2 = StreamSequencer(can_replay=True, replay_on_start=True, epoch=3, delivered=41)
    actions = seqr2.live(2, b"2")  # below the checkpoint: the engine restarted meanwhile
    assert isinstance(actions[0], Reset) and actions[0].epoch == 4


def test_gap_beyond_buffer_is_one_lost_after_confirmation() -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=True)
    seqr.live(0, b"0")
    actions = seqr.live(100, b"100")
    req = next(a for a in actions if isinstance(a, RequestReplay))
    out = seqr.replayed(req.request_id, 60, b"60")  # the buffer starts at 60
    assert not any(isinstance(a, Lost) for a in out)
    out = seqr.replay_finished(req.request_id, True)
    req2 = next(a for a in out if isinstance(a, RequestReplay))
    out = seqr.replayed(req2.request_id, 61, b"61")
    assert [a for a in out if isinstance(a, Lost)] == [Lost(1, 60, "replay_buffer_exceeded")]


def test_replay_reveals_restart_hidden_by_higher_seqs() -> None:
    """The engine restarted and passed our position unseen: the replay's first (verify) reply tells."""
    engine = Engine(buffer=100)
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    sink = Sink()
    for _ in range(3):
        sink.apply(seqr.live(*engine.publish()), seqr)
    engine.restart()
    for _ in range(5):
        engine.publish()  # all missed
    actions = seqr.live(*engine.publish())  # seq 5 > last live 2: looks like a plain gap
    sink.apply(actions, seqr)
    req = next(a for a in actions if isinstance(a, RequestReplay))
    assert req.start == 2  # one early, to verify
    out: list[Action] = []
    for s, p in engine.replay(req.start):
        out += seqr.replayed(req.request_id, s, p)
    sink.apply(out, seqr)
    assert any(isinstance(a, Reset) for a in out)
    req2 = next(a for a in out if isinstance(a, RequestReplay))
    assert req2.start == 0
    out = []
    for s, p in engine.replay(0):
        out += seqr.replayed(req2.request_id, s, p)
    out += seqr.replay_finished(req2.request_id, True)
    sink.apply(out, seqr)
    assert seqr.epoch == 1
    sink.check_contiguous(1, 5)
    assert sink.payload_instance[1] == "1"


def test_resume_verifies_checkpoint_position() -> None:
    engine = Engine(buffer=100)
    for _ in range(10):
        engine.publish()
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, epoch=2, delivered=6, delivered_ts=ts_of(b"0:6"), ts_of=ts_of)
    (req,) = seqr.start()
    assert isinstance(req, RequestReplay) and req.start == 6 and req.until == -1
    out: list[Action] = []
    for s, p in engine.replay(req.start):
        out += seqr.replayed(req.request_id, s, p)
    assert [a.seq for a in out if isinstance(a, Deliver)] == [7, 8, 9]
    assert seqr.epoch == 2


def test_idle_probe_fetches_a_dropped_tail() -> None:
    engine = Engine(buffer=100)
    seqr = StreamSequencer(can_replay=True, replay_on_start=True, ts_of=ts_of)
    sink = Sink()
    for _ in range(5):
        sink.apply(seqr.live(*engine.publish()), seqr)
    engine.publish()  # seq 5 never arrives live, and the engine goes quiet
    (req,) = seqr.probe()
    assert isinstance(req, RequestReplay) and req.start == 4 and req.until == -1
    out: list[Action] = []
    for s, p in engine.replay(req.start):
        out += seqr.replayed(req.request_id, s, p)
    out += seqr.replay_finished(req.request_id, True)
    sink.apply(out, seqr)
    assert [a.seq for a in out if isinstance(a, Deliver)] == [5]
    assert seqr.probe() and seqr.delivered == 5
