"""The shared delivery mechanism (bridge.sink.SinkWorker) with an in-memory connector."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from bridge import config, wire
from bridge.config import SinkConfig
from bridge.deadletter import DeadLetters
from bridge.errors import NotConnected, PartialFailure, Permanent, Retriable
from bridge.formats import Renderer
from bridge.metrics import Metrics
from bridge.records import Record, Stream
from bridge.sink import SinkWorker
from tests.support.memory import MemoryConnector, MemoryOptions
from tests.support.records import stream_records
from tests.unit.test_hostile_input import deep_payload

STREAM = Stream("s", 0)


def make(tmp: Path, **sink: object) -> tuple[SinkWorker, MemoryConnector, list[Record], Metrics]:
    cfg = config.convert(
        {
            "type": "memory",
            "name": "mem",
            "granularity": "batch",
            "retry": {"initial_backoff": 0.001, "max_backoff": 0.01},
            **sink,
        },
        SinkConfig,
        "sink",
        [],
    )
    assert cfg is not None
    conn = MemoryConnector("mem", MemoryOptions(), cfg)
    acked: list[Record] = []
    metrics = Metrics()
    worker = SinkWorker(
        0, cfg, conn, Renderer(cfg.format, cfg.granularity), metrics, DeadLetters(str(tmp / "dead.jsonl")),
        lambda _i, records: acked.extend(records),
    )  # fmt: skip
    return worker, conn, acked, metrics


async def fill(worker: SinkWorker, records: list[Record]) -> None:
    for r in records:
        while not worker.offer(r):
            await worker.wait_room()


async def test_delivers_in_order_in_bounded_writes(tmp_path: Path) -> None:
    worker, conn, acked, metrics = make(tmp_path, batch={"max_messages": 7, "linger": 0})
    worker.start()
    records = stream_records(STREAM, 50)
    await fill(worker, records)
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [m.record.seq for m in conn.messages] == list(range(50))
    assert max(conn.writes) <= 7
    assert [r.seq for r in acked] == list(range(50))
    assert metrics.registry.get_sample_value("kv_bridge_sink_events_total", {"sink": "mem"}) == 150


async def test_transient_failures_are_retried_not_dropped(tmp_path: Path) -> None:
    worker, conn, _acked, metrics = make(tmp_path, batch={"linger": 0})
    conn.failures = [NotConnected("down"), Retriable("busy"), None]
    worker.start()
    await fill(worker, stream_records(STREAM, 5))
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [m.record.seq for m in conn.messages] == list(range(5))
    assert metrics.registry.get_sample_value("kv_bridge_sink_retries_total", {"sink": "mem"}) == 2
    assert metrics.registry.get_sample_value("kv_bridge_sink_errors_total", {"sink": "mem", "reason": "not_connected"}) == 1


async def test_partial_failure_retries_only_the_failed(tmp_path: Path) -> None:
    worker, _conn, _acked, _ = make(tmp_path, batch={"linger": 0})
    records = stream_records(STREAM, 4)
    await fill(worker, records)

    class Once(MemoryConnector):
        calls = 0

        async def write(self, messages):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.calls == 1:
                self.messages.extend(messages[:2])
                raise PartialFailure([2, 3], Retriable("leader moved"))
            self.messages.extend(messages)

    once = Once("mem", MemoryOptions(), worker.config)
    worker.connector = once
    worker.start()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [m.record.seq for m in once.messages] == [0, 1, 2, 3]


async def test_permanent_failure_goes_to_dead_letters(tmp_path: Path) -> None:
    worker, conn, acked, metrics = make(tmp_path, batch={"linger": 0, "max_messages": 1})
    conn.failures = [Permanent("message too large"), None]
    worker.start()
    await fill(worker, stream_records(STREAM, 2))
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    # I6: the refused batch is announced to this sink's consumers, in its place, before the next one
    lost, batch = conn.messages
    assert (lost.record.kind, lost.record.control()) == (
        "EventsLost",
        {"type": "EventsLost", "from_seq": 0, "to_seq": 0, "count": 1, "reason": "sink_refused:mem"},
    )
    assert (batch.record.kind, batch.record.seq) == ("batch", 1)
    assert [r.seq for r in acked] == [0, 1]  # settled: the stream goes on
    dead = (tmp_path / "dead.jsonl").read_text().splitlines()
    assert len(dead) == 1 and '"reason":"sink_rejected"' in dead[0] and '"seq":0' in dead[0]
    assert metrics.registry.get_sample_value("kv_bridge_dead_letters_total", {"reason": "sink_rejected"}) == 1


async def test_block_policy_bounds_the_queue(tmp_path: Path) -> None:
    worker, conn, _acked, _ = make(tmp_path, queue={"max_batches": 3}, batch={"linger": 0})
    conn.gate = asyncio.Event()
    worker.start()
    records = stream_records(STREAM, 10)
    for r in records[:3]:
        assert worker.offer(r)
    assert not worker.offer(records[3])  # full: the caller (ingest) must wait
    filler = asyncio.create_task(fill(worker, records[3:]))
    await asyncio.sleep(0.05)
    assert not filler.done() and worker.queued[0] == 3
    conn.gate.set()
    await asyncio.wait_for(filler, 5)
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [m.record.seq for m in conn.messages] == list(range(10))


async def test_drop_policy_announces_each_dropped_span_once(tmp_path: Path) -> None:
    worker, conn, acked, metrics = make(tmp_path, queue={"max_batches": 3}, backpressure="drop", batch={"linger": 0})
    conn.gate = asyncio.Event()
    worker.start()
    records = stream_records(STREAM, 8)
    for r in records:
        assert worker.offer(r)  # never blocks
    conn.gate.set()
    await asyncio.sleep(0.05)
    later = stream_records(STREAM, 2, start=8)
    for r in later:
        assert worker.offer(r)
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    kinds = [(m.record.kind, m.record.from_seq, m.record.seq) for m in conn.messages]
    assert kinds == [
        ("batch", None, 0),
        ("batch", None, 1),
        ("batch", None, 2),
        ("EventsLost", 3, 7),
        ("batch", None, 8),
        ("batch", None, 9),
    ]
    assert conn.messages[3].record.reason == "sink_queue_full:mem"
    assert metrics.registry.get_sample_value("kv_bridge_sink_batches_total", {"sink": "mem", "outcome": "dropped"}) == 5
    assert metrics.registry.get_sample_value("kv_bridge_batches_lost_total", {"source": "s", "reason": "sink_queue_full"}) == 5
    # The checkpoint only moves through the announcement, in order.
    assert [r.seq for r in acked] == [0, 1, 2, 7, 8, 9]


async def test_flush_times_out_when_the_sink_stays_down(tmp_path: Path) -> None:
    worker, conn, acked, _ = make(tmp_path, batch={"linger": 0})
    conn.failures = [NotConnected("down")] * 1000
    worker.start()
    await fill(worker, stream_records(STREAM, 3))
    assert not await worker.flush(0.2)
    await worker.stop()
    worker.dead_letters.close()
    assert acked == []
    assert not worker.connected and worker.last_error is not None and "down" in worker.last_error


async def test_unrenderable_record_is_dead_lettered_and_the_stream_goes_on(tmp_path: Path) -> None:
    """I5: a value nested past the renderer's recursion depth must not kill the sink task."""
    worker, conn, acked, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    task = worker.start()
    payload = deep_payload()
    batch = wire.decode_batch(payload)
    hostile = Record(stream=STREAM, epoch=0, seq=1, ts=batch.ts, payload=payload, events=batch.events)
    first, last = stream_records(STREAM, 3)[0::2]
    await fill(worker, [first, hostile, last])
    assert await worker.flush(2)
    assert not task.done()
    await worker.stop()
    worker.dead_letters.close()
    delivered = [(m.record.kind, m.record.seq) for m in conn.messages]
    assert delivered == [("batch", 0)] * 3 + [("EventsLost", 1)] + [("batch", 2)] * 3
    lost = conn.messages[3].record
    assert (lost.from_seq, lost.reason) == (1, "unrenderable")
    assert [r.seq for r in acked] == [0, 1, 2]  # settled: a restart does not replay it again
    (dead,) = (tmp_path / "dead.jsonl").read_text().splitlines()
    assert '"reason":"unrenderable"' in dead and '"seq":1' in dead
    assert metrics.registry.get_sample_value("kv_bridge_dead_letters_total", {"reason": "unrenderable"}) == 1


async def test_dropped_span_from_seq_0_counts_every_batch(tmp_path: Path) -> None:
    worker, conn, _acked, metrics = make(tmp_path, queue={"max_batches": 1}, backpressure="drop", batch={"linger": 0})
    conn.gate = asyncio.Event()
    worker.start()
    assert worker.offer(stream_records(Stream("other", 0), 1)[0])  # fills the queue, held in the write
    await asyncio.sleep(0.01)
    for r in stream_records(STREAM, 3):
        assert worker.offer(r)  # dropped: seqs 0..2
    conn.gate.set()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert [(m.record.kind, m.record.from_seq, m.record.seq) for m in conn.messages if m.record.stream == STREAM] == [
        ("EventsLost", 0, 2)
    ]
    assert metrics.registry.get_sample_value("kv_bridge_batches_lost_total", {"source": "s", "reason": "sink_queue_full"}) == 3


@pytest.mark.parametrize(
    ("held", "announced", "lost"),
    [
        (None, [(0, 8)], 9),  # holds nothing of the stream: the whole span
        (5, [(6, 8)], 3),  # held through 5 by the last run: announced from 6
        (10, [], 0),  # held whole: nothing announced, acknowledged all the same
    ],
)
@pytest.mark.parametrize("reader", ["positions", "positions_before_run"])  # (a sink that keeps copies: the latter)
async def test_a_dropped_span_is_announced_only_past_what_the_sink_holds(
    tmp_path: Path, held: int | None, announced: list[tuple[int, int]], lost: int, reader: str
) -> None:
    """breaker100 B1: after a restart the replay sends again batches the sink stored in the last
    run, and a drop sink's full queue drops some: they were announced lost though the sink held
    them (I3: delivered and announced), 6 of 6. The span is announced from the first batch the
    sink does not hold (its positions()); once past, the epoch's later spans are not asked about."""
    from bridge.checkpoint import SinkPosition

    worker, conn, acked, metrics = make(tmp_path, queue={"max_batches": 1}, backpressure="drop", batch={"linger": 0})
    asked: list[list[str]] = []

    async def positions(streams: list[Stream]) -> dict[str, SinkPosition | None]:
        asked.append([s.key for s in streams])
        return {s.key: None if held is None else SinkPosition(1, held) for s in streams}

    setattr(conn, reader, positions)
    conn.gate = asyncio.Event()
    worker.start()
    assert worker.offer(stream_records(Stream("other", 0), 1)[0])  # fills the queue, held in the write
    await asyncio.sleep(0.01)
    for r in stream_records(STREAM, 9, epoch=1):
        assert worker.offer(r)  # dropped: seqs 0..8
    conn.gate.set()
    assert await worker.flush(5)
    conn.gate = asyncio.Event()  # a second span, later in the epoch: past what the sink held
    assert worker.offer(stream_records(Stream("other", 0), 1, start=1)[0])
    await asyncio.sleep(0.01)
    for r in stream_records(STREAM, 2, start=20, epoch=1):
        assert worker.offer(r)
    conn.gate.set()
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    spans = [(m.record.from_seq, m.record.seq) for m in conn.messages if m.record.stream == STREAM]
    assert spans == [*announced, (20, 21)]
    assert len(asked) == (2 if held == 10 else 1)  # (held whole: the second span is asked about too)
    value = metrics.registry.get_sample_value("kv_bridge_batches_lost_total", {"source": "s", "reason": "sink_queue_full"})
    assert value == lost + 2
    assert [r.seq for r in acked if r.stream == STREAM] == [8, 21]  # each span acknowledged, announced or not


# -- the dead-letter destination ---------------------------------------------------------------


needs_dev_full = pytest.mark.skipif(
    not Path("/dev/full").exists(), reason="no /dev/full (a device whose writes fail with ENOSPC)"
)


def _letter(letters: DeadLetters, seq: int) -> None:
    letters.write(reason="bad_msgpack", source="s", dp_rank=0, seq=seq, detail="x", payload=b"\x01")


@needs_dev_full
def test_dead_letters_on_a_full_disk_are_counted_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    letters = DeadLetters("/dev/full")
    _letter(letters, 1)
    _letter(letters, 2)
    letters.close()
    assert letters.write_failures == 2
    assert [r.getMessage() for r in caplog.records] == ["dead letter not written"] * 2
    assert caplog.records[0].seq == 1 and "No space left" in caplog.records[0].error


# (A read-only directory is no obstacle to root, which CI runs as: the two cases above cover EACCES-like failures.)
@pytest.mark.parametrize("obstacle", ["file_as_directory", "directory_as_file"])
def test_dead_letters_recover_once_the_path_is_writable(tmp_path: Path, caplog: pytest.LogCaptureFixture, obstacle: str) -> None:
    path = tmp_path / "dl" / "dead.jsonl"
    if obstacle == "file_as_directory":
        (tmp_path / "dl").write_text("")  # the directory cannot be created
    else:
        path.mkdir(parents=True)
    letters = DeadLetters(str(path))
    _letter(letters, 1)
    assert letters.write_failures == 1
    if obstacle == "file_as_directory":
        (tmp_path / "dl").unlink()
    else:
        path.rmdir()
    _letter(letters, 2)
    letters.close()
    assert letters.write_failures == 1
    (line,) = path.read_text().splitlines()
    assert '"seq":2' in line
    assert "dead letters written again" in [r.getMessage() for r in caplog.records]


def test_dead_letters_follow_a_removed_file(tmp_path: Path) -> None:
    path = tmp_path / "dl" / "dead.jsonl"
    letters = DeadLetters(str(path))
    _letter(letters, 1)
    shutil.rmtree(path.parent)  # removed (or rotated away) while open: writing on would lose letters
    _letter(letters, 2)
    letters.close()
    assert letters.write_failures == 0
    (line,) = path.read_text().splitlines()
    assert '"seq":2' in line


def test_dead_letter_directory_problem_is_reported_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "dl").write_text("")
    DeadLetters(str(tmp_path / "dl" / "dead.jsonl")).close()
    assert [r.getMessage() for r in caplog.records] == ["dead-letter directory cannot be created"]


@needs_dev_full
async def test_sink_goes_on_when_dead_letters_cannot_be_written(tmp_path: Path) -> None:
    worker, conn, acked, _ = make(tmp_path, batch={"linger": 0, "max_messages": 1})
    worker.dead_letters = letters = DeadLetters("/dev/full")
    conn.failures = [Permanent("message too large"), None]
    task = worker.start()
    await fill(worker, stream_records(STREAM, 2))
    assert await worker.flush(2)
    assert not task.done()
    await worker.stop()
    letters.close()
    assert [(m.record.kind, m.record.seq) for m in conn.messages] == [("EventsLost", 0), ("batch", 1)]
    assert [r.seq for r in acked] == [0, 1]
    assert letters.write_failures == 1


def record_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses the sink worker takes (each returns at once)."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args: object) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr("bridge.sink.asyncio.sleep", sleep)
    return slept


async def test_a_transient_failure_with_retry_after_waits_that_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sink that says when to retry (a broker's throttle time) is retried after that, not after
    the backoff."""
    worker, conn, _acked, _ = make(tmp_path, batch={"linger": 0}, retry={"initial_backoff": 0.001, "max_backoff": 0.01})
    conn.failures = [Retriable("throttled", retry_after=0.37), None]
    slept = record_sleeps(monkeypatch)
    worker.start()
    await fill(worker, stream_records(STREAM, 1))
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert 0.37 in slept
    assert [m.record.seq for m in conn.messages] == [0]


@pytest.mark.parametrize("failure", [Retriable("throttled", retry_after=0.0), NotConnected("refused at once")])
async def test_a_sink_that_fails_at_once_does_not_spin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """No pause between attempts is shorter than the floor, whatever a connector's retry_after or
    retry.initial_backoff (0 is accepted) says: a failing sink must not spin the event loop."""
    from bridge.sink import RETRY_FLOOR

    # max_backoff must be above 0 (config refuses 0); initial_backoff 0 and retry_after 0 still ask for no pause.
    retry = {"initial_backoff": 0, "max_backoff": "1ms", "jitter": 0}
    worker, conn, _acked, _ = make(tmp_path, batch={"linger": 0}, retry=retry)
    conn.failures = [failure, failure, None]
    slept = record_sleeps(monkeypatch)
    worker.start()
    await fill(worker, stream_records(STREAM, 1))
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()
    assert len(slept) == 2 and min(slept) >= RETRY_FLOOR > 0
    assert [m.record.seq for m in conn.messages] == [0]
