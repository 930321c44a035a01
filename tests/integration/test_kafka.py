"""The Kafka connector on a real broker: conformance, ordering, outages, failure classes, security.

Tests use the session ``kafka`` fixture (tests/integration/conftest.py) or a broker of their own;
the option-mapping tests without a broker are in tests/unit/test_kafka_options.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import struct
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.codec import has_zstd
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import ConsumerRecord

from bridge.cli import check
from bridge.config import SinkConfig, convert_options
from bridge.connector import Registry
from bridge.errors import ConfigError, ConnectorError, NotConnected, PartialFailure, Permanent, SinkLost
from bridge.formats import Message, Renderer
from bridge.logs import JsonFormatter, TextFormatter
from bridge.records import Stream, source_reset
from bridge.sink import fold
from connectors.kafka import KafkaConnector, KafkaOptions
from tests.infra.servers import KafkaServer, ServerError
from tests.integration.conformance import ConformanceSuite, Stored
from tests.integration.conftest import unavailable
from tests.support.contract import Scenario, interleaved
from tests.support.records import stream_records
from tests.support.schema import check_if_written_by_bridge
from tests.support.state_kafka import add_partitions

SECRET = "s3cr3t-Pa55w0rd-never-logged"


def build(
    kafka: KafkaServer | str, topic: str, *, fmt: str = "json", granularity: str = "event", **options: Any
) -> KafkaConnector:
    """A connector the way the registry builds one from a config file."""
    servers = kafka if isinstance(kafka, str) else kafka.bootstrap_servers
    sink = SinkConfig(
        type="kafka",
        name="kafka-test",
        format=fmt,  # type: ignore[arg-type]
        granularity=granularity,  # type: ignore[arg-type]
        options={"bootstrap_servers": servers, "topic": topic, "request_timeout": "5s", **options},
    )
    connector = Registry({"kafka": KafkaConnector}, entry_points=False).build(sink, 0)
    assert isinstance(connector, KafkaConnector)
    return connector


def render(records: Sequence[Any], fmt: str = "json", granularity: str = "event") -> list[Message]:
    renderer = Renderer(fmt, granularity)  # type: ignore[arg-type]
    return [m for r in records for m in renderer.render(r)]


async def a_run_writes(kafka: KafkaServer, topic: str, records: Sequence[Any]) -> None:
    """One run of the sink (a connector of its own) writes ``records`` (batch granularity) to ``topic``."""
    run = build(kafka, topic, granularity="batch")
    await run.connect()
    try:
        await run.write(render(records, granularity="batch"))
    finally:
        await run.close()


async def partitions_of(kafka: KafkaServer, topic: str) -> list[TopicPartition]:
    """``topic``'s partitions, as the broker describes them."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return sorted(TopicPartition(topic, p["partition"]) for p in described[0]["partitions"])


async def consume(kafka: KafkaServer, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Everything in ``topic`` (all partitions, up to the current end), partition by partition."""
    partitions = await partitions_of(kafka, topic)
    assert partitions, f"topic {topic} has no partitions"
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        out: dict[int, list[ConsumerRecord[bytes, bytes]]] = {tp.partition: [] for tp in partitions}
        deadline = time.monotonic() + 30
        while [tp for tp in partitions if await consumer.position(tp) < ends[tp]]:
            assert time.monotonic() < deadline, "timed out reading the topic back"
            batch = await consumer.getmany(timeout_ms=500)
            for tp, records in batch.items():
                out[tp.partition].extend(records)
        everything = [r for p in sorted(out) for r in out[p]]
        for r in everything:
            check_if_written_by_bridge(r.value or b"", headers_of(r))
        return everything
    finally:
        await consumer.stop()


def headers_of(record: ConsumerRecord[bytes, bytes]) -> dict[str, str]:
    return {k: v.decode() for k, v in record.headers}


def identity(record: ConsumerRecord[bytes, bytes]) -> tuple[str, str, int, int, int]:
    """(source, dp_rank, epoch, seq, index): what a consumer deduplicates on."""
    h = headers_of(record)
    return (h["source"], h["dp_rank"], int(h["epoch"]), int(h["seq"]), int(h.get("index", -1)))


async def deliver(
    connector: KafkaConnector, messages: Sequence[Message], *, budget: float = 60.0, write_timeout: float = 10.0
) -> list[int]:
    """Write like the runtime does (bridge.sink: the write timeout, fold(), backoff); return the
    dead-lettered indexes."""
    pending = list(range(len(messages)))
    dead: list[int] = []
    delay = 0.1
    deadline = time.monotonic() + budget
    while pending:
        try:
            async with asyncio.timeout(write_timeout):
                await connector.write([messages[i] for i in pending])
            return sorted(dead)
        except PartialFailure as exc:
            outcome = fold([messages[i] for i in pending], exc.errors)
            dead += [pending[i] for i, _ in outcome.dead]
            pending = [pending[i] for i in outcome.retry]
        except Permanent:
            return sorted(dead + pending)
        except (ConnectorError, TimeoutError):
            pass
        assert time.monotonic() < deadline, "the connector did not recover in time"
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)
    return sorted(dead)


# -- the shared conformance suite ---------------------------------------------------------------


@pytest.mark.integration
class TestKafkaConformance(ConformanceSuite):
    # The idempotent producer dedups only its own internal retries; a write the runtime sends
    # again is stored again (consumers dedup on source/dp_rank/epoch/seq/index).
    dedup_on_redelivery = False

    @pytest.fixture(autouse=True)
    def _broker(self, kafka: KafkaServer) -> None:
        self.kafka = kafka

    def new_dest(self) -> str:
        return self.kafka.new_topic(partitions=1)

    async def make_connector(self, sink: SinkConfig, dest: str) -> KafkaConnector:
        options = convert_options(
            {"bootstrap_servers": self.kafka.bootstrap_servers, "topic": dest, "request_timeout": "5s"},
            KafkaOptions,
            "sinks[0]",
        )
        return KafkaConnector("kafka-conformance", options, sink)

    async def read_back(self, dest: str, stream: Stream, expected: int) -> list[Stored]:
        records = [r for r in await consume(self.kafka, dest) if r.key == stream.key.encode()]
        assert len(records) >= expected
        return [Stored(value=r.value or b"", headers=headers_of(r)) for r in records]

    async def restart_server(self) -> None:
        await self.kafka.arestart()

    def _scenario_connector(self, sink: SinkConfig, topic: str) -> KafkaConnector:
        options = {"bootstrap_servers": self.kafka.bootstrap_servers, "topic": topic, "request_timeout": "5s"}
        # Batches of up to 7 KiB on a topic that takes 6000 bytes per batch (max.message.bytes).
        return KafkaConnector(
            "kafka-conformance", convert_options({**options, "max_batch_bytes": "7KiB"}, KafkaOptions, "s"), sink
        )

    def _reader(self, topic: str) -> Any:
        async def read(stream: Stream, expected: int) -> list[tuple[bytes, dict[str, str]]]:
            records = [r for r in await consume(self.kafka, topic) if r.key == stream.key.encode()]
            return [(r.value or b"", headers_of(r)) for r in records]

        return read

    async def transient_partial_failure(self, sink: SinkConfig, dest: str) -> Scenario:
        """Two partitions, the topic refusing batches over 6000 bytes: llama-a/2 alone on
        partition 0 (5 messages of 800 bytes, one batch: stored); llama-a/0 and llama-a/1 on
        partition 1 (10 messages: a first batch of ~7 KiB the broker refuses, the rest held back).
        The connector then sends the refused batch's messages one per batch: healed by the retry."""
        topic = await self.kafka.anew_topic(partitions=2, config={"max.message.bytes": "6000"})
        renderer = Renderer(sink.format, sink.granularity)
        streams = [Stream("llama-a", 0), Stream("llama-a", 2), Stream("llama-a", 1)]
        assert [DefaultPartitioner()(s.key.encode(), [0, 1], [0, 1]) for s in streams] == [1, 0, 1]
        records = interleaved(renderer, streams, 5, lambda _s, _seq: 800)
        return Scenario(self._scenario_connector(sink, topic), records, self._reader(topic), struck=("batch_refused",))

    async def refused_message(self, sink: SinkConfig, dest: str) -> Scenario:
        """One message of 6500 bytes (over the topic's max.message.bytes, under max_batch_bytes),
        in the middle of llama-a/0, among 500-byte messages of two streams."""
        topic = await self.kafka.anew_topic(config={"max.message.bytes": "6000"})
        renderer = Renderer(sink.format, sink.granularity)
        streams = [Stream("llama-a", 0), Stream("llama-a", 1)]
        records = interleaved(renderer, streams, 5, lambda s, seq: 6500 if (s.dp_rank, seq) == (0, 2) else 500)
        (refused,) = [r for r in records if (r.stream.dp_rank, r.seq) == (0, 2)]
        return Scenario(self._scenario_connector(sink, topic), records, self._reader(topic), refused=refused)


# -- ordering and partitioning ------------------------------------------------------------------


@pytest.mark.integration
async def test_streams_keep_order_and_partition_across_four_partitions(kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic(partitions=4)
    streams = [Stream("llama-a", 0), Stream("llama-a", 1), Stream("qwen-b", 0)]
    per_stream = {s.key: render(stream_records(s, 12)) for s in streams}
    # Interleave the streams and cut into writes of uneven size, as the runtime's batching does.
    interleaved = [m for group in zip(*per_stream.values(), strict=True) for m in group]
    connector = build(kafka, topic, max_batch_bytes="4KiB")  # several record batches per partition
    await connector.connect()
    try:
        for start in range(0, len(interleaved), 25):
            await connector.write(interleaved[start : start + 25])
    finally:
        await connector.close()
    records = await consume(kafka, topic)
    assert len(records) == len(interleaved)
    partitioner = DefaultPartitioner()
    for stream in streams:
        mine = [r for r in records if r.key == stream.key.encode()]
        assert [r.value for r in mine] == [m.value for m in per_stream[stream.key]]
        # One partition per stream, the one Java's murmur2 partitioner picks for the key.
        assert {r.partition for r in mine} == {partitioner(stream.key.encode(), [0, 1, 2, 3], [0, 1, 2, 3])}


@pytest.mark.integration
async def test_fixed_partition_and_templated_topic(kafka: KafkaServer) -> None:
    prefix = f"kvb-tpl-{uuid.uuid4().hex[:8]}"
    await kafka.anew_topic(partitions=3, name=f"{prefix}-llama-a")
    connector = build(kafka, prefix + "-{source}", partition=2)
    stream = Stream("llama-a", 0)
    messages = render(stream_records(stream, 3))
    await connector.connect()
    try:
        await connector.write(messages)
        assert await connector.health() is None
    finally:
        await connector.close()
    records = await consume(kafka, f"{prefix}-llama-a")
    assert [r.value for r in records] == [m.value for m in messages]
    assert {r.partition for r in records} == {2}


# -- broker outage ------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
async def test_broker_down_for_20s_loses_nothing_and_keeps_order(kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic(partitions=2)
    streams = [Stream("llama-a", 0), Stream("llama-b", 1)]
    connector = build(kafka, topic, request_timeout="3s")
    await connector.connect()
    written: list[Message] = []
    restarted = asyncio.Event()
    after_restart = 0

    async def produce() -> None:
        nonlocal after_restart
        seq = 0
        while after_restart < 20:
            messages = [m for s in streams for m in render(stream_records(s, 1, start=seq))]
            assert await deliver(connector, messages, budget=90) == []
            written.extend(messages)
            seq += 1
            after_restart += restarted.is_set()
            await asyncio.sleep(0.02)

    writer = asyncio.create_task(produce())
    try:
        await asyncio.sleep(1.0)
        await kafka.astop()
        down_since = time.monotonic()
        reason = None
        while reason is None and time.monotonic() - down_since < 15:
            await asyncio.sleep(0.5)
            reason = await connector.health()
        assert reason is not None, "health() kept saying healthy while the broker was down"
        await asyncio.sleep(max(0.0, 20 - (time.monotonic() - down_since)))
        await kafka.astart()
        restarted.set()
        await asyncio.wait_for(writer, 120)
        assert await connector.health() is None
    finally:
        writer.cancel()
        await connector.close()

    records = await consume(kafka, topic)
    for stream in streams:
        expected = [(m.record.seq, m.index) for m in written if m.record.stream == stream]
        seen: set[tuple[int, int | None]] = set()
        firsts = []
        for r in records:
            if r.key != stream.key.encode():
                continue
            _s, _r, _e, seq, index = identity(r)
            if (seq, index) not in seen:  # what a deduplicating consumer keeps
                seen.add((seq, index))
                firsts.append((seq, index))
        assert firsts == expected, f"{stream.key}: a message is missing or out of order"
        assert len({r.partition for r in records if r.key == stream.key.encode()}) == 1


# -- failure classification ---------------------------------------------------------------------


@pytest.mark.integration
async def test_message_larger_than_max_batch_bytes_is_permanent(kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic()
    stream = Stream("llama-a", 0)
    small = render(stream_records(stream, 3), granularity="batch")  # one message per record
    big = msgspec.structs.replace(small[1], value=b"x" * 100_000)
    connector = build(kafka, topic, granularity="batch", max_batch_bytes="64KiB")
    await connector.connect()
    try:
        with pytest.raises(Permanent, match="more than max_batch_bytes"):
            await connector.write([big])
        with pytest.raises(PartialFailure) as info:
            await connector.write([small[0], big, small[2]])
        assert info.value.failed == [1, 2]  # 2 waits for the refusal's announcement (bridge/connector.py)
        assert isinstance(info.value.cause, Permanent)
        assert info.value.errors[2].reason == "not_sent"
        await connector.write([small[2]])
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, topic)] == [small[0].value, small[2].value]


@pytest.mark.integration
async def test_message_refused_by_the_topic_is_permanent_and_the_rest_delivered(kafka: KafkaServer) -> None:
    # The topic takes at most 20000 bytes per batch, far below max_batch_bytes: the broker refuses.
    topic = await kafka.anew_topic(config={"max.message.bytes": "20000"})
    stream = Stream("llama-a", 0)
    small = render(stream_records(stream, 6))
    big = msgspec.structs.replace(render(stream_records(stream, 1, start=99))[0], value=b"y" * 30_000)
    messages = [*small[:3], big, *small[3:]]
    connector = build(kafka, topic)
    await connector.connect()
    try:
        assert await deliver(connector, messages) == [3]
        # The producer recovered (the refused batch broke its sequence numbers): writes go on.
        more = render(stream_records(stream, 2, start=6))
        await connector.write(more)
    finally:
        await connector.close()
    values = [r.value for r in await consume(kafka, topic)]
    firsts = list(dict.fromkeys(values))  # at least once across the retries: keep first copies
    assert firsts == [m.value for m in small + more]


@pytest.mark.integration
async def test_an_events_topic_whose_size_limit_is_below_the_smallest_record_is_refused(kafka: KafkaServer) -> None:
    """breaker118 B1 (2 of 2): an events topic with max.message.bytes=300 passed ``--check``; the
    run then dead-lettered every batch, and the EventsLost announcing them was refused too (not
    ready for good, nothing delivered). Below the smallest record the sink writes (that
    announcement), the topic is refused at connect and by ``--check``, naming the fix; raised, it
    is used."""
    topic = await kafka.anew_topic(config={"max.message.bytes": "300"})
    connector = build(kafka, topic)
    connector.configured_streams = [Stream("llama-a", 0)]  # (as --check sets them)
    try:
        with pytest.raises(NotConnected, match=f"events topic '{topic}' takes record batches of at most 300 bytes") as info:
            await connector.connect()
        assert info.value.reason == "events_topic_too_small" and "max.message.bytes=1048588" in str(info.value), info.value
        await kafka.set_topic_configs(topic, {"max.message.bytes": "1048588"})
        assert await connector.health() is None
        assert await deliver(connector, render(stream_records(Stream("llama-a", 0), 3))) == []
    finally:
        await connector.close()


@pytest.mark.integration
async def test_a_timestamp_window_too_short_is_refused_at_connect_and_a_skewed_clock_is_retried(
    kafka: KafkaServer, tmp_path: Path
) -> None:
    """breaker74 B1: a CreateTime topic whose message.timestamp.before.max.ms is shorter than a
    write may take refuses every record (INVALID_TIMESTAMP) whatever the clock, while ``--check``
    said ok and the not-ready sink blamed the bridge host's clock. Refused now at connect, by
    ``--check`` and in ``/readyz``, naming the setting and the fix. A refusal the configs cannot
    foresee (a skewed clock, the window shortened mid-run) is retried, never dead-lettered."""
    fix = "--add-config message.timestamp.before.max.ms=60000"
    topic = await kafka.anew_topic(config={"message.timestamp.before.max.ms": "0"})
    messages = render(stream_records(Stream("llama-a", 0), 3))
    connector = build(kafka, topic)
    try:
        with pytest.raises(NotConnected, match=f"topic '{topic}' refuses records stamped more than 0 ms") as info:
            await connector.connect()
        assert info.value.reason == "timestamp_window" and fix in str(info.value), info.value
        problem = await connector.health()
        assert problem is not None and topic in problem and fix in problem, problem
        await kafka.set_topic_configs(topic, {"message.timestamp.type": "LogAppendTime"})  # (the broker stamps)
        assert await connector.health() is None
        assert await deliver(connector, messages) == []
    finally:
        await connector.close()

    path = tmp_path / "bridge.yaml"
    state_topic = f"kvb-ts-state-{uuid.uuid4().hex[:8]}"
    await kafka.anew_topic(name=state_topic, config={"cleanup.policy": "compact", "message.timestamp.before.max.ms": "5000"})
    sink = {"type": "kafka", "name": "k", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    sink["state"] = {"enabled": True, "topic": state_topic}
    path.write_text(json.dumps({"sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:11"}], "sinks": [sink]}))
    code, out = await asyncio.to_thread(run_check, path)
    assert code == 3 and f"state topic '{state_topic}' refuses records stamped more than 5000 ms" in out, out

    # The window shortened under a connected sink (as a skewed clock is refused): retried, not dead-lettered.
    await kafka.set_topic_configs(topic, {"message.timestamp.type": "CreateTime", "message.timestamp.before.max.ms": "3600000"})
    connector = build(kafka, topic)
    await connector.connect()
    try:
        await kafka.set_topic_configs(topic, {"message.timestamp.before.max.ms": "0"})
        # Written as the runtime does (fold), without the backoff: what would be dead-lettered.
        everything = list(range(len(messages)))
        pending, dead, last = everything, [], None
        for _ in range(20):  # a record sent within the millisecond it was stamped passes: again
            try:
                await connector.write([messages[i] for i in pending])
                pending, last = everything, None
            except PartialFailure as exc:
                outcome = fold([messages[i] for i in pending], exc.errors)
                dead += [pending[i] for i, _ in outcome.dead]
                pending, last = [pending[i] for i in outcome.retry], exc.cause
            except ConnectorError as exc:
                dead += pending if isinstance(exc, Permanent) else []
                pending, last = ([] if isinstance(exc, Permanent) else pending), exc
            if not pending or (last is not None and last.reason != "batch_refused"):
                break
        print("dead-lettered", dead, "last error:", last)
        assert dead == [] and last is not None
        assert last.reason == "broker_refuses" and "InvalidTimestamp" in str(last)
        with pytest.raises(NotConnected) as info:  # the topic's configs read again: the window named
            await connector.write(messages)
        assert info.value.reason == "timestamp_window" and fix in str(info.value), info.value
        reason = await connector.health()
        assert reason is not None and topic in reason and fix in reason, reason
        await kafka.set_topic_configs(topic, {"message.timestamp.before.max.ms": "3600000"})
        assert await deliver(connector, messages) == []
        assert await connector.health() is None
    finally:
        await connector.close()


@pytest.mark.integration
async def test_unknown_topic_without_auto_creation_is_a_clear_error(kafka: KafkaServer) -> None:
    # The broker auto-creates topics; the producer asks it not to (allow.auto.create.topics).
    topic = f"kvb-missing-{uuid.uuid4().hex[:8]}"
    connector = build(kafka, topic, allow_auto_create_topics=False)
    try:
        with pytest.raises(NotConnected, match=f"sinks\\[kafka-test\\]: topic '{topic}' does not exist") as info:
            await connector.connect()
        assert info.value.reason == "unknown_topic"
        reason = await connector.health()
        assert reason is not None and topic in reason and "does not exist" in reason
        messages = render(stream_records(Stream("llama-a", 0), 2))
        with pytest.raises(NotConnected, match=topic):
            await connector.write(messages)
        # Once the topic exists the connector is healthy again without a write, and delivers.
        await kafka.anew_topic(name=topic)
        assert await connector.health() is None
        await connector.write(messages)
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, topic)] == [m.value for m in messages]


async def topic_exists(kafka: KafkaServer, topic: str) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        return topic in await admin.list_topics()
    finally:
        await admin.close()


async def delete_topic(kafka: KafkaServer, topic: str) -> None:
    """Delete ``topic`` and wait until the broker no longer lists it."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()
    deadline = time.monotonic() + 20
    while await topic_exists(kafka, topic):
        assert time.monotonic() < deadline, f"topic {topic} still listed"
        await asyncio.sleep(0.1)


@pytest.mark.integration
async def test_a_topic_deleted_during_a_run_is_never_created_again_by_metadata_and_its_loss_is_announced(
    kafka: KafkaServer,
) -> None:
    # The broker auto-creates topics and the sink allows it (the default) for a topic it never
    # saw; a topic it wrote to and that was deleted must not come back with the broker's defaults
    # through a metadata request (aiokafka's own refreshes allowed that), nor silently.
    topic = await kafka.anew_topic(partitions=2)
    stream = Stream("llama-a", 0)
    first = render(stream_records(stream, 5, epoch=3))
    later = render(stream_records(stream, 2, epoch=3, start=5))
    connector = build(kafka, topic, request_timeout="2s")
    await connector.connect()
    try:
        await connector.write(first)
        await delete_topic(kafka, topic)
        outcomes: list[str] = []
        lost: list[tuple[str, int, int, int]] = []
        for _ in range(6):  # the write in flight when the topic went away fails first (request_timeout)
            try:
                async with asyncio.timeout(8):
                    await connector.write(later)
                outcomes.append("delivered")
            except (ConnectorError, TimeoutError) as exc:
                outcomes.append(getattr(exc, "reason", type(exc).__name__))
                if isinstance(exc, SinkLost):
                    lost += [(s.key, e, a, b) for s, e, a, b in exc.spans]
            if outcomes[-1] in ("topic_deleted", "delivered"):
                break
        print("writes after the deletion:", outcomes, "topic exists:", await topic_exists(kafka, topic))
        assert outcomes[-1] == "topic_deleted", outcomes
        assert not await topic_exists(kafka, topic), "the topic was created again by a metadata request"
        # What the old topic held is announced, once (the runtime writes it ahead of the retry).
        assert lost == [("llama-a/0", 3, 0, 4)]
        reason = await connector.health()
        assert reason is not None and f"topic '{topic}' was deleted" in reason and "create it again" in reason, reason
        # The operator creates it again: the sink is ready and delivers, with nothing more to announce.
        await kafka.anew_topic(partitions=2, name=topic)
        assert await connector.health() is None
        await connector.write(later)
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, topic)] == [m.value for m in later]


@pytest.mark.integration
async def test_a_topic_deleted_and_created_again_between_two_writes_is_announced(kafka: KafkaServer) -> None:
    # No write saw the topic missing (an operator, or another client's auto-creation, was
    # quicker): the next write is stored in the new topic below the offsets the broker had
    # acknowledged in the old one, and raises SinkLost once stored (the runtime writes it again
    # after the announcement).
    topic = await kafka.anew_topic(partitions=2)
    stream = Stream("llama-a", 0)
    connector = build(kafka, topic, request_timeout="2s")
    await connector.connect()
    try:
        await connector.write(render(stream_records(stream, 5, epoch=3)))
        await delete_topic(kafka, topic)
        await kafka.anew_topic(partitions=2, name=topic)
        later = render(stream_records(stream, 2, epoch=3, start=5))
        outcomes: list[str] = []
        lost: list[tuple[str, int, int, int]] = []
        for _ in range(6):
            try:
                async with asyncio.timeout(8):
                    await connector.write(later)
                outcomes.append("delivered")
                if lost:
                    break
            except (ConnectorError, TimeoutError) as exc:
                outcomes.append(getattr(exc, "reason", type(exc).__name__))
                if isinstance(exc, SinkLost):
                    lost += [(s.key, e, a, b) for s, e, a, b in exc.spans]
        print("writes after the topic was created again:", outcomes)
        assert lost == [("llama-a/0", 3, 0, 4)], outcomes
    finally:
        await connector.close()


@pytest.mark.integration
@pytest.mark.parametrize("recreated", [False, True], ids=["deleted", "deleted and created again"])
async def test_a_topic_lost_while_the_sink_is_quiet_is_found_by_its_audit(kafka: KafkaServer, recreated: bool) -> None:
    # Issue 29 B2 on Kafka: no write comes (the engine is quiet), so only the runtime's audit
    # between writes can find the loss; it raises SinkLost once, with the span, and the audit of a
    # topic that holds what it acknowledged says nothing.
    topic = await kafka.anew_topic(partitions=2)
    stream = Stream("llama-a", 0)
    connector = build(kafka, topic, request_timeout="2s")
    await connector.connect()
    try:
        await connector.write(render(stream_records(stream, 5, epoch=3)))
        await connector.audit()  # nothing lost: nothing raised
        await delete_topic(kafka, topic)
        if recreated:
            await kafka.anew_topic(partitions=2, name=topic)
        with pytest.raises(ConnectorError) as found:
            await connector.audit()
        print("the audit after the loss:", found.value.reason, found.value)
        assert isinstance(found.value, SinkLost) or found.value.reason == "topic_deleted"
        lost = [(s.key, e, a, b) for s, e, a, b in found.value.spans] if isinstance(found.value, SinkLost) else []
        if not lost:  # deleted: the audit says so (not ready) and the loss comes with the write after it
            with pytest.raises(SinkLost) as again:
                await connector.write(render(stream_records(stream, 1, epoch=3, start=5)))
            lost = [(s.key, e, a, b) for s, e, a, b in again.value.spans]
        assert lost == [("llama-a/0", 3, 0, 4)]
        if recreated:
            await connector.audit()  # said once
    finally:
        await connector.close()


@pytest.mark.integration
@pytest.mark.parametrize("past", [10, 0], ids=["past_it", "to_exactly_it"])
async def test_a_topic_refilled_past_what_it_acknowledged_by_another_producer_is_found_by_its_audit(
    kafka: KafkaServer, past: int
) -> None:
    # breaker81 B3/B4: the partition lost the sink's records (here deleted and created again; a
    # broker that lost its newest segment alike) and another producer (a sharded bridge's other
    # pod) filled it past the offset the sink had acknowledged before its next look: the offsets
    # alone said nothing was lost. The record the sink acknowledged last must still be its own,
    # also when the partition ends exactly where the sink's did (breaker86 B2).
    topic = await kafka.anew_topic(partitions=1)
    stream = Stream("llama-a", 0)
    connector = build(kafka, topic, request_timeout="2s")
    other = build(kafka, topic, request_timeout="2s")
    await connector.connect()
    await other.connect()
    try:
        await connector.write(render(stream_records(stream, 5, epoch=3)))
        await other.write(render(stream_records(Stream("llama-b", 0), 2, epoch=7)))
        await connector.audit()  # another producer's records after its own: nothing lost
        await delete_topic(kafka, topic)
        await kafka.anew_topic(partitions=1, name=topic)
        acked = connector._acked[(topic, 0)]  # (the offset after the sink's last record)
        refill = render(stream_records(Stream("llama-b", 0), 10, epoch=8))
        if not past:  # records to exactly that offset (each batch is 3 messages at event granularity)
            assert acked % 3 == 0
            refill = render(stream_records(Stream("llama-b", 0), acked // 3, epoch=8))
        with pytest.raises(SinkLost):  # (stored, then the other producer finds it lost its own two)
            await other.write(refill)
        if past:
            await other.write(refill)
        ends = await connector._offsets([TopicPartition(topic, 0)], start=False)
        assert (ends[TopicPartition(topic, 0)] > acked) if past else (ends[TopicPartition(topic, 0)] == acked), ends
        with pytest.raises(SinkLost) as found:
            await connector.audit()
        assert [(s.key, e, a, b) for s, e, a, b in found.value.spans] == [("llama-a/0", 3, 0, 4)]
        await connector.audit()  # said once
    finally:
        await other.close()
        await connector.close()


@pytest.mark.integration
async def test_a_lost_topic_announces_every_epoch_it_held(kafka: KafkaServer) -> None:
    # Breaker finds (the Kafka twin of NATS's B5, then a crash loop): the topic held epoch 3's
    # seqs 0-4, after a restart epoch 4's seq 0, after another epoch 5's 0-2; lost, every span is
    # announced, not the newest epoch's alone (nor the two newest).
    topic = await kafka.anew_topic(partitions=2)
    stream = Stream("llama-a", 0)
    connector = build(kafka, topic, request_timeout="2s")
    await connector.connect()
    try:
        records = [*stream_records(stream, 5, epoch=3), source_reset(stream, 4, "publisher_restart", 0.0)]
        records += [*stream_records(stream, 1, epoch=4), source_reset(stream, 5, "publisher_restart", 0.0)]
        await connector.write(render([*records, *stream_records(stream, 3, epoch=5)]))
        await delete_topic(kafka, topic)
        await kafka.anew_topic(partitions=2, name=topic)
        with pytest.raises(SinkLost) as lost:
            await connector.audit()
        spans = sorted((s.key, e, a, b) for s, e, a, b in lost.value.spans)
        assert spans == [("llama-a/0", 3, 0, 4), ("llama-a/0", 4, 0, 0), ("llama-a/0", 5, 0, 2)]
    finally:
        await connector.close()


@pytest.mark.integration
async def test_templated_topic_missing_for_one_stream_fails_only_its_messages(kafka: KafkaServer) -> None:
    prefix = f"kvb-part-{uuid.uuid4().hex[:8]}"
    await kafka.anew_topic(name=f"{prefix}-llama-a")
    connector = build(kafka, prefix + "-{source}", allow_auto_create_topics=False)
    a = render(stream_records(Stream("llama-a", 0), 2))
    b = render(stream_records(Stream("qwen-b", 0), 2))
    messages = [x for pair in zip(a, b, strict=True) for x in pair]
    await connector.connect()
    try:
        with pytest.raises(PartialFailure) as info:
            await connector.write(messages)
        assert info.value.failed == [i for i, m in enumerate(messages) if m.record.stream.source == "qwen-b"]
        assert isinstance(info.value.cause, NotConnected) and f"{prefix}-qwen-b" in str(info.value.cause)
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, f"{prefix}-llama-a")] == [m.value for m in a]


@pytest.mark.integration
@pytest.mark.parametrize("create", [True, False], ids=["created-by-the-sink", "auto-created-by-the-broker"])
async def test_a_stream_whose_topic_collides_with_another_writers_is_refused_alone(kafka: KafkaServer, create: bool) -> None:
    """breaker100 B2: a discovered source whose topic ('kv.eng_x') differs from another sink's
    ('kv_eng_x') only by '.' and '_': Kafka refuses to create it, and the whole sink went down
    (create_topic, retried for ever: its other streams stored 0-1 of 6 batches, 2 of 2). The stream
    is refused for itself (topic_clash), and the sink's other streams go on."""
    prefix = f"kvb_clash_{uuid.uuid4().hex[:8]}"
    await kafka.anew_topic(name=f"{prefix}_eng_x")  # (another sink's)
    make = {"create_topics": {"enabled": True, "partitions": 1}} if create else {"allow_auto_create_topics": True}
    connector = build(kafka, prefix + ".{source}", **make)
    x = render(stream_records(Stream("eng_x", 0), 2))
    y = render(stream_records(Stream("eng_y", 0), 2))
    messages = [m for pair in zip(x, y, strict=True) for m in pair]
    await connector.connect()
    try:
        with pytest.raises(PartialFailure) as info:
            await connector.write(messages)
        refused = {i: (type(e).__name__, e.reason) for i, e in info.value.errors.items()}
        want = {i: ("StreamRefused", "topic_clash") for i, m in enumerate(messages) if m.record.stream.source == "eng_x"}
        assert refused == want, refused
        assert f"{prefix}.eng_x" in str(info.value.errors[0]), info.value.errors[0]
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, f"{prefix}.eng_y")] == [m.value for m in y]


@pytest.mark.integration
async def test_what_a_topic_held_before_this_process_leaves_its_copies_out(kafka: KafkaServer) -> None:
    """breaker102 B1: after a restart the replay wrote copies of seqs 3 and 4 after the 0..12 the
    topic held; positions() names the last message, the copy of 4, so a drop sink announced 5..12
    lost (6 of 6). positions_before_run() reads the partition below this process's first record."""
    topic = await kafka.anew_topic(1)
    stream = Stream("llama-a", 0)
    records = stream_records(stream, 13, epoch=1)
    await a_run_writes(kafka, topic, records)
    again = build(kafka, topic, granularity="batch")
    await again.connect()
    try:
        assert (await again.positions_before_run([stream]))[stream.key].seq == 12  # (nothing written yet)
        await again.write(render(records[3:5], granularity="batch"))  # the replay's copies
        last = (await again.positions([stream]))[stream.key]
        held = (await again.positions_before_run([stream]))[stream.key]
        other = (await again.positions_before_run([Stream("qwen-b", 0)]))["qwen-b/0"]
    finally:
        await again.close()
    assert last is not None and (last.epoch, last.seq) == (1, 4)
    assert held is not None and (held.epoch, held.seq) == (1, 12)
    assert other is None  # (a stream the partition never held)


@pytest.mark.integration
async def test_what_a_topic_held_before_partitions_were_added_is_found_in_the_old_partition(kafka: KafkaServer) -> None:
    """breaker105 E1: partitions added between two runs sent the stream's key to a new partition,
    which held only this run's copies: positions_before_run said it held nothing before, and a drop
    sink announced 5..12 lost while partition 0 held them (6 of 6). The partitions its key went to
    while the topic had fewer are read too."""
    from connectors.kafka import _PARTITIONER

    topic = await kafka.anew_topic(1)
    stream = next(s for s in (Stream(f"eng-{n}", 0) for n in range(64)) if _PARTITIONER(s.key.encode(), [0, 1], [0, 1]) == 1)
    records = stream_records(stream, 13, epoch=1)
    await a_run_writes(kafka, topic, records)
    await add_partitions(kafka.bootstrap_servers, topic, 2)
    again = build(kafka, topic, granularity="batch")
    await again.connect()
    try:
        await again.write(render(records[3:5], granularity="batch"))  # the replay's copies, in partition 1
        held = (await again.positions_before_run([stream]))[stream.key]
    finally:
        await again.close()
    assert held is not None and (held.epoch, held.seq) == (1, 12)


@pytest.mark.integration
@pytest.mark.parametrize("grown", [4, 3], ids=["to a third partition", "back to the first"])
async def test_what_a_topic_held_before_partitions_were_added_twice_is_the_latest_of_them(kafka: KafkaServer, grown: int) -> None:
    """breaker106 F1: partitions added twice (1, 2, then ``grown``) between three runs; run 2 wrote
    3..12 to partition 1. The oldest partition holding the stream answered (run 1's 2), or the
    current one did when the key went back to partition 0, and a drop sink announced 7..12 lost
    while partition 1 held them (6 of 6). Every partition the key went to is read: the latest wins."""
    from connectors.kafka import _PARTITIONER

    def went(s: Stream, n: int) -> int:
        return _PARTITIONER(s.key.encode(), list(range(n)), list(range(n)))

    topic = await kafka.anew_topic(1)
    last = (lambda p: p == 0) if grown == 3 else (lambda p: p not in (0, 1))
    stream = next(s for s in (Stream(f"eng-{n}", 0) for n in range(256)) if went(s, 2) == 1 and last(went(s, grown)))
    records = stream_records(stream, 13, epoch=1)
    for part, total in ((slice(0, 3), 2), (slice(3, 13), grown)):
        await a_run_writes(kafka, topic, records[part])
        await add_partitions(kafka.bootstrap_servers, topic, total)
    again = build(kafka, topic, granularity="batch")
    await again.connect()
    try:
        await again.write(render(records[5:7], granularity="batch"))  # the replay's copies
        held = (await again.positions_before_run([stream]))[stream.key]
    finally:
        await again.close()
    assert held is not None and (held.epoch, held.seq) == (1, 12)


@pytest.mark.integration
async def test_a_label_value_a_topic_name_cannot_hold_is_made_valid(kafka: KafkaServer) -> None:
    """Issue 29 C4: ``topic: kv-{labels.model}`` with design.md's own example label value
    ``meta-llama/Llama-3.1-8B`` rendered an invalid topic name: --check said ok, the run was
    ready and every batch of the stream was dead-lettered. Each value's characters a topic name
    cannot hold now become ``_`` (as NATS does in subjects); a name over 249 characters is cut,
    ending in a hash; a template whose own text cannot make a topic name is refused at config."""
    prefix = f"kvb-lbl-{uuid.uuid4().hex[:8]}"
    connector = build(kafka, prefix + "-{labels.model}", create_topics={"enabled": True, "partitions": 1})
    llama = render(stream_records(Stream("e0", 0, {"model": "meta-llama/Llama-3.1-8B"}), 3))
    long = render(stream_records(Stream("e1", 0, {"model": "m" * 300}), 2))
    await connector.connect()
    try:
        await connector.write(llama + long)
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, f"{prefix}-meta-llama_Llama-3.1-8B")] == [m.value for m in llama]
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        (cut,) = [t for t in await admin.list_topics() if t.startswith(f"{prefix}-mmm")]
    finally:
        await admin.close()
    assert len(cut) == 249 and cut.startswith(f"{prefix}-{'m' * 200}")
    assert [r.value for r in await consume(kafka, cut)] == [m.value for m in long]
    with pytest.raises(ConfigError, match=r"'kv/\{labels.model\}' is not a valid Kafka topic name: it holds '/'"):
        build(kafka, "kv/{labels.model}")


@pytest.mark.integration
async def test_create_topics_creates_missing_topic_with_partitions_and_configs(kafka: KafkaServer) -> None:
    topic = f"kvb-created-{uuid.uuid4().hex[:8]}"
    connector = build(
        kafka,
        topic,
        allow_auto_create_topics=False,
        create_topics={"enabled": True, "partitions": 3, "configs": {"retention.ms": "3600000"}},
    )
    await connector.connect()
    try:
        await connector.write(render(stream_records(Stream("llama-a", 0), 1)))
    finally:
        await connector.close()
    assert {r.partition for r in await consume(kafka, topic)} <= {0, 1, 2}
    assert len(await partitions_of(kafka, topic)) == 3


def run_check(path: Path) -> tuple[int, str]:
    """``--check`` of the config file at ``path``: its exit code and what it printed."""
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        code = check(str(path))
    return code, out.getvalue()


@pytest.mark.integration
async def test_a_log_compacted_events_topic_is_refused_at_connect_in_check_and_at_first_write(
    kafka: KafkaServer, tmp_path: Path
) -> None:
    """breaker57 B3: the key is the stream, so a compacted events topic (cleanup.policy compact,
    or compact,delete) keeps each stream's last message and deletes the rest the broker
    acknowledged, unannounced (69 of 75 seqs gone), while ``--check`` said "reachable" and the sink
    stayed ready. Refused now, naming the topic and the fix: at connect (the sink not ready until
    the policy is fixed), by ``--check`` (a templated topic's too: read in one request), and at the
    first write to a templated topic."""
    fix = "--add-config cleanup.policy=delete"
    compacted = await kafka.anew_topic(config={"cleanup.policy": "compact"})
    connector = build(kafka, compacted)
    messages = render(stream_records(Stream("llama-a", 0), 2))
    try:
        with pytest.raises(NotConnected, match=f"events topic '{compacted}' is log-compacted") as info:
            await connector.connect()
        assert info.value.reason == "events_topic_compacted" and fix in str(info.value)
        problem = await connector.health()
        assert problem is not None and compacted in problem and fix in problem, problem
        with pytest.raises(NotConnected, match="is log-compacted"):
            await connector.write(messages)
        await kafka.set_topic_configs(compacted, {"cleanup.policy": "delete"})
        assert await connector.health() is None
        await connector.write(messages)
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, compacted)] == [m.value for m in messages]

    # Compacted during a run: what the sink wrote there may be gone; the audit announces it.
    connector = build(kafka, compacted)
    try:
        await connector.connect()
        await connector.write(render(stream_records(Stream("llama-a", 0), 5, epoch=3)))
        await connector.audit()  # nothing lost: nothing raised
        await kafka.set_topic_configs(compacted, {"cleanup.policy": "compact"})
        with pytest.raises(SinkLost) as lost:
            await connector.audit()
        assert [(st.key, *span) for st, *span in lost.value.spans] == [("llama-a/0", 3, 0, 4)]
        problem = await connector.health()
        assert problem is not None and "is log-compacted" in problem and fix in problem, problem
        await kafka.set_topic_configs(compacted, {"cleanup.policy": "delete"})
        assert await connector.health() is None
    finally:
        await connector.close()

    # --check, a templated topic rendered for each source: the compacted one named, the plain one not.
    prefix = f"kvb-compacted-{uuid.uuid4().hex[:8]}"
    await kafka.anew_topic(name=f"{prefix}-llama-a")
    await kafka.anew_topic(name=f"{prefix}-qwen-b", config={"cleanup.policy": "compact,delete"})
    sink = {"type": "kafka", "name": "k", "bootstrap_servers": kafka.bootstrap_servers, "topic": prefix + "-{source}"}
    sources = [{"name": name, "endpoint": f"tcp://127.0.0.1:{port}"} for name, port in (("llama-a", 11), ("qwen-b", 21))]
    path = tmp_path / "bridge.yaml"
    path.write_text(json.dumps({"sources": sources, "sinks": [sink]}))
    code, out = await asyncio.to_thread(run_check, path)
    assert code == 3 and f"events topic '{prefix}-qwen-b' is log-compacted (cleanup.policy=compact,delete)" in out, out
    assert fix in out and f"'{prefix}-llama-a'" not in out, out

    # A run learns a templated topic at its first write: only that topic's messages are refused.
    connector = build(kafka, prefix + "-{source}", allow_auto_create_topics=False)
    a = render(stream_records(Stream("llama-a", 0), 2))
    b = render(stream_records(Stream("qwen-b", 0), 2))
    try:
        await connector.connect()
        with pytest.raises(PartialFailure) as partial:
            await connector.write(a + b)
        assert partial.value.failed == list(range(len(a), len(a) + len(b)))
        cause = partial.value.cause
        assert isinstance(cause, NotConnected) and cause.reason == "events_topic_compacted", cause
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, f"{prefix}-llama-a")] == [m.value for m in a]


@pytest.mark.integration
async def test_unreachable_broker_is_not_connected_naming_sink_and_server() -> None:
    from tests.infra.servers import free_port

    address = f"127.0.0.1:{free_port()}"
    connector = build(address, "kv-events", request_timeout="2s")
    with pytest.raises(NotConnected, match=rf"sinks\[kafka-test\]: cannot connect to {address} \(connection refused\)"):
        await connector.connect()
    assert await connector.health() == f"cannot connect to {address} (connection refused)"
    with pytest.raises(NotConnected):
        await connector.write(render(stream_records(Stream("llama-a", 0), 1)))
    await connector.close()
    await connector.close()  # twice: still no error


CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}


def stored_codecs(kafka: KafkaServer, topic: str, partition: int = 0) -> list[str]:
    """The compression of every record batch the broker stored for ``topic``[``partition``], read
    from its log segments (record batch v2: baseOffset int64, batchLength int32, partitionLeaderEpoch
    int32, magic int8, crc uint32, attributes int16 whose low 3 bits are the codec)."""
    codecs: list[str] = []
    for segment in sorted((kafka.data_dir / f"{topic}-{partition}").glob("*.log")):
        data = segment.read_bytes()
        at = 0
        while at + 23 <= len(data):
            (length,) = struct.unpack_from(">i", data, at + 8)
            if length <= 0:
                break  # preallocated tail
            magic, _crc, attributes = struct.unpack_from(">bIh", data, at + 16)
            assert magic == 2, f"record batch magic {magic} in {segment}"
            codecs.append(CODECS[attributes & 0x07])
            at += 12 + length
    return codecs


@pytest.mark.integration
@pytest.mark.parametrize("codec", ["none", "gzip", "zstd", "lz4", "snappy"])
async def test_compression_is_applied_to_the_stored_batches(kafka: KafkaServer, codec: str) -> None:
    # Consumers decompress transparently, so the values alone cannot tell: read the codec of the
    # record batches the broker stored.
    assert has_zstd(), "cramjam (a dependency of the bridge) is missing: zstd, lz4 and snappy need it"
    topic = await kafka.anew_topic()
    messages = render(stream_records(Stream("llama-a", 0), 5), "msgpack", "batch")
    connector = build(kafka, topic, compression=codec, fmt="msgpack", granularity="batch")
    await connector.connect()
    try:
        await connector.write(messages[:2])
        await connector.write(messages[2:])
    finally:
        await connector.close()
    assert [r.value for r in await consume(kafka, topic)] == [m.value for m in messages]
    assert stored_codecs(kafka, topic) == [codec, codec]


@pytest.mark.integration
async def test_sasl_password_never_logged_when_handshake_fails(kafka: KafkaServer, caplog: pytest.LogCaptureFixture) -> None:
    # The PLAINTEXT listener does not speak SASL: the connection attempt fails after sending.
    caplog.set_level(logging.DEBUG)
    connector = build(
        kafka,
        "kv-events",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="bridge",
        sasl_password=SECRET,
        request_timeout="3s",
    )
    with pytest.raises(NotConnected) as info:
        await connector.connect()
    texts = [str(info.value), repr(info.value), str(await connector.health()), caplog.text, repr(connector)]
    texts += [str(info.value.__cause__ or ""), str(info.value.__context__ or "")]
    assert not [t for t in texts if SECRET in t]
    assert "cannot connect to" in str(info.value)
    await connector.close()


@pytest.fixture(scope="module")
def sasl_kafka(infra_run_dir: Path) -> Iterator[KafkaServer]:
    """A broker of this module's own with a SASL_PLAINTEXT (PLAIN) listener besides PLAINTEXT, that
    creates no topic by itself (auto.create.topics.enable=false)."""
    jaas = f'org.apache.kafka.common.security.plain.PlainLoginModule required user_bridge="{SECRET}";'
    server = KafkaServer(
        infra_run_dir / "kafka-sasl",
        listeners={"SASL_PLAINTEXT": "SASL_PLAINTEXT"},
        extra_properties={
            "sasl.enabled.mechanisms": "PLAIN",
            "listener.name.sasl_plaintext.plain.sasl.jaas.config": jaas,
            "auto.create.topics.enable": "false",
        },
    )
    try:
        server.start()
    except ServerError as exc:
        server.kill()
        unavailable("kafka with SASL", exc)
    yield server
    server.remove()


def formatted(records: Sequence[logging.LogRecord]) -> str:
    """The log lines the bridge writes for ``records``, in both of its formats (they redact secrets)."""
    return "\n".join(f.format(r) for r in records for f in (TextFormatter(), JsonFormatter()))


@pytest.mark.integration
async def test_sasl_plain_delivers_and_never_logs_the_password(sasl_kafka: KafkaServer, caplog: pytest.LogCaptureFixture) -> None:
    # DEBUG on: aiokafka logs every request it sends, the SASL PLAIN authentication included,
    # whose body holds the password; the bridge's log formatters redact every Secret.
    caplog.set_level(logging.DEBUG)
    topic = await sasl_kafka.anew_topic()
    sasl = f"127.0.0.1:{sasl_kafka.ports['SASL_PLAINTEXT']}"
    messages = render(stream_records(Stream("llama-a", 0), 2))
    connector = build(sasl, topic, security_protocol="SASL_PLAINTEXT", sasl_username="bridge", sasl_password=SECRET)
    await connector.connect()
    try:
        await connector.write(messages)
        assert await connector.health() is None
    finally:
        await connector.close()
    bodies = [r for r in caplog.records if "SaslAuthenticateRequest" in r.getMessage()]
    assert bodies and SECRET in bodies[0].getMessage()  # the record carries it: the test can fail
    assert "SaslAuthenticateRequest" in formatted(caplog.records)
    assert SECRET not in formatted(caplog.records)
    assert [r.value for r in await consume(sasl_kafka, topic)] == [m.value for m in messages]

    wrong = "wr0ng-" + SECRET
    connector = build(sasl, topic, security_protocol="SASL_PLAINTEXT", sasl_username="bridge", sasl_password=wrong)
    with pytest.raises(NotConnected, match=r"cannot connect to .*[Aa]uthentication") as info:
        await connector.connect()
    await connector.close()
    texts = [formatted(caplog.records), str(info.value), str(await connector.health())]
    assert not [t for t in texts if SECRET in t or wrong in t]


@pytest.mark.integration
def test_check_names_a_missing_topic_the_broker_would_not_auto_create(sasl_kafka: KafkaServer, tmp_path: Path) -> None:
    """breaker93 B4: a broker with auto.create.topics.enable=false, the topic missing, the sink
    left to the broker's auto-creation (the default): ``--check`` said "config ok", and the run
    stayed not ready (unknown_topic) for ever, 3 of 3. ``--check`` reads the broker's setting."""
    topic = f"kvb-missing-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "c.yaml"
    path.write_text(
        "sources:\n  - {name: a, endpoint: 'tcp://127.0.0.1:1'}\n"
        f"sinks:\n  - {{type: kafka, name: k, bootstrap_servers: '{sasl_kafka.bootstrap_servers}', topic: {topic}}}\n"
    )
    code, out = run_check(path)
    assert code == 3, out
    assert (
        f"topic '{topic}' does not exist on {sasl_kafka.bootstrap_servers} and the broker does not auto-create topics "
        "(auto.create.topics.enable=false); create it, or set create_topics.enabled: true"
    ) in out, out
