"""Ask a ZMQ TCP or ipc endpoint what socket type answers there, without ZMQ: the ZMTP 3 greeting.

``--check`` uses it to tell a typo from a running engine before the bridge starts, and a running
bridge to say why a source does not connect (libzmq drops a SUB that reached a ROUTER without a
word: a connection, then a disconnection, no handshake): a live endpoint must be a PUB (or XPUB)
socket, a replay endpoint a ROUTER. After both greetings a ZMTP
3 peer using the NULL mechanism sends a READY command whose ``Socket-Type`` property names its
socket type (ZMTP RFC 23); nothing is subscribed or requested, so the engine publishes nothing
for it and the connection is closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat

SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
GREETING = SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


class ProbeError(Exception):
    """The peer does not speak ZMTP 3 as expected (the message says what it did)."""


async def socket_type(host: str, port: int, timeout: float) -> str:
    """The ZMQ socket type serving ``host:port`` (``PUB``, ``ROUTER``, ...). Raises OSError when it
    cannot connect, TimeoutError when it does not answer in ``timeout``, ProbeError otherwise."""
    async with asyncio.timeout(timeout):
        return await _greet(*await asyncio.open_connection(host, port))


async def unix_socket_type(path: str, timeout: float) -> str:
    """:func:`socket_type` of the ``ipc://`` socket at ``path`` (a Unix domain socket; ``@name``
    is Linux's abstract namespace, as libzmq reads it)."""
    async with asyncio.timeout(timeout):
        return await _greet(*await asyncio.open_unix_connection("\0" + path[1:] if path.startswith("@") else path))


async def _greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    """The peer's socket type, from the ZMTP 3 handshake on an open connection (closed after)."""
    try:
        writer.write(GREETING)
        await writer.drain()
        try:
            greeting = await reader.readexactly(64)
        except asyncio.IncompleteReadError:
            raise ProbeError("closed the connection without a ZMTP greeting (not a ZMQ socket?)") from None
        if greeting[:1] != b"\xff" or greeting[9:10] != b"\x7f":
            raise ProbeError("answered, but not with a ZMTP greeting (not a ZMQ socket?)")
        if greeting[10] < 3:
            raise ProbeError(f"speaks ZMTP {greeting[10]}, too old to say its socket type")
        return _ready_socket_type(await _command(reader))
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _command(reader: asyncio.StreamReader) -> bytes:
    try:
        flags = (await reader.readexactly(1))[0]
        if not flags & 0x04:
            raise ProbeError("sent a message before its READY command")
        size_bytes = 8 if flags & 0x02 else 1
        size = int.from_bytes(await reader.readexactly(size_bytes), "big")
        if size > 1 << 16:
            raise ProbeError(f"sent a {size}-byte command during the handshake")
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ProbeError("closed the connection during the ZMTP handshake") from None


def _ready_socket_type(body: bytes) -> str:
    """The Socket-Type property of a READY command body."""
    name_len = body[0] if body else 0
    if body[1 : 1 + name_len] != b"READY":
        raise ProbeError(f"sent {body[1 : 1 + name_len]!r} instead of READY (a security mechanism other than NULL?)")
    i = 1 + name_len
    while i < len(body):
        n = body[i]
        name = body[i + 1 : i + 1 + n]
        i += 1 + n
        size = int.from_bytes(body[i : i + 4], "big")
        value = body[i + 4 : i + 4 + size]
        i += 4 + size
        if name.lower() == b"socket-type":
            return value.decode("ascii", "replace")
    raise ProbeError("its READY command names no Socket-Type")


def _ipc_problem(path: str, exc: OSError) -> tuple[str, str]:
    """Why nothing answers at the ``ipc://`` path ``path`` (connecting raised ``exc``)."""
    shared = "in Kubernetes, a volume shared with the engine's container"
    if path.startswith("@"):  # (abstract: no file, and seen only within one network namespace)
        return f"nothing listens at the abstract socket {path}; is the engine running in this pod's network namespace?", "refused"
    if isinstance(exc, FileNotFoundError):
        return (
            f"no socket at {path}; is the engine running on this host with this ipc path, and does the bridge see "
            f"its filesystem ({shared})?",
            "refused",
        )
    if isinstance(exc, PermissionError):
        return f"permission denied opening {path}; give the bridge's user access to it ({shared})", "unreachable"
    with contextlib.suppress(OSError):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return f"{path} is not a socket; give the path the engine binds its KV events socket to", "not_zmq"
    return f"nothing listens at {path} (a socket left by an engine that stopped?); is the engine running?", "refused"


EXPECTED = {"live": ("PUB", "XPUB"), "replay": ("ROUTER",), "snapshot": ("ROUTER", "REP")}
"""The socket types each of an engine's endpoints has (docs/protocol.md: PUB live, ROUTER replay;
section 4: a snapshot socket is a REP or ROUTER)."""

_FIX = {
    ("live", "ROUTER"): "this looks like the engine's replay port: give its PUB (kv-events endpoint) port here "
    "(with dp ranks, rank r uses port + r on both sockets)",
    ("replay", "PUB"): "this looks like the engine's live PUB port: give its replay_endpoint port here",
    ("replay", "XPUB"): "this looks like the engine's live PUB port: give its replay_endpoint port here",
    ("snapshot", "PUB"): "this looks like the engine's live PUB port: give its snapshot_endpoint port here",
    ("snapshot", "XPUB"): "this looks like the engine's live PUB port: give its snapshot_endpoint port here",
}


def split_ipc(endpoint: str) -> str | None:
    """The path of an ``ipc://path`` endpoint; None otherwise."""
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def split_tcp(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` endpoint (``[v6]`` brackets removed); None otherwise
    (another transport, a wildcard host)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if not port.isdigit() or "*" in host:
        return None
    return host.strip("[]"), int(port)


def probed(endpoint: str) -> bool:
    """Whether :func:`diagnose` can ask ``endpoint`` (a TCP host and port, or an ipc path)."""
    return split_tcp(endpoint) is not None or split_ipc(endpoint) is not None


async def diagnose(endpoint: str, role: str, timeout: float = 2.0) -> tuple[str, str] | None:
    """Why an engine's ``role`` endpoint ("live", "replay" or "snapshot") does not work, as (problem, reason),
    asked of the endpoint itself; None when the expected socket type answers (or it is neither a
    TCP nor an ipc endpoint). Reasons: unresolvable, refused, unreachable, no_answer, not_zmq,
    wrong_peer."""
    path, address = split_ipc(endpoint), split_tcp(endpoint)
    try:
        if path is not None:
            found = await unix_socket_type(path, timeout)
        elif address is not None:
            found = await socket_type(*address, timeout)
        else:
            return None
    except socket.gaierror as exc:
        host = address[0] if address is not None else endpoint
        return f"cannot resolve the host {host!r} ({exc.strerror}); check the name", "unresolvable"
    except TimeoutError:  # (an OSError: before it)
        return f"no answer in {timeout:g}s (a firewall, a frozen engine, or not a ZMQ socket?)", "no_answer"
    except OSError as exc:
        if path is not None:
            return _ipc_problem(path, exc)
        if isinstance(exc, ConnectionRefusedError):
            return (
                "connection refused; is the engine running with KV events on (vLLM: --kv-events-config with "
                "enable_kv_cache_events), and is this its port?",
                "refused",
            )
        return f"cannot connect ({exc.strerror or exc}); is the host up and the port right?", "unreachable"
    except ProbeError as exc:
        return str(exc), "not_zmq"
    expected = EXPECTED[role]
    if found.upper() in expected:
        return None
    fix = _FIX.get((role, found.upper()), f"point it at the engine's {expected[0]} socket")
    return f"a {found} socket answers, not {' or '.join(expected)}; {fix}", "wrong_peer"
