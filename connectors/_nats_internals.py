"""The private members of nats-py's ``Client`` that the NATS connector uses, and nothing else.

Every reach past nats-py's public API is here, each in one small function that says why it is
needed; ``tests/unit/test_nats_internals.py`` checks each against the installed nats-py (names,
types, behaviour on a client with a fake socket), so an upgrade that changes them fails there,
loudly. ``pyproject.toml`` pins nats-py below the next minor version for the same reason.
"""

from __future__ import annotations

from nats.aio.client import Client

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


def server_info(nc: Client) -> dict[str, object]:
    """The INFO the server sent at connect (``cluster``: its cluster's name, when it has one)."""
    info = getattr(nc, "_server_info", None)
    return info if isinstance(info, dict) else {}
