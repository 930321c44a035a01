"""A Redis password in the url's query string (``redis://host/0?password=...``, which redis-py
accepts) stays out of everything the bridge shows, on a real redis-server that requires it.

The bridge runs as a user runs it (``python -m bridge --config FILE``, logging at debug) against a
private redis-server with ``requirepass``, fed by a simulated engine; one stream's key holds a
string, so the sink refuses its messages (WRONGTYPE) and dead-letters them; then the server goes
away, so ``/readyz`` and ``--check`` say why the sink is not ready. The password must appear in no
log line (the connect line included), no dead letter, no ``/readyz`` body, no ``--check`` output,
and neither repr (options, connector); each of them shows the url with ``password=***`` instead.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bridge.config import from_data
from bridge.connector import Registry
from bridge.simulator import Simulator, SimulatorOptions
from connectors.redis import RedisConnector
from tests.infra.servers import RedisServer
from tests.integration.conftest import own_server
from tests.support.harness import free_ports
from tests.support.process import ROOT, BridgeProcess, BridgeRun, bridge_config, http_get

pytestmark = pytest.mark.integration

SECRET = f"pw-{uuid.uuid4().hex}"  # distinctive, so any text can be searched for it


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server that wants SECRET (requirepass) from every client."""
    server = RedisServer(tmp_path_factory.mktemp("redis-locked"), persistent=False, password=SECRET)
    with own_server("redis (requirepass)", server) as started:
        yield started


def _config(tmp: Path, url: str, prefix: str, ports: list[int]) -> dict[str, Any]:
    sink = {
        "type": "redis",
        "name": "redis",
        "url": url,
        "stream": prefix + ":{source}:{dp_rank}",
        "timeout": "1s",
        "format": "json",
        "granularity": "batch",
        "retry": {"initial_backoff": "50ms", "max_backoff": "500ms", "write_timeout": "5s"},
    }
    source = {"name": "sec", "endpoint": f"tcp://127.0.0.1:{ports[0]}", "replay_endpoint": f"tcp://127.0.0.1:{ports[2]}"}
    return bridge_config(
        tmp,
        [{**source, "dp_ranks": 2}],
        [sink],
        replay={"timeout": "500ms", "initial_backoff": "50ms", "max_backoff": "500ms"},
        log={"level": "debug"},
    )


async def _readyz_when_down(bridge: BridgeProcess, timeout: float = 30.0) -> dict[str, Any]:
    """/readyz once the idle sink's health check (every 5 s) has noticed the server is gone."""
    assert bridge.metrics_port is not None
    for _ in range(int(timeout / 0.2)):
        status, body = await http_get(bridge.metrics_port, "/readyz")
        if status == 503 and b"not_connected" in body:  # (not an earlier refusal's: the server gone)
            answer: dict[str, Any] = json.loads(body)
            return answer
        await asyncio.sleep(0.2)
    raise AssertionError(f"/readyz still ready {timeout} s after the server went away")


def _check(config_path: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "bridge", "--check", "--config", str(config_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0, "the server is down: --check must fail"
    return out.stdout + out.stderr


async def test_a_password_in_the_url_query_string_is_never_shown(locked_redis: RedisServer, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{locked_redis.port}/0?password={SECRET}"
    shown = f"redis://127.0.0.1:{locked_redis.port}/0?password=***"
    prefix = f"t{uuid.uuid4().hex[:8]}"
    ports = free_ports(4)
    cfg = _config(tmp_path, url, prefix, ports)
    texts: dict[str, str] = {}

    # 1. Both reprs, of the connector the bridge builds from this config.
    connector = Registry().build(from_data(json.loads(json.dumps(cfg))).sinks[0], 0)
    assert isinstance(connector, RedisConnector)
    texts["repr(options)"] = repr(connector.options) + str(connector.options)
    texts["repr(connector)"] = repr(connector)

    # 2. The bridge as a process: logs, dead letters, /readyz, then --check.
    bridge = BridgeProcess(tmp_path, cfg)
    engine = SimulatorOptions(
        endpoint=f"tcp://127.0.0.1:{ports[0]}",
        replay_endpoint=f"tcp://127.0.0.1:{ports[2]}",
        dp_ranks=2,
        rate=200,
        count=20_000,  # (still publishing when rank 1's key is spoiled: its next batch meets it before the audit)
        events_per_batch=3,
        linger=30.0,
    )
    async with Simulator(engine) as sim, BridgeRun(bridge, engine=sim):
        await bridge.wait_metric("kv_bridge_sink_batches_total", 1, sink="redis", outcome="delivered")
        with redis.Redis(host=locked_redis.host, port=locked_redis.port, password=SECRET) as admin:
            # rank 1's next messages are refused: dead letters. One SET, which replaces the stream
            # (a DEL first let a write find the key missing in between: a loss, announced, and that
            # announcement refused and kept, so no batch was ever dead-lettered).
            admin.set(f"{prefix}:sec:1", "not a stream")
        await bridge.wait_metric("kv_bridge_dead_letters_total", 1, reason="sink_rejected")
        await locked_redis.astop()
        try:
            texts["/readyz"] = json.dumps(await _readyz_when_down(bridge))
            texts["--check"] = _check(bridge.config_path)
        finally:
            await locked_redis.astart()
        texts["log"] = bridge.log()
    texts["dead letters"] = (tmp_path / "dead.jsonl").read_text()

    leaks = [where for where, text in texts.items() if SECRET in text]
    assert not leaks, f"the password appears in: {', '.join(leaks)}"
    # ...and each place does show what it is about, the url with its password masked.
    connected = [line for line in texts["log"].splitlines() if "redis sink connected" in line]
    assert connected and shown in connected[0], connected
    assert "WRONGTYPE" in texts["dead letters"] and "sinks[redis]" in texts["dead letters"]
    assert shown in texts["/readyz"] and "sinks[redis]" in texts["/readyz"], texts["/readyz"]
    assert shown in texts["--check"], texts["--check"]
    assert shown in texts["repr(options)"] and shown in texts["repr(connector)"]
