"""Prompt privacy on the real brokers: ``token_ids: drop`` and ``token_ids: hash`` per sink.

Two scripted engines (two streams) publish BlockStored events whose token blocks partly coincide
(two shared blocks, then one block of their own). One bridge writes them to each broker through
four sinks: ``drop`` as json events, ``drop`` as msgpack batches, ``hash`` under one key and
``hash`` under another. Then engine A restarts, the bridge restarts, and A publishes again.

- With ``drop``: no message stored on the broker holds any published token id, searched in the
  raw bytes of every message (values, and headers / entry fields), as decimal text and as its
  msgpack encoding.
- With ``hash``: a block's hash is the documented HMAC-SHA256 of its tokens, truncated, so equal
  blocks hash alike across streams, engine restarts and bridge restarts; under another key the
  hashes differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bridge.config import from_data
from bridge.runtime import Bridge
from tests.infra.servers import KafkaServer, NatsServer, RedisServer
from tests.support.harness import free_ports, wait_for
from tests.support.schema import check_message
from tests.support.scripted_engine import MARK, ScriptedEngine

pytestmark = pytest.mark.integration

KEY = "privacy-test-key-0123456789"
OTHER_KEY = "another-privacy-key-98765"
BLOCK = 4
BASE = 3_000_000_000  # token ids no header, hash or timestamp of the test contains by chance
SHARED = [[BASE + 1, BASE + 2, BASE + 3, BASE + 4], [BASE + 5, BASE + 6, BASE + 7, BASE + 8]]
BATCHES = 5  # per engine and phase

Stored = tuple[dict[str, str], bytes]  # one stored message: its text headers, its raw value


class TokenFactory:
    """BlockStored events: the two shared blocks, then a block only this engine ever sends."""

    def __init__(self, engine: int) -> None:
        self.engine = engine
        self.n = 0
        self.published: list[list[int]] = []

    def stored_event(self) -> dict[str, Any]:
        self.n += 1
        own = [BASE + 1000 * (self.engine + 1) + 10 * self.n + i for i in range(BLOCK)]
        tokens = SHARED[0] + SHARED[1] + own
        self.published.append(tokens)
        return {
            "type": "BlockStored",
            "block_hashes": [0, 1, 2],
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": BLOCK,
            "medium": "GPU",
            "lookahead_token_ids": [BASE + 999],
        }


def mac(key: str, tokens: list[int]) -> str:
    """The documented token block hash (hash_format: hex), computed independently of the bridge."""
    data = b"".join(t.to_bytes(8, "big") for t in tokens)
    return hmac.new(key.encode(), data, hashlib.sha256).digest()[:8].hex()


def sinks(make: Callable[[str], dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """The four sinks, each to its own destination (``make(name)`` gives its connector keys)."""
    common = {"batch": {"linger": 0}, "retry": {"initial_backoff": "50ms", "max_backoff": "500ms"}}
    shapes = [
        {"format": "json", "granularity": "event", "token_ids": "drop"},
        {"format": "msgpack", "granularity": "batch", "token_ids": "drop"},
        {"format": "json", "granularity": "event", "hash_format": "hex", "token_ids": "hash", "token_ids_key": "${KEY_A}"},
        {"format": "json", "granularity": "event", "hash_format": "hex", "token_ids": "hash", "token_ids_key": "${KEY_B}"},
    ]
    return [{"name": name, **shape, **common, **make(name)} for name, shape in zip(names, shapes, strict=True)]


NAMES = ["drop-json", "drop-msgpack", "hash-a", "hash-b"]


@asynccontextmanager
async def engines() -> AsyncIterator[tuple[list[ScriptedEngine], list[TokenFactory], list[dict[str, Any]]]]:
    ports = free_ports(4)
    factories = [TokenFactory(0), TokenFactory(1)]
    async with ScriptedEngine(ports[0], ports[1]) as a, ScriptedEngine(ports[2], ports[3]) as b:
        for engine, factory in zip((a, b), factories, strict=True):
            engine._factory = factory  # type: ignore[assignment]
        sources = [
            {"name": name, "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
            for name, live, replay in (("engine-a", ports[0], ports[1]), ("engine-b", ports[2], ports[3]))
        ]
        yield [a, b], factories, sources


async def run_once(cfg: dict[str, Any], publish: Callable[[], Awaitable[int]]) -> None:
    """One bridge life: the engines publish, then the bridge starts (and replays their buffers from
    the start: no subscription race), until every sink has written all of it."""
    expected = await publish()
    bridge = Bridge(from_data(json.loads(json.dumps(cfg)), env={"KEY_A": KEY, "KEY_B": OTHER_KEY}))
    await bridge.start()
    try:

        def delivered() -> bool:
            samples = bridge.metrics.registry.get_sample_value
            return all(
                (samples("kv_bridge_sink_batches_total", {"sink": n, "outcome": "delivered"}) or 0) >= expected for n in NAMES
            )

        await wait_for(delivered, timeout=60, what=f"{expected} batches delivered to every sink")
    finally:
        await bridge.stop()


async def scenario(tmp: Path, make: Callable[[str], dict[str, Any]]) -> list[TokenFactory]:
    """Phase 1: both engines publish; phase 2: engine A restarts, so does the bridge, A publishes."""
    async with engines() as (live, factories, sources):
        cfg = {
            "sources": sources,
            "sinks": sinks(make, NAMES),
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp / "dead.jsonl")},
            # Resuming from it, the bridge opens a new epoch for A's new instance (Redis entry ids
            # and NATS message ids are per epoch: the same epoch would be taken for re-sends).
            "checkpoint": {"path": str(tmp / "checkpoint.json"), "interval": "100ms"},
            "replay": {"timeout": "500ms", "initial_backoff": "50ms", "max_backoff": "500ms"},
        }

        async def first() -> int:
            for engine in live:
                await engine.publish(BATCHES)
            return 2 * BATCHES

        async def second() -> int:
            await live[0].restart()
            await live[0].publish(BATCHES)
            return BATCHES

        await run_once(cfg, first)
        await run_once(cfg, second)
        return factories


def check(stored: dict[str, list[Stored]], factories: list[TokenFactory]) -> None:
    for messages in stored.values():
        for headers, value in messages:
            check_message(value, headers)  # filtered records still follow the output schema
    tokens = {t for f in factories for event in f.published for t in event} | {BASE + 999}
    assert len(factories[0].published) == 2 * BATCHES and len(factories[1].published) == BATCHES
    for name in ("drop-json", "drop-msgpack"):
        assert stored[name], f"{name}: nothing stored"
        blob = b"\n".join(value + json.dumps(headers).encode() for headers, value in stored[name])
        assert b"block_hashes" in blob
        for t in tokens:
            assert str(t).encode() not in blob, f"{name}: token {t} stored"
            assert msgspec.msgpack.encode(t) not in blob, f"{name}: token {t} stored (msgpack)"
    for name in ("hash-a", "hash-b"):
        blob = b"\n".join(value + json.dumps(headers).encode() for headers, value in stored[name])
        assert not any(str(t).encode() in blob for t in tokens), f"{name}: a token id stored"
    key_of = {"hash-a": KEY, "hash-b": OTHER_KEY}
    seen: dict[str, dict[tuple[int, ...], set[str]]] = {}
    streams: set[tuple[str, int]] = set()
    for name, key in key_of.items():
        by_block = seen[name] = {}
        want = {tuple(block): mac(key, block) for f in factories for ev in f.published for block in _blocks(ev)}
        for headers, value in stored[name]:
            if headers["type"] != "BlockStored":
                continue
            body = json.loads(value)
            assert "token_ids" not in body and "lookahead_token_ids" not in body
            hashes = body["token_hashes"]
            assert len(hashes) == 3
            assert hashes[:2] == [want[tuple(SHARED[0])], want[tuple(SHARED[1])]]  # equal blocks, equal hashes
            assert hashes[2] in {want[b] for b in want if b not in map(tuple, SHARED)}
            by_block.setdefault(tuple(SHARED[0]), set()).add(hashes[0])
            streams.add((body["source"], int(body["block_hashes"][0], 16) // MARK))  # the engine's instance
    # Both streams, and engine A before and after its restart, wrote the shared block's one hash.
    assert {s for s, _ in streams} == {"engine-a", "engine-b"} and len(streams) >= 3, streams
    assert len(seen["hash-a"][tuple(SHARED[0])]) == 1 and len(seen["hash-b"][tuple(SHARED[0])]) == 1
    assert seen["hash-a"][tuple(SHARED[0])] != seen["hash-b"][tuple(SHARED[0])]  # another key, another hash


def _blocks(tokens: list[int]) -> list[list[int]]:
    return [tokens[i : i + BLOCK] for i in range(0, len(tokens), BLOCK)]


# -- the brokers --------------------------------------------------------------------------------------


async def test_kafka(tmp_path: Path, kafka: KafkaServer) -> None:
    topics = {name: await kafka.anew_topic() for name in NAMES}
    factories = await scenario(
        tmp_path, lambda name: {"type": "kafka", "bootstrap_servers": kafka.bootstrap_servers, "topic": topics[name]}
    )
    check({name: await read_kafka(kafka.bootstrap_servers, topic) for name, topic in topics.items()}, factories)


async def test_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    prefix = f"priv{uuid.uuid4().hex[:8]}"
    factories = await scenario(
        tmp_path, lambda name: {"type": "redis", "url": redis_server.url, "stream": f"{prefix}:{name}:{{source}}:{{dp_rank}}"}
    )
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        stored = {name: await read_redis(client, [f"{prefix}:{name}:engine-{e}:0" for e in "ab"]) for name in NAMES}
        check(stored, factories)
    finally:
        keys = [k async for k in client.scan_iter(match=prefix + ":*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_nats(tmp_path: Path, nats_server: NatsServer) -> None:
    uid = uuid.uuid4().hex[:8]

    def sink(name: str) -> dict[str, Any]:
        subject = f"priv{uid}{name.replace('-', '')}"
        return {
            "type": "nats",
            "servers": nats_server.url,
            "subject": subject + ".{source}.{dp_rank}",
            "mode": "jetstream",
            "stream": {"create": True, "name": f"PRIV_{uid}_{name.replace('-', '_')}"},
        }

    factories = await scenario(tmp_path, sink)
    nc = await nats.connect(nats_server.url)
    try:
        stored = {name: await read_jetstream(nc, f"PRIV_{uid}_{name.replace('-', '_')}") for name in NAMES}
        check(stored, factories)
    finally:
        for name in NAMES:
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(f"PRIV_{uid}_{name.replace('-', '_')}")
        await nc.close()


# -- raw readers: every stored byte --------------------------------------------------------------------


async def read_kafka(bootstrap_servers: str, topic: str) -> list[Stored]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False)
    await consumer.start()
    out: list[Stored] = []
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        deadline = time.monotonic() + 60
        while await consumer.position(tp) < end:
            assert time.monotonic() < deadline, "timed out reading the topic back"
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out.extend(({k: v.decode() for k, v in r.headers}, r.value or b"") for r in records)
    finally:
        await consumer.stop()
    return out


async def read_redis(client: aioredis.Redis, keys: list[str]) -> list[Stored]:
    out: list[Stored] = []
    for key in keys:
        for _id, fields in await client.xrange(key):
            body = fields.get(b"data", fields.get(b"payload", b""))
            rest = {k.decode(): v.decode() for k, v in fields.items() if k not in (b"data", b"payload")}
            out.append((rest, body))
    return out


async def read_jetstream(nc: nats.NATS, stream: str) -> list[Stored]:
    js = nc.jetstream(timeout=10)
    total = (await js.stream_info(stream)).state.messages
    sub = await js.pull_subscribe(
        "", stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL)
    )
    out: list[Stored] = []
    deadline = time.monotonic() + 60
    while len(out) < total:
        assert time.monotonic() < deadline, f"read {len(out)} of {total} messages back"
        with contextlib.suppress(asyncio.TimeoutError, nats.errors.TimeoutError):
            out.extend((dict(m.headers or {}), m.data or b"") for m in await sub.fetch(5000, timeout=5))
    await sub.unsubscribe()
    return out
