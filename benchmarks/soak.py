"""Soak: a simulated engine -> ``python -m bridge`` -> file, Kafka, Redis and NATS for a set time.

Not part of CI. The engine (``bridge.simulator``, in this process) publishes ``--ranks`` streams at
``--rate`` batches per second each, dropping ``--drop-rate`` of its live messages (kept in its
replay buffer, as a PUB high-water mark would) and restarting every ``--restart-every`` batches
if asked. The bridge runs as its own process with all four sinks (JSON, event granularity, default
queue bounds); its RSS is sampled every 100 ms. At the end the engine stops, the bridge drains and
exits on SIGTERM, and every sink is read back with the broker's own client:

- events in: what the engine published (batches x events per batch, per epoch);
- events out, per sink: distinct events stored; duplicates: extra copies; lost: events neither
  stored nor inside an announced EventsLost span; announced: events inside such spans;
- max RSS of the bridge process, and its throughput.

Servers: the ones ``python -m tests.infra start`` left running, else fresh ones in a temporary
directory (removed at the end).

    .venv/bin/python -m benchmarks.soak --duration 120
    .venv/bin/python -m benchmarks.soak --duration 600 --rate 200 --drop-rate 0.01 --restart-every 20000 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bridge.simulator import Faults, Simulator, SimulatorOptions
from tests.infra.servers import KafkaServer, ManagedServer, NatsServer, RedisServer, StateFile, create
from tests.support.harness import free_port, free_ports
from tests.support.process import BridgeProcess, Sampler, metric
from tests.support.readback import Readback, read_file, read_jetstream, read_kafka, read_redis

MiB = 2**20


def servers(workdir: Path) -> tuple[dict[str, ManagedServer], list[ManagedServer]]:
    """Kafka, Redis and NATS: shared running ones when recorded, else started here (second list)."""
    state = StateFile()
    found: dict[str, ManagedServer] = {}
    own: list[ManagedServer] = []
    for kind in ("kafka", "redis", "nats"):
        server = state.running(kind)
        if server is None:
            server = create(kind, workdir / kind)
            server.start()
            own.append(server)
        found[kind] = server
    return found, own


def sink_configs(found: dict[str, ManagedServer], out: Path, dest: str, topic: str) -> list[dict[str, Any]]:
    common = {"format": "json", "granularity": "event"}
    kafka, redis, nats = found["kafka"], found["redis"], found["nats"]
    assert isinstance(kafka, KafkaServer) and isinstance(redis, RedisServer) and isinstance(nats, NatsServer)
    return [
        {"type": "file", "name": "file", "path": str(out), **common},
        {"type": "kafka", "name": "kafka", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic, **common},
        {"type": "redis", "name": "redis", "url": redis.url, "stream": dest + ":{source}:{dp_rank}", **common},
        {
            "type": "nats",
            "name": "nats",
            "servers": nats.url,
            "subject": dest + ".{source}.{dp_rank}",
            "stream": {"create": True, "name": dest, "subjects": [f"{dest}.>"], "duplicate_window": "10m"},
            **common,
        },
    ]


def expected(per_epoch: dict[int, list[int]], events: int) -> dict[str, int]:
    return {"batches": sum(sum(v) for v in per_epoch.values()), "events": sum(sum(v) for v in per_epoch.values()) * events}


def tally(back: Readback, per_epoch: dict[int, list[int]], events: int) -> dict[str, int]:
    """Distinct events stored, duplicates, events lost silently, events announced lost."""
    data = [r for r in back.rows if r[4] not in ("SourceReset", "EventsLost")]
    seen = {(r, e, s, i) for r, e, s, i, _ in data}
    announced = {(r, e, s) for r, e, s in _announced(back)}
    want = {
        (r, e, s, i)
        for r, counts in per_epoch.items()
        for e, n in enumerate(counts)
        for s in range(n)
        for i in range(events)
        if (r, e, s) not in announced
    }
    order_violations = 0
    last: dict[int, tuple[int, int, int]] = {}
    first: set[tuple[int, int, int, int]] = set()
    for r, e, s, i, _ in data:
        if (r, e, s, i) in first:
            continue
        first.add((r, e, s, i))
        if (e, s, i) <= last.get(r, (-1, -1, -1)):
            order_violations += 1
        last[r] = (e, s, i)
    return {
        "events_out": len(seen & want),
        "duplicates": len(data) - len(seen),
        "lost": len(want - seen),
        "announced_lost_events": len(announced) * events,
        "unexpected": len(seen - want),
        "order_violations": order_violations,
    }


def _announced(back: Readback) -> list[tuple[int, int, int]]:
    # EventsLost rows carry their epoch in rows; Readback.lost has (rank, from, to, reason) in the same order.
    lost_rows = [r for r in back.rows if r[4] == "EventsLost"]
    out = []
    for (rank, epoch, *_), (_r, a, b, _reason) in zip(lost_rows, back.lost, strict=False):
        out.extend((rank, epoch, s) for s in range(a, b + 1))
    return out


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvb-soak-"))
    found, own = await asyncio.to_thread(servers, workdir)
    try:
        kafka = found["kafka"]
        assert isinstance(kafka, KafkaServer)
        topic = await kafka.anew_topic(partitions=args.ranks)
        dest = f"SOAK{uuid.uuid4().hex[:8].upper()}"
        out = workdir / "file.jsonl"
        ports = free_ports(2 * args.ranks)
        live, replay = f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[args.ranks]}"
        config = {
            "sources": [{"name": "soak", "endpoint": live, "replay_endpoint": replay, "dp_ranks": args.ranks}],
            "sinks": sink_configs(found, out, dest, topic),
            "metrics": {"listen": f"127.0.0.1:{free_port()}"},
            "dead_letter": {"path": str(workdir / "dead.jsonl")},
            "checkpoint": {"path": str(workdir / "checkpoint.json")},
        }
        engine = SimulatorOptions(
            endpoint=live,
            replay_endpoint=replay,
            dp_ranks=args.ranks,
            rate=args.rate,
            events_per_batch=args.events,
            buffer_steps=args.buffer_steps,
            faults=Faults(drop_rate=args.drop_rate, restart_every=args.restart_every),
            seed=args.seed,
        )
        bridge = BridgeProcess(workdir, config, name="soak-bridge")
        per_epoch: dict[int, list[int]] = {r: [0] for r in range(args.ranks)}
        async with Simulator(engine) as sim:
            bridge.start()
            sampler = Sampler(bridge).start()
            await bridge.wait_ready()
            ready_rss = bridge.rss()
            runner = asyncio.create_task(sim.run())
            started = time.monotonic()
            restarts = [0] * args.ranks
            try:
                while time.monotonic() - started < args.duration:
                    await asyncio.sleep(0.05)
                    _follow(sim, per_epoch, restarts)
                    assert bridge.alive(), bridge.log()[-3000:]
                for rank in sim.ranks:
                    rank.faults.drop_rate = 0.0
                    rank.faults.restart_every = 0
                await asyncio.sleep(0.5)  # a few clean batches last, so a dropped tail shows as a gap
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)
                _follow(sim, per_epoch, restarts)
                published = expected(per_epoch, args.events)
                elapsed = time.monotonic() - started
                # Until every sink settled every batch, or nothing moved for 10 s (a batch the bridge
                # never saw, e.g. dropped right before an engine restart, is never settled).
                deadline = time.monotonic() + args.drain_timeout
                last, moved = None, time.monotonic()
                while time.monotonic() < deadline and time.monotonic() - moved < 10:
                    samples = await bridge.metrics()
                    settled = [
                        metric(samples, "kv_bridge_sink_batches_total", sink=s) for s in ("file", "kafka", "redis", "nats")
                    ]
                    if min(settled) >= published["batches"]:
                        break
                    if settled != last:
                        last, moved = settled, time.monotonic()
                    await asyncio.sleep(0.5)
                drained = time.monotonic() - started - elapsed
                samples = await bridge.metrics()
                code = await bridge.terminate()
            finally:
                runner.cancel()
                await sampler.stop()
                bridge.kill()
        redis, nats = found["redis"], found["nats"]
        assert isinstance(redis, RedisServer) and isinstance(nats, NatsServer)
        backs = {
            "file": read_file(out),
            "kafka": await read_kafka(kafka.bootstrap_servers, topic, args.ranks),
            "redis": await read_redis(redis.url, [f"{dest}:soak:{r}" for r in range(args.ranks)]),
            "nats": await read_jetstream(nats.url, dest),
        }
        return {
            "duration_s": round(elapsed, 1),
            "drain_s": round(drained, 1),
            "ranks": args.ranks,
            "rate_per_rank": args.rate,
            "events_per_batch": args.events,
            "drop_rate": args.drop_rate,
            "engine_restarts": sum(restarts),
            "batches_in": published["batches"],
            "events_in": published["events"],
            "events_in_per_s": round(published["events"] / elapsed),
            "sinks": {name: tally(back, per_epoch, args.events) for name, back in backs.items()},
            "bridge": {
                "exit_code": code,
                "max_rss_mib": round(sampler.peak / MiB, 1),
                "rss_when_ready_mib": round(ready_rss / MiB, 1),
                "sequence_gaps": metric(samples, "kv_bridge_sequence_gaps_total"),
                "batches_replayed": metric(samples, "kv_bridge_batches_replayed_total"),
                "batches_lost": metric(samples, "kv_bridge_batches_lost_total"),
                "source_restarts": metric(samples, "kv_bridge_source_restarts_total"),
                "sink_retries": metric(samples, "kv_bridge_sink_retries_total"),
                "dead_letters": metric(samples, "kv_bridge_dead_letters_total"),
            },
        }
    finally:
        for server in own:
            await asyncio.to_thread(server.remove)
        shutil.rmtree(workdir, ignore_errors=True)


def _follow(sim: Simulator, per_epoch: dict[int, list[int]], restarts: list[int]) -> None:
    for r, rank in enumerate(sim.ranks):
        if rank.restarts > restarts[r]:
            # The simulator restarts inside publish(): the epoch it left ended at restart_every.
            for _ in range(rank.restarts - restarts[r]):
                per_epoch[r][-1] = rank.faults.restart_every or per_epoch[r][-1]
                per_epoch[r].append(0)
            restarts[r] = rank.restarts
        per_epoch[r][-1] = rank.seq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of publishing")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rate", type=float, default=100.0, help="batches per second per rank")
    p.add_argument("--events", type=int, default=4, help="events per batch")
    p.add_argument("--drop-rate", type=float, default=0.01, help="live messages the engine drops (replay repairs them)")
    p.add_argument("--restart-every", type=int, default=0, help="engine restart every N batches per rank (0: never)")
    p.add_argument("--buffer-steps", type=int, default=10_000, help="engine replay buffer (batches)")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="how long the sinks may take to catch up")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    report = asyncio.run(soak(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
