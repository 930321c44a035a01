"""NATS connector on a real ``nats-server -js``: the conformance suite in both modes, and NATS specifics.

JetStream is read back through the stream itself (``get_msg`` by subject, in stream order); core
NATS through a subscription opened before the connector writes. The delivery contract under
partial failure is in test_nats_delivery.py; what needs no server in tests/unit/test_nats_*.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api as js_api

from bridge.checkpoint import SinkPosition
from bridge.config import SinkConfig, convert_options
from bridge.connector import Connector
from bridge.errors import ConnectorError, NotConnected, PartialFailure, Permanent, Retriable, StreamRefused
from bridge.formats import Message, Renderer
from bridge.records import Stream
from bridge.sink import fold
from connectors.nats import MSG_ID_HEADER, NatsConnector, NatsOptions, subject_token
from tests.infra.servers import NatsServer, free_port, port_open
from tests.integration.conformance import ConformanceSuite, Stored
from tests.support.contract import BeforeFirstWrite, Scenario, interleaved, sized, worker_config
from tests.support.process import BridgeProcess, bridge_config, freeze, http_get, thaw
from tests.support.records import control_records, stream_records
from tests.support.schema import check_if_written_by_bridge


def _dest() -> str:
    # Subject prefix and stream name at once: letters and digits only.
    return f"KVT{uuid.uuid4().hex[:10].upper()}"


def _subject(dest: str, stream: Stream) -> str:
    return f"{dest}.{subject_token(stream.source)}.{stream.dp_rank}"


def _options(url: str, dest: str, **extra: Any) -> NatsOptions:
    """Options writing ``{dest}.{source}.{dp_rank}``; JetStream stream ``dest`` created at connect."""
    base: dict[str, Any] = {
        "servers": url,
        "subject": dest + ".{source}.{dp_rank}",
        "connect_timeout": 5.0,
        "reconnect_wait": 0.2,
        "reconnect_jitter": 0.2,
        "stream": {"create": True, "name": dest, "subjects": [f"{dest}.>"], "duplicate_window": 600},
    }
    base.update(extra)
    return convert_options(base, NatsOptions, "sinks[0]")


async def _read_stream(nc: Client, dest: str, subject: str) -> list[Msg | Any]:
    """Every message stored for ``subject`` in stream ``dest``, in stream order."""
    js = nc.jetstream(timeout=5)
    out = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(dest, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return out
        check_if_written_by_bridge(msg.data or b"", dict(msg.headers or {}))
        out.append(msg)
        assert msg.seq is not None
        seq = msg.seq + 1


async def _retrying_write(conn: Connector, messages: Sequence[Message], *, attempts: int = 120) -> int:
    """Write like the runtime: retry failures after a pause, only the failed part of a partial one.

    Returns how many attempts failed before everything was delivered.
    """
    pending = list(messages)
    for failures in range(attempts):
        try:
            await conn.write(pending)
            return failures
        except PartialFailure as exc:
            outcome = fold(pending, exc.errors)
            assert not outcome.dead, exc
            pending = [pending[i] for i in outcome.retry]
        except ConnectorError:
            pass
        await asyncio.sleep(0.25)
    pytest.fail(f"write did not succeed after {attempts} attempts")


# -- the conformance suite ----------------------------------------------------------------------


@pytest.mark.integration
class TestJetStreamConformance(ConformanceSuite):
    """JetStream: acked writes; a re-sent message is dropped by the server (Nats-Msg-Id)."""

    dedup_on_redelivery = True

    @pytest.fixture(autouse=True)
    async def _harness(self, nats_server: NatsServer, reader: Client) -> AsyncIterator[None]:
        self.server = nats_server
        self.reader = reader
        self.dests: list[str] = []
        yield
        js = reader.jetstream(timeout=5)
        for dest in self.dests:
            with contextlib.suppress(nats.errors.Error):
                await js.delete_stream(dest)

    def new_dest(self) -> str:
        dest = _dest()
        self.dests.append(dest)
        return dest

    async def make_connector(self, sink: SinkConfig, dest: str) -> Connector:
        return NatsConnector("nats-js", _options(self.server.url, dest), sink)

    async def read_back(self, dest: str, stream: Stream, expected: int) -> list[Stored]:
        msgs = await _read_stream(self.reader, dest, _subject(dest, stream))
        out = []
        for m in msgs:
            headers = dict(m.headers or {})
            # Each stored message carries its id, which is what made re-sends harmless.
            assert MSG_ID_HEADER in headers
            out.append(Stored(value=m.data or b"", headers=headers))
        return out

    async def restart_server(self) -> None:
        await self.server.arestart()

    def _reader(self, dest: str) -> Any:
        async def read(stream: Stream, expected: int) -> list[tuple[bytes, dict[str, str]]]:
            return [(m.data or b"", dict(m.headers or {})) for m in await _read_stream(self.reader, dest, _subject(dest, stream))]

        return read

    async def transient_partial_failure(self, sink: SinkConfig, dest: str) -> Scenario:
        """A full ``discard: new`` stream: room for the small messages of nats-a/1 and nats-a/2
        but not for nats-a/0's first (larger than the room): the server refuses it (maximum bytes
        exceeded) and stores the other streams' messages. Healed by purging the filler."""
        renderer = Renderer(sink.format, sink.granularity)
        streams = [Stream("nats-a", 0), Stream("nats-a", 1), Stream("nats-a", 2)]
        light = [sized(renderer, s, seq, 200) for seq in range(4) for s in streams]
        # What the other streams take in the stream (subject, headers and body, with room to spare).
        room = sum(len(m.value) + 600 for r in light if r.stream != streams[0] for m in renderer.render(r))
        records = [sized(renderer, r.stream, 0, room + 4000) if r.stream == streams[0] and r.seq == 0 else r for r in light]
        js = self.reader.jetstream(timeout=5)
        limit = room + 64 * 1024
        config = js_api.StreamConfig(
            name=dest, subjects=[f"{dest}.>"], max_bytes=limit, discard=js_api.DiscardPolicy.NEW, duplicate_window=600
        )
        await js.add_stream(config)
        while (left := limit - (await js.stream_info(dest)).state.bytes) > room + 8000:
            await js.publish(f"{dest}.filler", b"f" * 4000)
        if left > room:
            await js.publish(f"{dest}.filler", b"f" * max(1, left - room - 100))

        async def heal() -> None:
            await js.purge_stream(dest, subject=f"{dest}.filler")

        connector = NatsConnector("nats-js", _options(self.server.url, dest, stream={}), sink)
        return Scenario(connector, records, self._reader(dest), heal=heal, struck=("stream_full",))

    async def refused_message(self, sink: SinkConfig, dest: str) -> Scenario:
        """A stream whose ``max_msg_size`` is 3000 bytes; nats-a/0's seq 2 is 5000: refused for itself."""
        renderer = Renderer(sink.format, sink.granularity)
        streams = [Stream("nats-a", 0), Stream("nats-a", 1)]
        records = interleaved(renderer, streams, 5, lambda s, seq: 5000 if (s.dp_rank, seq) == (0, 2) else 300)
        (refused,) = [r for r in records if (r.stream.dp_rank, r.seq) == (0, 2)]
        js = self.reader.jetstream(timeout=5)
        await js.add_stream(name=dest, subjects=[f"{dest}.>"], max_msg_size=3000, duplicate_window=600)
        connector = NatsConnector("nats-js", _options(self.server.url, dest, stream={}), sink)
        return Scenario(connector, records, self._reader(dest), refused=refused)


@pytest.mark.integration
class TestCoreConformance(ConformanceSuite):
    """Core NATS: at most once, so a re-sent message arrives twice (consumers dedup on headers)."""

    dedup_on_redelivery = False

    @pytest.fixture(autouse=True)
    async def _harness(self, nats_server: NatsServer, reader: Client) -> AsyncIterator[None]:
        self.server = nats_server
        self.reader = reader
        self.received: dict[str, list[Msg]] = {}
        yield

    def new_dest(self) -> str:
        return _dest()

    async def make_connector(self, sink: SinkConfig, dest: str) -> Connector:
        # Core NATS keeps nothing: subscribe before the connector writes.
        got = self.received.setdefault(dest, [])

        async def on_msg(msg: Msg) -> None:
            got.append(msg)

        await self.reader.subscribe(f"{dest}.>", cb=on_msg)
        await self.reader.flush()
        options = _options(self.server.url, dest, mode="core", stream={})
        return NatsConnector("nats-core", options, sink)

    async def read_back(self, dest: str, stream: Stream, expected: int) -> list[Stored]:
        subject = _subject(dest, stream)
        got = self.received[dest]
        for _ in range(100):
            if sum(m.subject == subject for m in got) >= expected:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # anything beyond `expected` (duplicates) shows up too
        return [Stored(value=m.data, headers=dict(m.headers or {})) for m in got if m.subject == subject]

    partial_failure_not_applicable = (
        "core NATS acknowledges no message: a write ends with one flush (PING/PONG) for all of it, "
        "so a transient failure (a lost, stalled or restarting server) fails the whole write, which "
        "the runtime writes again whole (copies possible; consumers deduplicate on the headers)"
    )

    @pytest.fixture(autouse=True)
    def _request(self, request: pytest.FixtureRequest) -> None:
        self.request = request

    async def transient_partial_failure(self, sink: SinkConfig, dest: str) -> Scenario:
        """Not applicable (see ``partial_failure_not_applicable``): a whole write fails instead.
        A nats-server of the test's own is stopped (SIGSTOP) as the first write starts: its flush
        gets no PONG, the runtime's write timeout (0.5 s) ends it and the write is sent again,
        until the server is continued (SIGCONT) and answers. No connection is lost, so the
        subscriber gets every copy (the first write's included), first copies in order."""
        workdir = self.request.getfixturevalue("tmp_path_factory").mktemp("nats-stall")
        server = await NatsServer(workdir).astart()
        pid = server.pid
        assert pid is not None
        reader = await nats.connect(server.url)
        got: list[Msg] = []

        async def on_msg(msg: Msg) -> None:
            got.append(msg)

        await reader.subscribe(f"{dest}.>", cb=on_msg)
        await reader.flush()

        async def stall() -> None:
            await freeze(pid)

        async def heal() -> None:
            thaw(pid)

        async def cleanup() -> None:
            thaw(pid)
            with contextlib.suppress(nats.errors.Error):
                await reader.flush(timeout=5)  # the subscriber has had everything the server took
            await reader.close()
            await asyncio.to_thread(server.remove)

        async def read(stream: Stream, expected: int) -> list[tuple[bytes, dict[str, str]]]:
            return [(m.data, dict(m.headers or {})) for m in got if m.subject == _subject(dest, stream)]

        renderer = Renderer(sink.format, sink.granularity)
        records = interleaved(renderer, [Stream("nats-c", r) for r in range(3)], 5, lambda _s, _seq: 300)
        # The connector bounds its flush by the sink's write timeout: the runtime's, here.
        options = _options(server.url, dest, mode="core", stream={})
        connector = BeforeFirstWrite(NatsConnector("nats-core", options, worker_config(sink, 0.5)), stall)
        return Scenario(
            connector,
            records,
            read,
            heal=heal,
            struck=lambda: any(exc is not None for _, exc in connector.outcomes),  # a write met the stall
            write_timeout=0.5,
            cleanup=[cleanup],
        )

    async def refused_message(self, sink: SinkConfig, dest: str) -> Scenario:
        """nats-c/0's seq 2 is larger than the server's max_payload: refused for itself (the server
        announces the limit; a larger publish would cost the connection)."""
        renderer = Renderer(sink.format, sink.granularity)
        streams = [Stream("nats-c", 0), Stream("nats-c", 1)]
        big = self.reader.max_payload + 1  # the value alone is over the limit
        records = interleaved(renderer, streams, 5, lambda s, seq: big if (s.dp_rank, seq) == (0, 2) else 300)
        (refused,) = [r for r in records if (r.stream.dp_rank, r.seq) == (0, 2)]
        connector = await self.make_connector(sink, dest)  # subscribes the reader first

        async def read(stream: Stream, expected: int) -> list[tuple[bytes, dict[str, str]]]:
            return [(s.value, s.headers) for s in await self.read_back(dest, stream, expected)]

        return Scenario(connector, records, read, refused=refused)

    async def restart_server(self) -> None:
        # Adapted for at-most-once: a core message published while the reader is still
        # reconnecting is lost by design. Return once the reader has re-subscribed, so what the
        # suite checks is that the connector itself recovers and then delivers.
        await self.server.arestart()
        for _ in range(200):
            if self.reader.is_connected:
                try:
                    await self.reader.flush(timeout=1)
                    return
                except nats.errors.Error:
                    pass
            await asyncio.sleep(0.05)
        pytest.fail("the reader did not reconnect after the restart")


# -- NATS specifics -----------------------------------------------------------------------------


def _render(fmt: str, granularity: str, streams: Sequence[Stream], count: int) -> list[Message]:
    r = Renderer(fmt, granularity)  # type: ignore[arg-type]
    out: list[Message] = []
    for seq in range(count):  # interleaved across streams, like the runtime's fan-out
        for s in streams:
            for rec in stream_records(s, 1, start=seq, epoch=1):
                out.extend(r.render(rec))
    return out


@pytest.fixture
async def js_dest(reader: Client) -> AsyncIterator[str]:
    dest = _dest()
    yield dest
    with contextlib.suppress(nats.errors.Error):
        await reader.jetstream(timeout=5).delete_stream(dest)


SINK = SinkConfig(type="nats", name="nats", format="json", granularity="event")


@pytest.mark.integration
async def test_two_sinks_whose_subjects_one_stream_captures_each_keep_every_message(
    nats_server: NatsServer, reader: Client, js_dest: str
) -> None:
    """breaker101 B2: two sinks on subjects kv.x.* and kv.y.* of one operator-made stream: JetStream
    took one sink's messages for copies of the other's (one id per record): one subject held all,
    the other none or a part, both counted delivered, nothing announced, 5 of 5. The id names the
    subject."""
    stream = Stream("llama-a", 0)
    messages = [m for rec in stream_records(stream, 4, epoch=1) for m in Renderer("json").render(rec)]
    sinks = []
    for name in ("x", "y"):
        options = _options(nats_server.url, js_dest, subject=f"{js_dest}.{name}.{{source}}.{{dp_rank}}")
        sinks.append(NatsConnector(name, options, SinkConfig(type="nats", name=name, format="json", granularity="batch")))
    for conn in sinks:
        await conn.connect()
    try:
        for conn in sinks:
            await conn.write(messages)
    finally:
        for conn in sinks:
            await conn.close()
    for name in ("x", "y"):
        stored = await _read_stream(reader, js_dest, f"{js_dest}.{name}.llama-a.0")
        assert [s.data for s in stored] == [m.value for m in messages], name


@pytest.mark.integration
async def test_a_stream_created_for_a_subject_with_a_label_captures_it(nats_server: NatsServer, reader: Client) -> None:
    """breaker105 E2: subject 'kv.{labels.zone}.{source}.{dp_rank}' with stream.create made a stream
    capturing 'kv.*.zone}.*.*': --check ok, nothing ever stored (3 of 3)."""
    dest = f"KVL{uuid.uuid4().hex[:8].upper()}"
    stream = Stream("a", 0, {"zone": "eu"})
    options = _options(
        nats_server.url, dest, subject=dest + ".{labels.zone}.{source}.{dp_rank}", stream={"create": True, "name": dest}
    )
    conn = NatsConnector("nats", options, SINK)
    messages = [m for rec in stream_records(stream, 2) for m in Renderer("json").render(rec)]
    await conn.connect()
    try:
        await conn.write(messages)
        assert await conn.health() is None
    finally:
        await conn.close()
    js = reader.jetstream(timeout=5)
    try:
        assert (await js.stream_info(dest)).config.subjects == [f"{dest}.*.*.*"]
        assert [s.data for s in await _read_stream(reader, dest, f"{dest}.eu.a.0")] == [m.value for m in messages]
    finally:
        await js.delete_stream(dest)


@pytest.mark.integration
async def test_jetstream_headers_and_msg_id(nats_server: NatsServer, reader: Client, js_dest: str) -> None:
    stream = Stream("llama-a", 2, {"model": "m"})
    records = control_records(stream, 1) + stream_records(stream, 3, epoch=1)
    messages = [m for rec in records for m in Renderer("raw").render(rec)]
    conn = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await conn.connect()
    try:
        await conn.write(messages)
    finally:
        await conn.close()
    stored = await _read_stream(reader, js_dest, _subject(js_dest, stream))
    assert [s.data for s in stored] == [m.value for m in messages]
    for s, m in zip(stored, messages, strict=True):
        headers = dict(s.headers or {})
        assert headers[MSG_ID_HEADER] == f"{_subject(js_dest, stream)} {m.msg_id}"
        for key, value in m.headers.items():  # source, dp_rank, epoch, seq, type, content-type, schema_version, ts
            assert headers[key] == value


@pytest.mark.integration
async def test_jetstream_resent_batch_is_stored_once(nats_server: NatsServer, reader: Client, js_dest: str) -> None:
    stream = Stream("llama-a", 0)
    messages = _render("json", "event", [stream], 10)
    conn = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await conn.connect()
    try:
        await conn.write(messages)
        await conn.write(messages)  # the whole batch again, as after a lost ack
        await conn.write(messages[5:])
        # A new connection (as after a bridge restart) is deduplicated the same way.
        await conn.close()
        await conn.connect()
        await conn.write(messages)
    finally:
        await conn.close()
    stored = await _read_stream(reader, js_dest, _subject(js_dest, stream))
    assert [s.data for s in stored] == [m.value for m in messages]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["jetstream", "core"])
async def test_order_per_subject_across_interleaved_streams(
    nats_server: NatsServer, reader: Client, js_dest: str, mode: str
) -> None:
    streams = [Stream("llama-a", 0), Stream("llama-a", 1), Stream("qwen.2.5", 0)]
    messages = _render("msgpack", "event", streams, 40)
    got: dict[str, list[bytes]] = {}
    if mode == "core":

        async def on_msg(msg: Msg) -> None:
            got.setdefault(msg.subject, []).append(msg.data)

        await reader.subscribe(f"{js_dest}.>", cb=on_msg)
        await reader.flush()
    conn = NatsConnector("nats", _options(nats_server.url, js_dest, mode=mode), SINK)
    await conn.connect()
    try:
        for i in range(0, len(messages), 100):
            await conn.write(messages[i : i + 100])
    finally:
        await conn.close()
    for s in streams:
        subject = _subject(js_dest, s)
        expected = [m.value for m in messages if m.record.stream == s]
        if mode == "jetstream":
            values = [m.data for m in await _read_stream(reader, js_dest, subject)]
        else:
            for _ in range(100):
                if len(got.get(subject, [])) >= len(expected):
                    break
                await asyncio.sleep(0.05)
            values = got.get(subject, [])
        assert values == expected, subject
    # The dots of "qwen.2.5" must not make extra subject tokens.
    assert _subject(js_dest, streams[2]) == f"{js_dest}.qwen_2_5.0"


@pytest.mark.integration
async def test_jetstream_restart_mid_stream_loses_nothing(nats_server: NatsServer, reader: Client, js_dest: str) -> None:
    """A writer keeps going while the server restarts; every message is stored once, in order."""
    stream = Stream("llama-r", 0)
    messages = _render("json", "event", [stream], 2000)  # 6000 messages
    batches = [messages[i : i + 200] for i in range(0, len(messages), 200)]
    conn = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await conn.connect()
    failures = 0
    restarted = asyncio.Event()
    down = asyncio.Event()
    mark = len(batches) // 3

    async def restart_soon() -> None:
        await asyncio.sleep(0.1)
        await nats_server.astop()
        down.set()
        await asyncio.sleep(0.5)
        await nats_server.astart()
        restarted.set()

    restarter = asyncio.create_task(restart_soon())
    try:
        for i, batch in enumerate(batches):
            if i == mark:
                await down.wait()  # however slow the machine, this write meets the server down
            failures += await _retrying_write(conn, batch)
            await asyncio.sleep(0)  # back to back: the restart lands mid-write
        await restarter
        assert await conn.health() is None
    finally:
        restarter.cancel()
        await conn.close()
    assert restarted.is_set()
    assert failures > 0, "the restart did not interrupt any write; the test proves nothing"
    stored = await _read_stream(reader, js_dest, _subject(js_dest, stream))
    assert len(stored) == len(messages)
    assert [s.data for s in stored] == [m.value for m in messages]


@pytest.mark.integration
async def test_health_follows_the_connection(nats_server: NatsServer, js_dest: str) -> None:
    conn = NatsConnector("nats-h", _options(nats_server.url, js_dest), SINK)
    await conn.connect()
    try:
        assert await conn.health() is None
        await nats_server.astop()
        for _ in range(100):
            if await conn.health() is not None:
                break
            await asyncio.sleep(0.05)
        reason = await conn.health()
        assert reason is not None and "nats-h" in reason and "reconnecting" in reason
        with pytest.raises(NotConnected):
            await conn.write(_render("json", "event", [Stream("a", 0)], 1))
        await nats_server.astart()
        for _ in range(200):
            if await conn.health() is None:
                break
            await asyncio.sleep(0.05)
        assert await conn.health() is None
    finally:
        await conn.close()
        await conn.close()  # twice: still no error
    assert await conn.health() is not None


@pytest.mark.integration
async def test_health_sees_a_frozen_server_and_the_client_reads_again_once_it_answers(tmp_path: Path) -> None:
    """A server frozen (SIGSTOP) keeps the connection up: health's PING round trip says it does not
    answer, within ``connect_timeout``, while the sink is idle. Its late PONGs, once it answers,
    leave the client reading (a PING cancelled in nats-py's own flush() killed its read loop):
    health passes again and a write is acknowledged."""
    server = await NatsServer(tmp_path / "srv").astart()
    pid = server.pid
    assert pid is not None
    dest = _dest()
    conn = NatsConnector("nats-f", _options(server.url, dest, connect_timeout=1.0), SINK)
    await conn.connect()
    try:
        assert await conn.health() is None
        await freeze(pid)
        reason = await conn.health()
        assert reason is not None and "nats-f" in reason and "does not answer" in reason
        with contextlib.suppress(TimeoutError):  # health cut short by the caller's own timeout
            async with asyncio.timeout(0.2):
                await conn.health()
        thaw(pid)
        for _ in range(100):  # bounded wait, not a timing assertion
            if await conn.health() is None:
                break
        assert await conn.health() is None
        messages = _render("json", "event", [Stream("a", 0)], 3)
        async with asyncio.timeout(10):
            await conn.write(messages)
        reader = await nats.connect(server.url)
        try:
            stored = await _read_stream(reader, dest, _subject(dest, Stream("a", 0)))
            assert [m.data for m in stored] == [m.value for m in messages]
        finally:
            await reader.close()
    finally:
        thaw(pid)
        await conn.close()
        await asyncio.to_thread(server.remove)


@pytest.mark.integration
async def test_connect_fails_fast_naming_sink_and_server() -> None:
    url = f"nats://bridge:hunter2@127.0.0.1:{free_port()}"
    options = NatsOptions(servers=url, connect_timeout=1.0)  # type: ignore[arg-type]
    conn = NatsConnector("nats-x", options, SINK)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(NotConnected) as info:
        await conn.connect()
    assert loop.time() - started < 3
    text = str(info.value)
    assert "nats-x" in text and "127.0.0.1" in text and "hunter2" not in text
    await conn.close()


@pytest.mark.integration
async def test_no_stream_is_a_clear_retriable_error(nats_server: NatsServer) -> None:
    dest = _dest()  # no stream captures it
    conn = NatsConnector("nats-n", _options(nats_server.url, dest, stream={}), SINK)
    await conn.connect()
    try:
        reason = await conn.health()
        assert reason is not None and f"{dest}.*.*" in reason
        with pytest.raises(Retriable) as info:
            await conn.write(_render("json", "event", [Stream("a", 0)], 1))
        assert info.value.reason == "no_stream"
        assert f"{dest}.a.0" in str(info.value) and "stream" in str(info.value)
    finally:
        await conn.close()


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["jetstream", "core"])
async def test_a_stream_whose_subject_another_stream_owns_is_refused_never_mixed_into_it(
    nats_server: NatsServer, reader: Client, js_dest: str, mode: str
) -> None:
    """Sources found at run time (discovery) whose names become one subject token: the second
    stream's messages are refused for themselves (the sink's consumers of the first stream's
    subject never get them), in a write shared with the first's and in one of their own."""
    owner, clash = Stream("llama_a", 0), Stream("llama.a", 0)
    messages = _render("raw", "batch", [owner, clash], 2)
    conn = NatsConnector("nats", _options(nats_server.url, js_dest, mode=mode), SINK)
    await conn.connect()
    try:
        with pytest.raises(PartialFailure) as info:
            await conn.write(messages)
        assert [messages[i].record.stream for i in info.value.failed] == [clash, clash]
        assert isinstance(info.value.cause, StreamRefused) and info.value.cause.reason == "subject_taken"
        with pytest.raises(Permanent, match=r"subject .* is written by stream 'llama_a/0' already"):
            await conn.write([m for m in messages if m.record.stream == clash][-1:])
    finally:
        await conn.close()
    if mode == "jetstream":
        stored = await _read_stream(reader, js_dest, _subject(js_dest, owner))
        assert [s.headers["source"] for s in stored if s.headers] == ["llama_a", "llama_a"]


@pytest.mark.integration
async def test_a_subject_another_bridge_or_run_wrote_is_not_taken_over(
    nats_server: NatsServer, reader: Client, js_dest: str
) -> None:
    """The owner of a subject is not only the stream this process met first: a second bridge (or
    this one after a restart, its streams met in another order) whose stream's source name becomes
    the same token reads the subject's last message, and is refused (breaker30n3 B1: 3 of 3 runs
    mixed two engines on one subject)."""
    owner, clash = Stream("llama_a", 0), Stream("llama.a", 0)
    first = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await first.connect()
    try:
        await first.write(_render("raw", "batch", [owner], 2))
    finally:
        await first.close()
    for run in range(2):  # another bridge; then the owner's own bridge restarted, the other stream first
        later = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
        await later.connect()
        try:
            with pytest.raises(Permanent) as info:
                await later.write(_render("raw", "batch", [clash], 1))
            assert info.value.reason == "subject_taken" and "'llama_a/0'" in str(info.value)
            if run:
                await later.write(_render("raw", "batch", [owner], 3)[2:])  # the owner goes on
        finally:
            await later.close()
    stored = await _read_stream(reader, js_dest, _subject(js_dest, owner))
    assert [s.headers["source"] for s in stored if s.headers] == ["llama_a"] * 3


async def _write_refused(conn: NatsConnector, messages: Sequence[Message]) -> ConnectorError:
    """The failure of ``conn.write(messages)`` (a whole-write error, or a partial one's cause)."""
    with pytest.raises(ConnectorError) as info:
        await conn.write(messages)
    return info.value.cause if isinstance(info.value, PartialFailure) else info.value


@pytest.mark.integration
@pytest.mark.parametrize("gone", ["purge", "max_age"])
@pytest.mark.parametrize("seen_by", ["write", "audit"])
async def test_a_subject_taken_over_after_its_owners_messages_left_the_stream_is_never_written_by_both(
    nats_server: NatsServer, reader: Client, js_dest: str, gone: str, seen_by: str
) -> None:
    """breaker31h C1: the owner of a subject claimed it once per process, from the subject's last
    message. Once its messages left the stream (a purge, max_age), a second bridge found the subject
    empty and claimed it, and both wrote it, ready, nothing logged (a follower of one applied 18-26
    blocks of the other's engine). Each write of a stream now stores its first message only over
    the subject's last one this sink knows (Nats-Expected-Last-Subject-Sequence): the owner's next
    write finds the other's message, and its stream is refused (subject_taken, the sink not ready,
    naming both); the subject never holds both streams' messages after the takeover. The audit
    between writes reads each claimed subject again: an owner whose engine is quiet is refused
    (not ready) before it writes."""
    owner, other = Stream("llama.a", 0), Stream("llama_a", 0)
    subject = _subject(js_dest, owner)
    so: dict[str, Any] = {"create": True, "name": js_dest, "subjects": [f"{js_dest}.>"]}
    if gone == "max_age":
        so.update(max_age="2s", duplicate_window="1s")
    first = NatsConnector("nats-a", _options(nats_server.url, js_dest, stream=so), SINK)
    second = NatsConnector("nats-b", _options(nats_server.url, js_dest, stream=so), SINK)
    await first.connect()
    await second.connect()
    try:
        batches = _render("raw", "batch", [owner], 4)
        await first.write(batches[:2])
        js = reader.jetstream(timeout=5)
        if gone == "purge":
            await js.purge_stream(js_dest, subject=subject)
        for _ in range(100):  # max_age: until the server removed them (its expiry runs about once a second)
            if not await _read_stream(reader, js_dest, subject):
                break
            await asyncio.sleep(0.1)
        await second.write(_render("raw", "batch", [other], 2))  # the subject is empty: the other bridge claims it
        if seen_by == "audit":
            assert await first.health() is None
            await first.audit()
            assert await first.health() is not None
        refused = await _write_refused(first, batches[2:])
        assert isinstance(refused, StreamRefused) and refused.reason == "subject_taken", refused
        assert "'llama_a/0'" in str(refused) and "'llama.a'" in str(refused)
        health = await first.health()
        assert health is not None and "'llama_a/0'" in health and "rename one of the two sources" in health
        assert await second.health() is None  # (it cannot tell: nothing of the owner's is left to read)
    finally:
        await first.close()
        await second.close()
    stored = await _read_stream(reader, js_dest, subject)
    assert [s.headers["source"] for s in stored if s.headers] == ["llama_a", "llama_a"]


@pytest.mark.integration
async def test_a_bridge_resuming_from_the_sinks_does_not_take_over_another_bridges_subject(
    nats_server: NatsServer, reader: Client, js_dest: str
) -> None:
    """checkpoint.from_sinks: positions() renders each stream's subject before its first write,
    which made this process the subject's owner before the subject's last message was read: the
    other bridge's stream there did not refuse it, and both wrote one subject."""
    owner, clash = Stream("llama_a", 0), Stream("llama.a", 0)
    first = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await first.connect()
    try:
        await first.write(_render("raw", "batch", [owner], 2))
    finally:
        await first.close()
    later = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await later.connect()
    try:
        assert await later.positions([clash]) == {}  # (the other stream's message: cannot tell)
        refused = await _write_refused(later, _render("raw", "batch", [clash], 1))
        assert isinstance(refused, StreamRefused) and refused.reason == "subject_taken", refused
    finally:
        await later.close()
    stored = await _read_stream(reader, js_dest, _subject(js_dest, owner))
    assert [s.headers["source"] for s in stored if s.headers] == ["llama_a"] * 2


@pytest.mark.integration
@pytest.mark.parametrize("source", ["modèle", " llama"])
async def test_a_source_name_nats_py_reads_back_changed_is_still_its_own_subjects_owner(
    nats_server: NatsServer, js_dest: str, source: str
) -> None:
    """nats-py parses headers with the email package: a non-ASCII source comes back as an
    email.header.Header whose text has U+FFFD for its bytes, and a leading blank is dropped. The
    stream's own messages then named "another" stream: it was refused subject_taken at its first
    audit or restart (its announcements dead-lettered since ea36386), and positions() could not
    tell what the sink held, so a new pod announced a restart that never happened (breaker31y B1)."""
    stream = Stream(source, 0)
    first = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await first.connect()
    try:
        await first.write(_render("raw", "batch", [stream], 2))
        await first.audit()
        assert await first.health() is None
        await first.write(_render("raw", "batch", [stream], 3)[2:])
    finally:
        await first.close()
    later = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await later.connect()
    try:
        held = await later.positions([stream])
        assert held[stream.key] is not None and held[stream.key].seq == 2, held
        await later.write(_render("raw", "batch", [stream], 4)[3:])
        assert await later.health() is None
    finally:
        await later.close()


@pytest.mark.integration
async def test_what_a_subject_held_before_this_process_outlasts_its_own_source_reset(
    nats_server: NatsServer, js_dest: str
) -> None:
    """breaker110 4: a drop sink's bridge killed before its first checkpoint save; the next run
    wrote SourceReset(bridge_restart) in the same epoch, then dropped the replay's 1..10: it asked
    positions(), got that SourceReset (nothing held of the epoch) and announced 1..10, though the
    subject held 0..3 and 4 was announced already (4 of 4). positions_before_run() takes the
    subject's last message from before this process first wrote there."""
    from bridge.records import events_lost, source_reset

    stream = Stream("llama-a", 0)
    r = Renderer("raw", "batch")
    earlier = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await earlier.connect()
    try:
        lost = events_lost(stream, 1, 4, 4, "sink_queue_full", 0.0)
        await earlier.write([m for rec in [*stream_records(stream, 4, epoch=1), lost] for m in r.render(rec)])
    finally:
        await earlier.close()
    later = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await later.connect()
    try:
        untouched = (await later.positions_before_run([stream]))[stream.key]  # (nothing written yet)
        await later.write(r.render(source_reset(stream, 1, "bridge_restart", 0.0)))
        last = (await later.positions([stream]))[stream.key]
        held = (await later.positions_before_run([stream]))[stream.key]
    finally:
        await later.close()
    assert untouched is not None and (untouched.kind, untouched.seq) == ("EventsLost", 4), untouched
    assert last is not None and last.kind == "SourceReset", last
    assert held is not None and (held.epoch, held.first_missing()) == (1, 5), held


@pytest.mark.integration
async def test_the_owner_writes_on_after_its_own_messages_left_the_stream(
    nats_server: NatsServer, reader: Client, js_dest: str
) -> None:
    """The subject fence (above) against a subject emptied under its owner (a purge), and one
    written meanwhile by another pod of the same engine stream (a handover): neither is another
    stream's, so the write goes through whole, read again at once (no failed write)."""
    owner = Stream("llama.a", 0)
    subject = _subject(js_dest, owner)
    batches = _render("raw", "batch", [owner], 6)
    conn = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    pod = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await conn.connect()
    await pod.connect()
    try:
        await conn.write(batches[:2])
        await reader.jetstream(timeout=5).purge_stream(js_dest, subject=subject)
        await conn.write(batches[2:4])
        await pod.write(batches[4:5])
        await conn.write(batches[5:])  # (over the pod's message: a write of batches[4:] would start with its copy)
        assert await conn.health() is None
    finally:
        await conn.close()
        await pod.close()
    stored = await _read_stream(reader, js_dest, subject)
    assert [s.data for s in stored] == [m.value for m in batches[2:]]


@pytest.mark.integration
async def test_a_stream_whose_messages_leave_when_consumed_has_no_subject_fence(
    nats_server: NatsServer, reader: Client, js_dest: str
) -> None:
    """retention: workqueue (or interest): consumers empty the subjects, so a fence on the
    subject's last message would fail nearly every write (and send the rest of it one message per
    round trip); such a stream's subjects are claimed at a stream's first write only."""
    stream = Stream("llama.a", 0)
    so = {"create": True, "name": js_dest, "subjects": [f"{js_dest}.>"], "retention": "workqueue"}
    conn = NatsConnector("nats", _options(nats_server.url, js_dest, stream=so), SINK)
    await conn.connect()
    try:
        batches = _render("raw", "batch", [stream], 4)
        await conn.write(batches[:2])
        assert not conn._fences  # (white-box: what each write would be stored over)
        sub = await reader.jetstream(timeout=5).pull_subscribe(_subject(js_dest, stream), durable="w")
        for msg in await sub.fetch(2, timeout=5):
            await msg.ack_sync()
        await conn.write(batches[2:])
    finally:
        await conn.close()
    stored = await _read_stream(reader, js_dest, _subject(js_dest, stream))
    assert [s.data for s in stored] == [m.value for m in batches[2:]]


@pytest.mark.integration
async def test_two_bridges_claiming_one_empty_subject_at_the_same_moment_never_both_write_it(
    nats_server: NatsServer, reader: Client, js_dest: str
) -> None:
    """Both read the subject empty before either writes (the race the claim alone left open): the
    fence of the second to write is the empty subject, which the first's message broke."""
    a, b = Stream("llama.a", 0), Stream("llama_a", 0)
    first = NatsConnector("nats-a", _options(nats_server.url, js_dest), SINK)
    second = NatsConnector("nats-b", _options(nats_server.url, js_dest), SINK)
    await first.connect()
    await second.connect()
    try:
        mine, theirs = _render("raw", "batch", [a], 2), _render("raw", "batch", [b], 2)
        for conn, messages in ((first, mine), (second, theirs)):  # both claims before any write
            assert conn._nc is not None
            await conn._claim(conn._nc, messages)
        await first.write(mine)
        refused = await _write_refused(second, theirs)
        assert isinstance(refused, StreamRefused) and refused.reason == "subject_taken", refused
        assert "'llama.a/0'" in str(refused)
    finally:
        await first.close()
        await second.close()
    stored = await _read_stream(reader, js_dest, _subject(js_dest, a))
    assert [s.headers["source"] for s in stored if s.headers] == ["llama.a", "llama.a"]


@pytest.mark.integration
@pytest.mark.parametrize("crowded", [False, True], ids=["alone", "past-the-first-page"])
async def test_subjects_split_over_two_jetstream_streams_are_each_read_from_the_one_capturing_them(
    nats_server: NatsServer, reader: Client, crowded: bool
) -> None:
    """The operator's streams split the template's subjects (``P.a_x.>`` and ``P.b_x.>``,
    stream.create: false). ``positions()`` (checkpoint.from_sinks) and the subject-owner lookup at
    a stream's first write read each subject in the stream capturing it: one stream looked up for
    all said "holds nothing" of the other's subjects, so a new pod restarted them in a second epoch
    and duplicated them (breaker30n4 Break 3), and took over a subject another stream wrote. A
    subject no stream captures: cannot tell (no entry), never "holds nothing". The streams are
    listed page by page: an account with more than a page (256) before them in name order hid
    them (breaker30z3 Break 1)."""
    dest = _dest()
    js = reader.jetstream(timeout=5)
    crowd = [f"A{i:03d}{dest}" for i in range(300 if crowded else 0)]  # (names sort before dest's)
    for name in crowd:
        await js.add_stream(js_api.StreamConfig(name=name, subjects=[f"{name}.x"], storage=js_api.StorageType.MEMORY))
    for part in ("a_x", "b_x"):
        await js.add_stream(js_api.StreamConfig(name=f"{dest}{part.upper()}", subjects=[f"{dest}.{part}.>"]))
    owners, uncaptured = [Stream("a_x", 0), Stream("b_x", 0)], Stream("c", 0)
    options = _options(nats_server.url, dest, stream={"create": False, "name": f"{dest}A_X"})
    messages = _render("raw", "batch", owners, 3)
    try:
        first = NatsConnector("nats", options, SINK)
        await first.connect()
        try:
            await first.write(messages)
        finally:
            await first.close()
        later = NatsConnector("nats", options, SINK)  # a new pod
        await later.connect()
        try:
            got = await later.positions([*owners, uncaptured])
            assert uncaptured.key not in got
            for owner in owners:
                last = [m for m in messages if m.record.stream == owner][-1]
                assert got[owner.key] == SinkPosition.from_headers(last.headers, last.value), owner
            for clash in (Stream("a.x", 0), Stream("b.x", 0)):  # the same subject tokens as the owners'
                with pytest.raises(Permanent) as info:
                    await later.write(_render("raw", "batch", [clash], 1))
                assert info.value.reason == "subject_taken", clash
        finally:
            await later.close()
    finally:
        for name in [f"{dest}A_X", f"{dest}B_X", *crowd]:
            with contextlib.suppress(nats.errors.Error):
                await js.delete_stream(name)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["jetstream", "core"])
async def test_too_large_message_is_a_permanent_partial_failure(
    nats_server: NatsServer, reader: Client, js_dest: str, mode: str
) -> None:
    stream = Stream("llama-big", 0)
    messages = _render("raw", "batch", [stream], 3)
    big = msgspec.structs.replace(messages[1], value=b"x" * (reader.max_payload + 1))
    batch = [messages[0], big, messages[2]]
    conn = NatsConnector("nats", _options(nats_server.url, js_dest, mode=mode), SINK)
    await conn.connect()
    try:
        with pytest.raises(PartialFailure) as info:
            await conn.write(batch)
        assert info.value.failed == [1, 2]  # 2 waits for the refusal's announcement (bridge/connector.py)
        assert isinstance(info.value.cause, Permanent) and info.value.cause.reason == "too_large"
        assert info.value.errors[2].reason == "not_sent"
        assert await conn.health() is None  # the connection survived (nothing oversized was sent)
        with pytest.raises(Permanent):
            await conn.write([big])
        await conn.write([messages[2]])
    finally:
        await conn.close()
    if mode == "jetstream":
        stored = await _read_stream(reader, js_dest, _subject(js_dest, stream))
        assert [s.data for s in stored] == [messages[0].value, messages[2].value]


@pytest.mark.integration
async def test_user_password_auth_and_no_secret_in_errors(nats_server: NatsServer, tmp_path: Path) -> None:
    server = _GuardedNatsServer(tmp_path, extra_config='authorization { user: bridge, password: "s3cr3t-pw" }')
    await server.astart()
    try:
        good = NatsConnector("nats-a", _options(server.url, _dest(), mode="core", user="bridge", password="s3cr3t-pw"), SINK)
        await good.connect()
        try:
            await good.write(_render("json", "event", [Stream("a", 0)], 2))
            assert "s3cr3t-pw" not in repr(good.options)
        finally:
            await good.close()
        bad = NatsConnector(
            "nats-b", _options(server.url, _dest(), mode="core", user="bridge", password="wrong-pw", connect_timeout=1.0), SINK
        )
        with pytest.raises(NotConnected) as info:
            await bad.connect()
        assert "wrong-pw" not in str(info.value) and "nats-b" in str(info.value)
        await bad.close()
    finally:
        server.remove()


@pytest.mark.integration
async def test_a_user_that_may_not_publish_to_the_subjects_is_named_at_once_not_after_the_write_timeout(tmp_path: Path) -> None:
    """An authorization mistake: the user may use the JetStream API but not publish to the sink's
    subjects. The server drops the message and says so only on the connection's error channel:
    the write waited for its acks until write_timeout (30 s by default) with the sink ready, then
    said ``timeout`` (breaker29e K2), and ``--check`` said ok. Now connect refuses such a user
    (reason no_permission, naming the fix) without storing anything, and a permission revoked
    while the bridge runs (a config reload) fails the next write at once, health naming it."""
    dest = _dest()

    def auth(publish: list[str]) -> str:
        return (
            "authorization { users = [\n"
            '  {user: admin, password: "adminpw"}\n'
            f'  {{user: bridge, password: "pw", permissions: {{publish: {{allow: {json.dumps(publish)}}}, '
            'subscribe: {allow: ["_INBOX.>"]}}}\n'
            "] }\n"
            "jetstream: enabled\n"
        )

    server = _GuardedNatsServer(tmp_path, extra_config=auth(["$JS.API.>", "_INBOX.>"]))
    await server.astart()
    try:
        admin = await nats.connect(server.url, user="admin", password="adminpw")
        conn = NatsConnector("nats-p", _options(server.url, dest, user="bridge", password="pw", stream={}), SINK)
        try:
            await admin.jetstream().add_stream(name=dest, subjects=[f"{dest}.>"])
            with pytest.raises(NotConnected) as refused_at_connect:
                await conn.connect()
            assert refused_at_connect.value.reason == "no_permission", refused_at_connect.value
            assert "grant it publish on the sink's subjects" in str(refused_at_connect.value)
            assert (await admin.jetstream().stream_info(dest)).state.messages == 0  # the probe stored nothing

            await _reload(server, auth(["$JS.API.>", "_INBOX.>", f"{dest}.>"]))
            await conn.connect()
            assert (await admin.jetstream().stream_info(dest)).state.messages == 0
            await _reload(server, auth(["$JS.API.>", "_INBOX.>"]))  # revoked while the sink runs
            t0 = time.monotonic()
            with pytest.raises(Retriable) as refused:
                await conn.write(_render("json", "batch", [Stream("a", 0)], 1))
            took = time.monotonic() - t0
            assert refused.value.reason == "no_permission" and "permissions violation" in str(refused.value), refused.value
            print(f"refused after {took:.2f}s: {refused.value}")
            problem = await conn.health()
            assert problem is not None and "grant it publish on the sink's subjects" in problem
        finally:
            await conn.close()
            await admin.close()
    finally:
        server.remove()


@pytest.mark.integration
async def test_check_probes_each_configured_streams_subject_for_the_publish_permission(tmp_path: Path) -> None:
    """A user denied one source's subjects: ``--check`` probed one subject of the template (each
    placeholder ``_check``) and said ok, then the run stored nothing of that source (breaker115 4:
    2 of 2). Now it probes each configured stream's subject too, naming the refused one, and
    stores nothing; the same user passes for the sources it may write."""
    dest = _dest()
    server = _GuardedNatsServer(
        tmp_path,
        extra_config=(
            "authorization { users = [\n"
            f'  {{user: bridge, password: "pw", permissions: {{publish: {{allow: ">", deny: "{dest}.b.>"}}}}}}\n'
            "] }\n"
            "jetstream: enabled\n"
        ),
    )
    await server.astart()
    try:
        for streams, refused in (([Stream("a", 0), Stream("b", 0)], True), ([Stream("a", 0)], False)):
            check = NatsConnector("nats-q", _options(server.url, dest, user="bridge", password="pw"), SINK)
            check.creates_nothing = True
            check.configured_streams = streams
            try:
                if refused:
                    with pytest.raises(NotConnected) as denied:
                        await check.connect()
                    assert denied.value.reason == "no_permission" and f"{dest}.b.0".lower() in str(denied.value).lower()
                else:
                    await check.connect()
                    assert await check.health() is None
            finally:
                await check.close()
    finally:
        server.remove()


@pytest.mark.integration
async def test_a_refused_jetstream_api_request_fails_the_write_at_once_not_after_its_timeout(tmp_path: Path) -> None:
    """Every publish revoked (a config reload denying ``>``, or the JetStream API alone): the write's
    first API request (the stream lookup before a stream's first message) is dropped by the
    server, which says so only on the connection's error channel. The request waited for its
    whole timeout (``connect_timeout``), the write "in progress" and /readyz ready meanwhile
    (breaker111: 5.4 s at the default 5 s). Now the refusal fails the waiting requests at once:
    the write fails well within that timeout (30 s here), naming the permission."""
    dest = _dest()

    def auth(publish: list[str]) -> str:
        return (
            "authorization { users = [\n"
            f'  {{user: bridge, password: "pw", permissions: {{publish: {{allow: {json.dumps(publish)}}}}}}}\n'
            "] }\n"
            "jetstream: enabled\n"
        )

    server = _GuardedNatsServer(tmp_path, extra_config=auth([">"]))
    await server.astart()
    conn = NatsConnector("nats-a", _options(server.url, dest, user="bridge", password="pw", connect_timeout=30.0), SINK)
    try:
        await conn.connect()
        await _reload(server, auth(["_INBOX.>"]))
        t0 = time.monotonic()
        with pytest.raises(Retriable) as refused:
            async with asyncio.timeout(15):  # (half the request's own timeout: not a wait for it)
                await conn.write(_render("json", "batch", [Stream("a", 0)], 1))
        print(f"refused after {time.monotonic() - t0:.2f}s: {refused.value}")
        assert "permissions violation" in str(refused.value), refused.value
        problem = await conn.health()
        assert problem is not None and "refuses this user" in problem
        await _reload(server, auth([">"]))
        await conn.write(_render("json", "batch", [Stream("a", 0)], 1))
        assert await conn.health() is None
    finally:
        await conn.close()
        server.remove()


@pytest.mark.integration
async def test_core_mode_with_the_publish_permission_revoked_never_counts_a_batch_delivered(tmp_path: Path) -> None:
    """Core NATS: the user's publish permission is revoked while the bridge runs (a config
    reload). The server drops each message and says so only on the connection's error channel;
    the flush went through, so every batch counted delivered and the checkpoint moved past them:
    lost, with /readyz ready (breaker29h C1: 4 of 4 runs). Now such a write fails whole (reason
    no_permission, retried), health names the fix, and a write after the permission is back
    goes through and clears it."""
    dest = _dest()

    def auth(publish: list[str]) -> str:
        users = f'{{user: bridge, password: "pw", permissions: {{publish: {{allow: {json.dumps(publish)}}}}}}}'
        return f"authorization {{ users = [\n  {users}\n] }}\n"

    server = _GuardedNatsServer(tmp_path, extra_config=auth([f"{dest}.>", "_INBOX.>"]))
    await server.astart()
    conn = NatsConnector("nats-c", _options(server.url, dest, mode="core", user="bridge", password="pw", stream={}), SINK)
    try:
        await conn.connect()
        await conn.write(_render("json", "batch", [Stream("a", 0)], 1))
        await _reload(server, auth(["_INBOX.>"]))
        with pytest.raises(Retriable) as refused:
            await conn.write(_render("json", "batch", [Stream("a", 0)], 1))
        assert refused.value.reason == "no_permission" and "permissions violation" in str(refused.value), refused.value
        problem = await conn.health()
        assert problem is not None and "grant it publish on the sink's subjects" in problem
        await _reload(server, auth([f"{dest}.>", "_INBOX.>"]))
        await conn.write(_render("json", "batch", [Stream("a", 0)], 1))
        assert await conn.health() is None
    finally:
        await conn.close()
        server.remove()


@pytest.mark.integration
@pytest.mark.parametrize("created", [False, True], ids=["operator's streams", "stream.create"])
@pytest.mark.parametrize("fault", ["full", "no_ack", None])
async def test_check_checks_each_stream_that_captures_some_of_the_subjects(
    nats_server: NatsServer, reader: Client, fault: str | None, created: bool
) -> None:
    """The sink's subjects split over two streams, source a's in one, source b's in another that
    refuses every write (``discard: new`` and full, or ``no_ack``). ``--check`` looked only at
    the stream the template's wildcard finds (with ``stream.create``, only at the one it would
    create) and said ok, then the run's writes of b were refused (breaker115 1 and 2: 4 of 4, 3
    of 3). Now each stream capturing some of the subjects is checked; healthy, they pass."""
    dest = _dest()
    js = reader.jetstream()
    first, other = f"{dest}A", f"{dest}B"
    if not created:
        await js.add_stream(name=first, subjects=[f"{dest}.a.>"])
    full = {"max_msgs": 1, "discard": js_api.DiscardPolicy.NEW}
    refusing: dict[str | None, dict[str, Any]] = {"full": full, "no_ack": {"no_ack": True}, None: {}}
    await js.add_stream(name=other, subjects=[f"{dest}.b.>"], **refusing[fault])
    if fault == "full":
        await js.publish(f"{dest}.b.x.0", b"filler")
    stream = {"create": created, "name": first} | ({"subjects": [f"{dest}.a.>"]} if created else {})
    check = NatsConnector("nats-s", _options(nats_server.url, dest, stream=stream), SINK)
    check.creates_nothing = True
    check.configured_streams = [Stream("a", 0), Stream("b", 0)]
    try:
        await check.connect()
        problem = await check.health()
    finally:
        await check.close()
        names = [i.config.name for i in await js.streams_info()]
        for name in (first, other):
            if name in names:
                await js.delete_stream(name)
    if fault is None:
        assert problem is None
    else:
        assert problem is not None and repr(other) in problem and ("full" if fault == "full" else "no_ack") in problem, problem
    assert created is False or first not in names  # (--check creates nothing)


@pytest.mark.integration
@pytest.mark.parametrize("limit", [300, 1024])
async def test_check_refuses_a_stream_whose_message_size_limit_is_below_the_smallest_record(
    nats_server: NatsServer, reader: Client, limit: int
) -> None:
    """breaker118 B1 (2 of 2): a stream with ``max_msg_size: 300`` passed ``--check``; the run then
    dead-lettered every batch, and the EventsLost announcing them was refused too (not ready for
    good, nothing delivered). Below the smallest record the sink writes (that announcement), the
    stream is refused naming the setting; above it, it passes."""
    dest = _dest()
    js = reader.jetstream()
    await js.add_stream(name=dest, subjects=[f"{dest}.>"], max_msg_size=limit)
    check = NatsConnector("nats-s", _options(nats_server.url, dest, stream={"name": dest}), SINK)
    check.creates_nothing = True
    check.configured_streams = [Stream("a", 0)]
    try:
        await check.connect()
        problem = await check.health()
    finally:
        await check.close()
        await js.delete_stream(dest)
    if limit == 300:
        assert problem is not None and "max_msg_size" in problem and repr(dest) in problem, problem
    else:
        assert problem is None, problem


@pytest.mark.integration
@pytest.mark.parametrize("case", ["stream replicas", "state replicas", "overlapping subjects"])
async def test_check_refuses_a_stream_or_bucket_the_run_could_not_create(
    nats_server: NatsServer, reader: Client, case: str
) -> None:
    """``--check`` said ok for a stream or bucket the run would create, and the run then never
    became ready: 3 replicas on a server outside a cluster, subjects another stream captures
    (breaker29h C2). ``--check`` (a connector that creates nothing) now refuses them, naming the
    fix, and creates nothing; the same config without the mistake passes."""
    dest = _dest()
    other = f"{dest}OTHER"
    await reader.jetstream().add_stream(name=other, subjects=[f"{dest}.a.>"])
    try:
        wrong: dict[str, Any] = {
            "stream replicas": {"stream": {"create": True, "name": dest, "replicas": 3}},
            "state replicas": {"stream": {"create": True, "name": dest, "subjects": [f"{dest}.b.>"]},
                               "state": {"enabled": True, "bucket": dest, "create": True, "replicas": 3}},
            "overlapping subjects": {"stream": {"create": True, "name": dest}},
        }[case]  # fmt: skip
        conn = NatsConnector("nats-k", _options(nats_server.url, dest, **wrong), SINK)
        conn.creates_nothing = True
        with pytest.raises(NotConnected) as refused:
            await conn.connect()
        assert refused.value.reason == "cannot_create", refused.value
        assert ("set replicas: 1" if "replicas" in case else f"stream {other!r} captures") in str(refused.value)
        names = [i.config.name for i in await reader.jetstream().streams_info()]
        assert dest not in names and f"KV_{dest}" not in names  # nothing created
        right = {"create": True, "name": dest, "subjects": [f"{dest}.b.>"]}
        fine = NatsConnector("nats-k", _options(nats_server.url, dest, stream=right), SINK)
        fine.creates_nothing = True
        await fine.connect()
        await fine.close()
    finally:
        await reader.jetstream().delete_stream(other)


@pytest.mark.integration
@pytest.mark.parametrize("limit", ["max_streams", "max_file"])
async def test_check_refuses_streams_the_accounts_jetstream_limits_leave_no_room_for(
    tmp_path: Path, limit: str, caplog: pytest.LogCaptureFixture
) -> None:
    """breaker65 B1: an account that may have one JetStream stream, already used (or whose file
    storage is full): ``--check`` said ok for a sink that would create a stream and a bucket, and
    the run then never stored anything (``maximum number of streams reached``). The account's
    limits are read (``nats account info``): counted with every stream the sink would create."""
    cap = {"max_streams": "max_streams: 2", "max_file": "max_file: 100000"}[limit]
    server = await NatsServer(
        tmp_path / "srv",
        extra_config="accounts {\n  A: { jetstream: { " + cap + ", max_mem: 1000000 }, users: [{user: a, password: a}] }\n}\n"
        "no_auth_user: a\n",
    ).astart()
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="OCCUPY", subjects=["occ.>"])
        if limit == "max_file":
            with contextlib.suppress(nats.js.errors.BadRequestError):  # (resource limits exceeded: full)
                for _ in range(200):
                    await js.publish("occ.x", b"x" * 1000)
        dest = _dest()
        state = {"enabled": True, "bucket": f"ST{dest}", "create": True}
        conn = NatsConnector("nats-l", _options(server.url, dest, state=state), SINK)
        conn.creates_nothing = True
        with pytest.raises(NotConnected) as refused:
            await conn.connect()
        assert refused.value.reason == "cannot_create", refused.value
        said = str(refused.value)
        if limit == "max_streams":
            assert "the account may have 2 JetStream stream(s) and has 1 already (this sink would create 2)" in said, said
        else:
            assert "file storage is full" in said, said
        assert [i.config.name for i in await js.streams_info()] == ["OCCUPY"]  # nothing created
        # The run: the server refuses the stream. The client the sink closes itself after each
        # try was logged as "disconnected from NATS ...; reconnecting" (about 200 WARNINGs).
        if limit == "max_streams":
            caplog.set_level(logging.WARNING)
            run = NatsConnector("nats-l", _options(server.url, dest, state=state), SINK)
            for _ in range(3):
                with pytest.raises(NotConnected):
                    await run.connect()
            assert not [r for r in caplog.records if "disconnected from NATS" in r.getMessage()]
            await run.close()
            # One stream the sink would create: room for it.
            fine = NatsConnector("nats-l", _options(server.url, dest), SINK)
            fine.creates_nothing = True
            await fine.connect()
            await fine.close()
    finally:
        await nc.close()
        await asyncio.to_thread(server.remove)


@pytest.mark.integration
@pytest.mark.parametrize("case", ["max_bytes required", "per-stream cap", "reserved", "full bucket", "full account"])
async def test_check_refuses_what_the_account_or_a_full_bucket_would_refuse(tmp_path: Path, case: str) -> None:
    """breaker72 B2, B3: the events stream exists; the sink creates (or finds) the state bucket.
    ``--check`` said ok although every write would be refused: an account that requires max_bytes
    on each stream, caps each stream's bytes, or has its storage reserved by other streams; an
    existing bucket that is full (discard new); an account whose storage is full with the streams
    already there. Each is refused now, naming the limit."""
    limits = {
        "max_bytes required": "max_file: 100MB, max_bytes_required: true",
        "per-stream cap": "max_file: 100MB, disk_max_stream_bytes: 1MB",
        "reserved": "max_file: 5MB",
        "full account": "max_file: 300000",
    }.get(case)
    accounts = f"accounts {{\n  A: {{ jetstream: {{ {limits}, max_mem: 1000000 }}, users: [{{user: a, password: a}}] }}\n}}\n"
    server = await NatsServer(tmp_path / "srv", extra_config=accounts + "no_auth_user: a\n" if limits else "").astart()
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        dest = _dest()
        await js.add_stream(name=dest, subjects=[f"{dest}.>"], max_bytes=-1 if case == "full account" else 512 * 1024)
        state: dict[str, Any] = {"enabled": True, "bucket": f"ST{dest}", "create": case != "full bucket"}
        if case == "per-stream cap":
            state["max_bytes"] = 4 << 20
        elif case == "reserved":
            state["max_bytes"] = 50 << 20
        elif case == "full bucket":
            kv = await js.create_key_value(js_api.KeyValueConfig(bucket=f"ST{dest}", history=1, max_bytes=64 * 1024))
            with contextlib.suppress(nats.js.errors.BadRequestError, nats.js.errors.APIError):
                for i in range(100):
                    await kv.put(f"fill.{i}", b"x" * 900)
        elif case == "full account":
            with contextlib.suppress(nats.js.errors.BadRequestError, nats.js.errors.APIError):
                for _ in range(200):
                    await js.publish(f"{dest}.fill", b"x" * 2000)
        stream = {"create": False, "name": dest}
        conn = NatsConnector("nats-b", _options(server.url, dest, stream=stream, state=state), SINK)
        conn.creates_nothing = True
        try:  # (what the run would create is refused at connect; what exists is a problem health says)
            await conn.connect()
            problem = await conn.health()
        except NotConnected as exc:
            problem = str(exc)
        await conn.close()
        said = {
            "max_bytes required": "requires a max_bytes on every stream",
            "per-stream cap": "caps each file stream at",
            "reserved": "reserved by other streams",
            "full bucket": "is full (",
            "full account": "file storage is full",
        }[case]
        assert problem is not None and said in problem, problem
    finally:
        await nc.close()
        await asyncio.to_thread(server.remove)


@pytest.mark.integration
async def test_a_stream_with_a_max_age_below_the_default_duplicate_window_is_created_and_written(
    nats_server: NatsServer, reader: Client, js_dest: str
) -> None:
    """breaker31h C2: ``max_age: 1m`` with no ``duplicate_window`` was created with the default 2m,
    which nats-server refuses (10052): the stream never existed, 0 of 10 batches were stored. The
    window is now max_age, as the server itself picks when none is given."""
    stream = Stream("llama-a", 0)
    so = {"create": True, "name": js_dest, "subjects": [f"{js_dest}.>"], "max_age": "1m"}
    conn = NatsConnector("nats", _options(nats_server.url, js_dest, stream=so), SINK)
    await conn.connect()
    try:
        assert await conn.health() is None
        messages = _render("raw", "batch", [stream], 3)
        await conn.write(messages)
    finally:
        await conn.close()
    config = (await reader.jetstream().stream_info(js_dest)).config
    assert config.max_age == 60.0 and config.duplicate_window == 60.0
    stored = await _read_stream(reader, js_dest, _subject(js_dest, stream))
    assert [s.data for s in stored] == [m.value for m in messages]


@pytest.mark.integration
async def test_a_stream_keeping_few_messages_per_subject_is_warned_about(
    nats_server: NatsServer, reader: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Each engine stream is one subject: an operator's stream with max_msgs_per_subject keeps only
    its last messages, and a consumer behind by more misses them with nothing announced
    (breaker29e N5: 1 of 15 applied, complete with 44 of 88 keys missing)."""
    dest = _dest()
    await reader.jetstream().add_stream(name=dest, subjects=[f"{dest}.>"], max_msgs_per_subject=1)
    conn = NatsConnector("nats-w", _options(nats_server.url, dest, stream={}), SINK)
    try:
        await conn.connect()
    finally:
        await conn.close()
    assert any("keeps only the last 1 message(s) of each subject" in r.getMessage() for r in caplog.records)


async def _reload(server: NatsServer, extra_config: str) -> None:
    """Give ``server`` a new configuration and wait until it has reloaded it (SIGHUP)."""
    done = server.log_path.read_text(errors="replace").count("Reloaded server configuration")
    server.extra_config = extra_config
    server._prepare()
    assert server._proc is not None
    server._proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while server.log_path.read_text(errors="replace").count("Reloaded server configuration") <= done:
        assert time.monotonic() < deadline, "nats-server did not reload its configuration"
        await asyncio.sleep(0.05)


class _GuardedNatsServer(NatsServer):
    """A nats-server wanting a password or TLS: healthy once it accepts connections."""

    def check_health(self, timeout: float) -> None:
        if not port_open(self.host, self.port, timeout):
            raise ConnectionRefusedError(f"nothing accepts on {self.url}")


@pytest.fixture
def tls_cert(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) for 127.0.0.1 only, and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.integration
async def test_tls_with_ca_file_and_hostname_check(nats_server: NatsServer, tmp_path: Path, tls_cert: tuple[Path, Path]) -> None:
    cert, key = tls_cert
    server = _GuardedNatsServer(
        tmp_path / "server", extra_config=f"tls {{ cert_file: {json.dumps(str(cert))}, key_file: {json.dumps(str(key))} }}"
    )
    await server.astart()
    try:
        dest = _dest()
        ok = NatsConnector("nats-tls", _options(server.url, dest, mode="core", tls={"ca_file": str(cert)}), SINK)
        await ok.connect()
        try:
            await ok.write(_render("json", "event", [Stream("a", 0)], 2))
            assert await ok.health() is None
        finally:
            await ok.close()
        # The certificate names 127.0.0.1, not localhost: only without the hostname check.
        other = server.url.replace("127.0.0.1", "localhost")
        strict_options = _options(other, dest, mode="core", connect_timeout=1.0, tls={"ca_file": str(cert)})
        strict = NatsConnector("nats-tls2", strict_options, SINK)
        with pytest.raises(NotConnected):
            await strict.connect()
        await strict.close()
        lax = NatsConnector(
            "nats-tls3", _options(other, dest, mode="core", tls={"ca_file": str(cert), "check_hostname": False}), SINK
        )
        await lax.connect()
        await lax.close()
        # No CA given: the system store does not know this certificate.
        unknown = NatsConnector("nats-tls4", _options(server.url, dest, mode="core", connect_timeout=1.0, tls={}), SINK)
        with pytest.raises(NotConnected) as info:
            await unknown.connect()
        assert "nats-tls4" in str(info.value)
        await unknown.close()
    finally:
        server.remove()


@pytest.mark.integration
async def test_header_values_cannot_break_the_protocol(nats_server: NatsServer, reader: Client, js_dest: str) -> None:
    """An engine's free-text event type with CR/LF stays one header line."""
    stream = Stream("llama-a", 0)
    evil = "Evil\r\nPUB x 1\r\n"
    records = stream_records(stream, 2)
    records[0].events[0]["type"] = evil
    messages = [m for rec in records for m in Renderer("json").render(rec)]
    conn = NatsConnector("nats", _options(nats_server.url, js_dest), SINK)
    await conn.connect()
    try:
        await conn.write(messages)
        assert await conn.health() is None
    finally:
        await conn.close()
    stored = await _read_stream(reader, js_dest, _subject(js_dest, stream))
    assert [s.data for s in stored] == [m.value for m in messages]
    headers = dict(stored[0].headers or {})
    assert headers["type"] == "Evil  PUB x 1" and headers["seq"] == "0"
    assert headers[MSG_ID_HEADER] == f"{_subject(js_dest, stream)} llama-a/0/0/0/0"


@pytest.mark.integration
async def test_a_token_in_the_server_url_is_never_shown(nats_server: NatsServer, tmp_path: Path) -> None:
    """``nats://TOKEN@host`` (NATS's documented form): the bridge connects with it, and its logs
    (debug), ``/readyz`` while the server is down, and ``--check`` (reachable, then not) show the
    URL with the token masked."""
    token = f"tok-{uuid.uuid4().hex}"
    server = _GuardedNatsServer(tmp_path, extra_config=f'authorization {{ token: "{token}" }}')
    await server.astart()
    try:
        url = f"nats://${{NATS_TOKEN}}@{server.host}:{server.port}"
        sink = {"type": "nats", "name": "nats-t", "servers": url, "mode": "core", "connect_timeout": "1s"}
        source = {"name": "e", "endpoint": f"tcp://127.0.0.1:{free_port()}", "bind": True}  # no engine to probe
        cfg = bridge_config(tmp_path, [source], [sink], log={"level": "debug"})
        bridge = BridgeProcess(tmp_path, cfg, env={"NATS_TOKEN": token}).start()
        texts: dict[str, str] = {}
        try:
            await bridge.wait_ready()
            await server.astop()
            assert bridge.metrics_port is not None
            for _ in range(200):  # bounded: until /readyz says the sink is down
                status, body = await http_get(bridge.metrics_port, "/readyz")
                if status == 503 and b"nats-t" in body:
                    break
                await asyncio.sleep(0.05)
            texts["/readyz"] = body.decode()
            checks = [await asyncio.to_thread(_run_check, bridge)]  # the server down: unreachable
            await server.astart()
            checks.append(await asyncio.to_thread(_run_check, bridge))
            assert await bridge.terminate() == 0
        finally:
            bridge.kill()
        texts["log"] = bridge.log()
        texts["--check (down)"], texts["--check (up)"] = (c.stdout + c.stderr for c in checks)
        print(f"\n/readyz: {texts['/readyz']}\n--check (down): {texts['--check (down)']}")
        assert [c.returncode for c in checks] == [3, 0], texts  # 3: valid, but the server unreachable
        assert f"***@{server.host}:{server.port}" in texts["/readyz"] and "***@" in texts["--check (down)"]
        assert "***@" in texts["log"]
        assert [where for where, text in texts.items() if token in text] == []
    finally:
        server.remove()


def _run_check(bridge: BridgeProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bridge", "--config", str(bridge.config_path), "--check"],
        env=bridge.env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
