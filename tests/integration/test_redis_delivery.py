"""The Redis sink under partial failure, through the runtime's delivery loop, on a real redis-server.

Each test runs the runtime's :class:`bridge.sink.SinkWorker` (retries, :func:`bridge.sink.fold`,
dead letters, acknowledgements) over the real connector against a redis-server of this module's
own whose ``maxmemory`` the tests squeeze (policy ``noeviction``: a write past the limit is refused
with OOM, nothing is evicted), and checks the delivery contract (design.md, "Delivery"):

- nothing is dead-lettered but a message refused for itself;
- every other message is stored once, and each engine stream reads back in id order equal to its
  seq (and event) order;
- every acknowledgement (what the checkpoint advances on) is checked against Redis the moment
  the worker gives it: the entries of every acknowledged record are already stored.

Why writes near the limit go wrong without care: Redis checks ``maxmemory`` before each command,
counting the command's own arguments, and frees them after. Close to the limit a large entry is
refused while a smaller one after it still fits, and memory another client frees in the middle
of a write lets the rest of that write in. A pipeline of independent XADDs then stores later
entries of a stream after a refused one (the retry used to dead-letter the refused one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from bridge.formats import Renderer
from bridge.records import Event, Record, Stream
from connectors.redis import entry_id, message_position
from tests.infra.servers import RedisServer
from tests.integration.conftest import own_server
from tests.support.records import batch, block_stored
from tests.support.redis_sink import RedisDelivery
from tests.support.schema import check_entry

pytestmark = pytest.mark.integration

KiB = 1024
STREAMS = [Stream("llama-a", r) for r in range(4)]
BATCHES = 300  # per stream, 3 events each, one entry per event: 3,600 entries


@pytest.fixture(scope="module")
def tight_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server whose ``maxmemory`` the tests set (no eviction: writes past it get OOM), with
    DEBUG enabled (to stall it)."""
    config = {"maxmemory-policy": "noeviction", "enable-debug-command": "yes"}
    with own_server(
        "redis (maxmemory)", RedisServer(tmp_path_factory.mktemp("redis-tight"), persistent=False, extra_config=config)
    ) as server:
        yield server


@pytest.fixture
async def admin(tight_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(tight_redis.url)
    await client.config_set("maxmemory", 0)
    await client.flushall()
    yield client
    await client.config_set("maxmemory", 0)
    await client.aclose()


def engine_batch(stream: Stream, seq: int, big_every: int) -> Record:
    """An engine batch of 3 events; in every ``big_every``-th one (0: none) the middle event
    carries 6,000 token ids (about 40 KB of json, an entry Redis reads as a large argument)."""
    if not big_every or seq % big_every:
        return batch(stream, seq, epoch=1)
    events: list[Event] = [block_stored(seq * 10), block_stored(seq * 10 + 1, n_blocks=375), block_stored(seq * 10 + 2)]
    ts = 1_700_000_000.0 + seq * 0.01
    payload = msgspec.msgpack.encode([ts, events, stream.dp_rank])
    return Record(stream=stream, epoch=1, seq=seq, ts=ts, payload=payload, events=events, received=ts)


def with_event(record: Record, event: Event) -> Record:
    """``record`` with ``event`` after its events."""
    events = [*record.events, event]
    payload = msgspec.msgpack.encode([record.ts, events, record.stream.dp_rank])
    return Record(
        stream=record.stream, epoch=record.epoch, seq=record.seq, ts=record.ts, payload=payload, events=events, received=record.ts
    )


def interleaved(big_every: int = 0) -> list[Record]:
    """BATCHES per stream of STREAMS, the streams interleaved as an engine's ranks arrive."""
    return [engine_batch(s, seq, big_every) for seq in range(BATCHES) for s in STREAMS]


def delivery(tmp: Path, url: str, template: str, refused: set[str]) -> RedisDelivery:
    """The Redis sink at event granularity; ``refused``: ids of messages expected to be
    dead-lettered (refused for themselves)."""
    retry = {"initial_backoff": "20ms", "max_backoff": "200ms", "write_timeout": "10s"}
    return RedisDelivery(tmp, url, {"stream": template, "timeout": "5s"}, granularity="event", retry=retry, refused=refused)


@asynccontextmanager
async def delivering(
    server: RedisServer, tmp: Path, template: str, refused: set[str] | None = None
) -> AsyncIterator[RedisDelivery]:
    d = delivery(tmp, server.url, template, refused or set())
    d.worker.start()
    try:
        await until(lambda: d.worker.connected, "the sink to connect")
        yield d
    finally:
        await d.close()


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def deliver_through_oom(
    d: RedisDelivery, client: aioredis.Redis, records: list[Record], margin: int, heal: Callable[[], Awaitable[None]]
) -> None:
    """Set ``maxmemory`` to what the server uses now plus ``margin`` bytes, feed ``records``, and
    once the writes meet OOM, ``heal``; returns when everything is acknowledged."""
    used = int((await client.info("memory"))["used_memory"])
    await client.config_set("maxmemory", used + margin)
    feeding = asyncio.create_task(d.feed(records))
    await until(lambda: d.felt("oom"), "writes refused with OOM")
    await heal()
    await feeding
    await d.finish(records)


async def raise_the_limit(client: aioredis.Redis) -> None:
    """maxmemory raised again by an operator, 1.5 s later."""
    await asyncio.sleep(1.5)
    await client.config_set("maxmemory", 0)


async def assert_every_stream_in_order(d: RedisDelivery, client: aioredis.Redis, records: list[Record]) -> None:
    """Every message but the refused ones stored once; per engine stream, id order is seq order."""
    for stream in STREAMS:
        kept = [m for r in records if r.stream == stream for m in d.renderer.render(r) if m.msg_id not in d.refused]
        stored: list[tuple[bytes, bytes]] = []
        for key in {d.key(m) for m in kept}:
            entries = await client.xrange(key)
            for _ident, fields in entries:
                check_entry(fields)
            stored += [(ident, fields[b"data"]) for ident, fields in entries]
        stored.sort(key=lambda entry: tuple(int(x) for x in entry[0].split(b"-")))
        expected = [(entry_id(message_position(m)).encode(), m.value) for m in kept]
        assert [i for i, _ in stored] == [i for i, _ in expected], f"{stream.key}: missing, repeated or out of order"
        assert stored == expected


async def test_transient_out_of_memory_dead_letters_nothing_and_keeps_each_stream_in_order(
    tight_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """maxmemory just above use, raised again 1.5 s after the writes first meet OOM; a large
    event every fourth batch (refused near the limit while smaller entries still fit)."""
    records = interleaved(big_every=4)
    async with delivering(tight_redis, tmp_path, "oom:{source}:{dp_rank}") as d:
        await deliver_through_oom(d, admin, records, 256 * KiB, lambda: raise_the_limit(admin))  # 256 KiB: ~2% of the data
        assert d.dead_letters() == []
        assert d.count("kv_bridge_dead_letters_total", reason="sink_rejected") == 0
    await assert_every_stream_in_order(d, admin, records)


async def test_another_client_freeing_memory_during_a_write_dead_letters_nothing(
    tight_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """At the limit (entries of one size), another client deletes a big key of its own while the
    server is reading a write of the sink: the entries of that write after the DEL fit, those
    before it did not."""
    await admin.setrange("ballast", (8 << 20) - 1, b"\0")  # 8 MiB, made by the server (no 8 MiB request)
    records = interleaved()
    async with delivering(tight_redis, tmp_path, "del:{source}:{dp_rank}") as d:
        await deliver_through_oom(d, admin, records, 64 * KiB, lambda: delete_during_a_write(tight_redis.url, "ballast"))
        assert d.dead_letters() == []
    await assert_every_stream_in_order(d, admin, records)


async def delete_during_a_write(url: str, key: str) -> None:
    """DEL ``key`` from another client in the middle of a write of the sink.

    The server sleeps for 0.6 s (DEBUG SLEEP); the sink, retrying OOM every 200 ms at most, sends
    its next write meanwhile, and another client a DEL 0.4 s in. Waking up, the server reads the
    start of the write (16 KB), runs it, then the DEL, then the rest of the write.
    """
    sleeper, deleter = aioredis.Redis.from_url(url), aioredis.Redis.from_url(url)
    try:
        await deleter.ping()
        stall = asyncio.create_task(sleeper.execute_command("DEBUG", "SLEEP", "0.6"))
        await asyncio.sleep(0.4)
        assert await deleter.delete(key) == 1
        await stall
    finally:
        await sleeper.aclose()
        await deleter.aclose()


async def test_a_refused_message_is_isolated_and_its_stream_goes_on_in_order(
    tight_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """One message in the middle of a stream is refused for itself (an event of a type no other
    event has, whose key, one per type, holds a string: WRONGTYPE) while the writes also meet OOM:
    only that one is dead-lettered, every other message of its stream is stored once, in order,
    before and after it. (An announcement refused so is kept, not dead-lettered: test_redis_faults.)"""
    at = BATCHES // 2
    records = interleaved(big_every=4)
    i = records.index(next(r for r in records if r.stream == STREAMS[1] and r.seq == at))
    records[i] = with_event(records[i], {"type": "AllBlocksCleared", "medium": "GPU"})
    refused = Renderer("json", "event").render(records[i])[-1]
    async with delivering(tight_redis, tmp_path, "part:{source}:{dp_rank}:{type}", {refused.msg_id}) as d:
        await admin.set(d.key(refused), "not a stream")
        await deliver_through_oom(d, admin, records, 256 * KiB, lambda: raise_the_limit(admin))
        dead = d.dead_letters()
    assert [(x["source"], x["dp_rank"], x["seq"]) for x in dead] == [("llama-a", 1, at)], dead[:3]
    assert "WRONGTYPE" in str(dead[0]["detail"]) and dead[0]["payload_hex"] == refused.value.hex()
    await assert_every_stream_in_order(d, admin, records)
