"""Running the bridge safely: TLS and authentication per sink on real servers, secrets kept out of
every output, the metrics listener's bind address, and hostile engines.

- Kafka over SASL_SSL with SCRAM-SHA-512 (PEM keystore, SCRAM user created at storage format),
  Redis over TLS as an ACL user, NATS JetStream over TLS with user/password: the whole bridge
  delivers through them, with passwords from ``${VAR}``; wrong credentials leave the sink not
  ready with a reason. (The connectors' own tests cover mutual TLS, hostname checks and SASL
  PLAIN; this is the bridge end to end.)
- Secrets: the passwords appear in no log line (in-process at DEBUG, and a subprocess's stderr at
  debug), no /metrics or /readyz body, no ``--check`` output and no dead letter, with right and
  with wrong credentials.
- ``metrics.listen: 127.0.0.1:PORT`` binds loopback only.
- Hostile engines: a replay ROUTER answering garbage is counted
  (``kv_bridge_decode_failures_total{reason="bad_replay_reply"}``) and the stream goes on; a
  100 MB message is refused before it is allocated (the bridge's RSS does not grow by it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
import zmq.asyncio

from bridge.config import from_data
from bridge.runtime import Bridge
from bridge.simulator import PROFILES, EventFactory, Simulator, SimulatorOptions, encode_batch
from tests.infra.servers import KafkaServer
from tests.integration.conftest import SecureServer
from tests.support import tls
from tests.support.harness import free_port, free_ports, metric, read_lines, wait_for
from tests.support.process import ROOT, BridgeProcess, BridgeRun, bridge_config, http_get
from tests.support.readback import Readback, read_jetstream, read_kafka, read_redis

pytestmark = pytest.mark.integration

MiB = 2**20
BATCHES = 100  # per rank, two ranks
EVENTS = 3


# -- a bridge fed by a simulated engine, in process ---------------------------------------------------


def _sources(ports: list[int]) -> list[dict[str, Any]]:
    return [
        {
            "name": "sec",
            "endpoint": f"tcp://127.0.0.1:{ports[0]}",
            "replay_endpoint": f"tcp://127.0.0.1:{ports[2]}",
            "dp_ranks": 2,
        }
    ]


def _config(tmp: Path, ports: list[int], sinks: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    cfg = bridge_config(
        tmp,
        _sources(ports),
        sinks,
        # The engine publishes its batches at once, possibly before its SUB peer's subscription
        # has reached it (ZeroMQ drops those): the idle probe fetches them, in 1 s, not 30 s.
        replay={"timeout": "500ms", "initial_backoff": "50ms", "max_backoff": "500ms", "idle_probe": "1s"},
        shutdown_timeout="3s",
    )
    cfg.update(extra)
    return cfg


def _sink(type_: str, name: str, **options: Any) -> dict[str, Any]:
    return {
        "type": type_,
        "name": name,
        "format": "json",
        "granularity": "event",
        "retry": {"initial_backoff": "100ms", "max_backoff": "500ms", "write_timeout": "10s"},
        **options,
    }


def kafka_sink(k: SecureServer, topic: str, password: str = "${KAFKA_PASSWORD}", **extra: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "bootstrap_servers": k.address,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": k.username,
        "sasl_password": password,
        "tls": {"ca_file": str(k.ca)},
    }
    options.update(extra)
    return _sink("kafka", "kafka-sec", topic=topic, request_timeout="5s", **options)


def redis_sink(r: SecureServer, prefix: str, password: str = "${REDIS_PASSWORD}", **extra: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"url": r.address, "username": r.username, "password": password, "tls": {"ca_file": str(r.ca)}}
    options.update(extra)
    return _sink("redis", "redis-sec", stream=prefix + ":{source}:{dp_rank}", timeout="2s", **options)


def nats_sink(n: SecureServer, dest: str, password: str = "${NATS_PASSWORD}", **extra: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "servers": n.address,
        "user": n.username,
        "password": password,
        "tls": {"ca_file": str(n.ca)},
        "connect_timeout": "3s",
    }
    options.update(extra)
    return _sink(
        "nats",
        "nats-sec",
        subject=dest + ".{source}.{dp_rank}",
        reconnect_wait="250ms",
        stream={"create": True, "name": dest, "subjects": [f"{dest}.>"]},
        **options,
    )


@asynccontextmanager
async def running(cfg: dict[str, Any], env: dict[str, str]) -> AsyncIterator[Bridge]:
    bridge = Bridge(from_data(json.loads(json.dumps(cfg)), env=env))
    await bridge.start()
    try:
        yield bridge
    finally:
        await bridge.stop()


async def publish(ports: list[int], batches: int = BATCHES) -> dict[int, int]:
    """A simulated 2-rank engine publishing ``batches`` per rank; the bridge replays them from the
    start (replay_on_start), so no subscription race matters. Returns batches per rank."""
    opts = SimulatorOptions(
        endpoint=f"tcp://127.0.0.1:{ports[0]}",
        replay_endpoint=f"tcp://127.0.0.1:{ports[2]}",
        dp_ranks=2,
        rate=0,
        count=batches,
        events_per_batch=EVENTS,
        linger=0,
    )
    sim = Simulator(opts)
    await sim.__aenter__()
    await sim.run()
    _simulators.append(sim)
    return {r: sim.ranks[r].seq for r in range(2)}


_simulators: list[Simulator] = []


@pytest.fixture(autouse=True)
async def _close_simulators() -> AsyncIterator[None]:
    yield
    while _simulators:
        await _simulators.pop().__aexit__(None, None, None)


async def readyz(bridge: Bridge) -> tuple[int, dict[str, Any]]:
    assert bridge.health is not None
    status, body = await http_get(bridge.health.port, "/readyz")
    return status, json.loads(body)


async def wait_delivered(bridge: Bridge, sink: str, batches: int, timeout: float = 60.0) -> None:
    await wait_for(
        lambda: metric(bridge, "kv_bridge_sink_batches_total", sink=sink, outcome="delivered") >= batches,
        timeout=timeout,
        what=f"{batches} batches delivered to {sink}",
    )


def failing(bridge: Bridge, reason: str = "", sink: int = 0) -> bool:
    """Whether the bridge's ``sink``-th sink has reported an error (containing ``reason``)."""
    error = bridge.workers[sink].last_error
    return error not in (None, "not connected yet") and reason in (error or "")


async def deliver(tmp: Path, sink: dict[str, Any], env: dict[str, str]) -> tuple[list[int], dict[int, int], int]:
    """Run a bridge whose only sink is ``sink`` until what an engine published is delivered.

    Returns the engine's ports, the batches it published per rank and /readyz's status at the end.
    """
    ports = free_ports(4)
    async with running(_config(tmp, ports, [sink]), env) as bridge:
        published = await publish(ports)
        await wait_delivered(bridge, sink["name"], sum(published.values()))
        return ports, published, (await readyz(bridge))[0]


async def readyz_when_failing(
    tmp: Path, ports: list[int], sink: dict[str, Any], env: dict[str, str], reason: str = "", publish_first: int = 0
) -> tuple[int, dict[str, Any]]:
    """/readyz of a bridge whose only sink is ``sink``, once that sink has reported an error
    (containing ``reason``); with ``publish_first``, after an engine on ``ports`` has published
    that many batches per rank (some failures only show on a write)."""
    async with running(_config(tmp, ports, [sink]), env) as bridge:
        if publish_first:
            await publish(ports, publish_first)
        await wait_for(lambda: failing(bridge, reason), what=f"an error {reason!r}")
        return await readyz(bridge)


def tls_context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


async def read_secure_redis(r: SecureServer, keys: list[str]) -> Readback:
    return await read_redis(r.address, keys, username=r.username, password=r.password, ssl_ca_certs=str(r.ca))


async def read_secure_jetstream(n: SecureServer, dest: str) -> Readback:
    return await read_jetstream(n.address, dest, user=n.username, password=n.password, tls=tls_context(n.ca))


# -- each sink through TLS and authentication -----------------------------------------------------


async def test_kafka_sasl_ssl_scram_sha_512(scram_kafka: SecureServer, tmp_path: Path) -> None:
    kafka = scram_kafka.server
    assert isinstance(kafka, KafkaServer)
    topic = await kafka.anew_topic(partitions=2)
    env = {"KAFKA_PASSWORD": scram_kafka.password}
    since = time.time()
    ports, published, ready = await deliver(tmp_path, kafka_sink(scram_kafka, topic), env)
    assert ready == 200
    counts = (await read_kafka(kafka.bootstrap_servers, topic, 2)).check(published, EVENTS, since=since)
    assert counts["lost"] == 0 and counts["duplicated"] == 0
    # Wrong password, or a server certificate the sink does not trust: not ready, with a reason.
    for sink, why in (
        (kafka_sink(scram_kafka, topic, password="wrong-" + scram_kafka.password), "uthentication"),
        (kafka_sink(scram_kafka, topic, tls={"ca_file": None}), "certificate"),
    ):
        status, body = await readyz_when_failing(tmp_path, ports, sink, env)
        assert status == 503 and why in body["sinks"]["kafka-sec"], body


async def test_redis_tls_and_acl_user(secure_redis: SecureServer, tmp_path: Path) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    env = {"REDIS_PASSWORD": secure_redis.password}
    since = time.time()
    _, published, _ = await deliver(tmp_path, redis_sink(secure_redis, prefix), env)
    back = await read_secure_redis(secure_redis, [f"{prefix}:sec:{r}" for r in range(2)])
    assert back.check(published, EVENTS, since=since) == {
        "delivered": 2 * BATCHES * EVENTS,
        "duplicated": 0,
        "lost": 0,
        "announced": 0,
        "control": 0,
    }
    # Without the ACL user (the default user may only PING), or with a wrong password: not ready.
    anonymous = redis_sink(secure_redis, prefix + "x", password=None, username=None)  # type: ignore[arg-type]
    wrong = redis_sink(secure_redis, prefix + "x", password="wrong-" + secure_redis.password)
    for sink, why in ((anonymous, "permission"), (wrong, "auth")):
        status, body = await readyz_when_failing(tmp_path, free_ports(4), sink, env, reason=why, publish_first=2)
        assert status == 503 and why in body["sinks"]["redis-sec"], body


async def test_nats_jetstream_tls_and_user_password(secure_nats: SecureServer, tmp_path: Path) -> None:
    dest = f"KVS{uuid.uuid4().hex[:8].upper()}"
    env = {"NATS_PASSWORD": secure_nats.password}
    since = time.time()
    ports, published, _ = await deliver(tmp_path, nats_sink(secure_nats, dest), env)
    counts = (await read_secure_jetstream(secure_nats, dest)).check(published, EVENTS, since=since)
    assert counts["lost"] == 0 and counts["duplicated"] == 0
    wrong = nats_sink(secure_nats, dest, password="wrong-" + secure_nats.password, connect_timeout="1s")
    for sink in (wrong, nats_sink(secure_nats, dest, tls=None, connect_timeout="1s")):
        status, body = await readyz_when_failing(tmp_path, ports, sink, env)
        assert status == 503 and "nats-sec" in body["sinks"]["nats-sec"], body


# The server answered and refused: the sink is "reachable, not usable as configured" (no "is the
# server up" hint), its reason (auth, tls) and the server's own answer named by --check and /readyz.
REFUSALS: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("nats", "wrong_password", {"password": "wrong-pw"}, "auth", "Authorization Violation"),
    ("nats", "token_not_user", {"user": None, "password": None, "token": "${NATS_PASSWORD}"}, "auth", "Authorization Violation"),
    ("nats", "no_auth", {"user": None, "password": None}, "auth", "Authorization Violation"),
    ("nats", "other_ca", {"tls": "other"}, "tls", "certificate verify failed"),
    ("kafka", "wrong_password", {"sasl_password": "wrong-pw"}, "auth", "SaslAuthenticationFailed"),
    ("kafka", "scram_sha_256", {"sasl_mechanism": "SCRAM-SHA-256"}, "auth", "it accepts SCRAM-SHA-512"),
    ("kafka", "plain", {"sasl_mechanism": "PLAIN"}, "auth", "it accepts SCRAM-SHA-512"),
    ("kafka", "other_ca", {"tls": "other"}, "tls", "certificate verification failed"),
]


@pytest.mark.parametrize(("kind", "case", "change", "reason", "answer"), REFUSALS, ids=[f"{k}-{c}" for k, c, *_ in REFUSALS])
async def test_a_server_that_refuses_the_credentials_or_tls_is_named_as_refusing_not_unreachable(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, case: str, change: dict[str, Any], reason: str, answer: str
) -> None:
    """Wrong password, token or no user, a SASL mechanism the broker does not accept, a CA that did
    not sign the server's certificate. Each was ``unreachable ... (is the server up and reachable
    from here?)`` with reason not_connected, and on NATS over TLS the reason text was mostly a
    broken pipe or a reset, the server's "Authorization Violation" lost in a race (breaker30h3 B2)."""
    server: SecureServer = request.getfixturevalue("secure_nats" if kind == "nats" else "scram_kafka")
    env = {"NATS_PASSWORD": server.password, "KAFKA_PASSWORD": server.password}
    if change.get("tls") == "other":
        change = {"tls": {"ca_file": str(tls.make_certificates(tmp_path / "other-ca").ca)}}
    if kind == "nats":
        sink = nats_sink(server, f"KVR{uuid.uuid4().hex[:8].upper()}", **change)
    else:
        sink = kafka_sink(server, f"refused-{uuid.uuid4().hex[:8]}", **change)
    path = tmp_path / "check.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, free_ports(4), [sink])))
    check = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "bridge", "--config", str(path), "--check"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = check.stdout + check.stderr
    assert check.returncode == 3, out
    assert f"sinks[0] ({sink['name']}): reachable, not usable as configured" in out, out
    (line,) = [line for line in out.splitlines() if line.strip().startswith(f"sinks[{sink['name']}]")]
    assert answer in line and "is the server up" not in line, line
    status, body = await readyz_when_failing(tmp_path, free_ports(4), sink, env, reason=answer)
    assert status == 503 and body["sinks"][sink["name"]].startswith(f"{reason}: "), body
    assert answer in body["sinks"][sink["name"]], body


# -- secrets ---------------------------------------------------------------------------------------


def _leaks(secrets: list[str], texts: dict[str, str]) -> list[str]:
    return [f"{where} holds {s[:10]}..." for where, text in texts.items() for s in secrets if s in text]


@pytest.mark.slow
async def test_secrets_never_appear_in_logs_metrics_readyz_check_or_dead_letters(
    scram_kafka: SecureServer,
    secure_redis: SecureServer,
    secure_nats: SecureServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)  # every library's debug output too (aiokafka logs its SASL exchange)
    kafka = scram_kafka.server
    assert isinstance(kafka, KafkaServer)
    topic = await kafka.anew_topic(partitions=2)
    prefix, dest = f"t{uuid.uuid4().hex[:8]}", f"KVS{uuid.uuid4().hex[:8].upper()}"
    right = {
        "KAFKA_PASSWORD": scram_kafka.password,
        "REDIS_PASSWORD": secure_redis.password,
        "NATS_PASSWORD": secure_nats.password,
    }
    wrong = {k: "wrong-" + uuid.uuid4().hex for k in right}
    secrets = [*right.values(), *wrong.values()]
    sinks = [kafka_sink(scram_kafka, topic), redis_sink(secure_redis, prefix), nats_sink(secure_nats, dest)]
    texts: dict[str, str] = {}

    # 1. In process, right credentials, a garbage message for a dead letter.
    ports, (junk_port,) = free_ports(4), free_ports(1)
    cfg = _config(tmp_path, ports, sinks, log={"level": "debug"})
    cfg["sources"].append({"name": "junk", "endpoint": f"tcp://127.0.0.1:{junk_port}"})
    ctx = zmq.asyncio.Context()
    junk = ctx.socket(zmq.PUB)
    junk.bind(f"tcp://127.0.0.1:{junk_port}")
    try:
        async with running(cfg, right) as bridge:
            published = await publish(ports)
            for sink in ("kafka-sec", "redis-sec", "nats-sec"):
                await wait_delivered(bridge, sink, sum(published.values()))
            await wait_for(lambda: bridge.readers["junk/0"].connections > 0, what="junk subscription")
            await asyncio.sleep(0.3)
            await junk.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
            await wait_for(lambda: (tmp_path / "dead.jsonl").exists(), what="a dead letter")
            assert bridge.health is not None
            texts["/metrics"] = (await http_get(bridge.health.port, "/metrics"))[1].decode()
            status, body = await http_get(bridge.health.port, "/readyz")
            assert status == 200, body
            texts["/readyz (right)"] = body.decode()
    finally:
        junk.close(linger=0)
        ctx.destroy(linger=0)
    texts["dead letters"] = (tmp_path / "dead.jsonl").read_text()

    # 2. In process, wrong credentials, some of them inside URLs: every sink fails and says why.
    bad_sinks = [
        kafka_sink(scram_kafka, topic, password="${KAFKA_PASSWORD}"),
        redis_sink(secure_redis, prefix, password=None, url=secure_redis.address.replace("//", "//bridge:${REDIS_PASSWORD}@")),  # type: ignore[arg-type]
        nats_sink(
            secure_nats, dest, password=None, user=None, servers=secure_nats.address.replace("//", "//bridge:${NATS_PASSWORD}@")
        ),  # type: ignore[arg-type]
    ]
    async with running(_config(tmp_path, free_ports(4), bad_sinks), wrong) as bridge:
        await wait_for(
            lambda: all(failing(bridge, sink=i) for i in range(3)),
            what="three failing sinks",
        )
        await asyncio.sleep(1.0)  # a few retries more, each logged or counted
        status, body = await readyz(bridge)
        assert status == 503 and len(body["sinks"]) == 3 and "ok" not in body["sinks"].values(), body
        texts["/readyz (wrong)"] = json.dumps(body)
    texts["logs (in process, debug)"] = caplog.text + "\n".join(repr(r.__dict__) for r in caplog.records)

    # 3. `python -m bridge` at debug with ${VAR} passwords: stderr, and --check with right and wrong ones.
    proc_cfg = _config(tmp_path, free_ports(4), sinks, log={"level": "debug"})
    bridge = BridgeProcess(tmp_path, proc_cfg, env=right).start()
    try:
        await bridge.wait_ready()
        texts["/metrics (process)"] = (await http_get(bridge.metrics_port or 0, "/metrics"))[1].decode()
        assert await bridge.terminate() == 0
    finally:
        bridge.kill()
    texts["stderr (process, debug)"] = bridge.log()
    for name, env in (("right", right), ("wrong", wrong)):
        check = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "bridge", "--config", str(bridge.config_path), "--check"],
            cwd=ROOT,
            env={**bridge.env, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        # No engine runs here, so --check names the engine endpoints and exits 3 (valid, not reachable) either way.
        assert check.returncode == 3, check.stdout + check.stderr
        texts[f"--check ({name})"] = check.stdout + check.stderr
    assert "not usable as configured" in texts["--check (wrong)"] and "not usable" not in texts["--check (right)"]

    assert not _leaks(secrets, texts)
    assert "SaslAuthenticateRequest" in texts["logs (in process, debug)"]  # the exchange was logged, not its body


# -- the metrics listener ----------------------------------------------------------------------------


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine other than 127.0.0.0/8, if it has one."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks a route
        address = str(s.getsockname()[0])
        if not address.startswith("127."):
            return address
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            address = str(info[4][0])
            if not address.startswith("127."):
                return address
    return None


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_metrics_listen_binds_where_told(host: str, tmp_path: Path) -> None:
    other = _non_loopback_address()
    port = free_port()
    cfg = _config(
        tmp_path, free_ports(4), [{"type": "file", "path": str(tmp_path / "out.jsonl")}], metrics={"listen": f"{host}:{port}"}
    )
    async with running(cfg, {}) as bridge:
        assert bridge.health is not None and bridge.health._server is not None
        bound = {sock.getsockname()[0] for sock in bridge.health._server.sockets}
        assert bound == {host}
        assert (await http_get(port, "/healthz", host="127.0.0.1"))[0] == 200
        if other is None:
            pytest.skip("no non-loopback address to try from")
        if host == "127.0.0.1":
            with pytest.raises(OSError):
                await http_get(port, "/healthz", host=other, timeout=2)
        else:
            assert (await http_get(port, "/healthz", host=other))[0] == 200


# -- hostile engines -----------------------------------------------------------------------------------


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def scripted_engine(seed: int) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket, zmq.asyncio.Socket, dict[str, Any], list[bytes]]:
    """A fake engine's PUB and replay ROUTER bound on free ports, its source config and 40 batches."""
    pub_port, replay_port = free_ports(2)
    profile = PROFILES["vllm-0.33.0"]
    factory = EventFactory(profile, seed=seed)
    payloads = [encode_batch(profile, 1_700_000_000.0 + i, factory.batch(2), 0) for i in range(41)]
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    source = {"name": "e", "endpoint": f"tcp://127.0.0.1:{pub_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
    return ctx, pub, router, source, payloads


async def test_garbage_replay_replies_are_counted_and_the_stream_goes_on(tmp_path: Path) -> None:
    """A fake engine whose ROUTER answers each request with malformed replies before the real ones."""
    ctx, pub, router, source, payloads = scripted_engine(seed=3)
    garbage = [
        [b"only one frame"],
        [b"", b"topic", seq(0), payloads[0], b"a fifth frame"],
        [b"", b"\x00" * 7, payloads[0]],  # a 7-byte seq
        [b"", b"", b"\x00" * 9, payloads[0]],  # a 9-byte seq after a topic
        [b"", seq(0)],  # no payload frame: the seq is where the payload belongs
        [b""],  # the delimiter and nothing else
    ]
    requests: list[int] = []

    async def serve() -> None:
        while True:
            identity, *rest = await router.recv_multipart()
            start = int.from_bytes(rest[-1], "big")
            requests.append(start)
            for frames in garbage:
                await router.send_multipart([identity, *frames])
            for s in range(start, 20):
                await router.send_multipart([identity, b"", b"", seq(s), payloads[s]])
            await router.send_multipart([identity, b"", b"", seq(2**64 - 1), b""])

    server = asyncio.create_task(serve())
    cfg = _config(tmp_path, [0, 0, 0, 0], [{"type": "file", "path": str(tmp_path / "out.jsonl"), "granularity": "batch"}])
    cfg["sources"] = [source]
    try:
        async with running(cfg, {}) as bridge:
            await wait_for(lambda: len(read_lines(tmp_path / "out.jsonl")) >= 20, what="the replayed history")
            await wait_for(lambda: bridge.readers["e/0"].connections > 0, what="subscription")
            await asyncio.sleep(0.3)
            for s in range(20, 40):  # live from here on
                await pub.send_multipart([b"", seq(s), payloads[s]])
            await wait_for(lambda: len(read_lines(tmp_path / "out.jsonl")) >= 40, what="the live batches")
            bad = metric(bridge, "kv_bridge_decode_failures_total", source="e", reason="bad_replay_reply")
    finally:
        server.cancel()
        pub.close(linger=0)
        router.close(linger=0)
        ctx.destroy(linger=0)
    lines = read_lines(tmp_path / "out.jsonl")
    assert [ln["seq"] for ln in lines] == list(range(40)) and all("events" in ln for ln in lines)
    assert bad == len(garbage) * len(requests) >= len(garbage)


async def _one_foreign_frame(
    tmp_path: Path, seed: int, foreign: bytes, live: Callable[[int], bytes], reply: Callable[[int], bytes]
) -> tuple[list[dict[str, Any]], float, int, str, list[dict[str, Any]]]:
    """An engine on real ZMQ publishes 0..19 (sequence frames ``live(seq)``), one frame the engine
    never sent (sequence frame ``foreign``), then 20..39; its replay socket answers from what it
    has published (``reply(seq)``). What the bridge delivered (file sink), its restarts, /readyz,
    and its dead letters, once the frame is dead-lettered."""
    ctx, pub, router, source, payloads = scripted_engine(seed=seed)
    bogus = payloads.pop()  # (never published by the engine)
    held: list[int] = []  # what the engine has published (its replay buffer)

    async def serve() -> None:
        while True:
            identity, *rest = await router.recv_multipart()
            start = int.from_bytes(rest[-1], "big")
            for s in [s for s in held if s >= start]:
                await router.send_multipart([identity, b"", b"", reply(s), payloads[s]])
            await router.send_multipart([identity, b"", b"", seq(2**64 - 1), b""])

    async def publish(s: int) -> None:
        held.append(s)
        await pub.send_multipart([b"", live(s), payloads[s]])
        await asyncio.sleep(0.01)

    server = asyncio.create_task(serve())
    out = tmp_path / "out.jsonl"
    cfg = _config(tmp_path, [0, 0, 0, 0], [{"type": "file", "path": str(out), "granularity": "batch", "batch": {"linger": 0}}])
    cfg["sources"] = [source]
    try:
        async with running(cfg, {}) as bridge:
            await wait_for(lambda: bridge.readers["e/0"].connections > 0, what="subscription")
            await asyncio.sleep(0.3)
            for s in range(20):
                await publish(s)
            await wait_for(lambda: len(read_lines(out)) >= 20, what="the first batches")
            await pub.send_multipart([b"", foreign, bogus])
            for s in range(20, 40):
                await publish(s)
            await wait_for(lambda: len(read_lines(out)) >= 40, what="the engine's next batches")
            await wait_for(
                lambda: metric(bridge, "kv_bridge_decode_failures_total", source="e", reason="bad_seq") == 1,
                what="the frame dead-lettered",
            )
            await asyncio.sleep(0.5)  # (nothing more comes)
            status, body = await readyz(bridge)
            restarts = metric(bridge, "kv_bridge_source_restarts_total", source="e")
    finally:
        server.cancel()
        pub.close(linger=0)
        router.close(linger=0)
        ctx.destroy(linger=0)
    dead = [json.loads(line) for line in (tmp_path / "dead.jsonl").read_text().splitlines()]
    return read_lines(out), restarts, status, body, dead


def _one_epoch_every_batch_once(lines: list[dict[str, Any]], restarts: float, status: int, body: str) -> None:
    assert [(ln["type"], ln["seq"]) for ln in lines] == [("EventBatch", s) for s in range(40)]
    assert len({ln["epoch"] for ln in lines}) == 1 and restarts == 0
    assert status == 200, body


@pytest.mark.parametrize("forged", [2**63, 10**6, 22, 2**64 - 1])
async def test_a_live_frame_ahead_of_its_engine_is_dead_lettered_never_a_restart_or_a_loss(tmp_path: Path, forged: int) -> None:
    """Issue 29 (breaker31x B2). An engine on real ZMQ publishes 0..19, one frame whose seq is
    ``forged`` (a flipped high bit, a garbled counter, one just ahead: 22, which the engine then
    publishes itself with other bytes; the end marker's seq), then 20..39. Its replay socket
    answers from what it holds. One epoch with every batch once, nothing announced lost, the
    frame dead-lettered (``bad_seq``), never delivered, and no restart."""
    lines, restarts, status, body, dead = await _one_foreign_frame(tmp_path, 5, seq(forged), seq, seq)
    _one_epoch_every_batch_once(lines, restarts, status, body)
    assert [d["reason"] for d in dead] == ["bad_seq"] and dead[0]["seq"] in (forged, None)


@pytest.mark.parametrize("forged_uuid", [uuid.uuid4().bytes, None], ids=["another_uuid", "no_uuid"])
@pytest.mark.parametrize("replies_named", [True, False], ids=["replies_with_uuid", "replies_without"])
async def test_one_frame_under_another_uuid_is_dead_lettered_never_a_restart(
    tmp_path: Path, forged_uuid: bytes | None, replies_named: bool
) -> None:
    """Issue 29 (breaker32 B1). An engine on real ZMQ with a publisher UUID (24-byte seq frames,
    vLLM #57789) publishes 0..19, then one frame at seq 20 under another UUID (or an 8-byte seq
    frame: no UUID), then its own 20..39; its replay socket answers from what it holds, with its
    UUID on replies or without. Before: a certain restart, the engine's UUID retired and its
    20..39 dropped as a retired instance's. Now: one epoch with every batch once, the frame
    dead-lettered (``bad_seq``), no restart."""
    mine = uuid.uuid4().bytes
    lines, restarts, status, body, dead = await _one_foreign_frame(
        tmp_path,
        7,
        seq(20) + (forged_uuid or b""),
        lambda s: seq(s) + mine,
        lambda s: seq(s) + (mine if replies_named else b""),
    )
    _one_epoch_every_batch_once(lines, restarts, status, body)
    assert [d["reason"] for d in dead] == ["bad_seq"]


async def test_a_100mb_message_is_refused_before_allocation(tmp_path: Path) -> None:
    """ZMQ's MAXMSGSIZE (ingest.max_frame_bytes, 64 MiB by default): the bridge's memory does not
    grow by the message, the connection is re-established and the next message is served."""
    (pub_port,) = free_ports(1)
    out = tmp_path / "out.jsonl"
    cfg = _config(
        tmp_path,
        [0, 0, 0, 0],
        [{"type": "file", "path": str(out), "granularity": "batch", "batch": {"linger": 0}}],
        sources=[{"name": "big", "endpoint": f"tcp://127.0.0.1:{pub_port}"}],
    )
    profile = PROFILES["vllm-0.33.0"]
    factory = EventFactory(profile, seed=4)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    bridge = BridgeProcess(tmp_path, cfg)
    try:
        async with BridgeRun(bridge, interval=0.02, metrics_every=1000) as run:
            await bridge.wait_metric("kv_bridge_sources_connected", 1)
            await asyncio.sleep(0.3)
            for s in range(3):
                await pub.send_multipart([b"", s.to_bytes(8, "big"), encode_batch(profile, time.time(), factory.batch(2), 0)])
            await wait_for(lambda: len(read_lines(out)) >= 3, what="the first batches")
            await asyncio.sleep(0.5)
            before = bridge.rss()
            t0 = time.monotonic()
            await pub.send_multipart([b"", (3).to_bytes(8, "big"), b"\x00" * (100 * MiB)])
            await bridge.wait_metric("kv_bridge_source_disconnects_total", 1)
            await bridge.wait_metric("kv_bridge_sources_connected", 1)
            await asyncio.sleep(0.3)
            await pub.send_multipart([b"", (4).to_bytes(8, "big"), encode_batch(profile, time.time(), factory.batch(2), 0)])
            await wait_for(lambda: any(ln["seq"] == 4 for ln in read_lines(out)), what="the next batch")
            peak = run.sampler.peak_between(t0, time.monotonic())
            assert await bridge.terminate() == 0
    finally:
        pub.close(linger=0)
        ctx.destroy(linger=0)
    print(f"[security] 100 MB message: RSS before {before / MiB:.1f} MiB, peak after {peak / MiB:.1f} MiB")
    assert peak - before < 20 * MiB  # ZMQ refused it before reading it in
    lines = read_lines(out)
    assert [(ln["seq"], ln["type"]) for ln in lines] == [
        (0, "EventBatch"),
        (1, "EventBatch"),
        (2, "EventBatch"),
        (3, "EventsLost"),
        (4, "EventBatch"),
    ]
