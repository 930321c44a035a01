"""The shared delivery mechanism (bridge.sink.SinkWorker), part two: connecting, queue and write
bounds, linger, the backoff schedule, partial failures at their edges, control records under the
drop policy, and stopping. Found missing by mutation testing (tools/mutants.py)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bridge.errors import NotConnected, PartialFailure, Permanent, Retriable, SinkLost
from bridge.fanout import Fanout
from bridge.formats import STATE_TYPE, Message
from bridge.metrics import Metrics
from bridge.records import Record, Stream, events_lost, source_reset
from bridge.sink import SinkWorker
from tests.support.memory import MemoryConnector, MemoryOptions
from tests.support.records import stream_records
from tests.unit.test_sink import STREAM, fill, make, record_sleeps
from tests.unit.test_sink_i6 import Delta, Raising

STREAM_RECORDS: list[Record] = stream_records(STREAM, 10)
STREAM_RECORDS_OTHER: list[Record] = stream_records(Stream("other", 0), 1)
NO_JITTER = {"initial_backoff": 0.001, "max_backoff": 0.004, "multiplier": 2.0, "jitter": 0.0}


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def until(condition: object, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def done(worker: SinkWorker) -> None:
    await worker.stop()
    worker.dead_letters.close()


def seqs(conn: MemoryConnector, stream: Stream = STREAM) -> list[tuple[str, int | None, int]]:
    return [(m.record.kind, m.record.from_seq, m.record.seq) for m in conn.messages if m.record.stream == stream]


# -- connecting ----------------------------------------------------------------------------------


class RefusesFirst(MemoryConnector):
    refusals = 0

    async def connect(self) -> None:
        if self.refusals:
            self.refusals -= 1
            raise NotConnected("connection refused")
        await super().connect()


class NeverConnects(MemoryConnector):
    async def connect(self) -> None:
        await asyncio.Event().wait()


async def test_connecting_is_retried_with_exponential_backoff_until_the_server_is_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, _, _, metrics = make(tmp_path, batch={"linger": 0}, retry=NO_JITTER)
    conn = worker.connector = RefusesFirst("mem", MemoryOptions(), worker.config)
    conn.refusals = 4
    slept = record_sleeps(monkeypatch)
    worker.start()
    await fill(worker, STREAM_RECORDS[:3])
    assert await worker.flush(5)
    assert conn.connected
    assert slept == [0.001, 0.002, 0.004, 0.004]  # doubling from initial_backoff, capped at max_backoff
    assert [m.record.seq for m in conn.messages] == [0, 1, 2]
    assert value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="not_connected") == 4
    assert worker.connected and worker.last_error is None
    assert value(metrics, "kv_bridge_sink_up", sink="mem") == 1
    await done(worker)


async def test_a_sink_not_connected_yet_is_not_ready_and_an_empty_one_flushes_at_once(tmp_path: Path) -> None:
    worker, _, _, metrics = make(tmp_path, batch={"linger": 0})
    worker.connector = NeverConnects("mem", MemoryOptions(), worker.config)
    task = worker.start()
    await asyncio.sleep(0.02)
    assert not worker.connected and worker.last_error is not None
    assert value(metrics, "kv_bridge_sink_up", sink="mem") == 0
    assert await worker.flush(0.2)  # nothing queued: shutdown does not wait for the server
    await done(worker)
    assert task.cancelled()


async def test_write_retries_back_off_exponentially_and_the_sink_is_ready_again_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, conn, acked, _ = make(tmp_path, batch={"linger": 0}, retry=NO_JITTER)
    conn.failures = [NotConnected("down")] * 4 + [None]
    slept = record_sleeps(monkeypatch)
    worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    assert await worker.flush(5)
    assert slept == [0.001, 0.002, 0.004, 0.004]
    assert worker.connected and worker.last_error is None
    assert [r.seq for r in acked] == [0]
    await done(worker)


class _Buffers:
    """Stands for what a failed client call leaves referenced from its traceback's frames."""


class FailsWithCycles(MemoryConnector):
    """Each failure is a reference cycle (its traceback holds a frame that holds the exception,
    as asyncio's futures and clients' retry wrappers do) that keeps a buffer alive."""

    failures_left = 4
    # or "connect"; "partial", "unexpected": the write fails with a PartialFailure (whose transient
    # error holds the cycle), a RuntimeError; "isolated": RuntimeErrors, then an unhealthy connector
    fail_in = "write"
    unhealthy = 0  # health checks that fail

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buffers: list[weakref.ref[_Buffers]] = []

    def _fail(self) -> None:
        buffers = _Buffers()
        self.buffers.append(weakref.ref(buffers))
        failure: Exception = NotConnected("down")
        if self.fail_in == "partial":
            try:
                raise NotConnected("down")
            except NotConnected as cause:
                inner = cause  # the cycle: cause -> traceback -> this frame -> inner -> cause
            raise PartialFailure({0: inner})
        if self.fail_in in ("unexpected", "isolated"):
            failure = RuntimeError("client bug")
        try:
            raise failure
        except Exception as exc:
            held = exc  # noqa: F841 - the cycle: exc -> traceback -> this frame -> held -> exc
            raise

    async def health(self) -> str | None:
        if self.unhealthy:
            self.unhealthy -= 1
            return "reconnecting"
        return await super().health()

    async def connect(self) -> None:
        if self.fail_in == "connect" and self.failures_left:
            self.failures_left -= 1
            self._fail()
        await super().connect()

    async def write(self, messages: Sequence[Message]) -> None:
        if self.fail_in != "connect" and self.failures_left:
            self.failures_left -= 1
            self._fail()
        await super().write(messages)


@pytest.mark.parametrize("stage", ["connect", "write", "partial", "unexpected", "isolated"])
async def test_each_failure_is_freed_before_the_backoff_not_kept_until_a_full_collection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """A failure collected while the worker still refers to it would be promoted to the oldest
    generation, which an outage may not collect for minutes: one failure's buffers kept per retry
    (the Redis outage test's memory grew 18.8 MiB while its queue was full)."""
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0}, retry=NO_JITTER)
    conn = worker.connector = FailsWithCycles("mem", MemoryOptions(), worker.config)
    conn.fail_in = stage
    if stage == "unexpected":
        conn.failures_left = 1  # a second one in a row would cut the write into records
    if stage == "isolated":
        # a retry, then the isolation's health checks (3), after the one that follows the connect
        conn.failures_left, conn.unhealthy = 2, 4
    alive_at_each_backoff: list[int] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args: object) -> None:
        alive_at_each_backoff.append(sum(ref() is not None for ref in conn.buffers))
        await real_sleep(0)

    monkeypatch.setattr("bridge.sink.asyncio.sleep", sleep)
    enabled = gc.isenabled()
    gc.disable()  # only the worker's own collections run, as during a quiet outage
    try:
        worker.start()
        await fill(worker, STREAM_RECORDS[:1])
        assert await worker.flush(5)
    finally:
        if enabled:
            gc.enable()
    assert [r.seq for r in acked] == [0]
    assert alive_at_each_backoff == [0] * {"unexpected": 1, "isolated": 4}.get(stage, 4)
    await done(worker)


async def test_an_unclassified_client_error_is_retried_as_transient(tmp_path: Path) -> None:
    class Boom(MemoryConnector):
        calls = 0

        async def write(self, messages: Sequence[Message]) -> None:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("client bug")
            await super().write(messages)

    worker, _, acked, metrics = make(tmp_path, batch={"linger": 0})
    conn = worker.connector = Boom("mem", MemoryOptions(), worker.config)
    task = worker.start()
    await fill(worker, STREAM_RECORDS[:2])
    assert await worker.flush(5)
    assert not task.done()
    assert [m.record.seq for m in conn.messages] == [0, 1] and [r.seq for r in acked] == [0, 1]
    assert value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="unexpected") == 1
    await done(worker)


# -- stopping ------------------------------------------------------------------------------------


async def test_stop_cancels_a_write_in_progress_and_closes_the_connector(tmp_path: Path) -> None:
    worker, conn, acked, _ = make(tmp_path, batch={"linger": 0})
    conn.gate = asyncio.Event()  # the write never returns
    task = worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    await until(lambda: conn.connected)
    await asyncio.sleep(0.01)
    await done(worker)
    assert task.cancelled()  # cancelled, not failed
    assert not conn.connected
    assert acked == []


async def test_stop_before_start_closes_the_connector(tmp_path: Path) -> None:
    worker, conn, _, _ = make(tmp_path)
    conn.connected = True
    await done(worker)
    assert not conn.connected


# -- bounds --------------------------------------------------------------------------------------


def test_the_queue_holds_up_to_its_byte_bound_exactly(tmp_path: Path) -> None:
    records = STREAM_RECORDS[:4]
    worker, _, _, _ = make(tmp_path, queue={"max_batches": 100, "max_bytes": sum(r.size for r in records[:3])})
    assert all(worker.offer(r) for r in records[:3])  # the third fills it to the byte
    assert not worker.offer(records[3])
    assert worker.queued == (3, sum(r.size for r in records[:3]))
    worker.dead_letters.close()


def test_a_batch_larger_than_the_queue_bound_still_goes_alone(tmp_path: Path) -> None:
    big = STREAM_RECORDS[0]
    worker, _, _, _ = make(tmp_path, queue={"max_bytes": big.size // 2})
    assert worker.offer(big)
    assert not worker.offer(STREAM_RECORDS[1])
    worker.dead_letters.close()


async def test_writes_are_filled_up_to_max_bytes_and_not_past_it(tmp_path: Path) -> None:
    records = STREAM_RECORDS[:9]
    limit = records[0].size + records[1].size
    worker, conn, _, _ = make(tmp_path, granularity="batch", batch={"linger": 0, "max_bytes": limit})
    await fill(worker, records)  # all queued before the first write
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    assert [m.record.seq for m in conn.messages] == list(range(9))
    sizes = [r.size for r in records]
    i = 0
    for n in conn.writes:
        assert n == 1 or sum(sizes[i : i + n]) <= limit
        if i + n < len(sizes):
            assert sum(sizes[i : i + n + 1]) > limit, "a write left out a batch that fitted"
        i += n
    assert worker.queued == (0, 0)


async def test_linger_gathers_what_arrives_meanwhile_into_one_write(tmp_path: Path) -> None:
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0.1, "max_messages": 10})
    worker.start()
    await until(lambda: worker.connected)
    assert worker.offer(STREAM_RECORDS[0])
    await asyncio.sleep(0.01)
    assert worker.offer(STREAM_RECORDS[1]) and worker.offer(STREAM_RECORDS[2])
    assert await worker.flush(5)
    await done(worker)
    assert conn.writes == [3]


async def test_a_full_write_does_not_wait_for_linger(tmp_path: Path) -> None:
    worker, conn, _, _ = make(tmp_path, batch={"linger": 30, "max_messages": 3})
    worker.start()
    await until(lambda: worker.connected)
    for r in STREAM_RECORDS[:3]:
        assert worker.offer(r)
    assert await worker.flush(2)
    await done(worker)
    assert conn.writes == [3]


# -- partial failures ----------------------------------------------------------------------------


class FailsOnce(MemoryConnector):
    """The first write delivers all but ``failed`` (indexes as a client reports them) and raises."""

    failed: list[int]
    cause: Exception

    calls = 0

    async def write(self, messages: Sequence[Message]) -> None:
        self.calls += 1
        if self.calls == 1:
            self.messages.extend(m for i, m in enumerate(messages) if i not in self.failed)
            raise PartialFailure(self.failed, self.cause)  # type: ignore[arg-type]
        await super().write(messages)


def failing_once(worker: SinkWorker, failed: list[int], cause: Exception) -> FailsOnce:
    conn = FailsOnce("mem", MemoryOptions(), worker.config)
    conn.failed, conn.cause = failed, cause
    worker.connector = conn
    return conn


async def test_partial_failure_rewrites_its_stream_from_the_first_failed_index_ignoring_any_outside_the_write(
    tmp_path: Path,
) -> None:
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0})
    conn = failing_once(worker, [1, 3, -1, 99], Retriable("leader moved"))
    await fill(worker, STREAM_RECORDS[:4])
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    # 0 and 2 were taken; the retry starts at 1, the stream's first failure, and takes 2 again
    # (a copy the sink's idempotence drops) so that nothing after 1 is written before it.
    assert [m.record.seq for m in conn.messages] == [0, 2, 1, 2, 3]
    assert conn.writes == [3]
    assert [r.seq for r in acked] == [0, 1, 2, 3]


async def test_partial_failure_with_only_unknown_indexes_settles_the_write(tmp_path: Path) -> None:
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0})
    conn = failing_once(worker, [7], Retriable("odd client"))
    await fill(worker, STREAM_RECORDS[:2])
    task = worker.start()
    assert await worker.flush(5)
    assert not task.done()
    await done(worker)
    assert [m.record.seq for m in conn.messages] == [0, 1]
    assert [r.seq for r in acked] == [0, 1]


async def test_permanent_partial_failure_dead_letters_only_the_refused(tmp_path: Path) -> None:
    worker, _, acked, metrics = make(tmp_path, batch={"linger": 0})
    conn = failing_once(worker, [1], Permanent("record too large"))
    await fill(worker, STREAM_RECORDS[:3])
    task = worker.start()
    assert await worker.flush(5)
    assert not task.done()
    await done(worker)
    # I6: batch 1 announced to the sink, standing after batch 2 (stored by the same write)
    assert [(m.record.kind, m.record.seq) for m in conn.messages] == [("batch", 0), ("batch", 2), ("EventsLost", 2)]
    assert conn.messages[-1].record.control() == {
        "type": "EventsLost",
        "from_seq": 1,
        "to_seq": 1,
        "count": 1,
        "reason": "sink_refused:mem",
    }
    assert [r.seq for r in acked] == [0, 1, 2]  # settled: the stream goes on
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="dead_lettered") == 1
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="delivered") == 2
    assert value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="permanent") == 1
    (dead,) = (tmp_path / "dead.jsonl").read_text().splitlines()
    assert '"seq":1' in dead


async def test_a_rejected_control_record_is_not_counted_as_a_batch(tmp_path: Path) -> None:
    worker, conn, acked, metrics = make(tmp_path, batch={"linger": 0, "max_messages": 1})
    conn.failures = [Permanent("refused"), None]
    reset = source_reset(STREAM, 1, "publisher_restart", 0.0)
    await fill(worker, [reset, *STREAM_RECORDS[:1]])
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="dead_lettered") == 0
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="delivered") == 1
    assert acked[0] is reset


# -- the drop policy and control records -------------------------------------------------------


async def test_control_records_are_queued_past_a_full_drop_queue_after_the_dropped_span(tmp_path: Path) -> None:
    """A SourceReset arriving while batches are being dropped: the span's EventsLost goes first,
    in the old epoch, then the SourceReset; neither is dropped nor makes the stream wait."""
    worker, conn, acked, _ = make(tmp_path, queue={"max_batches": 1}, backpressure="drop", batch={"linger": 0})
    conn.gate = asyncio.Event()
    worker.start()
    assert worker.offer(STREAM_RECORDS_OTHER[0])  # fills the queue, held in the write
    await asyncio.sleep(0.01)
    for r in STREAM_RECORDS[:3]:
        assert worker.offer(r)  # dropped
    reset = source_reset(STREAM, 1, "publisher_restart", 0.0)
    assert worker.offer(reset)
    lost = events_lost(STREAM, 1, 0, 4, "replay_unavailable", 0.0)
    assert worker.offer(lost)
    conn.gate.set()
    assert await worker.flush(5)
    await done(worker)
    assert seqs(conn) == [("EventsLost", 0, 2), ("SourceReset", None, 0), ("EventsLost", 0, 4)]
    assert [(r.kind, r.epoch) for r in acked if r.stream == STREAM] == [("EventsLost", 0), ("SourceReset", 1), ("EventsLost", 1)]


async def test_each_dropped_span_is_announced_even_when_they_are_not_contiguous(tmp_path: Path) -> None:
    worker, conn, _, metrics = make(tmp_path, queue={"max_batches": 1}, backpressure="drop", batch={"linger": 0})
    conn.gate = asyncio.Event()
    worker.start()
    assert worker.offer(STREAM_RECORDS_OTHER[0])
    await asyncio.sleep(0.01)
    for r in [*STREAM_RECORDS[0:2], *STREAM_RECORDS[5:7]]:
        assert worker.offer(r)
    conn.gate.set()
    assert await worker.flush(5)
    await done(worker)
    assert seqs(conn) == [("EventsLost", 0, 1), ("EventsLost", 5, 6)]
    assert value(metrics, "kv_bridge_batches_lost_total", source="s", reason="sink_queue_full") == 4


# -- what the metrics say -----------------------------------------------------------------------


async def test_lag_is_ack_time_minus_engine_ts_and_send_duration_the_write_time(tmp_path: Path) -> None:
    worker, _, _, metrics = make(tmp_path, batch={"linger": 0})
    records = STREAM_RECORDS[:5]
    before = time.time()
    worker.start()
    await fill(worker, records)
    assert await worker.flush(5)
    after = time.time()
    await done(worker)
    count = value(metrics, "kv_bridge_lag_seconds_count", sink="mem")
    total = value(metrics, "kv_bridge_lag_seconds_sum", sink="mem")
    assert count == 5
    stamps = [r.ts for r in records if r.ts is not None]
    assert sum(before - t for t in stamps) <= total <= sum(after - t for t in stamps)
    writes = value(metrics, "kv_bridge_sink_send_duration_seconds_count", sink="mem")
    assert writes >= 1 and 0 <= value(metrics, "kv_bridge_sink_send_duration_seconds_sum", sink="mem") <= after - before


# -- readiness -------------------------------------------------------------------------------------


async def test_a_sink_whose_writes_fail_is_down_until_one_succeeds(tmp_path: Path) -> None:
    worker, conn, _, metrics = make(tmp_path, batch={"linger": 0}, queue={"max_batches": 7, "max_bytes": 12345})
    assert value(metrics, "kv_bridge_sink_queue_limit_batches", sink="mem") == 7
    assert value(metrics, "kv_bridge_sink_queue_limit_bytes", sink="mem") == 12345
    conn.failures = [NotConnected("down")] * 1000
    worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    await until(lambda: conn.writes)
    await until(lambda: value(metrics, "kv_bridge_sink_retries_total", sink="mem") >= 1)
    assert not worker.connected
    assert value(metrics, "kv_bridge_sink_up", sink="mem") == 0
    conn.failures.clear()
    assert await worker.flush(5)
    assert value(metrics, "kv_bridge_sink_up", sink="mem") == 1
    await done(worker)


class HangingHealth(MemoryConnector):
    async def health(self) -> str | None:
        await asyncio.Event().wait()
        return None


class RaisingHealth(MemoryConnector):
    async def health(self) -> str | None:
        raise RuntimeError("health hook bug")


@pytest.mark.parametrize("connector", [HangingHealth, RaisingHealth], ids=["hangs", "raises"])
async def test_a_health_check_that_hangs_or_raises_marks_an_idle_sink_down_and_the_sink_goes_on(
    tmp_path: Path, connector: type[MemoryConnector]
) -> None:
    worker, _, _, metrics = make(tmp_path, batch={"linger": 0}, retry={"write_timeout": 0.05})
    conn = worker.connector = connector("mem", MemoryOptions(), worker.config)
    worker.health_interval = 0.01
    task = worker.start()
    await until(lambda: conn.connected)
    await until(lambda: not worker.connected)
    assert worker.last_error is not None and value(metrics, "kv_bridge_sink_up", sink="mem") == 0
    assert not task.done()
    await fill(worker, STREAM_RECORDS[:1])  # and it still delivers
    assert await worker.flush(5)
    assert [m.record.seq for m in conn.messages] == [0]
    await done(worker)


# -- audits, drop spans, stopping (mutation survivors) ---------------------------------------------


async def test_the_first_audit_comes_an_audit_interval_after_start_not_with_the_first_write(tmp_path: Path) -> None:
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0})
    audits: list[float] = []

    async def audit() -> None:
        audits.append(time.monotonic())

    worker._audit = audit
    worker.start()
    await fill(worker, STREAM_RECORDS[:3])
    assert await worker.flush(5)
    await done(worker)
    assert len(conn.messages) == 3 and audits == []


async def test_an_audit_due_runs_after_the_write_not_only_when_the_sink_is_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("bridge.sink.AUDIT_INTERVAL", 0.0)  # always due
    worker, _, _, _ = make(tmp_path, batch={"linger": 0})
    audits = 0

    async def audit() -> None:
        nonlocal audits
        audits += 1

    worker._audit = audit
    worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    assert await worker.flush(5)
    await until(lambda: audits >= 1)  # well before the first idle health interval (5 s)
    await done(worker)


async def test_a_run_offered_at_once_after_a_dropped_span_comes_after_its_announcement(tmp_path: Path) -> None:
    """A drop sink dropped a batch too big for its byte bound; a run that fits comes next, offered
    at once (Fanout.offer_all): the span's EventsLost goes first (I3's order), not after the run."""
    worker, conn, _, _ = make(tmp_path, backpressure="drop", queue={"max_bytes": 2000}, batch={"linger": 0})
    small = stream_records(STREAM, 3)
    big = Record(stream=STREAM, epoch=0, seq=1, ts=small[1].ts, payload=b"x" * 5000, events=small[1].events)
    assert worker.offer(small[0])
    assert worker.offer(big)  # dropped: past the byte bound
    assert Fanout([worker]).offer_all(small[2:]) or worker.offer(small[2])
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    assert seqs(conn) == [("batch", None, 0), ("EventsLost", 1, 1), ("batch", None, 2)]


async def test_a_control_record_offered_after_a_dropped_span_comes_after_its_announcement(tmp_path: Path) -> None:
    worker, conn, _, _ = make(tmp_path, backpressure="drop", queue={"max_batches": 2}, batch={"linger": 0})
    for r in STREAM_RECORDS[:4]:
        assert worker.offer(r)  # 2 and 3 dropped
    assert worker.offer(events_lost(STREAM, 0, 4, 4, "replay_unavailable", 1.0))
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    assert seqs(conn) == [("batch", None, 0), ("batch", None, 1), ("EventsLost", 2, 3), ("EventsLost", 4, 4)]


async def test_flush_announces_a_dropped_span_even_while_the_sink_cannot_write(tmp_path: Path) -> None:
    """At shutdown the bridge flushes each sink: a span a drop sink dropped is queued as its
    EventsLost then, even if the sink is not writing (still connecting)."""
    worker, _, _, _ = make(tmp_path, backpressure="drop", queue={"max_batches": 2}, batch={"linger": 0})
    worker.connector = NeverConnects("mem", MemoryOptions(), worker.config)
    worker.start()
    for r in STREAM_RECORDS[:3]:
        assert worker.offer(r)  # 2 dropped
    assert worker.queued[0] == 2
    assert not await worker.flush(0.05)
    assert [(r.kind, r.from_seq, r.seq) for r in worker._queue] == [("batch", None, 0), ("batch", None, 1), ("EventsLost", 2, 2)]
    await done(worker)


BACKOFF_TEN_MS = {"initial_backoff": 0.01, "max_backoff": 0.08, "multiplier": 2.0, "jitter": 0.0}


async def test_a_loss_the_sink_reports_is_written_again_at_once_then_with_the_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SinkLost is not an outage: the write (with the announcement ahead of it) goes again after
    the retry floor, not the backoff; reported again by the very next try, it backs off."""
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0}, retry=BACKOFF_TEN_MS)
    span = (STREAM, 0, 0, 0)
    conn.failures = [SinkLost("stream reset", [span]), SinkLost("stream reset", [span]), None]
    slept = record_sleeps(monkeypatch)
    worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    assert await worker.flush(5)
    await done(worker)
    assert slept == [0.001, 0.02]  # RETRY_FLOOR; then the backoff of a second attempt


@pytest.mark.parametrize("refusal", ["partial", "whole"])
async def test_after_a_refusal_the_announcement_s_retries_back_off_from_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """Records refused for themselves (dead-lettered) are progress: the write of their
    announcement that then fails transiently backs off from the first step again."""
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0}, retry=BACKOFF_TEN_MS)
    refused = Permanent("too large", reason="too_large")
    first = PartialFailure({1: refused}) if refusal == "partial" else refused
    conn.failures = [Retriable("busy"), first, Retriable("busy"), None]
    slept = record_sleeps(monkeypatch)
    worker.start()
    await fill(worker, STREAM_RECORDS[:3])
    assert await worker.flush(5)
    await done(worker)
    assert slept == [0.01, 0.01]  # the write's first retry; the announcement's first retry


async def test_a_partial_failure_that_asks_for_a_pause_is_retried_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0}, retry=BACKOFF_TEN_MS)
    conn.failures = [PartialFailure({1: Retriable("throttled", retry_after=0.37)}), None]
    slept = record_sleeps(monkeypatch)
    worker.start()
    await fill(worker, STREAM_RECORDS[:3])
    assert await worker.flush(5)
    await done(worker)
    assert slept == [0.37]
    assert [m.record.seq for m in conn.messages] == [1, 2]  # from the one that failed on (the memory sink kept none)


async def test_an_index_just_past_the_write_in_a_partial_failure_is_ignored(tmp_path: Path) -> None:
    worker, conn, acked, _ = make(tmp_path, batch={"linger": 0})
    conn.failures = [PartialFailure({3: Retriable("no such message")})]
    worker.start()
    await fill(worker, STREAM_RECORDS[:3])
    assert await worker.flush(5)
    await done(worker)
    assert conn.writes == [3] and [r.seq for r in acked] == [0, 1, 2]


async def test_a_write_whose_only_failures_are_refusals_counts_its_duration_and_brings_the_sink_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Down after a transient failure, then a write refused in part for itself (the rest stored):
    the sink is up again, and that write's duration is observed (once, and it is short)."""
    worker, conn, _, metrics = make(tmp_path, batch={"linger": 0}, retry=BACKOFF_TEN_MS)
    record_sleeps(monkeypatch)
    conn.failures = [Retriable("busy"), PartialFailure({1: Permanent("too large", reason="too_large")}), None]
    worker.start()
    await fill(worker, STREAM_RECORDS[:3])
    assert await worker.flush(5)
    assert worker.connected and worker.last_error is None
    assert value(metrics, "kv_bridge_sink_send_duration_seconds_count", sink="mem") == 2  # the refusal's write, its announcement
    assert value(metrics, "kv_bridge_sink_send_duration_seconds_sum", sink="mem") < 60
    await done(worker)


async def test_refusals_non_adjacent_in_one_write_are_one_span_from_the_first_to_the_last(tmp_path: Path) -> None:
    worker, conn, acked, _ = make(tmp_path, batch={"linger": 0})
    refused = Permanent("too large", reason="too_large")
    conn.failures = [PartialFailure({1: refused, 3: refused, 5: refused}), None]
    worker.start()
    await fill(worker, STREAM_RECORDS[:7])
    assert await worker.flush(5)
    await done(worker)
    lost = [m.record for m in conn.messages if m.record.kind == "EventsLost"]
    assert [(r.from_seq, r.to_seq, r.seq) for r in lost] == [(1, 5, 6)]  # it stands at the write's highest seq
    assert [r.seq for r in acked] == list(range(7))


async def test_a_refused_state_change_in_a_write_that_also_goes_again_is_not_announced(tmp_path: Path) -> None:
    """A state message refused for itself while another message failed transiently: the write goes
    again from the transient failure on, with no announcement for the state message."""
    worker, conn, acked, _ = make(tmp_path, batch={"linger": 0})
    worker.writes_state, worker.on_state_lost = True, lambda _stream, _at: None
    records = stream_records(STREAM, 2)
    for r in records:
        r.state = Delta()
    # b0, its state (refused), b1 (fails transiently), its state
    state_lost = Permanent("bucket created again: state lost", reason="state_lost")
    conn.failures = [PartialFailure({1: state_lost, 2: Retriable("busy")}), None]
    worker.start()
    await fill(worker, records)
    assert await worker.flush(5)
    await done(worker)
    assert [(m.record.kind, m.record.seq) for m in conn.messages if m.type != STATE_TYPE] == [("batch", 1)]
    assert [r.seq for r in acked] == [0, 1]


async def test_an_unexpected_error_while_unhealthy_backs_off_until_healthy_then_writes_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One record; the connector raises an unclassified error twice and its health check fails
    four times: each failed check is an outage (counted, backed off as usual); once healthy the
    record is written again and the sink is up."""
    worker, _, acked, metrics = make(tmp_path, batch={"linger": 0}, retry=BACKOFF_TEN_MS)
    conn = Raising("mem", MemoryOptions(), worker.config)
    conn.down = 7  # counted down by the check after the connect, the two writes, then four health checks
    worker.connector = conn
    slept = record_sleeps(monkeypatch)
    worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    assert await worker.flush(5)
    assert slept == [0.01, 0.01, 0.02, 0.04, 0.08]  # the write's retry; then attempts 1..4 of the health check
    assert value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="unexpected") == 5
    assert worker.connected and [r.seq for r in acked] == [0]
    await done(worker)


async def test_an_isolated_record_that_then_fails_as_usual_is_retried_as_usual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, conn, acked, _ = make(tmp_path, batch={"linger": 0}, retry=BACKOFF_TEN_MS)
    record_sleeps(monkeypatch)
    conn.failures = [RuntimeError("client bug"), RuntimeError("client bug"), Retriable("busy"), None]  # type: ignore[list-item]
    worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    assert await worker.flush(5)
    await done(worker)
    assert [m.record.seq for m in conn.messages] == [0] and [r.seq for r in acked] == [0]
    assert not (tmp_path / "dead.jsonl").exists() or not (tmp_path / "dead.jsonl").read_text().strip()


async def test_a_record_refused_after_isolation_is_dead_lettered_with_the_last_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0}, retry=BACKOFF_TEN_MS)
    record_sleeps(monkeypatch)
    conn.failures = [RuntimeError("client bug"), RuntimeError("client bug"), ValueError("bad record"), None]  # type: ignore[list-item]
    worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    assert await worker.flush(5)
    await done(worker)
    (dead,) = (tmp_path / "dead.jsonl").read_text().splitlines()
    assert "ValueError: bad record" in dead
    assert seqs(conn) == [("EventsLost", 0, 0)]


async def test_an_audit_the_broker_does_not_answer_keeps_the_sink_not_ready_until_one_passes(tmp_path: Path) -> None:
    """breaker60 B1: an idle NATS sink's audits timed out against a frozen server while /readyz
    said ready for about 60 s (its client stays "connected" until its pings run out; a health
    PING that times out kills nats-py's read loop, breaker64). An audit that fails for the broker
    (a timeout, a connection error) makes the sink not ready; the health check, which still
    passes, does not make it ready again: the audit runs again at each health check, and the sink
    is ready once one passes (or a write does)."""
    worker, _, _, metrics = make(tmp_path, batch={"linger": 0})
    worker.health_interval = 0.01
    frozen = True
    audits = 0

    async def audit() -> None:
        nonlocal audits
        audits += 1
        if frozen:
            raise TimeoutError

    worker._audit = audit
    worker._audit_at = 0.0  # due now
    worker.start()
    await fill(worker, STREAM_RECORDS[:1])
    assert await worker.flush(5)
    await until(lambda: audits >= 3)  # (audited again at each health check meanwhile)
    assert not worker.connected and (worker.last_error or "").startswith("audit:")
    assert value(metrics, "kv_bridge_sink_up", sink="mem") == 0
    frozen = False
    await until(lambda: worker.connected)
    assert worker.last_error is None
    await done(worker)


async def test_an_audit_runs_again_only_an_audit_interval_later(tmp_path: Path) -> None:
    worker, _, _, _ = make(tmp_path, batch={"linger": 0, "max_messages": 1})
    audits = 0

    async def audit() -> None:
        nonlocal audits
        audits += 1

    worker._audit = audit
    worker._audit_at = 0.0  # due now
    worker.start()
    await fill(worker, STREAM_RECORDS[:4])  # four writes
    assert await worker.flush(5)
    await done(worker)
    assert audits == 1


async def test_a_loss_the_sink_reports_again_is_announced_once_even_where_it_stands_past_its_span(
    tmp_path: Path,
) -> None:
    """The connector names where the announcement must stand (``at``, past the span's end): the same
    loss reported by the next try is recognised as announced already."""
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0})
    span = (STREAM, 0, 0, 1)
    lost = SinkLost("stream reset", [span], at={(STREAM.key, 0, 0, 1): 3})
    conn.failures = [lost, SinkLost("stream reset", [span], at={(STREAM.key, 0, 0, 1): 3}), None]
    worker.start()
    await fill(worker, STREAM_RECORDS[2:4])
    assert await worker.flush(5)
    await done(worker)
    assert [(r.kind, r.from_seq, r.seq) for r in (m.record for m in conn.messages)] == [
        ("EventsLost", 0, 3),
        ("batch", None, 2),
        ("batch", None, 3),
    ]


async def test_a_loss_the_sink_reports_of_seqs_the_write_announces_itself_is_not_announced_twice(tmp_path: Path) -> None:
    """The write carries an engine loss of seqs 0..1 (its announcement, lost with the sink, goes
    again): the sink's own loss of 0..1 adds no second EventsLost over them (I3: one per seq), the
    stream's state is cleared all the same; a loss reaching below the write's is announced below it."""
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0})
    cleared: list[Stream] = []
    worker.writes_state, worker.on_state_lost = True, lambda stream, _at: cleared.append(stream)
    engine_lost = events_lost(STREAM, 0, 0, 1, "replay_unavailable", 1.0)
    conn.failures = [SinkLost("stream reset", [(STREAM, 0, 0, 1)]), None]
    worker.start()
    await fill(worker, [engine_lost, STREAM_RECORDS[2]])
    assert await worker.flush(5)
    later = events_lost(STREAM, 0, 4, 5, "replay_unavailable", 1.0)
    conn.failures = [SinkLost("stream reset", [(STREAM, 0, 0, 5)]), None]
    await fill(worker, [later, STREAM_RECORDS[6]])
    assert await worker.flush(5)
    await done(worker)
    told = [(m.record.reason, m.record.from_seq, m.record.lost_to) for m in conn.messages if m.record.kind == "EventsLost"]
    assert told == [("replay_unavailable", 0, 1), ("sink_lost:mem", 0, 3), ("replay_unavailable", 4, 5)]
    assert [s.key for s in cleared] == [STREAM.key, STREAM.key]


async def test_a_write_whose_only_refusal_is_a_state_change_brings_the_sink_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Down after a transient failure, then the write goes through but for its state change,
    refused for itself (nothing to announce): the sink is up."""
    worker, conn, _, _ = make(tmp_path, batch={"linger": 0}, retry=BACKOFF_TEN_MS)
    worker.writes_state, worker.on_state_lost = True, lambda _stream, _at: None
    record_sleeps(monkeypatch)
    (record,) = STREAM_RECORDS[:1]
    record = Record(stream=record.stream, epoch=0, seq=0, ts=record.ts, payload=record.payload, events=record.events)
    record.state = Delta()
    state_lost = Permanent("bucket created again: state lost", reason="state_lost")
    conn.failures = [Retriable("busy"), PartialFailure({1: state_lost})]
    worker.start()
    await fill(worker, [record])
    assert await worker.flush(5)
    assert worker.connected and worker.last_error is None
    await done(worker)


async def test_a_stream_s_state_refused_again_and_again_is_told_once_until_its_state_is_written_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A state change refused for itself at every write (a head too large for the state topic:
    fix31s) is counted each time but logged once; once a clear's state change is written, the next
    refusal is logged again (the stream's state was fine in between)."""
    worker, conn, _, metrics = make(tmp_path, batch={"linger": 0, "max_messages": 2})
    worker.writes_state, worker.on_state_lost = True, lambda _stream, _at: None
    records = stream_records(STREAM, 5)
    for r, clear in zip(records, [False, True, True, True, False], strict=True):
        r.state = Delta(clear)
    too_large = Permanent("state head of 1200 bytes, the topic takes 1100", reason="state_too_large")
    # r0's state refused; the clears that start the stream's state afresh (r1, r2) refused again,
    # not told again; r3's clear written; r4's state refused: told again
    refused = [PartialFailure({1: too_large}) for _ in range(3)]
    conn.failures = [*refused, None, PartialFailure({1: too_large})]
    worker.start()
    with caplog.at_level("ERROR", logger="bridge.sink"):
        for r in records:
            await fill(worker, [r])
            assert await worker.flush(5)
    await done(worker)
    told = [r for r in caplog.records if r.getMessage().startswith("state change refused by the sink")]
    assert len(told) == 2
    assert value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="state_too_large") == 4


class RefusesAfterConnect(MemoryConnector):
    """Connects, then says in its health check that the broker refuses every write (a NATS stream
    with ``no_ack``), the way a connector finds a problem that does not fail its connect."""

    async def health(self) -> str | None:
        return "stream_refuses_writes: the stream takes no acks"


async def test_a_sink_whose_health_check_fails_after_connect_is_not_ready_before_the_first_interval(
    tmp_path: Path,
) -> None:
    """Ready means the health check agreed, not only the connect: a sink was ready for up to a
    health interval (5 s) after connecting to a stream that refuses every write."""
    worker, _, _, metrics = make(tmp_path, batch={"linger": 0})
    conn = worker.connector = RefusesAfterConnect("mem", MemoryOptions(), worker.config)
    worker.health_interval = 3600.0  # no idle check comes: only the one after the connect can tell
    worker.start()
    await until(lambda: conn.connected)
    await until(lambda: worker.problem is not None and "stream_refuses_writes" in worker.problem)
    assert value(metrics, "kv_bridge_sink_up", sink="mem") == 0
    await done(worker)
