"""HTTP endpoints on ``metrics.listen``: ``/metrics``, ``/healthz``, ``/readyz``.

A deliberately tiny HTTP/1.1 server on asyncio streams (GET only, one request per connection,
bounded header size and read timeout), so the bridge needs no web framework.

Readiness is computed on every ``/readyz`` (and, without its detail, on every scrape, which keeps
``kv_bridge_ready`` current): 200 when every sink is connected and every source subscribed, else
503; both answer with a JSON body naming each sink's state (``"ok"`` or why not) and the sources
not subscribed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from .errors import StartupError
from .secret import redact

Readiness = Callable[[bool], tuple[bool, dict[str, Any]]]  # (detail: False for the verdict alone)


def _cannot_listen(host: str, port: int, exc: OSError) -> str:
    why = "another process holds the port: stop it, or" if exc.errno == errno.EADDRINUSE else "fix the address, or"
    return (
        f"metrics.listen: cannot listen on {host}:{port} ({exc.strerror or exc}); {why} choose another "
        "host:port in metrics.listen (an empty string turns the endpoints off)"
    )


def listen_problem(listen: str) -> tuple[str, bool] | None:
    """Can ``metrics.listen`` be taken (what --check asks)? None if so, else the problem and
    whether another process holds it now."""
    host, port = _address(listen)
    try:
        # Every address the name stands for, as asyncio.start_server binds them ("localhost": the
        # IPv4 and the IPv6 loopback), each in its own family only.
        infos = {(i[0], i[4]) for i in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
        with contextlib.ExitStack() as held:
            for family, address in infos:
                sock = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen()
        return None
    except OSError as exc:
        return _cannot_listen(host, port, exc), exc.errno == errno.EADDRINUSE


def _address(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class HealthServer:
    def __init__(self, listen: str, exposition: Callable[[], Awaitable[Sequence[bytes]]], readiness: Readiness) -> None:
        self.host, self.port = _address(listen)
        self.exposition = exposition
        self.readiness = readiness
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=16384)
        except OSError as exc:
            raise StartupError(_cannot_listen(self.host, self.port, exc)) from exc
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = path.split("?", 1)[0]
            body: Sequence[bytes]  # in pieces: the exposition of thousands of streams is megabytes
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain", [b"method not allowed\n"]
            elif path == "/metrics":
                self.readiness(False)  # keeps kv_bridge_ready current for every scrape, not only /readyz
                await asyncio.sleep(0)  # (a pass over every stream: with 10,000, a few ms of the loop)
                status, ctype, body = 200, CONTENT_TYPE_LATEST, await self.exposition()
            elif path == "/healthz":
                status, ctype, body = 200, "text/plain", [b"ok\n"]
            elif path == "/readyz":
                ready, detail = self.readiness(True)
                status, ctype = (200 if ready else 503), "application/json"
                body = [redact(json.dumps({"ready": ready, **detail})).encode()]
            else:
                status, ctype, body = 404, "text/plain", [b"not found\n"]
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {sum(map(len, body))}\r\n"
                f"Connection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                for piece in body:  # a piece at a time: the transport never holds a copy of the whole body
                    writer.write(piece)
                    async with asyncio.timeout(5):
                        await writer.drain()
            async with asyncio.timeout(5):
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
