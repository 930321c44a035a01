"""Redis Streams sink: explicit entry ids, one script call per engine stream and write, an optional block index.

Configuration: :class:`RedisOptions` (``url``, ``username``, ``password: ${REDIS_PASSWORD}``,
``tls``, ``stream`` template, ``maxlen``, ``index: {enabled, key}``, ``cluster``).

Entries carry the stream header as fields, in this order: ``source``, ``dp_rank``, ``epoch``,
``seq``, ``type``, ``content-type``, ``schema_version``, then ``ts`` (engine batches) and ``index``
(event granularity), all as text; then the body: ``data`` (json / msgpack, and control records in
every format) or ``payload`` (the engine's bytes, ``format: raw`` batches). Each entry has an
explicit id built from (epoch, slot, sub) (:func:`entry_id`; slot = seq + 1, sub = event index + 1
or 0; a SourceReset at slot 0, an EventsLost after everything of its slot), so ids grow strictly
along an engine stream and a consumer resumes exactly with ``XREAD`` from the last id it saw
(:func:`entry_position` inverts it). The first part is not a time.

One key, one engine stream: two streams in one key would share ids (the same epoch and seq), and
the second one's entries would be taken as already there, acknowledged and never stored. Key
templates must name ``{source}`` and ``{dp_rank}``, not side by side (``kv:{source}{dp_rank}``
renders ``kv:llama12`` for llama1/2 and llama/12: a ConfigError). What a template check cannot see
(a label between them that renders empty) is caught when writing: the connector remembers which
engine stream each rendered key (stream or index) belongs to (up to 64 keys per stream, the
latest), and the script checks the engine stream named by the top entry of a stream key (across
restarts and instances). A second stream's messages then fail ``Retriable`` (reason
``key_collision``, naming both streams, the key and the fix): nothing of it is written or
acknowledged, the sink reports not ready until the template is fixed.

Delivery. A write is one pipeline holding one call of :data:`WRITE_SCRIPT` per engine stream (per
engine stream and hash slot in a cluster, where a script's keys share a slot: a stream template
that spreads one engine stream over slots keeps the order per key only). The script adds
the stream's entries in order and stops at the first one that fails for a reason other than the
entry itself, so Redis never stores an entry of a stream after an earlier one of the same write
failed. Near ``maxmemory`` a stream's write is all or nothing: Redis checks memory at a script's
first write only, and only for commands that may grow memory, so the script's first write is always
SADD or XADD (never DEL or SREM, which would let everything after them past the limit). Per entry:

- stored, or already there (id at or below the top and present, or below a trimmed head: a
  re-send after a timeout, a retry or a bridge restart): delivered, stored once;
- id below the top and absent: another client wrote to the stream (an auto-id entry sits above
  every id of epoch 1) or deleted this entry (XDEL). It can no longer be added in order:
  ``Permanent`` (reason ``out_of_order``, dead-lettered), and the stream goes on. The bridge must
  be the only writer. It causes this itself only with an EventsLost, after a restart from a
  checkpoint older than its last writes: settled (not stored), see ``_results``;
- WRONGTYPE (the key is no stream): refused for itself, the stream goes on (the runtime keeps and
  retries a refused announcement: bridge/sink.py); a configured stream's key of another type is
  refused at connect already (``_check_key_types``, reason ``key_type``);
- anything else stops the stream, the entries after it reported transient (not attempted):
  LOADING, BUSY, TRYAGAIN, OOM, MISCONF, READONLY, NOPERM, MASTERDOWN, CLUSTERDOWN, redirections and
  key collisions are transient (retried, sink not ready), other refusals ``Permanent``. An ACL refusal
  is NOPERM however it is worded: a command the script calls and the user may not run aborts the
  script with "ERR The user executing the script can't run this command ..." (Redis 7.0; 7.2:
  "NOPERM ... no permissions ..."), and redis-py strips the code from it.

A refusal of a whole script call is no entry's own: an operator's ``SCRIPT KILL`` (reason
``script_killed``) and a protocol error are retried. An argument over the server's
``proto-max-bulk-len`` would make the server refuse the whole call (and close the connection), and
one over its ``client-query-buffer-limit`` (less 2: the CRLF) would make it close the connection,
so the connector reads both limits at connect (Redis's defaults, 512 MB and 1 GB, when CONFIG is
not allowed), again after a write whose connection failed, and refuses a longer entry for itself
(``Permanent``, reason ``too_large``) before the call.

Losses (I6). The connector remembers the last entry id it stored in each stream key and the
``_at``/``_gen`` it last wrote to each state hash, and the script checks them before it writes
anything: a stream key whose top entry is below that id (Redis restarted from an older snapshot or
without persistence, the key deleted) fails the write with ``SinkLost`` naming the seqs lost (the
runtime announces them to this sink and writes the messages again; the connector has forgotten
its expectation of that key); a hash that no longer holds the last ``_at`` is emptied and the
state change refused for itself (``Permanent``, reason ``state_lost``: the runtime clears the
stream into a new generation, incomplete). The connector writes no further change of the lost
generation meanwhile, so the hash is never left holding part of a state marked complete.

The runtime (:func:`bridge.sink.fold`) then writes each stream again from its first transient
failure, in order. Connection refused, timeouts and failed authentication are ``NotConnected``;
redis-py's own retries are off, its socket timeouts (``timeout``) stay.

Index mode (``index.enabled``): a SET per engine stream holds the block hashes the engine caches;
a router asks with ``SMISMEMBER``. A block is a member while the engine holds a copy of it in any
(medium, group_idx): copies are counted as vLLM keeps them (it does not de-duplicate, and removes
one copy per BlockRemoved, of the medium named), in a HASH beside the set (the index key +
``:counts``: a count per copy and a total per block, and ``_at``, the id of the last entry whose
change it holds). AllBlocksCleared and SourceReset empty both, EventsLost per
``index.on_events_lost``. Members: decimal text of integer hashes (16 hex digits with
``hash_format: hex``), lowercase hex of binary ones. The script applies a message's index change
with its entry, only when the entry is new: a re-sent message changes nothing (an old BlockStored
re-applied after its BlockRemoved would resurrect the block). Order per entry: first whether it is
new (its id above the top of its stream; read, nothing written), then its index change, then its
XADD. A script that fails midway (an ACL without SADD, say) keeps what it did: the entries before
the failure with their changes, and maybe part of the failed entry's change, never its entry
without its change. The retry finds that entry still new and applies its change again to the same
result: the counts move in one HSET with ``_at`` (a retry that finds its id there leaves them), a
change with a clear starts from nothing again, and the members follow the totals. Then it adds
the entry. (Were the entry stored first, a failed change would be lost: the retry finds the entry
already there and changes nothing.) Another client deleting the top
entries of a stream (misuse) can make a new-looking entry out of order after its set change.
In a cluster the stream, its set and its counts must share a slot (a hash tag): the cluster defaults are
``kv:{{source}:{dp_rank}}`` and ``kv:{{source}:{dp_rank}}:blocks`` (keys like ``kv:{llama-a:0}``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Annotated, Any, ClassVar, Literal, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ClusterCrossSlotError,
    ClusterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bridge.connector import (
    EPOCHS_REMEMBERED,
    STATE_TYPE,
    ConfigError,
    ConnectorError,
    ConnectorOptions,
    Duration,
    Event,
    Message,
    NotConnected,
    PartialFailure,
    Permanent,
    Retriable,
    Secret,
    SinkConfig,
    SinkLost,
    SinkPosition,
    StateDelta,
    Stops,
    Stream,
    Template,
    TlsOptions,
    doc,
    hex64,
    message_types,
    place_crc,
    redact_url,
    refusal,
    rendered,
    reveal,
    sample_message,
    server_address,
)
from bridge.state import Head, SeedEntry
from bridge.state_docs import StateFormat, entry_key, parse, seed_of
from kv_consumer.redis import MAX_SLOT, MAX_SUB, MAX_WIDE_SUB, SLOT_BITS, SUB_BITS, WIDE, WIDE_EPOCHS, entry_position
from kv_consumer.redis import hash_fields as _hash_fields

from . import _redis_internals as internals
from ._redis_internals import one_pass_packing, resp_command

log = logging.getLogger(__name__)

# -- entry ids ----------------------------------------------------------------------------------


def entry_id(position: tuple[int, int, int]) -> str:
    """The Redis entry id of a message at ``position`` = (epoch, slot, sub).

    Two layouts (:mod:`kv_consumer.redis` defines them and reads them back), so that ids already in
    a stream stay below every new one:

    - narrow, epochs below :data:`WIDE_EPOCHS`: ``<epoch * 2**40 + slot>-<sub>``;
    - wide, from :data:`WIDE_EPOCHS`: ``<2**63 + epoch>-<slot * 2**24 + sub>``, where the sub
      ``2**64 - 1`` (an EventsLost or a state change: after everything of its slot) becomes
      ``2**24 - 1`` (a StateSeeded record's ``2**64 - 2``, after its batch's events: ``2**24 - 2``).

    Both parts are unsigned 64-bit in Redis; every narrow first part is below ``2**63`` and
    every wide one above, so comparing ids compares (epoch, slot, sub) lexicographically in and
    across the layouts. Redis refuses ``0-0``, so the one position that would map to it (a
    SourceReset opening epoch 0, which the sequencer does not emit) becomes ``0-1``; no other
    position has slot 0 with sub 1. Raises ValueError when a part is out of range.
    """
    epoch, slot, sub = position
    if 0 <= epoch < WIDE_EPOCHS and 0 <= slot <= MAX_SLOT and 0 <= sub <= MAX_SUB:
        first = (epoch << SLOT_BITS) | slot
        return f"{first}-{1 if first == 0 and sub == 0 else sub}"
    if sub == MAX_SUB - 1:  # a StateSeeded record (formats.SEED_SUB): after its batch's events, before its state
        sub = MAX_WIDE_SUB - 1 if epoch >= WIDE_EPOCHS else sub
    if not (WIDE_EPOCHS <= epoch < WIDE and 0 <= slot <= MAX_SLOT and (0 <= sub < MAX_WIDE_SUB or sub == MAX_SUB)):
        raise ValueError(
            f"position {position} does not fit a Redis entry id "
            f"(epoch < 2**63, slot <= {MAX_SLOT}, at most {MAX_WIDE_SUB - 1} events in a batch)"
        )
    return f"{WIDE | epoch}-{(slot << SUB_BITS) | min(sub, MAX_WIDE_SUB)}"


def _merged(message: str, lost: Sequence[SinkLost], states: Sequence[Stream] = ()) -> SinkLost:
    """One SinkLost for the losses of several engine streams."""
    at = {k: v for e in lost for k, v in e.at.items()}
    return SinkLost(message, [span for e in lost for span in e.spans], states=states, at=at)


def _database(url: str) -> int:
    """The database a Redis URL names, as redis-py reads it (ValueError: not a number)."""
    return int(parse_url(url).get("db", 0))  # type: ignore[no-untyped-call]


def _entries_added(info: object) -> int | None:
    """``entries-added`` of an ``XINFO STREAM`` reply (RESP2 pairs or RESP3 map); None when the
    reply has none (Redis before 7.0) or is an error."""
    pairs: Iterable[tuple[Any, Any]]
    if isinstance(info, dict):
        pairs = info.items()
    elif isinstance(info, list):
        pairs = zip(info[::2], info[1::2], strict=False)
    else:
        return None
    for name, value in pairs:
        if _text(name) == "entries-added":
            return int(value) if isinstance(value, int) else None
    return None


def _server_place(url: str) -> str:
    """The server and database a Redis URL's keys are on (``host:port/db``, or a unix socket's path),
    the database read as redis-py reads it (``?db=`` over the path, which is unquoted)."""
    parts = urlsplit(url)
    db = _database(url)
    return parts.path if parts.scheme == "unix" else f"{server_address(url, 6379)}/{db}"


def message_position(message: Message) -> tuple[int, int, int]:
    """``message.position``, except that an EventsLost takes the last sub of its slot: should the
    batch at its ``to_seq`` itself have reached the sink, the record must still sort after it."""
    if message.record.kind == "EventsLost":
        epoch, slot, _ = message.position
        return (epoch, slot, MAX_SUB)
    return message.position


# -- options ------------------------------------------------------------------------------------

DEFAULT_STREAM = "kv:{source}:{dp_rank}"
DEFAULT_INDEX_KEY = "kv:{source}:{dp_rank}:blocks"
# In a cluster the stream and its index set must share a hash slot (one script touches both).
# The outer braces stay literal around the rendered placeholders: "kv:{llama-a:0}".
CLUSTER_STREAM = "kv:{{source}:{dp_rank}}"
CLUSTER_INDEX_KEY = "kv:{{source}:{dp_rank}}:blocks"
DEFAULT_STATE_KEY = "kv:{source}:{dp_rank}:state"
CLUSTER_STATE_KEY = "kv:{{source}:{dp_rank}}:state"
# {source} right before or after {dp_rank}: the rendered key does not tell where one ends ("llama1" + "2"
# and "llama" + "12"). Other ambiguous templates (a label between them) are caught when writing.
_ADJACENT = re.compile(r"\{source\}\{dp_rank\}|\{dp_rank\}\{source\}")


class IndexOptions(ConnectorOptions):
    """A SET per engine stream of the block hashes the engine currently holds."""

    enabled: Annotated[bool, doc("Keep the block index next to each stream.")] = False
    key: Annotated[
        str | None,
        doc(
            "Key template of the set, over {source}, {dp_rank} and labels; must name {source} "
            f"and {{dp_rank}}. Default {DEFAULT_INDEX_KEY} ({CLUSTER_INDEX_KEY} with cluster: true)."
        ),
    ] = None
    on_events_lost: Annotated[
        Literal["keep", "clear"],
        doc(
            "After an EventsLost record: keep the set as it is (it may hold blocks evicted meanwhile "
            "until the next AllBlocksCleared or SourceReset), or clear it (it refills as blocks are stored)."
        ),
    ] = "keep"


class StateOptions(ConnectorOptions):
    """A HASH per engine stream of its live blocks and its head, written with its entries (docs/output/state.md)."""

    enabled: Annotated[
        bool,
        doc(
            "Keep the stream's live-block state (entries with counts, versions and facts, and the head) "
            "next to each stream, in the same script call as its entries: an exact cut."
        ),
    ] = False
    key: Annotated[
        str | None,
        doc(
            "Key template of the hash, over {source}, {dp_rank} and labels; must name {source} and {dp_rank}. "
            f"Default {DEFAULT_STATE_KEY} ({CLUSTER_STATE_KEY} with cluster: true)."
        ),
    ] = None


_COUNTS_FIELD = "index.key's counts hash"
"""How errors name the index's counts hash (``index.key`` + ``:counts``), a key of its own."""


class RedisOptions(ConnectorOptions):
    """The redis sink's own keys."""

    url: Annotated[
        str,
        doc(
            "redis://host:port/db or rediss://host:port/db (TLS). Credentials belong in username/password, "
            "TLS settings in tls (ssl_* url options, such as ssl_cert_reqs=none, are refused)."
        ),
    ]
    username: Annotated[str | None, doc("ACL user (Redis 6+); null: the default user.")] = None
    password: Annotated[Secret | None, doc("Password, e.g. ${REDIS_PASSWORD}; never logged.")] = None
    tls: Annotated[
        TlsOptions | None,
        doc("TLS files and checks; only with rediss:// URLs (redis-py trusts ca_file besides the system CAs)."),
    ] = None
    stream: Annotated[
        str | None,
        doc(
            "Stream key template over {source}, {dp_rank}, {type}, {epoch} and labels; must name {source} "
            f"and {{dp_rank}} so that one key never mixes two engine streams. Default {DEFAULT_STREAM} "
            f"({CLUSTER_STREAM} with cluster: true)."
        ),
    ] = None
    maxlen: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc("Trim each stream to about this many entries (XADD MAXLEN ~); null: never trim."),
    ] = None
    timeout: Annotated[Duration, doc("Connect and socket read/write timeout.")] = Duration(5.0)
    index: Annotated[IndexOptions, doc("The optional block index.")] = msgspec.field(default_factory=IndexOptions)
    state: Annotated[StateOptions, doc("The optional live-block state (state bootstrap).")] = msgspec.field(
        default_factory=StateOptions
    )
    cluster: Annotated[bool, doc("url names a node of a Redis Cluster (redis.asyncio.RedisCluster).")] = False

    def __post_init__(self) -> None:
        # ValueError here becomes a ConfigError line naming the sink (msgspec wraps it).
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError("url: expected redis://host:port/db or rediss://host:port/db")
        redact_url(self.url)  # remembers a password inside the url: every log line, error and body hides it
        database = unquote(parts.path).strip("/")
        if database and not database.isdigit():  # (redis-py would use db 0)
            raise ValueError(f"url: the database {database!r} is not a number: redis://host:port/N")
        try:
            _database(self.url)
        except ValueError as exc:
            raise ValueError(f"url: {exc}") from None
        in_url = parts.password or any(k.lower() == "password" for k, _ in parse_qsl(parts.query))
        if in_url and self.password is not None:
            raise ValueError("url: give the password either in url or in password, not both")
        if self.tls is not None and parts.scheme != "rediss":
            raise ValueError("tls: only used with a rediss:// url")
        # redis-py lets url query options override the client's settings: ?ssl_cert_reqs=none
        # would turn off certificate verification silently, even with a tls block.
        ssl = sorted({k for k, _ in parse_qsl(parts.query) if k.lower().startswith("ssl")})
        if ssl:
            raise ValueError(
                f"url: {', '.join(ssl)} not allowed in the url (it would override the tls block; ssl_cert_reqs=none "
                "turns off certificate verification): remove it and set tls: {ca_file, cert_file, key_file, "
                "check_hostname} instead; the server's certificate is always verified"
            )
        if self.timeout <= 0:
            raise ValueError("timeout: must be greater than 0")
        stream, index, state = self.templates()
        for field, text in (("stream", stream), ("index.key", index), ("state.key", state)):
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
            if _ADJACENT.search(text):
                raise ValueError(
                    f"{field}: {text!r} puts {{source}} and {{dp_rank}} side by side: source 'llama1' rank 2 and "
                    "source 'llama' rank 12 would share one key, and one key must not mix two engine streams; "
                    f"put a separator between them, e.g. {DEFAULT_STREAM if field == 'stream' else DEFAULT_INDEX_KEY}"
                )
        banned = [f"{{{p}}}" for p in ("type", "epoch") if p in Template(index).fields]
        if self.index.enabled and banned:
            raise ValueError(
                f"index.key: {' and '.join(banned)} not allowed: one set holds the blocks of an engine "
                "for its whole life, and a SourceReset must empty that same set"
            )
        for text, field in ((state, "state.key"), (stream, "stream")):
            banned = [f"{{{p}}}" for p in ("type", "epoch") if p in Template(text).fields]
            if self.state.enabled and banned:
                raise ValueError(
                    f"{field}: {' and '.join(banned)} not allowed with state.enabled: a consumer bootstraps from one "
                    "hash, then follows the engine stream's messages in one stream key"
                )
        keys = [("stream", stream)] + [
            (f, t)
            for f, t, on in (
                ("index.key", index, self.index.enabled),
                (_COUNTS_FIELD, index + ":counts", self.index.enabled),
                ("state.key", state, self.state.enabled),
            )
            if on
        ]
        for n, (field, text) in enumerate(keys):
            same = next((f for f, t in keys[:n] if t == text), None)  # (renders alike for every stream; see conflicts)
            if same is not None and field == _COUNTS_FIELD:
                raise ValueError(
                    f"index.key: {index!r} keeps its counts in {text!r}, the {same} template: one key holds one type "
                    f"(a stream, a set, a hash); give index.key or {same} another key"
                )
            if same is not None:
                raise ValueError(
                    f"{field}: {text!r} is the {same} template too: one key holds one type (a stream, a set, a hash); "
                    f"give it a key of its own, e.g. {field}: "
                    f"{DEFAULT_INDEX_KEY if field == 'index.key' else DEFAULT_STATE_KEY!r}"
                )
        for enabled, other, field, default in (
            (self.index.enabled, index, "index.key", CLUSTER_INDEX_KEY),
            (self.state.enabled, state, "state.key", CLUSTER_STATE_KEY),
        ):
            if not (self.cluster and enabled):
                continue
            for sample in _SAMPLES:
                s, i = Template(stream).render(sample), Template(other).render(sample)
                if internals.key_slot(s) != internals.key_slot(i):
                    raise ValueError(
                        f"{field}: in a cluster the stream {s!r} and {i!r} must hash to one slot (one script "
                        f"writes both); wrap the shared part in a hash tag, e.g. stream: {CLUSTER_STREAM!r} and "
                        f"{field}: {default!r}"
                    )

    def templates(self) -> tuple[str, str, str]:
        """The stream, index and state key templates, defaults resolved."""
        stream = self.stream or (CLUSTER_STREAM if self.cluster else DEFAULT_STREAM)
        index = self.index.key or (CLUSTER_INDEX_KEY if self.cluster else DEFAULT_INDEX_KEY)
        state = self.state.key or (CLUSTER_STATE_KEY if self.cluster else DEFAULT_STATE_KEY)
        return stream, index, state

    def __repr__(self) -> str:
        # The default Struct repr would print the url as given, with a password inside it.
        return (
            f"RedisOptions(url={redact_url(self.url)!r}, username={self.username!r}, password={self.password!r}, "
            f"stream={self.stream!r}, cluster={self.cluster!r}, index={self.index!r}, state={self.state!r})"
        )


def _sample(source: str, dp_rank: int, type_: str) -> Message:
    return sample_message(Stream(source, dp_rank), type_, epoch=1)


def _sample_of(stream: Stream) -> Message:
    """A message of ``stream`` to render its key with (the template names no type or epoch)."""
    return sample_message(stream)


_SAMPLES = [
    _sample(src, rank, t)
    for src, rank in (("a", 0), ("llama-b", 3))
    for t in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "EventBatch", "SourceReset", "EventsLost")
]


# -- the block index ----------------------------------------------------------------------------


class IndexDelta(NamedTuple):
    """A message's change to its engine's block index: ``clear`` first (the set and its counts
    emptied), then per copy (member, count field, step, floor): the copy's count ``c`` becomes
    ``max(c + step, floor)``."""

    clear: bool
    changes: list[tuple[str, str, int, int]]

    def args(self) -> list[str | int]:
        """The write script's arguments: the clear flag, the number of copies, each copy's four."""
        return ["1" if self.clear else "0", len(self.changes), *(x for c in self.changes for x in c)]


def index_delta(events: Iterable[Event], hash_hex: bool = False, *, clear: bool = False) -> IndexDelta:
    """The change ``events`` make to the index, in order.

    A copy is a block in one (medium, group_idx), counted like the engine does: vLLM does not
    de-duplicate cached blocks and removes one copy per ``BlockRemoved``, so two stores and one
    removal leave one copy, and a removal from one medium leaves the block's other copies; a
    removal of an absent copy changes nothing. A block is a member while any copy of it is held.
    Members: decimal text of integer hashes (``hex64`` with ``hash_hex``), lowercase hex of binary
    hashes, text hashes as they are. For each copy, ``step`` is the sum of its +1s and -1s and
    ``floor`` the count they leave from 0 (never below 0 on the way): from any count ``c`` they
    leave ``max(c + step, floor)``. Applying the delta equals applying the events one by one.
    """
    walks: dict[tuple[str, str], list[int]] = {}  # (member, count field) -> [step, floor]
    for event in events:
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            clear = True
            walks.clear()
            continue
        if kind not in ("BlockStored", "BlockRemoved"):
            continue
        hashes = event.get("block_hashes")
        if not isinstance(hashes, list | tuple):
            continue
        d = 1 if kind == "BlockStored" else -1
        tier = f"c:{_tier_text(event.get('medium'))}:{_tier_text(event.get('group_idx'))}:"
        for h in hashes:
            member = _member(h, hash_hex)
            walk = walks.setdefault((member, tier + member), [0, 0])
            walk[0] += d
            walk[1] = max(walk[1] + d, 0)
    return IndexDelta(clear, [(m, f, step, floor) for (m, f), (step, floor) in walks.items()])


def _tier_text(value: Any) -> str:
    """A medium or group in a count field: '-' when not sent; ':' escaped (the field's separator)."""
    return "-" if value is None else str(value).replace("%", "%25").replace(":", "%3A")


def _member(h: Any, hash_hex: bool) -> str:
    if isinstance(h, bytes | bytearray | memoryview):
        return bytes(h).hex()
    if isinstance(h, int) and not isinstance(h, bool):
        return hex64(h) if hash_hex else str(h)
    return str(h)


# -- the write script ---------------------------------------------------------------------------

# One call per engine stream and write. KEYS: the stream keys the call writes, then (index mode)
# the block set and its counts hash, then (state) the hash. ARGV: maxlen ('' for none), '1' in
# index mode, the engine stream's source and dp_rank, '1' with state, the number of stream keys the
# connector stored in before and per key its number in KEYS and the last id stored there, the
# state's '_at' and '_gen' the connector last wrote ('' when none), then per entry: the number of
# its key in KEYS, its id, the number of fields, the fields, and in index mode its index change
# (IndexDelta.args: clear flag, number of copies, per copy member, count field, step, floor).
# Returns one result per entry tried: 1 stored, 0 already there (a re-send, or below a trimmed
# head), or the error line; it stops after the first error that is not the
# entry's own (WRONGTYPE, OUT_OF_ORDER), so nothing later of the stream is stored.
#
# Per entry, in this order: (1) is it new? Its key's top entry (read once per key and call, then
# followed as entries are added) decides without writing: an id at or below the top is a re-send
# (or out of order) and changes nothing; (2) a new entry's index change; (3) its XADD. A command
# that fails aborts the script (its earlier effects stay): an entry is then either stored with
# its index change, or not stored, with its index change applied in part, in full or not at all.
# The retry writes the stream again from that entry: still new, its index change is applied again
# to the same result (see change: the counts move in one HSET with the entry's id, the members
# follow the counts), then its XADD. The top entry also names its engine
# stream (its first fields): a key whose top entry belongs to another engine stream is a key
# collision (KEY_COLLISION), the stream stops there. Redis checks maxmemory at a script's first
# write only, if that command may grow memory: the first write is always SADD, HSET or XADD (see
# first_write), so either it is refused and nothing is written, or every entry is stored.
# Before anything, what the connector stored before must still be there (I6): a stream key whose
# top entry is below the last id stored there makes the call write nothing and return SINK_LOST
# with each such key and its top id ('' for none); a state hash without the last '_at' written
# (or a later one of that generation) is emptied and its change refused (STATE_LOST).
WRITE_SCRIPT = """
local function compare(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if am == bm then
    am, bm = as, bs
  end
  if am == bm then
    return 0
  elseif #am ~= #bm then
    return #am < #bm and -1 or 1
  end
  return am < bm and -1 or 1
end
local set, counts, hash = nil, nil, nil
if ARGV[5] == '1' then
  hash = KEYS[#KEYS]
end
-- What the bridge stored before (I6): each stream key's top entry must still be at or above the
-- last id the connector stored there; a restart from an older snapshot or without persistence, or
-- a deleted key, lost entries it acknowledged. Checked before anything is written.
local nheld = tonumber(ARGV[6])
local lost = {}
for j = 1, nheld do
  local key, want = KEYS[tonumber(ARGV[5 + 2 * j])], ARGV[6 + 2 * j]
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'stream' or kind == 'none' then
    local held = ''
    if kind == 'stream' then
      local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
      if #last > 0 then
        held = last[1][1]
      end
    end
    if held == '' or compare(held, want) < 0 then
      lost[#lost + 1] = key
      lost[#lost + 1] = held
    end
  end
end
if #lost > 0 then
  return {'SINK_LOST', unpack(lost)}
end
local want_at, want_gen = ARGV[7 + 2 * nheld], ARGV[8 + 2 * nheld]
if ARGV[2] == '1' then
  counts = KEYS[#KEYS - (hash and 1 or 0)]
  set = KEYS[#KEYS - (hash and 2 or 1)]
  for _, k in ipairs({{set, 'set'}, {counts, 'hash'}}) do
    local kind = redis.call('TYPE', k[1])['ok']
    if kind ~= 'none' and kind ~= k[2] then
      return redis.error_reply('WRONGTYPE index key ' .. k[1] .. ' holds a ' .. kind .. ', not a ' .. k[2])
    end
  end
end
local tops = {}
local function top(key)
  local t = tops[key]
  if t then
    return t
  end
  t = {}
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'stream' then
    local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
    if #last > 0 then
      t.id = last[1][1]
      local f = last[1][2]
      if f[1] == 'source' and f[3] == 'dp_rank' and (f[2] ~= ARGV[3] or f[4] ~= ARGV[4]) then
        t.err = 'KEY_COLLISION the stream key ' .. key .. ' of engine stream ' .. ARGV[3] .. '/' .. ARGV[4]
          .. ' holds entries of engine stream ' .. f[2] .. '/' .. f[4]
      end
    end
  elseif kind ~= 'none' then
    t.err = 'WRONGTYPE key ' .. key .. ' holds a ' .. kind .. ', not a stream'
  end
  tops[key] = t
  return t
end
-- Redis checks maxmemory at a script's first write only, and only if that command is one it
-- refuses near maxmemory (SADD, XADD; not DEL or SREM): a write never starts with DEL or SREM.
local written = false
local function first_write(member)
  if not written then
    redis.call('SADD', set, member)
    written = true
  end
end
local function chunked(command, key, items)
  local first = 1
  while first <= #items do
    local upto = math.min(first + 999, #items)
    redis.call(command, key, unpack(items, first, upto))
    written = true
    first = upto + 1
  end
end
-- An entry's index change: the clear flag, then per copy (member, its count field, step, floor):
-- the copy's count c becomes max(c + step, floor), which is applying the entry's stores (+1) and
-- removals (-1, never below 0) of that copy in order. The counts and the members' totals are set
-- in one HSET with '_at' (the entry's id), so a retry after a failure later in the script finds
-- the change applied and does not count it twice; a change with a clear starts from nothing, so
-- applying it again gives the same counts. Then each member is in the set iff its total is above 0.
local function change(clear, at, id)
  local applied = false
  if clear then
    first_write('0')
    redis.call('DEL', set, counts)
  else
    local done = redis.call('HGET', counts, '_at')
    applied = done and compare(done, id) >= 0
  end
  local n = tonumber(ARGV[at])
  local puts, zeros, members, totals = {}, {}, {}, {}
  for q = at + 1, at + 4 * n, 4 do
    local member, field = ARGV[q], ARGV[q + 1]
    local total = totals[member]
    if total == nil then
      members[#members + 1] = member
      total = tonumber(redis.call('HGET', counts, 't:' .. member) or '0')
    end
    if not applied then
      local c = tonumber(redis.call('HGET', counts, field) or '0')
      local new = math.max(c + tonumber(ARGV[q + 2]), tonumber(ARGV[q + 3]))
      if new ~= c then
        puts[#puts + 1] = field
        puts[#puts + 1] = new
        total = total + new - c
      end
    end
    totals[member] = total
  end
  if #puts > 0 then
    for _, member in ipairs(members) do
      puts[#puts + 1] = 't:' .. member
      puts[#puts + 1] = totals[member]
    end
    -- Redis checks maxmemory here if this is the script's first write (HSET may grow memory).
    local first = 1
    while first <= #puts do
      local upto = math.min(first + 1999, #puts)
      if upto == #puts then
        redis.call('HSET', counts, '_at', id, unpack(puts, first, upto))
      else
        redis.call('HSET', counts, unpack(puts, first, upto))
      end
      written = true
      first = upto + 1
    end
    for q = 1, #puts, 2 do
      if puts[q + 1] == 0 then
        zeros[#zeros + 1] = puts[q]
      end
    end
  end
  local adds, removes = {}, {}
  for _, member in ipairs(members) do
    if totals[member] > 0 then
      adds[#adds + 1] = member
    else
      removes[#removes + 1] = member
    end
  end
  chunked('SADD', set, adds)
  if #removes > 0 then
    first_write(removes[1])
  end
  chunked('SREM', set, removes)
  if #zeros > 0 then
    chunked('HDEL', counts, zeros)
  end
end
-- A record's state change: applied unless the hash already holds that record or a later one of
-- the same generation ('_at', '_gen'), so a re-sent change never undoes a later one. Its first
-- write is an HSET (refused near maxmemory before anything is changed); '_at' is set last, so a
-- change that fails midway is applied again, whole and in order, by the retry.
local function state(p)
  local clear, at, gen = ARGV[p + 1] == '1', ARGV[p + 2], ARGV[p + 3]
  local nd = tonumber(ARGV[p + 4])
  local puts = p + 5 + nd
  local np = tonumber(ARGV[puts])
  local head = ARGV[puts + 1 + 2 * np]
  local after = puts + 2 + 2 * np
  -- Checked here, not for the whole call: the stream's entries before it are written all the same.
  local kind = redis.call('TYPE', hash)['ok']
  if kind ~= 'none' and kind ~= 'hash' then
    return after, 'STATE_WRONGTYPE state key ' .. hash .. ' holds a ' .. kind .. ', not a hash'
  end
  local cur = redis.call('HMGET', hash, '_at', '_gen')
  if want_at ~= '' then
    -- The hash must still hold the bridge's last state write (or a later one of its generation),
    -- once per call: else it lost it (evicted, deleted, an older snapshot). Emptied, so that no
    -- partial state stays marked complete; the state is written again as a new generation. A
    -- clear builds on nothing: it writes the whole state.
    if not clear and (not cur[1] or cur[2] ~= want_gen or compare(cur[1], want_at) < 0) then
      -- Left alone when another writer (the next pod of a rolling update) moved it to a later generation.
      if not (cur[2] and tonumber(cur[2]) > tonumber(want_gen)) then
        redis.call('UNLINK', hash)
      end
      return after, 'STATE_LOST state key ' .. hash .. ' holds ' .. (cur[1] or 'nothing') .. ' of generation '
        .. (cur[2] or '-') .. ' where the bridge wrote ' .. want_at .. ' of generation ' .. want_gen
    end
    want_at = ''
  end
  if cur[1] and cur[2] == gen and compare(at, cur[1]) <= 0 then
    return after, 0
  end
  redis.call('HSET', hash, '_w', '1')
  written = true
  if clear then
    redis.call('UNLINK', hash)
  end
  local first, last = p + 5, p + 4 + nd
  while first <= last do
    local upto = math.min(first + 999, last)
    redis.call('HDEL', hash, unpack(ARGV, first, upto))
    first = upto + 1
  end
  first, last = puts + 1, puts + 2 * np
  while first <= last do
    local upto = math.min(first + 1999, last)
    redis.call('HSET', hash, unpack(ARGV, first, upto))
    first = upto + 1
  end
  redis.call('HSET', hash, '_head', head, '_gen', gen, '_at', at)
  redis.call('HDEL', hash, '_w')
  return after, 1
end
local out = {}
local p = 9 + 2 * nheld
while p <= #ARGV do
  if ARGV[p] == '0' then
    local after, result = state(p)
    out[#out + 1] = result
    if type(result) == 'string' then
      return out
    end
    p = after
  else
    local key, id, n = KEYS[tonumber(ARGV[p])], ARGV[p + 1], tonumber(ARGV[p + 2])
    local xadd = {key}
    if ARGV[1] ~= '' then
      xadd = {key, 'MAXLEN', '~', ARGV[1]}
    end
    xadd[#xadd + 1] = id
    for i = p + 3, p + 2 + n do
      xadd[#xadd + 1] = ARGV[i]
    end
    p = p + 3 + n
    local clear, at = false, nil
    if set then
      clear, at = ARGV[p] == '1', p + 1
      p = at + 1 + 4 * tonumber(ARGV[at])
    end
    local t = top(key)
    local result = 1
    if t.err then
      result = t.err
    elseif t.id and compare(id, t.id) <= 0 then
      result = 0
      if id ~= t.id then
        local below = redis.call('XREVRANGE', key, id, '-', 'COUNT', 1)
        if #below > 0 and below[1][1] ~= id then
          result = 'OUT_OF_ORDER entry ' .. id .. ' is below the top of ' .. key .. ' but not in it'
        end
      end
    else
      if set then
        change(clear, at, id)
      end
      local added = redis.pcall('XADD', unpack(xadd))
      written = true
      if type(added) == 'table' and added['err'] then
        result = added['err']
        if string.find(result, 'equal or smaller', 1, true) then
          result = 'OUT_OF_ORDER entry ' .. id .. ' is above the top of ' .. key .. ' but not above its last id (entries deleted)'
        end
      else
        t.id = id
      end
    end
    out[#out + 1] = result
    if type(result) == 'string' and not string.find(result, '^WRONGTYPE') and not string.find(result, '^OUT_OF_ORDER') then
      return out
    end
  end
end
return out
"""

_WRITE_PROBE = "#!lua\nreturn 1"
"""A script Redis 7 takes for one that may write (a shebang without ``no-writes``): a read-only
replica refuses it (READONLY) without its running; a primary runs it, and it writes nothing."""

# Server error codes that an operator or time heals: retried, never dead-lettered.
_TRANSIENT: dict[str, tuple[str, float | None]] = {
    "OOM": ("oom", None),  # consumers trimming or a raised maxmemory heal it; backpressure holds the data
    # RDB or AOF writes failing (a full disk, an unwritable dir): refused until an operator fixes the disk
    "MISCONF": ("misconf", None),
    "NOPERM": ("no_permission", None),  # an ACL mistake an operator fixes
    "BUSY": ("busy", None),
    "LOADING": ("loading", 1.0),
    "NOREPLICAS": ("noreplicas", None),
    **{code: ("cluster", 0.5) for code in ("TRYAGAIN", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "MOVED", "ASK")},
    "KEY_COLLISION": ("key_collision", None),  # two engine streams render one key: the template needs fixing
    "STATE_WRONGTYPE": ("state_key_type", None),  # the state key holds something else: an operator fixes it
    "CROSSSLOT": ("cluster", None),  # a Redis Cluster node written as a single server: cluster: true fixes it
}
# An ACL refusal, however it reaches us: NOPERM from a command, "ERR The user executing the script
# can't run this command or subcommand" / "... can't access at least one of the keys ..." from a
# command inside a script (Redis 6.2 and 7.0; 7.2 says "NOPERM User x has no permissions to run
# ..."), with or without the code (redis-py strips "ERR " and "NOPERM " from an error reply).
_ACL_REFUSAL = re.compile(r"\bNOPERM\b|can't run this command|can't access at least one of the keys|no permissions", re.I)
# redis-py strips the code from the message of these; put it back to classify one way.
_CODES = (
    (OutOfMemoryError, "OOM"),
    (NoPermissionError, "NOPERM"),
    (ReadOnlyError, "READONLY"),
    (TryAgainError, "TRYAGAIN"),
    (ClusterDownError, "CLUSTERDOWN"),
    (AskError, "MOVED"),
    (ClusterCrossSlotError, "CROSSSLOT"),
)
# Refusals of a whole script call that no entry caused for itself: retried.
_CALL_REFUSALS = (
    (re.compile(r"Script killed by user", re.I), "script_killed", "an operator's SCRIPT KILL: the call is made again"),
    (
        re.compile(r"^Protocol error", re.I),
        "protocol",
        "the server refused the call's framing, e.g. proto-max-bulk-len lowered since connect: read again, retried",
    ),
    (
        re.compile(r"unknown command|Unknown Redis command", re.I),
        "unknown_command",
        "the server does not run a command the sink needs (renamed or disabled by rename-command or a managed "
        "service): allow EVAL and, inside it, XADD, XREVRANGE, TYPE, HSET, HGET, HMGET, HDEL, SADD, SREM, DEL and UNLINK",
    ),
)
_MAX_BULK = 512 * 1024 * 1024  # Redis's default proto-max-bulk-len
_MAX_QUERY = 1024 * 1024 * 1024  # and client-query-buffer-limit
_SETTINGS = (
    "proto-max-bulk-len",
    "client-query-buffer-limit",
    "appendonly",
    "maxmemory-policy",
    "min-replicas-to-write",
)
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._:-]")
_KEYS_PER_STREAM = 64


_BELOW_TOP = b" is below the top of "  # (WRITE_SCRIPT's OUT_OF_ORDER for an id below the top and absent)


class _Call:
    """The script call of one engine stream in a write: its keys, arguments and message indexes."""

    def __init__(self, maxlen: str, index_key: str | None, state_key: str | None, stream: Stream) -> None:
        self.keys: list[str] = []
        self.head: list[str | bytes | int] = [
            maxlen,
            "1" if index_key else "0",
            stream.source,
            str(stream.dp_rank),
            "1" if state_key else "0",
        ]
        self.args: list[str | bytes | int] = []  # per entry and state change
        self.indexes: list[int] = []
        # Per index, in order: (stream key, entry id) of an entry, (None, (at, generation)) of a state change.
        self.items: list[tuple[str | None, Any]] = []
        self.index_key = index_key
        self.state_key = state_key
        self.stream = stream
        self.announces: dict[str, tuple[int, int]] = {}  # entry id of an EventsLost -> the seqs it announces
        self.lost: set[str] = set()  # entry ids of the EventsLost of the engine's gaps and of this sink's refusals

    def add(self, i: int, key: str, ident: str, fields: list[str | bytes]) -> None:
        if key not in self.keys:
            self.keys.append(key)
        self.args += [self.keys.index(key) + 1, ident, len(fields), *fields]
        self.indexes.append(i)
        self.items.append((key, ident))

    def add_state(self, i: int, args: list[str | bytes | int]) -> None:
        """A record's state change (see state_args), after its entries."""
        self.args += args
        self.indexes.append(i)
        self.items.append((None, (args[2], args[3])))

    def command(self, held: dict[str, str], written: dict[str, tuple[str, str]]) -> list[str | bytes | int]:
        """The EVAL, with the last id stored in each of its stream keys (``held``) and the state
        last written (``written``) for the script to check (I6)."""
        counts = self.index_key + ":counts" if self.index_key else None
        keys = [*self.keys, *(k for k in (self.index_key, counts, self.state_key) if k)]
        expect: list[str | bytes | int] = []
        for n, key in enumerate(self.keys, 1):
            if key in held:
                expect += [n, held[key]]
        at, gen = written.get(self.state_key, ("", "")) if self.state_key else ("", "")
        return ["EVAL", WRITE_SCRIPT, len(keys), *keys, *self.head, len(expect) // 2, *expect, at, gen, *self.args]


def state_args(m: Message, fmt: StateFormat, max_bulk: int = _MAX_BULK) -> list[str | bytes | int]:
    """The script's arguments for the state change of ``m``'s record (a STATE_TYPE message):
    ``0``, the clear flag, its position as an entry id (``_at``), its generation, the fields to
    delete, the fields to set with their documents, the head. The head's ``next`` is that same id:
    every entry of the record is at or below it, every later one above. A document over the
    server's ``proto-max-bulk-len`` (``max_bulk``: a block of a huge prompt's token ids) would make
    the server refuse the whole call, for ever: it is written without its fact, as Kafka and NATS
    write it (the count and version are the state; the fact only describes the block)."""
    delta: StateDelta = m.record.state
    stream, head = delta.stream, delta.head
    at = entry_id(m.position)
    deletes: list[str | bytes | int] = []
    puts: list[str | bytes | int] = []
    for c in delta.changes:
        field = entry_key(c.medium, c.group_idx, c.block)
        if c.count > 0:
            doc = fmt.entry(stream, head, c)
            if len(doc) > max_bulk:
                doc = fmt.entry(stream, head, msgspec.structs.replace(c, fact=None))
            puts += [field, doc]
        else:
            deletes.append(field)
    return [
        0,
        "1" if delta.clear else "0",
        at,
        str(head.generation),
        len(deletes),
        *deletes,
        len(puts) // 2,
        *puts,
        fmt.head(stream, head, at),
    ]


# -- what the ACL user may run ------------------------------------------------------------------

# The commands the sink runs on each kind of key (WRITE_SCRIPT, audit, positions, read_state), each
# with the arguments after the key that let the server find the key in it.
_STREAM_COMMANDS = (("TYPE",), ("XREVRANGE", "+", "-", "COUNT", "1"), ("XADD", "*", "f", "v"))
_SET_COMMANDS = (("TYPE",), ("SADD", "m"), ("SREM", "m"), ("DEL",))
_COUNTS_COMMANDS = (("TYPE",), ("HGET", "f"), ("HSET", "f", "v"), ("HDEL", "f"), ("DEL",))
_STATE_COMMANDS = (("TYPE",), ("HMGET", "f"), ("HSET", "f", "v"), ("HDEL", "f"), ("UNLINK",), ("HGET", "f"), ("HSCAN", "0"))
_KEY_KINDS = {"stream": "stream key", "index.key": "index key", "state.key": "state key"}
_PROBES_PER_CALL = 1000  # permission probes per EVAL (the calls go in one pipeline)
_KEYS_NAMED = 10  # refused keys a permission error names (it counts the rest)
# Whether the connection's ACL user may run each probe (ARGV: per probe its number of words, then
# the words: a command, maybe a key and arguments), by redis.acl_check_cmd (Redis 7.0+), which needs
# no permission beyond EVAL and touches no key: the numbers (from 1) of the probes refused, negative
# for a command the server does not know (renamed or disabled); nil where the server cannot tell.
PERMISSIONS_SCRIPT = """
if not redis.acl_check_cmd then
  return nil
end
local refused, i, n = {}, 1, 0
while i <= #ARGV do
  local size = tonumber(ARGV[i])
  n = n + 1
  local ok, allowed = pcall(redis.acl_check_cmd, unpack(ARGV, i + 1, i + size))
  if not ok then
    refused[#refused + 1] = -n
  elseif not allowed then
    refused[#refused + 1] = n
  end
  i = i + 1 + size
end
return refused
"""


# -- the connector ------------------------------------------------------------------------------


class RedisConnector:
    """Writes messages to Redis Streams (see the module docstring for layout and semantics)."""

    Options: ClassVar[type[msgspec.Struct]] = RedisOptions
    whole_batches: ClassVar[bool] = True
    """Each write is one script call: a batch's entries are stored, and lost, all or none."""

    def __init__(self, name: str, options: RedisOptions, sink: SinkConfig) -> None:
        """Prepare templates and client settings; no I/O."""
        self.name = name
        self.options = options
        stream, index, state = options.templates()
        self._stream = Template(stream, "stream")
        self._index = Template(index, "index.key") if options.index.enabled else None
        # (the index's counts hash: a key of its own, beside the set)
        self._counts = Template(index + ":counts", "index.key") if options.index.enabled else None
        self._state = Template(state, "state.key") if options.state.enabled else None
        self._state_format = StateFormat.for_sink(sink)
        self._granularity = sink.granularity
        self.writes_state = self._state is not None
        # the block index and the state read the events, even of raw batches
        self.needs_events = self._index is not None or self.writes_state
        self.configured_streams: list[Stream] = []  # --check: their keys are checked against the ACL user's
        self.known_streams: list[Stream] = []  # run and --check: their keys' types are checked at connect
        self._clear_on_lost = options.index.on_events_lost == "clear"
        self._hash_hex = sink.hash_format == "hex"
        self._raw = sink.format == "raw"
        self._maxlen = str(options.maxlen) if options.maxlen else ""
        self._prefix = f"sinks[{name}]"
        self._server = redact_url(options.url)
        self._server_at = _server_place(options.url)  # (places, marks)
        # A stream template with {type} or {epoch} spreads a stream over keys: where it stands
        # cannot be read back (positions), nor kept in a mark (stored_through).
        self._spread = any(f in self._stream.fields for f in ("type", "epoch"))
        self._client: aioredis.Redis | aioredis.RedisCluster | None = None
        # Which engine stream each rendered key (stream or index) belongs to, and each stream's
        # keys, latest last: at most _KEYS_PER_STREAM per stream (a template with {epoch} renders
        # new keys as epochs go by), so bounded by the number of streams.
        self._owners: dict[str, str] = {}
        self._fields: dict[str, str] = {}  # rendered key -> the template that rendered it first (see _claim)
        self._keys: dict[str, dict[str, None]] = {}
        self._streams: dict[str, Stream] = {}  # the engine streams of _keys
        self._max_bulk: int | None = None  # the longest argument the server takes (None: read it again)
        self._max_bulk_by = "proto-max-bulk-len"  # the setting that sets it
        self._min_replicas = 0  # the server's min-replicas-to-write (0: off, or CONFIG not allowed)
        # What this connector stored, checked by the script before it builds on it (I6): the last
        # entry id stored in each stream key (keys bounded like _keys), the (_at, _gen) last written
        # to each state key, and per state key the generation whose state Redis lost (its changes
        # still queued are not written: the runtime opens a new generation).
        self._held: dict[str, str] = {}
        # per stream key, the last id stored in each of the epochs before (oldest first, at most
        # EPOCHS_REMEMBERED - 1: with the last one, EPOCHS_REMEMBERED epochs)
        self._held_before: dict[str, list[str]] = {}
        # per stream key, the EventsLost entries stored in it, newest last (at most
        # EPOCHS_REMEMBERED): (entry id, from_seq, to_seq), announced again when Redis loses them
        self._held_announces: dict[str, list[tuple[str, int, int]]] = {}
        self._written: dict[str, tuple[str, str]] = {}
        # Streams positions() found with an empty stream key, or none while their state hash or
        # index set exists: their entries were deleted (announced at start by the runtime).
        self.records_gone: set[str] = set()
        # per stream key whose _held an earlier run's checkpoint gave (stored_before): (epoch, seq)
        # where its stream resumed, the entries after it being written again (not announced lost)
        self._resent: dict[str, tuple[int, int]] = {}
        self._state_lost: dict[str, int] = {}
        self._warned: set[str] = set()  # durability problems logged (see _warn_durability)

    def __repr__(self) -> str:
        return f"<RedisConnector {self.name!r} {self._server}>"

    def _connection(self) -> aioredis.Redis | aioredis.RedisCluster:
        if self._client is not None:
            return self._client
        o = self.options
        kwargs: dict[str, Any] = {
            "socket_timeout": float(o.timeout),
            "socket_connect_timeout": float(o.timeout),
            # Retries with backoff belong to the runtime; redis-py's own would multiply every
            # timeout and hide outages from readiness and metrics.
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": False,
            "client_name": "kv-event-bridge." + _NAME_CHARS.sub("_", self.name),
        }
        if o.username is not None:
            kwargs["username"] = o.username
        if o.password is not None:
            kwargs["password"] = reveal(o.password)
        if o.tls is not None:
            kwargs.update(
                ssl_ca_certs=o.tls.ca_file,
                ssl_certfile=o.tls.cert_file,
                ssl_keyfile=o.tls.key_file,
                ssl_check_hostname=o.tls.check_hostname,
                ssl_cert_reqs="required",
            )
        if o.cluster:
            self._client = aioredis.RedisCluster.from_url(o.url, **kwargs)
        else:
            self._client = client = aioredis.Redis.from_url(o.url, **kwargs)
            internals.pack_in_one_pass(client)  # cluster clients keep redis-py's packer
        return self._client

    # -- hooks ------------------------------------------------------------------------------
    async def connect(self) -> None:
        """PING the server, run a script that does nothing (every write is one: an ACL or a
        renamed command that forbids it is found here, and so by ``--check``), ask whether the
        user may run what the writes run (:meth:`_check_permissions`), refuse a key of the known
        streams that holds another type than the writes need (:meth:`_check_key_types`), refuse a replica,
        then read the settings the writes depend on (see :meth:`_read_settings`), and refuse a
        primary with too few good replicas for its ``min-replicas-to-write`` (see
        :meth:`_replicas_short`); NotConnected naming the sink, the server and the cause if any of
        it fails."""
        try:
            await self._connection().ping()
            await self._connection().eval("return 1", 0)
            await self._check_permissions()
            await self._check_key_types()
            await self._check_role()
            await self._check_server_state()
            settings = await self._read_settings()
            short = await self._replicas_short()
        except (RedisError, RedisClusterException, OSError) as exc:
            error = self._classify(exc, f"cannot connect to {self._server}")
            raise NotConnected(str(error), reason=error.reason) from None
        if short is not None:
            raise NotConnected(f"{self._prefix}: {short}", reason="noreplicas")
        log.info("redis sink connected", extra={"sink": self.name, "server": self._server})
        if self._state is not None:
            self._warn_durability(settings)

    async def _check_role(self) -> None:
        """A replica answers PING and runs a read-only script, but refuses every write (READONLY),
        or loses it at its next sync when it is writable: refused at connect (and so by
        ``--check``), naming the fix. A server that does not allow ROLE (an ACL such as the one the
        docs recommend, ``-@dangerous``; a managed service) is asked to run a script that may
        write (``_WRITE_PROBE``: it writes nothing): a read-only replica refuses it. A writable
        replica goes unseen then. A cluster's nodes are found by the client."""
        if self.options.cluster:
            return
        try:
            role: Any = await self._connection().execute_command("ROLE")
        except ResponseError:
            try:
                await self._connection().eval(_WRITE_PROBE, 0)
            except ResponseError as exc:  # (an older Redis cannot parse the flags line: it cannot tell)
                if isinstance(exc, ReadOnlyError) or "read only replica" in str(exc):
                    raise NotConnected(
                        f"{self._prefix}: {self._server} is a read-only replica, not a primary (it refuses a script that "
                        "may write: READONLY): it refuses every write of the sink; point url at the primary",
                        reason="replica",
                    ) from None
            return
        name = _text(role[0]) if role else "master"
        if name != "master":
            raise NotConnected(
                f"{self._prefix}: {self._server} is a {name}, not a primary (ROLE): it refuses the sink's writes "
                "(READONLY) or loses them at its next sync; point url at the primary",
                reason="replica",
            )

    async def _check_server_state(self) -> None:
        """Refused at connect (and so by ``--check``), naming the fix: a Redis Cluster node written
        as a single server (``cluster: false``: a script over the state's keys and the stream's
        gets CROSSSLOT), and a server over its ``maxmemory`` that evicts nothing (every write gets
        OOM until memory is freed). A server that does not allow INFO (an ACL, a managed service)
        is left to its first write."""
        try:
            cluster: Any = None if self.options.cluster else await self._connection().info("cluster")
            memory: Any = await self._connection().info("memory")
        except ResponseError:
            return
        if cluster and int(cluster.get("cluster_enabled", 0) or 0):
            raise NotConnected(
                f"{self._prefix}: {self._server} is a Redis Cluster node (cluster_enabled:1), but the sink has cluster: "
                "false: set cluster: true (a single-server client's scripts get CROSSSLOT over the sink's keys)",
                reason="cluster",
            )
        limit, used = int(memory.get("maxmemory", 0) or 0), int(memory.get("used_memory", 0) or 0)
        policy = str(memory.get("maxmemory_policy", ""))
        if limit <= 0 or used < limit or not (policy == "noeviction" or policy.startswith("volatile-")):
            return
        if policy.startswith("volatile-"):  # evicts only keys with a TTL: nothing, when none has one
            try:
                keyspace: Any = await self._connection().info("keyspace")
            except ResponseError:
                return
            if any(int(db.get("expires", 0) or 0) for db in keyspace.values() if isinstance(db, dict)):
                return
        raise NotConnected(
            f"{self._prefix}: {self._server} is over its maxmemory ({used} of {limit} bytes) and evicts nothing "
            f"({policy}{', and no key has a TTL' if policy != 'noeviction' else ''}): every write is refused (OOM) "
            "until memory is freed (consumers trimming, or a raised maxmemory)",
            reason="oom",
        )

    async def _replicas_short(self) -> str | None:
        """Why the primary refuses every write now for want of replicas: its ``min-replicas-to-write``
        (read at connect, and again by each health check) above ``min_slaves_good_slaves`` in ``INFO replication`` (the replicas
        that acknowledged within ``min-replicas-max-lag``; shown only while both are set), so a
        write would get NOREPLICAS. None when it has enough, or it cannot tell: CONFIG or INFO not
        allowed (an ACL, a managed service), or a cluster (its nodes are the client's). One
        command, and none while min-replicas-to-write is off."""
        need = self._min_replicas
        if need <= 0 or self.options.cluster:
            return None
        try:
            info: Any = await self._connection().info("replication")
        except ResponseError:
            return None
        good = info.get("min_slaves_good_slaves") if isinstance(info, dict) else None
        if not isinstance(good, int) or good >= need:
            return None
        return (
            f"{self._server} refuses every write (NOREPLICAS): min-replicas-to-write is {need} and {good} replica(s) "
            "are connected and in sync (INFO replication, min_slaves_good_slaves); attach or repair a replica, "
            "or lower min-replicas-to-write"
        )

    def _warn_durability(self, settings: dict[str, str]) -> None:
        """One WARNING per problem and connector when the server may lose what the state is built
        on (README "Losses"), at connect or at a health check that finds it. Warned, not refused:
        the bridge notices such a loss at its next write and clears the state, and a managed Redis
        may not let the operator change these."""
        problems = []
        if settings.get("appendonly") == "no":
            problems.append(
                "runs without AOF (appendonly no): a restart keeps only the last RDB snapshot, if any, so "
                "entries and state it acknowledged are lost; set appendonly yes"
            )
        policy = settings.get("maxmemory-policy", "noeviction")
        if policy.startswith("allkeys-"):  # volatile-* evicts only keys with a TTL, and the bridge sets none
            problems.append(
                f"evicts keys at maxmemory (maxmemory-policy {policy}): a stream or state hash evicted is "
                "lost; set maxmemory-policy noeviction (writes are then refused with OOM and retried)"
            )
        for problem in problems:
            if problem not in self._warned:
                self._warned.add(problem)
                log.warning(
                    "%s: %s %s. The bridge announces such a loss (EventsLost, reason sink_lost) and the state "
                    "is incomplete until the engine's next reset",
                    self._prefix,
                    self._server,
                    problem,
                    extra={"sink": self.name, "server": self._server},
                )

    async def _read_settings(self) -> dict[str, str]:
        """The server's settings this sink depends on (``CONFIG GET``, one command per setting: Redis
        6 takes one pattern; in a cluster, one node's), and the longest argument it takes remembered
        (``proto-max-bulk-len``, and ``client-query-buffer-limit``): a longer one makes the server
        refuse the whole script call, or close the connection, so a longer entry is refused for
        itself before the call is sent. A server that
        does not allow CONFIG (an ACL, a managed service) keeps Redis's defaults."""
        client = self._connection()
        settings: dict[str, str] = {}
        for name in _SETTINGS:
            try:
                reply: Any = await client.config_get(name)
            except ResponseError:
                continue  # not allowed: Redis's default is assumed
            pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
            for k, v in pairs:
                settings[_text(k)] = _text(v)
        limits = [(_setting(settings, "proto-max-bulk-len", _MAX_BULK), "proto-max-bulk-len")]
        # An argument is read whole into the connection's query buffer (with its CRLF): over
        # client-query-buffer-limit, the server closes the connection instead of refusing it.
        limits.append((_setting(settings, "client-query-buffer-limit", _MAX_QUERY) - 2, "client-query-buffer-limit"))
        self._max_bulk, self._max_bulk_by = min(limits)
        self._min_replicas = _setting(settings, "min-replicas-to-write", 0)
        return settings

    async def health(self) -> str | None:
        """None when a PING is answered, the server is still a primary and lets the user run what
        the writes run (asked again: a failover demotes it, an operator revokes an ACL during the
        run; :meth:`_check_role`, :meth:`_check_permissions`), and the primary has the replicas its
        ``min-replicas-to-write`` asks for (its settings read again, :meth:`_read_settings`;
        :meth:`_replicas_short`: an INFO only while it is set), else a short reason: an idle sink
        shows what a write would meet before it does. Durability turned off during the run is
        warned about as at connect (:meth:`_warn_durability`)."""
        try:
            await self._connection().ping()
            await self._check_role()
            await self._check_permissions()
            if not self.options.cluster:
                settings = await self._read_settings()
                if self._state is not None:
                    self._warn_durability(settings)
            short = await self._replicas_short()
        except NotConnected as exc:
            return f"{exc.reason}: {exc}"
        except (RedisError, RedisClusterException, OSError) as exc:
            # A refusal (MISCONF, LOADING, NOPERM, ...) is an answer: say what the server said.
            what = "refuses PING" if isinstance(exc, ResponseError) else "does not answer"
            return str(self._classify(exc, f"{self._server} {what}"))
        return None if short is None else f"noreplicas: {self._prefix}: {short}"

    async def close(self) -> None:
        """Close the client's connections (redis-py bounds each close by ``timeout``); never raises."""
        client, self._client = self._client, None
        if client is None:
            return
        try:
            await client.aclose()
        except Exception as exc:  # closing is best effort: the process is leaving or reconnecting
            log.debug("redis sink close failed", extra={"sink": self.name, "error": str(exc)})

    async def write(self, messages: Sequence[Message]) -> None:
        """One pipeline with one script call per engine stream; returning means Redis holds every entry.

        Raises NotConnected / Retriable when the pipeline as a whole failed, else PartialFailure
        with each failed message's own error (see the module docstring).
        """
        errors: dict[int, ConnectorError] = {}
        calls: dict[object, _Call] = {}
        stopped: dict[str, ConnectorError] = {}  # engine streams stopped at a key collision in this write
        stops = Stops(self._prefix)  # engine streams with a message refused for itself: stopped at their next record
        if self._max_bulk is None:
            try:
                await self._read_settings()
            except (RedisError, RedisClusterException, OSError) as exc:
                raise self._classify(exc, "cannot read the server's settings") from None
        max_bulk = self._max_bulk or _MAX_BULK
        for i, m in enumerate(messages):
            stream = m.record.stream.key
            if stream not in stopped and (held := stops.past(m)) is not None:
                stopped[stream] = held
            if stream in stopped:  # nothing of a stream after its failed message
                errors[i] = stopped[stream]
                continue
            if m.type == STATE_TYPE:
                self._add_state(i, m, calls, errors, stopped)
                continue
            try:
                ident = entry_id(message_position(m))
            except ValueError as exc:
                errors[i] = Permanent(f"{self._prefix}: {exc}", reason="id_range")
                stops.refused(m)
                continue
            key = self._stream.render(m)
            index_key = self._index.render(m) if self._index else None
            collision = self._claim(m.record.stream, key, "stream")
            if collision is None and index_key is not None:
                collision = self._claim(m.record.stream, index_key, "index.key")
                collision = collision or self._claim(m.record.stream, index_key + ":counts", _COUNTS_FIELD)
            if collision is None and self._state is not None:  # (claimed before any entry is written)
                collision = self._claim(m.record.stream, self._state.render(m), "state.key")
            if collision is not None:
                errors[i] = stopped[stream] = collision
                continue
            group: object = (stream, _slot(key)) if self.options.cluster else stream
            call = calls.get(group)
            if call is None:
                state_key = self._state.render(m) if self._state else None
                call = calls[group] = _Call(self._maxlen, index_key, state_key, m.record.stream)
            value = m.value
            if len(value) > max_bulk:
                # The server would refuse the whole call (every entry of the stream in this write).
                errors[i] = Permanent(
                    f"{self._prefix}: entry {ident} of {key} is {len(value)} bytes, over what the server's "
                    f"{self._max_bulk_by} takes ({max_bulk} bytes): refused; raise {self._max_bulk_by} or keep "
                    "batches smaller at the engine",
                    reason="too_large",
                )
                stops.refused(m)
                continue
            fields: list[str | bytes] = [x for kv in m.headers.items() for x in kv]
            fields += ["payload" if self._raw and m.record.kind == "batch" else "data", value]
            call.add(i, key, ident, fields)
            if m.record.kind == "EventsLost" and (m.record.to_seq is None or refusal(m.record)):
                call.lost.add(ident)
            if m.record.kind == "EventsLost" and m.record.from_seq is not None and m.record.to_seq is not None:
                call.announces[ident] = (m.record.from_seq, m.record.to_seq)
            if self._index is not None:
                call.args += self._delta(m).args()
        if calls:
            pipe = self._connection().pipeline(transaction=False)
            for call in calls.values():
                pipe.execute_command(*call.command(self._held, self._written))
            try:
                replies = await pipe.execute(raise_on_error=False)
            except (RedisError, RedisClusterException, OSError) as exc:
                # The pipeline as a whole failed; what was stored is recognised by its id on retry.
                # A limit lowered since they were read makes the server close the connection at an
                # entry over it: read them again before the retry.
                self._max_bulk = None
                raise self._classify(exc) from None
            lost: list[SinkLost] = []
            for call, reply in zip(calls.values(), replies, strict=True):
                if isinstance(reply, list) and reply and reply[0] == b"SINK_LOST":
                    lost.append(self._sink_lost(call.stream, reply[1:]))
                    continue
                errors.update(self._results(call, reply))
            if lost:
                # Other streams' calls went through; the runtime writes them again (each entry then
                # found there), after announcing what the sink lost.
                raise _merged("; ".join(map(str, lost)), lost)
        if not errors:
            return
        if len(errors) == len(messages):  # one error for all: their shared cause, or the first transient one
            first = errors[min(errors)]
            if all(e is first for e in errors.values()) or not any(isinstance(e, Permanent) for e in errors.values()):
                raise first
        raise PartialFailure(errors)

    def conflicts(self, streams: Sequence[Stream]) -> list[str]:
        """What the configured ``streams`` make impossible (see bridge.connector): a key that two of
        the templates render (a stream key that is a stream's index set or state hash, labels
        included): one key holds one type, and every write to it would fail WRONGTYPE."""
        types = message_types(self._granularity)
        owner: dict[str, str] = {}
        lines = []
        fields = (
            ("stream", self._stream),
            ("index.key", self._index),
            (_COUNTS_FIELD, self._counts),
            ("state.key", self._state),
        )
        for field, template in fields:
            if template is None:
                continue
            for key in rendered(template.render, template, streams, types)[1:]:
                first = owner.setdefault(key, field)
                if first != field:
                    lines.append(
                        f"{field} and {first} both name key {key!r}: one key holds one type (a stream, a set, a hash); "
                        "give each a key of its own"
                    )
        return list(dict.fromkeys(lines))

    def places(self, streams: Sequence[Stream]) -> list[tuple[frozenset[str], str]]:
        """The keys it writes, on its server and database (see bridge.connector: two sinks may not
        share one)."""
        server = self._server_at
        types = message_types(self._granularity)
        templates = [t for t in (self._stream, self._index, self._counts, self._state) if t is not None]
        keys = [k for t in templates for k in rendered(t.render, t, streams, types)]
        return [(frozenset({server}), f"key {k!r}") for k in keys]

    async def positions(self, streams: Sequence[Stream]) -> dict[str, SinkPosition | None]:
        """The last entry of each stream's key (``checkpoint.from_sinks``): one ``XREVRANGE key + -
        COUNT 1`` per stream, all in one pipeline (per node in a cluster). A key that does not exist
        holds nothing, unless the stream's state hash or index set does (the stream key was deleted
        or expired, its entries with it): cannot tell, as for an empty stream key (its entries
        trimmed or deleted; both asked in a second pipeline, only for the keys found empty). A key
        template with ``{type}`` or ``{epoch}`` (a stream spread over keys), a key that is no stream
        or whose top entry is not the bridge's, cannot tell."""
        if self._spread:
            return {}
        keys = {s.key: self._stream.render(_sample_of(s)) for s in streams}
        pipe = self._connection().pipeline(transaction=False)
        for key in keys.values():
            pipe.execute_command("XREVRANGE", key, "+", "-", "COUNT", 1)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._classify(exc, "cannot read stream positions") from None
        out: dict[str, SinkPosition | None] = {}
        empty: list[Stream] = []
        for stream, reply in zip(streams, replies, strict=True):
            if isinstance(reply, BaseException):
                continue  # WRONGTYPE, ...: cannot tell
            if not reply:
                empty.append(stream)
                continue
            entry_id_, raw = reply[0]
            fields = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=True))
            if fields.get(b"source") != stream.source.encode() or fields.get(b"dp_rank") != str(stream.dp_rank).encode():
                continue
            try:
                held = SinkPosition.from_headers(
                    {k.decode(): v for k, v in fields.items() if k != b"payload"}, fields.get(b"payload")
                )
            except (ValueError, UnicodeDecodeError):
                continue
            if entry_position(entry_id_)[0] != held.epoch:
                continue  # not an id this connector wrote
            out[stream.key] = held
            self._held.setdefault(keys[stream.key], _text(entry_id_))  # checked at the next write (I6)
        if empty:
            unwritten, emptied = await self._unwritten(empty, keys)
            out.update(dict.fromkeys(unwritten))
            # A stream key that exists and is empty had its entries deleted (the bridge never
            # empties one: MAXLEN ~ keeps the newest). Where the stream resumes cannot be told by
            # it, but what it held is lost (the runtime reads records_gone: bridge.connector). A
            # key gone while the stream's state is there cannot tell: batches with no event leave
            # no entry at event granularity, and a key template may have changed.
            self.records_gone.update(emptied)
        return out

    def _one_key(self, stream: Stream) -> str | None:
        """The one key ``stream``'s messages go to, None when its template spreads it over keys
        (``{type}``, ``{epoch}``)."""
        if self._spread:
            return None
        return self._stream.render(_sample_of(stream))

    def _mark_crc(self, key: str) -> int:
        """What a mark of ``key`` on this server carries to name it (see place_crc)."""
        return place_crc([self._server_at], key)

    def stored_through(self, stream: Stream) -> tuple[int, ...] | None:
        """The mark of the last entry stored of ``stream`` (bridge.connector; the checkpoint keeps
        it for the next run's ``stored_before``), when its messages go to one key: that entry's
        position, the position of the last one of each epoch before (newest first), and a CRC-32
        of the key and the server (place_crc)."""
        keys = self._keys.get(stream.key)  # (the keys the stream claimed: its stream key, its index's)
        if not keys or self._spread:
            return None
        key = next((k for k in reversed(keys) if k in self._held), None)  # (index keys hold none)
        if key is None:
            return None
        ends = [self._held[key], *reversed(self._held_before.get(key, []))]
        return (*(n for ident in ends for n in entry_position(ident)), self._mark_crc(key))

    def stored_before(self, stream: Stream, mark: tuple[int, ...], resume: tuple[int, int] | None) -> None:
        """An earlier run stored ``stream``'s entries up to ``mark`` (bridge.connector): its key
        must still hold that entry, checked at the stream's next write and by ``audit`` (I6), as
        if this process had stored it. What Redis lost meanwhile is then announced (SinkLost), up
        to ``resume``: the entries after it are written again. A mark of another key (the
        template changed since) says nothing of this one."""
        key = self._one_key(stream)
        if key is None or len(mark) % 3 != 1 or mark[-1] != self._mark_crc(key):
            return
        try:
            ends = [entry_id((mark[i], mark[i + 1], mark[i + 2])) for i in range(0, len(mark) - 1, 3)]
        except ValueError:
            return  # (not an id this connector writes: a checkpoint edited by hand)
        if self._claim(stream, key, "stream") is None and key not in self._held:
            self._held[key] = ends[0]
            self._held_before[key] = ends[:0:-1][-(EPOCHS_REMEMBERED - 1) :]
            if resume is not None:
                self._resent[key] = resume

    async def _unwritten(self, streams: list[Stream], keys: dict[str, str]) -> tuple[list[str], list[str]]:
        """Of ``streams``, whose stream keys hold no entry, the keys (``Stream.key``) of those that
        were never written, as far as Redis tells: no stream key (an empty one had entries, trimmed
        or deleted), and no state hash or index set of the stream (it was written, and its stream
        key deleted since: FLUSHALL leaves nothing to tell by); and those whose stream key exists,
        empty (its entries deleted). One ``TYPE`` per key (a command the sink's ACL user runs
        already), in one pipeline."""
        asked = [[keys[s.key], *(t.render(_sample_of(s)) for t in (self._state, self._index) if t is not None)] for s in streams]
        pipe = self._connection().pipeline(transaction=False)
        for names in asked:
            for name in names:
                pipe.execute_command("TYPE", name)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._classify(exc, "cannot read stream positions") from None
        # An error reply (NOPERM, ...) is no answer: cannot tell.
        kinds = iter([_text(r) if isinstance(r, (str, bytes)) else None for r in replies])
        found = [[next(kinds) for _ in names] for names in asked]
        empty = [got for got in found if got[0] == "stream"]
        if empty:
            # A stream key no entry was ever added to (Redis 7's entries-added: 0) was created
            # empty by someone else (a consumer's XGROUP CREATE ... MKSTREAM): no entry of it was
            # deleted, it tells no more than a missing key.
            pipe = self._connection().pipeline(transaction=False)
            for names, got in zip(asked, found, strict=True):
                if got[0] == "stream":
                    pipe.execute_command("XINFO", "STREAM", names[0])
            try:
                infos = await pipe.execute(raise_on_error=False)
            except (RedisError, RedisClusterException, OSError) as exc:
                raise self._classify(exc, "cannot read stream positions") from None
            for got, info in zip(empty, infos, strict=True):
                if _entries_added(info) == 0:
                    got[0] = "none"
        return (
            [s.key for s, got in zip(streams, found, strict=True) if all(k == "none" for k in got)],
            [s.key for s, got in zip(streams, found, strict=True) if got[0] == "stream"],
        )

    async def audit(self) -> None:
        """Between writes (bridge.connector, I6): does Redis still hold the last entry stored in
        each stream key and the last state written to each state hash? Reads the top of each key
        and ``_at``/``_gen`` of each hash in one pipeline; a hash that lost its state is emptied (as
        the write script does), so that no stale state stays marked complete while its stream is
        quiet. Raises SinkLost naming the seqs lost and the states lost."""
        held = [(k, v) for k, v in self._held.items() if self._owners.get(k) in self._streams]
        written = [(k, v) for k, v in self._written.items() if self._owners.get(k) in self._streams]
        if not held and not written:
            return
        pipe = self._connection().pipeline(transaction=False)
        for key, _ in held:
            pipe.execute_command("XREVRANGE", key, "+", "-", "COUNT", 1)
        for key, _ in written:
            pipe.execute_command("HMGET", key, "_at", "_gen")
        try:
            replies = await pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._classify(exc, "cannot read what it stored") from None
        found: dict[str, list[bytes | str]] = {}
        for (key, want), reply in zip(held, replies, strict=False):
            if isinstance(reply, BaseException) or self._held.get(key) != want:
                continue  # cannot tell (WRONGTYPE, ...), or written meanwhile: the write checks it
            top = _text(reply[0][0]) if reply else ""
            if not top or entry_position(top) < entry_position(want):
                found.setdefault(self._owners[key], []).extend([key, top])
        states: list[Stream] = []
        gone: list[str] = []
        for (key, (at, gen)), reply in zip(written, replies[len(held) :], strict=False):
            if isinstance(reply, BaseException) or self._written.get(key) != (at, gen):
                continue
            cur_at, cur_gen = (_text(x) if x is not None else None for x in reply)
            if cur_gen is not None and cur_gen != gen and int(cur_gen) > int(gen):
                continue  # moved on by another writer (the next pod of a rolling update)
            if cur_at is None or cur_gen != gen or entry_position(cur_at) < entry_position(at):
                gone.append(key)
                del self._written[key]
                self._state_lost[key] = int(gen)
                states.append(self._streams[self._owners[key]])
        if gone:
            pipe = self._connection().pipeline(transaction=False)
            for key in gone:
                pipe.execute_command("UNLINK", key)
            try:
                await pipe.execute()
            except (RedisError, RedisClusterException, OSError) as exc:
                raise self._classify(exc, "cannot empty a state hash that lost its state") from None
        lost = [self._sink_lost(self._streams[s], keys) for s, keys in found.items()]
        if lost or states:
            what = "; ".join(map(str, lost)) or f"{self._prefix}: Redis lost the state it held of {', '.join(gone)}"
            raise _merged(what, lost, states)

    async def read_state(self, streams: Sequence[Stream]) -> dict[str, tuple[Head, list[SeedEntry]] | None]:
        """Each stream's state hash, for a restarted bridge's rebuild: ``HSCAN`` of each, between two
        reads of its ``_at`` (another writer, e.g. the previous pod of a rolling update still
        running, may change it meanwhile: read again, up to 3 times). A hash that does not exist
        holds nothing; one whose head is missing or unreadable, that kept changing, or that is no
        hash, cannot tell."""
        if self._state is None:
            return {}
        client = self._connection()
        out: dict[str, tuple[Head, list[SeedEntry]] | None] = {}
        for stream in streams:
            key = self._state.render(_sample_of(stream))
            try:
                for _ in range(3):
                    at = await client.hget(key, "_at")
                    fields = await _hash_fields(client, key)
                    if fields.get(b"_at") == at and await client.hget(key, "_at") == at:
                        break
                else:
                    continue  # written all along: cannot tell
            except ResponseError:
                continue  # WRONGTYPE: cannot tell
            except (RedisError, RedisClusterException, OSError) as exc:
                raise self._classify(exc, "cannot read the state back") from None
            if not fields:
                out[stream.key] = None
                continue
            doc = parse(fields.pop(b"_head", b""))
            if doc is None or b"_w" in fields:
                continue  # a change cut midway by a script error (the retry was never made): cannot tell
            docs = [d for f, v in fields.items() if b"/" in f and (d := parse(v)) is not None]
            seed = seed_of(doc, docs)
            gen = fields.get(b"_gen")
            if seed is not None and at is not None and gen is not None:
                self._written.setdefault(key, (_text(at), _text(gen)))  # checked at the next write (I6)
            if seed is not None:
                out[stream.key] = seed
        return out

    # -- internals --------------------------------------------------------------------------
    def _probes(self) -> list[tuple[str, str | None, tuple[str, ...]]]:
        """What :meth:`_check_permissions` asks, as (command, key, arguments after the key): each
        command the sink runs, alone, then on each key of the configured streams (``--check``; at
        a run the keys are not known at connect: a key the ACL refuses is named by the first write)."""
        kinds: list[tuple[Template, tuple[tuple[str, ...], ...]]] = [(self._stream, _STREAM_COMMANDS)]
        if self._index is not None:
            kinds.append((self._index, _SET_COMMANDS))
        if self._state is not None:
            kinds.append((self._state, _STATE_COMMANDS))
        commands = [c for _, cs in kinds for c in cs] + (list(_COUNTS_COMMANDS) if self._index is not None else [])
        probes: list[tuple[str, str | None, tuple[str, ...]]] = [(c[0], None, ()) for c in dict.fromkeys(c[:1] for c in commands)]
        keyed: dict[tuple[str, str], tuple[str, ...]] = {}
        for stream in self.configured_streams:
            m = _sample_of(stream)
            for template, cs in kinds:
                key = template.render(m)
                for c in cs:
                    keyed.setdefault((c[0], key), c[1:])
                if template is self._index:
                    for c in _COUNTS_COMMANDS:
                        keyed.setdefault((c[0], key + ":counts"), c[1:])
        probes += [(command, key, rest) for (command, key), rest in keyed.items()]
        return probes

    def _typed_keys(self) -> dict[str, tuple[str, str]]:
        """Each key the sink writes for a known stream (``known_streams``, every one: a single key
        of another type left out would stop the sink at its stream's first announcement): the
        type its writes need there and the option that names it. None of a template with
        ``{epoch}`` (the run's epochs are not known before it) or ``{type}`` (which types a
        stream's records will have is not known either)."""
        kinds: list[tuple[Template, str, str]] = [(self._stream, "stream", "stream")]
        if self._index is not None:
            kinds.append((self._index, "set", "index.key"))
        if self._state is not None:
            kinds.append((self._state, "hash", "state.key"))
        keys: dict[str, tuple[str, str]] = {}
        for stream in self.known_streams:
            m = _sample_of(stream)
            for template, kind, option in kinds:
                if "epoch" in template.fields or "type" in template.fields:
                    continue
                key = template.render(m)
                keys.setdefault(key, (kind, option))
                if template is self._index:
                    keys.setdefault(key + ":counts", ("hash", option))
        return keys

    async def _check_key_types(self) -> None:
        """A key the sink writes that holds another type (an operator's string, an old stream
        where the set goes) refuses every write to it (WRONGTYPE): each batch of its stream would
        be dead-lettered, after the sink said it was ready. Asked at connect (and so by ``--check``;
        a key spoiled later is met by the writes, see the module docstring), one ``TYPE`` per key of
        the known streams in one pipeline:
        NotConnected (``key_type``) naming each such key, its type and the fix. A key that does
        not exist is fine (the first write makes it); one whose TYPE is refused is left to
        :meth:`_check_permissions`."""
        keys = self._typed_keys()
        if not keys:
            return
        pipe = self._connection().pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        wrong = [
            (f"{_KEY_KINDS[option]} {key!r} holds a {found}, not a {kind}", option)
            for (key, (kind, option)), reply in zip(keys.items(), replies, strict=True)
            if not isinstance(reply, Exception) and (found := _text(reply)) not in ("none", kind)
        ]
        if wrong:
            shown = "; ".join(w for w, _ in wrong[:3]) + (f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else "")
            options = " or ".join(dict.fromkeys(o for _, o in wrong))
            raise NotConnected(
                f"{self._prefix}: {self._server}: {shown}: the sink's writes there would be refused (WRONGTYPE); "
                f"delete the key if nothing else needs it, or change {options} so that the sink writes to keys of its own",
                reason="key_type",
            )

    async def _check_permissions(self) -> None:
        """Whether the ACL user may run what the writes run, on the keys they write (connect, and
        so ``--check`` and ``/readyz``): a refusal would otherwise show only at the first write,
        after the sink said it was ready, and every write would fail (NOPERM, retried for ever).
        NotConnected (``no_permission``) naming the commands and keys refused and the fix, or
        (``unknown_command``) the commands the server does not know. A server that cannot tell
        (Redis before 7.0) or refuses the question says nothing more than EVAL did."""
        probes = self._probes()
        pipe = self._connection().pipeline(transaction=False)
        for start in range(0, len(probes), _PROBES_PER_CALL):  # (thousands of streams: calls of a bounded size)
            argv: list[str] = []
            for command, key, rest in probes[start : start + _PROBES_PER_CALL]:
                words = [command, *([key] if key is not None else []), *rest]
                argv += [str(len(words)), *words]
            pipe.eval(PERMISSIONS_SCRIPT, 0, *argv)
        try:
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        except ResponseError:
            return
        # Each call's numbers count from its first probe: made the whole list's (negative: unknown).
        reply = [
            n + start * (1 if n > 0 else -1)
            for start, got in zip(range(0, len(probes), _PROBES_PER_CALL), replies, strict=True)
            if isinstance(got, list)
            for n in map(int, got)
        ]
        if not reply:
            return
        unknown = list(dict.fromkeys(probes[-int(n) - 1][0] for n in reply if int(n) < 0))
        if unknown:
            raise NotConnected(
                f"{self._prefix}: {self._server} does not run {', '.join(unknown)}, which the sink's writes run "
                "(renamed or disabled by rename-command or a managed service): allow it",
                reason="unknown_command",
            )
        refused = [probes[int(n) - 1] for n in reply]
        commands = [command for command, key, _ in refused if key is None]
        keys: dict[str, list[str]] = {}
        for command, key, _ in refused:
            if key is not None and command not in commands:
                keys.setdefault(key, []).append(command)
        user = self.options.username or unquote(urlsplit(self.options.url).username or "") or "default"
        what = []
        if commands:
            what.append(f"may not run {', '.join(commands)}")
        if keys:
            named = list(keys.items())[:_KEYS_NAMED]
            more = f"; and {len(keys) - len(named)} more keys" if len(keys) > len(named) else ""
            what.append("may not run " + "; ".join(f"{', '.join(cs)} on key {k!r}" for k, cs in named) + more)
        grant = " ".join([*(f"+{c.lower()}" for c in commands), *(f"~{k}" for k in list(keys)[:_KEYS_NAMED])])
        raise NotConnected(
            f"{self._prefix}: {self._server}: ACL user {user!r} {' and '.join(what)}, which the sink's writes run; "
            f"allow them (ACL SETUSER {user} {grant}, or a key pattern covering those keys)",
            reason="no_permission",
        )

    def _add_state(
        self,
        i: int,
        m: Message,
        calls: dict[object, _Call],
        errors: dict[int, ConnectorError],
        stopped: dict[str, ConnectorError],
    ) -> None:
        """Add the state change of ``m``'s record to its stream's script call (after its entries)."""
        delta = m.record.state
        if self._state is None or delta is None or delta.stale:
            return  # nothing to change: written as it is
        stream = m.record.stream.key
        state_key = self._state.render(m)
        lost = self._state_lost.get(state_key)
        if lost is not None:
            if delta.head.generation <= lost:
                return  # a change of the generation Redis lost: the hash stays empty until the next one
            del self._state_lost[state_key]
        collision = self._claim(m.record.stream, state_key, "state.key")
        if collision is not None:
            errors[i] = stopped[stream] = collision
            return
        try:
            args = state_args(m, self._state_format, self._max_bulk or _MAX_BULK)
        except ValueError as exc:  # a position no entry id holds: its entries are refused alike
            errors[i] = Permanent(f"{self._prefix}: state: {exc}", reason="id_range")
            return
        group: object = (stream, _slot(state_key)) if self.options.cluster else stream
        call = calls.get(group)
        if call is None:
            index_key = self._index.render(m) if self._index else None
            call = calls[group] = _Call(self._maxlen, index_key, state_key, m.record.stream)
        call.add_state(i, args)

    def _sink_lost(self, stream: Stream, found: Sequence[bytes | str]) -> SinkLost:
        """The SinkLost of ``stream``, whose stream keys no longer hold the last entry stored in them
        (``found``: key, top id or empty, ...): per key, the seqs from the one after its top entry
        (0 when the top is of an earlier epoch, or there is none) to the last one stored, in the
        epoch of the last one stored, and likewise in each epoch before it whose end is above the
        top (``EPOCHS_REMEMBERED`` epochs in all are remembered). A script call stores whole records, and
        Redis persists a script's writes whole, so the top entry's record is whole. Forgets what it
        expected of those keys, so that the write that follows goes through."""
        spans: dict[int, tuple[int, int]] = {}
        again: list[tuple[Stream, int, int, int]] = []  # announcements lost: announced again
        at: dict[tuple[str, int, int, int], int] = {}
        placed: list[tuple[tuple[str, int, int, int], int, int, int | None]] = []
        lines = []
        resent: tuple[int, int] | None = None
        for raw_key, raw_top in zip(found[::2], found[1::2], strict=True):
            key, top = _text(raw_key), _text(raw_top)
            want = self._held.pop(key)
            resent = self._resent.pop(key, resent)
            before = self._held_before.pop(key, [])
            announces = self._held_announces.pop(key, [])
            lines.append(f"{key} holds {top or 'nothing'}, below {want} it stored")
            top_at = entry_position(top) if top else (-1, -1, -1)
            for ident, low, high in announces:
                # An EventsLost Redis lost announced seqs it never stored (refused): the span after
                # the top (below) covers those above it; those at or below it are announced again,
                # where it stood (above the top: an id below it would be refused out of order).
                a_epoch, a_slot, _ = entry_position(ident)
                if entry_position(ident) <= top_at:
                    continue
                covered = top_at[1] if a_epoch == top_at[0] else 0  # the first seq the span after the top holds
                if low < covered:
                    span = (stream, a_epoch, low, min(high, covered - 1))
                    again.append(span)
                    # where it stood, unless the span after the top is announced there (one id:
                    # the second would be taken as there already): then right after the top
                    at_top = top_at[1] - 1 if a_epoch == top_at[0] and top_at[2] != MAX_SUB else None
                    placed.append(((stream.key, *span[1:]), a_epoch, a_slot - 1, at_top))
            for end in [b for b in before if top_at < entry_position(b)] + [want]:
                end_at = epoch, slot, _ = entry_position(end)
                first = top_at[1] if top_at[0] == epoch else 0
                if top_at[0] == epoch and top_at[1] == slot and top_at < end_at:
                    # Only what stood after the top's batch in its slot is gone: an EventsLost
                    # (one announcing a refusal, say), announced again above when remembered;
                    # else which seqs it announced is not known here: announce that batch's
                    # seq, so consumers know their view misses.
                    if any(ident == end for ident, _, _ in announces):
                        continue
                    first = slot - 1
                if first <= slot - 1:
                    low, high = spans.get(epoch, (first, slot - 1))
                    spans[epoch] = (min(low, first), max(high, slot - 1))
        if resent is not None:
            # Held as an earlier run stored it (stored_before): what follows the stream's resume
            # point comes again, written after this announcement. An epoch after the resume one
            # would be announced before its records: left out (bridge.connector.resent_spans), the
            # resume epoch then lost from the top up to the resume point (held to its end).
            epoch, seq = resent
            if any(e > epoch for e in spans) and seq >= 0:
                spans[epoch] = (top_at[1] if top_at[0] == epoch else 0, seq)
            spans = {e: (low, min(high, seq) if e == epoch else high) for e, (low, high) in spans.items() if e <= epoch}
            spans = {e: (low, high) for e, (low, high) in spans.items() if low <= high}
        for span_key, epoch, where, at_top in placed:
            at[span_key] = at_top if epoch in spans and spans[epoch][1] == where and at_top is not None else where
        message = (
            f"{self._prefix}: Redis lost entries it acknowledged (a restart from an older snapshot or without "
            f"persistence, a deleted key): {'; '.join(lines)}; set appendonly yes (appendfsync everysec or always) "
            "so a restart keeps them"
        )
        return SinkLost(message, [*again, *((stream, e, low, high) for e, (low, high) in spans.items())], at=at)

    def _claim(self, engine_stream: Stream, key: str, field: str) -> Retriable | None:
        """None when ``key`` belongs to ``engine_stream`` as its ``field`` key (claimed now if no
        stream had it), else the key collision (another stream's, or another template's of one
        stream): retried (the sink not ready) until the template is fixed, never written."""
        stream = engine_stream.key
        first = self._fields.setdefault(key, field)
        if first != field:  # (a label found at run time can make two templates render one key)
            return Retriable(
                f"{self._prefix}: key collision: engine stream {self._owners.get(key, stream)}'s {first} key and "
                f"{stream}'s {field} key are both {key!r}, and one key holds one type (a stream, a set, a hash); "
                f"change the templates (or the labels) so that they differ ({stream} is not written meanwhile)",
                reason="key_collision",
            )
        owner = self._owners.setdefault(key, stream)
        if owner != stream:
            return Retriable(
                f"{self._prefix}: key collision: engine streams {owner} and {stream} both render the "
                f"{field} key {key!r}, and one key must hold one engine stream; put a separator between "
                f"the placeholders, e.g. {field}: {DEFAULT_STREAM if field == 'stream' else DEFAULT_INDEX_KEY} "
                f"({stream} is not written meanwhile)",
                reason="key_collision",
            )
        keys = self._keys.setdefault(stream, {})
        if key not in keys:
            keys[key] = None
            self._streams[stream] = engine_stream
            if len(keys) > _KEYS_PER_STREAM:
                old = next(iter(keys))
                del keys[old]
                self._held.pop(old, None)
                self._resent.pop(old, None)
                self._held_before.pop(old, None)
                self._held_announces.pop(old, None)
                if self._owners.get(old) == stream:
                    del self._owners[old]
                    self._fields.pop(old, None)
        return None

    def _results(self, call: _Call, reply: Any) -> dict[int, ConnectorError]:
        """The errors of one script call's entries (a failed call fails every entry alike)."""
        if isinstance(reply, BaseException):
            # The whole call refused: no entry's own doing (an oversized entry is refused before
            # the call), so retried (see _CALL_REFUSALS).
            error = self._classify(reply)
            if error.reason == "protocol":
                self._max_bulk = None  # proto-max-bulk-len lowered since connect: read it again
            return dict.fromkeys(call.indexes, error)
        errors: dict[int, ConnectorError] = {}
        settled = True  # no transient failure yet: what is stored up to here is acknowledged
        for i, (key, what), result in zip(call.indexes, call.items, reply, strict=False):
            if isinstance(result, bytes) and what in call.lost and result.startswith(b"OUT_OF_ORDER") and _BELOW_TOP in result:
                # An EventsLost below entries this stream key holds: the key got everything up to
                # its top from this bridge in order (stored, or announced then), so the span is
                # settled here. A bridge restarted from a checkpoint saved before its last writes
                # (a SIGKILL) announces what the engine's replay no longer holds, which this key
                # may hold already (breaker94 B1/B2), or a refusal it met before, announced where an
                # earlier release put it (breaker98 B4): stored as a copy, not refused for ever.
                log.info(
                    "announcement below what the stream holds: settled there",
                    extra={"sink": self.name, "key": key, "entry": what},
                )
                continue
            if isinstance(result, bytes):
                errors[i] = error = self._refused(result.decode(errors="replace"))
                if error.reason == "state_lost" and call.state_key is not None:
                    self._written.pop(call.state_key, None)
                    self._state_lost[call.state_key] = int(what[1])
                settled = settled and isinstance(error, Permanent)
            elif not settled:
                continue
            elif key is not None:
                last = self._held.get(key)
                if last is None or entry_position(what) > entry_position(last):
                    if last is not None and entry_position(what)[0] > entry_position(last)[0]:
                        before = self._held_before.setdefault(key, [])  # a new epoch: its predecessor's end, for _sink_lost
                        before.append(last)
                        del before[: -(EPOCHS_REMEMBERED - 1)]
                    self._held[key] = what
                    self._resent.pop(key, None)
                    if what in call.announces:
                        announces = self._held_announces.setdefault(key, [])
                        announces.append((what, *call.announces[what]))
                        del announces[:-EPOCHS_REMEMBERED]
            elif call.state_key is not None:
                self._written[call.state_key] = (what[0], what[1])
        if len(reply) < len(call.indexes):  # the script stopped at a failure: the rest waits behind it
            stop = errors.get(call.indexes[len(reply) - 1]) if reply else None
            held = Retriable(f"{self._prefix}: not written, behind a failed entry of its stream ({stop})", reason="held_back")
            errors.update(dict.fromkeys(call.indexes[len(reply) :], held))
        return errors

    def _delta(self, m: Message) -> IndexDelta:
        record = m.record
        if record.kind == "SourceReset":
            return IndexDelta(True, [])
        if record.kind == "EventsLost":
            return IndexDelta(self._clear_on_lost, [])
        event = m.event
        return index_delta(record.events if event is None else (event,), self._hash_hex)

    def _refused(self, line: str, what: str = "") -> ConnectorError:
        """The failure class of a server error line (``CODE message``, or the message alone)."""
        code = line.split(" ", 1)[0]
        if code not in _TRANSIENT and code not in ("WRONGTYPE", "OUT_OF_ORDER") and _ACL_REFUSAL.search(line):
            code = "NOPERM"  # an ACL refusal, worded as the server and redis-py do (see _ACL_REFUSAL)
        text = f"{self._prefix}: {what}: {line}" if what else f"{self._prefix}: {line}"
        if code == "CROSSSLOT":
            text += "; the server is a Redis Cluster node: set cluster: true (the sink's keys are hash-tagged then)"
        if code == "KEY_COLLISION":
            text += (
                "; one key must hold one engine stream: put a separator between the placeholders, e.g. stream: "
                f"{DEFAULT_STREAM} (the stream is not written meanwhile)"
            )
        if code in _TRANSIENT:
            reason, wait = _TRANSIENT[code]
            return Retriable(text, retry_after=wait, reason=reason)
        for pattern, reason, why in _CALL_REFUSALS:
            if pattern.search(line):
                return Retriable(f"{text} ({why})", reason=reason)
        if code == "OUT_OF_ORDER":
            return Permanent(f"{text} (another client wrote or deleted entries of the stream)", reason="out_of_order")
        if code == "STATE_LOST":
            # Refused for itself: the runtime clears the stream's state into a new generation
            # (incomplete), which writes the hash whole again; the script emptied it meanwhile.
            return Permanent(f"{text}: the state is written again from its next change, incomplete", reason="state_lost")
        return Permanent(text, reason="rejected")

    def _classify(self, exc: BaseException, what: str = "") -> ConnectorError:
        """The failure class of a redis-py exception."""
        text = str(exc) or type(exc).__name__
        where = f"{self._prefix}: {what}" if what else self._prefix
        if isinstance(exc, BusyLoadingError):  # a ConnectionError subclass in redis-py, but transient
            return self._refused(f"LOADING {text}", what)
        if isinstance(exc, AuthenticationError | AuthorizationError):
            return NotConnected(f"{where}: authentication failed: {text}", reason="auth")
        if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
            return NotConnected(f"{where}: {text}" if what else f"{where}: {self._server}: {text}")  # (named once)
        for cls, code in _CODES:
            if isinstance(exc, cls):
                return self._refused(f"{code} {text}", what)
        if isinstance(exc, ResponseError):
            return self._refused(text, what)
        if isinstance(exc, RedisClusterException):
            return Retriable(f"{where}: {text}", retry_after=0.5, reason="cluster")
        return Retriable(f"{where}: {text}")


def _setting(settings: Mapping[str, str], name: str, default: int) -> int:
    """A numeric server setting (``CONFIG GET``), ``default`` when unknown or not a number."""
    try:
        return int(settings.get(name, default))
    except ValueError:
        return default


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@lru_cache(maxsize=65536)
def _slot(key: str) -> int:
    return internals.key_slot(key)


__all__ = [
    "MAX_SLOT",
    "MAX_SUB",
    "MAX_WIDE_SUB",
    "WIDE_EPOCHS",
    "WRITE_SCRIPT",
    "IndexDelta",
    "IndexOptions",
    "RedisConnector",
    "RedisOptions",
    "TlsOptions",
    "entry_id",
    "entry_position",
    "index_delta",
    "message_position",
    "one_pass_packing",
    "resp_command",
]
