"""CPU per batch by how many streams share the load: what a pod costs beside a real fleet.

    .venv/bin/python -m benchmarks.streams [--streams 4,100,1000] [--total 5000] [--format raw/batch]
                                           [--sink file|kafka|redis|nats] [--duration 8] [--bridge-cpus 1]

``benchmarks.run`` measures at saturation with 4 streams: every socket wake-up then carries up to
``ingest.drain_max`` batches, and the per-wake-up costs (the event loop, the reader, a burst's
metrics and fan-out, a sink write) are shared by hundreds of batches. A vLLM fleet is the other
way round: thousands of streams, each publishing one batch per engine step, so nearly every
batch is a wake-up of its own. This benchmark offers the same total rate spread over more and
more streams and reports the bridge's CPU per batch (process CPU from ``/proc``, all threads,
the ZMQ I/O thread apart), i.e. what sizing by batches/s alone leaves out.

The load: publisher processes (:func:`benchmarks.load.publisher_main`, 4 at most), each hosting a
share of the streams as PUB sockets and publishing round-robin in 1 ms ticks; the bridge as users
run it (``python -m bridge --config``, uvloop when installed) with one source per stream and
one sink: a file sink to ``/dev/null`` by default, or a private broker as ``benchmarks.run``
starts it (``--servers shared``: the ones of ``python -m tests.infra start``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tests.support.harness import free_port, free_ports

from .load import LoadShape, cpu_seconds, start_publisher, thread_cpu
from .run import cleanup, quantile, scrape, servers, sink_entry

ROOT = Path(__file__).resolve().parents[1]


def measure(
    streams: int,
    total: float,
    sink: dict[str, Any],
    duration: float,
    cpus: set[int] | None,
    workdir: Path,
    root: Path = ROOT,
) -> dict[str, Any]:
    """Offer ``total`` batches/s over ``streams`` streams; the bridge's CPU per delivered batch."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = streams * 8 + 1024
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))  # inherited by the bridge
    base = free_ports(streams, bases=range(20000, 32000 - streams, 1500))[0]
    procs = min(4, streams)
    per = streams // procs
    port = free_port()
    config = {
        "sources": [{"name": f"engine-{s:04d}", "endpoint": f"tcp://127.0.0.1:{base + s}"} for s in range(per * procs)],
        "sinks": [sink],
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "replay": {"idle_probe": 0},
        "log": {"level": "warning"},
    }
    path = workdir / f"bridge-{streams}.json"
    path.write_text(json.dumps(config))
    publishers: list[tuple[Any, Any, Any]] = []
    bridge: subprocess.Popen[bytes] | None = None
    try:
        for i in range(procs):
            publishers.append(start_publisher(LoadShape("127.0.0.1", base + i * per, ranks=per, events=4, pool=64, seed=i + 1)))
        bridge = subprocess.Popen(
            [sys.executable, "-m", "bridge", "--config", str(path)],
            cwd=root,
            stderr=subprocess.DEVNULL,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        deadline = time.monotonic() + 60
        while True:  # every SUB connected before the first message
            try:
                if scrape(port).total("kv_bridge_sources_connected") >= per * procs:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bridge did not connect {streams} streams within 60 s")
            time.sleep(0.3)
        time.sleep(0.5)
        for _, rate, _ in publishers:
            rate.value = total / procs
        time.sleep(3.0)  # past the start-up and the first young collections
        # The publishers' counts are read as each scrape returns: a scrape of 1,000 streams takes
        # most of a second, which would otherwise count as published and not delivered.
        c0, t0, m0 = cpu_seconds(bridge.pid), thread_cpu(bridge.pid), scrape(port)
        s0, w0 = sum(sent.value for _, _, sent in publishers), time.monotonic()
        time.sleep(duration)
        c1, t1, m1 = cpu_seconds(bridge.pid), thread_cpu(bridge.pid), scrape(port)
        s1, w1 = sum(sent.value for _, _, sent in publishers), time.monotonic()
        n = m1.total("kv_bridge_sink_batches_total", outcome="delivered") - m0.total(
            "kv_bridge_sink_batches_total", outcome="delivered"
        )
        lag0, lag1 = m0.buckets("kv_bridge_lag_seconds"), m1.buckets("kv_bridge_lag_seconds")
        io = sum(t1[k] - t0.get(k, 0.0) for k in t1 if k.startswith("ZMQbg/IO"))
        return {
            "streams": per * procs,
            "offered": total,
            "published_per_s": (s1 - s0) / (w1 - w0),
            "delivered_per_s": n / (w1 - w0),
            "cpu_us_per_batch": (c1 - c0) / n * 1e6,
            "zmq_io_us_per_batch": io / n * 1e6,
            "core_share": (c1 - c0) / (w1 - w0),
            "p50_ms": (quantile(0.5, lag0, lag1) or 0.0) * 1e3,  # engine ts to sink ack (see benchmarks.run)
            "p99_ms": (quantile(0.99, lag0, lag1) or 0.0) * 1e3,
        }
    finally:
        if bridge is not None:
            bridge.send_signal(signal.SIGTERM)
            try:
                bridge.wait(30)
            except subprocess.TimeoutExpired:
                bridge.kill()
        for proc, _, _ in publishers:
            proc.terminate()
            proc.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="4,100,1000", help="stream counts to measure, in order")
    parser.add_argument("--total", type=float, default=5000.0, help="batches/s offered in total, spread over the streams")
    parser.add_argument("--format", default="raw/batch", help="FORMAT/GRANULARITY of the sink")
    parser.add_argument("--sink", choices=("file", "kafka", "redis", "nats"), default="file")
    parser.add_argument("--servers", choices=("private", "shared"), default="private", help="brokers: as benchmarks.run")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per row")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every stream count (lowest CPU kept)")
    parser.add_argument("--bridge-cpus", help="pin the bridge to these CPUs (e.g. 1)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="run the bridge of this checkout (for A/B comparisons)")
    args = parser.parse_args()
    cpus = {int(c) for c in args.bridge_cpus.split(",")} if args.bridge_cpus else None
    best: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, servers({args.sink}, args.servers, Path(tmp)) as addresses:
        for _ in range(args.rounds):  # alternating, so that the machine's drift touches every row alike
            for streams in map(int, args.streams.split(",")):
                run_id = uuid.uuid4().hex[:8]
                sink = sink_entry(args.sink, args.format, addresses.get(args.sink), run_id)
                try:
                    row = measure(streams, args.total, sink, args.duration, cpus, Path(tmp), args.tree)
                finally:
                    if args.sink != "file":
                        cleanup(args.sink, addresses[args.sink], run_id)
                if streams not in best or row["cpu_us_per_batch"] < best[streams]["cpu_us_per_batch"]:
                    best[streams] = row
    print(f"{args.sink} {args.format}, {args.total:,.0f} batches/s offered in total, 4 events per batch")
    print(
        f"{'streams':>8s} {'batches/s per stream':>21s} {'published/s':>12s} {'delivered/s':>12s} {'CPU us/batch':>13s} "
        f"{'of which ZMQ I/O':>17s} {'core share':>11s} {'batches/s per core':>19s} {'p50 / p99 ms':>14s}"
    )
    for streams, r in best.items():
        print(
            f"{streams:8d} {r['delivered_per_s'] / r['streams']:21.1f} "
            f"{r['published_per_s']:12,.0f} {r['delivered_per_s']:12,.0f} "
            f"{r['cpu_us_per_batch']:13.1f} {r['zmq_io_us_per_batch']:17.1f} {r['core_share']:11.2f} "
            f"{1e6 / r['cpu_us_per_batch']:19,.0f} {r['p50_ms']:6.1f} / {r['p99_ms']:5.1f}"
        )


if __name__ == "__main__":
    main()
