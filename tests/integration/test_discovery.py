"""DNS discovery end to end: a stub DNS server on 127.0.0.1 whose records the test changes,
simulated engines on other loopback addresses (127.0.0.2, 127.0.0.3, ...), and a running bridge
that resolves the name through ``discovery.dns.resolver``. Sources appear and disappear with the
records, events flow from newly found engines, and failures keep what is known."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from bridge.runtime import Bridge
from bridge.simulator import Simulator, SimulatorOptions
from tests.support.dns import StubDns, stub_dns
from tests.support.harness import batches, free_ports, free_ports_on, metric, read_lines, running_bridge, wait_for

pytestmark = pytest.mark.integration

NAME = "engines.test.svc.cluster.local"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


def _ports_free_on(hosts: list[str]) -> tuple[int, int]:
    """A PUB port and a replay port free on every host (discovery gives every engine the same ports)."""
    pub, replay = free_ports_on(hosts, 2)
    return pub, replay


@asynccontextmanager
async def _engines(hosts: list[str], ports: tuple[int, int]) -> AsyncIterator[dict[str, Simulator]]:
    async with AsyncExitStack() as stack:
        sims = {}
        for i, h in enumerate(hosts):
            opts = SimulatorOptions(endpoint=f"tcp://{h}:{ports[0]}", replay_endpoint=f"tcp://{h}:{ports[1]}", rate=0, seed=i + 1)
            sims[h] = await stack.enter_async_context(Simulator(opts))
        yield sims


def _discovery(dns: StubDns, ports: tuple[int, int], **extra: Any) -> dict[str, Any]:
    return {
        "dns": {
            "name": NAME,
            "port": ports[0],
            "replay_port": ports[1],
            "interval": "100ms",
            "timeout": "1s",
            "resolver": dns.address,
            "labels": {"model": "sim"},
            **extra,
        }
    }


def _sources(bridge: Bridge) -> set[str]:
    return {p.stream.source for p in bridge.pipelines.values()}


def _name(host: str) -> str:
    return "engines-" + host.replace(".", "-")


async def _publish_until_seen(sim: Simulator, out: Path, source: str, n: int) -> list[dict[str, Any]]:
    for _ in range(n):
        await sim.step()
    want = set(range(sim.ranks[0].published))
    await wait_for(lambda: {b["seq"] for b in batches(read_lines(out), source)} >= want, what=f"batches of {source}")
    return batches(read_lines(out), source)


async def test_sources_follow_the_records_and_events_flow(tmp_path: Path) -> None:
    ports = _ports_free_on(HOSTS)
    async with stub_dns() as dns, _engines(HOSTS[:2], ports) as sims:
        dns.records[NAME] = [HOSTS[0]]
        checkpoint = tmp_path / "checkpoint.json"
        async with running_bridge(
            tmp_path, [], discovery=_discovery(dns, ports), checkpoint={"path": str(checkpoint), "interval": "100ms"}
        ) as (bridge, out):
            # found during start-up: the first resolution happens before start() returns
            assert _sources(bridge) == {_name(HOSTS[0])}
            first = await _publish_until_seen(sims[HOSTS[0]], out, _name(HOSTS[0]), 20)
            assert [b["seq"] for b in first] == list(range(20))

            # a second engine: history published before it was discovered comes through replay
            for _ in range(5):
                await sims[HOSTS[1]].step()
            dns.records[NAME] = [HOSTS[0], HOSTS[1]]
            await wait_for(lambda: _name(HOSTS[1]) in _sources(bridge), what="second source")
            second = await _publish_until_seen(sims[HOSTS[1]], out, _name(HOSTS[1]), 15)
            assert [b["seq"] for b in second] == list(range(20))
            assert metric(bridge, "kv_bridge_discovery_sources") == 2

            # the first engine leaves DNS: its source goes, the other keeps flowing, its position is kept
            dns.records[NAME] = [HOSTS[1]]
            await wait_for(lambda: _sources(bridge) == {_name(HOSTS[1])}, what="first source removed")
            await _publish_until_seen(sims[HOSTS[1]], out, _name(HOSTS[1]), 5)
            assert bridge.checkpointer.snapshot()[1].streams[f"{_name(HOSTS[0])}/0"].seq == 19

            # it comes back: resumes after what was delivered (events published meanwhile are replayed)
            for _ in range(7):
                await sims[HOSTS[0]].step()
            dns.records[NAME] = [HOSTS[0], HOSTS[1]]
            await wait_for(lambda: _name(HOSTS[0]) in _sources(bridge), what="first source back")
            again = await _publish_until_seen(sims[HOSTS[0]], out, _name(HOSTS[0]), 3)
        seqs = [b["seq"] for b in again if "events" in b]
        assert sorted(set(seqs)) == list(range(30)), "every batch delivered"
        assert not [b for b in read_lines(out) if b.get("type") == "EventsLost"]
        labels = {b["source"] for b in read_lines(out)}
        assert labels == {_name(HOSTS[0]), _name(HOSTS[1])}


async def test_failures_keep_known_sources(tmp_path: Path) -> None:
    ports = _ports_free_on(HOSTS[:2])
    async with stub_dns() as dns, _engines(HOSTS[:2], ports) as sims:
        dns.records[NAME] = HOSTS[:2]
        cfg = _discovery(dns, ports, timeout="300ms", nxdomain_grace="1s")
        async with running_bridge(tmp_path, [], discovery=cfg) as (bridge, out):
            assert _sources(bridge) == {_name(h) for h in HOSTS[:2]}
            for mode in ("silent", "servfail"):
                dns.mode = mode
                target = dns.queries + 6
                await wait_for(lambda target=target: dns.queries >= target, what=f"resolutions while {mode}")
                assert _sources(bridge) == {_name(h) for h in HOSTS[:2]}, mode
            assert metric(bridge, "kv_bridge_discovery_resolutions_total", outcome="timeout") >= 1
            assert metric(bridge, "kv_bridge_discovery_resolutions_total", outcome="error") >= 1
            # engines keep flowing while DNS is broken
            await _publish_until_seen(sims[HOSTS[0]], out, _name(HOSTS[0]), 5)

            # a truncated UDP answer is asked again over TCP
            dns.mode = "truncate"
            dns.records[NAME] = [HOSTS[1]]
            await wait_for(lambda: _sources(bridge) == {_name(HOSTS[1])}, what="answer over TCP")

            # NXDOMAIN: kept for the grace, then the name counts as empty
            dns.mode = "ok"
            del dns.records[NAME]
            await wait_for(lambda: metric(bridge, "kv_bridge_discovery_resolutions_total", outcome="nxdomain") >= 3, what="nx")
            assert _sources(bridge) == {_name(HOSTS[1])}
            await wait_for(lambda: not _sources(bridge), timeout=5, what="removal after the grace")


async def test_sharded_replicas_split_the_engines(tmp_path: Path) -> None:
    ports = _ports_free_on(HOSTS)
    async with stub_dns() as dns, _engines(HOSTS, ports) as sims:
        dns.records[NAME] = HOSTS
        async with AsyncExitStack() as stack:
            bridges = []
            for i in range(2):
                workdir = tmp_path / f"replica-{i}"
                workdir.mkdir()
                cfg = _discovery(dns, ports, shard={"count": 2, "index": "auto", "pod_name": f"kv-event-bridge-{i}"})
                bridges.append(await stack.enter_async_context(running_bridge(workdir, [], discovery=cfg)))
            owned = [_sources(b) for b, _ in bridges]
            assert set.union(*owned) == {_name(h) for h in HOSTS}
            assert not owned[0] & owned[1]
            for sim in sims.values():
                for _ in range(4):
                    await sim.step()
            for (_, out), names in zip(bridges, owned, strict=True):
                await wait_for(
                    lambda out=out, names=names: (
                        {b["source"] for b in read_lines(out)} == names and len(read_lines(out)) >= 4 * len(names)
                    ),
                    what="each replica's own engines",
                )
                assert {b["source"] for b in read_lines(out)} == names


async def test_bridge_stops_cleanly_while_discovering(tmp_path: Path) -> None:
    """stop() cancels a resolution in flight: it does not wait it out (up to discovery.dns.timeout)."""
    ports = _ports_free_on(HOSTS[:1])
    hang = 6.0  # how long a resolution the server never answers takes
    loop = asyncio.get_running_loop()
    async with stub_dns() as dns:
        dns.records[NAME] = []  # start() resolves at once (an empty answer)
        async with running_bridge(tmp_path, [], discovery=_discovery(dns, ports, timeout=f"{hang}s")) as (bridge, _):
            assert bridge.discovery is not None
            # The clock starts before the hang: from here every query goes unanswered, and the
            # periodic resolution (every 100ms) asks within the wait below.
            dns.mode = "silent"
            asked = dns.queries
            started = loop.time()
            await wait_for(lambda: dns.queries > asked, timeout=hang / 3, what="a resolution in flight")
        elapsed = loop.time() - started
    # A stop() that waited for the resolution would return about `hang` after `started`.
    assert elapsed < hang / 2, f"stop() took {elapsed:.2f}s from the start of a {hang:.0f}s hanging resolution"


async def test_a_returning_source_resumes_after_what_it_delivered(tmp_path: Path) -> None:
    ports = _ports_free_on(HOSTS[:1])
    async with stub_dns() as dns, _engines(HOSTS[:1], ports) as sims:
        dns.records[NAME] = HOSTS[:1]
        async with running_bridge(tmp_path, [], discovery=_discovery(dns, ports)) as (bridge, out):
            await _publish_until_seen(sims[HOSTS[0]], out, _name(HOSTS[0]), 10)
            dns.records[NAME] = []
            await wait_for(lambda: not _sources(bridge), what="source removed")
            dns.records[NAME] = HOSTS[:1]
            await wait_for(lambda: bool(_sources(bridge)), what="source back")
            lines = await _publish_until_seen(sims[HOSTS[0]], out, _name(HOSTS[0]), 2)
        assert [b["seq"] for b in lines] == list(range(12))


async def test_ipv6_engines(tmp_path: Path) -> None:
    """AAAA records become tcp://[addr]:port sources (ZMQ needs its IPV6 option for those)."""
    base = free_ports(2)[0]
    for port in (base, base + 1):
        with socket.socket(socket.AF_INET6) as s:
            try:
                s.bind(("::1", port))
            except OSError as exc:
                pytest.skip(f"no IPv6 loopback here (or [::1]:{port} taken): {exc}")
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.IPV6, 1)
    opts = SimulatorOptions(endpoint=f"tcp://[::1]:{base}", replay_endpoint=f"tcp://[::1]:{base + 1}", rate=0)
    try:
        async with stub_dns() as dns, Simulator(opts, ctx) as sim:
            dns.records[NAME] = ["::1"]
            cfg = _discovery(dns, (base, base + 1))
            async with running_bridge(tmp_path, [], discovery=cfg) as (bridge, out):
                assert _sources(bridge) == {"engines---1"}
                lines = await _publish_until_seen(sim, out, "engines---1", 5)
            assert [b["seq"] for b in lines] == list(range(5))
            assert bridge.pipelines["engines---1/0"].stream.labels == {"model": "sim", "address": "::1"}
    finally:
        ctx.destroy(linger=0)
