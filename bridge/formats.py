"""Output formats: how records become messages (design.md "Output formats").

A :class:`Renderer` is built once per distinct (format, granularity, hash_format, event filter
(:mod:`bridge.filters`)) and turns a :class:`~bridge.records.Record` into :class:`Message`
objects. The JSON header is encoded once per batch and spliced in front of each event, so
per-event work is one ``msgspec`` encode.

- ``json`` / ``msgpack``, ``event`` granularity: one message per event (and per control record),
  ``{"source", "dp_rank", "epoch", "seq", "index", "ts", "schema_version", "type", fields...}``.
- ``json`` / ``msgpack``, ``batch`` granularity: one message per batch, ``"type": "EventBatch"``, events
  under ``"events"``.
- ``raw``: the engine payload untouched, one message per batch; the header travels as message
  headers. Control records are JSON (``content-type: application/json``).

Record headers and control records are encoded through the structs of :mod:`bridge.schema` (the
output contract and its JSON Schema), so their fields cannot drift from the schema; every message's
headers carry ``schema_version`` too.

Integer block hashes stay integers unless ``hash_format: hex``; binary hashes (and any other
binary value) become lowercase hex strings in JSON and stay binary in msgpack (with ``hash_format:
hex``, every block hash is hex text in msgpack too).
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from .filters import EventFilter
from .records import Event, Record, Stream
from .schema import HASH_FIELDS, HEADER_KEYS, SCHEMA_VERSION, EventBatch, EventRecordHeader, EventsLost, SourceReset, StateSeeded
from .wire import KNOWN_TYPES

Format = Literal["json", "msgpack", "raw"]
Granularity = Literal["event", "batch"]
HashFormat = Literal["int", "hex"]

CONTENT_TYPES: dict[str, str] = {
    "json": "application/json",
    "msgpack": "application/msgpack",
    "raw": "application/vnd.kv-events.msgpack",
}
BATCH_TYPE: Final = "EventBatch"
SCHEMA_VERSION_TEXT = str(SCHEMA_VERSION)
_U64 = 0xFFFFFFFFFFFFFFFF

_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()


class Envelope(msgspec.Struct, eq=False):
    """What every message of one record shares: its header fields and its message id, both built
    on first use (a sink that writes only values, such as a file of JSON lines, never pays for
    them) and then kept. ``type`` is the messages' type (event messages set their own);
    ``given_id``: the id when it is not the record's ``source/dp_rank/epoch/seq`` (control records).
    A msgspec Struct: built once per record on the hot path, at a third of a class's cost."""

    record: Record
    type: str
    content_type: str
    given_id: str | None = None
    built_fields: dict[str, str] | None = None
    built_encoded: tuple[list[tuple[str, bytes]], int] | None = None

    @property
    def fields(self) -> dict[str, str]:
        """The header as text: source, dp_rank, epoch, seq, type, content-type, schema_version, ts,
        instance."""
        f = self.built_fields
        if f is None:
            r = self.record
            s = r.stream
            f = self.built_fields = {
                "source": s.source,
                "dp_rank": str(s.dp_rank),
                "epoch": str(r.epoch),
                "seq": str(r.seq),
                "type": self.type,
                "content-type": self.content_type,
                "schema_version": SCHEMA_VERSION_TEXT,
            }
            if r.ts is not None:
                f["ts"] = repr(r.ts)
            if r.instance is not None:
                f["instance"] = r.instance.hex()
        return f

    def encoded(self) -> tuple[list[tuple[str, bytes]], int]:
        """The fields as (name, UTF-8 value) pairs, and where ``type`` is among them."""
        e = self.built_encoded
        if e is None:
            items = [(k, v.encode()) for k, v in self.fields.items()]
            e = self.built_encoded = (items, next(i for i, (k, _) in enumerate(items) if k == "type"))
        return e

    @property
    def id(self) -> str:
        """The record's message id (``source/dp_rank/epoch/seq`` for engine data)."""
        i = self.given_id
        if i is None:
            r = self.record
            s = r.stream
            i = self.given_id = f"{s.source}/{s.dp_rank}/{r.epoch}/{r.seq}"
        return i

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Envelope) and (self.fields, self.id) == (other.fields, other.id)

    __hash__ = None  # type: ignore[assignment]


class Message(msgspec.Struct):
    """One message for a sink.

    ``value`` is the rendered body. Read from its :class:`Envelope` (shared by the record's
    messages, built when first read): ``headers`` carry the stream header as text (Kafka / NATS
    headers, Redis entry fields for ``raw``); ``msg_id`` is unique per stream message and stable
    across retries and bridge restarts (``source/dp_rank/epoch/seq[/index]`` for engine data,
    ``.../reset`` and ``.../lost/FROM-TO`` for control records). ``position`` orders messages of a
    stream (epoch, slot, sub) and is what id schemes that need numbers (Redis) build on.
    """

    record: Record
    index: int | None
    type: str
    value: bytes
    envelope: Envelope
    last: bool = False  # the last message of its batch at event granularity (header ``last``)

    @property
    def position(self) -> tuple[int, int, int]:
        """(epoch, slot, sub): the record's position, and the event's index + 1 (0 for a whole
        batch or a control record, SEED_SUB for a StateSeeded record: after its batch's events,
        STATE_SUB for a state message: after all of its record's)."""
        epoch, slot = self.record.position
        i = self.index
        if i is not None:
            return (epoch, slot, i + 1)
        t = self.type
        return (epoch, slot, STATE_SUB if t == STATE_TYPE else SEED_SUB if t == SEED_TYPE else 0)

    @property
    def headers(self) -> dict[str, str]:
        """The message's header fields (a new dict on each read: read it once per write)."""
        h = self.envelope.fields.copy()
        i = self.index
        if i is not None:
            h["type"] = self.type
            h["index"] = _INDEX_TEXT[i] if i < 4096 else str(i)
            if self.last:
                h["last"] = "1"
        return h

    def header_items(self) -> list[tuple[str, bytes]]:
        """``headers`` as (name, UTF-8 value) pairs, in the same order (what Kafka's client takes),
        from the envelope's pairs encoded once per record."""
        items, at = self.envelope.encoded()
        items = items.copy()
        i = self.index
        if i is not None:
            items[at] = ("type", self.type.encode())
            items.append(("index", _INDEX[i] if i < 4096 else str(i).encode()))
            if self.last:
                items.append(("last", b"1"))
        return items

    @property
    def msg_id(self) -> str:
        i = self.index
        if i is None:
            return self.envelope.id
        return self.envelope.id + "/" + (_INDEX_TEXT[i] if i < 4096 else str(i))

    @property
    def key(self) -> bytes:
        """Partitioning key: the stream (``source/dp_rank``), so one stream keeps its order."""
        return self.record.stream.key.encode()

    @property
    def event(self) -> Event | None:
        """The decoded event this message carries (event granularity), if any."""
        if self.index is None or self.record.kind != "batch":
            return None
        return self.record.events[self.index]


STATE_TYPE = "StateDelta"
"""The type of the message that follows each record for a sink whose connector writes state
(``writes_state``): no value, ``record.state`` is what it writes, its position is after every
message of the record."""
STATE_SUB = (1 << 64) - 1
SEED_TYPE: Final = "StateSeeded"
"""The type of the record a batch carries when the stream's state was seeded from an engine
snapshot with it (``Record.seed``); rendered after the batch's messages."""
SEED_SUB = STATE_SUB - 1


def state_message(record: Record) -> Message:
    """The state message of ``record`` (see STATE_TYPE)."""
    return Message(record, None, STATE_TYPE, b"", Envelope(record, STATE_TYPE, "", ""))


def message_types(granularity: str, *, seeded: bool = False) -> list[str]:
    """The types a renderer gives messages (what ``{type}`` in a name template takes): the records'
    kinds, a batch's first (``StateSeeded`` only when ``seeded``: a stream's state seeded from an
    engine snapshot, experimental), and at event granularity every event type the decoder knows
    (an unknown one's comes as the engine names it)."""
    kinds = [BATCH_TYPE, "SourceReset", "EventsLost", *([SEED_TYPE] if seeded else [])]
    return kinds + sorted(KNOWN_TYPES) if granularity == "event" else kinds


def sample_message(stream: Stream, type_: str = BATCH_TYPE, epoch: int = 0) -> Message:
    """An empty message of ``stream`` (seq 0), to render a name template (topic, key, subject) with."""
    record = Record(stream=stream, epoch=epoch, seq=0)
    return Message(record, None, type_, b"", Envelope(record, type_, ""))


def hex64(value: int) -> str:
    """A 64-bit hash as 16 lowercase hex digits (negative values as two's complement)."""
    return format(value & _U64, "016x")


def _jsonable(value: Any, hash_hex: bool) -> Any:
    """``value`` with binary made hex (and, for hash fields, ints made hex when asked)."""
    t = type(value)
    if t is bytes or t is bytearray or t is memoryview:
        return bytes(value).hex()
    if t is int:
        return hex64(value) if hash_hex else value
    if t is list or t is tuple:
        return [_jsonable(v, hash_hex) for v in value]
    if t is dict:
        return {k: _jsonable(v, False) for k, v in value.items()}
    return value


_SCALARS = frozenset({int, str, float, bool, type(None)})


def _scalar_list(value: list[Any]) -> bool:
    """True when a list holds only JSON scalars (no binary, no nesting)."""
    scalars = _SCALARS
    for x in value:  # noqa: SIM110 - a plain loop is faster than all() over a generator
        if type(x) not in scalars:
            return False
    return True


def _needs_json_fix(event: Event) -> bool:
    """Whether the event holds anything JSON cannot carry as is (binary anywhere)."""
    scalars = _SCALARS
    for k, v in event.items():
        t = type(v)
        if t in scalars:
            continue
        if t is not list:
            return True
        if k != "token_ids":  # token ids are ints: not worth looking at each
            for x in v:
                if type(x) not in scalars:
                    return True
    return False


def json_event(event: Event, hash_hex: bool) -> Event:
    """The event ready for JSON: a copy only where something has to change."""
    if not hash_hex and not _needs_json_fix(event):
        return event
    out = dict(event)
    for k, v in event.items():
        if k == "token_ids":
            continue
        t = type(v)
        hex_ints = hash_hex and k in HASH_FIELDS
        if (t is int and hex_ints) or (t is list and (hex_ints or not _scalar_list(v))) or t in _CONVERT:
            out[k] = _jsonable(v, hex_ints)
    return out


_CONVERT = frozenset({bytes, bytearray, memoryview, dict, tuple})
# An engine's own "shadowed" field goes under "shadowed" too, rather than being replaced.
_HEADER_KEYS = HEADER_KEYS | {"shadowed"}


def unshadow(event: Event) -> Event:
    """The event with fields named like header keys (or ``shadowed``) moved under ``"shadowed"``.

    At event granularity header and event share one object: such a field (a hostile or a future
    engine) would otherwise override the stream identity consumers deduplicate on.
    """
    if _HEADER_KEYS.isdisjoint(event):
        return event
    out = {k: v for k, v in event.items() if k not in _HEADER_KEYS}
    out["shadowed"] = {k: v for k, v in event.items() if k in _HEADER_KEYS}
    return out


SHARED_MAX = 1024
"""Batches whose messages a shared renderer keeps for the sinks that have not taken them yet."""
SHARED_MAX_BYTES = 8 * 2**20
"""And the bytes of their rendered values, at most (kept outside every queue's byte bound)."""

_INDEX_TEXT = [str(i) for i in range(4096)]
_INDEX = [t.encode() for t in _INDEX_TEXT]
# How an EventRecordHeader with seq 0, index 0 and no ts ends once encoded (the fields after
# epoch, in the schema's order): what _json_header cuts off to splice the batch's own values in.
_HEADER_TAIL = b'"seq":0,"index":0,"ts":null,"schema_version":%d}' % SCHEMA_VERSION


class Renderer:
    """Renders records into messages for one (format, granularity, hash_format, event filter).

    ``event_filter`` (:mod:`bridge.filters`: field selection, token policy) is applied to a batch's
    events once per batch; without one (and for raw) the events are rendered as they are.
    """

    def __init__(
        self,
        fmt: Format,
        granularity: Granularity = "event",
        hash_format: HashFormat = "int",
        event_filter: EventFilter | None = None,
    ) -> None:
        self.format: Format = fmt
        self.granularity: Granularity = "batch" if fmt == "raw" else granularity
        self.hash_hex = hash_format == "hex"
        self.content_type = CONTENT_TYPES[fmt]
        if fmt == "msgpack" and self.hash_hex:  # json converts hashes as it encodes; msgpack here
            event_filter = (event_filter or EventFilter()).with_hex_hashes()
        self.event_filter = None if fmt == "raw" else event_filter
        self._raw = fmt == "raw"
        self.sharers = 1
        """Sinks that take a batch's messages from one rendering (the runtime counts them)."""
        self._shared: dict[int, tuple[Record, list[Message], list[int]]] = {}  # [sinks yet to take them, bytes]
        self._shared_bytes = 0
        self._heads: dict[tuple[str, int, int], bytes] = {}  # see _json_header

    def render(self, record: Record) -> list[Message]:
        """All messages for ``record``, in order.

        With several sharers (sinks), the first to render a batch keeps the messages for
        the others (they are read-only), until every one has taken them or newer batches pushed
        them out (``SHARED_MAX`` batches, ``SHARED_MAX_BYTES`` of values: a sink far behind, or
        one that dropped the batch, renders again).

        Raises on values that cannot be encoded, including ones nested deeper than the stack allows
        (RecursionError: the decoder's bound depends on its own stack depth, not ours); the sink
        worker dead-letters the record on any Exception.
        """
        if record.kind != "batch" or record.seed is not None:
            if record.seed is not None:  # (rare: the batch an engine snapshot is seeded with)
                return [*self._render(record), self._control(record.seed)]
            return [self._control(record)]
        if self.sharers == 1:
            if self._raw:  # the engine's bytes as they are (_batch, inline: the raw sinks' hot path)
                return [Message(record, None, BATCH_TYPE, record.payload, Envelope(record, BATCH_TYPE, self.content_type))]
            return self._render(record)
        shared = self._shared
        key = id(record)
        hit = shared.get(key)
        if hit is not None and hit[0] is record:
            left = hit[2]
            left[0] -= 1
            if left[0] == 0:
                del shared[key]
                self._shared_bytes -= left[1]
            return hit[1]
        messages = self._render(record)
        size = sum(len(m.value) for m in messages)
        shared[key] = (record, messages, [self.sharers - 1, size])
        self._shared_bytes += size
        while len(shared) > SHARED_MAX or (self._shared_bytes > SHARED_MAX_BYTES and len(shared) > 1):
            self._shared_bytes -= shared.pop(next(iter(shared)))[2][1]
        return messages

    def _render(self, record: Record) -> list[Message]:
        """The messages of a batch record."""
        events = record.events if self.event_filter is None else self.event_filter(record.events)
        if self.granularity == "batch":
            return [self._batch(record, events)]
        return self._events(record, events)

    # -- the header ---------------------------------------------------------------------------
    def _json_header(self, record: Record) -> tuple[bytes, bytes]:
        """The JSON event header of ``record`` cut around its index: what comes before the index
        value, and what follows it up to the event's fields (with their comma). The part up to
        ``"seq":`` is encoded once per (source, dp_rank, epoch) and kept."""
        s = record.stream
        key = (s.source, s.dp_rank, record.epoch)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= 4096:
                self._heads.clear()
            encoded = _json.encode(EventRecordHeader(s.source, s.dp_rank, record.epoch, 0, 0, None, SCHEMA_VERSION))
            assert encoded.endswith(_HEADER_TAIL), "EventRecordHeader changed: update _HEADER_TAIL"
            head = self._heads[key] = encoded[: -len(_HEADER_TAIL)] + b'"seq":'
        ts = record.ts
        return b'%b%d,"index":' % (head, record.seq), b',"ts":%b,"schema_version":%d,' % (
            b"null" if ts is None else _json.encode(ts),
            SCHEMA_VERSION,
        )

    @staticmethod
    def _event_header(record: Record) -> EventRecordHeader:
        """The header of the batch's events, with index 0 (each event sets its own)."""
        s = record.stream
        return EventRecordHeader(s.source, s.dp_rank, record.epoch, record.seq, 0, record.ts, SCHEMA_VERSION)

    # -- record kinds -------------------------------------------------------------------------
    def _control(self, record: Record) -> Message:
        s = record.stream
        fields = record.control()
        ctype = fields["type"]
        cls = SourceReset if record.kind == "SourceReset" else StateSeeded if record.kind == "StateSeeded" else EventsLost
        body = cls(
            source=s.source, dp_rank=s.dp_rank, epoch=record.epoch, seq=record.seq, schema_version=SCHEMA_VERSION, **fields
        )
        if self.format == "msgpack":
            value, content_type = _msgpack.encode(body), CONTENT_TYPES["msgpack"]
        else:
            value, content_type = _json.encode(body), CONTENT_TYPES["json"]
        if record.kind == "SourceReset":
            msg_id = f"{s.source}/{s.dp_rank}/{record.epoch}/reset"
        elif record.kind == "StateSeeded":
            msg_id = f"{s.source}/{s.dp_rank}/{record.epoch}/{record.seq}/seeded"
        else:
            msg_id = f"{s.source}/{s.dp_rank}/{record.epoch}/lost/{record.from_seq}-{record.seq}"
        return Message(record, None, ctype, value, Envelope(record, ctype, content_type, msg_id))

    def _batch(self, record: Record, events: list[Event]) -> Message:
        if self.format == "raw":
            value = record.payload
        else:
            s = record.stream
            json_ = self.format == "json"
            if json_ and (self.hash_hex or not record.plain):
                events = [json_event(e, self.hash_hex) for e in events]
            body = EventBatch(s.source, s.dp_rank, record.epoch, record.seq, record.ts, SCHEMA_VERSION, BATCH_TYPE, events)
            value = _json.encode(body) if json_ else _msgpack.encode(body)
        return Message(record, None, BATCH_TYPE, value, Envelope(record, BATCH_TYPE, self.content_type))

    def _events(self, record: Record, events: list[Event]) -> list[Message]:
        envelope = Envelope(record, "", self.content_type)  # each event's message sets its type and index
        out: list[Message] = []
        if self.format == "json":
            # The header around its index: per event, prefix + index + rest + the event without
            # its '{' ('{"source":..,"seq":..,"index":' + i + ',"ts":..,"schema_version":..,' + ...).
            prefix, rest = self._json_header(record)
            encode, hash_hex, join, header_keys = _json.encode, self.hash_hex, b"".join, _HEADER_KEYS
            # Plain batches (the decoder proved it) hold nothing to convert: no per-value check.
            check = not record.plain
            append, index_bytes = out.append, _INDEX
            for i, event in enumerate(events):
                # The common event (no binary, no field named like a header) is encoded as it is.
                if hash_hex or not header_keys.isdisjoint(event) or (check and _needs_json_fix(event)):
                    body = encode(json_event(unshadow(event), hash_hex))
                else:
                    body = encode(event)
                index = index_bytes[i] if i < 4096 else str(i).encode()
                # The message, inline (one per event: a call per event costs as much as the rest).
                type_ = event.get("type")
                type_ = type_ if type_.__class__ is str else "Unknown"
                append(Message(record, i, type_, join((prefix, index, rest, body[1:])), envelope))
        else:
            header = msgspec.structs.asdict(self._event_header(record))
            for i, event in enumerate(events):
                fields = header.copy()
                fields["index"] = i
                fields.update(unshadow(event))
                type_ = event.get("type")
                type_ = type_ if type_.__class__ is str else "Unknown"
                out.append(Message(record, i, type_, _msgpack.encode(fields), envelope))
        if out:
            out[-1].last = True  # (a sink that holds it holds the whole batch: SinkPosition.from_headers)
        return out
