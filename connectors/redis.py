"""Redis Streams sink: one XADD per message, explicit entry ids, an optional block index.

Configuration (the sink entry's own keys; see :class:`RedisConnector.Options`)::

    - type: redis
      url: rediss://redis.example:6380/0
      username: kv-bridge
      password: ${REDIS_PASSWORD}
      tls: {ca_file: /etc/ssl/redis-ca.pem}
      stream: "kv:{source}:{dp_rank}"
      maxlen: 1000000
      index: {enabled: true, key: "kv:{source}:{dp_rank}:blocks"}

Entry layout. Every entry carries the stream header as fields, in this order: ``source``,
``dp_rank``, ``epoch``, ``seq``, ``type``, ``content-type``, then ``index`` (event granularity)
and ``ts`` (when the engine gave one), all as text. The body follows as one more field: ``data``
holds the rendered message (json / msgpack, and control records in every format), ``payload``
holds the engine's payload bytes untouched (``format: raw`` engine batches).

Entry ids. Each entry is added with an explicit id built from its position (epoch, slot, sub)
(``Message.position``; slot = engine seq + 1, sub = event index + 1 at event granularity, else 0):
``<epoch * 2**40 + slot>-<sub>`` (:func:`entry_id`). A SourceReset sits at slot 0 of its epoch;
an EventsLost at the slot of its ``to_seq`` with sub 2**64 - 1 (:func:`message_position`). Ids
therefore grow strictly along a stream, across epochs, batches and the events of a batch:

- a re-sent entry (write retried after a timeout, bridge restarted from its checkpoint) is
  refused by Redis as "equal or smaller than the target stream top item"; the connector checks
  (one more round trip, only then) that the entry is there, or older than a trimmed head, and
  counts it as delivered, so each entry is stored once. An entry that is absent although a later
  one is stored (it failed, and a later one did not) can never be added in order: that is a
  ``Permanent`` failure (``reason="skipped"``), so it is dead-lettered instead of lost silently;
- a consumer resumes exactly with ``XREAD STREAMS key <last id seen>`` and can recover
  (epoch, slot, sub) from an id with :func:`entry_position`.

Bounds: epoch < 2**24, slot < 2**40 (an entry outside is a ``Permanent`` failure). The first
part is not a time: ``XRANGE`` by time and ``MINID`` trimming do not apply, and the bridge must be
the only writer of its streams (an auto-id entry, about 1.7e12, would sit above epoch 1's ids).
The stream and index key templates must name ``{source}`` and ``{dp_rank}`` so that no key mixes
two engine streams.

Index mode (``index.enabled``). Besides the stream, a Redis SET per engine stream holds the block
hashes the engine currently caches: BlockStored adds, BlockRemoved removes, AllBlocksCleared and
SourceReset empty it (EventsLost: ``index.on_events_lost``). A router asks which engines hold a
prefix with one ``SMISMEMBER`` per engine. Members are decimal text for integer hashes (16
lowercase hex digits with ``hash_format: hex``) and lowercase hex for binary hashes, like the json
format; ``medium`` is not distinguished. A small Lua script per message adds the entry and, only
when it is newly stored, applies the message's net set change, atomically: a re-sent message
changes nothing, even one older than the tail (re-applying an old BlockStored after its
BlockRemoved would resurrect the block). In a cluster the stream and its set must share a hash
slot: the cluster defaults are ``kv:{{source}:{dp_rank}}`` and ``kv:{{source}:{dp_rank}}:blocks``
(the outer braces stay literal, so keys look like ``kv:{llama-a:0}``).

Delivery: one round trip per write (a pipeline without MULTI, one XADD or script call per
message); writes are serialised so the entries of a stream reach Redis in order; returning means
Redis stored every entry. redis-py's own retries are off (the runtime retries). Failures:
connection refused, timeouts and failed authentication are ``NotConnected``; LOADING, BUSY,
TRYAGAIN, OOM, READONLY, NOPERM and cluster reconfiguration are ``Retriable``; anything else
refused for an entry (WRONGTYPE, an id out of range) is ``Permanent``; when only some entries of
a write fail it is a ``PartialFailure`` naming them (transient cause if any is transient).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, ClassVar, Literal, NamedTuple
from urllib.parse import urlsplit

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bridge.config import Duration, SinkConfig
from bridge.config import Struct as ConfigStruct
from bridge.connector import Template, TlsOptions
from bridge.errors import ConfigError, ConnectorError, NotConnected, PartialFailure, Permanent, Retriable
from bridge.formats import Message, hex64
from bridge.records import Event, Record, Stream

log = logging.getLogger(__name__)

# -- command packing ----------------------------------------------------------------------------


def resp_command(args: Sequence[str | bytes | int]) -> bytes:
    """``args`` as one Redis protocol command (an array of bulk strings), the bytes redis-py sends.

    Takes ``str`` (UTF-8, redis-py's default encoding), ``bytes`` and ``int``; raises TypeError
    for anything else (redis-py's own packer handles those).
    """
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if type(a) is str:
            b = a.encode()
        elif type(a) is bytes:
            b = a
        elif type(a) is int:
            b = b"%d" % a
        else:
            raise TypeError(f"not str, bytes or int: {type(a).__name__}")
        out.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(out)


_ONE_PASS: dict[type[Any], type[Any]] = {}


def one_pass_packing(base: type[Any]) -> type[Any]:
    """``base`` (a redis-py asyncio connection class) packing its pipelines in one pass.

    redis-py's asyncio connections pack every argument of a pipeline in Python through the
    encoder, about 30 us per 20-argument XADD (its sync client uses hiredis, the async one
    does not); :func:`resp_command` takes 6 us for the same bytes. That was half the CPU of a
    raw batch written to Redis (``benchmarks/redis_client_bench.py``). Commands with other
    argument types, or a multi-word first argument, go through redis-py's own packer.
    """
    fast = _ONE_PASS.get(base)
    if fast is None:

        def pack_commands(self: Any, commands: Iterable[Iterable[Any]]) -> list[bytes]:
            out: list[bytes] = []
            for command in commands:
                args = tuple(command)
                try:
                    first = args[0]
                    if (type(first) is str and " " in first) or (type(first) is bytes and b" " in first):
                        raise TypeError("multi-word command name")  # redis-py splits those
                    out.append(resp_command(args))
                except TypeError:
                    out.extend(base.pack_command(self, *args))
            return [b"".join(out)]

        fast = _ONE_PASS[base] = type(f"OnePass{base.__name__}", (base,), {"pack_commands": pack_commands})
    return fast


# -- entry ids ----------------------------------------------------------------------------------

SLOT_BITS = 40
"""Bits of the id's first part that hold the slot (engine seq + 1); the epoch sits above them."""
MAX_EPOCH = (1 << (64 - SLOT_BITS)) - 1  # 16,777,215 engine restarts
MAX_SLOT = (1 << SLOT_BITS) - 1  # ~1.1e12 batches per epoch: 3.5 years at 10,000 batches/s
MAX_SUB = (1 << 64) - 1


def entry_id(position: tuple[int, int, int]) -> str:
    """The Redis entry id of a message at ``position`` = (epoch, slot, sub).

    ``<epoch * 2**40 + slot>-<sub>``: both parts are unsigned 64-bit in Redis, and comparing ids
    compares (epoch, slot, sub) lexicographically because slot < 2**40. Redis refuses ``0-0``, so
    the one position that would map to it (a SourceReset opening epoch 0, which the sequencer does
    not emit since every announced epoch is >= 1) becomes ``0-1``; no other position has slot 0
    with sub 1, so the order is kept. Raises ValueError when a part is out of range.
    """
    epoch, slot, sub = position
    if not (0 <= epoch <= MAX_EPOCH and 0 <= slot <= MAX_SLOT and 0 <= sub <= MAX_SUB):
        raise ValueError(f"position {position} does not fit a Redis entry id (epoch <= {MAX_EPOCH}, slot <= {MAX_SLOT})")
    first = (epoch << SLOT_BITS) | slot
    if first == 0 and sub == 0:
        sub = 1
    return f"{first}-{sub}"


def entry_position(entry: str | bytes) -> tuple[int, int, int]:
    """(epoch, slot, sub) of an entry id written by this connector (the inverse of :func:`entry_id`).

    For engine batches slot = seq + 1 and sub = event index + 1 at event granularity (0 at batch
    granularity); a SourceReset has slot 0 and sub 0, an EventsLost the slot of its ``to_seq`` and
    sub 2**64 - 1 (see :func:`message_position`).
    """
    text = entry.decode() if isinstance(entry, bytes) else entry
    first, _, sub = text.partition("-")
    ms = int(first)
    return (ms >> SLOT_BITS, ms & MAX_SLOT, int(sub or 0))


def message_position(message: Message) -> tuple[int, int, int]:
    """The position a message's entry id is built from: ``message.position``, except that an
    EventsLost takes the last sub of its slot.

    An EventsLost stands at the slot of its ``to_seq``; should that batch itself have reached the
    sink (a lost span reported inclusively), the record must still sort after it, or Redis would
    refuse it as out of order. Nothing else of the stream can come later within that slot.
    """
    if message.record.kind == "EventsLost":
        epoch, slot, _ = message.position
        return (epoch, slot, MAX_SUB)
    return message.position


# -- options ------------------------------------------------------------------------------------

DEFAULT_STREAM = "kv:{source}:{dp_rank}"
DEFAULT_INDEX_KEY = "kv:{source}:{dp_rank}:blocks"
# In a cluster the stream and its index set must share a hash slot (one script touches both).
# The outer braces stay literal around the rendered placeholders, so the key is
# "kv:{llama-a:0}" and Redis hashes only "llama-a:0".
CLUSTER_STREAM = "kv:{{source}:{dp_rank}}"
CLUSTER_INDEX_KEY = "kv:{{source}:{dp_rank}}:blocks"


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class IndexOptions(ConfigStruct):
    """A SET per engine stream of the block hashes the engine currently holds."""

    enabled: Annotated[bool, _doc("Keep the block index next to each stream.")] = False
    key: Annotated[
        str | None,
        _doc(
            "Key template of the set, over {source}, {dp_rank} and labels; must name {source} "
            f"and {{dp_rank}}. Default {DEFAULT_INDEX_KEY} ({CLUSTER_INDEX_KEY} with cluster: true)."
        ),
    ] = None
    on_events_lost: Annotated[
        Literal["keep", "clear"],
        _doc(
            "After an EventsLost record: keep the set as it is (it may hold blocks evicted meanwhile "
            "until the next AllBlocksCleared or SourceReset), or clear it (it refills as blocks are stored)."
        ),
    ] = "keep"


class RedisOptions(ConfigStruct):
    """The redis sink's own keys."""

    url: Annotated[
        str,
        _doc("redis://host:port/db or rediss://host:port/db (TLS). Credentials belong in username/password."),
    ]
    username: Annotated[str | None, _doc("ACL user (Redis 6+); null: the default user.")] = None
    password: Annotated[str | None, _doc("Password, e.g. ${REDIS_PASSWORD}; never logged.")] = None
    tls: Annotated[
        TlsOptions | None,
        _doc("TLS files and checks; only with rediss:// URLs (redis-py trusts ca_file besides the system CAs)."),
    ] = None
    stream: Annotated[
        str | None,
        _doc(
            "Stream key template over {source}, {dp_rank}, {type}, {epoch} and labels; must name {source} "
            f"and {{dp_rank}} so that one key never mixes two engine streams. Default {DEFAULT_STREAM} "
            f"({CLUSTER_STREAM} with cluster: true)."
        ),
    ] = None
    maxlen: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        _doc("Trim each stream to about this many entries (XADD MAXLEN ~); null: never trim."),
    ] = None
    timeout: Annotated[Duration, _doc("Connect and socket read/write timeout.")] = Duration(5.0)
    index: Annotated[IndexOptions, _doc("The optional block index.")] = msgspec.field(default_factory=IndexOptions)
    cluster: Annotated[bool, _doc("url names a node of a Redis Cluster (redis.asyncio.RedisCluster).")] = False

    def __post_init__(self) -> None:
        # ValueError here becomes a ConfigError line naming the sink (msgspec wraps it).
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss"):
            raise ValueError("url: expected redis://host:port/db or rediss://host:port/db")
        parts = urlsplit(self.url)
        if parts.password and self.password is not None:
            raise ValueError("url: give the password either in url or in password, not both")
        if self.tls is not None and scheme != "rediss":
            raise ValueError("tls: only used with a rediss:// url")
        if self.timeout <= 0:
            raise ValueError("timeout: must be greater than 0")
        stream, index = self.templates()
        for field, text in (("stream", stream), ("index.key", index)):
            try:
                t = Template(text, field)
            except ConfigError as exc:
                raise ValueError("; ".join(exc.problems)) from None
            missing = [p for p in ("source", "dp_rank") if p not in t.fields]
            if missing:
                raise ValueError(
                    f"{field}: {text!r} must name {{source}} and {{dp_rank}} (missing {', '.join(missing)}): "
                    "entry ids grow per engine stream, so one key must not mix two of them"
                )
        banned = [f"{{{p}}}" for p in ("type", "epoch") if p in Template(index).fields]
        if self.index.enabled and banned:
            raise ValueError(
                f"index.key: {' and '.join(banned)} not allowed: one set holds the blocks of an engine "
                "for its whole life, and a SourceReset must empty that same set"
            )
        if self.cluster and self.index.enabled:
            for sample in _SAMPLES:
                s, i = _render(stream, sample), _render(index, sample)
                if key_slot(s.encode()) != key_slot(i.encode()):
                    raise ValueError(
                        f"index.key: in a cluster the stream {s!r} and its index {i!r} must hash to one slot; "
                        f"wrap the shared part in a hash tag, e.g. stream: {CLUSTER_STREAM!r} and "
                        f"index.key: {CLUSTER_INDEX_KEY!r}"
                    )

    def templates(self) -> tuple[str, str]:
        """The stream and index key templates, defaults resolved."""
        stream = self.stream or (CLUSTER_STREAM if self.cluster else DEFAULT_STREAM)
        index = self.index.key or (CLUSTER_INDEX_KEY if self.cluster else DEFAULT_INDEX_KEY)
        return stream, index

    def __repr__(self) -> str:
        # The default Struct repr would print the password (and a password inside url).
        return (
            f"RedisOptions(url={_redact_url(self.url)!r}, username={self.username!r}, "
            f"password={'***' if self.password else None!r}, stream={self.stream!r}, cluster={self.cluster!r}, "
            f"index={self.index!r})"
        )

    __str__ = __repr__


def _sample(source: str, dp_rank: int, type_: str) -> Message:
    rec = Record(stream=Stream(source, dp_rank), epoch=1, seq=0)
    return Message(record=rec, index=None, type=type_, value=b"", headers={}, msg_id="", position=(1, 1, 0))


_SAMPLES = [
    _sample(src, rank, t)
    for src, rank in (("a", 0), ("llama-b", 3))
    for t in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "EventBatch", "SourceReset", "EventsLost")
]


def _render(template: str, message: Message) -> str:
    return Template(template).render(message)


def _redact_url(url: str) -> str:
    """``url`` without its user info (which may hold a password)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return parts._replace(netloc=netloc).geturl()


# -- the index script ---------------------------------------------------------------------------

# One call per message in index mode: XADD the entry and, only when it is newly stored, apply the
# message's net change to the set, atomically. A re-sent entry is refused by XADD ("equal or
# smaller"); the script then tells a duplicate (the id is there, or below a trimmed head) from an
# entry that was skipped (later ones stored first) and applies nothing in either case.
# The set's type is checked first so a WRONGTYPE index key fails before the entry is stored.
INDEX_SCRIPT = """
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'none' and kind ~= 'set' then
  return redis.error_reply('WRONGTYPE index key ' .. KEYS[2] .. ' holds a ' .. kind .. ', not a set')
end
local nfields = tonumber(ARGV[3])
local xadd = {KEYS[1]}
if ARGV[2] ~= '' then
  xadd[#xadd + 1] = 'MAXLEN'
  xadd[#xadd + 1] = '~'
  xadd[#xadd + 1] = ARGV[2]
end
xadd[#xadd + 1] = ARGV[1]
for i = 4, 3 + nfields do
  xadd[#xadd + 1] = ARGV[i]
end
local added = redis.pcall('XADD', unpack(xadd))
if type(added) == 'table' and added['err'] then
  if string.find(added['err'], 'equal or smaller', 1, true) then
    local below = redis.call('XREVRANGE', KEYS[1], ARGV[1], '-', 'COUNT', 1)
    if #below == 0 or below[1][1] == ARGV[1] then
      return 0
    end
    return redis.error_reply('KVBRIDGE_SKIPPED entry ' .. ARGV[1] .. ' is below the top of ' .. KEYS[1] .. ' but not in it')
  end
  return added
end
local p = 4 + nfields
if ARGV[p] == '1' then
  redis.call('DEL', KEYS[2])
end
p = p + 1
for _, command in ipairs({'SREM', 'SADD'}) do
  local first = p + 1
  local last = p + tonumber(ARGV[p])
  while first <= last do
    local upto = math.min(first + 999, last)
    redis.call(command, KEYS[2], unpack(ARGV, first, upto))
    first = upto + 1
  end
  p = last + 1
end
return 1
"""
_SKIPPED = "KVBRIDGE_SKIPPED"
_TOO_SMALL = "equal or smaller than the target stream top item"


class IndexDelta(NamedTuple):
    """The net effect of some events on a stream's block set: clear first, then remove, then add."""

    clear: bool
    remove: list[str]
    add: list[str]


def index_delta(events: Iterable[Event], hash_hex: bool = False, *, clear: bool = False) -> IndexDelta:
    """The net change ``events`` make to the set, in order (a block's last event wins).

    Members: decimal text of integer hashes (``hex64`` with ``hash_hex``), lowercase hex of binary
    hashes, text hashes as they are. Applying the delta equals applying the events one by one.
    """
    state: dict[str, bool] = {}
    for event in events:
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            clear = True
            state.clear()
            continue
        if kind == "BlockStored":
            present = True
        elif kind == "BlockRemoved":
            present = False
        else:
            continue
        hashes = event.get("block_hashes")
        if not isinstance(hashes, list | tuple):
            continue
        for h in hashes:
            state[_member(h, hash_hex)] = present
    # After a clear the set is empty, so removals are no-ops and can be left out.
    remove = [] if clear else [m for m, present in state.items() if not present]
    return IndexDelta(clear, remove, [m for m, present in state.items() if present])


def _member(h: Any, hash_hex: bool) -> str:
    if isinstance(h, bytes | bytearray | memoryview):
        return bytes(h).hex()
    if isinstance(h, int) and not isinstance(h, bool):
        return hex64(h) if hash_hex else str(h)
    return str(h)


# -- failure classes ----------------------------------------------------------------------------

_RETRIABLE_CODES = ("BUSY", "TRYAGAIN", "LOADING", "OOM", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "NOREPLICAS")


def _classify(exc: BaseException, where: str, secret: str | None) -> ConnectorError:
    """The bridge failure class of a redis-py exception (``where`` names sink and server)."""
    text = _scrub(str(exc) or type(exc).__name__, secret)
    if isinstance(exc, BusyLoadingError):  # a ConnectionError subclass in redis-py, but transient
        return Retriable(f"{where}: server is loading its data: {text}", retry_after=1.0, reason="loading")
    if isinstance(exc, AuthenticationError | AuthorizationError):
        return NotConnected(f"{where}: authentication failed: {text}", reason="auth")
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError | asyncio.TimeoutError):
        return NotConnected(f"{where}: {text}")
    if isinstance(exc, OutOfMemoryError):
        # Not dead-lettered: consumers trimming or an operator raising maxmemory heals it, and
        # meanwhile backpressure holds the data.
        return Retriable(f"{where}: out of memory: {text}", reason="oom")
    if isinstance(exc, NoPermissionError):
        # An ACL mistake is fixed by an operator; retrying keeps the data until then.
        return Retriable(f"{where}: no permission: {text}", reason="no_permission")
    if isinstance(exc, NoScriptError):  # flushed again between loading and running it
        return Retriable(f"{where}: {text}", reason="noscript")
    if isinstance(exc, ReadOnlyError | TryAgainError | ClusterDownError | SlotNotCoveredError | AskError):
        return Retriable(f"{where}: {text}", retry_after=0.5, reason="cluster")
    if isinstance(exc, ResponseError):
        code = str(exc).split(" ", 1)[0]
        if code in _RETRIABLE_CODES:
            return Retriable(f"{where}: {text}", reason=code.lower())
        if code == _SKIPPED:
            return Permanent(f"{where}: {text} (a later entry of the stream was stored first)", reason="skipped")
        return Permanent(f"{where}: {text}", reason="rejected")
    if isinstance(exc, RedisClusterException):
        return Retriable(f"{where}: {text}", retry_after=0.5, reason="cluster")
    if isinstance(exc, RedisError):
        return Retriable(f"{where}: {text}")
    return NotConnected(f"{where}: {type(exc).__name__}: {text}", reason="unexpected")


def _scrub(text: str, secret: str | None) -> str:
    # Defence in depth: no redis-py message should hold the password, but never let one through.
    return text.replace(secret, "***") if secret else text


def _combine(errors: list[ConnectorError]) -> ConnectorError:
    """One cause for several failed entries: anything transient wins, so all of them are retried
    (a permanent one fails again on its own and is dead-lettered then)."""
    for kind in (NotConnected, Retriable):
        matching = [e for e in errors if isinstance(e, kind)]
        if matching:
            if kind is Retriable:
                waits = [e.retry_after for e in matching if isinstance(e, Retriable) and e.retry_after is not None]
                first = matching[0]
                return Retriable(str(first), retry_after=max(waits) if waits else None, reason=first.reason)
            return matching[0]
    return errors[0]


# -- the connector ------------------------------------------------------------------------------


class _Entry(NamedTuple):
    key: str
    id: str
    fields: list[str | bytes]


_NAME_CHARS = re.compile(r"[^A-Za-z0-9._:-]")


class RedisConnector:
    """Writes messages to Redis Streams (see the module docstring for layout and semantics)."""

    Options: ClassVar[type[msgspec.Struct]] = RedisOptions

    def __init__(self, name: str, options: RedisOptions, sink: SinkConfig) -> None:
        """Prepare templates and client settings; no I/O."""
        self.name = name
        self.options = options
        self.sink = sink
        stream, index = options.templates()
        self._stream = Template(stream, "stream")
        self._index = Template(index, "index.key") if options.index.enabled else None
        self.needs_events = self._index is not None  # the block index reads the events, even of raw batches
        self._clear_on_lost = options.index.on_events_lost == "clear"
        self._hash_hex = sink.hash_format == "hex"
        self._raw = sink.format == "raw"
        self._trim: list[str | bytes] = ["MAXLEN", "~", str(options.maxlen)] if options.maxlen else []
        self._maxlen_arg = str(options.maxlen) if options.maxlen else ""
        self._where = f"redis sink {name!r} at {_redact_url(options.url)}"
        self._client: aioredis.Redis | aioredis.RedisCluster | None = None
        self._script_sha: str | None = None
        # Entry ids only work if a stream's entries reach Redis in order, so writes never overlap.
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<RedisConnector {self.name!r} {_redact_url(self.options.url)}>"

    # -- client -----------------------------------------------------------------------------
    def _make_client(self) -> aioredis.Redis | aioredis.RedisCluster:
        o = self.options
        kwargs: dict[str, Any] = {
            "socket_timeout": float(o.timeout),
            "socket_connect_timeout": float(o.timeout),
            # Retries with backoff belong to the runtime; redis-py's own (10 by default) would
            # multiply every timeout and hide outages from readiness and metrics.
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": False,
            "client_name": "kv-event-bridge." + _NAME_CHARS.sub("_", self.name),
        }
        if o.username is not None:
            kwargs["username"] = o.username
        if o.password is not None:
            kwargs["password"] = o.password
        if o.tls is not None:
            kwargs.update(
                ssl_ca_certs=o.tls.ca_file,
                ssl_certfile=o.tls.cert_file,
                ssl_keyfile=o.tls.key_file,
                ssl_check_hostname=o.tls.check_hostname,
                ssl_cert_reqs="required",
            )
        if o.cluster:
            return aioredis.RedisCluster.from_url(o.url, **kwargs)
        client = aioredis.Redis.from_url(o.url, **kwargs)
        pool = client.connection_pool
        pool.connection_class = one_pass_packing(pool.connection_class)
        return client

    def _connection(self) -> aioredis.Redis | aioredis.RedisCluster:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    @property
    def _secret(self) -> str | None:
        return self.options.password or urlsplit(self.options.url).password

    def _error(self, exc: BaseException) -> ConnectorError:
        return _classify(exc, self._where, self._secret)

    # -- hooks ------------------------------------------------------------------------------
    async def connect(self) -> None:
        """PING the server (and load the index script); NotConnected naming sink and server if not."""
        client = self._connection()
        try:
            async with asyncio.timeout(float(self.options.timeout) * 2):
                await client.ping()
                if self._index is not None:
                    await self._load_script(client)
        except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
            error = self._error(exc)
            raise NotConnected(f"cannot connect: {error}", reason=error.reason) from None
        log.info("redis sink connected", extra={"sink": self.name, "server": _redact_url(self.options.url)})

    async def health(self) -> str | None:
        """None when a PING is answered within the timeout, else a short reason."""
        try:
            async with asyncio.timeout(float(self.options.timeout)):
                await self._connection().ping()
        except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
            return str(self._error(exc))
        return None

    async def close(self) -> None:
        """Close the client's connections; never raises."""
        client, self._client = self._client, None
        self._script_sha = None
        if client is None:
            return
        try:
            async with asyncio.timeout(float(self.options.timeout)):
                await client.aclose()
        except Exception as exc:  # closing is best effort: the process is leaving or reconnecting
            log.debug("redis sink close failed", extra={"sink": self.name, "error": _scrub(str(exc), self._secret)})

    async def write(self, messages: Sequence[Message]) -> None:
        """XADD every message in one pipeline; returning means Redis stored each one (once).

        Raises NotConnected / Retriable when nothing is known to be stored, PartialFailure for
        the entries Redis refused (see the module docstring), Permanent when all were refused.
        """
        if not messages:
            return
        failed: dict[int, ConnectorError] = {}
        entries: list[_Entry | None] = []
        for i, message in enumerate(messages):
            try:
                entries.append(self._entry(message))
            except ValueError as exc:
                failed[i] = Permanent(f"{self._where}: {exc}", reason="id_range")
                entries.append(None)
        async with self._lock:
            client = self._connection()
            try:
                if self._index is not None:
                    results = await self._add_indexed(client, messages, entries)
                else:
                    results = await self._add(client, entries)
                    await self._check_refused(client, entries, results)
            except (RedisError, RedisClusterException, OSError) as exc:
                # The pipeline as a whole failed: some entries may be stored, and the retry will
                # recognise them by their ids.
                raise self._error(exc) from None
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                failed[i] = self._error(result)
        if not failed:
            return
        cause = _combine(list(failed.values()))
        if len(failed) == len(messages):
            raise cause
        raise PartialFailure(sorted(failed), cause)

    # -- internals --------------------------------------------------------------------------
    def _entry(self, m: Message) -> _Entry:
        fields: list[str | bytes] = []
        for k, v in m.headers.items():
            fields.append(k)
            fields.append(v)
        fields.append("payload" if self._raw and m.record.kind == "batch" else "data")
        fields.append(m.value)
        return _Entry(self._stream.render(m), entry_id(message_position(m)), fields)

    async def _add(self, client: aioredis.Redis | aioredis.RedisCluster, entries: list[_Entry | None]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        sent: list[int] = []
        for i, e in enumerate(entries):
            if e is not None:
                pipe.execute_command("XADD", e.key, *self._trim, e.id, *e.fields)
                sent.append(i)
        replies = await pipe.execute(raise_on_error=False) if sent else []
        results: list[Any] = [None] * len(entries)
        for i, reply in zip(sent, replies, strict=True):
            results[i] = reply
        return results

    async def _check_refused(
        self, client: aioredis.Redis | aioredis.RedisCluster, entries: list[_Entry | None], results: list[Any]
    ) -> None:
        """Turn "id too small" refusals into success when the entry is stored (a re-send).

        An id at or below the top that is absent was skipped: a later entry of the stream was
        stored first (after an earlier partial failure), so this one can never be added in
        order; that is permanent. An id below a trimmed head counts as stored.
        """
        refused = [
            i for i, r in enumerate(results) if isinstance(r, ResponseError) and _TOO_SMALL in str(r) and entries[i] is not None
        ]
        if not refused:
            return
        pipe = client.pipeline(transaction=False)
        for i in refused:
            e = entries[i]
            assert e is not None
            pipe.execute_command("XREVRANGE", e.key, e.id, "-", "COUNT", "1")
        found = await pipe.execute(raise_on_error=False)
        for i, reply in zip(refused, found, strict=True):
            e = entries[i]
            assert e is not None
            if isinstance(reply, BaseException):
                results[i] = reply
            elif not reply or _entry_id_of(reply[0]) == e.id:
                results[i] = None
            else:
                results[i] = ResponseError(f"{_SKIPPED} entry {e.id} is below the top of {e.key} but not in it")

    async def _add_indexed(
        self, client: aioredis.Redis | aioredis.RedisCluster, messages: Sequence[Message], entries: list[_Entry | None]
    ) -> list[Any]:
        assert self._index is not None
        sha = self._script_sha or await self._load_script(client)
        results: list[Any] = []
        for attempt in range(2):
            pipe = client.pipeline(transaction=False)
            sent: list[int] = []
            for i, (m, e) in enumerate(zip(messages, entries, strict=True)):
                if e is None:
                    continue
                delta = self._delta(m)
                pipe.execute_command(
                    "EVALSHA",
                    sha,
                    2,
                    e.key,
                    self._index.render(m),
                    e.id,
                    self._maxlen_arg,
                    len(e.fields),
                    *e.fields,
                    "1" if delta.clear else "0",
                    len(delta.remove),
                    *delta.remove,
                    len(delta.add),
                    *delta.add,
                )
                sent.append(i)
            replies = await pipe.execute(raise_on_error=False) if sent else []
            results = [None] * len(entries)
            for i, reply in zip(sent, replies, strict=True):
                results[i] = reply
            # After a server restart (or SCRIPT FLUSH) the script is gone: load it and send the
            # whole write again; entries stored meanwhile come back as duplicates.
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in results):
                sha = await self._load_script(client)
                continue
            break
        return results

    def _delta(self, m: Message) -> IndexDelta:
        record = m.record
        if record.kind == "SourceReset":
            return IndexDelta(True, [], [])
        if record.kind == "EventsLost":
            return IndexDelta(self._clear_on_lost, [], [])
        event = m.event
        return index_delta(record.events if event is None else (event,), self._hash_hex)

    async def _load_script(self, client: aioredis.Redis | aioredis.RedisCluster) -> str:
        reply: Any = await client.script_load(INDEX_SCRIPT)
        self._script_sha = reply.decode() if isinstance(reply, bytes) else str(reply)
        return self._script_sha


def _entry_id_of(item: Any) -> str:
    """The id of one XRANGE/XREVRANGE item, however the client shaped it."""
    ident = item[0] if isinstance(item, list | tuple) else item
    return ident.decode() if isinstance(ident, bytes) else str(ident)


__all__ = [
    "MAX_EPOCH",
    "MAX_SLOT",
    "IndexDelta",
    "IndexOptions",
    "RedisConnector",
    "RedisOptions",
    "TlsOptions",
    "entry_id",
    "entry_position",
    "index_delta",
    "message_position",
]
