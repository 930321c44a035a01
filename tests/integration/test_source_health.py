"""Health that matches reality (issue 30, item 1), with real sockets: a bridge that reads from no
engine is not ready and says why; one engine down among several is not; a port of the wrong kind
is named with its fix.

Each case runs an in-process bridge with a file sink and ``ingest.connect_grace`` of 1 s, and
reads what an operator would: ``readiness()`` (the body of ``/readyz``), the metrics, the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from bridge.runtime import Bridge
from bridge.simulator import Simulator, SimulatorOptions
from bridge.stream import UNDECODABLE_AFTER
from tests.support.cache_engine import CacheEngine
from tests.support.dns import stub_dns
from tests.support.harness import free_port, metric, read_lines, running_bridge, wait_for
from tests.support.scripted_engine import ScriptedEngine, check_invariants

pytestmark = pytest.mark.integration

GRACE = {"connect_grace": "1s"}


def source(name: str, live: str, replay: str | None = None) -> dict[str, Any]:
    return {"name": name, "endpoint": live, **({"replay_endpoint": replay} if replay else {})}


async def not_ready(bridge: Bridge) -> dict[str, Any]:
    """The readiness detail once the bridge says it is not ready (within 10 s)."""
    await wait_for(lambda: not bridge.readiness()[0] and "not_ready" in bridge.readiness()[1], what="not ready", timeout=10)
    return bridge.readiness()[1]


def problem(bridge: Bridge, key: str, reason: str) -> float:
    source, rank = key.split("/")
    return metric(bridge, "kv_bridge_source_problem", source=source, dp_rank=rank, reason=reason)


def lines(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == message]


@pytest.mark.parametrize(
    ("endpoint", "reason", "says"),
    [
        ("tcp://127.0.0.1:{port}", "refused", ": connection refused; is the engine running"),
        ("tcp://no-such-engine.invalid:5557", "unresolvable", "cannot resolve the host 'no-such-engine.invalid'"),
        # breaker78 B2: an ipc:// endpoint was never diagnosed: "not connected yet" for good.
        ("ipc://{tmp}/kv", "refused", ": no socket at {tmp}/kv; is the engine running on this host"),
        ("ipc://{tmp}/file", "not_zmq", ": {tmp}/file is not a socket; give the path the engine binds"),
        ("ipc://{tmp}/stale", "refused", ": nothing listens at {tmp}/stale (a socket left by an engine that stopped?)"),
        ("ipc://@kvb-{port}", "refused", ": nothing listens at the abstract socket @kvb-{port}; is the engine running"),
    ],
    ids=["dead port", "unresolvable name", "ipc path missing", "ipc path a file", "ipc socket left behind", "ipc abstract"],
)
async def test_a_bridge_whose_only_engine_cannot_be_reached_is_not_ready_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, endpoint: str, reason: str, says: str
) -> None:
    caplog.set_level(logging.INFO)
    (tmp_path / "file").write_text("not a socket")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale"))  # bound, never listening: as an engine's socket left after it stopped
    stale.close()
    port = free_port()
    live, says = endpoint.format(port=port, tmp=tmp_path), says.format(tmp=tmp_path, port=port)
    async with running_bridge(tmp_path, [source("a", live)], ingest=GRACE) as (bridge, _out):
        detail = await not_ready(bridge)
        assert detail["not_ready"] == "no source connected: see sources_not_connected"
        await wait_for(lambda: problem(bridge, "a/0", reason) == 1, what=f"source_problem {reason}", timeout=10)
        assert says in bridge.readiness()[1]["sources_not_connected"]["a/0"]
        assert metric(bridge, "kv_bridge_source_up", source="a", dp_rank="0") == 0
        assert metric(bridge, "kv_bridge_ready") == 0
        assert metric(bridge, "kv_bridge_sources_configured") == 1
        (line,) = lines(caplog, "source not connected")  # one line per change, not one per retry
        assert line.levelno == logging.WARNING and says in line.error  # type: ignore[attr-defined]


async def test_a_live_endpoint_that_reached_the_replay_router_is_an_error_naming_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """dp ranks use port + r on both sockets: a live endpoint one off lands on a replay ROUTER."""
    caplog.set_level(logging.INFO)
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with running_bridge(tmp_path, [source("a", f"tcp://127.0.0.1:{port}")], ingest=GRACE) as (bridge, _out):
            detail = await not_ready(bridge)
            await wait_for(lambda: problem(bridge, "a/0", "wrong_peer") == 1, what="wrong_peer", timeout=10)
            said = bridge.readiness()[1]["sources_not_connected"]["a/0"]
            assert said.startswith(
                f"tcp://127.0.0.1:{port}: a ROUTER socket answers, not PUB or XPUB; this looks like the engine's replay port"
            )
            assert metric(bridge, "kv_bridge_sources_connected") == 0  # a connection without a handshake is none
            (line,) = lines(caplog, "source not connected")
            assert line.levelno == logging.ERROR and "replay port" in line.error  # type: ignore[attr-defined]
            assert detail["not_ready"]
    finally:
        router.close(0)
        ctx.term()


async def test_a_replay_endpoint_that_is_the_engines_pub_is_an_error_naming_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    live, rep = free_port(), free_port()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)  # another engine's live socket, given as this one's replay endpoint
    wrong = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        async with CacheEngine(live, rep, seed=3) as engine:
            sources = [source("a", f"tcp://127.0.0.1:{live}", wrong)]
            replay = {"timeout": "200ms", "max_attempts": 3}
            async with running_bridge(tmp_path, sources, ingest=GRACE, replay=replay) as (bridge, _out):
                await engine.wait_subscribed()
                await engine.step(3, deliver=False)  # a gap: the bridge needs its replay endpoint
                await engine.step(1)
                await wait_for(lambda: "replay_not_usable" in bridge.readiness()[1], what="replay diagnosed", timeout=15)
                said = bridge.readiness()[1]["replay_not_usable"]["a/0"]
                assert said.startswith(f"{wrong}: a PUB socket answers, not ROUTER; this looks like the engine's live PUB port")
                (line,) = lines(caplog, "replay endpoint not usable")
                assert line.levelno == logging.ERROR
                assert bridge.readiness()[0]  # the source is connected: ready, with the replay problem named
    finally:
        pub.close(0)
        ctx.term()


async def test_one_engine_down_among_several_leaves_the_bridge_ready(tmp_path: Path) -> None:
    live, rep = free_port(), free_port()
    async with CacheEngine(live, rep, seed=4) as engine:
        sources = [source("up", f"tcp://127.0.0.1:{live}"), source("down", f"tcp://127.0.0.1:{free_port()}")]
        async with running_bridge(tmp_path, sources, ingest=GRACE) as (bridge, _out):
            await engine.wait_subscribed()
            await wait_for(lambda: problem(bridge, "down/0", "refused") == 1, what="the dead one diagnosed", timeout=10)
            ready, detail = bridge.readiness()
            assert ready and "not_ready" not in detail
            assert list(detail["sources_not_connected"]) == ["down/0"]
            assert metric(bridge, "kv_bridge_source_up", source="up", dp_rank="0") == 1


async def test_discovery_that_finds_no_engine_is_not_ready(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with stub_dns() as dns:
        dns.records["engines.test.svc.cluster.local"] = []  # the Service exists, with no ready pod
        discovery = {
            "dns": {"name": "engines.test.svc.cluster.local", "port": 5557, "resolver": dns.address, "interval": "100ms"}
        }
        async with running_bridge(tmp_path, [], ingest=GRACE, discovery=discovery) as (bridge, _out):
            detail = await not_ready(bridge)
            assert detail["not_ready"] == "discovery finds no engine at engines.test.svc.cluster.local"
            assert metric(bridge, "kv_bridge_discovery_sources") == 0
            (line,) = lines(caplog, "DNS name resolves to no engine: check discovery.dns.name (Service and namespace) "
                            "and that the Service is headless with ready pods")  # fmt: skip
            assert line.levelno == logging.WARNING  # once, though it resolves every 100 ms


async def test_an_engine_publishing_under_another_topic_is_not_taken_for_an_idle_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29 B8: the engine publishes under topic "kv", the source subscribes to "xx". Before,
    the bridge connected, received nothing and said ready, as for an idle engine. Now the stream
    counts as not connected, naming the engine's topic and the fix; a prefix of the engine's
    topic reads every batch and is ready."""
    caplog.set_level(logging.INFO)
    live, rep = free_port(), free_port()
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{rep}", rate=0, topic="kv")
    async with Simulator(opts) as sim:
        wrong = [source("a", opts.endpoint, opts.replay_endpoint) | {"topic": "xx"}]
        async with running_bridge(tmp_path / "wrong", wrong, ingest=GRACE) as (bridge, out):
            await wait_for(lambda: metric(bridge, "kv_bridge_sources_connected") == 1, what="connected", timeout=10)
            for _ in range(30):
                await sim.step(0)
                if problem(bridge, "a/0", "wrong_topic") == 1:
                    break
                await asyncio.sleep(0.05)
            detail = await not_ready(bridge)
            assert detail["not_ready"] == "no source connected: see sources_not_connected"
            said = detail["sources_not_connected"]["a/0"]
            assert said == (
                f"{opts.endpoint}: the engine publishes under 'kv' and nothing yet under a topic starting with 'xx': "
                "set the source's topic to the engine's KV events topic (\"\" for every topic)"
            )
            assert metric(bridge, "kv_bridge_source_up", source="a", dp_rank="0") == 0
            # breaker108 G2: connected at the ZMQ level, the stream still counted 1 here, so the
            # KvBridgeNoSourceConnected alert (sources_connected == 0) never fired (3 of 3).
            assert metric(bridge, "kv_bridge_sources_connected") == 0
            assert not out.exists() or read_lines(out) == []  # nothing of another topic delivered
            assert bridge.pipelines["a/0"].foreign_only  # (not probed: replay would deliver them, breaker77 B1)
            (line,) = lines(caplog, "source receives no message of its topic")
            assert line.levelno == logging.ERROR
        published = sim.ranks[0].seq
        right = [source("a", opts.endpoint, opts.replay_endpoint) | {"topic": "k"}]
        async with running_bridge(tmp_path / "right", right, ingest=GRACE) as (bridge, out):
            await wait_for(lambda: metric(bridge, "kv_bridge_sources_connected") == 1, what="connected", timeout=10)
            await sim.step(0)
            await wait_for(lambda: out.exists() and len(read_lines(out)) == published + 1, what="every batch", timeout=10)
            assert bridge.readiness()[0] and problem(bridge, "a/0", "wrong_topic") == 0
            assert not bridge.pipelines["a/0"].foreign_only


async def test_a_tcp_probe_of_a_bound_port_is_not_taken_for_the_engine_going_away(tmp_path: Path) -> None:
    """breaker110 1: a ``bind: true`` source with its engine connected in; a TCP connection that
    never does the ZMTP handshake (a Kubernetes tcpSocket probe, a port scan) came and went, and
    its DISCONNECTED was counted as the engine's: not connected, source_up 0, the engine "went
    away" while it published on (5 of 5). libzmq says HANDSHAKE_FAILED before such a DISCONNECTED."""
    live = free_port()
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{live}", replay_endpoint=None, rate=0, bind=False)
    sources = [source("a", opts.endpoint, None) | {"bind": True}]
    async with running_bridge(tmp_path, sources, ingest=GRACE) as (bridge, out), Simulator(opts) as sim:
        await wait_for(lambda: metric(bridge, "kv_bridge_sources_connected") == 1, what="connected", timeout=10)
        # An empty TCP probe, a TLS ClientHello's first bytes and a NUL: libzmq reports no
        # HANDSHAKE_FAILED for the last two (it reads them as ZMTP/1.0), only DISCONNECTED
        # (breaker112 B1, 3 of 3; after one, a real restart was missed: B2).
        for sent in (b"", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", b"\x00"):
            probe = socket.create_connection(("127.0.0.1", live), timeout=2)
            probe.sendall(sent)
            await asyncio.sleep(0.05)
            probe.close()
        await sim.step(0)
        await wait_for(lambda: out.exists() and len(read_lines(out)) >= 1, what="a batch", timeout=10)
        await asyncio.sleep(0.5)  # (the monitor's events are read by then)
        await sim.step(0)
        await wait_for(lambda: len(read_lines(out)) >= 2, what="another batch", timeout=10)
        assert metric(bridge, "kv_bridge_sources_connected") == 1
        assert metric(bridge, "kv_bridge_source_up", source="a", dp_rank="0") == 1
        assert metric(bridge, "kv_bridge_source_disconnects_total", source="a", dp_rank="0") == 0
        assert bridge.readiness()[0]


class _ConnectingEngine(ScriptedEngine):
    """A scripted engine whose PUB connects to the bridge (a ``bind: true`` source)."""

    async def _bind(self, kind: int, port: int) -> zmq.asyncio.Socket:
        if kind != zmq.XPUB:
            return await super()._bind(kind, port)
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock


class _Proxy:
    """engine -> proxy -> bridge, the engine's bytes ``latency`` seconds late (a slow link); with
    ``dead_host``, when the engine's side closes, the bridge's stays open, as a connection from a
    host that died (no FIN, no RST) does until TCP keep-alive ends it."""

    def __init__(self, target: int, *, latency: float = 0.0, dead_host: bool = False) -> None:
        self.target, self.latency, self.dead_host = target, latency, dead_host
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.opened = asyncio.Event()  # (the bridge's side of a connection)
        # Cut off (an L4 proxy whose backend is gone): open connections stay up and forward
        # nothing; each new one is reset as soon as it is accepted.
        self.cut = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, engine_in: asyncio.StreamReader, engine_out: asyncio.StreamWriter) -> None:
        if self.cut:
            engine_out.transport.abort()
            return
        bridge_in, bridge_out = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [engine_out, bridge_out]
        self.opened.set()

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if self.cut:
                        continue
                    if delay:
                        await asyncio.sleep(delay)  # (a whole read late: enough for a handshake's few bytes)
                    dst.write(data)
                    await dst.drain()

        self.tasks.add(asyncio.create_task(pump(bridge_in, engine_out, 0.0)))
        await pump(engine_in, bridge_out, self.latency)
        engine_out.close()
        if not self.dead_host:
            bridge_out.close()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()
        self.server.close()
        await self.server.wait_closed()


async def test_an_engine_cut_off_behind_a_proxy_that_holds_the_live_connection_is_not_taken_for_an_idle_one(
    tmp_path: Path,
) -> None:
    """breaker119 2: the engine behind a proxy that keeps the established connections open but
    forwards nothing, and resets each new one (an L4 proxy or sidecar whose backend is gone). The
    live connection stays up (the proxy answers TCP keep-alive), and a replay endpoint that
    resets counted as an answer: /readyz said ready for as long as it lasted (40 s of 40, 3 of
    3). Nothing vouches for the engine then: not ready, naming the stream; ready again once the
    proxy forwards again."""
    live, rep = free_port(), free_port()
    proxies = [_Proxy(live), _Proxy(rep)]
    live_port, rep_port = [await p.start() for p in proxies]
    try:
        async with ScriptedEngine(live, rep) as engine:
            src = source("eng", f"tcp://127.0.0.1:{live_port}", f"tcp://127.0.0.1:{rep_port}")
            replay = {"idle_probe": "1s", "timeout": "500ms"}
            async with running_bridge(tmp_path, [src], ingest=GRACE, replay=replay) as (bridge, out):
                await engine.wait_subscribed()
                await engine.publish(2)
                await wait_for(lambda: out.exists() and len(read_lines(out)) == 2, what="2 batches", timeout=10)
                await wait_for(lambda: bridge.readiness()[0], what="ready", timeout=10)
                for p in proxies:
                    p.cut = True
                await engine.publish(1)  # (dropped by the proxy)
                detail = await not_ready(bridge)
                assert detail["not_ready"].startswith("no source answers"), detail
                assert detail["sources_not_answering"] == ["eng/0"], detail
                assert "eng/0" in detail["replay_not_usable"], detail
                live_proxy, _ = proxies
                live_proxy.cut = False  # (the replay endpoint stays cut off)
                await engine.publish(1)
                await wait_for(lambda: bridge.readiness()[0], what="ready once live batches come again", timeout=30)
                # Cut off again, within a minute of the first diagnosis: found again (breaker120 2:
                # a diagnosis ran at most once a minute, and /readyz said ready for up to 60 s).
                live_proxy.cut = True
                await wait_for(lambda: not bridge.readiness()[0], what="not ready when cut off again", timeout=20)
                assert bridge.readiness()[1]["sources_not_answering"] == ["eng/0"]
                for p in proxies:
                    p.cut = False
                await engine.publish(1)
                await wait_for(lambda: bridge.readiness()[0], what="ready once the proxy forwards again", timeout=30)
                await wait_for(lambda: len(read_lines(out)) == 5, what="the batches dropped by the proxy, replayed", timeout=30)
    finally:
        for p in proxies:
            await p.close()


async def test_a_drop_during_a_probes_handshake_window_is_not_taken_for_a_connected_engine(tmp_path: Path) -> None:
    """breaker116 4: ``bind: true``, the engine's handshake slowed by a 1 s link, a TCP probe
    accepted meanwhile and held. A handshake event names no connection, so when the engine went for
    good the drop could have been the probe's: the stream stayed connected and /readyz ready until
    libzmq dropped the probe (30.9 s; 4 of 4). Such a drop now makes the stream not connected
    (``perhaps_gone``) until a message is read or the counts come right."""
    live, rep = free_port(), free_port()
    sources = [source("a", f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{rep}") | {"bind": True}]
    proxy = _Proxy(live, latency=1.0)
    probe: socket.socket | None = None
    async with running_bridge(tmp_path, sources, ingest=GRACE) as (bridge, out):
        port = await proxy.start()
        try:
            engine = _ConnectingEngine(port, rep)
            await engine.__aenter__()
            try:
                await proxy.opened.wait()
                await asyncio.sleep(0.2)
                probe = socket.create_connection(("127.0.0.1", live), timeout=2)  # (while the handshake is in flight)
                await engine.wait_subscribed(timeout=15)
                for _ in range(5):
                    await engine.publish(1)
                await wait_for(lambda: out.exists() and len(read_lines(out)) >= 5, what="the engine's batches", timeout=10)
                assert bridge.readiness()[0]
            finally:
                await engine.__aexit__(None, None, None)  # the engine goes, for good
            await wait_for(lambda: not bridge.readiness()[0], what="not ready once the engine went", timeout=5)
            assert metric(bridge, "kv_bridge_sources_connected") == 0
        finally:
            if probe is not None:
                probe.close()
            await proxy.close()


async def test_an_engine_back_on_a_bound_port_while_its_dead_hosts_connection_is_open_gets_a_new_epoch(
    tmp_path: Path,
) -> None:
    """breaker116 3: ``bind: true``; the engine's host dies, its connection stays open at the
    bridge (half-open), and the engine comes back (a new pod) and connects anew. Its first batches
    go out before it has the bridge's subscription, so the first seen is the old last + 1: with no
    drop seen, it was delivered in the old epoch (I1; 4 of 4). A second connection's handshake is
    now told as a drop: the new instance is verified through the replay, in a new epoch, whole."""
    live, rep = free_port(), free_port()
    sources = [source("a", f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{rep}") | {"bind": True}]
    proxy = _Proxy(live, dead_host=True)
    async with running_bridge(tmp_path, sources, ingest=GRACE) as (_, out):
        port = await proxy.start()
        try:
            async with _ConnectingEngine(port, rep) as engine:
                await engine.wait_subscribed(timeout=15)
                for _ in range(10):
                    await engine.publish(1)
                    await asyncio.sleep(0.05)
                await wait_for(lambda: out.exists() and len(read_lines(out)) >= 10, what="the first instance", timeout=10)
                await engine.restart()
                await engine.publish(10, deliver=False)  # (before the bridge's subscription reached it)
                await engine.wait_subscribed(timeout=15)
                for _ in range(10):
                    await engine.publish(1)
                    await asyncio.sleep(0.05)
                await wait_for(lambda: len(read_lines(out)) >= 31, what="the second instance", timeout=15)
                views = check_invariants(read_lines(out), engine)
        finally:
            await proxy.close()
    assert [(sorted(v.instances), v.delivered, v.lost) for v in views] == [
        ([0], list(range(10)), []),
        ([1], list(range(20)), []),
    ], [str(v) for v in views]


async def test_the_last_batch_of_an_engine_that_stops_right_after_it_is_delivered(tmp_path: Path) -> None:
    """breaker111 H1: an engine that stops within milliseconds of its last step; the socket's drop
    was told before its last batch was read, which then read in doubt (perhaps a new instance's,
    clocks within clock_skew cannot say) and was announced lost when the engine restarted: 24 of
    24 such batches, received by the bridge (I4). What the socket holds when its last connection
    drops is handed on first."""
    live, rep = free_port(), free_port()
    async with ScriptedEngine(live, rep) as engine:
        sources = [source("a", f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{rep}")]
        async with running_bridge(tmp_path, sources, ingest=GRACE) as (_, out):
            await engine.wait_subscribed(timeout=10)
            for _ in range(4):
                for _ in range(3):
                    await engine.publish(1)
                    await asyncio.sleep(0.1)
                await engine.publish(1)
                await engine.restart()  # (at once: the last batch is in flight as the socket closes)
                await engine.wait_subscribed(timeout=10)
                await asyncio.sleep(0.5)
            await engine.publish(1)
            published = sum(len(i.payloads) for i in engine.instances)
            await wait_for(
                lambda: out.exists() and sum("events" in r for r in read_lines(out)) >= published, what="every batch", timeout=15
            )
            records = read_lines(out)
    lost = [(r["epoch"], r["from_seq"], r["to_seq"], r["reason"]) for r in records if r.get("type") == "EventsLost"]
    assert lost == [], lost
    assert sum("events" in r for r in records) == published
    assert sum(r.get("type") == "SourceReset" for r in records) == 4


async def test_an_engine_redeployed_under_another_topic_is_not_taken_for_an_idle_one(tmp_path: Path) -> None:
    """Breaker find (T2): the engine published under "kv", then a redeployed one publishes its
    events under "engine-kv". A topic seen once must not vouch for the next engine on the socket."""
    live, rep = free_port(), free_port()
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{rep}", rate=0, topic="kv")
    sources = [source("a", opts.endpoint, opts.replay_endpoint) | {"topic": "kv"}]
    async with running_bridge(tmp_path, sources, ingest=GRACE) as (bridge, out):
        async with Simulator(opts) as sim:
            await wait_for(lambda: metric(bridge, "kv_bridge_sources_connected") == 1, what="connected", timeout=10)
            await sim.step(0)
            await wait_for(lambda: out.exists() and len(read_lines(out)) == 1, what="a batch", timeout=10)
        await wait_for(lambda: metric(bridge, "kv_bridge_sources_connected") == 0, what="the engine gone", timeout=10)
        async with Simulator(dataclasses.replace(opts, topic="engine-kv")) as sim:
            await wait_for(lambda: metric(bridge, "kv_bridge_sources_connected") == 1, what="reconnected", timeout=10)
            for _ in range(60):
                await sim.step(0)
                if problem(bridge, "a/0", "wrong_topic") == 1:
                    break
                await asyncio.sleep(0.05)
            detail = await not_ready(bridge)
            assert "'engine-kv'" in detail["sources_not_connected"]["a/0"]
            assert metric(bridge, "kv_bridge_sources_connected") == 0


async def test_a_frozen_engine_is_not_taken_for_an_idle_one(tmp_path: Path) -> None:
    """The only engine is frozen (SIGSTOP: a `docker pause`, a cgroup freeze, a hung process). The
    kernel keeps its TCP connections up, so the live socket stays connected and the bridge was
    ready while it read nothing, for as long as it lasted (breaker29h F1: 100 s of 100). Its
    replay endpoint now tells it from an idle engine: the idle probe gets no answer and the
    endpoint accepts a connection but never speaks, so the bridge is not ready and names the
    stream; once the engine runs again, it is ready again."""
    live, rep = free_port(), free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "bridge", "simulate", "--endpoint", f"tcp://127.0.0.1:{live}",
         "--replay-endpoint", f"tcp://127.0.0.1:{rep}", "--rate", "20"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        src = source("eng", f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{rep}")
        async with running_bridge(tmp_path, [src], ingest=GRACE, replay={"idle_probe": "1s"}) as (bridge, out):
            await wait_for(lambda: len(read_lines(out)) >= 20 and bridge.readiness()[0], what="batches and ready", timeout=30)
            os.kill(sim.pid, signal.SIGSTOP)
            await wait_for(lambda: not bridge.readiness()[0], what="not ready while the engine is frozen", timeout=60)
            detail = bridge.readiness()[1]
            assert detail["not_ready"].startswith("no source answers") and detail["sources_not_answering"] == ["eng/0"], detail
            assert "no answer" in detail["replay_not_usable"]["eng/0"], detail
            os.kill(sim.pid, signal.SIGCONT)
            await wait_for(lambda: bridge.readiness()[0], what="ready once the engine runs again", timeout=30)
            assert "sources_not_answering" not in bridge.readiness()[1]
    finally:
        os.kill(sim.pid, signal.SIGCONT)
        sim.kill()
        sim.wait(10)


async def test_a_hung_engine_whose_replay_socket_still_handshakes_is_not_taken_for_an_idle_one(tmp_path: Path) -> None:
    """A hung engine process whose ZMQ I/O thread still runs: its replay ROUTER completes the
    handshake (libzmq answers it) but no request gets a reply, and nothing is published. The
    probe saw the right socket type and the bridge was ready for ever (breaker30h3 B1, 4 of 4).
    A replay with no reply from a socket that handshakes is as good as no answer: not ready,
    naming the stream; once the engine answers again, ready again."""
    live, rep = free_port(), free_port()
    async with ScriptedEngine(live, rep) as engine:
        src = source("eng", f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{rep}")
        replay = {"idle_probe": "1s", "timeout": "500ms"}
        async with running_bridge(tmp_path, [src], ingest=GRACE, replay=replay) as (bridge, out):
            await engine.wait_subscribed()
            await engine.publish(2)
            await wait_for(lambda: out.exists() and len(read_lines(out)) == 2 and bridge.readiness()[0], what="ready", timeout=10)
            engine.replay = "ignore"  # hung: its sockets up, nothing answered or published
            detail = await not_ready(bridge)
            assert detail["sources_not_answering"] == ["eng/0"], detail
            assert "answers its handshake, but no replay request" in detail["replay_not_usable"]["eng/0"], detail
            engine.replay = "answer"
            await wait_for(lambda: bridge.readiness()[0], what="ready once it answers again", timeout=30)
            # Hung again, then restarted by the operator: the new instance is idle, its buffer
            # empty, so it answers a replay with its end marker alone. That is an answer too
            # (breaker30z1 B2: not ready for good after the fix the docs give).
            engine.replay = "ignore"
            await not_ready(bridge)
            engine.replay = "answer"
            await engine.restart()
            await wait_for(lambda: bridge.readiness()[0], what="ready once the restarted engine answers", timeout=30)


async def test_an_engine_whose_every_batch_is_undecodable_is_not_taken_for_a_working_one(tmp_path: Path) -> None:
    """Breaker30h U1: the only engine publishes under the right topic with the right seqs, but no
    payload decodes (another encoder, another program). Each batch is announced lost, and the
    bridge was ready for ever with nothing named. Now a run of undecodable batches makes it not
    ready, naming the stream and the decoder's reason; a bad batch among good ones does not, and
    the next good batch makes it ready again."""
    live, rep = free_port(), free_port()
    async with ScriptedEngine(live, rep) as engine:
        src = source("eng", f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{rep}")
        async with running_bridge(tmp_path, [src], ingest=GRACE) as (bridge, out):
            await engine.wait_subscribed()
            await engine.publish(2)
            await engine.publish(1, payload=b"\xc1 not msgpack")
            await engine.publish(1)
            await wait_for(lambda: out.exists() and len(read_lines(out)) == 4, what="four records", timeout=10)
            assert bridge.readiness()[0], bridge.readiness()[1]  # one bad batch among good ones
            await engine.publish(UNDECODABLE_AFTER, payload=b"\xc1 not msgpack")
            detail = await not_ready(bridge)
            assert detail["not_ready"].startswith("no source sends anything decodable"), detail
            assert detail["sources_not_decodable"]["eng/0"].startswith("bad_msgpack: "), detail
            await engine.publish(1)
            await wait_for(lambda: bridge.readiness()[0], what="ready after a good batch", timeout=10)
            assert "sources_not_decodable" not in bridge.readiness()[1]


async def test_an_engine_whose_every_message_is_over_max_frame_bytes_is_not_taken_for_a_connected_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """breaker66 B1: every batch over ``ingest.max_frame_bytes``. ZMQ drops the connection at each
    one and says nothing else; the bridge read nothing, yet said ready between the drops (and
    "the engine went away" during them). Now 3 drops in a row before any message was read make
    the stream not connected (``dropped_unread``, naming the limit) across the reconnects, until
    a message is read."""
    caplog.set_level(logging.INFO)
    live, rep = free_port(), free_port()
    big = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, list(range(1000, 2000)), 16, None]], 0])  # 3 KB
    async with ScriptedEngine(live, rep) as engine:
        src = source("eng", f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{rep}")
        async with running_bridge(tmp_path, [src], ingest=GRACE | {"max_frame_bytes": "1KiB"}) as (bridge, out):

            async def publish_big() -> None:
                while True:
                    await engine.publish(1, payload=big)
                    await asyncio.sleep(0.1)

            publisher = asyncio.create_task(publish_big())
            try:
                await wait_for(lambda: problem(bridge, "eng/0", "dropped_unread") == 1, what="dropped_unread", timeout=30)
                for _ in range(20):  # across the reconnects that follow (one a second)
                    detail = await not_ready(bridge)
                    said = detail["sources_not_connected"]["eng/0"]
                    assert "times in a row before any message was read" in said and "max_frame_bytes (1024 bytes)" in said
                    await asyncio.sleep(0.1)
                assert not out.exists() or read_lines(out) == []
                (line,) = lines(caplog, "source reads nothing")
                assert line.levelno == logging.ERROR
            finally:
                publisher.cancel()
                await asyncio.gather(publisher, return_exceptions=True)
            for _ in range(50):  # (a small batch once the bridge has redialled)
                await engine.publish(1)
                if problem(bridge, "eng/0", "dropped_unread") == 0:
                    break
                await asyncio.sleep(0.2)
            await wait_for(lambda: bridge.readiness()[0], what="ready once a message is read", timeout=10)
