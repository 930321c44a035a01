"""The NATS sink when the server loses, limits or keeps in memory what the bridge relies on (issue
29, I6), on a real nats-server with JetStream:

- the events stream deleted during a run: with ``stream.create`` it is created again (the
  configured settings) at the next write and what it held is announced (``SinkLost``, spans per
  bridge stream); without, the sink is not ready, naming the stream and the fix, and announces the
  loss once an operator created it again; a stream deleted and created again between two writes
  (its sequence goes back) is announced too, and two streams sharing the subjects are not taken
  for that;
- end to end, a server restart that loses a stream and a bucket kept in memory: the new stream
  starts with an EventsLost (sink_lost:<sink>) over what the old one held, then the batches
  after, and a consumer's bootstrap is incomplete;
- a stream or bucket kept in memory is warned about at connect and in ``--check``: one WARNING
  each, with the consequence and the fix;
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import api as js_api

from bridge.cli import check
from bridge.config import SinkConfig, convert_options, from_data
from bridge.errors import ConfigError, PartialFailure, Retriable, SinkLost
from bridge.formats import Message, Renderer, state_message
from bridge.records import Stream
from bridge.runtime import Bridge
from bridge.state import StateTracker
from connectors.nats import NatsConnector, NatsOptions, subject_token
from kv_consumer.nats import bootstrap
from tests.infra.servers import NatsServer
from tests.integration.test_nats_delivery import REFUSING
from tests.support.cache_engine import CacheEngine
from tests.support.harness import free_port, one_run
from tests.support.records import stream_records

pytestmark = pytest.mark.integration

SINK = SinkConfig(type="nats", name="nats-l", format="json", granularity="batch")
A, B = Stream("eng-a", 0), Stream("eng-b", 1)
U64 = (1 << 64) - 1


def _options(url: str, dest: str, **extra: Any) -> NatsOptions:
    base: dict[str, Any] = {
        "servers": url,
        "subject": dest + ".{source}.{dp_rank}",
        "connect_timeout": 5.0,
        "reconnect_wait": 0.2,
        "stream": {"create": True, "name": dest, "duplicate_window": "90s", "max_age": "1h"},
    }
    base.update(extra)
    return convert_options(base, NatsOptions, "sinks[0]")


def _render(streams: Sequence[Stream], start: int, count: int, epoch: int = 1) -> list[Message]:
    r = Renderer("json", "batch")
    return [m for s in streams for rec in stream_records(s, count, start=start, epoch=epoch) for m in r.render(rec)]


async def _subject_messages(nc: Client, dest: str, stream: Stream, within: str | None = None) -> list[dict[str, Any]]:
    """The messages (JSON) held on ``stream``'s subject (``dest.<source>.<rank>``) of JetStream stream
    ``dest`` (or ``within``, where an operator split the subjects over several), in stream order."""
    js = nc.jetstream(timeout=5)
    subject = f"{dest}.{subject_token(stream.source)}.{stream.dp_rank}"
    out: list[dict[str, Any]] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(within or dest, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return out
        out.append(json.loads(msg.data or b"{}"))
        assert msg.seq is not None
        seq = msg.seq + 1


async def _subject_seqs(nc: Client, dest: str, stream: Stream, within: str | None = None) -> list[int]:
    """The engine seqs held on ``stream``'s subject of JetStream stream ``dest`` (or ``within``), in
    stream order."""
    return [int(m["seq"]) for m in await _subject_messages(nc, dest, stream, within)]


@pytest.fixture
async def dest(reader: Client) -> AsyncIterator[str]:
    name = f"KVL{uuid.uuid4().hex[:10].upper()}"
    yield name
    with contextlib.suppress(nats.errors.Error):
        await reader.jetstream(timeout=5).delete_stream(name)


# -- case 5: the events stream lost during a run --------------------------------------------------


async def test_a_deleted_stream_is_created_again_and_its_loss_announced(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    js = reader.jetstream(timeout=5)
    conn = NatsConnector("nats-l", _options(nats_server.url, dest), SINK)
    await conn.connect()  # creates the stream: a bridge stream's copy starts at its first message
    try:
        await conn.write(_render([A], 3, 5) + _render([B], 0, 2))  # A: 3..7, B: 0..1
        await js.delete_stream(dest)
        retry = _render([A, B], 8, 2)
        with pytest.raises(Retriable) as failed:
            await conn.write(retry)
        print(f"\nthe write meeting the deleted stream: {failed.value.reason}: {failed.value}")
        assert failed.value.reason == "no_stream"
        assert "set stream.create" not in str(failed.value)  # it is set: that advice would be wrong
        info = await js.stream_info(dest)  # created again for the next write, as configured
        assert info.config.subjects == [f"{dest}.*.*"] and info.config.duplicate_window == 90.0
        assert info.config.max_age == 3600.0 and info.state.messages == 0
        with pytest.raises(SinkLost) as lost:
            await conn.write(retry)  # the runtime's retry: the loss first, nothing stored yet
        print(f"announced: {lost.value}; spans {[(s.key, e, f, t) for s, e, f, t in lost.value.spans]}")
        assert sorted((s.key, e, f, t) for s, e, f, t in lost.value.spans) == [(A.key, 1, 3, 7), (B.key, 1, 0, 1)]
        assert (await js.stream_info(dest)).state.messages == 0
        await conn.write(retry)  # the same messages again: they go through
        assert await conn.health() is None
    finally:
        await conn.close()
    assert await _subject_seqs(reader, dest, A) == [8, 9]


async def test_a_stream_lost_while_the_sink_is_quiet_is_found_by_its_audit(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """Issue 29 B2 on NATS: no write comes (the engine is quiet), so only the runtime's audit
    between writes can find the loss: it raises SinkLost once, with the spans; the audit of a
    stream that holds what it acknowledged says nothing."""
    js = reader.jetstream(timeout=5)
    conn = NatsConnector("nats-l", _options(nats_server.url, dest), SINK)
    await conn.connect()
    try:
        await conn.write(_render([A], 3, 5) + _render([B], 0, 2))
        await conn.audit()  # nothing lost: nothing raised
        await js.delete_stream(dest)
        with pytest.raises(SinkLost) as lost:
            await conn.audit()
        assert sorted((s.key, e, f, t) for s, e, f, t in lost.value.spans) == [(A.key, 1, 3, 7), (B.key, 1, 0, 1)]
        await conn.audit()  # said once
        retry = _render([A, B], 8, 2)
        with pytest.raises(Retriable):
            await conn.write(retry)  # no stream: created again, as configured
        await conn.write(retry)
    finally:
        await conn.close()
    assert await _subject_seqs(reader, dest, A) == [8, 9]


async def test_a_stream_another_pod_created_again_and_filled_past_ours_is_found_by_the_audit(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """Breaker find: pod A's stream is deleted and pod B (another engine, the same stream) creates
    it again and writes past the last JetStream seq A had: the sequence alone looks intact to A.
    The stream's creation time is not: A's audit announces its loss."""
    js = reader.jetstream(timeout=5)
    a = NatsConnector("nats-l", _options(nats_server.url, dest), SINK)
    b = NatsConnector("nats-l", _options(nats_server.url, dest), SINK)
    await a.connect()
    await b.connect()
    try:
        await a.write(_render([A], 0, 3))  # JetStream seqs 1..3
        await a.audit()
        await js.delete_stream(dest)
        with pytest.raises(Retriable):
            await b.write(_render([B], 0, 10))  # no stream: created again
        await b.write(_render([B], 0, 10))
        assert (await js.stream_info(dest)).state.last_seq == 10
        with pytest.raises(SinkLost) as lost:
            await a.audit()
        assert [(s.key, e, f, t) for s, e, f, t in lost.value.spans] == [(A.key, 1, 0, 2)]
        await a.audit()  # said once
        await a.write(_render([A], 3, 1))
    finally:
        await a.close()
        await b.close()
    assert await _subject_seqs(reader, dest, A) == [3]


async def test_a_stream_created_again_before_the_first_write_is_no_loss(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """Breaker find (N5, I4): the stream was created again after this pod connected and before it
    wrote anything; what it then wrote is all there, and its audit must not announce it lost."""
    js = reader.jetstream(timeout=5)
    conn = NatsConnector("nats-l", _options(nats_server.url, dest), SINK)
    await conn.connect()
    try:
        info = await js.stream_info(dest)
        await js.delete_stream(dest)
        await js.add_stream(info.config)
        await conn.write(_render([A], 0, 5))
        await conn.audit()
        await conn.audit()
    finally:
        await conn.close()
    assert await _subject_seqs(reader, dest, A) == [0, 1, 2, 3, 4]


async def test_a_lost_stream_announces_every_epoch_it_held(nats_server: NatsServer, reader: Client, dest: str) -> None:
    """Breaker find (a crash loop): epochs 1 (seqs 0-4), 2 (seq 0) and 3 (seqs 0-2) held, then the
    stream lost: each epoch's span is announced, not the two newest alone."""
    js = reader.jetstream(timeout=5)
    conn = NatsConnector("nats-l", _options(nats_server.url, dest), SINK)
    await conn.connect()
    try:
        await conn.write(_render([A], 0, 5, epoch=1) + _render([A], 0, 1, epoch=2) + _render([A], 0, 3, epoch=3))
        await js.delete_stream(dest)
        with pytest.raises(SinkLost) as lost:
            await conn.audit()
        spans = sorted((s.key, e, f, t) for s, e, f, t in lost.value.spans)
        assert spans == [(A.key, 1, 0, 4), (A.key, 2, 0, 0), (A.key, 3, 0, 2)]
    finally:
        await conn.close()


async def test_without_create_a_lost_stream_is_announced_and_named_until_it_is_back(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    js = reader.jetstream(timeout=5)
    config = js_api.StreamConfig(name=dest, subjects=[f"{dest}.>"])
    await js.add_stream(config)
    conn = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"name": "UNUSED"}), SINK)
    await conn.connect()
    try:
        await conn.write(_render([A], 3, 5))
        await js.delete_stream(dest)
        retry = _render([A], 8, 1)
        with pytest.raises(Retriable) as failed:
            await conn.write(retry)
        assert failed.value.reason == "no_stream"
        with pytest.raises(SinkLost) as lost:  # announced at once (the runtime queues it ahead of the stream)
            await conn.write(retry)
        assert [(s.key, e, f, t) for s, e, f, t in lost.value.spans] == [(A.key, 1, 0, 7)]  # its start unknown: from 0
        for _ in range(2):  # then not ready, for as long as it lasts
            with pytest.raises(Retriable) as failed:
                await conn.write(retry)
            assert failed.value.reason == "no_stream"
            problem = await conn.health()
            print(f"\nhealth: {problem}")
            assert problem is not None and f"stream {dest!r}" in problem and "set stream.create: true" in problem
        await js.add_stream(config)  # the operator's fix
        await conn.write(retry)
        assert await conn.health() is None
    finally:
        await conn.close()
    assert await _subject_seqs(reader, dest, A) == [8]


async def test_a_created_stream_missing_a_sources_subject_is_named_as_it_is(nats_server: NatsServer, dest: str) -> None:
    """breaker107 F1: a stream the sink created with ``stream.subjects`` missing source b's: b's
    writes failed saying the stream "is created again" though it was there. The error names the
    stream and the subject it does not capture, and the fix."""
    b = Stream("qwen-b", 0)
    conn = NatsConnector(
        "nats-l",
        _options(nats_server.url, dest, stream={"create": True, "name": dest, "subjects": [f"{dest}.{A.source}.*"]}),
        SINK,
    )
    await conn.connect()
    try:
        with pytest.raises(PartialFailure) as failed:
            await conn.write(_render([A, b], 0, 1))
        errors = failed.value.errors
        assert [(i, e.reason) for i, e in errors.items()] == [(1, "no_stream")], errors
        why = str(errors[1])
        assert f"stream {dest!r} does not capture subject '{dest}.qwen-b.0'" in why and "created again" not in why, why
        assert await conn.health() == why
    finally:
        await conn.close()


async def test_a_stream_created_again_between_two_writes_is_announced(nats_server: NatsServer, reader: Client, dest: str) -> None:
    """Deleted and created again (by an operator, or another replica after a restart that lost it)
    before the bridge wrote to it: no write fails, but the sequence goes back."""
    js = reader.jetstream(timeout=5)
    conn = NatsConnector("nats-l", _options(nats_server.url, dest), SINK)
    await conn.connect()
    try:
        await conn.write(_render([A], 0, 30))
        await js.delete_stream(dest)
        await js.add_stream(js_api.StreamConfig(name=dest, subjects=[f"{dest}.*.*"]))
        await conn.write(_render([A], 30, 2))  # stored in the new stream, after the loss
        with pytest.raises(SinkLost) as lost:
            await conn.write(_render([A], 32, 1))
        assert [(s.key, e, f, t) for s, e, f, t in lost.value.spans] == [(A.key, 1, 0, 31)]
    finally:
        await conn.close()


async def test_two_streams_sharing_the_subjects_are_not_taken_for_a_lost_one(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """Each JetStream stream numbers its messages itself: a write whose messages go to two streams
    (one per source here), in any order, is not a sequence going back."""
    js = reader.jetstream(timeout=5)
    await js.add_stream(js_api.StreamConfig(name=dest, subjects=[f"{dest}.eng-a.>"]))
    await js.add_stream(js_api.StreamConfig(name=dest + "B", subjects=[f"{dest}.eng-b.>"]))
    await js.publish(f"{dest}.eng-a.9", b"another publisher's")  # the streams' sequences differ
    conn = NatsConnector("nats-l", _options(nats_server.url, dest, stream={}), SINK)
    await conn.connect()
    try:
        for start in range(0, 12, 3):
            await conn.write(_render([A, B] if start % 2 else [B, A], start, 3))
    finally:
        await conn.close()
        await js.delete_stream(dest + "B")
    assert await _subject_seqs(reader, dest, A) == list(range(12))


@pytest.mark.parametrize("lost", ["A", "B"])
async def test_one_of_two_streams_sharing_the_subjects_lost_is_told_to_its_bridge_streams_only(
    nats_server: NatsServer, reader: Client, dest: str, lost: str
) -> None:
    """breaker89 B1: subjects split over two JetStream streams (one per source). The connector knew
    one events stream, the last to acknowledge: a loss of the other was never announced (3 of 3),
    and a loss of either was announced to both bridge streams, the intact one too (3 of 3). Each
    bridge stream now has its own: a loss goes to the bridge streams that stream held, found by
    the audit and by a write's sequence going back."""
    js = reader.jetstream(timeout=5)
    names = {"A": dest, "B": dest + "B"}
    await js.add_stream(js_api.StreamConfig(name=names["A"], subjects=[f"{dest}.eng-a.>"]))
    await js.add_stream(js_api.StreamConfig(name=names["B"], subjects=[f"{dest}.eng-b.>"]))
    gone, kept = (A, B) if lost == "A" else (B, A)
    conn = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"create": False}), SINK)
    await conn.connect()
    try:
        await conn.write(_render([A], 0, 5))
        await conn.write(_render([B], 0, 5))  # (B acknowledged last)
        await conn.audit()  # nothing lost
        await js.delete_stream(names[lost])
        await js.add_stream(js_api.StreamConfig(name=names[lost], subjects=[f"{dest}.eng-{lost.lower()}.>"]))
        with pytest.raises(SinkLost) as told:
            await conn.audit()
        assert [(s.key, e, f, t) for s, e, f, t in told.value.spans] == [(gone.key, 1, 0, 4)]
        await conn.audit()  # said once
        await conn.write(_render([A, B], 5, 3))
        # The same found by a write: the lost stream's sequence goes back below what it gave.
        await js.delete_stream(names[lost])
        await js.add_stream(js_api.StreamConfig(name=names[lost], subjects=[f"{dest}.eng-{lost.lower()}.>"]))
        await conn.write(_render([gone], 8, 1))
        with pytest.raises(SinkLost) as told:
            await conn.write(_render([A, B], 9, 1))
        assert [(s.key, e, f, t) for s, e, f, t in told.value.spans] == [(gone.key, 1, 0, 8)]
        held = {A.key: await _subject_seqs(reader, dest, A, names["A"]), B.key: await _subject_seqs(reader, dest, B, names["B"])}
        assert held[kept.key] == list(range(8)), held
    finally:
        await conn.close()
        with contextlib.suppress(nats.errors.Error):
            await js.delete_stream(dest + "B")


# -- case 13: memory storage under a sink that relies on what it stored ---------------------------


async def test_memory_storage_is_warned_about_at_connect_and_in_check(
    nats_server: NatsServer, reader: Client, dest: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = f"ST{dest}"
    options = {
        "servers": nats_server.url,
        "subject": dest + ".{source}.{dp_rank}",
        "stream": {"create": True, "name": dest, "storage": "memory"},
        "state": {"enabled": True, "bucket": bucket, "create": True, "storage": "memory"},
    }
    sink = SinkConfig(type="nats", name="nats-m", format="json", granularity="batch")
    try:
        conn = NatsConnector("nats-m", convert_options(options, NatsOptions, "sinks[0]"), sink)
        with caplog.at_level(logging.WARNING, logger="connectors.nats"):
            await conn.connect()
        await conn.close()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        print("\n" + "\n".join(warnings))
        assert len(warnings) == 2, warnings  # one for the stream, one for the bucket
        stream_warning, bucket_warning = sorted(warnings, key=lambda w: "KV bucket" in w)
        assert f"JetStream stream {dest!r} keeps its data in memory" in stream_warning
        assert "sink_lost:nats-m" in stream_warning and "stream.storage: file" in stream_warning
        assert f"KV bucket {bucket!r} keeps its data in memory" in bucket_warning
        assert "incomplete" in bucket_warning and "state.storage: file" in bucket_warning

        caplog.clear()
        path = tmp_path / "bridge.yaml"
        source = {"name": "e", "endpoint": f"tcp://127.0.0.1:{free_port()}", "bind": True}  # nothing to probe
        path.write_text(json.dumps({"sources": [source], "sinks": [{"type": "nats", "name": "nats-m", **options}]}))
        with caplog.at_level(logging.WARNING, logger="connectors.nats"):
            assert await asyncio.to_thread(check, str(path)) == 0  # a warning, not a refusal
        assert len([r for r in caplog.records if "keeps its data in memory" in r.getMessage()]) == 2
    finally:
        with contextlib.suppress(nats.errors.Error):
            await reader.jetstream(timeout=5).delete_key_value(bucket)


# -- case 5 end to end: the runtime announces what the server lost --------------------------------


def _bridge_config(tmp_path: Path, url: str, dest: str, name: str, bucket_storage: str, live: int, rep: int) -> dict[str, Any]:
    """A bridge on one engine whose NATS sink keeps its events stream in memory (and its state
    bucket in ``bucket_storage``), with a checkpoint."""
    sink = {
        "type": "nats",
        "name": name,
        "servers": url,
        "subject": dest + ".{source}.{dp_rank}",
        "format": "json",
        "granularity": "batch",
        "reconnect_wait": "200ms",
        "batch": {"linger": 0, "max_messages": 200},
        "retry": {"initial_backoff": "50ms", "max_backoff": "200ms", "jitter": 0.0, "write_timeout": 10},
        "stream": {"create": True, "name": dest, "storage": "memory"},
        "state": {"enabled": True, "bucket": f"ST{dest}", "create": True, "storage": bucket_storage},
    }
    return {
        "sources": [{"name": "eng", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}],
        "sinks": [sink],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
        "replay": {"timeout": "300ms", "max_attempts": 20, "initial_backoff": "50ms", "max_backoff": "200ms", "idle_probe": 0},
        "shutdown_timeout": "3s",
    }


async def _until(met: Callable[[], Awaitable[bool]], never: str) -> None:
    """Wait (bounded, not a timing assertion) until ``met``; a read that fails counts as not yet."""
    for _ in range(600):
        with contextlib.suppress(LookupError, nats.errors.Error):
            if await met():
                return
        await asyncio.sleep(0.05)
    pytest.fail(never)


async def _created(reader: Client, name: str) -> None:
    """Until JetStream stream ``name`` exists, set up: nats-server before 2.9.15 lists a stream a
    moment before its store is set up, and crashes on a read in that moment (stream names touch
    no store). A stream the sink creates again after a loss is read only once it is made."""

    async def listed() -> bool:
        reply = await reader.request("$JS.API.STREAM.NAMES", b"{}", timeout=5)
        return name in (json.loads(reply.data).get("streams") or [])

    with contextlib.suppress(nats.errors.Error):
        if await listed():
            return
    await _until(listed, f"JetStream stream {name} was never created")
    await asyncio.sleep(0.5)


async def _until_head(reader: Client, bucket: str, seq: int) -> None:
    """Until the state's head of stream eng/0 is at ``seq``."""
    await _created(reader, f"KV_{bucket}")

    async def met() -> bool:
        state, _ = await bootstrap(reader, bucket, "eng", 0, attempts=1)
        return int(state.head["seq"]) == seq

    await _until(met, f"the state's head never reached seq {seq}")


async def _until_stored(reader: Client, dest: str, seq: int) -> None:
    """Until the events stream holds batch ``seq`` of stream eng/0."""
    await _created(reader, dest)

    async def met() -> bool:
        return seq in [m["seq"] for m in await _subject_messages(reader, dest, Stream("eng", 0))]

    await _until(met, f"the stream never held seq {seq}")


async def _first_run(cfg: dict[str, Any], engine: CacheEngine, reader: Client, dest: str) -> int:
    """A bridge run that stores 20 batches of eng/0 and its state, then stops; their last seq."""
    first = Bridge(from_data(cfg, env={}))
    await first.start()
    try:
        await engine.wait_subscribed()
        await engine.step(20, events_per_batch=4)
        await _until_head(reader, f"ST{dest}", engine.last_seq)
        return engine.last_seq
    finally:
        await first.stop()


async def _after_the_loss(engine: CacheEngine, reader: Client, dest: str) -> None:
    """10 batches stored in the new stream, then 5 more, through the state (a state cleared is
    written again at its next record)."""
    await engine.step(10, events_per_batch=4)
    await _until_stored(reader, dest, engine.last_seq)
    await engine.step(5, events_per_batch=4)
    await _until_head(reader, f"ST{dest}", engine.last_seq)


async def _check_announced(reader: Client, dest: str, sink: str, before: int, last: int) -> None:
    """The new stream starts with the EventsLost of what the old one held (0..``before``), then the
    batches after it; the state read back is incomplete, up to ``last``."""
    held = await _subject_messages(reader, dest, Stream("eng", 0))
    shown = [(m["type"], m.get("reason"), m.get("from_seq"), m.get("to_seq", m["seq"])) for m in held]
    print(f"\nthe new stream holds: {shown}")
    first = held[0]
    assert first.get("type") == "EventsLost" and first["reason"] == f"sink_lost:{sink}", shown
    assert (first["from_seq"], first["to_seq"]) == (0, before), shown
    assert [m["seq"] for m in held if "events" in m] == list(range(before + 1, last + 1))
    state, _ = await bootstrap(reader, f"ST{dest}", "eng", 0)
    assert not state.complete and int(state.head["seq"]) == last


async def test_a_server_restart_that_loses_a_memory_stream_is_announced_to_its_consumers(
    tmp_path: Path, nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """Stream and bucket kept in memory, the server restarts: the sink goes on by itself (both
    created again), the new stream starts with an EventsLost (reason sink_lost:<sink>) covering
    what the old one held, then the batches after, and a consumer's bootstrap is incomplete, never
    complete with blocks missing."""
    live, rep = free_port(), free_port()
    cfg = _bridge_config(tmp_path, nats_server.url, dest, "nats-m", "memory", live, rep)
    js = reader.jetstream(timeout=5)
    try:
        async with CacheEngine(live, rep, seed=5) as engine:
            bridge = Bridge(from_data(cfg, env={}))
            await bridge.start()
            try:
                await engine.wait_subscribed()
                await engine.step(20, events_per_batch=4)
                await _until_head(reader, f"ST{dest}", engine.last_seq)
                before = engine.last_seq
                await nats_server.arestart()  # what it kept in memory is gone
                await _after_the_loss(engine, reader, dest)
            finally:
                await bridge.stop()
        await _check_announced(reader, dest, "nats-m", before, engine.last_seq)
        state, _ = await bootstrap(reader, f"ST{dest}", "eng", 0)
        assert set(state.blocks()) <= {(m, 0, h & U64) for h, m in engine.cache}
    finally:
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")


@pytest.mark.parametrize("refilled", [0, 60], ids=["empty", "refilled_by_another_writer"])
async def test_a_memory_stream_lost_while_no_bridge_ran_is_announced_at_the_next_start(
    tmp_path: Path, nats_server: NatsServer, reader: Client, dest: str, refilled: int
) -> None:
    """Issue 29 (breaker33 B3). Events stream in memory, state bucket on file: the bridge stops, the
    server restarts (the stream is gone), the bridge starts again from its checkpoint and creates
    the stream afresh. Before: it wrote on from JetStream seq 1 in the same epoch, nothing
    announced, and the state it read back stayed complete over batches the stream no longer
    held. Now the heads read back name a JetStream seq the new stream does not reach: the new
    stream starts with an EventsLost (sink_lost:<sink>) over what the old one held, and the state
    is cleared (incomplete). So when another writer created the stream again and filled it past
    that seq before this bridge started (breaker35 B3): the message there is not this stream's."""
    live, rep = free_port(), free_port()
    cfg = _bridge_config(tmp_path, nats_server.url, dest, "nats-f", "file", live, rep)
    js = reader.jetstream(timeout=5)
    try:
        async with CacheEngine(live, rep, seed=6) as engine:
            before = await _first_run(cfg, engine, reader, dest)
            await nats_server.arestart()  # the events stream, kept in memory, is gone
            if refilled:
                other = NatsConnector("other", _options(nats_server.url, dest, stream={"create": True, "name": dest}), SINK)
                await other.connect()
                try:
                    await other.write(_render([Stream("eng-b", 1)], 0, refilled))
                finally:
                    await other.close()
                assert (await js.stream_info(dest)).state.last_seq > before
            second = Bridge(from_data(cfg, env={}))
            await second.start()
            try:
                await engine.wait_subscribed()
                await _after_the_loss(engine, reader, dest)
            finally:
                await second.stop()
        await _check_announced(reader, dest, "nats-f", before, engine.last_seq)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")


@pytest.mark.parametrize(
    ("how", "mode"),
    [("memory", "file"), ("deleted", "file"), ("created_again", "file"), ("deleted", "from_sinks")],
)
async def test_an_events_only_sinks_stream_lost_while_no_bridge_ran_is_announced_at_the_next_start(
    tmp_path: Path, nats_server: NatsServer, reader: Client, dest: str, how: str, mode: str
) -> None:
    """breaker82 B1 (I6): a sink without state, its events stream lost while no bridge ran (kept in
    memory and the server restarted, deleted, or deleted and created again empty by an operator).
    The next bridge created it again (or found it) and wrote on: the seqs the old stream held were
    neither there nor announced, 12 of 12 runs. The checkpoint now keeps what the sink stored
    (the stream's last JetStream seq and creation time, ``stored``), checked before the first
    write: an EventsLost (sink_lost) over them comes first. With from_sinks, likewise for a sink
    that says it holds nothing of the stream."""
    live, rep = free_port(), free_port()
    cfg = _bridge_config(tmp_path, nats_server.url, dest, "nats-e", "file", live, rep)
    sink = cfg["sinks"][0]
    del sink["state"]
    sink["stream"]["storage"] = "memory" if how == "memory" else "file"
    cfg["checkpoint"]["from_sinks"] = mode == "from_sinks"
    js = reader.jetstream(timeout=5)
    async with CacheEngine(live, rep, seed=8) as engine:

        async def stored() -> None:
            await _until_stored(reader, dest, engine.last_seq)

        await one_run(from_data(cfg, env={}), engine, 20, stored, events_per_batch=4)
        before = engine.last_seq
        if how == "memory":
            await nats_server.arestart()  # what it kept in memory is gone
        else:
            await js.delete_stream(dest)
            if how == "created_again":
                await js.add_stream(name=dest, subjects=[dest + ".*.*"])
        await one_run(from_data(cfg, env={}), engine, 10, stored, events_per_batch=4)
    held = await _subject_messages(reader, dest, Stream("eng", 0))
    shown = [(m["type"], m.get("reason"), m.get("from_seq"), m.get("to_seq", m["seq"])) for m in held]
    assert held[0].get("type") == "EventsLost" and held[0]["reason"] == "sink_lost:nats-e", shown
    assert (held[0]["from_seq"], held[0]["to_seq"]) == (0, before), shown
    assert [m["seq"] for m in held if "events" in m] == list(range(before + 1, engine.last_seq + 1)), shown


async def test_a_stream_lost_after_a_restarted_bridge_read_its_state_and_before_its_first_write_is_announced(
    tmp_path: Path, nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """breaker79 B3 (I6): the bridge restarts, reads the state back (its head says the stream
    holds 0..N), and only then is the events stream lost (deleted; a server keeping it in memory
    restarted), before the bridge wrote anything of it. Its first write created the stream again
    and went on from N+1: what the old stream held was neither there nor announced, for a
    process that had stored nothing yet had nothing to announce."""
    live, rep = free_port(), free_port()
    cfg = _bridge_config(tmp_path, nats_server.url, dest, "nats-r", "file", live, rep)
    js = reader.jetstream(timeout=5)
    try:
        async with CacheEngine(live, rep, seed=7) as engine:
            before = await _first_run(cfg, engine, reader, dest)
            second = Bridge(from_data(cfg, env={}))
            await second.start()
            try:
                await engine.wait_subscribed()
                await js.delete_stream(dest)  # after the start read what the sink holds; nothing written yet
                await _after_the_loss(engine, reader, dest)
            finally:
                await second.stop()
        await _check_announced(reader, dest, "nats-r", before, engine.last_seq)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")


@pytest.mark.parametrize("setting", ["no_ack", "discard_new_per_subject"])
async def test_a_stream_edited_to_refuse_every_write_is_found_by_the_audit(
    nats_server: NatsServer, reader: Client, dest: str, setting: str
) -> None:
    """breaker76 B2: the events stream edited during the run to acknowledge nothing (no_ack), or to
    refuse a subject's messages past a few: an idle sink stayed ready for a minute, --check alone
    said why. The audit between writes reads the stream's settings: the sink is not ready, naming
    the setting, until they are set back."""
    js = reader.jetstream(timeout=5)
    conn = NatsConnector("nats-l", _options(nats_server.url, dest), SINK)
    await conn.connect()
    try:
        await conn.write(_render([A], 3, 2))
        info = await js.stream_info(dest)
        await js.update_stream(dataclasses.replace(info.config, **REFUSING[setting][0]))
        await conn.audit()
        said = await conn.health()
        assert said is not None and REFUSING[setting][1] in said, said
        await js.update_stream(info.config)
        await conn.audit()
        assert await conn.health() is None
    finally:
        await conn.close()


async def test_a_stream_whose_messages_leave_once_consumed_is_warned_about_and_refused_with_state(
    nats_server: NatsServer, reader: Client, dest: str, caplog: pytest.LogCaptureFixture
) -> None:
    """breaker93 B8: an events stream with interest retention and no consumer yet: 264-272 batches
    counted delivered, the stream held none, /readyz 200, --check ok, 4 of 4. Without state it is
    one WARNING naming the consequence (that is what interest retention is for); with state it is
    refused (a consumer bootstrapping would miss what left between the head and its subscription,
    under a state saying complete), and stream.create with it is a config error."""
    js = reader.jetstream(timeout=5)
    await js.add_stream(name=dest, subjects=[f"{dest}.>"], retention=js_api.RetentionPolicy.INTEREST)
    plain = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"create": False}), SINK)
    await plain.connect()
    try:
        assert await plain.health() is None
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"JetStream stream {dest} has interest retention: its messages leave once consumed" in w for w in warned)
    finally:
        await plain.close()
    state = {"enabled": True, "bucket": f"ST{dest}", "create": True}
    with_state = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"create": False}, state=state), SINK)
    try:
        await with_state.connect()
        said = await with_state.health()
        assert said is not None and f"JetStream stream {dest!r} has interest retention" in said, said
        assert "retention cannot be edited: create it again" in said, said
        # breaker97 B1: the stream takes every write, so a write succeeded and cleared the sink's
        # health (/readyz 200 in 19 of 20 samples, 0 events kept beside 965 state entries, 9 of 9).
        # A write is refused itself, and goes through once the stream is created again to keep.
        with pytest.raises(Retriable, match="has interest retention") as refused:
            await with_state.write(_render([A], 0, 2))
        assert refused.value.reason == "stream_refused"
        assert (await js.stream_info(dest)).state.messages == 0
        await js.delete_stream(dest)
        await js.add_stream(name=dest, subjects=[f"{dest}.>"])
        await with_state.write(_render([A], 0, 2))
        assert await _subject_seqs(reader, dest, A) == [0, 1]
        assert await with_state.health() is None
    finally:
        await with_state.close()
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")
    with pytest.raises(ConfigError, match=r"stream\.retention: interest not allowed with state\.enabled"):
        _options(nats_server.url, dest, stream={"create": True, "retention": "interest"}, state=state)


async def test_a_stream_that_keeps_few_messages_per_subject_is_refused_with_state(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """breaker101 B3: max_msgs_per_subject 4 with state on was one WARNING: --check 0, /readyz 200,
    and a consumer that bootstrapped and then read on ended complete with 18-24 block copies where
    the engine held 29-40, 4 of 4 (the events between the state's head and its read were gone).
    With state it is refused as interest retention is; without, it stays a WARNING."""
    js = reader.jetstream(timeout=5)
    await js.add_stream(name=dest, subjects=[f"{dest}.>"], max_msgs_per_subject=4)
    state = {"enabled": True, "bucket": f"ST{dest}", "create": True}
    conn = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"create": False}, state=state), SINK)
    try:
        await conn.connect()
        said = await conn.health()
        assert said is not None and "keeps only the last 4 message(s) of each subject" in said, said
        with pytest.raises(Retriable, match="max_msgs_per_subject") as refused:
            await conn.write(_render([A], 0, 2))
        assert refused.value.reason == "stream_refused"
        assert (await js.stream_info(dest)).state.messages == 0
        await js.update_stream(name=dest, subjects=[f"{dest}.>"], max_msgs_per_subject=-1)
        await conn.write(_render([A], 0, 2))
        assert await _subject_seqs(reader, dest, A) == [0, 1]
    finally:
        await conn.close()
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")
    plain = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"create": False}), SINK)
    await js.update_stream(name=dest, subjects=[f"{dest}.>"], max_msgs_per_subject=4)
    try:
        await plain.connect()
        assert await plain.health() is None
    finally:
        await plain.close()


async def test_a_refusing_stream_created_during_the_run_takes_no_write_or_has_it_announced(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """breaker102 B2: with state on, an interest-retention stream an operator created during the run
    for eng-b's subjects took eng-b's writes, which left at once while its state head said complete
    (3 of 3); deleted and created again so, it took 3 more. Met by the listing of an engine stream's
    first write it is refused before any write; met by a write's acknowledgement, what that write
    stored is announced lost, and nothing more is written to it."""
    js = reader.jetstream(timeout=5)
    good, bad = f"{dest}_GOOD", f"{dest}_BAD"
    await js.add_stream(name=good, subjects=[f"{dest}.eng-a.>"])
    state = {"enabled": True, "bucket": f"ST{dest}", "create": True}
    conn = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"create": False}, state=state), SINK)
    try:
        await conn.connect()
        await conn.write(_render([A], 0, 1))
        with pytest.raises(Retriable) as missing:
            await conn.write(_render([B], 0, 1))
        assert missing.value.reason == "no_stream"
        await js.add_stream(name=bad, subjects=[f"{dest}.eng-b.>"], retention=js_api.RetentionPolicy.INTEREST)
        with pytest.raises(Retriable, match="has interest retention") as refused:
            await conn.write(_render([B], 0, 1))
        assert refused.value.reason == "stream_refused"
        assert (await js.stream_info(bad)).state.last_seq == 0
        await js.delete_stream(bad)  # fixed: eng-b goes on
        await js.add_stream(name=bad, subjects=[f"{dest}.eng-b.>"])
        await conn.write(_render([B], 0, 2))
        await js.delete_stream(bad)  # and created again with interest retention, while the sink writes
        await js.add_stream(name=bad, subjects=[f"{dest}.eng-b.>"], retention=js_api.RetentionPolicy.INTEREST)
        # (eng-b's subject was claimed while the stream consumed its messages: no fence, so the
        # write goes through, and its acknowledgement names the stream)
        await conn.write(_render([B], 2, 1))
        assert (await js.stream_info(bad)).state.last_seq == 1
        with pytest.raises(SinkLost) as told:
            await conn.write(_render([B], 3, 1))
        assert [(s.key, lo, hi) for s, _e, lo, hi in told.value.spans] == [(B.key, 0, 2)], told.value.spans
        with pytest.raises(Retriable, match="has interest retention"):
            await conn.write(_render([B], 3, 1))
        assert (await js.stream_info(bad)).state.last_seq == 1
    finally:
        await conn.close()
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")


async def test_a_stream_created_again_to_consume_its_messages_is_refused_when_the_fence_reads_it(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """breaker102 B2, fenced: the stream holding eng-b's subject deleted and created again with
    interest retention. The write's fence fails (the subject moved), the subject is read again,
    and the stream is refused there: nothing of the write is stored in it."""
    js = reader.jetstream(timeout=5)
    await js.add_stream(name=dest, subjects=[f"{dest}.>"])
    state = {"enabled": True, "bucket": f"ST{dest}", "create": True}
    conn = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"create": False}, state=state), SINK)
    try:
        await conn.connect()
        await conn.write(_render([B], 0, 2))
        await js.delete_stream(dest)
        await js.add_stream(name=dest, subjects=[f"{dest}.>"], retention=js_api.RetentionPolicy.INTEREST)
        with pytest.raises(Retriable, match="has interest retention") as refused:
            await conn.write(_render([B], 2, 1))
        assert refused.value.reason == "stream_refused"
        assert (await js.stream_info(dest)).state.last_seq == 0
    finally:
        await conn.close()
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")


async def test_a_head_whose_seq_now_holds_another_sinks_copy_of_the_record_is_told_lost(
    nats_server: NatsServer, reader: Client, dest: str
) -> None:
    """breaker104 D5: two sinks on subjects of one stream, one epoch. The stream was created again
    and the other sink refilled it past the state's head; at restart the message at the head's seq,
    the other sink's copy of a record of the same epoch, was taken for the sink's own: the loss went
    unannounced, the head kept (4 of 4). A message counts as its own only on its own subject."""
    js = reader.jetstream(timeout=5)
    await js.add_stream(name=dest, subjects=[f"{dest}.>"])
    state = {"enabled": True, "bucket": f"ST{dest}", "create": True}

    def sink_of(name: str, **extra: Any) -> NatsConnector:
        options = _options(
            nats_server.url, dest, subject=f"{dest}.{name}.{{source}}.{{dp_rank}}", stream={"create": False}, **extra
        )
        return NatsConnector(name, options, SinkConfig(type="nats", name=name, format="json", granularity="batch"))

    tracker, renderer = StateTracker(), Renderer("json", "batch")
    records = stream_records(A, 6, epoch=1)
    for r in records:
        r.state = tracker.apply(r)
    first = sink_of("s1", state=state)
    await first.connect()
    try:
        await first.write([m for r in records for m in (*renderer.render(r), state_message(r))])
    finally:
        await first.close()
    await js.delete_stream(dest)
    await js.add_stream(name=dest, subjects=[f"{dest}.>"])
    other = sink_of("s2")
    await other.connect()
    try:
        await other.write(_render([A], 0, 12))
    finally:
        await other.close()
    again = sink_of("s1", state=state)
    await again.connect()
    try:
        held = await again.read_state([A])
    finally:
        await again.close()
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")
    assert A.key in again.records_gone, held


@pytest.mark.parametrize("bad_first", [False, True], ids=["good-stream-named-first", "bad-stream-named-first"])
async def test_a_refusing_stream_among_several_holds_back_only_the_engine_streams_it_captures(
    nats_server: NatsServer, reader: Client, dest: str, bad_first: bool
) -> None:
    """breaker99 B4: the sink's subjects split over two streams, eng-a's kept (limits), eng-b's
    with interest retention, and state on. When the server named the good stream first, connect
    checked only that one: health said nothing, and eng-b's first write was stored and left at
    once (3 of 3); once refused, eng-a's writes were held back too. Every stream capturing some
    of the subjects is checked at connect, and only eng-b is held back until its stream keeps."""
    js = reader.jetstream(timeout=5)
    good, bad = (f"{dest}_Z_GOOD", f"{dest}_A_BAD") if bad_first else (f"{dest}_A_GOOD", f"{dest}_Z_BAD")
    await js.add_stream(name=good, subjects=[f"{dest}.eng-a.>"])
    await js.add_stream(name=bad, subjects=[f"{dest}.eng-b.>"], retention=js_api.RetentionPolicy.INTEREST)
    state = {"enabled": True, "bucket": f"ST{dest}", "create": True}
    conn = NatsConnector("nats-l", _options(nats_server.url, dest, stream={"create": False}, state=state), SINK)
    try:
        await conn.connect()
        said = await conn.health()
        assert said is not None and f"JetStream stream {bad!r} has interest retention" in said, said
        with pytest.raises(PartialFailure) as held:
            await conn.write(_render([A, B], 0, 2))
        reasons = {i: e.reason for i, e in held.value.errors.items()}
        assert reasons == {2: "stream_refused", 3: "stream_refused"}, reasons  # eng-b's two batches only
        assert await _subject_seqs(reader, dest, A, within=good) == [0, 1]
        assert (await js.stream_info(bad)).state.last_seq == 0
        await conn.write(_render([A], 2, 1))  # eng-a alone goes on
        assert await _subject_seqs(reader, dest, A, within=good) == [0, 1, 2]
        await js.delete_stream(bad)
        await js.add_stream(name=bad, subjects=[f"{dest}.eng-b.>"])
        await conn.audit()  # (a quiet sink is ready again once the stream keeps)
        assert await conn.health() is None
        await conn.write(_render([B], 0, 2))
        assert await _subject_seqs(reader, dest, B, within=bad) == [0, 1]
    finally:
        await conn.close()
        for name in (good, bad):
            with contextlib.suppress(nats.errors.Error):
                await js.delete_stream(name)
        with contextlib.suppress(nats.errors.Error):
            await js.delete_key_value(f"ST{dest}")


async def test_a_mark_of_a_stream_in_another_account_is_not_taken_for_a_loss(tmp_path: Path) -> None:
    """breaker89 B2: the sink's user moved from account A to account B between runs (same servers,
    stream name, subject and sink name). A's mark was checked against B's stream of that name
    ("created again") and B's consumers were told 0..4 were lost while A held them all, 4 of 4. A
    mark names who the sink logs in as; the same user again still has its loss found."""
    accounts = (
        "accounts {\n  A { jetstream: enabled, users: [{user: ua, password: pa}] }\n"
        "  B { jetstream: enabled, users: [{user: ub, password: pb}] }\n}\nno_auth_user: ua\n"
    )
    server = await NatsServer(tmp_path / "srv", extra_config=accounts).astart()
    try:
        live, rep = free_port(), free_port()
        cfg = _bridge_config(tmp_path, server.url, "KVACC", "nats-a", "file", live, rep)
        sink = cfg["sinks"][0]
        del sink["state"]
        sink["stream"]["storage"] = "file"
        clients = {}
        for user in ("ua", "ub"):
            clients[user] = await nats.connect(server.url, user=user, password="p" + user[1])
        async with CacheEngine(live, rep, seed=5) as engine:
            for user in ("ua", "ub", "ub"):
                sink.update(user=user, password="p" + user[1])
                reader = clients[user]
                await one_run(from_data(cfg, env={}), engine, 5, lambda r=reader: _until_stored(r, "KVACC", engine.last_seq))
                if user == "ub" and "lost" not in clients:
                    in_b = await _subject_messages(reader, "KVACC", Stream("eng", 0))
                    assert [("events" in m, m["seq"]) for m in in_b] == [(True, seq) for seq in range(5, 10)], in_b
                    clients["lost"] = reader  # the same user's loss is still found: the control
                    await reader.jetstream(timeout=5).delete_stream("KVACC")
        in_a = await _subject_messages(clients["ua"], "KVACC", Stream("eng", 0))
        assert [m["seq"] for m in in_a] == [0, 1, 2, 3, 4]
        in_b = await _subject_messages(clients["ub"], "KVACC", Stream("eng", 0))
        lost = [(m["reason"], m["from_seq"], m["to_seq"]) for m in in_b if m["type"] == "EventsLost"]
        assert lost == [("sink_lost:nats-a", 0, 9)], lost  # (from 0: where B's copy began cannot be told)
        assert [m["seq"] for m in in_b if "events" in m] == list(range(10, 15))
    finally:
        for nc in {id(c): c for c in clients.values()}.values():
            await nc.close()
        server.stop()


async def test_a_mark_taken_before_marks_named_the_login_is_still_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """breaker90 B2b: a sink with credentials, its checkpoint's marks written by a bridge from
    before marks named the login; the events stream lost while no bridge ran. After the upgrade
    the marks were taken for another stream's and skipped: 0..4 never announced (4 of 4). A mark
    without the login is still this stream's."""
    server = await NatsServer(
        tmp_path / "srv",
        extra_config="accounts {\n  A { jetstream: enabled, users: [{user: ua, password: pa}] }\n}\nno_auth_user: ua\n",
    ).astart()
    reader = await nats.connect(server.url)
    try:
        live, rep = free_port(), free_port()
        cfg = _bridge_config(tmp_path, server.url, "KVUP", "nats-u", "file", live, rep)
        sink = cfg["sinks"][0]
        del sink["state"]
        sink.update(user="ua", password="pa", stream={"create": True, "name": "KVUP", "storage": "file"})
        async with CacheEngine(live, rep, seed=9) as engine:
            with monkeypatch.context() as before:
                before.setattr("connectors.nats._login", lambda _options: "")  # (what the marks named then)
                await one_run(from_data(cfg, env={}), engine, 5, lambda: _until_stored(reader, "KVUP", engine.last_seq))
            await reader.jetstream(timeout=5).delete_stream("KVUP")
            await one_run(from_data(cfg, env={}), engine, 5, lambda: _until_stored(reader, "KVUP", engine.last_seq))
        held = await _subject_messages(reader, "KVUP", Stream("eng", 0))
        assert [(m["type"], m.get("from_seq"), m["seq"]) for m in held][:1] == [("EventsLost", 0, 4)], held
        assert [m["seq"] for m in held if "events" in m] == list(range(5, 10))
    finally:
        await reader.close()
        server.stop()
