"""The aiokafka internals the Kafka sink relies on (connectors/_aiokafka_internals.py) are still
there, with the shapes it uses: this fails loudly when an aiokafka upgrade changes them."""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib
from pathlib import Path
from typing import Any

import aiokafka
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.errors import KafkaConnectionError
from aiokafka.producer.message_accumulator import MessageBatch
from aiokafka.protocol.metadata import MetadataRequest

from connectors import _aiokafka_internals as internals

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_aiokafka_is_within_the_pinned_range() -> None:
    """The quarantine module was checked against the minor the pin allows, and only that one."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("aiokafka")]
    upper = re.search(r"<\s*(\d+)\.(\d+)", spec)
    assert upper, f"aiokafka has no upper bound in pyproject.toml: {spec}"
    installed = tuple(int(x) for x in aiokafka.__version__.split(".")[:2])
    assert installed < (int(upper.group(1)), int(upper.group(2))), (aiokafka.__version__, spec)
    assert installed >= (int(upper.group(1)), int(upper.group(2)) - 1), f"re-check the internals for {aiokafka.__version__}"


def test_client_internals_keep_their_shape() -> None:
    assert list(inspect.signature(AIOKafkaClient._metadata_update).parameters) == ["self", "cluster_metadata", "topics"]
    assert inspect.iscoroutinefunction(AIOKafkaClient._metadata_update)
    assert inspect.iscoroutinefunction(AIOKafkaClient.send)
    assert callable(AIOKafkaClient.get_random_node)
    request = MetadataRequest(["t"], allow_auto_topic_creation=False)
    assert request.API_KEY == 3
    assert list(inspect.signature(internals.record_size).parameters) == ["key", "value", "headers"]
    assert collect_hosts(["k1:9093", "k2"], randomize=False)[0][:2] == ("k1", 9093)
    parameters = inspect.signature(create_conn).parameters
    for name in ("client_id", "request_timeout_ms", "ssl_context", "security_protocol", "sasl_mechanism"):
        assert name in parameters, name
    assert "sasl_plain_username" in parameters and "sasl_plain_password" in parameters
    assert internals.record_size(b"k", b"v" * 100, [("h", b"x")]) > 100


async def test_no_auto_create_sends_aiokafkas_metadata_requests_without_auto_creation() -> None:
    # It runs aiokafka's own _metadata_update with another MetadataRequest: that method must
    # still build its request from the module-level name.
    assert "MetadataRequest" in AIOKafkaClient._metadata_update.__code__.co_names
    assert not AIOKafkaClient._metadata_update.__code__.co_freevars
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
    internals.no_auto_create(producer.client)
    sent: list[Any] = []

    class Conn:
        async def send(self, request: Any) -> Any:
            sent.append(request)
            raise KafkaConnectionError("no broker")

    async def get_conn(node_id: Any) -> Conn:
        return Conn()

    producer.client._get_conn = get_conn
    producer.client._conns[("bootstrap", 0)] = object()  # one node to ask
    try:
        assert await producer.client._metadata_update(producer.client.cluster, {"t"}) is False
    finally:
        producer.client._conns.clear()
        await producer.stop()
    (request,) = sent
    assert isinstance(request, MetadataRequest) and request._topics == ["t"]
    assert request._allow_auto_topic_creation is False


async def test_pace_metadata_retries_waits_after_a_failed_update(monkeypatch: pytest.MonkeyPatch) -> None:
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
    answers = [False, True]
    calls: list[tuple[Any, Any]] = []

    async def update(cluster_metadata: Any, topics: Any) -> bool:
        calls.append((cluster_metadata, topics))
        return answers.pop(0)

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(producer.client, "_metadata_update", update)
    monkeypatch.setattr(internals.asyncio, "sleep", sleep)
    internals.pace_metadata_retries(producer.client, 0.5)
    assert await producer.client._metadata_update("md", {"t"}) is False
    assert await producer.client._metadata_update("md", None) is True
    assert calls == [("md", {"t"}), ("md", None)] and slept == [0.5]
    await producer.stop()


async def test_fail_pending_fails_queued_and_retried_batches_and_stop_returns() -> None:
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
    loop_errors: list[dict[str, Any]] = []  # e.g. a KeyError in a batch's done-callback
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: loop_errors.append(context))
    try:
        accumulator = producer._message_accumulator
        futures = []
        for partition in (0, 1, 2):
            builder = producer.create_batch()
            assert builder.append(timestamp=None, key=b"k", value=b"v", headers=[]) is not None
            futures.append(await accumulator.add_batch(builder, TopicPartition("t", partition), 1.0))
        # Batch 1 in flight (drained by the sender); batch 2 as the sender leaves one after a
        # retriable error: drained, then put back in the queue.
        in_flight = accumulator._pop_batch(TopicPartition("t", 1))
        (retried,) = accumulator._batches[TopicPartition("t", 2)]
        assert isinstance(in_flight, MessageBatch) and isinstance(retried, MessageBatch)
        accumulator._pop_batch(TopicPartition("t", 2))
        accumulator.reenqueue(retried)
        assert retried.retry_count == 1 and retried not in accumulator._pending_batches
        assert in_flight in accumulator._pending_batches

        internals.fail_pending(producer, KafkaConnectionError("discarded"))
        for future in futures:
            with pytest.raises(KafkaConnectionError, match="discarded"):
                await future
        await asyncio.sleep(0)  # let the batches' done-callbacks run
        assert loop_errors == []
    finally:
        await asyncio.wait_for(producer.stop(), 5)


async def test_probe_reports_why_a_server_cannot_be_reached() -> None:
    from tests.infra.servers import free_port

    settings = {
        "bootstrap_servers": [f"127.0.0.1:{free_port()}"],
        "client_id": "t",
        "request_timeout_ms": 2000,
        "security_protocol": "PLAINTEXT",
    }
    with pytest.raises(ConnectionRefusedError):
        await internals.probe(settings, None)


@pytest.mark.parametrize(("newest", "version"), [(12, 8), (7, 5), (2, 2)])
async def test_topic_error_asks_for_the_authorized_operations_only_of_a_broker_speaking_v8(newest: int, version: int) -> None:
    """Metadata v8 (KIP-430) tells which operations the principal may do on the topic; an older
    broker (aiokafka's v0-v5, the newest its versions allow) cannot say: None, nothing refused."""
    sent: list[Any] = []

    class Client:
        def get_random_node(self) -> int:
            return 0

        async def send(self, node: int, request: Any) -> Any:
            struct = request.prepare({3: (0, newest)})  # as aiokafka's connection picks the version
            sent.append(struct)
            topics = [(0, "t", False, [], 1 << internals.WRITE | 1 << 8)] if struct.API_VERSION >= 8 else [(0, "t", False, [])]
            fields = {"topics": topics, "brokers": [], "cluster_id": None, "controller_id": 0, "throttle_time_ms": 0}
            fields["cluster_authorized_operations"] = 0
            response = struct.RESPONSE_TYPE
            return response.decode(response(*[fields[n] for n in response.SCHEMA.names]).encode())

    answer = await internals.topic_error(Client(), "t", allow_auto_create=False)
    (struct,) = sent
    sent_version = struct.API_VERSION
    assert sent_version == version
    if version >= 4:
        assert struct.allow_auto_topic_creation is False
    if version >= 8:
        assert struct.include_topic_authorized_operations is True
        assert answer is not None and answer[0] == 0 and answer[1] is not None
        assert internals.may(answer[1], internals.WRITE) and not internals.may(answer[1], 3)  # Write, not Read
    else:
        assert answer == (0, None)
