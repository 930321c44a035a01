"""An announcement the sink refuses for itself is kept and retried, never dead-lettered (I3, I6).

Regression tests of issue 29 (breaker29h W1-W4): a broker that refuses a batch for itself because
of its destination (a Redis key of another type, a NATS stream's ``max_msg_size`` or a Kafka
topic's ``max.message.bytes`` lowered) refuses the ``EventsLost`` announcing it too; the loop
dead-lettered that announcement like a batch, so the consumers were never told, and the sink
stayed ready. Each test fails on the loop before the fix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from bridge.errors import ConnectorError, PartialFailure, Permanent, StreamRefused
from bridge.formats import Message
from bridge.records import Stream, events_lost, source_reset
from bridge.sink import SinkWorker
from tests.support.memory import MemoryOptions
from tests.support.records import stream_records
from tests.unit.test_sink import fill, make
from tests.unit.test_sink_counts import Answers, answering, dead_lines
from tests.unit.test_sink_i6 import Raising
from tests.unit.test_sink_worker import done, value

STREAM = Stream("s", 0)
OTHER = Stream("t", 0)
WRONGTYPE = "WRONGTYPE key kv:s:0 holds a string, not a stream"


class Watched(Answers):
    """Answers, and notes what /readyz would say of the sink at each write."""

    worker: SinkWorker
    seen: list[tuple[bool, str | None]]

    async def write(self, messages: Sequence[Message]) -> None:
        self.seen.append((self.worker.connected, self.worker.last_error))
        await super().write(messages)


def watched(worker: SinkWorker, answers: list[ConnectorError | None]) -> Watched:
    conn = Watched("mem", MemoryOptions(), worker.config)
    conn.answers, conn.worker, conn.seen = answers, worker, []
    worker.connector = conn
    return conn


def stored(conn: Answers) -> list[tuple[str, str, int | None, int]]:
    return [(m.record.stream.key, m.record.kind, m.record.from_seq, m.record.seq) for m in conn.messages]


@pytest.mark.parametrize("how", ["whole", "partial"])
async def test_an_announcement_refused_for_itself_is_retried_until_taken_then_delivered_in_order(
    tmp_path: Path, how: str
) -> None:
    """Batch 0 is refused for itself (dead-lettered); its EventsLost is refused three times for the
    same cause, then the destination is fixed: the EventsLost is written, before batches 1 and 2,
    and nothing but batch 0 is dead-lettered; the sink is not ready meanwhile, and says why."""
    worker, _, acked, metrics = make(tmp_path, batch={"linger": 0, "max_messages": 1})

    def refused() -> ConnectorError:
        error = Permanent(WRONGTYPE, reason="wrongtype")
        return error if how == "whole" else PartialFailure({0: error})

    conn = watched(worker, [refused(), refused(), refused(), refused(), None])
    await fill(worker, stream_records(STREAM, 3))
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    assert stored(conn) == [("s/0", "EventsLost", 0, 0), ("s/0", "batch", None, 1), ("s/0", "batch", None, 2)]
    assert conn.messages[0].record.control()["reason"] == "sink_refused:mem"
    # five writes for the EventsLost's record: batch 0, then the announcement refused 3 times, then taken
    assert len(conn.seen) == 7
    for connected, why in conn.seen[2:5]:  # each retry of the announcement: the sink not ready, and why
        assert not connected
        assert why is not None and WRONGTYPE in why and "announcement" in why and "fix the destination" in why
    assert worker.connected and worker.last_error is None  # ready again once it went through
    assert worker.problem is None  # (a batch refused for itself is no refusal of its stream)
    assert [(d["seq"], d["reason"]) for d in dead_lines(tmp_path)] == [(0, "sink_rejected")]
    assert value(metrics, "kv_bridge_dead_letters_total", reason="sink_rejected") == 1
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="dead_lettered") == 1
    assert value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="delivered") == 2
    assert value(metrics, "kv_bridge_sink_retries_total", sink="mem") == 3
    assert [r.seq for r in acked] == [0, 1, 2]


async def test_a_refused_batch_and_its_stream_s_announcement_in_one_write_dead_letter_the_batch_alone(
    tmp_path: Path,
) -> None:
    """A write of an engine's EventsLost (seqs 1-2) and batch 3, refused whole: batch 3 is
    dead-lettered, the engine's EventsLost is kept, and the announcement of batch 3 follows it."""
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0})
    records = stream_records(STREAM, 4)
    gap = events_lost(STREAM, records[0].epoch, 1, 2, "replay_buffer_exceeded", 0.0)
    conn = answering(worker, [None, Permanent(WRONGTYPE), Permanent(WRONGTYPE), None])
    await fill(worker, [records[0]])
    worker.start()
    assert await worker.flush(5)
    await fill(worker, [gap, records[3]])
    assert await worker.flush(5)
    await done(worker)
    assert stored(conn) == [("s/0", "batch", None, 0), ("s/0", "EventsLost", 1, 2), ("s/0", "EventsLost", 3, 3)]
    assert [d["seq"] for d in dead_lines(tmp_path)] == [3]
    assert [r.seq for r in acked] == [0, 2, 3]


async def test_a_refused_source_reset_is_kept_and_other_streams_go_on_in_a_partial_failure(tmp_path: Path) -> None:
    """A SourceReset refused for itself in a write that also holds another stream's batch: that
    batch is stored, the reset is written again (not dead-lettered) and nothing of its stream
    passes it."""
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0})
    reset = source_reset(STREAM, 2, "publisher_restart", 0.0)
    other = stream_records(OTHER, 1)
    conn = watched(worker, [PartialFailure({0: Permanent(WRONGTYPE)}), None])
    await fill(worker, [reset, *other])
    assert worker.problem == "not connected yet"  # (not started: not ready)
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    assert stored(conn) == [("t/0", "batch", None, 0), ("s/0", "SourceReset", None, reset.seq)]
    assert dead_lines(tmp_path) == []
    assert acked[0] is reset and len(acked) == 2
    # the retry of the reset: not ready, saying that one announcement is kept
    assert conn.seen[1][1] is not None and "(1 announcement(s) to this sink's consumers refused" in conn.seen[1][1]
    assert worker.problem is None  # an ordinary refusal, once taken, leaves the sink ready


async def test_an_announcement_the_connector_keeps_failing_on_is_kept_not_dead_lettered(tmp_path: Path) -> None:
    """I5's isolation: a record that fails alone with an unclassified error is dead-lettered; an
    announcement is kept instead (backing off, not ready) until the connector takes it."""
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0})

    class FailsOnAnnouncements(Raising):
        left = 5

        async def write(self, messages: Sequence[Message]) -> None:
            if self.left and any(m.record.kind == "SourceReset" for m in messages):
                self.left -= 1
                self.writes.append(len(messages))
                raise RecursionError("maximum recursion depth exceeded")
            await super().write(messages)

    conn = FailsOnAnnouncements("mem", MemoryOptions(), worker.config)
    worker.connector = conn
    reset = source_reset(STREAM, 2, "publisher_restart", 0.0)
    await fill(worker, [reset, *stream_records(STREAM, 1)])
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    assert conn.left == 0
    assert [m.record.kind for m in conn.messages] == ["SourceReset", "batch"]
    assert dead_lines(tmp_path) == []
    assert acked[0] is reset


class RefusesStream(Answers):
    """Refuses every message of STREAM for itself with StreamRefused, as the NATS sink does a
    stream whose subject another stream owns (breaker31z B1); stores the rest."""

    async def write(self, messages: Sequence[Message]) -> None:
        self.writes.append(len(messages))
        refused = {
            i: StreamRefused("subject 'kvb.s.0' is written by stream 'x/0' already", reason="subject_taken")
            for i, m in enumerate(messages)
            if m.record.stream == STREAM
        }
        self.messages.extend(m for i, m in enumerate(messages) if i not in refused)
        if len(refused) == len(messages):
            raise refused[0]
        if refused:
            raise PartialFailure(refused)


@pytest.mark.parametrize("alone", [False, True])
async def test_a_stream_the_sink_refuses_for_good_has_its_announcements_dead_lettered_and_the_others_go_on(
    tmp_path: Path, alone: bool
) -> None:
    """A refusal of the whole stream for as long as the sink runs (StreamRefused) is never taken
    back: keeping its announcements held every other stream of the sink back for good (I5; the
    NATS sink stored nothing more of any stream). Its batches and announcements are dead-lettered,
    the other streams are written, and the sink says it is not ready, and why, from then on."""
    worker, _, acked, _ = make(tmp_path, batch={"linger": 0, "max_messages": 1 if alone else 100})
    conn = RefusesStream("mem", MemoryOptions(), worker.config)
    worker.connector = conn
    reset = source_reset(STREAM, 2, "publisher_restart", 0.0)
    mine = stream_records(STREAM, 2)
    other = stream_records(OTHER, 3)
    await fill(worker, [reset, mine[0], other[0], other[1], mine[1], other[2]])
    worker.start()
    assert await worker.flush(5)
    await done(worker)
    assert stored(conn) == [("t/0", "batch", None, 0), ("t/0", "batch", None, 1), ("t/0", "batch", None, 2)]
    kinds = {(json.loads(bytes.fromhex(d["payload_hex"]))["type"], d["seq"]) for d in dead_lines(tmp_path)}
    assert {("SourceReset", 0), ("EventBatch", 0), ("EventBatch", 1)} <= kinds
    assert any(kind == "EventsLost" for kind, _ in kinds)  # the announcement of the refused batches, refused too
    assert len(acked) == 6
    assert worker.problem is not None and "subject_taken" in worker.problem and "written by stream" in worker.problem
