"""The shared delivery mechanism (bridge.sink.SinkWorker) with an in-memory connector."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bridge import config
from bridge.config import SinkConfig
from bridge.deadletter import DeadLetters
from bridge.errors import NotConnected, PartialFailure, Permanent, Retriable
from bridge.formats import Renderer
from bridge.metrics import Metrics
from bridge.records import Record, Stream
from bridge.sink import SinkWorker
from tests.support.memory import MemoryConnector, MemoryOptions
from tests.support.records import stream_records

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
    assert [m.record.seq for m in conn.messages] == [1]
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
    assert metrics.registry.get_sample_value("kv_bridge_batches_lost_total", {"source": "s"}) == 5
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
