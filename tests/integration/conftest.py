"""Fixtures that give integration tests real servers on loopback (see tests/infra/README.md).

Session fixtures reuse a server left running by ``python -m tests.infra start`` when the state
file names a healthy one (unless ``KVB_REUSE_SERVERS=0``), and otherwise install what is missing,
start their own on free ports and remove it at the end of the session. A server that cannot be
installed or started skips the test, or fails it when ``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

import nats
import nats.aio.client
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
    free_port,
    promtool_binary,
    run_dir,
)
from tests.support import tls

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
async def reader(nats_server: NatsServer) -> AsyncIterator[nats.aio.client.Client]:
    """A plain nats-py client for reading back (and cleaning up) what a NATS connector wrote."""
    nc = await nats.connect(nats_server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    yield nc
    await nc.close()


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


# -- TLS and authentication variants (tests/integration/test_security.py) ---------------------------


@dataclass(frozen=True)
class SecureServer:
    """A server that wants TLS and a user with a password.

    ``address`` is what a sink connects to (``rediss://...``, ``nats://...`` with TLS, Kafka
    ``host:port`` of the SASL_SSL listener); ``ca`` is the CA that signed the server certificate;
    ``plain`` is an address without TLS or authentication for reading back, where the server has one.
    """

    server: ManagedServer
    address: str
    username: str
    password: str
    ca: Path
    plain: str | None = None


SECURE_USER = "bridge"


@pytest.fixture(scope="session")
def certificates(infra_run_dir: Path) -> tls.Certificates:
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate (PEM)."""
    if not tls.available():
        unavailable("openssl", "not installed")
    return tls.make_certificates(infra_run_dir / "certs")


def _secret() -> str:
    return f"pw-{uuid.uuid4().hex}"  # distinctive, so a test can search logs for it


@contextlib.contextmanager
def _own_server(what: str, server: S) -> Iterator[S]:
    """Start a server of the fixture's own; skip (or fail under CI) when it cannot start."""
    failure = _start(server)
    if failure is not None:
        server.kill()
        unavailable(what, failure)
    try:
        yield server
    finally:
        server.remove()


own_server = _own_server  # for test modules with servers of their own (a private maxmemory, requirepass)


@pytest.fixture(scope="session")
def secure_redis(infra_run_dir: Path, certificates: tls.Certificates) -> Iterator[SecureServer]:
    """redis-server with a TLS port (server certificate, no client certificate) and an ACL user.

    The default user may only PING (health checks on the plain port); everything else needs the
    ACL user, which may not run @dangerous commands (FLUSHALL, CONFIG, DEBUG, KEYS, ...).
    """
    password = _secret()
    workdir = infra_run_dir / "redis-secure"
    workdir.mkdir(parents=True, exist_ok=True)
    acl = workdir / "users.acl"
    acl.write_text(f"user default on nopass ~* -@all +ping\nuser {SECURE_USER} on >{password} ~* &* +@all -@dangerous\n")
    tls_port = free_port()
    server = RedisServer(
        workdir,
        persistent=False,
        extra_config={
            "tls-port": str(tls_port),
            "tls-cert-file": str(certificates.server_cert),
            "tls-key-file": str(certificates.server_key),
            "tls-ca-cert-file": str(certificates.ca),
            "tls-auth-clients": "no",
            "aclfile": str(acl),
        },
    )
    with _own_server("redis (TLS + ACL)", server) as started:
        yield SecureServer(started, f"rediss://127.0.0.1:{tls_port}/0", SECURE_USER, password, certificates.ca)


@pytest.fixture(scope="session")
def secure_nats(infra_run_dir: Path, certificates: tls.Certificates) -> Iterator[SecureServer]:
    """nats-server (JetStream) that wants TLS and a user with a password."""
    password = _secret()
    cert, key = json.dumps(str(certificates.server_cert)), json.dumps(str(certificates.server_key))
    config = (
        f"tls {{ cert_file: {cert}, key_file: {key} }}\n"
        f"authorization {{ user: {SECURE_USER}, password: {json.dumps(password)} }}\n"
    )
    client = {"user": SECURE_USER, "password": password, "ca_file": str(certificates.ca)}
    server = NatsServer(infra_run_dir / "nats-secure", extra_config=config, client=client)
    with _own_server("nats (TLS + user/password)", server) as started:
        yield SecureServer(started, started.url, SECURE_USER, password, certificates.ca)


def _pem_property(pem: str) -> str:
    """A PEM block as one java.util.Properties value (newlines escaped)."""
    return pem.strip().replace("\n", "\\n")


@pytest.fixture(scope="session")
def scram_kafka(infra_run_dir: Path, certificates: tls.Certificates) -> Iterator[SecureServer]:
    """Kafka with a SASL_SSL listener: TLS from PEM files, SCRAM-SHA-512 user created at format time.

    PLAINTEXT stays for the broker's own health checks and for reading back (``plain``).
    """
    password = _secret()
    listener = "listener.name.sasl_ssl."
    server = KafkaServer(
        infra_run_dir / "kafka-scram",
        listeners={"SASL_SSL": "SASL_SSL"},
        extra_properties={
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            listener + "scram-sha-512.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            listener + "ssl.keystore.type": "PEM",
            listener + "ssl.keystore.certificate.chain": _pem_property(certificates.server_chain_pem),
            listener + "ssl.keystore.key": _pem_property(certificates.server_key_pem),
            listener + "ssl.truststore.type": "PEM",
            listener + "ssl.truststore.certificates": _pem_property(certificates.ca.read_text()),
            listener + "ssl.client.auth": "none",
        },
        storage_args=["--add-scram", f"SCRAM-SHA-512=[name={SECURE_USER},password={password}]"],
    )
    with _own_server("kafka (SASL_SSL + SCRAM-SHA-512)", server) as started:
        yield SecureServer(
            started, f"127.0.0.1:{started.ports['SASL_SSL']}", SECURE_USER, password, certificates.ca, started.bootstrap_servers
        )
