"""DNS discovery: engines found at run time by resolving a (headless Service) name.

Every ``interval`` the name in ``discovery.dns`` is resolved (A and AAAA); each address becomes
one source named ``<prefix>-<address>`` (dots and colons as dashes, so the name is safe in Kafka
keys, Redis keys and NATS subjects) reading ``tcp://address:port`` and, when configured,
``tcp://address:replay_port``. Sources are added and removed live through the bridge's
``add_source`` / ``remove_source``; a removed source's already queued batches are still delivered
and its checkpoint position is kept (a source that comes back resumes from it).

Failures never drop what is known: a timeout or a server failure keeps every known source, and so
does NXDOMAIN for ``nxdomain_grace`` (a Service being recreated); only a successful answer that
lacks a source removes it. After the grace, NXDOMAIN counts as an empty answer, because a headless
Service with no ready pods answers NXDOMAIN, not an empty record set.

With ``shard: {count: N, index: i}`` a replica keeps only the sources whose stable hash (the first
8 bytes of sha1 of the source name) modulo N is i, so N replicas over the same name split the
engines between them without talking to each other. ``index: auto`` takes i from the trailing
``-N`` of the pod name (a StatefulSet ordinal).

The pure parts (naming, sharding, the diff, the DNS wire format) have no I/O; :class:`Discovery`
is the thin shell around them. The system resolver is used through ``loop.getaddrinfo``; a
``resolver: host:port`` asks that DNS server directly over UDP (TCP when the answer is truncated),
which is how the tests run against a stub server and how a caching resolver can be bypassed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import random
import re
import socket
import struct
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from .config import DnsDiscovery, SourceConfig
from .errors import BridgeError, ConfigError

log = logging.getLogger("bridge.discovery")

Outcome = Literal["ok", "nxdomain", "timeout", "error"]


class ResolveError(BridgeError):
    """A resolution that gave no usable answer; ``kind`` is nxdomain, timeout or error."""

    def __init__(self, kind: Outcome, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind: Outcome = kind
        self.detail = detail


# -- pure: names, shards, the diff ----------------------------------------------------------------


def default_prefix(dns_name: str) -> str:
    """The first label of the DNS name (``vllm-kv.default.svc.cluster.local`` -> ``vllm-kv``)."""
    return dns_name.strip(".").split(".", 1)[0]


def source_name(prefix: str, address: str) -> str:
    """``<prefix>-<address>`` with ``.`` and ``:`` as ``-`` (stable for as long as the address is)."""
    return f"{prefix}-{address.replace('.', '-').replace(':', '-')}"


def tcp_endpoint(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def shard_of(name: str, count: int) -> int:
    """The shard of a source: sha1 (not ``hash()``, which is salted per process) so every replica
    and every restart agree."""
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big") % count


_ORDINAL = re.compile(r"-(\d+)$")


def ordinal(pod_name: str) -> int:
    """The trailing ``-N`` of a StatefulSet pod name; raises ConfigError when there is none."""
    m = _ORDINAL.search(pod_name)
    if m is None:
        raise ConfigError(
            [f"discovery.dns.shard.index: auto needs a pod name ending in -N (a StatefulSet pod), got {pod_name!r}"]
        )
    return int(m.group(1))


def shard_position(config: DnsDiscovery, hostname: Callable[[], str] = socket.gethostname) -> tuple[int, int]:
    """(index, count) of this replica; (0, 1) without sharding. Raises ConfigError."""
    shard = config.shard
    if shard is None:
        return 0, 1
    if shard.index != "auto":
        return shard.index, shard.count
    index = ordinal(shard.pod_name or hostname())
    if index >= shard.count:
        raise ConfigError(
            [
                f"discovery.dns.shard: this pod's ordinal {index} is not below count {shard.count} "
                "(more replicas than shard.count: set count to the replica count)"
            ]
        )
    return index, shard.count


def normalise(address: str) -> str:
    """The canonical text of an IP address (``fd00:0::1`` -> ``fd00::1``); scope ids dropped."""
    return ipaddress.ip_address(address.split("%", 1)[0]).compressed


def source_for(config: DnsDiscovery, address: str, prefix: str) -> SourceConfig:
    """The source of one discovered engine address."""
    return SourceConfig(
        name=source_name(prefix, address),
        endpoint=tcp_endpoint(address, config.port),
        replay_endpoint=tcp_endpoint(address, config.replay_port) if config.replay_port is not None else None,
        topic=config.topic,
        dp_ranks=config.dp_ranks,
        labels={**config.labels, "address": address},
        snapshot=config.snapshot,
        snapshot_endpoint=tcp_endpoint(address, config.snapshot_port) if config.snapshot_port is not None else None,
    )


def desired_sources(
    config: DnsDiscovery, addresses: Iterable[str], *, prefix: str, index: int = 0, count: int = 1
) -> dict[str, SourceConfig]:
    """The sources this replica should read, by name, given the resolved addresses."""
    out: dict[str, SourceConfig] = {}
    for address in addresses:
        source = source_for(config, address, prefix)
        if count == 1 or shard_of(source.name, count) == index:
            out[source.name] = source
    return out


@dataclass(frozen=True)
class Plan:
    """What one resolution changes: sources to add and names to remove (both sorted)."""

    add: list[SourceConfig] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.add or self.remove)


def diff(known: Iterable[str], desired: Mapping[str, SourceConfig]) -> Plan:
    """Sources in ``desired`` but not ``known`` are added; ``known`` names not desired are removed."""
    have = set(known)
    return Plan(
        add=[desired[n] for n in sorted(desired.keys() - have)],
        remove=sorted(have - desired.keys()),
    )


# -- pure: the DNS wire format (RFC 1035, EDNS0 from RFC 6891) -------------------------------------

QTYPE_A = 1
QTYPE_AAAA = 28
_QTYPE_OPT = 41
_RCODE_NXDOMAIN = 3
_EDNS_UDP_SIZE = 4096  # a headless Service with many pods does not fit in 512 bytes


class DnsFormatError(ValueError):
    """A DNS message that cannot be parsed."""


@dataclass(frozen=True)
class DnsAnswer:
    rcode: int
    truncated: bool
    addresses: list[str]


def encode_query(query_id: int, name: str, qtype: int) -> bytes:
    """A recursive query for ``name`` with an EDNS0 OPT record advertising a 4 KiB UDP size."""
    qname = b""
    for label in name.strip(".").split("."):
        raw = label.encode("idna") if not label.isascii() else label.encode()
        if not 0 < len(raw) < 64:
            raise ValueError(f"bad DNS label in {name!r}")
        qname += bytes([len(raw)]) + raw
    header = struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 1)  # RD; one question; one additional (OPT)
    opt = b"\x00" + struct.pack("!HHIH", _QTYPE_OPT, _EDNS_UDP_SIZE, 0, 0)
    return header + qname + b"\x00" + struct.pack("!HH", qtype, 1) + opt


def _skip_name(data: bytes, pos: int) -> int:
    while True:
        if pos >= len(data):
            raise DnsFormatError("name runs past the end")
        n = data[pos]
        if n & 0xC0 == 0xC0:  # compression pointer: the name ends here
            if pos + 2 > len(data):
                raise DnsFormatError("truncated pointer")
            return pos + 2
        if n & 0xC0:
            raise DnsFormatError("unknown label type")
        pos += 1 + n
        if n == 0:
            return pos


def parse_response(data: bytes, query_id: int) -> DnsAnswer:
    """The rcode, TC bit and A/AAAA addresses of a response to ``query_id``.

    Every A/AAAA record of the answer section counts, whatever its owner name, because a
    recursive server puts a CNAME chain's target records there.
    """
    if len(data) < 12:
        raise DnsFormatError("short header")
    qid, flags, qd, an, _, _ = struct.unpack_from("!HHHHHH", data)
    if qid != query_id or not flags & 0x8000:
        raise DnsFormatError("not a response to this query")
    pos = 12
    for _ in range(qd):
        pos = _skip_name(data, pos) + 4
    addresses: list[str] = []
    for _ in range(an):
        pos = _skip_name(data, pos)
        if pos + 10 > len(data):
            raise DnsFormatError("truncated record")
        rtype, _, _, rdlen = struct.unpack_from("!HHIH", data, pos)
        pos += 10
        rdata = data[pos : pos + rdlen]
        if len(rdata) != rdlen:
            raise DnsFormatError("truncated record data")
        pos += rdlen
        if rtype == QTYPE_A and rdlen == 4:
            addresses.append(str(ipaddress.IPv4Address(rdata)))
        elif rtype == QTYPE_AAAA and rdlen == 16:
            addresses.append(ipaddress.IPv6Address(rdata).compressed)
    return DnsAnswer(rcode=flags & 0x000F, truncated=bool(flags & 0x0200), addresses=addresses)


# -- resolvers ------------------------------------------------------------------------------------


class Resolver(Protocol):
    async def resolve(self, name: str) -> frozenset[str]:
        """Every address of ``name``; raises ResolveError."""
        ...


class SystemResolver:
    """The system resolver (``/etc/resolv.conf``, search domains, nsswitch) via ``getaddrinfo``."""

    _NOT_FOUND = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

    async def resolve(self, name: str) -> frozenset[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(name, None, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            # getaddrinfo cannot tell NXDOMAIN from "no records": both count as not found.
            kind: Outcome = "nxdomain" if exc.errno in self._NOT_FOUND else "error"
            raise ResolveError(kind, exc.strerror or str(exc)) from exc
        except OSError as exc:
            raise ResolveError("error", str(exc)) from exc
        return frozenset(normalise(str(info[4][0])) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6))


class _Datagram(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.replies: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.replies.put_nowait(data)


class UdpResolver:
    """Asks one DNS server directly: A and AAAA over UDP, again over TCP when truncated.

    Queries are resent every ``retransmit`` seconds (UDP loses packets); the caller bounds the whole
    resolution with a timeout.
    """

    def __init__(self, server: str, *, retransmit: float = 1.0) -> None:
        host, _, port = server.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self.retransmit = retransmit
        self._ids = random.Random()

    async def resolve(self, name: str) -> frozenset[str]:
        answers = await asyncio.gather(self._ask(name, QTYPE_A), self._ask(name, QTYPE_AAAA))
        if all(a.rcode == _RCODE_NXDOMAIN for a in answers):
            raise ResolveError("nxdomain", f"{name} does not exist")
        for a in answers:
            if a.rcode not in (0, _RCODE_NXDOMAIN):
                raise ResolveError("error", f"{name}: DNS server answered rcode {a.rcode}")
        return frozenset(addr for a in answers for addr in a.addresses)

    async def _ask(self, name: str, qtype: int) -> DnsAnswer:
        query_id = self._ids.getrandbits(16)
        query = encode_query(query_id, name, qtype)
        answer = await self._udp(query, query_id)
        if answer.truncated:
            answer = await self._tcp(query, query_id)
        return answer

    async def _udp(self, query: bytes, query_id: int) -> DnsAnswer:
        loop = asyncio.get_running_loop()
        transport, proto = await loop.create_datagram_endpoint(_Datagram, remote_addr=(self.host, self.port))
        try:
            while True:
                transport.sendto(query)
                deadline = loop.time() + self.retransmit
                while (left := deadline - loop.time()) > 0:
                    try:
                        async with asyncio.timeout(left):
                            data = await proto.replies.get()
                    except TimeoutError:
                        break
                    with contextlib.suppress(DnsFormatError):  # a stray or late datagram: keep waiting
                        return parse_response(data, query_id)
        finally:
            transport.close()

    async def _tcp(self, query: bytes, query_id: int) -> DnsAnswer:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(struct.pack("!H", len(query)) + query)
            await writer.drain()
            (size,) = struct.unpack("!H", await reader.readexactly(2))
            return parse_response(await reader.readexactly(size), query_id)
        except (DnsFormatError, asyncio.IncompleteReadError) as exc:
            raise ResolveError("error", f"bad answer over TCP: {exc}") from exc
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


# -- the shell ------------------------------------------------------------------------------------


class SourceTarget(Protocol):
    """What discovery drives: the bridge."""

    zmq_context: Any

    async def add_source(self, source: SourceConfig) -> None: ...

    async def remove_source(self, name: str) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...


class Discovery:
    """Keeps the bridge's discovered sources in line with DNS. ``start()`` resolves once (bounded
    by ``timeout``; a failure is logged, not raised) and then re-resolves every ``interval``."""

    def __init__(
        self,
        config: DnsDiscovery,
        target: SourceTarget,
        *,
        registry: CollectorRegistry | None = None,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
        hostname: Callable[[], str] = socket.gethostname,
        reserved: Iterable[str] = (),
    ) -> None:
        self.config = config
        self.reserved = frozenset(reserved)  # static source names: never added or removed by discovery
        self.target = target
        self.resolver: Resolver = resolver or (UdpResolver(config.resolver) if config.resolver else SystemResolver())
        self.clock = clock
        self.index, self.count = shard_position(config, hostname)  # a bad shard fails start-up, not later
        self.prefix = config.name_prefix or default_prefix(config.name)
        self.known: dict[str, SourceConfig] = {}
        self.addresses: frozenset[str] = frozenset()
        self._nxdomain_since: float | None = None
        self._last_outcome: Outcome | None = None
        self._empty_said = False  # the "resolves to no engine" warning was logged for the current answer
        self._task: asyncio.Task[None] | None = None
        r = registry or CollectorRegistry()
        self._m_resolutions = Counter(
            "kv_bridge_discovery_resolutions",
            "DNS resolutions by outcome: ok, nxdomain, timeout, error.",
            ["outcome"],
            registry=r,
        )
        self._m_addresses = Gauge("kv_bridge_discovery_addresses", "Addresses in the last successful answer.", registry=r)
        self._m_sources = Gauge("kv_bridge_discovery_sources", "Discovered sources this replica reads.", registry=r)
        self._m_shard = Gauge(
            "kv_bridge_discovery_shard", "This replica's shard (value: index) out of count.", ["count"], registry=r
        )
        self._m_shard.labels(str(self.count)).set(self.index)

    async def start(self) -> None:
        log.info(
            "discovery started",
            extra={"dns_name": self.config.name, "interval": self.config.interval, "shard": f"{self.index}/{self.count}"},
        )
        await self.refresh()
        self._task = self.target.spawn(self._loop(), "discovery")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            await self.refresh()

    async def refresh(self) -> Plan:
        """Resolve once and apply the result; returns what changed."""
        name = self.config.name
        try:
            async with asyncio.timeout(self.config.timeout):
                addresses = await self.resolver.resolve(name)
        except (ResolveError, TimeoutError, OSError) as exc:
            if isinstance(exc, ResolveError):
                err = exc
            else:
                err = ResolveError("timeout" if isinstance(exc, TimeoutError) else "error", str(exc) or type(exc).__name__)
            self._m_resolutions.labels(err.kind).inc()
            found = self._after_failure(err)
            if found is None:
                return Plan()
            addresses = found
        else:
            self._m_resolutions.labels("ok").inc()
            self._nxdomain_since = None
            if self._last_outcome not in (None, "ok"):
                log.info("DNS resolution recovered", extra={"dns_name": name, "addresses": len(addresses)})
            self._last_outcome = "ok"
        found = frozenset(normalise(a) for a in addresses)
        if not found and (self.addresses or not self._empty_said):
            # Once per change: a typo in the Service name or namespace looks exactly like this.
            log.warning(
                "DNS name resolves to no engine: check discovery.dns.name (Service and namespace) and that the "
                "Service is headless with ready pods",
                extra={"dns_name": name},
            )
        self._empty_said = not found
        self.addresses = found
        self._m_addresses.set(len(self.addresses))
        desired = desired_sources(self.config, self.addresses, prefix=self.prefix, index=self.index, count=self.count)
        plan = diff(self.known, {n: s for n, s in desired.items() if n not in self.reserved})
        await self._apply(plan)
        return plan

    def _after_failure(self, err: ResolveError) -> frozenset[str] | None:
        """None: keep the known sources; a set: act as if DNS answered it (NXDOMAIN after the grace)."""
        now = self.clock()
        if err.kind == "nxdomain":
            if self._nxdomain_since is None:
                self._nxdomain_since = now
            grace = self.config.nxdomain_grace
            if grace is not None and now - self._nxdomain_since >= grace:
                if self.known:
                    log.warning(
                        "DNS name still does not exist after the grace: removing its sources",
                        extra={"dns_name": self.config.name, "sources": len(self.known), "grace": grace},
                    )
                self._last_outcome = err.kind
                return frozenset()
        log.warning(
            "DNS resolution failed, keeping the known sources",
            extra={"dns_name": self.config.name, "outcome": err.kind, "error": err.detail, "sources": len(self.known)},
        )
        self._last_outcome = err.kind
        return None

    async def _apply(self, plan: Plan) -> None:
        for name in plan.remove:
            log.info("discovered source gone: removing", extra={"source": name})
            await self.target.remove_source(name)
            del self.known[name]
        for source in plan.add:
            try:
                await self.target.add_source(source)
            except ConfigError as exc:  # e.g. an address the endpoint arithmetic refuses: skip it, go on
                log.error("cannot add a discovered source", extra={"source": source.name, "error": str(exc)})
                continue
            self.known[source.name] = source
            log.info("source discovered", extra={"source": source.name, "endpoint": source.endpoint})
        self._m_sources.set(len(self.known))
