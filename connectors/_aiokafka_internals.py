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
from aiokafka.protocol.metadata import MetadataRequest
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


async def topic_error(client: Any, topic: str, *, allow_auto_create: bool) -> int | None:
    """The metadata error code of ``topic`` (0: usable), None when no broker is known.

    Asks without auto-creating the topic unless allowed: aiokafka's own metadata requests
    always allow auto-creation.
    """
    node = client.get_random_node()
    if node is None:
        return None
    response = await client.send(node, MetadataRequest([topic], allow_auto_topic_creation=allow_auto_create))
    for error_code, name, *_ in response.topics:
        if name == topic:
            return int(error_code)
    return None


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
    host, port, _family = collect_hosts(settings["bootstrap_servers"], randomize=False)[0]
    conn = await create_conn(
        host,
        port,
        client_id=settings["client_id"],
        request_timeout_ms=settings["request_timeout_ms"],
        ssl_context=ssl_context,
        security_protocol=settings["security_protocol"],
        sasl_mechanism=settings.get("sasl_mechanism"),
        sasl_plain_username=settings.get("sasl_plain_username"),
        sasl_plain_password=settings.get("sasl_plain_password"),
    )
    conn.close()
    return f"{host}:{port}"


__all__ = [
    "InvalidRecordError",
    "fail_pending",
    "no_auto_create",
    "pace_metadata_retries",
    "ping",
    "probe",
    "record_size",
    "topic_error",
]
