"""Instructions per batch under valgrind: an A/B measure this shared machine cannot blur.

    .venv/bin/python -m benchmarks.instructions [--formats raw/batch,json/event] [--tree DIR]
    .venv/bin/python -m benchmarks.instructions --streams 100 [--rate 100] [--tree DIR]

CPU time on a shared 2-core VM moves by 10-20% between runs of the same code, more than most
single changes save. Instructions retired do not: the same code gives the same count to a few
tenths of a percent. They are not time (a cache miss costs more than an add), so a change is
still confirmed in CPU time (``benchmarks.pipeline``, ``benchmarks.streams``); this tool says
which of two trees does less work, and by how much. Needs valgrind (Debian ``valgrind``).

- Default: ``benchmarks.pipeline``'s run (a real Bridge, one stream, bursts of
  ``ingest.drain_max``, file sink to /dev/null) and its floor, each under cachegrind for two
  batch counts; the difference over the difference in batches is the cost of a batch without
  start-up. Uvloop when installed, GC as ``python -m bridge`` sets it.
- ``--streams N``: a fleet, where each batch is a socket wake-up of its own. The bridge with N
  live sources fed over TCP by a publisher process that runs natively (``--rate`` batches/s in
  all, slow enough for valgrind), under callgrind with collection switched on for ``--batches``
  delivered batches after 200 of warm-up. The sink's linger is set so that a write carries
  about 10 batches, as 2 ms does at 5,000 batches/s. The count includes ZMQ's I/O thread.

``--tree DIR`` measures another checkout (e.g. ``git archive REV | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_IREFS = re.compile(r"(?:I\s+refs|Collected)\s*:\s*([\d,]+)")


def _valgrind(tree: Path, tool: list[str], args: list[str]) -> tuple[int, str]:
    """Instructions counted for this script's ``--child ARGS`` run on ``tree``'s code (this file
    is run as a script, so that a tree from before it existed can be measured too)."""
    cmd = ["valgrind", *tool, sys.executable, __file__, "--child", *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False)
    found = _IREFS.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"valgrind run failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return int(found[-1].replace(",", "")), done.stderr


def pipeline_cost(tree: Path, fmt: str, what: str, counts: tuple[int, int]) -> float:
    """Instructions per batch of the pipeline (``what`` = bridge) or its floor, start-up excluded."""
    tool = ["--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    (a, _), (b, _) = (_valgrind(tree, tool, ["pipeline", fmt, str(n), what]) for n in counts)
    return (b - a) / (counts[1] - counts[0])


def fleet_cost(tree: Path, fmt: str, streams: int, rate: float, batches: int) -> float:
    """Instructions per delivered batch of a bridge with ``streams`` quiet streams (see the docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        tool = ["--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        irefs, stderr = _valgrind(tree, tool, ["fleet", fmt, str(streams), str(rate), str(batches)])
    measured = re.findall(r"measured (\d+)", stderr)
    if not measured:
        raise RuntimeError(f"the fleet run did not report its batches:\n{stderr[-2000:]}")
    return irefs / int(measured[-1])


# -- what runs under valgrind -------------------------------------------------------------------
def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    # benchmarks.pipeline.main's choice, written here again: a --tree from before this file has
    # no shared helper to import.
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        return uvloop.new_event_loop  # type: ignore[no-any-return,unused-ignore]
    except ImportError:
        return None


def _child_pipeline(fmt: str, batches: int, what: str) -> None:
    from benchmarks import pipeline

    if what == "bridge":
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(pipeline.one(fmt, batches, 256))
    else:
        pipeline.FLOORS[fmt](pipeline._frames(batches))


async def _until(done: Callable[[], bool]) -> None:
    while True:
        if done():
            return
        await asyncio.sleep(0.05)


async def _collect(state: str) -> None:
    """Switch callgrind's collection on or off in this process."""
    proc = await asyncio.create_subprocess_exec(
        "callgrind_control", "-i", state, str(os.getpid()), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    if await proc.wait() != 0:
        raise RuntimeError(f"callgrind_control -i {state} failed")


async def _fleet(fmt: str, streams: int, rate: float, batches: int) -> None:
    from benchmarks.load import LoadShape, start_publisher
    from bridge import config as config_mod
    from bridge.runtime import Bridge
    from tests.support.harness import free_ports

    f, g = fmt.split("/")
    base = free_ports(streams, bases=range(20000, 32000 - streams, 1500))[0]
    config = config_mod.from_data(
        {
            "sources": [{"name": f"engine-{s:04d}", "endpoint": f"tcp://127.0.0.1:{base + s}"} for s in range(streams)],
            "sinks": [
                {
                    "type": "file",
                    "name": "null",
                    "path": "/dev/null",
                    "format": f,
                    "granularity": g,
                    "binary": "length-prefixed",
                    "batch": {"linger": 10 / rate},
                }
            ],
            "metrics": {"listen": ""},
            "replay": {"idle_probe": 0},
            "log": {"level": "warning"},
        },
        env={},
    )
    proc, rate_value, _ = start_publisher(LoadShape("127.0.0.1", base, ranks=streams, events=4, pool=64, seed=1))
    bridge = Bridge(config)
    await bridge.start()
    try:
        worker = bridge.workers[0]
        await _until(lambda: sum(r.connections for r in bridge.readers.values()) >= streams)
        await asyncio.sleep(1.0)
        rate_value.value = rate
        await _until(lambda: worker._n_ok >= 200)  # warm-up (no scrape runs, so _n_ok only grows)
        await _collect("on")
        start = worker._n_ok
        await _until(lambda: worker._n_ok >= start + batches)
        await _collect("off")
        print(f"measured {worker._n_ok - start}", file=sys.stderr)
        rate_value.value = 0
    finally:
        proc.terminate()
        await bridge.stop()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        from bridge.cli import tune_gc

        tune_gc()
        kind, fmt, *rest = sys.argv[2:]
        if kind == "pipeline":
            _child_pipeline(fmt, int(rest[0]), rest[1])
        else:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(_fleet(fmt, int(rest[0]), float(rest[1]), int(rest[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="raw/batch,json/event")
    parser.add_argument("--counts", default="10000,30000", help="the two batch counts of a pipeline measurement")
    parser.add_argument("--streams", type=int, help="measure a fleet of this many quiet streams instead")
    parser.add_argument("--rate", type=float, default=100.0, help="fleet: batches/s in all")
    parser.add_argument("--batches", type=int, default=500, help="fleet: batches measured")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to measure")
    args = parser.parse_args()
    tree = args.tree.resolve()
    if args.streams:
        print(f"{'format':16s} {'streams':>8s} {'instructions/batch':>19s}")
        for fmt in args.formats.split(","):
            cost = fleet_cost(tree, fmt, args.streams, args.rate, args.batches)
            print(f"{fmt:16s} {args.streams:8d} {cost:19,.0f}", flush=True)
        return
    n1, n2 = (int(n) for n in args.counts.split(","))
    print(f"{'format':16s} {'bridge instr/batch':>19s} {'floor instr/batch':>18s} {'bridge/floor':>13s}")
    for fmt in args.formats.split(","):
        bridge = pipeline_cost(tree, fmt, "bridge", (n1, n2))
        floor = pipeline_cost(tree, fmt, "floor", (n1, n2))
        print(f"{fmt:16s} {bridge:19,.0f} {floor:18,.0f} {bridge / floor:12.2f}x", flush=True)


if __name__ == "__main__":
    main()
