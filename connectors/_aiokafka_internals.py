"""Every aiokafka internal the Kafka sink relies on, in one place (tested on aiokafka 0.14).

aiokafka has no public API for these. Each function says why the sink needs it; nothing here
hides a failure: when an upgrade renames or removes something, the unit test
``tests/unit/test_kafka_internals.py`` fails (and so does the sink, loudly), and pyproject.toml
keeps aiokafka below the next minor until this module has been checked against it.
"""

from __future__ import annotations

import asyncio
import functools
import types
from typing import Any

from aiokafka import errors as kafka_errors
from aiokafka.client import AIOKafkaClient
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.protocol.admin import SaslHandShakeRequest
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.metadata import (
    MetadataRequest,
    MetadataRequest_v0,
    MetadataRequest_v1,
    MetadataRequest_v2,
    MetadataRequest_v3,
    MetadataRequest_v4,
    MetadataRequest_v5,
)
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String
from aiokafka.record.default_records import DefaultRecordBatchBuilder

# The exact size of one record in a batch (key, value, headers): checked only for messages
# close to max_batch_bytes, so a message too large for a batch is refused before it is sent.
record_size = DefaultRecordBatchBuilder.estimate_size_in_bytes


class InvalidRecordError(kafka_errors.UnknownError):  # type: ignore[misc]  # aiokafka is untyped here
    """Error code 87 (INVALID_RECORD): the broker refused a record itself (a compacted topic's
    record without a key, a broker-side validation).

    aiokafka has no class for it and raises :class:`~aiokafka.errors.UnknownError` for every code
    it does not know, the same as for -1 (UNKNOWN_SERVER_ERROR: an exception inside the broker,
    for an operator to fix). Registered under its code (a subclass of ``UnknownError``, so code
    that catches that still catches it), the sink can tell a refused record from a broken broker.
    """

    errno = 87
    message = "INVALID_RECORD"
    description = "This record has failed the validation on broker and hence will be rejected."


kafka_errors.kafka_errors.setdefault(InvalidRecordError.errno, InvalidRecordError)


def fail_pending(producer: Any, exc: BaseException) -> None:
    """Fail every batch ``producer`` holds, queued or in flight, so that ``stop()`` returns at once.

    aiokafka has no abort: ``stop()`` waits for every pending batch, and an idempotent batch is
    retried until the broker takes it. The writes waiting on these batches see ``exc``.
    """
    accumulator = producer._message_accumulator
    queued = [batch for queue in accumulator._batches.values() for batch in queue]
    # A batch re-queued for a retry is off the pending set, but its done-callback still removes
    # it from there: put it back, so that failing it does not raise KeyError in that callback.
    accumulator._pending_batches.update(batch for batch in queued if batch.retry_count > 0)
    batches = queued + list(accumulator._pending_batches)
    accumulator.fail_all(exc)
    for batch in batches:
        waiter = batch._drain_waiter  # nobody waits for the drain of a failed batch: mark it seen
        if waiter.done() and not waiter.cancelled():
            waiter.exception()


# aiokafka's own metadata update, in a namespace where MetadataRequest never lets the broker
# create the topics it names (see no_auto_create).
_update = AIOKafkaClient._metadata_update
_update_no_create = types.FunctionType(
    _update.__code__,
    {**_update.__globals__, "MetadataRequest": functools.partial(MetadataRequest, allow_auto_topic_creation=False)},
    _update.__name__,
    _update.__defaults__,
    _update.__closure__,
)


def no_auto_create(client: Any) -> None:
    """Make every metadata request ``client`` sends by itself say ``allow_auto_topic_creation=false``.

    aiokafka's requests (a producer's or consumer's periodic refresh, the refresh after a produce
    error, ``partitions_for``) always allow it: a topic deleted during a run comes back at once,
    created by the broker with its defaults (a state topic no longer compacted, one partition, the
    default retention), and the sink writes on into it as if nothing had been lost
    (``auto.create.topics.enable`` is on by default). This runs aiokafka's own
    ``_metadata_update`` with a request that forbids it. Metadata v0-v3 (brokers before 0.11)
    cannot say it.
    """
    client._metadata_update = types.MethodType(_update_no_create, client)


def pace_metadata_retries(client: Any, pause: float) -> None:
    """Pause ``pause`` seconds after a failed metadata update of ``client`` before the next one.

    When no broker answers, aiokafka's sender asks for metadata again as soon as an update
    fails, without backoff: a busy loop logging two errors per try, thousands per second
    (aio-libs/aiokafka#496).
    """
    update = client._metadata_update

    async def paced(cluster_metadata: Any, topics: Any) -> Any:
        ok = await update(cluster_metadata, topics)
        if not ok:
            await asyncio.sleep(pause)
        return ok

    client._metadata_update = paced


class _MetadataResponse_v8(Response):  # type: ignore[misc]  # aiokafka is untyped here
    """Metadata v8 (KIP-430): v5 with each partition's leader epoch (v7) and each topic's
    authorized operations, a bit field of ACL operation codes (v8). Not flexible (v9 is)."""

    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("brokers", Array(("node_id", Int32), ("host", String("utf-8")), ("port", Int32), ("rack", String("utf-8")))),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        (
            "topics",
            Array(
                ("error_code", Int16),
                ("topic", String("utf-8")),
                ("is_internal", Boolean),
                (
                    "partitions",
                    Array(
                        ("error_code", Int16),
                        ("partition", Int32),
                        ("leader", Int32),
                        ("leader_epoch", Int32),
                        ("replicas", Array(Int32)),
                        ("isr", Array(Int32)),
                        ("offline_replicas", Array(Int32)),
                    ),
                ),
                ("topic_authorized_operations", Int32),
            ),
        ),
        ("cluster_authorized_operations", Int32),
    )


class _MetadataRequest_v8(RequestStruct):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = _MetadataResponse_v8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))),
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


_MetadataStructs = (
    MetadataRequest_v0
    | MetadataRequest_v1
    | MetadataRequest_v2
    | MetadataRequest_v3
    | MetadataRequest_v4
    | MetadataRequest_v5
    | _MetadataRequest_v8
)


class _TopicMetadataRequest(Request[_MetadataStructs]):  # type: ignore[misc]
    """aiokafka's MetadataRequest (v0-v5), and v8 asking for each topic's authorized operations
    when the broker speaks it (aiokafka has no v6-v8: Kafka 2.3 and later answer v8)."""

    API_KEY = 3

    def __init__(self, topics: list[str], allow_auto_create: bool) -> None:
        self._topics = topics
        self._allow = allow_auto_create

    def build(self, request_struct_class: type[Any]) -> Any:
        if request_struct_class.API_VERSION >= 8:
            return request_struct_class(self._topics, self._allow, False, True)
        return MetadataRequest(self._topics, allow_auto_topic_creation=self._allow).build(request_struct_class)


# ACL operation codes (org.apache.kafka.common.acl.AclOperation): bits of authorized operations.
WRITE = 4
_OPERATIONS_UNKNOWN = -(2**31)  # what a broker answers when the operations were not asked for


async def topic_error(client: Any, topic: str, *, allow_auto_create: bool) -> tuple[int, int | None] | None:
    """The metadata error code of ``topic`` (0: usable) and the operations the client's principal
    may do on it (a bit per ACL operation code, see :func:`may`; None when the broker cannot say:
    before Kafka 2.3, or the topic has an error); None when no broker is known.

    Asks without auto-creating the topic unless allowed: aiokafka's own metadata requests
    always allow it. Reading the operations writes nothing, so ``--check`` can tell a principal
    that may not write the topic.
    """
    node = client.get_random_node()
    if node is None:
        return None
    response = await client.send(node, _TopicMetadataRequest([topic], allow_auto_create))
    for error_code, name, *rest in response.topics:
        if name == topic:
            operations = int(rest[-1]) if response.API_VERSION >= 8 and not error_code else _OPERATIONS_UNKNOWN
            return int(error_code), None if operations == _OPERATIONS_UNKNOWN else operations
    return None


def may(operations: int, operation: int) -> bool:
    """Whether the authorized ``operations`` (:func:`topic_error`) hold ``operation`` (e.g. WRITE)."""
    return bool(operations >> operation & 1)


async def ping(client: Any) -> bool:
    """Ask one broker for the (empty) cluster metadata; False when no broker is known."""
    node = client.get_random_node()
    if node is None:
        return False
    await client.send(node, MetadataRequest([]))
    return True


async def probe(settings: dict[str, Any], ssl_context: Any) -> str:
    """Open (and close) one connection to the first bootstrap server with the client's
    ``settings``; returns its ``host:port``. Raises what the connection attempt raises.

    aiokafka only logs why a bootstrap failed (``Unable to bootstrap from ...``): this finds the
    cause (refused, TLS, authentication) to report it.
    """
    host, port, conn = await _first_connection(
        settings,
        ssl_context,
        security_protocol=settings["security_protocol"],
        sasl_mechanism=settings.get("sasl_mechanism"),
        sasl_plain_username=settings.get("sasl_plain_username"),
        sasl_plain_password=settings.get("sasl_plain_password"),
    )
    conn.close()
    return f"{host}:{port}"


async def _first_connection(settings: dict[str, Any], ssl_context: Any, **security: Any) -> tuple[str, int, Any]:
    """A connection to the first bootstrap server with the client's id and timeout, and
    ``security`` (security_protocol and, for probe, the SASL settings): (host, port, connection)."""
    host, port, _family = collect_hosts(settings["bootstrap_servers"], randomize=False)[0]
    conn = await create_conn(
        host,
        port,
        client_id=settings["client_id"],
        request_timeout_ms=settings["request_timeout_ms"],
        ssl_context=ssl_context,
        **security,
    )
    return host, port, conn


async def sasl_mechanisms(settings: dict[str, Any], ssl_context: Any) -> list[str]:
    """The SASL mechanisms the first bootstrap server accepts: its answer to a SASL handshake for
    the configured mechanism, on a connection without SASL (TLS kept). aiokafka's
    ``UnsupportedSaslMechanismError`` names only the connection, so a mismatch could not name the
    fix without this. Raises what the connection or the request raises."""
    protocol = "SSL" if settings["security_protocol"].endswith("SSL") else "PLAINTEXT"
    _host, _port, conn = await _first_connection(settings, ssl_context, security_protocol=protocol)
    try:
        response = await conn.send(SaslHandShakeRequest(settings.get("sasl_mechanism") or "PLAIN"))
    finally:
        conn.close()
    return [str(m) for m in response.enabled_mechanisms]


__all__ = [
    "WRITE",
    "InvalidRecordError",
    "fail_pending",
    "may",
    "no_auto_create",
    "pace_metadata_retries",
    "ping",
    "probe",
    "record_size",
    "sasl_mechanisms",
    "topic_error",
]
