"""Run the bridge in-process against real ZMQ sockets and read what its file sink wrote."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bridge.config import Config, from_data
from bridge.runtime import Bridge
from tests.infra.servers import free_port, port_reserved, reserve_ports
from tests.support.schema import check_line

if TYPE_CHECKING:
    from tests.support.cache_engine import CacheEngine


def free_ports(n: int, bases: Iterable[int] | None = None) -> list[int]:
    """``n`` consecutive free ports (ranks use port + r) from a base outside the kernel's
    ephemeral range (see ``free_port``), or from the first of ``bases`` that has them."""
    for base in (free_port() for _ in range(200)) if bases is None else bases:
        ports = range(base, base + n)
        # Random draws skip ports handed out before in this process (a test may not have bound
        # them yet); explicit bases (the 1,000-stream test's wide ranges, which a session's draws
        # would fence off) only need the ports free now.
        others = ports[1:] if bases is None else ()
        if all(_bindable(p) for p in ports) and not any(port_reserved(p) for p in others):
            reserve_ports(ports)
            return list(ports)
    raise RuntimeError(f"no {n} consecutive free ports")


def free_ports_on(hosts: Iterable[str], n: int) -> list[int]:
    """``n`` consecutive ports free on every one of ``hosts`` (loopback addresses such as
    127.0.0.2: DNS discovery gives every engine the same ports)."""
    hosts = list(hosts)
    for _ in range(200):
        ports = free_ports(n)
        if all(_bindable(p, h) for h in hosts for p in ports):
            return ports
    raise RuntimeError(f"no {n} consecutive ports free on {', '.join(hosts)}")


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def read_lines(path: Path, *, records: bool = True) -> list[dict[str, Any]]:
    """The JSON lines of ``path``: records a ``json`` file sink wrote, each checked against the
    output schema; ``records=False`` for other files (dead letters)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    # A line counts once its newline is written: what follows the last one is a write in
    # progress (read while the bridge writes, or cut by a SIGKILL), possibly mid-character.
    lines = [line for line in data[: data.rfind(b"\n") + 1].decode().splitlines() if line.strip()]
    return [check_line(line) for line in lines] if records else [json.loads(line) for line in lines]


async def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def running_bridge(
    tmp: Path, sources: list[dict[str, Any]], *, granularity: str = "batch", **extra: Any
) -> AsyncIterator[tuple[Bridge, Path]]:
    out = tmp / "out.jsonl"
    cfg: dict[str, Any] = {
        "sources": sources,
        "sinks": [{"type": "file", "path": str(out), "format": "json", "granularity": granularity, "batch": {"linger": 0}}],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp / "dead.jsonl")},
        "replay": {"timeout": "500ms", "initial_backoff": "50ms", "max_backoff": "500ms"},
    }
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    bridge = Bridge(from_data(cfg, env={}))
    await bridge.start()
    try:
        yield bridge, out
    finally:
        await bridge.stop()


async def one_run(config: Config, engine: CacheEngine, steps: int, written: Callable[[], Awaitable[Any]], **step: Any) -> Any:
    """One in-process bridge on ``config``: the engine publishes ``steps`` batches (``step``: the
    engine's step options), then what ``written()`` returns once the sink holds them; the bridge
    stops (its checkpoint saved).

    The engine publishes once every sink has connected: ``written()`` must not read a stream the
    sink is still creating (nats-server before 2.9.15 crashes on a read in that window)."""
    bridge = Bridge(config)
    await bridge.start()
    try:
        await wait_for(lambda: all(w.connected for w in bridge.workers), timeout=30, what="every sink connected")
        await engine.wait_subscribed()
        await engine.step(steps, **step)
        return await written()
    finally:
        await bridge.stop()


def metric(bridge: Bridge, name: str, **labels: str) -> float:
    value = bridge.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def batches(lines: list[dict[str, Any]], source: str | None = None, dp_rank: int | None = None) -> list[dict[str, Any]]:
    return [
        line for line in lines if (source is None or line["source"] == source) and (dp_rank is None or line["dp_rank"] == dp_rank)
    ]
