"""The Redis Streams connector against a real redis-server.

The shared conformance suite, then what is Redis-specific: the entry layout, entry ids that grow
along a stream and make re-delivery idempotent, MAXLEN trimming, the block index against a model
of the engine's cache, failure classes (WRONGTYPE, OOM, BUSY, auth, refused connections), a
server restart in the middle of a stream, and Redis Cluster.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from bridge.config import SinkConfig, convert_options
from bridge.connector import Registry
from bridge.errors import ConfigError, NotConnected, PartialFailure, Permanent, Retriable
from bridge.formats import Message, Renderer, hex64
from bridge.records import Event, Record, Stream, events_lost, source_reset
from bridge.sink import fold
from connectors.redis import (
    CLUSTER_INDEX_KEY,
    CLUSTER_STATE_KEY,
    CLUSTER_STREAM,
    MAX_SLOT,
    MAX_SUB,
    MAX_WIDE_SUB,
    WIDE_EPOCHS,
    RedisConnector,
    RedisOptions,
    entry_id,
    entry_position,
    index_delta,
    message_position,
)
from tests.infra.servers import RedisServer, free_port
from tests.integration.conformance import FORMATS, ConformanceSuite, Stored
from tests.integration.conftest import own_server, unavailable
from tests.support.contract import BeforeFirstWrite, Scenario, interleaved
from tests.support.records import CacheModel, batch, control_records, stream_records
from tests.support.schema import check_entry, check_message

integration = pytest.mark.integration
SECRET = "Zq9-very-secret-pw"
USER = "kvbridge"


# -- harness ------------------------------------------------------------------------------------


def options(url: str, **extra: Any) -> RedisOptions:
    return convert_options({"url": url, "timeout": "2s", **extra}, RedisOptions, "sinks[0]")


def make(url: str, sink: SinkConfig | None = None, **extra: Any) -> RedisConnector:
    sink = sink or SinkConfig(type="redis", name="redis-test")
    return RedisConnector(sink.name, options(url, **extra), sink)


def make_indexed(
    url: str, s: SinkConfig, prefix: str, index: str, *, enabled: bool = True, on_events_lost: str | None = None, **extra: Any
) -> RedisConnector:
    """A connector writing the streams ``{prefix}:{source}:{dp_rank}``, each with its block index
    (when ``enabled``) at the stream's key + ``:{index}``."""
    options: dict[str, Any] = {"enabled": enabled, "key": f"{prefix}:{{source}}:{{dp_rank}}:{index}"}
    if on_events_lost is not None:
        options["on_events_lost"] = on_events_lost
    return make(url, s, stream=prefix + ":{source}:{dp_rank}", index=options, **extra)


def sink(fmt: str = "json", granularity: str = "event", hash_format: str = "int") -> SinkConfig:
    return SinkConfig(type="redis", name="redis-test", format=fmt, granularity=granularity, hash_format=hash_format)  # type: ignore[arg-type]


def render(s: SinkConfig, records: Sequence[Record]) -> list[Message]:
    r = Renderer(s.format, s.granularity, s.hash_format)
    return [m for rec in records for m in r.render(rec)]


def new_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


async def xrange(url: str, key: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Every entry of ``key``; those the bridge wrote checked against the output schema."""
    client = aioredis.Redis.from_url(url, password=None)
    try:
        entries = list(await client.xrange(key))
        for _ident, fields in entries:
            check_entry(fields)
        return entries
    finally:
        await client.aclose()


async def smembers(url: str, key: str, password: str | None = None) -> set[str]:
    client = aioredis.Redis.from_url(url, password=password)
    try:
        return {m.decode() for m in await client.smembers(key)}
    finally:
        await client.aclose()


def to_stored(fields: dict[bytes, bytes]) -> Stored:
    body = fields.get(b"payload", fields.get(b"data"))
    assert body is not None, fields
    headers = {k.decode(): v.decode() for k, v in fields.items() if k not in (b"data", b"payload")}
    return Stored(value=body, headers=headers)


async def deliver(conn: RedisConnector, messages: Sequence[Message], *, attempts: int = 200) -> int:
    """Write like the runtime does (:func:`bridge.sink.fold`): after a partial failure, write each
    stream again from its first transient failure on; raise if anything would be dead-lettered.
    Returns the number of retries."""
    pending = list(messages)
    for attempt in range(attempts):
        try:
            await asyncio.wait_for(conn.write(pending), 10)
            return attempt
        except PartialFailure as exc:
            outcome = fold(pending, exc.errors)
            assert not outcome.dead, f"dead-lettered: {outcome.dead}"
            pending = [pending[i] for i in outcome.retry]
            if not pending:
                return attempt
        except (NotConnected, Retriable, TimeoutError):
            pass
        await asyncio.sleep(min(0.05 * 2**attempt, 0.5))
    raise AssertionError(f"not delivered after {attempts} attempts")


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module's own, for tests that change server settings (maxmemory) or
    stall it: fast BUSY replies, DEBUG enabled, and an ACL user USER with password SECRET (the
    default user stays open for the fixture's own health checks)."""
    server = RedisServer(
        tmp_path_factory.mktemp("redis-private"),
        persistent=False,
        extra_config={"lua-time-limit": "100", "enable-debug-command": "yes"},
    )
    with own_server("redis (private)", server):
        with redis.Redis(host=server.host, port=server.port, socket_timeout=10) as client:
            client.execute_command("ACL", "SETUSER", USER, "on", f">{SECRET}", "~*", "&*", "+@all")
        yield server


@pytest.fixture
async def admin(private_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(private_redis.url)
    yield client
    await client.config_set("maxmemory", 0)
    await client.aclose()


# -- the shared suite ---------------------------------------------------------------------------


@integration
class TestRedisConformance(ConformanceSuite):
    dedup_on_redelivery = True

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer, request: pytest.FixtureRequest) -> None:
        self.server = redis_server
        self.request = request  # the contract tests ask for the module's private server

    async def make_connector(self, sink: SinkConfig, dest: str) -> RedisConnector:
        return make(self.server.url, sink, stream=dest + ":{source}:{dp_rank}")

    async def read_back(self, dest: str, stream: Stream, expected: int) -> list[Stored]:
        entries = await xrange(self.server.url, f"{dest}:{stream.source}:{stream.dp_rank}")
        return [to_stored(fields) for _, fields in entries]

    async def restart_server(self) -> None:
        await self.server.arestart()

    def new_dest(self) -> str:
        return new_prefix()

    @staticmethod
    def _reader(url: str, pattern: str) -> Any:
        """Read back every entry of a stream's keys (``pattern`` with ``{source}``/``{dp_rank}``,
        maybe a glob), merged in entry id order."""

        async def read(stream: Stream, expected: int) -> list[tuple[bytes, dict[str, str]]]:
            client = aioredis.Redis.from_url(url)
            match = pattern.format(source=stream.source, dp_rank=stream.dp_rank)
            try:
                keys = [k.decode() async for k in client.scan_iter(match=match, _type="stream")]
            finally:
                await client.aclose()
            entries = [entry for key in keys for entry in await xrange(url, key)]
            entries.sort(key=lambda entry: entry_position(entry[0]))
            return [(s.value, s.headers) for s in (to_stored(fields) for _, fields in entries)]

        return read

    async def transient_partial_failure(self, sink: SinkConfig, dest: str) -> Scenario:
        """OOM near ``maxmemory`` on the module's private server (policy noeviction):
        ``maxmemory`` is set, as the first write starts, to what the server uses plus 128 KiB. The
        write holds one script call per stream, llama-r/1's first: stored. The call of llama-r/0
        comes last and carries a 512 KiB message, which Redis counts against the limit before the
        call runs: refused with OOM (so is llama-r/2's when Redis has read that argument before
        running it). Healed by lifting the limit."""
        server: RedisServer = self.request.getfixturevalue("private_redis")
        renderer = Renderer(sink.format, sink.granularity)
        streams = [Stream("llama-r", 1), Stream("llama-r", 2), Stream("llama-r", 0)]
        records = interleaved(renderer, streams, 4, lambda s, seq: 512 * 1024 if (s.dp_rank, seq) == (0, 0) else 300)
        admin = aioredis.Redis.from_url(server.url)

        async def squeeze() -> None:  # as the first write starts: the sink's connection counts too
            used = int((await admin.info("memory"))["used_memory"])
            await admin.config_set("maxmemory", used + 128 * 1024)

        async def heal() -> None:
            await admin.config_set("maxmemory", 0)

        async def cleanup() -> None:
            await admin.config_set("maxmemory", 0)
            await admin.aclose()

        connector = BeforeFirstWrite(make(server.url, sink, stream=dest + ":{source}:{dp_rank}"), squeeze)
        reader = self._reader(server.url, dest + ":{source}:{dp_rank}")
        return Scenario(connector, records, reader, heal=heal, struck=("oom",), cleanup=[cleanup])

    async def refused_message(self, sink: SinkConfig, dest: str) -> Scenario:
        """proto-max-bulk-len lowered to 1 MiB, and llama-r/0's seq 2 over it: refused for itself
        (too_large) before the script call. (A key of another type refuses every message of its
        type, an announcement among them, which is kept, not dead-lettered: test_redis_faults.)"""
        renderer = Renderer(sink.format, sink.granularity)
        streams = [Stream("llama-r", 0), Stream("llama-r", 1)]
        records = interleaved(renderer, streams, 4, lambda s, seq: 1_200_000 if (s.dp_rank, seq) == (0, 2) else 300)
        refused = next(r for r in records if r.stream == streams[0] and r.seq == 2)
        admin = aioredis.Redis.from_url(self.server.url)
        await admin.config_set("proto-max-bulk-len", 1024 * 1024)

        async def cleanup() -> None:
            await admin.config_set("proto-max-bulk-len", 512 * 1024 * 1024)
            await admin.aclose()

        connector = make(self.server.url, sink, stream=dest + ":{source}:{dp_rank}")
        reader = self._reader(self.server.url, dest + ":{source}:{dp_rank}")
        return Scenario(connector, records, reader, refused=refused, cleanup=[cleanup])


# -- entry layout and ids -----------------------------------------------------------------------


@integration
@pytest.mark.parametrize(("fmt", "granularity"), FORMATS)
async def test_entry_layout_is_the_header_then_the_body(redis_server: RedisServer, fmt: str, granularity: str) -> None:
    s = sink(fmt, granularity)
    prefix = new_prefix()
    stream = Stream("llama-a", 2, {"model": "m"})
    records = control_records(stream, 1)[:1] + stream_records(stream, 3, epoch=1) + control_records(stream, 1)[1:]
    messages = render(s, records)
    conn = make(redis_server.url, s, stream=prefix + ":{labels.model}:{source}:{dp_rank}")
    await conn.connect()
    try:
        await conn.write(messages)
    finally:
        await conn.close()
    entries = await xrange(redis_server.url, f"{prefix}:m:llama-a:2")
    assert len(entries) == len(messages)
    for (ident, fields), m in zip(entries, messages, strict=True):
        body = "payload" if fmt == "raw" and m.record.kind == "batch" else "data"
        expected = [(k.encode(), v.encode()) for k, v in m.headers.items()] + [(body.encode(), m.value)]
        assert list(fields.items()) == expected
        assert list(fields)[:7] == [b"source", b"dp_rank", b"epoch", b"seq", b"type", b"content-type", b"schema_version"]
        stored = to_stored(fields)
        check_message(stored.value, stored.headers)
        assert ident.decode() == entry_id(message_position(m))
        assert entry_position(ident) == message_position(m)


@integration
async def test_ids_strictly_increase_per_stream_across_epochs_and_types(redis_server: RedisServer) -> None:
    s = sink("json", "event")
    prefix = new_prefix()
    a, b = Stream("llama-a", 0), Stream("llama-a", 1)
    records: list[Record] = []
    for one in (a, b):
        records += stream_records(one, 4, epoch=0)
        records += [source_reset(one, 1, "publisher_restart", 0.0)]
        records += stream_records(one, 3, epoch=1)
        records += [events_lost(one, 1, 3, 9, "replay_unavailable", 0.0)]
        records += stream_records(one, 3, epoch=1, start=10)
        records += [source_reset(one, 7, "publisher_restart", 0.0), *stream_records(one, 2, epoch=7)]
        # a minute epoch (streams written before epochs were microseconds), then a microsecond one
        for epoch in (1_010_000, 1_796_000_000_000_000):
            records += [source_reset(one, epoch, "publisher_restart", 0.0), *stream_records(one, 2, epoch=epoch)]
            records += [events_lost(one, epoch, 2, 3, "replay_unavailable", 0.0), *stream_records(one, 2, epoch=epoch, start=4)]
    random.Random(3).shuffle(records)  # interleave the streams...
    records.sort(key=lambda r: (r.stream.dp_rank, r.position))  # ...but keep each one in order
    messages = render(s, records)
    conn = make(redis_server.url, s, stream=prefix + ":{source}:{dp_rank}")
    await conn.connect()
    try:
        for i in range(0, len(messages), 7):
            await conn.write(messages[i : i + 7])
    finally:
        await conn.close()
    for one in (a, b):
        entries = await xrange(redis_server.url, f"{prefix}:{one.source}:{one.dp_rank}")
        ids = [tuple(int(x) for x in ident.split(b"-")) for ident, _ in entries]
        assert ids == sorted(set(ids)), "ids must strictly increase"
        mine = [m for m in messages if m.record.stream == one]
        assert [entry_position(ident) for ident, _ in entries] == [message_position(m) for m in mine]
        # A consumer resumes exactly after any entry it saw (EventsLost's 2**64-1 sub included).
        key = f"{prefix}:{one.source}:{one.dp_rank}"
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            for n, (seen, _) in enumerate(entries[:-1]):
                reply = await client.xread({key: seen}, count=1000)
                assert [ident for ident, _ in reply[0][1]] == [ident for ident, _ in entries[n + 1 :]]
        finally:
            await client.aclose()


epochs = st.one_of(st.integers(0, WIDE_EPOCHS - 1), st.integers(WIDE_EPOCHS, 2**63 - 1), st.just(1_780_000_000_250_000))
subs = st.one_of(st.integers(0, MAX_WIDE_SUB - 1), st.just(MAX_SUB))
positions = st.tuples(epochs, st.integers(0, MAX_SLOT), subs)


def _id_key(text: str) -> tuple[int, int]:
    first, sub = text.split("-")
    return int(first), int(sub)


@given(positions, positions)
def test_entry_ids_order_like_positions(p: tuple[int, int, int], q: tuple[int, int, int]) -> None:
    """In and across the narrow (minute epochs of earlier releases) and the wide layout."""
    a, b = _id_key(entry_id(p)), _id_key(entry_id(q))
    assert a != (0, 0) and b != (0, 0) and max(a + b) < 2**64
    assert (a < b) == (p < q) and (a == b) == (p == q)
    if p != (0, 0, 0):
        assert entry_position(entry_id(p)) == p


def test_entry_id_bounds() -> None:
    assert entry_id((1, 1, 0)) == f"{2**40 + 1}-0"
    assert entry_id((0, 0, 0)) == "0-1"
    assert entry_id((WIDE_EPOCHS - 1, MAX_SLOT, MAX_SUB)) == f"{2**63 - 1}-{MAX_SUB}"
    assert entry_id((WIDE_EPOCHS, 0, 0)) == f"{2**63 + WIDE_EPOCHS}-0"
    assert entry_id((2**63 - 1, MAX_SLOT, MAX_SUB)) == f"{2**64 - 1}-{2**64 - 1}"
    # a microsecond epoch: its own first part, the slot and event index in the second
    assert entry_id((1_780_000_000_250_000, 42, 3)) == f"{2**63 + 1_780_000_000_250_000}-{42 * 2**24 + 3}"
    for bad in ((2**63, 0, 0), (0, MAX_SLOT + 1, 0), (0, 1, 2**64), (-1, 0, 0), (WIDE_EPOCHS, 1, MAX_WIDE_SUB)):
        with pytest.raises(ValueError):
            entry_id(bad)


# -- duplicate safety ---------------------------------------------------------------------------


@integration
async def test_redelivery_after_a_timeout_is_stored_once(private_redis: RedisServer, admin: aioredis.Redis) -> None:
    """The server stalls past the client's timeout, then runs the write anyway; the runtime's
    retry re-sends the whole batch, which must not store anything twice."""
    s = sink("json", "event")
    prefix = new_prefix()
    stream = Stream("llama-t", 0)
    messages = render(s, stream_records(stream, 6))
    conn = make(private_redis.url, s, username=USER, password=SECRET, stream=prefix + ":{source}:{dp_rank}", timeout="300ms")
    await conn.connect()
    try:
        await conn.write(messages[:3])
        sleeper = aioredis.Redis.from_url(private_redis.url, socket_timeout=10)
        stall = asyncio.create_task(sleeper.execute_command("DEBUG", "SLEEP", "1"))
        await asyncio.sleep(0.1)
        with pytest.raises(NotConnected):
            await conn.write(messages)  # sent; times out while the server sleeps
        await stall
        await sleeper.aclose()
        key = f"{prefix}:llama-t:0"
        assert await admin.xlen(key) == len(messages), "the timed-out write did land"
        await conn.write(messages)  # the retry
        await conn.write(messages[4:])  # and a tail once more
    finally:
        await conn.close()
    entries = await admin.xrange(key)
    assert [f[b"data"] for _, f in entries] == [m.value for m in messages]


@integration
async def test_cancelled_write_then_retry(private_redis: RedisServer, admin: aioredis.Redis) -> None:
    """The runtime's write_timeout cancels write(); the connection must not be reused half-read."""
    s = sink("msgpack", "batch")
    prefix = new_prefix()
    stream = Stream("llama-x", 0)
    messages = render(s, stream_records(stream, 5))
    conn = make(private_redis.url, s, username=USER, password=SECRET, stream=prefix + ":{source}:{dp_rank}")
    await conn.connect()
    try:
        sleeper = aioredis.Redis.from_url(private_redis.url, socket_timeout=10)
        stall = asyncio.create_task(sleeper.execute_command("DEBUG", "SLEEP", "0.5"))
        await asyncio.sleep(0.1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(conn.write(messages), 0.1)
        await stall
        await sleeper.aclose()
        await deliver(conn, messages)
        assert await conn.health() is None
    finally:
        await conn.close()
    entries = await admin.xrange(f"{prefix}:llama-x:0")
    assert [f[b"data"] for _, f in entries] == [m.value for m in messages]


@integration
@pytest.mark.parametrize("indexed", [False, True])
async def test_an_absent_entry_below_the_top_is_refused_for_itself(redis_server: RedisServer, indexed: bool) -> None:
    """The bridge never stores a later entry of a stream before an earlier one; if another client
    did (here: wrote entry 2 itself), entry 1 can never be added in order: it is refused for
    itself (dead-lettered, reason out_of_order), not mistaken for a duplicate, and its stream
    goes on."""
    s = sink("json", "batch")
    prefix = new_prefix()
    stream = Stream("llama-s", 0)
    messages = render(s, stream_records(stream, 4))
    conn = make_indexed(redis_server.url, s, prefix, "i", enabled=indexed)
    other = aioredis.Redis.from_url(redis_server.url)
    await conn.connect()
    try:
        await conn.write([messages[0]])
        await other.xadd(f"{prefix}:llama-s:0", {"by": "another writer"}, id=entry_id(messages[2].position))
        with pytest.raises(Permanent) as info:
            await conn.write([messages[1]])
        assert info.value.reason == "out_of_order" and "another client" in str(info.value)
        with pytest.raises(PartialFailure) as partial:
            await conn.write(messages)  # 0 is a duplicate, 1 out of order, 2 "a duplicate", 3 new
        assert list(partial.value.errors) == [1] and isinstance(partial.value.errors[1], Permanent)
        assert await other.xlen(f"{prefix}:llama-s:0") == 3
    finally:
        await conn.close()
        await other.aclose()


@integration
async def test_an_announcement_below_what_the_stream_key_holds_is_settled_there(redis_server: RedisServer) -> None:
    """breaker94 B1/B2: a bridge SIGKILLed before its checkpoint saved its last writes restarts from
    an older position; the engine's replay no longer holds 0..3, so it announces them lost, while
    the stream key holds 0..5 already. Redis refused the EventsLost below its top (out_of_order),
    the runtime kept and retried it, and nothing later of the stream was ever written (20 of 20
    runs). The key got everything up to its top in order: the span is settled there."""
    s = sink("json", "batch")
    prefix = new_prefix()
    stream = Stream("llama-k", 0)
    batches = render(s, stream_records(stream, 8))
    key = f"{prefix}:llama-k:0"
    before = make(redis_server.url, s, stream=prefix + ":{source}:{dp_rank}")
    await before.connect()
    try:
        await before.write(batches[:6])
    finally:
        await before.close()
    restarted = make(redis_server.url, s, stream=prefix + ":{source}:{dp_rank}")
    await restarted.connect()
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await restarted.write(render(s, [events_lost(stream, 0, 0, 3, "replay_buffer_exceeded", 1.0)]) + batches[4:])
        assert await restarted.health() is None
        held = [json.loads(f[b"data"]) for _, f in await client.xrange(key)]
        assert [(h["type"], h["seq"]) for h in held] == [("EventBatch", n) for n in range(8)], held
        # breaker98 B4: a refusal met again after a SIGKILL, whose announcement an earlier release
        # had put elsewhere (at the top of its write): absent below the top, settled too, where it
        # was refused (out_of_order), kept and retried for ever, and the stream stopped (6 of 6).
        refusal = events_lost(stream, 0, 2, 2, "sink_refused:redis", 1.0)
        refusal.to_seq = 2
        await restarted.write(render(s, [refusal]))
        assert [json.loads(f[b"data"])["seq"] for _, f in await client.xrange(key)] == list(range(8))
    finally:
        await restarted.close()
        await client.aclose()


@integration
async def test_maxlen_trims_approximately_and_redelivery_below_the_head_counts_as_stored(redis_server: RedisServer) -> None:
    s = sink("json", "event")
    prefix = new_prefix()
    stream = Stream("llama-m", 0)
    messages = render(s, stream_records(stream, 1000))  # 3000 entries
    conn = make(redis_server.url, s, stream=prefix + ":{source}:{dp_rank}", maxlen=200)
    await conn.connect()
    try:
        for i in range(0, len(messages), 250):
            await conn.write(messages[i : i + 250])
        client = aioredis.Redis.from_url(redis_server.url)
        key = f"{prefix}:llama-m:0"
        length = await client.xlen(key)
        # "~" trims whole radix-tree nodes (stream-node-max-entries, 100 by default).
        assert 200 <= length <= 200 + 100 + 250, length
        newest = await client.xrevrange(key, count=1)
        assert newest[0][0].decode() == entry_id(messages[-1].position)
        await conn.write(messages[:10])  # long trimmed away: counted as stored, nothing added
        assert await client.xlen(key) == length
        await client.aclose()
    finally:
        await conn.close()


# -- the block index ----------------------------------------------------------------------------


def random_records(rng: random.Random, stream: Stream, count: int, pool: list[Any]) -> list[Record]:
    """A long random history of one engine: stores, removals (of held and unknown blocks),
    rare full clears, and an engine restart (SourceReset, new epoch) in the middle."""
    records: list[Record] = []
    held: list[Any] = []
    epoch, seq = 1, 0
    for n in range(count):
        if n == count // 2:
            epoch, seq = epoch + 1, 0
            records.append(source_reset(stream, epoch, "publisher_restart", 0.0))
            held.clear()
        events: list[Event] = []
        for _ in range(rng.randint(1, 6)):
            roll = rng.random()
            if roll < 0.004:
                events.append({"type": "AllBlocksCleared"})
                held.clear()
            elif roll < 0.6 or not held:
                hashes = rng.sample(pool, rng.randint(1, 5))
                events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": hashes,
                        "parent_block_hash": None,
                        "token_ids": [1, 2, 3],
                        "block_size": 16,
                        "lora_id": None,
                        "medium": "GPU",
                    }
                )
                held.extend(hashes)
            else:
                gone = rng.sample(held, min(len(held), rng.randint(1, 4))) + rng.sample(pool, 1)
                events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
                held = [h for h in held if h not in gone]
        ts = 1_700_000_000.0 + n
        payload = msgspec.msgpack.encode([ts, events, stream.dp_rank])
        records.append(Record(stream=stream, epoch=epoch, seq=seq, ts=ts, payload=payload, events=events))
        seq += 1
    return records


INDEX_CASES = [
    pytest.param("json", "event", "int", False, id="json-event-int"),
    pytest.param("msgpack", "batch", "hex", False, id="msgpack-batch-hexints"),
    pytest.param("raw", "batch", "int", True, id="raw-binary-hashes"),
]


@integration
@pytest.mark.parametrize(("fmt", "granularity", "hash_format", "binary"), INDEX_CASES)
async def test_index_matches_a_model_of_the_engine_cache(
    redis_server: RedisServer, fmt: str, granularity: str, hash_format: str, binary: bool
) -> None:
    rng = random.Random(f"{fmt}-{granularity}-{hash_format}")
    s = sink(fmt, granularity, hash_format)
    prefix = new_prefix()
    stream = Stream("llama-i", 3)
    if binary:
        pool: list[Any] = [rng.randbytes(32) for _ in range(300)]
        model = CacheModel(lambda h: h.hex())
    else:
        pool = [rng.randrange(2**64) for _ in range(300)]
        model = CacheModel(hex64 if hash_format == "hex" else str)
    records = random_records(rng, stream, 1500, pool)
    conn = make_indexed(redis_server.url, s, prefix, "blocks")
    key, set_key = f"{prefix}:llama-i:3", f"{prefix}:llama-i:3:blocks"
    await conn.connect()
    written: list[Message] = []
    largest = 0
    try:
        i = 0
        while i < len(records):
            chunk = records[i : i + rng.randint(1, 25)]
            messages = render(s, chunk)
            await conn.write(messages)
            for r in chunk:
                model.apply(r)
            written += messages
            i += len(chunk)
            roll = rng.random()
            if roll < 0.15:  # the runtime re-sends the tail after a timeout
                await conn.write(messages[rng.randrange(len(messages)) :])
            elif roll < 0.2:  # a much older message again (e.g. replay after a bridge restart)
                await conn.write([written[rng.randrange(len(written))]])
            largest = max(largest, len(model.blocks))
            if rng.random() < 0.05:
                assert await smembers(redis_server.url, set_key) == model.blocks
    finally:
        await conn.close()
    assert largest > 50 and model.blocks, "the run should exercise a sizeable set"
    assert await smembers(redis_server.url, set_key) == model.blocks
    entries = await xrange(redis_server.url, key)
    assert [to_stored(f).value for _, f in entries] == [m.value for m in written]
    # The router's question: which of these blocks does this engine hold?
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        probe = [*sorted(model.blocks)[:5], "not-a-block"]
        assert await client.smismember(set_key, probe) == [1, 1, 1, 1, 1, 0]
    finally:
        await client.aclose()


@integration
async def test_flushed_index_script_is_reloaded(redis_server: RedisServer) -> None:
    """A server restart or SCRIPT FLUSH forgets the script: the write sends it whole (EVAL) and goes on."""
    s = sink("json", "batch")
    prefix = new_prefix()
    stream = Stream("llama-f", 0)
    messages = render(s, stream_records(stream, 4))
    conn = make_indexed(redis_server.url, s, prefix, "b")
    client = aioredis.Redis.from_url(redis_server.url)
    await conn.connect()
    try:
        await conn.write(messages[:2])
        await client.script_flush()
        await conn.write(messages)
    finally:
        await conn.close()
    assert await client.xlen(f"{prefix}:llama-f:0") == 4
    model = CacheModel(str)
    for r in stream_records(stream, 4):
        model.apply(r)
    assert await smembers(redis_server.url, f"{prefix}:llama-f:0:b") == model.blocks
    await client.aclose()


@integration
@pytest.mark.parametrize("policy", ["keep", "clear"])
async def test_index_after_events_lost(redis_server: RedisServer, policy: str) -> None:
    s = sink("json", "event")
    prefix = new_prefix()
    stream = Stream("llama-l", 0)
    records = [batch(stream, 0, epoch=1), events_lost(stream, 1, 1, 4, "replay_unavailable", 0.0)]
    conn = make_indexed(redis_server.url, s, prefix, "b", on_events_lost=policy)
    await conn.connect()
    try:
        await conn.write(render(s, records[:1]))
        before = await smembers(redis_server.url, f"{prefix}:llama-l:0:b")
        await conn.write(render(s, records[1:]))
    finally:
        await conn.close()
    assert before
    assert await smembers(redis_server.url, f"{prefix}:llama-l:0:b") == (before if policy == "keep" else set())


@integration
@pytest.mark.parametrize("granularity", ["event", "batch"])
async def test_the_index_counts_copies_per_medium(redis_server: RedisServer, granularity: str) -> None:
    """vLLM stores a block twice and removes it once (one copy left), and a BlockRemoved of the
    CPU copy leaves the GPU copy: the index used to answer "absent" for both. It counts copies per
    (medium, group_idx): a block is a member while any copy is held, across writes and re-sends."""
    s = sink("json", granularity)
    prefix = new_prefix()
    stream = Stream("llama-c", 0)

    def stored(h: int, medium: str = "GPU") -> Event:
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [1],
                "block_size": 16, "lora_id": None, "medium": medium}  # fmt: skip

    def removed(h: int, medium: str = "GPU") -> Event:
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium}

    steps: list[list[Event]] = [
        [stored(1)],
        [stored(1), stored(2)],  # block 1 twice
        [removed(1)],  # one copy of block 1 left
        [removed(2, "CPU"), stored(3, "CPU"), stored(3), removed(3)],  # 2 keeps its GPU copy, 3 its CPU one
        [removed(4)],  # never held: nothing
    ]
    records = [Record(stream=stream, epoch=1, seq=q, ts=1.0, events=events) for q, events in enumerate(steps)]
    conn = make_indexed(redis_server.url, s, prefix, "blocks")
    client = aioredis.Redis.from_url(redis_server.url)
    set_key = f"{prefix}:llama-c:0:blocks"
    try:
        for q in range(len(records)):
            await conn.write(render(s, records[q : q + 1]))
            await conn.write(render(s, records[: q + 1]))  # re-sent: counted once
        assert await client.smismember(set_key, ["1", "2", "3", "4"]) == [1, 1, 1, 0]
        last = [removed(1), removed(2), removed(3, "CPU")]
        records.append(Record(stream=stream, epoch=1, seq=len(records), ts=1.0, events=last))
        await conn.write(render(s, records[-1:]))
        assert await client.smismember(set_key, ["1", "2", "3"]) == [0, 0, 0]
    finally:
        await conn.close()
        await client.delete(f"{prefix}:llama-c:0", set_key, set_key + ":counts")
        await client.aclose()


def test_index_delta_counts_each_copy_in_order() -> None:
    events: list[Event] = [
        {"type": "BlockStored", "block_hashes": [1, 2, 3]},
        {"type": "BlockRemoved", "block_hashes": [2, 9, 2]},
        {"type": "BlockStored", "block_hashes": [2, b"\x0a\xff", 1]},
        {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU"},
        {"type": "Unknown", "block_hashes": [7]},
    ]
    d = index_delta(events)
    assert d.clear is False
    assert {(m, f): (step, floor) for m, f, step, floor in d.changes} == {
        ("1", "c:-:-:1"): (2, 2),
        ("2", "c:-:-:2"): (0, 1),  # +1 -1 -1 (floored at 0) +1
        ("3", "c:-:-:3"): (1, 1),
        ("9", "c:-:-:9"): (-1, 0),
        ("0aff", "c:-:-:0aff"): (1, 1),
        ("3", "c:CPU:-:3"): (-1, 0),  # a removal from another medium leaves the copy above
    }
    d = index_delta(
        [
            {"type": "BlockStored", "block_hashes": [1]},
            {"type": "AllBlocksCleared"},
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 1},
            {"type": "BlockStored", "block_hashes": [-1], "medium": "a:b"},
        ],
        True,
    )
    assert d == (
        True,
        [
            ("0000000000000005", "c:GPU:1:0000000000000005", -1, 0),
            ("ffffffffffffffff", "c:a%3Ab:-:ffffffffffffffff", 1, 1),
        ],
    )


# -- failures -----------------------------------------------------------------------------------


@integration
async def test_wrongtype_is_a_partial_permanent_failure(redis_server: RedisServer) -> None:
    s = sink("json", "batch")
    prefix = new_prefix()
    good, bad = Stream("good", 0), Stream("bad", 0)
    client = aioredis.Redis.from_url(redis_server.url)
    await client.set(f"{prefix}:bad:0", "not a stream")
    records = [batch(good, 0), batch(bad, 0), batch(good, 1), batch(bad, 1)]
    conn = make(redis_server.url, s, stream=prefix + ":{source}:{dp_rank}")
    await conn.connect()
    try:
        with pytest.raises(PartialFailure) as info:
            await conn.write(render(s, records))
        assert info.value.failed == [1, 3]
        assert isinstance(info.value.cause, Permanent) and "WRONGTYPE" in str(info.value.cause)
        with pytest.raises(Permanent):
            await conn.write(render(s, records[1:2]))
        assert await client.xlen(f"{prefix}:good:0") == 2
    finally:
        await conn.close()
        await client.aclose()


@integration
async def test_connect_refuses_a_known_streams_key_of_another_type(redis_server: RedisServer) -> None:
    """breaker46 B3: a run whose stream key held a string connected and said it was ready, then
    dead-lettered every batch of the stream. The runtime gives the connector the configured streams
    (``known_streams``) before it connects: connect refuses such a key (``key_type``, so the sink is
    not ready and says why), and connects once the key is gone; keys of streams it does not know
    (a discovered engine's) are left to the writes."""
    prefix = new_prefix()
    client = aioredis.Redis.from_url(redis_server.url)
    await client.set(f"{prefix}:w:0:blocks", "a string")
    conn = make_indexed(redis_server.url, sink("json", "batch"), prefix, "blocks")
    try:
        await conn.connect()  # no known streams: nothing to ask
        await conn.close()
        conn.known_streams = [Stream("w", 0), Stream("w", 1)]
        with pytest.raises(NotConnected) as info:
            await conn.connect()
        assert info.value.reason == "key_type", info.value
        assert f"index key '{prefix}:w:0:blocks' holds a string, not a set" in str(info.value), info.value
        await conn.close()
        await client.delete(f"{prefix}:w:0:blocks")
        await conn.connect()
    finally:
        await conn.close()
        await client.aclose()


async def test_wrongtype_index_key_stores_nothing(redis_server: RedisServer) -> None:
    s = sink("json", "batch")
    prefix = new_prefix()
    stream = Stream("w", 0)
    client = aioredis.Redis.from_url(redis_server.url)
    await client.set(f"{prefix}:w:0:blocks", "a string")
    conn = make_indexed(redis_server.url, s, prefix, "blocks")
    await conn.connect()
    try:
        with pytest.raises(Permanent, match="WRONGTYPE"):
            await conn.write(render(s, [batch(stream, 0)]))
        assert await client.exists(f"{prefix}:w:0") == 0, "the entry must not be stored without its index change"
    finally:
        await conn.close()
        await client.aclose()


@integration
@pytest.mark.parametrize("indexed", [False, True])
async def test_out_of_memory_is_retriable(private_redis: RedisServer, admin: aioredis.Redis, indexed: bool) -> None:
    s = sink("json", "batch")
    prefix = new_prefix()
    stream = Stream("oom", 0)
    messages = render(s, stream_records(stream, 3))
    conn = make_indexed(private_redis.url, s, prefix, "b", enabled=indexed, username=USER, password=SECRET)
    await conn.connect()
    try:
        await admin.config_set("maxmemory", 1)
        with pytest.raises(Retriable) as info:
            await conn.write(messages)
        assert info.value.reason == "oom"
        await admin.config_set("maxmemory", 0)
        await conn.write(messages)
    finally:
        await conn.close()
    assert await admin.xlen(f"{prefix}:oom:0") == 3


@integration
async def test_an_acl_refusal_inside_the_write_script_is_retried(private_redis: RedisServer, admin: aioredis.Redis) -> None:
    """A user that may run scripts but not XADD: Redis 7.0 words that refusal inside a script as
    "ERR ... can't run this command" (7.2 and later: NOPERM). Either way it is an ACL mistake an
    operator fixes: retried (no_permission), never dead-lettered, and delivered once fixed."""
    s = sink("json", "batch")
    prefix = new_prefix()
    messages = render(s, stream_records(Stream("acl", 0), 3))
    await admin.execute_command("ACL", "SETUSER", "noxadd", "on", f">{SECRET}", "~*", "&*", "+@all")
    conn = make(private_redis.url, s, username="noxadd", password=SECRET, stream=prefix + ":{source}:{dp_rank}")
    await conn.connect()
    # Revoked after connect, which refuses a user that may not run XADD (test_redis_faults).
    await admin.execute_command("ACL", "SETUSER", "noxadd", "-xadd")
    try:
        with pytest.raises(Retriable) as info:
            await conn.write(messages)
        assert info.value.reason == "no_permission"
        await admin.execute_command("ACL", "SETUSER", "noxadd", "+xadd")
        await conn.write(messages)
    finally:
        await conn.close()
        await admin.execute_command("ACL", "DELUSER", "noxadd")
    assert await admin.xlen(f"{prefix}:acl:0") == 3


@integration
async def test_busy_server_is_retriable(private_redis: RedisServer, admin: aioredis.Redis) -> None:
    s = sink("json", "batch")
    prefix = new_prefix()
    messages = render(s, stream_records(Stream("busy", 0), 2))
    conn = make(private_redis.url, s, username=USER, password=SECRET, stream=prefix + ":{source}:{dp_rank}")
    await conn.connect()
    await conn.write(messages[:1])  # the connection is open before the server gets busy
    spinner = aioredis.Redis.from_url(private_redis.url, socket_timeout=None)
    spin = asyncio.create_task(spinner.eval("while true do end", 0))
    try:
        await asyncio.sleep(0.4)  # past lua-time-limit (100 ms): the server answers BUSY
        with pytest.raises(Retriable) as info:
            await conn.write(messages)
        assert info.value.reason == "busy"
        assert await conn.health() is not None
    finally:
        await admin.script_kill()
        with pytest.raises(redis.ResponseError):
            await spin
        await spinner.aclose()
    try:
        await conn.write(messages)
    finally:
        await conn.close()
    assert await admin.xlen(f"{prefix}:busy:0") == 2


@integration
async def test_unreachable_server_is_not_connected_and_secrets_stay_out(private_redis: RedisServer) -> None:
    closed = f"redis://127.0.0.1:{_closed_port()}/0"
    conn = make(closed, password=SECRET, timeout="500ms")
    with pytest.raises(NotConnected) as info:
        await conn.connect()
    text = str(info.value)
    assert "redis-test" in text and f"127.0.0.1:{closed.rsplit(':', 1)[1].split('/')[0]}" in text
    reason = await conn.health()
    assert reason is not None
    with pytest.raises(NotConnected):
        await conn.write(render(sink(), [batch(Stream("x", 0), 0)]))
    await conn.close()
    await conn.close()  # twice: still quiet
    # Wrong password (in the URL this time): NotConnected, and the secret appears nowhere.
    url_with_secret = private_redis.url.replace("redis://", f"redis://{USER}:{SECRET}x@")
    wrong = make(url_with_secret)
    with pytest.raises(NotConnected) as auth:
        await wrong.connect()
    assert auth.value.reason == "auth"
    await wrong.close()
    for text in (
        str(info.value),
        reason,
        str(auth.value),
        repr(wrong),
        repr(wrong.options),
        str(wrong.options),
        repr(conn.options),
        repr(options(closed, password=SECRET)),
    ):
        assert SECRET not in text, text
    right = make(private_redis.url, username=USER, password=SECRET)
    await right.connect()
    assert await right.health() is None
    await right.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- TLS ----------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvb-test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=d,
        )  # fmt: skip


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, int, Path]]:
    """redis-server with a TLS port that requires client certificates (plain port for health checks)."""
    if shutil.which("openssl") is None:
        unavailable("openssl", "not installed")
    certs = tmp_path_factory.mktemp("redis-tls-certs")
    _certificates(certs)
    tls_port = free_port()
    server = RedisServer(
        tmp_path_factory.mktemp("redis-tls"),
        persistent=False,
        extra_config={
            "tls-port": str(tls_port),
            "tls-cert-file": str(certs / "server.pem"),
            "tls-key-file": str(certs / "server.key"),
            "tls-ca-cert-file": str(certs / "ca.pem"),
            "tls-auth-clients": "yes",
        },
    )
    with own_server("redis (tls)", server):
        yield server, tls_port, certs


@integration
async def test_tls_with_client_certificate(tls_redis: tuple[RedisServer, int, Path]) -> None:
    server, tls_port, certs = tls_redis
    url = f"rediss://127.0.0.1:{tls_port}/0"
    s = sink("json", "batch")
    prefix = new_prefix()
    messages = render(s, stream_records(Stream("tls", 0), 3))
    tls = {"ca_file": str(certs / "ca.pem"), "cert_file": str(certs / "client.pem"), "key_file": str(certs / "client.key")}
    conn = make(url, s, stream=prefix + ":{source}:{dp_rank}", tls=tls)
    await conn.connect()
    try:
        await conn.write(messages)
        assert await conn.health() is None
    finally:
        await conn.close()
    entries = await xrange(server.url, f"{prefix}:tls:0")
    assert [f[b"data"] for _, f in entries] == [m.value for m in messages]
    # No client certificate, or a server the system CAs do not vouch for: not connected.
    for bad in ({"ca_file": str(certs / "ca.pem")}, {}):
        refused = make(url, s, stream=prefix + ":{source}:{dp_rank}", tls=bad, timeout="2s")
        with pytest.raises(NotConnected):
            await refused.connect()
        await refused.close()


# -- restart in the middle of a stream ----------------------------------------------------------


@integration
@pytest.mark.parametrize("indexed", [False, True])
async def test_server_restart_mid_stream_loses_nothing(redis_server: RedisServer, indexed: bool) -> None:
    s = sink("json", "event")
    prefix = new_prefix()
    stream = Stream("llama-r", 0)
    rng = random.Random(11)
    records = random_records(rng, stream, 300, [rng.randrange(2**64) for _ in range(100)])
    model = CacheModel(str)
    conn = make_indexed(redis_server.url, s, prefix, "blocks", enabled=indexed, timeout="1s")
    await conn.connect()
    retries = 0
    writes = range(0, len(records), 5)
    marks = {writes[len(writes) // 3]: asyncio.Event(), writes[2 * len(writes) // 3]: asyncio.Event()}
    down = {i: asyncio.Event() for i in marks}
    restarts_seen = 0

    async def produce() -> None:
        nonlocal retries
        for i in writes:
            if i in marks:
                marks[i].set()  # the server goes down while this loop keeps writing
                await down[i].wait()  # (however slow the machine, the next write meets it down)
            retries += await deliver(conn, render(s, records[i : i + 5]))
            for r in records[i : i + 5]:
                model.apply(r)
            await asyncio.sleep(0.01)

    async def restart() -> None:
        nonlocal restarts_seen
        for i, mark in marks.items():
            await mark.wait()
            await redis_server.astop()
            down[i].set()
            restarts_seen += not producer.done()
            await asyncio.sleep(0.5)
            await redis_server.astart()

    try:
        producer = asyncio.create_task(produce())
        await asyncio.wait_for(restart(), 120)
        await asyncio.wait_for(producer, 120)
    finally:
        await conn.close()
    assert restarts_seen == 2, "both restarts should happen while the stream is being written"
    assert retries > 0, "the restarts should have been felt"
    entries = await xrange(redis_server.url, f"{prefix}:llama-r:0")
    assert [f[b"data"] for _, f in entries] == [m.value for m in render(s, records)]
    if indexed:
        assert await smembers(redis_server.url, f"{prefix}:llama-r:0:blocks") == model.blocks


# -- configuration ------------------------------------------------------------------------------


def test_registry_builds_the_connector_from_sink_keys() -> None:
    from bridge.config import from_data

    config = from_data(
        {
            "sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}],
            "sinks": [
                {
                    "type": "redis",
                    "url": "redis://127.0.0.1:6379/0",
                    "password": "${PW}",
                    "maxlen": 1000,
                    "index": {"enabled": True},
                }
            ],
        },
        env={"PW": SECRET},
    )
    conn = Registry().build(config.sinks[0], 0)
    assert isinstance(conn, RedisConnector)
    assert conn.options.password is not None and conn.options.password.reveal() == SECRET
    assert SECRET not in repr(conn.options) and SECRET not in repr(conn)


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ({"url": "http://x"}, "url: expected redis://"),
        ({"url": "redis://x/abc"}, "url: the database 'abc' is not a number"),
        ({"url": "redis://x/0?db=x"}, "url: invalid value for 'db' in connection URL"),
        ({"url": "redis://x", "stream": "kv:{source}"}, "must name {source} and {dp_rank}"),
        ({"url": "redis://x", "stream": "kv:{source}:{dp_rank}:{}"}, "bad placeholder"),
        ({"url": "redis://x", "index": {"enabled": True, "key": "i:{source}:{dp_rank}:{type}"}}, "{type} not allowed"),
        ({"url": "redis://x", "index": {"enabled": True, "key": "i:{source}:{dp_rank}:{epoch}"}}, "{epoch} not allowed"),
        ({"url": "redis://x", "tls": {"ca_file": "/ca.pem"}}, "tls: only used with a rediss:// url"),
        ({"url": "redis://:a@x", "password": "b"}, "either in url or in password"),
        ({"url": "rediss://x?ssl_cert_reqs=none", "tls": {"ca_file": "/ca.pem"}}, "url: ssl_cert_reqs not allowed"),
        ({"url": "rediss://x/0?ssl_cert_reqs=none"}, "turns off certificate verification"),
        ({"url": "rediss://x/0?SSL_CHECK_HOSTNAME=false&ssl_ca_certs=/a"}, "SSL_CHECK_HOSTNAME, ssl_ca_certs not allowed"),
        ({"url": "rediss://x/0?ssl_cert_reqs=none"}, "set tls: {ca_file, cert_file, key_file, check_hostname} instead"),
        ({"url": "redis://x", "maxlen": 0}, "maxlen"),
        (
            {"url": "redis://x", "cluster": True, "stream": "kv:{source}:{dp_rank}", "index": {"enabled": True}},
            "hash to one slot",
        ),
        ({"url": "redis://x", "strem": "a"}, "sinks[0].strem: unknown key (did you mean stream?)"),
        ({"url": "redis://x", "state": {"enabled": True, "key": "s:{source}:{dp_rank}:{epoch}"}}, "{epoch} not allowed"),
        (
            {"url": "redis://x", "stream": "kv:{source}:{dp_rank}:{type}", "state": {"enabled": True}},
            "stream: {type} not allowed",
        ),
        ({"url": "redis://x", "state": {"enabled": True, "key": "s:{source}"}}, "state.key: 's:{source}' must name"),
        (
            {"url": "redis://x", "cluster": True, "state": {"enabled": True, "key": "s:{source}:{dp_rank}"}},
            "state.key: in a cluster",
        ),
    ],
)
def test_options_are_checked_with_their_path(keys: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        convert_options(keys, RedisOptions, "sinks[0]")
    assert problem in str(info.value)
    assert str(info.value).startswith("sinks[0]")


def test_cluster_defaults_put_stream_and_index_in_one_slot() -> None:
    from redis.crc import key_slot

    o = options("redis://x", cluster=True, index={"enabled": True})
    assert o.templates() == (CLUSTER_STREAM, CLUSTER_INDEX_KEY, CLUSTER_STATE_KEY)
    m = render(sink(), [batch(Stream("llama-a", 0), 0)])[0]
    conn = RedisConnector("c", o, sink())
    key = conn._stream.render(m)
    assert conn._index is not None
    index_key = conn._index.render(m)
    # The template's outer braces stay literal: the key carries the hash tag {llama-a:0}.
    assert (key, index_key) == ("kv:{llama-a:0}", "kv:{llama-a:0}:blocks")
    assert key_slot(key.encode()) == key_slot(index_key.encode())


# -- Redis Cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A one-node Redis Cluster owning all 16384 slots (CROSSSLOT rules apply as in a big one)."""
    server = RedisServer(
        tmp_path_factory.mktemp("redis-cluster"),
        persistent=False,
        # The bus port defaults to port + 10000, which a free high port may not have.
        extra_config={"cluster-enabled": "yes", "cluster-config-file": "nodes.conf", "cluster-port": str(free_port())},
    )
    with own_server("redis (cluster)", server):
        with redis.Redis(host=server.host, port=server.port, socket_timeout=10) as client:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 30
            while "cluster_state:ok" not in _text(client.execute_command("CLUSTER", "INFO")):
                if time.monotonic() > deadline:
                    pytest.fail("the one-node cluster did not come up")
                time.sleep(0.1)
        yield server


def _text(reply: Any) -> str:
    if isinstance(reply, dict):
        return "\n".join(f"{k}:{v}" for k, v in reply.items())
    return reply.decode() if isinstance(reply, bytes) else str(reply)


@integration
async def test_cluster_with_index(cluster_redis: RedisServer) -> None:
    s = sink("json", "event")
    stream = Stream(f"c{uuid.uuid4().hex[:6]}", 1)
    rng = random.Random(5)
    records = random_records(rng, stream, 200, [rng.randrange(2**64) for _ in range(80)])
    model = CacheModel(str)
    conn = make(cluster_redis.url, s, cluster=True, index={"enabled": True})
    await conn.connect()
    try:
        for i in range(0, len(records), 20):
            messages = render(s, records[i : i + 20])
            await conn.write(messages)
            await conn.write(messages[len(messages) // 2 :])
            for r in records[i : i + 20]:
                model.apply(r)
        assert await conn.health() is None
    finally:
        await conn.close()
    key = f"kv:{{{stream.source}:1}}"
    client = aioredis.RedisCluster.from_url(cluster_redis.url)
    try:
        entries = await client.xrange(key)
        assert [f[b"data"] for _, f in entries] == [m.value for m in render(s, records)]
        assert {m.decode() for m in await client.smembers(key + ":blocks")} == model.blocks
    finally:
        await client.aclose()


def test_state_decodes_raw_batches() -> None:
    conn = make("redis://x", SinkConfig(type="redis", name="r", format="raw"), state={"enabled": True})
    assert conn.writes_state and conn.needs_events  # raw batches are decoded for the state
