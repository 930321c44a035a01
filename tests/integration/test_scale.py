"""Scale: 1,000 streams (500 engines x 2 ranks) in one bridge process.

The engines are simulated by a few publisher processes (:func:`benchmarks.load.publisher_main`),
each hosting 250 PUB sockets on consecutive loopback ports and publishing realistic batches
round-robin at a steady rate. The bridge runs as users run it (``python -m bridge --config``),
writing JSON batches to a file. Checked:

- memory: the bridge's peak RSS (``VmHWM``) stays under 400 MB;
- order: within every stream the delivered seqs are strictly consecutive (no gap, no duplicate,
  no ``EventsLost``, nothing out of order);
- no starvation: every batch of every stream is in the file within a bound of its engine ``ts``
  (the file is read while the bridge writes it), and everything published is delivered.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks.load import LoadShape, rss_bytes, start_publisher
from tests.support.harness import free_port, free_ports
from tests.support.process import wait_readyz

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ENGINES = 500
RANKS = 2
STREAMS = ENGINES * RANKS
PROCESSES = 4  # publisher processes, STREAMS / PROCESSES sockets each
RATE = 5.0  # batches per second per stream: 5,000 batches/s in total
PUBLISH_SECONDS = 20.0
DELIVERY_BOUND = 5.0  # seconds from an engine's publish to the batch being in the sink's file, for every batch
DRAIN_BOUND = 20.0  # seconds from the end of publishing until everything published is delivered
RSS_LIMIT = 400 * 2**20


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))  # inherited by the processes started below


class _Tail:
    """Reads the sink's file while the bridge writes it: per stream, (seq, engine ts, arrival time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: dict[tuple[str, int], list[tuple[int, float, float]]] = defaultdict(list)
        self.problems: list[str] = []
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.poll()

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        now = time.time()
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].splitlines():
            rec = json.loads(line)
            if "events" not in rec:
                self.problems.append(f"control record: {rec}")
                continue
            self.seen[(rec["source"], rec["dp_rank"])].append((rec["seq"], rec["ts"], now))
        self._offset += end

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.poll()


def _connected(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kv_bridge_sources_connected "):
                return float(line.split()[1])
    return 0.0


def test_thousand_streams_bounded_memory_order_and_no_starvation(tmp_path: Path) -> None:
    _raise_fd_limit(STREAMS * 8 + 1024)
    try:
        # Below the ephemeral range (32768 and up here), where the bridge's own connections take their ports;
        # windows 100 apart (a CI run beside other work found none free among 8 windows 1,500 apart).
        base = free_ports(STREAMS, bases=range(10000, 32000 - STREAMS, 100))[0]
    except RuntimeError as exc:
        if os.environ.get("CI") == "true":  # in CI a skipped scale test would hide a regression
            raise
        pytest.skip(f"{exc} between 20000 and 32000")
    per_process = STREAMS // PROCESSES
    out = tmp_path / "out.jsonl"
    metrics_port = free_port()
    config = {
        "sources": [
            {"name": f"engine-{e:03d}", "endpoint": f"tcp://127.0.0.1:{base + e * RANKS}", "dp_ranks": RANKS}
            for e in range(ENGINES)
        ],
        "sinks": [{"type": "file", "path": str(out), "format": "json", "granularity": "batch"}],
        "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
        "replay": {"idle_probe": 0},
        "log": {"level": "warning"},
    }
    cfg = tmp_path / "bridge.yaml"
    cfg.write_text(json.dumps(config))

    publishers: list[tuple[Any, Any, Any]] = []
    bridge: subprocess.Popen[bytes] | None = None
    tail: _Tail | None = None
    try:
        for i in range(PROCESSES):
            shape = LoadShape("127.0.0.1", base + i * per_process, ranks=per_process, events=3, pool=8, seed=i + 1)
            publishers.append(start_publisher(shape))

        with open(tmp_path / "bridge.log", "wb") as log:
            bridge = subprocess.Popen([sys.executable, "-m", "bridge", "--config", str(cfg)], cwd=ROOT, stderr=log)
        started = time.monotonic()
        wait_readyz(metrics_port, 60, bridge)
        # Every SUB connected before the first message, so every stream starts at seq 0.
        deadline = time.monotonic() + 30
        while _connected(metrics_port) < STREAMS:
            assert time.monotonic() < deadline, f"only {_connected(metrics_port):.0f} of {STREAMS} connections"
            time.sleep(0.25)
        startup = time.monotonic() - started
        time.sleep(0.5)

        tail = _Tail(out)
        for _, rate, _ in publishers:
            rate.value = RATE * per_process
        time.sleep(PUBLISH_SECONDS)
        for _, rate, _ in publishers:
            rate.value = 0.0
        time.sleep(0.2)
        stopped_at = time.time()
        # The seq of the last batch of each stream: a publisher goes round-robin over its sockets.
        last_seq: dict[tuple[str, int], int] = {}
        for i, (_, _, sent) in enumerate(publishers):
            total = sent.value
            for k in range(per_process):
                stream = i * per_process + k
                last_seq[(f"engine-{stream // RANKS:03d}", stream % RANKS)] = (total - k + per_process - 1) // per_process - 1

        deadline = stopped_at + DRAIN_BOUND
        while True:
            missing = [k for k, last in last_seq.items() if not tail.seen[k] or tail.seen[k][-1][0] < last]
            if not missing or time.time() > deadline:
                break
            time.sleep(0.5)
        tail.stop()
        drained_in = time.time() - stopped_at
        peak_rss = rss_bytes(bridge.pid)[1]
        seen = tail.seen

        assert not tail.problems, tail.problems[:5]
        assert len(seen) == STREAMS, f"{STREAMS - len(seen)} streams delivered nothing"
        assert not missing, f"{len(missing)} streams not fully delivered {DRAIN_BOUND}s after publishing stopped: {missing[:5]}"
        worst = 0.0
        for key, items in seen.items():
            seqs = [s for s, _, _ in items]
            assert seqs == list(range(len(seqs))), f"{key}: seqs not 0, 1, 2, ... in order: {seqs[:10]}"
            assert seqs[-1] == last_seq[key], f"{key}: last seq {seqs[-1]}, published up to {last_seq[key]}"
            # Seen in the file at most this long after the engine published it (the reader polls
            # every 0.1 s): a starved stream would fall behind here.
            worst = max(worst, max(arrived - ts for _, ts, arrived in items))
        assert worst < DELIVERY_BOUND, f"a batch took {worst:.1f}s from engine to file"
        assert peak_rss < RSS_LIMIT, f"peak RSS {peak_rss / 2**20:.0f} MB"
        print(
            f"\n{STREAMS} streams: bridge ready and connected in {startup:.1f}s, "
            f"{sum(len(v) for v in seen.values())} batches delivered in order, worst engine->file {worst * 1000:.0f} ms, "
            f"drained {drained_in:.1f}s after publishing stopped, peak RSS {peak_rss / 2**20:.0f} MB"
        )
    finally:
        if tail is not None:
            tail.stop()
        if bridge is not None and bridge.poll() is None:
            bridge.send_signal(signal.SIGTERM)
            try:
                bridge.wait(30)
            except subprocess.TimeoutExpired:
                bridge.kill()
                bridge.wait()
        for proc, _, _ in publishers:
            proc.terminate()
            proc.join(10)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
