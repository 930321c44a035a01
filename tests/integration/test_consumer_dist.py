"""The consumer library (./consumer, distribution ``kv-event-consumer``) stands on its own.

A fresh virtual environment gets the distribution with one client extra (``[redis]``) and
nothing else: no bridge, no ``connectors``, no other broker client. The Redis example consumer
runs from it (a separate process printing its index, ``--json``) through the scenario the
in-process example consumers pass (tests/integration/test_example_consumers.py: restart, loss,
clear), and through the state bootstrap.

Wheels (redis-py, setuptools for the build) are downloaded once into the test cache
(``$KVB_CACHE_DIR/consumer-wheels``); the install itself is offline (``--no-index``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.infra.servers import RedisServer, cache_dir
from tests.integration.test_example_consumers import delete_keys, run_bootstrap_scenario, run_scenario, wait_written
from tests.support.cache_engine import CacheEngine
from tests.support.consumer_process import SnapshotIndex, follow

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "consumers" / "consume_redis.py"
NEEDS = ["redis>=5", "setuptools>=77"]  # the [redis] extra, and the build backend of ./consumer


def run(*command: str | Path, timeout: float = 300) -> str:
    """Run ``command`` outside the repository (``python -c`` would import from the working directory)."""
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, env=_clean_env(), cwd=cache_dir()
    )
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}


@pytest.fixture(scope="session")
def consumer_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Python of a fresh virtual environment holding only ``kv-event-consumer[redis]``."""
    wheels = cache_dir() / "consumer-wheels"
    if not list(wheels.glob("redis-*.whl")) or not list(wheels.glob("setuptools-*.whl")):
        run(sys.executable, "-m", "pip", "download", "--quiet", "--dest", wheels, *NEEDS)
    venv = tmp_path_factory.mktemp("consumer-venv")
    run(sys.executable, "-m", "venv", "--without-pip", venv)  # this pip installs into it (--python): faster
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python]
    run(*pip, "install", "--quiet", "--no-index", "--find-links", wheels, f"{ROOT / 'consumer'}[redis]")
    installed = run(*pip, "list", "--format", "freeze")
    names = {line.split("==")[0].lower() for line in installed.split()}
    assert "kv-event-consumer" in names and "redis" in names, installed
    assert not names & {"kv-event-bridge", "aiokafka", "nats-py", "pyzmq", "msgspec"}, installed
    return python


def test_the_library_imports_without_the_bridge(consumer_python: Path) -> None:
    probe = (
        "import importlib.util as u, kv_consumer, kv_consumer.redis;"
        "print([m for m in ('bridge', 'connectors', 'aiokafka', 'nats') if u.find_spec(m)])"
    )
    assert run(consumer_python, "-c", probe, timeout=60).strip() == "[]"


def example(python: Path, tmp: Path, *args: str) -> Callable[[Any, Callable[[], bool]], Coroutine[Any, Any, None]]:
    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        command = [str(python), str(EXAMPLE), *args, "--json", "--every", "0.05"]
        return follow(index, command, stop, tmp / "consumer.log", env={"PYTHONPATH": ""})

    return consume


async def test_the_redis_example_runs_on_the_library_alone(
    tmp_path: Path, redis_server: RedisServer, consumer_python: Path
) -> None:
    prefix = f"kvd{uuid.uuid4().hex[:8]}"
    sink = {"type": "redis", "url": redis_server.url, "stream": prefix + ":{source}:{dp_rank}"}
    consume = example(consumer_python, tmp_path, "--url", redis_server.url, "--match", prefix + ":*")
    try:
        index = await run_scenario(tmp_path, sink, consume, "batch", index=SnapshotIndex())
        assert index.lines > 0
    finally:
        await delete_keys(redis_server.url, prefix)


async def test_the_redis_example_bootstraps_on_the_library_alone(
    tmp_path: Path, redis_server: RedisServer, consumer_python: Path
) -> None:
    prefix = f"kvdb{uuid.uuid4().hex[:8]}"
    sink = {
        "type": "redis",
        "url": redis_server.url,
        "stream": prefix + ":{source}:{dp_rank}",
        "maxlen": 40,
        "state": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:state"},
    }
    client = aioredis.Redis.from_url(redis_server.url)

    async def heads_at(engines: dict[tuple[str, int], CacheEngine]) -> None:
        await wait_written(client, prefix, engines)

    consume = example(consumer_python, tmp_path, "--url", redis_server.url, "--match", prefix + ":*", "--bootstrap")
    try:
        await run_bootstrap_scenario(tmp_path, sink, consume, heads_at, index=SnapshotIndex())
    finally:
        await client.aclose()
        await delete_keys(redis_server.url, prefix)
