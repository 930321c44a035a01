"""NATS sink: JetStream (acknowledged, duplicate-safe) or core NATS (at most once).

Every message goes to a subject rendered from a template (default ``kv.{source}.{dp_rank}``) and
carries the stream header as NATS headers. A value put into a placeholder has ``.``, whitespace and
the wildcards replaced by ``_`` (``llama-3.1`` -> ``kv.llama-3_1.0``): one placeholder, one token.

``mode: jetstream``: each message carries ``Nats-Msg-Id`` = its subject, a space and
``Message.msg_id`` (:func:`js_msg_id`), so the server stores a message sent again within the
stream's duplicate window once, while two sinks (or bridges) whose subjects one stream captures
keep their own (a subject holds no whitespace). JetStream acknowledges each
message on its own, and may refuse one and store the next (a full ``discard: new`` stream takes a
smaller message after refusing a larger one; a cluster fails a publish during a leader change). The
delivery contract (:mod:`bridge.connector`) forbids storing a later message of a bridge stream
after an earlier one failed, so a write publishes its messages at once, each with
``Nats-Expected-Last-Msg-Id`` = the id of the one sent before it: the server stores a message only
right after its predecessor, and after a failure refuses everything later in the write ("wrong
last msg ID"). A duplicate passes that check (the server drops it first), and the last id survives
a server restart. The refused messages of bridge streams that did not fail themselves are then
sent again in turn (each after the previous one's ack, streams in parallel); a stream that failed
keeps the rest of its messages failed, and the runtime writes them again, in order. Another
publisher on the stream, or a second JetStream stream capturing some of the write's subjects,
breaks the chain too: what follows the break then goes in turn.

``mode: core``: a write publishes every message, then one flush (PING/PONG) proves the server has
them; only subscribers connected then get them. A failed flush fails the whole write, which the
runtime sends again (copies possible; consumers deduplicate on the stream header). What nats-py
buffered for a lost socket is dropped, so the first copies arrive in order.

A subject no JetStream stream captures fails at once (the server answers "no responders") with
reason ``no_stream``; ``connect()`` checks that a stream captures the subjects, so ``health()``,
``/readyz`` and ``--check`` report it before any traffic.

A stream lost during a run (deleted, or a restart of a server that kept it in memory) is noticed
by the write that finds no stream capturing its subjects, or whose new messages are stored at
sequence numbers the stream had passed (created again by someone else): ``stream.create`` creates
it again (the configured settings), and the next write raises ``SinkLost`` before storing
anything, with a span per bridge stream (:class:`_Held`: from the first seq the stream stored, 0
when that is unknown, to the last acknowledged), so the runtime announces the loss to this sink's
consumers and clears their state. ``connect()`` warns about a stream or bucket kept in memory.

``state.enabled`` (JetStream mode; README "State bootstrap"): each engine stream's live blocks go
to a JetStream KV bucket (history 1), under ``{source token}.{dp_rank}.{entry key}`` (the entry
key of :mod:`bridge.state_docs`, ``GPU/0/<16 hex>``; :func:`state_token` escapes the source
injectively) and its head under ``{source token}.{dp_rank}._head``, with ``next`` = the JetStream
sequence after the last message of the stream stored so far. A write stores its messages first;
then, per engine stream, the state messages up to its first failure are folded into one bucket
write (:func:`fold_deltas`), in this order, each step acknowledged before the next:

1. the write's *journal* (``_journal.{source token}.{dp_rank}.0``, further parts under ``.p.N``:
   whether it clears, every entry it puts or deletes, the head it ends with), its first part
   written only over the one this connector wrote last: the fence that shows another writer of
   the stream before any entry is touched (:meth:`NatsConnector._write_journal`);
2. a clear: one subject-filtered purge of the stream's keys (ADR-8 / ADR-10: no per-key marker,
   whatever their number; it takes the head too);
3. every entry put (a :mod:`bridge.state_docs` document) or removed (a purge of its key) at once;
4. the head.

A removed entry is purged, not deleted: a KV delete leaves a ``DEL`` marker per key (history 1:
the marker replaces the value) until the stream's next clear, and a long-running engine rarely
clears, so the bucket would grow with every block ever removed. A purge leaves nothing: the bucket
holds each stream's live entries, its head and its journal (one JetStream API request per removed
block, up to 64 at once).

A consumer never reads a head ahead of its entries (the head is last); entries ahead of the head
are what the bootstrap's version rule is for. A tracker rebuilt by ``read_state`` has no such
rule (it would apply those records twice), so ``read_state`` first finishes, from its journal, a
write the last process was killed in. :func:`kv_consumer.nats.bootstrap` is the consumer side.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.header
import itertools
import json
import logging
import random
import re
import secrets
import ssl
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, NamedTuple
from urllib.parse import urlsplit

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.api import RawStreamMsg
from nats.js.client import JetStreamContext

from bridge.connector import (
    EPOCHS_REMEMBERED,
    STATE_TYPE,
    ByteSize,
    ConfigError,
    ConnectorError,
    ConnectorOptions,
    Duration,
    Message,
    NotConnected,
    PartialFailure,
    Permanent,
    Record,
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
    redact_url,
    rendered,
    resent_spans,
    reveal,
    sample_message,
    server_address,
    smallest_record,
    unreadable,
)
from bridge.state import EntryChange, Head
from bridge.state_docs import StateFormat, entry_key, head_of, parse, seed_entry
from kv_consumer.nats import HEAD_KEY, state_prefix, state_token, sweep

from . import _nats_internals as internals

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"

# -- subjects -----------------------------------------------------------------------------------

# What a subject token cannot hold: the separator, whitespace (the protocol splits on it), the
# wildcards and control characters.
_UNSAFE_TOKEN = re.compile(r"[.\s*>\x00-\x1f\x7f]")


def subject_token(value: str) -> str:
    """``value`` made into exactly one subject token (unsafe characters become ``_``)."""
    return _UNSAFE_TOKEN.sub("_", value) or "_"


def subject_problem(subject: str, *, wildcards: bool) -> str | None:
    """Why ``subject`` is not a valid NATS subject (with wildcards when allowed), or None."""
    tokens = subject.split(".")
    for i, token in enumerate(tokens):
        if not token:
            return "it has an empty token (a leading, trailing or doubled '.')"
        if re.search(r"[\s\x00-\x1f\x7f]", token):
            return "it contains whitespace or a control character"
        if "*" in token or ">" in token:
            if not wildcards:
                return "it contains a wildcard (* or >), which cannot be published to"
            if token not in ("*", ">") or (token == ">" and i != len(tokens) - 1):
                return "a wildcard must be a whole token ('>' only the last)"
    return None


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some subject matches both subject filters (``*`` one token, ``>`` the rest)."""
    x, y = a.split("."), b.split(".")
    for i in range(min(len(x), len(y))):
        if x[i] == ">" or y[i] == ">":
            return True
        if x[i] != y[i] and x[i] != "*" and y[i] != "*":
            return False
    return len(x) == len(y)


def subject_filter(text: str) -> str:
    """The wildcard subject covering every subject the template renders (``kv.*.*``); a
    placeholder is one token, whatever its name holds (``{labels.zone}``)."""
    marked = _FIELD.sub("{}", text)
    return ".".join("*" if "{" in token else token for token in marked.split("."))


_FIELD = re.compile(r"\{[^{}]*\}")


def _clean(stream: Stream) -> Stream:
    """``stream`` with its source and labels made subject tokens (see :func:`subject_token`)."""
    return Stream(subject_token(stream.source), stream.dp_rank, {k: subject_token(v) for k, v in stream.labels.items()})


class _Subjects:
    """The subject of a message: the template rendered with sanitised values (cached per stream
    and type, like :class:`Template` itself).

    A template that names ``{source}`` and ``{dp_rank}`` gives each engine stream subjects of its
    own, which consumers follow one stream at a time. Sanitising can still map two source names
    to one token (``llama.a`` and ``llama_a``): the first stream to render a subject owns it, and
    another stream's messages for it are refused (:meth:`taken`), never mixed into its subject.
    The configured sources are checked before a run (``destination()``, see
    :mod:`bridge.connector`); this catches those found at run time. In JetStream mode, with no
    ``{type}`` or ``{epoch}`` in the template, the subject's last message also names its owner
    (:meth:`NatsConnector._claim`): another bridge's stream, or this one's before a restart; each
    write is then stored only over the last message this connector knows there (its fence), so
    another bridge's stream that took the subject over meanwhile is seen."""

    def __init__(self, text: str) -> None:
        self.template = Template(text, "subject")
        self._cache: dict[tuple[str, int, str, int], str] = {}
        self._apart = {"source", "dp_rank"} <= set(self.template.fields)
        # A stream's base subject (see render) -> the stream key that rendered it first, and
        # stream key -> (base subject, its owner) for a stream refused. One entry per stream met.
        self._owners: dict[str, str] = {}
        self._taken: dict[str, tuple[str, str]] = {}
        # Whether a stream's subject is one the JetStream stream can say the owner of (its last
        # message), and the streams whose owner it said in this process (see NatsConnector._claim).
        self.claims = self._apart and not {"type", "epoch"} & set(self.template.fields)
        self.claimed: set[str] = set()

    def render(self, message: Message) -> str:
        if self.template.static:
            return self.template.text
        stream = message.record.stream
        key = (stream.source, stream.dp_rank, message.type, message.record.epoch)
        subject = self._cache.get(key)
        if subject is None:
            if len(self._cache) > 100_000:
                self._cache.clear()  # (the owners stay: one per stream)
            clean = _clean(stream)
            probe = msgspec.structs.replace(
                message, record=Record(stream=clean, epoch=message.record.epoch, seq=0), type=subject_token(message.type)
            )
            subject = self._cache[key] = self.template.render(probe)
            base = self.base(stream)
            if base is not None and stream.key not in self._taken:
                owner = self._owners.setdefault(base, stream.key)
                if owner != stream.key:
                    self._taken[stream.key] = (base, owner)
        return subject

    def base(self, stream: Stream) -> str | None:
        """The subject of ``stream``'s batches in epoch 0 when each stream has subjects of its own
        (None: streams share subjects by design). It depends on the stream alone, so it names the
        stream's subjects as a whole, whatever types and epochs they render."""
        return self.template.render(sample_message(_clean(stream))) if self._apart else None

    def claim(self, stream: Stream, holder: str | None) -> str | None:
        """What the JetStream stream says of ``stream``'s subject: ``holder``, the stream key of
        its last message (None: it holds none), owns it, whatever this process met first (another
        bridge may have written it since: see NatsConnector._claim); a subject that holds none, or
        ``stream``'s own, is ``stream``'s unless this process gave it another owner. Returns the
        owner when the subject is newly found another stream's."""
        self.claimed.add(stream.key)
        base = self.base(stream)
        if base is None or stream.key in self._taken:
            return None
        owner = holder if holder is not None and holder != stream.key else self._owners.setdefault(base, stream.key)
        if owner == stream.key:
            return None
        self._taken[stream.key] = (base, owner)
        return owner

    def taken(self, message: Message, prefix: str) -> Permanent | None:
        """The refusal of a message whose stream's subject another stream owns (see the class
        docstring), after :meth:`render`; None for every other message."""
        if not self._taken:
            return None
        clash = self._taken.get(message.record.stream.key)
        if clash is None:
            return None
        return StreamRefused(self.refusal(message.record.stream, prefix), reason="subject_taken")

    def refusal(self, stream: Stream, prefix: str) -> str:
        """Why ``stream``'s messages are refused (it is :meth:`taken`): both streams and the fix."""
        subject, owner = self._taken[stream.key]
        return (
            f"{prefix}: subject {subject!r} is written by stream {owner!r} already: the names of its source and "
            f"{stream.source!r} become the same subject token ('.', whitespace, '*' and '>' turn "
            "into '_'); rename one of the two sources (discovery.dns.prefix for discovered ones)"
        )


# -- state keys and writes (pure) ----------------------------------------------------------------

JOURNAL_KEY = "_journal"


class StateOp(msgspec.Struct):
    """The deltas of one stream in one write, folded into what the bucket must change: when
    ``clear``, every key of the stream goes (one purge); then each change (the newest per entry,
    with the head of the delta that made it: its version); then ``head`` (with ``next``)."""

    head: Head
    next: int | None
    clear: bool = False
    changes: dict[tuple[str | None, int | None, int], tuple[EntryChange, Head]] = msgspec.field(default_factory=dict)


def fold_deltas(deltas: Sequence[tuple[StateDelta, int | None]]) -> StateOp | None:
    """One :class:`StateOp` for a stream's consecutive ``(delta, next)`` pairs (stale ones left
    out); None when there is nothing to write. A clear drops the changes before it (it purges
    them), a later change of an entry replaces an earlier one: the bucket ends as after each in turn."""
    op: StateOp | None = None
    for delta, next_ in deltas:
        if delta.stale:
            continue
        if op is None:
            op = StateOp(delta.head, next_)
        if delta.clear:
            op.clear = True
            op.changes.clear()
        for change in delta.changes:
            key = (change.medium, change.group_idx, change.block)
            op.changes.pop(key, None)  # re-inserted last: the newest delta's order (parents first)
            op.changes[key] = (change, delta.head)
        op.head = delta.head
        op.next = next_
    return op


def _order(head: Head) -> tuple[int, int, int]:
    return (head.epoch, head.generation, head.seq)


_journal_encoder = msgspec.json.Encoder()


class _Journal(msgspec.Struct):
    target: tuple[int, int, int]
    part: int
    parts: int
    head: msgspec.Raw
    ops: list[tuple[str, msgspec.Raw]]  # a document, or null (a delete)
    clear: bool = False
    writer: str = ""  # the connector that wrote it (a random id per process; "" before it was kept)


class _JournalAt(NamedTuple):
    """A journal part as the bucket holds it: its bucket seq (0: none), the target of its write
    (None: none, or unreadable), its writer, and the part as read (None: one this connector wrote)."""

    seq: int
    target: tuple[int, int, int] | None = None
    writer: str = ""
    part: _Journal | None = None


_journal_decoder = msgspec.json.Decoder(_Journal)
_NULL = msgspec.Raw(b"null")


def journal_part_key(prefix: str, part: int) -> str:
    """The key of a journal's part: the first, the fence, alone under ``_journal.{prefix}.0``; the
    others under ``_journal.{prefix}.p.``, which one purge removes."""
    return f"{JOURNAL_KEY}.{prefix}.0" if part == 0 else f"{JOURNAL_KEY}.{prefix}.p.{part}"


def journal_parts(
    head: Head, head_doc: bytes, ops: Sequence[tuple[str, bytes | None]], limit: int, *, clear: bool = False, writer: str = ""
) -> list[bytes]:
    """The journal of one state write: whether it purges the stream first, every entry it puts (a
    document) or deletes (None) and the head it ends with, in parts of about ``limit`` bytes. It is
    stored before anything else of the write, so a bridge killed half-way finds it and completes
    the write (see read_state)."""
    target = _order(head)
    chunks: list[list[tuple[str, msgspec.Raw]]] = [[]]
    size = 0
    for key, value in ops:
        n = len(key) + (len(value) if value is not None else 4) + 8
        if chunks[-1] and size + n > limit:
            chunks.append([])
            size = 0
        chunks[-1].append((key, _NULL if value is None else msgspec.Raw(value)))
        size += n
    raw_head = msgspec.Raw(head_doc)
    return [_journal_encoder.encode(_Journal(target, i, len(chunks), raw_head, c, clear, writer)) for i, c in enumerate(chunks)]


def journal_redo(parts: Sequence[bytes], head: Head | None) -> tuple[bool, list[tuple[str, bytes | None]], bytes] | None:
    """What a stored journal says to write again: (purge first?, [(entry key, document or None)],
    head document), when it is complete and ahead of ``head`` (the stored head, None when there is
    none: the write did not finish); else None."""
    by_target: dict[tuple[int, int, int], dict[int, _Journal]] = {}
    for raw in parts:
        try:
            j = _journal_decoder.decode(raw)
        except msgspec.DecodeError:
            continue
        by_target.setdefault(j.target, {})[j.part] = j
    for target in sorted(by_target, reverse=True):
        if head is not None and target <= _order(head):
            return None
        got = by_target[target]
        first = next(iter(got.values()))
        if len(got) != first.parts or set(got) != set(range(first.parts)):
            continue  # written in part only: no entry of that write was stored
        ops = [(k, None if bytes(v) == b"null" else bytes(v)) for i in range(first.parts) for k, v in got[i].ops]
        return first.clear, ops, bytes(first.head)
    return None


# -- options ------------------------------------------------------------------------------------


class StreamOptions(ConnectorOptions):
    """The JetStream stream, created at connect when ``create`` is true and it does not exist."""

    create: Annotated[bool, doc("Create the stream at connect when it does not exist (an existing one is left as is).")] = False
    name: Annotated[str, doc("Stream name.")] = "KV_EVENTS"
    subjects: Annotated[
        list[str] | None, doc("Subjects the stream captures; default: the subject template with placeholders as '*'.")
    ] = None
    retention: Annotated[
        Literal["limits", "interest", "workqueue"],
        doc("JetStream retention policy; interest and workqueue drop consumed messages (refused with state.enabled)."),
    ] = "limits"
    storage: Annotated[Literal["file", "memory"], doc("JetStream storage.")] = "file"
    max_age: Annotated[Duration | None, doc("Messages older than this are removed (null: no limit).")] = None
    max_bytes: Annotated[ByteSize | None, doc("Oldest messages are removed past this size (null: no limit).")] = None
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5, description="Replicas in a JetStream cluster.")] = 1
    duplicate_window: Annotated[
        Duration | None,
        doc(
            "How long the server remembers Nats-Msg-Id values to drop re-sent messages (null: 2m, or max_age when "
            "that is shorter, as nats-server picks; at most max_age). Cover the longest time from a first send to a "
            "re-send (write timeout and retries, a bridge restart); the server holds about rate x window ids in memory."
        ),
    ] = None

    def __post_init__(self) -> None:
        if not self.name or re.search(r"[.*>\s/\\]", self.name):
            raise ValueError(f"stream.name {self.name!r} is not a valid JetStream stream name (no '.', '*', '>', '/', spaces)")
        if self.subjects is not None and not self.subjects:
            raise ValueError("stream.subjects: give at least one subject (or leave it out)")
        for subject in self.subjects or []:
            problem = subject_problem(subject, wildcards=True)
            if problem:
                raise ValueError(f"stream.subjects: {subject!r} is not a valid NATS subject: {problem}")
        if self.create and self.duplicate_window and self.max_age and self.duplicate_window > self.max_age:
            # nats-server refuses the stream (10052: "duplicates window can not be larger then max age"):
            # refused here, so that --check (even offline) and the run agree.
            raise ValueError(
                f"stream.duplicate_window ({self.duplicate_window:g}s) must not exceed stream.max_age "
                f"({self.max_age:g}s), or nats-server refuses to create the stream: lower duplicate_window to at most "
                f"{self.max_age:g}s (or leave it out: it is then {self.max_age:g}s), or raise max_age"
            )

    @property
    def window(self) -> float:
        """The duplicate window the stream is created with: ``duplicate_window``, else the server's
        own choice when none is given (2 minutes, or ``max_age`` when that is shorter)."""
        if self.duplicate_window:
            return self.duplicate_window
        return min(DEFAULT_DUPLICATE_WINDOW, self.max_age) if self.max_age else DEFAULT_DUPLICATE_WINDOW


DEFAULT_DUPLICATE_WINDOW = 120.0
"""nats-server's duplicate window for a stream created without one (seconds)."""


_BUCKET_NAME = re.compile(r"[A-Za-z0-9_-]+")


class StateOptions(ConnectorOptions):
    """The live-block state (docs/output/state.md): a JetStream key-value bucket, JetStream mode only."""

    enabled: Annotated[
        bool,
        doc(
            "Keep each engine stream's live blocks and head in a JetStream KV bucket (keys <source>.<dp_rank>.<entry> "
            "and <source>.<dp_rank>._head; characters of the source other than letters, digits, _ and - become =XX), "
            "written after the stream's messages are acknowledged. JetStream mode, backpressure: block."
        ),
    ] = False
    bucket: Annotated[str, doc("KV bucket name (its JetStream stream is KV_<bucket>).")] = "KV_STATE"
    create: Annotated[
        bool, doc("Create the bucket at connect (history 1) when it does not exist (an existing one is left as is).")
    ] = False
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5, description="Replicas of a bucket created here.")] = 1
    storage: Annotated[Literal["file", "memory"], doc("Storage of a bucket created here.")] = "file"
    max_bytes: Annotated[
        ByteSize | None, doc("Size limit of a bucket created here (null: none); a full bucket fails state writes (retried).")
    ] = None

    def __post_init__(self) -> None:
        if not _BUCKET_NAME.fullmatch(self.bucket):
            raise ValueError(f"bucket {self.bucket!r} is not a valid KV bucket name (letters, digits, '_', '-')")


class NatsOptions(ConnectorOptions):
    """Keys of a ``type: nats`` sink."""

    servers: Annotated[
        str | list[str], doc("NATS server URL(s): nats://host:4222, tls://host:4222 (several: tried in turn).")
    ] = "nats://127.0.0.1:4222"
    subject: Annotated[
        str,
        doc(
            "Subject template: {source}, {dp_rank}, {type}, {epoch}, {labels.NAME}. Values have '.', spaces "
            "and wildcards replaced by '_'."
        ),
    ] = "kv.{source}.{dp_rank}"
    mode: Annotated[
        Literal["jetstream", "core"],
        doc("jetstream: acknowledged, duplicate-safe via Nats-Msg-Id; core: at-most-once, flushed per write."),
    ] = "jetstream"
    credentials: Annotated[str | None, doc("Path of a .creds file (user JWT and nkey seed).")] = None
    nkey_seed: Annotated[str | None, doc("Path of a file holding a user nkey seed.")] = None
    user: Annotated[str | None, doc("User name (with password).")] = None
    password: Annotated[Secret | None, doc("Password; use ${VAR} to take it from the environment.")] = None
    token: Annotated[Secret | None, doc("Auth token; use ${VAR} to take it from the environment.")] = None
    tls: Annotated[TlsOptions | None, doc("TLS settings; tls:// server URLs use TLS even without them.")] = None
    connect_timeout: Annotated[Duration, doc("Bound on connect() and on JetStream API calls.")] = Duration(5.0)
    reconnect_wait: Annotated[Duration, doc("Pause between reconnect attempts to the same server.")] = Duration(1.0)
    reconnect_jitter: Annotated[
        Duration, doc("Random extra pause (0..this) so that many bridges do not reconnect in lockstep.")
    ] = Duration(0.5)
    ping_interval: Annotated[Duration, doc("Keep-alive PING interval; two missed PONGs count as a lost connection.")] = Duration(
        20.0
    )
    stream: Annotated[StreamOptions, doc("JetStream stream to create when missing (see stream.create).")] = msgspec.field(
        default_factory=StreamOptions
    )
    state: Annotated[StateOptions, doc("Live-block state in a JetStream KV bucket (docs/output/state.md).")] = msgspec.field(
        default_factory=StateOptions
    )

    def __post_init__(self) -> None:
        if not self.server_list or any(not s.strip() for s in self.server_list):
            raise ValueError("servers: give at least one non-empty server URL")
        for url in self.server_list:
            redact_url(url, token_user=True)  # a password or token in a URL is remembered: redact() masks it
        try:
            fields = Template(self.subject, "subject").fields
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        sample = self.subject
        for field in fields:
            sample = sample.replace("{" + field + "}", "x")
        problem = subject_problem(sample, wildcards=False)
        if problem:
            raise ValueError(f"subject: {self.subject!r} is not a valid NATS subject: {problem}")
        given = [k for k in ("credentials", "nkey_seed", "token", "user") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one way to authenticate, not {' and '.join(given)}")
        if (self.user is None) != (self.password is None):
            raise ValueError("user and password go together")
        if self.state.enabled and self.mode != "jetstream":
            raise ValueError("state.enabled: the state needs mode: jetstream (core NATS keeps nothing)")
        if self.state.enabled and self.stream.create and self.stream.retention != "limits":
            raise ValueError(f"stream.retention: {self.stream.retention} not allowed with state.enabled: {_CONSUMED_WITH_STATE}")
        if self.state.enabled and self.stream.name == f"KV_{self.state.bucket}":
            raise ValueError(
                f"stream.name: {self.stream.name!r} is the JetStream stream of state.bucket {self.state.bucket!r}; "
                "name the events stream otherwise"
            )
        banned = [f"{{{f}}}" for f in ("type", "epoch") if f in fields]
        if self.state.enabled and banned:
            raise ValueError(
                f"subject: {' and '.join(banned)} not allowed with state.enabled: a consumer bootstraps from the "
                "state, then follows the engine stream's messages on one subject; remove it, or turn state off"
            )

    @property
    def server_list(self) -> list[str]:
        return [self.servers] if isinstance(self.servers, str) else list(self.servers)

    def file_problems(self, path: str) -> list[str]:
        """The ``credentials`` or ``nkey_seed`` file that the client could not read, or that does
        not hold what it reads (read at validation: see ``local_file_problems``)."""
        problems = []
        for key, what in (("credentials", "a .creds file"), ("nkey_seed", "an nkey seed file")):
            file = getattr(self, key)
            if not file:
                continue
            problem = unreadable(file)
            if problem is None:
                problem = _creds_problem(Path(file).read_bytes(), key == "credentials")
            if problem is not None:
                problems.append(f"{path}.{key}: {file}: {problem} (give the path of {what} the bridge can read)")
        return problems

    def __repr__(self) -> str:
        # The default Struct repr would print the servers as given, with a token or password inside.
        rest = "".join(f", {f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f != "servers")
        return f"NatsOptions(servers={shown_servers(self.server_list)!r}{rest})"


def _login(options: NatsOptions) -> str:
    """Who a sink logs in as, for its marks (each JetStream account has streams of its own): a
    credentials file's account (its user JWT's issuer account), an nkey's public key, a user name
    or a token's CRC-32 (given as options or in the first server URL); "" without credentials.
    A file that cannot be read is named by its path (the connection fails on it anyway)."""
    if options.credentials is not None:
        try:
            lines = Path(options.credentials).read_text().splitlines()
            jwt = next(lines[i + 1] for i, line in enumerate(lines[:-1]) if "BEGIN NATS USER JWT" in line).strip()
            body = jwt.split(".")[1]
            claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            return f"account:{claims.get('nats', {}).get('issuer_account') or claims['iss']}"
        except (OSError, StopIteration, IndexError, KeyError, ValueError, AttributeError):
            return f"creds:{options.credentials}"
    if options.nkey_seed is not None:
        import nkeys

        try:
            key = nkeys.from_seed(bytearray(Path(options.nkey_seed).read_bytes().strip()))
            return f"nkey:{key.public_key.decode()}"
        except Exception:  # nkeys raises its own errors, binascii's and ValueError alike
            return f"nkey:{options.nkey_seed}"
    if options.user is not None:
        return f"user:{options.user}"
    if options.token is not None:
        return f"token:{zlib.crc32((reveal(options.token) or '').encode()):08x}"
    info = urlsplit(options.server_list[0] if "://" in options.server_list[0] else f"nats://{options.server_list[0]}")
    if info.username:  # (as nats-py sends it: not unquoted)
        secret = info.password is None  # nats://TOKEN@host
        return f"token:{zlib.crc32(info.username.encode()):08x}" if secret else f"user:{info.username}"
    return ""


def _creds_problem(content: bytes, creds: bool) -> str | None:
    """What a credentials file (``creds``) or an nkey seed file lacks of what nats-py reads from it:
    the seed is read as nats-py reads it (a credentials file's seed line up to its newline, a
    carriage return kept; a seed file whole, stripped) and parsed by nkeys, as its login does."""
    import nkeys  # (nats-py's own dependency for these logins: the nkeys extra)

    lines = content.split(b"\n")

    def after(marker: bytes) -> bytes | None:
        for i, line in enumerate(lines[:-1]):
            if marker in line:
                return lines[i + 1]
        return None

    if creds:
        if not (after(b"BEGIN NATS USER JWT") or b"").strip():
            return "holds no user JWT (no -----BEGIN NATS USER JWT----- block)"
        seed = after(b"BEGIN USER NKEY SEED")
        if seed is None:
            return "holds no user nkey seed (no -----BEGIN USER NKEY SEED----- block)"
    else:
        seed = content.strip()
    try:
        nkeys.from_seed(bytearray(seed)).wipe()
    except Exception as exc:  # nkeys raises its own errors, binascii's and ValueError alike
        why = (
            "a carriage return ends its seed line (write the file with Unix line ends)"
            if seed.endswith(b"\r")
            else (f"{type(exc).__name__}")
        )
        return f"holds no user nkey seed nkeys can read ({why})"
    return None


def shown_servers(urls: Sequence[str]) -> str:
    """The server URLs as logs, errors, ``/readyz`` and ``--check`` show them: a token given as the
    user part (``nats://TOKEN@host``, NATS's documented form) or a password masked."""
    return ", ".join(redact_url(u, token_user=True) for u in urls)


# -- the wire -----------------------------------------------------------------------------------

_NEWLINES = str.maketrans({"\r": " ", "\n": " "})


def _header_text(value: object) -> str:
    """A header value as nats-py gives it back, as the text it was sent as: nats-py parses headers
    with the email package, which hands back a value with non-ASCII bytes as an ``email.header.Header``
    (its ``str`` replaces them with U+FFFD); its bytes are the UTF-8 that was sent."""
    if not isinstance(value, email.header.Header):
        return "" if value is None else str(value)
    parts = email.header.decode_header(value)
    raw = b"".join(p if isinstance(p, bytes) else p.encode("utf-8", "surrogateescape") for p, _ in parts)
    return raw.decode("utf-8", "replace")


def _names(headers: Mapping[str, Any], stream: Stream) -> bool:
    """Whether a message's headers, as nats-py parsed them, name ``stream`` (``source``, ``dp_rank``).
    The parse also drops a value's leading blanks: a source sent as ``" llama"`` reads ``"llama"``."""
    source = _header_text(headers.get("source"))
    if headers.get("dp_rank") != str(stream.dp_rank) or "source" not in headers:
        return False
    return source == stream.source or source == stream.source.lstrip(" \t")


def header_block(
    headers: dict[str, str], msg_id: str | None = None, expected_last: str | None = None, subject_seq: int | None = None
) -> bytes:
    """The encoded NATS header block of a message, exactly as it goes on the wire.

    Keys are the renderer's fixed names. A CR or LF in a value (an engine's event type is free
    text) becomes a space, as nats-py does: a value must never end the header line early.
    """
    lines = [f"{k}: {v}\r\n" for k, v in headers.items()]
    if msg_id is not None:
        lines.append(f"{MSG_ID_HEADER}: {msg_id}\r\n")
    if expected_last is not None:
        lines.append(f"{EXPECTED_LAST_HEADER}: {expected_last}\r\n")
    if subject_seq is not None:
        lines.append(f"{EXPECTED_SUBJECT_SEQ_HEADER}: {subject_seq}\r\n")
    text = "".join(lines)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        pairs = [line[:-2].partition(": ") for line in lines]
        text = "".join(f"{k}: {v.translate(_NEWLINES).strip()}\r\n" for k, _, v in pairs)
    return b"NATS/1.0\r\n" + text.encode() + b"\r\n"


def js_msg_id(subject: str, m: Message) -> str:
    """The ``Nats-Msg-Id`` of ``m`` on ``subject``: JetStream drops a message as a copy by its id
    across the whole stream, so two sinks' messages of one record, on two subjects of one stream,
    must not share it (one would be dropped unannounced, counted delivered)."""
    return f"{subject} {m.msg_id}"


def hpub(subject: str, reply: str, hdr: bytes, payload: bytes) -> bytes:
    """One ``HPUB`` protocol command (``reply`` empty: none); a ``PUB`` when ``hdr`` is empty."""
    if not hdr:
        line = f"PUB {subject} {reply} {len(payload)}\r\n" if reply else f"PUB {subject} {len(payload)}\r\n"
        return b"".join((line.encode(), payload, b"\r\n"))
    size = len(hdr)
    line = (
        f"HPUB {subject} {reply} {size} {size + len(payload)}\r\n"
        if reply
        else f"HPUB {subject} {size} {size + len(payload)}\r\n"
    )
    return b"".join((line.encode(), hdr, payload, b"\r\n"))


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _StateGone(Permanent):
    """The bucket no longer holds what this connector wrote of a stream's state (see _finish), or
    cannot hold it (``state_too_large``: see _apply_state): the stream's state starts again."""


class _PubAck(msgspec.Struct):
    """The server's reply to a JetStream publish (``duplicate`` is a success too)."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)
# Refusals of a message for itself: past the stream's max_msg_size (10054), headers past the
# server's limit (10097). Every other refusal is about the stream (see _ack_error).
_REFUSED_FOR_ITSELF = frozenset({10054, 10097})
_STREAM_NAME_EXISTS = 10058
# A journal part: its JSON frame (target, part numbers, clear) and, beside an entry's document, its
# key and list framing; a bucket whose values cannot hold a head and an entry is refused at connect.
_JOURNAL_FRAME = 192
_KEY_ROOM = 96
MIN_STATE_VALUE = 1024
# How often writes with state look at the bucket's settings again (see _recheck_bucket); the audit
# looks between writes too, for a sink with none.
BUCKET_RECHECK = 1.0
_MEMORY_STREAM = (
    "what it held is announced lost to this sink's consumers (EventsLost, reason sink_lost:{sink}) and their "
    "states start again incomplete"
)
_MEMORY_BUCKET = "every stream's state starts again incomplete, until its engine's next clear or restart"
_CONSUMED = (
    "its messages leave once consumed (interest: once every consumer interested acknowledged them, at once "
    "while none is; workqueue: once one did), so a consumer that starts later misses what came before, and "
    "nothing announces it"
)
_CONSUMED_WITH_STATE = (
    "a consumer bootstrapping from the state follows the events from the state's head, and those between the "
    "head and its subscription may be gone while the state says complete; use limits retention"
)
_WRONG_LAST_MSG_ID = 10070  # JSStreamWrongLastMsgIDErr: Nats-Expected-Last-Msg-Id did not match
_WRONG_LAST_SUBJECT_SEQ = 10071  # JSStreamWrongLastSequenceErrF: Nats-Expected-Last-Subject-Sequence did not match
EXPECTED_LAST_HEADER = "Nats-Expected-Last-Msg-Id"
EXPECTED_SUBJECT_SEQ_HEADER = "Nats-Expected-Last-Subject-Sequence"
_PROBE = {"Nats-Expected-Stream": "KV_BRIDGE_PERMISSION_PROBE"}  # no stream has this name: nothing is stored


class _Acks:
    """The acks one chain of publishes waits for, in the order sent: filled in as they arrive, or
    failed at once when the connection goes (one wakeup per chain, not per message)."""

    __slots__ = ("_all_in", "error", "left", "msgs", "tokens")

    def __init__(self) -> None:
        self.msgs: list[Msg | None] = []
        self.tokens: list[str] = []
        self.left = 0
        self.error: ConnectorError | None = None
        self._all_in = asyncio.Event()

    def expect(self, token: str) -> int:
        self.tokens.append(token)
        self.msgs.append(None)
        self.left += 1
        return len(self.msgs) - 1

    def unexpect(self) -> None:
        """The last message expected was not sent after all."""
        self.tokens.pop()
        self.msgs.pop()
        self.left -= 1

    def settle(self, position: int, msg: Msg) -> None:
        if self.msgs[position] is None:
            self.msgs[position] = msg
            self.left -= 1
            if self.left == 0:
                self._all_in.set()

    def fail(self, error: ConnectorError) -> None:
        self.error = self.error or error
        self._all_in.set()

    async def wait(self) -> None:
        if self.left > 0 and self.error is None:
            await self._all_in.wait()


def _micros(when: datetime) -> int:
    """A server time as microseconds since 1970 (what a checkpoint mark keeps)."""
    return int(when.timestamp() * 1_000_000)


class _Span(msgspec.Struct):
    """What the events stream holds of one bridge stream, as far as this process knows: its newest
    epoch acknowledged, from ``first`` (0: cannot tell where its copy starts) to ``last``."""

    stream: Stream
    epoch: int
    first: int
    last: int


class _Fence(NamedTuple):
    """A bridge stream's claim of its subject (see NatsConnector._claim): the JetStream stream
    holding the subject, and the seq of the subject's last message there as far as this connector
    knows (0: none)."""

    stream: Stream
    name: str
    seq: int


class _Held:
    """The spans of each bridge stream the events stream acknowledged (SinkLost's spans when it
    loses them), in its newest ``EPOCHS_REMEMBERED`` epochs (a loss reaches back past engine
    restarts: the older epochs' tails are announced too). ``fresh``: the stream was created empty by this process, so a
    bridge stream's copy there starts at the first seq acknowledged; else it may hold earlier ones
    (from 0)."""

    __slots__ = ("fresh", "spans")

    def __init__(self) -> None:
        self.spans: dict[str, list[_Span]] = {}  # oldest first, at most EPOCHS_REMEMBERED
        self.fresh = False

    def note(self, record: Record) -> None:
        if record.kind == "SourceReset":  # no seq of its own: nothing to announce for it
            return
        spans = self.spans.setdefault(record.stream.key, [])
        span = spans[-1] if spans else None
        if span is None or span.epoch < record.epoch:
            first = record.from_seq if record.kind == "EventsLost" and record.from_seq is not None else record.seq
            spans.append(_Span(record.stream, record.epoch, first if self.fresh else 0, record.seq))
            del spans[:-EPOCHS_REMEMBERED]
        elif span.epoch == record.epoch and record.seq > span.last:
            span.last = record.seq

    def take(self, keys: Iterable[str] | None = None) -> list[tuple[Stream, int, int, int]]:
        """Every span (of the bridge streams ``keys``; None: all), oldest epoch first per stream,
        forgotten: the stream that held them is gone."""
        taken = [self.spans.pop(k) for k in (list(self.spans) if keys is None else keys) if k in self.spans]
        return [(s.stream, s.epoch, s.first, s.last) for spans in taken for s in spans]


# -- the connector ------------------------------------------------------------------------------


_ACCOUNT_ROOM_MIN = 64 << 10
"""Less room than this left in an account's JetStream storage is full, for ``--check``: not one
batch of a busy engine would fit."""


class NatsConnector:
    """Writes messages to NATS subjects, through JetStream or core NATS (see the module docstring)."""

    Options: ClassVar[type[NatsOptions]] = NatsOptions
    needs_events: ClassVar[bool] = False  # sends value and headers only: raw batches need no decoding

    def __init__(self, name: str, options: NatsOptions, sink: SinkConfig) -> None:
        self.name = name
        self.options = options
        self.sink = sink
        self._prefix = f"sinks[{name}]"
        self._where = shown_servers(options.server_list)
        self._addresses = frozenset(server_address(u, 4222) for u in options.server_list)  # (places, marks)
        self._login: str | None = None  # (marks: see _login; read at the first mark)
        self._subjects = _Subjects(options.subject)
        self._nc: Client | None = None
        self._would_create = 0  # --check: streams and buckets the run would create (see _check_creatable)
        self._closing = False  # this connector is closing a client of its own
        # A new client for one nats-py closed for good (see _revived): the attempt in flight, and
        # when the next may start.
        self._revival: asyncio.Task[None] | None = None
        self._revive_after = 0.0
        self._last_error: str | None = None
        self._refusal: str | None = None  # the reason (auth, tls) when _last_error is the server refusing us
        self._refused_at = 0.0  # when the server last refused us (see _on_error)
        self._stream_problem: str | None = None
        # Per JetStream stream capturing some of the sink's subjects whose settings refuse every write
        # (see _refusing): why, and its subjects; the bridge streams written there are held back.
        self._refusals: dict[str, tuple[str, list[str]]] = {}
        self._ack_prefix = ""  # JetStream acks: one wildcard inbox subscription, a token per publish
        self._tokens = itertools.count()
        self._acks: dict[str, tuple[_Acks, int]] = {}  # reply token -> who waits for it, at which position
        # The events stream, which the server may lose (deleted; a restart of a server that kept it
        # in memory): its name (from the acks), per JetStream stream the highest seq stored before
        # this write and this write's new ones, lowest and highest (at or below the highest before:
        # a new stream), what it holds of each bridge stream, and what a lost one took with it:
        # announced (SinkLost) at the start of the next write.
        self._events_stream: str | None = None
        self._stream_seqs: dict[str, int] = {}
        # Per bridge stream, the JetStream stream that acknowledged its last message (an operator
        # may split the template's subjects over several): a loss of one is announced to its
        # bridge streams only, and each stream's mark names its own.
        self._homes: dict[str, str] = {}
        self._stream_subjects: dict[str, list[str]] = {}  # each JetStream stream's subjects, as last listed
        # A message was refused as over the max_payload the server announced at connect: the
        # audit reads the server's limit again (raised by a reload, it takes them now).
        self._payload_stale = False
        # When the events stream that acknowledged this pod's messages was created, as the server
        # says, read right after the first acknowledgement (a stream created again by another
        # writer and already past our last seq is told apart by this alone).
        self._stream_created: dict[str, datetime | None] = {}
        self._new_seqs: dict[str, list[int]] = {}
        self._held = _Held()
        # Per bridge stream an earlier run's checkpoint told of (stored_before), not checked yet:
        # its mark (see stored_through) and where the stream resumes (what follows comes again).
        self._marked: dict[str, tuple[Stream, tuple[int, ...], tuple[int, int] | None]] = {}
        # Streams whose events stream was found created again, or gone, while no bridge ran
        # (read_state): their records are known lost, beyond what the head's epoch says (the
        # runtime reads it: bridge.connector).
        self.records_gone: set[str] = set()
        # Per bridge stream whose subject it claimed (see _claim): the JetStream stream holding the
        # subject and the seq of the subject's last message there as far as this connector knows
        # (0: none). A stream's first message of each write is stored only over that one
        # (Nats-Expected-Last-Subject-Sequence), so another writer of the subject since is seen.
        self._fences: dict[str, _Fence] = {}
        # Stream key -> its subject's last message read at the stream's first claim in this process
        # (None: it held none), before this process wrote there: see positions_before_run.
        self._before_run: dict[str, SinkPosition | None] = {}
        self._subject_problem: str | None = None  # a subject another bridge's stream took over (see _claim)
        # JetStream streams whose messages leave when consumed (retention interest, workqueue): a
        # subject there is emptied by its readers, so no fence (each write would find it moved).
        self._consumed: set[str] = set()
        self.creates_nothing = False  # --check: connect() creates nothing (bridge.connector)
        self.configured_streams: list[Stream] = []  # --check: each one's subject must be captured
        self._lost: list[tuple[Stream, int, int, int]] = []
        self._lost_why = ""
        state = options.state
        self.writes_state = state.enabled
        self._bucket = state.bucket
        self._kv_stream = f"KV_{state.bucket}"
        self._kv_prefix = f"$KV.{state.bucket}."
        self._state_problem: str | None = None
        # The server refused a publish or subscription of this user (a permissions violation),
        # until an ack comes through again (see _on_error).
        self._permission_problem: str | None = None
        self._refused = 0  # publishes the server refused for permissions (see _on_error)
        self._next: dict[str, int | None] = {}  # stream key -> JetStream seq its messages continue from
        # How many times this process created the bucket, and at which count each stream last wrote
        # its state (a bucket created again has lost the state of the streams written before).
        self._bucket_life = 0
        self._bucket_lives: dict[str, int] = {}
        # Per stream (its key prefix), the bucket seq and (epoch, generation, seq) of the head this
        # connector wrote (or read back) last: the next head is written only over that one
        # (Nats-Expected-Last-Subject-Sequence), or over another pod's (see _finish), so a bucket
        # purged, created again or restored under it is noticed at that write (I6).
        self._heads: dict[str, tuple[int, tuple[int, int, int]]] = {}
        # Per stream prefix, the journal's first part this connector wrote last:
        # every state write stores its journal first, over that one alone (the fence: see
        # _write_journal), so another writer of the stream is seen before any entry is written.
        self._journals: dict[str, _JournalAt] = {}
        self._writer = secrets.token_hex(8)  # tells this connector's journals from another bridge's
        self._bucket_gone = False  # seen missing since it last held state: its next life has begun
        # Why the bucket, edited during the run, no longer keeps what it is given (a TTL, limits
        # that discard the oldest: see _recheck_bucket), until an operator fixes it; and when a
        # write last looked.
        self._bucket_unfit: str | None = None
        self._bucket_checked = 0.0
        self._value_limit: int | None = None  # the bucket's max_value_size, read at connect
        self._warned: set[str] = set()  # what _warn_once warned about
        self._format: StateFormat | None = None
        if state.enabled:
            try:
                self._format = StateFormat.for_sink(sink)
            except ValueError as exc:
                raise ConfigError([f"{self._prefix}.state.enabled: {exc}"]) from None

    # -- connector hooks ------------------------------------------------------------------------
    async def _stream_exists(self, js: JetStreamContext) -> bool:
        try:
            await js.stream_info(self.options.stream.name)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def connect(self) -> None:
        """Connect (within ``connect_timeout``), subscribe to acks, create or check the stream.

        Raises :class:`NotConnected` naming the sink and the servers when the server cannot be
        reached, authentication or TLS setup fails, or a requested stream cannot be created.
        """
        if self._nc is not None and not self._nc.is_closed:
            return
        nc = Client()
        self._last_error = self._refusal = self._permission_problem = None
        timeout = self.options.connect_timeout
        try:
            # nats-py retries the first connect forever with max_reconnect_attempts=-1.
            async with asyncio.timeout(timeout):
                await nc.connect(**self._client_options())
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await self._close_client(nc)
            if self._last_error is None:
                self._last_error, self._refusal = _describe(exc), _refusal(exc)
            raise self._not_connected(f"cannot connect to NATS at {self._where} within {timeout:g}s") from None
        except Exception as exc:  # the client's own failure (a login it could not set up): the sink waits, not the bridge
            await self._close_client(nc)
            raise NotConnected(
                f"{self._prefix}: the NATS client could not connect to {self._where}: {type(exc).__name__}: {exc}",
                reason="auth",
            ) from None
        self._nc = nc
        try:
            if self.options.mode == "jetstream":
                self._ack_prefix = nc.new_inbox() + "."
                await nc.subscribe(self._ack_prefix + "*", cb=self._on_ack)
            js = nc.jetstream(timeout=timeout)
            if self.options.stream.create and not self.creates_nothing:
                await self._ensure_stream(js)
            so = self.options.stream
            if self.options.mode == "jetstream" and self.creates_nothing and so.create and not await self._stream_exists(js):
                subjects = so.subjects or [subject_filter(self.options.subject)]  # (--check: one the run would create)
                what = f"JetStream stream {so.name!r}"
                await self._check_creatable(nc, js, what, subjects, so.replicas, so.storage, so.max_bytes)
                others = await _all_streams(js)
                wildcard = subject_filter(self.options.subject)
                if not await self._check_capturing(js, others, wildcard):  # (the others the writes would meet)
                    captured = [*subjects, *(f for info in others for f in info.config.subjects or [])]
                    fix = f"add {wildcard!r} to stream.subjects, or create a stream capturing them"
                    self._stream_problem = self._missed(captured, f"{what}, as the run would create it, captures {subjects}", fix)
            elif self.options.mode == "jetstream":
                await self._check_stream(js)
            if self.writes_state:
                await self._check_bucket(js)
            if self.options.mode == "jetstream":
                await self._check_publish(nc)
        except NotConnected:
            await self._discard(nc)
            raise
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await self._discard(nc)
            if self._permission_problem is not None:  # the server answered: it refused something setup needs
                raise NotConnected(self._permission_problem, reason="no_permission") from None
            raise NotConnected(f"{self._prefix}: NATS at {self._where} failed during setup: {_describe(exc)}") from None
        log.info("%s: connected to NATS at %s (%s)", self._prefix, self._where, self.options.mode, extra={"sink": self.name})

    async def _check_publish(self, nc: Client) -> None:
        """The user may publish where the sink writes (one subject of the template, the bucket's
        with state, and under ``--check`` each configured stream's subjects, 64 at once), checked
        without storing anything: each probe names a stream no stream is
        (``Nats-Expected-Stream``), so JetStream refuses it before storing, while the server refuses
        a subject the user may not publish to on the connection's error channel alone (see
        _on_error). Found here, ``--check`` reports it. A probe with no answer within a second says
        nothing either way (not refused). Core mode has no such probe: a message would reach the
        subscribers."""
        subjects = [subject_filter(self.options.subject).replace("*", "_check")]
        if self.writes_state:
            subjects.append(f"{self._kv_prefix}_check")
        # (--check: each configured stream's own subjects too, as a user may be denied some of them)
        subjects += dict.fromkeys(
            self._subjects.render(sample_message(s, t)) for s in self.configured_streams for t in self._types()
        )
        self._permission_problem = None
        window = asyncio.Semaphore(64)

        async def probe(subject: str) -> None:
            async with window:
                if self._permission_problem is None:  # (a refusal fails the probes then waiting: see _on_error)
                    with contextlib.suppress(TimeoutError, nats.errors.Error):
                        await nc.request(subject, b"", timeout=min(1.0, self.options.connect_timeout), headers=_PROBE)

        await asyncio.gather(*(probe(subject) for subject in subjects))
        if self._permission_problem is not None:
            raise NotConnected(self._permission_problem, reason="no_permission")

    async def _discard(self, nc: Client) -> None:
        """A client whose setup failed: closed, and kept closed (the next connect makes a new one)."""
        self._fail_acks(NotConnected(f"{self._prefix}: closed"))
        await self._close_client(nc)

    async def _revived(self) -> Client | None:
        """The client, connected again if nats-py closed it for good: it does so after a server
        error it takes as fatal (a "Maximum Payload Violation" once a configuration reload lowered
        ``max_payload``; an authorization violation), and never reconnects then. A new client learns
        the server's limits afresh, so the message over the new one is then refused for itself.
        One attempt at a time (shielded: a caller's timeout does not cut it short), at most once
        per ``reconnect_wait`` plus jitter; None while not connected."""
        nc = self._nc
        if nc is None or not nc.is_closed:
            return nc
        task = self._revival
        if task is None:
            now = time.monotonic()
            if now < self._revive_after:
                return None
            self._revive_after = now + self.options.reconnect_wait + random.uniform(0, self.options.reconnect_jitter)
            task = self._revival = asyncio.get_running_loop().create_task(self._revive())
        await asyncio.shield(task)
        return self._nc if self._nc is not None and not self._nc.is_closed else None

    async def _revive(self) -> None:
        try:
            log.warning(
                "%s: the NATS client was closed (%s): connecting again",
                self._prefix,
                self._last_error or "by the server",
                extra={"sink": self.name},
            )
            with contextlib.suppress(NotConnected):
                await self.connect()
        finally:
            self._revival = None

    async def write(self, messages: Sequence[Message]) -> None:
        """JetStream: return once every message is acknowledged; core: once flushed."""
        if not messages:
            return
        nc = await self._revived()
        if nc is None or nc.is_closed:
            raise NotConnected(f"{self._prefix}: not connected to NATS at {self._where}")
        if not nc.is_connected:
            raise self._reconnecting()
        if self._marked:
            await self._check_marked(nc)
        self._raise_lost()  # before anything of this write is stored: the runtime announces, then writes again
        errors = await (self._write_core(nc, messages) if self.options.mode == "core" else self._write_jetstream(nc, messages))
        if not errors:
            return
        if len(errors) == len(messages):  # the whole write failed: one cause, as fold() would pick it
            first = errors[min(errors)]
            if not any(isinstance(e, Permanent) for e in errors.values()):
                raise next((e for e in errors.values() if isinstance(e, NotConnected)), first)
            if all(e is first for e in errors.values()):
                raise first
        raise PartialFailure(errors)

    async def close(self) -> None:
        """Flush what is buffered and close the connection (the runtime bounds the call); never raises."""
        nc, self._nc = self._nc, None
        self._fail_acks(NotConnected(f"{self._prefix}: closed"))
        revival, self._revival = self._revival, None
        if revival is not None:
            revival.cancel()
        if nc is not None:
            await self._close_client(nc)

    async def health(self) -> str | None:
        """None when connected (and, in JetStream mode, a stream captures the subjects), else why not."""
        nc = await self._revived()
        if nc is None or nc.is_closed:
            return f"{self._prefix}: not connected to NATS at {self._where}"
        if not nc.is_connected:
            return str(self._reconnecting())
        # A round trip: a server that stopped answering (frozen, a half-open connection) keeps the
        # client "connected" until its pings run out (ping_interval x 2), while writes would stall.
        timeout = self.options.connect_timeout
        try:
            answered = await internals.round_trip(nc, timeout)
        except (nats.errors.Error, OSError) as exc:
            return f"{self._prefix}: NATS at {self._where} does not answer ({_describe(exc)})"
        if not answered:
            return f"{self._prefix}: NATS at {self._where} does not answer a PING within {timeout:g}s"
        return (
            self._permission_problem
            or next((why for why, _ in self._refusals.values()), None)
            or self._stream_problem
            or self._state_problem
            or self._subject_problem
        )

    def _mark_crc(self, name: str) -> int:
        """What a mark of events stream ``name`` on these servers, in the account this sink logs in
        to (see _login), carries to name it (see place_crc): a stream of that name in another
        account is another stream."""
        if self._login is None:
            self._login = _login(self.options)
        return place_crc(self._addresses, f"{name}|{self._login}" if self._login else name)

    def _marks_of(self, name: str, of: int) -> bool:
        """Whether a mark naming ``of`` was taken of events stream ``name`` here: with this login,
        or by a bridge before marks named the login (breaker90 B2b: those marks of every sink with
        credentials were skipped after an upgrade, and a loss while no bridge ran went unseen)."""
        return of in (self._mark_crc(name), place_crc(self._addresses, name))

    def stored_through(self, stream: Stream) -> tuple[int, ...] | None:
        """The mark of ``stream``'s last message the events stream acknowledged (bridge.connector):
        its epoch and seq, the events stream's last JetStream seq and its creation time
        (microseconds) then, a CRC-32 of its name and servers (place_crc), and the last seq of each epoch before, newest
        first; None in core mode, or before the events stream acknowledged anything of it in this
        process (nor was told of it)."""
        marked = self._marked.get(stream.key)
        if marked is not None:
            return marked[1]
        name, spans = self._homes.get(stream.key), self._held.spans.get(stream.key)
        created = self._stream_created.get(name) if name is not None else None
        if self.options.mode == "core" or name is None or not spans or created is None or name not in self._stream_seqs:
            return None
        before = [n for span in reversed(spans[:-1]) for n in (span.epoch, span.last)]
        return (spans[-1].epoch, spans[-1].last, self._stream_seqs[name], _micros(created), self._mark_crc(name), *before)

    def stored_before(self, stream: Stream, mark: tuple[int, ...], resume: tuple[int, int] | None) -> None:
        """An earlier run had the events stream acknowledge ``stream`` up to ``mark`` (bridge.connector):
        checked before this process's first write (and by the audit): an events stream gone, created
        again (another creation time) or ending below the mark's JetStream seq lost the stream's
        messages, announced (SinkLost) up to ``resume``, where the stream resumes."""
        if len(mark) >= 5 and len(mark) % 2 and self.options.mode == "jetstream" and stream.key not in self.records_gone:
            self._marked[stream.key] = (stream, mark, resume)

    async def _check_marked(self, nc: Client) -> None:
        """What the earlier run's marks say the events streams held (see stored_before), against
        each as it is now, once: the JetStream stream capturing each bridge stream's subject (an
        operator may split the subjects over several), or, when none does, the one its mark names
        (gone). The streams that lost messages are kept for _raise_lost."""
        marked, self._marked = self._marked, {}
        if not marked:
            return
        js = nc.jetstream(timeout=self.options.connect_timeout)
        try:
            subjects = {key: self._subjects.render(sample_message(stream)) for key, (stream, _, _) in marked.items()}
            owners = await self._capturing(js, subjects.values())
        except (TimeoutError, nats.errors.Error) as exc:
            self._marked = marked
            raise Retriable(f"{self._prefix}: cannot list the JetStream streams ({_describe(exc)})") from None
        known = {n for n in (self._events_stream, self.options.stream.name, *self._stream_seqs) if n is not None}
        infos: dict[str, js_api.StreamInfo | None] = {}
        lost: list[tuple[Stream, int, int, int]] = []
        whys: list[str] = []
        for key, (stream, (epoch, seq, js_seq, created, of, *before), resume) in marked.items():
            name = owners.get(subjects[key])
            if name is None:  # captured by none now: the stream the mark names is gone (if it is one this sink knows)
                name = next((n for n in known if self._marks_of(n, of)), None)
            if name is None or not self._marks_of(name, of):
                continue  # (another events stream's)
            if name not in infos:
                try:
                    infos[name] = await js.stream_info(name)
                except nats.js.errors.NotFoundError:
                    infos[name] = None
                except (TimeoutError, nats.errors.Error) as exc:
                    self._marked = marked
                    raise Retriable(f"{self._prefix}: cannot read JetStream stream {name!r} ({_describe(exc)})") from None
            info = infos[name]
            ends = [(epoch, seq), *zip(before[::2], before[1::2], strict=True)]
            made = _micros(info.created) if info is not None and info.created is not None else -1
            if info is not None and made == created and info.state.last_seq >= js_seq:
                # Still held: known as if this process had stored it (the audit checks it too).
                self._held.spans[stream.key] = [_Span(stream, e, 0, n) for e, n in reversed(ends)]
                self._adopt(stream.key, name, js_seq, info.created)
                continue
            lost += resent_spans(stream, ends, resume)
            self._held.spans.pop(stream.key, None)
            why = _GONE if info is None else "was created again, or lost messages, while no bridge ran"
            whys.append(f"{name!r} {why}")
        if lost:
            self._lost.extend(lost)
            self._lost_why = ", ".join(dict.fromkeys(whys))

    def acknowledged_before(self, stream: Stream, epoch: int, seq: int) -> None:
        """Earlier runs had this sink acknowledge ``stream`` up to ``seq`` of ``epoch`` (see
        bridge.connector): lost before this process stores anything of it (the events stream
        deleted, a server keeping it in memory restarted, after the start read what the sink
        held), that is announced too, from seq 0 (where it starts cannot be told)."""
        if stream.key not in self.records_gone:  # (else found lost at start, and announced so)
            self._held.spans.setdefault(stream.key, [_Span(stream, epoch, 0, seq)])

    def places(self, streams: Sequence[Stream]) -> list[tuple[frozenset[str], str]]:
        """Its subjects, the events stream it creates, its state bucket, on its servers (see
        bridge.connector: two sinks may not share one; one JetStream stream's duplicate window
        would take one sink's messages for copies of the other's, their ids being alike). Users
        are not told apart: two may be in one account, and the config cannot say."""
        servers = self._addresses
        subjects = rendered(self._subjects.render, self._subjects.template, streams, self._types())
        places = [f"subject {s!r}" for s in subjects]
        if self.options.mode == "jetstream" and self.options.stream.create:
            places.append(f"JetStream stream {self.options.stream.name!r}")
        if self.writes_state:  # (the bucket is JetStream stream KV_<bucket>, a name an events stream may take)
            places.append(f"JetStream stream {self._kv_stream!r}")
        return [(servers, p) for p in places]

    def destination(self, stream: Stream) -> str | None:
        """The subject of ``stream``'s batches, when each stream has subjects of its own (see
        :class:`_Subjects`): two configured streams with one are refused before a run."""
        return self._subjects.base(stream)

    async def positions_before_run(self, streams: Sequence[Stream]) -> dict[str, SinkPosition | None]:
        """What the sink holds of each stream, this process's own messages left out (bridge.sink
        asks this before announcing a dropped span): JetStream drops the replay's copies by their
        ids, but a SourceReset this process wrote (``bridge_restart``, after a restart without the
        checkpoint) is the subject's last message, and says nothing of the batches before it. The
        later of :meth:`positions` and the subject's last message before this process first wrote
        there (read by the claim, see _claim); a stream this process has not written yet: positions."""
        before = {s.key: self._before_run[s.key] for s in streams if s.key in self._before_run}
        return held_before_run(await self.positions(streams), before)

    async def positions(self, streams: Sequence[Stream]) -> dict[str, SinkPosition | None]:
        """The last message on each stream's subject (``checkpoint.from_sinks``, JetStream mode): the
        JetStream stream capturing each subject is found (see _capturing; the subjects may be split
        over several), then one ``STREAM.MSG.GET`` request (last by subject) per stream, up to 64 in
        flight. A subject no stream captures, core NATS (keeps nothing), and a subject template with
        ``{type}`` or ``{epoch}`` (spreads a stream over subjects): cannot tell."""
        nc = self._nc
        fields = self._subjects.template.fields
        if self.options.mode != "jetstream" or "type" in fields or "epoch" in fields:
            return {}
        if nc is None or nc.is_closed or not nc.is_connected:
            raise NotConnected(f"{self._prefix}: not connected to NATS at {self._where}")
        js = nc.jetstream(timeout=self.options.connect_timeout)
        subjects = {s.key: self._subjects.render(sample_message(s)) for s in streams}
        owners = await self._capturing(js, subjects.values())
        window = asyncio.Semaphore(64)
        out: dict[str, SinkPosition | None] = {}

        async def last(stream: Stream) -> None:
            subject = subjects[stream.key]
            name = owners.get(subject)
            if name is None:
                return  # no stream captures it (yet): cannot tell, never "holds nothing"
            async with window:
                try:
                    msg = await js.get_last_msg(name, subject)
                except nats.js.errors.NotFoundError:
                    out[stream.key] = None
                    return
            headers = msg.headers or {}
            if not _names(headers, stream):
                return  # another publisher's message, or a subject shared with another stream: cannot tell
            try:
                out[stream.key] = SinkPosition.from_headers(headers, msg.data)
            except ValueError:
                return
            found[stream.key] = (name, msg.seq or 0)

        found: dict[str, tuple[str, int]] = {}
        await asyncio.gather(*(last(s) for s in streams))
        made: dict[str, datetime | None] = {}
        for key, (name, js_seq) in found.items():
            if name not in made:
                with contextlib.suppress(TimeoutError, nats.errors.Error):
                    made[name] = (await js.stream_info(name)).created
            self._adopt(key, name, js_seq, made.get(name))
        return out

    # -- writes ---------------------------------------------------------------------------------
    async def _write_core(self, nc: Client, messages: Sequence[Message]) -> dict[int, ConnectorError]:
        """Publish and flush. The server says nothing of a message it delivered, and refuses one the
        user may not publish only on the connection's error channel, read before the flush's PONG
        (see _on_error): a write during which that happened fails whole (no_permission, retried),
        never counted delivered."""
        errors: dict[int, ConnectorError] = {}
        refused = self._refused
        stops = Stops(self._prefix)
        for i, m in enumerate(messages):
            if (held := stops.past(m)) is not None:
                errors[i] = held
                continue
            subject = self._subjects.render(m)
            hdr = header_block(m.headers)
            problem = self._unsendable(m, len(hdr), nc.max_payload)
            if problem is not None:
                errors[i] = problem
                stops.refused(m)
                continue
            if not nc.is_connected:
                raise self._reconnecting()
            try:
                await internals.send_encoded(nc, hpub(subject, "", hdr, m.value))
            except (nats.errors.Error, OSError) as exc:
                raise NotConnected(f"{self._prefix}: publish to NATS failed: {_describe(exc)}") from None
        internals.write_pending(nc)  # else the PING overtakes them (see write_pending)
        try:
            # Not nc.flush(): see round_trip. The runtime's write timeout usually ends this first.
            answered = await internals.round_trip(nc, self.sink.retry.write_timeout)
        except (nats.errors.Error, OSError) as exc:
            raise NotConnected(f"{self._prefix}: flush to NATS at {self._where} failed: {_describe(exc)}") from None
        if not answered:
            raise NotConnected(f"{self._prefix}: NATS at {self._where} did not answer a PING within the write timeout")
        if self._refused != refused:
            raise Retriable(self._permission_problem or f"{self._prefix}: a publish was refused", reason="no_permission")
        self._permission_problem = None  # (whatever was refused before was fixed)
        return errors

    async def _write_jetstream(self, nc: Client, messages: Sequence[Message]) -> dict[int, ConnectorError]:
        errors: dict[int, ConnectorError] = {}
        seqs: dict[int, int] = {}  # index -> JetStream stream seq of the stored message
        self._new_seqs.clear()
        await self._claim(nc, messages)
        if self._refusals:  # (known before, or met by the claim's listing: see _capturing)
            await self._still_refusing(nc)
            errors.update(self._held_by_refusal(messages))
        await self._publish_chained(nc, messages, errors, seqs)
        again = _refused_for_turn(messages, errors, await self._reclaim(nc, messages, errors))
        if again and self._refusals:  # (a stream the reclaim's listing met: see _capturing)
            held = self._held_by_refusal(messages)
            errors.update((i, held[i]) for i in again if i in held)
            again = [i for i in again if i not in held]
        if again:
            streams: dict[str, list[int]] = {}
            for i in again:
                streams.setdefault(messages[i].record.stream.key, []).append(i)
            chains = [self._publish_in_turn(nc, messages, indexes, errors, seqs) for indexes in streams.values()]
            await (chains[0] if len(chains) == 1 else asyncio.gather(*chains))
        if seqs:
            self._note_stored(messages, seqs)
            await self._note_created(nc)
        if any(e.reason == "no_stream" for e in errors.values()):
            await self._stream_missing(nc, messages[min(i for i, e in errors.items() if e.reason == "no_stream")])
            if self._stream_problem is not None:  # (what it found: the stream there captures other subjects)
                problem = Retriable(self._stream_problem, reason="no_stream")
                errors.update((i, problem) for i, e in list(errors.items()) if e.reason == "no_stream")
        elif not errors:
            self._stream_problem = None
        if self.writes_state:
            await self._write_state(nc, messages, errors, seqs)
        return errors

    async def _reclaim(self, nc: Client, messages: Sequence[Message], errors: dict[int, ConnectorError]) -> bool:
        """The subjects whose fence refused a write's message (``subject_moved``) read again (see
        _claim): True when that worked, so the streams still their subject's owner are sent again
        in turn (the one another stream took is refused for itself: subject_taken); else those
        streams fail the write (tried again, and read again at the next)."""
        moved = [messages[i] for i, e in errors.items() if e.reason == "subject_moved"]
        if not moved:
            return False
        try:
            await self._claim(nc, moved)
        except Retriable:
            return False
        return True

    async def _note_created(self, nc: Client) -> None:
        """When the stream that just acknowledged this pod's first messages in it was created
        (one request per stream; again after a loss): what the audit compares with. Not read: the
        audit reads it later (a stream lost and created again meanwhile then goes unseen). Its
        settings are read too: one created during the run that refuses writes (see _refusing) is
        refused from now on, and when its messages leave once consumed, what it acknowledged is
        announced lost."""
        for name in self._stream_seqs.keys() - self._stream_created.keys():
            js = nc.jetstream(timeout=self.options.connect_timeout)
            try:
                info = await js.stream_info(name)
            except (TimeoutError, nats.errors.Error):
                continue
            self._stream_created[name] = info.created
            if self._refusing(name, info.config) and (kind := _consumed(info.config)) is not None:
                self._stream_lost(f"{name!r} has {kind} retention: its messages leave once consumed", name)

    def _note_stored(self, messages: Sequence[Message], seqs: dict[int, int]) -> None:
        """Follow what the events stream holds of each bridge stream; a new message stored at or
        below a seq the stream had reached before this write means the stream is a new one (lost
        and created again by someone else): what it held is announced at the next write."""
        last: Record | None = None
        for i in seqs:
            record = messages[i].record
            if record is not last:
                self._held.note(record)
                last = record
        for name, (low, high) in self._new_seqs.items():
            if low <= self._stream_seqs.get(name, 0):  # this write's messages too: the announcement follows them
                self._stream_lost(f"{name!r} was created again (its sequence went back)", name)
            self._stream_seqs[name] = high

    def _holds(self, name: str, key: str) -> bool:
        """Whether JetStream stream ``name`` holds what this sink stored of bridge stream ``key``:
        the one that acknowledged it last; one known to no acknowledgement of this process (an
        earlier run's, see acknowledged_before) when ``name`` captures its subject (as last listed;
        not listed: it may)."""
        home = self._homes.get(key)
        if home is not None:
            return home == name
        subjects = self._stream_subjects.get(name)
        spans = self._held.spans.get(key)
        if subjects is None or not spans:
            return True
        subject = self._subjects.render(sample_message(spans[-1].stream))
        return any(subjects_overlap(f, subject) for f in subjects)

    def _adopt(self, key: str, name: str, js_seq: int, created: datetime | None) -> None:
        """An earlier run's messages of bridge stream ``key`` are held by JetStream stream ``name``,
        up to its seq ``js_seq`` at least (created at ``created``): checked from now on by the
        audit and each write, as if this process had stored them."""
        self._homes.setdefault(key, name)
        self._stream_seqs[name] = max(self._stream_seqs.get(name, 0), js_seq)
        if created is not None:
            self._stream_created.setdefault(name, created)

    def _stream_lost(self, why: str, name: str | None = None, keys: Iterable[str] | None = None) -> None:
        """JetStream stream ``name`` (None: every one) lost what it acknowledged: the spans it held
        of its bridge streams (those it acknowledged last, and those no stream acknowledged in this
        process; or ``keys``) are announced at the next write (SinkLost); the JetStream seqs their
        state's heads continue from are void."""
        homed: set[str] = set()
        names: list[str] = [name] if name is not None else []
        if keys is None:
            keys = [k for k in self._held.spans if name is None or self._holds(name, k)]
            homed = {k for k, n in self._homes.items() if name is None or n == name}
            names = list(self._stream_seqs) if name is None else names
        keys = set(keys)
        spans = self._held.take(keys)
        self._held.fresh = False
        for gone in names:
            self._stream_seqs.pop(gone, None)
            self._stream_created.pop(gone, None)
        for key in keys | homed:
            self._next.pop(key, None)
            self._fences.pop(key, None)  # (a new stream: the subject's owner is read again)
            self._subjects.claimed.discard(key)
            if key in self._before_run:
                self._before_run[key] = None  # (what it held before this process is gone with it)
        if not spans:
            return
        self._lost.extend(spans)
        self._lost_why = why
        log.warning(
            "%s: JetStream stream %s: %d stream(s) lose what it acknowledged; announced to this sink's consumers "
            "(EventsLost, reason sink_lost:%s) at the next write",
            self._prefix,
            why,
            len(spans),
            self.name,
            extra={"sink": self.name, "count": len(spans)},
        )

    def _raise_lost(self) -> None:
        """Raise SinkLost for the spans kept by _stream_lost (and forget them: the write that
        follows goes through)."""
        if self._lost:
            spans, self._lost = self._lost, []
            what = f"{self._prefix}: JetStream stream {self._lost_why}: what it held of {len(spans)} stream(s) is lost"
            raise SinkLost(what, spans)

    async def audit(self) -> None:
        """Between writes (bridge.connector, I6): each JetStream stream that acknowledged this sink's
        messages (one, unless an operator split the subjects over several) still exists and has not
        gone back below the last JetStream seq it gave; else what it held is lost (SinkLost, to the
        bridge streams it held; with ``stream.create`` the next write creates it again). The state
        bucket still keeps what it is given (see _recheck_bucket)."""
        nc = self._nc
        if nc is not None and nc.is_connected and self._payload_stale:
            await self._reread_max_payload(nc)
        if nc is not None and nc.is_connected and self.writes_state:
            await self._recheck_bucket(nc)
        if nc is not None and nc.is_connected and self._fences:
            await self._recheck_subjects(nc)
        if nc is not None and nc.is_connected and self._refusals:  # (fixed while the sink is quiet: ready again)
            with contextlib.suppress(Retriable):
                await self._still_refusing(nc)
        if self.options.mode == "core" or nc is None or not nc.is_connected or not self._stream_seqs:
            return
        js = nc.jetstream(timeout=self.options.connect_timeout)
        for name in list(self._stream_seqs):
            try:
                info = await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                self._refusals.pop(name, None)
                self._stream_lost(f"{name!r} {_GONE}", name)
                continue
            self._refusing(name, info.config)
            last, created = info.state.last_seq, self._stream_created.setdefault(name, info.created)
            if created != info.created:
                self._stream_created[name] = info.created
                self._stream_lost(f"{name!r} was created again (at {info.created}, after {created})", name)
            elif last < self._stream_seqs[name]:
                self._stream_lost(f"{name!r} ends at seq {last}, below the {self._stream_seqs[name]} it acknowledged", name)
        self._raise_lost()

    async def _reread_max_payload(self, nc: Client) -> None:
        """The server's max_payload now, from the INFO it sends a new connection first (before any
        login or TLS): raised by a configuration reload since this client connected, the client
        takes it, and the messages it refused as too large go through. Failing says nothing."""
        self._payload_stale = False
        url = urlsplit(nc.connected_url.geturl() if nc.connected_url is not None else "")
        if url.hostname is None:
            return
        writer = None
        try:
            async with asyncio.timeout(self.options.connect_timeout):
                reader, writer = await asyncio.open_connection(url.hostname, url.port or 4222)
                line = await reader.readline()
            limit = json.loads(line[5:]).get("max_payload") if line.startswith(b"INFO ") else None
        except (OSError, TimeoutError, ValueError):
            return
        finally:
            if writer is not None:
                writer.close()
        if type(limit) is int and limit > nc.max_payload:
            log.info(
                "%s: NATS at %s takes messages up to %d bytes now (was %d)",
                self._prefix,
                self._where,
                limit,
                nc.max_payload,
                extra={"sink": self.name},
            )
            internals.raise_max_payload(nc, limit)

    async def _recheck_subjects(self, nc: Client) -> None:
        """The audit's look at each claimed subject (see _claim): its last message again, one
        ``STREAM.MSG.GET`` per stream, up to 64 at once. A stream whose subject another stream's
        message ends is refused now (subject_taken, the sink not ready), even if its engine is
        quiet; one still its own (or emptied: ``max_age``, a purge) moves its fence there, so its
        next write needs no second look. A lookup that fails says nothing: the next write's fence
        still holds."""
        js = nc.jetstream(timeout=self.options.connect_timeout)
        window = asyncio.Semaphore(64)

        async def one(fence: _Fence) -> None:
            subject = self._subjects.base(fence.stream)
            if subject is None:
                return
            async with window:
                try:
                    msg = await js.get_last_msg(fence.name, subject)
                except nats.js.errors.NotFoundError:
                    msg = None
                except (TimeoutError, nats.errors.Error) as exc:
                    why = _describe(exc)
                    log.debug("%s: reading subject %s failed: %s", self._prefix, subject, why, extra={"sink": self.name})
                    return
            if self._fences.get(fence.stream.key) == fence:  # (unchanged meanwhile)
                self._claimed(fence.stream, fence.name, msg)

        await asyncio.gather(*(one(f) for f in list(self._fences.values())))

    async def _stream_missing(self, nc: Client, message: Message) -> None:
        """A write found no stream capturing the subject of ``message``. When the stream that
        acknowledged its bridge stream's earlier writes is gone, what it held is lost (announced at
        the next write) and, with ``stream.create``, it is created again (the configured settings)
        for the next write."""
        so = self.options.stream
        subject = self._subjects.render(message)
        name = self._homes.get(message.record.stream.key) or self._events_stream or (so.name if so.create else None)
        js = nc.jetstream(timeout=self.options.connect_timeout)
        wildcard = subject_filter(self.options.subject)
        try:
            if name is not None:
                try:
                    await js.stream_info(name)
                except nats.js.errors.NotFoundError:
                    pass
                else:
                    self._stream_problem = (
                        f"{self._prefix}: JetStream stream {name!r} does not capture subject {subject!r}: "
                        f"add {wildcard!r} to its subjects"
                    )
                    return
                if name == self._events_stream or name in self._stream_seqs:
                    self._stream_lost(f"{name!r} {_GONE}", name)
            if so.create:
                await self._ensure_stream(js)
                self._stream_problem = None
            else:
                gone = f" (stream {name!r} that held its messages is gone)" if name is not None else ""
                self._stream_problem = (
                    f"{self._prefix}: no JetStream stream captures subject {subject!r}{gone}: create one capturing "
                    f"{wildcard!r}, or set stream.create: true"
                )
        except NotConnected as exc:
            self._stream_problem = str(exc)
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("%s: stream lookup failed: %s", self._prefix, _describe(exc), extra={"sink": self.name})

    async def _capturing(self, js: JetStreamContext, subjects: Iterable[str]) -> dict[str, str]:
        """The JetStream stream capturing each of ``subjects`` (concrete ones), from one listing of
        the streams (an operator may split the template's subjects over several: ``P.a.>`` and
        ``P.b.>``); a subject no stream captures has no entry. Looked up again at every call: a
        stream can be created, edited or deleted during the run."""
        wanted = set(subjects)
        out: dict[str, str] = {}
        if not wanted:
            return out
        for info in await _all_streams(js):
            name = info.config.name
            if name is None:
                continue
            if info.config.retention in (None, js_api.RetentionPolicy.LIMITS):
                self._consumed.discard(name)
            else:
                self._consumed.add(name)
            self._stream_subjects[name] = list(info.config.subjects or [])
            before = len(out)
            for filt in info.config.subjects or []:
                out.update((subject, name) for subject in wanted.difference(out) if subjects_overlap(filt, subject))
            if len(out) > before:  # (one met now, created during the run: its settings say at once)
                self._refusing(name, info.config)
        return out

    async def _claim(self, nc: Client, messages: Sequence[Message]) -> None:
        """Before the first write of a stream in this process: the last message its subject holds
        names the stream that owns it (headers ``source``, ``dp_rank``), so that a stream whose
        source name becomes the same subject token as another's (see :class:`_Subjects`) is
        refused whichever bridge, or which run of this one, wrote the subject first. Up to 64
        lookups at once; a lookup that fails fails the write (nothing sent: tried again).

        The claim is kept as a fence (``_fences``: the subject's last seq): every write of the
        stream stores its first message only over it, so a message of another writer on the subject
        since (another bridge that found the subject empty after this stream's messages left it:
        ``max_age``, a purge) fails that write's first message (``subject_moved``); the subject is
        then read again (:meth:`_reclaim`), and when another stream holds it, this one is refused."""
        subjects = self._subjects
        if not subjects.claims:
            return
        new = {m.record.stream.key: m.record.stream for m in messages if m.record.stream.key not in subjects.claimed}
        if not new:
            return
        js = nc.jetstream(timeout=self.options.connect_timeout)
        bases = {key: subjects.base(stream) for key, stream in new.items()}
        try:
            owners = await self._capturing(js, [b for b in bases.values() if b is not None])
        except (TimeoutError, nats.errors.Error) as exc:
            raise Retriable(f"{self._prefix}: looking up the streams of {self._where} failed: {_describe(exc)}") from None
        window = asyncio.Semaphore(64)

        async def look(stream: Stream) -> None:
            subject = bases[stream.key]
            assert subject is not None
            name = owners.get(subject)
            if name is None:
                return  # (no stream captures the subject: the write fails no_stream; claimed at the next)
            async with window:
                try:
                    msg = await js.get_last_msg(name, subject)
                except nats.js.errors.NotFoundError:
                    msg = None
            self._claimed(stream, name, msg)

        try:
            await asyncio.gather(*(look(s) for s in new.values()))
        except (TimeoutError, nats.errors.Error) as exc:
            raise Retriable(f"{self._prefix}: reading who writes a subject failed: {_describe(exc)}") from None

    def _claimed(self, stream: Stream, name: str, msg: RawStreamMsg | None) -> None:
        """What the subject's last message (``msg`` in JetStream stream ``name``; None: the subject
        holds none) says of ``stream``'s claim: its fence, or, when another stream wrote it, the
        refusal of ``stream`` (logged, and the sink not ready, naming both and the fix)."""
        headers = (msg.headers if msg is not None else None) or {}
        source, rank = headers.get("source"), headers.get("dp_rank")
        holder = None
        if msg is None:
            self._before_run.setdefault(stream.key, None)
        if _names(headers, stream):
            holder = stream.key
            if msg is not None and stream.key not in self._before_run:
                with contextlib.suppress(ValueError):
                    self._before_run[stream.key] = SinkPosition.from_headers(headers, msg.data)
        elif source is not None and rank is not None:
            holder = f"{_header_text(source)}/{rank}"
        owner = self._subjects.claim(stream, holder)
        if owner is None:  # (a stream this process refused already keeps a fence it never uses)
            if name in self._consumed:
                self._fences.pop(stream.key, None)
            else:
                self._fences[stream.key] = _Fence(stream, name, (msg.seq or 0) if msg is not None else 0)
            return
        self._fences.pop(stream.key, None)
        self._subject_problem = self._subjects.refusal(stream, self._prefix)
        log.warning("%s", self._subject_problem, extra={"sink": self.name, "stream": stream.key})

    def _fence(self, m: Message) -> int | None:
        """The subject seq ``m`` is stored over (see _fences), None: no fence for its stream."""
        fence = self._fences.get(m.record.stream.key)
        return fence.seq if fence is not None else None

    async def _publish_chained(
        self, nc: Client, messages: Sequence[Message], errors: dict[int, ConnectorError], seqs: dict[int, int]
    ) -> None:
        """Publish every message at once, each with ``Nats-Expected-Last-Msg-Id`` = the id of the one
        sent before it: JetStream then stores a message only right after its predecessor, so after a
        failure nothing later in the write is stored (refused with "wrong last msg ID")."""
        acks = _Acks()
        sent: list[tuple[int, str]] = []  # (index, subject), in the order sent
        previous: str | None = None
        # Each bridge stream's messages are sent one after the other, so that a message's
        # predecessor in the chain is the one before it in its own stream: a duplicate (stored by
        # an earlier try) passes the server's check whatever it expects, and a message of another
        # stream between the two would let the chain go on past a failure of this stream.
        order = [i for i in _by_stream(messages) if messages[i].type != STATE_TYPE]  # state: see _write_state
        # Each stream's first message sent is fenced (see _claim); its next ones follow it in the
        # chain (nothing else stored in between), so they need none.
        fenced: set[str] = set()
        stops = Stops(self._prefix)
        try:
            for n, i in enumerate(order):
                if i in errors:  # (held back: see _held_by_refusal)
                    continue
                m = messages[i]
                key = m.record.stream.key
                if (held := stops.past(m)) is not None:
                    errors[i] = held
                    continue
                subject = self._subjects.render(m)
                msg_id = js_msg_id(subject, m)
                hdr = header_block(m.headers, msg_id, previous, None if key in fenced else self._fence(m))
                problem = self._unsendable(m, len(hdr), nc.max_payload)
                if problem is not None:
                    errors[i] = problem
                    stops.refused(m)
                    continue
                try:
                    await self._send(nc, subject, hdr, m.value, acks)
                except NotConnected as exc:
                    errors.update(dict.fromkeys(order[n:], exc))
                    break
                sent.append((i, subject))
                fenced.add(key)
                previous = msg_id
            await acks.wait()
        finally:
            self._forget(acks)
        for (i, subject), msg in zip(sent, acks.msgs, strict=True):
            m = messages[i]
            if (held := stops.past(m)) is not None:
                # After a message the server refused for itself, the chain lets through only copies
                # stored by an earlier write (a duplicate passes whatever it expects): they count as
                # not sent, and go again after the refusal's announcement (see bridge.connector).
                errors[i] = held
                continue
            error = self._ack_error(msg, m, subject, seqs, i) if msg is not None else acks.error
            if error is not None:
                errors[i] = error
                if isinstance(error, Permanent):
                    stops.refused(m)

    async def _publish_in_turn(
        self,
        nc: Client,
        messages: Sequence[Message],
        indexes: list[int],
        errors: dict[int, ConnectorError],
        seqs: dict[int, int],
    ) -> None:
        """Publish one stream's messages of a write, each after the previous one's ack (and over
        its subject's last seq: see _claim); at the first transient failure, the rest of the
        stream stays unsent (failed at its indexes); after a message refused for itself, so do its
        later records (see bridge.connector)."""
        stops = Stops(self._prefix)
        for n, i in enumerate(indexes):
            m = messages[i]
            if (held := stops.past(m)) is not None:
                errors.update(dict.fromkeys(indexes[n:], held))
                return
            subject = self._subjects.render(m)
            hdr = header_block(m.headers, js_msg_id(subject, m), subject_seq=self._fence(m))
            problem = self._unsendable(m, len(hdr), nc.max_payload)
            if problem is not None:
                errors[i] = problem
                stops.refused(m)
                continue
            acks = _Acks()
            error: ConnectorError | None
            try:
                await self._send(nc, subject, hdr, m.value, acks)
                await acks.wait()
                error = self._ack_error(acks.msgs[0], m, subject, seqs, i) if acks.msgs[0] is not None else acks.error
            except NotConnected as exc:
                error = exc
            finally:
                self._forget(acks)
            if error is None:
                continue
            errors[i] = error
            if isinstance(error, Permanent):
                stops.refused(m)
            else:
                errors.update(dict.fromkeys(indexes[n + 1 :], error))
                return

    async def _send(self, nc: Client, subject: str, hdr: bytes, payload: bytes, acks: _Acks) -> None:
        """Publish with a reply token whose ack goes to ``acks``."""
        if not nc.is_connected:  # never let nats-py buffer while reconnecting (internals.drop_pending)
            raise self._reconnecting()
        token = str(next(self._tokens))
        self._acks[token] = (acks, acks.expect(token))
        try:
            await internals.send_encoded(nc, hpub(subject, self._ack_prefix + token, hdr, payload))
        except (nats.errors.Error, OSError) as exc:
            if self._acks.pop(token, None) is None:  # its ack is in: it was sent after all
                return
            acks.unexpect()
            raise NotConnected(f"{self._prefix}: publish to NATS failed: {_describe(exc)}") from None

    def _forget(self, acks: _Acks) -> None:
        """Stop waiting for these acks (a late one is ignored)."""
        for token in acks.tokens:
            self._acks.pop(token, None)

    async def _on_ack(self, msg: Msg) -> None:
        self._permission_problem = None  # (a publish went through: whatever was refused was fixed)
        entry = self._acks.pop(msg.subject[len(self._ack_prefix) :], None)
        if entry is not None:  # else: its write was cancelled or failed
            entry[0].settle(entry[1], msg)

    def _fail_acks(self, error: ConnectorError) -> None:
        for acks, _ in list(self._acks.values()):
            acks.fail(error)

    def _ack_error(self, msg: Msg, m: Message, subject: str, seqs: dict[int, int], i: int) -> ConnectorError | None:
        """Why JetStream did not store message ``i`` (``m``), or None and its stream seq in ``seqs``."""
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            fix = (
                f"stream.create: stream {self.options.stream.name!r} is created again"
                if self.options.stream.create
                else f"create a stream whose subjects cover {subject_filter(self.options.subject)!r}, or set stream.create: true"
            )
            self._stream_problem = f"{self._prefix}: no JetStream stream captures subject {subject!r}: {fix}"
            return Retriable(self._stream_problem, reason="no_stream")
        try:
            ack = _ack_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return Retriable(f"{self._prefix}: unreadable JetStream ack {msg.data[:200]!r}", reason="bad_ack")
        err = ack.error
        if err is None:
            seqs[i] = ack.seq  # a duplicate's ack names the copy stored first
            self._homes[m.record.stream.key] = ack.stream
            fence = self._fences.get(m.record.stream.key)
            if fence is not None and fence.name == ack.stream and ack.seq > fence.seq:
                self._fences[m.record.stream.key] = fence._replace(seq=ack.seq)
            if not ack.duplicate:
                span = self._new_seqs.get(ack.stream)
                if span is None:
                    self._new_seqs[ack.stream] = [ack.seq, ack.seq]
                    self._events_stream = ack.stream
                elif ack.seq < span[0]:
                    span[0] = ack.seq
                elif ack.seq > span[1]:
                    span[1] = ack.seq
            return None
        text = f"{self._prefix}: JetStream refused {m.msg_id} on {subject!r}: {err.description} (code {err.code}/{err.err_code})"
        if err.err_code in _REFUSED_FOR_ITSELF:
            return Permanent(text, reason="too_large")
        if err.err_code == _WRONG_LAST_MSG_ID:  # the message sent before it was not stored
            return Retriable(text, reason="out_of_turn")
        if err.err_code == _WRONG_LAST_SUBJECT_SEQ:  # the fence (see _claim): the subject was written since
            self._fences.pop(m.record.stream.key, None)
            self._subjects.claimed.discard(m.record.stream.key)  # read again (_reclaim, or the next write)
            return Retriable(
                f"{text}: the subject holds a message this sink did not write after its last one (another writer, "
                "or its messages left the stream); who owns it is read again",
                reason="subject_moved",
            )
        # Anything else is about the stream, which an operator or consumers can fix: a full
        # `discard: new` stream ("maximum bytes/messages exceeded"), a sealed stream, a leader
        # election, storage out of resources. Retried; the sink reports itself not ready.
        if err.code < 500:
            return Retriable(text, reason="rejected")
        return Retriable(text, reason="stream_full" if "maximum" in err.description.lower() else "jetstream_unavailable")

    def _unsendable(self, m: Message, header_size: int, max_payload: int) -> Permanent | None:
        """Why ``m`` (its subject rendered) is refused for itself before it is sent: over the
        server's max_payload, or its subject owned by another stream (:meth:`_Subjects.taken`)."""
        if header_size + len(m.value) > max_payload:
            return self._too_large(m, header_size, max_payload)
        return self._subjects.taken(m, self._prefix)

    def _too_large(self, m: Message, header_size: int, max_payload: int) -> Permanent:
        self._payload_stale = True  # (the audit asks the server whether it still is: see _reread_max_payload)
        return Permanent(
            f"{self._prefix}: message {m.msg_id} is {header_size + len(m.value)} bytes with headers, over the "
            f"server's max_payload of {max_payload}",
            reason="too_large",
        )

    def _reconnecting(self) -> NotConnected:
        return self._not_connected(f"reconnecting to NATS at {self._where}")

    def _not_connected(self, what: str) -> NotConnected:
        """``what`` failed, with the last error the connection met: when the server refused the
        credentials or the TLS handshake (it answered: reason ``auth`` / ``tls``), naming the fix."""
        if self._refusal == "auth":
            return NotConnected(
                f"{self._prefix}: {what}: the server refuses the credentials ({self._last_error}): set user and "
                "password, token, nkey_seed or credentials to ones the server's authorization accepts",
                reason="auth",
            )
        if self._refusal == "tls":
            return NotConnected(
                f"{self._prefix}: {what}: the TLS handshake failed ({self._last_error}): set tls.ca_file to the CA "
                "that signed the server's certificate (and tls.cert_file / tls.key_file when the server wants a "
                "client certificate)",
                reason="tls",
            )
        return NotConnected(f"{self._prefix}: {what}: {self._last_error}" if self._last_error else f"{self._prefix}: {what}")

    # -- state (state.enabled) ---------------------------------------------------------------------
    async def _write_state(
        self, nc: Client, messages: Sequence[Message], errors: dict[int, ConnectorError], seqs: dict[int, int]
    ) -> None:
        """Apply the state messages of a write, once the messages before them are stored: per bridge
        stream (streams in parallel), the deltas up to its first transient failure folded into one
        bucket write (see _apply_state); the state messages after a failure fail with it."""
        if self._bucket_unfit is not None or time.monotonic() - self._bucket_checked >= BUCKET_RECHECK:
            await self._recheck_bucket(nc)
        if self._bucket_unfit is not None:
            unfit = Retriable(self._bucket_unfit, reason="bucket_drops_entries")
            errors.update({i: unfit for i, m in enumerate(messages) if m.type == STATE_TYPE and i not in errors})
            return
        streams: dict[str, list[int]] = {}
        for i, m in enumerate(messages):
            streams.setdefault(m.record.stream.key, []).append(i)
        jobs = [
            self._stream_state(nc, messages, indexes, errors, seqs)
            for indexes in streams.values()
            if any(messages[i].type == STATE_TYPE for i in indexes)
        ]
        if jobs:
            await (jobs[0] if len(jobs) == 1 else asyncio.gather(*jobs))

    async def _stream_state(
        self,
        nc: Client,
        messages: Sequence[Message],
        indexes: list[int],
        errors: dict[int, ConnectorError],
        seqs: dict[int, int],
    ) -> None:
        stream = messages[indexes[0]].record.stream
        next_ = self._next.get(stream.key)
        deltas: list[tuple[StateDelta, int | None]] = []
        states = [i for i in indexes if messages[i].type == STATE_TYPE]
        blocked: ConnectorError | None = None
        for i in indexes:
            m = messages[i]
            if m.type == STATE_TYPE:
                deltas.append((m.record.state, next_))
                continue
            error = errors.get(i)
            if error is not None and (not isinstance(error, Permanent) or m.record.kind != "batch"):
                # This and every later message of the stream are not stored: a transient failure,
                # or an announcement refused for itself (kept and retried: bridge.sink.announces).
                blocked = error if not isinstance(error, Permanent) else Retriable(str(error), reason=error.reason)
                break
            if i in seqs:
                next_ = seqs[i] + 1
        first = next((d for d, _ in deltas if not d.stale), None)
        clears = first is not None and first.clear
        if deltas and not clears and self._bucket_lives.get(stream.key, self._bucket_life) != self._bucket_life:
            # The bucket went missing or was created again since this stream's last state write
            # (deleted, a server that kept it in memory restarted): what it held is gone. Refused for
            # itself, the runtime clears the stream at its next record (incomplete), which writes
            # it whole again. A write that clears first (the runtime cleared it already, after a
            # SinkLost) needs nothing it held: it goes through.
            self._bucket_lives[stream.key] = self._bucket_life
            prefix = state_prefix(stream.source, stream.dp_rank)
            self._heads.pop(prefix, None)  # (told once: not again by its head or its journal)
            self._journals.pop(prefix, None)
            lost = Permanent(
                f"{self._prefix}: KV bucket {self._bucket!r} lost what it held (deleted, or a server that kept it in "
                "memory restarted): the stream's state starts again",
                reason="state_lost",
            )
            errors.update(dict.fromkeys(states, lost))
            return
        if deltas:
            try:
                await self._apply_state(nc, stream, deltas)
            except _StateGone as gone:
                # Refused for itself, like a lost bucket above: the runtime clears the stream at its
                # next record (incomplete), and that write needs nothing the bucket held.
                errors.update(dict.fromkeys(states, gone))
                return
            except ConnectorError as exc:
                failure = exc if not isinstance(exc, Permanent) else Retriable(str(exc), reason=exc.reason)
                errors.update(dict.fromkeys(states, failure))
                self._state_problem = str(failure)
                if failure.reason == "no_bucket":
                    if not self._bucket_gone:  # what it held is lost, whoever creates it again
                        self._bucket_gone = True
                        self._bucket_life += 1
                    if self.options.state.create:
                        try:
                            await self._check_bucket(nc.jetstream(timeout=self.options.connect_timeout))
                        except NotConnected as created:
                            self._state_problem = str(created)
                        except (TimeoutError, nats.errors.Error):
                            pass
                return
            self._bucket_lives[stream.key] = self._bucket_life  # the bucket holds its state
            self._bucket_gone = False
            self._state_problem = None
            if deltas[-1][1] is not None:
                self._next[stream.key] = deltas[-1][1]
        if blocked is not None:
            errors.update(dict.fromkeys(states[len(deltas) :], blocked))

    async def _apply_state(self, nc: Client, stream: Stream, deltas: Sequence[tuple[StateDelta, int | None]]) -> None:
        """Write one stream's state changes: the purge of a clear (awaited), the journal (awaited),
        every entry put or delete at once (their acks gathered), then the head. The head comes
        last, so a consumer never reads a head ahead of its entries; entries ahead of the head are
        what the bootstrap's version rule is for, and the journal lets a restarted bridge finish
        a write it was killed in (see read_state)."""
        op = fold_deltas(deltas)
        if op is None:
            return
        fmt = self._format
        assert fmt is not None
        prefix = state_prefix(stream.source, stream.dp_rank)
        head_doc = fmt.head(stream, op.head, op.next)
        # A journal part holds the head and one entry at least, within the bucket's value limit.
        room = self._part_size(nc)
        budget = room - len(head_doc) - _JOURNAL_FRAME
        limit = budget - _KEY_ROOM

        def document(c: EntryChange, head: Head) -> bytes:
            doc = fmt.entry(stream, head, c)
            if len(doc) > limit:  # a fact too large for a message (a huge lora_name): the count and version
                doc = fmt.entry(stream, head, msgspec.structs.replace(c, fact=None))
            return doc

        ops = [
            (entry_key(c.medium, c.group_idx, c.block), document(c, head) if c.count > 0 else None)
            for c, head in op.changes.values()
        ]
        parts = journal_parts(op.head, head_doc, ops, budget, clear=op.clear, writer=self._writer)
        largest = max(len(part) for part in parts)
        if largest > room:
            # A head or an entry (without its fact) too large for the bucket or the server even alone
            # (a long source name or medium): refused for ever if sent, which stopped every stream of
            # the sink (I5). The stream's state is cleared instead, incomplete; its events go on.
            raise _StateGone(
                f"{self._prefix}: the state of {stream.key} needs a journal part of {largest} bytes, above the "
                f"{room} KV bucket {self._bucket!r} and the server take (max_value_size, max_payload): the stream's "
                "state is cleared and incomplete until a write fits; raise the bucket's max_value_size and the "
                "server's max_payload, or shorten the source name or medium",
                reason="state_too_large",
            )
        target = _order(op.head)
        await self._write_journal(nc, prefix, parts, target, clear=op.clear)
        await self._finish(nc, prefix, op.clear, ops, head_doc, target)
        if len(parts) > 1:  # a large write: its other parts would stay until a write as large (the first, the fence, stays)
            await self._purge(nc, [f"{JOURNAL_KEY}.{prefix}.p.>"])

    async def _write_journal(
        self, nc: Client, prefix: str, parts: Sequence[bytes], target: tuple[int, int, int], *, clear: bool
    ) -> None:
        """Store a write's journal (``target``: the epoch, generation and seq of the head it ends
        with), its first part only over the one this connector stored last
        (Nats-Expected-Last-Subject-Sequence): the fence of the stream's state, since every write
        starts with it. Another journal found there (not this write's own, stored before its ack
        was lost: each connector stamps its journals with a writer id of its own) is another
        bridge's writing the same stream (two pods reading one engine): its
        clears, removals and late entries would mix with this one's under a head marked complete,
        so the state is _StateGone before this write touches an entry. The runtime then clears
        the stream (a new generation, incomplete), written over that journal, and the other
        bridge does the same at its next write: the state stays incomplete while both write and
        after, until the engine's next clear or restart (as Redis's ``_at`` check does). The
        first write after this connector started goes over the journal the bucket holds when its
        write is finished, its head stored (a restart of the one writer: read_state finishes the
        write of one killed half-way); an unfinished one is another bridge's write in flight, whose
        entries may still land: _StateGone. A clear goes over a journal the bucket lost."""
        key = journal_part_key(prefix, 0)
        last = self._journals.get(prefix)
        if last is None:
            last = self._journals[prefix] = await self._journal_now(nc, key)
            if last.target is not None:
                head = await self._head_now(nc, f"{prefix}.{HEAD_KEY}")
                if (head is None or last.target > head[1]) and await self._journal_whole(nc, prefix, last):
                    # A write another bridge has not finished (one killed half-way is finished by
                    # read_state, before this; one killed within its journal wrote no entry): its
                    # entries may still land after this one's.
                    raise self._other_writer("journal", last.target)
        try:
            (written,) = await self._kv_write(nc, [(key, parts[0])], _expect_subject_seq(last.seq))
        except _StateGone as gone:
            now = self._journals[prefix] = await self._journal_now(nc, key)  # (the clear that follows goes over it)
            lost = now.target is None or (last.target is not None and now.target < last.target)  # purged, restored
            if now.writer == self._writer and now.target == target:
                written = now.seq  # this write's own, stored before its ack was lost
            elif now.writer == self._writer or (lost and clear):
                # An earlier write's own whose ack was lost (retried with more changes folded in), or
                # a clear, which needs nothing the bucket held: written over it.
                (written,) = await self._kv_write(nc, [(key, parts[0])], _expect_subject_seq(now.seq))
            elif lost:
                raise gone from None
            else:
                raise self._other_writer("journal", now.target) from None
        self._journals[prefix] = _JournalAt(written, target, self._writer)
        if len(parts) > 1:
            await self._kv_write(nc, [(journal_part_key(prefix, i), p) for i, p in enumerate(parts[1:], 1)])

    async def _journal_whole(self, nc: Client, prefix: str, first: _JournalAt) -> bool:
        """Whether every part of the journal whose first part is ``first`` is stored (its parts are
        sent in order on one connection, so its last part tells)."""
        if first.part is None:
            return False
        parts = first.part.parts
        if parts <= 1:
            return True
        last = await self._journal_now(nc, journal_part_key(prefix, parts - 1))
        return last.target == first.target and last.writer == first.writer

    def _other_writer(self, what: str, target: tuple[int, int, int] | None) -> _StateGone:
        at = f" (epoch {target[0]}, generation {target[1]}, seq {target[2]})" if target else ""
        return _StateGone(
            f"{self._prefix}: another bridge wrote this stream's state {what} into KV bucket {self._bucket!r}{at} since "
            "this sink's last write (two pods reading one engine): the stream's state starts again, incomplete until "
            "the engine's next clear or restart; let one bridge write each stream",
            reason="state_lost",
        )

    async def _journal_now(self, nc: Client, key: str) -> _JournalAt:
        """The journal part the bucket holds at ``key``."""
        msg = await self._last_msg(nc, key, "journal")
        if msg is None or msg.seq is None:
            return _JournalAt(0)
        data = msg.data or b""
        try:
            j = _journal_decoder.decode(data)
        except msgspec.DecodeError:
            return _JournalAt(msg.seq)
        return _JournalAt(msg.seq, j.target, j.writer, j)

    async def _finish(
        self,
        nc: Client,
        prefix: str,
        clear: bool,
        ops: Sequence[tuple[str, bytes | None]],
        head_doc: bytes,
        at: tuple[int, int, int] | None = None,
    ) -> None:
        """The writes a journal stands for: the purge, every entry put or removed at once, then the
        head (``at``: its epoch, generation and seq) over the head this connector wrote last.
        Any other head there is _StateGone: gone, or behind the one this sink wrote last, the
        bucket was purged, created again or restored under this sink; ahead, another bridge
        writes the stream (see _write_journal). This head, stored already (its ack lost), stands."""
        if clear:
            await self._purge(nc, [prefix + ".>"])
        puts = [(f"{prefix}.{key}", doc) for key, doc in ops if doc is not None]
        gone = [f"{prefix}.{key}" for key, doc in ops if doc is None]
        if puts and gone:
            await asyncio.gather(self._kv_write(nc, puts), self._purge(nc, gone))
        elif puts or gone:
            await (self._kv_write(nc, puts) if puts else self._purge(nc, gone))
        key = f"{prefix}.{HEAD_KEY}"
        last = None if clear or at is None else self._heads.get(prefix)
        try:
            (written,) = await self._kv_write(nc, [(key, head_doc)], _expect_subject_seq(last[0] if last else None))
        except _StateGone:
            assert last is not None and at is not None
            now = await self._head_now(nc, key)
            journal = self._journals.get(prefix)
            # This head, stored before its ack was lost, unless another bridge wrote one alike (two
            # pods in one epoch): then its journal went over this sink's.
            if (
                now is not None
                and now[1] == at
                and journal is not None
                and (await self._journal_now(nc, journal_part_key(prefix, 0))).seq == journal.seq
            ):
                self._heads[prefix] = now
                return
            self._heads.pop(prefix, None)
            if now is not None and now[1] > last[1]:
                raise self._other_writer("head", now[1]) from None
            raise
        if at is not None:
            self._heads[prefix] = (written, at)

    async def _last_msg(self, nc: Client, key: str, what: str) -> RawStreamMsg | None:
        """The message the bucket holds at ``key`` (None: none); ``what`` names it in an error."""
        js = nc.jetstream(timeout=self.options.connect_timeout)
        try:
            return await js.get_last_msg(self._kv_stream, self._kv_prefix + key)
        except nats.js.errors.NotFoundError:
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise Retriable(
                f"{self._prefix}: reading a state {what} in bucket {self._bucket!r} failed: {_describe(exc)}"
            ) from None

    async def _head_now(self, nc: Client, key: str) -> tuple[int, tuple[int, int, int]] | None:
        """The bucket seq and (epoch, generation, seq) of the head the bucket holds at ``key`` (None: none)."""
        msg = await self._last_msg(nc, key, "head")
        if msg is None:
            return None
        doc = parse(msg.data) if msg.data else None
        head = head_of(doc) if doc is not None else None
        return None if head is None or msg.seq is None else (msg.seq, (head.epoch, head.generation, head.seq))

    async def _purge(self, nc: Client, keys: Sequence[str]) -> None:
        """Remove each key (or ``{prefix}.>``: every key of a stream) with a subject-filtered purge of
        the bucket's stream (ADR-8 / ADR-10), up to 64 at once: unlike a KV delete, it leaves no
        marker, so the bucket holds the live entries alone however many blocks come and go."""
        js = nc.jetstream(timeout=self.options.connect_timeout)
        window = asyncio.Semaphore(64)

        async def one(key: str) -> None:
            async with window:
                await js.purge_stream(self._kv_stream, subject=self._kv_prefix + key)

        try:
            await (one(keys[0]) if len(keys) == 1 else asyncio.gather(*(one(k) for k in keys)))
        except nats.js.errors.NotFoundError:
            raise Retriable(self._no_bucket(), reason="no_bucket") from None
        except (TimeoutError, nats.errors.Error) as exc:
            raise Retriable(f"{self._prefix}: state purge in bucket {self._bucket!r} failed: {_describe(exc)}") from None

    async def _kv_write(self, nc: Client, ops: Sequence[tuple[str, bytes]], hdr: bytes = b"") -> list[int]:
        """Put each (key, value) into the bucket, all at once (``hdr``: each put's header block; b"",
        _KV_PUT: none); return their bucket seqs when every one is stored. The server stores one connection's
        publishes to a stream in the order sent."""
        acks = _Acks()
        sent: list[str] = []
        try:
            for key, value in ops:
                subject = self._kv_prefix + key
                await self._send(nc, subject, hdr, value, acks)
                sent.append(subject)
            await acks.wait()
        finally:
            self._forget(acks)
        seqs = []
        for subject, msg in zip(sent, acks.msgs, strict=True):
            if msg is None:
                raise acks.error or NotConnected(f"{self._prefix}: no ack for state key {subject!r}")
            error = self._kv_ack_error(msg, subject)
            if error is not None:
                raise error
            seqs.append(_ack_decoder.decode(msg.data).seq)
        return seqs

    def _kv_ack_error(self, msg: Msg, subject: str) -> ConnectorError | None:
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            return Retriable(self._no_bucket(), reason="no_bucket")
        try:
            err = _ack_decoder.decode(msg.data).error
        except msgspec.DecodeError:
            return Retriable(f"{self._prefix}: unreadable JetStream ack {msg.data[:200]!r}", reason="bad_ack")
        if err is None:
            return None
        if err.err_code == _WRONG_LAST_SUBJECT_SEQ:
            return _StateGone(
                f"{self._prefix}: KV bucket {self._bucket!r} no longer holds what this sink wrote last of the stream's state "
                "(purged, or deleted and created again): the stream's state starts again, incomplete",
                reason="state_lost",
            )
        text = f"{self._prefix}: JetStream refused state key {subject!r}: {err.description} (code {err.code}/{err.err_code})"
        return Retriable(text, reason="stream_full" if "maximum" in err.description.lower() else "state_rejected")

    def _part_size(self, nc: Client) -> int:
        """The size of a journal part: half the server's max_payload (4 KiB at least, 1 KiB below
        max_payload at most), within the bucket's value limit (max_value_size)."""
        size = min(max(4096, nc.max_payload // 2), nc.max_payload - 1024)  # (headers, subject: within max_payload)
        return size if self._value_limit is None else min(size, self._value_limit)

    def _no_bucket(self) -> str:
        create = self.options.state.create
        fix = "state.create: it is created again" if create else "create it (history 1), or set state.create: true"
        return f"{self._prefix}: KV bucket {self._bucket!r} does not exist: {fix}"

    async def _check_bucket(self, js: JetStreamContext) -> None:
        """Create the bucket (state.create) or check that it exists (health, ``--check``)."""
        so = self.options.state
        try:
            info = await js.stream_info(self._kv_stream)
        except nats.js.errors.NotFoundError:
            pass
        else:
            self._check_bucket_config(info.config)
            self._state_problem = None
            if self.creates_nothing:  # (--check only, as for the events stream: see _check_stream)
                self._state_problem = await self._full_problem(js, info, f"KV bucket {so.bucket!r}")
            return
        if not so.create:
            self._state_problem = self._no_bucket()
            log.warning("%s", self._state_problem, extra={"sink": self.name})
            return
        if self.creates_nothing:  # --check: the run would create it, if it can be
            assert self._nc is not None
            await self._check_creatable(
                self._nc, js, f"KV bucket {so.bucket!r}", [f"$KV.{so.bucket}.>"], so.replicas, so.storage, so.max_bytes
            )
            self._state_problem = None
            return
        config = js_api.KeyValueConfig(
            bucket=so.bucket,
            history=1,
            replicas=so.replicas,
            storage=js_api.StorageType(so.storage),
            max_bytes=so.max_bytes if so.max_bytes is not None else -1,
        )
        try:
            await js.create_key_value(config)
        except nats.js.errors.APIError as exc:
            if exc.err_code != _STREAM_NAME_EXISTS:
                raise NotConnected(f"{self._prefix}: cannot create KV bucket {so.bucket!r}: {_describe(exc)}") from None
        self._bucket_life += 1  # created (again): streams written before lost their state
        self._value_limit = None
        self._state_problem = None
        log.info("%s: created KV bucket %s for the state", self._prefix, so.bucket, extra={"sink": self.name})
        if so.storage == "memory":
            self._warn_memory(f"KV bucket {so.bucket!r}", _MEMORY_BUCKET, "state.storage: file")

    async def _check_creatable(
        self,
        nc: Client,
        js: JetStreamContext,
        what: str,
        subjects: list[str],
        replicas: int,
        storage: str,
        max_bytes: int | None,
    ) -> None:
        """``--check``, for a stream or bucket the run would create: what the server would refuse and
        can be seen without creating anything is refused now, naming the fix (NotConnected):
        replicas above one on a server outside a cluster, subjects another stream captures, an
        account at its limit of streams (counting every one this sink would create) or with no
        room left in the storage it would use. (A size above the server's store is seen only when
        the run creates it.)"""
        self._would_create += 1
        if replicas > 1 and not internals.server_info(nc).get("cluster"):
            raise NotConnected(
                f"{self._prefix}: {what} would be created with {replicas} replicas, but NATS at {self._where} is not "
                "in a JetStream cluster: set replicas: 1 (or run a cluster of as many servers)",
                reason="cannot_create",
            )
        streams = await _all_streams(js)
        await self._check_account_room(js, what, storage, creating=(max_bytes, streams))
        for info in streams:
            taken = [s for s in info.config.subjects or [] for ours in subjects if subjects_overlap(s, ours)]
            if taken:
                raise NotConnected(
                    f"{self._prefix}: {what} would capture {subjects}, but stream {info.config.name!r} captures "
                    f"{taken} already (NATS refuses overlapping streams): use that stream (stream.name), or other subjects",
                    reason="cannot_create",
                )

    async def _check_account_room(
        self,
        js: JetStreamContext,
        what: str,
        storage: str,
        creating: tuple[int | None, list[js_api.StreamInfo]] | None = None,
    ) -> None:
        """The account's own JetStream limits (``nats account info``), for ``--check``: a full
        storage of the kind ``what`` uses (NotConnected); with ``creating`` (the ``max_bytes`` it
        would be created with, and the account's streams), also its ``max_streams`` (counting
        every stream this sink would create), ``max_bytes_required``, its per-stream cap, and the
        bytes the other streams reserve (their ``max_bytes``). -1 is no limit; an account that may
        not read its info cannot tell (nothing refused)."""
        try:
            account = await js.account_info()
        except nats.errors.Error:
            return
        limits = account.limits
        memory = storage == "memory"
        limit, used = (limits.max_memory, account.memory) if memory else (limits.max_storage, account.storage)
        problem = None
        if limit >= 0 and limit - used < _ACCOUNT_ROOM_MIN:
            problem = (
                f"the account's {storage} storage is full ({used} of {limit} bytes): raise the account's limit, or free room"
            )
        if creating is not None and problem is None:
            max_bytes, streams = creating
            cap = (limits.memory_max_stream_bytes if memory else limits.storage_max_stream_bytes) or 0
            kind = js_api.StorageType.MEMORY if memory else js_api.StorageType.FILE
            reserved = sum(max(i.config.max_bytes or 0, 0) for i in streams if i.config.storage == kind)
            if limits.max_streams >= 0 and account.streams + self._would_create > limits.max_streams:
                problem = (
                    f"the account may have {limits.max_streams} JetStream stream(s) and has {account.streams} already "
                    f"(this sink would create {self._would_create}): raise the account's max_streams, or use streams "
                    "that exist (stream.name, state.bucket)"
                )
            elif limits.max_bytes_required and not max_bytes:
                problem = "the account requires a max_bytes on every stream: set max_bytes (stream.max_bytes, state.max_bytes)"
            elif cap > 0 and (not max_bytes or max_bytes > cap):
                problem = f"the account caps each {storage} stream at {cap} bytes: set max_bytes to {cap} or less"
            elif limit >= 0 and max_bytes and reserved + max_bytes > limit:
                problem = (
                    f"its max_bytes {max_bytes} does not fit in the account's {storage} storage ({limit} bytes, "
                    f"{reserved} reserved by other streams): lower max_bytes, or raise the account's limit"
                )
        if problem is not None:
            verb = "would be created" if creating is not None else "is written"
            raise NotConnected(f"{self._prefix}: {what} {verb} with {storage} storage, but {problem}", reason="cannot_create")

    async def _full_problem(self, js: JetStreamContext, info: js_api.StreamInfo, what: str) -> str | None:
        """``--check``: why an existing stream or bucket refuses every write now (a ``discard: new``
        one at its limits, or an account whose storage of its kind is full), or None."""
        full = _full(info)
        if full is not None:
            return (
                f"{self._prefix}: {what} is full ({full}) and discards new messages: every write would be refused "
                "until room is made (consumers acking, a purge) or its limits are raised"
            )
        try:
            await self._check_account_room(js, what, _storage(info.config))
        except NotConnected as exc:
            return str(exc)
        return None

    async def _recheck_bucket(self, nc: Client) -> None:
        """The bucket's settings again (an operator can edit them during the run: ``nats stream
        edit``): one that no longer keeps what it is given (see _check_bucket_config) may have
        dropped entries of states marked complete already. Its heads this connector knows are
        removed (a consumer bootstrapping meanwhile finds no state, never a wrong one marked
        complete), every stream's state starts again at its next write (a new bucket life:
        cleared, incomplete until the engine's next clear or restart), and state writes fail,
        the sink not ready and naming the fix, until the bucket keeps entries again. Called by
        ``audit()`` and, at most every ``BUCKET_RECHECK`` seconds, by writes with state."""
        self._bucket_checked = time.monotonic()
        js = nc.jetstream(timeout=self.options.connect_timeout)
        try:
            config = (await js.stream_info(self._kv_stream)).config
            self._check_bucket_config(config)
        except nats.js.errors.NotFoundError:
            return  # (a write finds it missing: no_bucket)
        except NotConnected as exc:
            if exc.reason not in ("bucket_drops_entries", "bucket_too_small", "bucket_refuses_writes"):
                raise
            self._state_problem = str(exc)
            if self._bucket_unfit is None:
                # Each stream's head, and its journal (without a head, a journal would look like
                # another bridge's write in flight to the next write: see _write_journal).
                prefixes = set(self._heads) | set(self._journals)
                keys = [f"{p}.{HEAD_KEY}" for p in prefixes] + [f"{JOURNAL_KEY}.{p}.>" for p in prefixes]
                await self._purge(nc, keys)  # (raises when it fails: the next look tries again)
                self._heads.clear()
                self._journals.clear()
                self._bucket_unfit = str(exc)
                self._bucket_life += 1
                log.error(
                    "%s; the state of %d stream(s) it held is lost: their heads are removed, and each starts again "
                    "(incomplete) once the bucket is fixed",
                    exc,
                    len(prefixes),
                    extra={"sink": self.name, "count": len(prefixes)},
                )
            return
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("%s: bucket lookup failed: %s", self._prefix, _describe(exc), extra={"sink": self.name})
            return
        if self._bucket_unfit is not None:
            self._bucket_unfit = self._state_problem = None
            log.info("%s: KV bucket %s keeps its entries again", self._prefix, self._bucket, extra={"sink": self.name})

    def _check_bucket_config(self, config: js_api.StreamConfig) -> None:
        """What the bridge needs of an existing bucket: values large enough for a journal part
        (NotConnected naming the fix otherwise: the journal would be refused for ever), entries
        that stay until the bridge removes them (a TTL, or limits that discard the oldest, would
        take blocks out of a state still marked complete: I6), and it warns when the bucket is
        kept in memory."""
        limit = config.max_msg_size
        self._value_limit = limit if limit is not None and limit > 0 else None
        if self._value_limit is not None and self._value_limit < MIN_STATE_VALUE:
            raise NotConnected(
                f"{self._prefix}: KV bucket {self._bucket!r} takes values of at most {self._value_limit} bytes "
                f"(max_value_size); the state's journal needs {MIN_STATE_VALUE} at least: raise it "
                f"(nats stream edit {self._kv_stream} --max-msg-size={MIN_STATE_VALUE}, or -1: no limit), or use "
                "another bucket",
                reason="bucket_too_small",
            )
        if config.storage == js_api.StorageType.MEMORY:
            self._warn_memory(f"KV bucket {self._bucket!r}", _MEMORY_BUCKET, "a bucket with file storage")
        if config.mirror is not None:  # (a KV read replica: its stream takes no publish, only its origin's)
            refusal: str | None = (
                f"is a mirror of {config.mirror.name.removeprefix('KV_')!r} (a read replica): it takes no write of its "
                "own; write to the bucket it mirrors"
            )
        elif not any(subjects_overlap(f, f"$KV.{self._bucket}.x") for f in config.subjects or []):
            refusal = f"captures no subject $KV.{self._bucket}.> (a stream named as a bucket, not one): use a KV bucket"
        else:
            refusal = _refuses_writes(config, "key")  # (deny_purge: a KV bucket cannot have it, its roll-ups need purges)
        if refusal is not None:
            raise NotConnected(
                f"{self._prefix}: KV bucket {self._bucket!r} {refusal}, or use another bucket", reason="bucket_refuses_writes"
            )
        if config.retention == js_api.RetentionPolicy.WORK_QUEUE:
            raise NotConnected(
                f"{self._prefix}: KV bucket {self._bucket!r} has workqueue retention: nobody can read the state back "
                "(a workqueue stream takes only acking consumers, whose acks would delete the entries); use a bucket "
                "with limits retention",
                reason="bucket_refuses_writes",
            )
        drops = []
        if config.retention == js_api.RetentionPolicy.INTEREST:
            drops.append("its entries go once every consumer interested acknowledged them (interest retention): use limits")
        if config.max_age:
            drops.append(f"its entries expire after {config.max_age:g} s (ttl): remove the TTL")
        if config.discard == js_api.DiscardPolicy.OLD and ((config.max_msgs or 0) > 0 or (config.max_bytes or 0) > 0):
            drops.append("it discards its oldest entries at its limits (discard old): use discard new, or no limits")
        if drops:
            raise NotConnected(
                f"{self._prefix}: KV bucket {self._bucket!r} loses state entries on its own, so a state marked complete "
                f"would not be: {'; '.join(drops)} (nats stream edit {self._kv_stream}), or use another bucket",
                reason="bucket_drops_entries",
            )

    def _warn_memory(self, what: str, consequence: str, fix: str) -> None:
        self._warn_once(what, "%s keeps its data in memory: a restart of the server loses it; %s. Use %s", what, consequence, fix)

    def _warn_once(self, key: str, text: str, *args: object) -> None:
        """One WARNING per ``key`` and connector (not again when a stream or bucket is created again)."""
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning("%s: " + text, self._prefix, *args, extra={"sink": self.name})

    async def read_state(self, streams: Sequence[Stream]) -> dict[str, tuple[Head, list[SeedEntry]] | None]:
        """The state the bucket holds of each stream (a restarted bridge rebuilds from it): its keys
        swept with an ordered consumer (DeliverLastPerSubject), 16 streams at a time. A write the
        last process was killed in (a complete journal ahead of the head) is finished first, so
        the entries are exactly those of the head. ``None``: no key of the stream; no entry (cannot
        tell): entries without a head, a head of another source, entries of a newer generation."""
        nc = self._nc
        if nc is None or nc.is_closed or not nc.is_connected:
            raise NotConnected(f"{self._prefix}: not connected to NATS at {self._where}")
        js = nc.jetstream(timeout=self.options.connect_timeout)
        window = asyncio.Semaphore(16)
        out: dict[str, tuple[Head, list[SeedEntry]] | None] = {}

        async def one(stream: Stream) -> None:
            prefix = state_prefix(stream.source, stream.dp_rank)
            async with window:
                try:
                    journal = await sweep(js, self._bucket, f"{JOURNAL_KEY}.{prefix}")
                    held = await sweep(js, self._bucket, prefix)
                except nats.js.errors.NotFoundError:
                    out[stream.key] = None  # no bucket: nothing held
                    return
                got = await self._rebuild(nc, stream, prefix, held, [v for v in journal.values() if v])
                if isinstance(got, tuple):
                    # The head the tracker builds on: the next head is written over it (or the
                    # state is lost: purged or created again before this bridge's first write).
                    now = await self._head_now(nc, f"{prefix}.{HEAD_KEY}")
                    if now is not None and now[1] == (got[0].epoch, got[0].generation, got[0].seq):
                        self._heads[prefix] = now
            if got != "unknown":
                out[stream.key] = got  # type: ignore[assignment]
                if got is not None:
                    self._bucket_lives[stream.key] = self._bucket_life  # the tracker builds on what it holds

        await asyncio.gather(*(one(s) for s in streams))
        await self._check_heads_stored(nc, {s.key: s for s in streams}, out)
        return out

    async def _check_heads_stored(
        self, nc: Client, streams: dict[str, Stream], out: dict[str, tuple[Head, list[SeedEntry]] | None]
    ) -> None:
        """Each head read back names the seq its stream continues from in the JetStream stream that
        captures its subject (``next``, one past its last message stored): one that no longer
        reaches it (created again, empty, after a server that kept it in memory restarted, or
        deleted, while no bridge ran), or holds another writer's message there (created again and
        filled past it), lost what the head says it stored. The head's epoch is announced lost
        from seq 0 at the first write or audit, and the stream's state cleared, as a loss found at
        run time is (I6); the runtime is told (``records_gone``). Each stream is judged by the
        stream capturing its own subject (an operator may split the subjects over several); a head
        whose subject no stream captures any more (deleted while no bridge ran, and not created
        again yet) lost what it stored all the same."""
        reach = {key: n for key, n in self._next.items() if n is not None and isinstance(out.get(key), tuple)}
        if self.options.mode == "core" or not reach:
            return
        js = nc.jetstream(timeout=self.options.connect_timeout)
        subjects = {key: self._subjects.render(sample_message(streams[key])) for key in reach}
        owners = await self._capturing(js, subjects.values())
        owner = {key: owners[subject] for key, subject in subjects.items() if subject in owners}
        lasts: dict[str, int] = {}
        made: dict[str, datetime | None] = {}
        for name in set(owner.values()):
            try:
                info = await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                lasts[name] = 0
            else:
                lasts[name], made[name] = info.state.last_seq, info.created
        gone = [key for key, n in reach.items() if n > 1 and (key not in owner or n - 1 > lasts[owner[key]])]
        window = asyncio.Semaphore(16)

        async def refilled(key: str, at: int) -> bool:
            """Is the message at ``at`` another one than this stream's own, in the head's epoch (the
            stream created again and filled past it by another writer)? One gone (expired,
            deleted) proves nothing."""
            stream, head = streams[key], out[key]
            assert head is not None
            async with window:
                try:
                    msg = await js.get_msg(owner[key], seq=at)
                except (nats.js.errors.NotFoundError, nats.js.errors.APIError):
                    return False
            given = (msg.headers or {}).get(MSG_ID_HEADER, "")
            mine = f"{stream.source}/{stream.dp_rank}/{head[0].epoch}/"
            # (the id: the subject, a space and the record's id; a release before js_msg_id: the record's alone)
            ours = given.partition(" ")[2].startswith(mine) or given.startswith(mine)
            # On its own subject: another sink's message of the same record, on a subject of its
            # own in the same stream, is another writer's (state keeps the subject one per stream).
            return not (ours and msg.subject == self._subjects.render(sample_message(stream)))

        kept = [(key, n - 1) for key, n in reach.items() if key in owner and 0 < n - 1 <= lasts[owner[key]]]
        found = await asyncio.gather(*(refilled(key, at) for key, at in kept))
        gone += [key for (key, _), other in zip(kept, found, strict=True) if other]
        for key in gone:
            head = out[key]
            assert head is not None
            self._held.spans[key] = [_Span(streams[key], head[0].epoch, 0, head[0].seq)]
            self.records_gone.add(key)  # (the runtime announces the epoch before the head's too)
        for key, at in kept:
            if key not in gone:  # held: checked from now on, by the stream that holds it
                self._adopt(key, owner[key], at, made.get(owner[key]))
        if gone:
            where = ", ".join(sorted({repr(owner[k]) if k in owner else "no stream (deleted)" for k in gone}))
            stored = max(reach[k] for k in gone) - 1
            self._stream_lost(f"{where} no longer holds the message at seq {stored} the state says it stored", keys=gone)

    async def _redo(
        self, nc: Client, prefix: str, clear: bool, ops: Sequence[tuple[str, bytes | None]], head_doc: bytes, head: Head | None
    ) -> None:
        """Finish a write the last process was killed in (its journal ahead of the stored ``head``),
        through the fence like any write: the journal's first part is written again as this
        connector's, over the one the sweep read, and the head over the stored one. Either moved
        meanwhile (_StateGone): another bridge writes the stream, and finishing the old write
        would put its entries and head over newer ones."""
        key = journal_part_key(prefix, 0)
        seen = await self._journal_now(nc, key)
        redone = head_of(parse(head_doc) or {})
        stored = await self._head_now(nc, f"{prefix}.{HEAD_KEY}")
        if (
            redone is None
            or seen.part is None
            or seen.target != _order(redone)
            or (stored[1] if stored else None) != (_order(head) if head else None)
        ):
            raise self._other_writer("journal", seen.target)
        claim = _journal_encoder.encode(msgspec.structs.replace(seen.part, writer=self._writer))
        (written,) = await self._kv_write(nc, [(key, claim)], _expect_subject_seq(seen.seq))
        self._journals[prefix] = _JournalAt(written, seen.target, self._writer)
        self._heads[prefix] = stored or (0, (0, 0, 0))  # (0: the head is written only where there is none)
        await self._finish(nc, prefix, clear, ops, head_doc, seen.target)

    async def _rebuild(
        self, nc: Client, stream: Stream, prefix: str, held: dict[str, bytes | None], journal: list[bytes]
    ) -> tuple[Head, list[SeedEntry]] | str | None:
        head_raw = held.pop(HEAD_KEY, None)
        entries = {k: v for k, v in held.items() if "/" in k}
        head_doc = parse(head_raw) if head_raw else None
        head = head_of(head_doc) if head_doc is not None else None
        redo = journal_redo(journal, head)
        if redo is not None:
            clear, ops, redo_head = redo
            try:
                await self._redo(nc, prefix, clear, ops, redo_head, head)
            except _StateGone:
                return "unknown"  # another bridge wrote the stream since the sweep: a fresh start
            if clear:
                entries.clear()
            entries.update(ops)
            head_doc = parse(redo_head)
            head = head_of(head_doc) if head_doc is not None else None
            log.info("%s: finished an interrupted state write", self._prefix, extra={"stream": stream.key, "count": len(ops)})
        if head_doc is None or head is None:
            return None if not any(entries.values()) else "unknown"
        if head_doc.get("source") != stream.source or head_doc.get("dp_rank") != stream.dp_rank:
            return "unknown"
        generation = (head.epoch, head.generation)
        seeds: list[SeedEntry] = []
        for value in entries.values():
            doc = parse(value) if value else None
            if doc is None:
                continue
            try:
                written = (int(doc["epoch"]), int(doc["gen"]))
            except (KeyError, TypeError, ValueError):
                continue
            if written < generation:
                continue  # not expected (a clear purges): left behind, not part of the head's state
            if written > generation:
                return "unknown"  # a clear whose head is missing: cannot tell
            seed = seed_entry(doc)
            if seed is not None:
                seeds.append(seed)
        next_ = head_doc.get("next")
        if type(next_) is int:
            self._next[stream.key] = next_
        return head, seeds

    # -- connection -----------------------------------------------------------------------------
    def _client_options(self) -> dict[str, Any]:
        o = self.options
        opts: dict[str, Any] = {
            "servers": o.server_list,
            "name": f"kv-event-bridge/{self.name}",
            "connect_timeout": o.connect_timeout,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": o.reconnect_wait,
            "reconnect_to_server_handler": self._next_server,
            "ping_interval": o.ping_interval,
            "max_outstanding_pings": 2,
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "closed_cb": self._on_closed,
        }
        for key in ("credentials", "nkey_seed"):
            path = getattr(o, key)
            if path is not None and not Path(path).is_file():
                raise NotConnected(f"{self._prefix}.{key}: file {path!r} does not exist", reason="auth")
        if o.credentials is not None:
            opts["user_credentials"] = o.credentials
        if o.nkey_seed is not None:
            opts["nkeys_seed"] = o.nkey_seed
        if o.user is not None:
            opts["user"], opts["password"] = o.user, reveal(o.password)
        if o.token is not None:
            opts["token"] = reveal(o.token)
        if o.tls is not None:
            try:
                opts["tls"] = o.tls.ssl_context()
            except OSError as exc:  # ssl.SSLError is an OSError
                raise NotConnected(f"{self._prefix}.tls: cannot load the TLS files: {_describe(exc)}", reason="tls") from None
        return opts

    def _next_server(self, servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        """The least-tried server: at once on its first attempt, else after ``reconnect_wait`` plus
        jitter (many bridges must not hammer a restarting server in lockstep)."""
        best = min(servers, key=lambda s: s.reconnects)
        return best, 0.0 if best.reconnects == 0 else self.options.reconnect_wait + random.uniform(
            0, self.options.reconnect_jitter
        )

    async def _on_error(self, exc: Exception) -> None:
        text, refusal = _describe(exc), _refusal(exc)
        log.debug("%s: NATS error: %s", self._prefix, text, extra={"sink": self.name})
        now = time.monotonic()
        if refusal is None and self._refusal is not None and isinstance(exc, OSError) and now - self._refused_at < 1.0:
            return  # the server closing the socket right after its refusal (a broken pipe, a reset): keep the refusal
        self._last_error, self._refusal = text, refusal
        if refusal is not None:
            self._refused_at = now
        if "permissions violation" in self._last_error.lower():
            # The server drops the message and says so only here: without this, the write would
            # wait for its acks until write_timeout, and the sink look ready meanwhile.
            problem = (
                f"{self._prefix}: NATS at {self._where} refuses this user: {self._last_error}; grant it publish on the "
                f"sink's subjects ({subject_filter(self.options.subject)}), the JetStream API ($JS.API.>) and, with "
                "state, the bucket's ($KV.>), and subscribe on its inbox (_INBOX.>)"
            )
            if problem != self._permission_problem:
                log.warning("%s", problem, extra={"sink": self.name})
            self._permission_problem = problem
            self._refused += 1
            self._fail_acks(Retriable(problem, reason="no_permission"))
            if self._nc is not None:  # the refused one among them would wait its whole timeout
                internals.fail_requests(self._nc, nats.errors.Error(text))

    async def _on_disconnected(self) -> None:
        nc = self._nc
        if nc is not None:
            internals.drop_pending(nc)
            if not self._closing:
                log.warning(
                    "%s: disconnected from NATS at %s; reconnecting", self._prefix, self._where, extra={"sink": self.name}
                )
        self._fail_acks(
            NotConnected(f"{self._prefix}: connection to NATS at {self._where} lost before the ack", reason="disconnected")
        )

    async def _on_reconnected(self) -> None:
        self._last_error = self._refusal = None
        log.info("%s: reconnected to NATS at %s", self._prefix, self._where, extra={"sink": self.name})

    async def _on_closed(self) -> None:
        self._fail_acks(NotConnected(f"{self._prefix}: NATS connection closed"))

    async def _close_client(self, nc: Client) -> None:
        self._closing = True  # (its disconnected callback is no loss of the connection: see _on_disconnected)
        try:
            await nc.close()  # flushes what is buffered first; the runtime bounds the call
        except Exception as exc:
            log.debug("%s: close failed: %s", self._prefix, _describe(exc), extra={"sink": self.name})
        finally:
            self._closing = False

    # -- streams --------------------------------------------------------------------------------
    async def _ensure_stream(self, js: JetStreamContext) -> None:
        """Create the stream with the configured settings when it does not exist (stream.create)."""
        so = self.options.stream
        try:
            await js.stream_info(so.name)
            return
        except nats.js.errors.NotFoundError:
            pass
        config = js_api.StreamConfig(
            name=so.name,
            subjects=so.subjects or [subject_filter(self.options.subject)],
            retention=js_api.RetentionPolicy(so.retention),
            storage=js_api.StorageType(so.storage),
            max_age=so.max_age,
            max_bytes=so.max_bytes,
            num_replicas=so.replicas,
            duplicate_window=so.window,
        )
        try:
            await js.add_stream(config)
        except nats.js.errors.APIError as exc:
            if exc.err_code == _STREAM_NAME_EXISTS:  # another replica created it just now
                return
            raise NotConnected(f"{self._prefix}: cannot create JetStream stream {so.name!r}: {_describe(exc)}") from None
        self._held.fresh = True  # empty: a bridge stream's copy starts with the first message stored
        self._events_stream = so.name
        self._stream_seqs.pop(so.name, None)
        self._stream_created.pop(so.name, None)
        log.info(
            "%s: created JetStream stream %s for %s (duplicate window %gs)",
            self._prefix,
            so.name,
            config.subjects,
            so.window,
            extra={"sink": self.name},
        )

    def _types(self) -> list[str]:
        """The message types whose subjects a write can need (one, unless the template has ``{type}``)."""
        types = message_types(self.sink.granularity)
        return types if "type" in self._subjects.template.fields else types[:1]

    def _refusing(self, name: str, config: js_api.StreamConfig) -> bool:
        """Whether JetStream stream ``name``, capturing some of the sink's subjects, refuses or never
        acknowledges every write (its settings: :func:`_refuses_writes`), at connect and at each
        audit (an operator can edit it during the run): the sink not ready, naming the setting, and
        the bridge streams it captures held back (:meth:`_held_by_refusal`), until the settings are
        fixed. The other streams' messages are written."""
        refusal = _refuses_writes(config, "engine stream")
        kept = config.max_msgs_per_subject or 0
        if refusal is None and self.writes_state and (kind := _consumed(config)) is not None:
            refusal = f"has {kind} retention: {_CONSUMED_WITH_STATE} (retention cannot be edited: create it again)"
        elif refusal is None and self.writes_state and kept > 0:
            refusal = (
                f"keeps only the last {kept} message(s) of each subject (max_msgs_per_subject), and each engine stream "
                "is one subject: a consumer bootstrapping from the state follows the events from the state's head, and "
                "those removed before it read them would be missing while the state says complete; set "
                "max_msgs_per_subject: -1"
            )
        limit = config.max_msg_size or -1
        if refusal is None and 0 < limit < (smallest := smallest_record(self.sink, self.configured_streams)):
            refusal = (
                f"takes messages of at most {limit} bytes (max_msg_size), below the {smallest} of the smallest record "
                "this sink writes (the EventsLost that announces a refused batch): every record would be refused, its "
                "announcement too; raise max_msg_size"
            )
        if refusal is None:
            self._refusals.pop(name, None)
            return False
        problem = (
            f"{self._prefix}: JetStream stream {name!r} {refusal}, or write to another stream (stream.name, and "
            "subjects it captures)"
        )
        if problem != self._refusals.get(name, ("", []))[0]:
            log.warning("%s", problem, extra={"sink": self.name})
        self._refusals[name] = (problem, list(config.subjects or []))
        return True

    async def _still_refusing(self, nc: Client) -> None:
        """Each stream whose settings refused writes (:meth:`_refusing`) read again: an operator may
        have fixed them, created it again, or deleted it (the write then finds what captures its
        subjects now). A read that fails fails the write (``Retriable``: nothing written)."""
        js = nc.jetstream(timeout=self.options.connect_timeout)
        for name in list(self._refusals):
            try:
                info = await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                self._refusals.pop(name, None)
                continue
            except (nats.errors.Error, OSError) as exc:
                raise Retriable(f"{self._prefix}: cannot read JetStream stream {name!r} ({_describe(exc)})") from None
            self._refusing(name, info.config)

    def _held_by_refusal(self, messages: Sequence[Message]) -> dict[int, ConnectorError]:
        """The messages not written while a stream refuses (see _refusing): every message of a
        bridge stream with a message whose subject that stream captures (a stream's messages are
        never stored past one held back), each as ``Retriable`` (``stream_refused``). A stream whose
        messages leave once consumed takes every write, so only this keeps a state's events from
        leaving unseen."""
        refused: dict[str, str] = {}
        for m in messages:
            key = m.record.stream.key
            if m.type == STATE_TYPE or key in refused:
                continue
            subject = self._subjects.render(m)
            why = next((w for w, filters in self._refusals.values() if any(subjects_overlap(f, subject) for f in filters)), None)
            if why is not None:
                refused[key] = why
        errors: dict[str, ConnectorError] = {k: Retriable(why, reason="stream_refused") for k, why in refused.items()}
        return {i: errors[m.record.stream.key] for i, m in enumerate(messages) if m.record.stream.key in errors}

    def _missed(self, captured: Sequence[str], what: str, fix: str) -> str | None:
        """``--check``: the problem when the subject of a configured stream (``configured_streams``,
        each type with ``{type}``) is not among ``captured`` (what the streams capture), or None. A
        write of it would fail ``no_stream``; ``what`` says which stream, ``fix`` what to do."""
        rendered = (self._subjects.render(sample_message(s, t)) for s in self.configured_streams for t in self._types())
        missed = [s for s in dict.fromkeys(rendered) if not any(subjects_overlap(f, s) for f in captured)]
        if not missed:
            return None
        shown = ", ".join(repr(m) for m in missed[:3]) + (f" (+{len(missed) - 3} more)" if len(missed) > 3 else "")
        return f"{self._prefix}: {what}, not the subject of every source: {shown} would fail (no_stream); {fix}"

    async def _check_capturing(self, js: JetStreamContext, infos: list[js_api.StreamInfo], wildcard: str) -> bool:
        """Every stream among ``infos`` that captures some of the sink's subjects (``wildcard``), as a
        write would meet it (an operator may split them over several: see _capturing): one whose
        settings refuse writes is refused (:meth:`_refusing`: held back, the sink not ready); with
        ``--check``, one full now is the sink's problem (True; at a run, writes say stream_full,
        and the first that fits clears it); the others' settings that lose what a consumer needs are
        warned of."""
        seen: set[str] = set()
        for info in infos:
            config = info.config
            name, filters = config.name, config.subjects or []
            if name is None or name in seen or not any(subjects_overlap(f, wildcard) for f in filters):
                continue
            seen.add(name)
            if self._refusing(name, config):
                continue
            if self.creates_nothing and (problem := await self._full_problem(js, info, f"JetStream stream {name!r}")):
                self._stream_problem = problem
                return True
            if (kind := _consumed(config)) is not None:  # (with state: refused, see _refusing)
                self._warn_once(
                    f"retention {name}", "JetStream stream %s has %s retention: %s; use limits retention", name, kind, _CONSUMED
                )
            if config.storage == js_api.StorageType.MEMORY:
                consequence = _MEMORY_STREAM.format(sink=self.name)
                self._warn_memory(f"JetStream stream {name!r}", consequence, "file storage (stream.storage: file)")
            kept = config.max_msgs_per_subject or 0
            if kept > 0:
                self._warn_once(
                    f"per-subject {name}",
                    "JetStream stream %s keeps only the last %d message(s) of each subject (max_msgs_per_subject), "
                    "and each engine stream has one subject: a consumer that falls that far behind misses messages "
                    "nothing announces; raise it or remove the limit (-1)",
                    name,
                    kept,
                )
        return False

    async def _check_stream(self, js: JetStreamContext) -> None:
        """Report (health, ``--check``) when no stream captures any subject of the template; do not
        fail: a stream may be created later, and a write names the problem too. The server matches
        streams whose subjects overlap the template's wildcard form (``kv.*.*``), so a stream
        capturing only some sources passes here, and a write to the others fails ``no_stream``;
        ``--check`` looks for each configured stream's subject (``configured_streams``)."""
        wildcard = subject_filter(self.options.subject)
        try:
            self._refusals.clear()  # (the streams found, if any, say again)
            name = self._events_stream = await js.find_stream_name_by_subject(wildcard)
            self._stream_problem = None
            try:  # (an operator may split the subjects over several: the first write reads them too, see _claim)
                others = await _all_streams(js)
            except (TimeoutError, nats.errors.Error) as exc:
                log.debug("%s: listing the streams failed: %s", self._prefix, _describe(exc), extra={"sink": self.name})
                others = []
            info = await js.stream_info(name)
            config = info.config
            if await self._check_capturing(js, [info, *others], wildcard) or name in self._refusals:
                return
            captured = config.subjects or []
            # (with the subjects split over several streams, each captures its own: see _capturing)
            self._stream_problem = self._missed(
                [f for other in others for f in other.config.subjects or []] or captured,
                f"JetStream stream {name!r} captures {captured}",
                f"add {wildcard!r} to its subjects, or create a stream capturing them",
            )
            return
        except nats.js.errors.NotFoundError:
            problem = f"no JetStream stream captures subject {wildcard!r}: create one, or set stream.create: true"
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            problem = f"JetStream is not enabled on NATS at {self._where} (or mode: core was meant)"
        self._stream_problem = f"{self._prefix}: {problem}"
        log.warning("%s", self._stream_problem, extra={"sink": self.name})


def _storage(config: js_api.StreamConfig) -> str:
    return "memory" if config.storage == js_api.StorageType.MEMORY else "file"


def _refuses_writes(config: js_api.StreamConfig, subject: str) -> str | None:
    """Why a stream refuses or never acknowledges the sink's writes, whatever it holds (with the
    setting to change), or None. ``subject``: what one of its subjects is to the sink (an engine
    stream's, a state key's), each written again and again."""
    if config.sealed:
        return "is sealed: it refuses every write, for good; nothing makes it take writes again"
    if config.no_ack:
        return (
            "acknowledges no publish (no_ack: true): no write could be confirmed, so every write times out and "
            "nothing is ever known stored; set no_ack: false on it"
        )
    per = config.max_msgs_per_subject or 0
    if config.discard == js_api.DiscardPolicy.NEW and config.discard_new_per_subject and per > 0:
        return (
            f"refuses a subject's message past its {per} (discard: new with discard_new_per_subject and "
            f"max_msgs_per_subject {per}), and each {subject} is one subject it writes to again and again: set "
            "discard_new_per_subject: false"
        )
    return None


def _consumed(config: js_api.StreamConfig) -> str | None:
    """The retention of a stream whose messages leave once consumed (interest, workqueue), or None."""
    if config.retention == js_api.RetentionPolicy.INTEREST:
        return "interest"
    return "workqueue" if config.retention == js_api.RetentionPolicy.WORK_QUEUE else None


def _full(info: js_api.StreamInfo) -> str | None:
    """Which limit a ``discard: new`` stream has reached (it refuses every publish then), or None."""
    config, state = info.config, info.state
    if config.discard != js_api.DiscardPolicy.NEW:
        return None
    max_msgs, max_bytes = config.max_msgs or 0, config.max_bytes or 0
    if max_msgs > 0 and state.messages >= max_msgs:
        return f"{state.messages} of max_msgs {max_msgs}"
    if max_bytes > 0 and max_bytes - state.bytes < _STREAM_ROOM_MIN:
        return f"{state.bytes} of max_bytes {max_bytes}"
    return None


_STREAM_ROOM_MIN = 1024
"""Less room than this left in a ``discard: new`` stream is full: no batch record would fit."""
_GONE = "is gone (deleted, or a server that kept it in memory restarted)"
_STREAM_PAGES = 100
"""Pages of ``STREAM.LIST`` read at most (the server gives 256 streams a page): 25,600 streams."""


async def _all_streams(js: JetStreamContext) -> list[js_api.StreamInfo]:
    """Every JetStream stream of the account (``STREAM.LIST`` page by page: one page holds 256)."""
    out: list[js_api.StreamInfo] = []
    for _ in range(_STREAM_PAGES):
        page = await js.streams_info_iterator(offset=len(out))
        got = list(page)
        out += got
        if not got or len(out) >= getattr(page, "total", 0):  # (nats-py's StreamsListIterator has it)
            break
    return out


def _expect_subject_seq(seq: int | None) -> bytes:
    """The header block of a KV put written only over the subject's message ``seq`` (None: none)."""
    return _KV_PUT if seq is None else header_block({}, subject_seq=seq)


_KV_PUT = b""  # a plain PUB: no header block to store and parse back


def _by_stream(messages: Sequence[Message]) -> list[int]:
    """Indexes of ``messages`` with each bridge stream's together, streams in order of first
    appearance, each stream's in write order."""
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(messages):
        groups.setdefault(m.record.stream.key, []).append(i)
    return [i for group in groups.values() for i in group]


def _refused_for_turn(messages: Sequence[Message], errors: dict[int, ConnectorError], reclaimed: bool = False) -> list[int]:
    """The messages the chain refused only because one sent before them was not stored (and,
    when ``reclaimed``, by a subject fence whose subject was read again: ``subject_moved``), and
    that follow no transient failure of their own bridge stream: taken out of ``errors``, to be
    sent again, in turn. A stream that failed keeps the rest of its messages failed (fold()
    retries them in order), and so does one past the record of a message refused for itself (see
    bridge.connector); the other streams go on."""
    failed: set[str] = set()
    again: list[int] = []
    stops = Stops("")  # (only whether a message is past a refusal is asked)
    resend = ("out_of_turn", "subject_moved") if reclaimed else ("out_of_turn",)
    for i in sorted(errors):
        key = messages[i].record.stream.key
        error = errors[i]
        if key in failed:
            continue
        if isinstance(error, Permanent):
            stops.refused(messages[i])
            continue
        if error.reason in resend and stops.past(messages[i]) is None:
            again.append(i)
        else:
            failed.add(key)
    for i in again:
        del errors[i]
    return again


def _refusal(exc: BaseException) -> str | None:
    """``auth`` when ``exc`` is the server refusing the credentials (``-ERR 'Authorization
    Violation'``, an expired or revoked user), ``tls`` when it is a failed TLS handshake, else None."""
    if isinstance(exc, ssl.SSLError):
        return "tls"
    text = str(exc).lower()
    refused = ("authorization violation", "authentication expired", "authentication revoked")  # (not "timeout")
    if isinstance(exc, nats.errors.AuthorizationError) or any(r in text for r in refused):
        return "auth"
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return redact(text if text.startswith("nats:") else f"{type(exc).__name__}: {text}")


__all__ = [
    "MSG_ID_HEADER",
    "NatsConnector",
    "NatsOptions",
    "StateOptions",
    "StreamOptions",
    "TlsOptions",
    "header_block",
    "hpub",
    "state_prefix",
    "state_token",
    "subject_token",
    "sweep",
]
