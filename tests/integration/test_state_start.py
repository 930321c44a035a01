"""A state sink that comes up a few seconds after the bridge (issue 29, case 8).

Kubernetes starts the bridge and Redis together; the bridge must not take a sink that is still
starting for one that holds nothing, or every stream's state starts afresh (incomplete until the
engine's next reset, hours or days). It retries within ``state.load_timeout`` and rebuilds.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from bridge.runtime import Bridge
from tests.infra.servers import RedisServer
from tests.integration.test_redis_state import bootstrapped, check, in_process, remove_keys, settled, sink
from tests.support.cache_engine import CacheEngine
from tests.support.harness import free_port
from tests.support.process import BridgeProcess, bridge_config, http_get

pytestmark = pytest.mark.integration


async def test_a_state_sink_down_for_3s_at_start_is_waited_for_and_the_state_rebuilt(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    del redis_server  # only for its install and CI check: this test stops and starts a Redis of its own
    server = RedisServer(tmp_path / "redis")  # persistent (AOF): a restart keeps what was written
    await server.astart()
    prefix = f"kvw{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    cfg = in_process(tmp_path, [("a", live, rep)], sink(server.url, prefix), state={"load_timeout": "30s"})
    client = aioredis.Redis.from_url(server.url)
    try:
        async with CacheEngine(live, rep, seed=11) as engine:
            first = Bridge(cfg)
            await first.start()
            try:
                await engine.wait_subscribed()
                await engine.step(20)
                await settled(client, prefix, engine, "a")
            finally:
                await first.stop()
            await server.astop()
            await client.aclose()

            second = Bridge(cfg)
            starting = asyncio.create_task(second.start())
            await asyncio.sleep(3)  # the bridge meets no Redis for 3 s
            assert not starting.done()  # waiting for the sink, not started afresh
            await server.astart()
            await asyncio.wait_for(starting, 30)
            client = aioredis.Redis.from_url(server.url)
            try:
                rebuilt = second.metrics.registry.get_sample_value("kv_bridge_state_rebuilds_total", {"outcome": "rebuilt"})
                assert rebuilt == 1
                await engine.wait_subscribed()
                await engine.step(10)
                await settled(client, prefix, engine, "a")
                check(await bootstrapped(client, prefix, "a"), engine)  # complete, and equal to the engine's cache
            finally:
                await second.stop()
                await remove_keys(client, prefix)
    finally:
        await client.aclose()
        await server.astop()


async def test_sigterm_while_start_up_waits_for_a_state_sink_stops_at_once(tmp_path: Path, redis_server: RedisServer) -> None:
    """While start-up waits for its state sink (up to ``state.load_timeout``, here 60 s), /healthz
    answers and /readyz says what it waits for. Kubernetes stops such a pod: SIGTERM stops it at
    once, exit 0, the checkpoint file as it was (nothing was read). Before, the bridge waited out
    the bound first (breaker29f: ~53 s), and Kubernetes killed it at its grace period."""
    del redis_server  # only for its install and CI check: the sink's port has no server
    prefix = f"kvw{uuid.uuid4().hex[:8]}"
    checkpoint = tmp_path / "checkpoint.json"
    cfg = bridge_config(
        tmp_path,
        [{"name": "a", "endpoint": f"tcp://127.0.0.1:{free_port()}"}],
        [sink(f"redis://127.0.0.1:{free_port()}/0", prefix)],
        state={"load_timeout": "60s"},
        checkpoint={"path": str(checkpoint)},
    )
    bridge = BridgeProcess(tmp_path, cfg).start()
    try:
        deadline = time.monotonic() + 30
        while "retrying until its bound" not in bridge.log():
            assert bridge.alive() and time.monotonic() < deadline, bridge.log()[-2000:]
            await asyncio.sleep(0.05)
        # Meanwhile the pod is alive (the chart's startup and liveness probes pass) and says what
        # it waits for; before, nothing listened until the sink answered or the bound passed.
        assert bridge.metrics_port is not None
        assert (await http_get(bridge.metrics_port, "/healthz"))[0] == 200
        status, body = await http_get(bridge.metrics_port, "/readyz")
        assert status == 503
        assert json.loads(body)["not_ready"] == "starting: connecting to the sinks read before any stream starts: out", body
        assert await bridge.terminate(timeout=20) == 0, bridge.log()[-2000:]
    finally:
        if bridge.alive():
            bridge.kill()
    assert "stopped during start-up" in bridge.log()
    assert not checkpoint.exists()
