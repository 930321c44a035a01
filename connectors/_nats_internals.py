"""The private members of nats-py's ``Client`` that the NATS connector uses, and nothing else.

Every reach past nats-py's public API is here, each in one small function that says why it is
needed; ``tests/unit/test_nats_internals.py`` checks each against the installed nats-py (names,
types, behaviour on a client with a fake socket), so an upgrade that changes them fails there,
loudly. ``pyproject.toml`` pins nats-py below the next minor version for the same reason.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.errors import StaleConnectionError

TESTED = "2.16"  # the nats-py minor version these functions were written and tested against


async def send_encoded(nc: Client, command: bytes) -> None:
    """Queue one complete protocol command (an ``HPUB`` with its header block already encoded) and
    kick the flusher, as ``Client.publish`` does once it has encoded the message.

    ``publish()`` re-validates and re-encodes every header of every message, most of the cost of a
    publish (about 3x slower per message); the connector encodes its fixed header keys once.
    """
    await nc._send_command(command)
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


def drop_pending(nc: Client) -> None:
    """Forget what the client still buffers for a socket that went away.

    nats-py sends that buffer to the next server after a reconnect, behind messages that were lost
    with the old socket: core NATS would then receive the tail of a write before the middle the
    retry sends again (first copies out of order). The write that owned the buffer fails instead,
    and the runtime sends it again, in order.
    """
    nc._pending = []
    nc._pending_data_size = 0


def write_pending(nc: Client) -> None:
    """Hand what the client buffers to its socket now, before a ``flush()``.

    ``flush()`` writes its PING straight to the socket, ahead of publishes still in the buffer, so
    the PONG would not prove that they reached the server. Called with nothing awaited in between,
    the flusher task finds the buffer empty afterwards.
    """
    transport = nc._transport
    if nc._pending_data_size > 0 and transport is not None:
        transport.writelines(nc._pending[:])
        nc._pending = []
        nc._pending_data_size = 0


async def round_trip(nc: Client, timeout: float) -> bool:
    """PING the server and wait up to ``timeout`` for its PONG: True once it came, False if not.

    ``Client.flush(timeout)`` cancels its PING's future on a timeout (or when its caller is
    cancelled) and leaves it queued: the server's late PONG then meets ``set_result`` on a cancelled
    future, nats-py's read loop dies of ``InvalidStateError`` without reconnecting, nothing the
    server sends is read again until the keep-alive gives up (2 x ``ping_interval``), and every
    ``flush()`` meanwhile returns at once, proving nothing. Here the future is waited on with
    ``asyncio.wait``, which never cancels it: a late PONG completes it harmlessly.

    A read loop found dead (by anything else that raised in it) cannot read a PONG: the connection
    is handed to nats-py's reconnect, as a stale one, and this raises ``StaleConnectionError``.
    """
    reading = nc._reading_task
    if nc._transport is None or reading is None or reading.done():
        await nc._process_op_err(StaleConnectionError())
        raise StaleConnectionError
    pong: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    await nc._send_ping(pong)
    done, _ = await asyncio.wait((pong,), timeout=timeout)
    return bool(done)


def server_info(nc: Client) -> dict[str, object]:
    """The INFO the server sent at connect (``cluster``: its cluster's name, when it has one)."""
    info = getattr(nc, "_server_info", None)
    return info if isinstance(info, dict) else {}


def raise_max_payload(nc: Client, limit: int) -> None:
    """Take a larger ``max_payload`` than the one the server announced at connect. nats-py reads it
    only from the INFO at connect (an INFO sent later updates the servers it knows, not this),
    and checks each publish against it: a limit an operator raised by a configuration reload
    would refuse messages the server now takes until the client connects again."""
    if limit > nc._max_payload:
        nc._max_payload = limit


def fail_requests(nc: Client, exc: Exception) -> int:
    """Fail every request still waiting for its reply with ``exc`` (how many): the server refused
    one of them (a permission violation, told on the connection's error channel alone, naming the
    subject but not the request), and a refused request would wait its whole timeout meanwhile, the
    write behind it "in progress" and the sink ready. Each future's done callback removes it
    from the client's reply map; a reply that comes after all is dropped there."""
    waiting = [f for f in nc._resp_map.values() if not f.done()]
    for future in waiting:
        future.set_exception(exc)
    return len(waiting)
