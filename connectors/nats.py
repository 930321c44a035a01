"""NATS sink: JetStream (acknowledged, duplicate-safe) or core NATS (at most once).

Every message goes to a subject rendered from a template (default ``kv.{source}.{dp_rank}``) and
carries the stream header as NATS headers. A value put into a placeholder has ``.``, whitespace and
the wildcards replaced by ``_`` (``llama-3.1`` -> ``kv.llama-3_1.0``): one placeholder, one token.

``mode: jetstream``: each message carries ``Nats-Msg-Id`` = ``Message.msg_id``, so the server
stores a message sent again within the stream's duplicate window once. JetStream acknowledges each
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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.client import JetStreamContext

from bridge.connector import (
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
    SinkConfig,
    SinkPosition,
    Stream,
    Template,
    TlsOptions,
    doc,
    redact,
    redact_url,
    reveal,
)

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


def subject_filter(text: str) -> str:
    """The wildcard subject covering every subject the template renders (``kv.*.*``)."""
    return ".".join("*" if "{" in token else token for token in text.split("."))


class _Subjects:
    """The subject of a message: the template rendered with sanitised values (cached per stream
    and type, like :class:`Template` itself)."""

    def __init__(self, text: str) -> None:
        self.template = Template(text, "subject")
        self._cache: dict[tuple[str, int, str, int], str] = {}

    def render(self, message: Message) -> str:
        if self.template.static:
            return self.template.text
        stream = message.record.stream
        key = (stream.source, stream.dp_rank, message.type, message.record.epoch)
        subject = self._cache.get(key)
        if subject is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            clean = Stream(subject_token(stream.source), stream.dp_rank, {k: subject_token(v) for k, v in stream.labels.items()})
            probe = msgspec.structs.replace(
                message, record=Record(stream=clean, epoch=message.record.epoch, seq=0), type=subject_token(message.type)
            )
            subject = self._cache[key] = self.template.render(probe)
        return subject


# -- options ------------------------------------------------------------------------------------


class StreamOptions(ConnectorOptions):
    """The JetStream stream, created at connect when ``create`` is true and it does not exist."""

    create: Annotated[bool, doc("Create the stream at connect when it does not exist (an existing one is left as is).")] = False
    name: Annotated[str, doc("Stream name.")] = "KV_EVENTS"
    subjects: Annotated[
        list[str] | None, doc("Subjects the stream captures; default: the subject template with placeholders as '*'.")
    ] = None
    retention: Annotated[Literal["limits", "interest", "workqueue"], doc("JetStream retention policy.")] = "limits"
    storage: Annotated[Literal["file", "memory"], doc("JetStream storage.")] = "file"
    max_age: Annotated[Duration | None, doc("Messages older than this are removed (null: no limit).")] = None
    max_bytes: Annotated[ByteSize | None, doc("Oldest messages are removed past this size (null: no limit).")] = None
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5, description="Replicas in a JetStream cluster.")] = 1
    duplicate_window: Annotated[
        Duration,
        doc(
            "How long the server remembers Nats-Msg-Id values to drop re-sent messages. Cover the longest "
            "time from a first send to a re-send (write timeout and retries, a bridge restart); the server "
            "holds about rate x window ids in memory."
        ),
    ] = Duration(120.0)

    def __post_init__(self) -> None:
        if not self.name or re.search(r"[.*>\s/\\]", self.name):
            raise ValueError(f"stream.name {self.name!r} is not a valid JetStream stream name (no '.', '*', '>', '/', spaces)")
        if self.subjects is not None and not self.subjects:
            raise ValueError("stream.subjects: give at least one subject (or leave it out)")
        for subject in self.subjects or []:
            problem = subject_problem(subject, wildcards=True)
            if problem:
                raise ValueError(f"stream.subjects: {subject!r} is not a valid NATS subject: {problem}")


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

    def __post_init__(self) -> None:
        if not self.server_list or any(not s.strip() for s in self.server_list):
            raise ValueError("servers: give at least one non-empty server URL")
        for url in self.server_list:
            redact_url(url)  # a password in a URL is remembered: redact() masks it wherever text leaves
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

    @property
    def server_list(self) -> list[str]:
        return [self.servers] if isinstance(self.servers, str) else list(self.servers)


# -- the wire -----------------------------------------------------------------------------------

_NEWLINES = str.maketrans({"\r": " ", "\n": " "})


def header_block(headers: dict[str, str], msg_id: str | None = None, expected_last: str | None = None) -> bytes:
    """The encoded NATS header block of a message, exactly as it goes on the wire.

    Keys are the renderer's fixed names. A CR or LF in a value (an engine's event type is free
    text) becomes a space, as nats-py does: a value must never end the header line early.
    """
    lines = [f"{k}: {v}\r\n" for k, v in headers.items()]
    if msg_id is not None:
        lines.append(f"{MSG_ID_HEADER}: {msg_id}\r\n")
    if expected_last is not None:
        lines.append(f"{EXPECTED_LAST_HEADER}: {expected_last}\r\n")
    text = "".join(lines)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        pairs = [line[:-2].partition(": ") for line in lines]
        text = "".join(f"{k}: {v.translate(_NEWLINES).strip()}\r\n" for k, _, v in pairs)
    return b"NATS/1.0\r\n" + text.encode() + b"\r\n"


def hpub(subject: str, reply: str, hdr: bytes, payload: bytes) -> bytes:
    """One ``HPUB`` protocol command (``reply`` empty: none)."""
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
_WRONG_LAST_MSG_ID = 10070  # JSStreamWrongLastMsgIDErr: Nats-Expected-Last-Msg-Id did not match
EXPECTED_LAST_HEADER = "Nats-Expected-Last-Msg-Id"


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


# -- the connector ------------------------------------------------------------------------------


class NatsConnector:
    """Writes messages to NATS subjects, through JetStream or core NATS (see the module docstring)."""

    Options: ClassVar[type[NatsOptions]] = NatsOptions
    needs_events: ClassVar[bool] = False  # sends value and headers only: raw batches need no decoding

    def __init__(self, name: str, options: NatsOptions, sink: SinkConfig) -> None:
        self.name = name
        self.options = options
        self.sink = sink
        self._prefix = f"sinks[{name}]"
        self._where = ", ".join(redact_url(s) for s in options.server_list)
        self._subjects = _Subjects(options.subject)
        self._nc: Client | None = None
        self._last_error: str | None = None
        self._stream_problem: str | None = None
        self._ack_prefix = ""  # JetStream acks: one wildcard inbox subscription, a token per publish
        self._tokens = itertools.count()
        self._acks: dict[str, tuple[_Acks, int]] = {}  # reply token -> who waits for it, at which position
        self._position_stream: str | None = None  # the JetStream stream positions() reads, once found

    # -- connector hooks ------------------------------------------------------------------------
    async def connect(self) -> None:
        """Connect (within ``connect_timeout``), subscribe to acks, create or check the stream.

        Raises :class:`NotConnected` naming the sink and the servers when the server cannot be
        reached, authentication or TLS setup fails, or a requested stream cannot be created.
        """
        if self._nc is not None and not self._nc.is_closed:
            return
        nc = Client()
        self._last_error = None
        timeout = self.options.connect_timeout
        try:
            # nats-py retries the first connect forever with max_reconnect_attempts=-1.
            await asyncio.wait_for(nc.connect(**self._client_options()), timeout)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await self._close_client(nc)
            detail = self._last_error or _describe(exc)
            raise NotConnected(f"{self._prefix}: cannot connect to NATS at {self._where} within {timeout:g}s: {detail}") from None
        self._nc = nc
        try:
            if self.options.mode == "jetstream":
                self._ack_prefix = nc.new_inbox() + "."
                await nc.subscribe(self._ack_prefix + "*", cb=self._on_ack)
            js = nc.jetstream(timeout=timeout)
            if self.options.stream.create:
                await self._ensure_stream(js)
            if self.options.mode == "jetstream":
                await self._check_stream(js)
        except NotConnected:
            await self.close()
            raise
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await self.close()
            raise NotConnected(f"{self._prefix}: NATS at {self._where} failed during setup: {_describe(exc)}") from None
        log.info("%s: connected to NATS at %s (%s)", self._prefix, self._where, self.options.mode, extra={"sink": self.name})

    async def write(self, messages: Sequence[Message]) -> None:
        """JetStream: return once every message is acknowledged; core: once flushed."""
        nc = self._nc
        if not messages:
            return
        if nc is None or nc.is_closed:
            raise NotConnected(f"{self._prefix}: not connected to NATS at {self._where}")
        if not nc.is_connected:
            raise NotConnected(self._reconnecting())
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
        if nc is not None:
            await self._close_client(nc)

    async def health(self) -> str | None:
        """None when connected (and, in JetStream mode, a stream captures the subjects), else why not."""
        nc = self._nc
        if nc is None or nc.is_closed:
            return f"{self._prefix}: not connected to NATS at {self._where}"
        if not nc.is_connected:
            return self._reconnecting()
        return self._stream_problem

    async def positions(self, streams: Sequence[Stream]) -> dict[str, SinkPosition | None]:
        """The last message on each stream's subject (``checkpoint.from_sinks``, JetStream mode): the
        JetStream stream capturing the subjects is found once, then one ``STREAM.MSG.GET`` request
        (last by subject) per stream, up to 64 in flight. Core NATS keeps nothing, and a subject
        template with ``{type}`` or ``{epoch}`` spreads a stream over subjects: cannot tell."""
        nc = self._nc
        fields = self._subjects.template.fields
        if self.options.mode != "jetstream" or "type" in fields or "epoch" in fields:
            return {}
        if nc is None or nc.is_closed or not nc.is_connected:
            raise NotConnected(f"{self._prefix}: not connected to NATS at {self._where}")
        js = nc.jetstream(timeout=self.options.connect_timeout)
        name = self._position_stream
        if name is None:
            name = self._position_stream = await js.find_stream_name_by_subject(subject_filter(self.options.subject))
        window = asyncio.Semaphore(64)
        out: dict[str, SinkPosition | None] = {}

        async def last(stream: Stream) -> None:
            probe = Message(Record(stream=stream, epoch=0, seq=0), None, "EventBatch", b"", {}, "", (0, 1, 0))
            subject = self._subjects.render(probe)
            async with window:
                try:
                    msg = await js.get_last_msg(name, subject)
                except nats.js.errors.NotFoundError:
                    out[stream.key] = None
                    return
            headers = msg.headers or {}
            if headers.get("source") != stream.source or headers.get("dp_rank") != str(stream.dp_rank):
                return  # another publisher's message, or a subject shared with another stream: cannot tell
            try:
                out[stream.key] = SinkPosition.from_headers(headers, msg.data)
            except ValueError:
                return

        await asyncio.gather(*(last(s) for s in streams))
        return out

    # -- writes ---------------------------------------------------------------------------------
    async def _write_core(self, nc: Client, messages: Sequence[Message]) -> dict[int, ConnectorError]:
        errors: dict[int, ConnectorError] = {}
        for i, m in enumerate(messages):
            hdr = header_block(m.headers)
            if len(hdr) + len(m.value) > nc.max_payload:
                errors[i] = self._too_large(m, len(hdr), nc.max_payload)
                continue
            if not nc.is_connected:
                raise NotConnected(self._reconnecting())
            try:
                await internals.send_encoded(nc, hpub(self._subjects.render(m), "", hdr, m.value))
            except (nats.errors.Error, OSError) as exc:
                raise NotConnected(f"{self._prefix}: publish to NATS failed: {_describe(exc)}") from None
        internals.write_pending(nc)  # else flush()'s PING overtakes them (see write_pending)
        try:
            # nats-py wants a bound; the runtime's write timeout cancels this first.
            await nc.flush(timeout=self.sink.retry.write_timeout)  # type: ignore[arg-type]  # a float works
        except (nats.errors.Error, OSError) as exc:
            raise NotConnected(f"{self._prefix}: flush to NATS at {self._where} failed: {_describe(exc)}") from None
        return errors

    async def _write_jetstream(self, nc: Client, messages: Sequence[Message]) -> dict[int, ConnectorError]:
        errors: dict[int, ConnectorError] = {}
        await self._publish_chained(nc, messages, errors)
        again = _refused_for_turn(messages, errors)
        if again:
            streams: dict[str, list[int]] = {}
            for i in again:
                streams.setdefault(messages[i].record.stream.key, []).append(i)
            chains = [self._publish_in_turn(nc, messages, indexes, errors) for indexes in streams.values()]
            await (chains[0] if len(chains) == 1 else asyncio.gather(*chains))
        if not errors:
            self._stream_problem = None
        return errors

    async def _publish_chained(self, nc: Client, messages: Sequence[Message], errors: dict[int, ConnectorError]) -> None:
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
        order = _by_stream(messages)
        try:
            for n, i in enumerate(order):
                m = messages[i]
                subject = self._subjects.render(m)
                hdr = header_block(m.headers, m.msg_id, previous)
                if len(hdr) + len(m.value) > nc.max_payload:
                    errors[i] = self._too_large(m, len(hdr), nc.max_payload)
                    continue
                try:
                    await self._send(nc, subject, hdr, m.value, acks)
                except NotConnected as exc:
                    errors.update(dict.fromkeys(order[n:], exc))
                    break
                sent.append((i, subject))
                previous = m.msg_id
            await acks.wait()
        finally:
            self._forget(acks)
        for (i, subject), msg in zip(sent, acks.msgs, strict=True):
            error = self._ack_error(msg, messages[i], subject) if msg is not None else acks.error
            if error is not None:
                errors[i] = error

    async def _publish_in_turn(
        self, nc: Client, messages: Sequence[Message], indexes: list[int], errors: dict[int, ConnectorError]
    ) -> None:
        """Publish one stream's messages of a write, each after the previous one's ack; at the
        first transient failure, the rest of the stream stays unsent (failed at its indexes)."""
        for n, i in enumerate(indexes):
            m = messages[i]
            subject = self._subjects.render(m)
            hdr = header_block(m.headers, m.msg_id)
            if len(hdr) + len(m.value) > nc.max_payload:
                errors[i] = self._too_large(m, len(hdr), nc.max_payload)
                continue
            acks = _Acks()
            error: ConnectorError | None
            try:
                await self._send(nc, subject, hdr, m.value, acks)
                await acks.wait()
                error = self._ack_error(acks.msgs[0], m, subject) if acks.msgs[0] is not None else acks.error
            except NotConnected as exc:
                error = exc
            finally:
                self._forget(acks)
            if error is None:
                continue
            errors[i] = error
            if not isinstance(error, Permanent):
                errors.update(dict.fromkeys(indexes[n + 1 :], error))
                return

    async def _send(self, nc: Client, subject: str, hdr: bytes, payload: bytes, acks: _Acks) -> None:
        """Publish with a reply token whose ack goes to ``acks``."""
        if not nc.is_connected:  # never let nats-py buffer while reconnecting (internals.drop_pending)
            raise NotConnected(self._reconnecting())
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
        entry = self._acks.pop(msg.subject[len(self._ack_prefix) :], None)
        if entry is not None:  # else: its write was cancelled or failed
            entry[0].settle(entry[1], msg)

    def _fail_acks(self, error: ConnectorError) -> None:
        for acks, _ in list(self._acks.values()):
            acks.fail(error)

    def _ack_error(self, msg: Msg, m: Message, subject: str) -> ConnectorError | None:
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            self._stream_problem = (
                f"{self._prefix}: no JetStream stream captures subject {subject!r}: create a stream whose subjects "
                f"cover {subject_filter(self.options.subject)!r}, or set stream.create: true"
            )
            return Retriable(self._stream_problem, reason="no_stream")
        try:
            err = _ack_decoder.decode(msg.data).error
        except msgspec.DecodeError:
            return Retriable(f"{self._prefix}: unreadable JetStream ack {msg.data[:200]!r}", reason="bad_ack")
        if err is None:
            return None
        text = f"{self._prefix}: JetStream refused {m.msg_id} on {subject!r}: {err.description} (code {err.code}/{err.err_code})"
        if err.err_code in _REFUSED_FOR_ITSELF:
            return Permanent(text, reason="too_large")
        if err.err_code == _WRONG_LAST_MSG_ID:  # the message sent before it was not stored
            return Retriable(text, reason="out_of_turn")
        # Anything else is about the stream, which an operator or consumers can fix: a full
        # `discard: new` stream ("maximum bytes/messages exceeded"), a sealed stream, a leader
        # election, storage out of resources. Retried; the sink reports itself not ready.
        if err.code < 500:
            return Retriable(text, reason="rejected")
        return Retriable(text, reason="stream_full" if "maximum" in err.description.lower() else "jetstream_unavailable")

    def _too_large(self, m: Message, header_size: int, max_payload: int) -> Permanent:
        return Permanent(
            f"{self._prefix}: message {m.msg_id} is {header_size + len(m.value)} bytes with headers, over the "
            f"server's max_payload of {max_payload}",
            reason="too_large",
        )

    def _reconnecting(self) -> str:
        detail = f": {self._last_error}" if self._last_error else ""
        return f"{self._prefix}: reconnecting to NATS at {self._where}{detail}"

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
        self._last_error = _describe(exc)
        log.debug("%s: NATS error: %s", self._prefix, self._last_error, extra={"sink": self.name})

    async def _on_disconnected(self) -> None:
        nc = self._nc
        if nc is not None:
            internals.drop_pending(nc)
            log.warning("%s: disconnected from NATS at %s; reconnecting", self._prefix, self._where, extra={"sink": self.name})
        self._fail_acks(
            NotConnected(f"{self._prefix}: connection to NATS at {self._where} lost before the ack", reason="disconnected")
        )

    async def _on_reconnected(self) -> None:
        self._last_error = None
        log.info("%s: reconnected to NATS at %s", self._prefix, self._where, extra={"sink": self.name})

    async def _on_closed(self) -> None:
        self._fail_acks(NotConnected(f"{self._prefix}: NATS connection closed"))

    async def _close_client(self, nc: Client) -> None:
        try:
            await nc.close()  # flushes what is buffered first; the runtime bounds the call
        except Exception as exc:
            log.debug("%s: close failed: %s", self._prefix, _describe(exc), extra={"sink": self.name})

    # -- streams --------------------------------------------------------------------------------
    async def _ensure_stream(self, js: JetStreamContext) -> None:
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
            duplicate_window=so.duplicate_window,
        )
        try:
            await js.add_stream(config)
        except nats.js.errors.APIError as exc:
            if exc.err_code == _STREAM_NAME_EXISTS:  # another replica created it just now
                return
            raise NotConnected(f"{self._prefix}: cannot create JetStream stream {so.name!r}: {_describe(exc)}") from None
        log.info("%s: created JetStream stream %s for %s", self._prefix, so.name, config.subjects, extra={"sink": self.name})

    async def _check_stream(self, js: JetStreamContext) -> None:
        """Report (health, ``--check``) when no stream captures any subject of the template; do not
        fail: a stream may be created later, and a write names the problem too. The server matches
        streams whose subjects overlap the template's wildcard form (``kv.*.*``), so a stream
        capturing only some sources passes here, and a write to the others fails ``no_stream``."""
        wildcard = subject_filter(self.options.subject)
        try:
            await js.find_stream_name_by_subject(wildcard)
            self._stream_problem = None
            return
        except nats.js.errors.NotFoundError:
            problem = f"no JetStream stream captures subject {wildcard!r}: create one, or set stream.create: true"
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            problem = f"JetStream is not enabled on NATS at {self._where} (or mode: core was meant)"
        self._stream_problem = f"{self._prefix}: {problem}"
        log.warning("%s", self._stream_problem, extra={"sink": self.name})


def _by_stream(messages: Sequence[Message]) -> list[int]:
    """Indexes of ``messages`` with each bridge stream's together, streams in order of first
    appearance, each stream's in write order."""
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(messages):
        groups.setdefault(m.record.stream.key, []).append(i)
    return [i for group in groups.values() for i in group]


def _refused_for_turn(messages: Sequence[Message], errors: dict[int, ConnectorError]) -> list[int]:
    """The messages the chain refused only because one sent before them was not stored, and that
    follow no transient failure of their own bridge stream: taken out of ``errors``, to be sent
    again, in turn. A stream that failed keeps the rest of its messages failed (fold() retries
    them in order); the other streams go on."""
    failed: set[str] = set()
    again: list[int] = []
    for i in sorted(errors):
        key = messages[i].record.stream.key
        error = errors[i]
        if key in failed or isinstance(error, Permanent):
            continue
        if error.reason == "out_of_turn":
            again.append(i)
        else:
            failed.add(key)
    for i in again:
        del errors[i]
    return again


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return redact(text if text.startswith("nats:") else f"{type(exc).__name__}: {text}")


__all__ = [
    "MSG_ID_HEADER",
    "NatsConnector",
    "NatsOptions",
    "StreamOptions",
    "TlsOptions",
    "header_block",
    "hpub",
    "subject_token",
]
