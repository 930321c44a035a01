"""DNS discovery without sockets: naming, sharding, the diff, the DNS wire format, and the
refresh logic (failures keep sources, NXDOMAIN grace, shards) against a fake resolver."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.config import DnsDiscovery, ShardConfig, SourceConfig, from_data
from bridge.discovery import (
    QTYPE_A,
    QTYPE_AAAA,
    Discovery,
    DnsFormatError,
    ResolveError,
    default_prefix,
    desired_sources,
    diff,
    encode_query,
    ordinal,
    parse_response,
    shard_of,
    shard_position,
    source_for,
    source_name,
    tcp_endpoint,
)
from bridge.errors import ConfigError
from tests.support.dns import build_response, parse_query

ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(lambda a: a.compressed)
addresses = st.frozensets(ipv4 | ipv6, max_size=30)


# -- names ----------------------------------------------------------------------------------------


def test_names_and_endpoints() -> None:
    assert default_prefix("vllm-kv.default.svc.cluster.local.") == "vllm-kv"
    assert default_prefix("engines") == "engines"
    assert source_name("vllm-kv", "10.1.2.3") == "vllm-kv-10-1-2-3"
    assert source_name("vllm-kv", "fd00::1") == "vllm-kv-fd00--1"
    assert tcp_endpoint("10.1.2.3", 5557) == "tcp://10.1.2.3:5557"
    assert tcp_endpoint("fd00::1", 5557) == "tcp://[fd00::1]:5557"


def test_source_for_carries_every_setting() -> None:
    cfg = DnsDiscovery(name="x.ns.svc", port=6000, replay_port=6100, topic="kv", dp_ranks=2, labels={"model": "m"})
    s = source_for(cfg, "10.0.0.7", "x")
    assert s == SourceConfig(
        name="x-10-0-0-7",
        endpoint="tcp://10.0.0.7:6000",
        replay_endpoint="tcp://10.0.0.7:6100",
        topic="kv",
        dp_ranks=2,
        labels={"model": "m", "address": "10.0.0.7"},
    )
    assert source_for(DnsDiscovery(name="x", replay_port=None), "10.0.0.7", "x").replay_endpoint is None


@given(addresses)
def test_names_are_unique_per_address(addrs: frozenset[str]) -> None:
    names = {source_name("p", a) for a in addrs}
    assert len(names) == len(addrs)


# -- sharding -------------------------------------------------------------------------------------


def test_shard_hash_is_pinned() -> None:
    # A different hash would move every source to another replica on upgrade: these values are a contract.
    assert [shard_of(f"vllm-kv-10-0-0-{i}", 3) for i in range(8)] == [0, 2, 0, 2, 2, 1, 1, 2]
    assert shard_of("llama-a", 2**64) == 18239670775260732835  # the first 8 bytes of sha1, big-endian
    assert shard_of("vllm-kv-10-0-0-1", 1) == 0


@given(st.lists(ipv4, min_size=1, max_size=60, unique=True), st.integers(1, 8))
def test_every_source_is_read_by_exactly_one_shard(addrs: list[str], count: int) -> None:
    cfg = DnsDiscovery(name="x")
    shares = [desired_sources(cfg, addrs, prefix="x", index=i, count=count) for i in range(count)]
    names = [n for share in shares for n in share]
    assert sorted(names) == sorted(source_name("x", a) for a in addrs)


def test_shards_are_roughly_even() -> None:
    names = [source_name("vllm", f"10.0.{i // 250}.{i % 250}") for i in range(3000)]
    counts = [0, 0, 0]
    for n in names:
        counts[shard_of(n, 3)] += 1
    assert all(900 < c < 1100 for c in counts), counts


def test_ordinal_from_pod_name() -> None:
    assert ordinal("kv-event-bridge-0") == 0
    assert ordinal("release-kv-event-bridge-12") == 12
    with pytest.raises(ConfigError, match="ending in -N"):
        ordinal("kv-event-bridge-7d9f8c-abcde")


def test_shard_position() -> None:
    assert shard_position(DnsDiscovery(name="x")) == (0, 1)
    assert shard_position(DnsDiscovery(name="x", shard=ShardConfig(count=4, index=2))) == (2, 4)
    auto = DnsDiscovery(name="x", shard=ShardConfig(count=4))
    assert shard_position(auto, lambda: "bridge-3") == (3, 4)
    named = DnsDiscovery(name="x", shard=ShardConfig(count=4, pod_name="bridge-1"))
    assert shard_position(named, lambda: "bridge-3") == (1, 4)
    with pytest.raises(ConfigError, match="not below count 4"):
        shard_position(auto, lambda: "bridge-4")
    with pytest.raises(ConfigError, match="ending in -N"):
        shard_position(auto, lambda: "laptop")


def test_shard_config_errors_have_paths() -> None:
    base: dict[str, Any] = {"sinks": [{"type": "file", "path": "-"}]}
    with pytest.raises(ConfigError) as exc:
        from_data({**base, "discovery": {"dns": {"name": "x", "shard": {"count": 2, "index": 2}}}}, env={})
    assert exc.value.problems == ["discovery.dns.shard: index 2 must be below count 2"]
    with pytest.raises(ConfigError) as exc:
        from_data({**base, "discovery": {"dns": {"name": "x", "shard": {"index": "first"}}}}, env={})
    assert sorted(exc.value.problems) == [
        "discovery.dns.shard.count: required key is missing",
        'discovery.dns.shard.index: expected int | "auto", got "first"',
    ]
    cfg = from_data({**base, "discovery": {"dns": {"name": "x", "shard": {"count": "3", "index": "${IDX}"}}}}, env={"IDX": "1"})
    assert cfg.discovery.dns is not None and cfg.discovery.dns.shard == ShardConfig(count=3, index=1)


# -- the diff -------------------------------------------------------------------------------------


@given(st.frozensets(st.sampled_from([f"s{i}" for i in range(12)])), addresses)
def test_diff_turns_known_into_desired(known: frozenset[str], addrs: frozenset[str]) -> None:
    desired = desired_sources(DnsDiscovery(name="x"), addrs, prefix="x")
    plan = diff(known, desired)
    after = (set(known) - set(plan.remove)) | {s.name for s in plan.add}
    assert after == set(desired)
    assert not set(plan.remove) & {s.name for s in plan.add}
    assert plan.remove == sorted(plan.remove) and [s.name for s in plan.add] == sorted(s.name for s in plan.add)
    assert bool(plan) == (set(known) != set(desired))


# -- DNS wire format ------------------------------------------------------------------------------


def test_query_encoding() -> None:
    q = encode_query(0x1234, "vllm-kv.default.svc.cluster.local.", QTYPE_AAAA)
    assert parse_query(q) == (0x1234, "vllm-kv.default.svc.cluster.local", QTYPE_AAAA)
    assert q[2:4] == b"\x01\x00"  # recursion desired
    assert q.endswith(b"\x00\x00\x29\x10\x00\x00\x00\x00\x00\x00\x00")  # EDNS0 OPT: 4096-byte UDP answers
    with pytest.raises(ValueError):
        encode_query(1, "a" * 64 + ".example", QTYPE_A)


@pytest.mark.parametrize("compress", [True, False])
def test_parse_answers(compress: bool) -> None:
    addrs = ["10.0.0.1", "10.0.0.2", "fd00::5"]
    a = parse_response(build_response(7, "x.ns.svc", QTYPE_A, addrs, compress=compress), 7)
    assert (a.rcode, a.truncated, a.addresses) == (0, False, ["10.0.0.1", "10.0.0.2"])
    aaaa = parse_response(build_response(7, "x.ns.svc", QTYPE_AAAA, addrs, compress=compress), 7)
    assert aaaa.addresses == ["fd00::5"]


def test_parse_cname_chain_nxdomain_truncated() -> None:
    chained = parse_response(build_response(9, "alias.ns", QTYPE_A, ["10.9.9.9"], cname="real.ns.svc"), 9)
    assert chained.addresses == ["10.9.9.9"]
    assert parse_response(build_response(9, "gone.ns", QTYPE_A, None), 9).rcode == 3
    t = parse_response(build_response(9, "big.ns", QTYPE_A, ["10.0.0.1"], truncated=True), 9)
    assert t.truncated and t.addresses == []


def test_parse_rejects_other_queries_and_garbage() -> None:
    good = build_response(5, "x.ns", QTYPE_A, ["10.0.0.1"])
    with pytest.raises(DnsFormatError):
        parse_response(good, 6)
    with pytest.raises(DnsFormatError):
        parse_response(good[:-3], 5)
    with pytest.raises(DnsFormatError):
        parse_response(encode_query(5, "x.ns", QTYPE_A), 5)  # a query, not a response


@given(st.binary(max_size=300))
def test_parse_never_fails_otherwise(data: bytes) -> None:
    try:
        answer = parse_response(data, int.from_bytes(data[:2], "big") if len(data) >= 2 else 0)
    except DnsFormatError:
        return
    for a in answer.addresses:
        ipaddress.ip_address(a)


@given(st.lists(ipv4 | ipv6, max_size=40), st.sampled_from([QTYPE_A, QTYPE_AAAA]), st.booleans())
def test_response_round_trip(addrs: list[str], qtype: int, compress: bool) -> None:
    answer = parse_response(build_response(77, "svc.ns.svc.cluster.local", qtype, addrs, compress=compress), 77)
    version = 4 if qtype == QTYPE_A else 6
    assert answer.addresses == [ipaddress.ip_address(a).compressed for a in addrs if ipaddress.ip_address(a).version == version]


# -- the refresh logic ----------------------------------------------------------------------------


class FakeResolver:
    def __init__(self) -> None:
        self.answer: frozenset[str] | ResolveError | TimeoutError = frozenset()

    async def resolve(self, name: str) -> frozenset[str]:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class FakeBridge:
    zmq_context: Any = None

    def __init__(self) -> None:
        self.sources: dict[str, SourceConfig] = {}
        self.log: list[str] = []

    async def add_source(self, source: SourceConfig) -> None:
        self.sources[source.name] = source
        self.log.append(f"+{source.name}")

    async def remove_source(self, name: str) -> None:
        self.sources.pop(name, None)
        self.log.append(f"-{name}")

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return asyncio.create_task(coro, name=name)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _discovery(**dns: Any) -> tuple[Discovery, FakeResolver, FakeBridge, Clock]:
    resolver, bridge, clock = FakeResolver(), FakeBridge(), Clock()
    config = DnsDiscovery(name="vllm.ns.svc.cluster.local", **dns)
    return Discovery(config, bridge, resolver=resolver, clock=clock), resolver, bridge, clock


async def test_sources_follow_successful_answers() -> None:
    d, resolver, bridge, _ = _discovery()
    resolver.answer = frozenset({"10.0.0.1", "10.0.0.2"})
    plan = await d.refresh()
    assert [s.name for s in plan.add] == ["vllm-10-0-0-1", "vllm-10-0-0-2"] and not plan.remove
    assert set(bridge.sources) == {"vllm-10-0-0-1", "vllm-10-0-0-2"}
    resolver.answer = frozenset({"10.0.0.2", "10.0.0.3"})
    await d.refresh()
    assert set(bridge.sources) == {"vllm-10-0-0-2", "vllm-10-0-0-3"}
    assert not await d.refresh()  # unchanged answer: nothing to do
    resolver.answer = frozenset()  # NOERROR, no records: a successful answer without them
    await d.refresh()
    assert bridge.sources == {}
    assert bridge.log == [
        "+vllm-10-0-0-1",
        "+vllm-10-0-0-2",
        "-vllm-10-0-0-1",
        "+vllm-10-0-0-3",
        "-vllm-10-0-0-2",
        "-vllm-10-0-0-3",
    ]


@pytest.mark.parametrize("failure", [ResolveError("timeout", "no answer"), ResolveError("error", "SERVFAIL"), TimeoutError()])
async def test_transient_failures_keep_sources(failure: BaseException) -> None:
    d, resolver, bridge, clock = _discovery()
    resolver.answer = frozenset({"10.0.0.1"})
    await d.refresh()
    resolver.answer = failure  # type: ignore[assignment]
    for _ in range(100):
        clock.now += 3600
        assert not await d.refresh()
    assert set(bridge.sources) == {"vllm-10-0-0-1"}


async def test_nxdomain_keeps_sources_for_the_grace_then_removes_them() -> None:
    d, resolver, bridge, clock = _discovery(nxdomain_grace=60.0)
    resolver.answer = frozenset({"10.0.0.1"})
    await d.refresh()
    resolver.answer = ResolveError("nxdomain", "gone")
    await d.refresh()
    clock.now += 30
    resolver.answer = ResolveError("timeout", "slow")  # a timeout inside the streak does not restart it
    await d.refresh()
    clock.now += 29
    resolver.answer = ResolveError("nxdomain", "gone")
    await d.refresh()
    assert set(bridge.sources) == {"vllm-10-0-0-1"}
    clock.now += 1
    plan = await d.refresh()
    assert plan.remove == ["vllm-10-0-0-1"] and bridge.sources == {}
    # a good answer ends the streak: the next NXDOMAIN gets a full grace again
    resolver.answer = frozenset({"10.0.0.4"})
    await d.refresh()
    resolver.answer = ResolveError("nxdomain", "gone")
    clock.now += 59
    await d.refresh()
    assert set(bridge.sources) == {"vllm-10-0-0-4"}


async def test_nxdomain_never_removes_without_a_grace() -> None:
    d, resolver, bridge, clock = _discovery(nxdomain_grace=None)
    resolver.answer = frozenset({"10.0.0.1"})
    await d.refresh()
    resolver.answer = ResolveError("nxdomain", "gone")
    clock.now += 10**6
    await d.refresh()
    assert set(bridge.sources) == {"vllm-10-0-0-1"}


async def test_shards_split_the_sources() -> None:
    addrs = frozenset(f"10.0.0.{i}" for i in range(1, 40))
    seen: list[set[str]] = []
    for i in range(3):
        resolver, bridge = FakeResolver(), FakeBridge()
        config = DnsDiscovery(name="vllm.ns", shard=ShardConfig(count=3, pod_name=f"kv-event-bridge-{i}"))
        d = Discovery(config, bridge, resolver=resolver)
        resolver.answer = addrs
        await d.refresh()
        assert all(shard_of(n, 3) == i for n in bridge.sources)
        seen.append(set(bridge.sources))
    assert set.union(*seen) == {source_name("vllm", a) for a in addrs}
    assert sum(map(len, seen)) == len(addrs)


async def test_static_sources_are_left_alone_and_loop_runs() -> None:
    resolver, bridge = FakeResolver(), FakeBridge()
    config = DnsDiscovery(name="vllm.ns", interval=0.01)  # type: ignore[arg-type]
    d = Discovery(config, bridge, resolver=resolver, reserved=["vllm-10-0-0-1"])
    resolver.answer = frozenset({"10.0.0.1", "10.0.0.2"})
    await d.start()
    try:
        assert set(bridge.sources) == {"vllm-10-0-0-2"}
        resolver.answer = frozenset({"10.0.0.3"})
        for _ in range(200):
            if set(bridge.sources) == {"vllm-10-0-0-3"}:
                break
            await asyncio.sleep(0.01)
        assert set(bridge.sources) == {"vllm-10-0-0-3"}
        assert "-vllm-10-0-0-1" not in bridge.log
    finally:
        await d.stop()


async def test_a_source_the_bridge_refuses_is_skipped_and_retried() -> None:
    d, resolver, bridge, _ = _discovery()

    async def refuse(source: SourceConfig) -> None:
        raise ConfigError([f"{source.endpoint}: refused"])

    bridge.add_source = refuse  # type: ignore[method-assign]
    resolver.answer = frozenset({"10.0.0.1"})
    assert [s.name for s in (await d.refresh()).add] == ["vllm-10-0-0-1"]
    assert d.known == {}
    assert [s.name for s in (await d.refresh()).add] == ["vllm-10-0-0-1"]  # tried again next time
