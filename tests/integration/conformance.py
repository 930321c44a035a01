"""The connector conformance suite, run against every connector on its real server.

A connector's test module subclasses :class:`ConformanceSuite` and implements the harness
methods (build a connector, read back what the server stored, restart the server). The suite
checks what every sink must do: connect/close, a batch delivered and read back field by field, in
order per stream, every format and granularity, reconnect after a server restart, (where the
sink promises it) duplicate-safe re-delivery, and the delivery contract of bridge/connector.py
under partial failure, through the runtime's own delivery loop (a SinkWorker: retries,
:func:`bridge.sink.fold`, dead letters):

- a write of several streams that the server fails in part, transiently, and that is then healed:
  every message stored once (first copies, for at-least-once sinks), in order per stream, nothing
  dead-lettered (harness hook :meth:`ConformanceSuite.transient_partial_failure`);
- one message the server refuses for itself in the middle of a write: only it dead-lettered,
  every other message stored once, in order per stream (hook :meth:`ConformanceSuite.refused_message`).

A connector whose server cannot fail part of a write transiently in a way the bridge sees sets
:attr:`ConformanceSuite.partial_failure_not_applicable` to the reason; its hook then fails a
whole write transiently instead, and the test checks the documented alternative (the whole write
is written again, nothing dead-lettered, first copies in order, and no write ever failed in part).

Everything the suite reads back goes through :meth:`ConformanceSuite.stored` (or, for the contract
tests, :meth:`ConformanceSuite.read_all`), which checks each message against the committed output
schema (:func:`tests.support.schema.check_message`): every JSON body (and msgpack body) validates,
every message carries the ``schema_version`` header.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest

from bridge.config import SinkConfig
from bridge.connector import Connector
from bridge.errors import PartialFailure
from bridge.formats import Message, Renderer
from bridge.records import Record, Stream
from tests.support.contract import Result, Scenario, first_copy_items, run, transient_partial
from tests.support.records import control_records, stream_records
from tests.support.schema import check_message

FORMATS = [("json", "event"), ("json", "batch"), ("msgpack", "event"), ("msgpack", "batch"), ("raw", "batch")]
# The contract tests need a server set up to fail: two formats, one of each granularity.
CONTRACT_FORMATS = [("json", "event"), ("raw", "batch")]
# Per stream, what the server stored: (value, headers) in server order.
Readback = list[tuple[Stream, list[tuple[bytes, dict[str, str]]]]]


def decode_body(value: bytes) -> dict[str, Any]:
    """A control record's body: JSON (json and raw sinks) or msgpack."""
    try:
        body = msgspec.json.decode(value)
    except msgspec.DecodeError:
        body = msgspec.msgpack.decode(value)
    assert isinstance(body, dict)
    return body


def control_type(value: bytes, headers: dict[str, str]) -> str | None:
    """``SourceReset`` / ``EventsLost`` for a control record, else None."""
    kind = headers.get("type")
    return kind if kind in ("SourceReset", "EventsLost") else None


class Stored(msgspec.Struct):
    """One message as read back from the server."""

    value: bytes
    headers: dict[str, str]


class ConformanceSuite:
    """Subclass per connector; pytest collects the ``test_*`` methods for each subclass."""

    dedup_on_redelivery: ClassVar[bool] = True  # the server stores a re-sent message once
    # None, or why the server cannot fail part of a write transiently in a way the bridge sees
    # (then transient_partial_failure() fails a whole write transiently instead).
    partial_failure_not_applicable: ClassVar[str | None] = None

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

    async def transient_partial_failure(self, sink: SinkConfig, dest: str) -> Scenario:
        """One write of several streams (``Scenario.records``, at least two streams) that the
        server fails in part, transiently: some messages taken, others refused for a reason an
        operator or time heals (``Scenario.heal``, run once the worker counted an error with a
        reason in ``Scenario.struck``; None when the connector's retry itself gets through).
        With ``partial_failure_not_applicable``: a failure of the whole write instead."""
        raise NotImplementedError

    async def refused_message(self, sink: SinkConfig, dest: str) -> Scenario:
        """One write of several streams in which the server refuses one message for itself
        (``Scenario.refused``, a record of one message, neither first nor last of its stream)."""
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------------------
    async def stored(self, dest: str, stream: Stream, expected: int) -> list[Stored]:
        """:meth:`read_back`, each message checked against the output schema: the suite reads
        through this, never through read_back directly."""
        got = await self.read_back(dest, stream, expected)
        for s in got:
            check_message(s.value, s.headers)
        return got

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
        stored = await self.stored(dest, stream, len(messages))
        assert [s.value for s in stored] == [m.value for m in messages]
        for s, m in zip(stored, messages, strict=True):
            for key in ("source", "dp_rank", "epoch", "seq", "type", "schema_version"):
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
        stored = await self.stored(dest, stream, len(self.render(sink, first + second)))
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
            stored = await self.stored(dest, stream, len(messages))
            assert [s.value for s in stored] == [m.value for m in messages]
            return
        stored = await self.stored(dest, stream, len(messages) + len(messages[2:]))
        keys = [tuple(s.headers.get(k) for k in ("source", "dp_rank", "epoch", "seq", "index")) for s in stored]
        first = [s.value for i, s in enumerate(stored) if keys[i] not in keys[:i]]
        assert first == [m.value for m in messages]
        assert len(stored) == len(messages) + len(messages[2:])  # the re-sent tail, stored again

    # -- the delivery contract under partial failure (bridge/connector.py) ---------------------
    def check_stored(self, scenario: Scenario, sink: SinkConfig, result: Result, stored: Readback) -> None:
        """Every record acknowledged; every message but the refused one stored once (first
        copies, for at-least-once sinks), in order per stream; the refused batch announced to the
        sink's consumers (I6) when it is a batch: one ``EventsLost`` of its seq, reason
        ``sink_refused:<sink>``, standing right after it (the connector stops its stream at the
        record after the refused one: bridge/connector.py), where a consumer that orders by
        position keeps it."""
        renderer = Renderer(sink.format, sink.granularity, sink.hash_format)
        assert len(result.acked) == len(scenario.records)
        refused = scenario.refused
        for stream, got in stored:
            kept = [r for r in scenario.records if r.stream.key == stream.key and r is not refused]
            expected = [m.value for r in kept for m in renderer.render(r)]
            firsts = first_copy_items(got)
            lost = [i for i, (value, headers) in enumerate(firsts) if control_type(value, headers) == "EventsLost"]
            assert [v for i, (v, _) in enumerate(firsts) if i not in lost] == expected, (
                f"{stream.key}: a message missing, repeated or out of order"
            )
            if refused is not None and refused.kind == "batch" and stream.key == refused.stream.key:
                assert len(lost) == 1, f"{stream.key}: the refused batch must be announced once, got {len(lost)}"
                (at,) = lost
                body = decode_body(firsts[at][0])
                want = (refused.seq, refused.seq, refused.seq, f"sink_refused:{sink.name}")
                assert (body["seq"], body["from_seq"], body["to_seq"], body["reason"]) == want
                seqs = [int(headers["seq"]) for _, headers in firsts]
                assert all(q <= body["seq"] for q in seqs[:at]) and all(q > body["seq"] for q in seqs[at + 1 :]), (
                    f"{stream.key}: the announcement at seq {body['seq']} is out of order among {seqs}"
                )
            else:  # nothing lost (a refused control record is not announced: it announces nothing lost)
                assert not lost, f"{stream.key}: an announcement for a stream that lost nothing"
            if self.dedup_on_redelivery:
                assert [v for v, _ in got] == [v for v, _ in firsts], f"{stream.key}: stored more than once"

    async def read_all(self, scenario: Scenario, sink: SinkConfig) -> Readback:
        """What the server stored, per stream of the scenario (the refused batch's announcement too)."""
        renderer = Renderer(sink.format, sink.granularity, sink.hash_format)
        streams = {r.stream.key: r.stream for r in scenario.records}
        out = []
        for key, stream in streams.items():
            kept = [r for r in scenario.records if r.stream.key == key and r is not scenario.refused]
            refused = scenario.refused
            announced = 1 if refused is not None and refused.kind == "batch" and refused.stream.key == key else 0
            got = await scenario.read(stream, sum(len(renderer.render(r)) for r in kept) + announced)
            for value, headers in got:
                check_message(value, headers)
            out.append((stream, got))
        return out

    @pytest.mark.parametrize(("fmt", "granularity"), CONTRACT_FORMATS)
    async def test_partial_failure_is_retried_in_order(self, fmt: str, granularity: str, tmp_path: Path) -> None:
        sink = self.sink(fmt, granularity)
        scenario = await self.transient_partial_failure(sink, self.new_dest())
        assert len({r.stream.key for r in scenario.records}) >= 2, "the write must carry several streams"
        result = await run(scenario, sink, tmp_path)
        assert result.dead == [], "nothing may be dead-lettered for a transient failure"
        failed = [exc for _, exc in result.outcomes if exc is not None]
        assert failed, "no write failed: the harness did not cause the failure"
        if self.partial_failure_not_applicable is None:
            assert transient_partial(result.outcomes), f"no write failed in part, transiently: {failed}"
        else:
            # The documented alternative: a transient failure fails the whole write, which the
            # runtime writes again whole; no write ever fails in part.
            assert not transient_partial(result.outcomes), "a write failed in part"
            assert not any(isinstance(exc, PartialFailure) for exc in failed), failed
        self.check_stored(scenario, sink, result, await self.read_all(scenario, sink))

    @pytest.mark.parametrize(("fmt", "granularity"), CONTRACT_FORMATS)
    async def test_a_refused_message_is_isolated(self, fmt: str, granularity: str, tmp_path: Path) -> None:
        sink = self.sink(fmt, granularity)
        scenario = await self.refused_message(sink, self.new_dest())
        refused = scenario.refused
        assert refused is not None
        same = [r for r in scenario.records if r.stream.key == refused.stream.key]
        assert same[0] is not refused and same[-1] is not refused, "the refused message must have neighbours in its stream"
        assert len({r.stream.key for r in scenario.records}) >= 2, "the write must carry several streams"
        (message,) = Renderer(sink.format, sink.granularity, sink.hash_format).render(refused)
        result = await run(scenario, sink, tmp_path)
        assert [(d["source"], d["dp_rank"], d["epoch"], d["seq"]) for d in result.dead] == [
            (refused.stream.source, refused.stream.dp_rank, refused.epoch, refused.seq)
        ], result.dead
        assert result.dead[0]["payload_size"] == len(message.value)
        assert bytes.fromhex(result.dead[0]["payload_hex"]) == message.value[: len(result.dead[0]["payload_hex"]) // 2]
        self.check_stored(scenario, sink, result, await self.read_all(scenario, sink))

    @pytest.mark.parametrize(("fmt", "granularity"), CONTRACT_FORMATS)
    async def test_a_refusal_met_again_is_announced_at_the_same_place(self, fmt: str, granularity: str, tmp_path: Path) -> None:
        """breaker98 B3/B4: after a SIGKILL the replay wrote the refused batch again in writes cut
        otherwise, and its refusal was announced again at another seq: a second EventsLost over
        an exact view (Kafka, NATS, Redis: 18 of 18), or, below the Redis key's top and absent
        there, refused and retried for ever (6 of 6). The same records again in writes of two
        messages: the announcement lands where it stands already, a copy."""
        sink = self.sink(fmt, granularity)
        scenario = await self.refused_message(sink, self.new_dest())
        refused = scenario.refused
        assert refused is not None
        await run(scenario, sink, tmp_path / "first", cleanup=False)
        again = await run(scenario, sink, tmp_path / "again", max_messages=2)
        assert len(again.dead) == 1 and again.dead[0]["seq"] == refused.seq, again.dead
        for stream, got in await self.read_all(scenario, sink):
            bodies = [decode_body(v) for v, h in first_copy_items(got) if control_type(v, h) == "EventsLost"]
            want = [(refused.seq, refused.seq)] if stream.key == refused.stream.key else []
            assert [(b["seq"], b["from_seq"]) for b in bodies] == want, f"{stream.key}: {bodies}"
