"""Events per second through RedisConnector.write versus a bare redis-py pipelined XADD.

Both sides write the same entries (json, event granularity: one entry per event, the same ids and
fields) in writes of ``--chunk`` messages to fresh streams, so the difference is the connector's
own cost: rendering keys and ids, the duplicate check, failure classification; and with
``--index`` the Lua script that keeps the block set.

    .venv/bin/python -m benchmarks.redis_client_bench --url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Sequence

import redis.asyncio as aioredis

from bridge.config import SinkConfig, convert_options
from bridge.formats import Message, Renderer
from bridge.records import Stream
from connectors.redis import RedisConnector, RedisOptions, entry_id, message_position
from tests.support.records import stream_records


def messages_for(records: int, sources: int) -> list[Message]:
    renderer = Renderer("json", "event")
    out: list[Message] = []
    per_source = records // sources
    for s in range(sources):
        for rec in stream_records(Stream(f"bench-{s}", 0), per_source, epoch=1):
            out.extend(renderer.render(rec))
    return out


async def bench_connector(url: str, messages: Sequence[Message], chunk: int, index: bool) -> float:
    prefix = f"bench:{uuid.uuid4().hex[:8]}"
    options = convert_options(
        {
            "url": url,
            "stream": prefix + ":{source}:{dp_rank}",
            "index": {"enabled": index, "key": prefix + ":{source}:{dp_rank}:b"},
        },
        RedisOptions,
        "bench",
    )
    conn = RedisConnector("bench", options, SinkConfig(type="redis", name="bench"))
    await conn.connect()
    try:
        start = time.perf_counter()
        for i in range(0, len(messages), chunk):
            await conn.write(messages[i : i + chunk])
        return time.perf_counter() - start
    finally:
        await conn.close()
        await _drop(url, prefix)


async def bench_bare(url: str, messages: Sequence[Message], chunk: int) -> float:
    prefix = f"bench:{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(url)
    try:
        start = time.perf_counter()
        for i in range(0, len(messages), chunk):
            pipe = client.pipeline(transaction=False)
            for m in messages[i : i + chunk]:
                s = m.record.stream
                fields: dict[str | bytes, str | bytes] = dict(m.headers)
                fields["data"] = m.value
                pipe.xadd(f"{prefix}:{s.source}:{s.dp_rank}", fields, id=entry_id(message_position(m)))  # type: ignore[arg-type]
            await pipe.execute()
        return time.perf_counter() - start
    finally:
        await client.aclose()
        await _drop(url, prefix)


async def _drop(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=prefix + ":*", count=1000)]
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])
    finally:
        await client.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--records", type=int, default=20000, help="engine batches (3 events each)")
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=2000, help="messages per write (batch.max_messages)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    messages = messages_for(args.records, args.sources)
    print(f"{len(messages)} events, writes of {args.chunk}, best of {args.rounds}")
    runs = {
        "bare redis-py pipeline XADD": lambda: bench_bare(args.url, messages, args.chunk),
        "RedisConnector.write": lambda: bench_connector(args.url, messages, args.chunk, False),
        "RedisConnector.write, index": lambda: bench_connector(args.url, messages, args.chunk, True),
    }
    for name, run in runs.items():
        best = min([await run() for _ in range(args.rounds)])
        print(f"{name:32s} {len(messages) / best:>10,.0f} events/s  ({best:.2f} s)")


if __name__ == "__main__":
    asyncio.run(main())
