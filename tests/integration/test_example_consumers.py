"""The example consumers (examples/consumers/) keep the engines' true block sets, on real brokers.

They keep a :class:`kv_consumer.KvIndex` (the ``kv-event-consumer`` distribution, ./consumer).
Two :class:`~tests.support.cache_engine.CacheEngine` s (real ZMQ sockets; engine ``b`` keeps a
replay buffer of 4 batches) feed an in-process bridge writing json to Kafka, Redis Streams or
NATS JetStream; the example's ``consume`` function runs against the broker meanwhile, into a
``KvIndex``. After each phase the index is held against the engines' true caches (residency
counts per (hash, medium), and block hash -> streams):

1. both engines store, store again (counts of 2+), offload to CPU and remove blocks: equal;
2. engine ``a`` restarts (new sockets, seq from 0): the index holds only the new instance's cache;
3. engine ``b`` publishes 6 batches its subscriber never gets, which its replay buffer no longer
   holds when the bridge asks (EventsLost): ``b`` is marked incomplete, naming the lost seqs, and
   holds no block the engine lacks; ``a`` is still exact;
4. engine ``b`` clears its cache (AllBlocksCleared): ``b`` is complete and exact again.

On Kafka every message is also stored a second time after phase 1 (what a re-sent write leaves
there); the index must skip exactly those copies.

``test_index_rules`` holds the index's rules (copies, stale epochs, resets, losses) without a broker.
:func:`run_scenario` and :func:`run_bootstrap_scenario` take any index with the same queries (the
Go consumer's, tests/integration/test_go_consumer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any

import nats
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from bridge.config import from_data
from bridge.runtime import Bridge
from kv_consumer import KvIndex, block_id
from tests.infra.servers import KafkaServer, NatsServer, RedisServer
from tests.support.cache_engine import CacheEngine
from tests.support.harness import free_port

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "consumers"
A, B = ("a", 0), ("b", 0)
REPLAY = {"timeout": "300ms", "max_attempts": 20, "initial_backoff": "50ms", "max_backoff": "200ms", "idle_probe": 0}
WAIT = 20.0

Consume = Callable[[Any, Callable[[], bool]], Coroutine[Any, Any, None]]  # (index, stop) -> runs until stop()


def example(name: str) -> ModuleType:
    """An example module, imported as the examples import each other (top-level names)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def held(index: Any, stream: tuple[str, int]) -> Counter[tuple[Any, Any]]:
    """The index's residency counts of ``stream`` as (hash, medium) -> copies."""
    return Counter(index.residency(stream))


def check(index: Any, engines: dict[tuple[str, int], CacheEngine], incomplete: frozenset[tuple[str, int]] = frozenset()) -> None:
    """Complete streams hold exactly their engine's cache, incomplete ones a part of it; the
    router's map (hash -> streams) agrees; exactly ``incomplete`` are marked incomplete."""
    __tracebackhide__ = True
    assert set(index.incomplete()) == incomplete, index.summary()
    holders: dict[Any, set[tuple[str, int]]] = {}
    for stream, engine in engines.items():
        mine, truth = held(index, stream), engine.cache
        if stream in incomplete:
            assert mine <= truth, f"{stream}: blocks the engine does not hold: {mine - truth}"
            assert mine != truth, f"{stream}: the loss did not show"  # the lost batches held stores
        else:
            assert mine == truth, f"{stream}: missing {truth - mine}, extra {mine - truth}"
        for h, _ in mine:
            holders.setdefault(block_id(h), set()).add(stream)
    assert index.holders == holders
    assert all(index.streams_holding(h) == s for h, s in holders.items())


async def caught_up(index: Any, consumer: asyncio.Task[None], engines: dict[tuple[str, int], CacheEngine], **after: int) -> None:
    """Until the index has applied each engine's last published event; ``after``: per source,
    an epoch the stream must have left (a restart)."""

    def done() -> bool:
        for (source, rank), engine in engines.items():
            view = index.streams.get((source, rank))
            if view is None or view.epoch <= after.get(source, -1):
                return False
            # sub: 0 a batch, the last event's index + 1, or past every event (a bootstrap's head)
            if view.seq != engine.last_seq or view.applied[2] not in (0, engine.last_events, 2**64):
                return False
        return True

    deadline = time.monotonic() + WAIT
    while not done():
        if consumer.done():
            consumer.result()  # its exception
            raise AssertionError("the consumer stopped")
        assert time.monotonic() < deadline, f"the index did not catch up within {WAIT}s:\n{index.summary()}"
        await asyncio.sleep(0.05)


async def run_scenario(
    tmp: Path,
    sink: dict[str, Any],
    consume: Consume,
    granularity: str,
    copies: Callable[[], Awaitable[int]] | None = None,
    index: Any = None,
) -> Any:
    """The four phases (module docstring) with ``sink`` and the example's ``consume``, into
    ``index`` (a new :class:`KvIndex` when None); the index. ``copies``, after phase 1: stores
    copies of messages already written (what a re-sent write leaves in Kafka); the index must skip
    exactly that many."""
    (la, ra), (lb, rb) = (free_port(), free_port()), (free_port(), free_port())
    sources = [
        {"name": name, "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
        for name, live, rep in [("a", la, ra), ("b", lb, rb)]
    ]
    config = {
        "sources": sources,
        "sinks": [{**sink, "name": "out", "format": "json", "granularity": granularity, "batch": {"linger": 0}}],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    async with CacheEngine(la, ra, seed=1) as a, CacheEngine(lb, rb, seed=2, buffer_steps=4) as b:
        engines = {A: a, B: b}
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        index = KvIndex() if index is None else index
        stopped = False
        consumer = asyncio.create_task(consume(index, lambda: stopped), name="example-consumer")
        try:
            await a.wait_subscribed()
            await b.wait_subscribed()
            # 1. both engines at work
            await a.step(8)
            await b.step(8)
            await caught_up(index, consumer, engines)
            assert any(n > 1 for n in a.cache.values()) and any(m == "CPU" for _, m in a.cache), "no copies to count"
            check(index, engines)
            expected = await copies() if copies is not None else 0
            # 2. engine a restarts
            old = index.streams[A].epoch
            await a.restart()
            await a.wait_subscribed()
            await a.step(6)
            await caught_up(index, consumer, engines, a=old)
            assert a.caches[0] and not set(a.caches[0]) <= set(a.cache)  # the old instance's blocks are gone
            check(index, engines)
            # 3. engine b: 6 batches its subscriber never gets, then 3 live; its buffer holds 4
            gap = b.last_seq + 1
            await b.step(6, deliver=False)
            await b.step(3)
            await caught_up(index, consumer, engines)
            check(index, engines, frozenset({B}))
            why = index.incomplete()[B]
            assert f"seqs {gap}-" in why and "replay_buffer_exceeded" in why, why
            # 4. engine b clears its cache: known exactly again
            await b.clear()
            await b.step(2)
            await caught_up(index, consumer, engines)
            check(index, engines)
        finally:
            stopped = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer, 10)
            await bridge.stop()
    assert index.duplicates + index.stale == expected, index.summary()
    return index


async def test_kafka_consumer(tmp_path: Path, kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic(partitions=2)
    sink = {"type": "kafka", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    consume_kafka = example("consume_kafka")

    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return consume_kafka.consume(index, kafka.bootstrap_servers, topic, stop)  # type: ignore[no-any-return]

    async def copies() -> int:
        return await resend(kafka.bootstrap_servers, topic, 2)

    index = await run_scenario(tmp_path, sink, consume, "event", copies)
    assert index.duplicates > 0


async def resend(bootstrap_servers: str, topic: str, partitions: int) -> int:
    """Every message ``topic`` holds, stored again after itself (same partition, key, value and
    headers), as when the bridge re-sends a write whose acknowledgement it did not get."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers)
    await consumer.start()
    await producer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        # An explicit seek: seek_to_beginning right after assign can lose the race with the default
        # reset to the latest offset, already in flight (aiokafka's fetcher).
        for tp, first in (await consumer.beginning_offsets(tps)).items():
            consumer.seek(tp, first)
        ends = await consumer.end_offsets(tps)
        held: list[ConsumerRecord[bytes, bytes]] = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                held.extend(r for r in records if r.offset < ends[TopicPartition(r.topic, r.partition)])
        for r in held:
            await producer.send_and_wait(topic, r.value, key=r.key, partition=r.partition, headers=list(r.headers))
    finally:
        await producer.stop()
        await consumer.stop()
    return len(held)


async def test_redis_consumer(tmp_path: Path, redis_server: RedisServer) -> None:
    prefix = f"kvx{uuid.uuid4().hex[:8]}"
    sink = {"type": "redis", "url": redis_server.url, "stream": prefix + ":{source}:{dp_rank}"}
    consume_redis = example("consume_redis")

    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return consume_redis.consume(index, redis_server.url, stop, match=prefix + ":*", rescan=0.2)  # type: ignore[no-any-return]

    try:
        await run_scenario(tmp_path, sink, consume, "batch")
    finally:
        await delete_keys(redis_server.url, prefix)


async def delete_keys(url: str, prefix: str) -> None:
    """Delete the keys a test's sink wrote under ``prefix``."""
    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + ":*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def test_redis_consumer_bootstraps_from_the_state(tmp_path: Path, redis_server: RedisServer) -> None:
    """``--bootstrap``: a consumer that starts after the stream was trimmed (``maxlen``) takes each
    engine's blocks from the state, then follows; exact, while the engines go on publishing."""
    prefix = f"kvb{uuid.uuid4().hex[:8]}"
    consume_redis = example("consume_redis")
    sink = {
        "type": "redis",
        "url": redis_server.url,
        "stream": prefix + ":{source}:{dp_rank}",
        "maxlen": 40,
        "state": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:state"},
    }
    client = aioredis.Redis.from_url(redis_server.url)

    async def heads_at(engines: dict[tuple[str, int], CacheEngine]) -> None:
        await wait_written(client, prefix, engines)
        assert await client.xlen(f"{prefix}:a:0") < 100  # trimmed: the history alone no longer tells

    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return consume_redis.consume(index, redis_server.url, stop, match=prefix + ":*", rescan=0.2, bootstrap=":state")  # type: ignore[no-any-return]

    try:
        await run_bootstrap_scenario(tmp_path, sink, consume, heads_at)
    finally:
        await client.aclose()
        await delete_keys(redis_server.url, prefix)


async def wait_written(client: Any, prefix: str, engines: dict[tuple[str, int], CacheEngine]) -> None:
    """Until each engine's last batch is in its stream key."""
    deadline = time.monotonic() + WAIT
    for (source, rank), engine in engines.items():
        while True:
            last = await client.xrevrange(f"{prefix}:{source}:{rank}", "+", "-", count=1)
            if last and int(last[0][1][b"seq"]) == engine.last_seq:
                break
            assert time.monotonic() < deadline, f"{source}/{rank}: the bridge did not write seq {engine.last_seq}"
            await asyncio.sleep(0.05)


async def test_nats_consumer(tmp_path: Path, nats_server: NatsServer) -> None:
    uid = uuid.uuid4().hex[:8]
    subject, stream = f"kvx{uid}", f"KVX_{uid}"
    sink = {
        "type": "nats",
        "servers": nats_server.url,
        "subject": subject + ".{source}.{dp_rank}",
        "mode": "jetstream",
        "stream": {"create": True, "name": stream},
    }
    consume_nats = example("consume_nats")

    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return consume_nats.consume(index, nats_server.url, stop, subject=subject + ".>", stream=stream)  # type: ignore[no-any-return]

    try:
        await run_scenario(tmp_path, sink, consume, "event")
    finally:
        nc = await nats.connect(nats_server.url)
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(stream)
        await nc.close()


# -- the rules, without a broker --------------------------------------------------------------------


def _batch(epoch: int, seq: int, *events: dict[str, Any], source: str = "e") -> dict[str, Any]:
    return {"source": source, "dp_rank": 0, "epoch": epoch, "seq": seq, "ts": 1.0, "events": list(events)}


def _stored(*hashes: int, medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None, "medium": medium}


def _removed(*hashes: int, medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def _control(epoch: int, seq: int, kind: str, **fields: Any) -> dict[str, Any]:
    return {"source": "e", "dp_rank": 0, "epoch": epoch, "seq": seq, "type": kind, **fields}


def test_index_rules() -> None:
    index = KvIndex()
    e = ("e", 0)
    # residency counts: two copies need two removals; media are separate copies
    index.apply(_batch(10, 0, _stored(1, 2), _stored(1), _stored(2, medium="CPU")))
    index.apply(_batch(10, 1, _removed(1), _removed(2, medium="CPU")))
    assert held(index, e) == {(1, "GPU"): 1, (2, "GPU"): 1}
    # a copy of a batch (a re-sent write) changes nothing
    index.apply(_batch(10, 1, _removed(1), _removed(2, medium="CPU")))
    index.apply(_batch(10, 2, _stored(3), _removed(1)))
    index.apply(_batch(10, 1, _removed(1), _removed(2, medium="CPU")))
    assert held(index, e) == {(2, "GPU"): 1, (3, "GPU"): 1} and index.duplicates == 2
    assert index.streams_holding(3) == {e} and index.streams_holding(1) == set()
    assert index.streams_holding("0000000000000003") == {e}  # the same block as hex text (hash_format: hex)
    # event granularity: positions (seq, index); a copy of an event changes nothing
    g = ("g", 0)
    for seq, i, body in [(0, 0, _stored(3)), (0, 1, _stored(3)), (1, 0, _removed(3)), (0, 1, _stored(3))]:
        index.apply({"source": "g", "dp_rank": 0, "epoch": 10, "seq": seq, "index": i, "ts": 1.0, **body})
    assert held(index, g) == {(3, "GPU"): 1} and index.duplicates == 3
    assert index.streams_holding(3) == {e, g}
    # a loss: dropped, incomplete; a removal of a block not held keeps counts at 0
    index.apply(_control(10, 5, "EventsLost", from_seq=3, to_seq=5, count=3, reason="replay_buffer_exceeded"))
    index.apply(_batch(10, 6, _stored(4), _removed(2)))
    assert held(index, e) == {(4, "GPU"): 1}
    assert index.incomplete() == {e: "seqs 3-5 of epoch 10 lost (replay_buffer_exceeded)"}
    # the engine clears its cache: complete again
    index.apply(_batch(10, 7, {"type": "AllBlocksCleared"}, _stored(5)))
    assert held(index, e) == {(5, "GPU"): 1} and index.incomplete() == {}
    # a restart: a new epoch drops everything; the old epoch's late records are ignored
    index.apply(_control(11, 0, "SourceReset", reason="publisher_restart"))
    index.apply(_batch(11, 0, _stored(6)))
    index.apply(_batch(10, 8, _stored(7)))
    assert held(index, e) == {(6, "GPU"): 1} and index.stale == 1
    # the bridge restarted: the epoch's SourceReset and records again (the same ones): skipped
    index.apply(_control(11, 0, "SourceReset", reason="bridge_restart"))
    index.apply(_batch(11, 0, _stored(6)))
    index.apply(_batch(11, 1, _stored(8)))
    assert held(index, e) == {(6, "GPU"): 1, (8, "GPU"): 1} and index.duplicates == 5
    # a newer epoch without a SourceReset (a bridge without its checkpoint): same as a reset,
    # complete only when it starts at the epoch's first seq
    index.apply(_batch(12, 0, _stored(9)))
    assert held(index, e) == {(9, "GPU"): 1} and index.incomplete() == {}
    index.apply(_batch(13, 4, _stored(10)))
    assert held(index, e) == {(10, "GPU"): 1} and index.incomplete() == {e: "joined mid-stream"}
    # streams are independent
    index.apply(_batch(1, 0, _stored(10), source="f"))
    assert index.streams_holding(10) == {e, ("f", 0)}
    assert index.summary().startswith("2 distinct blocks")  # 3 (stream g) and 10
    # a batch record carrying its type (schema_version 2): still a batch, after its epoch's reset
    index.apply(_control(14, 0, "SourceReset", reason="publisher_restart"))
    index.apply({**_batch(14, 0, _stored(11)), "type": "EventBatch"})
    assert held(index, e) == {(11, "GPU"): 1} and index.incomplete() == {}


def test_an_event_field_named_events_does_not_make_an_event_record_a_batch() -> None:
    """An engine field ``events`` stays at the top of an event record (unknown fields are kept by
    name): the index tells an event record by its ``index`` (found by a breaker)."""
    index = KvIndex()
    head = {"source": "e", "dp_rank": 0, "epoch": 5, "ts": 1.0, "schema_version": 1}
    index.apply({**head, "seq": 0, "index": 0, "type": "BlockStored", "block_hashes": [42], "medium": "GPU"})
    index.apply({**head, "seq": 1, "index": 0, "type": "BlockRemoved", "block_hashes": [42], "medium": "GPU", "events": []})
    assert index.streams_holding(42) == set() and index.incomplete() == {}


# -- --bootstrap on Kafka and NATS (the Redis test's steps, with a helper) ---------------------------


async def run_bootstrap_scenario(
    tmp: Path,
    sink: dict[str, Any],
    consume: Consume,
    heads_at: Callable[[dict[tuple[str, int], CacheEngine]], Awaitable[None]],
    index: Any = None,
) -> Any:
    """The bootstrap scenario with ``sink`` (state enabled, batch granularity): 60 batches per
    engine, until ``heads_at`` sees each engine's last batch in the state; then the consumer
    (``consume``, with ``--bootstrap``) starts while both engines publish (until it has seeded both
    streams, and 3 batches more): exact; then engine ``a`` restarts: exact. Returns the index
    (``index``, or a new :class:`KvIndex`)."""
    (la, ra), (lb, rb) = (free_port(), free_port()), (free_port(), free_port())
    config = {
        "sources": [
            {"name": name, "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
            for name, live, rep in [("a", la, ra), ("b", lb, rb)]
        ],
        "sinks": [{**sink, "name": "out", "format": "json", "granularity": "batch", "batch": {"linger": 0}}],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    async with CacheEngine(la, ra, seed=1) as a, CacheEngine(lb, rb, seed=2) as b:
        engines = {A: a, B: b}
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        index = KvIndex() if index is None else index
        stopped = False
        consumer: asyncio.Task[None] | None = None
        try:
            await a.wait_subscribed()
            await b.wait_subscribed()
            await a.step(60)
            await b.step(60)
            await heads_at(engines)
            consumer = asyncio.create_task(consume(index, lambda: stopped), name="example-consumer")
            deadline = time.monotonic() + WAIT
            while len(index.streams) < 2:  # publishing while the consumer bootstraps (seeds the streams)
                assert time.monotonic() < deadline and not consumer.done(), index.summary()
                await asyncio.gather(a.step(), b.step())
                await asyncio.sleep(0.01)
            await asyncio.gather(a.step(3), b.step(3))  # and after: followed from the heads
            await caught_up(index, consumer, engines)
            check(index, engines)
            old = index.streams[A].epoch
            await a.restart()
            await a.wait_subscribed()
            await a.step(6)
            await caught_up(index, consumer, engines, a=old)
            check(index, engines)
        finally:
            stopped = True
            if consumer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(consumer, 10)
            await bridge.stop()
    return index


async def run_lost_events_bootstrap(
    tmp: Path,
    sink: dict[str, Any],
    consume: Consume,
    heads_at: Callable[[dict[tuple[str, int], CacheEngine]], Awaitable[None]],
    lose: Callable[[], Awaitable[None]],
    index: Any = None,
) -> Any:
    """breaker88 B1, B2: 20 batches of one engine (event granularity, where a missing seq cannot be
    told from a batch with no event) until ``heads_at`` sees the last in the state; the bridge
    stops and ``lose()`` loses the sink's events (a topic or stream deleted, created again empty);
    the consumer (``consume``, with ``--bootstrap``) seeds from the state, which still names
    offsets of the old events; then the bridge starts again (it announces the loss) and the engine
    publishes 40 batches more. The consumer holds exactly the engine's cache. Before, it followed
    from the head's ``next`` into the new events, past the first records written there, and held a
    wrong state marked complete. Returns the index."""
    live, rep = free_port(), free_port()
    config = {
        "sources": [{"name": "a", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}],
        "sinks": [{**sink, "name": "out", "format": "json", "granularity": "event", "batch": {"linger": 0}}],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp / "dead.jsonl")},
        "checkpoint": {"path": str(tmp / "checkpoint.json"), "interval": "100ms"},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    index = KvIndex() if index is None else index
    stopped = False
    consumer: asyncio.Task[None] | None = None
    async with CacheEngine(live, rep, seed=11) as engine:
        engines = {A: engine}
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(20, events_per_batch=4)
            await heads_at(engines)
        finally:
            await bridge.stop()
        await lose()
        try:
            consumer = asyncio.create_task(consume(index, lambda: stopped), name="example-consumer")
            deadline = time.monotonic() + WAIT
            while A not in index.streams:  # seeded from the state before the bridge is back
                assert time.monotonic() < deadline and not consumer.done(), index.summary()
                await asyncio.sleep(0.05)
            bridge = Bridge(from_data(config, env={}))
            await bridge.start()
            try:
                await engine.wait_subscribed()
                await engine.step(40, events_per_batch=4)
                await caught_up(index, consumer, engines)
            finally:
                await bridge.stop()
            check(index, engines)
        finally:
            stopped = True
            if consumer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(consumer, 10)
    return index


async def test_kafka_consumer_bootstrapping_over_a_topic_created_again_ends_exact(tmp_path: Path, kafka: KafkaServer) -> None:
    """breaker88 B2 (the Python library: tests/integration/test_go_consumer.py has the Go one)."""
    servers = kafka.bootstrap_servers
    topic = await kafka.anew_topic(partitions=1)
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"
    sink = kafka_state_sink(servers, topic, state_topic)
    consume_kafka = example("consume_kafka")

    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return consume_kafka.consume(index, servers, topic, stop, bootstrap=state_topic)  # type: ignore[no-any-return]

    await run_lost_events_bootstrap(
        tmp_path, sink, consume, kafka_heads_at(servers, state_topic), topic_created_again(kafka, topic)
    )


def kafka_heads_at(servers: str, state_topic: str) -> Callable[[dict[tuple[str, int], CacheEngine]], Awaitable[None]]:
    """Until each engine's head in ``state_topic`` is at its last seq."""

    async def heads_at(engines: dict[tuple[str, int], CacheEngine]) -> None:
        deadline = time.monotonic() + WAIT
        while True:
            seqs = await kafka_heads(servers, state_topic)
            if all(seqs.get(f"{s}/{r}/_head".encode()) == e.last_seq for (s, r), e in engines.items()):
                return
            assert time.monotonic() < deadline, f"the heads are at {seqs}"
            await asyncio.sleep(0.1)

    return heads_at


def topic_created_again(kafka: KafkaServer, topic: str) -> Callable[[], Awaitable[None]]:
    """Deletes ``topic`` and creates it again, empty (one partition)."""
    from tests.integration.test_kafka import delete_topic

    async def lose() -> None:
        await delete_topic(kafka, topic)
        await kafka.anew_topic(partitions=1, name=topic)

    return lose


async def test_nats_consumer_bootstrapping_over_a_stream_lost_ends_exact(tmp_path: Path, nats_server: NatsServer) -> None:
    """breaker88 B1: the events stream deleted while no bridge ran; the bridge creates it again."""

    uid = uuid.uuid4().hex[:8]
    subject, stream, bucket = f"kvl{uid}", f"KVL_{uid}", f"KVLS{uid}"
    sink = {
        "type": "nats",
        "servers": nats_server.url,
        "subject": subject + ".{source}.{dp_rank}",
        "stream": {"name": stream, "create": True},
        "state": {"enabled": True, "bucket": bucket, "create": True},
    }
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    consume_nats = example("consume_nats")

    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return consume_nats.consume(index, nats_server.url, stop, subject=subject + ".>", stream=stream, bootstrap=bucket)  # type: ignore[no-any-return]

    heads_at = nats_heads_at(js, bucket)

    async def lose() -> None:
        await js.delete_stream(stream)

    try:
        await run_lost_events_bootstrap(tmp_path, sink, consume, heads_at, lose)
    finally:
        for name in (stream, f"KV_{bucket}"):
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
        await nc.close()


def records_read(index: Any) -> int:
    return int(index.applied + index.duplicates + index.stale)


async def test_kafka_consumer_bootstraps_from_the_state(tmp_path: Path, kafka: KafkaServer) -> None:
    """``--bootstrap STATE_TOPIC``: a consumer started after 60 batches per engine takes each
    engine's blocks from the compacted state topic and reads each partition only from where its
    streams' heads continue (far fewer records than the topic holds); exact, while the engines go
    on publishing, and through an engine restart."""
    from tests.support.state_kafka import offsets

    servers = kafka.bootstrap_servers
    topic = await kafka.anew_topic(partitions=2)
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"  # created by the sink (state.create)
    sink = kafka_state_sink(servers, topic, state_topic)
    consume_kafka = example("consume_kafka")

    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return consume_kafka.consume(index, servers, topic, stop, bootstrap=state_topic)  # type: ignore[no-any-return]

    heads_at = kafka_heads_at(servers, state_topic)

    index = await run_bootstrap_scenario(tmp_path, sink, consume, heads_at)
    written = sum(end for _, end in [await offsets(servers, TopicPartition(topic, p)) for p in range(2)])
    assert records_read(index) < written / 2, (records_read(index), written)  # started from the heads


async def kafka_heads(servers: str, state_topic: str) -> dict[bytes, int]:
    """The seq of each head (key ``source/dp_rank/_head``) the state topic's 2 partitions hold now.
    (Reset to the earliest by the consumer itself: a ``seek_to_beginning`` right after ``assign``
    can lose the race with the default reset to the latest offset.)"""
    consumer = AIOKafkaConsumer(bootstrap_servers=servers, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(state_topic, p) for p in range(2)]
        consumer.assign(tps)
        ends, seqs = await consumer.end_offsets(tps), {}
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for r in records:
                    if r.key is not None and r.key.endswith(b"/_head") and r.value is not None:
                        seqs[r.key] = int(json.loads(r.value)["seq"])
        return seqs
    finally:
        await consumer.stop()


async def test_nats_consumer_bootstraps_from_the_state(tmp_path: Path, nats_server: NatsServer) -> None:
    """``--bootstrap BUCKET``: a consumer started after the JetStream stream (``max_msgs`` 40) lost
    the engines' first batches takes each engine's blocks from the KV bucket, then follows from
    the lowest ``next`` of the heads; exact, while the engines go on publishing, and through an
    engine restart."""

    uid = uuid.uuid4().hex[:8]
    subject, stream, bucket = f"kvb{uid}", f"KVB_{uid}", f"KVBS{uid}"
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[subject + ".>"], max_msgs=40)  # trims the history
    sink = {
        "type": "nats",
        "servers": nats_server.url,
        "subject": subject + ".{source}.{dp_rank}",
        "mode": "jetstream",
        "stream": {"name": stream},
        "state": {"enabled": True, "bucket": bucket, "create": True},
    }
    consume_nats = example("consume_nats")

    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return consume_nats.consume(index, nats_server.url, stop, subject=subject + ".>", stream=stream, bootstrap=bucket)  # type: ignore[no-any-return]

    async def heads_at(engines: dict[tuple[str, int], CacheEngine]) -> None:
        await nats_heads_at(js, bucket)(engines)
        assert (await js.stream_info(stream)).state.first_seq > 1  # trimmed: the history alone no longer tells

    try:
        index = await run_bootstrap_scenario(tmp_path, sink, consume, heads_at)
        written = (await js.stream_info(stream)).state.last_seq
        assert records_read(index) < written, (records_read(index), written)
    finally:
        for name in (stream, f"KV_{bucket}"):
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
        await nc.close()


def nats_heads_at(js: Any, bucket: str) -> Callable[[dict[tuple[str, int], CacheEngine]], Awaitable[None]]:
    """Until each engine's head in KV ``bucket`` is at its last seq."""
    from connectors.nats import state_prefix

    async def heads_at(engines: dict[tuple[str, int], CacheEngine]) -> None:
        kv = await js.key_value(bucket)
        deadline = time.monotonic() + WAIT
        for (source, rank), engine in engines.items():
            while True:
                with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                    entry = await kv.get(f"{state_prefix(source, rank)}._head")
                    if entry.value and json.loads(entry.value)["seq"] == engine.last_seq:
                        break
                assert time.monotonic() < deadline, f"{source}/{rank}: no head at seq {engine.last_seq}"
                await asyncio.sleep(0.05)

    return heads_at


def kafka_state_sink(servers: str, topic: str, state_topic: str) -> dict[str, Any]:
    """A Kafka sink writing ``topic`` and its state to ``state_topic`` (created, 2 partitions)."""
    state = {"enabled": True, "topic": state_topic, "create": True, "partitions": 2}
    return {"type": "kafka", "bootstrap_servers": servers, "topic": topic, "state": state}
