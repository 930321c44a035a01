"""Kafka sink on aiokafka: one producer per sink, record batches built per partition.

Each ``write()`` routes its messages to (topic, partition) like Kafka's Java client does (murmur2
of the key ``source/dp_rank``, so every client agrees and one stream stays in one partition),
appends them to one record batch per partition (more when a batch fills up), hands all batches to
the producer at once and returns when the broker acknowledged every one. The producer is
idempotent by default, so its own internal retries never duplicate or reorder a batch.

Delivery is at least once: when a write fails (timeout, broker away) the runtime sends it again,
and the broker cannot tell that copy from new data, so a consumer deduplicates on the headers
``source``, ``dp_rank``, ``epoch``, ``seq`` (and ``index`` at event granularity), as design.md
promises. Within a stream the first copy of every message comes in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import weakref
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.codec import has_lz4, has_snappy, has_zstd
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from bridge.config import ByteSize, Duration, SinkConfig, Struct
from bridge.connector import Template, TlsOptions
from bridge.errors import ConfigError, ConnectorError, NotConnected, PartialFailure, Permanent, Retriable
from bridge.formats import Message

log = logging.getLogger(__name__)

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
Compression = Literal["none", "gzip", "snappy", "lz4", "zstd"]

MiB = 2**20
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
# Kafka protocol error codes seen in metadata and CreateTopics responses.
_UNKNOWN_TOPIC, _LEADER_NOT_AVAILABLE, _INVALID_TOPIC, _TOPIC_AUTHORIZATION, _TOPIC_EXISTS = 3, 5, 17, 29, 36
# The partitioner aiokafka (and Java's client) uses for keyed records: murmur2(key) % partitions.
_PARTITIONER = DefaultPartitioner()
_CODECS = {"snappy": has_snappy, "lz4": has_lz4, "zstd": has_zstd}
_SIZE_ERRORS = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError,
)
# After one of these the idempotent producer's sequence numbers no longer match the broker's
# (the broker rejects every later batch of the partition with OutOfOrderSequenceNumber), so the
# producer is replaced (new producer id) before the next write.
_PRODUCER_STATE_ERRORS = (
    kafka_errors.OutOfOrderSequenceNumber,
    kafka_errors.UnknownProducerId,
    kafka_errors.InvalidProducerEpoch,
    kafka_errors.ProducerFenced,
    kafka_errors.ProducerClosed,
)
_METADATA_RETRY_PAUSE = 0.5  # seconds between metadata updates while no broker answers
_HEADROOM = 4096  # a message this close to max_batch_bytes gets its exact size computed
_MEMORY = 10_000  # msg_ids remembered as refused by the broker, or to be sent alone
_UNREACHABLE = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.NoBrokersAvailable,
    kafka_errors.KafkaTimeoutError,
    kafka_errors.StaleMetadata,
)


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class CreateTopicsOptions(Struct):
    """Create missing topics with the admin API before the first write to them."""

    enabled: Annotated[bool, _doc("Create each topic the sink writes to when it does not exist.")] = False
    partitions: Annotated[int, msgspec.Meta(ge=1, description="Partitions of a created topic.")] = 6
    replication_factor: Annotated[
        int, msgspec.Meta(ge=1, description="Replicas of a created topic (use 3 on a production cluster).")
    ] = 1
    configs: Annotated[dict[str, str], _doc("Topic configs of a created topic, e.g. retention.ms.")] = msgspec.field(
        default_factory=dict
    )


class KafkaOptions(Struct):
    """The kafka sink's own keys."""

    bootstrap_servers: Annotated[
        str | list[str], _doc("host:port of one or more brokers (a list, or one comma-separated string).")
    ]
    topic: Annotated[str, _doc("Topic name template: {source}, {dp_rank}, {type}, {epoch}, labels as {labels.NAME}.")] = (
        "kv-events"
    )
    partition: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        _doc("Write every message to this partition (default: by stream key)."),
    ] = None
    acks: Annotated[
        Literal["all", 1, 0], _doc("Broker acknowledgement: all (every in-sync replica), 1 (leader) or 0 (none).")
    ] = "all"
    enable_idempotence: Annotated[
        bool, _doc("Idempotent producer: internal retries never duplicate or reorder (needs acks: all).")
    ] = True
    compression: Annotated[Compression, _doc("Record batch compression (snappy, lz4, zstd need the cramjam package).")] = "none"
    linger_ms: Annotated[
        int, msgspec.Meta(ge=0, description="Extra wait before a batch is sent (the runtime's batch.linger usually suffices).")
    ] = 0
    max_batch_bytes: Annotated[
        ByteSize,
        _doc("Record batch size per partition and the largest message accepted (keep <= broker message.max.bytes)."),
    ] = ByteSize(MiB)
    request_timeout: Annotated[Duration, _doc("Bound on connecting, metadata, and each write's acknowledgement.")] = Duration(
        10.0
    )
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: Annotated[SaslMechanism, _doc("SASL mechanism (security_protocol SASL_PLAINTEXT or SASL_SSL).")] = "PLAIN"
    sasl_username: Annotated[str | None, _doc("SASL user; use ${VAR} to take it from the environment.")] = None
    sasl_password: Annotated[str | None, _doc("SASL password; use ${VAR} to take it from the environment. Never logged.")] = None
    tls: Annotated[TlsOptions | None, _doc("TLS files and checks (security_protocol SSL or SASL_SSL).")] = None
    create_topics: CreateTopicsOptions = msgspec.field(default_factory=CreateTopicsOptions)
    allow_auto_create_topics: Annotated[
        bool, _doc("Let the broker auto-create a missing topic on first use (if the broker allows it).")
    ] = True
    client_id: Annotated[str | None, _doc("Client id seen by the brokers (default: kv-event-bridge-SINKNAME).")] = None

    def __post_init__(self) -> None:
        # msgspec turns a ValueError here into a validation error at the sink's path.
        problems: list[str] = []
        if not self.servers():
            problems.append("bootstrap_servers: at least one host:port is required")
        if self.enable_idempotence and self.acks != "all":
            problems.append('acks must be "all" while enable_idempotence is true')
        check = _CODECS.get(self.compression)
        if check is not None and not check():
            problems.append(
                f"compression {self.compression} needs the cramjam package (pip install cramjam); gzip and none work without it"
            )
        if self.max_batch_bytes < 1024:
            problems.append("max_batch_bytes must be at least 1KiB")
        if self.request_timeout <= 0:
            problems.append("request_timeout must be positive")
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and not (self.sasl_username and self.sasl_password):
            problems.append(f"sasl_username and sasl_password are required with security_protocol {self.security_protocol}")
        if not sasl and (self.sasl_username or self.sasl_password):
            problems.append(
                f"sasl_username/sasl_password are set but security_protocol is {self.security_protocol}: "
                "use SASL_PLAINTEXT or SASL_SSL"
            )
        if self.tls is not None and not self.security_protocol.endswith("SSL"):
            problems.append(f"tls is set but security_protocol is {self.security_protocol}: use SSL or SASL_SSL")
        if problems:
            raise ValueError("; ".join(problems))

    def servers(self) -> list[str]:
        """The bootstrap servers as a list of host:port."""
        raw = [self.bootstrap_servers] if isinstance(self.bootstrap_servers, str) else self.bootstrap_servers
        return [s.strip() for entry in raw for s in entry.split(",") if s.strip()]

    def __repr__(self) -> str:
        # The default repr would print sasl_password; list only what is safe and useful.
        return (
            f"KafkaOptions(bootstrap_servers={self.servers()!r}, topic={self.topic!r}, "
            f"security_protocol={self.security_protocol!r}, sasl_username={self.sasl_username!r}, "
            f"sasl_password={'***' if self.sasl_password else None})"
        )

    __str__ = __repr__


def producer_settings(options: KafkaOptions, name: str) -> dict[str, Any]:
    """The AIOKafkaProducer keyword arguments for ``options`` (without ``ssl_context``)."""
    settings = client_settings(options, name)
    settings.update(
        acks=options.acks,
        enable_idempotence=options.enable_idempotence,
        compression_type=None if options.compression == "none" else options.compression,
        linger_ms=options.linger_ms,
        max_batch_size=int(options.max_batch_bytes),
        # Only send() checks it; the batch API is bounded by max_batch_bytes (checked per message).
        max_request_size=max(int(options.max_batch_bytes), MiB),
    )
    return settings


def client_settings(options: KafkaOptions, name: str) -> dict[str, Any]:
    """Keyword arguments shared by the producer and the admin client (connection and security)."""
    settings: dict[str, Any] = {
        "bootstrap_servers": options.servers(),
        "client_id": options.client_id or f"kv-event-bridge-{name}",
        "request_timeout_ms": int(options.request_timeout * 1000),
        "security_protocol": options.security_protocol,
    }
    if options.security_protocol.startswith("SASL_"):
        # aiokafka takes the SCRAM credentials through the sasl_plain_* arguments too.
        settings.update(
            sasl_mechanism=options.sasl_mechanism,
            sasl_plain_username=options.sasl_username,
            sasl_plain_password=options.sasl_password,
        )
    return settings


def ssl_context(options: KafkaOptions) -> ssl.SSLContext | None:
    """The client TLS context for SSL / SASL_SSL (reads the files), else None."""
    if not options.security_protocol.endswith("SSL"):
        return None
    return (options.tls or TlsOptions()).ssl_context()


class _Chunk:
    """One record batch for one partition, and the indexes (into the write) it carries."""

    __slots__ = ("builder", "indexes", "partition", "sealed", "topic", "used")

    def __init__(self, builder: Any, topic: str, partition: int) -> None:
        self.builder = builder
        self.topic = topic
        self.partition = partition
        self.indexes: list[int] = []
        self.sealed = False  # holds a message that must travel alone
        self.used = 0  # bytes of the records appended so far


def _retrieve(future: asyncio.Future[Any]) -> None:
    # A batch future nobody awaits any more (write timed out) must not log "never retrieved".
    if future.done() and not future.cancelled():
        future.exception()


class KafkaConnector:
    """The kafka sink: see the module docstring for routing and delivery semantics."""

    Options: ClassVar[type[KafkaOptions]] = KafkaOptions
    needs_events: ClassVar[bool] = False  # sends value, key and headers only: raw batches need no decoding

    def __init__(self, name: str, options: KafkaOptions, sink: SinkConfig) -> None:
        self.name = name
        self.options = options
        self.sink = sink
        self._where = f"sinks[{name}]"
        self._servers = ",".join(options.servers())
        self._topic = Template(options.topic, f"{self._where}.topic")
        if self._topic.static and not _TOPIC_NAME.fullmatch(options.topic):
            raise ConfigError(
                [f"{self._where}.topic: {options.topic!r} is not a valid Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)"]
            )
        self._timeout = float(options.request_timeout)
        self._max_bytes = int(options.max_batch_bytes)
        self._producer: Any = None
        self._connect_lock = asyncio.Lock()
        # Submissions are serialised so concurrent writes enter each partition in call order.
        self._submit_lock = asyncio.Lock()
        self._partitions: dict[str, list[int]] = {}  # topic -> partition ids, once checked
        self._routes: dict[tuple[str, bytes], int] = {}  # (topic, key) -> partition
        self._batch_limit: dict[str, int] = {}  # topics whose broker limit is below max_batch_bytes
        self._suspects: dict[str, bool] = {}  # msg_id -> send alone (it was in a refused batch)
        self._rejected: dict[str, ConnectorError] = {}  # msg_id -> why the broker refused it alone
        self._created: set[str] = set()
        if options.sasl_password:
            _REDACT.secrets[id(self)] = options.sasl_password
            weakref.finalize(self, _REDACT.secrets.pop, id(self), None)
        self._closed = False
        self._down: str | None = "not connected yet"  # why there is no producer
        self._topic_problem: str | None = None  # a missing / unusable topic, for health()

    def __repr__(self) -> str:
        return f"KafkaConnector(name={self.name!r}, servers={self._servers!r}, topic={self.options.topic!r})"

    # -- hooks ----------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Start the producer (bounded by request_timeout) and check a static topic.

        Raises NotConnected naming the sink and the servers, or the topic when it is missing and
        will not be created.
        """
        producer = await self._ensure_producer()
        if self._topic.static and self.options.topic not in self._partitions:
            try:
                async with asyncio.timeout(self._timeout):
                    await self._prepare_topic(producer, self.options.topic)
            except TimeoutError:
                raise NotConnected(
                    f"{self._where}: no metadata for topic {self.options.topic!r} from {self._servers} within {self._timeout:g}s"
                ) from None
            except ConnectorError as exc:
                raise NotConnected(str(exc), reason=exc.reason) from exc

    async def write(self, messages: Sequence[Message]) -> None:
        """Deliver ``messages``; return once the broker acknowledged every one.

        Messages of one stream keep their order: when something fails, every later message of
        the same stream in this write is reported failed too (even if the broker took it), so
        the runtime's retry re-sends them after the failed one.
        """
        if not messages:
            return
        producer = await self._ensure_producer()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        failures: dict[int, ConnectorError] = {}
        chunks: list[_Chunk] = []
        submitted: list[tuple[asyncio.Future[Any], _Chunk]] = []
        reset = False
        unsent: ConnectorError | None = None  # why batches that were built were not queued
        try:
            async with asyncio.timeout_at(deadline), self._submit_lock:
                chains = await self._build(producer, messages, failures)
                chunks = [c for chain in chains for c in chain]
                unsent = await self._submit(producer, chains, submitted)
        except TimeoutError:
            reset = True
            unsent = self._timed_out()
        if unsent is not None:
            queued = {id(c) for _, c in submitted}
            for chunk in chunks:
                if id(chunk) not in queued:
                    self._fail(failures, chunk, unsent)
        if submitted:
            futures = [f for f, _ in submitted]
            await asyncio.wait(futures, timeout=max(0.0, deadline - loop.time()))
            for future, chunk in submitted:
                if not future.done():
                    reset = True
                    self._fail(failures, chunk, self._timed_out())
                    continue
                exc = future.exception()
                if exc is None:
                    continue
                error, needs_reset = self._classify(exc, chunk, messages)
                reset = reset or needs_reset
                self._fail(failures, chunk, error)
        if reset:
            # A timed-out producer still holds batches it would retry for ever (idempotent
            # batches never expire); a broken one rejects everything. Start afresh next write.
            await self._discard(producer)
        if failures:
            raise self._outcome(messages, failures)
        self._topic_problem = None

    async def close(self) -> None:
        """Flush what is pending (bounded by request_timeout) and stop; never raises."""
        producer, self._producer = self._producer, None
        self._closed = True
        self._down = "closed"
        if producer is None:
            return
        try:
            async with asyncio.timeout(self._timeout):
                await producer.stop()
        except Exception as exc:
            log.warning(
                "kafka sink %s: close did not flush cleanly (%s); pending messages are dropped",
                self.name,
                self._scrub(_describe(exc)),
            )
            await self._force_stop(producer)

    async def health(self) -> str | None:
        """None when a broker answers a metadata request, else a short reason.

        Without a producer (never connected, or dropped after an outage) it tries to connect,
        and it re-checks a missing static topic, so an idle sink turns ready again by itself.
        """
        if self._closed:
            return "closed"
        limit = min(self._timeout, 5.0)
        try:
            producer = await self._ensure_producer()
            if self._topic_problem is not None and self._topic.static:
                async with asyncio.timeout(self._timeout):
                    await self._prepare_topic(producer, self.options.topic)
            if self._topic_problem is not None:
                return self._topic_problem
            async with asyncio.timeout(limit):
                node = producer.client.get_random_node()
                if node is None:
                    return f"no broker known from {self._servers}"
                await producer.client.send(node, MetadataRequest([]))
        except ConnectorError as exc:
            return self._topic_problem or self._down or str(exc)
        except (Exception, TimeoutError) as exc:
            return f"cannot reach {self._servers} ({self._scrub(_describe(exc))})"
        return None

    # -- connection -----------------------------------------------------------------------------
    async def _ensure_producer(self) -> Any:
        if self._producer is not None:
            return self._producer
        self._closed = False  # connect() or write() after close() starts over
        async with self._connect_lock:
            if self._producer is None:
                self._producer = await self._start()
                self._down = None
            return self._producer

    async def _start(self) -> Any:
        try:
            context = ssl_context(self.options)
        except (OSError, ssl.SSLError) as exc:
            self._down = f"TLS setup failed: {exc}"
            raise NotConnected(f"{self._where}: {self._down}", reason="tls") from None
        producer = AIOKafkaProducer(**producer_settings(self.options, self.name), ssl_context=context)
        _throttle_metadata_retries(producer.client)
        try:
            async with asyncio.timeout(self._timeout):
                await producer.start()
        except BaseException as exc:
            await self._force_stop(producer)
            if not isinstance(exc, Exception):
                raise  # cancelled: the caller is going away
            self._down = f"cannot connect to {self._servers} ({await self._diagnose(exc, context)})"
            raise NotConnected(f"{self._where}: {self._down}") from None
        # A new producer has a new producer id and no knowledge of earlier topic checks.
        self._partitions.clear()
        self._routes.clear()
        log.info("kafka sink %s: connected to %s", self.name, self._servers)
        return producer

    async def _diagnose(self, exc: BaseException, context: ssl.SSLContext | None) -> str:
        """A short reason for a failed start; aiokafka only logs the cause of a failed bootstrap."""
        if isinstance(exc, TimeoutError):
            return f"no answer within {self._timeout:g}s"
        if not isinstance(exc, kafka_errors.KafkaConnectionError):
            return self._scrub(_describe(exc))
        settings = client_settings(self.options, self.name)
        host, port, _family = collect_hosts(settings["bootstrap_servers"], randomize=False)[0]
        try:
            async with asyncio.timeout(min(self._timeout, 5.0)):
                conn = await create_conn(
                    host,
                    port,
                    client_id=settings["client_id"],
                    request_timeout_ms=settings["request_timeout_ms"],
                    ssl_context=context,
                    security_protocol=self.options.security_protocol,
                    sasl_mechanism=settings.get("sasl_mechanism"),
                    sasl_plain_username=settings.get("sasl_plain_username"),
                    sasl_plain_password=settings.get("sasl_plain_password"),
                )
            conn.close()
        except TimeoutError:
            return f"no answer from {host}:{port} within {min(self._timeout, 5.0):g}s"
        except ConnectionRefusedError:
            return "connection refused"
        except ssl.SSLCertVerificationError as probe:
            return f"TLS certificate verification failed: {probe.verify_message}"
        except ssl.SSLError as probe:
            return f"TLS handshake failed: {probe.reason or probe}"
        except OSError as probe:
            return probe.strerror or _describe(probe)
        except Exception as probe:
            return self._scrub(_describe(probe))
        return self._scrub(_describe(exc))

    async def _discard(self, producer: Any) -> None:
        if self._producer is producer:
            self._producer = None
            self._down = f"reconnecting to {self._servers}"
        await self._force_stop(producer)

    async def _force_stop(self, producer: Any) -> None:
        """Stop a producer without waiting for its pending batches (bounded, never raises).

        aiokafka has no abort: stop() waits for every pending batch, and an idempotent batch is
        retried until the broker takes it. So pending batches are failed first (the writes
        waiting on them see an error and their messages are sent again), then it is stopped.
        """
        abandoned = kafka_errors.KafkaConnectionError("producer discarded by the kafka sink")
        with contextlib.suppress(Exception):
            accumulator = producer._message_accumulator
            queued = [b for queue in accumulator._batches.values() for b in queue]
            # A batch re-queued for retry is off the pending set but its done-callback still
            # removes it from there: put it back so failing it does not raise KeyError.
            accumulator._pending_batches.update(b for b in queued if b.retry_count > 0)
            batches = queued + list(accumulator._pending_batches)
            accumulator.fail_all(abandoned)
            for batch in batches:
                _retrieve(batch._drain_waiter)
        try:
            async with asyncio.timeout(min(self._timeout, 5.0)):
                await producer.stop()
        except (Exception, TimeoutError):
            with contextlib.suppress(Exception, TimeoutError):
                task = producer._sender.sender_task
                if task is not None and not task.done():
                    task.cancel()
                async with asyncio.timeout(2.0):
                    await producer.client.close()

    # -- topics ---------------------------------------------------------------------------------
    async def _prepare_topic(self, producer: Any, topic: str) -> list[int]:
        """The partitions of ``topic`` after making sure it exists (creating it if configured)."""
        if not _TOPIC_NAME.fullmatch(topic):
            raise Permanent(
                f"{self._where}: {topic!r} is not a valid Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)",
                reason="invalid_topic",
            )
        if self.options.create_topics.enabled and topic not in self._created:
            await self._create_topic(topic)
        # A broker that auto-creates answers "unknown topic" (KRaft) or "leader not available"
        # until the new topic has a leader, so "unknown" is final only after a grace period.
        loop = asyncio.get_running_loop()
        allow = self.options.allow_auto_create_topics
        grace = loop.time() + (min(self._timeout / 2, 5.0) if allow or self.options.create_topics.enabled else 0.0)
        while True:
            code = await self._topic_error(producer, topic)
            if code == 0:
                break
            if code == _UNKNOWN_TOPIC and loop.time() >= grace:
                why = (
                    "the broker did not auto-create it (auto.create.topics.enable=false?)"
                    if allow
                    else "auto-creation is off (allow_auto_create_topics: false)"
                )
                self._topic_problem = (
                    f"topic {topic!r} does not exist on {self._servers} and {why}; create it, or set create_topics.enabled: true"
                )
                raise NotConnected(f"{self._where}: {self._topic_problem}", reason="unknown_topic")
            if code == _INVALID_TOPIC:
                raise Permanent(f"{self._where}: the broker rejects topic name {topic!r}", reason="invalid_topic")
            if code == _TOPIC_AUTHORIZATION:
                self._topic_problem = f"not authorized to write to topic {topic!r}"
                raise Permanent(f"{self._where}: {self._topic_problem}", reason="unauthorized")
            if code not in (_UNKNOWN_TOPIC, _LEADER_NOT_AVAILABLE):
                raise Retriable(
                    f"{self._where}: metadata for topic {topic!r}: {kafka_errors.for_code(code).__name__}",
                    reason="metadata",
                )
            await asyncio.sleep(0.1)
        try:
            partitions = sorted(await producer.partitions_for(topic))
        except Exception as exc:
            raise self._classify(exc, None)[0] from exc
        if self.options.partition is not None and self.options.partition not in partitions:
            self._topic_problem = (
                f"topic {topic!r} has {len(partitions)} partition(s); partition {self.options.partition} does not exist"
            )
            raise NotConnected(f"{self._where}: {self._topic_problem}", reason="unknown_partition")
        self._partitions[topic] = partitions
        if self._topic_problem is not None and repr(topic) in self._topic_problem:
            self._topic_problem = None
        return partitions

    async def _topic_error(self, producer: Any, topic: str) -> int:
        """The metadata error code of ``topic`` (0: usable), asking without auto-creating it
        unless allowed; aiokafka's own metadata requests always allow auto-creation."""
        client = producer.client
        node = client.get_random_node()
        if node is None:
            raise NotConnected(f"{self._where}: no broker known from {self._servers}")
        request = MetadataRequest([topic], allow_auto_topic_creation=self.options.allow_auto_create_topics)
        try:
            response = await client.send(node, request)
        except Exception as exc:
            raise self._classify(exc, None)[0] from exc
        for entry in response.topics:
            if entry[1] == topic:
                return int(entry[0])
        return _LEADER_NOT_AVAILABLE

    async def _create_topic(self, topic: str) -> None:
        spec = self.options.create_topics
        admin = AIOKafkaAdminClient(**client_settings(self.options, self.name), ssl_context=ssl_context(self.options))
        try:
            await admin.start()
            response = await admin.create_topics(
                [NewTopic(topic, spec.partitions, spec.replication_factor, topic_configs=dict(spec.configs))]
            )
        except Exception as exc:
            raise NotConnected(f"{self._where}: cannot create topic {topic!r}: {self._scrub(_describe(exc))}") from None
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        for entry in response.topic_errors:
            code = int(entry[1])
            if code not in (0, _TOPIC_EXISTS):
                detail = entry[2] if len(entry) > 2 and entry[2] else kafka_errors.for_code(code).__name__
                self._topic_problem = f"cannot create topic {topic!r}: {detail}"
                raise NotConnected(f"{self._where}: {self._topic_problem}", reason="create_topic")
        self._created.add(topic)
        log.info("kafka sink %s: topic %s ready (created or already there)", self.name, topic)

    # -- the write path -------------------------------------------------------------------------
    async def _build(self, producer: Any, messages: Sequence[Message], failures: dict[int, ConnectorError]) -> list[list[_Chunk]]:
        """Route every message and append it to its partition's record batches.

        Returns one chain of batches per (topic, partition), in first-seen order. Messages that
        cannot be sent (too large, topic unusable) are put in ``failures`` instead.
        """
        render = self._topic.render
        fixed = self.options.partition
        cluster = producer.client.cluster
        chains: dict[tuple[str, int], list[_Chunk]] = {}
        limits: dict[str, int] = {}
        topic_errors: dict[str, ConnectorError] = {}
        estimate = DefaultRecordBatchBuilder.estimate_size_in_bytes
        encode = str.encode
        rejected, suspects, routes = self._rejected, self._suspects, self._routes
        record: Any = None
        key = b""
        for i, m in enumerate(messages):
            topic = render(m)
            limit = limits.get(topic)
            if limit is None:  # first message for this topic in this write
                if topic in topic_errors:
                    failures[i] = topic_errors[topic]
                    continue
                parts = self._partitions.get(topic)
                known = cluster.partitions_for_topic(topic)
                if parts is not None and known is not None and len(known) != len(parts):
                    parts = None  # partitions were added: routes change, as with every client
                    routes = self._routes = {k: v for k, v in routes.items() if k[0] != topic}
                if parts is None:
                    try:
                        await self._prepare_topic(producer, topic)
                    except ConnectorError as exc:
                        topic_errors[topic] = exc
                        failures[i] = exc
                        continue
                limit = limits[topic] = self._batch_limit.get(topic, self._max_bytes)
            if rejected and m.msg_id in rejected:
                failures[i] = rejected[m.msg_id]
                continue
            if m.record is not record:  # the messages of one record are consecutive
                record = m.record
                key = m.key
            if fixed is not None:
                partition = fixed
            else:
                partition = routes.get((topic, key), -1)
                if partition < 0:
                    all_parts = self._partitions[topic]
                    partition = routes[(topic, key)] = _PARTITIONER(key, all_parts, all_parts)
            headers = list(zip(m.headers, map(encode, m.headers.values()), strict=True))
            value = m.value
            size = len(value) + len(key)  # the headers add ~150 bytes; exact near the limit only
            if size + _HEADROOM > self._max_bytes:
                size = estimate(key, value, headers)
                if size > self._max_bytes:
                    failures[i] = Permanent(
                        f"{self._where}: message {m.msg_id} is {size} bytes, more than max_batch_bytes ({self._max_bytes})",
                        reason="too_large",
                    )
                    continue
            chain = chains.get((topic, partition))
            if chain is None:
                chain = chains[(topic, partition)] = [_Chunk(producer.create_batch(), topic, partition)]
            chunk = chain[-1]
            alone = bool(suspects) and m.msg_id in suspects
            if chunk.indexes and (alone or chunk.sealed or chunk.used + size > limit):
                chunk = _Chunk(producer.create_batch(), topic, partition)
                chain.append(chunk)
            chunk.sealed = alone
            appended = chunk.builder.append(timestamp=None, key=key, value=value, headers=headers)
            if appended is None:  # aiokafka's exact bound (max_batch_bytes) is reached
                chunk = _Chunk(producer.create_batch(), topic, partition)
                chain.append(chunk)
                appended = chunk.builder.append(timestamp=None, key=key, value=value, headers=headers)
            chunk.used += appended.size
            chunk.indexes.append(i)
        return list(chains.values())

    async def _submit(
        self, producer: Any, chains: list[list[_Chunk]], submitted: list[tuple[asyncio.Future[Any], _Chunk]]
    ) -> ConnectorError | None:
        """Queue every batch with the producer, the first batch of every partition first.

        aiokafka queues one batch per partition and waits for it to be taken before accepting
        the next, so round-robin order lets one request carry a batch for every partition.
        Returns why the remaining batches could not be queued, if one could not.
        """
        depth = max((len(c) for c in chains), default=0)
        for level in range(depth):
            for chain in chains:
                if level >= len(chain):
                    continue
                chunk = chain[level]
                try:
                    future = await producer.send_batch(chunk.builder, chunk.topic, partition=chunk.partition)
                except kafka_errors.KafkaError as exc:
                    return self._classify(exc, chunk)[0]
                future.add_done_callback(_retrieve)
                submitted.append((future, chunk))
        return None

    # -- failure classification -----------------------------------------------------------------
    def _timed_out(self) -> NotConnected:
        return NotConnected(f"{self._where}: no acknowledgement from {self._servers} within {self._timeout:g}s", reason="timeout")

    @staticmethod
    def _fail(failures: dict[int, ConnectorError], chunk: _Chunk, error: ConnectorError) -> None:
        for i in chunk.indexes:
            failures[i] = error

    def _classify(
        self, exc: BaseException, chunk: _Chunk | None, messages: Sequence[Message] = ()
    ) -> tuple[ConnectorError, bool]:
        """The bridge error for an aiokafka failure, and whether the producer must be replaced."""
        if isinstance(exc, ConnectorError):
            return exc, False
        if not isinstance(exc, kafka_errors.KafkaError):
            raise exc  # not a delivery failure but a bug: let it surface
        topic = chunk.topic if chunk is not None else "?"
        text = self._scrub(_describe(exc))
        if isinstance(exc, kafka_errors.InvalidTopicError):
            return Permanent(f"{self._where}: invalid topic {topic!r} ({text})", reason="invalid_topic"), True
        if isinstance(exc, kafka_errors.TopicAuthorizationFailedError):
            return Permanent(f"{self._where}: not authorized to write to topic {topic!r}", reason="unauthorized"), True
        if isinstance(exc, kafka_errors.UnknownTopicOrPartitionError):
            self._partitions.pop(topic, None)  # check it again (and explain) on the next write
            return NotConnected(f"{self._where}: topic {topic!r} is unknown to the broker ({text})", reason="unknown_topic"), True
        if isinstance(exc, _PRODUCER_STATE_ERRORS):
            return Retriable(f"{self._where}: producer state lost ({text}); reconnecting", reason="producer_reset"), True
        if isinstance(exc, _UNREACHABLE):
            return NotConnected(f"{self._where}: cannot reach {self._servers} ({text})"), True
        if exc.retriable:
            return Retriable(f"{self._where}: {text}"), False
        if isinstance(exc, kafka_errors.BrokerResponseError) and chunk is not None and messages:
            # The broker refused this batch (too large for the topic, invalid record...). It
            # cannot say which record, so the records of a larger batch are retried one per
            # batch; a record refused alone is permanent, and refused before sending next time
            # (the runtime may retry it with others, whose batches it would break again).
            too_large = isinstance(exc, _SIZE_ERRORS)
            ids = [messages[i].msg_id for i in chunk.indexes]
            if len(ids) > 1:
                if too_large:  # the topic's max.message.bytes is below max_batch_bytes
                    self._batch_limit[topic] = max(1024, chunk.builder.size() // 2)
                _remember(self._suspects, ids, True)
                return Retriable(
                    f"{self._where}: topic {topic!r} refused a batch of {len(ids)} ({text}); retrying them one by one",
                    reason="batch_refused",
                ), True
            what = "message too large for" if too_large else "message refused by the broker for"
            error = Permanent(
                f"{self._where}: {what} topic {topic!r} ({messages[chunk.indexes[0]].msg_id}: {text})",
                reason="too_large" if too_large else "rejected",
            )
            _remember(self._rejected, ids, error)
            return error, True
        # aiokafka's own failures (sender task died...): a fresh producer is the way out.
        return Retriable(f"{self._where}: {text}", reason="producer_reset"), True

    def _outcome(self, messages: Sequence[Message], failures: dict[int, ConnectorError]) -> ConnectorError:
        """One exception for the write: the cause itself, or PartialFailure with the indexes."""
        # Order within a stream: a message after one that will be retried is retried too.
        first: dict[bytes, int] = {}
        for i in sorted(failures):
            if not isinstance(failures[i], Permanent):
                first.setdefault(messages[i].key, i)
        if first:
            for i, m in enumerate(messages):
                j = first.get(m.key)
                if j is not None and i > j and i not in failures:
                    failures[i] = failures[j]
        causes = list(failures.values())
        cause: ConnectorError = next((c for c in causes if isinstance(c, NotConnected)), causes[0])
        if isinstance(cause, Permanent):
            cause = next((c for c in causes if not isinstance(c, Permanent)), cause)
        if len(failures) == len(messages):
            return cause
        return PartialFailure(sorted(failures), cause)

    def _scrub(self, text: str) -> str:
        """``text`` without the SASL password (defence in depth: error texts are logged)."""
        secret = self.options.sasl_password
        return text.replace(secret, "***") if secret else text


class _RedactSecrets(logging.Filter):
    """Keeps SASL secrets out of aiokafka's debug log.

    aiokafka.conn logs every request it sends at DEBUG, SaslAuthenticate included, whose bytes
    hold the PLAIN password. Records of such requests lose their body, and any live sink's
    password in any aiokafka record is masked.
    """

    def __init__(self) -> None:
        super().__init__()
        self.secrets: dict[int, str] = {}  # id(connector) -> password

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        redacted = _SASL_AUTH.sub(r"\1(<redacted>)", text)
        for secret in self.secrets.values():
            redacted = redacted.replace(secret, "***")
        if redacted != text:
            record.msg, record.args = redacted, None
        return True


_SASL_AUTH = re.compile(r"(SaslAuthenticateRequest\w*)\(.*\)", re.DOTALL)
_REDACT = _RedactSecrets()
for _name in (
    "aiokafka",
    "aiokafka.conn",
    "aiokafka.cluster",
    "aiokafka.producer.producer",
    "aiokafka.producer.sender",
    "aiokafka.admin.client",
):
    logging.getLogger(_name).addFilter(_REDACT)  # logger filters do not apply to child loggers


def _throttle_metadata_retries(client: Any) -> None:
    """Pause after a failed metadata update before the next one.

    When no broker answers, aiokafka's sender asks for metadata again as soon as an update fails,
    without backoff: a busy loop logging two errors per try, thousands per second, until the
    write gives up (aio-libs/aiokafka#496). Wrapping this client's update adds the pause.
    """
    update = getattr(client, "_metadata_update", None)
    if update is None:  # aiokafka changed: keep its behaviour rather than break
        return

    async def paced(cluster: Any, topics: Any) -> Any:
        ok = await update(cluster, topics)
        if not ok:
            await asyncio.sleep(_METADATA_RETRY_PAUSE)
        return ok

    client._metadata_update = paced


def _remember(memory: dict[str, Any], keys: Sequence[str], value: Any) -> None:
    """Add ``keys`` to a bounded memory (oldest entries go first)."""
    for key in keys:
        memory[key] = value
    while len(memory) > _MEMORY:
        del memory[next(iter(memory))]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, kafka_errors.KafkaError):
        return str(exc)  # already "[Error N] Name: detail"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


__all__ = ["KafkaConnector", "KafkaOptions", "TlsOptions", "client_settings", "producer_settings", "ssl_context"]
