"""Configuration: the only module that reads files and the environment.

``load(path)`` reads YAML or TOML (by extension), replaces ``${VAR}`` / ``${VAR:-default}`` in
string values from the environment, and converts the result to typed structs. Every problem is
collected with its path (``sinks[1].batch.max_messages: expected int, got "ten"``) and raised
together as one :class:`~bridge.errors.ConfigError`.

Each sink entry mixes the keys every sink shares (:class:`SinkConfig`) with the keys of its
connector type; the latter are kept in ``SinkConfig.options`` and validated by the connector's own
``Options`` struct when the registry builds it (so ``bridge/`` never needs to know a connector).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import tomllib
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec
import yaml

from .errors import ConfigError
from .secret import Secret, redact


class Duration(float):
    """Seconds; in files also ``"250ms"``, ``"15s"``, ``"2m"``, ``"1h"``."""


class Interval(Duration):
    """A :class:`Duration` greater than 0: a timeout, period or bound that 0 would turn into "never"
    or "at once, forever" (nothing written, a busy loop)."""


SnapshotDesign = Literal["off", "auto", "vllm-57789", "vllm-50134", "sglang-34407"]
"""How a source's engine serves snapshots (bridge.snapshot)."""


class ByteSize(int):
    """Bytes; in files also ``"64KiB"``, ``"16MiB"``, ``"1GiB"``, ``"10MB"``."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?\s*$", re.IGNORECASE)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZES = {"b": 1, "kb": 1000, "kib": 1024, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30}


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is Secret:
        if not isinstance(obj, str):
            raise ValueError("expected a string (a password or token, e.g. ${PASSWORD})")
        return Secret(obj)
    if tp is Duration or tp is Interval:
        if isinstance(obj, int | float) and not isinstance(obj, bool) and obj >= 0:
            seconds = float(obj)
        else:
            m = _DURATION.match(obj) if isinstance(obj, str) else None
            if m is None:
                raise ValueError(f"expected a duration such as 15s or 250ms, got {json.dumps(obj)}")
            seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
        if tp is Interval and seconds <= 0:
            raise ValueError(
                f"must be greater than 0, got {json.dumps(obj)} (give a duration such as 5s, or leave the key out "
                "for its default)"
            )
        return tp(seconds)
    if tp is ByteSize:
        if isinstance(obj, int) and not isinstance(obj, bool) and obj >= 0:
            return ByteSize(obj)
        m = _SIZE.match(obj) if isinstance(obj, str) else None
        if m is None:
            raise ValueError(f"expected a size such as 16MiB or 65536, got {json.dumps(obj)}")
        return ByteSize(int(m.group(1)) * _SIZES[(m.group(2) or "b").lower()])
    raise NotImplementedError(tp)


def doc(text: str) -> msgspec.Meta:
    """Field metadata: the description shown in the docs reference tables and the chart schema."""
    return msgspec.Meta(description=text)


class Struct(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of config structs: unknown keys are errors; the repr shows no secret (a
    :class:`~bridge.secret.Secret` is ``***``, and so is a password inside a URL once read)."""

    def __repr__(self) -> str:
        return redact(super().__repr__())


# A source name keys every output message (Kafka key, Redis entry fields, Nats-Msg-Id, headers):
# no separator (/), space or control character, so that no two streams' keys can coincide.
SOURCE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"


class SourceConfig(Struct):
    """One engine (or one data-parallel group of ranks) to subscribe to."""

    name: Annotated[
        str,
        msgspec.Meta(
            pattern=SOURCE_NAME,
            description="Stream name (unique; letters, digits, . _ : -); with the rank it keys every output message.",
        ),
    ]
    endpoint: Annotated[
        str,
        doc("ZMQ PUB endpoint of rank 0, e.g. tcp://10.1.2.3:5557 (rank r uses port + r; ipc://x becomes ipc://x_dp{r})."),
    ]
    replay_endpoint: Annotated[str | None, doc("ZMQ ROUTER replay endpoint of rank 0; enables gap recovery.")] = None
    topic: Annotated[str, doc("ZMQ subscription prefix (the engine's topic).")] = ""
    dp_ranks: Annotated[int, msgspec.Meta(ge=1, le=1024, description="Ranks 0..n-1 at port+rank on both sockets.")] = 1
    bind: Annotated[
        bool,
        doc(
            "True: the bridge binds the endpoint and engines connect in (an engine whose endpoint has no * connects). "
            "Each bound endpoint takes one engine per rank: give each engine its own port."
        ),
    ] = False
    labels: Annotated[dict[str, str], doc("Free labels, usable in sink name templates.")] = msgspec.field(default_factory=dict)
    replay_on_start: Annotated[
        bool | None,
        doc(
            "On start, replay the engine's buffered history (or from the checkpoint) instead of starting mid-stream "
            "(default: true when replay_endpoint is set)."
        ),
    ] = None
    snapshot: Annotated[
        SnapshotDesign,
        doc(
            "Experimental: engine snapshots that make a state-keeping stream complete when it is met mid-epoch or "
            "after an EventsLost (docs/sources/snapshots.md). off; auto (the design told by snapshot_endpoint's "
            "reply, else vLLM #50134 on replay_endpoint); or one design: vllm-57789 and sglang-34407 (on "
            "snapshot_endpoint), vllm-50134 (on replay_endpoint). Used only with a sink that has state.enabled."
        ),
    ] = "off"
    snapshot_endpoint: Annotated[
        str | None,
        doc("ZMQ snapshot endpoint of rank 0 (vLLM #57789, SGLang #34407; rank r uses port + r), for snapshot."),
    ] = None


class ShardConfig(Struct):
    """This replica's share of the discovered sources, for running several bridges over one name."""

    count: Annotated[int, msgspec.Meta(ge=1, le=4096, description="Number of replicas sharing the discovered sources.")]
    index: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | Literal["auto"],
        doc(
            "This replica's ordinal, 0..count-1: it reads the sources whose stable hash (sha1 of the source name) "
            "modulo count equals it. auto: the trailing -N of pod_name (a StatefulSet pod's ordinal)."
        ),
    ] = "auto"
    pod_name: Annotated[
        str | None,
        doc("Name whose trailing -N is the ordinal when index is auto (default: the host name, which is the pod name)."),
    ] = None

    def __post_init__(self) -> None:
        if isinstance(self.index, int) and self.index >= self.count:
            raise ValueError(f"index {self.index} must be below count {self.count}")


class DnsDiscovery(Struct):
    """Sources found by resolving a (headless Service) DNS name: one source per address."""

    name: Annotated[str, msgspec.Meta(min_length=1, description="DNS name to resolve (A and AAAA records); give the FQDN.")]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535, description="Engine PUB port.")] = 5557
    replay_port: Annotated[Annotated[int, msgspec.Meta(ge=1, le=65535)] | None, doc("Engine replay port (null: no replay).")] = (
        5558
    )
    interval: Annotated[Interval, doc("How often to re-resolve.")] = Interval(15.0)
    timeout: Annotated[Interval, doc("Bound on one resolution; a timed-out one keeps the known sources.")] = Interval(5.0)
    resolver: Annotated[
        str | None,
        doc("host:port of a DNS server to ask directly over UDP (TCP when truncated); default: the system resolver."),
    ] = None
    name_prefix: Annotated[
        Annotated[str, msgspec.Meta(pattern=SOURCE_NAME)] | None,
        doc("Discovered sources are named <prefix>-<address> (default: the first label of name)."),
    ] = None
    nxdomain_grace: Annotated[
        Duration | None,
        doc(
            "NXDOMAIN keeps the known sources this long, then counts as an empty answer (a headless Service with no "
            "ready pods answers NXDOMAIN); null: NXDOMAIN never removes sources."
        ),
    ] = Duration(60.0)
    topic: Annotated[str, doc("ZMQ subscription prefix of every discovered engine.")] = ""
    dp_ranks: Annotated[int, msgspec.Meta(ge=1, le=1024, description="Ranks per engine, at port+rank.")] = 1
    labels: Annotated[dict[str, str], doc("Labels of every discovered source (the label address is added: the engine's IP).")] = (
        msgspec.field(default_factory=dict)
    )
    shard: Annotated[ShardConfig | None, doc("Read only this replica's share of the discovered sources.")] = None
    snapshot: Annotated[
        SnapshotDesign,
        doc("Experimental: every discovered engine's snapshot design, as a source's snapshot (docs/sources/snapshots.md)."),
    ] = "off"
    snapshot_port: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=65535)] | None,
        doc("Engine snapshot port (vLLM #57789, SGLang #34407; rank r: port + r), for snapshot."),
    ] = None

    def __post_init__(self) -> None:
        if self.snapshot == "off" and self.snapshot_port is not None:
            raise ValueError("snapshot_port is set, but snapshot is off: set snapshot: auto (or the engines' design)")
        if self.snapshot in ("vllm-57789", "sglang-34407") and self.snapshot_port is None:
            raise ValueError(f"snapshot {self.snapshot} is served on a snapshot socket of its own: set snapshot_port")
        if self.snapshot in ("vllm-50134", "auto") and self.snapshot_port is None and self.replay_port is None:
            raise ValueError(f"snapshot {self.snapshot} needs replay_port (vLLM #50134) or snapshot_port")
        top = max(self.port, self.replay_port or 0, self.snapshot_port or 0) + self.dp_ranks - 1
        if top > 65535:
            raise ValueError(f"dp_ranks {self.dp_ranks} would use port {top} (> 65535)")
        if self.resolver is not None:
            host, sep, port = self.resolver.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"resolver must be host:port, got {self.resolver!r}")


class DiscoveryConfig(Struct):
    """Sources found at run time, beside the static ``sources``."""

    dns: Annotated[DnsDiscovery | None, doc("Resolve a headless Service name; one source per address.")] = None
    forget_after: Annotated[
        Duration,
        doc(
            "How long a source that discovery removed keeps its position (to resume if it returns) before the bridge "
            "forgets it: its checkpoint entry and its metric series."
        ),
    ] = Duration(3600.0)


class CheckpointConfig(Struct):
    path: Annotated[str | None, doc("Checkpoint file (null: no checkpoint, start fresh every time).")] = None
    interval: Annotated[Interval, doc("How often the checkpoint is saved (also on shutdown).")] = Interval(5.0)
    from_sinks: Annotated[
        bool,
        doc(
            "Before a stream starts, ask each sink what it holds of it (Redis: the last entry of its key; "
            "JetStream: the last message on its subject; Kafka: its last message in its partition) and resume "
            "from the lowest of those and the checkpoint file; a sink that holds more skips what it has. "
            "For pods that take over streams without the previous owner's checkpoint (sharded replicas)."
        ),
    ] = False
    from_sinks_timeout: Annotated[
        Interval,
        doc(
            "Bound on asking one sink for the positions of the streams starting together; a sink that does not "
            "answer in time counts as holding what the checkpoint file says (nothing without one)."
        ),
    ] = Interval(10.0)


class StateConfig(Struct):
    """The live-block state kept for sinks with ``state.enabled`` (docs/output/state.md)."""

    max_entries: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description=(
                "Live blocks kept across all streams, at most (about 20 bytes each). Past it, the stream whose "
                "store crossed it has its state switched off (cleared, complete: false, logged and counted) while "
                "its events keep flowing; it is switched on again at its next reset if there is room."
            ),
        ),
    ] = 10_000_000
    load_timeout: Annotated[
        Interval,
        doc(
            "Bound on reading back one sink's state of the streams starting together (a restarted bridge rebuilds "
            "its tables from it); a sink not reachable yet is retried with backoff meanwhile, and one that does not "
            "answer in time has those streams' state cleared and started afresh (complete: false until the "
            "engine's next reset)."
        ),
    ] = Interval(60.0)


class SnapshotsConfig(Struct):
    """Bounds of the engine snapshots (experimental; sources' ``snapshot``)."""

    max_bytes: Annotated[
        ByteSize,
        doc(
            "Largest snapshot read, in bytes (its frames in all), and largest span of batches kept between its cut "
            "and the batch it is seeded with; past it the snapshot is refused and the state stays incomplete."
        ),
    ] = ByteSize(256 * 2**20)
    timeout: Annotated[
        Interval,
        doc("Bound on one snapshot, from asking (waiting for a slot included) to its last frame; then it is refused."),
    ] = Interval(30.0)
    max_concurrent: Annotated[
        int,
        msgspec.Meta(ge=1, description="Snapshots in flight per bridge process, at most (an engine serves them inline)."),
    ] = 2
    retry_interval: Annotated[
        Duration,
        doc(
            "After a refused or timed-out snapshot, wait about this long (jittered) before asking again while the "
            "state is still incomplete (0: ask again only after the next EventsLost)."
        ),
    ] = Duration(300.0)


class BatchConfig(Struct):
    """How many queued messages one connector write may carry."""

    max_messages: Annotated[int, msgspec.Meta(ge=1, description="Messages per write, at most.")] = 2000
    max_bytes: Annotated[ByteSize, doc("Bytes per write, at most (a single larger batch still goes alone).")] = ByteSize(
        4 * 2**20
    )
    linger: Annotated[Duration, doc("How long a write waits to fill up once something is queued.")] = Duration(0.002)


class QueueConfig(Struct):
    """The bound of each sink's queue."""

    max_batches: Annotated[int, msgspec.Meta(ge=1, description="Engine batches queued per sink, at most.")] = 10000
    max_bytes: Annotated[ByteSize, doc("Payload bytes queued per sink, at most.")] = ByteSize(64 * 2**20)

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError("max_bytes: must be at least 1 byte, got 0 (nothing could be queued); e.g. 64MiB")


class RetryConfig(Struct):
    """Capped exponential backoff with jitter, shared by every sink."""

    initial_backoff: Annotated[Duration, doc("First pause between write attempts (capped exponential, jittered).")] = Duration(
        0.1
    )
    max_backoff: Annotated[Interval, doc("Longest pause between write attempts.")] = Interval(10.0)
    multiplier: Annotated[float, msgspec.Meta(ge=1.0, description="Factor between one pause and the next.")] = 2.0
    jitter: Annotated[float, msgspec.Meta(ge=0.0, le=1.0, description="Fraction of each delay drawn at random.")] = 0.2
    write_timeout: Annotated[Interval, doc("A write that has not returned after this is retried.")] = Interval(30.0)

    def __post_init__(self) -> None:
        _check_backoff(self.initial_backoff, self.max_backoff)


SinkFormat = Literal["json", "msgpack", "raw"]
SinkGranularity = Literal["event", "batch"]
TokenPolicy = Literal["keep", "drop", "hash"]


class FieldRule(Struct):
    """Which event fields a sink writes: keep only some, or drop some (not both)."""

    keep: Annotated[
        list[str] | None,
        doc("Write only these event fields (type is always written; the record header is not an event field)."),
    ] = None
    drop: Annotated[list[str] | None, doc("Write every event field but these.")] = None


class FieldSelection(FieldRule):
    """Field selection of a json or msgpack sink (see Output formats, Field selection)."""

    by_type: Annotated[
        dict[str, FieldRule],
        doc("Per event type (e.g. BlockStored), a rule used instead of the top-level keep/drop for that type."),
    ] = msgspec.field(default_factory=dict)


TOKEN_KEY_MIN = 16
"""Shortest ``token_ids_key`` accepted (characters)."""

SINK_KEYS = frozenset(
    {
        "type",
        "name",
        "format",
        "granularity",
        "hash_format",
        "fields",
        "token_ids",
        "token_ids_key",
        "batch",
        "queue",
        "retry",
        "backpressure",
    }
)


class SinkConfig(Struct):
    """Keys every sink has; ``options`` holds the connector type's own keys."""

    type: Annotated[str, doc("Connector type: kafka, redis, nats, file, or a plugin's name.")]
    name: Annotated[str, doc("Sink name, used in metrics and logs (default: the type, then type-N).")] = ""
    format: Annotated[SinkFormat, doc("Message format: json, msgpack or raw (see Output formats).")] = "json"
    granularity: Annotated[
        SinkGranularity, doc("event: one message per event; batch: one per engine batch (raw is always batch).")
    ] = "event"
    hash_format: Annotated[
        Literal["int", "hex"],
        doc(
            "int: integer block hashes as numbers; hex: as 16-digit hex strings (for consumers without 64-bit unsigned numbers)."
        ),
    ] = "int"
    fields: Annotated[
        FieldSelection | None,
        doc("json and msgpack: which event fields to write, e.g. {drop: [extra_keys]} (see Field selection)."),
    ] = None
    token_ids: Annotated[
        TokenPolicy,
        doc(
            "json and msgpack: the prompt's token ids (every event field named *token_ids). keep; drop; hash: "
            "replaced by token_hashes, one keyed hash per block (needs token_ids_key)."
        ),
    ] = "keep"
    token_ids_key: Annotated[
        Secret | None,
        doc(
            f"Key of token_ids: hash (at least {TOKEN_KEY_MIN} characters, e.g. ${{KV_TOKEN_KEY}}): equal blocks hash "
            "alike under one key, and not alike under another."
        ),
    ] = None
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    queue: QueueConfig = msgspec.field(default_factory=QueueConfig)
    retry: RetryConfig = msgspec.field(default_factory=RetryConfig)
    backpressure: Annotated[
        Literal["block", "drop"], doc("Full queue: block ingest (replay repairs later) or drop and announce EventsLost.")
    ] = "block"
    options: dict[str, Any] = msgspec.field(default_factory=dict)

    def __repr__(self) -> str:
        # Connector keys may hold secrets (passwords, tokens): never let a repr or log show them.
        shown = {k: ("***" if _SECRET.search(k) else v) for k, v in self.options.items()}
        return f"SinkConfig(type={self.type!r}, name={self.name!r}, format={self.format!r}, options={shown!r})"


_SECRET = re.compile(r"pass|secret|token|key|cred|seed", re.IGNORECASE)


class ReplayConfig(Struct):
    """The replay client (gap recovery through the engines' ROUTER sockets)."""

    timeout: Annotated[Interval, doc("Silence after which a replay is uncertain and retried.")] = Interval(2.0)
    max_attempts: Annotated[int, msgspec.Meta(ge=1, description="Attempts without progress before a gap is declared lost.")] = 5
    initial_backoff: Annotated[Duration, doc("First pause between replay attempts (capped exponential, jittered).")] = Duration(
        0.2
    )
    max_backoff: Annotated[Interval, doc("Longest pause between replay attempts.")] = Interval(5.0)
    max_concurrent: Annotated[
        int,
        msgspec.Meta(
            ge=1, description="Replays in flight per process, at most (the engine serves replay inline: ask sparingly)."
        ),
    ] = 8
    idle_probe: Annotated[Duration, doc("Quiet time after which a stream asks replay for a missed tail (0 disables).")] = (
        Duration(30.0)
    )
    max_held_batches: Annotated[
        int,
        msgspec.Meta(ge=1, description="Live batches held per stream while a gap is open (beyond, they are fetched by replay)."),
    ] = 5000

    def __post_init__(self) -> None:
        _check_backoff(self.initial_backoff, self.max_backoff)


def _check_backoff(initial: float, maximum: float) -> None:
    if initial > maximum:
        raise ValueError(
            f"initial_backoff: {_seconds(initial)} is above max_backoff {_seconds(maximum)}: the first pause would "
            "already be the longest; lower initial_backoff or raise max_backoff"
        )


def _seconds(value: float) -> str:
    return f"{value:g}s"


class IngestConfig(Struct):
    max_frame_bytes: Annotated[ByteSize, doc("Larger ZMQ messages are refused before allocation.")] = ByteSize(64 * 2**20)
    receive_hwm: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="ZMQ receive high-water mark per socket: messages buffered while ingest waits for a full sink "
            "(beyond, the engine drops and replay repairs). At least 1 (ZMQ would take 0 as no bound).",
        ),
    ] = 5000
    drain_max: Annotated[int, msgspec.Meta(ge=1, description="Messages read per socket wake-up before yielding.")] = 256
    tick: Annotated[
        Duration,
        doc(
            "How long after a socket signals the bridge waits before reading it, so that the batches of other "
            "streams arriving meanwhile are read in the same pass (one wake-up, one fan-out, one sink write for "
            "many streams; see docs/operations/sizing.md). The most latency it adds; 0 reads at once."
        ),
    ] = Duration(0.001)
    connect_grace: Annotated[
        Duration,
        doc(
            "How long after start-up the bridge may read from no engine and still be ready: past it, /readyz says "
            "not ready while no source is connected (or discovery finds none), and names why. One engine down "
            "among several does not make the bridge unready."
        ),
    ] = Duration(60.0)

    def __post_init__(self) -> None:
        if self.max_frame_bytes < 1:
            raise ValueError("max_frame_bytes: must be at least 1 byte, got 0 (every message would be refused); e.g. 64MiB")


class MetricsConfig(Struct):
    listen: Annotated[str, doc("host:port of /metrics, /healthz, /readyz; empty string disables.")] = "0.0.0.0:9300"

    def __post_init__(self) -> None:
        problem = listen_problem(self.listen)
        if problem is not None:
            raise ValueError(f"listen: {problem}")


def listen_problem(listen: str) -> str | None:
    """Why ``listen`` is not a host:port to serve HTTP on (empty: off), with the fix; None when it is."""
    _host, sep, port = listen.rpartition(":")
    if not listen or (sep and port.isdigit() and int(port) <= 65535 and "/" not in listen):
        return None
    return (
        f"{listen!r} is not host:port; give e.g. 0.0.0.0:9300 (all interfaces) or 127.0.0.1:9300 (loopback), "
        "or an empty string to turn the endpoints off"
    )


class LogConfig(Struct):
    format: Annotated[Literal["text", "json"], doc("Log lines on stderr: text or json (one object per line).")] = "text"
    level: Annotated[Literal["debug", "info", "warning", "error"], doc("Lowest level logged.")] = "info"


class DeadLetterConfig(Struct):
    path: Annotated[str, doc("JSON-lines file for what could not be decoded or written; '-' is stderr.")] = "-"


class Config(Struct):
    """The whole bridge configuration."""

    sources: Annotated[list[SourceConfig], doc("Engines to subscribe to (see Sources).")] = msgspec.field(default_factory=list)
    discovery: Annotated[DiscoveryConfig, doc("Engines found at run time, beside sources (see Discovery).")] = msgspec.field(
        default_factory=DiscoveryConfig
    )
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    state: Annotated[StateConfig, doc("Bounds of the live-block state (sinks with state.enabled).")] = msgspec.field(
        default_factory=StateConfig
    )
    sinks: Annotated[list[SinkConfig], doc("Where events go: one or more sinks (see Sinks).")] = msgspec.field(
        default_factory=list
    )
    replay: ReplayConfig = msgspec.field(default_factory=ReplayConfig)
    snapshots: Annotated[SnapshotsConfig, doc("Bounds of the engine snapshots (experimental; sources' snapshot).")] = (
        msgspec.field(default_factory=SnapshotsConfig)
    )
    ingest: IngestConfig = msgspec.field(default_factory=IngestConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    dead_letter: DeadLetterConfig = msgspec.field(default_factory=DeadLetterConfig)
    shutdown_timeout: Annotated[Interval, doc("Bound on the graceful shutdown (flush, checkpoint).")] = Interval(20.0)


# -- environment substitution -------------------------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def substitute(data: Any, env: Mapping[str, str], path: str, problems: list[str]) -> Any:
    """``data`` with ``${VAR}`` and ``${VAR:-default}`` replaced in every string (``$${`` escapes)."""
    if isinstance(data, str):
        if "${" not in data:
            return data

        def repl(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env and (env[name] != "" or default is None):
                return env[name]
            if default is not None:
                return default
            problems.append(f"{path}: environment variable {name} is not set (or give ${{{name}:-default}})")
            return ""

        parts = data.split("$${")
        return "${".join(_VAR.sub(repl, p) for p in parts)
    if isinstance(data, dict):
        return {k: substitute(v, env, _join(path, str(k)), problems) for k, v in data.items()}
    if isinstance(data, list):
        return [substitute(v, env, f"{path}[{i}]", problems) for i, v in enumerate(data)]
    return data


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# -- conversion that reports every problem ------------------------------------------------------

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Annotated:
        return _type_name(get_args(tp)[0])
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if any(_struct_of(a) is not None or get_origin(a) in (list, dict) for a in args):
            args = tuple(a for a in args if a is not type(None))  # "a mapping", not "a mapping | null"
        return " | ".join(_type_name(a) for a in args)
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, Duration):
        return "duration"
    if tp is ByteSize:
        return "size"
    if origin is dict or (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
        return "a mapping"
    if origin is list:
        return "a list"
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(tp, "__name__", str(tp))


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    """The Struct inside ``tp`` (``S``, ``S | None``, ``Annotated[S, ...]``), if any."""
    if get_origin(tp) is Annotated:
        return _struct_of(get_args(tp)[0])
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    if get_origin(tp) in (Union, types.UnionType):
        structs = [a for a in get_args(tp) if isinstance(a, type) and issubclass(a, msgspec.Struct)]
        return structs[0] if len(structs) == 1 else None
    return None


def _list_item(tp: Any) -> Any:
    if get_origin(tp) is Annotated:
        return _list_item(get_args(tp)[0])
    return get_args(tp)[0] if get_origin(tp) is list else None


def _dict_value(tp: Any) -> Any:
    """The value type of a ``dict[str, S]`` whose values are structs (walked key by key), else None."""
    if get_origin(tp) is Annotated:
        return _dict_value(get_args(tp)[0])
    if get_origin(tp) is dict and _struct_of(get_args(tp)[1]) is not None:
        return get_args(tp)[1]
    return None


def convert(data: Any, tp: type[T], path: str, problems: list[str]) -> T | None:
    """Convert ``data`` to ``tp``, appending one line per problem (all of them) to ``problems``."""
    try:
        return msgspec.convert(data, tp, strict=False, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        first = str(exc)
    before = len(problems)
    _explain(data, tp, path, problems)
    if len(problems) == before:  # a constraint msgspec saw that the walk did not: report it as is
        problems.extend(_rewrite(first, path, data, tp))
    return None


def _explain(data: Any, tp: Any, path: str, problems: list[str]) -> None:
    struct = _struct_of(tp)
    item = _list_item(tp)
    if struct is not None and isinstance(data, dict):
        fields = {f.encode_name: f for f in msgspec.structs.fields(struct)}
        for key, value in data.items():
            if key not in fields:
                near = difflib.get_close_matches(str(key), list(fields), n=1)
                hint = f" (did you mean {near[0]}?)" if near else f"; expected one of: {', '.join(sorted(fields))}"
                problems.append(f"{_join(path, str(key))}: unknown key{hint}")
                continue
            _leaf(value, fields[key].type, _join(path, str(key)), problems)
        for name, f in fields.items():
            if f.required and name not in data:
                problems.append(f"{_join(path, name)}: required key is missing")
        return
    if item is not None and isinstance(data, list):
        for i, v in enumerate(data):
            _leaf(v, item, f"{path}[{i}]", problems)
        return
    value = _dict_value(tp)
    if value is not None and isinstance(data, dict):
        for k, v in data.items():
            _leaf(v, value, _join(path, str(k)), problems)
        return
    _leaf(data, tp, path, problems)


def _leaf(value: Any, tp: Any, path: str, problems: list[str]) -> None:
    try:
        msgspec.convert(value, tp, strict=False, dec_hook=_dec_hook)
        return
    except msgspec.ValidationError as exc:
        message = str(exc)
    struct, item, entry = _struct_of(tp), _list_item(tp), _dict_value(tp)
    if ((struct is not None or entry is not None) and isinstance(value, dict)) or (item is not None and isinstance(value, list)):
        before = len(problems)
        _explain(value, tp, path, problems)
        if len(problems) > before:
            return
        # Every key is fine on its own: the struct refused their combination (its __post_init__).
    problems.extend(_rewrite(message, path, value, tp))


_AT = re.compile(r"^(.*?)(?: - at `\$([^`]*)`)?$", re.DOTALL)
_BOUND = re.compile(r"^Expected `(\w+)` (>=|<=|>|<) (\S+)$")
_LENGTH = re.compile(r"^Expected `(\w+)` of length (>=|<=) (\d+)$")
_BOUND_WORDS = {">=": "at least", "<=": "at most", ">": "greater than", "<": "less than"}
_KEYED = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): (.*)$", re.DOTALL)


def _rewrite(message: str, path: str, value: Any = None, tp: Any = None) -> list[str]:
    """A msgspec message as ``path: message`` lines, with our own wording for type mismatches and
    bounds. A struct's ``__post_init__`` may report several problems, one per line; a line that
    starts with one of the struct's keys (``initial_backoff: ...``) is placed at that key's path."""
    m = _AT.match(message)
    text, sub = (m.group(1), m.group(2) or "") if m else (message, "")
    full = path + sub if sub.startswith("[") or not sub else _join(path, sub.lstrip("."))
    known = _value_at(value, sub)
    bound, length = _BOUND.match(text), _LENGTH.match(text)
    if "matching regex" in text:  # say what the pattern means rather than show it
        allowed = "letters, digits and . _ : - (starting with a letter or digit)" if SOURCE_NAME in text else None
        shown = json.dumps(value if known is _UNKNOWN else known, default=str)
        text = f"{shown} is not allowed" + (f": use {allowed}" if allowed else f" ({text})")
    elif bound is not None:
        limit = bound.group(3).removesuffix(".0")
        got = f", got {json.dumps(known, default=str)}" if known is not _UNKNOWN else ""
        text = f"must be {_BOUND_WORDS[bound.group(2)]} {limit}{got}"
    elif length is not None:
        n, op = int(length.group(3)), length.group(2)
        text = "must not be empty" if (op, n) == (">=", 1) else f"must have {_BOUND_WORDS[op]} {n} item(s) or character(s)"
    elif (text.startswith("Expected `") or text.startswith("Invalid enum")) and tp is not None and not sub:
        text = f"expected {_type_name(tp)}, got {json.dumps(value, default=str)}"
    lines = []
    struct = _struct_of(tp) if not sub else None
    keys = {f.encode_name for f in msgspec.structs.fields(struct)} if struct is not None else set()
    for line in text.split("\n"):
        keyed = _KEYED.match(line)
        if keyed is not None and keyed.group(1).split(".")[0] in keys:
            lines.append(f"{_join(full, keyed.group(1))}: {_lower(keyed.group(2))}")
        else:
            lines.append(f"{full}: {_lower(line)}")
    return [line.replace("`", "") for line in lines]


_UNKNOWN = object()


def _value_at(value: Any, sub: str) -> Any:
    """The value msgspec complained about: ``value`` itself, or the part at ``sub`` (``.a[0].b``)."""
    if not sub:
        return value
    for key, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", sub):
        try:
            value = value[key] if key else value[int(index)]
        except (KeyError, IndexError, TypeError, ValueError):
            return _UNKNOWN
    return value


def _lower(text: str) -> str:
    """A message's first letter in lower case (it follows a path and a colon), unless it starts a
    word in capitals (a name: ``SSL_CHECK_HOSTNAME``, ``TLS``)."""
    if not text or text[1:2].isupper() or text[1:2] == "_":
        return text
    return text[0].lower() + text[1:]


# -- loading ------------------------------------------------------------------------------------


def parse_text(text: str, suffix: str) -> Any:
    """Parse YAML (``.yaml``/``.yml``) or TOML (``.toml``) text; raises ConfigError when malformed."""
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml", ".json"):
            return yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError([f"cannot parse the file: {_parse_error(exc)}"]) from exc
    raise ConfigError([f"unknown config file type {suffix!r}: use .yaml, .yml or .toml"])


def _parse_error(exc: Exception) -> str:
    """A parser's message on one line: where, then what (YAML's spans several lines with a caret)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem} (fix the YAML syntax there)"
    return " ".join(str(exc).split())


def from_data(data: Any, env: Mapping[str, str] | None = None) -> Config:
    """Build the Config from parsed data; raises ConfigError listing every problem."""
    problems: list[str] = []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"top level: expected a mapping (sources:, sinks:, ...), got a {type(data).__name__}"])
    data = substitute(data, os.environ if env is None else env, "", problems)
    raw_sinks = data.pop("sinks", [])
    config = convert(data, Config, "", problems)
    sinks: list[SinkConfig] = []
    if not isinstance(raw_sinks, list):
        problems.append(f"sinks: expected a list, got {type(raw_sinks).__name__}")
        raw_sinks = []
    for i, raw in enumerate(raw_sinks):
        if not isinstance(raw, dict):
            problems.append(f"sinks[{i}]: expected a mapping, got {json.dumps(raw, default=str)}")
            continue
        common = {k: v for k, v in raw.items() if k in SINK_KEYS}
        common["options"] = {k: v for k, v in raw.items() if k not in SINK_KEYS}
        sink = convert(common, SinkConfig, f"sinks[{i}]", problems)
        if sink is not None:
            sinks.append(sink)
    _check_names(data.get("sources"), "sources", problems)
    _check_endpoints(data.get("sources"), problems)
    if config is not None:
        _check_semantics(config, sinks, raw_sinks, problems)
    if problems or config is None:
        raise ConfigError(problems)
    config.sinks = sinks
    return config


def _check_names(entries: Any, section: str, problems: list[str]) -> None:
    """Names must be unique within a section (checked on the raw data, so it shows with other problems)."""
    if not isinstance(entries, list):
        return
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            continue
        if name in seen:
            problems.append(f"{section}[{i}].name: {name!r} is already used by {section}[{seen[name]}]")
        seen[name] = i


_ENDPOINT = re.compile(r"^([a-z]+)://(.*)$")


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not a ZMQ endpoint the bridge can use (tcp://host:port, ipc://path),
    with the fix; None when it is."""
    m = _ENDPOINT.match(endpoint)
    if m is None:
        guess = f"tcp://{endpoint}" if re.fullmatch(r"[^/:\s]+:\d+", endpoint) else "tcp://HOST:PORT"
        return f"{endpoint!r} has no transport: write {guess} (or ipc://PATH)"
    scheme, rest = m.groups()
    if scheme == "ipc":
        return None if rest else f"{endpoint!r} names no path"
    if scheme == "inproc":
        return (
            f"{endpoint!r}: an inproc:// socket exists only inside one process, and no engine runs inside the "
            "bridge's: use the engine's tcp://HOST:PORT, or ipc://PATH on a filesystem both see"
        )
    if scheme != "tcp":
        return f"{endpoint!r}: transport {scheme}:// is not supported; use tcp://HOST:PORT or ipc://PATH"
    host, sep, port = rest.rpartition(":")
    if sep and not host and port.isdigit():
        return f"{endpoint!r} has no host: write tcp://HOST:{port} (* to bind every interface)"
    if not sep or not host or not port.isdigit():
        return f"{endpoint!r} has no port: write tcp://{rest or 'HOST'}:PORT (vLLM's default live port is 5557, replay 5558)"
    if not 0 < int(port) < 65536:
        return f"{endpoint!r}: port {port} is out of range (1-65535)"
    return None


def _check_endpoints(entries: Any, problems: list[str]) -> None:
    """Every source's endpoints are ZMQ endpoints (checked on the raw data, beside other problems)."""
    if not isinstance(entries, list):
        return
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        for key in ("endpoint", "replay_endpoint", "snapshot_endpoint"):
            value = entry.get(key)
            problem = endpoint_problem(value) if isinstance(value, str) else None
            if problem is None and isinstance(value, str) and _wildcard_host(value):
                problem = _connected_wildcard(value, key, bool(entry.get("bind")))
            if problem is not None:
                problems.append(f"sources[{i}].{key}: {problem}")


def _wildcard_host(endpoint: str) -> bool:
    """``tcp://*:PORT`` (every interface): an address to bind, never one to connect to."""
    return endpoint.startswith("tcp://") and endpoint[len("tcp://") :].rpartition(":")[0] == "*"


def _connected_wildcard(endpoint: str, key: str, bind: bool) -> str | None:
    """Why a wildcard ``endpoint`` under ``key`` cannot be used: the bridge connects there (every
    endpoint but a live one with ``bind: true``); None when it binds it."""
    port = endpoint.rpartition(":")[2]
    if key == "endpoint":
        if bind:
            return None
        return (
            f"{endpoint!r}: * (every interface) can only be bound, and the bridge connects to the live endpoint: "
            f"give the engine's host (tcp://HOST:{port}), or set bind: true for the engines to connect in"
        )
    return (
        f"{endpoint!r}: * (every interface) can only be bound, and the bridge always connects to the engine's "
        f"{key.split('_')[0]} socket: give the engine's host (tcp://HOST:{port})"
    )


def _check_semantics(config: Config, sinks: list[SinkConfig], raw: list[Any], problems: list[str]) -> None:
    if not config.sources and config.discovery.dns is None:
        problems.append("sources: no sources and no discovery: nothing to read from")
    if not raw:
        problems.append("sinks: at least one sink is required")
    counts: dict[str, int] = {}
    for s in sinks:
        counts[s.type] = counts.get(s.type, 0) + 1
    used: dict[str, int] = {}
    for s in sinks:
        if not s.name:
            n = used.get(s.type, 0)
            s.name = s.type if counts[s.type] == 1 else f"{s.type}-{n}"
            used[s.type] = n + 1
    _check_ports(config.sources, problems, config.metrics.listen)
    _check_files(config, sinks, problems)
    _check_snapshots(config.sources, problems)
    dns = config.discovery.dns
    if dns is not None and dns.replay_port is not None and dns.dp_ranks > 1:
        n = dns.dp_ranks
        if dns.port <= dns.replay_port + n - 1 and dns.replay_port <= dns.port + n - 1:
            problems.append(
                f"discovery.dns.replay_port: {_uses(n, 'live', dns.port)}, which {_overlap(n)} the "
                f"{_ports('replay', dns.replay_port, n)}; rank r uses port + r on both sockets, so the two ports must be "
                f"at least dp_ranks apart: e.g. replay_port {dns.port + n} (and the engines' replay_endpoint with it)"
            )
    names: dict[str, int] = {}
    for i, s in enumerate(sinks):
        if s.name in names:
            problems.append(f"sinks[{i}].name: {s.name!r} is already used by sinks[{names[s.name]}]")
        names[s.name] = i
        if s.format == "raw" and s.granularity == "event":
            s.granularity = "batch"  # raw is always one message per batch
        _check_filters(s, f"sinks[{i}]", problems)


# Names the bridge itself writes in an event-granularity record's header (bridge.schema.HEADER_KEYS,
# spelled out here: config stays free of the output modules).
_HEADER_FIELDS = ("source", "dp_rank", "epoch", "seq", "index", "ts", "schema_version")
_EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_CONTROL_TYPES = ("SourceReset", "EventsLost", "EventBatch")


def _check_filters(sink: SinkConfig, path: str, problems: list[str]) -> None:
    """Field selection and the token policy: only where the sink renders events, and well formed."""
    if sink.format == "raw":
        why = "format raw forwards the engine's bytes untouched, so it cannot"
        if sink.fields is not None:
            problems.append(f"{path}.fields: {why} select fields; use format json or msgpack, or remove fields")
        if sink.token_ids != "keep":
            problems.append(
                f"{path}.token_ids: {why} {sink.token_ids} the token ids (they stay in the payload); use format json or "
                "msgpack, or remove token_ids"
            )
    if sink.token_ids == "hash":
        key = sink.token_ids_key.reveal() if sink.token_ids_key is not None else ""
        if not key:
            problems.append(f"{path}.token_ids_key: required with token_ids: hash (a secret, e.g. ${{KV_TOKEN_KEY}})")
        elif len(key) < TOKEN_KEY_MIN:
            problems.append(
                f"{path}.token_ids_key: {len(key)} characters is too short a key; give at least {TOKEN_KEY_MIN} "
                "(e.g. the output of openssl rand -hex 32)"
            )
    if sink.fields is None:
        return
    _check_rule(sink.fields, f"{path}.fields", problems)
    for name, rule in sink.fields.by_type.items():
        where = f"{path}.fields.by_type.{name}"
        if name in _CONTROL_TYPES:
            problems.append(f"{where}: {name} records are written whole (field selection applies to engine events)")
            continue
        near = difflib.get_close_matches(name, _EVENT_TYPES, n=1, cutoff=0.8)
        if near and near[0] != name:
            problems.append(f"{where}: unknown event type (did you mean {near[0]}?)")
        _check_rule(rule, where, problems)


def _check_rule(rule: FieldRule, path: str, problems: list[str]) -> None:
    if rule.keep is not None and rule.drop is not None:
        problems.append(f"{path}: give keep or drop, not both")
    for key in ("keep", "drop"):
        for j, name in enumerate(getattr(rule, key) or ()):
            if name in _HEADER_FIELDS:
                problems.append(f"{path}.{key}[{j}]: {name} is a header key, written in every record (not an event field)")
            elif name == "type" and key == "drop":
                problems.append(f"{path}.drop[{j}]: type cannot be dropped: consumers tell events apart by it")


_TCP = re.compile(r"^tcp://(.+):(\d+)$")


def _check_snapshots(sources: list[SourceConfig], problems: list[str]) -> None:
    """Each source's snapshot design has the socket it is served on (bridge.snapshot)."""
    for i, source in enumerate(sources):
        design, at = source.snapshot, f"sources[{i}]"
        if design == "off" and source.snapshot_endpoint is not None:
            problems.append(
                f"{at}.snapshot_endpoint: set, but snapshot is off; set snapshot: auto (or the engine's design) to use it, "
                "or remove snapshot_endpoint"
            )
        elif design in ("vllm-57789", "sglang-34407") and source.snapshot_endpoint is None:
            problems.append(f"{at}.snapshot: {design} is served on a snapshot socket of its own: set snapshot_endpoint")
        elif design == "vllm-50134" and source.replay_endpoint is None:
            problems.append(f"{at}.snapshot: vllm-50134 is served on the replay socket: set replay_endpoint")
        elif design == "auto" and source.snapshot_endpoint is None and source.replay_endpoint is None:
            problems.append(
                f"{at}.snapshot: auto needs snapshot_endpoint (vLLM #57789, SGLang #34407) or replay_endpoint "
                "(vLLM #50134): set one, or snapshot: off"
            )


_STANDARD_STREAM = re.compile(r"^/(dev/(stdout|stderr|fd/\d+)|proc/self/fd/\d+)$")


def _check_files(config: Config, sinks: list[SinkConfig], problems: list[str]) -> None:
    """Refuse one file written as two of the bridge's files: a file sink's path that is the
    checkpoint (each save replaces the file, and what the sink wrote with it), the dead-letter
    file, or another file sink's."""
    owners: dict[str, str] = {}
    named = [("checkpoint.path", config.checkpoint.path), ("dead_letter.path", config.dead_letter.path)]
    named += [(f"sinks[{i}].path", s.options.get("path")) for i, s in enumerate(sinks) if s.type == "file"]
    for key, path in named:
        if not isinstance(path, str) or not path or path == "-" or _STANDARD_STREAM.match(path):
            continue  # (this process's own streams, as "-": what they are depends on where it runs)
        real = os.path.realpath(path)
        if os.path.exists(real) and not os.path.isfile(real):
            continue  # (a device, /dev/null or a terminal: written by many at once by design)
        other = owners.setdefault(real, key)
        if other != key:
            problems.append(f"{key}: {path} is also {other}: the bridge would write both into one file; give each its own")


def _bound(host: str, metrics: bool) -> tuple[frozenset[int], str | None]:
    """The addresses a bind on ``host`` takes: its IP families and its address (None: every
    address of those families). A ZMQ socket (IPv6 on: the bridge's) binds ``*`` and ``::``
    dual-stack; ``metrics.listen`` (asyncio) binds ``::`` IPv6 only, and an empty host as
    ``0.0.0.0``. ``localhost`` is the loopback, an IPv4-mapped IPv6 address its IPv4 one."""
    host = host.strip("[]").lower()
    if host in ("", "0.0.0.0") or (host == "*" and metrics):
        return frozenset({4}), None
    if host in ("*", "::"):
        return (frozenset({6}) if metrics else frozenset({4, 6})), None
    host = "127.0.0.1" if host == "localhost" else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return frozenset({4, 6}), host  # (a name: whichever family it resolves to)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return frozenset({ip.version}), str(ip)


def _hosts_meet(side: str, a: str, b: str, metrics: bool = False) -> bool:
    """Do two hosts of one side of a connection take the same addresses? Connected to: the same
    host as written. Bound (``metrics``: ``b`` is ``metrics.listen``'s): see _bound."""
    if side != "bind":
        return a == b
    (fa, xa), (fb, xb) = _bound(a, False), _bound(b, metrics)
    return bool(fa & fb) and (xa is None or xb is None or xa == xb)


def _check_ports(sources: list[SourceConfig], problems: list[str], listen: str = "") -> None:
    """Refuse one host:port used by two port ranges.

    Rank r uses port + r on both sockets (docs/protocol.md section 1), so with several ranks a live and
    a replay port one apart overlap: rank 1's live port would be rank 0's replay port. Only what is
    certainly wrong is refused: the same host, on the same side of the connection (``bind: true``
    binds the live endpoints here, as ``metrics.listen`` does; replay endpoints are always the
    engines', connected to). ``ipc://`` and ``inproc://`` endpoints have no ports.
    """
    seen: list[tuple[str, str, int, int, int, str]] = []  # side, host, first port, last port, source, socket
    host, _, port = listen.rpartition(":")
    if port.isdigit():
        seen.append(("bind", host, int(port), int(port), -1, "metrics"))  # (source -1: metrics.listen)
    for i, source in enumerate(sources):
        n = source.dp_ranks
        sockets = (
            ("live", source.endpoint, "bind" if source.bind else "connect"),
            ("replay", source.replay_endpoint, "connect"),
            ("snapshot", source.snapshot_endpoint, "connect"),  # (one engine's snapshot seeds another's state: I6)
        )
        for kind, endpoint, side in sockets:
            m = _TCP.match(endpoint or "")
            if m is None:
                continue
            host, first = m.group(1).lower(), int(m.group(2))
            last = first + n - 1
            key = {"live": "endpoint", "replay": "replay_endpoint", "snapshot": "snapshot_endpoint"}[kind]
            if last > 65535:
                problems.append(f"sources[{i}].dp_ranks: ranks 0..{n - 1} would use {kind} ports up to {last} (> 65535)")
            for side2, host2, first2, last2, j, kind2 in seen:
                if side2 != side or not _hosts_meet(side, host, host2, j < 0) or first > last2 or first2 > last:
                    continue
                if j < 0:
                    problems.append(
                        f"sources[{i}].{key}: {_uses(n, kind, first)} on {host}, which {_overlap(n)} metrics.listen "
                        f"({listen}); a port can be bound once: choose another port for one of them"
                    )
                elif j == i and (kind2, kind) != ("live", "replay"):
                    problems.append(
                        f"sources[{i}].{key}: {_uses(n, kind, first)}, which {_overlap(n)} its "
                        f"{_ports(kind2, first2, last2 - first2 + 1)}; rank r uses port + r on every socket, so the ports "
                        "must be at least dp_ranks apart"
                    )
                elif j == i:  # this source's live range, seen just before
                    problems.append(
                        f"sources[{i}].{'dp_ranks' if first != first2 else key}: {_uses(n, 'live', first2)}, which "
                        f"{_overlap(n)} the {_ports('replay', first, n)}; rank r uses port + r on both sockets, so the two "
                        f"ports must be at least dp_ranks apart: e.g. replay_endpoint port {first2 + n} (and the engines' "
                        "replay_endpoint with it)"
                    )
                else:
                    problems.append(
                        f"sources[{i}].{key}: {_uses(n, kind, first)} on {host}, which {_overlap(n)} the "
                        f"{_ports(kind2, first2, last2 - first2 + 1)} of sources[{j}] ({sources[j].name}); "
                        + ("a port can be bound once" if side == "bind" else "one host:port is one socket of one engine rank")
                    )
            seen.append((side, host, first, last, i, kind))


def _uses(n: int, kind: str, first: int) -> str:
    """``ranks 0..1 use live ports 5557-5558`` / ``rank 0 uses live port 5557``."""
    return f"ranks 0..{n - 1} use {_ports(kind, first, n)}" if n > 1 else f"rank 0 uses {_ports(kind, first, n)}"


def _ports(kind: str, first: int, n: int) -> str:
    return f"{kind} ports {first}-{first + n - 1}" if n > 1 else f"{kind} port {first}"


def _overlap(n: int) -> str:
    return "overlap" if n > 1 else "overlaps"


def label_names(data: Any) -> frozenset[str]:
    """Every label a source of the (parsed, maybe invalid) config ``data`` can carry: the labels of
    the static sources, and with DNS discovery its labels and ``address``. Name templates may use these."""
    names: set[str] = set()
    if not isinstance(data, dict):
        return frozenset()
    for source in data.get("sources") or []:
        if isinstance(source, dict) and isinstance(source.get("labels"), dict):
            names |= {str(k) for k in source["labels"]}
    discovery = data.get("discovery")
    dns = discovery.get("dns") if isinstance(discovery, dict) else None
    if isinstance(dns, dict):
        names.add("address")
        if isinstance(dns.get("labels"), dict):
            names |= {str(k) for k in dns["labels"]}
    return frozenset(names)


_URL_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@\s]*:([^/@\s]+)@", re.IGNORECASE)


def plain_secrets(data: Any, tp: Any, path: str) -> list[str]:
    """Where the raw (not yet substituted) ``data`` of type ``tp`` holds a secret written out: a
    secret string (:class:`~bridge.secret.Secret`) or a password inside a URL that is not taken
    from the environment with ``${VAR}``. One warning line per place, with the fix."""
    out: list[str] = []
    fix = "is written in plain text in the config file: give it as ${VAR} from the environment (the chart: secretEnv)"
    if isinstance(data, str):
        if _holds_secret(tp) and data and "${" not in data:
            out.append(f"{path}: this secret {fix}")
        m = _URL_PASSWORD.match(data)
        if m is not None and "${" not in m.group(1):
            out.append(f"{path}: the password in this URL {fix}")
        return out
    struct, item = _struct_of(tp), _list_item(tp)
    if isinstance(data, dict) and struct is not None:
        fields = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}
        for key, value in data.items():
            if key in fields:
                out.extend(plain_secrets(value, fields[key], _join(path, str(key))))
    elif isinstance(data, dict) and get_origin(tp) is dict:
        for key, value in data.items():
            out.extend(plain_secrets(value, get_args(tp)[1], _join(path, str(key))))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out.extend(plain_secrets(value, item if item is not None else _element(tp), f"{path}[{i}]"))
    return out


def _holds_secret(tp: Any) -> bool:
    if get_origin(tp) is Annotated:
        return _holds_secret(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        return any(_holds_secret(a) for a in get_args(tp))
    return tp is Secret


def _element(tp: Any) -> Any:
    """The list type inside ``tp`` (``str | list[str]``), or Any."""
    if get_origin(tp) is Annotated:
        return _element(get_args(tp)[0])
    for a in get_args(tp) if get_origin(tp) in (Union, types.UnionType) else ():
        if get_origin(a) is list:
            return get_args(a)[0]
    return Any


def read(path: str | Path) -> Any:
    """The parsed (not yet validated) content of a config file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read the config file ({exc.strerror or exc})"]) from exc
    return parse_text(text, p.suffix.lower())


def load(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read, substitute and validate a config file."""
    return from_data(read(path), env)


def raw_sink_options(data: Any, env: Mapping[str, str] | None = None) -> list[tuple[int, str, dict[str, Any]]]:
    """(index, type, connector keys) of every sink entry that names a type, for validating the
    connector options even when other parts of the file are wrong (``--check`` lists everything)."""
    out: list[tuple[int, str, dict[str, Any]]] = []
    sinks = data.get("sinks") if isinstance(data, dict) else None
    if not isinstance(sinks, list):
        return out
    ignored: list[str] = []
    for i, raw in enumerate(sinks):
        if isinstance(raw, dict) and isinstance(raw.get("type"), str):
            options = {k: v for k, v in raw.items() if k not in SINK_KEYS}
            out.append((i, raw["type"], substitute(options, os.environ if env is None else env, f"sinks[{i}]", ignored)))
    return out


def sink_config(data: Any, index: int, env: Mapping[str, str] | None = None) -> SinkConfig | None:
    """Sink ``index`` of the parsed ``data`` on its own (None if its own keys are wrong), named as
    given or after its type: to check a sink's connector while other parts of the file are wrong."""
    raw = data["sinks"][index]
    ignored: list[str] = []
    raw = substitute(raw, os.environ if env is None else env, f"sinks[{index}]", ignored)
    common = {k: v for k, v in raw.items() if k in SINK_KEYS}
    common["options"] = {k: v for k, v in raw.items() if k not in SINK_KEYS}
    sink = convert(common, SinkConfig, f"sinks[{index}]", ignored)
    if sink is not None and not sink.name:
        sink.name = sink.type
    return sink


def convert_options(options: Mapping[str, Any], tp: type[T], path: str) -> T:
    """Validate a connector's own keys against its Options struct; raises ConfigError."""
    problems: list[str] = []
    result = convert(dict(options), tp, path, problems)
    if problems or result is None:
        raise ConfigError(problems)
    return result


Hook = Callable[[type, Any], Any]
dec_hook: Hook = _dec_hook
