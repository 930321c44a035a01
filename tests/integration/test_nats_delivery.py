"""The NATS connector's part of the delivery contract (issue 16), on a real nats-server, through
the runtime's own SinkWorker (retries, fold(), dead letters):

- JetStream never stores a message of a bridge stream after an earlier one of the same stream
  failed in the same write (a full ``discard: new`` stream refuses a large message and takes the
  smaller ones after it): once room is made, every message is stored once, in order;
- a message refused for itself (past the stream's ``max_msg_size``, or the server's
  ``max_payload`` in core NATS) is the only one dead-lettered; its neighbours are delivered;
- a subject no stream captures fails at once with ``no_stream``, and ``--check`` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api as js_api

from bridge import config
from bridge.cli import check
from bridge.config import SinkConfig, convert_options
from bridge.deadletter import DeadLetters
from bridge.errors import NotConnected, Retriable
from bridge.formats import Renderer
from bridge.metrics import Metrics
from bridge.records import Record, Stream, events_lost
from bridge.sink import SinkWorker
from connectors.nats import NatsConnector, NatsOptions, subject_token
from tests.infra.servers import NatsServer
from tests.support.process import freeze, thaw
from tests.support.records import batch

pytestmark = pytest.mark.integration

A, B = Stream("eng-a", 0), Stream("eng-b", 1)


def _dest() -> str:
    return f"KVD{uuid.uuid4().hex[:10].upper()}"


def _subject(dest: str, stream: Stream) -> str:
    return f"{dest}.{subject_token(stream.source)}.{stream.dp_rank}"


def record(stream: Stream, seq: int, size: int) -> Record:
    """An engine batch whose payload (the raw message's value) is ``size`` bytes."""
    return msgspec.structs.replace(batch(stream, seq, epoch=1), payload=bytes([65 + seq % 26]) * size)


@pytest.fixture
async def dest(reader: Client) -> AsyncIterator[str]:
    name = _dest()
    yield name
    with contextlib.suppress(nats.errors.Error):
        await reader.jetstream(timeout=5).delete_stream(name)


class Harness:
    """One sink (``nats-d``, raw batches) and its SinkWorker, with dead letters in a file."""

    def __init__(
        self, tmp_path: Path, url: str, dest: str, *, max_messages: int = 10000, write_timeout: float = 20, **options: Any
    ) -> None:
        opts = {"servers": url, "subject": dest + ".{source}.{dp_rank}", "connect_timeout": "5s", "reconnect_wait": "200ms"}
        opts.update(options)
        cfg = config.convert(
            {
                "type": "nats",
                "name": "nats-d",
                "format": "raw",
                "retry": {"initial_backoff": 0.05, "max_backoff": 0.2, "jitter": 0.0, "write_timeout": write_timeout},
                "batch": {"max_messages": max_messages, "linger": 0},
                "options": opts,
            },
            SinkConfig,
            "sink",
            [],
        )
        assert cfg is not None
        self.cfg = cfg
        self.connector = NatsConnector("nats-d", convert_options(opts, NatsOptions, "sinks[0]"), cfg)
        self.dead_path = tmp_path / "dead.jsonl"
        self.acked: list[Record] = []
        self.worker = SinkWorker(
            0, cfg, self.connector, Renderer("raw"), Metrics(), DeadLetters(str(self.dead_path)),
            lambda _i, records: self.acked.extend(records),
        )  # fmt: skip

    def start(self, records: Sequence[Record]) -> None:
        """Queue every record first, so the first write carries them all, then start the worker."""
        for r in records:
            self.worker.force(r)
        self.worker.start()

    async def wait_for_error(self, text: str) -> None:
        await _until(lambda: text in (self.worker.last_error or ""), f"sink error containing {text!r}")

    async def finish(self) -> None:
        try:
            assert await self.worker.flush(30), f"not delivered: {self.worker.last_error}"
        finally:
            await self.worker.stop()
            self.worker.dead_letters.close()

    def dead(self) -> list[dict[str, Any]]:
        if not self.dead_path.exists():
            return []
        return [json.loads(line) for line in self.dead_path.read_text().splitlines()]


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(600):  # bounded wait, not a timing assertion
        if condition():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"never saw {what}")


async def _subscribed(reader: Client, dest: str) -> list[Msg]:
    """Every message published under ``dest`` from now on (core NATS), in arrival order."""
    got: list[Msg] = []

    async def on_msg(msg: Msg) -> None:
        got.append(msg)

    await reader.subscribe(f"{dest}.>", cb=on_msg)
    await reader.flush()
    return got


async def _stored(reader: Client, dest: str) -> dict[str, list[tuple[int, bytes]]]:
    """Every message of JetStream stream ``dest`` in stream order, per subject: (engine seq, value)."""
    js = reader.jetstream(timeout=5)
    out: dict[str, list[tuple[int, bytes]]] = {}
    last = (await js.stream_info(dest)).state.last_seq
    for seq in range(1, last + 1):
        try:
            msg = await js.get_msg(dest, seq)
        except nats.js.errors.NotFoundError:  # purged filler
            continue
        assert msg.subject is not None
        headers = msg.headers or {}
        out.setdefault(msg.subject, []).append((int(headers.get("seq", -1)), msg.data or b""))
    return out


async def _full_stream(reader: Client, dest: str, *, room: int, max_msg_size: int = -1) -> None:
    """Stream ``dest`` (``max_bytes``, ``discard: new``) with filler so that about ``room`` bytes are left."""
    js = reader.jetstream(timeout=5)
    limit = 16384
    await js.add_stream(
        js_api.StreamConfig(
            name=dest,
            subjects=[f"{dest}.>"],
            max_bytes=limit,
            discard=js_api.DiscardPolicy.NEW,
            max_msg_size=max_msg_size,
            duplicate_window=600,
        )
    )
    while limit - (await js.stream_info(dest)).state.bytes > room + 2000:
        await js.publish(f"{dest}.filler", b"f" * 1900)
    left = limit - (await js.stream_info(dest)).state.bytes
    if left > room:
        await js.publish(f"{dest}.filler", b"f" * max(1, left - room - 60))


async def _make_room(reader: Client, dest: str) -> None:
    await reader.jetstream(timeout=5).purge_stream(dest, subject=f"{dest}.filler")


async def test_full_discard_new_stream_keeps_each_stream_in_order(
    nats_server: NatsServer, reader: Client, dest: str, tmp_path: Path
) -> None:
    """The issue's case: seq 0 refused (maximum bytes exceeded), later smaller ones would fit.
    Nothing of stream A may be stored before A0. The chain refuses everything after A0; B's
    messages are then sent again in turn, and B1, too large for the room left, holds B2 back."""
    await _full_stream(reader, dest, room=1500)
    records = [record(A, 0, 2500), record(B, 0, 20), record(A, 1, 20), record(B, 1, 2500), record(A, 2, 20), record(B, 2, 20)]
    h = Harness(tmp_path, nats_server.url, dest)
    h.start(records)
    try:
        await h.wait_for_error("maximum bytes exceeded")
        error = h.worker.last_error
        while_full = await _stored(reader, dest)
        await _make_room(reader, dest)
    finally:
        await h.finish()
    stored = await _stored(reader, dest)
    assert stored[_subject(dest, A)] == [(r.seq, r.payload) for r in records if r.stream == A]
    assert stored[_subject(dest, B)] == [(r.seq, r.payload) for r in records if r.stream == B]
    assert h.dead() == []
    assert len(h.acked) == len(records)
    assert _subject(dest, A) not in while_full  # nothing of A passed A0 while it was refused
    assert [seq for seq, _ in while_full[_subject(dest, B)]] == [0]  # B went on, up to its own refusal
    assert error is not None and error.startswith("stream_full: sinks[nats-d]")


async def test_refused_message_is_isolated_and_a_transient_failure_after_it_keeps_order(
    nats_server: NatsServer, reader: Client, dest: str, tmp_path: Path
) -> None:
    """A1 is past the stream's max_msg_size (refused for itself: dead-lettered); A2 is refused
    because the stream is full (transient), so A3 must wait for it; B is unaffected."""
    await _full_stream(reader, dest, room=1500, max_msg_size=3000)
    records = [
        record(A, 0, 20),
        record(B, 0, 20),
        record(A, 1, 5000),  # > max_msg_size
        record(A, 2, 2500),  # < max_msg_size, > the room left
        record(B, 1, 20),
        record(A, 3, 20),
        record(B, 2, 20),
    ]
    h = Harness(tmp_path, nats_server.url, dest)
    h.start(records)
    try:
        await h.wait_for_error("maximum bytes exceeded")
        while_full = await _stored(reader, dest)
        await _make_room(reader, dest)
    finally:
        await h.finish()
    stored = await _stored(reader, dest)
    # I6: A1 is announced to the stream's consumers right after A0, where it stands (A2 and A3 wait
    # for it, then for the room): a consumer that orders by position keeps it
    lost = events_lost(A, records[2].epoch, 1, 1, "sink_refused:nats-d", 0.0)
    lost.to_seq = 1
    (announcement,) = Renderer("raw", "batch").render(lost)
    kept = [(r.seq, r.payload) for r in records if r.stream == A and r.seq != 1]
    assert stored[_subject(dest, A)] == [kept[0], (1, announcement.value), *kept[1:]]
    assert stored[_subject(dest, B)] == [(r.seq, r.payload) for r in records if r.stream == B]
    dead = h.dead()
    assert [(d["source"], d["seq"]) for d in dead] == [("eng-a", 1)]
    assert "message size exceeds maximum" in dead[0]["detail"]
    assert [seq for seq, _ in while_full.get(_subject(dest, A), []) if seq > 1] == []  # A2 and A3 waited for the room


async def test_an_announcement_refused_by_a_lowered_max_msg_size_is_kept_until_the_limit_is_set_back(
    nats_server: NatsServer, reader: Client, dest: str, tmp_path: Path
) -> None:
    """Issue 29 (breaker29h W2): A0, A1 stored; an operator lowers the stream's max_msg_size to 64
    bytes; A2 and A3, written meanwhile, were refused for themselves (dead-lettered), and so was the
    EventsLost announcing them, which used to be dead-lettered too: the stream's consumers never
    learnt of A2-A3, the sink stayed ready. Now the announcement is kept, the sink not ready and
    naming why, until the limit is set back; it is then stored right after A1, and A3, which waited
    behind it, after it."""
    js = reader.jetstream(timeout=5)
    await js.add_stream(js_api.StreamConfig(name=dest, subjects=[f"{dest}.>"], duplicate_window=600))
    records = [record(A, q, 200) for q in range(4)]
    h = Harness(tmp_path, nats_server.url, dest)
    h.start(records[:2])
    try:
        await _until(lambda: len(h.acked) == 2, "A0, A1 acknowledged")
        info = await js.stream_info(dest)
        info.config.max_msg_size = 64
        await js.update_stream(info.config)
        for r in records[2:]:  # one write: queued at once while the worker waits for work
            h.worker.force(r)
        await h.wait_for_error("announcement")
        await _until(lambda: len(h.dead()) == 1, "A2 dead-lettered")
        assert not h.worker.connected
        assert "message size exceeds maximum" in str(h.worker.last_error)
        assert len(h.acked) == 2, "acknowledged past an announcement not written"
        info.config.max_msg_size = -1  # the operator sets the limit back
        await js.update_stream(info.config)
    finally:
        await h.finish()
    assert h.worker.connected and len(h.acked) == 4
    # A3 waited behind the announcement of A2 (right after it), so the limit set back took it.
    assert [(d["source"], d["seq"]) for d in h.dead()] == [("eng-a", 2)]
    lost = events_lost(A, records[2].epoch, 2, 2, "sink_refused:nats-d", 0.0)
    (announcement,) = Renderer("raw", "batch").render(lost)
    stored = (await _stored(reader, dest))[_subject(dest, A)]
    assert stored[:2] == [(r.seq, r.payload) for r in records[:2]]
    assert [seq for seq, _ in stored[2:]] == [2, 3]
    assert json.loads(stored[2][1]) | {"ts": None} == json.loads(announcement.value) | {"ts": None}
    assert stored[3] == (3, records[3].payload)


async def test_duplicates_from_an_earlier_try_do_not_let_the_chain_pass_a_failure(
    nats_server: NatsServer, reader: Client, dest: str, tmp_path: Path
) -> None:
    """A duplicate passes the server's Nats-Expected-Last-Msg-Id check whatever it expects. A
    write re-sent after a partial try (B0..B2 stored then) holds A0 (refused: the stream is full),
    B0..B4 and A1: A1 must not follow B4 into the stream past A0's failure (found by a breaker
    script: the chain went A0, B0..B4, A1, and A1 was stored before A0)."""
    await _full_stream(reader, dest, room=4000)  # room for B's and A1, not for A0
    earlier = [record(B, q, 20) for q in range(3)]
    h0 = Harness(tmp_path, nats_server.url, dest)
    h0.start(earlier)
    await h0.finish()
    records = [record(A, 0, 6000), *(record(B, q, 20) for q in range(5)), record(A, 1, 20)]
    h = Harness(tmp_path, nats_server.url, dest)
    h.start(records)
    try:
        await h.wait_for_error("maximum bytes exceeded")
        while_full = await _stored(reader, dest)
        await _make_room(reader, dest)
    finally:
        await h.finish()
    assert _subject(dest, A) not in while_full  # A1 waited for A0
    stored = await _stored(reader, dest)
    assert stored[_subject(dest, A)] == [(0, records[0].payload), (1, records[-1].payload)]
    assert [q for q, _ in stored[_subject(dest, B)]] == [0, 1, 2, 3, 4]  # each once
    assert h.dead() == []


async def test_a_second_jetstream_stream_breaks_the_chain_and_the_rest_goes_in_turn(
    nats_server: NatsServer, reader: Client, dest: str, tmp_path: Path
) -> None:
    """Each bridge stream here goes to a JetStream stream of its own, so the write's chain of
    Nats-Expected-Last-Msg-Id breaks at once (B0 follows A0, stored elsewhere): what follows goes
    again in turn, within the same write, and everything is stored once, in order."""
    js = reader.jetstream(timeout=5)
    other = dest + "B"
    await js.add_stream(name=dest, subjects=[_subject(dest, A)])
    await js.add_stream(name=other, subjects=[_subject(dest, B)])
    try:
        records = [record(s, seq, 30) for seq in range(5) for s in (A, B)]
        h = Harness(tmp_path, nats_server.url, dest)
        h.start(records)
        await h.finish()
        assert h.worker.metrics.registry.get_sample_value("kv_bridge_sink_retries_total", {"sink": "nats-d"}) == 0
        assert (await _stored(reader, dest))[_subject(dest, A)] == [(r.seq, r.payload) for r in records if r.stream == A]
        assert (await _stored(reader, other))[_subject(dest, B)] == [(r.seq, r.payload) for r in records if r.stream == B]
        assert h.dead() == []
    finally:
        with contextlib.suppress(nats.errors.Error):
            await js.delete_stream(other)


async def test_core_oversized_message_is_isolated_across_a_server_restart(
    nats_server: NatsServer, reader: Client, tmp_path: Path
) -> None:
    """Core NATS: a message over max_payload in the middle of a write is dead-lettered alone; writes
    that meet the server down fail whole and are sent again once it is back: copies are possible,
    first copies arrive in order."""
    dest = _dest()
    got = await _subscribed(reader, dest)
    big = reader.max_payload + 1
    records = [record(s, seq, big if (s, seq) == (A, 3) else 200) for seq in range(1000) for s in (A, B)]
    before, after = records[:1000], records[1000:]
    h = Harness(tmp_path, nats_server.url, dest, mode="core", max_messages=50)
    registry = h.worker.metrics.registry
    h.start(before)
    try:
        await _until(lambda: len(h.acked) == len(before), "the first writes delivered")
        await nats_server.astop()
        for r in after:
            h.worker.force(r)
        await _until(
            lambda: bool(registry.get_sample_value("kv_bridge_sink_retries_total", {"sink": "nats-d"})),
            "a write failing while the server is down",
        )
        await nats_server.astart()
        await _until(lambda: reader.is_connected, "the reader reconnected")
    finally:
        await h.finish()
    for s in (A, B):
        heads = [m.headers or {} for m in got if m.subject == _subject(dest, s)]
        seqs = [int(h["seq"]) for h in heads if h["type"] != "EventsLost"]
        first = list(dict.fromkeys(seqs))  # first copies, in arrival order
        assert first == sorted(first), f"{s.source}: first copies out of order"
        assert [seq for seq in first if seq < 500] == [seq for seq in range(500) if (s, seq) != (A, 3)]  # before the outage
        announced = {int(h["seq"]) for h in heads if h["type"] == "EventsLost"}
        assert announced == ({3} if s == A else set()), announced  # right after the refused batch
    dead = h.dead()
    assert [(d["source"], d["seq"]) for d in dead] == [("eng-a", 3)]
    assert "max_payload" in dead[0]["detail"]
    assert len(h.acked) == len(records)


async def test_core_writes_after_a_server_stall_are_counted_only_once_the_server_answers(tmp_path: Path) -> None:
    """Core NATS proves a write by a PING's PONG. A server frozen past the write timeout answers
    the first write's PING late; that late PONG must not end the client's reading (nats-py's own
    flush() leaves its PING cancelled, and a PONG for it kills the read loop: every flush after
    returns at once, proving nothing). So a write while the server is frozen again is never
    counted delivered, and both stalls' batches are delivered once the server answers."""
    server = await NatsServer(tmp_path / "srv").astart()
    pid = server.pid
    assert pid is not None
    dest = _dest()
    h = Harness(tmp_path, server.url, dest, mode="core", write_timeout=1)
    h.start([record(A, 0, 100)])
    try:
        await _until(lambda: len(h.acked) == 1, "the first write delivered")
        for seq in (1, 2):  # each write meets a frozen server, then a server that answers late
            await freeze(pid)
            h.worker.force(record(A, seq, 100))
            retries = h.worker.metrics.registry.get_sample_value("kv_bridge_sink_retries_total", {"sink": "nats-d"}) or 0
            await _until(
                lambda r=retries, s=seq: (
                    len(h.acked) > s
                    or (h.worker.metrics.registry.get_sample_value("kv_bridge_sink_retries_total", {"sink": "nats-d"}) or 0)
                    > r + 1
                ),
                "two writes timing out on the frozen server",
            )
            assert len(h.acked) == seq, f"seq {seq} counted delivered while the server was frozen"
            thaw(pid)
            await _until(lambda s=seq: len(h.acked) == s + 1, f"seq {seq} delivered once the server answers")
    finally:
        thaw(pid)
        await h.finish()
        await asyncio.to_thread(server.remove)
    assert [r.seq for r in h.acked] == [0, 1, 2] and h.dead() == []


async def test_no_stream_fails_at_once_and_check_reports_it(nats_server: NatsServer, tmp_path: Path) -> None:
    """No stream captures the subject: the server answers "no responders", and the write fails
    with reason no_stream naming the subject and the fix, before the runtime's write timeout
    (far longer here) could end it; ``--check`` (online) reports it too."""
    dest = _dest()
    cfg = config.convert(
        {"type": "nats", "name": "nats-n", "format": "raw", "retry": {"write_timeout": 600}}, SinkConfig, "sink", []
    )
    assert cfg is not None
    options = convert_options({"servers": nats_server.url, "subject": dest + ".{source}.{dp_rank}"}, NatsOptions, "s")
    conn = NatsConnector("nats-n", options, cfg)
    await conn.connect()
    try:
        problem = await conn.health()
        assert problem is not None and f"{dest}.*.*" in problem and "stream.create" in problem
        messages = Renderer("raw").render(record(A, 0, 10))
        async with asyncio.timeout(60):  # a bound on the test only: the sink's write timeout is 600 s
            with pytest.raises(Retriable) as info:
                await conn.write(messages)
        assert info.value.reason == "no_stream"
        text = str(info.value)
        assert text.startswith("sinks[nats-n]") and f"{dest}.eng-a.0" in text and "stream.create" in text
    finally:
        await conn.close()

    path = tmp_path / "bridge.yaml"
    path.write_text(
        json.dumps(
            {
                "sources": [{"name": "eng", "endpoint": "tcp://127.0.0.1:1"}],
                "sinks": [{"type": "nats", "name": "nats-n", "format": "raw", **options_dict(nats_server, dest)}],
            }
        )
    )
    out = await asyncio.to_thread(_check, str(path))
    assert out[0] == 3, out  # valid, but the sink is not usable as configured (docs/reference/cli.md: exit codes)
    assert "nats-n" in out[1] and f"{dest}.*.*" in out[1] and "stream" in out[1], out


async def test_check_reports_a_stream_that_captures_only_some_configured_sources(
    nats_server: NatsServer, reader: Client, tmp_path: Path
) -> None:
    """An operator's stream made for the sources there were (``{dest}.llama-a.*``), then a source
    added: ``--check`` said ok and the run failed no_stream for the new source (breaker30n B3, 3
    of 3). It looks for each configured source's subject, and says which and the fix."""
    dest = _dest()
    js = reader.jetstream(timeout=10)
    await js.add_stream(js_api.StreamConfig(name=dest, subjects=[f"{dest}.llama-a.*"]))
    try:
        path = tmp_path / "bridge.yaml"
        sources = [{"name": "llama-a", "endpoint": "tcp://127.0.0.1:1"}, {"name": "llama-b", "endpoint": "tcp://127.0.0.1:3"}]
        sink = {"type": "nats", "name": "nats-p", "format": "raw", **options_dict(nats_server, dest)}
        path.write_text(json.dumps({"sources": sources, "sinks": [sink]}))
        code, out = await asyncio.to_thread(_check, str(path))
        assert code == 3, out
        assert f"'{dest}.llama-b.0' would fail (no_stream)" in out and f"add '{dest}.*.*' to its subjects" in out, out
        assert f"'{dest}.llama-a.0'" not in out
        path.write_text(json.dumps({"sources": sources[:1], "sinks": [sink]}))
        code, out = await asyncio.to_thread(_check, str(path))
        assert "sinks[0] (nats-p): reachable" in out, out  # (the engine's endpoint is down: exit 3 for that alone)
    finally:
        await js.delete_stream(dest)
    # A template with {type}: a stream made for the batches alone (breaker30n2 B3: the engine's
    # restart then stopped the stream behind its SourceReset, no_stream).
    await js.add_stream(js_api.StreamConfig(name=dest, subjects=[f"{dest}.*.*.EventBatch"]))
    try:
        sink["subject"] = dest + ".{source}.{dp_rank}.{type}"
        path.write_text(json.dumps({"sources": sources[:1], "sinks": [sink]}))
        code, out = await asyncio.to_thread(_check, str(path))
        assert f"'{dest}.llama-a.0.SourceReset', '{dest}.llama-a.0.EventsLost'" in out, out
        assert f"'{dest}.llama-a.0.EventBatch'" not in out
    finally:
        await js.delete_stream(dest)


async def test_check_reports_a_stream_it_would_create_that_misses_a_source(
    nats_server: NatsServer, reader: Client, tmp_path: Path
) -> None:
    """breaker107 F1: ``stream.create`` with ``stream.subjects`` made for source a alone: ``--check``
    said "config ok" (the missing stream was only checked as creatable), the run created it, and
    source b's writes failed no_stream, holding a's back (3 of 3). It now names b's subject."""
    dest = _dest()
    path = tmp_path / "bridge.yaml"
    sources = [{"name": "llama-a", "endpoint": "tcp://127.0.0.1:1"}, {"name": "llama-b", "endpoint": "tcp://127.0.0.1:3"}]
    sink = {"type": "nats", "name": "nats-p", "format": "raw", **options_dict(nats_server, dest)}
    sink["stream"] = {"name": dest, "create": True, "subjects": [f"{dest}.llama-a.*"]}
    path.write_text(json.dumps({"sources": sources, "sinks": [sink]}))
    code, out = await asyncio.to_thread(_check, str(path))
    assert code == 3, out
    assert f"'{dest}.llama-b.0' would fail (no_stream)" in out and "add " in out and "stream.subjects" in out, out
    assert f"'{dest}.llama-a.0'" not in out
    js = reader.jetstream(timeout=10)
    with pytest.raises(nats.js.errors.NotFoundError):  # (--check creates nothing)
        await js.stream_info(dest)
    sink["stream"]["subjects"] = [f"{dest}.llama-a.*", f"{dest}.llama-b.*"]
    path.write_text(json.dumps({"sources": sources, "sinks": [sink]}))
    code, out = await asyncio.to_thread(_check, str(path))
    assert "sinks[0] (nats-p): reachable" in out and "no_stream" not in out, out


async def test_check_accepts_a_sinks_subjects_split_over_two_streams(
    nats_server: NatsServer, reader: Client, tmp_path: Path
) -> None:
    """breaker107 F2: an operator's streams ``P.a.>`` and ``P.b.>`` (a layout docs/sinks/nats.md
    supports), the sink's ``stream.name`` the first: ``--check`` failed the config, naming b's
    subject, though the run stored both (3 of 3). Each subject is looked for in every stream."""
    dest = _dest()
    js = reader.jetstream(timeout=10)
    await js.add_stream(js_api.StreamConfig(name=f"{dest}_A", subjects=[f"{dest}.llama-a.>"]))
    await js.add_stream(js_api.StreamConfig(name=f"{dest}_B", subjects=[f"{dest}.llama-b.>"]))
    try:
        path = tmp_path / "bridge.yaml"
        sources = [{"name": "llama-a", "endpoint": "tcp://127.0.0.1:1"}, {"name": "llama-b", "endpoint": "tcp://127.0.0.1:3"}]
        sink = {"type": "nats", "name": "nats-p", "format": "raw", **options_dict(nats_server, dest)}
        sink["stream"] = {"name": f"{dest}_A", "create": False}
        path.write_text(json.dumps({"sources": sources, "sinks": [sink]}))
        code, out = await asyncio.to_thread(_check, str(path))
        assert "sinks[0] (nats-p): reachable" in out and "no_stream" not in out, out
        sources.append({"name": "llama-c", "endpoint": "tcp://127.0.0.1:5"})  # (a subject neither captures)
        path.write_text(json.dumps({"sources": sources, "sinks": [sink]}))
        code, out = await asyncio.to_thread(_check, str(path))
        assert code == 3 and f"'{dest}.llama-c.0' would fail (no_stream)" in out, out
        assert f"'{dest}.llama-b.0'" not in out, out
    finally:
        await js.delete_stream(f"{dest}_A")
        await js.delete_stream(f"{dest}_B")


REFUSING = {
    "sealed": ({"sealed": True}, "is sealed"),
    # breaker75 B2: no write is ever acknowledged (every one times out); ready and "config ok".
    "no_ack": ({"no_ack": True}, "acknowledges no publish (no_ack: true)"),
    # breaker75 B3: each engine stream (a state key) is one subject, refused past its N-th message.
    "discard_new_per_subject": (
        {"discard": js_api.DiscardPolicy.NEW, "discard_new_per_subject": True, "max_msgs_per_subject": 2},
        "refuses a subject's message past its 2",
    ),
}
"""Stream settings that refuse (or never acknowledge) every write of the sink, and what it says."""


async def _refusing_stream(js: Any, dest: str, setting: str) -> str:
    """Stream ``dest`` with the refusing settings ``setting`` (see REFUSING); what the sink says of it."""
    changes, said = REFUSING[setting]
    await js.add_stream(js_api.StreamConfig(name=dest, subjects=[f"{dest}.>"]))
    info = await js.stream_info(dest)
    await js.update_stream(dataclasses.replace(info.config, **changes))
    return said


@pytest.mark.parametrize("setting", list(REFUSING))
async def test_a_stream_refusing_every_write_is_not_usable_and_check_says_so(
    nats_server: NatsServer, reader: Client, tmp_path: Path, setting: str
) -> None:
    """A sealed stream refuses every write for good: ``--check`` said "config ok" and an idle sink
    was ready (breaker30h2 B3, 4 of 4); so with a stream that acknowledges nothing, or refuses a
    subject's messages past a few. Reported at connect: not ready, and ``--check`` exit 3."""
    dest, js = _dest(), reader.jetstream(timeout=10)
    said = await _refusing_stream(js, dest, setting)
    try:
        path = tmp_path / "bridge.yaml"
        sink = {"type": "nats", "name": "nats-z", "format": "raw", **options_dict(nats_server, dest)}
        path.write_text(json.dumps({"sources": [{"name": "e", "endpoint": "tcp://127.0.0.1:1"}], "sinks": [sink]}))
        code, out = await asyncio.to_thread(_check, str(path))
        assert code == 3 and f"JetStream stream {dest!r} {said}" in out and "reachable, not usable" in out, out
    finally:
        await js.delete_stream(dest)


@pytest.mark.parametrize("setting", list(REFUSING))
async def test_a_run_on_a_stream_refusing_every_write_is_not_ready_from_its_connect(
    nats_server: NatsServer, reader: Client, tmp_path: Path, setting: str
) -> None:
    """The connect finds the refusal without failing, and the sink was ready until its first idle
    health check, up to 5 s later. It is not ready from the connect on, naming the setting."""
    dest, js = _dest(), reader.jetstream(timeout=10)
    said = await _refusing_stream(js, dest, setting)
    h = Harness(tmp_path, nats_server.url, dest)
    h.worker.health_interval = 3600.0  # no idle health check comes: the connect alone must tell
    try:
        h.worker.start()
        await _until(lambda: h.connector._nc is not None, "the connect")
        await _until(lambda: f"JetStream stream {dest!r} {said}" in (h.worker.problem or ""), "the refusal at connect")
    finally:
        await h.worker.stop()
        h.worker.dead_letters.close()
        await js.delete_stream(dest)


@pytest.mark.parametrize("limit", ["max_msgs", "max_bytes"])
async def test_check_says_a_full_discard_new_stream_is_not_usable(
    nats_server: NatsServer, reader: Client, tmp_path: Path, limit: str
) -> None:
    """breaker70 B3: an existing stream with ``discard: new`` at its max_msgs (or max_bytes)
    refuses every publish; ``--check`` said "config ok". It says the stream is full now (exit 3)."""
    dest = _dest()
    js = reader.jetstream(timeout=10)
    cap = {"max_msgs": 5} if limit == "max_msgs" else {"max_bytes": 4000}
    await js.add_stream(js_api.StreamConfig(name=dest, subjects=[f"{dest}.>"], discard=js_api.DiscardPolicy.NEW, **cap))
    with contextlib.suppress(nats.js.errors.BadRequestError, nats.js.errors.APIError):
        for _ in range(5 if limit == "max_msgs" else 40):
            await js.publish(f"{dest}.x", b"x" * 100)
    try:
        path = tmp_path / "bridge.yaml"
        sink = {"type": "nats", "name": "nats-f", "format": "raw", **options_dict(nats_server, dest)}
        path.write_text(json.dumps({"sources": [{"name": "e", "endpoint": "tcp://127.0.0.1:1"}], "sinks": [sink]}))
        code, out = await asyncio.to_thread(_check, str(path))
        assert code == 3 and f"JetStream stream {dest!r} is full (" in out and f"of {limit} " in out, out
    finally:
        await js.delete_stream(dest)


def options_dict(server: NatsServer, dest: str) -> dict[str, Any]:
    return {"servers": server.url, "subject": dest + ".{source}.{dp_rank}"}


def _check(path: str) -> tuple[int, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = check(path)
    return code, out.getvalue() + err.getvalue()


async def test_a_message_over_a_max_payload_lowered_by_a_reload_is_refused_alone_and_the_sink_goes_on(tmp_path: Path) -> None:
    """breaker57 B1: the operator lowers the server's max_payload by a configuration reload during a
    run, and the next batch is over it. nats-py closes its client for good on the server's
    "Maximum Payload Violation": the sink never connected again and stayed not ready, every later
    batch undelivered, nothing dead-lettered nor announced, until the bridge restarted (I5, I6).
    It connects again now, learns the new limit, and refuses that batch alone."""
    from tests.integration.test_nats import _reload

    server = await NatsServer(tmp_path / "nats").astart()
    reader = await nats.connect(server.url)
    try:
        dest = _dest()
        got = await _subscribed(reader, dest)
        h = Harness(tmp_path, server.url, dest, mode="core", max_messages=1)
        h.start([record(A, seq, 200) for seq in range(5)])
        try:
            await _until(lambda: len(h.acked) == 5, "the first batches delivered")
            await _reload(server, "max_payload: 16384")
            for r in [record(A, 5, 20000), *(record(A, seq, 200) for seq in range(6, 10))]:
                h.worker.force(r)
            assert await h.worker.flush(30), f"not delivered: {h.worker.last_error}"
            assert await h.connector.health() is None
        finally:
            await h.finish()
        await _until(lambda: len({m.headers.get("seq") for m in got if m.headers}) >= 10, "every batch and the announcement")
    finally:
        await reader.close()
        server.remove()
    dead = h.dead()
    assert [(d["source"], d["seq"]) for d in dead] == [("eng-a", 5)] and "max_payload" in dead[0]["detail"], dead
    kinds = [(int((m.headers or {})["seq"]), (m.headers or {}).get("type", "batch")) for m in got]
    assert [seq for seq, kind in kinds if kind == "EventBatch"] == [0, 1, 2, 3, 4, 6, 7, 8, 9], kinds
    assert (5, "EventsLost") in kinds, kinds


async def test_a_max_payload_raised_by_a_reload_is_taken_at_the_next_audit(tmp_path: Path) -> None:
    """breaker90 B5: the operator raises the server's max_payload by a configuration reload, to let
    the batches the sink refused as too large through. nats-py keeps the limit of its connect, and
    the sink refused every later one as before, not ready, until the bridge restarted (3 of 3).
    The audit after such a refusal reads the server's limit again."""
    from tests.integration.test_nats import _reload

    server = await NatsServer(tmp_path / "nats", extra_config="max_payload: 4096").astart()
    reader = await nats.connect(server.url)
    try:
        dest = _dest()
        got = await _subscribed(reader, dest)
        h = Harness(tmp_path, server.url, dest, mode="core", max_messages=1)
        h.start([record(A, 0, 200), record(A, 1, 6000)])
        try:
            await _until(lambda: len(h.dead()) == 1, "seq 1 refused as too large")
            await _reload(server, "max_payload: 65536")
            await h.connector.audit()
            h.worker.force(record(A, 2, 6000))
            assert await h.worker.flush(30), f"not delivered: {h.worker.last_error}"
        finally:
            await h.finish()
        await _until(lambda: {int((m.headers or {})["seq"]) for m in got} >= {0, 1, 2}, "seq 2 stored")
    finally:
        await reader.close()
        server.remove()
    assert [d["seq"] for d in h.dead()] == [1]


async def test_a_user_who_may_not_subscribe_to_its_inbox_is_refused_not_unreachable(tmp_path: Path) -> None:
    """breaker89 B5: a user that may publish anywhere but not subscribe to ``_INBOX.>`` (where
    JetStream's answers come back). Setup's requests timed out and ``--check`` said "unreachable"
    ("is the server up and reachable from here?"), while the server had answered with a
    permissions violation: it is "reachable, not usable as configured", naming the permission."""
    users = (
        'users: [{user: u, password: p, permissions: {publish: {allow: [">"]}, subscribe: {deny: ["_INBOX.>"]}}}, '
        "{user: admin, password: a}]"  # (the harness's own health check logs in as admin)
    )
    accounts = f"accounts {{\n  A {{ jetstream: enabled, {users} }}\n}}\nno_auth_user: admin\n"
    server = await NatsServer(tmp_path / "srv", extra_config=accounts).astart()
    try:
        dest = _dest()
        options = {"servers": server.url, "user": "u", "password": "p", "subject": dest + ".{source}.{dp_rank}",
                   "connect_timeout": 2.0, "stream": {"create": True, "name": dest}}  # fmt: skip
        conn = NatsConnector("nats-n", convert_options(options, NatsOptions, "sinks[0]"), SinkConfig(type="nats", name="nats-n"))
        with pytest.raises(NotConnected) as refused:
            await conn.connect()
        assert refused.value.reason == "no_permission" and "_INBOX" in str(refused.value), refused.value
        await conn.close()
        path = tmp_path / "bridge.yaml"
        sinks = [{"type": "nats", "name": "nats-n", **options}]
        path.write_text(json.dumps({"sources": [{"name": "eng", "endpoint": "tcp://127.0.0.1:1"}], "sinks": sinks}))
        code, said = await asyncio.to_thread(_check, str(path))
        assert code == 3 and "sinks[0] (nats-n): reachable, not usable as configured" in said, said
        assert "is the server up" not in said, said
    finally:
        server.stop()
