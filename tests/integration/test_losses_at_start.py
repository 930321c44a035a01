"""What a Kafka or NATS state sink lost while no bridge ran, announced at the next start (issue 29,
I6; breaker40). The runtime asks each state sink what records it still holds (``positions``) and
announces what every sink acknowledged and it no longer holds, in the checkpoint's epoch and the
one before it (``Bridge._behind_at_start``; the model: tests/unit/test_lost_at_start.py):

- a NATS server restored from a backup taken in the middle of one write: its last message the
  SourceReset of a new epoch (that epoch's seq 0 is lost), or an event of a batch held in part
  (event granularity: the batch is lost). Before, the last message was counted as a whole batch
  held, and the first batch lost was never announced;
- a Kafka events topic deleted while no bridge ran, its state topic intact: before, nothing was
  announced (its state was not behind);
- a NATS events stream kept in memory, lost with a server restart, across an engine restart:
  before, only the head's epoch was announced, never the epoch before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from nats.aio.client import Client
from nats.js import api as js_api

import connectors.nats as cn
from bridge.config import Config, from_data
from bridge.records import Stream
from bridge.runtime import Bridge
from kv_consumer.nats import bootstrap
from tests.infra.servers import KafkaServer, NatsServer
from tests.integration.test_kafka import delete_topic, topic_exists
from tests.integration.test_kafka_state import REPLAY, last_head, partition_of, read_partition, sink, source
from tests.integration.test_nats_losses import _bridge_config, _subject_messages, _until, _until_head, _until_stored
from tests.support.cache_engine import CacheEngine
from tests.support.harness import free_port, one_run

pytestmark = pytest.mark.integration

ENG = Stream("eng", 0)


def config(tmp_path: Path, url: str, dest: str, granularity: str, live: int, rep: int) -> dict[str, Any]:
    sink = {
        "type": "nats",
        "name": "nats-b",
        "servers": url,
        "subject": dest + ".{source}.{dp_rank}",
        "format": "json",
        "granularity": granularity,
        "reconnect_wait": "200ms",
        "batch": {"linger": 0, "max_messages": 200},
        "retry": {"initial_backoff": "50ms", "max_backoff": "200ms", "jitter": 0.0, "write_timeout": 10},
        "stream": {"create": True, "name": dest, "storage": "file"},
        "state": {"enabled": True, "bucket": f"ST{dest}", "create": True, "storage": "file"},
    }
    return {
        "sources": [{"name": "eng", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}],
        "sinks": [sink],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "checkpoint": {"path": str(tmp_path / "checkpoint.json"), "interval": "100ms"},
        "replay": {"timeout": "300ms", "max_attempts": 20, "initial_backoff": "50ms", "max_backoff": "200ms", "idle_probe": 0},
        "shutdown_timeout": "5s",
    }


def header(hdr: bytes, name: str) -> str | None:
    m = re.search(rb"\r\n" + name.encode() + rb":\s*([^\r]*)\r\n", hdr)
    return m.group(1).decode() if m else None


class Gate:
    """Holds the first message matching ``match`` (its headers) in NatsConnector._send until let go."""

    def __init__(self, match: Any) -> None:
        self.match = match
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        self.armed = True

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = cn.NatsConnector._send
        gate = self

        async def _send(conn: Any, nc: Any, subject: str, hdr: bytes, payload: bytes, acks: Any) -> None:
            if gate.armed and gate.match(hdr):
                gate.armed = False
                gate.reached.set()
                await gate.go.wait()
            await original(conn, nc, subject, hdr, payload, acks)

        monkeypatch.setattr(cn.NatsConnector, "_send", _send)


async def wait_held(reader: Client, dest: str, pred: Any, what: str) -> None:
    async def met() -> bool:
        return pred(await _subject_messages(reader, dest, ENG))

    await _until(met, what)


def announced(msgs: list[dict[str, Any]]) -> list[tuple[int, int, int, str]]:
    return [(m["epoch"], m["from_seq"], m["to_seq"], m["reason"]) for m in msgs if m.get("type") == "EventsLost"]


@pytest.mark.parametrize("case", ["reset", "partial", "reset_from_sinks"])
async def test_a_nats_server_restored_from_a_backup_taken_mid_write(
    tmp_path: Path, nats_server: NatsServer, reader: Client, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """``reset_from_sinks`` (breaker49 B1): with checkpoint.from_sinks the start check skipped every
    sink holding a record, taking the stream to resume from it; from a SourceReset, with no batch
    to verify the instance, it resumes from the checkpoint instead, and E1 0..4 were neither sent
    again nor announced."""
    dest = f"KVB{uuid.uuid4().hex[:8].upper()}"
    live, rep = free_port(), free_port()
    granularity = "event" if case == "partial" else "batch"
    raw = config(tmp_path, nats_server.url, dest, granularity, live, rep)
    raw["checkpoint"]["from_sinks"] = case == "reset_from_sinks"
    cfg = from_data(raw, env={})
    backup = tmp_path / "js-backup"
    epochs: list[int] = []

    if case != "partial":
        # hold the first batch message of an epoch above the first one (batch (E1, 0))
        def match(hdr: bytes) -> bool:
            e, t = header(hdr, "epoch"), header(hdr, "type")
            return e is not None and bool(epochs) and int(e) > epochs[0] and t not in ("SourceReset", "EventsLost")
    else:

        def match(hdr: bytes) -> bool:  # event index 2 of batch 5
            return header(hdr, "seq") == "5" and header(hdr, "index") == "2"

    gate = Gate(match)
    gate.install(monkeypatch)
    try:
        async with CacheEngine(live, rep, seed=40) as engine:
            first = Bridge(cfg)
            await first.start()
            try:
                await engine.wait_subscribed()
                if case != "partial":
                    await engine.step(10, events_per_batch=3)
                    await wait_held(reader, dest, lambda ms: any(m["seq"] == 9 for m in ms), "E0 9 never stored")
                    epochs.append(int((await _subject_messages(reader, dest, ENG))[-1]["epoch"]))
                    await engine.restart()
                    await engine.wait_subscribed()
                    await engine.step(5, events_per_batch=3)
                    await asyncio.wait_for(gate.reached.wait(), 30)
                    await wait_held(reader, dest, lambda ms: ms and ms[-1].get("type") == "SourceReset", "no SourceReset")
                else:
                    await engine.step(10, events_per_batch=4)
                    await asyncio.wait_for(gate.reached.wait(), 30)
                    await wait_held(
                        reader, dest, lambda ms: ms and (ms[-1]["seq"], ms[-1].get("index")) == (5, 1), "5/1 never stored"
                    )
                # the backup: the server stopped, its store copied, started again
                await nats_server.astop()
                shutil.copytree(nats_server.store_dir, backup)
                await nats_server.astart()
                gate.go.set()
                last = engine.last_seq
                await wait_held(
                    reader,
                    dest,
                    lambda ms: (
                        ms
                        and ms[-1]["seq"] == last
                        and ms[-1].get("type") not in ("SourceReset",)
                        and (granularity == "batch" or ms[-1].get("index") == 3)
                    ),
                    "the rest never stored",
                )
                await asyncio.sleep(0.5)
            finally:
                await first.stop()
            # while no bridge runs: the server comes back from the backup
            await nats_server.astop()
            shutil.rmtree(nats_server.store_dir)
            shutil.copytree(backup, nats_server.store_dir)
            await nats_server.astart()
            second = Bridge(cfg)
            await second.start()
            try:
                await engine.wait_subscribed()
                await engine.step(3, events_per_batch=4)
                last = engine.last_seq
                await wait_held(
                    reader,
                    dest,
                    lambda ms: any(m["seq"] == last and m.get("type") != "EventsLost" for m in ms[-5:]),
                    "the second run's batches never stored",
                )
            finally:
                await second.stop()
        msgs = await _subject_messages(reader, dest, ENG)
        lost = announced(msgs)
        # every (epoch, seq) whole in the sink
        counts: dict[tuple[int, int], set[Any]] = {}
        for m in msgs:
            if m.get("type") in ("SourceReset", "EventsLost"):
                continue
            counts.setdefault((m["epoch"], m["seq"]), set()).add(m.get("index"))
        told = {(e, s) for e, a, b, r in lost if r.startswith("sink_lost") for s in range(a, b + 1)}
        whole = {k for k, ix in counts.items() if ix == {0, 1, 2, 3}} if granularity == "event" else set(counts)
        missing = [
            (e, s)
            for e in sorted({k[0] for k in counts})
            for s in range(0, max(k[1] for k in counts if k[0] == e) + 1)
            if (e, s) not in whole and (e, s) not in told
        ]
        assert not missing, f"lost and never announced: {missing}"
        # Exactly the first batch lost on (E1 0 at the SourceReset; batch 5 held in part), once.
        assert [(e - min(counts)[0], a, b, r) for e, a, b, r in lost] == (
            [(1, 0, 4, "sink_lost:nats-b")] if case != "partial" else [(0, 5, 9, "sink_lost:nats-b")]
        )
    finally:
        with contextlib.suppress(nats.errors.Error, Exception):
            js = reader.jetstream(timeout=5)
            await js.delete_stream(dest)
            await js.delete_key_value(f"ST{dest}")


def kafka_config(
    tmp_path: Path, kafka: KafkaServer, topic: str, state_topic: str, live: int, replay: int, create: bool
) -> Config:
    """One source "a", one Kafka sink with state, topics created by it (``create``) or by an operator."""
    made = {"enabled": True, "partitions": 1} if create else {"enabled": False}
    kw = {"granularity": "batch", "request_timeout": "2s", "create_topics": made, "allow_auto_create_topics": False}
    return from_data(
        {
            "sources": [source("a", live, replay)],
            "sinks": [sink(kafka, topic, state_topic, **kw)],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
            "checkpoint": {"path": str(tmp_path / "cp.json"), "interval": "100ms"},
            "state": {"load_timeout": "3s"},
            "replay": REPLAY,
            "shutdown_timeout": "5s",
        },
        env={},
    )


async def kafka_head_at(kafka: KafkaServer, state_topic: str, seq: int, within: float) -> dict[str, Any] | None:
    """Stream a/0's state head once it is at ``seq``, or None if it is not within ``within`` seconds."""
    part, deadline = partition_of("a/0", 2), time.monotonic() + within
    while (head := await last_head(kafka.bootstrap_servers, state_topic, part, "a/0")) is None or head["seq"] != seq:
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.2)
    return head


async def kafka_state_at(kafka: KafkaServer, state_topic: str, seq: int) -> dict[str, Any]:
    """Until stream a/0's state head is at ``seq``: the head."""
    head = await kafka_head_at(kafka, state_topic, seq, 60)
    assert head is not None, f"the state did not reach seq {seq}"
    return head


async def kafka_docs(kafka: KafkaServer, topic: str) -> list[dict[str, Any]]:
    tp = TopicPartition(topic, 0)
    return [json.loads(v) for k, v in await read_partition(kafka.bootstrap_servers, tp) if k == b"a/0" and v]


@pytest.mark.parametrize("topics", ["created_by_the_sink", "created_by_an_operator_after_the_start", "deleted_again_in_the_run"])
async def test_a_kafka_events_topic_deleted_while_no_bridge_ran_is_announced_once(
    tmp_path: Path, kafka: KafkaServer, topics: str
) -> None:
    """breaker40 B2: the events topic deleted while no bridge ran, its state topic intact (the state
    not behind): the sink created it again at start, and nothing was announced. breaker41 B2: with
    topics an operator manages, the bridge started while it was missing; positions() failed for
    it, and nothing was announced either. Now EventsLost 0..acked, once, ahead of the rest.
    breaker43 B1: deleted again during that run, the connector's own span overlapped the one told
    at start (which went with the topic) and was skipped whole: now announced whole."""
    create = topics != "created_by_an_operator_after_the_start"
    topic = f"kvb40-events-{uuid.uuid4().hex[:10]}" if create else await kafka.anew_topic(partitions=1)
    state_topic = f"kvb40-state-{uuid.uuid4().hex[:10]}"
    live, replay = free_port(), free_port()
    cfg = kafka_config(tmp_path, kafka, topic, state_topic, live, replay, create=create)
    async with CacheEngine(live, replay, seed=40) as engine:
        first = Bridge(cfg)
        await first.start()
        try:
            await engine.wait_subscribed()
            await engine.step(10)
            await kafka_state_at(kafka, state_topic, engine.last_seq)
        finally:
            await first.stop()
        acked = engine.last_seq
        await delete_topic(kafka, topic)  # while no bridge runs
        second = Bridge(cfg)
        await second.start()  # (without create_topics the topic is missing: the sink is not ready)
        try:
            if not create:
                await asyncio.sleep(1.0)
                await kafka.anew_topic(partitions=1, name=topic)  # the operator creates it again
            await engine.wait_subscribed()
            await engine.step(5)
            head = await kafka_state_at(kafka, state_topic, engine.last_seq)
            if topics == "deleted_again_in_the_run":
                acked = engine.last_seq  # (acknowledged by the topic created again, in this run)
                await delete_topic(kafka, topic)  # the connector's own check finds it at its next write
                deadline = time.monotonic() + 60
                while not await topic_exists(kafka, topic):
                    assert time.monotonic() < deadline, "the events topic did not come back"
                    await engine.step(1)
                    await asyncio.sleep(0.3)
                # The loss found, the state is cleared at the stream's next record (docs/sinks/kafka.md):
                # a record queued before that (a loaded machine) is written without it. So a record
                # more until one lands after and the head reaches it.
                for _ in range(5):
                    await engine.step(1)
                    if (reached := await kafka_head_at(kafka, state_topic, engine.last_seq, 15)) is not None:
                        head = reached
                        break
                else:
                    pytest.fail(f"the state did not reach the last seq {engine.last_seq} after 5 records")
        finally:
            await second.stop()
    docs = await kafka_docs(kafka, topic)
    lost = [(d["from_seq"], d["to_seq"], d["reason"]) for d in docs if d["type"] == "EventsLost"]
    held = [d["seq"] for d in docs if d["type"] not in ("EventsLost", "SourceReset")]
    assert held == list(range(acked + 1, engine.last_seq + 1))
    assert lost == [(0, acked, "sink_lost:k")] and docs[0]["type"] == "EventsLost"
    assert topics == "deleted_again_in_the_run" or not head["complete"]


def kafka_events_only(tmp_path: Path, kafka: KafkaServer, topic: str, live: int, replay: int) -> Config:
    """One source "a", one Kafka sink "k" without state (batch granularity, the topic created by
    it), a checkpoint file."""
    made = {"enabled": True, "partitions": 1}
    entry = sink(kafka, topic, "unused", granularity="batch", request_timeout="2s", create_topics=made, state={"enabled": False})
    return from_data(
        {
            "sources": [source("a", live, replay)],
            "sinks": [entry],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
            "checkpoint": {"path": str(tmp_path / "cp.json"), "interval": "100ms"},
            "replay": REPLAY,
            "shutdown_timeout": "5s",
        },
        env={},
    )


async def kafka_events_at(kafka: KafkaServer, topic: str, seq: int, within: float = 60) -> list[dict[str, Any]]:
    """Stream a/0's messages in ``topic`` once one of batch ``seq`` is there."""
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(Exception):  # (the topic not there yet)
            docs = await kafka_docs(kafka, topic)
            if any(d["type"] not in ("EventsLost", "SourceReset") and d["seq"] == seq for d in docs):
                return docs
        assert time.monotonic() < deadline, f"{topic}: batch {seq} not written"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("case", ["deleted", "deleted_resumed_below", "refilled_by_another_producer", "intact"])
async def test_a_kafka_events_topic_of_a_sink_without_state_deleted_while_no_bridge_ran_is_announced(
    tmp_path: Path, kafka: KafkaServer, case: str
) -> None:
    """Note 48 (left alone): a sink without state reads nothing back at start, so its events topic
    deleted while no bridge ran was created again and written on, and the batches it had
    acknowledged were never announced (I6). Now the checkpoint keeps each such sink's last batch
    acknowledged and its partition's end offset (``stored``), and the next start looks at the
    topic again before its first write: EventsLost 0..acknowledged (sink_lost:k) comes first. Where
    the stream resumes below that (another sink behind), only up to the resume point: the rest is
    sent again. An intact topic gets no announcement."""
    topic = f"kvs-events-{uuid.uuid4().hex[:10]}"
    live, replay = free_port(), free_port()
    cfg = kafka_events_only(tmp_path, kafka, topic, live, replay)
    async with CacheEngine(live, replay, seed=48) as engine:

        async def written() -> list[dict[str, Any]]:
            return await kafka_events_at(kafka, topic, engine.last_seq)

        await one_run(cfg, engine, 10, written)
        acked = engine.last_seq
        saved = json.loads((tmp_path / "cp.json").read_text())
        stored = saved.get("stored", {}).get("a/0", {}).get("k")
        resume = acked
        if case == "deleted_resumed_below":  # as if a second sink had acknowledged only up to seq 4
            resume = 4
            saved["streams"]["a/0"] = {"epoch": saved["streams"]["a/0"]["epoch"], "seq": resume}
            (tmp_path / "cp.json").write_text(json.dumps(saved))
        if case != "intact":
            await delete_topic(kafka, topic)  # while no bridge runs
        if case == "refilled_by_another_producer":
            # breaker86 B1: a sharded bridge's other pod fills the new partition past the mark's end
            # offset: the offsets alone look whole; the record at the mark's offset is not the sink's.
            await kafka.anew_topic(partitions=1, name=topic)
            producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
            await producer.start()
            try:
                for i in range(stored[3] + 3):
                    await producer.send_and_wait(topic, key=b"b/0", value=b'{"seq": %d}' % i, partition=0)
            finally:
                await producer.stop()
        docs = await one_run(cfg, engine, 5, written)
    lost = [(d["from_seq"], d["to_seq"], d["reason"]) for d in docs if d["type"] == "EventsLost"]
    held = [d["seq"] for d in docs if d["type"] not in ("EventsLost", "SourceReset")]
    if case == "intact":
        assert not lost and sorted(set(held)) == list(range(engine.last_seq + 1))
    else:
        assert lost == [(0, resume, "sink_lost:k")] and docs[0]["type"] == "EventsLost", lost
        assert held == list(range(resume + 1, engine.last_seq + 1))
    assert stored is not None and stored[:3] == [saved["streams"]["a/0"]["epoch"], acked, 0], stored


async def test_a_kafka_mark_of_another_topic_is_not_taken_for_a_loss(tmp_path: Path, kafka: KafkaServer) -> None:
    """breaker85 B4: the sink's topic changed between runs (same sink name): the checkpoint's mark
    of the old topic's partition was checked against the new topic, and 0..4 announced lost there
    though the new topic never held them and the old one holds them all. A mark names its topic
    and cluster."""
    old, new = (f"kvm-{n}-{uuid.uuid4().hex[:8]}" for n in ("old", "new"))
    live, replay = free_port(), free_port()

    async with CacheEngine(live, replay, seed=85) as engine:
        for topic, steps in ((old, 5), (new, 3)):
            cfg = kafka_events_only(tmp_path, kafka, topic, live, replay)
            docs = await one_run(cfg, engine, steps, lambda t=topic: kafka_events_at(kafka, t, engine.last_seq))
    assert not [d for d in docs if d["type"] == "EventsLost"], docs


@pytest.mark.parametrize("mode", ["file", "from_sinks"])
async def test_nats_memory_stream_lost_while_no_bridge_ran_two_epochs(
    tmp_path: Path, nats_server: NatsServer, reader: Client, mode: str
) -> None:
    """With checkpoint.from_sinks too (breaker45 B3): the sink holds nothing, so it skips every
    message at or below the checkpoint's position, and that dropped the announcement made for it
    (its seq stands there); the state head then stayed complete. Now an announcement a worker made
    for its own sink is never skipped."""
    dest = f"KVC{uuid.uuid4().hex[:8].upper()}"
    live, rep = free_port(), free_port()
    raw = _bridge_config(tmp_path, nats_server.url, dest, "nats-f", "file", live, rep)
    raw["checkpoint"]["interval"] = "100ms"
    raw["checkpoint"]["from_sinks"] = mode == "from_sinks"
    cfg = from_data(raw, env={})
    eng = Stream("eng", 0)
    js = reader.jetstream(timeout=5)
    try:
        async with CacheEngine(live, rep, seed=41) as engine:
            first = Bridge(cfg)
            await first.start()
            try:
                await engine.wait_subscribed()
                await engine.step(10, events_per_batch=4)
                await _until_head(reader, f"ST{dest}", 9)
                e0 = int((await _subject_messages(reader, dest, eng))[-1]["epoch"])
                await engine.restart()
                await engine.wait_subscribed()
                await engine.step(5, events_per_batch=4)
                await _until_head(reader, f"ST{dest}", 4)
                # The restart's epoch is read, not assumed e0 + 1: it is the engine clock's minute
                # when that is above e0 (Checkpointer.next_epoch), i.e. when a minute turned
                # between epoch 0's first batch and the restart.
                e1s: set[int] = set()

                async def epoch1_stored() -> bool:
                    held = await _subject_messages(reader, dest, eng)
                    e1s.update(
                        int(m["epoch"])
                        for m in held
                        if int(m["epoch"]) != e0 and m.get("type") not in ("EventsLost", "SourceReset") and m["seq"] == 4
                    )
                    return bool(e1s)

                await _until(epoch1_stored, "the events stream never held seq 4 of the second epoch")
                (e1,) = e1s
            finally:
                await first.stop()
            await nats_server.arestart()  # the events stream, kept in memory, is gone
            second = Bridge(cfg)
            await second.start()
            try:
                await engine.wait_subscribed()
                await engine.step(3, events_per_batch=4)
                await _until_stored(reader, dest, engine.last_seq)
            finally:
                await second.stop()
        msgs = await _subject_messages(reader, dest, eng)
        rank = {e0: 0, e1: 1}  # (another epoch stays as it is, and fails below)
        lost = [
            (rank.get(m["epoch"], m["epoch"]), m["from_seq"], m["to_seq"], m["reason"])
            for m in msgs
            if m.get("type") == "EventsLost"
        ]
        held = [(rank.get(m["epoch"], m["epoch"]), m["seq"]) for m in msgs if m.get("type") not in ("EventsLost", "SourceReset")]
        missing = [
            (e, s)
            for e, top in ((0, 9), (1, 4))
            for s in range(top + 1)
            if (e, s) not in held and not any(le == e and a <= s <= b for le, a, b, _ in lost)
        ]
        assert not missing
        assert lost == [(0, 0, 9, "sink_lost:nats-f"), (1, 0, 4, "sink_lost:nats-f")]  # each once
        state, _ = await bootstrap(reader, f"ST{dest}", "eng", 0, attempts=1)
        assert not state.complete
    finally:
        with contextlib.suppress(nats.errors.Error, Exception):
            await js.delete_stream(dest)
            await js.delete_key_value(f"ST{dest}")


class _Split:
    """Two engines (``a``, ``b``) whose subjects an operator split over two JetStream streams made
    beforehand (``names``: source -> stream; ``stream.create: false``), and the config of a
    bridge writing them through one NATS sink (state on, checkpoint saved every 100 ms)."""

    def __init__(self, reader: Client, tmp_path: Path, url: str, prefix: str, sink_name: str) -> None:
        self.reader, self.js = reader, reader.jetstream(timeout=5)
        self.dest = f"{prefix}{uuid.uuid4().hex[:8].upper()}"
        self.names = {"a": self.dest + "A", "b": self.dest + "B"}
        self.ports = {n: (free_port(), free_port()) for n in "ab"}
        self.raw = _bridge_config(tmp_path, url, self.dest, sink_name, "file", *self.ports["a"])
        self.raw["sinks"][0]["stream"] = {"create": False}  # (the operator's two streams)
        self.raw["sources"] = [
            {"name": n, "endpoint": f"tcp://127.0.0.1:{lv}", "replay_endpoint": f"tcp://127.0.0.1:{rp}"}
            for n, (lv, rp) in self.ports.items()
        ]
        self.raw["checkpoint"]["interval"] = "100ms"

    async def create(self, *sources: str) -> None:
        """Creates the stream of each of ``sources`` (all when none), empty."""
        for src in sources or tuple(self.names):
            await self.js.add_stream(js_api.StreamConfig(name=self.names[src], subjects=[f"{self.dest}.{src}.>"]))

    async def lose(self, src: str) -> None:
        """An operator deletes the stream of ``src`` and creates it again, empty."""
        await self.js.delete_stream(self.names[src])
        await self.create(src)

    async def messages(self, src: str) -> list[dict[str, Any]]:
        """What the stream of ``src`` holds on its subject, in stream order."""
        return await _subject_messages(self.reader, self.dest, Stream(src, 0), within=self.names[src])

    async def stored(self, engines: dict[str, CacheEngine], *sources: str) -> None:
        """Until each of ``sources`` has its engine's last batch in its own stream."""

        async def met() -> bool:
            for src in sources:
                if engines[src].last_seq not in [m["seq"] for m in await self.messages(src) if "events" in m]:
                    return False
            return True

        await _until(met, f"{sources}: the last batches were never stored")

    @contextlib.asynccontextmanager
    async def running(self, *engines: CacheEngine) -> AsyncIterator[Bridge]:
        """A bridge on ``raw`` (as it is now), once ``engines`` have its subscription; stopped after."""
        bridge = Bridge(from_data(self.raw, env={}))
        await bridge.start()
        try:
            for engine in engines:
                await engine.wait_subscribed()
            yield bridge
        finally:
            await bridge.stop()

    async def remove(self) -> None:
        for name in self.names.values():
            with contextlib.suppress(Exception):
                await self.js.delete_stream(name)
        with contextlib.suppress(Exception):
            await self.js.delete_key_value(f"ST{self.dest}")


async def test_nats_subjects_split_over_two_streams_lose_nothing_over_a_clean_restart(
    tmp_path: Path, nats_server: NatsServer, reader: Client
) -> None:
    """breaker41 B1: the connector's start check judged every head by one JetStream stream; the
    stream whose subject another captures was told EventsLost for seqs it held, its state cleared."""
    split = _Split(reader, tmp_path, nats_server.url, "KVS", "nats-s")
    await split.create()
    bucket, ports = f"ST{split.dest}", split.ports

    async def head(src: str) -> Any:
        state, _ = await bootstrap(reader, bucket, src, 0, attempts=1)
        return state

    try:
        async with CacheEngine(*ports["a"], seed=1) as ea, CacheEngine(*ports["b"], seed=2) as eb:
            for run in ("first", "second"):  # (nothing happens to the server while no bridge runs)
                async with split.running(ea, eb):
                    await ea.step(10, events_per_batch=3)
                    await eb.step(10, events_per_batch=3)

                    async def both_at_head() -> bool:
                        return (
                            int((await head("a")).head["seq"]) == ea.last_seq
                            and int((await head("b")).head["seq"]) == eb.last_seq
                        )

                    await _until(both_at_head, f"the {run} run's heads never reached")
                    await asyncio.sleep(0.5)
        result = {}
        for src in "ab":
            msgs = await split.messages(src)
            held = sorted({m["seq"] for m in msgs if m.get("type") not in ("EventsLost", "SourceReset")})
            lost = [(m["from_seq"], m["to_seq"], m["reason"]) for m in msgs if m.get("type") == "EventsLost"]
            falsely = sorted({s for a, b, _ in lost for s in range(a, b + 1) if s in held})
            st = await head(src)
            result[src] = (lost, falsely, st.complete)
        assert all(not r[0] for r in result.values()), f"EventsLost announced although nothing was lost: {result}"
        assert all(r[2] for r in result.values()), f"a complete state was cleared: {result}"
    finally:
        await split.remove()


@pytest.mark.parametrize("lost", ["a", "b"])
async def test_nats_subjects_split_over_two_streams_one_lost_while_no_bridge_ran(
    tmp_path: Path, nats_server: NatsServer, reader: Client, lost: str
) -> None:
    """breaker89 B1 (marks): a sink without state, its subjects split over two JetStream streams;
    one is deleted and created again while no bridge runs. Every mark named the stream that
    acknowledged last, so the loss was never announced, whichever stream it was (4 of 4). Each
    mark now names its bridge stream's own: the lost one is told, first, the other nothing."""
    split = _Split(reader, tmp_path, nats_server.url, "KVM", "nats-m")
    await split.create()
    del split.raw["sinks"][0]["state"]
    try:
        async with CacheEngine(*split.ports["a"], seed=1) as ea, CacheEngine(*split.ports["b"], seed=2) as eb:
            engines = {"a": ea, "b": eb}

            async def run() -> None:
                async with split.running(ea, eb):
                    await ea.step(5, events_per_batch=3)
                    await eb.step(5, events_per_batch=3)
                    await split.stored(engines, "a", "b")

            await run()
            await split.lose(lost)
            await run()
        for src in "ab":
            msgs = await split.messages(src)
            told = [(m["from_seq"], m["to_seq"], m["reason"]) for m in msgs if m.get("type") == "EventsLost"]
            held = [m["seq"] for m in msgs if "events" in m]
            if src == lost:
                assert told == [(0, 4, "sink_lost:nats-m")] and msgs[0]["type"] == "EventsLost", (src, told)
                assert held == list(range(5, 10)), (src, held)
            else:
                assert (told, held) == ([], list(range(10))), (src, told, held)
    finally:
        await split.remove()


@pytest.mark.parametrize("lost", ["a", "b"])
@pytest.mark.parametrize("mode", ["state", "from_sinks"])
async def test_nats_subjects_split_over_two_streams_one_lost_under_a_quiet_engine_after_a_restart(
    tmp_path: Path, nats_server: NatsServer, reader: Client, lost: str, mode: str
) -> None:
    """breaker91 B1, B3: subjects split over two JetStream streams, a sink with state (or
    ``checkpoint.from_sinks``), restarted; engine a writes, b is quiet. What the start read back
    of b (its state's head, or its last message) gave b no stream of its own: a loss of a's stream
    was told to b too, though b's stream held all it had (4 of 4), and a loss of b's stream was
    never announced (4 of 4). The start now takes each stream's holder from what it read."""
    split = _Split(reader, tmp_path, nats_server.url, "KVQ", "nats-q")
    await split.create()
    raw = split.raw
    if mode == "from_sinks":
        del raw["sinks"][0]["state"]
    raw["checkpoint"]["from_sinks"] = mode == "from_sinks"
    try:
        async with CacheEngine(*split.ports["a"], seed=1) as ea, CacheEngine(*split.ports["b"], seed=2) as eb:
            engines = {"a": ea, "b": eb}

            async def stored(*sources: str) -> None:
                await split.stored(engines, *sources)

            async with split.running(ea, eb):
                await ea.step(10, events_per_batch=3)
                await eb.step(10, events_per_batch=3)
                await stored("a", "b")
                await asyncio.sleep(0.5)  # (the state's heads, the checkpoint)
            async with split.running(ea, eb):
                await ea.step(3, events_per_batch=3)
                await stored("a")
                await split.lose(lost)
                await ea.step(2, events_per_batch=3)
                await stored("a")
                await eb.step(3, events_per_batch=3)
                await stored("b")
        for src in "ab":
            told = [(m["from_seq"], m["to_seq"]) for m in await split.messages(src) if m.get("type") == "EventsLost"]
            if src == lost:
                assert any(first <= 0 and last >= 9 for first, last in told), (src, told)
            else:
                assert told == [], (src, told)
    finally:
        await split.remove()


@pytest.mark.parametrize("engine", ["goes_on", "restarted"])
async def test_a_loss_found_by_both_checks_after_a_crash_is_announced_once(
    tmp_path: Path, nats_server: NatsServer, reader: Client, engine: str
) -> None:
    """breaker41 B3: the checkpoint behind the state heads (a crash between two saves: saved at 9,
    the head at 14), then the memory stream lost: the start check (0..9) and the connector's own
    (0..14) both announced, overlapping. breaker43 B3: with the engine also restarted while no
    bridge ran, 10..14 never come again, and skipping the connector's span left them unannounced.
    Now the start span, then the rest of the connector's: each seq once, in order."""
    dest = f"KVD{uuid.uuid4().hex[:8].upper()}"
    live, rep = free_port(), free_port()
    raw = _bridge_config(tmp_path, nats_server.url, dest, "nats-f", "file", live, rep)
    raw["checkpoint"]["interval"] = "100ms"
    cfg = from_data(raw, env={})
    cp = Path(raw["checkpoint"]["path"])
    eng = Stream("eng", 0)
    js = reader.jetstream(timeout=5)
    try:
        async with CacheEngine(live, rep, seed=41) as cache:
            first = Bridge(cfg)
            await first.start()
            try:
                await cache.wait_subscribed()
                await cache.step(10, events_per_batch=4)
                await _until_head(reader, f"ST{dest}", 9)

                async def saved_at_9() -> bool:
                    text = await asyncio.to_thread(lambda: cp.read_text() if cp.exists() else "")
                    return '"seq":9,' in text or '"seq":9}' in text

                await _until(saved_at_9, "checkpoint never saved at seq 9")
                shutil.copy(cp, tmp_path / "cp-at-crash.json")  # what was on disk at the crash
                await cache.step(5, events_per_batch=4)
                await _until_head(reader, f"ST{dest}", 14)
                await _until_stored(reader, dest, 14)
                first_epoch = (await _subject_messages(reader, dest, eng))[-1]["epoch"]
            finally:
                await first.stop()
            shutil.copy(tmp_path / "cp-at-crash.json", cp)  # the crash: the last save was at seq 9
            await nats_server.arestart()  # the events stream, kept in memory, is gone
            if engine == "restarted":
                await cache.restart()  # 10..14 are not in its buffer any more
            second = Bridge(cfg)
            await second.start()
            try:
                await cache.wait_subscribed()
                await cache.step(3, events_per_batch=4)
                await _until_stored(reader, dest, cache.last_seq)
                await asyncio.sleep(0.5)
            finally:
                await second.stop()
        msgs = await _subject_messages(reader, dest, eng)
        lost = [(m["from_seq"], m["to_seq"]) for m in msgs if m.get("type") == "EventsLost" and m["epoch"] == first_epoch]
        assert lost == [(0, 9), (10, 14)], lost
        assert all(m["reason"] == "sink_lost:nats-f" for m in msgs if m.get("type") == "EventsLost")
    finally:
        with contextlib.suppress(nats.errors.Error, Exception):
            await js.delete_stream(dest)
            await js.delete_key_value(f"ST{dest}")


@pytest.mark.parametrize("recreated", ["after_start", "before_start_control"])
async def test_a_nats_stream_missing_at_start_has_its_loss_announced_once_created_again(
    recreated: str, tmp_path: Path, nats_server: NatsServer, reader: Client
) -> None:
    """breaker43 B2 (the NATS twin of breaker41 B2): an operator-managed events stream deleted while
    no bridge ran, created again only after the start: its heads' subject captured by no stream was
    taken for "cannot tell", and nothing was announced."""
    dest = f"KVM{uuid.uuid4().hex[:8].upper()}"
    js = reader.jetstream(timeout=5)
    stream_cfg = js_api.StreamConfig(name=dest, subjects=[f"{dest}.>"], storage=js_api.StorageType.FILE)
    await js.add_stream(stream_cfg)  # the operator's stream
    live, rep = free_port(), free_port()
    raw = _bridge_config(tmp_path, nats_server.url, dest, "nats-o", "file", live, rep)
    raw["sinks"][0]["stream"] = {"create": False, "name": dest}  # operator-managed (the default)
    raw["checkpoint"]["interval"] = "100ms"
    cfg = from_data(raw, env={})
    try:
        async with CacheEngine(live, rep, seed=43) as engine:
            first = Bridge(cfg)
            await first.start()
            try:
                await engine.wait_subscribed()
                await engine.step(10, events_per_batch=4)
                await _until_head(reader, f"ST{dest}", engine.last_seq)
                await _until_stored(reader, dest, engine.last_seq)
            finally:
                await first.stop()
            acked = engine.last_seq
            await js.delete_stream(dest)  # while no bridge runs
            if recreated != "after_start":
                await js.add_stream(stream_cfg)  # control: created again (empty) before the start
            second = Bridge(cfg)
            await second.start()
            try:
                await asyncio.sleep(1.0)
                if recreated == "after_start":
                    await js.add_stream(stream_cfg)  # the operator creates it again
                await engine.wait_subscribed()
                await engine.step(5, events_per_batch=4)
                await _until_stored(reader, dest, engine.last_seq)
                await asyncio.sleep(0.5)
            finally:
                await second.stop()
        msgs = await _subject_messages(reader, dest, Stream("eng", 0))
        lost = [(m["from_seq"], m["to_seq"], m["reason"]) for m in msgs if m.get("type") == "EventsLost"]
        held = sorted({m["seq"] for m in msgs if m.get("type") not in ("EventsLost", "SourceReset")})
        state, _ = await bootstrap(reader, f"ST{dest}", "eng", 0, attempts=1)
        missing = [s for s in range(acked + 1) if s not in held and not any(a <= s <= b for a, b, _ in lost)]
        assert not missing, f"I6: acknowledged then lost, never announced: {missing}"
        assert lost == [(0, acked, "sink_lost:nats-o")] and not state.complete
    finally:
        with contextlib.suppress(nats.errors.Error, Exception):
            await js.delete_stream(dest)
            await js.delete_key_value(f"ST{dest}")


async def _event_records(kafka: KafkaServer, topic: str) -> list[Any]:
    """Every record of partition 0 of ``topic``, as aiokafka gives them (headers included)."""
    from aiokafka import AIOKafkaConsumer

    tp = TopicPartition(topic, 0)
    c = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=None, enable_auto_commit=False)
    await c.start()
    try:
        c.assign([tp])
        end = (await c.end_offsets([tp]))[tp]
        c.seek(tp, (await c.beginning_offsets([tp]))[tp])
        out: list[Any] = []
        while (await c.position(tp)) < end:
            got = await c.getmany(tp, timeout_ms=500, max_records=10_000)
            out.extend(r for r in got.get(tp, []) if r.offset < end)
        return out
    finally:
        await c.stop()


@pytest.mark.parametrize("restored", [False, True, "empty_last"])
@pytest.mark.parametrize("from_sinks", [False, True])
async def test_a_kafka_sink_at_event_granularity_is_told_only_what_it_lacks_of_its_last_batch(
    tmp_path: Path, kafka: KafkaServer, from_sinks: bool, restored: bool | str
) -> None:
    """breaker51 B2: a clean stop and start at event granularity (nothing touched meanwhile) told the
    sink its last batch was lost and cleared its state: from the headers the last event of a whole
    batch looked like one of a batch cut short. It now says ``last``. breaker51 B1: the events
    topic restored from a backup that lacks the last 2 events of the last batch every sink
    acknowledged: with checkpoint.from_sinks that batch was neither sent again nor announced. Now
    it is held whole in the end, or announced lost; and nothing is announced after a clean restart.
    ``empty_last`` (breaker55 B1): the last batch before a clean stop holds no event, so the sink
    has no message of it: it was announced lost, and the state cleared."""
    from aiokafka import AIOKafkaProducer

    topic, state_topic = f"kvev-{uuid.uuid4().hex[:8]}", f"kvst-{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    made = {"enabled": True, "partitions": 1}
    k = sink(kafka, topic, state_topic, granularity="event", create_topics=made, allow_auto_create_topics=False)
    cfg = from_data(
        {
            "sources": [source("a", live, rep)],
            "sinks": [k],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
            "checkpoint": {"path": str(tmp_path / "cp.json"), "interval": "100ms", "from_sinks": from_sinks},
            "replay": REPLAY,
            "shutdown_timeout": "5s",
        },
        env={},
    )
    async with CacheEngine(live, rep, seed=51) as engine:
        first = Bridge(cfg)
        await first.start()
        try:
            await engine.wait_subscribed()
            await engine.step(10, events_per_batch=4)
            if restored == "empty_last":
                await engine.send([])
            await kafka_state_at(kafka, state_topic, engine.last_seq)
        finally:
            await first.stop()
        acked = engine.last_seq if restored != "empty_last" else engine.last_seq - 1  # (the last batch with events)
        if restored is True:  # while no bridge runs: the topic comes back from a backup cut in its last batch
            backup = await _event_records(kafka, topic)
            await delete_topic(kafka, topic)
            await kafka.anew_topic(partitions=1, name=topic)
            producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
            await producer.start()
            try:
                for r in backup[:-2]:
                    await producer.send_and_wait(topic, r.value, key=r.key, headers=list(r.headers), partition=0)
            finally:
                await producer.stop()
        second = Bridge(cfg)
        await second.start()
        try:
            await engine.wait_subscribed()
            await engine.step(3, events_per_batch=4)
            head = await kafka_state_at(kafka, state_topic, engine.last_seq)
        finally:
            await second.stop()
    held: dict[int, set[int]] = {}
    lost = []
    for d in (json.loads(r.value) for r in await _event_records(kafka, topic) if r.key == b"a/0" and r.value):
        if d["type"] == "EventsLost":
            lost.append((d["from_seq"], d["to_seq"], d["reason"]))
        elif d["type"] != "SourceReset":
            held.setdefault(d["seq"], set()).add(d["index"])
    if restored is not True:
        assert not lost and head["complete"], f"a clean restart announced {lost}"
    told = any(a <= acked <= b and why == "sink_lost:k" for a, b, why in lost)
    assert held.get(acked) == {0, 1, 2, 3} or told, f"batch {acked} held as events {held.get(acked)}, announced {lost}"
