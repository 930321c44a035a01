"""The bridge as a separate process (``python -m bridge --config``), measured from outside.

:class:`BridgeProcess` writes a config file (:func:`bridge_config` makes one), starts the bridge
with its stderr in a log file, and reads its resident memory (``VmRSS`` in ``/proc/PID/status``)
and its ``/metrics``; :class:`Sampler` follows both in the background (peak RSS, peak queue
bytes); :class:`BridgeRun` starts, samples and cleans up bridges fed by a simulated engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tests.support.harness import free_port

if TYPE_CHECKING:
    from bridge.simulator import Simulator

ROOT = Path(__file__).resolve().parents[2]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def freeze(pid: int) -> None:
    """Stop ``pid`` (SIGSTOP: a GC pause, a stalled VM, a ``docker pause``) and return once every
    thread of it is stopped (the signal takes effect asynchronously); ``thaw`` continues it."""
    os.kill(pid, signal.SIGSTOP)
    for _ in range(1000):  # bounded wait, not a timing assertion
        if _stopped(pid):
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


def _stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (state T in /proc)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for t in tasks)


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def wait_readyz(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until the bridge's ``/readyz`` on ``port`` answers 200 (for synchronous callers);
    AssertionError after ``timeout`` seconds, or as soon as ``proc`` (the bridge) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the bridge exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"bridge not ready within {timeout}s")


async def http_get(port: int, path: str, host: str = "127.0.0.1", timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of one GET (the bridge's endpoints close the connection after each answer)."""
    # (asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that arrives as the
    # read completes, and a sampler polling through it then never stops)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        async with asyncio.timeout(timeout):
            await writer.drain()
            data = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout):
                await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def parse_metrics(text: str) -> dict[str, float]:
    """Exposition text as ``{'name{labels}': value}`` (labels as printed, in their order)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def bridge_config(tmp: Path, sources: list[dict[str, Any]], sinks: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    """A config for :class:`BridgeProcess`: ``sources`` and ``sinks``, ``/metrics`` on a free loopback
    port, dead letters in ``tmp``; each of ``sections`` sets the section of that name."""
    cfg: dict[str, Any] = {
        "sources": sources,
        "sinks": sinks,
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        "dead_letter": {"path": str(tmp / "dead.jsonl")},
    }
    cfg.update(sections)
    return cfg


class BridgeProcess:
    """``python -m bridge --config FILE`` with ``config`` (a dict, written as YAML/JSON)."""

    def __init__(self, tmp: Path, config: dict[str, Any], *, env: dict[str, str] | None = None, name: str = "bridge") -> None:
        self.tmp = tmp
        self.config_path = tmp / f"{name}.yaml"
        self.config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.log_path = tmp / f"{name}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        listen = config.get("metrics", {}).get("listen", "")
        self.metrics_port = int(listen.rpartition(":")[2]) if listen else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, new_session: bool = False) -> BridgeProcess:
        """Start it; ``new_session``: out of the caller's process group (a terminal's Ctrl-C then
        reaches only the caller, which stops it in its turn)."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bridge", "--config", str(self.config_path)],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=new_session,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def metrics(self) -> dict[str, float]:
        assert self.metrics_port is not None
        status, body = await http_get(self.metrics_port, "/metrics")
        assert status == 200, status
        return parse_metrics(body.decode())

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Until /readyz answers 200 (every sink connected, every source subscribed)."""
        assert self.metrics_port is not None
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            assert self.alive(), f"the bridge exited: {self.log()[-3000:]}"
            try:
                status, body = await http_get(self.metrics_port, "/readyz")
                if status == 200:
                    return
                last = body
            except OSError as exc:
                last = exc
            await asyncio.sleep(0.1)
        raise AssertionError(f"bridge not ready after {timeout}s: {last!r}\n{self.log()[-3000:]}")

    async def wait_metric(self, name: str, at_least: float, timeout: float = 60.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        value = 0.0
        while time.monotonic() < deadline:
            assert self.alive(), f"the bridge exited: {self.log()[-3000:]}"
            with contextlib.suppress(OSError, AssertionError, TimeoutError):
                value = metric(await self.metrics(), name, **labels)
                if value >= at_least:
                    return value
            await asyncio.sleep(0.2)
        raise AssertionError(f"{name}{labels} = {value} < {at_least} after {timeout}s\n{self.log()[-3000:]}")

    async def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code (SIGKILL and fail after ``timeout``)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the bridge did not exit within {timeout}s\n{self.log()[-3000:]}")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Sampler:
    """Samples a bridge's RSS (every ``interval``) and, with metrics, its sink queue bytes."""

    def __init__(self, bridge: BridgeProcess, interval: float = 0.1, metrics_every: int = 5) -> None:
        self.bridge = bridge
        self.interval = interval
        self.metrics_every = metrics_every
        self.rss: list[tuple[float, int]] = []
        self.queue_bytes_peak: dict[str, float] = {}
        self.queue_batches_peak: dict[str, float] = {}
        self.queue_bytes: list[tuple[float, float]] = []  # (time, bytes queued over every sink)
        self.delivered: list[tuple[float, float]] = []  # (time, batches delivered by every sink)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> Sampler:
        self._task = asyncio.create_task(self._run(), name="rss-sampler")
        return self

    async def stop(self) -> None:
        self._stopping = True  # (ends the loop even where a cancel gets swallowed)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def peak(self) -> int:
        return max((r for _, r in self.rss), default=0)

    def current(self) -> int:
        return self.rss[-1][1] if self.rss else self.bridge.rss()

    def peak_between(self, t0: float, t1: float) -> int:
        return max((r for t, r in self.rss if t0 <= t <= t1), default=0)

    def rss_at(self, t0: float) -> int:
        """The first RSS sample at or after ``t0``."""
        return next((r for t, r in self.rss if t >= t0), 0)

    def queue_reached(self, size: float) -> float | None:
        """When the sink queues first held ``size`` bytes or more."""
        return next((t for t, b in self.queue_bytes if b >= size), None)

    def delivering_again(self, t0: float) -> float | None:
        """The last sample before the sinks delivered a batch again after ``t0`` (the end of a
        stall that began before ``t0``), or None while they have not."""
        stalled = next(((t, d) for t, d in self.delivered if t >= t0), None)
        if stalled is None:
            return None
        last = stalled[0]
        for t, d in self.delivered:
            if t > stalled[0]:
                if d > stalled[1]:
                    return last
                last = t
        return None

    async def _run(self) -> None:
        n = 0
        while not self._stopping and self.bridge.alive():
            with contextlib.suppress(OSError, RuntimeError):
                self.rss.append((time.monotonic(), self.bridge.rss()))
            if self.bridge.metrics_port is not None and n % self.metrics_every == 0:
                with contextlib.suppress(OSError, AssertionError, TimeoutError, ValueError, IndexError):
                    samples = await self.bridge.metrics()
                    now = time.monotonic()
                    self.queue_bytes.append((now, metric(samples, "kv_bridge_sink_queue_bytes")))
                    self.delivered.append((now, metric(samples, "kv_bridge_sink_batches_total", outcome="delivered")))
                    for key, value in samples.items():
                        if key.startswith("kv_bridge_sink_queue_bytes{"):
                            self.queue_bytes_peak[key] = max(self.queue_bytes_peak.get(key, 0.0), value)
                        elif key.startswith("kv_bridge_sink_queue_batches{"):
                            self.queue_batches_peak[key] = max(self.queue_batches_peak.get(key, 0.0), value)
            n += 1
            await asyncio.sleep(self.interval)


class BridgeRun:
    """``async with BridgeRun(bridge, engine=sim) as run:`` starts ``bridge`` with a :class:`Sampler`
    (``sampler_options``), then ``engine`` (an entered Simulator) publishing in the background,
    and enters once the bridge is ready.

    On exit, whatever happened: the engine stops, the samplers stop and every bridge of the run
    still alive is killed. A test that wants a bridge's exit code ends it itself with
    ``terminate()`` first.
    """

    def __init__(self, bridge: BridgeProcess, *, engine: Simulator | None = None, **sampler_options: Any) -> None:
        self.first = bridge
        self.engine = engine
        self.samplers: list[Sampler] = []
        self._sampler_options = sampler_options
        self._bridges: list[BridgeProcess] = []
        self._publishing: asyncio.Task[None] | None = None

    @property
    def sampler(self) -> Sampler:
        """The first bridge's sampler."""
        return self.samplers[0]

    def _launch(self, bridge: BridgeProcess) -> None:
        self._bridges.append(bridge.start())
        self.samplers.append(Sampler(bridge, **self._sampler_options).start())

    async def start(self, bridge: BridgeProcess) -> Sampler:
        """Start one more bridge (sampled, and killed on exit) and wait until it is ready."""
        self._launch(bridge)
        await bridge.wait_ready()
        return self.samplers[-1]

    async def stop_engine(self) -> dict[int, int]:
        """Stop publishing; returns how many batches each rank published."""
        assert self.engine is not None and self._publishing is not None
        self._publishing.cancel()
        await asyncio.gather(self._publishing, return_exceptions=True)
        return {r: rank.seq for r, rank in enumerate(self.engine.ranks)}

    async def __aenter__(self) -> BridgeRun:
        self._launch(self.first)
        if self.engine is not None:
            self._publishing = asyncio.create_task(self.engine.run(), name="engine")
        try:
            await self.first.wait_ready()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._publishing is not None:
            self._publishing.cancel()
            await asyncio.gather(self._publishing, return_exceptions=True)
        for sampler in self.samplers:
            await sampler.stop()
        for bridge in self._bridges:
            bridge.kill()
