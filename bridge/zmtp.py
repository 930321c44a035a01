"""What kind of ZMQ socket listens at an endpoint: a ZMTP 3 greeting, read over plain TCP.

libzmq ends a connection to a peer of an incompatible type (a SUB that reached the engine's replay
ROUTER) without saying why: the socket monitor shows a connection, then a disconnection, and no
handshake. To tell a user which port is wrong, the bridge asks the peer itself: it sends a ZMTP 3.0
greeting (NULL mechanism) and a READY command naming its own type, and reads the peer's READY,
whose ``Socket-Type`` property names the peer's type (RFC 23/ZMTP). Nothing is subscribed or
requested: the connection is closed after the greeting.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)

EXPECTED = {"live": ("PUB", "XPUB"), "replay": ("ROUTER",)}
"""The peer types each of an engine's endpoints has (protocol.md: PUB live, ROUTER replay)."""

_OUR_TYPE = {"live": "SUB", "replay": "DEALER"}


def ready_command(socket_type: str) -> bytes:
    """A ZMTP READY command frame with one property, ``Socket-Type``."""
    name, value = b"Socket-Type", socket_type.encode()
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return b"\x04" + bytes([len(body)]) + body


def parse_ready(body: bytes) -> dict[str, bytes]:
    """The properties of a READY command's body (after its name); ValueError when malformed."""
    if not body.startswith(b"\x05READY"):
        raise ValueError("not a READY command")
    props: dict[str, bytes] = {}
    i = 6
    while i < len(body):
        n = body[i]
        name = body[i + 1 : i + 1 + n].decode("ascii", "replace")
        i += 1 + n
        if i + 4 > len(body):
            raise ValueError("truncated property")
        (size,) = struct.unpack(">I", body[i : i + 4])
        props[name] = body[i + 4 : i + 4 + size]
        i += 4 + size
    return props


async def peer_type(host: str, port: int, role: str = "live", timeout: float = 2.0) -> str:
    """The ZMQ socket type listening at ``host:port`` (``PUB``, ``ROUTER``...). Raises ``OSError``
    (refused, unreachable, unresolvable), ``TimeoutError``, or ``ValueError`` (not a ZMTP 3 peer)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(GREETING)
            await writer.drain()
            greeting = await reader.readexactly(64)
            if greeting[0] != 0xFF or greeting[9] != 0x7F:
                raise ValueError("the peer does not speak ZMTP")
            if greeting[10] < 3:
                raise ValueError(f"the peer speaks ZMTP {greeting[10]}.{greeting[11]}, not 3")
            writer.write(ready_command(_OUR_TYPE.get(role, "SUB")))
            await writer.drain()
            flags = (await reader.readexactly(1))[0]
            if not flags & 0x04:
                raise ValueError("the peer sent no command after its greeting")
            size = struct.unpack(">Q", await reader.readexactly(8))[0] if flags & 0x02 else (await reader.readexactly(1))[0]
            if size > 1 << 16:
                raise ValueError("the peer's first command is too large")
            props = parse_ready(await reader.readexactly(size))
            return props.get("Socket-Type", b"?").decode("ascii", "replace")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def wrong_peer_fix(role: str, endpoint: str, found: str) -> str:
    """The sentence that names what is wrong with ``endpoint`` and the likely fix."""
    if role == "live":
        hint = (
            "this looks like the engine's replay port: the live endpoint is its PUB port (vLLM: "
            "--kv-events-config endpoint, default 5557; with dp ranks, rank r uses port + r on both sockets)"
            if found == "ROUTER"
            else "point endpoint at the engine's PUB socket"
        )
        return f"{endpoint} is a {found} socket, not a PUB: {hint}"
    hint = (
        "this looks like the engine's live port: replay_endpoint is its ROUTER port (vLLM: replay_endpoint, default 5558)"
        if found in ("PUB", "XPUB")
        else "point replay_endpoint at the engine's ROUTER socket"
    )
    return f"{endpoint} is a {found} socket, not a ROUTER: {hint}"


def split_tcp(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` endpoint (``[v6]`` brackets removed); None otherwise."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


async def diagnose(endpoint: str, role: str, timeout: float = 2.0) -> tuple[str, str] | None:
    """Why an engine's ``role`` endpoint ("live" or "replay") does not work, as (problem, reason),
    asked of the endpoint itself; None when the expected socket type answers (or it is not TCP).
    Reasons: unresolvable, refused, unreachable, no_answer, not_zmq, wrong_peer."""
    address = split_tcp(endpoint)
    if address is None:
        return None
    host, port = address
    try:
        found = await peer_type(host, port, role, timeout)
    except OSError as exc:
        if isinstance(exc, socket.gaierror):
            return f"cannot resolve {host!r} ({exc.strerror}): check the host name in {endpoint}", "unresolvable"
        if isinstance(exc, ConnectionRefusedError):
            return (
                f"connection refused at {host}:{port}: is the engine running with KV events on "
                "(vLLM: --kv-events-config with enable_kv_cache_events), and is the port right?",
                "refused",
            )
        return f"cannot reach {host}:{port} ({exc.strerror or exc})", "unreachable"
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout:g} s (a firewall, or a host that is down?)", "no_answer"
    except (ValueError, asyncio.IncompleteReadError) as exc:
        return f"{host}:{port} is not a ZMQ socket ({exc})", "not_zmq"
    if found in EXPECTED[role]:
        return None
    return wrong_peer_fix(role, endpoint, found), "wrong_peer"
