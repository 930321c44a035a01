"""The connector conformance suite, run against every connector on its real server.

A connector's test module subclasses :class:`ConformanceSuite` and implements the harness
methods (build a connector, read back what the server stored, restart the server). The suite
checks what every sink must do: connect/close, a batch delivered and read back field by field, in
order per stream, every format and granularity, reconnect after a server restart, and (where the
sink promises it) duplicate-safe re-delivery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
import pytest

from bridge.config import SinkConfig
from bridge.connector import Connector
from bridge.formats import Message, Renderer
from bridge.records import Record, Stream
from tests.support.records import control_records, stream_records

FORMATS = [("json", "event"), ("json", "batch"), ("msgpack", "event"), ("msgpack", "batch"), ("raw", "batch")]


class Stored(msgspec.Struct):
    """One message as read back from the server."""

    value: bytes
    headers: dict[str, str]


class ConformanceSuite:
    """Subclass per connector; pytest collects the ``test_*`` methods for each subclass."""

    dedup_on_redelivery: ClassVar[bool] = True  # the server stores a re-sent message once

    # -- harness (implement in the subclass) ---------------------------------------------------
    async def make_connector(self, sink: SinkConfig, dest: str) -> Connector:
        """A connector writing to the fresh destination ``dest`` (topic / stream / subject)."""
        raise NotImplementedError

    async def read_back(self, dest: str, stream: Stream, expected: int) -> list[Stored]:
        """Everything stored for ``stream`` in ``dest`` in server order (wait for ``expected``)."""
        raise NotImplementedError

    async def restart_server(self) -> None:
        raise NotImplementedError

    def new_dest(self) -> str:
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def sink(fmt: str, granularity: str, **options: Any) -> SinkConfig:
        return SinkConfig(type="test", name="test", format=fmt, granularity=granularity, options=options)  # type: ignore[arg-type]

    @staticmethod
    def render(sink: SinkConfig, records: Sequence[Record]) -> list[Message]:
        r = Renderer(sink.format, sink.granularity, sink.hash_format)
        return [m for rec in records for m in r.render(rec)]

    # -- the suite -----------------------------------------------------------------------------
    @pytest.mark.parametrize(("fmt", "granularity"), FORMATS)
    async def test_delivers_every_format_in_order(self, fmt: str, granularity: str) -> None:
        dest = self.new_dest()
        sink = self.sink(fmt, granularity)
        stream = Stream("llama-a", 0, {"model": "m"})
        records = control_records(stream, 1)[:1] + stream_records(stream, 5, epoch=1) + control_records(stream, 2)
        messages = self.render(sink, records)
        conn = await self.make_connector(sink, dest)
        await conn.connect()
        try:
            await conn.write(messages[:3])
            await conn.write(messages[3:])
            assert await conn.health() is None
        finally:
            await conn.close()
        stored = await self.read_back(dest, stream, len(messages))
        assert [s.value for s in stored] == [m.value for m in messages]
        for s, m in zip(stored, messages, strict=True):
            for key in ("source", "dp_rank", "epoch", "seq", "type"):
                assert s.headers.get(key) == m.headers[key], (key, s.headers, m.headers)
            if m.index is not None:
                assert s.headers.get("index") == str(m.index)

    async def test_reconnects_after_server_restart(self) -> None:
        dest = self.new_dest()
        sink = self.sink("json", "event")
        stream = Stream("llama-b", 1)
        first, second = stream_records(stream, 3), stream_records(stream, 3, start=3)
        conn = await self.make_connector(sink, dest)
        await conn.connect()
        try:
            await conn.write(self.render(sink, first))
            await self.restart_server()
            # The runtime retries failed writes; emulate that with a bounded loop.
            for _attempt in range(60):
                try:
                    await conn.write(self.render(sink, second))
                    break
                except Exception:
                    await asyncio.sleep(0.5)
            else:
                pytest.fail("connector did not recover after the server restart")
        finally:
            await conn.close()
        stored = await self.read_back(dest, stream, len(self.render(sink, first + second)))
        values = [s.value for s in stored]
        expected = [m.value for m in self.render(sink, first + second)]
        # At least once: every message present, in order (as a subsequence), nothing foreign.
        remaining = iter(values)
        assert all(any(v == e for v in remaining) for e in expected), "a message is missing or out of order"
        assert set(values) <= set(expected)

    async def test_redelivery_is_stored_once(self) -> None:
        """Duplicate-safe sinks store a re-sent tail once; at-least-once sinks store it again, and
        a consumer that keeps the first copy of each (stream, epoch, seq, index) sees the stream
        exactly, in order."""
        dest = self.new_dest()
        sink = self.sink("json", "event")
        stream = Stream("llama-c", 0)
        messages = self.render(sink, stream_records(stream, 4))
        conn = await self.make_connector(sink, dest)
        await conn.connect()
        try:
            await conn.write(messages)
            await conn.write(messages[2:])  # as after a write timeout: the tail is sent again
        finally:
            await conn.close()
        if self.dedup_on_redelivery:
            stored = await self.read_back(dest, stream, len(messages))
            assert [s.value for s in stored] == [m.value for m in messages]
            return
        stored = await self.read_back(dest, stream, len(messages) + len(messages[2:]))
        keys = [tuple(s.headers.get(k) for k in ("source", "dp_rank", "epoch", "seq", "index")) for s in stored]
        first = [s.value for i, s in enumerate(stored) if keys[i] not in keys[:i]]
        assert first == [m.value for m in messages]
        assert len(stored) == len(messages) + len(messages[2:])  # the re-sent tail, stored again
