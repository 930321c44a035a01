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

The floor, measured in the same run on the same load (``--floor``, on by default): the least any
reader of these sockets must do, in a process of its own pinned like the bridge. One thread
waits in ``epoll`` on every SUB socket's ``ZMQ_FD``; when woken it drains each ready socket with
non-blocking reads and msgspec-decodes every payload, nothing else (no sequencing, no sink).
``--floor-ticks`` runs it once per tick (seconds): 0 is a wake-up per ready batch; a tick equal
to the bridge's ``ingest.tick`` waits that long after a wake-up so that the batches of other
streams arriving meanwhile share the pass, as the bridge does. ``--tree`` may be given more than
once (``label=DIR``): the trees are measured alternately, row by row, in the same run.
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
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from tests.support.harness import free_port, free_ports

from .load import LoadShape, cpu_seconds, rss_bytes, start_publisher, thread_cpu
from .run import cleanup, profile, quantile, scrape, servers, sink_entry

ROOT = Path(__file__).resolve().parents[1]


def floor_main(endpoints: list[str], tick: float, received: Synchronized[int], ready: Any) -> None:
    """The floor (see the module docstring): epoll on every socket's ZMQ_FD, drain what is ready,
    msgspec-decode each payload; with ``tick``, wait that long after a wake-up before the pass."""
    import select

    import msgspec
    import zmq
    from zmq.backend import Socket as BackendSocket

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, max(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
    recv, get, again = BackendSocket.recv, BackendSocket.get, zmq.Again
    events_opt, pollin, noblock = int(zmq.EVENTS), int(zmq.POLLIN), zmq.NOBLOCK
    decode = msgspec.msgpack.Decoder().decode
    by_fd: dict[int, zmq.Socket[bytes]] = {}
    poller = select.epoll()
    for ep in endpoints:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(ep)
        fd = s.getsockopt(zmq.FD)
        by_fd[fd] = s
        poller.register(fd, select.EPOLLIN)
    ready.set()
    n = 0
    try:
        while True:
            woken = poller.poll(0.1)
            if not woken:
                continue
            if tick > 0:
                time.sleep(tick)
                woken += poller.poll(0)
            for fd, _ in woken:
                s = by_fd[fd]
                # Reading ZMQ_EVENTS clears the descriptor; drain until the socket says no more.
                while get(s, events_opt) & pollin:
                    try:
                        while True:
                            recv(s, noblock, True)
                            recv(s, noblock, True)
                            decode(recv(s, noblock, True))
                            n += 1
                    except again:
                        pass
            received.value = n
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        for s in by_fd.values():
            s.close(linger=0)
        ctx.term()


def _start_floor(endpoints: list[str], tick: float, cpus: set[int] | None) -> tuple[Any, Synchronized[int]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    received, ready = ctx.Value("q", 0, lock=False), ctx.Event()
    proc = ctx.Process(target=floor_main, args=(endpoints, tick, received, ready), daemon=True)
    proc.start()
    if not ready.wait(60):
        proc.terminate()
        raise RuntimeError("the floor reader did not start within 60 s")
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    return proc, received


def _raise_nofile(streams: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = streams * 8 + 1024
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))  # inherited by the bridge


def _publishers(streams: int, base: int) -> tuple[list[tuple[Any, Any, Any]], int, int]:
    procs = min(4, streams)
    per = streams // procs
    shapes = [LoadShape("127.0.0.1", base + i * per, ranks=per, events=4, pool=64, seed=i + 1) for i in range(procs)]
    pubs = [start_publisher(shape) for shape in shapes]
    return pubs, procs, per


def _stop_publishers(publishers: list[tuple[Any, Any, Any]]) -> None:
    for proc, _, _ in publishers:
        proc.terminate()
        proc.join(10)


def measure_floor(streams: int, total: float, duration: float, cpus: set[int] | None, tick: float) -> dict[str, Any]:
    """Offer ``total`` batches/s over ``streams`` streams to the floor reader; its CPU per batch."""
    _raise_nofile(streams)
    base = free_ports(streams, bases=range(20000, 32000 - streams, 1500))[0]
    publishers, procs, per = _publishers(streams, base)
    floor = None
    try:
        floor, received = _start_floor([f"tcp://127.0.0.1:{base + s}" for s in range(per * procs)], tick, cpus)
        assert floor.pid is not None
        time.sleep(1.0 + streams / 1000)  # the SUBs connect and subscribe (no monitor here)
        for _, rate, _ in publishers:
            rate.value = total / procs
        time.sleep(3.0)
        c0, t0, n0, w0 = cpu_seconds(floor.pid), thread_cpu(floor.pid), received.value, time.monotonic()
        s0 = sum(sent.value for _, _, sent in publishers)
        time.sleep(duration)
        c1, t1, n1, w1 = cpu_seconds(floor.pid), thread_cpu(floor.pid), received.value, time.monotonic()
        s1 = sum(sent.value for _, _, sent in publishers)
        n = max(1, n1 - n0)
        io = sum(t1[k] - t0.get(k, 0.0) for k in t1 if k.startswith("ZMQbg/IO"))
        return {
            "streams": per * procs,
            "published_per_s": (s1 - s0) / (w1 - w0),
            "delivered_per_s": n / (w1 - w0),
            "cpu_us_per_batch": (c1 - c0) / n * 1e6,
            "zmq_io_us_per_batch": io / n * 1e6,
            "core_share": (c1 - c0) / (w1 - w0),
            "p50_ms": 0.0,
            "p99_ms": 0.0,
            "writes_per_s": 0.0,
            "write_p99_ms": 0.0,
            "rss_mb": rss_bytes(floor.pid)[0] / 2**20,
        }
    finally:
        if floor is not None:
            floor.terminate()
            floor.join(10)
        _stop_publishers(publishers)


def measure(
    streams: int,
    total: float,
    sink: dict[str, Any],
    duration: float,
    cpus: set[int] | None,
    workdir: Path,
    root: Path = ROOT,
    ingest: dict[str, Any] | None = None,
    profile_to: Path | None = None,
) -> dict[str, Any]:
    """Offer ``total`` batches/s over ``streams`` streams; the bridge's CPU per delivered batch
    (``profile_to``: also py-spy's raw stacks of the measured window, into that file)."""
    _raise_nofile(streams)
    base = free_ports(streams, bases=range(20000, 32000 - streams, 1500))[0]
    port = free_port()
    procs = min(4, streams)
    per = streams // procs
    config: dict[str, Any] = {
        "sources": [{"name": f"engine-{s:04d}", "endpoint": f"tcp://127.0.0.1:{base + s}"} for s in range(per * procs)],
        "sinks": [sink],
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "replay": {"idle_probe": 0},
        "log": {"level": "warning"},
    }
    if ingest:
        config["ingest"] = ingest
    path = workdir / f"bridge-{streams}.json"
    path.write_text(json.dumps(config))
    publishers: list[tuple[Any, Any, Any]] = []
    bridge: subprocess.Popen[bytes] | None = None
    try:
        publishers, procs, per = _publishers(streams, base)
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
        spy = profile(bridge.pid, duration, profile_to) if profile_to is not None else None
        time.sleep(duration)
        if spy is not None:
            spy.wait(30)
        c1, t1, m1 = cpu_seconds(bridge.pid), thread_cpu(bridge.pid), scrape(port)
        s1, w1 = sum(sent.value for _, _, sent in publishers), time.monotonic()
        n = m1.total("kv_bridge_sink_batches_total", outcome="delivered") - m0.total(
            "kv_bridge_sink_batches_total", outcome="delivered"
        )
        lag0, lag1 = m0.buckets("kv_bridge_lag_seconds"), m1.buckets("kv_bridge_lag_seconds")
        send0, send1 = m0.buckets("kv_bridge_sink_send_duration_seconds"), m1.buckets("kv_bridge_sink_send_duration_seconds")
        writes = m1.total("kv_bridge_sink_send_duration_seconds_count") - m0.total("kv_bridge_sink_send_duration_seconds_count")
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
            # the sink's writes (connector.write, one at a time): how many, and their p99
            "writes_per_s": writes / (w1 - w0),
            "write_p99_ms": (quantile(0.99, send0, send1) or 0.0) * 1e3,
            "rss_mb": rss_bytes(bridge.pid)[0] / 2**20,
        }
    finally:
        if bridge is not None:
            bridge.send_signal(signal.SIGTERM)
            try:
                bridge.wait(30)
            except subprocess.TimeoutExpired:
                bridge.kill()
        _stop_publishers(publishers)


def _tree(spec: str) -> tuple[str, Path]:
    label, _, path = spec.rpartition("=")
    return (label or Path(path).name or "tree"), Path(path).resolve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="4,100,1000", help="stream counts to measure, in order")
    parser.add_argument("--total", type=float, default=5000.0, help="batches/s offered in total, spread over the streams")
    parser.add_argument("--format", default="raw/batch", help="FORMAT/GRANULARITY of the sink")
    parser.add_argument("--sink", choices=("file", "kafka", "redis", "nats"), default="file")
    parser.add_argument("--servers", choices=("private", "shared"), default="private", help="brokers: as benchmarks.run")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per row")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every stream count (lowest CPU kept)")
    parser.add_argument("--bridge-cpus", help="pin the bridge (and the floor) to these CPUs (e.g. 1)")
    parser.add_argument(
        "--tree", action="append", help="[LABEL=]DIR: run the bridge of this checkout (repeat for A/B comparisons in one run)"
    )
    parser.add_argument("--floor-ticks", default="0,0.001", help="ticks (s) of the floor reader to measure; empty: no floor")
    parser.add_argument("--ingest", default="{}", help="the bridge's ingest options, as JSON (e.g. '{\"tick\": 0}')")
    parser.add_argument("--profile", type=Path, help="py-spy raw stacks of each bridge row's window, into this directory")
    args = parser.parse_args()
    cpus = {int(c) for c in args.bridge_cpus.split(",")} if args.bridge_cpus else None
    trees = [_tree(t) for t in args.tree] if args.tree else [("bridge", ROOT)]
    floor_ticks = [float(t) for t in args.floor_ticks.split(",") if t]
    ingest = json.loads(args.ingest)
    best: dict[tuple[str, int], dict[str, Any]] = {}

    def keep(key: tuple[str, int], row: dict[str, Any]) -> None:
        if key not in best or row["cpu_us_per_batch"] < best[key]["cpu_us_per_batch"]:
            best[key] = row

    with tempfile.TemporaryDirectory() as tmp, servers({args.sink}, args.servers, Path(tmp)) as addresses:
        for _ in range(args.rounds):  # alternating, so that the machine's drift touches every row alike
            for streams in map(int, args.streams.split(",")):
                for tick in floor_ticks:
                    row = measure_floor(streams, args.total, args.duration, cpus, tick)
                    keep((f"floor tick {tick * 1e3:g} ms", streams), row)
                for label, tree in trees:
                    run_id = uuid.uuid4().hex[:8]
                    sink = sink_entry(args.sink, args.format, addresses.get(args.sink), run_id)
                    try:
                        if args.profile is not None:
                            args.profile.mkdir(parents=True, exist_ok=True)
                        spy = args.profile / f"{label}-{streams}.txt" if args.profile is not None else None
                        row = measure(streams, args.total, sink, args.duration, cpus, Path(tmp), tree, ingest, spy)
                    finally:
                        if args.sink != "file":
                            cleanup(args.sink, addresses[args.sink], run_id)
                    keep((label, streams), row)
    print(f"{args.sink} {args.format}, {args.total:,.0f} batches/s offered in total, 4 events per batch")
    print(
        f"{'reader':>22s} {'streams':>8s} {'batches/s per stream':>21s} {'published/s':>12s} {'delivered/s':>12s} "
        f"{'CPU us/batch':>13s} {'of which ZMQ I/O':>17s} {'core share':>11s} {'batches/s per core':>19s} "
        f"{'p50 / p99 ms':>14s} {'writes/s, p99 ms':>17s} {'RSS MB':>7s}"
    )
    for (label, streams), r in sorted(best.items(), key=lambda kv: (kv[0][1], not kv[0][0].startswith("floor"))):
        print(
            f"{label:>22s} {streams:8d} {r['delivered_per_s'] / r['streams']:21.1f} "
            f"{r['published_per_s']:12,.0f} {r['delivered_per_s']:12,.0f} "
            f"{r['cpu_us_per_batch']:13.1f} {r['zmq_io_us_per_batch']:17.1f} {r['core_share']:11.2f} "
            f"{1e6 / r['cpu_us_per_batch']:19,.0f} {r['p50_ms']:6.1f} / {r['p99_ms']:5.1f} "
            f"{r['writes_per_s']:8.0f}, {r['write_p99_ms']:6.1f} {r['rss_mb']:7.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
