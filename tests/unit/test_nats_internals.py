"""The nats-py internals quarantined in connectors/_nats_internals.py, checked against the installed
nats-py: when an upgrade renames, retypes or reorders any of them, these fail, loudly, naming it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import inspect

import nats.errors
import pytest
from nats.aio.client import Client

from connectors import _nats_internals as internals


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def writelines(self, lines: list[bytes]) -> None:
        self.written.extend(lines)


def test_the_installed_nats_py_is_the_tested_minor() -> None:
    version = importlib.metadata.version("nats-py")
    assert version.startswith(internals.TESTED + "."), (
        f"nats-py {version} is installed; connectors/_nats_internals.py was tested with {internals.TESTED}.x: "
        "re-check every function there (and this file), then update TESTED and the pin in pyproject.toml"
    )


def test_a_new_client_has_the_members_used() -> None:
    nc = Client()
    assert nc._pending == [] and nc._pending_data_size == 0 and nc._flush_queue is None and nc._transport is None
    for name in ("_send_command", "_flush_pending"):
        assert inspect.iscoroutinefunction(getattr(Client, name)), name


async def test_send_encoded_buffers_the_command_and_kicks_the_flusher_once() -> None:
    nc = Client()
    await internals.send_encoded(nc, b"HPUB a 2 3\r\nH\r\nx\r\n")  # not connected yet: buffered only
    assert nc._pending == [b"HPUB a 2 3\r\nH\r\nx\r\n"] and nc.pending_data_size == 18
    nc._status = Client.CONNECTED
    nc._flush_queue = asyncio.Queue()
    nc._flusher_task = asyncio.create_task(asyncio.Event().wait())  # a flusher that is alive
    try:
        await internals.send_encoded(nc, b"B")
        await internals.send_encoded(nc, b"C")
        assert nc._pending[-2:] == [b"B", b"C"]
        assert nc._flush_queue.qsize() == 1  # kicked once, as publish() does
    finally:
        nc._flusher_task.cancel()


def test_drop_pending_empties_the_buffer() -> None:
    nc = Client()
    nc._pending, nc._pending_data_size = [b"abc"], 3
    internals.drop_pending(nc)
    assert nc._pending == [] and nc.pending_data_size == 0


def test_write_pending_hands_the_buffer_to_the_socket() -> None:
    nc = Client()
    fake = FakeTransport()
    nc._transport = fake  # type: ignore[assignment]
    nc._pending, nc._pending_data_size = [b"a", b"bc"], 3
    internals.write_pending(nc)
    assert fake.written == [b"a", b"bc"] and nc._pending == [] and nc.pending_data_size == 0


def test_the_library_still_behaves_as_the_functions_assume() -> None:
    # publish(): buffer the command, then kick the flusher (what send_encoded repeats).
    send = inspect.getsource(Client._send_publish)
    assert send.index("await self._send_command(pub_cmd)") < send.index("await self._flush_pending()")
    # flush(): the PING goes straight to the socket, ahead of the buffer (why write_pending exists).
    assert "self._transport.write(PING_PROTO)" in inspect.getsource(Client._send_ping)
    # A reconnect calls disconnected_cb before it sends the buffer to the next server (why
    # drop_pending, called from that callback, keeps a lost write's tail from going there first).
    reconnect = inspect.getsource(Client._attempt_reconnect)
    assert reconnect.index("await self._disconnected_cb()") < reconnect.index("await self._flush_pending()")
    # The reconnect handler the connector passes (least-tried server, jittered wait).
    assert "reconnect_to_server_handler" in inspect.signature(Client.connect).parameters


def _reading_client() -> tuple[Client, FakeTransport, asyncio.Task[bool]]:
    """A connected client with a fake socket, and a read loop and flusher that are alive (one task
    that waits for ever stands for both)."""
    nc = Client()
    fake = FakeTransport()
    nc._transport = fake  # type: ignore[assignment]
    nc._status = Client.CONNECTED
    nc._flush_queue = asyncio.Queue()
    loop = asyncio.create_task(asyncio.Event().wait())
    nc._reading_task = nc._flusher_task = loop
    return nc, fake, loop


async def test_a_pong_after_the_round_trip_gave_up_is_taken_harmlessly() -> None:
    nc, fake, loop = _reading_client()
    try:
        assert not await internals.round_trip(nc, 0.01)  # no PONG within the timeout
        waiting = asyncio.create_task(internals.round_trip(nc, 5))
        await asyncio.sleep(0)
        waiting.cancel()  # the caller's own timeout (the runtime's write timeout) ends it
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert fake.written == [b"PING\r\n", b"PING\r\n"]
        await nc._process_pong()  # the late PONGs: what would end the read loop if they raised
        await nc._process_pong()
        answered = asyncio.create_task(internals.round_trip(nc, 5))
        await asyncio.sleep(0)
        await nc._process_pong()
        assert await answered
    finally:
        loop.cancel()


async def test_the_library_flush_leaves_a_cancelled_ping_that_its_late_pong_breaks_on() -> None:
    # Why round_trip exists: when this stops raising, nats-py fixed it, and flush() may do again.
    nc, _fake, loop = _reading_client()
    try:
        with contextlib.suppress(nats.errors.TimeoutError):
            await nc.flush(timeout=0.01)  # type: ignore[arg-type]  # a float works
        with pytest.raises(asyncio.InvalidStateError):
            await nc._process_pong()
    finally:
        loop.cancel()


async def test_a_dead_read_loop_is_handed_to_the_reconnect_not_taken_for_an_answer() -> None:
    nc, fake, loop = _reading_client()
    loop.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop
    reconnects: list[bool] = []

    async def reconnect() -> None:
        reconnects.append(True)

    nc._attempt_reconnect = reconnect  # type: ignore[method-assign]
    nc.options["allow_reconnect"] = True
    with pytest.raises(nats.errors.StaleConnectionError):
        await internals.round_trip(nc, 5)
    await asyncio.sleep(0)
    assert nc.is_reconnecting and reconnects == [True] and fake.written == []


def test_raise_max_payload_changes_what_the_client_checks_publishes_against() -> None:
    nc = Client()
    nc._max_payload = 4096
    internals.raise_max_payload(nc, 1 << 20)
    assert nc.max_payload == 1 << 20
    internals.raise_max_payload(nc, 1024)  # never lowered: the server refuses those itself
    assert nc.max_payload == 1 << 20


async def test_fail_requests_fails_the_waiting_requests_and_forgets_them() -> None:
    nc, _fake, loop = _reading_client()
    nc._resp_sub_prefix = bytearray(b"_INBOX.x.")  # (as _init_request_sub leaves it)
    try:
        waiting = asyncio.create_task(nc.request("$JS.API.INFO", b"", timeout=30))
        await asyncio.sleep(0)
        assert len(nc._resp_map) == 1  # the request waits for its reply
        assert internals.fail_requests(nc, nats.errors.Error("nats: permissions violation")) == 1
        with pytest.raises(nats.errors.Error, match="permissions violation"):
            await waiting
        assert nc._resp_map == {}  # a late reply finds nothing to complete
        assert internals.fail_requests(nc, nats.errors.Error("again")) == 0
    finally:
        loop.cancel()
