"""I6 in the shared delivery loop: what a sink lost or refused is announced to that sink, and one
record a connector cannot handle never stops the sink (I5).

Each test is a regression test of issue 29 (cases 6, 14 and 15): it fails on the loop before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from bridge import wire
from bridge.connector import Stops
from bridge.errors import ConnectorError, PartialFailure, Permanent, Retriable, SinkLost
from bridge.formats import STATE_TYPE, Message
from bridge.records import Record, Stream, events_lost, source_reset
from bridge.sink import REFUSED_AFTER, SinkWorker
from tests.support.memory import MemoryConnector, MemoryOptions
from tests.support.records import stream_records
from tests.unit.test_hostile_input import deep_payload
from tests.unit.test_sink import fill, make
from tests.unit.test_sink_counts import answering

STREAM = Stream("s", 0)
OTHER = Stream("t", 0)


class Delta:
    """A state change: the worker passes it to the connector, and reads only whether it clears."""

    def __init__(self, clear: bool = False) -> None:
        self.clear = clear


def delta(clear: bool = False) -> Delta:
    return Delta(clear)


def kinds(conn: MemoryConnector) -> list[tuple[str, str, int]]:
    return [(m.record.stream.key, m.record.kind, m.record.seq) for m in conn.messages]


def value(worker_metrics: object, name: str, **labels: str) -> float:
    return worker_metrics.registry.get_sample_value(name, labels) or 0.0  # type: ignore[attr-defined]


async def test_a_span_the_sink_lost_is_announced_to_it_ahead_of_the_write_which_goes_again(tmp_path: Path) -> None:
    worker, conn, acked, metrics = make(tmp_path, batch={"linger": 0, "max_messages": 2})
    lost_streams: list[Stream] = []
    worker.writes_state, worker.on_state_lost = True, lambda stream, _at: lost_streams.append(stream)
    records = stream_records(STREAM, 4) + stream_records(OTHER, 1)
    await fill(worker, records[:2])
    worker.start()
    assert await worker.flush(5)
    # The broker lost seqs 0..1 of STREAM; the connector says so at the next write, twice (it must
    # be announced once), and the write then goes through.
    span = (STREAM, 0, 0, 1)
    conn.failures = [SinkLost("stream reset", [span]), SinkLost("stream reset", [span]), None]
    await fill(worker, records[2:])
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert kinds(conn) == [
        ("s/0", "batch", 0),
        ("s/0", "batch", 1),
        ("s/0", "EventsLost", 1),  # ahead of the write that found the loss, once
        ("s/0", "batch", 2),
        ("s/0", "batch", 3),
        ("t/0", "batch", 0),
    ]
    lost = conn.messages[2].record
    assert lost.control() == {"type": "EventsLost", "from_seq": 0, "to_seq": 1, "count": 2, "reason": "sink_lost:mem"}
    assert lost_streams and {s.key for s in lost_streams} == {STREAM.key}  # the stream's state is cleared, incomplete
    assert [r.seq for r in acked] == [0, 1, 2, 3, 0]  # every batch settled once, nothing dropped
    assert value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="sink_lost") == 2
    # counted as announced: once, under the reason's kind (breaker30h M1: not counted at all)
    assert value(metrics, "kv_bridge_batches_lost_total", source="s", reason="sink_lost") == 2
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="dead_lettered") == 0
    assert worker.connected  # a loss is announced, not an outage


async def test_a_lost_span_the_write_carries_again_is_announced_only_below_it(tmp_path: Path) -> None:
    """Note 48 (left alone): a write's messages were stored and its state change failed; the retry
    found the destination lost (a JetStream stream deleted, with the bucket) and the connector named
    the span up to the last seq it had stored, the write's own among them. Announced whole, the
    write's batches then came again after the EventsLost that covered them: seqs going back within
    the epoch (I2), and delivered as well as announced (I3). Only what the write does not carry
    again is announced."""
    worker, conn, _acked, metrics = make(tmp_path, batch={"linger": 0, "max_messages": 8})
    records = stream_records(STREAM, 5)
    await fill(worker, records[:2])
    worker.start()
    assert await worker.flush(5)
    conn.failures = [SinkLost("stream deleted", [(STREAM, 0, 0, 4)]), None]  # (2..4 had been stored, then lost)
    await fill(worker, records[2:])
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert kinds(conn)[2:] == [("s/0", "EventsLost", 1), ("s/0", "batch", 2), ("s/0", "batch", 3), ("s/0", "batch", 4)]
    assert conn.messages[2].record.control()["from_seq"] == 0
    assert value(metrics, "kv_bridge_batches_lost_total", source="s", reason="sink_lost") == 2
    # A span the write carries whole is announced not at all.
    worker, conn, _acked, _metrics = make(tmp_path, batch={"linger": 0, "max_messages": 8})
    await fill(worker, records[:2])
    worker.start()
    assert await worker.flush(5)
    conn.failures = [SinkLost("stream deleted", [(STREAM, 0, 2, 4)]), None]
    await fill(worker, records[2:])
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [k for k in kinds(conn) if k[1] == "EventsLost"] == []


async def test_a_lost_span_reaching_a_batch_the_write_carries_in_part_covers_that_batch(tmp_path: Path) -> None:
    """breaker85 B2: at event granularity a batch's first events were stored, its third refused for
    the time being; the write that went again (from the failed message) found the destination lost.
    The span was cut below the lowest seq the write carried, that batch's: its stored events were
    neither delivered nor announced (I3). A batch carried from a later event on is not carried
    whole: the announcement covers it (its last events, written after, are superseded by it)."""

    class Partial(MemoryConnector):
        step = 0

        async def write(self, messages: Sequence[Message]) -> None:
            self.step += 1
            if self.step == 2:  # batch 1: its first two events stored, the third waits (stream full)
                self.messages.extend(messages[:2])
                raise PartialFailure({i: Retriable("full", reason="stream_full") for i in range(2, len(messages))})
            if self.step == 3:  # the destination lost everything meanwhile
                self.messages.clear()
                raise SinkLost("stream deleted", [(STREAM, 0, 0, 1)])
            self.messages.extend(messages)

    worker, _, _, _ = make(tmp_path, granularity="event", batch={"linger": 0})
    worker.connector = conn = Partial("mem", MemoryOptions(), worker.config)
    await fill(worker, stream_records(STREAM, 1))
    worker.start()
    assert await worker.flush(5)
    await fill(worker, stream_records(STREAM, 1, start=1))
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    told = [(m.record.from_seq, m.record.lost_to) for m in conn.messages if m.record.kind == "EventsLost"]
    assert told == [(0, 1)], told


class Raising(MemoryConnector):
    """Raises ``exc`` for every write holding a message of ``bad`` (seq of STREAM); while ``down``
    (counted down by each write and health check), every write raises and health() says so."""

    bad: int = -1
    down: int = 0
    exc: Exception = RecursionError("maximum recursion depth exceeded")

    async def write(self, messages: Sequence[Message]) -> None:
        self.writes.append(len(messages))
        if self.down > 0:
            self.down -= 1
            raise ValueError("client in a bad state")
        if any(m.record.kind == "batch" and m.record.seq == self.bad for m in messages):
            raise self.exc
        self.messages.extend(messages)

    async def health(self) -> str | None:
        if self.down > 0:  # recovering meanwhile
            self.down -= 1
            return "reconnecting"
        return None


async def test_a_record_the_connector_keeps_failing_on_is_dead_lettered_and_announced(tmp_path: Path) -> None:
    """Case 14: an unexpected error inside a connector is not retried for ever as if it were the
    network: the write is cut into records, the one that fails alone is dead-lettered and announced."""
    worker, _, acked, metrics = make(tmp_path, batch={"linger": 0})
    conn = Raising("mem", MemoryOptions(), worker.config)
    conn.bad = 1
    worker.connector = conn
    await fill(worker, stream_records(STREAM, 3))
    task = worker.start()
    assert await worker.flush(5)
    assert not task.done()
    await worker.stop()
    worker.dead_letters.close()
    assert kinds(conn) == [("s/0", "batch", 0), ("s/0", "EventsLost", 1), ("s/0", "batch", 2)]
    assert conn.messages[1].record.control()["reason"] == "sink_refused:mem"
    assert [r.seq for r in acked] == [0, 1, 2]
    (dead,) = (tmp_path / "dead.jsonl").read_text().splitlines()
    assert '"seq":1' in dead and "RecursionError" in dead
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="dead_lettered") == 1
    assert value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="unexpected") >= 1
    assert value(metrics, "kv_bridge_batches_lost_total", source="s", reason="sink_refused") == 1


async def test_an_unexpected_error_goes_again_once_as_the_whole_write_before_it_is_cut_into_records(
    tmp_path: Path,
) -> None:
    """An unclassified error may be the client's passing state: the whole write is tried twice
    (``UNEXPECTED_TRIES``) before the runtime looks for the record that causes it."""
    worker, _, _, _ = make(tmp_path, batch={"linger": 0})
    conn = Raising("mem", MemoryOptions(), worker.config)
    conn.bad = 1
    worker.connector = conn
    await fill(worker, stream_records(STREAM, 3))
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert conn.writes[:3] == [3, 3, 1]  # the write, once more, then record by record


async def test_a_record_of_several_messages_the_connector_fails_on_is_refused_whole_and_alone(tmp_path: Path) -> None:
    """Per event, a record is several messages: the write is cut into records (never into
    messages), and of two records only the one that fails is dead-lettered."""
    worker, _, acked, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    conn = Raising("mem", MemoryOptions(), worker.config)
    conn.bad = 1
    worker.connector = conn
    await fill(worker, stream_records(STREAM, 2))
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert conn.writes[:4] == [6, 6, 3, 3]  # twice whole, then record 0 (3 events), then record 1
    assert [(m.record.kind, m.record.seq) for m in conn.messages] == [("batch", 0)] * 3 + [("EventsLost", 1)]
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="dead_lettered") == 1
    assert [r.seq for r in acked] == [0, 1]


async def test_an_unexpected_error_while_the_connector_is_unhealthy_dead_letters_nothing(tmp_path: Path) -> None:
    """The same error while the connector's health check fails is the connector's state, not the
    record's: retried until it passes, nothing dead-lettered."""
    worker, _, acked, metrics = make(tmp_path, batch={"linger": 0, "max_messages": 1})
    conn = Raising("mem", MemoryOptions(), worker.config)
    conn.down = 6
    worker.connector = conn
    await fill(worker, stream_records(STREAM, 2))
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert kinds(conn) == [("s/0", "batch", 0), ("s/0", "batch", 1)]
    assert [r.seq for r in acked] == [0, 1]
    assert not (tmp_path / "dead.jsonl").exists() or not (tmp_path / "dead.jsonl").read_text().strip()
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="dead_lettered") == 0


async def test_an_unrenderable_record_writes_no_state_change_and_clears_the_state(tmp_path: Path) -> None:
    """Case 14: a record the renderer dead-letters must not have its state change written (building
    the state document from it fails inside the sink's write, for ever)."""
    worker, conn, acked, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    lost_streams: list[Stream] = []
    worker.writes_state, worker.on_state_lost = True, lambda stream, _at: lost_streams.append(stream)
    payload = deep_payload()
    batch = wire.decode_batch(payload)
    hostile = Record(stream=STREAM, epoch=0, seq=1, ts=batch.ts, payload=payload, events=batch.events, state=delta())
    first, last = stream_records(STREAM, 3)[0::2]
    first.state = last.state = delta()
    await fill(worker, [first, hostile, last])
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    states = [m.record.seq for m in conn.messages if m.type == STATE_TYPE]
    assert states == [0]  # none for the dead-lettered record, nor for the next one (computed before the clear)
    assert lost_streams == [STREAM]
    assert [r.seq for r in acked] == [0, 1, 2]
    assert value(metrics, "kv_bridge_batches_lost_total", source="s", reason="unrenderable") == 1


async def test_after_a_lost_state_the_stream_s_changes_are_written_again_from_its_clear_on(tmp_path: Path) -> None:
    """The stream's state changes queued after the loss are not written until the first one that
    clears it (the tracker's new generation): that one and every later one are; another stream's
    are written throughout."""
    worker, conn, _, _ = make(tmp_path, granularity="event", batch={"linger": 0, "max_messages": 1})
    worker.writes_state, worker.on_state_lost = True, lambda _stream, _at: None
    payload = deep_payload()
    batch = wire.decode_batch(payload)
    hostile = Record(stream=STREAM, epoch=0, seq=1, ts=batch.ts, payload=payload, events=batch.events, state=delta())
    before, stale, cleared, after = stream_records(STREAM, 6)[2:]
    other = stream_records(OTHER, 1)[0]
    before.seq, stale.seq, cleared.seq, after.seq = 0, 2, 3, 4
    for r, d in ((before, delta()), (stale, delta()), (other, delta()), (cleared, delta(clear=True)), (after, delta())):
        r.state = d
    await fill(worker, [before, hostile, stale, other, cleared, after])
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    states = [(m.record.stream.key, m.record.seq) for m in conn.messages if m.type == STATE_TYPE]
    assert states == [("s/0", 0), ("t/0", 0), ("s/0", 3), ("s/0", 4)]


async def test_the_state_lost_callback_given_at_construction_is_told(tmp_path: Path) -> None:
    made, conn, _, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    lost_streams: list[Stream] = []
    told = lambda stream, _at: lost_streams.append(stream)  # noqa: E731
    worker = SinkWorker(0, made.config, conn, made.renderer, metrics, made.dead_letters, made.on_ack, on_state_lost=told)
    worker.writes_state = True
    payload = deep_payload()
    batch = wire.decode_batch(payload)
    await fill(worker, [Record(stream=STREAM, epoch=0, seq=0, ts=batch.ts, payload=payload, events=batch.events, state=delta())])
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert lost_streams == [STREAM]


async def test_an_unrenderable_record_without_a_state_change_leaves_the_state_alone(tmp_path: Path) -> None:
    worker, conn, _, _ = make(tmp_path, granularity="event", batch={"linger": 0})
    lost_streams: list[Stream] = []
    worker.writes_state, worker.on_state_lost = True, lambda stream, _at: lost_streams.append(stream)
    payload = deep_payload()
    batch = wire.decode_batch(payload)
    hostile = Record(stream=STREAM, epoch=0, seq=1, ts=batch.ts, payload=payload, events=batch.events)
    first, last = stream_records(STREAM, 3)[0::2]
    first.state = last.state = delta()
    await fill(worker, [first, hostile, last])
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert lost_streams == []
    assert [m.record.seq for m in conn.messages if m.type == STATE_TYPE] == [0, 2]


async def test_a_sink_that_keeps_no_state_writes_no_state_change(tmp_path: Path) -> None:
    """A connector that does not say it writes state (no ``writes_state``) gets only the records'
    own messages, whatever state changes they carry."""
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0})
    assert not hasattr(conn, "writes_state")
    records = stream_records(STREAM, 2)
    for r in records:
        r.state = delta()
    await fill(worker, records)
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [m.type for m in conn.messages if m.type == STATE_TYPE] == []
    assert len(conn.messages) == 2


async def test_a_dropped_span_is_announced_once_there_is_room_while_the_stream_is_quiet(tmp_path: Path) -> None:
    """Case 15: the EventsLost of a ``drop`` sink's span comes once the queue has room again, not
    with the stream's next batch (which may not come for a long time)."""
    worker, conn, _acked, metrics = make(tmp_path, queue={"max_batches": 1}, backpressure="drop", batch={"linger": 0})
    conn.gate = asyncio.Event()
    worker.start()
    first, *dropped = stream_records(STREAM, 4)
    assert worker.offer(first)  # fills the queue, held in the write
    await asyncio.sleep(0.01)
    for r in dropped:
        assert worker.offer(r)  # dropped: no room
    conn.gate.set()  # the sink recovers; the stream says nothing more
    # Not flush(): it announces dropped spans itself. Idle: the queue (and the announcement) written.
    await asyncio.wait_for(worker._idle.wait(), 5)
    await worker.stop()
    worker.dead_letters.close()
    assert kinds(conn) == [("s/0", "batch", 0), ("s/0", "EventsLost", 3)]
    assert conn.messages[1].record.control()["from_seq"] == 1
    assert value(metrics, "kv_bridge_batches_lost_total", source="s", reason="sink_queue_full") == 3


async def test_a_refused_state_change_clears_the_state_and_announces_no_batch(tmp_path: Path) -> None:
    """A state message refused for itself (``state_lost``): its record's events were stored, so no
    EventsLost is announced for the batch; the stream's state is cleared instead."""
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0})
    lost_streams: list[Stream] = []
    worker.writes_state, worker.on_state_lost = True, lambda stream, _at: lost_streams.append(stream)
    records = stream_records(STREAM, 2)
    for r in records:
        r.state = delta()
    # b0, its state change (refused), b1, its state change: the others stored
    conn = answering(worker, [PartialFailure({1: Permanent("bucket created again: state lost", reason="state_lost")})])
    await fill(worker, records)
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [(m.record.kind, m.record.seq) for m in conn.messages if m.type != STATE_TYPE] == [("batch", 0), ("batch", 1)]
    assert [s.key for s in lost_streams] == [STREAM.key]
    assert [r.seq for r in acked] == [0, 1]


def positions_of(messages: Sequence[Message]) -> list[tuple[int, int, int]]:
    """(epoch, seq, sub) of each message, as a consumer orders them."""
    out = []
    for m in messages:
        r = m.record
        if r.kind == "SourceReset":
            out.append((r.epoch, -1, 0))
        elif r.kind == "EventsLost":
            out.append((r.epoch, r.seq, 2**64))
        else:
            out.append((r.epoch, r.seq, -1 if m.index is None else m.index))
    return out


def positions(conn: MemoryConnector) -> list[tuple[int, int, int]]:
    """What a consumer orders by: (epoch, seq, sub), an EventsLost after everything of its seq."""
    return positions_of(conn.messages)


async def test_two_batches_refused_in_one_write_are_announced_by_one_span_in_order(tmp_path: Path) -> None:
    """Found by the invariant breaker (B1): each refusal was announced at the same position, so a
    consumer (or Redis, by entry id) took the second for a copy of the first."""
    worker, _, acked, metrics = make(tmp_path, batch={"linger": 0})
    too_large = Permanent("too large", reason="too_large")
    conn = answering(worker, [PartialFailure({1: too_large, 2: too_large})])
    await fill(worker, stream_records(STREAM, 5))
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    lost = [m.record.control() for m in conn.messages if m.record.kind == "EventsLost"]
    assert lost == [{"type": "EventsLost", "from_seq": 1, "to_seq": 2, "count": 2, "reason": "sink_refused:mem"}]
    assert value(metrics, "kv_bridge_batches_lost_total", source="s", reason="sink_refused") == 2
    seen = positions(conn)
    assert seen == sorted(set(seen)), "positions must strictly increase"
    assert [r.seq for r in acked] == [0, 1, 2, 3, 4]


async def test_an_announcement_follows_the_messages_of_its_stream_that_go_again(tmp_path: Path) -> None:
    """Found by the invariant breaker (B7): at event granularity, a refusal in batch 1 and a
    transient failure of batch 2's last event: the announcement stands at seq 2, so it must be
    written after the event that goes again, not before it."""
    worker, _, _acked, _ = make(tmp_path, granularity="event", batch={"linger": 0})
    records = stream_records(STREAM, 3)
    events = [len(r.events) for r in records]
    first_of_1, last_of_2 = events[0], sum(events) - 1
    conn = answering(worker, [PartialFailure({first_of_1: Permanent("too large"), last_of_2: Retriable("stream full")})])
    await fill(worker, records)
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    seen = positions(conn)
    assert seen == sorted(set(seen)), f"positions must strictly increase: {seen}"
    assert seen[-1] == (0, 2, 2**64)


async def test_a_refusal_is_announced_in_its_epoch_before_the_next_epochs_reset(tmp_path: Path) -> None:
    """Found by the invariant breaker (B9): a write that held epoch 1's refused batch and epoch 2's
    SourceReset announced the refusal after the reset (I3). A new epoch starts a write of its own."""
    worker, _, _acked, _ = make(tmp_path, batch={"linger": 0})
    old = stream_records(STREAM, 3, epoch=1)
    new = [source_reset(STREAM, 2, "publisher_restart", 0.0), *stream_records(STREAM, 2, epoch=2)]
    conn = answering(worker, [PartialFailure({1: Permanent("too large")})])
    await fill(worker, old + new)
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [(m.record.epoch, m.record.kind, m.record.seq) for m in conn.messages] == [
        (1, "batch", 0),
        (1, "batch", 2),
        (1, "EventsLost", 2),  # epoch 1's refusal, before epoch 2 opens
        (2, "SourceReset", 0),
        (2, "batch", 0),
        (2, "batch", 1),
    ]
    assert conn.writes[0] == 3  # the first write stopped at the SourceReset


async def test_state_changes_queued_before_a_lost_state_is_cleared_are_not_written(tmp_path: Path) -> None:
    """Found by the invariant breaker (B6, Kafka): the state topic was deleted while records were
    queued; their state changes, computed on what the topic held, were written once it was back,
    and the last head said complete over a partial state. After a state change is refused, none of
    the stream's changes is written until one that clears the state (the tracker's next)."""
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0, "max_messages": 2})
    lost_streams: list[Stream] = []
    worker.writes_state, worker.on_state_lost = True, lambda stream, _at: lost_streams.append(stream)
    records = stream_records(STREAM, 4) + stream_records(OTHER, 1)
    for r in records:
        r.state = delta(clear=r.seq == 3 and r.stream == STREAM)
    # first write: b0 and its state change (refused: the state topic was lost)
    conn = answering(worker, [PartialFailure({1: Permanent("state topic created again", reason="state_lost")})])
    await fill(worker, records)
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    states = [(m.record.stream.key, m.record.seq) for m in conn.messages if m.type == STATE_TYPE]
    # b1's and b2's changes were computed on the state the sink lost: not written; b3's clears the
    # stream's state: written, and so is every later one; other streams go on as they were
    assert states == [("s/0", 3), ("t/0", 0)]
    assert [r.seq for r in acked] == [0, 1, 2, 3, 0]


async def test_a_loss_the_audit_finds_on_a_quiet_sink_is_announced_without_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 B2: with no record to write, the worker asks the connector's ``audit()`` between
    health checks; the loss it finds is announced at once (the states it names cleared), once,
    and an audit that fails otherwise changes nothing."""
    import bridge.sink

    monkeypatch.setattr(bridge.sink, "AUDIT_INTERVAL", 0.01)
    worker, conn, acked, metrics = make(tmp_path, batch={"linger": 0})
    worker.health_interval = 0.01
    cleared: list[Stream] = []
    worker.writes_state, worker.on_state_lost = True, lambda stream, _at: cleared.append(stream)
    answers: list[BaseException | None] = [RuntimeError("cannot read"), SinkLost("lost", [(STREAM, 0, 0, 1)], states=[OTHER])]
    audits = 0

    async def audit() -> None:
        nonlocal audits
        audits += 1
        if answers:
            answer = answers.pop(0)
            if answer is not None:
                raise answer

    worker._audit = audit
    await fill(worker, stream_records(STREAM, 2))
    worker.start()
    assert await worker.flush(5)
    for _ in range(500):
        if audits >= 4:
            break
        await asyncio.sleep(0.01)
    await worker.stop()
    worker.dead_letters.close()
    assert audits >= 4
    assert kinds(conn) == [("s/0", "batch", 0), ("s/0", "batch", 1), ("s/0", "EventsLost", 1)]
    assert conn.messages[2].record.control()["reason"] == "sink_lost:mem"
    assert {s.key for s in cleared} == {STREAM.key, OTHER.key}
    assert [r.seq for r in acked] == [0, 1]
    assert value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="sink_lost") == 1
    assert value(metrics, "kv_bridge_batches_lost_total", source="s", reason="sink_lost") == 2
    assert worker.connected


async def test_a_lost_announcement_is_announced_again_where_it_stood(tmp_path: Path) -> None:
    """A SinkLost's ``at``: the connector still holds later batches than the span's end (a lost
    refusal announcement of seq 1 that stood after batch 3): the announcement stands at seq 3
    again, its to_seq 1, so the sink takes it after what it holds."""
    worker, conn, _acked, _metrics = make(tmp_path, batch={"linger": 0})
    await fill(worker, stream_records(STREAM, 4))
    worker.start()
    assert await worker.flush(5)
    conn.failures = [SinkLost("lost", [(STREAM, 0, 1, 1)], at={(STREAM.key, 0, 1, 1): 3}), None]
    await fill(worker, stream_records(STREAM, 1, start=4))
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    lost = conn.messages[4].record
    assert (lost.kind, lost.seq, lost.from_seq, lost.to_seq) == ("EventsLost", 3, 1, 1)
    assert kinds(conn)[5:] == [("s/0", "batch", 4)]


async def test_a_loss_found_while_the_start_announcements_are_written_is_told_once_and_whole(tmp_path: Path) -> None:
    """What the runtime found a sink lost while no bridge ran is announced at start; the connector's
    own check may find the same loss during that write. breaker44 B2: said twice, the part past the
    start span was announced (and counted) twice. breaker44 B1: a loss found at a retry, after one
    stream's start announcement was stored (and went with that loss), was trimmed against it and
    never announced."""
    a, b = Stream("a", 0), Stream("b", 0)
    worker, conn, _, metrics = make(tmp_path, batch={"linger": 0})
    worker.lost_at_start = [(a, 3, 0, 10)]
    conn.failures = [SinkLost("lost", [(a, 3, 0, 20)]), SinkLost("lost", [(a, 3, 0, 20)]), None]
    worker.start()
    await asyncio.sleep(0.3)  # (the announcements at start are written before any record: not queued)
    assert await worker.flush(5)
    await worker.stop()
    told = [(m.record.stream.key, m.record.from_seq, m.record.seq) for m in conn.messages if m.record.kind == "EventsLost"]
    assert told == [("a/0", 0, 10), ("a/0", 11, 20)]
    assert value(metrics, "kv_bridge_batches_lost_total", source="a", reason="sink_lost") == 21

    class Recreated(MemoryConnector):
        """Stores all but stream b at the first write (b's fail transiently), then finds the topic
        deleted and created again: what it stored is gone, each stream from 0."""

        steps = ["partial", "recreated"]

        async def write(self, messages: Sequence[Message]) -> None:
            step = self.steps.pop(0) if self.steps else "ok"
            if step == "partial":
                self.messages.extend(m for m in messages if m.record.stream != b)
                raise PartialFailure({i: Retriable("leader moved") for i, m in enumerate(messages) if m.record.stream == b})
            if step == "recreated":
                spans = {(m.record.stream, m.record.epoch, 0, m.record.seq) for m in self.messages}
                self.messages.clear()
                raise SinkLost("topic created again", sorted(spans, key=lambda s: s[0].key))
            self.messages.extend(messages)

    worker, _, _, _ = make(tmp_path / "again", batch={"linger": 0})
    worker.connector = conn = Recreated("mem", MemoryOptions(), worker.config)
    worker.lost_at_start = [(a, 3, 0, 10), (b, 3, 0, 10)]
    worker.start()
    await asyncio.sleep(0.3)
    assert await worker.flush(5)
    await worker.stop()
    told = sorted((m.record.stream.key, m.record.from_seq, m.record.seq) for m in conn.messages if m.record.kind == "EventsLost")
    assert told == [("a/0", 0, 10), ("b/0", 0, 10)]  # a's again, after its first went with the topic


async def test_a_connector_wrapped_for_checkpoint_from_sinks_is_audited_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``checkpoint.from_sinks`` the runtime wraps every connector (SkipHeld), and the worker
    asks the connector it is given for ``audit()``: the wrapper had none, so a loss on a quiet
    stream was announced only at the stream's next write (I6). The wrapper passes it on."""
    import bridge.sink
    from bridge.runtime import SkipHeld

    monkeypatch.setattr(bridge.sink, "AUDIT_INTERVAL", 0.01)
    _plain, conn, _acked, metrics = make(tmp_path, batch={"linger": 0})
    answers: list[BaseException] = [SinkLost("lost", [(STREAM, 0, 0, 1)])]

    async def audit() -> None:
        if answers:
            raise answers.pop(0)

    conn.audit = audit  # type: ignore[attr-defined]
    worker = SinkWorker(0, _plain.config, SkipHeld(conn), _plain.renderer, metrics, _plain.dead_letters, lambda _i, _r: None)
    worker.health_interval = 0.01
    await fill(worker, stream_records(STREAM, 2))
    worker.start()
    assert await worker.flush(5)
    for _ in range(500):
        if len(conn.messages) > 2:
            break
        await asyncio.sleep(0.01)
    await worker.stop()
    worker.dead_letters.close()
    assert kinds(conn) == [("s/0", "batch", 0), ("s/0", "batch", 1), ("s/0", "EventsLost", 1)]


class RefusesBatches(MemoryConnector):
    """Refuses for itself every batch above ``limit`` events (a broker's size limit), storing
    whatever else it is given (the announcements)."""

    limit = 0

    async def write(self, messages: Sequence[Message]) -> None:
        refused = {i: Permanent("message too large", reason="too_large") for i, m in enumerate(messages)
                   if m.record.kind == "batch" and len(m.record.events) > self.limit}  # fmt: skip
        self.messages.extend(m for i, m in enumerate(messages) if i not in refused)
        if refused:
            raise PartialFailure(refused)


async def test_a_sink_refusing_every_batch_is_not_ready_until_one_is_stored(tmp_path: Path) -> None:
    """breaker89 B4: a NATS server whose max_payload is below every batch's size and above an
    announcement's refused all 40 batches (dead-lettered, each announced) while /readyz said 200
    (7 of 7). REFUSED_AFTER batches refused in a row, none stored between, make the sink not ready,
    naming the refusal; one stored batch makes it ready again. Fewer in a row do not."""
    worker, _, _acked, _ = make(tmp_path, batch={"linger": 0, "max_messages": 1})
    conn = RefusesBatches("mem", MemoryOptions(), worker.config)
    worker.connector = conn
    records = stream_records(STREAM, 2 * REFUSED_AFTER + 2)
    conn.limit = min(len(r.events) for r in records) - 1  # every batch refused
    worker.start()
    try:
        await fill(worker, records[: REFUSED_AFTER - 1])
        assert await worker.flush(5)
        assert worker.problem is None  # a few refused in a row: the sink may be meeting a few large ones
        await fill(worker, records[REFUSED_AFTER - 1 : REFUSED_AFTER])
        assert await worker.flush(5)
        problem = worker.problem
        assert problem is not None and f"the last {REFUSED_AFTER} were refused" in problem and "too_large" in problem
        conn.limit = 10**6  # the operator raises the limit
        await fill(worker, records[REFUSED_AFTER : REFUSED_AFTER + 1])
        assert await worker.flush(5)
        assert worker.problem is None
    finally:
        await worker.stop()
        worker.dead_letters.close()
    assert sum(1 for m in conn.messages if m.record.kind == "EventsLost") >= 1


class RefusesFirstEvents(MemoryConnector):
    """Event granularity: refuses for itself the first event of every batch, stores the others."""

    async def write(self, messages: Sequence[Message]) -> None:
        refused = {i: Permanent("message too large", reason="too_large") for i, m in enumerate(messages) if m.index == 0}
        self.messages.extend(m for i, m in enumerate(messages) if i not in refused)
        if refused:
            raise PartialFailure(refused)


async def test_batches_stored_in_part_or_not_rendered_are_not_a_sink_refusing_every_batch(tmp_path: Path) -> None:
    """breaker90 B1, B3: at event granularity, a sink that stored 3 of every batch's 4 events was
    reported "refusing every batch" (a batch with one refused event counted as refused whole), 3 of
    3; and batches the bridge could not render counted as refused by the sink, with no reason or a
    stale one. Only a batch the sink refused every message of counts; an unrendered one does not."""
    worker, _, _acked, _ = make(tmp_path, granularity="event", batch={"linger": 0, "max_messages": 1})
    worker.connector = RefusesFirstEvents("mem", MemoryOptions(), worker.config)
    payload = deep_payload()
    batch = wire.decode_batch(payload)
    unrenderable = [
        Record(stream=STREAM, epoch=0, seq=s, ts=batch.ts, payload=payload, events=batch.events) for s in range(100, 106)
    ]
    worker.start()
    try:
        await fill(worker, [r for r in stream_records(STREAM, 2 * REFUSED_AFTER, start=6) if len(r.events) > 1])
        assert await worker.flush(5)
        assert worker.problem is None
        worker.connector = RefusesBatches("mem", MemoryOptions(), worker.config)  # every message refused
        await fill(worker, unrenderable[: REFUSED_AFTER + 1])
        assert await worker.flush(5)
        assert worker.problem is None
    finally:
        await worker.stop()
        worker.dead_letters.close()


class StopsAtRefusals(MemoryConnector):
    """A sink that keeps the connector contract on refusals and stores like Redis does by entry id:
    a batch in ``refuse`` is refused for itself, and its stream's later records in the write are
    not written (``not_sent``); a message at a position the sink holds is a copy (taken, not stored
    again), one below the stream's top that it does not hold is refused (``out_of_order``)."""

    refuse: frozenset[int] = frozenset()

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.held: set[tuple[int, int, int]] = set()

    async def write(self, messages: Sequence[Message]) -> None:
        self.writes.append(len(messages))
        errors: dict[int, ConnectorError] = {}
        stops = Stops("mem")
        for i, m in enumerate(messages):
            if (held := stops.past(m)) is not None:
                errors[i] = held
                continue
            if m.record.kind == "batch" and m.record.seq in self.refuse:
                errors[i] = Permanent("too large", reason="too_large")
                stops.refused(m)
                continue
            (at,) = positions_of([m])
            if at in self.held:
                continue  # a copy
            if self.held and at < max(self.held):
                errors[i] = Permanent("below the top, absent", reason="out_of_order")
                continue
            self.held.add(at)
            self.messages.append(m)
        if errors:
            raise PartialFailure(errors)


def stopping(worker: SinkWorker, refuse: set[int], held: StopsAtRefusals | None = None) -> StopsAtRefusals:
    conn = StopsAtRefusals("mem", MemoryOptions(), worker.config)
    conn.refuse = frozenset(refuse)
    if held is not None:  # the same sink, as a restarted bridge finds it
        conn.held, conn.messages = held.held, held.messages
    worker.connector = conn
    return conn


async def test_a_refusal_next_to_an_engine_gap_is_announced_at_a_place_of_its_own(tmp_path: Path) -> None:
    """breaker98 B1/B2: batch 1 refused in the write that also held the engine's gap announcement
    for seq 2: the refusal's announcement stood at the write's top, the gap's place, and Redis took
    it for a copy (9 of 9), Kafka and NATS consumers skipped it (10 of 10). With the connector
    stopping at the refused batch, it stands right after it."""
    worker, _, acked, metrics = make(tmp_path, batch={"linger": 0}, retry={"initial_backoff": 5, "max_backoff": 5})
    conn = stopping(worker, {1})
    records = [*stream_records(STREAM, 2), events_lost(STREAM, 0, 2, 2, "no_replay", 0.0), *stream_records(STREAM, 2, start=3)]
    await fill(worker, records)
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [(m.record.kind, m.record.seq, m.record.reason) for m in conn.messages] == [
        ("batch", 0, None),
        ("EventsLost", 1, "sink_refused:mem"),
        ("EventsLost", 2, "no_replay"),
        ("batch", 3, None),
        ("batch", 4, None),
    ]
    seen = positions_of(conn.messages)
    assert seen == sorted(set(seen))
    assert [r.seq for r in acked] == [0, 1, 2, 3, 4]
    # What waited behind the refusal is no failure of the sink's: written at once, nothing counted.
    assert conn.writes == [2, 1, 3]  # (the gap's announcement starts a write of its own)
    assert not value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="not_sent")


@pytest.mark.parametrize("cut", [1, 3, 10])
async def test_a_refusal_met_again_after_a_restart_is_announced_at_the_same_place(tmp_path: Path, cut: int) -> None:
    """breaker98 B3/B4: after a SIGKILL the replay cut the writes otherwise, and the refusal was
    announced again at another place: a second EventsLost over an exact view (Kafka, NATS, Redis:
    18 of 18), or, below the Redis key's top and absent there, refused and retried for ever (6 of 6).
    Its place is its batch's now, however the writes are cut, so the second is a copy."""
    first, _, _, _ = make(tmp_path / "a", batch={"linger": 0, "max_messages": 2})
    sink = stopping(first, {1})
    records = stream_records(STREAM, 6)
    await fill(first, records)
    first.start()
    assert await first.flush(5)
    await first.stop()
    first.dead_letters.close()
    again, _, acked, _ = make(tmp_path / "b", batch={"linger": 0, "max_messages": cut})
    stopping(again, {1}, held=sink)
    await fill(again, stream_records(STREAM, 6))  # the replay: the same batches again
    again.start()
    assert await again.flush(5), "the refusal's second announcement is stuck"
    await again.stop()
    again.dead_letters.close()
    lost = [(m.record.seq, m.record.from_seq, m.record.to_seq) for m in sink.messages if m.record.kind == "EventsLost"]
    assert lost == [(1, 1, 1)]
    assert [r.seq for r in acked] == list(range(6))


async def test_an_announcement_after_a_batch_of_its_stream_starts_a_write_of_its_own(tmp_path: Path) -> None:
    """breaker99 B2: a connector that writes on past a refused batch (Kafka with a topic per type:
    the refused batch's topic answers after the others stored) gets the refusal's announcement at
    its write's top; when that top was the engine's gap announcement, both stood at one place and
    consumers skipped the refusal (3 of 3). Such an announcement now starts a write of its own."""
    worker, _, _, _ = make(tmp_path, batch={"linger": 0})
    conn = answering(worker, [PartialFailure({1: Permanent("too large", reason="too_large")})])
    await fill(worker, [*stream_records(STREAM, 2), events_lost(STREAM, 0, 2, 2, "no_replay", 0.0)])
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    seen = positions(conn)
    assert seen == sorted(set(seen)), f"two records at one place: {seen}"
    assert [(m.record.seq, m.record.reason) for m in conn.messages if m.record.kind == "EventsLost"] == [
        (1, "sink_refused:mem"),
        (2, "no_replay"),
    ]
