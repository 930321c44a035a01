"""A stub DNS server for discovery tests: answers A/AAAA from a dict the test mutates.

``records`` maps a name (no trailing dot, lowercase) to its addresses; a name that is absent
answers NXDOMAIN, a name mapped to ``[]`` answers NOERROR with no records. ``mode`` makes it
misbehave: ``silent`` (no answer: the client times out), ``servfail``, or ``truncate`` (UDP answers
carry only the TC bit, so the client must retry over TCP, which answers in full).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

A, AAAA = 1, 28
Mode = Literal["ok", "silent", "servfail", "truncate"]


def encode_name(name: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in name.strip(".").split(".") if p) + b"\x00"


def build_response(
    query_id: int,
    name: str,
    qtype: int,
    addresses: list[str] | None,
    *,
    rcode: int = 0,
    truncated: bool = False,
    compress: bool = True,
    cname: str | None = None,
) -> bytes:
    """A response to one question; ``addresses`` of the matching family become answer records
    (owned by ``cname`` when given, after a CNAME record from ``name``)."""
    if addresses is None and rcode == 0:
        rcode = 3
    records: list[bytes] = []
    owner = b"\xc0\x0c" if compress else encode_name(name)  # pointer to the question's name
    if cname is not None:
        target = encode_name(cname)
        records.append(owner + struct.pack("!HHIH", 5, 1, 30, len(target)) + target)
        owner = target
    for address in addresses or []:
        ip = ipaddress.ip_address(address)
        rtype = A if ip.version == 4 else AAAA
        if rtype == qtype and not truncated:
            records.append(owner + struct.pack("!HHIH", rtype, 1, 30, len(ip.packed)) + ip.packed)
    flags = 0x8180 | rcode | (0x0200 if truncated else 0)
    header = struct.pack("!HHHHHH", query_id, flags, 1, len(records), 0, 0)
    return header + encode_name(name) + struct.pack("!HH", qtype, 1) + b"".join(records)


def parse_query(data: bytes) -> tuple[int, str, int]:
    """(id, name, qtype) of a query."""
    (query_id,) = struct.unpack_from("!H", data)
    pos, labels = 12, []
    while data[pos]:
        n = data[pos]
        labels.append(data[pos + 1 : pos + 1 + n].decode())
        pos += 1 + n
    (qtype,) = struct.unpack_from("!H", data, pos + 1)
    return query_id, ".".join(labels).lower(), qtype


class StubDns:
    """Serves ``records`` on 127.0.0.1 over UDP and TCP on one port (``address`` is host:port)."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.mode: Mode = "ok"
        self.queries = 0
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def answer(self, data: bytes, *, over_tcp: bool) -> bytes | None:
        self.queries += 1
        query_id, name, qtype = parse_query(data)
        if self.mode == "silent":
            return None
        if self.mode == "servfail":
            return build_response(query_id, name, qtype, [], rcode=2)
        truncated = self.mode == "truncate" and not over_tcp
        return build_response(query_id, name, qtype, self.records.get(name), truncated=truncated)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        stub = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: Any) -> None:
                reply = stub.answer(data, over_tcp=False)
                if reply is not None:
                    self.transport.sendto(reply, addr)

        transport, _ = await loop.create_datagram_endpoint(Udp, local_addr=("127.0.0.1", 0))
        self._udp = transport
        self.port = transport.get_extra_info("sockname")[1]
        self._tcp = await asyncio.start_server(self._serve_tcp, "127.0.0.1", self.port)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (size,) = struct.unpack("!H", await reader.readexactly(2))
            reply = self.answer(await reader.readexactly(size), over_tcp=True)
            if reply is not None:
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await self._tcp.wait_closed()


@asynccontextmanager
async def stub_dns() -> AsyncIterator[StubDns]:
    """A started :class:`StubDns`, stopped on exit. Its UDP and TCP ports are the same number, and a
    free UDP port is not always a free TCP port, so retry a few times."""
    for attempt in range(20):
        server = StubDns()
        try:
            await server.start()
        except OSError:
            await server.stop()
            if attempt == 19:
                raise
            continue
        try:
            yield server
        finally:
            await server.stop()
        return
