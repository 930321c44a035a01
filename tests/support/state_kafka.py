"""A Kafka state-bootstrap consumer for tests: ``kv_consumer.kafka.bootstrap`` then the events.

:class:`Follower` bootstraps one engine stream from a sink with ``state.enabled`` and applies the
stream's messages (json, either granularity) from the head's ``next`` on, as a router replica
would; :func:`truth` is a :class:`~tests.support.cache_engine.CacheEngine`'s cache in the same
shape as :meth:`StreamState.blocks`, and :func:`read_partition` reads one partition's records;
:func:`delete_records` and :func:`add_partitions` do what an operator does to a topic.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions
from aiokafka.admin.records_to_delete import RecordsToDelete

from kv_consumer.kafka import bootstrap, topic_partitions
from kv_consumer.state import StreamState
from tests.support.cache_engine import CacheEngine

U64 = (1 << 64) - 1


def truth(engine: CacheEngine) -> dict[tuple[Any, Any, int], int]:
    """The engine's true cache as (medium, group_idx, block id) -> copies (its events use group 0)."""
    return {(medium, 0, h & U64): n for (h, medium), n in engine.cache.items()}


class Follower:
    """One consumer of one stream: ``await Follower.start(...)``, then ``await f.catch_up(...)``."""

    def __init__(self, consumer: AIOKafkaConsumer, stream: str, state: StreamState, tp: TopicPartition, start: int) -> None:
        self.consumer = consumer
        self.stream = stream.encode()
        self.state = state
        self.tp = tp
        self.start_offset = start
        self.applied = 0
        self.read = 0

    @classmethod
    async def start(cls, servers: str, source: str, dp_rank: int, *, topic: str, state_topic: str) -> Follower:
        admin = AIOKafkaAdminClient(bootstrap_servers=servers)
        await admin.start()
        try:
            partitions = await topic_partitions(admin, [topic, state_topic])
        finally:
            await admin.close()
        consumer = AIOKafkaConsumer(bootstrap_servers=servers, group_id=None, enable_auto_commit=False)
        await consumer.start()
        try:
            state, tp, start = await bootstrap(
                consumer, source, dp_rank, topic=topic, state_topic=state_topic, partitions=partitions
            )
        except BaseException:
            await consumer.stop()
            raise
        return cls(consumer, f"{source}/{dp_rank}", state, tp, start)

    async def poll(self) -> None:
        """Apply what the events partition holds now."""
        end = (await self.consumer.end_offsets([self.tp]))[self.tp]
        while await self.consumer.position(self.tp) < end:
            got = await self.consumer.getmany(self.tp, timeout_ms=200, max_records=5000)
            for record in got.get(self.tp, []):
                self.read += 1
                if record.key == self.stream and record.value is not None:
                    self.applied += self.state.apply(json.loads(record.value))

    async def catch_up(self, epoch: int, seq: int, timeout: float = 30.0) -> None:
        """Until a message of (``epoch``, ``seq``) or later was applied."""
        deadline = time.monotonic() + timeout
        while self.state.applied[:2] < (epoch, seq + 1):
            assert time.monotonic() < deadline, (
                f"{self.stream!r}: at {self.state.applied}, not at ({epoch}, {seq}) after {timeout}s"
            )
            await self.poll()
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        await self.consumer.stop()


async def read_partition(servers: str, tp: TopicPartition) -> list[tuple[bytes | None, bytes | None]]:
    """(key, value) of every record ``tp`` holds now, in order."""
    # An explicit seek: seek_to_beginning right after assign can lose the race with the default
    # reset to the latest offset, already in flight (aiokafka's fetcher).
    consumer = AIOKafkaConsumer(bootstrap_servers=servers, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    out: list[tuple[bytes | None, bytes | None]] = []
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        consumer.seek(tp, (await consumer.beginning_offsets([tp]))[tp])
        while await consumer.position(tp) < end:
            got = await consumer.getmany(tp, timeout_ms=500, max_records=10_000)
            out.extend((r.key, r.value) for r in got.get(tp, []) if r.offset < end)
    finally:
        await consumer.stop()
    return out


async def offsets(servers: str, tp: TopicPartition) -> tuple[int, int]:
    """(first, end) offsets of ``tp`` now."""
    consumer = AIOKafkaConsumer(bootstrap_servers=servers, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        return (await consumer.beginning_offsets([tp]))[tp], (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()


async def delete_records(servers: str, tp: TopicPartition, keep: int = 0) -> int:
    """DeleteRecords of every record of ``tp`` but its last ``keep`` (what retention or an
    operator does); the partition's new start offset."""
    _, end = await offsets(servers, tp)
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        await admin.delete_records({tp: RecordsToDelete(before_offset=end - keep)})
    finally:
        await admin.close()
    return end - keep


async def add_partitions(servers: str, topic: str, total: int) -> None:
    """Partitions added to ``topic`` up to ``total`` (CreatePartitions)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        await admin.create_partitions({topic: NewPartitions(total_count=total)})
    finally:
        await admin.close()


async def last_head(servers: str, state_topic: str, partition: int, stream: str) -> dict[str, Any] | None:
    """The last head of ``stream`` in one state partition."""
    key = f"{stream}/_head".encode()
    head = None
    for k, v in await read_partition(servers, TopicPartition(state_topic, partition)):
        if k == key and v is not None:
            head = v
    return None if head is None else dict(json.loads(head))
