"""The delivery promises of design.md ("Delivery") under faults, on real servers.

- a sink's server down for 30 s under load (Kafka, Redis, NATS JetStream), ``backpressure: block``:
  every event delivered, in order per stream, duplicates only where the sink documents them
  (Kafka), and the bridge's memory stays bounded (measured from outside on a ``python -m bridge``
  process);
- fan-out isolation: a ``drop`` sink down does not hold back a file sink (its dropped span is
  announced and counted); two ``block`` sinks: one down holds back both (block-all);
- the bridge SIGKILLed under load and restarted from its checkpoint: Redis gets every entry once;
- an engine restart storm: ten restarts, each epoch announced once and delivered whole;
- dead letters: undecodable payloads land in the dead-letter file, the stream goes on.

Every scenario records its numbers (sent, delivered, duplicated, lost, peak RSS) in
``reliability.json`` in pytest's base temp directory and prints them (``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from bridge import wire
from bridge.endpoints import for_rank
from bridge.simulator import PROFILES, EventFactory, Simulator, SimulatorOptions, encode_batch
from tests.infra.servers import KafkaServer, ManagedServer, NatsServer, RedisServer
from tests.support.epochs import assert_first_epoch, assert_next_epoch
from tests.support.harness import free_port, free_ports, read_lines, running_bridge, wait_for
from tests.support.harness import metric as bridge_metric
from tests.support.process import BridgeProcess, BridgeRun, bridge_config, metric
from tests.support.readback import Readback, read_file, read_jetstream, read_kafka, read_redis

pytestmark = pytest.mark.integration

log = logging.getLogger("tests.reliability")
MiB = 2**20

# -- the scenario table ----------------------------------------------------------------------------


def report(factory: pytest.TempPathFactory, scenario: str, **numbers: Any) -> None:
    """Add one row to reliability.json (pytest's base temp dir) and print it."""
    path = factory.getbasetemp() / "reliability.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [r for r in rows if r["scenario"] != scenario] + [{"scenario": scenario, **numbers}]
    path.write_text(json.dumps(rows, indent=1))
    line = f"[reliability] {scenario}: " + ", ".join(f"{k}={v}" for k, v in numbers.items())
    print(line)
    log.warning(line)


# -- 1. a sink's server down for 30 s under load ----------------------------------------------------

OUTAGE = 30.0
RANKS = 4
RATE = 75.0  # batches per second per rank: 300 batches/s in all
EVENTS = 6  # events per batch (each BlockStored with 4 blocks of 16 tokens): ~1.7 KB per batch
QUEUE_BYTES = 8 * MiB
RECEIVE_HWM = 100
MAX_HELD = 2000


class Endpoints:
    """An engine's endpoints (rank r at port + r)."""

    def __init__(self) -> None:
        ports = free_ports(2 * RANKS)
        self.live = f"tcp://127.0.0.1:{ports[0]}"
        self.replay = f"tcp://127.0.0.1:{ports[RANKS]}"


def _engine(ep: Endpoints, **kw: Any) -> SimulatorOptions:
    """A 4-rank engine with a replay buffer that outlasts every outage here (no loss is expected
    under ``block``)."""
    base: dict[str, Any] = {
        "endpoint": ep.live,
        "replay_endpoint": ep.replay,
        "dp_ranks": RANKS,
        "rate": RATE,
        "events_per_batch": EVENTS,
        "blocks_per_event": 4,
        "buffer_steps": 100_000,
    }
    base.update(kw)
    return SimulatorOptions(**base)


def _bridge_config(tmp: Path, ep: Endpoints, sinks: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    cfg = bridge_config(
        tmp,
        [{"name": "engine", "endpoint": ep.live, "replay_endpoint": ep.replay, "dp_ranks": RANKS}],
        sinks,
        ingest={"receive_hwm": RECEIVE_HWM},
        replay={"timeout": "1s", "initial_backoff": "100ms", "max_backoff": "1s", "max_held_batches": MAX_HELD},
        log={"level": "info"},
    )
    cfg.update(extra)
    return cfg


@dataclass
class _Broker:
    """A sink's server, the sink's options for writing under one prefix there, and a read-back of it."""

    server: ManagedServer
    options: dict[str, Any]
    read_back: Callable[[], Awaitable[Readback]]


async def _broker(kind: str, request: pytest.FixtureRequest) -> _Broker:
    """``kind``'s session server (redis emptied first) and a fresh prefix, stream or topic on it."""
    dest = f"KVR{uuid.uuid4().hex[:8].upper()}"  # NATS wants a stream name: letters and digits
    if kind == "redis":
        redis = request.getfixturevalue("fresh_redis")
        assert isinstance(redis, RedisServer)
        keys = [f"{dest}:engine:{r}" for r in range(RANKS)]
        options: dict[str, Any] = {"url": redis.url, "stream": dest + ":{source}:{dp_rank}", "timeout": "2s"}
        return _Broker(redis, options, lambda: read_redis(redis.url, keys))
    if kind == "nats":
        nats = request.getfixturevalue("nats_server")
        assert isinstance(nats, NatsServer)
        options = {
            "servers": nats.url,
            "subject": dest + ".{source}.{dp_rank}",
            "reconnect_wait": "250ms",
            "stream": {"create": True, "name": dest, "subjects": [f"{dest}.>"], "duplicate_window": "10m"},
        }
        return _Broker(nats, options, lambda: read_jetstream(nats.url, dest))
    kafka = request.getfixturevalue("kafka")
    assert isinstance(kafka, KafkaServer)
    topic = await kafka.anew_topic(partitions=RANKS)
    options = {"bootstrap_servers": kafka.bootstrap_servers, "topic": topic, "request_timeout": "5s"}
    return _Broker(kafka, options, lambda: read_kafka(kafka.bootstrap_servers, topic, RANKS))


def _common_sink(name: str, type_: str, **options: Any) -> dict[str, Any]:
    return {
        "type": type_,
        "name": name,
        "format": "json",
        "granularity": "event",
        "queue": {"max_bytes": QUEUE_BYTES},
        "retry": {"max_backoff": "1s", "write_timeout": "10s"},
        "backpressure": "block",
        **options,
    }


async def _small_pub_hwm(sim: Simulator, hwm: int = 100) -> None:
    """A PUB high-water mark (and kernel send buffer) that a 30 s outage overflows, so the block
    chain goes all the way to the engine dropping and replay repairing, as it would after
    ~100,000 messages with vLLM's defaults. ZMQ copies a bound socket's options at bind time:
    unbind, set, bind again (before the bridge connects; the unbind completes asynchronously)."""
    for r, rank in enumerate(sim.ranks):
        endpoint = for_rank(sim.options.endpoint, r)
        rank.pub.unbind(endpoint)
        rank.pub.setsockopt(zmq.SNDHWM, hwm)
        rank.pub.setsockopt(zmq.SNDBUF, 64 * 1024)
        for attempt in range(100):
            try:
                rank.pub.bind(endpoint)
                break
            except zmq.ZMQError:
                if attempt == 99:
                    raise
                await asyncio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis", "nats", "kafka"])
async def test_sink_outage_of_30s_loses_nothing_and_memory_stays_bounded(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    broker = await _broker(kind, request)
    server = broker.server
    ep = Endpoints()
    engine = _engine(ep)
    bridge = BridgeProcess(tmp_path, _bridge_config(tmp_path, ep, [_common_sink(kind, kind, **broker.options)]))
    since = time.time()
    async with Simulator(engine) as sim:
        await _small_pub_hwm(sim)
        async with BridgeRun(bridge, engine=sim) as run:
            sampler = run.sampler
            await bridge.wait_metric("kv_bridge_sink_batches_total", 3 * RATE * RANKS, sink=kind, outcome="delivered")
            baseline = sampler.current()
            down_at = time.monotonic()
            await server.astop()
            await asyncio.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))
            stopped_for = time.monotonic() - down_at
            await server.astart()
            up_at = time.monotonic()
            await asyncio.sleep(3.0)  # the engine keeps publishing while the sink catches up
            published = await run.stop_engine()
            total = sum(published.values())
            await bridge.wait_metric("kv_bridge_sink_batches_total", total, timeout=90, sink=kind, outcome="delivered")
            caught_up = time.monotonic() - up_at
            samples = await bridge.metrics()
            assert await bridge.terminate() == 0
    counts = (await broker.read_back()).check(published, EVENTS, since=since)
    peak_queue = max(sampler.queue_bytes_peak.values(), default=0.0)
    growth = sampler.peak - baseline
    # Once the queue is full the bridge stops reading: memory must stay flat for the rest of the
    # outage however long it lasts (the engine's PUB drops, replay repairs later).
    # The full period ends when the sink delivers again: the bridge may reconnect before astart()
    # returns (it polls the server's health), and from then on it reads, and takes in the
    # replay's burst, as it should.
    full_at = sampler.queue_reached(0.9 * QUEUE_BYTES)
    assert full_at is not None and full_at < up_at - 5, "the outage did not fill the queue"
    resumed_at = sampler.delivering_again(full_at)
    full_until = up_at if resumed_at is None else min(up_at, resumed_at)
    assert full_until > full_at + 10, "the full period is too short to measure"
    plateau = sampler.peak_between(full_at + 2, full_until) - sampler.rss_at(full_at + 2)
    bound = memory_bound(engine, metric_sum(samples, "kv_bridge_batches_replayed_total"))
    report(
        tmp_path_factory,
        f"{kind} down {stopped_for:.0f}s (block)",
        sent=total * EVENTS,
        delivered=counts["delivered"],
        duplicated=counts["duplicated"],
        lost=counts["lost"],
        peak_rss_mib=round(sampler.peak / MiB, 1),
        rss_growth_mib=round(growth / MiB, 1),
        rss_bound_mib=round(bound / MiB, 1),
        rss_growth_while_full_mib=round(plateau / MiB, 1),
        full_s=round(full_until - full_at, 1),
        delivering_before_up_s=round(up_at - full_until, 1),
        rss_growth_when_full_mib=round((sampler.rss_at(full_at + 2) - baseline) / MiB, 1),
        peak_queue_mib=round(peak_queue / MiB, 2),
        gaps=metric_sum(samples, "kv_bridge_sequence_gaps_total"),
        replayed=metric_sum(samples, "kv_bridge_batches_replayed_total"),
        catch_up_s=round(caught_up, 1),
    )
    assert counts["lost"] == 0 and counts["control"] == 0
    if kind != "kafka":
        assert counts["duplicated"] == 0  # explicit Redis ids / Nats-Msg-Id: re-sends stored once
    assert metric_sum(samples, "kv_bridge_batches_lost_total") == 0
    assert metric_sum(samples, "kv_bridge_sequence_gaps_total") >= 1  # the engine did drop: replay repaired it
    assert peak_queue <= QUEUE_BYTES
    # Flat, not merely small: the second half of the full period grows no more than allocator and
    # GC slack (buffering the offered load would add ~8 MiB per 12 s here), and the whole period
    # stays well under what the engine sent meanwhile.
    middle = (full_at + 2 + full_until) / 2
    second_half = sampler.peak_between(middle, full_until) - sampler.rss_at(middle)
    assert second_half < 4 * MiB, f"memory still growing while the queue is full: +{second_half / MiB:.1f} MiB"
    assert plateau < 16 * MiB
    assert growth < bound


def memory_bound(engine: SimulatorOptions, replayed: float) -> int:
    """What the bridge may add to its resident memory with one full sink queue, from first principles.

    ``queue.max_bytes`` counts payload bytes; a queued batch also holds its decoded events, which
    take ``factor`` times the payload as Python objects (measured here with tracemalloc, ~8x for
    these batches). Besides the queue: per stream, the ZMQ receive queue (``ingest.receive_hwm``
    messages) and the live batches held while a gap is replayed (``replay.max_held_batches``,
    payload only); the replayed batches, which the engine sends all at once and the replay
    socket takes in without a bound of its own (its receive high-water mark is 0); and 64 MiB for
    rendered messages in flight, client buffers and allocator slack.
    """
    profile = PROFILES[engine.profile]
    factory = EventFactory(profile, seed=5, blocks_per_event=engine.blocks_per_event)
    payloads = [encode_batch(profile, time.time(), factory.batch(engine.events_per_batch), 0) for _ in range(300)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        decoded = [wire.decode_batch(p) for p in payloads]
        factor = (tracemalloc.get_traced_memory()[0] - before) / sum(map(len, payloads))
    finally:
        tracemalloc.stop()
    del decoded
    payload = sum(map(len, payloads)) / len(payloads)
    per_stream = (RECEIVE_HWM + MAX_HELD) * payload
    return int(QUEUE_BYTES * (1 + factor) + RANKS * per_stream + replayed * payload + 64 * MiB)


def metric_sum(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.partition("{")[0] == name)


# -- 2. fan-out: a sink down, with drop and with block ------------------------------------------------

FANOUT_RATE = 50.0  # per rank: 200 batches/s


def _file_sink(out: Path) -> dict[str, Any]:
    return {"type": "file", "name": "file", "path": str(out), "format": "json", "granularity": "batch", "batch": {"linger": 0}}


def _redis_sink(url: str, prefix: str, backpressure: str) -> dict[str, Any]:
    return {
        "type": "redis",
        "name": "redis",
        "url": url,
        "stream": prefix + ":{source}:{dp_rank}",
        "timeout": "1s",
        "format": "json",
        "granularity": "batch",
        "backpressure": backpressure,
        "queue": {"max_batches": 200},
        "retry": {"max_backoff": "500ms", "write_timeout": "5s"},
    }


def _lines(out: Path) -> int:
    if not out.exists():
        return 0
    with out.open("rb") as f:
        return sum(1 for _ in f)


@asynccontextmanager
async def _file_and_redis(tmp_path: Path, redis: RedisServer, backpressure: str) -> AsyncIterator[tuple[BridgeRun, Path, str]]:
    """A bridge process with a file sink and a redis sink (``backpressure``), fed at FANOUT_RATE;
    entered once the file has output. Yields the run, the file and the redis streams' prefix."""
    ep, out, prefix = Endpoints(), tmp_path / "file.jsonl", f"t{uuid.uuid4().hex[:8]}"
    cfg = _bridge_config(tmp_path, ep, [_file_sink(out), _redis_sink(redis.url, prefix, backpressure)])
    async with Simulator(_engine(ep, rate=FANOUT_RATE)) as sim, BridgeRun(BridgeProcess(tmp_path, cfg), engine=sim) as run:
        await wait_for(lambda: _lines(out) >= 400, what="output")
        yield run, out, prefix


@pytest.mark.slow
async def test_a_drop_sink_down_does_not_hold_back_a_file_sink(
    fresh_redis: RedisServer, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    since = time.time()
    async with _file_and_redis(tmp_path, fresh_redis, "drop") as (run, out, prefix):
        bridge = run.first
        await fresh_redis.astop()
        await bridge.wait_metric("kv_bridge_sink_batches_total", 1, sink="redis", outcome="dropped")
        before, t0 = _lines(out), time.monotonic()
        await asyncio.sleep(5.0)
        live_rate = (_lines(out) - before) / (time.monotonic() - t0)  # the file sink, while redis drops
        await fresh_redis.astart()
        await asyncio.sleep(2.0)
        published = await run.stop_engine()
        total = sum(published.values())
        await bridge.wait_metric("kv_bridge_sink_batches_total", total, sink="file", outcome="delivered")
        dropped = metric(await bridge.metrics(), "kv_bridge_sink_batches_total", sink="redis", outcome="dropped")
        # Each stream's span is announced (and counted lost) once redis has room again.
        lost = await bridge.wait_metric("kv_bridge_batches_lost_total", dropped)
        await bridge.wait_metric("kv_bridge_sink_batches_total", total - dropped, sink="redis", outcome="delivered")
        assert await bridge.terminate() == 0
    to_file = read_file(out).check(published, since=since)
    back = await read_redis(fresh_redis.url, [f"{prefix}:engine:{r}" for r in range(RANKS)])
    to_redis = back.check(published, since=since)
    report(
        tmp_path_factory,
        "redis (drop) down 7s + file",
        sent=total,
        file_delivered=to_file["delivered"],
        redis_delivered=to_redis["delivered"],
        redis_announced_lost=to_redis["announced"],
        duplicated=to_file["duplicated"] + to_redis["duplicated"],
        lost=to_file["lost"] + to_redis["lost"],
        peak_rss_mib=round(run.sampler.peak / MiB, 1),
        file_rate_while_redis_down=round(live_rate),
    )
    # The file sink got everything, live, while redis was down.
    assert to_file == {"delivered": total, "duplicated": 0, "lost": 0, "announced": 0, "control": 0}
    assert live_rate > 0.7 * FANOUT_RATE * RANKS
    # Redis: every batch stored or inside an announced span, each once, in order; the spans are the drops.
    assert to_redis["lost"] == 0 and to_redis["duplicated"] == 0
    assert to_redis["announced"] == dropped > 0
    assert {reason for *_, reason in back.lost} == {"sink_queue_full:redis"}
    assert lost == dropped


@pytest.mark.slow
async def test_two_block_sinks_one_down_holds_back_both(
    fresh_redis: RedisServer, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """docs/concepts/delivery.md: "With several block sinks, one slow sink holds back all of them (block-all)"."""
    since = time.time()
    async with _file_and_redis(tmp_path, fresh_redis, "block") as (run, out, prefix):
        bridge = run.first
        await fresh_redis.astop()
        await asyncio.sleep(2.0)  # redis's queue (200 batches) fills within a second
        before = _lines(out)
        await asyncio.sleep(4.0)
        held_back = _lines(out) - before
        await fresh_redis.astart()
        await asyncio.sleep(2.0)
        published = await run.stop_engine()
        total = sum(published.values())
        for sink in ("file", "redis"):
            await bridge.wait_metric("kv_bridge_sink_batches_total", total, sink=sink, outcome="delivered")
        assert await bridge.terminate() == 0
    to_file = read_file(out).check(published, since=since)
    to_redis = (await read_redis(fresh_redis.url, [f"{prefix}:engine:{r}" for r in range(RANKS)])).check(published, since=since)
    report(
        tmp_path_factory,
        "redis (block) down 6s + file (block)",
        sent=total,
        file_delivered=to_file["delivered"],
        redis_delivered=to_redis["delivered"],
        duplicated=to_file["duplicated"] + to_redis["duplicated"],
        lost=to_file["lost"] + to_redis["lost"],
        peak_rss_mib=round(run.sampler.peak / MiB, 1),
        file_lines_while_redis_down=held_back,
    )
    assert held_back == 0  # block-all: the file sink waited for redis too
    for got in (to_file, to_redis):
        assert got == {"delivered": total, "duplicated": 0, "lost": 0, "announced": 0, "control": 0}


# -- 3. the bridge SIGKILLed under load, restarted from its checkpoint ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis", "kafka"])
async def test_sigkill_under_load_then_restart_loses_nothing(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ep, broker = Endpoints(), await _broker(kind, request)
    cfg = _bridge_config(
        tmp_path,
        ep,
        [_common_sink(kind, kind, **broker.options)],
        checkpoint={"path": str(tmp_path / "ck.json"), "interval": "200ms"},
    )
    first = BridgeProcess(tmp_path, cfg, name="run1")
    # Same config, but its own metrics port: the first run's may be taken again the moment it dies.
    second = BridgeProcess(tmp_path, {**cfg, "metrics": {"listen": f"127.0.0.1:{free_port()}"}}, name="run2")
    since = time.time()
    async with Simulator(_engine(ep)) as sim, BridgeRun(first, engine=sim) as run:
        await first.wait_metric("kv_bridge_sink_batches_total", 4 * RATE * RANKS, sink=kind, outcome="delivered")
        before_kill = metric_sum(await first.metrics(), "kv_bridge_sink_batches_total")
        os.kill(first.pid, signal.SIGKILL)
        assert await first.terminate() == -signal.SIGKILL
        checkpoint = json.loads((tmp_path / "ck.json").read_text())["streams"]
        await asyncio.sleep(1.0)  # the engine goes on while the bridge is away
        await run.start(second)
        await asyncio.sleep(2.0)
        published = await run.stop_engine()
        # Resumed from the checkpoint: everything after it comes again (replay), nothing before.
        resent = sum(published[r] - 1 - checkpoint[f"engine/{r}"]["seq"] for r in range(RANKS))
        await second.wait_metric("kv_bridge_sink_batches_total", resent, sink=kind, outcome="delivered")
        await asyncio.sleep(0.5)
        samples = await second.metrics()
        assert await second.terminate() == 0
    # One epoch per stream across both runs: the second resumed the first's from the checkpoint.
    counts = (await broker.read_back()).check(published, EVENTS, since=since)
    total = sum(published.values())
    report(
        tmp_path_factory,
        f"bridge SIGKILL + restart ({kind})",
        sent=total * EVENTS,
        delivered=counts["delivered"],
        duplicated=counts["duplicated"],
        lost=counts["lost"],
        peak_rss_mib=round(max(s.peak for s in run.samplers) / MiB, 1),
        batches_before_kill=int(before_kill),
        batches_resent_after_restart=resent,
    )
    assert counts["lost"] == 0 and counts["control"] == 0
    assert metric_sum(samples, "kv_bridge_sink_batches_total") == resent  # exactly from checkpoint + 1
    if kind == "redis":
        assert counts["duplicated"] == 0  # re-sent entries were refused by their explicit ids


# -- 4. an engine restart storm -----------------------------------------------------------------------


@pytest.mark.slow
async def test_engine_restart_storm_ten_epochs_each_announced_and_whole(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ep, out = Endpoints(), tmp_path / "file.jsonl"
    cfg = _bridge_config(tmp_path, ep, [_file_sink(out)], checkpoint={"path": str(tmp_path / "ck.json"), "interval": "200ms"})
    bridge = BridgeProcess(tmp_path, cfg)
    per_epoch: list[int] = []  # batches rank 0 published in each epoch
    since = time.time()
    async with Simulator(_engine(ep, rate=100.0)) as sim, BridgeRun(bridge, engine=sim) as run:
        started = time.monotonic()
        for _ in range(10):  # ten restarts of rank 0 in 15 s; the other ranks go on
            await asyncio.sleep(1.5)
            per_epoch.append(sim.ranks[0].seq)
            sim.ranks[0].restart()
        storm = time.monotonic() - started
        await asyncio.sleep(1.5)
        published = await run.stop_engine()
        per_epoch.append(published[0])
        total = sum(per_epoch) + sum(published[r] for r in range(1, RANKS))
        await bridge.wait_metric("kv_bridge_sink_batches_total", total, sink="file", outcome="delivered")
        samples = await bridge.metrics()
        assert await bridge.terminate() == 0
    lines = read_lines(out)
    rank0 = [ln for ln in lines if ln["dp_rank"] == 0]
    resets = [i for i, ln in enumerate(rank0) if ln.get("type") == "SourceReset"]
    # The first epoch is the clock's; each of the ten restarts opens one above the previous.
    epochs = [assert_first_epoch(rank0[0]["epoch"], since)]
    for i in resets:  # one SourceReset per epoch, in order
        epochs.append(assert_next_epoch(rank0[i]["epoch"], epochs[-1], since))
    assert len(resets) == 10 and all(rank0[i]["reason"] == "publisher_restart" for i in resets)
    bounds = [0, *resets, len(rank0)]
    for k in range(11):
        epoch = epochs[k]
        segment = rank0[bounds[k] : bounds[k + 1]]
        if k > 0:
            head, segment = segment[0], segment[1:]
            assert head["type"] == "SourceReset" and head["epoch"] == epoch
        # Everything between this reset and the next is this epoch, seq 0.. in order, complete.
        assert {ln["epoch"] for ln in segment} == {epoch}, epoch
        assert [ln["seq"] for ln in segment] == list(range(per_epoch[k])), (epoch, per_epoch[k])
        assert all("events" in ln for ln in segment)
    for r in range(1, RANKS):
        others = [ln for ln in lines if ln["dp_rank"] == r]
        assert [ln["seq"] for ln in others] == list(range(published[r]))
        assert {ln["epoch"] for ln in others} == {assert_first_epoch(others[0]["epoch"], since)}  # never restarted
    ck = json.loads((tmp_path / "ck.json").read_text())
    assert ck["streams"]["engine/0"]["epoch"] == ck["epochs"]["engine/0"] == epochs[-1]
    report(
        tmp_path_factory,
        f"engine restart storm (10 restarts in {storm:.0f}s)",
        sent=total,
        delivered=sum(1 for ln in lines if "events" in ln),
        duplicated=0,
        lost=0,
        source_resets=len(resets),
        restarts_counted=metric_sum(samples, "kv_bridge_source_restarts_total"),
        peak_rss_mib=round(run.sampler.peak / MiB, 1),
    )
    assert metric_sum(samples, "kv_bridge_source_restarts_total") == 10
    assert metric_sum(samples, "kv_bridge_batches_lost_total") == 0


# -- 6. dead letters ---------------------------------------------------------------------------------


async def test_undecodable_payloads_are_dead_lettered_and_the_stream_goes_on(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    (port,) = free_ports(1)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    factory = EventFactory(PROFILES["vllm-0.33.0"], seed=9)

    def good() -> bytes:
        return encode_batch(PROFILES["vllm-0.33.0"], time.time(), factory.batch(3), 0)

    one_bad_event = msgspec.msgpack.encode([time.time(), [factory.stored_event(), 42, factory.stored_event()], 0])
    sent: dict[int, tuple[str, bytes]] = {}
    for seq in range(30):
        kind = {5: "bad_msgpack", 11: "bad_batch", 17: "bad_event", 23: "bad_msgpack"}.get(seq, "ok")
        payload = {
            "ok": good,
            "bad_msgpack": lambda: b"\xc1" + good()[1:],
            "bad_batch": lambda: msgspec.msgpack.encode({"events": []}),
            "bad_event": lambda: one_bad_event,
        }[kind]()
        sent[seq] = (kind, payload)
    source = {"name": "dl", "endpoint": f"tcp://127.0.0.1:{port}"}
    try:
        async with running_bridge(tmp_path, [source]) as (bridge, out):
            await wait_for(lambda: bridge.readers["dl/0"].connections > 0, what="subscription")
            await asyncio.sleep(0.3)
            for seq, (_kind, payload) in sent.items():
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            await wait_for(lambda: len(read_lines(out)) >= 30, what="30 records")
            reasons = ("bad_msgpack", "bad_batch", "bad_event")
            dead_total = {r: bridge_metric(bridge, "kv_bridge_dead_letters_total", reason=r) for r in reasons}
    finally:
        pub.close(linger=0)
        ctx.destroy(linger=0)
    lines = read_lines(out)
    assert [ln["seq"] for ln in lines] == list(range(30))  # nothing else lost, nothing out of order
    for ln in lines:
        kind, payload = sent[ln["seq"]]
        if kind in ("bad_msgpack", "bad_batch"):
            assert (ln["type"], ln["from_seq"], ln["reason"]) == ("EventsLost", ln["seq"], "undecodable")
        elif kind == "bad_event":  # the batch goes on without its one malformed event
            assert [e["type"] for e in ln["events"]] == ["BlockStored", "BlockStored"]
        else:
            assert len(ln["events"]) == 3
    dead = read_lines(tmp_path / "dead.jsonl", records=False)
    assert sorted((d["seq"], d["reason"]) for d in dead) == [
        (5, "bad_msgpack"),
        (11, "bad_batch"),
        (17, "bad_event"),
        (23, "bad_msgpack"),
    ]
    for d in dead:
        assert d["source"] == "dl" and d["dp_rank"] == 0 and d["detail"]
        if d["reason"] != "bad_event":
            assert bytes.fromhex(d["payload_hex"]) == sent[d["seq"]][1]  # the payload, for a post-mortem
        else:
            assert d["index"] == 1
    assert dead_total == {"bad_msgpack": 2, "bad_batch": 1, "bad_event": 1}
    report(tmp_path_factory, "undecodable payloads (in process)", sent=30, delivered=27, duplicated=0, lost=0,
           dead_lettered=4, announced_lost=3)  # fmt: skip
