"""``kv_bridge_sink_batches_total``: every batch a sink settles is counted once, as ``delivered`` or
as ``dead_lettered``, however many of its messages were refused and in however many tries.

At event granularity one batch is several messages, and the connectors refuse them one by one
(each with its own ``Permanent``); an unrenderable batch is dead-lettered whole and an
``EventsLost`` goes to the sink in its place. Found by an invariant breaker (I5: "counted").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bridge import wire
from bridge.errors import ConnectorError, PartialFailure, Permanent, Retriable
from bridge.formats import Message
from bridge.metrics import Metrics
from bridge.records import Record, Stream
from bridge.sink import SinkWorker
from tests.support.memory import MemoryConnector, MemoryOptions
from tests.support.records import stream_records
from tests.unit.test_hostile_input import deep_payload
from tests.unit.test_sink import fill, make

STREAM = Stream("s", 0)
BATCHES = "kv_bridge_sink_batches_total"


class Answers(MemoryConnector):
    """Each write is answered by the next of ``answers``: None stores every message; a
    ``PartialFailure`` stores the messages it does not name, then is raised (as a client that
    took some of the write reports it)."""

    answers: list[ConnectorError | None]

    async def write(self, messages: Sequence[Message]) -> None:
        self.writes.append(len(messages))
        answer = self.answers.pop(0) if self.answers else None
        if isinstance(answer, PartialFailure):
            self.messages.extend(m for i, m in enumerate(messages) if i not in answer.errors)
            raise answer
        if answer is not None:
            raise answer
        self.messages.extend(messages)


def answering(worker: SinkWorker, answers: list[ConnectorError | None]) -> Answers:
    conn = Answers("mem", MemoryOptions(), worker.config)
    conn.answers = answers
    worker.connector = conn
    return conn


async def settle_all(worker: SinkWorker, records: list[Record]) -> None:
    worker.start()
    await fill(worker, records)
    assert await worker.flush(5)
    await worker.stop()
    worker.dead_letters.close()


def counted(metrics: Metrics) -> dict[str, float]:
    return {
        outcome: metrics.registry.get_sample_value(BATCHES, {"sink": "mem", "outcome": outcome}) or 0.0
        for outcome in ("delivered", "dead_lettered")
    }


def dead_lines(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "dead.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def stored(conn: MemoryConnector) -> list[tuple[str, int, int | None]]:
    return [(m.record.kind, m.record.seq, m.index) for m in conn.messages]


async def test_a_batch_two_of_whose_events_are_refused_in_one_write_is_counted_dead_lettered_once(tmp_path: Path) -> None:
    """Case A: one batch of three events; the first write refuses events 0 and 2, each with its own
    error (too large), and takes event 1. The batch is dead-lettered: counted once, never delivered."""
    worker, _, acked, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    too_large = {0: Permanent("too large", reason="too_large"), 2: Permanent("too large", reason="too_large")}
    conn = answering(worker, [PartialFailure(too_large)])
    (record,) = stream_records(STREAM, 1)
    await settle_all(worker, [record])
    # I6: the batch is announced to the sink after the event it took, so a consumer does not take
    # the announcement for a copy; once, however many of its events were refused.
    assert stored(conn) == [("batch", 0, 1), ("EventsLost", 0, None)]
    assert conn.messages[1].record.control()["reason"] == "sink_refused:mem"
    assert conn.writes == [3, 1]  # nothing retried (both refusals are permanent), then the announcement
    assert acked == [record]  # settled: the stream goes on
    assert [(d["reason"], d["seq"]) for d in dead_lines(tmp_path)] == [("sink_rejected", 0), ("sink_rejected", 0)]
    assert counted(metrics) == {"delivered": 0.0, "dead_lettered": 1.0}


async def test_a_batch_with_an_event_refused_in_each_of_two_tries_is_counted_dead_lettered_once(tmp_path: Path) -> None:
    """Case B: one batch of three events; the first write refuses event 0 and fails event 1 for a
    while (so 1..2 are written again); the retry refuses event 1 and takes event 2 again. One batch,
    dead-lettered over two tries: counted once."""
    worker, _, acked, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    conn = answering(
        worker,
        [
            PartialFailure({0: Permanent("too large"), 1: Retriable("busy")}),
            # The retry is events 1 and 2, then the batch's announcement: event 1 refused.
            PartialFailure({0: Permanent("too large")}),
        ],
    )
    (record,) = stream_records(STREAM, 1)
    await settle_all(worker, [record])
    # Event 2, taken by the first write, is written again after event 1 (retried from the stream's
    # first transient failure on, in order).
    assert stored(conn) == [("batch", 0, 2), ("batch", 0, 2), ("EventsLost", 0, None)]
    assert conn.writes == [3, 3]
    assert acked == [record]
    assert len(dead_lines(tmp_path)) == 2  # event 0, then event 1
    assert counted(metrics) == {"delivered": 0.0, "dead_lettered": 1.0}


async def test_refused_batches_are_counted_once_each_and_the_others_delivered(tmp_path: Path) -> None:
    """Three batches in one write, events refused in the first and the last (two in the last): two
    dead-lettered, one delivered; three batches in all."""
    worker, _, acked, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    refused = {0: Permanent("too large"), 7: Permanent("too large"), 8: Permanent("too large")}
    conn = answering(worker, [PartialFailure(refused)])
    records = stream_records(STREAM, 3)
    await settle_all(worker, records)
    # The refused batches announced once, by one span from the first to the last, after the last
    # batch of the stream the write held (batch 1 between them is covered: the view is dropped anyway).
    assert [(kind, seq) for kind, seq, _ in stored(conn)] == [("batch", 0)] * 2 + [("batch", 1)] * 3 + [("batch", 2)] + [
        ("EventsLost", 2)
    ]
    assert (conn.messages[-1].record.control()["from_seq"], conn.messages[-1].record.control()["to_seq"]) == (0, 2)
    assert acked == records
    assert counted(metrics) == {"delivered": 1.0, "dead_lettered": 2.0}


async def test_an_unrenderable_batch_is_counted_dead_lettered_not_delivered(tmp_path: Path) -> None:
    """Case C: a batch nested past the renderer's depth is dead-lettered (reason unrenderable) and
    an EventsLost of its seq goes to the sink in its place: the batch counts as dead-lettered,
    never as delivered; the batches around it as delivered."""
    worker, conn, acked, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    payload = deep_payload()
    decoded = wire.decode_batch(payload)
    hostile = Record(stream=STREAM, epoch=0, seq=1, ts=decoded.ts, payload=payload, events=decoded.events)
    first, last = stream_records(STREAM, 3)[0::2]
    await settle_all(worker, [first, hostile, last])
    assert [(m.record.kind, m.record.seq) for m in conn.messages] == [("batch", 0)] * 3 + [("EventsLost", 1)] + [("batch", 2)] * 3
    assert [r.seq for r in acked] == [0, 1, 2]
    assert [(d["reason"], d["seq"]) for d in dead_lines(tmp_path)] == [("unrenderable", 1)]
    assert metrics.registry.get_sample_value("kv_bridge_dead_letters_total", {"reason": "unrenderable"}) == 1
    assert counted(metrics) == {"delivered": 2.0, "dead_lettered": 1.0}


async def test_an_unrenderable_batch_alone_is_counted_dead_lettered(tmp_path: Path) -> None:
    """Case C as the breaker ran it: the unrenderable batch on its own; the sink gets only the
    EventsLost in its place, and nothing is counted delivered."""
    worker, conn, _, metrics = make(tmp_path, granularity="event", batch={"linger": 0})
    payload = deep_payload()
    decoded = wire.decode_batch(payload)
    hostile = Record(stream=STREAM, epoch=0, seq=0, ts=decoded.ts, payload=payload, events=decoded.events)
    await settle_all(worker, [hostile])
    assert [(m.record.kind, m.record.seq) for m in conn.messages] == [("EventsLost", 0)]
    assert counted(metrics) == {"delivered": 0.0, "dead_lettered": 1.0}
