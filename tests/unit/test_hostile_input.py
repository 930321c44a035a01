"""Hostile input: whatever an engine (or anything that reaches port 5557/5558) sends, nothing escapes.

Three layers, each fed adversarial input with Hypothesis:

- the frame and payload decoder (``bridge.wire``): random frame lists and frame-level mutations of
  the captured vectors; only ``DecodeError`` may come out, and whatever decodes also renders in
  every output format (or raises an Exception, which the sink worker dead-letters: a value nested
  too deep for the renderer raises RecursionError) and can be dead-lettered;
- the sequencer (``StreamSequencer``): random interleavings of live messages, replay replies (to
  the request in flight or to stale ones), replay ends, idle probes and dropped connections, with
  arbitrary seqs (huge, repeated, going backwards) and resume positions. Invariants: no
  exception, held and unverified batches together never exceed ``max_held``, within an epoch
  what is delivered or announced lost moves strictly forward and without holes (each Deliver /
  Lost starts right after the previous one), and every Deliver / Lost carries the current epoch
  (none comes after the Reset that opened a later one);
- the two together, the way ``bridge.stream`` drives them.

The real-socket cases (a ROUTER answering garbage, a 100 MB frame) are in
``tests/integration/test_security.py``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bridge import wire
from bridge.deadletter import DeadLetters
from bridge.errors import DecodeError
from bridge.formats import Renderer
from bridge.records import Record, Stream, events_lost
from bridge.sequencer import Action, Deliver, Lost, RequestReplay, Reset, StreamSequencer, fingerprint
from tests.support.strategies import examples
from tests.support.vectors import load_all

VECTORS = load_all()
FRAMES = [v.frames for v in VECTORS]
PAYLOADS = [v.frames[-1] for v in VECTORS if v.frames[-1]]
RENDERERS = [Renderer(f, g, h) for f in ("json", "msgpack", "raw") for g in ("event", "batch") for h in ("int", "hex")]
STREAM = Stream("hostile", 0)
END = 2**64 - 1

# -- the decoder ---------------------------------------------------------------------------------


def _mutate(data: st.DataObject, frame: bytes) -> bytes:
    buf = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 6), label="mutations")):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "truncate", "splice"]))
        pos = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del buf[pos : pos + data.draw(st.integers(1, 32))]
        elif op == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "truncate":
            del buf[pos:]
        else:  # a piece of another vector's payload: valid msgpack in the wrong place
            other = data.draw(st.sampled_from(PAYLOADS))
            a = data.draw(st.integers(0, len(other)))
            buf[pos:pos] = other[a : a + data.draw(st.integers(1, 64))]
    return bytes(buf)


# msgpack values a hostile engine could put where events or fields belong.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=40),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3), st.binary(max_size=3)), inner, max_size=4),
    ),
    max_leaves=12,
)
_field_names = st.one_of(
    st.sampled_from(["type", *wire.FIELDS["BlockStored"], "source", "seq", "epoch", "index", "ts", "dp_rank", "extra"]),
    st.text(max_size=6),
)
_events = st.one_of(
    _values,
    st.lists(st.one_of(st.sampled_from([*wire.FIELDS, "Unknown", ""]), _values), min_size=0, max_size=8),
    st.dictionaries(_field_names, _values, max_size=8).map(lambda d: {"type": d.pop("type", "BlockStored"), **d}),
)
_batches = st.one_of(
    st.tuples(st.floats(allow_nan=False), st.lists(_events, max_size=5)).map(list),
    st.tuples(_values, st.lists(_events, max_size=5), _values).map(list),
    st.fixed_dictionaries({"ts": _values, "events": st.lists(_events, max_size=5)}, optional={"data_parallel_rank": _values}),
    _values,
)


def _encode(obj: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except (TypeError, ValueError, OverflowError):
        return b"\xc1"  # never valid msgpack


def _decode_and_render(payload: bytes, seq: int, tmp: Path | None = None) -> None:
    """What bridge.stream and bridge.sink do with one delivered payload, minus the sockets."""
    try:
        batch = wire.decode_batch(payload)
    except DecodeError as exc:
        assert exc.reason in ("bad_msgpack", "bad_batch")
        record = events_lost(STREAM, 0, seq, seq, "undecodable", 0.0)
    else:
        assert all(isinstance(e, dict) and isinstance(e.get("type"), str) for e in batch.events)
        record = Record(stream=STREAM, epoch=0, seq=seq, ts=batch.ts, payload=payload, events=batch.events)
    wire.peek_ts(payload)
    for renderer in RENDERERS:
        try:
            messages = renderer.render(record)
        except Exception:
            continue  # the sink worker dead-letters the record as unrenderable and announces it
        assert messages or (renderer.granularity == "event" and not record.events and record.kind == "batch")
        for m in messages:
            assert isinstance(m.value, bytes) and m.headers["source"] == "hostile" and m.headers["seq"] == str(seq)
    if tmp is not None:
        letters = DeadLetters(str(tmp / "dead.jsonl"))
        letters.write(reason="bad_msgpack", source="hostile", dp_rank=0, seq=seq, detail=repr(payload[:64]), payload=payload)
        letters.close()


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_and_mutated_frames_only_raise_decode_errors(data: st.DataObject) -> None:
    base = data.draw(st.sampled_from(FRAMES), label="vector")
    n = data.draw(st.integers(0, 6), label="frames")
    frames: list[bytes] = []
    for i in range(n):
        kind = data.draw(st.sampled_from(["keep", "mutate", "random", "empty", "seq"]))
        src = base[i] if i < len(base) else b""
        if kind == "keep":
            frames.append(src)
        elif kind == "mutate":
            frames.append(_mutate(data, src or b"\x00"))
        elif kind == "random":
            frames.append(data.draw(st.binary(max_size=64)))
        elif kind == "empty":
            frames.append(b"")
        else:
            frames.append(data.draw(st.sampled_from([0, 1, 2**63, END - 1, END])).to_bytes(8, "big"))
    for parse in (wire.parse_live, wire.parse_replay):
        try:
            parsed = parse(frames)
        except DecodeError as exc:
            assert exc.reason in ("bad_frames", "bad_seq")
            continue
        assert 0 <= parsed.seq <= END
        _decode_and_render(parsed.payload, parsed.seq)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches, st.integers(0, END))
def test_structurally_hostile_batches_decode_or_fail_cleanly(batch: Any, seq: int) -> None:
    _decode_and_render(_encode(batch), seq)


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2048))
def test_dead_letters_take_any_payload(tmp_path: Path, payload: bytes) -> None:
    _decode_and_render(payload, 7, tmp_path)
    for line in (tmp_path / "dead.jsonl").read_bytes().splitlines():
        entry = msgspec.json.decode(line)
        assert entry["source"] == "hostile" and entry["seq"] == 7 and entry["reason"] == "bad_msgpack"


def deep_payload(depth: int = 500) -> bytes:
    """A valid ~640-byte batch ``[ts, [BlockStored], 0]`` whose event's ``extra_keys`` is a list nested
    ``depth`` deep. Written byte by byte: msgspec's encoder refuses what its decoder accepts."""
    fields = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(16))}
    fields["block_size"] = 16
    head = msgspec.msgpack.encode(fields)  # a fixmap: one more entry follows
    event = bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode("extra_keys") + b"\x91" * depth + b"\xc0"
    return b"\x93" + msgspec.msgpack.encode(1.5) + b"\x91" + event + b"\x00"


def test_deep_nesting_renders_or_fails_cleanly() -> None:
    """I5: a decodable value nested past what a renderer can recurse into must raise an Exception
    (which the sink worker dead-letters), never escape as something the worker cannot catch."""
    payload = deep_payload()
    assert 600 <= len(payload) <= 700
    batch = wire.decode_batch(payload)
    record = Record(stream=STREAM, epoch=0, seq=1, ts=batch.ts, payload=payload, events=batch.events)
    failed = set()
    for renderer in RENDERERS:
        try:
            renderer.render(record)
        except Exception:
            failed.add(renderer.format)
    assert "raw" not in failed  # the engine's bytes are never looked into
    assert "json" in failed  # the documented case; msgpack may go either way with the stack depth
    # Deeper than the decoder can go is a decode error, also when only counted (raw sinks).
    deeper = deep_payload(100_000)
    assert wire.count_batch(deeper) is None
    with pytest.raises(DecodeError, match="recursion"):
        wire.decode_batch(deeper)


def test_event_fields_never_overwrite_the_message_header() -> None:
    """An event field named like a header key (source, seq, ...) must not change the stream identity."""
    evil = {"type": "BlockStored", "source": "spoofed", "dp_rank": 9, "epoch": 9, "seq": 9, "index": 9, "ts": 9.0}
    payload = msgspec.msgpack.encode([1.5, [evil], 0])
    batch = wire.decode_batch(payload)
    record = Record(stream=STREAM, epoch=0, seq=3, ts=batch.ts, payload=payload, events=batch.events)
    for renderer in RENDERERS:
        for m in renderer.render(record):
            if renderer.format == "raw":
                continue
            body = msgspec.json.decode(m.value) if renderer.format == "json" else msgspec.msgpack.decode(m.value)
            assert (body["source"], body["dp_rank"], body["epoch"], body["seq"]) == ("hostile", 0, 0, 3), (renderer.format, body)
            if renderer.granularity == "event":
                assert (body["index"], body["ts"]) == (0, 1.5), body
                # nothing dropped: the engine's own values are kept beside the header
                assert body["shadowed"] == {k: v for k, v in evil.items() if k != "type"}, body
            else:
                assert body["events"] == [evil], body


# -- the sequencer -------------------------------------------------------------------------------

_seqs = st.one_of(
    st.integers(0, 40),
    st.sampled_from([2**31, 2**63 - 1, 2**63, END - 1, END]),
    st.integers(0, END),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("live"), _seqs, st.integers(0, 3)),
        st.tuples(st.just("live_next"), st.integers(1, 3), st.integers(0, 3)),  # last live + k: mostly in order
        st.tuples(st.just("reply"), _seqs, st.integers(0, 3)),  # to the replay in flight
        st.tuples(st.just("reply_next"), st.integers(0, 3), st.integers(0, 3)),  # delivered + k
        st.tuples(st.just("stale_reply"), _seqs, st.integers(-2, 50)),  # to an old or never-made request
        st.tuples(st.just("finish"), st.booleans(), st.integers(0, 1)),
        st.tuples(st.just("stale_finish"), st.booleans(), st.integers(-2, 50)),
        st.tuples(st.just("probe"), st.just(0), st.just(0)),
        st.tuples(st.just("disconnect"), st.just(0), st.just(0)),
    ),
    max_size=150,
)
# A checkpoint's fingerprint: none, one that some payloads match, or one that none does.
_fps = st.one_of(
    st.none(),
    st.sampled_from([fingerprint(wire.peek_ts(p), p) for p in PAYLOADS[:3]]),
    st.tuples(st.sampled_from([None, 1.0, 2.5]), st.one_of(st.none(), st.integers(0, 2**32 - 1))),
)
_configs = st.fixed_dictionaries(
    {
        "can_replay": st.booleans(),
        "replay_on_start": st.booleans(),
        "max_held": st.integers(1, 12),
        "max_attempts": st.integers(1, 4),
        "resume": st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(-1, 30), _fps)),
    }
)


class Downstream:
    """What the sinks would see of one stream, checked action by action."""

    def __init__(self, seqr: StreamSequencer, joins: bool) -> None:
        self.epoch = seqr.epoch
        # Where the next Deliver/Lost must start; None: anywhere (a bridge joining mid-stream).
        self.next: int | None = None if joins else seqr.delivered + 1
        self.requests: list[int] = []

    def apply(self, actions: list[Action], seqr: StreamSequencer) -> None:
        for a in actions:
            if isinstance(a, Reset):
                assert a.epoch == self.epoch + 1, (a, self.epoch)
                self.epoch, self.next = a.epoch, 0
            elif isinstance(a, Deliver):
                assert a.epoch == self.epoch, (a, self.epoch)  # I1: never after a later epoch's Reset
                assert self.next is None or a.seq == self.next, (a.seq, self.next)
                self.next = a.seq + 1
            elif isinstance(a, Lost):
                assert a.epoch == self.epoch, (a, self.epoch)
                assert a.from_seq <= a.to_seq, a
                assert self.next is None or a.from_seq == self.next, (a, self.next)
                self.next = a.to_seq + 1
            elif isinstance(a, RequestReplay):
                assert seqr.can_replay
                assert 0 <= a.start <= END + 1 and (a.until == -1 or a.until >= a.start - 1), a  # the client clamps END + 1
                self.requests.append(a.request_id)
        assert len(seqr.held) + len(seqr.unverified) <= seqr.max_held
        assert seqr.epoch == self.epoch
        if self.next is not None:
            assert seqr.delivered == self.next - 1, (seqr.delivered, self.next)
        assert all(s > seqr.delivered for s in seqr.held), (seqr.delivered, sorted(seqr.held)[:5])
        assert all(s > seqr.delivered for s in seqr.unverified), (seqr.delivered, sorted(seqr.unverified)[:5])


def _payload(rng: random.Random, which: int) -> bytes:
    return PAYLOADS[which % len(PAYLOADS)] if which < 3 else bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 12)))


@settings(max_examples=examples(600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs, _ops, st.randoms(use_true_random=False))
@example(  # a live batch and a replayed one at the same seq, the replayed one with the earlier engine ts
    config={"can_replay": True, "replay_on_start": False, "max_held": 1, "max_attempts": 1, "resume": None},
    ops=[("disconnect", 0, 0), ("live", 0, 1), ("reply_next", 0, 0)],
    rng=random.Random(0),
)
@example(  # a checkpoint at seq -1 (nothing of its epoch yet) that carries a fingerprint all the same
    config={"can_replay": True, "replay_on_start": True, "max_held": 1, "max_attempts": 1, "resume": (0, -1, (1.0, 5))},
    ops=[],
    rng=random.Random(0),
)
def test_sequencer_survives_any_interleaving(config: dict[str, Any], ops: list[tuple[str, Any, Any]], rng: random.Random) -> None:
    resume = config["resume"]
    seqr = StreamSequencer(
        can_replay=config["can_replay"],
        replay_on_start=config["replay_on_start"],
        max_held=config["max_held"],
        max_attempts=config["max_attempts"],
        epoch=resume[0] if resume else 0,
        delivered=resume[1] if resume else None,
        delivered_fp=resume[2] if resume else None,
        ts_of=wire.peek_ts,
    )
    # A stream met for the first time is covered from seq 0 (its unseen head announced as
    # joined_late); a resumed one from its checkpoint on.
    down = Downstream(seqr, joins=False)
    down.apply(seqr.start(), seqr)
    for op, x, y in ops:
        current = down.requests[-1] if down.requests else 0
        if op == "live":
            actions = seqr.live(x, _payload(rng, y))
        elif op == "live_next":
            actions = seqr.live(min(END, (seqr.last_live if seqr.last_live is not None else -1) + x), _payload(rng, y))
        elif op == "reply":
            actions = seqr.replayed(current, x, _payload(rng, y))
        elif op == "reply_next":
            actions = seqr.replayed(current, min(END, max(0, seqr.delivered + x)), _payload(rng, y))
        elif op == "stale_reply":
            actions = seqr.replayed(y, x, _payload(rng, 0))
        elif op == "finish":
            actions = seqr.replay_finished(current, x)
        elif op == "stale_finish":
            actions = seqr.replay_finished(y, x)
        elif op == "disconnect":
            actions = seqr.disconnected()
        else:
            actions = seqr.probe()
        down.apply(actions, seqr)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 4)), max_size=300), st.integers(1, 8))
def test_held_stays_bounded_under_a_flood_of_gaps(seqs: list[tuple[int, int]], max_held: int) -> None:
    """A live stream of jumps while replay never answers: at most max_held batches are kept."""
    seqr = StreamSequencer(can_replay=True, replay_on_start=False, max_held=max_held, max_attempts=2, ts_of=wire.peek_ts)
    rng = random.Random(0)
    down = Downstream(seqr, joins=True)
    last = 0
    for step, which in seqs:
        last += 1 + step
        down.apply(seqr.live(last, _payload(rng, which)), seqr)
        if down.next is None and seqr.delivered >= 0:
            down.next = seqr.delivered + 1
        if which == 0 and down.requests:
            down.apply(seqr.replay_finished(down.requests[-1], False), seqr)


# -- decoder and sequencer together, as bridge.stream drives them ----------------------------------


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_hostile_frames_through_sequencer_decoder_and_renderers(data: st.DataObject) -> None:
    seqr = StreamSequencer(can_replay=True, replay_on_start=False, max_held=5, max_attempts=2, ts_of=wire.peek_ts)
    down = Downstream(seqr, joins=True)
    for _ in range(data.draw(st.integers(1, 25))):
        base = data.draw(st.sampled_from(FRAMES))
        frames = [f if not data.draw(st.booleans()) else _mutate(data, f or b"\x00") for f in base]
        if data.draw(st.booleans()):
            frames = frames[: data.draw(st.integers(0, len(frames)))] + data.draw(st.lists(st.binary(max_size=9), max_size=2))
        try:
            live = wire.parse_live(frames)
        except DecodeError:
            continue  # counted and dead-lettered by the pipeline; the stream goes on
        actions = seqr.live(live.seq, live.payload)
        down.apply(actions, seqr)
        if down.next is None and seqr.delivered >= 0:
            down.next = seqr.delivered + 1
        for a in actions:
            if isinstance(a, Deliver):
                _decode_and_render(a.payload, a.seq)
        pending = [a for a in actions if isinstance(a, RequestReplay)]
        if pending and data.draw(st.booleans()):
            reply = _mutate(data, data.draw(st.sampled_from(PAYLOADS)))
            down.apply(seqr.replayed(pending[-1].request_id, pending[-1].start, reply), seqr)
            down.apply(seqr.replay_finished(pending[-1].request_id, data.draw(st.booleans())), seqr)
