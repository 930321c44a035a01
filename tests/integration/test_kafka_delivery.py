"""The Kafka sink under the runtime's delivery loop (bridge.sink.SinkWorker) on a real broker.

What the delivery contract (bridge/connector.py) promises when part of a write fails: a batch the
topic refuses never lets a later batch of its partition be stored first; a message refused for
itself is dead-lettered alone and its neighbours are delivered; an authorization an operator can
fix is retried (the sink not ready meanwhile), never dead-lettered. Read back with aiokafka's
consumer: the first copy of each (stream, epoch, seq, index) in order per stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import CreateAclsRequest, DeleteAclsRequest

from bridge import config
from bridge.config import SinkConfig
from bridge.deadletter import DeadLetters
from bridge.errors import NotConnected
from bridge.formats import Renderer
from bridge.metrics import Metrics
from bridge.records import Record, Stream
from bridge.sink import SinkWorker
from connectors.kafka import KafkaConnector, KafkaOptions
from tests.infra.servers import KafkaServer, ServerError
from tests.integration.conftest import unavailable
from tests.integration.test_cli_errors import check_config
from tests.support.harness import free_ports
from tests.support.readback import CONTROL, read_kafka

pytestmark = pytest.mark.integration

USER, PASSWORD = "bridge", "acl-test-Pa55word"


def record(stream: Stream, seq: int, size: int) -> Record:
    """An engine batch whose raw payload is ``size`` bytes (the raw format sends it as is)."""
    payload = (f"{stream.key}/{seq}:".encode() + b"x" * size)[:size]
    return Record(stream=stream, epoch=0, seq=seq, ts=1_700_000_000.0 + seq, payload=payload, event_count=1)


@asynccontextmanager
async def sink_worker(tmp: Path, options: dict[str, Any], **sink: Any) -> AsyncIterator[tuple[SinkWorker, KafkaConnector]]:
    """A started SinkWorker (the runtime's delivery loop) writing to a Kafka connector."""
    cfg = config.convert(
        {
            "type": "kafka",
            "name": "kafka-delivery",
            "format": "raw",
            "batch": {"linger": 0, **sink.pop("batch", {})},
            "retry": {"initial_backoff": 0.05, "max_backoff": 0.5, "write_timeout": 30, **sink.pop("retry", {})},
            **sink,
        },
        SinkConfig,
        "sink",
        [],
    )
    assert cfg is not None
    kafka_options = config.convert_options({"request_timeout": "10s", **options}, KafkaOptions, "sinks[0]")
    connector = KafkaConnector(cfg.name, kafka_options, cfg)
    worker = SinkWorker(
        0, cfg, connector, Renderer(cfg.format, cfg.granularity), Metrics(), DeadLetters(str(tmp / "dead.jsonl")), lambda *_: None
    )
    worker.start()
    try:
        yield worker, connector
    finally:
        await worker.stop()
        worker.dead_letters.close()


async def offer(worker: SinkWorker, records: list[Record]) -> None:
    for r in records:
        while not worker.offer(r):
            await worker.wait_room()


def metric(worker: SinkWorker, name: str, **labels: str) -> float:
    return worker.metrics.registry.get_sample_value(name, {"sink": worker.name, **labels}) or 0.0


def dead_letters(tmp: Path) -> list[tuple[str, int, int]]:
    path = tmp / "dead.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(d["source"], d["dp_rank"], d["seq"]) for d in lines]


async def first_copies(bootstrap: str, topic: str, partitions: int) -> dict[int, list[int]]:
    """Per dp_rank, the seqs of the first copy of every batch, in stored order (what a consumer that
    deduplicates on the headers keeps); control records (announcements) are checked to stand where
    that consumer, ordering by position, keeps them, and left out."""
    seen: set[tuple[int, int, int, int, str]] = set()
    out: dict[int, list[int]] = {}
    last: dict[int, tuple[int, int, int]] = {}
    for rank, epoch, seq, index, type_ in (await read_kafka(bootstrap, topic, partitions)).rows:
        if (rank, epoch, seq, index, type_) in seen:
            continue
        seen.add((rank, epoch, seq, index, type_))
        position = (epoch, seq, 2**64 if type_ == "EventsLost" else index)
        assert position > last.get(rank, (-1, -1, -1)), f"stream {rank}: {type_} at {position} after {last[rank]}"
        last[rank] = position
        if type_ not in CONTROL:
            out.setdefault(rank, []).append(seq)
    return out


async def announced(bootstrap: str, topic: str, partitions: int) -> list[tuple[int, int, int, str]]:
    """The EventsLost records stored: (dp_rank, from_seq, to_seq, reason), first copies."""
    return list(dict.fromkeys((await read_kafka(bootstrap, topic, partitions)).lost))


async def copies(bootstrap: str, topic: str, partitions: int) -> int:
    return len((await read_kafka(bootstrap, topic, partitions)).rows)


async def until(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# -- a batch the topic refuses ----------------------------------------------------------------------


async def test_refused_multi_record_batch_keeps_order_and_dead_letters_only_the_oversized_message(
    kafka: KafkaServer, tmp_path: Path
) -> None:
    # The case: the topic takes 6000 bytes per batch; the runtime writes 8 KiB at a time,
    # and the connector's batches (7 KiB) hold several ~900-byte messages, so the first write of
    # a new producer makes two batches for the partition and the topic refuses the first.
    topic = await kafka.anew_topic(config={"max.message.bytes": "6000"})
    stream = Stream("llama-a", 0)
    oversized = 12  # larger than max.message.bytes, smaller than max_batch_bytes: refused by the broker
    records = [record(stream, s, 6500 if s == oversized else 900) for s in range(30)]
    options = {"bootstrap_servers": kafka.bootstrap_servers, "topic": topic, "max_batch_bytes": "7KiB"}
    async with sink_worker(tmp_path, options, batch={"max_bytes": "8KiB"}) as (worker, _connector):
        await offer(worker, records)
        assert await worker.flush(120)
    assert dead_letters(tmp_path) == [("llama-a", 0, oversized)]
    assert await first_copies(kafka.bootstrap_servers, topic, 1) == {0: [s for s in range(30) if s != oversized]}
    # I6: the topic's consumers are told what they miss
    assert await announced(kafka.bootstrap_servers, topic, 1) == [(0, oversized, oversized, "sink_refused:kafka-delivery")]


# -- a partial failure in the middle of a write ------------------------------------------------------


async def test_one_message_refused_mid_write_others_stored_once_in_order(kafka: KafkaServer, tmp_path: Path) -> None:
    # Three streams on two partitions (so two of them share one), written together; one message
    # of one stream, in the middle of the first write, is larger than the topic accepts.
    topic = await kafka.anew_topic(partitions=2, config={"max.message.bytes": "6000"})
    streams = [Stream("llama-a", rank) for rank in range(3)]
    refused = (1, 3)  # (dp_rank, seq)
    # Interleaved, as the engines publish.
    records = [record(s, seq, 6500 if (s.dp_rank, seq) == refused else 800) for seq in range(12) for s in streams]
    options = {"bootstrap_servers": kafka.bootstrap_servers, "topic": topic, "max_batch_bytes": "7KiB"}
    async with sink_worker(tmp_path, options, batch={"max_bytes": "24KiB"}) as (worker, _connector):
        await offer(worker, records)
        assert await worker.flush(120)
    assert dead_letters(tmp_path) == [("llama-a", 1, 3)]
    expected = {s.dp_rank: [seq for seq in range(12) if (s.dp_rank, seq) != refused] for s in streams}
    assert await first_copies(kafka.bootstrap_servers, topic, 2) == expected
    # I6: the refused batch is announced, once
    assert await announced(kafka.bootstrap_servers, topic, 2) == [(1, 3, 3, "sink_refused:kafka-delivery")]
    # Nothing of a stream was stored after a failed message of it in the same write: no copies
    # (the records but the refused one, and its announcement).
    assert await copies(kafka.bootstrap_servers, topic, 2) == len(records)


async def test_an_announcement_refused_by_a_lowered_topic_limit_is_kept_until_the_limit_is_set_back(
    kafka: KafkaServer, tmp_path: Path
) -> None:
    """Issue 29 (breaker29h W4): seqs 0-1 stored; an operator lowers the topic's max.message.bytes
    to 100; seqs 2-3 were refused for themselves (dead-lettered), and so was the EventsLost
    announcing them. The connector remembered each refused message and refused it again without
    sending it, so the announcement was never stored, even after the limit was set back. Now the
    announcement is kept and sent again each time, the sink not ready meanwhile, and stored once
    the limit is back; seq 3, which waits behind it (bridge/connector.py), is stored after it."""

    async def limit(value: int) -> None:
        await kafka.set_topic_configs(topic, {"max.message.bytes": str(value)})

    topic = await kafka.anew_topic(partitions=1)
    stream = Stream("llama-a", 0)
    records = [record(stream, seq, 400) for seq in range(5)]
    options = {"bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    async with sink_worker(tmp_path, options) as (worker, _connector):
        await offer(worker, records[:2])
        assert await worker.flush(60)
        await limit(100)
        await offer(worker, records[2:4])
        await until(lambda: len(dead_letters(tmp_path)) == 1, "seq 2 dead-lettered")
        await until(lambda: not worker.connected and "announcement" in str(worker.last_error), "the kept announcement named")
        await limit(1_048_588)  # the operator sets the limit back
        await offer(worker, records[4:])
        assert await worker.flush(120)
        assert worker.connected
    assert dead_letters(tmp_path) == [("llama-a", 0, 2)]
    spans = await announced(kafka.bootstrap_servers, topic, 1)
    assert [(a, b, reason) for _, a, b, reason in spans] == [(2, 2, "sink_refused:kafka-delivery")], spans
    assert await first_copies(kafka.bootstrap_servers, topic, 1) == {0: [0, 1, 3, 4]}


# -- authorization revoked while running -------------------------------------------------------------

# Kafka's ACL protocol values (org.apache.kafka.common.acl / resource).
TOPIC, CLUSTER = 2, 4
LITERAL = 3
ALL, WRITE, DESCRIBE_CONFIGS, IDEMPOTENT_WRITE = 2, 4, 10, 12
DENY, ALLOW = 2, 3


@pytest.fixture(scope="module")
def acl_kafka(infra_run_dir: Path) -> Iterator[KafkaServer]:
    """A broker of this module's own with an authorizer: the bridge logs in as User:bridge over
    SASL_PLAINTEXT (PLAIN) and may do anything to topics; the PLAINTEXT and controller listeners'
    principal (User:ANONYMOUS: the broker itself, the tests' admin client and reader) is a super user."""
    jaas = f'org.apache.kafka.common.security.plain.PlainLoginModule required user_{USER}="{PASSWORD}";'
    for attempt in range(2):  # a second try on other free ports: another process may take one first
        server = KafkaServer(
            infra_run_dir / f"kafka-acl-{attempt}",
            listeners={"SASL_PLAINTEXT": "SASL_PLAINTEXT"},
            extra_properties={
                "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                "super.users": "User:ANONYMOUS",
                "sasl.enabled.mechanisms": "PLAIN",
                "listener.name.sasl_plaintext.plain.sasl.jaas.config": jaas,
            },
        )
        try:
            server.start()
            break
        except ServerError as exc:
            server.kill()
            failure = exc
    else:
        unavailable("kafka with an authorizer", failure)
    try:
        asyncio.run(acl(server, "create", TOPIC, "*", ALL, ALLOW))
        asyncio.run(acl(server, "create", CLUSTER, "kafka-cluster", IDEMPOTENT_WRITE, ALLOW))
        yield server
    finally:
        server.remove()


async def acl(server: KafkaServer, action: str, resource: int, name: str, operation: int, permission: int) -> None:
    """Create or delete one ACL for User:bridge (through the super user's PLAINTEXT listener)."""
    request_type = CreateAclsRequest if action == "create" else DeleteAclsRequest
    request = request_type(resource, name, LITERAL, f"User:{USER}", "*", operation, permission)
    admin = AIOKafkaAdminClient(bootstrap_servers=server.bootstrap_servers)
    await admin.start()
    try:
        response = await admin._send_request(request)  # aiokafka's admin client has no ACL methods
    finally:
        await admin.close()
    results = response.creation_responses if action == "create" else response.filter_responses
    assert all(r[0] == 0 for r in results), response


def bridge_sink(server: KafkaServer, events: str, state_topic: str) -> dict[str, Any]:
    """The options of a sink logging in as User:bridge, writing ``events`` and its state to ``state_topic``."""
    return {
        "bootstrap_servers": f"127.0.0.1:{server.ports['SASL_PLAINTEXT']}",
        "topic": events,
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_username": USER,
        "sasl_password": PASSWORD,
        "request_timeout": "10s",
        "state": {"enabled": True, "topic": state_topic},
    }


async def connect_as_bridge(
    server: KafkaServer, events: str, state_topic: str, *, check: bool
) -> tuple[NotConnected | None, str | None]:
    """connect() (as ``--check`` does with ``check``: creating nothing) of a :func:`bridge_sink`
    connector: why it was refused, and what health() says then."""
    values = bridge_sink(server, events, state_topic)
    conn = KafkaConnector("k", config.convert_options(values, KafkaOptions, "sinks[0]"), SinkConfig(type="kafka", name="k"))
    conn.creates_nothing = check
    refused = None
    try:
        await conn.connect()
    except NotConnected as exc:
        refused = exc
    try:
        return refused, await conn.health()
    finally:
        await conn.close()


async def test_topic_authorization_revoked_mid_stream_is_retried_never_dead_lettered(
    acl_kafka: KafkaServer, tmp_path: Path
) -> None:
    topic = await acl_kafka.anew_topic()
    stream = Stream("llama-a", 0)
    options = {
        "bootstrap_servers": f"127.0.0.1:{acl_kafka.ports['SASL_PLAINTEXT']}",
        "topic": topic,
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_username": USER,
        "sasl_password": PASSWORD,
    }
    published = 0

    async def publish(worker: SinkWorker, n: int) -> None:
        nonlocal published
        await offer(worker, [record(stream, s, 300) for s in range(published, published + n)])
        published += n

    async with sink_worker(tmp_path, options) as (worker, connector):
        await publish(worker, 10)
        assert await worker.flush(60)
        await acl(acl_kafka, "create", TOPIC, topic, WRITE, DENY)
        try:
            # The broker applies the ACL shortly after the controller took it: publish until a
            # write is refused for it.
            deadline = time.monotonic() + 60
            while not metric(worker, "kv_bridge_sink_errors_total", reason="unauthorized"):
                assert time.monotonic() < deadline, "the DENY ACL never took effect"
                await publish(worker, 5)
                await asyncio.sleep(0.1)
            assert metric(worker, "kv_bridge_sink_batches_total", outcome="dead_lettered") == 0
            await until(lambda: metric(worker, "kv_bridge_sink_retries_total") >= 5, "retries while unauthorized")
            assert metric(worker, "kv_bridge_sink_batches_total", outcome="dead_lettered") == 0
            assert not worker.connected and "unauthorized" in (worker.last_error or "")
            assert "not authorized" in (await connector.health() or "")
            assert worker.queued[0] > 0  # held, not acknowledged
        finally:
            await acl(acl_kafka, "delete", TOPIC, topic, WRITE, DENY)
        await publish(worker, 5)
        assert await worker.flush(60)
        assert worker.connected and await connector.health() is None
    assert dead_letters(tmp_path) == []
    assert await first_copies(acl_kafka.bootstrap_servers, topic, 1) == {0: list(range(published))}


async def test_a_state_topic_whose_configs_cannot_be_read_is_refused_naming_the_acl_to_add(acl_kafka: KafkaServer) -> None:
    """breaker30r K2: with Write, Describe and Read on the topics (no DescribeConfigs), the broker
    answers DescribeConfigs on the state topic with TOPIC_AUTHORIZATION_FAILED inside the response.
    The sink read that as no configs, so a state topic deleting by retention was accepted (connect,
    --check, /readyz) and bootstraps took what retention left for a complete state (I6). A state
    topic whose configs cannot be read is now refused like one that deletes, at connect, by
    --check (creates_nothing) and by health(), naming the ACL to add; once granted, the configs
    decide again."""
    events = await acl_kafka.anew_topic()
    deleting = await acl_kafka.anew_topic(config={"cleanup.policy": "compact,delete", "retention.ms": "3600000"})
    compacted = await acl_kafka.anew_topic(config={"cleanup.policy": "compact"})

    async def connect(state_topic: str, *, check: bool) -> tuple[NotConnected | None, str | None]:
        return await connect_as_bridge(acl_kafka, events, state_topic, check=check)

    for topic in (deleting, compacted):
        await acl(acl_kafka, "create", TOPIC, topic, DESCRIBE_CONFIGS, DENY)
    try:
        for topic in (deleting, compacted):
            for check in (True, False):
                # The broker applies the ACL shortly after the controller took it.
                deadline = time.monotonic() + 60
                while (result := await connect(topic, check=check))[0] is None or result[0].reason != "unauthorized":
                    assert result[0] is None or result[0].reason == "state_topic_deletes", result
                    assert time.monotonic() < deadline, f"{topic} with DescribeConfigs denied was not refused: {result}"
                    await asyncio.sleep(0.2)
                refused, problem = result
                assert refused is not None and repr(topic) in str(refused)
                assert "TopicAuthorizationFailedError" in str(refused), refused
                fix = f"--allow-principal User:{USER} --operation DescribeConfigs --topic {topic}"
                assert fix in str(refused) and problem is not None and fix in problem, (refused, problem)
    finally:
        for topic in (deleting, compacted):
            await acl(acl_kafka, "delete", TOPIC, topic, DESCRIBE_CONFIGS, DENY)
    deadline = time.monotonic() + 60
    while (result := await connect(compacted, check=True)) != (None, None):
        assert time.monotonic() < deadline, f"{compacted} still refused with DescribeConfigs granted: {result}"
        await asyncio.sleep(0.2)
    assert await connect(compacted, check=False) == (None, None)
    refused, problem = await connect(deleting, check=True)
    assert refused is not None and refused.reason == "state_topic_deletes", refused
    assert problem is not None and "set cleanup.policy=compact" in problem


async def test_an_events_topic_whose_policy_cannot_be_read_is_used_and_that_said_once(
    acl_kafka: KafkaServer, caplog: pytest.LogCaptureFixture
) -> None:
    """breaker57 B3: a log-compacted events topic is refused (its cleanup.policy read at connect).
    An events topic needs no DescribeConfigs ACL: one the broker will not describe is used all
    the same, and that the sink cannot tell is logged once, at info; once it may read the policy,
    a compacted one is refused."""
    compacted = await acl_kafka.anew_topic(config={"cleanup.policy": "compact"})
    values = {k: v for k, v in bridge_sink(acl_kafka, compacted, "unused").items() if k != "state"}

    async def connect() -> NotConnected | None:
        conn = KafkaConnector("k", config.convert_options(values, KafkaOptions, "sinks[0]"), SinkConfig(type="kafka", name="k"))
        try:
            await conn.connect()
            await conn.connect()  # said once per sink
        except NotConnected as exc:
            return exc
        finally:
            await conn.close()
        return None

    refused = await connect()
    assert refused is not None and refused.reason == "events_topic_compacted", refused
    await acl(acl_kafka, "create", TOPIC, compacted, DESCRIBE_CONFIGS, DENY)
    try:
        deadline = time.monotonic() + 60  # the broker applies the ACL shortly after the controller took it
        with caplog.at_level(logging.INFO, logger="connectors.kafka"):
            while (refused := await connect()) is not None:
                assert refused.reason == "events_topic_compacted", refused
                assert time.monotonic() < deadline, "DescribeConfigs denied never took effect"
                await asyncio.sleep(0.2)
        told = [r.getMessage() for r in caplog.records if "cannot read the events topics' cleanup.policy" in r.getMessage()]
        assert len(told) == 1 and "TopicAuthorizationFailedError" in told[0], told
    finally:
        await acl(acl_kafka, "delete", TOPIC, compacted, DESCRIBE_CONFIGS, DENY)
    deadline = time.monotonic() + 60
    while (refused := await connect()) is None:
        assert time.monotonic() < deadline, "DescribeConfigs granted again never took effect"
        await asyncio.sleep(0.2)
    assert refused.reason == "events_topic_compacted", refused


@pytest.mark.parametrize("denied", ["events", "state"])
async def test_a_topic_the_principal_may_not_write_is_refused_at_connect_and_by_check(
    acl_kafka: KafkaServer, tmp_path: Path, denied: str
) -> None:
    """breaker30r2 K1: with Write denied on the events topic, or on the state topic only, connect
    and ``--check`` only described the topics: "config ok", ready, then every write refused
    (``unauthorized``) for ever. The broker says which operations the principal may do on a topic
    (Metadata v8, KIP-430), which writes nothing: connect refuses (``unauthorized``, /readyz and
    ``--check`` exit 3) naming the topic and the ACL to add; once granted, both pass."""
    events = await acl_kafka.anew_topic()
    state_topic = await acl_kafka.anew_topic(config={"cleanup.policy": "compact"})
    topic = events if denied == "events" else state_topic
    cfg = {
        "sources": [{"name": "a", "endpoint": f"tcp://127.0.0.1:{free_ports(1)[0]}", "bind": True}],
        "sinks": [{"type": "kafka", "name": "k", **bridge_sink(acl_kafka, events, state_topic)}],
        "checkpoint": {"path": str(tmp_path / "checkpoint.json")},
    }
    fix = f"kafka-acls --add --allow-principal User:{USER} --operation Write --topic {topic}"
    await acl(acl_kafka, "create", TOPIC, topic, WRITE, DENY)
    try:
        for check in (False, True):
            # The broker applies the ACL shortly after the controller took it.
            deadline = time.monotonic() + 60
            while (result := await connect_as_bridge(acl_kafka, events, state_topic, check=check))[0] is None:
                assert time.monotonic() < deadline, f"{topic} with Write denied was not refused: {result}"
                await asyncio.sleep(0.2)
            refused, problem = result
            assert refused is not None and refused.reason == "unauthorized", refused
            assert fix in str(refused) and problem is not None and fix in problem, (refused, problem)
        proc = await check_config(tmp_path, cfg)
        assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        assert "sinks[0] (k): reachable, not usable as configured" in proc.stdout, proc.stdout + proc.stderr
        assert fix in proc.stderr, proc.stderr
    finally:
        await acl(acl_kafka, "delete", TOPIC, topic, WRITE, DENY)
    deadline = time.monotonic() + 60
    while (result := await connect_as_bridge(acl_kafka, events, state_topic, check=True)) != (None, None):
        assert time.monotonic() < deadline, f"{topic} still refused with Write granted: {result}"
        await asyncio.sleep(0.2)
    proc = await check_config(tmp_path, cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert await copies(acl_kafka.bootstrap_servers, events, 1) == 0  # nothing written by any of it
