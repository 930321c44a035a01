"""The connector API: the whole surface a sink plugin needs, and the delivery contract it keeps.

A connector is small: its options, a pure message builder, one network call, and an error
classifier. Everything else (queues, batching, the write timeout, retries with backoff,
backpressure, ordering under partial failure, dead letters, acknowledgements, checkpoints,
metrics) lives once in the runtime (:mod:`bridge.sink`). Import what a plugin needs from here:

    from bridge.connector import ConnectorOptions, Message, Permanent, Retriable, Secret, doc

A connector class has:

- ``Options``: a :class:`ConnectorOptions` subclass (unknown keys are errors); describe each field
  with ``Annotated[T, doc("...")]`` (the docs reference tables and the chart schema show it); a password
  or token is a :class:`Secret` (``***`` in reprs, logs, metrics, ``--check``, dead letters);
- ``__init__(self, name, options, sink)``: no I/O;
- ``needs_events``: ``False`` when it reads nothing of a ``raw`` message but its value and headers
  (never ``Message.event`` or ``Record.events``): when every sink is ``raw`` and says so, the
  runtime only counts a batch's events instead of decoding them;
- ``async connect()``: reach the server; raise :class:`NotConnected` if it cannot;
- ``async write(messages)``: one network call that delivers every message; returning means every
  message is acknowledged as the sink defines it. Otherwise raise ``NotConnected`` / ``Retriable``
  (nothing known to be stored, or the whole write failed), ``Permanent`` (every message refused for
  itself), or ``PartialFailure({index: error})`` with each failed message's own classification.
  A message refused for itself stops its stream at its record's end: the stream's messages of
  later records in the write are not written (:class:`Stops`), so that the refusal's
  announcement, written next, stands right after the refused batch, where a replay after a
  restart puts it again (a copy). A connector that writes them anyway gets the announcement at
  the stream's highest seq in the write instead;
  A :class:`Message` builds its ``headers`` (a new dict on each read), ``msg_id`` and
  ``position`` from its record when read: read each once per message (``header_items()`` gives
  the headers as (name, UTF-8 bytes) pairs, encoded once per record);
- ``async close()``: flush and release; must not raise;
- ``async health()``: ``None`` when healthy, else a short reason (used by ``/readyz``, ``--check``).

Optional, for ``--check``, which must change nothing: ``async probe()``: ``None`` when the sink could
be used, else the reason, found without writing or creating anything. Without it ``--check`` calls
``connect()``, ``health()`` and ``close()``, after setting ``creates_nothing = True`` on a connector
that has that attribute: its ``connect()`` then checks what it would create (a topic, a stream, a
bucket) and creates none of it, a missing one it would create counting as fine when the server
says it could create it, as far as it can ask without creating it (Kafka: CreateTopics with
``validate_only``). A connector with a ``configured_streams`` attribute gets the configured
streams there first (``--check`` only; discovered ones are not known then), to check what it
needs for each (a NATS stream capturing each one's subject, a Redis user allowed on each one's keys).
A connector with a ``known_streams`` attribute gets them before its first ``connect()`` at a run
too (and under ``--check``): what its connect checks of each one (a Redis key's type) makes the
run's sink not ready as it makes ``--check`` fail.

Optional, for configs that would mix streams: ``destination(stream)``: where the sink writes
``stream``'s batches (a subject, a key) when every stream is meant to have one of its own, after
whatever the connector does to the names (None: streams share one by design). The config check
(start-up and ``--check``) refuses two configured streams with one destination; the connector
itself must refuse, at write, a stream found at run time whose destination another owns.

Optional: ``conflicts(streams)``: lines naming what the configured streams make impossible within
the sink (a Kafka events topic that is its state topic, two topics Kafka takes for one), refused
by the config check like a shared destination; the connector refuses such a stream found at run
time (``StreamRefused``).

Optional, for I6 across a restart: ``acknowledged_before(stream, epoch, seq)``: before the
stream starts, what every sink acknowledged of it in earlier runs (the checkpoint's position). A
connector that finds its losses by what this process stored (NATS: the spans its events stream
acknowledged) counts it as stored, so that a loss found before this process stores anything of
the stream is announced too.

Optional, for I6 across a restart, for a connector that can tell exactly what it stored:
``stored_through(stream)``, a mark of the last message of ``stream`` it stored (or was told of by
``stored_before``): a tuple of integers that only it reads and that grows along the stream (Redis:
the position of the stream key's last entry; Kafka: the stream's last epoch and seq in its
partition and the partition's end offset then), None when it cannot tell. The runtime saves it in
the checkpoint (``stored``). At the next start, for a sink without state (a state sink's is read
back) and, with ``checkpoint.from_sinks``, only one whose ``positions`` said it holds nothing of
the stream (else the stream resumes by what it holds), the runtime calls
``stored_before(stream, mark, resume)`` before the stream starts: the connector checks at its next
write (and audit) that the sink still holds what the mark says, and raises SinkLost for what it
lost meanwhile (a key or topic deleted, a restart from an older snapshot while no bridge ran), but
only up to ``resume`` (epoch, seq), where the stream resumes: what follows is sent again (or
announced to every sink as a gap). ``resume`` None: the stream starts afresh, nothing of it comes
again. A mark it does not read (another connector's) is ignored.

Optional, for configs whose sinks would mix their messages: ``places(streams)``: where on its
servers the sink writes, as ``(servers, place)`` pairs: ``servers`` a set of ``host:port`` (from
:func:`server_address`), ``place`` a name on them (``"topic 'kv-events'"``, ``"key '...'"``): each
template as written (streams found at run time) and as rendered for each of ``streams``, the
configured ones (:func:`rendered`). The config check refuses two sinks with a place in common on a
common server: their messages would mix in one destination, and share its ids and duplicate
windows (one sink's stored as the other's copies).

Optional, for ``checkpoint.from_sinks`` (a pod taking over streams it has no checkpoint for):

- ``async positions(streams)``: what the sink holds of each stream, read from the sink itself:
  ``{stream.key: SinkPosition}`` for the last message of the stream it holds (its header gives
  epoch, seq, type, index and ts; :meth:`SinkPosition.from_headers` reads it, given the engine's
  bytes for a ``raw`` batch), ``{stream.key: None}`` when it holds nothing of it, and no entry
  when it cannot tell (a name template with ``{type}`` or ``{epoch}``, a read past its scan limit,
  messages deleted outside the bridge that may have been the stream's: "holds nothing" only when
  the sink never held any). A stream that then starts afresh announces its new epoch with a
  ``SourceReset`` (it may hold an earlier epoch's records).
  Called after ``connect()`` succeeded, possibly while writes run; read-only; bounded by
  ``checkpoint.from_sinks_timeout`` (the runtime cancels it); raise on failure (every stream of
  the call then counts as unknown). The runtime resumes each stream from the lowest position any
  sink needs and drops, per sink, the messages at or below what that sink holds
  (:func:`bridge.checkpoint.combine`), so the sink sees no duplicate even if it cannot drop one.

Optional, for a sink that keeps the copies a replay writes (Kafka): ``async
positions_before_run(streams)``, what ``positions`` answers with this process's copies left out
(the later of the last message and the last one below this process's first: see
``held_before_run``): asked before a
``drop`` sink announces a dropped span (``positions`` otherwise), which is announced only from
the first batch the sink lacks.

Optional, for I6 on a quiet stream (a write checks what the sink holds before it builds on it, but
a stream with no write would keep a loss unannounced): ``async audit()``: check that the sink
still holds what this connector stored and acknowledged, and raise :class:`bridge.errors.SinkLost`
naming what it lost (spans of seqs, and ``states``: streams whose state it lost), after resetting
what it expects, as ``write`` does. Called by the runtime between writes, at most every
``AUDIT_INTERVAL`` (:mod:`bridge.sink`), bounded by ``retry.write_timeout``; read-only except
that a state it finds lost may be emptied (never left partial and marked complete); any other
exception is logged and ignored (the next write checks again).

Optional, for the live-block state (``state:`` in a sink's options; docs/output/state.md):

- ``writes_state``: ``True`` when the sink keeps state. The runtime then keeps a
  :class:`bridge.state.StateTracker`, decodes every batch, and follows each record's messages in a
  write with one message of type :data:`STATE_TYPE` (no value; ``message.record.state`` is the
  record's :class:`StateDelta`; ``delta.stale``: nothing to write). The connector writes it after
  the record's messages and only once they are stored (Redis: in the same script call, an exact
  cut), with the documents of :mod:`bridge.state_docs`; a failed state write is transient (never
  ``Permanent``: the state is not dead-lettered), reported at the state message's index;
- ``async read_state(streams)``: the state the sink holds of each stream, for a restarted bridge:
  ``{stream.key: (Head, [SeedEntry, ...])}`` (``bridge.state_docs.head_of`` and ``seed_entry``
  read the documents), ``{stream.key: None}`` when it holds none, no entry when it cannot tell.
  Called after ``connect()``, before the streams start, bounded by ``state.load_timeout``. The
  runtime also asks ``positions()`` (if the connector has it) what records each stream still
  holds, and announces what it acknowledged and no longer holds (I6); a batch held in part
  (event granularity) counts as lost, unless the class sets ``whole_batches = True`` (a write
  stores, and a loss removes, a batch's messages all or none: Redis's one script call). A
  stream of which ``positions()`` finds nothing, beside a state that is not behind, counts as
  lost only if the connector knows its own limits did not remove it: the class sets
  ``nothing_held_is_known = True`` (Kafka: "nothing" only of a partition that starts at offset 0,
  or a topic gone), or ``read_state`` or ``positions`` adds its key to the set ``records_gone``
  (NATS: the events stream found created again, or gone; Redis: the stream key found empty).

The delivery contract (design.md, "Delivery"), kept by the runtime and this API together:

- Per stream (``message.record.stream``), each sink receives messages in order. A message that
  failed transiently is written again before any later message of its stream: the runtime
  (:func:`bridge.sink.fold`) rewrites the stream from its first transient failure on, including
  later messages the sink already took (its idempotence drops the copies: Kafka consumers by the
  headers, JetStream by ``Nats-Msg-Id``, Redis by the explicit entry id). A connector's part: a
  write never lets the sink store a message of a stream after an earlier message of the same
  stream in that write failed (send a stream's messages in one request, or each part only after
  the previous one was acknowledged).
- A message is dead-lettered only when it was refused for itself (too large, malformed for the
  broker, permanently rejected): classify it ``Permanent`` at its index. Something an operator can
  fix (authorization, a full stream, out of memory) is transient: retried, the sink not ready.
  An announcement refused for itself is kept and retried, holding the sink back, unless the
  refusal is ``StreamRefused``: the sink refuses the whole stream for as long as it runs (its
  health says why), so the stream's announcements are dead-lettered too and the other streams go on.
- A write is bounded by ``retry.write_timeout``, owned by the runtime (the write is cancelled);
  a connector adds no timeouts, locks or concurrency windows of its own around it (a client's
  socket timeouts are its own business). Writes of one sink never overlap.

Connectors are registered under the ``kv_bridge.connectors`` entry-point group
(``kafka = "connectors.kafka:KafkaConnector"``), so a third party adds a sink with a package.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import hashlib
import importlib.metadata
import os
import re
import ssl
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Protocol, runtime_checkable

import msgspec

from .checkpoint import SinkPosition
from .config import ByteSize, Duration, SinkConfig, convert_options, doc
from .config import Struct as ConnectorOptions
from .errors import (
    EPOCHS_REMEMBERED,
    ConfigError,
    ConnectorError,
    NotConnected,
    PartialFailure,
    Permanent,
    Retriable,
    SinkLost,
    StreamRefused,
)
from .formats import STATE_TYPE, Envelope, Message, Renderer, hex64, message_types, sample_message
from .records import Event, Record, Stream, events_lost
from .secret import Secret, redact, redact_url, reveal
from .state import Head, SeedEntry, StateDelta

ENTRY_POINT_GROUP = "kv_bridge.connectors"


@runtime_checkable
class Connector(Protocol):
    """One sink's client. See the module docstring for the contract of each hook."""

    name: str
    needs_events: bool

    async def connect(self) -> None: ...

    async def write(self, messages: Sequence[Message]) -> None: ...

    async def close(self) -> None: ...

    async def health(self) -> str | None: ...


@runtime_checkable
class StateReader(Protocol):
    """A connector that keeps state and can read it back (see ``read_state`` above)."""

    async def read_state(self, streams: Sequence[Stream]) -> Mapping[str, tuple[Head, list[SeedEntry]] | None]: ...


@runtime_checkable
class PositionReader(Protocol):
    """A connector that can say what it holds of each stream (see ``positions`` above)."""

    async def positions(self, streams: Sequence[Stream]) -> dict[str, SinkPosition | None]: ...


class ConnectorFactory(Protocol):
    """A connector class: its Options struct and a constructor that does no I/O."""

    Options: ClassVar[type[msgspec.Struct]]

    def __call__(self, name: str, options: Any, sink: SinkConfig) -> Connector: ...


class Registry:
    """Connector types by name: entry points loaded lazily, plus any given directly (tests)."""

    def __init__(self, factories: Mapping[str, ConnectorFactory] | None = None, *, entry_points: bool = True) -> None:
        self._loaded: dict[str, ConnectorFactory] = dict(factories or {})
        self._entry_points: dict[str, importlib.metadata.EntryPoint] = {}
        if entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name in self._entry_points and self._entry_points[ep.name].value != ep.value:
                    raise ConfigError(
                        [
                            f"connector type {ep.name!r} is registered twice ({self._entry_points[ep.name].value} "
                            f"and {ep.value}): uninstall one of the packages"
                        ]
                    )
                self._entry_points[ep.name] = ep

    def names(self) -> list[str]:
        return sorted(set(self._loaded) | set(self._entry_points))

    def get(self, type_name: str, path: str = "type") -> ConnectorFactory:
        """The connector class for ``type_name``; ConfigError naming ``path`` when unknown."""
        if type_name in self._loaded:
            return self._loaded[type_name]
        ep = self._entry_points.get(type_name)
        if ep is None:
            raise ConfigError([f"{path}: unknown sink type {type_name!r}; known: {', '.join(self.names())}"])
        try:
            factory = ep.load()
        except Exception as exc:  # a broken plugin must not take the bridge down with a traceback
            raise ConfigError([f"{path}: cannot load connector {type_name!r} from {ep.value}: {exc}"]) from exc
        if not isinstance(getattr(factory, "Options", None), type):
            raise ConfigError([f"{path}: connector {type_name!r} ({ep.value}) has no Options struct"])
        self._loaded[type_name] = factory
        return factory  # type: ignore[no-any-return]

    def build(self, sink: SinkConfig, index: int, labels: Collection[str] | None = None) -> Connector:
        """Validate ``sink.options`` with the connector's Options, check that the local files
        they name (TLS, credentials) can be read and parsed, and construct it (no network I/O).

        ``labels``: every label a source can have (``Config.label_names()``); given, a name template
        with a placeholder that is neither fixed nor one of them (``{sorce}``) is refused."""
        path = f"sinks[{index}]"
        factory = self.get(sink.type, f"{path}.type")
        with template_labels(labels):
            options = convert_options(sink.options, factory.Options, path)
            files = local_file_problems(options, path)
            if files:  # (refused here, not at connect: no server would have been asked)
                raise ConfigError(files)
            connector = factory(sink.name, options, sink)
        if getattr(connector, "writes_state", False):
            check_state_sink(sink, path)
        return connector


@contextlib.contextmanager
def template_labels(labels: Collection[str] | None) -> Iterator[None]:
    """While inside, a :class:`Template` refuses a placeholder that is neither fixed nor one of
    ``labels`` (None: any label is accepted, as a program building connectors by hand expects)."""
    token = _LABELS.set(frozenset(labels) if labels is not None else None)
    try:
        yield
    finally:
        _LABELS.reset(token)


def unwritable(path: str, replaced: bool = False) -> str | None:
    """Why a file at ``path`` could not be appended to, or created with its missing directories;
    None when it could. ``replaced``: the file is saved by writing a new one beside it and renaming
    it over (the checkpoint), so its directory must take new files too. Looks without creating
    anything (``--check`` writes nothing)."""
    p = Path(path)
    if p.is_dir():
        return f"{path} is a directory; give a file path"
    if p.exists():
        if not os.access(p, os.W_OK):
            return f"{path} is not writable by uid {os.getuid()}; fix its permissions"
        if replaced and not os.access(p.parent, os.W_OK | os.X_OK):
            return (
                f"{path} is saved by writing a new file in {p.parent} and renaming it over, and that directory "
                f"is not writable by uid {os.getuid()}; fix the directory's permissions"
            )
        return None
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create {path}: {parent} is not a directory; give a path in a writable directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: {parent} is not writable by uid {os.getuid()}; give a writable path or fix the permissions"
    return None


def file_id(path: str) -> tuple[int, int] | None:
    """The identity (device, inode) of the file at ``path`` now (None: there is none): a file
    opened once and written on compares it with its own to see it removed or rotated under it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


STATE_FIELDS = ("block_hashes", "medium", "group_idx")
"""Event fields a consumer of the state needs in the messages it follows (``type`` is always written)."""

_STATE_FIELDS_OF = {"BlockStored": STATE_FIELDS, "BlockRemoved": STATE_FIELDS, "AllBlocksCleared": ("medium",)}
"""Those of each event type's messages: a clear naming a medium clears that tier alone (ROCm ATOM),
one without clears everything."""


def check_state_sink(sink: SinkConfig, path: str) -> None:
    """What a sink that keeps state needs of the sink's own keys: ConfigError naming each problem."""
    problems: list[str] = []
    if sink.backpressure == "drop":
        problems.append(
            f"{path}.state.enabled: needs backpressure: block (a dropped batch would leave the state wrong); "
            "set backpressure: block or turn state off"
        )
    fields = sink.fields
    if fields is not None:
        rules = [("fields", fields, STATE_FIELDS)] + [
            (f"fields.by_type.{t}", r, _STATE_FIELDS_OF[t]) for t, r in fields.by_type.items() if t in _STATE_FIELDS_OF
        ]
        for where, rule, needed in rules:
            gone = [f for f in needed if (rule.keep is not None and f not in rule.keep) or f in (rule.drop or ())]
            if gone and (rule.keep is not None or rule.drop is not None):
                problems.append(
                    f"{path}.{where}: state.enabled needs {', '.join(gone)} in the messages (a consumer follows them "
                    "from the state's head); keep them, or turn state off"
                )
    if problems:
        raise ConfigError(problems)


# -- TLS ---------------------------------------------------------------------------------------


class TlsOptions(ConnectorOptions):
    """TLS towards the sink's server: the CAs to trust, an optional client certificate, the hostname check.

    One struct for the ``tls`` key of every connector that speaks TLS, so the keys, defaults and
    checks are the same everywhere. The server's certificate is always verified. Empty strings
    (an unset ``${VAR:-}``) count as absent.
    """

    ca_file: Annotated[
        str | None, msgspec.Meta(description="CA bundle (PEM) that signs the server's certificate; default: the system CAs.")
    ] = None
    cert_file: Annotated[
        str | None, msgspec.Meta(description="Client certificate (PEM, may hold its chain and key) for mutual TLS.")
    ] = None
    key_file: Annotated[
        str | None, msgspec.Meta(description="Private key (PEM) of cert_file; omit when cert_file holds it. Needs cert_file.")
    ] = None
    check_hostname: Annotated[
        bool, msgspec.Meta(description="Check that the server's certificate names the host connected to.")
    ] = True

    def __post_init__(self) -> None:
        # Checked here, not by each connector, so all reject it alike; msgspec reports it at the
        # block's path ("sinks[0].tls: tls.key_file needs tls.cert_file").
        if self.key_file and not self.cert_file:
            raise ValueError("tls.key_file needs tls.cert_file")

    def ssl_context(self) -> ssl.SSLContext:
        """A client context: trusts ``ca_file`` (else the system CAs), presents ``cert_file`` /
        ``key_file`` when given, checks the hostname as configured, and always verifies the server's
        certificate. Reads the files: raises ``OSError`` (``ssl.SSLError``) when one is missing or
        unusable."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file or None)
        context.check_hostname = self.check_hostname
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def file_problems(self, path: str) -> list[str]:
        """Why the files named here could not make the context (``path``: this block's config
        path), one line per file naming its key; [] when :meth:`ssl_context` would load them.
        Read at validation, so ``--check --offline`` and a run's start refuse a missing or
        unusable file as a config problem, before any server is contacted."""
        given = [(k, f) for k in ("ca_file", "cert_file", "key_file") if (f := getattr(self, k))]
        problems = [
            f"{path}.{key}: {file}: {problem} (give the path of a PEM file the bridge can read)"
            for key, file in given
            if (problem := unreadable(file)) is not None
        ]
        if problems:
            return problems
        if self.ca_file:
            try:
                ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
            except (ssl.SSLError, ValueError) as exc:
                problems.append(
                    f"{path}.ca_file: {self.ca_file}: holds no PEM certificate ({_ssl_reason(exc)}); give the PEM "
                    "bundle of the CA that signs the server's certificate"
                )
        if self.cert_file:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            try:  # (a passphrase callback: an encrypted key fails here rather than prompting on a terminal)
                context.load_cert_chain(self.cert_file, self.key_file or None, password=_no_passphrase)
            except (ssl.SSLError, ValueError) as exc:
                if self.key_file and _holds_certificate(self.cert_file):
                    problems.append(
                        f"{path}.key_file: {self.key_file}: not the unencrypted PEM private key of tls.cert_file "
                        f"({_ssl_reason(exc)}); give the key that belongs to {self.cert_file}"
                    )
                else:
                    problems.append(
                        f"{path}.cert_file: {self.cert_file}: holds no PEM client certificate"
                        f"{'' if self.key_file else ' and its unencrypted private key'} ({_ssl_reason(exc)}); "
                        f"give the client certificate{'' if self.key_file else ' (with its key, or set tls.key_file)'}"
                    )
        return problems


def unreadable(path: str) -> str | None:
    """Why the file at ``path`` cannot be read by this process (said after the path), or None."""
    p = Path(path)
    try:
        if p.is_dir():
            return "is a directory"
        if not p.exists():
            return "no such file"
        if not p.is_file():  # (a FIFO would block the open, and a device holds no PEM)
            return "is not a regular file"
        with p.open("rb"):
            return None
    except OSError as exc:
        return f"cannot be read by uid {os.getuid()} ({exc.strerror or exc})"


def local_file_problems(options: Any, path: str) -> list[str]:
    """The local files a connector's options name (its ``tls`` blocks, and what its own
    ``file_problems(path)`` checks, such as a credentials file) that it could not use, one line
    each with its key path; [] when every one can be read and parsed."""
    own: Callable[[str], list[str]] | None = getattr(options, "file_problems", None)
    problems = list(own(path)) if own is not None else []
    for name in getattr(options, "__struct_fields__", ()):
        value = getattr(options, name)
        if isinstance(value, TlsOptions):
            problems.extend(value.file_problems(f"{path}.{name}"))
    return problems


def _no_passphrase() -> bytes:
    raise ValueError("the key is encrypted; the bridge takes no passphrase: give an unencrypted key")


def _holds_certificate(path: str) -> bool:
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, OSError, ValueError):
        return False
    return True


def _ssl_reason(exc: Exception) -> str:
    """An ssl error's reason without its errno noise (``[SSL] PEM lib (_ssl.c:3900)``: ``PEM lib``)."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).replace("_", " ").lower()
    return str(exc) or type(exc).__name__


# -- name templates ---------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_FIXED = ("source", "dp_rank", "type", "epoch")
_LABELS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("template_labels", default=None)
"""The labels templates built now may name (set by :meth:`Registry.build`); None: any."""


class Template:
    """A destination name template such as ``kv.{source}.{dp_rank}`` or ``{labels.model}-events``.

    Placeholders: ``{source}``, ``{dp_rank}``, ``{type}`` (event type, ``EventBatch`` at batch
    granularity, or the control record's type), ``{epoch}``, and labels as ``{labels.NAME}`` or
    plain ``{NAME}``. A label the source lacks renders as ``unknown``. Rendered names are cached
    per (stream, type), so rendering costs one dict lookup per message.

    ``clean``, when given, makes each value a valid part of a name before it is inserted (a
    destination's rules: a Kafka topic's characters); a name longer than ``max_length`` is cut,
    ending in a hash of the whole name (names that differ stay apart).
    """

    def __init__(
        self, text: str, path: str = "template", *, clean: Callable[[str], str] | None = None, max_length: int | None = None
    ) -> None:
        self.text = text
        self._clean = clean
        self._max_length = max_length
        self.fields = _PLACEHOLDER.findall(text)
        for f in self.fields:
            if not f or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", f):
                raise ConfigError([f"{path}: bad placeholder {{{f}}} in {text!r}"])
        labels = _LABELS.get()
        unknown = [f for f in self.fields if labels is not None and f not in _FIXED and f.removeprefix("labels.") not in labels]
        if unknown:
            known = [f"{{{f}}}" for f in _FIXED] + [f"{{labels.{name}}}" for name in sorted(labels or ())]
            near = difflib.get_close_matches(unknown[0], [*_FIXED, *sorted(labels or ())], n=1)
            hint = f"did you mean {{{near[0]}}}? " if near else ""
            raise ConfigError(
                [
                    f"{path}: unknown placeholder {{{unknown[0]}}} in {text!r}: no source has such a label, so it would "
                    f"render as 'unknown'; {hint}known: {', '.join(known)}"
                ]
            )
        self.static = not self.fields
        self._cache: dict[tuple[str, int, str, int], str] = {}

    def render(self, message: Message) -> str:
        if self.static:
            return self.text
        stream = message.record.stream
        key = (stream.source, stream.dp_rank, message.type, message.record.epoch)
        name = self._cache.get(key)
        if name is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            values = {
                "source": stream.source,
                "dp_rank": str(stream.dp_rank),
                "type": message.type,
                "epoch": str(message.record.epoch),
            }

            def sub(m: re.Match[str]) -> str:
                f = m.group(1)
                if f in values:
                    value = values[f]
                else:
                    label = f[len("labels.") :] if f.startswith("labels.") else f
                    value = stream.labels.get(label, "unknown")
                return value if self._clean is None else self._clean(value)

            name = _PLACEHOLDER.sub(sub, self.text)
            limit = self._max_length
            if limit is not None and len(name) > limit:
                digest = hashlib.sha256(name.encode()).hexdigest()[:12]
                name = f"{name[: limit - len(digest) - 1]}-{digest}"
            self._cache[key] = name
        return name


_EPOCH_MARK = 987654321987654321
"""An epoch no engine has (the clock in µs, some 30,000 years on), rendered into a name and then
written back as ``{epoch}``."""


def smallest_record(sink: SinkConfig, streams: Iterable[Stream]) -> int:
    """Bytes (body and header fields) of the announcement of a refusal, an ``EventsLost`` in
    ``sink``'s format, of the stream with the longest key among ``streams``, at an epoch and seqs
    of full width: a destination that takes no message that large refuses every record of the
    stream, the announcements of those refusals included, for ever (0 without a stream)."""
    longest = max(streams, key=lambda s: len(s.key), default=None)
    if longest is None:
        return 0
    lost = events_lost(longest, 2**53 - 1, 2**63 - 1, 2**63 - 1, f"sink_refused:{sink.name}", 1e10)
    return max(len(m.value) + sum(len(k) + len(v) for k, v in m.headers.items()) for m in Renderer(sink.format).render(lost))


def rendered(render: Callable[[Message], str], template: Template, streams: Sequence[Stream], types: Sequence[str]) -> list[str]:
    """A name template's text and the names it renders (``render``) for each of ``streams`` and
    message ``types`` (only the first when it has no ``{type}``: the others render alike; see
    ``places``). ``{epoch}`` stays ``{epoch}`` in them (an epoch is known only once its engine
    starts): two templates that write one name in every epoch render one name, while no fixed
    name (none holds ``{epoch}``) is taken for one an epoch renders."""
    types = types if "type" in template.fields else types[:1]
    if "epoch" in template.fields:
        mark = str(_EPOCH_MARK)
        names = {render(sample_message(s, t, epoch=_EPOCH_MARK)).replace(mark, "{epoch}") for s in streams for t in types}
    else:
        names = {render(sample_message(stream, t)) for stream in streams for t in types}
    return [template.text, *sorted(names - {template.text})]


def resent_spans(
    stream: Stream, ends: Iterable[tuple[int, int]], resume: tuple[int, int] | None
) -> list[tuple[Stream, int, int, int]]:
    """What a sink lost of ``stream`` that an earlier run's checkpoint told it of (``stored_before``),
    for a connector that cannot tell where its copy started (each epoch from seq 0): ``ends`` the
    last seq of each epoch it held, ``resume`` where the stream resumes (epoch, seq; None: afresh).
    The seqs after ``resume`` in its epoch come again, written after the announcement; an epoch
    later than the resume epoch (the sink was ahead of another, across an engine restart) would be
    announced before the resumed epoch's records, and is left out (docs: Limits), the resume
    epoch then lost up to ``resume`` (the sink held it to its end)."""
    spans: dict[int, int] = {}
    for epoch, seq in ends:
        if resume is not None and (epoch, seq) > resume:
            if resume[1] < 0:
                continue  # (resumed at the epoch's SourceReset: every seq of it comes again)
            epoch, seq = resume
        spans[epoch] = max(seq, spans.get(epoch, -1))
    return [(stream, epoch, 0, seq) for epoch, seq in sorted(spans.items()) if seq >= 0]


class Stops:
    """Within one write, the streams stopped at the record after a message refused for itself
    (see ``write`` in the module docstring): :meth:`refused` notes a refusal, :meth:`past` is the
    error of a message of a later record of its stream (``not_sent``, transient: written again
    after the refusal's announcement), None for any other (an earlier record's, whose answer may
    be read after the refusal's)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._after: dict[str, Record] = {}  # stream key -> the record of its message refused

    def refused(self, message: Message) -> None:
        self._after.setdefault(message.record.stream.key, message.record)

    def past(self, message: Message) -> Retriable | None:
        after = self._after.get(message.record.stream.key) if self._after else None
        if after is None or message.record.position <= after.position:
            return None
        return Retriable(
            f"{self._prefix}: not written yet: {message.record.stream.key} goes on after the announcement of a refusal",
            reason="not_sent",
        )


def held_before_run(
    last: dict[str, SinkPosition | None], before: Mapping[str, SinkPosition | None]
) -> dict[str, SinkPosition | None]:
    """``positions_before_run`` from ``last`` (what ``positions`` said: the last message, perhaps a
    copy this process wrote) and ``before`` (what the sink held before this process wrote there):
    for each stream of ``before``, the one that holds more, and ``before`` where ``last`` cannot
    tell. ``last`` is updated and returned."""
    for key, pos in before.items():
        now = last.get(key)
        if key not in last or (pos is not None and (now is None or pos.holds_more_than(now))):
            last[key] = pos
    return last


def refusal(record: Record) -> bool:
    """Whether ``record`` is a sink's announcement of batches it refused (``EventsLost``,
    ``sink_refused:<sink>``): it stands right after the last of them (see ``write``)."""
    return record.kind == "EventsLost" and (record.reason or "").startswith("sink_refused:")


def place_crc(servers: Iterable[str], place: str) -> int:
    """A CRC-32 of a place (a key, topic or stream name) on its servers (``host:port``, see
    :func:`server_address`), for a mark to name what it was taken of (``stored_through``): a mark
    of another place says nothing of this one (a template changed, sinks renamed or moved)."""
    return zlib.crc32(("/".join(sorted(servers)) + "|" + place).encode())


def server_address(url: str, default_port: int) -> str:
    """``host:port`` of a server given as a URL (``scheme://user@host:port/...``) or ``host:port``:
    the host lower-cased, the default port filled in; what two sinks compare (see ``places``)."""
    rest = url.split("://", 1)[-1].rsplit("@", 1)[-1].split("/", 1)[0].split("?", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or (host.startswith("[") != host.endswith("]")):
        host, port = rest, str(default_port)
    host = host.lower()
    return f"{'127.0.0.1' if host == 'localhost' else host}:{port}"


__all__ = [
    "ENTRY_POINT_GROUP",
    "EPOCHS_REMEMBERED",
    "STATE_TYPE",
    "ByteSize",
    "ConfigError",
    "Connector",
    "ConnectorError",
    "ConnectorFactory",
    "ConnectorOptions",
    "Duration",
    "Envelope",
    "Event",
    "Head",
    "Message",
    "NotConnected",
    "PartialFailure",
    "Permanent",
    "PositionReader",
    "Record",
    "Registry",
    "Retriable",
    "Secret",
    "SeedEntry",
    "SinkConfig",
    "SinkLost",
    "SinkPosition",
    "StateDelta",
    "StateReader",
    "Stops",
    "Stream",
    "StreamRefused",
    "Template",
    "TlsOptions",
    "doc",
    "file_id",
    "held_before_run",
    "hex64",
    "local_file_problems",
    "message_types",
    "place_crc",
    "redact",
    "redact_url",
    "refusal",
    "rendered",
    "resent_spans",
    "reveal",
    "sample_message",
    "server_address",
    "template_labels",
    "unreadable",
    "unwritable",
]
