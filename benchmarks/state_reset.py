"""A reset of a stream with many live blocks, while other streams flow: their lag, and the cost.

``python -m benchmarks.state_reset [--sinks redis,kafka,nats] [--blocks 100000] [--streams 8]
[--rate 20] [--rounds 2]`` starts a private server of each sink in turn and an in-process bridge
with that one sink keeping state (``state.enabled``). ``--streams`` simulated engines publish
``--rate`` batches/s each throughout; one scripted engine stores ``--blocks`` blocks (2,000 per
batch), then restarts: its ``SourceReset`` clears its state (the tracker detaches its tables;
Redis ``UNLINK`` s the hash in the same script call as the reset's entry, Kafka writes a tombstone
per key, NATS purges the stream's keys). Printed per round:

- the other streams' sink lag (``kv_bridge_lag_seconds``, ack time minus engine ts) before the
  reset and in the 3 s from it: the histogram bucket that holds the 99th percentile;
- the event loop's longest stall in those windows (a 1 ms ticker's overshoot);
- the time from the restart until the sink acknowledged the new epoch's first batch (its state,
  the clear included, is written with it);
- Redis: memory per entry of the state hash (``MEMORY USAGE`` / ``HLEN``) before the reset.

The machine is shared: compare the two windows of one round, not rounds or runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bridge.config import from_data
from bridge.metrics import LAG_BUCKETS
from bridge.runtime import Bridge
from bridge.simulator import Simulator, SimulatorOptions
from tests.infra.servers import KafkaServer, NatsServer, RedisServer
from tests.support.cache_engine import CacheEngine, event
from tests.support.harness import free_port

PER_BATCH = 2_000


async def until(read: Any, at_least: int, timeout: float = 120.0) -> None:
    """Poll ``read()`` until it returns at least ``at_least``."""
    deadline = time.monotonic() + timeout
    while (await read()) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"still below {at_least} after {timeout} s")
        await asyncio.sleep(0.05)


def p99_bucket(before: list[int], after: list[int]) -> str:
    """The upper bound of the bucket holding the 99th percentile of the observations in between."""
    counts = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(counts)
    if not total:
        return "-"
    seen = 0
    for bound, n in zip([*LAG_BUCKETS, float("inf")], counts, strict=True):
        seen += n
        if seen >= 0.99 * total:
            return f"<= {bound * 1000:g} ms" if bound != float("inf") else "> 300 s"
    return "?"


class Ticker:
    """The event loop's longest stall: a 1 ms sleep's overshoot, since the last ``take``."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - t - 0.001)

    def take(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def state_sink(kind: str, address: str, prefix: str) -> dict[str, Any]:
    """The sink under test, keeping state, named ``out``."""
    if kind == "redis":
        return {
            "type": "redis",
            "url": address,
            "stream": prefix + ":{source}:{dp_rank}",
            "maxlen": 10_000,
            "state": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:state"},
        }
    if kind == "kafka":
        return {
            "type": "kafka",
            "bootstrap_servers": address,
            "topic": prefix,
            "create_topics": {"enabled": True, "partitions": 4},
            "state": {"enabled": True, "topic": prefix + "-state", "create": True, "partitions": 4},
        }
    return {
        "type": "nats",
        "servers": address,
        "subject": prefix + ".{source}.{dp_rank}",
        "stream": {"create": True, "name": prefix.upper(), "subjects": [prefix + ".>"], "max_bytes": 2**30},
        "state": {"enabled": True, "bucket": prefix.upper() + "_STATE", "create": True},
    }


async def one_round(kind: str, address: str, blocks: int, streams: int, rate: float) -> dict[str, Any]:
    prefix = f"kvsr{uuid.uuid4().hex[:6]}"
    big_live, big_replay = free_port(), free_port()
    sims = [
        SimulatorOptions(endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=None, rate=rate, seed=i)
        for i in range(streams)
    ]
    config = {
        "sources": [
            {"name": "big", "endpoint": f"tcp://127.0.0.1:{big_live}", "replay_endpoint": f"tcp://127.0.0.1:{big_replay}"},
            *({"name": f"sim{i}", "endpoint": o.endpoint} for i, o in enumerate(sims)),
        ],
        "sinks": [{**state_sink(kind, address, prefix), "name": "out"}],
        "metrics": {"listen": ""},
        "dead_letter": {"path": "-"},
        "replay": {"idle_probe": 0},
    }
    out: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(CacheEngine(big_live, big_replay, seed=1))
        runs = []
        for o in sims:
            sim = await stack.enter_async_context(Simulator(o))
            runs.append(asyncio.create_task(sim.run()))
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        ticker = Ticker()
        lag = bridge.metrics.lag.labels("out")

        async def written(epoch: int | None = None) -> int:
            """1 once the sink acknowledged the big engine's last batch (its state with it)."""
            pos = bridge.checkpointer.position("big/0")
            return int(pos is not None and pos.seq == engine.last_seq and (epoch is None or pos.epoch > epoch))

        try:
            await engine.wait_subscribed()
            for first in range(1, blocks + 1, PER_BATCH):
                ev = event("BlockStored", block_hashes=list(range(first, first + PER_BATCH)), medium="GPU", group_idx=0)
                engine.apply(ev)
                await engine.send([ev])
            await until(written, 1)
            if kind == "redis":
                client = aioredis.Redis.from_url(address)
                key = f"{prefix}:big:0:state"
                out["bytes_per_entry"] = round((await client.memory_usage(key, samples=0) or 0) / await client.hlen(key), 1)
                await client.aclose()
            epoch = bridge.checkpointer.position("big/0").epoch  # type: ignore[union-attr]
            await asyncio.sleep(1.0)
            before = list(lag.counts)
            ticker.take()
            await asyncio.sleep(3.0)
            out["others_p99_before"] = p99_bucket(before, list(lag.counts))
            out["stall_before_ms"] = round(ticker.take() * 1000, 1)
            before = list(lag.counts)
            start = time.perf_counter()
            await engine.restart()
            await engine.wait_subscribed()
            await engine.step(1)
            await until(lambda: written(epoch), 1)
            out["reset_seconds"] = round(time.perf_counter() - start, 3)
            await asyncio.sleep(max(0.0, 3.0 - (time.perf_counter() - start)))
            out["others_p99_reset"] = p99_bucket(before, list(lag.counts))
            out["stall_reset_ms"] = round(ticker.take() * 1000, 1)
        finally:
            await ticker.stop()
            for task in runs:
                task.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            await bridge.stop()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rate", type=float, default=20.0, help="batches/s of each other stream")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sinks", default="redis,kafka,nats", help="comma-separated: redis, kafka, nats")
    args = parser.parse_args()
    servers = {"redis": RedisServer, "kafka": KafkaServer, "nats": NatsServer}
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for kind in args.sinks.split(","):
            server = servers[kind](Path(tmp) / kind)
            server.start()
            try:
                for _ in range(args.rounds):
                    rows.append((kind, await one_round(kind, server.address, args.blocks, args.streams, args.rate)))
            finally:
                server.remove()
    print(f"reset of {args.blocks:,} live blocks, {args.streams} other streams at {args.rate:g} batches/s, a sink with state")
    cols = ["others_p99_before", "others_p99_reset", "stall_before_ms", "stall_reset_ms", "reset_seconds", "bytes_per_entry"]
    print("  ".join(f"{c:>18}" for c in ["sink", *cols]))
    for kind, row in rows:
        print("  ".join(f"{x!s:>18}" for x in [kind, *(row.get(c, "-") for c in cols)]))


if __name__ == "__main__":
    asyncio.run(main())
