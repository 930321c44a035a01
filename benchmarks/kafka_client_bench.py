"""Throughput of the Kafka sink against bare aiokafka on a local broker.

    .venv/bin/python -m benchmarks.kafka_client_bench [--bootstrap-servers HOST:PORT] [--batches N]

Without --bootstrap-servers it uses the broker left running by ``python -m tests.infra start
kafka``. For json/event and raw/batch messages rendered from the same engine batches, it
prints events/s and messages/s of:

- ``connector``: KafkaConnector.write (per-partition record batches, awaited acks);
- ``aiokafka batch``: bare create_batch()/send_batch() per partition, then await every future;
- ``aiokafka send``: bare send() of every message without awaiting, then await every future.

Every mode writes the same messages, in writes of ``--write-size`` messages (the runtime's
default batch.max_messages), to a fresh 4-partition topic, acks=all and idempotence on.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner

from bridge.config import SinkConfig, convert_options
from bridge.formats import Message, Renderer
from bridge.records import Stream
from connectors.kafka import KafkaConnector, KafkaOptions
from tests.support.records import stream_records

STREAMS = [Stream("llama-a", r) for r in range(4)] + [Stream("qwen-b", r) for r in range(4)]


def messages_for(fmt: str, granularity: str, batches: int) -> list[Message]:
    renderer = Renderer(fmt, granularity)  # type: ignore[arg-type]
    per_stream = max(1, batches // len(STREAMS))
    records = [r for seq in range(per_stream) for s in STREAMS for r in stream_records(s, 1, start=seq)]
    return [m for r in records for m in renderer.render(r)]


async def new_topic(servers: str) -> str:
    topic = f"kvb-bench-{uuid.uuid4().hex[:10]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 4, 1)])
    finally:
        await admin.close()
    await asyncio.sleep(0.5)  # leaders elected
    return topic


async def run_connector(servers: str, topic: str, writes: Sequence[Sequence[Message]]) -> None:
    options = convert_options({"bootstrap_servers": servers, "topic": topic}, KafkaOptions, "bench")
    connector = KafkaConnector("bench", options, SinkConfig(type="kafka"))
    await connector.connect()
    try:
        for write in writes:
            await connector.write(write)
    finally:
        await connector.close()


async def _bare_producer(servers: str, topic: str) -> tuple[AIOKafkaProducer, list[int]]:
    producer = AIOKafkaProducer(bootstrap_servers=servers, enable_idempotence=True, max_batch_size=2**20)
    await producer.start()
    return producer, sorted(await producer.partitions_for(topic))


async def run_bare_batch(servers: str, topic: str, writes: Sequence[Sequence[Message]]) -> None:
    producer, partitions = await _bare_producer(servers, topic)
    partitioner = DefaultPartitioner()
    try:
        for write in writes:
            builders: dict[int, list[Any]] = {}
            for m in write:
                p = partitioner(m.key, partitions, partitions)
                chain = builders.setdefault(p, [producer.create_batch()])
                headers = [(k, v.encode()) for k, v in m.headers.items()]
                if chain[-1].append(timestamp=None, key=m.key, value=m.value, headers=headers) is None:
                    chain.append(producer.create_batch())
                    chain[-1].append(timestamp=None, key=m.key, value=m.value, headers=headers)
            futures = []
            for level in range(max(len(c) for c in builders.values())):
                for p, chain in builders.items():
                    if level < len(chain):
                        futures.append(await producer.send_batch(chain[level], topic, partition=p))
            await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def run_bare_send(servers: str, topic: str, writes: Sequence[Sequence[Message]]) -> None:
    producer, _ = await _bare_producer(servers, topic)
    try:
        for write in writes:
            futures = [
                await producer.send(topic, m.value, key=m.key, headers=[(k, v.encode()) for k, v in m.headers.items()])
                for m in write
            ]
            await asyncio.gather(*futures)
    finally:
        await producer.stop()


Runner = Callable[[str, str, Sequence[Sequence[Message]]], Awaitable[None]]
MODES: dict[str, Runner] = {"connector": run_connector, "aiokafka batch": run_bare_batch, "aiokafka send": run_bare_send}


async def main(servers: str, batches: int, write_size: int, rounds: int) -> None:
    print(f"broker {servers}; {len(STREAMS)} streams, 4 partitions, writes of {write_size} messages, best of {rounds}")
    for fmt, granularity in (("json", "event"), ("raw", "batch")):
        messages = messages_for(fmt, granularity, batches)
        events = sum(1 if m.index is not None else len(m.record.events) for m in messages)
        size = sum(len(m.value) for m in messages)
        writes = [messages[i : i + write_size] for i in range(0, len(messages), write_size)]
        print(f"\n{fmt}/{granularity}: {len(messages)} messages, {events} events, {size / 2**20:.1f} MiB")
        for name, run in MODES.items():
            best = float("inf")
            for _ in range(rounds):
                topic = await new_topic(servers)
                began = time.perf_counter()
                await run(servers, topic, writes)
                best = min(best, time.perf_counter() - began)
            print(
                f"  {name:<15} {events / best:>10,.0f} events/s  {len(messages) / best:>10,.0f} msg/s"
                f"  {size / best / 2**20:>7.1f} MiB/s  ({best:.2f}s)"
            )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", help="default: the broker of `python -m tests.infra start kafka`")
    parser.add_argument("--batches", type=int, default=20000, help="engine batches (3 events each)")
    parser.add_argument("--write-size", type=int, default=2000, help="messages per write")
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode; the best is shown")
    args = parser.parse_args()
    servers = args.bootstrap_servers
    if not servers:
        from tests.infra.servers import StateFile

        running = StateFile().running("kafka")
        if running is None:
            parser.error("no broker: pass --bootstrap-servers or run `python -m tests.infra start kafka`")
        servers = running.address
    asyncio.run(main(servers, args.batches, args.write_size, args.rounds))


if __name__ == "__main__":
    cli()
