"""Fixtures that give integration tests real servers on loopback (see tests/infra/README.md).

Session fixtures reuse a server left running by ``python -m tests.infra start`` when the state
file names a healthy one (unless ``KVB_REUSE_SERVERS=0``), and otherwise install what is missing,
start their own on free ports and remove it at the end of the session. A server that cannot be
installed or started skips the test, or fails it when ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest

from tests.infra.servers import (
    KafkaServer,
    ManagedServer,
    NatsServer,
    PrometheusFactory,
    PrometheusServer,
    RedisServer,
    ServerError,
    StateFile,
    create,
    promtool_binary,
    run_dir,
)

S = TypeVar("S", bound=ManagedServer)

# Session servers handed out so far; after each test any of them left stopped is started again,
# so a test that stops a broker and then fails does not take the rest of the session with it.
_session_servers: list[ManagedServer] = []


def unavailable(what: str, exc: BaseException | str) -> NoReturn:
    """Skip the test for a missing server, or fail it under CI (CI=true)."""
    reason = f"{what} unavailable: {exc}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def infra_run_dir() -> Iterator[Path]:
    """A directory of this session's own servers (logs, data), removed at the end."""
    base = run_dir()
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"pytest-{os.getpid()}-", dir=base))
    yield path
    if os.environ.get("KVB_KEEP_RUN_DIR") != "1":
        shutil.rmtree(path, ignore_errors=True)


def _start(server: ManagedServer) -> ServerError | None:
    try:
        server.start()
    except ServerError as exc:
        return exc
    return None


def _session_server(kind: str, cls: type[S], workdir: Path) -> Iterator[S]:
    if os.environ.get("KVB_REUSE_SERVERS", "1") != "0":
        shared = StateFile().running(kind)
        if isinstance(shared, cls):
            _session_servers.append(shared)
            yield shared
            return
    server = create(kind, workdir)
    assert isinstance(server, cls)
    failure = _start(server)
    if failure is not None:
        unavailable(kind, failure)
    _session_servers.append(server)
    try:
        yield server
    finally:
        _session_servers.remove(server)
        server.remove()


@pytest.fixture(autouse=True)
def _restart_stopped_servers() -> Iterator[None]:
    yield
    for server in _session_servers:
        if not server.is_running():
            server.start()


@pytest.fixture(scope="session")
def kafka(infra_run_dir: Path) -> Iterator[KafkaServer]:
    """Single-node Kafka: ``bootstrap_servers``, ``new_topic()``/``anew_topic()``, stop/start/restart."""
    yield from _session_server("kafka", KafkaServer, infra_run_dir / "kafka")


@pytest.fixture(scope="session")
def redis_server(infra_run_dir: Path) -> Iterator[RedisServer]:
    """redis-server: ``url``, ``flushall()``, stop/start/restart (data kept across restart)."""
    yield from _session_server("redis", RedisServer, infra_run_dir / "redis")


@pytest.fixture
def fresh_redis(redis_server: RedisServer) -> RedisServer:
    """The session redis_server, emptied before the test."""
    redis_server.flushall()
    return redis_server


@pytest.fixture(scope="session")
def nats_server(infra_run_dir: Path) -> Iterator[NatsServer]:
    """nats-server with JetStream: ``url``, stop/start/restart (JetStream store kept)."""
    yield from _session_server("nats", NatsServer, infra_run_dir / "nats")


@pytest.fixture
def prometheus_factory(infra_run_dir: Path) -> Iterator[PrometheusFactory]:
    """Start a Prometheus scraping the given ``host:port`` targets; each is removed after the test.

    Returns the server: ``url``, ``query(expr)``, ``wait_for(expr)`` / ``await_for(expr)``,
    ``configure(targets)``. A fresh instance per call (it starts in well under a second), so
    tests never see each other's series.
    """
    started: list[PrometheusServer] = []

    def factory(
        targets: Sequence[str],
        *,
        job: str = "kvb",
        scrape_interval: str = "1s",
        rule_files: Sequence[str] = (),
    ) -> PrometheusServer:
        workdir = Path(tempfile.mkdtemp(prefix="prometheus-", dir=infra_run_dir))
        server = PrometheusServer(workdir, targets=targets, job=job, scrape_interval=scrape_interval, rule_files=rule_files)
        failure = _start(server)
        if failure is not None:
            unavailable("prometheus", failure)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.remove()


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool (from Debian's prometheus package)."""
    try:
        return promtool_binary()
    except ServerError as exc:
        failure = exc
    unavailable("promtool", failure)
