"""NATS sink: JetStream (acknowledged, duplicate-safe) or core NATS (at-most-once).

Every message goes to a subject rendered from a template (default ``kv.{source}.{dp_rank}``) and
carries the stream header as NATS headers (``source``, ``dp_rank``, ``epoch``, ``seq``, ``index``,
``ts``, ``type``, ``content-type``).

``mode: jetstream`` (the default) publishes asynchronously, with at most ``max_pending`` messages
awaiting their acknowledgement at any time, and a write returns once the server has acked every
message of it. Each message carries ``Nats-Msg-Id`` = ``Message.msg_id``
(``source/dp_rank/epoch/seq[/index]``), so the server drops a message it has already stored within
the stream's duplicate window: a batch the bridge sends again after a timeout, a reconnect or a
bridge restart is stored once. Size that window to cover the longest time between a first send and
a re-send (write timeout plus retries, plus a bridge restart); the server keeps every id of the
window in memory, roughly ``rate x window`` ids.

``mode: core`` publishes every message of a write and then flushes once (a PING/PONG round trip)
with a timeout: the server has received the messages, but only subscribers connected at that
moment get them, and a write retried after a failure may repeat messages. At most once as far as
NATS goes; consumers deduplicate on (source, dp_rank, epoch, seq, index).

Subject tokens cannot contain ``.``, whitespace or the wildcards ``*`` and ``>``: every value put
into a placeholder (source name, rank, type, labels) has those characters replaced by ``_``
(``llama-3.1`` -> ``kv.llama-3_1.0``), so one placeholder is always exactly one token; the headers
keep the original values. The template text itself is checked when the config is loaded.

Ordering under failure: nats-py keeps publishes in a buffer until its flusher task writes them,
and after a reconnect it sends what was left there to the new server, behind messages that were
lost with the old socket. This connector publishes only while connected, drops that buffer when
the connection goes down and fails every unacknowledged message of the write, so the runtime
re-sends them in order (those already stored are dropped by their ``Nats-Msg-Id``). In a JetStream
cluster, a leader change can still fail one message while a later one is stored; consumers that
need strict order sort on (epoch, seq, index) within a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import random
import re
import ssl
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

from bridge.config import ByteSize, Duration, SinkConfig
from bridge.connector import Template, TlsOptions
from bridge.errors import ConfigError, ConnectorError, NotConnected, PartialFailure, Permanent, Retriable
from bridge.formats import Message
from bridge.records import Record, Stream

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


# -- subjects -----------------------------------------------------------------------------------

# Characters a subject token cannot hold: the token separator, whitespace (the protocol splits on
# it), the wildcards, and control characters.
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


def _template_problem(text: str) -> str | None:
    try:
        template = Template(text, "subject")
    except ConfigError as exc:
        return str(exc)
    sample = text
    for field in template.fields:
        sample = sample.replace("{" + field + "}", "x")
    problem = subject_problem(sample, wildcards=False)
    return f"{text!r} is not a valid NATS subject: {problem}" if problem else None


def subject_filter(text: str) -> str:
    """The wildcard subject covering every subject the template renders (``kv.*.*``)."""
    return ".".join("*" if "{" in token else token for token in text.split("."))


class _Subjects:
    """Renders the subject of a message through :class:`Template` with sanitised values.

    Cached per (stream, type, epoch), like the template itself, so a hit is one dict lookup.
    """

    def __init__(self, text: str, sink: str) -> None:
        self.template = Template(text, "subject")
        self.sink = sink
        self._cache: dict[tuple[str, int, str, int], str] = {}
        self._announced: set[str] = set()

    def render(self, message: Message) -> str:
        if self.template.static:
            return self.template.text
        stream = message.record.stream
        key = (stream.source, stream.dp_rank, message.type, message.record.epoch)
        subject = self._cache.get(key)
        if subject is None:
            subject = self._miss(message, key)
        return subject

    def _miss(self, message: Message, key: tuple[str, int, str, int]) -> str:
        if len(self._cache) > 100_000:
            self._cache.clear()
        stream = message.record.stream
        clean = Stream(
            subject_token(stream.source),
            stream.dp_rank,
            {k: subject_token(v) for k, v in stream.labels.items()},
        )
        if clean.source != stream.source and stream.source not in self._announced:
            self._announced.add(stream.source)
            log.info(
                "sink %s: source name %r is not a valid NATS subject token; %r used in subjects",
                self.sink,
                stream.source,
                clean.source,
                extra={"sink": self.sink},
            )
        probe = Message(
            record=Record(stream=clean, epoch=message.record.epoch, seq=0),
            index=None,
            type=subject_token(message.type),
            value=b"",
            headers={},
            msg_id="",
            position=(0, 0, 0),
        )
        subject = self.template.render(probe)
        self._cache[key] = subject
        return subject


# -- options ------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The JetStream stream, created at connect when ``create`` is true and it does not exist."""

    create: Annotated[bool, _doc("Create the stream at connect when it does not exist (an existing one is left as is).")] = False
    name: Annotated[str, _doc("Stream name.")] = "KV_EVENTS"
    subjects: Annotated[
        list[str] | None, _doc("Subjects the stream captures; default: the subject template with placeholders as '*'.")
    ] = None
    retention: Annotated[Literal["limits", "interest", "workqueue"], _doc("JetStream retention policy.")] = "limits"
    storage: Annotated[Literal["file", "memory"], _doc("JetStream storage.")] = "file"
    max_age: Annotated[Duration | None, _doc("Messages older than this are removed (null: no limit).")] = None
    max_bytes: Annotated[ByteSize | None, _doc("Oldest messages are removed past this size (null: no limit).")] = None
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5, description="Replicas in a JetStream cluster.")] = 1
    duplicate_window: Annotated[
        Duration,
        _doc(
            "How long the server remembers Nats-Msg-Id values to drop re-sent messages. Cover the longest "
            "time from a first send to a re-send (write timeout and retries, a bridge restart); the server "
            "holds about rate x window ids in memory."
        ),
    ] = Duration(120.0)

    def __post_init__(self) -> None:
        if not self.name or re.search(r"[.*>\s/\\]", self.name):
            raise ValueError(f"stream.name {self.name!r} is not a valid JetStream stream name (no '.', '*', '>', '/', spaces)")
        for subject in self.subjects or []:
            problem = subject_problem(subject, wildcards=True)
            if problem:
                raise ValueError(f"stream.subjects: {subject!r} is not a valid NATS subject: {problem}")
        if self.subjects is not None and not self.subjects:
            raise ValueError("stream.subjects: give at least one subject (or leave it out)")


_SECRETS = ("password", "token")


class NatsOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Keys of a ``type: nats`` sink."""

    servers: Annotated[
        str | list[str], _doc("NATS server URL(s): nats://host:4222, tls://host:4222 (several: tried in turn).")
    ] = "nats://127.0.0.1:4222"
    subject: Annotated[
        str,
        _doc(
            "Subject template: {source}, {dp_rank}, {type}, {epoch}, {labels.NAME}. Values have '.', spaces "
            "and wildcards replaced by '_'."
        ),
    ] = "kv.{source}.{dp_rank}"
    mode: Annotated[
        Literal["jetstream", "core"],
        _doc("jetstream: acknowledged, duplicate-safe via Nats-Msg-Id; core: at-most-once, flushed per write."),
    ] = "jetstream"
    credentials: Annotated[str | None, _doc("Path of a .creds file (user JWT and nkey seed).")] = None
    nkey_seed: Annotated[str | None, _doc("Path of a file holding a user nkey seed.")] = None
    user: Annotated[str | None, _doc("User name (with password).")] = None
    password: Annotated[str | None, _doc("Password; use ${VAR} to take it from the environment.")] = None
    token: Annotated[str | None, _doc("Auth token; use ${VAR} to take it from the environment.")] = None
    tls: Annotated[TlsOptions | None, _doc("TLS settings; tls:// server URLs use TLS even without them.")] = None
    connect_timeout: Annotated[Duration, _doc("Bound on connect() and on JetStream API calls.")] = Duration(5.0)
    ack_timeout: Annotated[Duration, _doc("How long a write waits for acknowledgements (JetStream) or the flush (core).")] = (
        Duration(5.0)
    )
    max_pending: Annotated[
        int, msgspec.Meta(ge=1, le=1_000_000, description="JetStream publishes awaiting their ack, at most.")
    ] = 4000
    reconnect_wait: Annotated[Duration, _doc("Pause between reconnect attempts to the same server.")] = Duration(1.0)
    reconnect_jitter: Annotated[
        Duration, _doc("Random extra pause (0..this) so that many bridges do not reconnect in lockstep.")
    ] = Duration(0.5)
    ping_interval: Annotated[Duration, _doc("Keep-alive PING interval; two missed PONGs count as a lost connection.")] = Duration(
        20.0
    )
    stream: Annotated[StreamOptions, _doc("JetStream stream to create when missing (see stream.create).")] = msgspec.field(
        default_factory=StreamOptions
    )

    def __post_init__(self) -> None:
        servers = self.server_list
        if not servers or any(not s.strip() for s in servers):
            raise ValueError("servers: give at least one non-empty server URL")
        problem = _template_problem(self.subject)
        if problem:
            raise ValueError(f"subject: {problem}")
        given = [k for k in ("credentials", "nkey_seed", "token", "user") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one way to authenticate, not {' and '.join(given)}")
        if (self.user is None) != (self.password is None):
            raise ValueError("user and password go together")

    @property
    def server_list(self) -> list[str]:
        return [self.servers] if isinstance(self.servers, str) else list(self.servers)

    def __repr__(self) -> str:
        # Secrets never reach logs or tracebacks through a repr.
        parts = []
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if field in _SECRETS and value is not None:
                value = "***"
            elif field == "servers":
                value = [redact(s) for s in self.server_list]
            parts.append(f"{field}={value!r}")
        return f"NatsOptions({', '.join(parts)})"

    __str__ = __repr__

    def __rich_repr__(self) -> Any:
        yield "redacted", repr(self)


_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^@/\s]*@")


def redact(text: str) -> str:
    """``text`` with the user:password part of any URL in it replaced by ``***``."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no detail"
    text = str(exc).strip()
    name = type(exc).__name__
    if not text:
        return name
    return redact(text if text.startswith("nats:") else f"{name}: {text}")


# -- acknowledgements ---------------------------------------------------------------------------


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

_TOO_LARGE = 10054  # JSStreamMessageExceedsMaximumErr: past the stream's max_msg_size


class _Write:
    """The state of one JetStream write: which messages are still unacknowledged, which failed."""

    __slots__ = ("done", "errors", "messages", "pending", "tokens")

    def __init__(self, messages: Sequence[Message]) -> None:
        self.messages = messages
        self.errors: dict[int, ConnectorError] = {}
        self.pending = 0
        self.done = asyncio.Event()
        self.tokens: list[str] = []

    def settle(self, index: int, error: ConnectorError | None) -> None:
        if error is not None:
            self.errors[index] = error
        self.pending -= 1
        if self.pending == 0:
            self.done.set()

    def fail_from(self, start: int, error: ConnectorError) -> None:
        """Mark every message from ``start`` on as not sent."""
        for i in range(start, len(self.messages)):
            self.errors.setdefault(i, error)


# NotConnected first: the runtime then waits for the connection before retrying anything.
_PRIORITY = {NotConnected: 0, Retriable: 1, Permanent: 2}


def _raise_for(errors: dict[int, ConnectorError], total: int) -> None:
    if not errors:
        return
    ordered = sorted(errors)
    cause = min((errors[i] for i in ordered), key=lambda e: _PRIORITY.get(type(e), 1))
    if len(ordered) == total:
        raise cause
    raise PartialFailure(ordered, cause)


_HAS_SERVER_HANDLER = "reconnect_to_server_handler" in inspect.signature(Client.connect).parameters


class NatsConnector:
    """Writes messages to NATS subjects, through JetStream or core NATS (see the module docstring)."""

    Options: ClassVar[type[NatsOptions]] = NatsOptions
    needs_events: ClassVar[bool] = False  # sends value and headers only: raw batches need no decoding

    def __init__(self, name: str, options: NatsOptions, sink: SinkConfig) -> None:
        self.name = name
        self.options = options
        self.sink = sink
        self._servers = options.server_list
        self._where = ", ".join(redact(s) for s in self._servers)
        self._subjects = _Subjects(options.subject, name)
        self._nc: Client | None = None
        self._last_error: str | None = None
        self._stream_problem: str | None = None
        # JetStream acks: one wildcard inbox subscription, a token per publish.
        self._ack_prefix = ""
        self._tokens = itertools.count()
        self._inflight: dict[str, tuple[_Write, int]] = {}
        self._outstanding = 0
        self._slot_freed = asyncio.Event()
        self._closing = False

    # -- connector hooks ------------------------------------------------------------------------
    async def connect(self) -> None:
        """Connect (within ``connect_timeout``), subscribe to acks and check or create the stream.

        Raises :class:`NotConnected` naming the sink and the servers when the server cannot be
        reached, authentication or TLS setup fails, or a requested stream cannot be created.
        """
        if self._nc is not None and not self._nc.is_closed:
            return
        self._closing = False
        opts = self._client_options()
        nc = Client()
        self._last_error = None
        timeout = self.options.connect_timeout
        try:
            await asyncio.wait_for(nc.connect(**opts), timeout)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await self._close_client(nc)
            detail = self._last_error or _describe(exc)
            raise NotConnected(
                f"sink {self.name}: cannot connect to NATS at {self._where} within {timeout:g}s: {detail}"
            ) from None
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
            raise NotConnected(f"sink {self.name}: NATS at {self._where} failed during setup: {_describe(exc)}") from None
        log.info("sink %s: connected to NATS at %s (%s)", self.name, self._where, self.options.mode, extra={"sink": self.name})

    async def write(self, messages: Sequence[Message]) -> None:
        """Publish ``messages`` in order; return once JetStream acked them all (core: flushed)."""
        if not messages:
            return
        nc = self._nc
        if nc is None or nc.is_closed:
            raise NotConnected(f"sink {self.name}: not connected to NATS at {self._where}")
        if not nc.is_connected:
            raise NotConnected(self._reconnecting_reason())
        if self.options.mode == "core":
            await self._write_core(nc, messages)
        else:
            await self._write_jetstream(nc, messages)

    async def close(self) -> None:
        """Flush what is buffered and close the connection (bounded; never raises)."""
        self._closing = True
        nc, self._nc = self._nc, None
        self._fail_inflight(NotConnected(f"sink {self.name}: closed"))
        if nc is not None:
            await self._close_client(nc)

    async def health(self) -> str | None:
        """None when connected (and, in JetStream mode, a stream was seen), else the reason."""
        nc = self._nc
        if nc is None or nc.is_closed:
            return f"not connected to NATS at {self._where}"
        if not nc.is_connected:
            return self._reconnecting_reason()
        return self._stream_problem

    # -- writes ---------------------------------------------------------------------------------
    async def _write_core(self, nc: Client, messages: Sequence[Message]) -> None:
        errors: dict[int, ConnectorError] = {}
        max_payload = nc.max_payload
        for i, m in enumerate(messages):
            subject = self._subjects.render(m)
            hdr = header_block(m.headers)
            if len(hdr) + len(m.value) > max_payload:
                errors[i] = self._too_large(m, max_payload)
                continue
            if not nc.is_connected:
                raise NotConnected(self._reconnecting_reason())
            try:
                await _publish(nc, subject, "", m.headers, hdr, m.value)
            except Exception as exc:
                error, whole = self._classify_publish(exc, subject)
                if whole:
                    raise error from None
                errors[i] = error
        # nats-py writes flush()'s PING straight to the socket, ahead of publishes still in its
        # buffer; one turn of the loop lets its flusher write them first, so the PONG covers them.
        await asyncio.sleep(0)
        try:
            await nc.flush(timeout=self.options.ack_timeout)  # type: ignore[arg-type]  # a float works
        except nats.errors.FlushTimeoutError:
            raise Retriable(
                f"sink {self.name}: NATS at {self._where} did not answer the flush within {self.options.ack_timeout:g}s",
                reason="flush_timeout",
            ) from None
        except (nats.errors.Error, OSError) as exc:
            raise NotConnected(f"sink {self.name}: flush to NATS failed: {_describe(exc)}") from None
        _raise_for(errors, len(messages))

    async def _write_jetstream(self, nc: Client, messages: Sequence[Message]) -> None:
        w = _Write(messages)
        max_payload = nc.max_payload
        prefix = self._ack_prefix
        timeout = self.options.ack_timeout
        try:
            for i, m in enumerate(messages):
                subject = self._subjects.render(m)
                hdr = header_block(m.headers, m.msg_id)
                if len(hdr) + len(m.value) > max_payload:
                    w.errors[i] = self._too_large(m, max_payload)
                    continue
                # Bounded pipelining: wait for acks (of any write) to free a slot.
                if self._outstanding >= self.options.max_pending and not await self._wait_for_slot():
                    w.fail_from(i, self._ack_timeout_error())
                    break
                if not nc.is_connected:
                    # Never let nats-py buffer while reconnecting: what it buffered would reach the
                    # new server after earlier messages lost with the old socket (out of order).
                    w.fail_from(i, NotConnected(self._reconnecting_reason()))
                    break
                token = str(next(self._tokens))
                self._inflight[token] = (w, i)
                self._outstanding += 1
                w.pending += 1
                w.tokens.append(token)
                try:
                    await _publish(nc, subject, prefix + token, m.headers, hdr, m.value, m.msg_id)
                except Exception as exc:
                    if self._inflight.pop(token, None) is not None:
                        self._release()
                        w.pending -= 1
                    error, whole = self._classify_publish(exc, subject)
                    if whole:
                        w.fail_from(i, error)
                        break
                    w.errors[i] = error
            if w.pending > 0:
                w.done.clear()
                # A timeout leaves the unacknowledged messages to the cleanup below.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await w.done.wait()
        finally:
            # Whatever is still unacknowledged (timeout, cancellation) stops holding a slot; a late
            # ack finds no token and is ignored.
            late: ConnectorError | None = None
            for token in w.tokens:
                entry = self._inflight.pop(token, None)
                if entry is not None:
                    self._release()
                    late = late or self._ack_timeout_error()
                    w.errors.setdefault(entry[1], late)
        if not w.errors:
            self._stream_problem = None
        _raise_for(w.errors, len(messages))

    async def _on_ack(self, msg: Msg) -> None:
        entry = self._inflight.pop(msg.subject[len(self._ack_prefix) :], None)
        if entry is None:  # timed out, failed on disconnect, or not ours
            return
        self._release()
        w, index = entry
        w.settle(index, self._ack_error(msg, w.messages[index]))

    def _ack_error(self, msg: Msg, message: Message) -> ConnectorError | None:
        headers = msg.headers
        if not msg.data and headers and headers.get("Status") == "503":
            subject = self._subjects.render(message)
            self._stream_problem = (
                f"no JetStream stream captures subject {subject!r}: create a stream covering "
                f"{subject_filter(self.options.subject)!r} or set stream.create: true"
            )
            return Retriable(f"sink {self.name}: {self._stream_problem}", reason="no_stream")
        try:
            ack = _ack_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return Retriable(f"sink {self.name}: unreadable JetStream ack {msg.data[:200]!r}", reason="bad_ack")
        err = ack.error
        if err is None:
            return None
        text = f"sink {self.name}: JetStream refused {message.msg_id}: {err.description} (code {err.code}/{err.err_code})"
        if err.err_code == _TOO_LARGE or "too large" in err.description.lower():
            return Permanent(text, reason="too_large")
        if err.code == 503:
            return Retriable(text, reason="jetstream_unavailable")
        if err.code == 400:
            return Permanent(text, reason="rejected")
        return Retriable(text, reason="jetstream_error")

    async def _wait_for_slot(self) -> bool:
        """Wait until fewer than ``max_pending`` publishes await an ack; False when no ack at all
        arrived within ``ack_timeout``."""
        while self._outstanding >= self.options.max_pending:
            self._slot_freed.clear()
            try:
                async with asyncio.timeout(self.options.ack_timeout):
                    await self._slot_freed.wait()
            except TimeoutError:
                return False
        return True

    def _release(self) -> None:
        self._outstanding -= 1
        self._slot_freed.set()

    def _fail_inflight(self, error: ConnectorError) -> None:
        inflight, self._inflight = self._inflight, {}
        for w, index in inflight.values():
            self._release()
            w.settle(index, error)

    def _classify_publish(self, exc: Exception, subject: str) -> tuple[ConnectorError, bool]:
        """The failure for one publish, and whether it applies to every later message too."""
        if isinstance(exc, nats.errors.MaxPayloadError):
            return Permanent(f"sink {self.name}: message larger than the server's max_payload", reason="too_large"), False
        if isinstance(exc, nats.errors.BadSubjectError | nats.errors.BadHeaderError):
            return Permanent(f"sink {self.name}: cannot publish to {subject!r}: {_describe(exc)}", reason="rejected"), False
        if isinstance(exc, nats.errors.ConnectionClosedError | nats.errors.OutboundBufferLimitError):
            return NotConnected(self._reconnecting_reason()), True
        if isinstance(exc, nats.errors.Error | OSError):
            return NotConnected(f"sink {self.name}: publish to NATS failed: {_describe(exc)}"), True
        return Retriable(f"sink {self.name}: publish to {subject!r} failed: {_describe(exc)}"), True

    def _too_large(self, m: Message, max_payload: int) -> Permanent:
        return Permanent(
            f"sink {self.name}: message {m.msg_id} is {len(m.value)} bytes with headers, over the server's "
            f"max_payload of {max_payload}",
            reason="too_large",
        )

    def _ack_timeout_error(self) -> Retriable:
        return Retriable(
            f"sink {self.name}: no JetStream ack within {self.options.ack_timeout:g}s from {self._where}",
            reason="ack_timeout",
        )

    def _reconnecting_reason(self) -> str:
        detail = f": {self._last_error}" if self._last_error else ""
        return f"sink {self.name}: reconnecting to NATS at {self._where}{detail}"

    # -- connection -----------------------------------------------------------------------------
    def _client_options(self) -> dict[str, Any]:
        o = self.options
        opts: dict[str, Any] = {
            "servers": self._servers,
            "name": f"kv-event-bridge/{self.name}",
            "connect_timeout": o.connect_timeout,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "ping_interval": o.ping_interval,
            "max_outstanding_pings": 2,
            "flush_timeout": o.ack_timeout,
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "closed_cb": self._on_closed,
        }
        if _HAS_SERVER_HANDLER:
            opts["reconnect_to_server_handler"] = self._next_server
            opts["reconnect_time_wait"] = o.reconnect_wait
        else:  # older nats-py: a fixed wait, jittered once per connector
            opts["reconnect_time_wait"] = o.reconnect_wait + random.uniform(0, o.reconnect_jitter)
        for key in ("credentials", "nkey_seed"):
            path = getattr(o, key)
            if path is not None and not Path(path).is_file():
                raise NotConnected(f"sink {self.name}: {key} file {path!r} does not exist", reason="auth")
        if o.credentials is not None:
            opts["user_credentials"] = o.credentials
        if o.nkey_seed is not None:
            opts["nkeys_seed"] = o.nkey_seed
        if o.user is not None:
            opts["user"], opts["password"] = o.user, o.password
        if o.token is not None:
            opts["token"] = o.token
        if o.tls is not None:
            opts["tls"] = self._tls_context(o.tls)
        return opts

    def _tls_context(self, tls: TlsOptions) -> ssl.SSLContext:
        try:
            return tls.ssl_context()
        except (OSError, ssl.SSLError) as exc:
            raise NotConnected(f"sink {self.name}: cannot load the TLS files: {_describe(exc)}", reason="tls") from None

    def _next_server(self, servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        """The server to reconnect to: the least-tried one, right away on its first attempt, else
        after ``reconnect_wait`` plus jitter (many bridges must not hammer a restarting server in
        lockstep)."""
        best = min(servers, key=lambda s: s.reconnects)
        if best.reconnects == 0:
            return best, 0.0
        return best, self.options.reconnect_wait + random.uniform(0, self.options.reconnect_jitter)

    async def _on_error(self, exc: Exception) -> None:
        self._last_error = _describe(exc)
        log.debug("sink %s: NATS error: %s", self.name, self._last_error, extra={"sink": self.name})

    async def _on_disconnected(self) -> None:
        nc = self._nc
        if nc is not None:
            # Drop what nats-py still buffers for the dead socket (see the module docstring): the
            # writes that own it fail below and are re-sent in order by the runtime.
            nc._pending = []
            nc._pending_data_size = 0
        self._fail_inflight(
            NotConnected(f"sink {self.name}: connection to NATS at {self._where} lost before the ack", reason="disconnected")
        )
        if nc is not None and not self._closing:  # not for a first connect that failed
            log.warning("sink %s: disconnected from NATS at %s; reconnecting", self.name, self._where, extra={"sink": self.name})

    async def _on_reconnected(self) -> None:
        self._last_error = None
        nc = self._nc
        url = nc.connected_url.geturl() if nc is not None and nc.connected_url is not None else self._where
        log.info("sink %s: reconnected to NATS at %s", self.name, redact(url), extra={"sink": self.name})

    async def _on_closed(self) -> None:
        self._fail_inflight(NotConnected(f"sink {self.name}: NATS connection closed"))

    async def _close_client(self, nc: Client) -> None:
        try:
            if nc.is_connected:
                await nc.flush(timeout=self.options.ack_timeout)  # type: ignore[arg-type]
        except Exception as exc:  # closing must not raise; a failed flush only loses buffered core messages
            log.debug("sink %s: flush on close failed: %s", self.name, _describe(exc), extra={"sink": self.name})
        try:
            await asyncio.wait_for(nc.close(), self.options.connect_timeout)
        except Exception as exc:
            log.debug("sink %s: close failed: %s", self.name, _describe(exc), extra={"sink": self.name})

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
            if exc.err_code == 10058:  # JSStreamNameExistErr: another replica created it just now
                return
            raise NotConnected(f"sink {self.name}: cannot create JetStream stream {so.name!r}: {_describe(exc)}") from None
        log.info(
            "sink %s: created JetStream stream %s for %s (duplicate window %gs)",
            self.name,
            so.name,
            config.subjects,
            so.duplicate_window,
            extra={"sink": self.name},
        )

    async def _check_stream(self, js: JetStreamContext) -> None:
        """Warn (and report in health) when no stream captures the subjects; do not fail: a
        stream may be created later, and writes name the problem too."""
        wildcard = subject_filter(self.options.subject)
        try:
            await js.find_stream_name_by_subject(wildcard)
            self._stream_problem = None
            return
        except nats.js.errors.NotFoundError:
            problem = f"no JetStream stream captures subject {wildcard!r}: create one or set stream.create: true"
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            problem = f"JetStream is not enabled on NATS at {self._where} (or mode: core was meant)"
        self._stream_problem = problem
        log.warning("sink %s: %s", self.name, problem, extra={"sink": self.name})


# -- the wire -----------------------------------------------------------------------------------

_NEWLINES = str.maketrans({"\r": " ", "\n": " "})


def header_block(headers: dict[str, str], msg_id: str | None = None) -> bytes:
    """The encoded NATS header block of a message, exactly as it goes on the wire.

    Keys are the renderer's fixed names. A CR or LF in a value (an engine's event type is free
    text) becomes a space, as nats-py does: a value must never end the header line early.
    """
    lines = [f"{k}: {v}\r\n" for k, v in headers.items()]
    if msg_id is not None:
        lines.append(f"{MSG_ID_HEADER}: {msg_id}\r\n")
    text = "".join(lines)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        items = [*headers.items(), *([(MSG_ID_HEADER, msg_id)] if msg_id is not None else [])]
        text = "".join(f"{k}: {v.translate(_NEWLINES).strip()}\r\n" for k, v in items)
    return b"NATS/1.0\r\n" + text.encode() + b"\r\n"


# nats-py's publish() re-validates and re-encodes every header of every message (most of the
# cost of a publish: ~3x slower per message). Headers here are encoded once, checked above, and
# the HPUB command handed to the client's own buffer-and-flusher path. Guarded: a client without
# these internals gets the public publish().
_RAW_PUBLISH = hasattr(Client, "_send_command") and hasattr(Client, "_flush_pending")


async def _publish(
    nc: Client, subject: str, reply: str, headers: dict[str, str], hdr: bytes, payload: bytes, msg_id: str | None = None
) -> None:
    """Publish with the pre-encoded header block ``hdr`` (``headers`` + ``msg_id``)."""
    if not _RAW_PUBLISH:
        if msg_id is not None:
            headers = {**headers, MSG_ID_HEADER: msg_id}
        await nc.publish(subject, payload, reply=reply, headers=headers)
        return
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    size = len(hdr)
    line = (
        f"HPUB {subject} {reply} {size} {size + len(payload)}\r\n"
        if reply
        else f"HPUB {subject} {size} {size + len(payload)}\r\n"
    )
    await nc._send_command(b"".join((line.encode(), hdr, payload, b"\r\n")))
    # What nats-py's publish does next: kick its flusher task unless a kick is already queued.
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


__all__ = [
    "MSG_ID_HEADER",
    "NatsConnector",
    "NatsOptions",
    "StreamOptions",
    "TlsOptions",
    "header_block",
    "redact",
    "subject_token",
]
