"""What a consumer reads back from each sink, checked against what the engine published.

:class:`Readback` collects every stored message as (dp_rank, epoch, seq, index, type), in stored
order, and :meth:`Readback.check` verifies the delivery promises: every event present or inside
an announced ``EventsLost`` span, first copies in order per stream, each stream in the one epoch
the bridge opened for it (the clock's), and counts duplicates. The
readers use each broker's own client: aiokafka, redis-py, nats-py (JetStream pull consumer), and
the file sink's JSON lines. Every message read is checked against the committed output schema
(:func:`tests.support.schema.check_message`): its body when it has JSON (or msgpack) content, its
``schema_version`` header always.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import nats
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from tests.support.epochs import assert_first_epoch
from tests.support.schema import JSON, MSGPACK, check_message

CONTROL = ("SourceReset", "EventsLost")

Identity = tuple[int, int, int, int]  # (dp_rank, epoch, seq, index)


class Readback:
    """Messages of every stream in stored order, as (dp_rank, epoch, seq, index, type); the
    EventsLost records also as (dp_rank, from_seq, to_seq, reason).

    Every message added is checked against the output schema before :attr:`rows` or :attr:`lost`
    is first read after it (not while reading: the readers have deadlines, and checking takes
    time), so nothing read back escapes the check."""

    def __init__(self) -> None:
        self._rows: list[tuple[int, int, int, int, str]] = []
        self._lost: list[tuple[int, int, int, str]] = []
        self.resets: list[tuple[int, int, str]] = []  # (dp_rank, epoch, reason) of every SourceReset
        self._unchecked: list[tuple[bytes, dict[str, str]]] = []

    def add(self, headers: dict[str, str], body: bytes) -> None:
        """One stored message: its text headers and its body."""
        row = (
            int(headers["dp_rank"]),
            int(headers["epoch"]),
            int(headers["seq"]),
            int(headers.get("index", -1)),
            headers["type"],
        )
        self._rows.append(row)
        self._unchecked.append((body, headers))
        if row[4] in ("EventsLost", "SourceReset"):
            control = msgspec.msgpack.decode(body) if headers.get("content-type") == MSGPACK else json.loads(body)
            if row[4] == "EventsLost":
                self._lost.append((row[0], control["from_seq"], control["to_seq"], control["reason"]))
            else:
                self.resets.append((row[0], row[1], control["reason"]))

    def validate(self) -> None:
        """Check every message added since the last call against the output schema."""
        for body, headers in self._unchecked:
            check_message(body, headers)
        self._unchecked.clear()

    @property
    def rows(self) -> list[tuple[int, int, int, int, str]]:
        self.validate()
        return self._rows

    @property
    def lost(self) -> list[tuple[int, int, int, str]]:
        self.validate()
        return self._lost

    def check(self, published: dict[int, int], events_per_batch: int = 0, *, since: float) -> dict[str, int]:
        """Every event (every batch with ``events_per_batch`` 0) of every published batch present
        or announced lost, first copies in order per stream, all in one epoch per stream: the one
        the bridge opened when it met the stream (no engine restarted), the clock's between
        wall-clock ``since`` (taken before the bridge first started) and now.

        Returns counts: delivered (distinct events or batches), duplicated (extra copies), lost
        (missing and not announced), announced (batches in EventsLost spans), control (control
        records seen)."""
        control = [r for r in self.rows if r[4] in CONTROL]
        data = [r for r in self.rows if r[4] not in CONTROL]
        epochs: dict[int, int] = {}  # per stream, the epoch of its first stored batch
        for rank, epoch, *_ in data:
            epochs.setdefault(rank, epoch)
        for epoch in epochs.values():
            assert_first_epoch(epoch, since)
        seen: set[Identity] = set()
        last: dict[int, tuple[int, int, int]] = {}
        duplicates = 0
        for rank, epoch, seq, index, _type in data:
            ident = (rank, epoch, seq, index)
            if ident in seen:
                duplicates += 1
                continue
            seen.add(ident)
            assert (epoch, seq, index) > last.get(rank, (-1, -1, -1)), f"stream {rank}: {ident} after {last[rank]}"
            last[rank] = (epoch, seq, index)
        indexes = range(events_per_batch) if events_per_batch else [-1]
        announced = {(r, s) for r, a, b, _ in self.lost for s in range(a, b + 1)}
        assert not {(r, s) for r, _e, s, _i in seen} & announced, "a batch both delivered and announced lost"
        # A stream with no batch stored has no epoch: all of it missing.
        want = {
            (r, epochs.get(r, -1), s, i)
            for r, n in published.items()
            for s in range(n)
            for i in indexes
            if (r, s) not in announced
        }
        missing = want - seen
        extra = seen - want
        assert not extra, sorted(extra)[:10]
        return {
            "delivered": len(seen),
            "duplicated": duplicates,
            "lost": len(missing),
            "announced": len(announced),
            "control": len(control),
        }


async def read_kafka(bootstrap_servers: str, topic: str, partitions: int) -> Readback:
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    out = Readback()
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + 60
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            assert time.monotonic() < deadline, "timed out reading the topic back"
            for records in (await consumer.getmany(timeout_ms=500, max_records=10_000)).values():
                for r in records:
                    out.add({k: v.decode() for k, v in r.headers}, r.value or b"")
    finally:
        await consumer.stop()
    return out


async def read_redis(url: str, keys: Iterable[str], **client: Any) -> Readback:
    client_ = aioredis.Redis.from_url(url, **client)
    out = Readback()
    try:
        for key in keys:
            start = "-"
            while True:
                entries = await client_.xrange(key, min=start, count=10_000)
                for _id, fields in entries:
                    body = fields.get(b"data", fields.get(b"payload", b""))
                    out.add({k.decode(): v.decode() for k, v in fields.items() if k not in (b"data", b"payload")}, body)
                if len(entries) < 10_000:
                    break
                start = "(" + entries[-1][0].decode()
    finally:
        await client_.aclose()
    return out


async def read_jetstream(url: str, stream: str, **client: Any) -> Readback:
    nc = await nats.connect(url, **client)
    out = Readback()
    try:
        js = nc.jetstream(timeout=10)
        total = (await js.stream_info(stream)).state.messages
        sub = await js.pull_subscribe(
            "",
            stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
        )
        deadline = time.monotonic() + 60
        while len(out._rows) < total:  # not .rows: that checks what was read, which takes time
            assert time.monotonic() < deadline, f"read {len(out._rows)} of {total} messages back"
            for m in await sub.fetch(5000, timeout=5):
                out.add(dict(m.headers or {}), m.data or b"")
        await sub.unsubscribe()
    finally:
        await nc.close()
    return out


def read_file(path: Path) -> Readback:
    """A file sink's JSON lines (batch or event granularity)."""
    out = Readback()
    if not path.exists():
        return out
    for raw in path.read_text().splitlines():
        if not raw.strip():
            continue
        line: dict[str, Any] = json.loads(raw)  # checked against the schema by add()
        headers = {"dp_rank": str(line["dp_rank"]), "epoch": str(line["epoch"]), "seq": str(line["seq"])}
        headers |= {"content-type": JSON, "schema_version": str(line["schema_version"])}
        headers["type"] = line.get("type", "EventBatch") if "events" not in line else "EventBatch"
        if "index" in line:
            headers["index"] = str(line["index"])
        out.add(headers, raw.encode())
    return out
