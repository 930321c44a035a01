"""What ``checkpoint.from_sinks`` costs at start-up, per stream and per sink, on the real servers.

Each sink holds 1,000 streams (a few batches each, some streams idle for a while so a Kafka
partition must be read back past the others' messages); one ``positions()`` call asks for all of
them. Every answer is checked against what was written (the last batch of each stream, its ts, and
for ``raw`` its CRC), a stream never written is reported as holding nothing, and the time per
stream is printed (docs/operations/scaling.md quotes it) and bounded loosely (it must not be seconds).
Kafka's scan limit is checked too: a stream whose last message lies beyond it is left out
("cannot tell"), not reported as holding nothing.
"""

from __future__ import annotations

import time
import uuid
import zlib
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import TopicPartition

from bridge.checkpoint import SinkPosition
from bridge.config import SinkConfig, convert
from bridge.connector import Registry
from bridge.formats import Renderer
from bridge.records import Record, Stream
from tests.support.records import batch
from tests.support.state_kafka import add_partitions, delete_records

pytestmark = pytest.mark.integration

N = 1000
BATCHES = 3


def connector(sink: dict[str, Any]) -> Any:
    common = {k: v for k, v in sink.items() if k in ("type", "name", "format", "granularity")}
    problems: list[str] = []
    cfg = convert({**common, "options": {k: v for k, v in sink.items() if k not in common}}, SinkConfig, "sink", problems)
    assert cfg is not None, problems
    return Registry().build(cfg, 0), Renderer(cfg.format, cfg.granularity)


async def fill(conn: Any, renderer: Renderer, streams: list[Stream]) -> dict[str, Record]:
    """BATCHES batches of each stream, streams interleaved; then again the first tenth (so the
    others' last messages sit further back). Returns each stream's last batch."""
    last: dict[str, Record] = {}
    for seq in range(BATCHES):
        records = [batch(s, seq, epoch=5) for s in streams]
        await conn.write([m for r in records for m in renderer.render(r)])
        last.update({r.stream.key: r for r in records})
    late = [batch(s, BATCHES, epoch=5) for s in streams[: N // 10]]
    await conn.write([m for r in late for m in renderer.render(r)])
    last.update({r.stream.key: r for r in late})
    return last


async def measure(kind: str, sink: dict[str, Any], raw: bool = False) -> float:
    conn, renderer = connector(sink)
    await conn.connect()
    try:
        streams = [Stream(f"src{i:04d}", i % 2) for i in range(N)]
        last = await fill(conn, renderer, streams)
        ask = [*streams, Stream("never-written", 0)]
        started = time.perf_counter()
        found = await conn.positions(ask)
        elapsed = time.perf_counter() - started
        one = []
        for s in streams[:20]:  # as discovery asks: one source (here one rank) at a time
            started = time.perf_counter()
            await conn.positions([s])
            one.append(time.perf_counter() - started)
    finally:
        await conn.close()
    assert found["never-written/0"] is None
    for s in streams:
        r = last[s.key]
        want = SinkPosition(5, r.seq, ts=r.ts, crc=zlib.crc32(r.payload) if raw else None)
        assert found[s.key] == want, s.key
    per_stream = elapsed / len(ask)
    print(
        f"{kind}: {len(ask)} streams in {elapsed * 1000:.1f} ms, {per_stream * 1e6:.0f} us per stream; "
        f"one stream per call: median {sorted(one)[len(one) // 2] * 1000:.2f} ms"
    )
    assert per_stream < 0.02
    return per_stream


async def test_redis(fresh_redis: Any) -> None:
    prefix = "cost" + uuid.uuid4().hex[:6]
    sink = {
        "type": "redis",
        "name": "r",
        "format": "json",
        "granularity": "batch",
        "url": fresh_redis.url,
        "stream": prefix + ":{source}:{dp_rank}",
    }
    await measure("redis", sink)


async def test_nats(nats_server: Any) -> None:
    uid = uuid.uuid4().hex[:6]
    sink = {
        "type": "nats",
        "name": "n",
        "format": "msgpack",
        "granularity": "batch",
        "servers": nats_server.url,
        "subject": f"c{uid}.{{source}}.{{dp_rank}}",
        "stream": {"create": True, "name": f"C{uid}"},
    }
    await measure("nats", sink)


@pytest.mark.parametrize("partitions", [1, 6])
async def test_kafka(kafka: Any, partitions: int) -> None:
    topic = await kafka.anew_topic(partitions)
    sink = {"type": "kafka", "name": "k", "format": "raw", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    await measure(f"kafka ({partitions} partitions)", sink, raw=True)


async def test_kafka_scan_limit(kafka: Any) -> None:
    topic = await kafka.anew_topic(1)
    base = {"type": "kafka", "name": "k", "format": "raw", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    conn, renderer = connector(base)
    await conn.connect()
    streams = [Stream(f"s{i}", 0) for i in range(50)]
    try:
        await fill(conn, renderer, streams)  # 4 rounds of 50 (N // 10 covers them all)
    finally:
        await conn.close()
    limited, _ = connector({**base, "position_scan": 20})
    await limited.connect()
    try:
        found = await limited.positions(streams)
    finally:
        await limited.close()
    # Within the last 20 records: s30..s49; the others cannot tell (not "nothing held").
    assert set(found) == {f"s{i}/0" for i in range(30, 50)}
    assert all(v is not None and v.seq == BATCHES for v in found.values())


async def test_kafka_later_calls_read_what_was_written_since(kafka: Any) -> None:
    """The connector keeps what it read of a partition; a later call must still see newer messages."""
    topic = await kafka.anew_topic(1)
    conn, renderer = connector(
        {"type": "kafka", "name": "k", "format": "raw", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    )
    await conn.connect()
    try:
        a, b = Stream("a", 0), Stream("b", 0)
        await conn.write(renderer.render(batch(a, 0, epoch=5)))
        assert await conn.positions([a]) == {"a/0": SinkPosition(5, 0, ts=batch(a, 0).ts, crc=zlib.crc32(batch(a, 0).payload))}
        assert await conn.positions([b]) == {"b/0": None}
        for seq in (1, 2):
            await conn.write([m for s in (a, b) for m in renderer.render(batch(s, seq, epoch=5))])
        found = await conn.positions([a, b])
        assert {k: v.seq if v else None for k, v in found.items()} == {"a/0": 2, "b/0": 2}
    finally:
        await conn.close()


async def test_kafka_records_deleted_from_a_partitions_start_cannot_tell(kafka: Any) -> None:
    """Retention or DeleteRecords moved the partition's start above offset 0: a stream not found
    back to that start may have had its messages there, so it cannot tell (left out), never
    "holds nothing" (a new pod then started the stream afresh with no SourceReset, writing the
    engine's buffer again in a new epoch: breaker31k Break 3). A stream found after the start
    still answers; a partition whose start is offset 0 still says "holds nothing"."""
    topic = await kafka.anew_topic(1)
    sink = {"type": "kafka", "name": "k", "format": "raw", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    conn, renderer = connector(sink)
    await conn.connect()
    a, b, never = Stream("a", 0), Stream("b", 0), Stream("never", 0)
    try:
        await conn.write([m for s in (a, b) for m in renderer.render(batch(s, 0, epoch=5))])
        assert await conn.positions([never]) == {"never/0": None}  # start at offset 0: nothing held
        await conn.write(renderer.render(batch(b, 1, epoch=5)))
    finally:
        await conn.close()
    assert await delete_records(kafka.bootstrap_servers, TopicPartition(topic, 0), keep=1) == 2  # a's batch 0 and b's
    later, _ = connector(sink)  # a new pod
    await later.connect()
    try:
        found = await later.positions([a, b, never])
        assert found == {"b/0": SinkPosition(5, 1, ts=batch(b, 1).ts, crc=zlib.crc32(batch(b, 1).payload))}
    finally:
        await later.close()
    await delete_records(kafka.bootstrap_servers, TopicPartition(topic, 0))  # the partition empty, its start at 3
    emptied, _ = connector(sink)
    await emptied.connect()
    try:
        assert await emptied.positions([a, b, never]) == {}
    finally:
        await emptied.close()


async def test_kafka_a_stream_in_the_partition_its_key_went_to_before_partitions_were_added_cannot_tell(kafka: Any) -> None:
    """Partitions added to the topic send a stream's key to another partition, which holds nothing
    of it: its records are in the partition the key went to before. That is "cannot tell", never
    "holds nothing" (a new pod started the stream afresh with no SourceReset, the sink holding its
    epoch: breaker31y B2). A stream found in no partition its key ever went to holds nothing."""
    topic = await kafka.anew_topic(1)
    sink = {"type": "kafka", "name": "k", "format": "raw", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    conn, renderer = connector(sink)
    await conn.connect()
    moved, never = Stream("a", 0), Stream("never", 0)  # with 4 partitions, "a/0" goes to 3, "never/0" to 2
    try:
        await conn.write([m for seq in range(2) for m in renderer.render(batch(moved, seq, epoch=5))])
    finally:
        await conn.close()
    await add_partitions(kafka.bootstrap_servers, topic, 4)
    later, _ = connector(sink)  # a new pod
    await later.connect()
    try:
        assert later._partitions[topic] == [0, 1, 2, 3]
        assert await later.positions([moved, never]) == {"never/0": None}
    finally:
        await later.close()


@pytest.mark.parametrize("index", [False, True])
async def test_redis_a_stream_key_emptied_or_deleted_with_its_state_kept_cannot_tell(fresh_redis: Any, index: bool) -> None:
    """A stream key found empty (its entries trimmed) or missing while the stream's state hash
    (or index set) exists was written, its entries deleted since (DEL, expiry): cannot tell (left
    out), never "holds nothing" (a new pod then wrote the engine's buffer again in a new epoch
    with no SourceReset: breaker31k Break 3). A stream with no key of its own at all (never
    written, or FLUSHALL) holds nothing."""
    prefix = "gone" + uuid.uuid4().hex[:6]
    sink = {
        "type": "redis",
        "name": "r",
        "format": "json",
        "granularity": "batch",
        "url": fresh_redis.url,
        "stream": prefix + ":{source}:{dp_rank}",
        "state" if not index else "index": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:kept"},
    }
    conn, renderer = connector(sink)
    trimmed, deleted, never = Stream("t", 0), Stream("d", 0), Stream("n", 0)
    client = aioredis.Redis.from_url(fresh_redis.url)
    await conn.connect()
    try:
        await conn.write([m for s in (trimmed, deleted) for m in renderer.render(batch(s, 0, epoch=5))])
        if not index:  # (the state hash by hand: its changes come from the runtime's tracker, not a bare connector)
            await client.hset(f"{prefix}:d:0:kept", "_at", "5-0")
        assert await client.exists(f"{prefix}:d:0:kept") == 1
        await client.xtrim(f"{prefix}:t:0", maxlen=0, approximate=False)
        await client.delete(f"{prefix}:d:0")
        assert await conn.positions([trimmed, deleted, never]) == {"n/0": None}
        await client.flushall()
        assert await conn.positions([trimmed, deleted, never]) == {"t/0": None, "d/0": None, "n/0": None}
    finally:
        await conn.close()
        await client.aclose()
