"""Memory per stream and the event loop's longest stall during a scrape, at fleet scale.

    .venv/bin/python -m benchmarks.fleet_scale [--streams 1000,10000] [--scrapes 3]

10,000 streams would need 30,000 ZMQ sockets in one process (a SUB and the two ends of its
monitor each) and 10,000 publishers: more descriptors than a test machine gives. So the streams
are simulated in-process: a real :class:`bridge.runtime.Bridge` builds every stream's pipeline
(sequencer, metrics series, reader object) exactly as at start-up, without opening its sockets.
Each stream has seen a batch of every event type (so every per-stream series a scrape renders
exists) when measured. Each stream count runs in a fresh process.

- **RSS per stream**: the process's RSS after building N streams minus before, over N (the
  sockets' share, ZMQ's buffers included, is measured by ``benchmarks.streams``, whose rows carry
  the bridge's RSS with real sockets);
- **scrape**: ``Metrics.scrape()`` (what ``/metrics`` runs) while a 1 ms ticker runs on the same
  loop: the wall time of the scrape and the longest gap between two ticks minus 1 ms, i.e. the
  longest stall every stream saw; beside it the same ticker's longest gap over 0.5 s without a
  scrape, right before (what the machine's other load gives). Best and worst of ``--scrapes``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time

from .load import rss_bytes


async def _ticker(gaps: list[float], stop: asyncio.Event) -> None:
    """Every 1 ms, how much later than asked it ran."""
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last - 0.001)
        last = now


async def _measure(streams: int, scrapes: int) -> dict[str, float]:
    import os

    from bridge import config as config_mod
    from bridge.cli import tune_gc
    from bridge.runtime import Bridge
    from bridge.source import SourceReader

    tune_gc()
    config = config_mod.from_data(
        {
            "sources": [
                {"name": f"engine-{s:05d}", "endpoint": f"tcp://127.0.0.1:{20000 + s % 10000}"} for s in range(streams)
            ],
            "sinks": [{"type": "file", "name": "null", "path": "/dev/null", "format": "raw", "granularity": "batch"}],
            "metrics": {"listen": ""},
            "replay": {"idle_probe": 0},
            "log": {"level": "warning"},
        },
        env={},
    )
    bridge = Bridge(config)
    gc.collect()
    before = rss_bytes(os.getpid())[0]
    for source in config.sources:
        for pipeline, endpoint in bridge._add_pipelines(source):
            reader = SourceReader(
                pipeline, bridge.zmq_context, endpoint, bind=False, topic="", ingest=config.ingest, drainer=bridge.drainer
            )
            bridge.readers[pipeline.stream.key] = reader
    for p in bridge.pipelines.values():  # a batch of every type seen: every per-stream series exists
        p._received += 1
        p._types.extend(("BlockStored", "BlockRemoved", "AllBlocksCleared"))
    bridge.metrics.exposition()  # applies them, creating the series
    gc.collect()
    after = rss_bytes(os.getpid())[0]
    results: dict[str, float] = {"rss_per_stream_kb": (after - before) / streams / 1024}
    walls: list[float] = []
    stalls: list[float] = []
    idle: list[float] = []
    for _ in range(scrapes):
        for p in bridge.pipelines.values():  # updates gathered since the last scrape
            p._received += 1
            p._types.append("BlockStored")
        quiet: list[float] = []  # the same ticker without a scrape: what the machine itself gives
        stop = asyncio.Event()
        tick = asyncio.create_task(_ticker(quiet, stop))
        await asyncio.sleep(0.5)
        stop.set()
        await tick
        idle.append(max(quiet))
        gaps: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(_ticker(gaps, stop))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        body = await bridge.metrics.scrape()
        walls.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)
        stop.set()
        await tick
        stalls.append(max(gaps))
        assert body
    results.update(
        scrape_ms=min(walls) * 1e3,
        scrape_ms_worst=max(walls) * 1e3,
        stall_ms=min(stalls) * 1e3,
        stall_ms_worst=max(stalls) * 1e3,
        idle_stall_ms=min(idle) * 1e3,
        idle_stall_ms_worst=max(idle) * 1e3,
        lines=body.count(b"\n"),
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1000,10000")
    parser.add_argument("--scrapes", type=int, default=3)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_measure(args.child, args.scrapes))))
        return
    print(
        f"{'streams':>8s} {'RSS KB/stream':>14s} {'lines':>9s} {'scrape ms':>14s} {'loop stall ms':>14s} "
        f"{'stall without scrape':>21s}"
    )
    for n in map(int, args.streams.split(",")):  # each in a process of its own
        cmd = [sys.executable, "-m", "benchmarks.fleet_scale", "--child", str(n), "--scrapes", str(args.scrapes)]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout)
        print(
            f"{n:8d} {r['rss_per_stream_kb']:14.1f} {r['lines']:9,.0f} {r['scrape_ms']:6.0f} - {r['scrape_ms_worst']:5.0f} "
            f"{r['stall_ms']:6.1f} - {r['stall_ms_worst']:5.1f} {r['idle_stall_ms']:13.1f} - {r['idle_stall_ms_worst']:5.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
