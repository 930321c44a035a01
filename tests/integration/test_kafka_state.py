"""The Kafka sink's live-block state (``state.enabled``) and ``kv_consumer.kafka.bootstrap`` on a real broker.

Each test holds a consumer's bootstrap (the state topic's head and entries, then the stream's
events from the head's ``next``) against the true cache of :class:`~tests.support.cache_engine.CacheEngine`
s publishing through a bridge:

- ``test_bootstrap_at_any_cut_equals_the_engines_cache``: consumers bootstrap at random moments
  while the engines publish (stores, copies, CPU offloads, removals, a clear, an engine restart);
  each one, once it followed the events, holds exactly each engine's cache (nothing applied twice,
  nothing skipped);
- ``test_sigkill_between_event_and_state_writes_then_rebuild``: a bridge process is SIGKILLed at
  random points while an engine publishes many small batches (kills between a write's events and
  its state are counted: some runs must have one), restarted (it rebuilds its tables from the state
  topic: ``read_state``), and a bootstrap still equals the engine's cache, complete;
- ``test_reset_tombstones_every_old_key``: a reset of a stream with 10^5 live blocks leaves no live
  key of the old epoch in the state topic, and a rebuild reads 10^5 keys back (timed);
- ``test_state_topic_is_created_compacted_and_one_that_deletes_by_retention_is_refused``:
  ``state.create`` makes a compacted topic; a missing one is never auto-created; one that deletes
  by retention (``delete`` in its cleanup.policy and a retention limit) is refused at connect and
  by ``--check``, naming the fix; a plain one that keeps everything is warned about;
- ``test_a_state_topic_set_to_delete_by_retention_during_a_run_is_refused_and_the_state_told_lost``
  and ``test_records_deleted_from_a_state_partitions_start_tell_its_streams_state_lost``: found by
  the sink's audit while the stream is quiet; the heads go (no bootstrap says complete), the
  sink is not ready naming the fix, and the state starts again incomplete;
- ``test_a_state_entry_larger_than_the_state_topics_limit_neither_stalls_nor_lies``: an entry over
  the state topic's ``max.message.bytes`` is written without its fact; the state goes on, exact;
- ``test_a_state_record_larger_than_a_state_batch_even_without_its_fact_neither_stalls_nor_lies`` and
  ``test_a_state_head_larger_than_a_state_batch_does_not_stop_the_events``: one that no batch holds
  even without its fact (a long medium, a long source name) is not written: the stream's state is
  cleared and incomplete (logged once, counted), the events and the state go on;
- ``test_a_state_topic_deleted_during_a_run_comes_back_compacted_and_the_state_incomplete``: no
  metadata request re-creates it with the broker's defaults; ``state.create`` makes it again as
  configured, and the stream's state starts a new generation, incomplete;
- ``test_an_events_topic_deleted_during_a_run_is_created_with_its_settings_and_the_loss_announced``:
  the same for the events topic (``create_topics``), with an ``EventsLost`` (``sink_lost:k``) for
  what it held ahead of everything else in the new topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import DefaultPartitioner

from bridge.config import SinkConfig, convert_options, from_data
from bridge.errors import NotConnected
from bridge.records import Stream
from bridge.runtime import Bridge
from connectors.kafka import KafkaConnector, KafkaOptions
from kv_consumer.kafka import StateLog
from kv_consumer.state import StreamState
from tests.infra.servers import KafkaServer, free_port
from tests.integration.test_kafka import delete_topic, topic_exists
from tests.support.cache_engine import CacheEngine, event
from tests.support.process import BridgeProcess, bridge_config
from tests.support.snapshots import seeded_mid_epoch_and_after_a_loss, snapshot_source
from tests.support.state_kafka import Follower, delete_records, last_head, offsets, read_partition, truth

pytestmark = pytest.mark.integration

REPLAY = {"timeout": "300ms", "max_attempts": 20, "initial_backoff": "50ms", "max_backoff": "200ms", "idle_probe": 0}
_PARTITIONER = DefaultPartitioner()


def partition_of(stream: str, partitions: int) -> int:
    return int(_PARTITIONER(stream.encode(), list(range(partitions)), list(range(partitions))))


def sink(kafka: KafkaServer, topic: str, state_topic: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "kafka",
        "name": "k",
        "bootstrap_servers": kafka.bootstrap_servers,
        "topic": topic,
        "format": "json",
        "granularity": "event",
        "batch": {"linger": 0},
        "state": {"enabled": True, "topic": state_topic, "create": True, "partitions": 2},
        **extra,
    }


def source(name: str, live: int, replay: int) -> dict[str, Any]:
    return {"name": name, "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}


async def delivered(bridge: Bridge, engines: dict[str, CacheEngine], timeout: float = 30.0) -> dict[str, tuple[int, int]]:
    """Until the bridge took each engine's last batch: {stream: (epoch, seq)} of each."""
    assert bridge.tracker is not None
    deadline = time.monotonic() + timeout
    while True:
        heads = {name: bridge.tracker.head(Stream(name, 0)) for name in engines}
        if all(h is not None and h.seq == engines[n].last_seq for n, h in heads.items()):
            return {f"{n}/0": (h.epoch, h.seq) for n, h in heads.items() if h is not None}
        assert time.monotonic() < deadline, f"the bridge did not take every batch: {heads}"
        await asyncio.sleep(0.05)


# -- (a) bootstrap at any cut -----------------------------------------------------------------------


async def test_bootstrap_at_any_cut_equals_the_engines_cache(tmp_path: Path, kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic(partitions=2)
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"  # created by the sink (state.create)
    ports = {name: (free_port(), free_port()) for name in ("a", "b")}
    config = {
        "sources": [source(n, *p) for n, p in ports.items()],
        "sinks": [sink(kafka, topic, state_topic, batch={"linger": 0, "max_messages": 40})],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    rand = random.Random(7)
    async with CacheEngine(*ports["a"], seed=1) as a, CacheEngine(*ports["b"], seed=2) as b:
        engines = {"a": a, "b": b}
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        followers: list[tuple[str, Follower]] = []
        try:
            await a.wait_subscribed()
            await b.wait_subscribed()

            async def publish() -> None:
                for step in range(240):
                    if step == 80:
                        await a.clear()
                    elif step == 150:
                        await b.restart()
                        await b.wait_subscribed()
                    for engine in engines.values():
                        await engine.step(1, events_per_batch=rand.randrange(1, 6))
                    await asyncio.sleep(0.01)

            async def cut(name: str, delay: float) -> None:
                await asyncio.sleep(delay)
                follower = await Follower.start(kafka.bootstrap_servers, name, 0, topic=topic, state_topic=state_topic)
                followers.append((f"{name}/0", follower))

            publisher = asyncio.create_task(publish())
            cuts = [asyncio.create_task(cut(n, rand.uniform(0.0, 3.0))) for n in ("a", "b") for _ in range(4)]
            await asyncio.gather(publisher, *cuts)
            assert b.caches[0] and any(n > 1 for n in a.cache.values()) and any(m == "CPU" for _, m in a.cache)
            # And one cut after everything, with nothing left to follow.
            last = await delivered(bridge, engines)
            for name in engines:
                follower = await Follower.start(kafka.bootstrap_servers, name, 0, topic=topic, state_topic=state_topic)
                followers.append((f"{name}/0", follower))
            mid = sum(1 for _, f in followers if f.state.head["seq"] >= 0 and f.state.head["seq"] < 200)
            assert mid >= 4, "too few cuts in the middle of the run"
            for key, follower in followers:
                await follower.catch_up(*last[key])
                engine = engines[key.split("/")[0]]
                assert follower.state.blocks() == truth(engine), f"{key} cut at {follower.state.head}"
                assert follower.state.complete
        finally:
            for _, follower in followers:
                await follower.close()
            await bridge.stop()


# -- (b) SIGKILL between the event write and the state write ---------------------------------------


async def test_sigkill_between_event_and_state_writes_then_rebuild(tmp_path: Path, kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic(partitions=1)
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"
    live, replay = free_port(), free_port()
    # Small writes: each is its events, then their state, so a kill often falls between the two.
    # Small record batches: a state write often takes several, so some kills fall inside one.
    sinks = [sink(kafka, topic, state_topic, batch={"linger": 0, "max_messages": 4}, max_batch_bytes="1KiB")]
    cfg = bridge_config(
        tmp_path, [source("a", live, replay)], sinks, replay=REPLAY, checkpoint={"path": str(tmp_path / "ckpt.json")}
    )
    rand = random.Random(int(os.environ.get("KVB_SEED", "11")))
    state_partition = partition_of("a/0", 2)
    between = 0  # kills that left events stored past the last head's next
    torn = 0  # kills that left records of a state write after its last head
    async with CacheEngine(live, replay, seed=3) as engine:
        stop = asyncio.Event()

        async def publish() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                if n % 97 == 0:
                    await engine.clear()
                else:
                    await engine.step(1, events_per_batch=1)
                if n % 2 == 0:
                    await asyncio.sleep(0.002)

        proc = BridgeProcess(tmp_path, cfg).start()
        publisher: asyncio.Task[None] | None = None
        try:
            await proc.wait_ready()
            await engine.wait_subscribed()
            publisher = asyncio.create_task(publish())
            kills = 0
            while kills < 4 or (between < 1 and kills < 30):
                await asyncio.sleep(rand.uniform(0.2, 1.0))
                proc.kill()
                kills += 1
                records = await read_partition(kafka.bootstrap_servers, TopicPartition(state_topic, state_partition))
                heads = [json.loads(v) for k, v in records if k == b"a/0/_head" and v is not None]
                end = (await offsets(kafka.bootstrap_servers, TopicPartition(topic, 0)))[1]
                if heads and isinstance(heads[-1]["next"], int) and end > heads[-1]["next"]:
                    between += 1
                if records and records[-1][0] != b"a/0/_head":
                    torn += 1  # killed in the middle of a state write: read_state must cut at the head
                proc = BridgeProcess(tmp_path, cfg).start()
                await proc.wait_ready()
            stop.set()
            await publisher
            deadline = time.monotonic() + 90  # the last bridge replays what the kills left behind
            while True:
                head = await last_head(kafka.bootstrap_servers, state_topic, state_partition, "a/0")
                if head is not None and head["seq"] == engine.last_seq:
                    break
                assert time.monotonic() < deadline, f"the state did not reach seq {engine.last_seq}: {head}"
                await asyncio.sleep(0.2)
            samples = await proc.metrics()
            rebuilt = sum(v for k, v in samples.items() if k.startswith("kv_bridge_state_rebuilds_total") and "rebuilt" in k)
            fresh = sum(v for k, v in samples.items() if k.startswith("kv_bridge_state_rebuilds_total") and "fresh" in k)
            assert (rebuilt, fresh) == (1, 0), proc.log()[-3000:]
            follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
            try:
                await follower.catch_up(head["epoch"], head["seq"])
                assert follower.state.complete, follower.state.head
                assert follower.state.blocks() == truth(engine)
            finally:
                await follower.close()
            print("kills", kills, "between", between, "torn", torn, "batches", engine.last_seq)
            assert between >= 1, "no kill fell between a write's events and its state"
        finally:
            stop.set()
            if publisher is not None:
                with contextlib.suppress(Exception):
                    await publisher
            with contextlib.suppress(AssertionError):
                await proc.terminate()


# -- (c) a reset tombstones every live key -----------------------------------------------------------


async def test_reset_tombstones_every_old_key(tmp_path: Path, kafka: KafkaServer) -> None:
    topic = await kafka.anew_topic(partitions=1)
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"
    live, replay = free_port(), free_port()
    n_blocks, per_batch = 100_000, 2_000
    config = {
        "sources": [source("a", live, replay)],
        "sinks": [sink(kafka, topic, state_topic, token_ids="drop", granularity="batch")],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    async with CacheEngine(live, replay, seed=4) as engine:
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        try:
            await engine.wait_subscribed()
            rand = random.Random(5)
            for _ in range(n_blocks // per_batch):
                hashes = [rand.getrandbits(64) for _ in range(per_batch)]
                ev = event(
                    "BlockStored",
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=16,
                    medium="GPU",
                    group_idx=0,
                )
                engine.apply(ev)
                await engine.send([ev])
            old = (await delivered(bridge, {"a": engine}, timeout=60))["a/0"]
            assert await bridge.workers[0].flush(60)
            stream = Stream("a", 0)
            # A rebuild reads the 10^5 keys back (what a restarted bridge does), timed.
            connector = bridge.workers[0].connector
            assert isinstance(connector, KafkaConnector)
            t0 = time.perf_counter()
            got = await connector.read_state([stream])
            took = time.perf_counter() - t0
            held = got["a/0"]
            assert held is not None and len(held[1]) == n_blocks and held[0].live == n_blocks, held and held[0]
            t0 = time.perf_counter()
            follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
            swept = time.perf_counter() - t0
            try:
                assert follower.state.ready and follower.state.blocks() == truth(engine)
            finally:
                await follower.close()
            print(f"read_state of {n_blocks} keys: {took:.2f}s; a consumer's bootstrap: {swept:.2f}s")
            t_reset = time.monotonic()
            await engine.restart()
            await engine.wait_subscribed()
            await engine.step(3)
            new = (await delivered(bridge, {"a": engine}, timeout=60))["a/0"]
            assert new[0] > old[0]
            deadline = time.monotonic() + 60
            part = partition_of("a/0", 2)
            while True:
                records = await read_partition(kafka.bootstrap_servers, TopicPartition(state_topic, part))
                log = StateLog(["a/0"])
                for k, v in records:
                    assert k is not None
                    log.add(k, v)
                head, values = log.newest("a/0")
                if head is not None and json.loads(head)["epoch"] == new[0] and json.loads(head)["seq"] == new[1]:
                    break
                assert time.monotonic() < deadline, "the new epoch's head did not come"
                await asyncio.sleep(0.2)
            print(f"reset of {n_blocks} live blocks: new head in the state topic after {time.monotonic() - t_reset:.2f}s")
            docs = [json.loads(v) for v in values]
            assert not [d for d in docs if d["epoch"] != new[0]], "live keys of the old epoch"
            assert len(docs) == json.loads(head)["live"] == len(truth(engine))
            tombstones = sum(1 for _, v in records if v is None)
            assert tombstones >= n_blocks
            follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
            try:
                await follower.catch_up(*new)
                assert follower.state.epoch == new[0] and follower.state.blocks() == truth(engine)
                assert {d["epoch"] for d in follower.state.entries.values()} == {new[0]}
            finally:
                await follower.close()
        finally:
            await bridge.stop()


# -- the state topic ---------------------------------------------------------------------------------


def state_connector(kafka: KafkaServer, events: str, **state: Any) -> KafkaConnector:
    values = {"bootstrap_servers": kafka.bootstrap_servers, "topic": events, "state": {"enabled": True, **state}}
    return KafkaConnector("k", convert_options(values, KafkaOptions, "sinks[0]"), SinkConfig(type="kafka", name="k"))


async def test_state_topic_is_created_compacted_and_one_that_deletes_by_retention_is_refused(
    kafka: KafkaServer, caplog: pytest.LogCaptureFixture
) -> None:
    topic = await kafka.anew_topic()
    created = f"kvb-state-{uuid.uuid4().hex[:12]}"
    conn = state_connector(kafka, topic, topic=created, create=True, partitions=3)
    await conn.connect()
    await conn.close()
    configs = await kafka.topic_configs(created)
    assert configs["cleanup.policy"] == "compact"
    assert (configs["min.cleanable.dirty.ratio"], configs["segment.ms"]) == ("0.1", "3600000")
    assert conn._partitions[created] == [0, 1, 2]
    # Not created by the sink and not there: never auto-created (a plain topic would lose the state).
    conn = state_connector(kafka, topic, topic=f"kvb-state-{uuid.uuid4().hex[:12]}")
    with pytest.raises(NotConnected, match=r"state topic .* does not exist"):
        await conn.connect()
    await conn.close()
    # A plain topic that keeps everything (delete policy, no retention limit): connected, warned about.
    keeps = await kafka.anew_topic(config={"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"})
    conn = state_connector(kafka, topic, topic=keeps)
    with caplog.at_level(logging.WARNING, logger="connectors.kafka"):
        await conn.connect()
    await conn.close()
    assert any("not log-compacted" in r.getMessage() for r in caplog.records)
    # Deleting by retention (the broker's default 7 days on a plain topic, or compact,delete with
    # an hour): heads and live entries would go and a bootstrap would call what is left complete
    # (breaker29h K4). Refused at connect, --check (creates_nothing) included, naming the fix.
    plain = await kafka.anew_topic()
    both = await kafka.anew_topic(config={"cleanup.policy": "compact,delete", "retention.ms": "3600000"})
    # A topic whose max.message.bytes is below what a state batch may need refuses them for ever:
    # nothing past them would be delivered (breaker31k, break 2: 0 of 25 batches, ready never).
    small = await kafka.anew_topic(config={"cleanup.policy": "compact", "max.message.bytes": "900"})
    # Tombstones deleted right after compaction (breaker74 B2, delete.retention.ms=0): a slow
    # bootstrap missed removals and kept 12 removed blocks in a state marked complete.
    brief = await kafka.anew_topic(config={"cleanup.policy": "compact", "delete.retention.ms": "0"})
    deletes = ("deletes records by retention", "state_topic_deletes", "set cleanup.policy=compact")
    limit = ("takes record batches of at most 900 bytes", "state_topic_limit", "--add-config max.message.bytes=")
    tombstones = ("deletes tombstones 0 ms after compaction", "state_topic_limit", "--add-config delete.retention.ms=")
    cases = [(plain, False, deletes), (both, False, deletes), (both, True, deletes), (small, False, limit), (small, True, limit)]
    cases += [(brief, False, tombstones), (brief, True, tombstones)]
    for refusing, check, (says, reason, fix) in cases:
        conn = state_connector(kafka, topic, topic=refusing)
        conn.creates_nothing = check
        with pytest.raises(NotConnected, match=says) as refused:
            await conn.connect()
        problem = await conn.health()
        await conn.close()
        assert refused.value.reason == reason
        assert repr(refusing) in str(refused.value) and fix in str(refused.value)
        assert problem is not None and fix in problem
        if refusing == both:
            assert "retention.ms=3600000" in str(refused.value)


async def limited_state_topic(
    tmp_path: Path, kafka: KafkaServer, limit: int, name: str = "a"
) -> tuple[str, str, int, int, dict[str, Any]]:
    """An events topic, a compacted state topic taking record batches of ``limit`` bytes at most
    (max.message.bytes), and an in-process bridge's config writing both for source ``name``:
    (topic, state topic, live port, replay port, config)."""
    topic = await kafka.anew_topic(partitions=1)
    state_topic = await kafka.anew_topic(partitions=2, config={"cleanup.policy": "compact", "max.message.bytes": str(limit)})
    live, replay = free_port(), free_port()
    config = {
        "sources": [source(name, live, replay)],
        "sinks": [sink(kafka, topic, state_topic, state={"enabled": True, "topic": state_topic})],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    return topic, state_topic, live, replay, config


async def test_a_state_entry_larger_than_the_state_topics_limit_neither_stalls_nor_lies(
    tmp_path: Path, kafka: KafkaServer
) -> None:
    # The state topic takes records of up to 20000 bytes (max.message.bytes), the sink's batches
    # 1MiB: one block with a 4,000-token prompt makes an entry of ~25KB, which the topic refuses.
    topic, state_topic, live, replay, config = await limited_state_topic(tmp_path, kafka, 20000)
    async with CacheEngine(live, replay, seed=6) as engine:
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(3)
            big = event(
                "BlockStored",
                block_hashes=[random.Random(6).getrandbits(64)],
                parent_block_hash=None,
                token_ids=[100_000 + i for i in range(4000)],
                block_size=4000,
                medium="GPU",
                group_idx=0,
            )
            engine.apply(big)
            await engine.send([big])
            await engine.step(3)
            deadline = time.monotonic() + 30
            part = partition_of("a/0", 2)
            while (head := await last_head(kafka.bootstrap_servers, state_topic, part, "a/0")) is None or head[
                "seq"
            ] != engine.last_seq:
                assert time.monotonic() < deadline, f"the state did not reach seq {engine.last_seq}: {head}"
                await asyncio.sleep(0.2)
            follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
            try:
                await follower.catch_up(head["epoch"], head["seq"])
                assert follower.state.complete and follower.state.blocks() == truth(engine)
            finally:
                await follower.close()
        finally:
            await bridge.stop()


async def test_a_state_record_larger_than_a_state_batch_even_without_its_fact_neither_stalls_nor_lies(
    tmp_path: Path, kafka: KafkaServer, caplog: pytest.LogCaptureFixture
) -> None:
    # The state topic takes batches of 1100 bytes (above the connect check's floor); two blocks
    # with a 600-character medium make entries larger than that even without their facts (the
    # key and the document both carry the medium). Sent, such an entry was refused for ever and
    # nothing past it was delivered (I5). Now it is refused for itself: the stream's state is
    # cleared and incomplete, logged once, counted, and the events and the state go on.
    topic, state_topic, live, replay, config = await limited_state_topic(tmp_path, kafka, 1100)
    rand = random.Random(31)
    async with CacheEngine(live, replay, seed=31) as engine:
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        try:
            with caplog.at_level(logging.ERROR, logger="connectors.kafka"):
                await engine.wait_subscribed()
                await engine.step(3)
                part = partition_of("a/0", 2)

                async def state_at_last_seq() -> dict[str, Any]:
                    deadline = time.monotonic() + 30
                    # The stream's next record after a refusal clears its state: one batch at a time.
                    while (head := await last_head(kafka.bootstrap_servers, state_topic, part, "a/0")) is None or head[
                        "seq"
                    ] != engine.last_seq:
                        assert time.monotonic() < deadline, f"the state did not reach seq {engine.last_seq}: {head}"
                        await engine.step(1)
                        await asyncio.sleep(0.2)
                    return head

                for _ in range(2):  # the second after the state went on from the first
                    big = event(
                        "BlockStored",
                        block_hashes=[rand.getrandbits(64)],
                        parent_block_hash=None,
                        token_ids=list(range(16)),
                        block_size=16,
                        medium="x" * 600,
                        group_idx=0,
                    )
                    engine.apply(big)
                    await engine.send([big])
                    await engine.step(5)
                    await state_at_last_seq()
                await engine.step(5)  # blocks stored in the cleared state's generation
                head = await state_at_last_seq()
            assert head["complete"] is False  # honest: the large entries are not in it
            refused = bridge.metrics.registry.get_sample_value(
                "kv_bridge_sink_errors_total", {"sink": "k", "reason": "state_too_large"}
            )
            assert refused is not None and refused >= 2
            told = [r.getMessage() for r in caplog.records if "larger than a batch of the state topic" in r.getMessage()]
            assert len(told) == 1 and "max.message.bytes" in told[0], told
            follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
            try:
                await follower.catch_up(head["epoch"], head["seq"])
                assert not follower.state.complete
                blocks, true = follower.state.blocks(), truth(engine)
                # A subset: never a block that is not live (a copy stored before the clear is not counted).
                assert blocks and all(0 < n <= true.get(k, 0) for k, n in blocks.items())
            finally:
                await follower.close()
        finally:
            await bridge.stop()


async def test_a_state_head_larger_than_a_state_batch_does_not_stop_the_events(
    tmp_path: Path, kafka: KafkaServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Source names have no length bound: one of 1100 characters makes a head (its key and its
    # document carry the name) that no batch of a 1100-byte state topic holds. The events go on;
    # each record's state is refused again (counted), told once.
    name = "a" * 1100
    topic, state_topic, live, replay, config = await limited_state_topic(tmp_path, kafka, 1100, name)
    async with CacheEngine(live, replay, seed=32) as engine:
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        try:
            await engine.wait_subscribed()
            with caplog.at_level(logging.ERROR):
                deadline = time.monotonic() + 30
                tp = TopicPartition(topic, 0)
                seqs: set[int] = set()
                refused: float | None = None
                # One batch at a time: the stream's next record after a refusal clears its state,
                # whose write is refused again.
                while engine.last_seq < 10 or engine.last_seq not in seqs or (refused or 0) < 3:
                    assert time.monotonic() < deadline, f"the events did not reach seq {engine.last_seq}: {sorted(seqs)}"
                    await engine.step(1)
                    await asyncio.sleep(0.2)
                    seqs = {json.loads(v)["seq"] for _, v in await read_partition(kafka.bootstrap_servers, tp) if v}
                    refused = bridge.metrics.registry.get_sample_value(
                        "kv_bridge_sink_errors_total", {"sink": "k", "reason": "state_too_large"}
                    )
            lines = [r.getMessage() for r in caplog.records]
            assert sum("larger than a batch of the state topic" in line for line in lines) == 1, lines
            assert sum("state change refused by the sink" in line for line in lines) == 1, lines
            for p in range(2):  # no head says anything of the stream
                assert await last_head(kafka.bootstrap_servers, state_topic, p, f"{name}/0") is None
        finally:
            await bridge.stop()


async def test_a_state_topic_deleted_during_a_run_comes_back_compacted_and_the_state_incomplete(
    tmp_path: Path, kafka: KafkaServer
) -> None:
    # aiokafka's metadata refreshes let the broker auto-create the deleted state topic with its
    # defaults (1 partition, cleanup.policy=delete), and the sink wrote on into it: a state with
    # most blocks missing, marked complete. With state.create it comes back as configured, and
    # the state it held is announced lost: the stream starts a new generation, incomplete.
    topic = await kafka.anew_topic(partitions=1)
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"
    live, replay = free_port(), free_port()
    config = {
        "sources": [source("a", live, replay)],
        "sinks": [sink(kafka, topic, state_topic, request_timeout="2s")],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    part = partition_of("a/0", 2)
    async with CacheEngine(live, replay, seed=8) as engine:
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(20)
            await delivered(bridge, {"a": engine})
            deadline = time.monotonic() + 30
            while (head := await last_head(kafka.bootstrap_servers, state_topic, part, "a/0")) is None or head[
                "seq"
            ] != engine.last_seq:  # the state of every batch so far acknowledged
                assert time.monotonic() < deadline, f"the state did not reach seq {engine.last_seq}: {head}"
                await asyncio.sleep(0.2)
            await delete_topic(kafka, state_topic)
            for _ in range(20):  # batches while the topic is gone, then after it is back
                await engine.step(1)
                await asyncio.sleep(0.1)
            deadline = time.monotonic() + 60
            head = None
            while not await topic_exists(kafka, state_topic):  # one more batch at a time until it is back
                assert time.monotonic() < deadline, "the state topic did not come back"
                await engine.step(1)
                await asyncio.sleep(0.3)
            configs = await kafka.topic_configs(state_topic)
            admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
            await admin.start()
            try:
                (described,) = await admin.describe_topics([state_topic])
            finally:
                await admin.close()
            print("state topic after the deletion:", configs["cleanup.policy"], len(described["partitions"]), "partitions")
            assert (configs["cleanup.policy"], len(described["partitions"])) == ("compact", 2)
            await engine.step(1)  # a record after the loss was seen
            while head is None or head["seq"] != engine.last_seq:
                assert time.monotonic() < deadline, f"the state did not reach seq {engine.last_seq}: {head}"
                await asyncio.sleep(0.3)
                head = await last_head(kafka.bootstrap_servers, state_topic, part, "a/0")
            follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
            try:
                await follower.catch_up(head["epoch"], head["seq"])
                print(
                    "head",
                    head,
                    "bootstrap: complete",
                    follower.state.complete,
                    "exact",
                    follower.state.blocks() == truth(engine),
                )
                assert not head["complete"] and not follower.state.complete  # what it held is gone: incomplete
            finally:
                await follower.close()
        finally:
            await bridge.stop()


async def head_now(kafka: KafkaServer, state_topic: str, partition: int, stream: str) -> dict[str, Any] | None:
    """The head of ``stream`` a bootstrap finds now: None when there is none (never written, or
    deleted by a tombstone)."""
    key = f"{stream}/_head".encode()
    head = None
    for k, v in await read_partition(kafka.bootstrap_servers, TopicPartition(state_topic, partition)):
        if k == key:
            head = None if v is None else dict(json.loads(v))
    return head


async def head_at(kafka: KafkaServer, state_topic: str, partition: int, engine: CacheEngine) -> dict[str, Any]:
    """Until the stream's head stands at the engine's last seq: that head."""
    deadline = time.monotonic() + 30
    while (head := await head_now(kafka, state_topic, partition, "a/0")) is None or head["seq"] != engine.last_seq:
        assert time.monotonic() < deadline, f"the state did not reach seq {engine.last_seq}: {head}"
        await asyncio.sleep(0.2)
    return head


def quiet_audit_config(
    tmp_path: Path, kafka: KafkaServer, topic: str, state_topic: str, live: int, replay: int
) -> dict[str, Any]:
    return {
        "sources": [source("a", live, replay)],
        "sinks": [
            sink(
                kafka,
                topic,
                state_topic,
                state={"enabled": True, "topic": state_topic, "create": True, "partitions": 2},
                retry={"initial_backoff": "20ms", "max_backoff": "300ms"},
            )
        ],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }


@contextlib.asynccontextmanager
async def complete_state(
    tmp: Path, kafka: KafkaServer, topic: str, state_topic: str, seed: int
) -> AsyncIterator[tuple[CacheEngine, Bridge, dict[str, Any]]]:
    """An engine and a bridge (quiet_audit_config) whose state of stream a/0 is complete after 20
    steps: (engine, bridge, its head); the bridge is stopped after the block."""
    live, replay = free_port(), free_port()
    async with CacheEngine(live, replay, seed=seed) as engine:
        bridge = Bridge(from_data(quiet_audit_config(tmp, kafka, topic, state_topic, live, replay), env={}))
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(20)
            await delivered(bridge, {"a": engine})
            before = await head_at(kafka, state_topic, partition_of("a/0", 2), engine)
            assert before["complete"]
            yield engine, bridge, before
        finally:
            await bridge.stop()


async def test_a_state_topic_set_to_delete_by_retention_during_a_run_is_refused_and_the_state_told_lost(
    tmp_path: Path, kafka: KafkaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 K4: an operator sets cleanup.policy=compact,delete with a retention on the state
    topic during a run. The configs were read once at connect: retention then deleted old entries
    and the heads went on saying complete (51-89% of the blocks missing). Now the sink's audit
    reads them again while the stream is quiet: the head goes (a bootstrap is incomplete), the
    sink is not ready naming the fix and holds what comes meanwhile; once the topic is compacted
    only again, it goes on and the state starts again, incomplete."""
    monkeypatch.setattr("bridge.sink.AUDIT_INTERVAL", 0.3)
    monkeypatch.setattr("bridge.sink.HEALTH_INTERVAL", 0.3)
    topic = await kafka.anew_topic(partitions=1)
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"
    part = partition_of("a/0", 2)
    async with complete_state(tmp_path, kafka, topic, state_topic, 13) as (engine, bridge, before):
        await kafka.set_topic_configs(state_topic, {"cleanup.policy": "compact,delete", "retention.ms": "3600000"})
        deadline = time.monotonic() + 30
        # The head goes (a bootstrap finds no state: incomplete) and the sink is not ready.
        while await head_now(kafka, state_topic, part, "a/0") is not None or bridge.readiness()[0]:
            assert time.monotonic() < deadline, f"not seen while the stream is quiet: {bridge.readiness()}"
            await asyncio.sleep(0.2)
        problem = bridge.readiness()[1]["sinks"]["k"]
        assert repr(state_topic) in problem and "set cleanup.policy=compact" in problem, problem
        await engine.step(5)  # batches meanwhile: the sink holds them (their state may not be written)
        await kafka.set_topic_configs(state_topic, {"cleanup.policy": "compact"})
        after = await head_at(kafka, state_topic, part, engine)
        assert not after["complete"] and after["gen"] > before["gen"], (before, after)
        deadline = time.monotonic() + 30
        while not bridge.readiness()[0]:
            assert time.monotonic() < deadline, f"not ready again once fixed: {bridge.readiness()}"
            await asyncio.sleep(0.2)


async def delete_all_but_the_head(kafka: KafkaServer, tp: TopicPartition) -> None:
    """DeleteRecords of every record of state partition ``tp`` but its last (the head)."""
    await delete_records(kafka.bootstrap_servers, tp, keep=1)


async def test_records_deleted_from_a_state_partitions_start_tell_its_streams_state_lost(
    tmp_path: Path, kafka: KafkaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 K4, the start offset: DeleteRecords (or a retention run between two audits) takes
    records from the start of a state partition whose configs delete nothing (compact,delete
    without a retention limit: accepted). Every record but the head goes: a bootstrap would say
    complete over nothing. The audit finds the partition's start offset moved: the head goes,
    the state starts again, incomplete."""
    monkeypatch.setattr("bridge.sink.AUDIT_INTERVAL", 0.3)
    topic = await kafka.anew_topic(partitions=1)
    unlimited = {"cleanup.policy": "compact,delete", "retention.ms": "-1", "retention.bytes": "-1"}
    state_topic = await kafka.anew_topic(partitions=2, config=unlimited)
    part = partition_of("a/0", 2)
    async with complete_state(tmp_path, kafka, topic, state_topic, 14) as (engine, bridge, before):
        tp = TopicPartition(state_topic, part)
        await delete_all_but_the_head(kafka, tp)
        deadline = time.monotonic() + 30
        while await head_now(kafka, state_topic, part, "a/0") is not None:  # a bootstrap: no state, incomplete
            assert time.monotonic() < deadline, "the head that lost its entries still stands"
            await asyncio.sleep(0.2)
        await engine.step(3)
        after = await head_at(kafka, state_topic, part, engine)
        assert not after["complete"] and after["gen"] > before["gen"], (before, after)
        assert bridge.readiness()[0], bridge.readiness()


async def test_records_deleted_from_a_state_partition_while_no_bridge_runs_leave_no_state_complete(
    tmp_path: Path, kafka: KafkaServer
) -> None:
    """The same deletion while the bridge is down (a retention run, DeleteRecords): the audit's
    start offset is read afresh by the next process, which rebuilt from what was left and went on
    writing heads marked complete (breaker30r2 R1: 76-91 blocks missing, 4 of 4 runs). The head
    counts its live entries: a consumer's bootstrap finds fewer and says incomplete, and the
    restarted bridge starts the stream again (incomplete) instead of rebuilding it."""
    topic = await kafka.anew_topic(partitions=1)
    unlimited = {"cleanup.policy": "compact,delete", "retention.ms": "-1", "retention.bytes": "-1"}
    state_topic = await kafka.anew_topic(partitions=2, config=unlimited)
    part = partition_of("a/0", 2)
    tp = TopicPartition(state_topic, part)
    live, replay = free_port(), free_port()
    raw = quiet_audit_config(tmp_path, kafka, topic, state_topic, live, replay)
    config = from_data({**raw, "checkpoint": {"path": str(tmp_path / "ck.json")}}, env={})  # resumed in its epoch
    async with CacheEngine(live, replay, seed=15) as engine:  # one engine instance throughout
        bridge = Bridge(config)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(20)
            await delivered(bridge, {"a": engine})
            before = await head_at(kafka, state_topic, part, engine)
            assert before["complete"]
        finally:
            await bridge.stop()
        await delete_all_but_the_head(kafka, tp)
        follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
        try:
            assert not follower.state.complete, "bootstrapped complete over a head whose entries are gone"
            assert "the sink holds 0 entries where the head counts" in follower.state.why, follower.state.why
        finally:
            await follower.close()
        bridge = Bridge(config)
        await bridge.start()
        try:
            await engine.step(3)
            after = await head_at(kafka, state_topic, part, engine)
            assert after["epoch"] == before["epoch"], (before, after)
            assert not after["complete"] and after["gen"] > before["gen"], (before, after)
        finally:
            await bridge.stop()


async def test_an_events_topic_deleted_during_a_run_is_created_with_its_settings_and_the_loss_announced(
    tmp_path: Path, kafka: KafkaServer
) -> None:
    # aiokafka's metadata refreshes let the broker auto-create the deleted events topic with its
    # defaults (1 partition, the default retention) even with allow_auto_create_topics false; the
    # sink wrote on, and nothing told consumers that what the old topic held is gone. With
    # create_topics it comes back as configured, with an EventsLost for what it held, and the
    # stream's state is cleared (incomplete).
    topic = f"kvb-events-{uuid.uuid4().hex[:12]}"
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"
    live, replay = free_port(), free_port()
    created = {"enabled": True, "partitions": 3, "configs": {"retention.ms": "7200000"}}
    config = {
        "sources": [source("a", live, replay)],
        "sinks": [sink(kafka, topic, state_topic, request_timeout="2s", create_topics=created, allow_auto_create_topics=False)],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    part = partition_of("a/0", 2)
    async with CacheEngine(live, replay, seed=9) as engine:
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(10)
            deadline = time.monotonic() + 30
            while (head := await last_head(kafka.bootstrap_servers, state_topic, part, "a/0")) is None or head[
                "seq"
            ] != engine.last_seq:  # every batch so far acknowledged, with its state
                assert time.monotonic() < deadline, f"the state did not reach seq {engine.last_seq}: {head}"
                await asyncio.sleep(0.2)
            acked = engine.last_seq
            await delete_topic(kafka, topic)
            deadline = time.monotonic() + 60
            while not await topic_exists(kafka, topic):  # one more batch at a time until it is back
                assert time.monotonic() < deadline, "the events topic did not come back"
                await engine.step(1)
                await asyncio.sleep(0.3)
            configs = await kafka.topic_configs(topic)
            admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
            await admin.start()
            try:
                (described,) = await admin.describe_topics([topic])
            finally:
                await admin.close()
            print("events topic after the deletion:", configs["retention.ms"], len(described["partitions"]), "partitions")
            assert (configs["retention.ms"], len(described["partitions"])) == ("7200000", 3)
            await engine.step(1)
            head = None
            while head is None or head["seq"] != engine.last_seq:
                assert time.monotonic() < deadline, f"the state did not reach seq {engine.last_seq}: {head}"
                await asyncio.sleep(0.3)
                head = await last_head(kafka.bootstrap_servers, state_topic, part, "a/0")
            events = TopicPartition(topic, partition_of("a/0", 3))
            docs = [json.loads(v) for k, v in await read_partition(kafka.bootstrap_servers, events) if k == b"a/0" and v]
            lost = [(d["from_seq"], d["to_seq"], d["reason"]) for d in docs if d["type"] == "EventsLost"]
            print("EventsLost in the new topic:", lost, "head", head)
            assert lost[:1] == [(0, acked, "sink_lost:k")]
            assert docs[0]["type"] == "EventsLost"  # ahead of everything the new topic holds of the stream
            assert not head["complete"]
            follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
            try:
                await follower.catch_up(head["epoch"], head["seq"])
                assert not follower.state.complete
            finally:
                await follower.close()
        finally:
            await bridge.stop()


# -- engine snapshots (experimental) ------------------------------------------------------------------


@pytest.mark.parametrize("design", ["vllm-57789", "vllm-50134"])
async def test_a_stream_met_mid_epoch_is_seeded_from_an_engine_snapshot(tmp_path: Path, kafka: KafkaServer, design: str) -> None:
    """The scenario of tests/support/snapshots.py on Kafka: after every step a consumer bootstraps
    from the state topic, follows the events topic, and bootstraps again where it meets a
    StateSeeded record (the state it followed from was older than the seed)."""
    topic = await kafka.anew_topic(partitions=2)
    state_topic = f"kvb-state-{uuid.uuid4().hex[:12]}"
    live, replay, snap = free_port(), free_port(), free_port()
    port = None if design == "vllm-50134" else snap
    config = {
        "sources": [snapshot_source("a", live, replay, design, port)],
        "sinks": [sink(kafka, topic, state_topic)],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
    }
    async with CacheEngine(live, replay, seed=5, buffer_steps=4, snapshot=design, snapshot_port=port) as engine:  # type: ignore[arg-type]
        engine.snapshot_gate = asyncio.Event()
        await engine.step(10)
        bridge = Bridge(from_data(config, env={}))
        await bridge.start()
        rebootstraps = 0
        try:

            async def state() -> StreamState:
                nonlocal rebootstraps
                at = (await delivered(bridge, {"a": engine}))["a/0"]
                for _ in range(5):
                    follower = await Follower.start(kafka.bootstrap_servers, "a", 0, topic=topic, state_topic=state_topic)
                    try:
                        await follower.catch_up(*at)
                    finally:
                        await follower.close()
                    if not follower.state.rebootstrap:
                        return follower.state
                    rebootstraps += 1
                raise AssertionError("told to bootstrap again five times in a row")

            await seeded_mid_epoch_and_after_a_loss(bridge, engine, "a/0", state, truth)
            assert bridge.metrics.snapshots.labels("a", "seeded")._value.get() == 2
        finally:
            await bridge.stop()
