"""Real Kafka, Redis, NATS and Prometheus servers on loopback for the integration tests.

Each server is installed when missing (Debian packages, Kafka jars from Maven Central, nats-server
built with ``go install`` as a fallback), started as a detached process on free 127.0.0.1 ports,
health-checked with a real protocol request, and stopped or restarted on the same ports with the
same data. Servers started by ``python -m tests.infra start`` are recorded in a state file so a
later pytest run reuses them.

Downloads are cached under ``$KVB_CACHE_DIR`` (default ``~/.cache/kv-event-bridge``); logs, data
directories and the state file live under ``$KVB_RUN_DIR`` (default
``/tmp/kv-event-bridge-servers``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, Self, TypeVar

LOOPBACK = "127.0.0.1"
DEFAULT_KAFKA_VERSION = "4.4.0"
KAFKA_POM = Path(__file__).with_name("kafka-pom.xml")
NATS_MODULE = "github.com/nats-io/nats-server/v2"
# JetStream arrived in nats-server 2.2; anything older is replaced by a `go install` build.
NATS_MIN_VERSION = (2, 2, 0)
LOG_TAIL_LINES = 40
POLL_INTERVAL = 0.2

T = TypeVar("T")


class ServerError(RuntimeError):
    """A test server could not be installed, started, checked or stopped.

    The message names the server and, when there is one, its log file with its last lines.
    """

    def __init__(self, server: str, message: str, log_path: Path | None = None) -> None:
        self.server = server
        self.log_path = log_path
        text = f"{server}: {message}"
        if log_path is not None:
            text += f"\n  log: {log_path}\n{_log_tail(log_path)}"
        super().__init__(text)


class InstallError(ServerError):
    """A server's software is missing and could not be installed."""


# ---------------------------------------------------------------------------------------------
# Places and small process tools


def cache_dir() -> Path:
    """Where downloads and builds are kept between runs (``$KVB_CACHE_DIR``)."""
    env = os.environ.get("KVB_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kv-event-bridge"


def run_dir() -> Path:
    """Where logs, data directories and the state file live (``$KVB_RUN_DIR``)."""
    return Path(os.environ.get("KVB_RUN_DIR") or "/tmp/kv-event-bridge-servers")


def kafka_version() -> str:
    """The Kafka version to run (``$KVB_KAFKA_VERSION``, default the one the pom pins)."""
    return os.environ.get("KVB_KAFKA_VERSION") or DEFAULT_KAFKA_VERSION


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that nothing listens on right now, outside the kernel's ephemeral range.

    Not a port the kernel would pick (bind to 0): outgoing connections take their local port from
    that range, so a port a test closes and binds again (an engine or a server restarting) could
    be taken meanwhile, even by a client reconnecting to it (a TCP self-connect to 127.0.0.1)."""
    low, high = _ephemeral_range()
    span = (10000, low - 1) if low - 10000 >= 5000 else (high + 1, 65000)
    rng = random.Random()
    for _ in range(500):
        port = rng.randint(*span)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        reserve_ports([port])
        return port
    raise RuntimeError(f"no free TCP port in {span[0]}-{span[1]}")


# Ports free_port returned in this process. A test often picks several ports before it binds any
# (an engine's, its replay socket's, a server's), and each is free when picked: without this, two
# picks could return the same port and the second bind fail with "Address already in use".
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def reserve_ports(ports: Iterable[int]) -> None:
    """Never hand these ports out again in this process."""
    with _handed_out_lock:
        _handed_out.update(ports)


def port_reserved(port: int) -> bool:
    """Whether free_port already handed this port out in this process."""
    return port in _handed_out


def env_port(var: str) -> int | None:
    """A fixed port from the environment, or None to pick a free one."""
    value = os.environ.get(var)
    return int(value) if value else None


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to host:port is accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int | None, marker: str | None = None) -> bool:
    """Whether pid runs (zombies count as dead) and, given a marker, has it in its command line.

    The marker (the server's work directory) guards against a recycled pid.
    """
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    # The state letter follows the parenthesised command name, which may itself hold spaces.
    state = stat.rsplit(")", 1)[-1].split()[0]
    if state in ("Z", "X"):
        return False
    return marker is None or marker in cmdline


def pids_with_marker(marker: str) -> list[int]:
    """Live processes whose command line contains marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and pid_alive(int(entry.name), marker):
            found.append(int(entry.name))
    return found


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode(errors="replace")
    except OSError as exc:
        return f"  (log unreadable: {exc})"
    tail = text.splitlines()[-lines:]
    return "\n".join(f"  | {line}" for line in tail) if tail else "  (log is empty)"


def spawn(argv: Sequence[str], log_path: Path, cwd: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start argv in a session of its own (no terminal signals), output appended to log_path.

    The server outlives this process when left running (``python -m tests.infra start``); later
    processes handle it by pid alone. While this process lives, stop() reaps it through the Popen.
    """
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


# Popen objects of servers this process started and left running: kept referenced so that they
# are not collected (and warn) while the server runs.
_children: list[subprocess.Popen[bytes]] = []


def run_async(factory: Callable[[], Awaitable[T]], timeout: float) -> T:
    """Run a coroutine on a private event loop in a worker thread and return its result.

    Works from plain code and from inside a running loop alike (the caller's loop is blocked for
    the duration, so async callers should go through ``asyncio.to_thread``).
    """
    result: list[T] = []
    error: list[BaseException] = []

    async def bounded() -> T:
        return await asyncio.wait_for(factory(), timeout)

    def target() -> None:
        try:
            result.append(asyncio.run(bounded()))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="kvb-infra-probe", daemon=True)
    thread.start()
    thread.join(timeout + 10)
    if thread.is_alive():
        raise TimeoutError(f"probe did not finish within {timeout + 10:.0f}s")
    if error:
        raise error[0]
    return result[0]


def _run(argv: Sequence[str], *, timeout: float, what: str, server: str, **kw: Any) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        raise InstallError(server, f"{what} timed out after {timeout:.0f}s: {' '.join(argv)}") from exc
    except OSError as exc:
        raise InstallError(server, f"{what} could not run: {exc}") from exc
    if out.returncode != 0:
        detail = (out.stdout + out.stderr).strip()[-4000:]
        raise InstallError(server, f"{what} failed (exit {out.returncode}): {' '.join(argv)}\n{detail}")
    return str(out.stdout)


# ---------------------------------------------------------------------------------------------
# Installation


_apt_lock = threading.Lock()
_apt_updated = False


def ensure_apt_package(binary: str, package: str, *, server: str) -> str:
    """Path of binary, installing Debian package when it is missing and we are root."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0:
        raise InstallError(server, f"{binary} not found and not root: run `apt-get install {package}`")
    if not shutil.which("apt-get"):
        raise InstallError(server, f"{binary} not found and there is no apt-get to install {package}")
    global _apt_updated
    with _apt_lock:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "-o", "Acquire::Retries=3"]
        if not _apt_updated:
            _run([*apt, "update"], timeout=600, what="apt-get update", server=server, env=env)
            _apt_updated = True
        with _no_service_starts():
            _run(
                [*apt, "install", "-y", "--no-install-recommends", package],
                timeout=900,
                what=f"apt-get install {package}",
                server=server,
                env=env,
            )
    found = shutil.which(binary)
    if not found:
        raise InstallError(server, f"installed {package} but {binary} is still not on PATH")
    return found


@contextlib.contextmanager
def _no_service_starts() -> Iterator[None]:
    """Keep maintainer scripts from starting system services (redis, prometheus) on install.

    Our instances use their own ports and data directories; a stray service on 6379 or 9090
    would only waste memory. policy-rc.d exiting 101 is Debian's documented switch for this.
    """
    policy = Path("/usr/sbin/policy-rc.d")
    if policy.exists():
        yield
        return
    try:
        policy.write_text("#!/bin/sh\n# kv-event-bridge tests/infra: no service starts\nexit 101\n")
        policy.chmod(0o755)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            policy.unlink()


def _version_tuple(text: str) -> tuple[int, ...]:
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(g) for g in match.groups()) if match else (0, 0, 0)


def binary_version(binary: str, flag: str = "--version") -> str:
    """First line of `binary --version`, or a note why there is none."""
    try:
        out = subprocess.run([binary, flag], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else "unknown"


def redis_server_binary() -> str:
    return os.environ.get("KVB_REDIS_SERVER") or ensure_apt_package("redis-server", "redis-server", server="redis")


def prometheus_binary() -> str:
    return os.environ.get("KVB_PROMETHEUS") or ensure_apt_package("prometheus", "prometheus", server="prometheus")


def promtool_binary() -> str:
    """Path of promtool (shipped with Debian's prometheus package)."""
    found = shutil.which("promtool")
    if found:
        return found
    prometheus_binary()
    return ensure_apt_package("promtool", "prometheus", server="promtool")


def nats_server_binary() -> str:
    """Path of a nats-server with JetStream.

    Order: ``$KVB_NATS_SERVER``; one built earlier into the cache; the one on PATH (Debian's
    package, installed when missing) if new enough; else ``go install`` into the cache.
    """
    override = os.environ.get("KVB_NATS_SERVER")
    if override:
        return override
    cached = cache_dir() / "bin" / "nats-server"
    if cached.exists():
        return str(cached)
    try:
        path = ensure_apt_package("nats-server", "nats-server", server="nats")
    except InstallError:
        path = None
    if path and _version_tuple(binary_version(path)) >= NATS_MIN_VERSION:
        return path
    if not shutil.which("go"):
        raise InstallError("nats", "no usable nats-server (Debian package missing or too old) and no `go`")
    cached.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOBIN": str(cached.parent), "CGO_ENABLED": "0"}
    _run(["go", "install", f"{NATS_MODULE}@latest"], timeout=900, what="go install nats-server", server="nats", env=env)
    return str(cached)


def kafka_libs(version: str | None = None) -> Path:
    """Directory of the Kafka broker jars, fetched with Maven into the cache when missing."""
    version = version or kafka_version()
    libs = cache_dir() / f"kafka-{version}" / "libs"
    if (libs / ".complete").exists():
        return libs
    for tool in ("java", "mvn"):
        if not shutil.which(tool):
            raise InstallError("kafka", f"`{tool}` not found; Kafka needs Java 17+ and Maven")
    libs.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=libs.parent, prefix=".fetch-") as tmp:
        pom = Path(tmp) / "pom.xml"
        shutil.copyfile(KAFKA_POM, pom)
        out = Path(tmp) / "libs"
        _run(
            [
                "mvn",
                "-B",
                "-q",
                "-f",
                str(pom),
                f"-Dkafka.version={version}",
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={out}",
            ],
            timeout=900,
            what=f"mvn fetching kafka_2.13:{version}",
            server="kafka",
            cwd=tmp,
        )
        if not list(out.glob(f"kafka_2.13-{version}.jar")):
            raise InstallError("kafka", f"mvn ran but kafka_2.13-{version}.jar is not in {out}")
        (out / ".complete").write_text(version + "\n")
        shutil.rmtree(libs, ignore_errors=True)
        out.rename(libs)
    return libs


# ---------------------------------------------------------------------------------------------
# The server lifecycle shared by all kinds


class ManagedServer:
    """One server process on loopback: start, health check, stop, restart on the same ports.

    Subclasses provide ``install`` (idempotent, fast when already installed), ``_prepare`` (write
    configuration, initialise storage; must keep existing data), ``_command`` and
    ``check_health``. Constructor keyword arguments are recorded by ``_options`` so a server can
    be re-attached from the state file by another process.
    """

    kind: ClassVar[str]
    start_timeout: ClassVar[float] = 60.0
    stop_timeout: ClassVar[float] = 30.0
    port: int

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.host = LOOPBACK
        self.pid: int | None = None
        self.registry: StateFile | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address} pid={self.pid} dir={self.workdir}>"

    # -- hooks

    @classmethod
    def install(cls) -> None:
        """Make sure the software is present, installing it when missing."""
        raise NotImplementedError

    def _prepare(self) -> None:
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        return None

    def check_health(self, timeout: float) -> None:
        """Raise unless the server answers a real request within timeout seconds."""
        raise NotImplementedError

    def _options(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def address(self) -> str:
        raise NotImplementedError

    def listen_ports(self) -> list[int]:
        """Every port the server binds; all must be free before it starts."""
        return [self.port]

    # -- lifecycle

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.kind}.log"

    @property
    def marker(self) -> str:
        """Text in the server's command line (its config path) that tells its processes apart."""
        return f"{self.workdir}/"

    def stop_strays(self) -> list[int]:
        """Stop processes of this work dir that no record knows (left by a crashed run)."""
        strays = [pid for pid in pids_with_marker(self.marker) if pid not in (self.pid, os.getpid())]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + (self.stop_timeout if sig == signal.SIGTERM else 10)
            while any(pid_alive(pid, self.marker) for pid in strays) and time.monotonic() < deadline:
                time.sleep(0.05)
        return strays

    def is_running(self) -> bool:
        return self._alive() or self._adopt_recorded()

    def _alive(self) -> bool:
        if self._proc is not None and self._proc.pid == self.pid:
            return self._proc.poll() is None
        return pid_alive(self.pid, self.marker)

    def _adopt_recorded(self) -> bool:
        """Follow a shared server that another process restarted (new pid in the state file)."""
        if self.registry is None:
            return False
        entry = self.registry.entry(self.kind)
        if not entry or entry.get("workdir") != str(self.workdir) or entry.get("pid") == self.pid:
            return False
        if not pid_alive(entry.get("pid"), self.marker):
            return False
        self._forget_process()
        self.pid = entry["pid"]
        return True

    def error(self, message: str) -> ServerError:
        return ServerError(self.kind, message, self.log_path)

    def start(self, timeout: float | None = None) -> Self:
        """Start (no-op when running) and return once healthy; on failure stop it and raise."""
        if self.registry is None:
            return self._start(timeout)
        # A shared server may be handled by several processes at once (CLI, pytest runs).
        with self.registry.lock(f"start-{self.kind}"):
            return self._start(timeout)

    def _start(self, timeout: float | None) -> Self:
        if self.is_running():
            return self
        timeout = self.start_timeout if timeout is None else timeout
        type(self).install()
        busy = [port for port in self.listen_ports() if port_open(self.host, port, 0.5)]
        if busy:
            # Refuse: a health check would pass against whatever holds the port.
            raise self.error(f"port(s) {busy} already accept connections; another process holds them")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._prepare()
        self._log_marker("start")
        try:
            self._proc = spawn(self._command(), self.log_path, self.workdir, self._env())
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise self.error(f"could not be launched: {exc}") from exc
        self.pid = self._proc.pid
        _children.append(self._proc)
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.kill()
            raise
        if self.registry is not None:
            self.registry.record(self)
        return self

    def wait_healthy(self, timeout: float) -> None:
        """Poll check_health until it passes; raise if the process dies or time runs out."""
        started = time.monotonic()
        deadline = started + timeout
        last: BaseException | None = None
        while True:
            if not self._alive():
                code = self._proc.returncode if self._proc is not None else None
                status = f"exit status {code}" if code is not None else "exit status unknown"
                raise self.error(f"process {self.pid} exited while starting ({status}; last check: {last!r})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.error(f"not healthy after {timeout:.0f}s at {self.address}; last check: {last!r}")
            try:
                self.check_health(min(remaining, 10.0))
            except Exception as exc:
                last = exc
            else:
                if self._alive():
                    return
            time.sleep(POLL_INTERVAL)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM and wait for exit (SIGKILL after timeout). Data directories are kept."""
        if not self.is_running():
            self._forget_process()
            return
        timeout = self.stop_timeout if timeout is None else timeout
        self._log_marker("stop")
        self._signal(signal.SIGTERM)
        if not self._wait_exit(timeout):
            self._signal(signal.SIGKILL)
            if not self._wait_exit(10):
                raise self.error(f"process {self.pid} survived SIGTERM and SIGKILL")
        self._forget_process()

    def kill(self) -> None:
        """SIGKILL, as a crash would (unflushed data may be lost)."""
        if self.is_running():
            self._signal(signal.SIGKILL)
            if not self._wait_exit(10):
                raise self.error(f"process {self.pid} survived SIGKILL")
        self._forget_process()

    def restart(self, timeout: float | None = None) -> Self:
        """Stop and start again on the same ports with the same data."""
        self.stop()
        return self.start(timeout)

    # The a* forms run the blocking call in a worker thread, so the caller's event loop (and
    # the client under test in it) keeps running meanwhile. They use the default timeouts.

    async def astart(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    async def akill(self) -> None:
        await asyncio.to_thread(self.kill)

    async def arestart(self) -> Self:
        return await asyncio.to_thread(self.restart)

    def remove(self) -> None:
        """Stop and delete the work directory (logs and data)."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _forget_process(self) -> None:
        if self._proc is not None:
            self._proc.poll()
            if self._proc in _children:
                _children.remove(self._proc)
        self._proc = None
        self.pid = None

    def _signal(self, sig: signal.Signals) -> None:
        assert self.pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _log_marker(self, what: str) -> None:
        with contextlib.suppress(OSError), self.log_path.open("a") as fh:
            fh.write(f"\n===== kv-event-bridge tests/infra: {what} {self.kind} at {time.ctime()} =====\n")

    # -- state file

    def to_state(self) -> dict[str, Any]:
        return {"kind": self.kind, "workdir": str(self.workdir), "pid": self.pid, "options": self._options()}

    @classmethod
    def from_state(cls, entry: Mapping[str, Any]) -> ManagedServer:
        server_cls = SERVER_KINDS[entry["kind"]]
        server = server_cls(Path(entry["workdir"]), **entry["options"])
        server.pid = entry.get("pid")
        return server


# ---------------------------------------------------------------------------------------------
# Kafka


class KafkaServer(ManagedServer):
    """Single-node Apache Kafka in KRaft mode (combined broker and controller).

    ``extra_properties`` are merged last into server.properties, and ``listeners`` (name ->
    protocol) may add listeners beyond PLAINTEXT, e.g. ``{"SASL_SSL": "SASL_SSL"}`` together
    with the matching ``extra_properties``; each extra listener gets a free port in ``ports``.
    ``storage_args`` are added to the storage format command run before the first start, e.g.
    ``["--add-scram", "SCRAM-SHA-512=[name=u,password=p]"]`` (KRaft keeps SCRAM users in metadata).
    """

    kind = "kafka"
    start_timeout = 120.0

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        controller_port: int | None = None,
        version: str | None = None,
        heap: str = "512m",
        listeners: Mapping[str, str] | None = None,
        ports: Mapping[str, int] | None = None,
        extra_properties: Mapping[str, str] | None = None,
        storage_args: Sequence[str] = (),
    ) -> None:
        super().__init__(workdir)
        self.port = port or free_port()
        self.controller_port = controller_port or free_port()
        self.storage_args = list(storage_args)
        self.version = version or kafka_version()
        self.heap = heap
        self.listeners = dict(listeners or {})
        self.ports = {name: (ports or {}).get(name) or free_port() for name in self.listeners}
        self.extra_properties = dict(extra_properties or {})

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return self.bootstrap_servers

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    def listen_ports(self) -> list[int]:
        return [self.port, self.controller_port, *self.ports.values()]

    @classmethod
    def install(cls) -> None:
        if not shutil.which("java"):
            raise InstallError("kafka", "`java` not found; Kafka 4 needs Java 17+")
        kafka_libs()

    def properties(self) -> dict[str, str]:
        listeners = [f"PLAINTEXT://{self.host}:{self.port}", f"CONTROLLER://{self.host}:{self.controller_port}"]
        listeners += [f"{name}://{self.host}:{port}" for name, port in self.ports.items()]
        advertised = [f"PLAINTEXT://{self.host}:{self.port}"]
        advertised += [f"{name}://{self.host}:{port}" for name, port in self.ports.items()]
        protocols = {"PLAINTEXT": "PLAINTEXT", "CONTROLLER": "PLAINTEXT", **self.listeners}
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": ",".join(f"{k}:{v}" for k, v in protocols.items()),
            "controller.quorum.bootstrap.servers": f"{self.host}:{self.controller_port}",
            "log.dirs": str(self.data_dir),
            "auto.create.topics.enable": "true",
            "num.partitions": "1",
            "default.replication.factor": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
        }
        props.update(self.extra_properties)
        return props

    def _prepare(self) -> None:
        libs = kafka_libs(self.version)
        props = "".join(f"{k}={v}\n" for k, v in self.properties().items())
        (self.workdir / "server.properties").write_text(props)
        (self.workdir / "log4j2.properties").write_text(_KAFKA_LOG4J)
        if (self.data_dir / "meta.properties").exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Base64 may start with "-", which the storage tool's argument parser takes for an option
        # (1 start in 64 failed with "--cluster-id: expected one argument"): draw until it doesn't.
        cluster_id = "-"
        while cluster_id.startswith("-"):
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        argv = [
            *self._java(libs),
            "kafka.tools.StorageTool",
            "format",
            "--config",
            str(self.workdir / "server.properties"),
            "--cluster-id",
            cluster_id,
            "--standalone",
            *self.storage_args,
        ]
        self._log_marker("format storage of")
        with self.log_path.open("a") as log:
            try:
                code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=120, cwd=self.workdir).returncode
            except subprocess.TimeoutExpired as exc:
                raise self.error("storage format timed out") from exc
        if code != 0:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            raise self.error(f"kafka.tools.StorageTool format failed (exit {code})")

    def _java(self, libs: Path) -> list[str]:
        heap = os.environ.get("KVB_KAFKA_HEAP_OPTS", f"-Xms128m -Xmx{self.heap}").split()
        return [
            "java",
            *heap,
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.workdir / 'log4j2.properties'}",
            # a marker so pid_alive can tell this JVM from a recycled pid
            f"-Dkvb.workdir={self.workdir}",
            "-cp",
            f"{libs}/*",
        ]

    def _command(self) -> list[str]:
        return [*self._java(kafka_libs(self.version)), "kafka.Kafka", str(self.workdir / "server.properties")]

    def _options(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "controller_port": self.controller_port,
            "version": self.version,
            "heap": self.heap,
            "listeners": self.listeners,
            "ports": self.ports,
            "extra_properties": self.extra_properties,
            "storage_args": self.storage_args,
        }

    def check_health(self, timeout: float) -> None:
        if not port_open(self.host, self.port, timeout):
            raise ConnectionRefusedError(f"nothing accepts on {self.bootstrap_servers}")
        info = run_async(self._describe_cluster, timeout)
        if not info.get("brokers"):
            raise RuntimeError(f"metadata lists no brokers: {info}")

    async def _describe_cluster(self) -> dict[str, Any]:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000)
        try:
            await admin.start()
            info: dict[str, Any] = await admin.describe_cluster()
            # Metadata answers before the broker is unfenced; a topic can be placed only after.
            response = await admin.create_topics(
                [NewTopic("kvb-readiness-probe", num_partitions=1, replication_factor=1)], validate_only=True
            )
            for entry in response.topic_errors:
                if entry[1] != 0:
                    raise RuntimeError(f"broker cannot place a topic yet: {entry}")
            return info
        finally:
            await admin.close()

    def new_topic(
        self, partitions: int = 1, *, name: str | None = None, config: Mapping[str, str] | None = None, timeout: float = 30.0
    ) -> str:
        """Create a topic with a unique name (or the given one) and wait until it has leaders."""
        topic = name or f"kvb-test-{uuid.uuid4().hex[:12]}"
        run_async(lambda: self._create_topic(topic, partitions, dict(config or {}), timeout), timeout)
        return topic

    async def anew_topic(self, partitions: int = 1, *, name: str | None = None, config: Mapping[str, str] | None = None) -> str:
        """new_topic() from async code."""
        return await asyncio.to_thread(self.new_topic, partitions, name=name, config=config)

    async def topic_configs(self, topic: str) -> dict[str, str]:
        """DescribeConfigs: every config of ``topic`` as the broker applies it."""
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=10000)
        await admin.start()
        try:
            responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        finally:
            await admin.close()
        return {entry[0]: entry[1] for r in responses for res in r.resources for entry in res[4]}

    async def set_topic_configs(self, topic: str, configs: Mapping[str, str], timeout: float = 30.0) -> None:
        """AlterConfigs: ``topic``'s configs become ``configs`` (the others the broker's defaults).

        Returns once the broker describes them. The controller answers AlterConfigs when the change
        is in the metadata log; the broker applies it when it reads it back, a moment later, and a
        write in between still meets the old configs."""
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=10000)
        await admin.start()
        try:
            await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, dict(configs))])
        finally:
            await admin.close()
        deadline = time.monotonic() + timeout
        while True:
            described = await self.topic_configs(topic)
            if all(described.get(key) == value for key, value in configs.items()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"kafka: topic {topic!r}: {dict(configs)} not applied after {timeout:.0f}s: {described}")
            await asyncio.sleep(POLL_INTERVAL)

    async def _create_topic(self, topic: str, partitions: int, config: dict[str, str], wait: float) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        # Retried until the deadline: the broker may be restarting (this test's or another's).
        deadline = time.monotonic() + wait
        created = False
        last: BaseException | None = None
        while time.monotonic() < deadline:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, request_timeout_ms=10000)
            try:
                await admin.start()
                if not created:
                    response = await admin.create_topics(
                        [NewTopic(topic, num_partitions=partitions, replication_factor=1, topic_configs=config)]
                    )
                    code = response.topic_errors[0][1]
                    if code == 36 and last is None:  # TOPIC_ALREADY_EXISTS on the first try: a name clash
                        raise ValueError(f"kafka: topic {topic!r} already exists")
                    if code not in (0, 36):
                        raise RuntimeError(f"creating topic {topic!r} failed: {response.topic_errors[0]}")
                    created = True
                described = await admin.describe_topics([topic])
                parts = described[0]["partitions"] if described else []
                if len(parts) == partitions and all(p["leader"] >= 0 for p in parts):
                    return
                last = RuntimeError(f"topic {topic!r} has no leaders yet: {parts}")
            except ValueError:
                raise
            except Exception as exc:
                last = exc
            finally:
                await admin.close()
            await asyncio.sleep(POLL_INTERVAL)
        raise TimeoutError(f"kafka: topic {topic!r} not ready after {wait:.0f}s: {last!r}")


_KAFKA_LOG4J = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
# the full config dumps drown everything else
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
"""


# ---------------------------------------------------------------------------------------------
# Redis


class RedisServer(ManagedServer):
    """redis-server with its own config file.

    With ``persistent`` (the default) the append-only file is on (fsync every second), so a
    ``restart()`` keeps the data; ``kill()`` may lose the last second. ``extra_config`` lines are
    appended to redis.conf (later: ``tls-port``, ``aclfile``, ...). ``password`` sets
    ``requirepass`` (the health check and ``flushall()`` authenticate with it).
    """

    kind = "redis"
    start_timeout = 30.0

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        persistent: bool = True,
        extra_config: Mapping[str, str] | None = None,
        password: str | None = None,
    ) -> None:
        super().__init__(workdir)
        self.port = port or free_port()
        self.persistent = persistent
        self.extra_config = dict(extra_config or {})
        self.password = password

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        return self.url

    @classmethod
    def install(cls) -> None:
        redis_server_binary()

    def _prepare(self) -> None:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        conf = {
            "port": str(self.port),
            "bind": self.host,
            "protected-mode": "no",
            "daemonize": "no",
            "dir": str(data),
            "save": '""',
            "appendonly": "yes" if self.persistent else "no",
            "appendfsync": "everysec",
            "logfile": '""',
            # keep argv (with our work dir) in /proc/PID/cmdline, which pid_alive checks
            "set-proc-title": "no",
            **({"requirepass": self.password} if self.password else {}),
            **self.extra_config,
        }
        (self.workdir / "redis.conf").write_text("".join(f"{k} {v}\n" for k, v in conf.items()))

    def _command(self) -> list[str]:
        return [redis_server_binary(), str(self.workdir / "redis.conf")]

    def _options(self) -> dict[str, Any]:
        return {"port": self.port, "persistent": self.persistent, "extra_config": self.extra_config, "password": self.password}

    def check_health(self, timeout: float) -> None:
        import redis

        with redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_timeout=timeout, socket_connect_timeout=timeout
        ) as client:
            if not client.ping():
                raise RuntimeError("PING did not answer PONG")

    def flushall(self) -> None:
        """Delete every key (between tests)."""
        import redis

        with redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=10) as client:
            client.flushall()


# ---------------------------------------------------------------------------------------------
# NATS


class NatsServer(ManagedServer):
    """nats-server with JetStream, its store under the work directory (kept across restarts).

    ``extra_config`` is raw nats-server configuration appended to the file (``tls {}``,
    ``authorization {}``); ``client`` gives the health check what such a server wants
    (``user``, ``password``, ``token``, ``ca_file``).
    """

    kind = "nats"
    start_timeout = 30.0

    def __init__(
        self, workdir: Path, *, port: int | None = None, extra_config: str = "", client: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(workdir)
        self.port = port or free_port()
        self.extra_config = extra_config
        self.client = dict(client or {})

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return self.url

    @property
    def store_dir(self) -> Path:
        return self.workdir / "jetstream"

    @classmethod
    def install(cls) -> None:
        nats_server_binary()

    def _prepare(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = (
            f"server_name: kvb_test_{self.port}\n"
            f"host: {self.host}\n"
            f"port: {self.port}\n"
            "jetstream {\n"
            f"  store_dir: {json.dumps(str(self.store_dir))}\n"
            "  max_memory_store: 268435456\n"
            "  max_file_store: 4294967296\n"
            "}\n"
            f"{self.extra_config}\n"
        )
        (self.workdir / "nats.conf").write_text(conf)

    def _command(self) -> list[str]:
        return [nats_server_binary(), "-c", str(self.workdir / "nats.conf")]

    def _options(self) -> dict[str, Any]:
        return {"port": self.port, "extra_config": self.extra_config, "client": self.client}

    def check_health(self, timeout: float) -> None:
        if not port_open(self.host, self.port, timeout):
            raise ConnectionRefusedError(f"nothing accepts on {self.url}")
        run_async(lambda: self._account_info(timeout), timeout)

    async def _account_info(self, wait: float) -> None:
        import nats

        async def quiet(_exc: Exception) -> None:
            return None

        auth: dict[str, Any] = {k: v for k, v in self.client.items() if k in ("user", "password", "token")}
        if "ca_file" in self.client:
            import ssl

            auth["tls"] = ssl.create_default_context(cafile=self.client["ca_file"])
        nc = await nats.connect(
            self.url, connect_timeout=wait, allow_reconnect=False, max_reconnect_attempts=0, error_cb=quiet, **auth
        )
        try:
            await nc.jetstream(timeout=wait).account_info()
        finally:
            await nc.close()


# ---------------------------------------------------------------------------------------------
# Prometheus


class PrometheusServer(ManagedServer):
    """Prometheus scraping static targets every ``scrape_interval``, storage in the work dir.

    Started with ``--web.enable-lifecycle`` so ``configure()`` can change targets by a reload.
    With no targets it scrapes itself.
    """

    kind = "prometheus"
    start_timeout = 60.0

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        targets: Sequence[str] = (),
        job: str = "kvb",
        scrape_interval: str = "1s",
        rule_files: Sequence[str] = (),
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(workdir)
        self.port = port or free_port()
        self.targets = list(targets)
        self.job = job
        self.scrape_interval = scrape_interval
        self.rule_files = list(rule_files)
        self.extra_args = list(extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return self.url

    @classmethod
    def install(cls) -> None:
        prometheus_binary()

    def config(self) -> dict[str, Any]:
        targets = self.targets or [f"{self.host}:{self.port}"]
        return {
            "global": {
                "scrape_interval": self.scrape_interval,
                "scrape_timeout": self.scrape_interval,
                "evaluation_interval": self.scrape_interval,
            },
            "rule_files": self.rule_files,
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": targets}]}],
        }

    def _prepare(self) -> None:
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        # JSON is YAML, and needs no YAML writer here
        (self.workdir / "prometheus.yml").write_text(json.dumps(self.config(), indent=2))

    def _command(self) -> list[str]:
        return [
            prometheus_binary(),
            f"--config.file={self.workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address={self.host}:{self.port}",
            "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1d",
            *self.extra_args,
        ]

    def _options(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "targets": self.targets,
            "job": self.job,
            "scrape_interval": self.scrape_interval,
            "rule_files": self.rule_files,
            "extra_args": self.extra_args,
        }

    def check_health(self, timeout: float) -> None:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=timeout) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"/-/ready answered {resp.status}")
        except urllib.error.HTTPError as exc:  # (503 while starting: closed here, or its socket is
            exc.close()  # left to the garbage collector, whose ResourceWarning fails a later test)
            raise RuntimeError(f"/-/ready answered {exc.code}") from None

    def configure(
        self, targets: Sequence[str], *, job: str | None = None, scrape_interval: str | None = None, timeout: float = 30.0
    ) -> None:
        """Change the scrape targets of the running server (config rewrite and /-/reload)."""
        self.targets = list(targets)
        self.job = job or self.job
        self.scrape_interval = scrape_interval or self.scrape_interval
        self._prepare()
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                pass
        except urllib.error.HTTPError as exc:
            raise self.error(f"reload rejected: {exc.read().decode(errors='replace')}") from exc
        if self.registry is not None:
            self.registry.record(self)

    def query(self, expr: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Instant query over the HTTP API; returns ``data.result``."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise self.error(f"query {expr!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(
        self, expr: str, *, within: float = 30.0, predicate: Callable[[list[dict[str, Any]]], bool] = bool
    ) -> list[dict[str, Any]]:
        """Poll an instant query until predicate(result) holds (default: non-empty)."""
        deadline = time.monotonic() + within
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise self.error(f"{expr!r} did not hold within {within:.0f}s; last result {result}")
            time.sleep(POLL_INTERVAL * 2)

    async def aquery(self, expr: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.query, expr)

    async def await_for(
        self, expr: str, *, within: float = 30.0, predicate: Callable[[list[dict[str, Any]]], bool] = bool
    ) -> list[dict[str, Any]]:
        """wait_for() from async code (the loop keeps running, e.g. to serve the target)."""
        return await asyncio.to_thread(lambda: self.wait_for(expr, within=within, predicate=predicate))


class PrometheusFactory(Protocol):
    """What the ``prometheus_factory`` fixture returns: start a Prometheus scraping targets."""

    def __call__(
        self,
        targets: Sequence[str],
        *,
        job: str = ...,
        scrape_interval: str = ...,
        rule_files: Sequence[str] = ...,
    ) -> PrometheusServer: ...


SERVER_KINDS: dict[str, type[ManagedServer]] = {cls.kind: cls for cls in (KafkaServer, RedisServer, NatsServer, PrometheusServer)}

_PORT_ENV = {
    "kafka": "KVB_KAFKA_PORT",
    "redis": "KVB_REDIS_PORT",
    "nats": "KVB_NATS_PORT",
    "prometheus": "KVB_PROMETHEUS_PORT",
}


def create(kind: str, workdir: Path, **options: Any) -> ManagedServer:
    """A server of the given kind, on the port fixed by ``KVB_<KIND>_PORT`` if set."""
    options.setdefault("port", env_port(_PORT_ENV[kind]))
    if kind == "kafka":
        options.setdefault("controller_port", env_port("KVB_KAFKA_CONTROLLER_PORT"))
    return SERVER_KINDS[kind](workdir, **options)


def versions() -> dict[str, str]:
    """What is installed, for reports (does not install anything)."""
    found: dict[str, str] = {}
    libs = cache_dir() / f"kafka-{kafka_version()}" / "libs"
    found["kafka"] = f"{kafka_version()} ({libs})" if (libs / ".complete").exists() else "not fetched"
    for kind, binary in (("redis", "redis-server"), ("prometheus", "prometheus"), ("promtool", "promtool")):
        path = shutil.which(binary)
        found[kind] = f"{binary_version(path)} ({path})" if path else "not installed"
    cached = cache_dir() / "bin" / "nats-server"
    nats_path = os.environ.get("KVB_NATS_SERVER") or (str(cached) if cached.exists() else shutil.which("nats-server"))
    found["nats"] = f"{binary_version(nats_path)} ({nats_path})" if nats_path else "not installed"
    java = shutil.which("java")
    found["java"] = binary_version(java, "-version") if java else "not installed"
    return found


# ---------------------------------------------------------------------------------------------
# State file: servers left running for later runs


class StateFile:
    """JSON record of the servers started by the CLI, shared by later CLI and pytest runs."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or run_dir() / "state.json"

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An exclusive lock between processes, held for the block (flock, freed on exit)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with (self.path.parent / f"{name}.lock").open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        with self.lock("state"):
            try:
                data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
            except (OSError, ValueError):
                data = {}
            before = json.dumps(data, sort_keys=True)
            yield data
            if json.dumps(data, sort_keys=True) != before:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
                tmp.replace(self.path)

    def servers(self) -> dict[str, ManagedServer]:
        """Every recorded server (running or not), attached to this state file."""
        with self._locked() as data:
            entries = dict(data)
        found: dict[str, ManagedServer] = {}
        for kind, entry in entries.items():
            try:
                server = ManagedServer.from_state(entry)
            except (KeyError, TypeError, ValueError):
                continue
            server.registry = self
            found[kind] = server
        return found

    def running(self, kind: str, health_timeout: float = 5.0) -> ManagedServer | None:
        """The recorded server of this kind if its process runs and answers, else None."""
        server = self.servers().get(kind)
        if server is None or not server.is_running():
            return None
        try:
            server.check_health(health_timeout)
        except Exception:
            return None
        return server

    def entry(self, kind: str) -> dict[str, Any] | None:
        with self._locked() as data:
            found: dict[str, Any] | None = data.get(kind)
            return found

    def record(self, server: ManagedServer) -> None:
        with self._locked() as data:
            data[server.kind] = server.to_state()

    def forget(self, kind: str) -> None:
        with self._locked() as data:
            data.pop(kind, None)
