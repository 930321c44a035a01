"""Kafka sink on aiokafka: one idempotent producer per sink, record batches built per partition.

Each ``write()`` routes its messages to (topic, partition) like Kafka's Java client does (murmur2
of the key ``source/dp_rank``, so every client agrees and one stream stays in one partition) and
appends them to record batches per partition. Each partition's batches are sent one after the
other, the next once the broker acknowledged the previous one (partitions in parallel): a refused
batch never lets a later batch of its partition be stored before it. Messages held back that way
are reported transient at their indexes, and the runtime writes each stream again from its first
transient failure (the delivery contract in :mod:`bridge.connector`).

A batch the broker refuses (too large for the topic, an invalid record) is retried one message
per batch, so a message refused alone is dead-lettered for itself and its neighbours go on. An
authorization error is transient: an operator can fix the ACL. After any failed batch the producer
is replaced before the next write (its sequence numbers no longer match the broker's), and so is
one whose write was cancelled half-way (it still holds batches it would retry for ever).

No metadata request of the sink's clients lets the broker create a topic (aiokafka's own would
re-create a deleted topic with the broker's defaults). The sink remembers, per partition, the
offset after the last record the broker acknowledged and each stream's last batch there; a topic
found deleted, or whose partitions end before that (deleted and created again), lost them: the
next write raises :class:`SinkLost` with each stream's span (an events topic), or refuses the
next state of each stream it held (``state_lost``: a state topic).

Delivery is at least once: the broker cannot tell a re-sent message from new data, so a consumer
deduplicates on the headers ``source``, ``dp_rank``, ``epoch``, ``seq`` (and ``index`` at event
granularity); within a stream the first copy of every message comes in order.

State (``state.enabled``, README "State bootstrap"): each stream's live blocks and head go to a
log-compacted topic, keyed ``source/dp_rank/{medium}/{group}/{block}`` (:mod:`bridge.state_docs`)
and ``source/dp_rank/_head``, partitioned like the events by murmur2 of ``source/dp_rank``, so a
stream's state is the subsequence of one partition, in the bridge's order. A write sends its
messages first; once they are acknowledged, the state of each record (tombstones of a clear, the
changes, then the head, whose ``next`` is the offset after the record's last message in its events
partition). There is no transaction: the head is a fuzzy cut (a consumer's sweep may read entries
of records after it), made exact by the entries' versions (:mod:`kv_consumer.state`); a bridge that
rebuilds its tables (:meth:`KafkaConnector.read_state`) reads each stream up to its last head,
which is exact. :func:`kv_consumer.kafka.bootstrap` is the consumers' side. An entry larger than
the state topic's batches is written without its fact; a record no batch holds even so (a long
medium, a long source name) is refused for itself (``state_too_large``: the stream's state is
cleared, incomplete), never sent to be refused for ever.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.codec import has_lz4, has_snappy, has_zstd
from aiokafka.partitioner import DefaultPartitioner

from bridge.connector import (
    EPOCHS_REMEMBERED,
    STATE_TYPE,
    ByteSize,
    ConfigError,
    ConnectorError,
    ConnectorOptions,
    Duration,
    Head,
    Message,
    NotConnected,
    PartialFailure,
    Permanent,
    Retriable,
    Secret,
    SeedEntry,
    SinkConfig,
    SinkLost,
    SinkPosition,
    StateDelta,
    Stops,
    Stream,
    StreamRefused,
    Template,
    TlsOptions,
    doc,
    held_before_run,
    message_types,
    place_crc,
    redact,
    rendered,
    resent_spans,
    sample_message,
    server_address,
    smallest_record,
)
from bridge.state import EntryChange
from bridge.state_docs import StateFormat, entry_key, parse, seed_of, tier_text
from kv_consumer.kafka import HEAD, StateLog, read_log, stream_of

from . import _aiokafka_internals as internals

log = logging.getLogger(__name__)

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
Compression = Literal["none", "gzip", "snappy", "lz4", "zstd"]

MiB = 2**20
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_TOPIC_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_TOPIC_MAX = 249


def topic_value(value: str) -> str:
    """A value inserted into a topic name (a source, a label): each character a Kafka topic name
    cannot hold becomes ``_`` (``meta-llama/Llama-3.1-8B`` -> ``meta-llama_Llama-3.1-8B``)."""
    return _TOPIC_UNSAFE.sub("_", value) or "_"


def compacts(policy: str) -> bool:
    """Whether a topic's ``cleanup.policy`` (``compact``, ``delete``, ``compact,delete``...)
    compacts its log."""
    return "compact" in (p.strip().lower() for p in policy.split(","))


def topic_template_problem(text: str) -> str | None:
    """Why the topic name template ``text`` renders no valid Kafka topic name whatever the values
    (its own characters), or None."""
    literal = re.sub(r"\{[^{}]*\}", "x", text)
    bad = sorted(set(_TOPIC_UNSAFE.findall(literal)))
    if bad:
        return f"{text!r} is not a valid Kafka topic name: it holds {', '.join(map(repr, bad))} (only A-Z a-z 0-9 . _ -)"
    if literal in (".", ".."):
        return f"{text!r} is not a valid Kafka topic name"
    return None


# Kafka protocol error codes seen in metadata and CreateTopics responses.
_UNKNOWN_TOPIC, _INVALID_TOPIC, _TOPIC_AUTHORIZATION, _TOPIC_EXISTS = 3, 17, 29, 36
_PARTITIONER = DefaultPartitioner()  # murmur2(key) % partitions, as Java's client does
_CODECS = {"snappy": has_snappy, "lz4": has_lz4, "zstd": has_zstd}
_SIZE_ERRORS = (kafka_errors.MessageSizeTooLargeError, kafka_errors.RecordListTooLargeError)
# The broker refused the records themselves (87 INVALID_RECORD: e.g. a broker-side validation).
_RECORDS_REFUSED = (*_SIZE_ERRORS, kafka_errors.CorruptRecordException, internals.InvalidRecordError)
# The broker refuses every record until an operator acts: transient (the sink not ready), never a
# reason to dead-letter. The fix each one needs, for /readyz and the log.
_BROKER_REFUSES: dict[type[kafka_errors.KafkaError], str] = {
    # The sink's records carry the bridge host's clock (CreateTime): skew beyond the topic's window.
    kafka_errors.InvalidTimestampError: (
        "the bridge host's clock is outside the topic's timestamp window: fix the clock (NTP) or raise the topic's "
        "message.timestamp.before.max.ms / message.timestamp.after.max.ms"
    ),
    kafka_errors.UnsupportedForMessageFormatError: "the topic's message format predates record headers: upgrade it",
    # UNKNOWN_SERVER_ERROR: an exception inside the broker (its log says which).
    kafka_errors.UnknownError: "an unexpected error inside the broker: see the broker's log",
}
# Fixable by an operator (an ACL, a user): transient, never a reason to dead-letter.
_AUTHORIZATION = (
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.ClusterAuthorizationFailedError,
    kafka_errors.GroupAuthorizationFailedError,
    kafka_errors.TransactionalIdAuthorizationFailed,
    kafka_errors.DelegationTokenAuthorizationFailed,
    kafka_errors.SaslAuthenticationFailed,
    kafka_errors.AuthenticationFailedError,
)
_TLS_FIX = (
    "set tls.ca_file to the CA that signed the broker's certificate (and tls.cert_file / tls.key_file when it wants "
    "a client certificate)"
)
_UNREACHABLE = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.NoBrokersAvailable,
    kafka_errors.KafkaTimeoutError,
    kafka_errors.StaleMetadata,
)
_METADATA_RETRY_PAUSE = 0.5  # seconds between metadata updates while no broker answers
_HEADROOM = 4096  # a message this close to max_batch_bytes gets its exact size computed
_SCAN_CHUNK = 2_000  # records read at a time, backward from a partition's end (positions())
_TOPICS_CHECKED = 32  # templated topics --check looks at, at most
_MEMORY = 10_000  # msg_ids remembered as refused by the broker, or to be sent alone
STATE_TOPIC_CONFIGS = {
    "cleanup.policy": "compact",
    "min.cleanable.dirty.ratio": "0.1",
    "segment.ms": str(3600 * 1000),
    "delete.retention.ms": str(24 * 3600 * 1000),  # (Kafka's default, whatever the broker's is: see _TOMBSTONES_KEPT_MIN)
}
"""Topic configs of a state topic the sink creates (``state.create``)."""
_TOMBSTONES_KEPT_MIN = 3600 * 1000
"""The shortest ``delete.retention.ms`` a state topic may have: a consumer's bootstrap reads the
entries, then the tombstones after them; one that takes longer than that window can miss a
tombstone the cleaner deleted meanwhile and keep a removed block in a state marked complete."""
_TIMESTAMP_CONFIGS = ("message.timestamp.type", "message.timestamp.before.max.ms", "message.timestamp.difference.max.ms")
_TIMESTAMP_WINDOW_MIN = 60_000
"""The shortest timestamp window (ms) a CreateTime topic may have: a loaded host or broker can
take seconds between stamping a record and the broker checking it (``request_timeout`` if longer)."""
_CLOCK_SKEW_MS = 600_000
"""How far apart the clocks of the bridges writing a topic may be (record timestamps are the
writer's clock): see ``KafkaConnector.positions_before_run``."""
_YIELD_EVERY = 4096  # state records built between two yields to the event loop
_RECORD_OVERHEAD = 32  # bytes a record adds to its key, value and headers in a batch (length, attributes, deltas)
_BATCH_OVERHEAD = 61  # bytes of a record batch's header, counted in a topic's max.message.bytes
_STATE_BATCH_MIN = 1024  # bytes of state records a batch may need (a head, or an entry without its fact)


def _short_window(configs: Mapping[str, str], request_timeout: float, linger_ms: int) -> tuple[str, str, int] | None:
    """The timestamp window of topic ``configs`` that would refuse the sink's records (see
    ``KafkaConnector._timestamp_window``): (config, its value, the least it may be), or None. A
    record waits up to ``linger_ms`` in the producer after it is stamped, then up to
    ``request_timeout`` to reach the broker."""
    if configs.get("message.timestamp.type", "CreateTime") != "CreateTime":
        return None  # (LogAppendTime: the broker stamps the records; it checks no window)
    floor = max(_TIMESTAMP_WINDOW_MIN, int(request_timeout * 1000) + linger_ms)
    for key in ("message.timestamp.before.max.ms", "message.timestamp.difference.max.ms"):
        value = configs.get(key)
        if value is not None and value.isdigit() and int(value) < floor:
            return key, value, floor
    return None


class CreateTopicsOptions(ConnectorOptions):
    """Create missing topics with the admin API before the first write to them."""

    enabled: Annotated[bool, doc("Create each topic the sink writes to when it does not exist.")] = False
    partitions: Annotated[int, msgspec.Meta(ge=1, description="Partitions of a created topic.")] = 6
    replication_factor: Annotated[
        int, msgspec.Meta(ge=1, description="Replicas of a created topic (use 3 on a production cluster).")
    ] = 1
    configs: Annotated[
        dict[str, str],
        doc(
            "Topic configs of a created topic, e.g. retention.ms (cleanup.policy compact is refused, and so is a "
            "timestamp window too short for the sink's records)."
        ),
    ] = msgspec.field(default_factory=dict)


class StateOptions(ConnectorOptions):
    """The live-block state of every stream in a log-compacted topic (docs/output/state.md).

    Written without transactions: a stream's head is a fuzzy cut (entries of later records may be
    read with it), made exact by the entries' versions (:mod:`kv_consumer.state`); no fencing of a
    second bridge writing the same streams."""

    enabled: Annotated[
        bool,
        doc(
            "Keep each stream's live blocks (entries with counts, versions and facts) and its head in a "
            "log-compacted topic, written once the events before them are acknowledged (needs backpressure: block)."
        ),
    ] = False
    topic: Annotated[
        str, doc("The state topic: log-compacted (cleanup.policy=compact), never auto-created; keys source/dp_rank/...")
    ] = "kv-state"
    create: Annotated[
        bool,
        doc(
            "Create the state topic at connect when missing: cleanup.policy=compact, min.cleanable.dirty.ratio=0.1, "
            "segment.ms=1h, delete.retention.ms=1d, the partitions below and create_topics.replication_factor."
        ),
    ] = False
    partitions: Annotated[int, msgspec.Meta(ge=1, description="Partitions of a created state topic.")] = 6


class KafkaOptions(ConnectorOptions):
    """The kafka sink's own keys."""

    bootstrap_servers: Annotated[
        str | list[str], doc("host:port of one or more brokers (a list, or one comma-separated string).")
    ]
    topic: Annotated[
        str,
        doc(
            "Topic name template: {source}, {dp_rank}, {type}, {epoch}, labels as {labels.NAME}; in each value, "
            "characters a topic name cannot hold (outside A-Z a-z 0-9 . _ -) become _, and a name over 249 "
            "characters is cut, ending in a hash of the whole name."
        ),
    ] = "kv-events"
    partition: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        doc(
            "Write every message to this partition (default: by stream key). It must exist: below "
            "create_topics.partitions with create_topics; --check compares it with the topic's partitions, or a missing "
            "topic's would-be partitions (create_topics.partitions, or the broker's num.partitions when it auto-creates)."
        ),
    ] = None
    acks: Annotated[
        Literal["all", 1, 0],
        doc(
            "Broker acknowledgement: all (every in-sync replica) or 1 (the leader). 0 (none) is refused: the sink "
            "would not know what the topic holds."
        ),
    ] = "all"
    enable_idempotence: Annotated[
        bool, doc("Idempotent producer: internal retries never duplicate or reorder (needs acks: all).")
    ] = True
    compression: Annotated[Compression, doc("Record batch compression (snappy, lz4, zstd need the cramjam package).")] = "none"
    linger_ms: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description=(
                "Extra wait before a batch is sent, at most half of retry.write_timeout (the runtime's batch.linger "
                "usually suffices)."
            ),
        ),
    ] = 0
    max_batch_bytes: Annotated[
        ByteSize, doc("Record batch size per partition and the largest message accepted (keep <= broker message.max.bytes).")
    ] = ByteSize(MiB)
    request_timeout: Annotated[
        Duration, doc("The client's bound on each request to a broker (the sink's retry.write_timeout bounds a write).")
    ] = Duration(10.0)
    security_protocol: Annotated[SecurityProtocol, doc("PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.")] = "PLAINTEXT"
    sasl_mechanism: Annotated[SaslMechanism, doc("SASL mechanism (security_protocol SASL_PLAINTEXT or SASL_SSL).")] = "PLAIN"
    sasl_username: Annotated[str | None, doc("SASL user; use ${VAR} to take it from the environment.")] = None
    sasl_password: Annotated[Secret | None, doc("SASL password; use ${VAR} to take it from the environment. Never logged.")] = (
        None
    )
    tls: Annotated[TlsOptions | None, doc("TLS files and checks (security_protocol SSL or SASL_SSL).")] = None
    create_topics: CreateTopicsOptions = msgspec.field(default_factory=CreateTopicsOptions)
    allow_auto_create_topics: Annotated[
        bool,
        doc(
            "Let the broker auto-create a missing topic on first use (if the broker allows it); "
            "never a topic deleted after the sink wrote to it."
        ),
    ] = True
    client_id: Annotated[str | None, doc("Client id seen by the brokers (default: kv-event-bridge-SINKNAME).")] = None
    state: Annotated[StateOptions, doc("The optional live-block state (a compacted topic).")] = msgspec.field(
        default_factory=StateOptions
    )
    position_scan: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description=(
                "checkpoint.from_sinks: records read back from the end of a partition, at most, to find the last "
                "message of each stream starting; a stream not found within them counts as unknown (it resumes "
                "from the checkpoint file, or afresh)."
            ),
        ),
    ] = 100_000

    def __post_init__(self) -> None:
        # msgspec turns a ValueError here into a validation error at the sink's path.
        problems: list[str] = []
        if not self.servers():
            problems.append("bootstrap_servers: at least one host:port is required")
        if self.acks == 0:
            # (aiokafka then resolves each send to None: no offset to acknowledge a record by.)
            problems.append(
                "acks: 0 is not supported: without the broker's acknowledgement and offsets the sink cannot tell what "
                "the topic holds (what to acknowledge, announce as lost, or write state after); use 1 or all"
            )
        elif self.enable_idempotence and self.acks != "all":
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
        if self.partition is not None and self.create_topics.enabled and self.partition >= self.create_topics.partitions:
            problems.append(
                f"partition: {self.partition} does not exist in a topic create_topics makes (create_topics.partitions: "
                f"{self.create_topics.partitions}, numbered from 0); set create_topics.partitions to at least "
                f"{self.partition + 1}, or a lower partition"
            )
        if compacts(self.create_topics.configs.get("cleanup.policy", "")):
            problems.append(
                f"create_topics.configs: cleanup.policy {self.create_topics.configs['cleanup.policy']!r} would log-compact "
                "the events topics it creates: the key is the stream, so compaction keeps only each stream's last message "
                "and deletes the others the broker acknowledged, unannounced; remove it or use delete"
            )
        short = _short_window(self.create_topics.configs, float(self.request_timeout), self.linger_ms)
        if short is not None:
            key, value, floor = short
            problems.append(
                f"create_topics.configs: {key} {value} would make the topics it creates refuse the sink's records (each "
                "is stamped as its write starts, then may wait linger_ms and take up to request_timeout): use "
                f"{floor} or more, or set message.timestamp.type: LogAppendTime"
            )
        if self.state.enabled:
            if not _TOPIC_NAME.fullmatch(self.state.topic):
                problems.append(f"state.topic: {self.state.topic!r} is not a valid Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)")
            if self.state.topic == self.topic:
                problems.append("state.topic: must differ from topic (the state topic is compacted)")
            banned = [f"{{{f}}}" for f in ("type", "epoch") if f"{{{f}" in self.topic]
            if banned:
                problems.append(
                    f"state.enabled: topic may not use {' or '.join(banned)} "
                    "(a head's next offset needs each stream in one partition)"
                )
        if problems:
            raise ValueError("; ".join(problems))

    def servers(self) -> list[str]:
        """The bootstrap servers as a list of host:port."""
        raw = [self.bootstrap_servers] if isinstance(self.bootstrap_servers, str) else self.bootstrap_servers
        return [s.strip() for entry in raw for s in entry.split(",") if s.strip()]


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
    if options.security_protocol.startswith("SASL_") and options.sasl_password is not None:
        # aiokafka takes the SCRAM credentials through the sasl_plain_* arguments too.
        settings.update(
            sasl_mechanism=options.sasl_mechanism,
            sasl_plain_username=options.sasl_username,
            sasl_plain_password=options.sasl_password.reveal(),
        )
    return settings


def ssl_context(options: KafkaOptions) -> ssl.SSLContext | None:
    """The client TLS context for SSL / SASL_SSL (reads the files), else None."""
    if not options.security_protocol.endswith("SSL"):
        return None
    return (options.tls or TlsOptions()).ssl_context()


class _Chunk:
    """One record batch for one partition, and the indexes (into the write) it carries."""

    __slots__ = ("alone", "builder", "indexes", "last", "partition", "topic", "used")

    def __init__(self, builder: Any, topic: str, partition: int, alone: bool) -> None:
        self.builder = builder
        self.topic = topic
        self.partition = partition
        self.alone = alone  # holds a message that must travel alone (it was in a refused batch)
        self.indexes: list[int] = []
        self.used = 0  # bytes of the records appended so far
        self.last: tuple[bytes | None, bytes | None] = (None, None)  # the key and value appended last


class _Last:
    """A stream's last batch acknowledged in a partition per epoch, ``[epoch, seq]`` pairs oldest
    first, for its newest ``EPOCHS_REMEMBERED`` epochs there."""

    __slots__ = ("ends", "stream")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.ends: list[list[int]] = []

    def note(self, epoch: int, seq: int) -> None:
        last = self.ends[-1] if self.ends else None
        if last is None or epoch > last[0]:
            self.ends.append([epoch, seq])
            del self.ends[:-EPOCHS_REMEMBERED]
        elif epoch == last[0] and seq > last[1]:
            last[1] = seq


def _place(topic: str) -> str:
    """``topic`` as a place (see :meth:`KafkaConnector.places`): Kafka refuses a topic whose name
    differs from an existing one's only by '.' against '_' (their metric names collide), so such
    names are one place, shown with '_'."""
    if "." not in topic and "_" not in topic:
        return f"topic {topic!r}"
    return f"topic {topic.replace('.', '_')!r} ('.' and '_' are one to Kafka)"


class KafkaConnector:
    """The kafka sink: see the module docstring for routing and delivery semantics."""

    Options: ClassVar[type[KafkaOptions]] = KafkaOptions
    needs_events: ClassVar[bool] = False  # sends value, key and headers only: raw batches need no decoding
    # positions() says a stream holds nothing only where its partition starts at offset 0 (no
    # record ever deleted there by retention): a stream with a state here and nothing there lost it.
    nothing_held_is_known: ClassVar[bool] = True

    def __init__(self, name: str, options: KafkaOptions, sink: SinkConfig) -> None:
        self.name = name
        self.options = options
        self.sink = sink
        self._where = f"sinks[{name}]"
        self._servers = ",".join(options.servers())
        self._topic = Template(options.topic, f"{self._where}.topic", clean=topic_value, max_length=_TOPIC_MAX)
        self._addresses = frozenset(server_address(s, 9092) for s in options.servers())  # (places, marks)
        # A template with {type} or {epoch} spreads a stream over topics: where it stands cannot be
        # read back (positions), nor checked from a mark (stored_before).
        self._spread = any(f in self._topic.fields for f in ("type", "epoch"))
        problem = topic_template_problem(options.topic)
        if problem is None and self._topic.static and not _TOPIC_NAME.fullmatch(options.topic):
            problem = f"{options.topic!r} is not a valid Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)"
        if problem is not None:
            raise ConfigError([f"{self._where}.topic: {problem}"])
        if options.linger_ms / 1000 > float(sink.retry.write_timeout) / 2:
            # (each write waits the linger before it is sent, then its acks: cut at write_timeout,
            # it is retried, and nothing is ever stored)
            raise ConfigError(
                [
                    f"{self._where}.linger_ms: {options.linger_ms} ms is over half of retry.write_timeout "
                    f"({float(sink.retry.write_timeout):g}s): a write waits the linger before it is sent and must be "
                    "acknowledged within write_timeout; lower linger_ms (the sink's batch.linger usually suffices)"
                ]
            )
        self._timeout = float(options.request_timeout)
        self._max_bytes = int(options.max_batch_bytes)
        self._producer: Any = None
        self._stale = False  # the producer must be replaced before the next write
        self._closed = False
        self._down: str | None = "not connected yet"  # why there is no producer
        self._topic_problem: str | None = None  # a missing / unusable topic, rechecked by health()
        self._denied: str | None = None  # the last write was refused (ACL, broker); cleared by a delivered write
        self._partitions: dict[str, list[int]] = {}  # topic -> partition ids, once checked
        self._routes: dict[tuple[str, bytes], int] = {}  # (topic, key) -> partition
        self._batch_limit: dict[str, int] = {}  # topics whose broker limit is below max_batch_bytes
        self._alone: dict[str, None] = {}  # msg_ids to send one per batch (they were in a refused batch)
        self._refused: dict[str, Permanent] = {}  # msg_id -> why the broker refused it alone
        self._created: set[str] = set()
        self._known: set[str] = set()  # topics this sink found or created: missing later, they were deleted
        # What the broker acknowledged, to tell later whether a topic lost it (deleted, created again):
        # per (topic, partition) the offset after its last record acknowledged.
        self._acked: dict[tuple[str, int], int] = {}
        # per (topic, partition) the offset of the first record this process stored there (see
        # positions_before_run: what it held before, copies this process wrote left out)
        self._own_from: dict[tuple[str, int], int] = {}
        # per (topic, partition) the CRC-32s of the key and the value (-1: none) of the last record
        # acknowledged there: another producer's record found there later replaced it (_check_kept)
        self._acked_last: dict[tuple[str, int], tuple[int, int]] = {}
        # per partition and stream: the last seq acknowledged there in each of its newest epochs (a
        # loss covers each: a crash-looping engine opens several between two writes)
        self._acked_streams: dict[tuple[str, int], dict[str, _Last]] = {}
        # per stream, the events partition its last batch was acknowledged in (stored_through)
        self._stream_tp: dict[str, tuple[str, int]] = {}
        # per stream an earlier run's checkpoint told of (stored_before): (epoch, seq) where it
        # resumes, what follows being sent again (not announced lost)
        self._resent: dict[str, tuple[int, int]] = {}
        self._lost: dict[tuple[str, int], tuple[Stream, int, int, int]] = {}  # (stream key, epoch) -> span (SinkLost)
        self._lost_topics: set[str] = set()  # the topics those spans were lost from
        self.creates_nothing = False  # --check: connect() creates nothing (bridge.connector)
        self.configured_streams: list[Stream] = []  # --check: a templated topic is checked for each one
        types = message_types(sink.granularity)  # those a templated topic is checked for (--check)
        self._types = types if "type" in self._topic.fields else types[:1]
        self._state_lost: set[str] = set()  # streams whose state a lost state topic held (refused: state_lost)
        self._state_unfit: set[str] = set()  # streams told to have a state record too large for the topic
        # The state topic deletes records by retention (its configs, read at connect and at each
        # audit): why, while it does (state writes held, the sink not ready); and the log start
        # offset of each of its partitions as last seen (retention or DeleteRecords moves it up).
        self._state_deletes: str | None = None
        self._state_starts: dict[tuple[str, int], int] = {}
        self._read_back: dict[str, Stream] = {}  # streams whose head read_state found
        # Events topics' configs (cleanup.policy, timestamps) read ahead for several topics in one request (connect,
        # audit), taken by the _prepare_topic that follows; and whether "cannot tell" was logged.
        self._configs_ahead: dict[str, dict[str, str]] = {}  # events topic -> the configs _events_configs reads
        self._policy_unread_told = False
        # Streams whose state the state topic lost records of: told (SinkLost ``states``) at the
        # next write or audit, after their heads are deleted (tombstones: no head says complete).
        self._lost_states: dict[str, Stream] = {}
        self._reader: Any = None  # the consumer positions() reads partitions back with
        self._windows: dict[Any, _Window] = {}  # what it read of each partition
        # The live-block state (state.enabled): see _write_state.
        self.writes_state = options.state.enabled
        self._state_format = StateFormat.for_sink(sink)
        self._state_topic = options.state.topic
        # Where each stream's messages continue in its events partition: per record whose messages
        # were acknowledged but whose state is not written yet (the offset after its last message),
        # and per stream, the ``next`` of the last head written (or read back).
        self._record_next: dict[tuple[str, int, int], int] = {}
        self._stream_next: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"KafkaConnector(name={self.name!r}, servers={self._servers!r}, topic={self.options.topic!r})"

    # -- hooks ----------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Start the producer and check a static topic (``--check``: a templated one for each
        configured stream); NotConnected naming the sink and the servers, or the topic when it is
        missing and will not be created, lacks the ``partition``, may not be written, or is
        log-compacted (:meth:`_check_events_topic`; several topics' policies read in one request)."""
        producer = await self._ensure_producer()
        topics = [t for t in self._topics_to_check() if t not in self._partitions]
        try:
            if len(topics) > 1:
                self._configs_ahead = await self._events_configs(topics)
            for topic in topics:
                await self._prepare_topic(producer, topic)
        finally:
            self._configs_ahead = {}
        if self.writes_state and self._state_topic not in self._partitions:
            await self._prepare_topic(producer, self._state_topic, state=True)

    async def write(self, messages: Sequence[Message]) -> None:
        """Deliver ``messages``; return once the broker acknowledged every one (see the module docstring)."""
        if not messages:
            return
        if self._stale:
            await self._discard()
        producer = await self._ensure_producer()
        self._stale = True  # until this write ends: one cancelled half-way leaves batches behind
        errors: dict[int, ConnectorError] = {}
        offsets: dict[int, int] | None = {} if self.writes_state else None
        chains = await self._build(producer, messages, errors)
        if self._lost_states:
            await self._drop_heads(producer)
        self._raise_lost(stale=False)  # found by _build, or by a health check: before anything is sent
        failed = await self._send_all(producer, chains, messages, errors, offsets)
        self._raise_lost(stale=failed)  # found in the offsets the broker gave (see _acknowledged)
        if offsets is not None:
            failed = await self._write_state(producer, messages, errors, offsets) or failed
        self._stale = failed
        if errors:
            distinct = {id(e): e for e in errors.values()}
            if len(errors) == len(messages) and len(distinct) == 1:
                raise next(iter(distinct.values()))
            raise PartialFailure(errors)
        self._denied = None

    def _raise_lost(self, *, stale: bool) -> None:
        """Raise :class:`SinkLost` for the spans kept by _lose and the streams whose state the state
        topic lost records of (and forget them: the write that follows goes through)."""
        if not self._lost and not self._lost_states:
            return
        spans, topics, states = list(self._lost.values()), sorted(self._lost_topics), list(self._lost_states.values())
        self._lost, self._lost_topics, self._lost_states, self._stale = {}, set(), {}, stale
        what = []
        if spans:
            what.append(
                f"topic(s) {', '.join(map(repr, topics))} no longer hold messages the broker acknowledged (deleted, or "
                f"deleted and created again): {len(spans)} stream(s) lost messages"
            )
        if states:
            what.append(
                f"state topic {self._state_topic!r} deleted records (retention, or DeleteRecords): the state of "
                f"{len(states)} stream(s) is lost"
            )
        raise SinkLost(f"{self._where}: {'; '.join(what)}", spans, states=states)

    async def _drop_heads(self, producer: Any) -> None:
        """Delete the head of each stream whose state the state topic lost records of (a tombstone
        in its partition), so that no bootstrap takes what is left for a complete state while the
        runtime has not written the stream's state again (a clear, incomplete). NotConnected when
        the broker does not take them (the next write or audit tries again)."""
        topic = self._state_topic
        parts = self._partitions.get(topic) or sorted(await producer.partitions_for(topic))
        for stream in list(self._lost_states.values()):
            key = stream.key.encode()
            partition = _PARTITIONER(key, parts, parts)
            try:
                await producer.send_and_wait(topic, None, key=key + b"/" + HEAD.encode(), partition=partition)
            except kafka_errors.KafkaError as exc:
                raise NotConnected(
                    f"{self._where}: cannot delete the head of {stream.key} in state topic {topic!r}: {_describe(exc)}"
                ) from None

    async def close(self) -> None:
        """Stop the producer, dropping what it still holds (the runtime bounds the call); never raises."""
        self._closed = True
        reader, self._reader = self._reader, None
        self._windows.clear()
        if reader is not None:
            try:
                await reader.stop()
            except (kafka_errors.KafkaError, OSError) as exc:
                log.debug("kafka position reader did not stop cleanly", extra={"sink": self.name, "error": _describe(exc)})
        if self._producer is not None:
            try:
                await self._discard()
            except (kafka_errors.KafkaError, OSError) as exc:
                log.warning("kafka producer did not stop cleanly", extra={"sink": self.name, "error": _describe(exc)})
        self._down = "closed"

    async def health(self) -> str | None:
        """None when a broker answers a metadata request, else a short reason.

        Without a producer (never connected, or dropped after an outage) it tries to connect,
        and it re-checks a missing static topic, so an idle sink turns ready again by itself.
        """
        if self._closed:
            return "closed"
        try:
            producer = await self._ensure_producer()
            if self._topic_problem is not None and self._topic.static:
                await self._prepare_topic(producer, self.options.topic)
            if self._topic_problem is not None and self.writes_state:
                await self._prepare_topic(producer, self._state_topic, state=True)
            problem = self._denied or self._topic_problem
            if problem is not None:
                return problem
            if not await internals.ping(producer.client):
                return f"no broker known from {self._servers}"
        except ConnectorError as exc:
            return self._topic_problem or self._down or str(exc)
        except (kafka_errors.KafkaError, OSError) as exc:
            return f"cannot reach {self._servers} ({_describe(exc)})"
        return None

    async def audit(self) -> None:
        """Between writes (bridge.connector, I6): each topic the broker acknowledged messages in
        is looked at as a write prepares it (deleted, or ending before what was acknowledged: lost;
        with ``create`` created again). Raises SinkLost for an events topic's streams; a state
        topic's streams have their next state refused, as at a write. The state topic's configs
        and start offsets are read again: one that deletes records by retention now, or whose
        partitions start later than before (retention, DeleteRecords), lost state: those streams'
        heads are deleted and their state told lost (SinkLost ``states``). An events topic found
        log-compacted now lost what it held of each stream but the last message: its spans are
        raised (SinkLost) and the sink is not ready until the policy is fixed."""
        producer = self._producer
        if producer is None or self._closed:
            return
        topics = sorted({tp[0] for tp in self._acked} | ({self._state_topic} if self._read_back else set()))
        try:
            events = [t for t in topics if not (self.writes_state and t == self._state_topic)]
            if len(events) > 1:
                self._configs_ahead = await self._events_configs(events)
            for topic in topics:
                try:
                    await self._prepare_topic(producer, topic, state=self.writes_state and topic == self._state_topic)
                except NotConnected as exc:
                    if exc.reason not in ("state_topic_deletes", "events_topic_compacted"):
                        raise
        finally:
            self._configs_ahead = {}
        if self._lost_states:
            await self._drop_heads(producer)
        self._raise_lost(stale=self._stale)

    def _mark_crc(self, topic: str) -> int:
        """What a mark of ``topic`` on this cluster carries to name it (see place_crc)."""
        return place_crc(self._addresses, topic)

    def stored_through(self, stream: Stream) -> tuple[int, ...] | None:
        """The mark of the stream's last batch the broker acknowledged (bridge.connector; the
        checkpoint keeps it for the next run's ``stored_before``): its (epoch, seq), its
        partition and the partition's end offset then, a CRC-32 of the topic and the cluster
        (place_crc), the CRC-32s of the key and value of the last record the sink stored in that
        partition (-2: not known), and the last seq of each epoch before (newest first), when its
        topic is one."""
        tp = self._stream_tp.get(stream.key)
        last = self._acked_streams.get(tp, {}).get(stream.key) if tp is not None else None
        end = self._acked.get(tp) if tp is not None else None
        if tp is None or last is None or not last.ends or end is None:
            return None
        epoch, seq = last.ends[-1]
        key_crc, value_crc = self._acked_last.get(tp, (-2, -2))
        return (
            epoch,
            seq,
            tp[1],
            end,
            self._mark_crc(tp[0]),
            key_crc,
            value_crc,
            *(n for e in reversed(last.ends[:-1]) for n in e),
        )

    def stored_before(self, stream: Stream, mark: tuple[int, ...], resume: tuple[int, int] | None) -> None:
        """An earlier run had the broker acknowledge ``stream`` up to ``mark`` (bridge.connector):
        remembered as if this process had written it, so the next write (which looks at the topic
        again first) or audit finds a topic deleted, or created again, since (I6); the span lost
        is announced up to ``resume``, where the stream resumes (what follows is sent again)."""
        if len(mark) < 7 or not len(mark) % 2 or self._spread:
            return
        epoch, seq, partition, end, crc, key_crc, value_crc, *before = mark
        topic = self._topic.render(sample_message(stream))
        if crc != self._mark_crc(topic):
            return  # (another topic's, or another cluster's: the template changed, sinks renamed)
        tp = (topic, partition)
        if stream.key in self._stream_tp or end <= 0:
            return  # (written by this process already: it knows better)
        if end >= self._acked.get(tp, 0) and key_crc != -2:
            self._acked_last[tp] = (key_crc, value_crc)  # (the record there must still be it: _check_kept)
        self._acked[tp] = max(self._acked.get(tp, 0), end)
        last = self._acked_streams.setdefault(tp, {}).setdefault(stream.key, _Last(stream))
        for e, n in [*reversed(list(zip(before[::2], before[1::2], strict=True))), (epoch, seq)]:
            last.note(e, n)
        self._stream_tp[stream.key] = tp
        if resume is not None:
            self._resent[stream.key] = resume
        self._known.add(topic)  # (deleted since: not auto-created by a metadata request, as in a run)
        self._partitions.pop(topic, None)  # the next write looks at it again, before it sends

    def _topic_clash(self, topic: str, others: Iterable[str]) -> str | None:
        """Why events topic ``topic`` cannot be written beside the sink's other topics (None: it
        can): it is the sink's own state topic (compacted: events there are deleted), or it and
        another differ only by '.' against '_', which Kafka refuses as colliding topic names."""
        if self.writes_state and topic == self._state_topic:
            return (
                f"the topic template {self.options.topic!r} renders {topic!r}, the sink's state topic, "
                "which is compacted and would delete events; change topic or state.topic"
            )
        folded = topic.replace(".", "_")
        for other in [*others, *([self._state_topic] if self.writes_state else [])]:
            if other != topic and other.replace(".", "_") == folded:
                return (
                    f"topics {other!r} and {topic!r} differ only by '.' and '_', which Kafka refuses "
                    "as colliding names: rename one of the two sources, or change the topic template"
                )
        return None

    def _collides(self, topic: str, detail: str) -> StreamRefused:
        """Kafka refuses to create events topic ``topic``, a valid name: it collides with a topic
        whose name differs only by '.' and '_' (another sink's or another writer's: the sink's own
        are refused before, see _topic_clash). Its streams are refused for the run, not the sink."""
        return StreamRefused(
            f"{self._where}: Kafka refuses to create topic {topic!r} ({detail}): a topic whose name differs only by "
            "'.' and '_' exists (another sink's?); rename the source, or change the topic template",
            reason="topic_clash",
        )

    def conflicts(self, streams: Sequence[Stream]) -> list[str]:
        """What the configured ``streams`` make impossible before a run (see bridge.connector): an
        events topic that is the state topic, or two topics Kafka takes for one."""
        topics = (
            rendered(self._topic.render, self._topic, streams, self._types)[1:]
            if not self._topic.static
            else [self.options.topic]
        )
        lines = [why for n, t in enumerate(topics) if (why := self._topic_clash(t, topics[:n])) is not None]
        return list(dict.fromkeys(lines))

    def places(self, streams: Sequence[Stream]) -> list[tuple[frozenset[str], str]]:
        """The topics it writes, on its cluster (see bridge.connector: two sinks may not share one)."""
        servers = self._addresses
        topics = rendered(self._topic.render, self._topic, streams, self._types)
        topics += [self._state_topic] if self.writes_state else []
        return [(servers, _place(t)) for t in topics]

    async def positions(self, streams: Sequence[Stream]) -> dict[str, SinkPosition | None]:
        """The last message of each stream in its partition (``checkpoint.from_sinks``).

        A partition holds many streams, so it is read backward from its end in chunks of
        :data:`_SCAN_CHUNK` records, once for every stream wanted in it, until each has its last
        message, the partition's start (the rest hold nothing when that start is offset 0; when it
        is above 0, records were deleted there, the rest's among them perhaps: they cannot tell), or
        ``position_scan`` records (the rest cannot tell). A message counts when its key is the stream's and its headers name the
        stream. A stream its partition holds nothing of is looked for in the partitions its key went
        to while the topic had fewer (partitions added since): found there, or not known not to be,
        it cannot tell. A topic that does not exist (deleted, not created yet) holds nothing. A
        topic template with ``{type}`` or ``{epoch}`` spreads a stream over topics: cannot tell."""
        if self._spread:
            return {}
        producer = self._producer  # started by connect(); not here, beside the sink's own reconnects
        if producer is None:
            raise NotConnected(f"{self._where}: not connected to {self._servers}")
        wanted, missing = await self._wanted(producer, streams)
        consumer = self._reader
        if consumer is None:
            # Kept for later calls (discovery asks source by source) until close().
            consumer = self._reader = await self._start_reader()
        try:
            out: dict[str, SinkPosition | None] = {s.key: None for ss in missing.values() for s in ss}
            await self._scan_all(consumer, wanted, out)
            # A stream its partition holds nothing of may sit in the one its key went to before
            # partitions were added: found there, or not known not to be, it cannot tell.
            for where, ks in self._earlier_partitions(wanted, out).items():
                nothing = {k: s for k, s in ks.items() if s.key in out and out[s.key] is None}
                if not nothing:
                    continue
                seen: dict[str, SinkPosition | None] = {}
                await self._scan_all(consumer, {where: nothing}, seen)
                for s in nothing.values():
                    if s.key not in seen or seen[s.key] is not None:
                        del out[s.key]
            return out
        except BaseException:
            self._reader = None  # cancelled (timed out) or failed half-way: start over next time
            self._windows.clear()
            await consumer.stop()
            raise

    async def positions_before_run(self, streams: Sequence[Stream]) -> dict[str, SinkPosition | None]:
        """What the sink holds of each stream, its copies left out: a topic keeps the copies a
        replay after a restart sends again, so the last message of a stream (:meth:`positions`)
        can be a copy this process wrote, below what the topic held (bridge.sink asks this before
        announcing a dropped span). In a partition this process wrote, the later of that last
        message (another pod's records count too) and the last one below this process's first
        record there. The partitions the stream's key went to while the topic had fewer (partitions
        added since) may hold later ones, written before the partition that took the key away was
        added: each is read back from the first record of that partition (by timestamp, plus
        ``_CLOCK_SKEW_MS``), and skipped when that record is older than the latest message found
        (less ``_CLOCK_SKEW_MS``); the latest message of them all is taken. Read with a consumer of
        its own (bounded by the caller), at most ``position_scan`` records back in each partition."""
        out = await self.positions(streams)
        producer = self._producer
        if self._spread or producer is None:
            return out
        wanted, _missing = await self._wanted(producer, streams)
        # (a partition this process did not write reads from its end, as in positions: again only
        # for a stream positions could not tell of, whose older partitions it does not read)
        asked = {
            tp: ks if tp in self._own_from else {k: s for k, s in ks.items() if s.key not in out} for tp, ks in wanted.items()
        }
        asked = {tp: ks for tp, ks in asked.items() if ks}
        if not asked:
            return out
        below: dict[str, SinkPosition | None] = {}
        consumer = await self._start_reader()
        firsts: dict[tuple[str, int], int | None] = {}

        async def added_at(topic: str, index: int) -> int | None:
            """The timestamp of the first record partition ``index`` holds (it existed then)."""
            if (topic, index) not in firsts:
                firsts[(topic, index)] = await _first_stamp(consumer, TopicPartition(topic, index))
            return firsts[(topic, index)]

        try:
            for (topic, partition), ks in asked.items():
                found, nothing, stamps = await self._last_below(consumer, topic, partition, ks)
                for key, stream in ks.items():
                    best, stamp = found.get(stream.key), stamps.get(key)
                    unknown = best is None and key not in nothing
                    older = self._older_partitions(topic, key, partition)
                    for other in reversed(older):  # (newest first)
                        # The key went there while the topic had up to max(counts) partitions:
                        # until partition max(counts) was added.
                        added = await added_at(topic, max(older[other]))
                        if added is not None and stamp is not None and added < stamp - _CLOCK_SKEW_MS:
                            continue  # (added before the latest message found: nothing later there)
                        until = None if added is None else added + _CLOCK_SKEW_MS
                        there, none, at = await self._last_below(consumer, topic, other, {key: stream}, until)
                        pos = there.get(stream.key)
                        if pos is not None and (best is None or pos.holds_more_than(best)):
                            best, stamp = pos, at[key]
                        unknown = unknown or (pos is None and key not in none)
                    if best is not None or not unknown:  # (else cannot tell: left as positions said)
                        below[stream.key] = best
        finally:
            await consumer.stop()
        return held_before_run(out, below)

    async def _last_below(
        self, consumer: Any, topic: str, partition: int, ks: dict[bytes, Stream], until: int | None = None
    ) -> tuple[dict[str, SinkPosition], dict[bytes, Stream], dict[bytes, int]]:
        """The last message of each of ``ks`` in one partition, below this process's first record
        there (its end when it wrote none) and, with ``until`` (a timestamp, ms), below the first
        record stamped from then on; those it holds nothing of (read back to offset 0), and the
        found messages' timestamps. The rest, past ``position_scan``, cannot tell."""
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        begin = (await consumer.beginning_offsets([tp]))[tp]
        hi = self._own_from.get((topic, partition))
        if hi is None:
            hi = (await consumer.end_offsets([tp]))[tp]
        if until is not None and (later := (await consumer.offsets_for_times({tp: until}))[tp]) is not None:
            hi = min(hi, later.offset)
        lo, left, found, stamps = hi, dict(ks), {}, {}
        while left and lo > begin and hi - lo < self.options.position_scan:
            top, lo = lo, max(begin, lo - _SCAN_CHUNK)
            at: dict[bytes, int] = {}
            for key, (source, rank, position) in (await _read(consumer, tp, lo, top, at)).items():
                stream = left.pop(key, None)
                ours = stream is not None and source == stream.source and rank == str(stream.dp_rank)
                if stream is not None and ours and position is not None:
                    found[stream.key], stamps[key] = position, at[key]
        return found, (left if lo <= begin == 0 else {}), stamps

    async def _wanted(
        self, producer: Any, streams: Sequence[Stream]
    ) -> tuple[dict[tuple[str, int], dict[bytes, Stream]], dict[str, list[Stream]]]:
        """Each stream's (topic, partition), and the topics that do not exist (their streams hold
        nothing)."""
        wanted: dict[tuple[str, int], dict[bytes, Stream]] = {}
        missing: dict[str, list[Stream]] = {}
        for stream in streams:
            probe = sample_message(stream)
            topic = self._topic.render(probe)
            if topic in missing:
                missing[topic].append(stream)
                continue
            if topic not in self._partitions:
                try:
                    await self._prepare_topic(producer, topic)
                except NotConnected as exc:
                    if exc.reason not in ("unknown_topic", "topic_deleted"):
                        raise
                    missing[topic] = [stream]
                    continue
            parts = self._partitions[topic]
            key = stream.key.encode()
            fixed = self.options.partition
            partition = fixed if fixed is not None else _PARTITIONER(key, parts, parts)
            wanted.setdefault((topic, partition), {})[key] = stream
        return wanted, missing

    def _earlier_partitions(
        self, wanted: dict[tuple[str, int], dict[bytes, Stream]], out: dict[str, SinkPosition | None]
    ) -> dict[tuple[str, int], dict[bytes, Stream]]:
        """Of the streams ``wanted`` whose partition holds nothing (None in ``out``), the other
        partitions their key went to while the topic had fewer (none with a fixed ``partition``)."""
        earlier: dict[tuple[str, int], dict[bytes, Stream]] = {}
        for (topic, partition), ks in wanted.items():
            for key, s in ks.items():
                if out.get(s.key, 0) is not None:
                    continue
                for older in self._older_partitions(topic, key, partition):
                    earlier.setdefault((topic, older), {})[key] = s
        return earlier

    def _older_partitions(self, topic: str, key: bytes, partition: int) -> dict[int, list[int]]:
        """The partitions other than ``partition`` that ``key`` went to while ``topic`` had fewer
        (none with a fixed ``partition``), oldest first, each with the partition counts it went
        there at."""
        out: dict[int, list[int]] = {}
        if self.options.partition is not None:
            return out
        parts = self._partitions[topic]
        for n in range(1, len(parts)):
            if (o := _PARTITIONER(key, parts[:n], parts[:n])) != partition:
                out.setdefault(o, []).append(n)
        return out

    async def _scan_all(
        self, consumer: Any, wanted: dict[tuple[str, int], dict[bytes, Stream]], out: dict[str, SinkPosition | None]
    ) -> None:
        """:meth:`_scan` of each (topic, partition) of ``wanted``, its answers into ``out``."""
        if not wanted:
            return
        tps = [TopicPartition(t, p) for t, p in wanted]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        begins = await consumer.beginning_offsets(tps)
        for tp in tps:
            out.update(await self._scan(consumer, tp, begins[tp], ends[tp], wanted[(tp.topic, tp.partition)]))

    async def _scan(
        self, consumer: Any, tp: Any, begin: int, end: int, wanted: dict[bytes, Stream]
    ) -> dict[str, SinkPosition | None]:
        """The last message of each wanted stream in one partition (see :meth:`positions`).

        What was read of the partition is kept (:class:`_Window`): a later call reads only the
        records written since, then further back if a stream is not found yet, so discovery asking
        source by source reads each record of a partition at most once."""
        window = self._windows.get(tp)
        if window is None or window.hi > end or window.lo < begin or end - window.hi > self.options.position_scan:
            window = self._windows[tp] = _Window(end)  # new, truncated or too far behind: start at the end
        if end > window.hi:  # written since the last call: newer than anything kept
            window.last.update(await _read(consumer, tp, window.hi, end))
            window.hi = end
        out: dict[str, SinkPosition | None] = {}
        left = {k: s for k, s in wanted.items() if k not in window.last}
        while left and window.lo > begin and window.hi - window.lo < self.options.position_scan:
            lo = max(begin, window.lo - min(_SCAN_CHUNK, self.options.position_scan - (window.hi - window.lo)))
            for key, older in (await _read(consumer, tp, lo, window.lo)).items():
                window.last.setdefault(key, older)  # what a later record said stands
                left.pop(key, None)
            window.lo = lo
        for key, stream in wanted.items():
            found = window.last.get(key)
            if found is None:
                if window.lo <= begin == 0:
                    out[stream.key] = None  # read back to the partition's first record ever: holds nothing
                # Past position_scan, or back to a start above offset 0 (records deleted by retention
                # or DeleteRecords, the stream's among them perhaps): cannot tell.
                continue
            source, rank, position = found
            if source == stream.source and rank == str(stream.dp_rank) and position is not None:
                out[stream.key] = position
        return out

    async def read_state(self, streams: Sequence[Stream]) -> dict[str, tuple[Head, list[SeedEntry]] | None]:
        """The state this sink holds of each stream (a restarted bridge rebuilds its tables from it).

        Reads the state topic's partitions of ``streams`` from their start to the end offsets taken
        first, keeping each stream's records up to its last head (:class:`StateLog`: the exact cut
        of that head; records after it are a state write a crash cut short, which the bridge
        writes again). ``{stream.key: None}`` for a stream with no head; no entry for one whose
        head cannot be read. Bounded by the runtime (``state.load_timeout``)."""
        if not self.writes_state or not streams:
            return {}
        producer = self._producer  # started by connect()
        if producer is None:
            raise NotConnected(f"{self._where}: not connected to {self._servers}")
        topic = self._state_topic
        if topic not in self._partitions:
            await self._prepare_topic(producer, topic, state=True)
        parts = self._partitions[topic]
        tps = sorted({TopicPartition(topic, _PARTITIONER(s.key.encode(), parts, parts)) for s in streams})
        log = StateLog(s.key for s in streams)
        consumer = await self._start_reader()
        try:
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            begins = await consumer.beginning_offsets(tps)
            for tp in tps:
                await read_log(consumer, tp, begins[tp], ends[tp], log)
        finally:
            await consumer.stop()
        out: dict[str, tuple[Head, list[SeedEntry]] | None] = {}
        for stream in streams:
            raw, values = log.cut(stream.key)
            if raw is None:
                out[stream.key] = None
                continue
            doc = parse(raw)
            seed = None if doc is None else seed_of(doc, [d for v in values if (d := parse(v)) is not None])
            if doc is None or seed is None:
                continue  # a damaged head: cannot tell
            if type(doc.get("next")) is int:
                self._stream_next.setdefault(stream.key, doc["next"])
            self._read_back[stream.key] = stream
            out[stream.key] = seed
        return out

    async def _offsets(self, tps: list[Any], *, start: bool) -> dict[Any, int]:
        """Each partition's start (``start``) or end offset, read by a reader of its own."""
        consumer = await self._start_reader()
        try:
            offsets: dict[Any, int] = await (consumer.beginning_offsets(tps) if start else consumer.end_offsets(tps))
            return offsets
        finally:
            await consumer.stop()

    async def _start_reader(self) -> AIOKafkaConsumer:
        """A started consumer of the sink's cluster that reads partitions it is assigned (no group)."""
        consumer = AIOKafkaConsumer(
            **client_settings(self.options, self.name),
            ssl_context=ssl_context(self.options),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        internals.no_auto_create(consumer._client)
        await consumer.start()
        return consumer

    # -- the write path -------------------------------------------------------------------------
    async def _build(self, producer: Any, messages: Sequence[Message], errors: dict[int, ConnectorError]) -> list[list[_Chunk]]:
        """Route every message and append it to its partition's record batches.

        Returns the chain of batches of every (topic, partition), in first-seen order. Messages
        that cannot be sent (too large, topic unusable) are put in ``errors`` instead.
        """
        chains: dict[tuple[str, int], list[_Chunk]] = {}
        topics: dict[str, ConnectorError | None] = {}  # why a topic cannot be written in this write
        fixed, routes, template = self.options.partition, self._routes, self._topic
        static = template.text if template.static else None
        refused, alone, max_bytes, batch_limit = self._refused, self._alone, self._max_bytes, self._batch_limit
        record: Any = None
        key = b""
        topic = ""
        chain: list[_Chunk] = []
        limit = max_bytes
        stops = Stops(self._where)
        for i, m in enumerate(messages):
            if m.type == STATE_TYPE:
                continue  # written once the messages before it are stored (_write_state)
            if (held := stops.past(m)) is not None:
                errors[i] = held
                continue
            new_topic = static if static is not None else template.render(m)
            if m.record is not record or new_topic != topic:
                # The messages of one record are consecutive: routing is done once per record
                # (and again where a template gives one of its messages another topic).
                topic = new_topic
                problem = topics[topic] if topic in topics else topics.setdefault(topic, await self._check_topic(producer, topic))
                if problem is not None:
                    record = None  # route again at the next message
                    errors[i] = problem
                    continue
                record, key = m.record, m.key
                if fixed is not None:
                    partition = fixed
                elif (partition := routes.get((topic, key), -1)) < 0:
                    parts = self._partitions[topic]
                    partition = routes[(topic, key)] = _PARTITIONER(key, parts, parts)
                chain = chains.setdefault((topic, partition), [])
                limit = batch_limit.get(topic, max_bytes)
            # (a batch refused for itself once is dead-lettered: not sent again; an announcement is
            # kept and retried until the broker takes it: sent each time)
            if refused and m.record.kind == "batch" and (problem := refused.get(m.msg_id)) is not None:
                errors[i] = problem
                stops.refused(m)
                continue
            headers = m.header_items()
            value = m.value
            size = len(value) + len(key)  # the headers add ~150 bytes; exact near the limit only
            if size + _HEADROOM > max_bytes and (size := internals.record_size(key, value, headers)) > max_bytes:
                errors[i] = Permanent(
                    f"{self._where}: message {m.msg_id} is {size} bytes, more than max_batch_bytes ({max_bytes})",
                    reason="too_large",
                )
                stops.refused(m)
                continue
            solo = bool(alone) and m.msg_id in alone
            if not chain or solo or chain[-1].alone or chain[-1].used + size > limit:
                chain.append(_Chunk(producer.create_batch(), topic, partition, solo))
            chunk = chain[-1]
            appended = chunk.builder.append(timestamp=None, key=key, value=value, headers=headers)
            if appended is None:  # aiokafka's exact bound (max_batch_bytes) is reached
                chunk = _Chunk(producer.create_batch(), topic, partition, solo)
                chain.append(chunk)
                appended = chunk.builder.append(timestamp=None, key=key, value=value, headers=headers)
            chunk.used += appended.size
            chunk.last = (key, value)
            chunk.indexes.append(i)
        return list(chains.values())

    async def _send_all(
        self,
        producer: Any,
        chains: list[list[_Chunk]],
        messages: Sequence[Message],
        errors: dict[int, ConnectorError],
        offsets: dict[int, int] | None,
    ) -> bool:
        """Send every partition's chain (partitions in parallel); True when a batch failed."""
        if not chains:
            return False
        if len(chains) == 1:
            return await self._send(producer, chains[0], messages, errors, offsets)
        async with asyncio.TaskGroup() as group:
            sends = [group.create_task(self._send(producer, chain, messages, errors, offsets)) for chain in chains]
        return any(s.result() for s in sends)

    async def _send(
        self,
        producer: Any,
        chain: list[_Chunk],
        messages: Sequence[Message],
        errors: dict[int, ConnectorError],
        offsets: dict[int, int] | None,
    ) -> bool:
        """Send one partition's batches in order, each once the previous one was acknowledged;
        ``offsets`` (when given) gets the offset of each message stored.

        After a failed batch the rest of the chain is not sent (reported transient). True when a
        batch failed.
        """
        for n, chunk in enumerate(chain):
            try:
                stored = await (await producer.send_batch(chunk.builder, chunk.topic, partition=chunk.partition))
                self._acknowledged(chunk, stored.offset, messages, state=False)
                if offsets is not None:  # the records of a batch take consecutive offsets from its base
                    offsets.update((i, stored.offset + j) for j, i in enumerate(chunk.indexes))
            except kafka_errors.KafkaError as exc:
                error = self._error(exc, chunk.topic) or self._refused_batch(exc, chunk, messages)
                errors.update(dict.fromkeys(chunk.indexes, error))
                if n + 1 < len(chain):
                    held = Retriable(
                        f"{self._where}: not sent, after a failed batch for {chunk.topic}[{chunk.partition}]: {error}",
                        reason="not_sent",
                    )
                    errors.update((i, held) for later in chain[n + 1 :] for i in later.indexes)
                return True
        return False

    # -- the live-block state (state.enabled) ----------------------------------------------------
    async def _write_state(
        self, producer: Any, messages: Sequence[Message], errors: dict[int, ConnectorError], offsets: dict[int, int]
    ) -> bool:
        """The second step of a write: the state of each record, now that the messages before it
        are stored; True when a batch failed.

        A record's state goes to the state topic's partition of its stream, in order: for a clear,
        a tombstone for each key the clear removed (``delta.cleared``), then each change (count 0:
        a tombstone), then the head, whose ``next`` is the offset after the record's last message
        in its events partition (``offsets``, or remembered from the write that stored them), or
        the last head's when the record wrote none. A state message is not written when a message
        of its stream before it failed transiently (the runtime writes it again from there); when
        its write fails, the state messages of its partition after it are not sent either (the
        state is never ahead of its head's order). Failures are transient, never Permanent, but for a
        state record larger than a batch of the topic holds (``state_too_large``, see _state_too_large)."""
        record_next = self._record_next
        for i in sorted(offsets):
            m = messages[i]
            key = (m.record.stream.key, *m.record.position)
            record_next[key] = max(record_next.get(key, 0), offsets[i] + 1)
        while len(record_next) > _MEMORY:  # records whose state never came (a dropped stream)
            del record_next[next(iter(record_next))]
        blocked: set[str] = set()  # streams with a transient failure earlier in the write
        wanted: list[tuple[int, int | None]] = []  # (index, next) of the state messages to write
        latest: dict[str, int | None] = {}  # per stream, the next of its last head in this write
        for i, m in enumerate(messages):
            stream_key = m.record.stream.key
            if m.type != STATE_TYPE:
                error = errors.get(i)
                if error is not None and not isinstance(error, Permanent):
                    blocked.add(stream_key)
                continue
            if stream_key in blocked:
                errors[i] = Retriable(
                    f"{self._where}: state not written: an earlier message of {stream_key} failed", reason="not_sent"
                )
                continue
            delta = m.record.state
            if not isinstance(delta, StateDelta) or delta.stale:
                record_next.pop((stream_key, *m.record.position), None)
                continue  # a record the state already reflects (a re-delivery): nothing to write
            next_ = record_next.get((stream_key, *m.record.position))
            if next_ is None:  # the record wrote no message: where the stream's last head said
                next_ = latest[stream_key] if stream_key in latest else self._stream_next.get(stream_key)
            latest[stream_key] = next_
            wanted.append((i, next_))
        if not wanted:
            return False
        topic = self._state_topic
        problem = await self._check_topic(producer, topic, state=True)
        if problem is not None:
            held = problem if not isinstance(problem, Permanent) else Retriable(str(problem), reason=problem.reason)
            errors.update((i, held) for i, _ in wanted)
            return False
        wanted = self._refuse_lost_state(messages, wanted, errors)
        if not wanted:
            return False
        parts = self._partitions[topic]
        limit = self._batch_limit.get(topic, self._max_bytes)
        chains: dict[int, list[_Chunk]] = {}
        unfit: dict[str, Permanent] = {}  # streams with a state record no batch of the topic can hold
        built = 0
        for i, next_ in wanted:
            m = messages[i]
            refused = unfit.get(m.record.stream.key)
            if refused is not None:  # built on the refused one: not written either
                errors[i] = refused
                continue
            partition = _PARTITIONER(m.key, parts, parts)
            chain = chains.setdefault(partition, [])
            for name, value in self._state_records(m.record.stream, m.record.state, next_):
                built += 1
                if not built % _YIELD_EVERY:
                    await asyncio.sleep(0)  # a clear of 10^5 keys: let the other streams' work run between
                size = len(name) + (len(value) if value is not None else 0) + _RECORD_OVERHEAD
                if size > limit:
                    # Even alone (an entry already without its fact): sent, it would be refused for
                    # ever and stop the sink (I5). Refused for itself instead: the runtime clears the
                    # stream's state at its next record (incomplete until the engine's next reset).
                    errors[i] = unfit[m.record.stream.key] = self._state_too_large(m.record.stream, name, value, size, limit)
                    break
                if not chain or chain[-1].used + size > limit:
                    chain.append(_Chunk(producer.create_batch(), topic, partition, False))
                chunk = chain[-1]
                if chunk.builder.append(timestamp=None, key=name, value=value, headers=[]) is None:
                    chunk = _Chunk(producer.create_batch(), topic, partition, False)
                    chain.append(chunk)
                    chunk.builder.append(timestamp=None, key=name, value=value, headers=[])
                chunk.used += size
                chunk.last = (name, value)
                if not chunk.indexes or chunk.indexes[-1] != i:
                    chunk.indexes.append(i)
        sends = list(chains.values())
        if len(sends) == 1:
            failed = await self._send_state(producer, sends[0], messages, errors)
        else:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._send_state(producer, chain, messages, errors)) for chain in sends]
            failed = any(t.result() for t in tasks)
        self._refuse_lost_state(messages, wanted, errors)  # a state partition found created again
        for i, next_ in wanted:
            if i not in errors:
                m = messages[i]
                record_next.pop((m.record.stream.key, *m.record.position), None)
                if next_ is not None:
                    self._stream_next[m.record.stream.key] = next_
        return failed

    def _refuse_lost_state(
        self, messages: Sequence[Message], wanted: list[tuple[int, int | None]], errors: dict[int, ConnectorError]
    ) -> list[tuple[int, int | None]]:
        """Refuse the state messages in ``wanted`` of streams whose state the state topic lost
        (deleted, created again): ``Permanent(reason="state_lost")``, so that the runtime clears
        each stream at its next record (a new generation, incomplete), which writes its state
        whole again. Every state message of such a stream in the write: none may build on what is
        gone. Returns the rest of ``wanted``."""
        lost = {messages[i].record.stream.key for i, _ in wanted} & self._state_lost if self._state_lost else set()
        if not lost:
            return wanted
        self._state_lost -= lost
        refused = Permanent(
            f"{self._where}: state topic {self._state_topic!r} was deleted or created again: the state it held is lost",
            reason="state_lost",
        )
        errors.update((i, refused) for i, _ in wanted if messages[i].record.stream.key in lost)
        return [w for w in wanted if w[0] not in errors]

    def _state_too_large(self, stream: Stream, key: bytes, value: bytes | None, size: int, limit: int) -> Permanent:
        """The refusal of a state record of ``size`` bytes (``key``, ``value``) above ``limit``,
        the bytes of records a batch of the state topic holds; logged once per stream."""
        what = "tombstone" if value is None else "head" if key.endswith(b"/" + HEAD.encode()) else "entry"
        fix = (
            f"raise the state topic's max.message.bytes above {size + _BATCH_OVERHEAD} (kafka-configs --alter "
            f"--entity-type topics --entity-name {self._state_topic} --add-config max.message.bytes=1048588)"
        )
        if stream.key not in self._state_unfit:
            self._state_unfit.add(stream.key)
            log.error(
                "a state %s of %d bytes is larger than a batch of the state topic may hold (%d bytes): not written; "
                "the stream's state is cleared and marked incomplete, its events keep flowing; %s",
                what,
                size,
                limit,
                fix,
                extra={"sink": self.name, "stream": stream.key, "topic": self._state_topic},
            )
        return Permanent(
            f"{self._where}: state {what} of {stream.key} is {size} bytes, over the {limit} a batch of state topic "
            f"{self._state_topic!r} holds; {fix}",
            reason="state_too_large",
        )

    def _state_records(self, stream: Stream, delta: StateDelta, next_: int | None) -> Iterator[tuple[bytes, bytes | None]]:
        """(key, value) of the state records of one delta, in their order (see _write_state)."""
        prefix = f"{stream.key}/"
        fmt, head = self._state_format, delta.head
        if delta.clear:
            for tier in delta.cleared:
                base = f"{prefix}{tier_text(tier.medium, tier.group_idx)}/"
                for block in tier.blocks:
                    yield f"{base}{block:016x}".encode(), None
        room = self._batch_limit.get(self._state_topic, self._max_bytes) - _RECORD_OVERHEAD
        for change in delta.changes:
            key = (prefix + entry_key(change.medium, change.group_idx, change.block)).encode()
            if change.count <= 0:
                yield key, None
                continue
            value = fmt.entry(stream, head, change)
            if len(key) + len(value) > room:
                # A fact too large for a record (a long prompt, huge extra_keys): the entry without
                # it (its count and version stand) rather than a sink stuck on a state it can never
                # write. The room is the state topic's max.message.bytes (read at connect, or
                # learnt from a refused batch) within max_batch_bytes.
                log.warning(
                    "state entry larger than a state topic record may be (max.message.bytes, max_batch_bytes: %d): "
                    "written without its fact",
                    room,
                    extra={"sink": self.name, "stream": stream.key, "count": len(value)},
                )
                value = fmt.entry(stream, head, EntryChange(change.medium, change.group_idx, change.block, change.count, None))
            yield key, value
        yield (prefix + HEAD).encode(), fmt.head(stream, head, next_)

    async def _send_state(
        self, producer: Any, chain: list[_Chunk], messages: Sequence[Message], errors: dict[int, ConnectorError]
    ) -> bool:
        """Send one state partition's batches in order, each once the previous one was
        acknowledged; after a failed batch, the rest is not sent. True when a batch failed."""
        for n, chunk in enumerate(chain):
            try:
                stored = await (await producer.send_batch(chunk.builder, chunk.topic, partition=chunk.partition))
                self._acknowledged(chunk, stored.offset, messages, state=True)
            except kafka_errors.KafkaError as exc:
                error = self._error(exc, chunk.topic)
                if error is None:  # the broker refused the records (too large for the topic?)
                    if isinstance(exc, _SIZE_ERRORS):
                        # Below what was refused (never back above the topic's real limit: a batch
                        # as large would be refused for ever), and its max.message.bytes read
                        # again before the next state write (_check_state_topic lowers it to that).
                        limit = self._batch_limit.get(chunk.topic, self._max_bytes)
                        floor = min(_STATE_BATCH_MIN, chunk.used - 1)
                        self._batch_limit[chunk.topic] = max(floor, min(limit, chunk.used) // 2)
                        self._partitions.pop(chunk.topic, None)
                    error = Retriable(
                        f"{self._where}: state topic {chunk.topic!r} refused a batch ({_describe(exc)})", reason="state_refused"
                    )
                elif isinstance(error, Permanent):  # the state is never dead-lettered
                    error = Retriable(str(error), reason=error.reason)
                errors.update((i, error) for later in chain[n:] for i in later.indexes)
                return True
        return False

    def _error(self, exc: kafka_errors.KafkaError, topic: str) -> ConnectorError | None:
        """The bridge error for an aiokafka failure on ``topic``; None when the broker refused the
        records themselves (see _refused_batch)."""
        text = _describe(exc)
        if isinstance(exc, _AUTHORIZATION):
            self._denied = f"not authorized to write to topic {topic!r} ({text})"
            return Retriable(f"{self._where}: {self._denied}", reason="unauthorized")
        if isinstance(exc, kafka_errors.InvalidTopicError):
            return Permanent(f"{self._where}: invalid topic {topic!r} ({text})", reason="invalid_topic")
        if isinstance(exc, kafka_errors.UnknownTopicOrPartitionError):
            self._partitions.pop(topic, None)  # check it again (and explain) on the next write
            return NotConnected(f"{self._where}: topic {topic!r} is unknown to the broker ({text})", reason="unknown_topic")
        if isinstance(exc, _UNREACHABLE):
            return NotConnected(f"{self._where}: cannot reach {self._servers} ({text})")
        if isinstance(exc, _RECORDS_REFUSED):
            return None
        fix = _BROKER_REFUSES.get(type(exc))
        if fix is not None:
            if isinstance(exc, kafka_errors.InvalidTimestampError):
                self._partitions.pop(topic, None)  # its configs read again at the next write: a short window is named
            self._denied = f"topic {topic!r} refuses every write ({text}): {fix}"
            return Retriable(f"{self._where}: {self._denied}", reason="broker_refuses")
        # Anything else (the producer's sequence state, a broker setting) is not the records'
        # fault: retried, with a new producer.
        return Retriable(f"{self._where}: {text}", reason="producer_reset")

    def _refused_batch(self, exc: kafka_errors.KafkaError, chunk: _Chunk, messages: Sequence[Message]) -> ConnectorError:
        """The broker refused ``chunk`` (too large for the topic, an invalid record...).

        It cannot say which record, so the records of a larger batch are retried one per batch;
        a record refused alone is permanent, and refused before sending next time (the runtime
        may retry it with others, whose batch it would break again).
        """
        text, topic, too_large = _describe(exc), chunk.topic, isinstance(exc, _SIZE_ERRORS)
        ids = [messages[i].msg_id for i in chunk.indexes]
        if len(ids) > 1:
            if too_large:  # the topic's max.message.bytes is below max_batch_bytes
                self._batch_limit[topic] = max(1024, min(self._batch_limit.get(topic, self._max_bytes), chunk.used) // 2)
            _remember(self._alone, dict.fromkeys(ids))
            return Retriable(
                f"{self._where}: topic {topic!r} refused a batch of {len(ids)} ({text}); retrying them one by one",
                reason="batch_refused",
            )
        what = "message too large for" if too_large else "message refused by the broker for"
        error = Permanent(
            f"{self._where}: {what} topic {topic!r} ({ids[0]}: {text})", reason="too_large" if too_large else "rejected"
        )
        _remember(self._refused, {ids[0]: error})
        return error

    # -- connection -----------------------------------------------------------------------------
    async def _ensure_producer(self) -> Any:
        if self._producer is None:
            self._closed = False  # connect() or write() after close() starts over
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
        internals.no_auto_create(producer.client)
        internals.pace_metadata_retries(producer.client, _METADATA_RETRY_PAUSE)
        try:
            await producer.start()
        except BaseException as exc:
            await producer.stop()  # also when cancelled: a half-started producer holds connections
            if not isinstance(exc, Exception):
                raise
            cause, reason = await self._diagnose(exc, context)
            self._down = f"cannot connect to {self._servers} ({cause})"
            raise NotConnected(f"{self._where}: {self._down}", reason=reason) from None
        # A new producer knows nothing of earlier topic checks (and has a new producer id).
        self._partitions.clear()
        self._routes.clear()
        return producer

    async def _diagnose(self, exc: BaseException, context: ssl.SSLContext | None) -> tuple[str, str | None]:
        """A short reason for a failed start, and the NotConnected reason when the broker answered
        and refused (``auth``: the credentials or the SASL mechanism, ``tls``: the TLS handshake),
        naming the fix; aiokafka only logs the cause of a failed bootstrap."""
        if not isinstance(exc, kafka_errors.KafkaConnectionError):
            return await self._refusal(exc, context) or (_describe(exc), None)
        try:
            await internals.probe(client_settings(self.options, self.name), context)
        except ConnectionRefusedError:
            return "connection refused", None
        except TimeoutError:
            return f"no answer within {self._timeout:g}s", None
        except ssl.SSLCertVerificationError as probe:
            return f"TLS certificate verification failed: {probe.verify_message}; {_TLS_FIX}", "tls"
        except ssl.SSLError as probe:
            return f"TLS handshake failed: {probe.reason or probe}; {_TLS_FIX}", "tls"
        except OSError as probe:
            return probe.strerror or _describe(probe), None
        except kafka_errors.KafkaError as probe:
            return await self._refusal(probe, context) or (_describe(probe), None)
        return _describe(exc), None

    async def _refusal(self, exc: BaseException, context: ssl.SSLContext | None) -> tuple[str, str] | None:
        """The broker refusing the credentials or the SASL mechanism, naming the fix; else None."""
        o = self.options
        if isinstance(exc, kafka_errors.UnsupportedSaslMechanismError):
            try:
                accepted = await internals.sasl_mechanisms(client_settings(o, self.name), context)
            except (TimeoutError, OSError, kafka_errors.KafkaError) as probe:
                log.debug("%s: reading the broker's SASL mechanisms failed: %s", self._where, _describe(probe))
                accepted = []
            which = f"it accepts {', '.join(accepted)}" if accepted else "see its sasl.enabled.mechanisms"
            return (
                f"the broker does not accept SASL mechanism {o.sasl_mechanism} ({which}): set sasl_mechanism to one it accepts",
                "auth",
            )
        if isinstance(exc, kafka_errors.SaslAuthenticationFailed | kafka_errors.AuthenticationFailedError):
            return (
                f"the broker refuses the credentials ({_describe(exc)}): set sasl_username and sasl_password to a "
                f"user the broker knows for {o.sasl_mechanism}",
                "auth",
            )
        return None

    async def _discard(self) -> None:
        """Stop the producer without waiting for the batches it still holds (they fail)."""
        producer, self._producer, self._stale = self._producer, None, False
        if producer is None:
            return
        self._down = f"reconnecting to {self._servers}"
        internals.fail_pending(producer, kafka_errors.KafkaConnectionError("producer discarded by the kafka sink"))
        await producer.stop()

    # -- topics ---------------------------------------------------------------------------------
    def _topics_to_check(self) -> list[str]:
        """The events topics connect() checks: the static one; with a template, under ``--check``
        only (a run learns its streams later), each configured stream's, for each message type the
        template names (none with ``{epoch}``: the run's epochs are not known before it)."""
        if self._topic.static:
            return [self.options.topic]
        if not self.creates_nothing or "epoch" in self._topic.fields:
            return []
        rendered = (self._topic.render(sample_message(s, t)) for s in self.configured_streams for t in self._types)
        return list(dict.fromkeys(rendered))[:_TOPICS_CHECKED]

    async def _check_topic(self, producer: Any, topic: str, *, state: bool = False) -> ConnectorError | None:
        """None when ``topic`` can be written (checked once per producer, and again when its
        partitions changed), else why not."""
        if not state:
            # (against every other topic once, as the topic is first prepared; after that only
            # against the state topic: not a pass over all topics at each write)
            others = [*self._partitions, *self._known] if topic not in self._partitions else []
            clash = self._topic_clash(topic, others)
            if clash is not None:
                return StreamRefused(f"{self._where}: {clash}", reason="topic_clash")
        parts = self._partitions.get(topic)
        known = producer.client.cluster.partitions_for_topic(topic)
        if parts is not None and (known is None or len(known) != len(parts)):
            # Partitions were added (routes change, as with every client), or the topic is gone
            # from the producer's metadata (deleted?): checked again.
            parts = None
            self._routes = {k: v for k, v in self._routes.items() if k[0] != topic}
        if parts is not None:
            return None
        try:
            await self._prepare_topic(producer, topic, state=state)
        except ConnectorError as exc:
            return exc
        return None

    async def _prepare_topic(self, producer: Any, topic: str, *, state: bool = False) -> None:
        """Make sure ``topic`` exists (creating it if configured) and learn its partitions.

        The state topic (``state``) is never auto-created by the broker: it must be compacted; nor
        is a topic this sink found before (deleted since: created again only with ``create``, with
        its settings). A topic that lost what the broker acknowledged (deleted, created again) has
        its streams' spans kept for the next write to announce (:class:`SinkLost`), or their state
        refused (``state_lost``)."""
        if not _TOPIC_NAME.fullmatch(topic):
            raise Permanent(
                f"{self._where}: {topic!r} is not a valid Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)", reason="invalid_topic"
            )
        create = self.options.state.create if state else self.options.create_topics.enabled
        if create and topic not in self._created and not self.creates_nothing:
            await self._create_topic(topic, state=state)
        # A broker that auto-creates answers "unknown topic" (KRaft) or "leader not available"
        # until the new topic has a leader, so "unknown" is final only after a grace period.
        auto = self.options.allow_auto_create_topics and not state and topic not in self._known
        allow = auto and not self.creates_nothing
        creates = allow or create
        loop = asyncio.get_running_loop()
        grace = loop.time() + min(self._timeout / 2, 5.0)
        recreated = False
        while True:
            try:
                code, operations = await internals.topic_error(producer.client, topic, allow_auto_create=allow) or (None, None)
                if code == 0:
                    if operations is not None and not internals.may(operations, internals.WRITE):
                        self._topic_problem = (
                            f"not authorized to write to {'state ' if state else ''}topic {topic!r}: the broker's ACLs do not "
                            f"let the bridge's principal {self._principal} Write to it, so every write would be refused; "
                            f"grant it (kafka-acls --add --allow-principal {self._principal} --operation Write --topic {topic})"
                        )
                        raise NotConnected(f"{self._where}: {self._topic_problem}", reason="unauthorized")
                    partitions = sorted(await producer.partitions_for(topic))
                    break
            except kafka_errors.KafkaError as exc:
                raise (self._error(exc, topic) or Retriable(f"{self._where}: {_describe(exc)}")) from exc
            late = loop.time() >= grace
            if code == _UNKNOWN_TOPIC and self.creates_nothing and (create or auto):
                if create:  # --check: the run would create it; the broker says whether it could
                    await self._create_topic(topic, state=state, validate_only=True)
                elif (await self._broker_config(producer, "auto.create.topics.enable") or "").lower() == "false":
                    self._topic_problem = (
                        f"topic {topic!r} does not exist on {self._servers} and the broker does not auto-create "
                        "topics (auto.create.topics.enable=false); create it, or set create_topics.enabled: true"
                    )
                    raise NotConnected(f"{self._where}: {self._topic_problem}", reason="unknown_topic")
                if not state and self.options.partition is not None:  # and with how many partitions
                    count = self.options.create_topics.partitions if create else await self._auto_partitions(producer)
                    if count is not None:
                        self._check_partition(topic, list(range(count)), created=True)
                return  # nothing is created here
            if code == _UNKNOWN_TOPIC and topic in self._known:
                self._lose([tp for tp in self._acked if tp[0] == topic], state=state)
                if create and not recreated:  # created again with its settings
                    recreated = True
                    await self._create_topic(topic, state=state)
                    continue
                if not create:
                    fix = "(cleanup.policy=compact), or set state.create: true" if state else "or set create_topics.enabled: true"
                    self._topic_problem = (
                        f"{'state ' if state else ''}topic {topic!r} was deleted on {self._servers}: what it held is "
                        f"lost (announced to its consumers); create it again {fix}"
                    )
                    raise NotConnected(f"{self._where}: {self._topic_problem}", reason="topic_deleted")
            if code == _UNKNOWN_TOPIC and (late or not creates) and allow and not state:
                twin = await self._twin(topic)  # (the broker leaves a colliding name uncreated, saying only "unknown")
                if twin is not None:
                    raise self._collides(topic, f"the broker did not auto-create it: {twin!r} exists")
            if code == _UNKNOWN_TOPIC and (late or not creates):
                why = "the broker did not auto-create it (auto.create.topics.enable=false?)" if allow else "auto-creation is off"
                self._topic_problem = (
                    f"state topic {topic!r} does not exist on {self._servers}; create it (cleanup.policy=compact), "
                    "or set state.create: true"
                    if state
                    else f"topic {topic!r} does not exist on {self._servers} and {why}; "
                    "create it, or set create_topics.enabled: true"
                )
                raise NotConnected(f"{self._where}: {self._topic_problem}", reason="unknown_topic")
            if code == _INVALID_TOPIC and not state:
                raise self._collides(topic, "the broker rejects the name")
            if code == _INVALID_TOPIC:
                raise Permanent(f"{self._where}: the broker rejects topic name {topic!r}", reason="invalid_topic")
            if code == _TOPIC_AUTHORIZATION:
                self._topic_problem = f"not authorized to describe topic {topic!r}"
                raise NotConnected(f"{self._where}: {self._topic_problem}", reason="unauthorized")
            if late and code is None:
                raise NotConnected(f"{self._where}: no broker of {self._servers} answers for topic {topic!r}")
            if late:
                name = kafka_errors.for_code(code).__name__
                raise Retriable(f"{self._where}: metadata for topic {topic!r}: {name}", reason="metadata")
            await asyncio.sleep(0.1)
        if not state:
            self._check_partition(topic, partitions)
        if self.options.acks == "all" and any(tp[0] == topic for tp in self._acked):
            # (With acks 1 the end offset, the high watermark, may trail what the leader acknowledged.)
            await self._check_kept(topic, partitions, state=state)
        self._known.add(topic)
        self._partitions[topic] = partitions
        if self._topic_problem is not None and repr(topic) in self._topic_problem:
            self._topic_problem = None
        if state:
            await self._check_state_topic(topic, partitions)
        else:
            await self._check_events_topic(topic)

    async def _check_events_topic(self, topic: str) -> None:
        """Refuse an events topic that is log-compacted (``compact`` in its ``cleanup.policy``): the
        key is the stream, so the cleaner keeps each stream's last message only and deletes every
        other one the broker acknowledged, with nothing to tell a consumer (I6). NotConnected
        (``events_topic_compacted``) naming the fix, the sink not ready, until it is fixed (read
        again each time the topic is prepared: at each write meanwhile, health check and audit).
        Found so after the sink wrote to it in this run (the policy changed), what it acknowledged
        there is announced lost at the next write (:meth:`_lose`). A policy that cannot be read
        (no DescribeConfigs) lets the topic be used (:meth:`_events_configs`). A timestamp window
        too short for the sink's records is refused too (:meth:`_timestamp_window`)."""
        configs = self._configs_ahead.pop(topic, None)
        if configs is None:
            configs = (await self._events_configs([topic])).get(topic, {})
        policy = configs.get("cleanup.policy")
        if policy is not None and compacts(policy):
            self._lose([tp for tp in self._acked if tp[0] == topic], state=False)
            problem: str | None = (
                f"events topic {topic!r} is log-compacted (cleanup.policy={policy}): its messages are keyed by stream, "
                "so compaction keeps only each stream's last message and deletes every other one the broker "
                "acknowledged, unannounced; set cleanup.policy=delete on it (kafka-configs --alter --entity-type topics "
                f"--entity-name {topic} --add-config cleanup.policy=delete)"
            )
            reason = "events_topic_compacted"
        elif (problem := self._too_small(topic, configs)) is not None:
            reason = "events_topic_too_small"
        else:
            problem, reason = self._timestamp_window(topic, configs), "timestamp_window"
            if problem is None:
                return
            self._denied = None  # (the cause of InvalidTimestamp refusals, if any: named instead)
        self._topic_problem = problem
        self._partitions.pop(topic, None)  # prepared again (its configs read again) before each write to it
        raise NotConnected(f"{self._where}: {problem}", reason=reason)

    def _too_small(self, topic: str, configs: Mapping[str, str]) -> str | None:
        """Why an events topic refuses every record of the sink (its ``max.message.bytes`` below
        the smallest one: the announcement of a refusal, :func:`smallest_record`), or None."""
        limit = configs.get("max.message.bytes")
        if limit is None or not limit.isdigit():
            return None
        smallest = smallest_record(self.sink, self.configured_streams) + _RECORD_OVERHEAD + _BATCH_OVERHEAD
        if int(limit) >= smallest:
            return None
        return (
            f"events topic {topic!r} takes record batches of at most {limit} bytes (max.message.bytes), below the "
            f"{smallest} of the smallest record this sink writes (the EventsLost that "
            "announces a refused batch): every record would be refused, its announcement too; raise it "
            f"(kafka-configs --alter --entity-type topics --entity-name {topic} --add-config max.message.bytes=1048588)"
        )

    async def _events_configs(self, topics: Sequence[str]) -> dict[str, dict[str, str]]:
        """The ``cleanup.policy`` and timestamp settings (``_TIMESTAMP_CONFIGS``) of each of the
        events ``topics`` the broker describes, in one DescribeConfigs request bounded by
        ``request_timeout``. A broker or an ACL that refuses it cannot tell: the topics are used all
        the same (an events topic needs no DescribeConfigs ACL), and that it cannot tell is logged
        once per sink."""
        configs: dict[str, dict[str, str]] = {}
        unread: list[str] = []
        admin = self._admin()
        try:
            async with asyncio.timeout(self._timeout):
                await admin.start()
                wanted = dict.fromkeys(("cleanup.policy", "max.message.bytes", *_TIMESTAMP_CONFIGS))
                resources = [ConfigResource(ConfigResourceType.TOPIC, t, wanted) for t in topics]
                responses = await admin.describe_configs(resources)
            for res in (res for r in responses for res in r.resources):
                code, name = int(res[0]), res[3]
                if code == _UNKNOWN_TOPIC:
                    continue  # not there (yet): checked once it is
                if code != 0:
                    unread.append(f"{name}: {kafka_errors.for_code(code).__name__}{f': {res[1]}' if res[1] else ''}")
                    continue
                configs[name] = {entry[0]: entry[1] for entry in res[4] if entry[1] is not None}
        except (kafka_errors.KafkaError, OSError, IndexError, TypeError) as exc:  # (TimeoutError is an OSError)
            unread.append(_describe(exc))
        finally:
            await admin.close()
        if unread and not self._policy_unread_told:
            self._policy_unread_told = True
            log.info(
                "cannot read the events topics' cleanup.policy (%s): a log-compacted events topic, which keeps only each "
                "stream's last message, would go unnoticed; grant the bridge's principal DescribeConfigs on them",
                "; ".join(unread),
                extra={"sink": self.name},
            )
        return configs

    def _timestamp_window(self, topic: str, configs: dict[str, str], *, state: bool = False) -> str | None:
        """Why ``topic`` would refuse the sink's records, with the fix, or None: with CreateTime
        (the records carry the bridge host's clock, stamped as each write starts), a
        ``message.timestamp.before.max.ms`` (or ``difference.max.ms`` of brokers before 4.0) under
        ``_TIMESTAMP_WINDOW_MIN`` or ``request_timeout`` refuses them whatever the clock, every write
        or the slow ones, and the sink would stall blaming the clock. The caller refuses the topic
        (the sink not ready) until it is fixed, its configs read again each time it is prepared."""
        short = _short_window(configs, self._timeout, self.options.linger_ms)
        if short is None:
            return None
        key, value, floor = short
        return (
            f"{'state ' if state else ''}topic {topic!r} refuses records stamped more than {value} ms before they "
            f"reach it ({key}, message.timestamp.type=CreateTime): the bridge stamps each record as a write starts, "
            f"waits up to linger_ms in the producer and may take up to request_timeout to reach the broker, so it "
            f"would refuse the sink's records; "
            f"raise it to {floor} or more (kafka-configs --alter --entity-type topics --entity-name {topic} "
            f"--add-config {key}={floor}), or set message.timestamp.type=LogAppendTime on it"
        )

    def _check_partition(self, topic: str, partitions: list[int], *, created: bool = False) -> None:
        """NotConnected (``unknown_partition``) when the configured ``partition`` is not one of the
        events topic's ``partitions`` (those it would have once created, with ``created``)."""
        wanted = self.options.partition
        if wanted is None or wanted in partitions:
            return
        fix = (
            f"create it with at least {wanted + 1} partitions (or create_topics.partitions: {wanted + 1})"
            if created
            else f"add partitions to it (kafka-topics --alter --topic {topic} --partitions {wanted + 1})"
        )
        self._topic_problem = (
            f"topic {topic!r} {'would be created with' if created else 'has'} {len(partitions)} partition(s); "
            f"partition {wanted} does not exist: {fix}, or set a lower partition"
        )
        raise NotConnected(f"{self._where}: {self._topic_problem}", reason="unknown_partition")

    async def _broker_config(self, producer: Any, name: str) -> str | None:
        """A broker config's value (of the broker with the lowest id), or None when it cannot be
        read (no DescribeConfigs on the cluster: nothing more is said)."""
        brokers = sorted(b.nodeId for b in producer.client.cluster.brokers())
        if not brokers:
            return None
        configs, _, error = await self._configs(ConfigResourceType.BROKER, str(brokers[0]), (name,))
        if error:
            log.debug("cannot read a broker config", extra={"sink": self.name, "config": name, "error": error})
        return None if error else configs.get(name)

    async def _auto_partitions(self, producer: Any) -> int | None:
        """The partitions a topic the broker auto-creates gets (``num.partitions``), or None when
        it cannot be read."""
        count = await self._broker_config(producer, "num.partitions")
        return int(count) if count is not None and count.isdigit() else None

    async def _check_kept(self, topic: str, partitions: list[int], *, state: bool) -> None:
        """Whether ``topic`` still holds what the broker acknowledged: a partition that ends before
        the offset after the last record acknowledged there, or no longer exists, lost it (the
        topic was deleted and created again, or truncated). So did one past that offset whose
        record there is not the one acknowledged (another producer, a sharded bridge's other pod,
        refilled it after the loss); one gone from there (compaction, retention) cannot tell. Its
        streams' losses are kept (_lose)."""
        acked = {tp: end for tp, end in self._acked.items() if tp[0] == topic}
        present = [TopicPartition(*tp) for tp in acked if tp[1] in partitions]
        ends: dict[Any, int] = {}
        found: dict[tuple[str, int], tuple[int, int] | None] = {}
        if present:
            try:
                consumer = await self._start_reader()
                try:
                    ends = await consumer.end_offsets(present)
                    for tp in present:
                        at = (tp.topic, tp.partition)
                        if at in self._acked_last and ends[tp] >= acked[at]:
                            found[at] = await _record_at(consumer, tp, acked[at] - 1, self._timeout)
                finally:
                    await consumer.stop()
            except (kafka_errors.KafkaError, OSError) as exc:
                raise NotConnected(f"{self._where}: cannot read the end offsets of topic {topic!r} ({_describe(exc)})") from None
        lost = [tp for tp, end in acked.items() if ends.get(TopicPartition(*tp), -1) < end]
        replaced = [tp for tp, got in found.items() if got is not None and got != self._acked_last.get(tp)]
        if lost or replaced:
            log.error(
                "a topic no longer holds what the broker acknowledged (deleted and created again, or truncated; "
                "refilled by another producer)",
                extra={"sink": self.name, "topic": topic, "partitions": sorted(p for _, p in lost + replaced)},
            )
            self._lose(lost + replaced, state=state)

    def _lose(self, tps: list[tuple[str, int]], *, state: bool) -> None:
        """Forget what the broker acknowledged in partitions ``tps`` (they lost it): the state
        topic's streams have their next state refused (``state_lost``); an events topic's streams
        have their span (from 0 to the last batch acknowledged) kept for the next write's
        :class:`SinkLost`, and the offsets their heads point to forgotten."""
        for tp in tps:
            self._acked.pop(tp, None)
            self._acked_last.pop(tp, None)
            self._own_from.pop(tp, None)
            streams = self._acked_streams.pop(tp, {})
            if state:
                self._state_lost.update(streams)
                continue
            for key, last in streams.items():
                self._lost_topics.add(tp[0])
                ends = [(epoch, seq) for epoch, seq in last.ends]
                if key in self._resent:  # (told by stored_before: what follows the resume point is sent again)
                    ends = [(epoch, seq) for _, epoch, _, seq in resent_spans(last.stream, ends, self._resent.pop(key))]
                for epoch, seq in ends:
                    old = self._lost.get((key, epoch))
                    if old is None or seq > old[3]:
                        self._lost[(key, epoch)] = (last.stream, epoch, 0, seq)
                self._stream_next.pop(key, None)
            if streams:
                self._record_next = {k: v for k, v in self._record_next.items() if k[0] not in streams}

    def _acknowledged(self, chunk: _Chunk, base: int, messages: Sequence[Message], *, state: bool) -> None:
        """Remember what the broker acknowledged of ``chunk`` (stored from offset ``base``): the
        offset after it in its partition, and each stream's last batch there (see _check_kept).

        A partition that stores it below what it acknowledged before was created again since (by
        an operator, or another client's metadata request) without this sink seeing it missing:
        what the old one held is lost (_lose), found only now that this chunk is in the new one."""
        tp = (chunk.topic, chunk.partition)
        end = base + chunk.builder.record_count()
        if not state and base >= 0:
            self._own_from.setdefault(tp, base)
        if 0 <= base < self._acked.get(tp, 0):
            log.error(
                "a partition stored a batch below what it had acknowledged: the topic was deleted and created again",
                extra={"sink": self.name, "topic": chunk.topic, "partition": chunk.partition},
            )
            self._lose([tp], state=state)
        if end > self._acked.get(tp, 0):
            self._acked[tp] = end
            self._acked_last[tp] = (_crc(chunk.last[0]), _crc(chunk.last[1]))
        streams = self._acked_streams.setdefault(tp, {})
        record: Any = None
        where = self._stream_tp if not state else None
        resent = self._resent
        for i in chunk.indexes:
            r = messages[i].record
            if r is record or r.kind == "SourceReset":  # a reset says nothing of the seqs it opens
                continue
            record = r
            key = r.stream.key
            last = streams.get(key)
            if last is None:
                last = streams[key] = _Last(r.stream)
            last.note(r.epoch, r.seq)
            if where is not None:
                where[key] = tp
                if resent:
                    resent.pop(key, None)

    async def _check_state_topic(self, topic: str, partitions: list[int]) -> None:
        """Read the state topic's configs and its partitions' start offsets (at connect, at each
        audit, whenever a write prepares the topic), and bound its records by its
        ``max.message.bytes``.

        A topic that deletes records by retention (``cleanup.policy`` with ``delete`` and a
        ``retention.ms`` or ``retention.bytes``) deletes live entries and heads: a bootstrap would
        take what is left for a complete state (I6). It is refused (NotConnected naming the fix;
        state writes are held, the sink not ready) until it is fixed; found so during a run, the
        state of every stream it holds is lost, as it is when a partition starts later than it
        did (retention, DeleteRecords): their heads are deleted and their state told lost
        (:meth:`_raise_lost`). Configs that cannot be read leave the topic untrusted: refused the
        same way (:meth:`_state_topic_configs`, I6). Start offsets that cannot be read prove nothing
        (logged): the configs said the topic keeps its records."""
        configs = await self._state_topic_configs(topic)
        policy = configs.get("cleanup.policy") or ""
        limits = [f"{k}={configs.get(k)}" for k in ("retention.ms", "retention.bytes") if configs.get(k) not in (None, "-1")]
        deletes = "delete" in policy.split(",") and bool(limits)
        if not deletes and policy and "compact" not in policy:
            log.warning(
                "the state topic is not log-compacted (cleanup.policy=%s): it keeps every record and grows without "
                "bound; set cleanup.policy=compact",
                policy,
                extra={"sink": self.name, "topic": topic},
            )
        limit = configs.get("max.message.bytes")
        room = int(limit) - _BATCH_OVERHEAD if limit is not None and limit.isdigit() else None
        small = None
        if room is not None and room < _STATE_BATCH_MIN:
            # (Its state batches would be refused for ever: nothing past them would be delivered.)
            small = (
                f"state topic {topic!r} takes record batches of at most {limit} bytes (max.message.bytes), below the "
                f"{_STATE_BATCH_MIN + _BATCH_OVERHEAD} a state batch may need; raise it (kafka-configs --alter --entity-type "
                f"topics --entity-name {topic} --add-config max.message.bytes=1048588)"
            )
        elif room is not None and room < self._batch_limit.get(topic, self._max_bytes):
            # A larger entry is written without its fact (_state_records): never refused for ever.
            self._batch_limit[topic] = room
        kept = configs.get("delete.retention.ms")
        if small is None and "compact" in policy and kept is not None and kept.isdigit() and int(kept) < _TOMBSTONES_KEPT_MIN:
            small = (
                f"state topic {topic!r} deletes tombstones {kept} ms after compaction (delete.retention.ms): a consumer "
                "whose bootstrap takes longer misses removals and keeps removed blocks in a state marked complete; "
                f"raise it to {_TOMBSTONES_KEPT_MIN} or more (kafka-configs --alter --entity-type topics --entity-name "
                f"{topic} --add-config delete.retention.ms=86400000)"
            )
        if small is None:
            small = self._timestamp_window(topic, configs, state=True)
        moved = await self._moved_starts(topic, partitions)
        if deletes and self._state_deletes is None:
            moved = partitions  # what it deleted before this was seen is unknown: every partition
        elif deletes:
            moved = []  # told when it was first seen; nothing is written meanwhile
        if moved:
            self._tell_state_lost(topic, moved, partitions)
        if not deletes:
            self._state_deletes = None
            if small is not None:
                self._topic_problem = small
                self._partitions.pop(topic, None)  # prepared again (its configs read again) before each state write
                raise NotConnected(f"{self._where}: {small}", reason="state_topic_limit")
            return
        self._state_deletes = (
            f"state topic {topic!r} deletes records by retention (cleanup.policy={policy}, {', '.join(limits)}): live "
            "entries and heads would go and a state marked complete would not be; set cleanup.policy=compact on it "
            f"(kafka-configs --alter --entity-type topics --entity-name {topic} --add-config cleanup.policy=compact)"
        )
        self._topic_problem = self._state_deletes
        self._partitions.pop(topic, None)  # prepared again (its configs read again) before each state write
        raise NotConnected(f"{self._where}: {self._state_deletes}", reason="state_topic_deletes")

    async def _state_topic_configs(self, topic: str) -> dict[str, str]:
        """The state topic's ``cleanup.policy``, ``retention.*``, ``max.message.bytes``,
        ``delete.retention.ms`` and timestamp settings (``_TIMESTAMP_CONFIGS``).

        A topic whose configs cannot be read (a broker answers DescribeConfigs with an error for
        it, TOPIC_AUTHORIZATION_FAILED without that ACL, or does not answer) may delete records by
        retention, and a bootstrap would take what is left for a complete state (I6): NotConnected
        naming the error and the fix (state writes held, the sink not ready, ``--check`` refused),
        read again before each state write, at each health check and audit."""
        configs, code, error = await self._configs(
            ConfigResourceType.TOPIC,
            topic,
            (
                "cleanup.policy",
                "retention.ms",
                "retention.bytes",
                "max.message.bytes",
                "delete.retention.ms",
                *_TIMESTAMP_CONFIGS,
            ),
        )
        if not error:
            return configs
        fix = (
            f"grant the bridge's principal DescribeConfigs on it (kafka-acls --add --allow-principal {self._principal} "
            f"--operation DescribeConfigs --topic {topic})"
            if code == _TOPIC_AUTHORIZATION
            else "it is read again at each health check"
        )
        self._topic_problem = (
            f"cannot read the configs of state topic {topic!r} ({error}): a topic that may delete records by retention "
            f"is not trusted with the state; {fix}"
        )
        self._partitions.pop(topic, None)  # prepared again (its configs read again) before each state write
        reason = "unauthorized" if code == _TOPIC_AUTHORIZATION else "state_topic_configs"
        raise NotConnected(f"{self._where}: {self._topic_problem}", reason=reason)

    async def _configs(self, kind: ConfigResourceType, name: str, wanted: Sequence[str]) -> tuple[dict[str, str], int, str]:
        """The configs ``wanted`` of one resource (a topic, a broker by its node id) as the broker
        answers DescribeConfigs, with the error code and a description of the error ("" when read).
        The broker answers a resource it refuses (an ACL) with an error code inside its response."""
        admin = self._admin()
        code, error, configs = 0, "", dict[str, str]()
        try:
            await admin.start()
            responses = await admin.describe_configs([ConfigResource(kind, name, dict.fromkeys(wanted))])
            resources = [res for r in responses for res in r.resources]
            for res in resources:  # (error_code, error_message, resource_type, resource_name, entries)
                if res[0] != 0:
                    code = int(res[0])
                    error = f"{kafka_errors.for_code(code).__name__}{f': {res[1]}' if res[1] else ''}"
                configs.update((entry[0], entry[1]) for entry in res[4] if entry[0] in wanted)
            if not resources:
                error = "no resource in the broker's answer"
        except (kafka_errors.KafkaError, OSError, IndexError, TypeError) as exc:
            error = _describe(exc)
        finally:
            await admin.close()
        return configs, code, error

    @property
    def _principal(self) -> str:
        """The bridge's principal as ACLs name it, for the fixes the sink names."""
        return f"User:{self.options.sasl_username}" if self.options.sasl_username else "<the bridge's principal>"

    async def _moved_starts(self, topic: str, partitions: list[int]) -> list[int]:
        """The partitions of the state topic whose log start offset is above what it was when last
        read (records deleted from their start); the offsets are remembered."""
        tps = [TopicPartition(topic, p) for p in partitions]
        try:
            begins = await self._offsets(tps, start=True)
        except (kafka_errors.KafkaError, OSError) as exc:
            log.debug("cannot read the state topic's start offsets", extra={"sink": self.name, "error": _describe(exc)})
            return []
        moved = []
        for tp, begin in begins.items():
            before = self._state_starts.get((topic, tp.partition))
            if before is not None and begin > before:
                moved.append(tp.partition)
            self._state_starts[(topic, tp.partition)] = begin
        return moved

    def _tell_state_lost(self, topic: str, lost: list[int], partitions: list[int]) -> None:
        """The state topic lost records of partitions ``lost`` (of its ``partitions``): every stream
        it holds there (written by this sink, or read back at start) has its head deleted and its
        state told lost."""
        wanted = set(lost)
        streams = {
            key: last.stream
            for tp, held in self._acked_streams.items()
            if tp[0] == topic and tp[1] in wanted
            for key, last in held.items()
        }
        for key, stream in self._read_back.items():
            if _PARTITIONER(key.encode(), partitions, partitions) in wanted:
                streams.setdefault(key, stream)
        log.error(
            "the state topic deletes records (retention, DeleteRecords): the state of its streams is told lost and "
            "their heads deleted",
            extra={"sink": self.name, "topic": topic, "partitions": sorted(wanted), "count": len(streams)},
        )
        self._lost_states.update(streams)

    def _admin(self) -> AIOKafkaAdminClient:
        """An admin client of the sink's cluster (not started), whose metadata refreshes create
        nothing (its ``describe_topics`` would: the sink does not call it)."""
        admin = AIOKafkaAdminClient(**client_settings(self.options, self.name), ssl_context=ssl_context(self.options))
        internals.no_auto_create(admin._client)
        return admin

    async def _twin(self, topic: str) -> str | None:
        """A topic of the cluster whose name differs from ``topic`` only by '.' and '_' (None: none,
        or the listing failed)."""
        folded = topic.replace(".", "_")
        admin = self._admin()
        try:
            await admin.start()
            names = await admin.list_topics()
        except kafka_errors.KafkaError:
            return None
        finally:
            await admin.close()
        return next((t for t in names if t != topic and t.replace(".", "_") == folded), None)

    async def _create_topic(self, topic: str, *, state: bool = False, validate_only: bool = False) -> None:
        """Create ``topic`` with the configured settings (an existing one will do); with
        ``validate_only`` (``--check``) the broker only says whether it could (replicas beyond its
        brokers, an invalid config...). NotConnected with the broker's reason otherwise."""
        spec = self.options.create_topics
        if state:
            new = NewTopic(topic, self.options.state.partitions, spec.replication_factor, topic_configs=dict(STATE_TOPIC_CONFIGS))
        else:
            new = NewTopic(topic, spec.partitions, spec.replication_factor, topic_configs=dict(spec.configs))
        admin = self._admin()
        try:
            await admin.start()
            response = await admin.create_topics([new], validate_only=validate_only)
        except kafka_errors.KafkaError as exc:
            raise NotConnected(f"{self._where}: cannot create topic {topic!r}: {_describe(exc)}") from None
        finally:
            await admin.close()
        for entry in response.topic_errors:
            code = int(entry[1])
            if code not in (0, _TOPIC_EXISTS):
                detail = entry[2] if len(entry) > 2 and entry[2] else kafka_errors.for_code(code).__name__
                if code == _INVALID_TOPIC and not state:  # (a valid name: see _prepare_topic)
                    raise self._collides(topic, detail)
                self._topic_problem = f"cannot create topic {topic!r}: {detail}"
                raise NotConnected(f"{self._where}: {self._topic_problem}", reason="create_topic")
        if validate_only:
            return
        self._created.add(topic)
        log.info("kafka topic ready (created or already there)", extra={"sink": self.name, "topic": topic})


# Per record key: the stream its last message names (source, dp_rank) and that message's position
# (None: a header the bridge does not write).
_Found = tuple[str, str, SinkPosition | None]


class _Window:
    """What :meth:`KafkaConnector.positions` has read of one partition: offsets ``lo``..``hi``, and
    per key its last message in that range."""

    def __init__(self, end: int) -> None:
        self.lo = self.hi = end
        self.last: dict[bytes, _Found] = {}


def _crc(value: bytes | None) -> int:
    """A record key's or value's CRC-32 (-1 for none: a tombstone's value)."""
    return zlib.crc32(value) if value is not None else -1


async def _record_at(consumer: Any, tp: Any, offset: int, timeout: float) -> tuple[int, int] | None:
    """The CRC-32s of the key and the value of the record at ``offset`` of one partition; None when there is
    none there (compacted, deleted by retention) or it cannot be read within ``timeout``."""
    consumer.assign([tp])
    consumer.seek(tp, offset)
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        got = await consumer.getmany(tp, timeout_ms=200, max_records=64)
        for record in got.get(tp, []):
            if record.offset == offset:
                return _crc(record.key), _crc(record.value)
            if record.offset > offset:
                return None
    return None


async def _first_stamp(consumer: Any, tp: Any) -> int | None:
    """The timestamp of the first record one partition holds (None: it holds none)."""
    consumer.assign([tp])
    begin = (await consumer.beginning_offsets([tp]))[tp]
    if begin >= (await consumer.end_offsets([tp]))[tp]:
        return None
    consumer.seek(tp, begin)
    for _ in range(25):  # (the read is bounded by its caller too)
        records = (await consumer.getmany(tp, timeout_ms=200, max_records=1)).get(tp, [])
        if records:
            return int(records[0].timestamp)
    return None


async def _read(consumer: Any, tp: Any, lo: int, hi: int, stamps: dict[bytes, int] | None = None) -> dict[bytes, _Found]:
    """The last message of each key among offsets ``lo``..``hi - 1`` of one partition that the
    bridge wrote (headers ``source`` and ``dp_rank``), its timestamp into ``stamps`` if given."""
    last: dict[bytes, _Found] = {}
    consumer.seek(tp, lo)
    while await consumer.position(tp) < hi:
        got = await consumer.getmany(tp, timeout_ms=200, max_records=_SCAN_CHUNK)
        for record in got.get(tp, []):
            if record.offset >= hi:
                break
            if record.offset < lo or record.key is None:  # the broker answers from a record batch's start
                continue
            headers = dict(record.headers)
            source, rank = headers.get("source"), headers.get("dp_rank")
            if source is None or rank is None:
                continue  # not the bridge's
            try:
                position: SinkPosition | None = SinkPosition.from_headers(headers, record.value)
                last[record.key] = (source.decode(), rank.decode(), position)
                if stamps is not None:
                    stamps[record.key] = record.timestamp
            except (ValueError, UnicodeDecodeError):
                last[record.key] = ("", "", None)
    return last


def _remember(memory: dict[str, Any], entries: dict[str, Any]) -> None:
    """Add ``entries`` to a bounded memory (the oldest entries go first)."""
    memory.update(entries)
    while len(memory) > _MEMORY:
        del memory[next(iter(memory))]


def _describe(exc: BaseException) -> str:
    """An aiokafka error as text, any secret it quotes redacted (it may end up in a dead letter)."""
    if isinstance(exc, kafka_errors.KafkaError):
        return redact(str(exc))  # already "[Error N] Name: detail"
    text = str(exc)
    return redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


__all__ = [
    "KafkaConnector",
    "KafkaOptions",
    "StateLog",
    "StateOptions",
    "TlsOptions",
    "client_settings",
    "producer_settings",
    "ssl_context",
    "stream_of",
]
