"""Memory per stream and the event loop's longest stall during a scrape, at fleet scale.

    .venv/bin/python -m benchmarks.fleet_scale [--streams 1000,10000] [--scrapes 3] [--rounds 1] [--tree LABEL=DIR ...]

10,000 streams would need 30,000 ZMQ sockets in one process (a SUB and the two ends of its
monitor each) and 10,000 publishers: more descriptors than a test machine gives. So the streams
are simulated in-process: a real :class:`bridge.runtime.Bridge` builds every stream's pipeline
(sequencer, metrics series, reader object) exactly as at start-up, without opening its sockets.
Each stream has seen a batch of every event type (so every per-stream series a scrape renders
exists) when measured. Each stream count runs in a fresh process.

- **RSS per stream**: the process's RSS after building N streams minus before, over N (the
  sockets' share, ZMQ's buffers included, is measured by ``benchmarks.streams``, whose rows carry
  the bridge's RSS with real sockets);
- **scrape**: a GET of ``/metrics`` from a client process, served by the bridge's
  :class:`bridge.health.HealthServer` (readiness, then ``Metrics.scrape()``, then the body
  written) while a 1 ms ticker runs on the same loop: the wall time until the client has read
  the whole body, and the longest gap between two ticks minus 1 ms, i.e. the longest stall every
  stream saw; beside it the same ticker's longest gap over 0.5 s without a scrape, right before
  (what the machine's other load gives). Best, median and worst of ``--scrapes``; beside them
  the stall counted only while the process ran (the machine's other load taken out: see
  ``_ticker``). Every reader counts as subscribed and connected, as in a healthy fleet
  (readiness then lists no stream). The loop is the bridge's: uvloop when installed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from .load import rss_bytes


async def _ticker(gaps: list[float], stop: asyncio.Event, running: list[float] | None = None) -> None:
    """Every 1 ms, how much later than asked it ran; ``running``: the same gap counted only while
    this process ran (its CPU time over the gap, all threads, at most the gap): what is left of
    a stall once the OS's preemption of the whole process, i.e. the machine's other load, is
    taken out."""
    last, cpu = time.perf_counter(), time.process_time()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now, now_cpu = time.perf_counter(), time.process_time()
        gaps.append(now - last - 0.001)
        if running is not None:
            running.append(min(now - last, now_cpu - cpu) - 0.001)
        last, cpu = now, now_cpu


async def _measure(streams: int, scrapes: int) -> dict[str, float]:
    from bridge import config as config_mod
    from bridge.cli import tune_gc
    from bridge.health import HealthServer
    from bridge.runtime import Bridge
    from bridge.source import SourceReader

    tune_gc()
    config = config_mod.from_data(
        {
            "sources": [{"name": f"engine-{s:05d}", "endpoint": f"tcp://127.0.0.1:{20000 + s % 10000}"} for s in range(streams)],
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
            reader.subscribed, reader.problem = True, None  # a healthy fleet's
            bridge.readers[pipeline.stream.key] = reader
    for p in bridge.pipelines.values():  # a batch of every type seen: every per-stream series exists
        p._received += 1
        p._types.extend(("BlockStored", "BlockRemoved", "AllBlocksCleared"))
    bridge.metrics.exposition()  # applies them, creating the series
    gc.collect()
    after = rss_bytes(os.getpid())[0]
    results: dict[str, float] = {"rss_per_stream_kb": (after - before) / streams / 1024}
    server = HealthServer("127.0.0.1:0", bridge.metrics.scrape, bridge.readiness)
    await server.start()
    client = await asyncio.create_subprocess_exec(  # started once, before any measurement
        sys.executable, "-m", "benchmarks.fleet_scale", "--client", str(server.port),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert client.stdin is not None and client.stdout is not None
    walls: list[float] = []
    stalls: list[float] = []
    stalls_running: list[float] = []
    idle: list[float] = []
    got: dict[str, int] = {}
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
        running: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.create_task(_ticker(gaps, stop, running))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        client.stdin.write(b"GET\n")
        got = json.loads(await asyncio.wait_for(client.stdout.readline(), 600))
        walls.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)
        stop.set()
        await tick
        stalls.append(max(gaps))
        stalls_running.append(max(running))
        assert got["status"] == 200 and got["bytes"] > 0, got
    client.stdin.close()
    await client.wait()
    await server.stop()
    results.update(
        scrape_ms=min(walls) * 1e3,
        scrape_ms_worst=max(walls) * 1e3,
        stall_ms=min(stalls) * 1e3,
        stall_ms_median=statistics.median(stalls) * 1e3,
        stall_ms_worst=max(stalls) * 1e3,
        stall_running_ms_median=statistics.median(stalls_running) * 1e3,
        stall_running_ms_worst=max(stalls_running) * 1e3,
        idle_stall_ms=min(idle) * 1e3,
        idle_stall_ms_worst=max(idle) * 1e3,
        lines=got["lines"],
    )
    return results


def _client(port: int) -> None:
    """A scraper in a process of its own: a GET of /metrics per line read; prints its outcome."""
    import http.client

    for _ in sys.stdin:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read()
        conn.close()
        print(json.dumps({"status": response.status, "bytes": len(body), "lines": body.count(b"\n")}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1000,10000")
    parser.add_argument("--scrapes", type=int, default=3, help="scrapes per process (best, median and worst shown)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every count and tree")
    parser.add_argument("--tree", action="append", help="[LABEL=]DIR: measure the bridge of this checkout (repeatable)")
    parser.add_argument("--bridge-tree", help=argparse.SUPPRESS)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        _client(args.client)
        return
    if args.child:
        if args.bridge_tree:
            sys.path.insert(0, args.bridge_tree)  # its bridge and connectors (imported in _measure)
        try:  # the loop the bridge runs on (bridge.cli)
            import uvloop  # type: ignore[import-not-found,unused-ignore]

            loop_factory = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            result = runner.run(_measure(args.child, args.scrapes))
        print(json.dumps({**result, "loop": "uvloop" if loop_factory else "asyncio"}))
        return
    trees = [_tree(t) for t in args.tree] if args.tree else [("bridge", "")]
    print(
        f"{'tree':>10s} {'streams':>8s} {'RSS KB/stream':>14s} {'lines':>9s} {'scrape ms':>14s} "
        f"{'loop stall ms (best / median / worst)':>38s} {'process running: median / worst':>32s} "
        f"{'stall without scrape':>21s}"
    )
    for _ in range(args.rounds):
        for n in map(int, args.streams.split(",")):
            for label, tree in trees:  # each in a process of its own
                cmd = [sys.executable, "-m", "benchmarks.fleet_scale", "--child", str(n), "--scrapes", str(args.scrapes)]
                if tree:
                    cmd += ["--bridge-tree", tree]
                r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800).stdout)
                print(
                    f"{label:>10s} {n:8d} {r['rss_per_stream_kb']:14.1f} {r['lines']:9,.0f} "
                    f"{r['scrape_ms']:6.0f} - {r['scrape_ms_worst']:5.0f} "
                    f"{r['stall_ms']:14.1f} / {r['stall_ms_median']:6.1f} / {r['stall_ms_worst']:6.1f}"
                    f"{r['stall_running_ms_median']:23.1f} / {r['stall_running_ms_worst']:6.1f}"
                    f"{r['idle_stall_ms']:13.1f} - {r['idle_stall_ms_worst']:5.1f}  load {os.getloadavg()[0]:.1f}, {r['loop']}",
                    flush=True,
                )


def _tree(spec: str) -> tuple[str, str]:
    label, _, path = spec.rpartition("=")
    return (label or os.path.basename(path.rstrip("/")) or "tree"), os.path.abspath(path)


if __name__ == "__main__":
    main()
