"""Sharded replicas over DNS-discovered engines, scaled from 2 to 3 without a shared volume (issue 18).

Simulated engines on loopback addresses 127.0.0.2.. (two ranks each) found through a stub DNS
server; every replica (an in-process :class:`Bridge` with ``discovery.dns.shard``) writes to the
same Redis. Two replicas (ordinals 0 and 1 of 2) cover every stream exactly once; then both stop,
the engines keep publishing (their replay buffers hold the gap), and three replicas (0, 1, 2 of 3)
start with no checkpoint file. Each phase: every stream read by exactly one replica. At the end:
every published batch is in Redis (nothing lost). With ``checkpoint.from_sinks`` every stream
goes on in its epoch, with no batch sent twice (the replicas' delivered counts add up to exactly
what the engines published); without it, the batches a new owner sends again are counted: the
figure docs/operations/scaling.md quotes (Redis drops those copies itself by entry id when they land
in the same epoch; Kafka would store them twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bridge.config import from_data
from bridge.discovery import shard_of
from bridge.runtime import Bridge
from bridge.simulator import Simulator, SimulatorOptions
from tests.infra.servers import RedisServer
from tests.support.dns import StubDns, stub_dns
from tests.support.harness import free_ports_on, metric
from tests.support.readback import read_redis

pytestmark = pytest.mark.integration

NAME = "engines.scale.svc.cluster.local"
HOSTS = [f"127.0.0.{i}" for i in range(2, 11)]  # 9 engines
RANKS = 2
BUFFER = 100_000  # batches each engine rank keeps for replay: far more than the test publishes
PERIOD = 0.02  # seconds between batches of every engine rank while it publishes


def _source(host: str) -> str:
    return "engines-" + host.replace(".", "-")


def _ports_free_on(hosts: list[str]) -> tuple[int, int]:
    """A PUB base port and a replay base port (RANKS each) free on every host."""
    base = free_ports_on(hosts, 2 * RANKS)[0]
    return base, base + RANKS


@contextlib.asynccontextmanager
async def _engines(ports: tuple[int, int]) -> AsyncIterator[dict[str, Simulator]]:
    async with contextlib.AsyncExitStack() as stack:
        sims = {}
        for i, h in enumerate(HOSTS):
            opts = SimulatorOptions(
                endpoint=f"tcp://{h}:{ports[0]}",
                replay_endpoint=f"tcp://{h}:{ports[1]}",
                dp_ranks=RANKS,
                rate=0,
                seed=i + 1,
                buffer_steps=BUFFER,
                events_per_batch=2,
            )
            sims[_source(h)] = await stack.enter_async_context(Simulator(opts))
        yield sims


async def _publish(sims: dict[str, Simulator], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for sim in sims.values():
            for r in range(RANKS):
                await sim.step(r)
        await asyncio.sleep(PERIOD)


def _config(dns: StubDns, ports: tuple[int, int], redis_url: str, prefix: str, index: int, count: int, from_sinks: bool) -> Any:
    return from_data(
        {
            "sources": [],
            "discovery": {
                "dns": {
                    "name": NAME,
                    "port": ports[0],
                    "replay_port": ports[1],
                    "dp_ranks": RANKS,
                    "interval": "200ms",
                    "timeout": "1s",
                    "resolver": dns.address,
                    "shard": {"count": count, "index": index},
                }
            },
            "sinks": [
                {
                    "type": "redis",
                    "name": "redis",
                    "format": "json",
                    "granularity": "batch",
                    "url": redis_url,
                    "stream": prefix + ":{source}:{dp_rank}",
                    "batch": {"linger": "2ms"},
                }
            ],
            "checkpoint": {"from_sinks": from_sinks},
            "metrics": {"listen": ""},
            "replay": {"timeout": "1s", "initial_backoff": "50ms", "max_backoff": "500ms"},
            "shutdown_timeout": "10s",
        },
        env={},
    )


def _owned(bridge: Bridge) -> set[str]:
    return set(bridge.pipelines)


async def _run_phase(
    dns: StubDns, ports: tuple[int, int], redis_url: str, prefix: str, count: int, from_sinks: bool, seconds: float
) -> tuple[list[set[str]], float]:
    """``count`` replicas for ``seconds``; returns what each read and the batches they delivered."""
    bridges = [Bridge(_config(dns, ports, redis_url, prefix, i, count, from_sinks)) for i in range(count)]
    for b in bridges:
        await b.start()
    try:
        await asyncio.sleep(seconds)
        owned = [_owned(b) for b in bridges]
    finally:
        for b in bridges:
            await b.stop()
    delivered = sum(metric(b, "kv_bridge_sink_batches_total", sink="redis", outcome="delivered") for b in bridges)
    return owned, delivered


async def _scale(tmp: Path, redis: RedisServer, from_sinks: bool) -> dict[str, Any]:
    prefix = "scale" + uuid.uuid4().hex[:6]
    ports = _ports_free_on(HOSTS)
    streams = {f"{_source(h)}/{r}" for h in HOSTS for r in range(RANKS)}
    async with stub_dns() as dns, _engines(ports) as sims:
        dns.records[NAME] = HOSTS
        stop = asyncio.Event()
        publisher = asyncio.create_task(_publish(sims, stop))
        try:
            two, delivered_two = await _run_phase(dns, ports, redis.url, prefix, 2, from_sinks, 3.0)
            await asyncio.sleep(0.5)  # no replica runs; the engines publish on
            # The last phase runs until the engines stop and every batch is through.
            bridges = [Bridge(_config(dns, ports, redis.url, prefix, i, 3, from_sinks)) for i in range(3)]
            for b in bridges:
                await b.start()
            try:
                await asyncio.sleep(2.0)
                stop.set()
                await publisher
                published = {f"{name}/{r}": sim.ranks[r].seq for name, sim in sims.items() for r in range(RANKS)}
                deadline = time.monotonic() + 60
                while True:
                    behind = {
                        k: (p.sequencer.delivered, published[k])
                        for b in bridges
                        for k, p in b.pipelines.items()
                        if p.sequencer.delivered < published[k] - 1
                    }
                    if not behind:
                        break
                    assert time.monotonic() < deadline, f"streams behind: {sorted(behind.items())[:5]}"
                    await asyncio.sleep(0.1)
                for b in bridges:
                    for w in b.workers:
                        assert await w.flush(20)
                three = [_owned(b) for b in bridges]
            finally:
                for b in bridges:
                    await b.stop()
            delivered_three = sum(metric(b, "kv_bridge_sink_batches_total", sink="redis", outcome="delivered") for b in bridges)
        finally:
            stop.set()
            await asyncio.gather(publisher, return_exceptions=True)
        for owned, count in ((two, 2), (three, 3)):
            assert set.union(*owned) == streams, f"{count} replicas: every stream read"
            assert sum(len(o) for o in owned) == len(streams), f"{count} replicas: no stream read twice"
            for i, o in enumerate(owned):
                assert o == {s for s in streams if shard_of(s.rsplit("/", 1)[0], count) == i}
        moved = sum(1 for s in streams if shard_of(s.rsplit("/", 1)[0], 2) != shard_of(s.rsplit("/", 1)[0], 3))
        total = sum(published.values())
        stored: dict[str, set[tuple[int, int]]] = {}
        lost = 0
        copies_in_new_epochs = 0
        resets = 0
        for key in sorted(streams):
            one = (await read_redis(redis.url, [f"{prefix}:{key.replace('/', ':')}"])).rows
            seqs = [(e, s) for _r, e, s, _i, t in one if t == "EventBatch"]
            resets += sum(1 for *_x, t in one if t == "SourceReset")
            assert not [t for *_x, t in one if t == "EventsLost"], f"{key}: nothing announced lost"
            have = {s for _e, s in seqs}
            lost += len(set(range(published[key])) - have)
            copies_in_new_epochs += len(seqs) - len(have)
            stored[key] = set(seqs)
        return {
            "streams": len(streams),
            "moved": moved,
            "published": total,
            "sent": delivered_two + delivered_three,
            "sent_again": delivered_two + delivered_three - total,
            "lost": lost,
            "copies_stored": copies_in_new_epochs,
            "resets": resets,
            "epochs": {len({e for e, _s in v}) for v in stored.values()},
        }


async def test_scale_from_two_to_three_with_positions_from_the_sink(tmp_path: Path, fresh_redis: RedisServer) -> None:
    result = await _scale(tmp_path, fresh_redis, from_sinks=True)
    print("scale 2->3 with checkpoint.from_sinks:", result)
    assert result["lost"] == 0
    assert result["sent_again"] == 0, result  # no batch written twice, by any replica
    assert result["copies_stored"] == 0 and result["resets"] == 0
    assert result["epochs"] == {1}  # every stream goes on in the epoch it started in


async def test_scale_from_two_to_three_without_it_loses_nothing_and_counts_copies(
    tmp_path: Path, fresh_redis: RedisServer
) -> None:
    result = await _scale(tmp_path, fresh_redis, from_sinks=False)
    print("scale 2->3 without checkpoint.from_sinks:", result)
    assert result["lost"] == 0
    # Each replica starting a stream with no checkpoint replays the engine's whole buffer: every
    # batch published before it took over is sent again (moved or not: no volume is shared).
    assert result["sent_again"] > 0
