"""Smoke tests of the real test servers: one round trip on each, and data surviving a restart."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from pathlib import Path

import nats
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tests.infra.servers import KafkaServer, NatsServer, PrometheusFactory, RedisServer

pytestmark = pytest.mark.integration


async def _consume(kafka: KafkaServer, topic: str, count: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka.bootstrap_servers,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        values: list[bytes] = []
        while len(values) < count:
            msg = await asyncio.wait_for(consumer.getone(), 30)
            values.append(msg.value)
        return values
    finally:
        await consumer.stop()


async def _produce(kafka: KafkaServer, topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=b"llama-a/0")
    finally:
        await producer.stop()


async def test_kafka_produce_consume(kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic(partitions=1)
    await _produce(kafka, topic, b"hello")
    assert await _consume(kafka, topic, 1) == [b"hello"]


async def test_kafka_restart_keeps_port_and_data(kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic()
    await _produce(kafka, topic, b"before")
    address = kafka.bootstrap_servers
    await kafka.arestart()
    assert kafka.bootstrap_servers == address
    await _produce(kafka, topic, b"after")
    assert await _consume(kafka, topic, 2) == [b"before", b"after"]


async def test_redis_xadd_xrange(fresh_redis: RedisServer) -> None:
    client = aioredis.Redis.from_url(fresh_redis.url)
    try:
        entry_id = await client.xadd("kvb:smoke", {"seq": "1", "payload": b"\x00\x01"})
        entries = await client.xrange("kvb:smoke")
    finally:
        await client.aclose()
    assert entries == [(entry_id, {b"seq": b"1", b"payload": b"\x00\x01"})]


async def test_redis_restart_keeps_data(fresh_redis: RedisServer) -> None:
    client = aioredis.Redis.from_url(fresh_redis.url)
    try:
        await client.xadd("kvb:durable", {"seq": "7"})
    finally:
        await client.aclose()
    await fresh_redis.arestart()
    client = aioredis.Redis.from_url(fresh_redis.url)
    try:
        assert await client.xlen("kvb:durable") == 1
    finally:
        await client.aclose()


async def test_nats_pubsub_and_jetstream(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        sub = await nc.subscribe("kvb.smoke.core")
        await nc.publish("kvb.smoke.core", b"ping")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"ping"

        js = nc.jetstream()
        stream = f"KVB_SMOKE_{uuid.uuid4().hex[:8].upper()}"
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        first = await js.publish(f"{stream}.ev", b"one", headers={"Nats-Msg-Id": "llama-a/0/1/42/0"})
        again = await js.publish(f"{stream}.ev", b"one", headers={"Nats-Msg-Id": "llama-a/0/1/42/0"})
        assert (first.stream, first.seq, first.duplicate) == (stream, 1, None)
        assert again.duplicate is True
        await js.delete_stream(stream)
    finally:
        await nc.close()


async def test_nats_restart_keeps_jetstream(nats_server: NatsServer) -> None:
    stream = f"KVB_DURABLE_{uuid.uuid4().hex[:8].upper()}"
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        await js.publish(f"{stream}.ev", b"kept")
    finally:
        await nc.close()
    await nats_server.arestart()
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        assert info.state.messages == 1
        await js.delete_stream(stream)
    finally:
        await nc.close()


async def test_prometheus_scrapes_target(prometheus_factory: PrometheusFactory) -> None:
    body = b"# TYPE kvb_smoke_total counter\nkvb_smoke_total 3\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    target = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with target:
        port = target.sockets[0].getsockname()[1]
        prom = await asyncio.to_thread(prometheus_factory, [f"127.0.0.1:{port}"], job="smoke")
        up = await prom.await_for('up{job="smoke"} == 1', within=30)
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{port}"
        value = await prom.await_for('kvb_smoke_total{job="smoke"}', within=30)
        assert value[0]["value"][1] == "3"


def test_promtool_checks_rules(promtool: str, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text("groups:\n  - name: kvb\n    rules:\n      - alert: KvBridgeDown\n        expr: up == 0\n        for: 1m\n")
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
