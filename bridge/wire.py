"""The wire format: ZMQ frames and every msgpack payload generation (docs/protocol.md sections 1-2).

Pure: no sockets, no asyncio, no clock. Decoding is done once per batch with msgspec's generic
msgpack decoder (ints up to 2**64-1 stay exact, binary stays ``bytes``); events are then
normalised to a field-name form:

- map events (vLLM >= 0.24, SGLang >= 0.5.20) are already by name and are used as decoded;
- array events (older releases) are named by position from the declaration order below; values
  past the known positions are kept under ``"extra"``.

Other producers' shapes are recognised by what they send, never by configuration:

- a sequence frame of 24 bytes is the seq plus a 16-byte publisher lifetime UUID (vLLM #57789);
  a live message with an empty payload is an idle heartbeat carrying the next seq, not a batch;
- array events longer than any vLLM array release are ROCm ATOM's (#1316): its ``BlockStored``
  array ends with ``token_offset`` (see :data:`ARRAY_FIELDS`); its replay end marker carries a
  ``[oldest, latest]`` window (:attr:`ReplayReply.window`);
- map events with an ``event_type`` key are RFC Mooncake #1527 events (Mooncake master,
  TokenSpeed): they are normalised to the names consumers read (:func:`normalise_rfc1527`) with
  every original field kept; a batch ``ts`` in milliseconds (an integer above 1e11 right after
  the batch's array header, what those producers send; every other producer sends a float)
  becomes seconds.

Unknown event types pass through with their type name. A malformed event is isolated (reported in
``DecodedBatch.bad_events``), a malformed batch raises :class:`~bridge.errors.DecodeError`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Union

import msgspec

from .errors import DecodeError
from .records import Event

SEQ_BYTES = 8
INSTANCE_BYTES = 16  # the publisher lifetime UUID after the seq (vLLM #57789)
SEQ_INSTANCE_BYTES = SEQ_BYTES + INSTANCE_BYTES
END_SEQ = 2**64 - 1  # the replay end marker: ff ff ff ff ff ff ff ff
END_FRAME = END_SEQ.to_bytes(8, "big")
MS_TS_ABOVE = 1e11
"""An integer ts of an array batch above this is in milliseconds (RFC 1527 producers send int64
ms; every other producer a float of seconds, and 1e11 seconds is the year 5138)."""
_FLOAT64 = 0xCB
_INT64 = (0xCF, 0xD3)  # msgpack uint64 / int64: the only integers above MS_TS_ABOVE


# Declaration order (vLLM 0.33); older releases, and every array encoding, have a prefix of it.
FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
# Optional fields of open vLLM pull requests, after the released ones (map events carry names):
# BlockStored.block_offsets (#44488), BlockRemoved.remaining_copy_counts (#48933).
FIELDS["BlockStored"] += ("block_offsets",)
FIELDS["BlockRemoved"] += ("remaining_copy_counts",)
# Event types of other producers and open pull requests: ROCm ATOM's (#1316) and vLLM #50732's.
FIELDS["BlockTransferred"] = ("block_hashes", "from_medium", "to_medium", "group_idx")
FIELDS["BlockInactive"] = ("block_hashes", "medium", "group_idx")
KNOWN_TYPES = frozenset(FIELDS)

# What array positions mean. vLLM's array generation ended at 11 BlockStored fields (0.22-0.23)
# and 3 BlockRemoved fields, SGLang's earlier: a longer array is ROCm ATOM's (#1316), whose
# BlockStored appends ``token_offset`` after vLLM's 11 and whose AllBlocksCleared carries a
# ``medium``. Past these positions values are kept under ``"extra"``.
ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    **FIELDS,
    "BlockStored": (*FIELDS["BlockStored"][:11], "token_offset"),
    "BlockRemoved": FIELDS["BlockRemoved"][:5],
    "AllBlocksCleared": ("medium",),
}

_decoder = msgspec.msgpack.Decoder()


class Frames(msgspec.Struct, frozen=True):
    """One live message: topic, sequence number and the raw payload; ``instance``: the publisher's
    16-byte lifetime UUID when its sequence frame carries one. An empty payload is a heartbeat
    (``seq`` is then the next seq the publisher will use)."""

    topic: bytes
    seq: int
    payload: bytes
    instance: bytes | None = None

    @property
    def heartbeat(self) -> bool:
        return not self.payload


class BadEvent(msgspec.Struct, frozen=True):
    """An event that could not be normalised; its neighbours were kept."""

    index: int
    reason: str
    value: Any


class DecodedBatch(msgspec.Struct):
    """One engine batch, decoded: ``events`` keep their batch positions minus the bad ones."""

    ts: float
    events: list[Event]
    dp_rank: int | None = None
    bad_events: list[BadEvent] = msgspec.field(default_factory=list)
    extra: Any = None
    plain: bool = False
    """Every event field is a JSON scalar, a list of them or a list of such lists: nothing to
    convert for JSON (no binary, no map, nothing nested deeper), known without looking."""


def parse_seq(frame: bytes) -> int:
    """The big-endian unsigned sequence number of a sequence frame (8 or 24 bytes)."""
    return parse_seq_frame(frame)[0]


def parse_seq_frame(frame: bytes) -> tuple[int, bytes | None]:
    """(seq, publisher UUID or None) of a sequence frame: 8 bytes, or 24 (seq + 16-byte UUID)."""
    n = len(frame)
    if n == SEQ_BYTES:
        return int.from_bytes(frame, "big"), None
    if n == SEQ_INSTANCE_BYTES:
        return int.from_bytes(frame[:SEQ_BYTES], "big"), bytes(frame[SEQ_BYTES:])
    raise DecodeError("bad_seq", f"sequence frame is {n} bytes, expected {SEQ_BYTES} or {SEQ_INSTANCE_BYTES} (seq + UUID)")


def parse_live(frames: Sequence[bytes]) -> Frames:
    """A PUB message: exactly ``[topic, seq, payload]`` (``seq`` of 8 or 24 bytes)."""
    if len(frames) != 3:
        raise DecodeError("bad_frames", f"live message has {len(frames)} frames, expected 3")
    seq, instance = parse_seq_frame(frames[1])
    if seq == END_SEQ:
        raise DecodeError("bad_seq", "live message with seq ff x 8, the replay end marker (never a batch's seq)")
    return Frames(bytes(frames[0]), seq, bytes(frames[2]), instance)


class ReplayReply(msgspec.Struct, frozen=True):
    """One replay reply; ``end`` marks the end marker. ``window``: ROCm ATOM's end marker carries
    the engine's buffered ``(oldest, latest)`` seqs (None where it says nothing, or for others);
    ``instance``: the publisher UUID when the reply's sequence frame carries one; ``topic``: its
    topic frame (newer releases; None without one)."""

    seq: int
    payload: bytes
    end: bool = False
    window: tuple[int | None, int | None] | None = None
    instance: bytes | None = None
    topic: bytes | None = None


def parse_replay(frames: Sequence[bytes]) -> ReplayReply:
    """A DEALER-side replay reply, with or without the empty delimiter and the topic frame.

    vLLM <= 0.25 / SGLang <= 0.5.21 send ``[empty, seq, payload]``; newer ones
    ``[empty, topic, seq, payload]``. Frames are counted, not assumed.
    """
    parts = list(frames)
    topic = None
    if parts and len(parts[0]) == 0 and len(parts) in (3, 4):
        parts = parts[1:]  # the delimiter the ROUTER puts before every reply
    if len(parts) == 3:
        topic, parts = bytes(parts[0]) or None, parts[1:]  # the topic frame of newer releases (empty: no topic)
    if len(parts) != 2:
        raise DecodeError("bad_frames", f"replay reply has {len(frames)} frames, expected 3 or 4")
    seq, instance = parse_seq_frame(parts[0])
    if seq == END_SEQ:
        return ReplayReply(seq, b"", end=True, window=_window(parts[1]), instance=instance, topic=topic)
    return ReplayReply(seq, bytes(parts[1]), instance=instance, topic=topic)


def _window(payload: bytes) -> tuple[int | None, int | None] | None:
    """ROCm ATOM's end-marker payload, msgpack ``[oldest, latest]`` (either nil when its buffer is
    empty); None for the empty payload of everyone else, or anything else."""
    if not payload:
        return None
    try:
        value = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    if isinstance(value, list) and len(value) == 2 and all(v is None or (type(v) is int and v >= 0) for v in value):
        return (value[0], value[1])
    return None


def _first_byte_kind(obj: Any) -> str:
    if isinstance(obj, list):
        return "array"
    if isinstance(obj, dict):
        return "map"
    return type(obj).__name__


# RFC Mooncake #1527 (Mooncake master #2214, TokenSpeed ``wire_format: "rfc1527"``): its event
# types, and the names consumers read for its fields (docs/sources/producers.md has the table).
RFC1527_TYPES = {"stored": "BlockStored", "removed": "BlockRemoved", "cleared": "AllBlocksCleared"}
_RFC1527_ALIASES = (("seq_hashes", "block_hashes"), ("parent_hash", "parent_block_hash"))
_RFC1527_OMIT_NIL = ("block_size", "token_ids")  # vLLM names these non-null: a nil means unset


def normalise_rfc1527(raw: dict[str, Any]) -> Event:
    """An RFC 1527 map event under the names consumers read, every original field kept.

    ``type`` from ``event_type`` (the producer's own legacy ``type`` only for an ``event_type``
    this bridge does not know: where the two disagree, ``event_type`` decides, as count_batch
    reads it);
    ``block_hashes`` from ``seq_hashes`` and ``parent_block_hash`` from ``parent_hash`` (unless
    the producer sent those legacy aliases itself, which are kept as sent); ``medium`` upper-cased
    ("gpu" -> "GPU"), the producer's spelling kept as ``medium_rfc1527`` when it differs;
    ``block_size`` and ``token_ids`` left out when nil (as vLLM's map generation leaves unset
    fields out). Every other field stays as sent, by name.
    """
    kind = raw["event_type"]
    tag = RFC1527_TYPES.get(kind) if isinstance(kind, str) else None
    if tag is None:
        tag = raw.get("type")
        if not isinstance(tag, str) or not tag:
            raise DecodeError("bad_event", f"RFC 1527 event with event_type {kind!r}, expected stored, removed or cleared")
    event: Event = {"type": tag}
    for k, v in raw.items():
        if k == "type" or (v is None and k in _RFC1527_OMIT_NIL):
            continue
        if k == "medium" and isinstance(v, str) and v != v.upper():
            event["medium_rfc1527"] = v
            v = v.upper()
        event[k] = v
    for original, alias in _RFC1527_ALIASES:
        if alias not in event and original in raw:
            event[alias] = raw[original]
    return event


def normalise_event(raw: Any) -> Event:
    """One decoded wire event as ``{"type": ..., fields...}``; raises DecodeError if malformed."""
    if isinstance(raw, dict):
        if "event_type" in raw:
            return normalise_rfc1527(raw)
        tag = raw.get("type")
        if not isinstance(tag, str) or not tag:
            raise DecodeError("bad_event", "map event without a string 'type'")
        if next(iter(raw)) == "type":
            return raw
        event: Event = {"type": tag}
        event.update((k, v) for k, v in raw.items() if k != "type")
        return event
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str) or not raw[0]:
            raise DecodeError("bad_event", "array event without a type name at position 0")
        tag = raw[0]
        names = ARRAY_FIELDS.get(tag, ())
        values = raw[1:]
        event = {"type": tag}
        n = len(names)
        if len(values) <= n:
            event.update(zip(names, values, strict=False))
        else:
            event.update(zip(names, values[:n], strict=True))
            event["extra"] = values[n:]
        return event
    raise DecodeError("bad_event", f"event is a {_first_byte_kind(raw)}, expected an array or a map")


# -- the plain fast path -------------------------------------------------------------------------
#
# Most batches hold only scalars and lists of scalars. A typed decoder that accepts exactly those
# (it costs what the generic decode costs: both parse every byte once) yields the very objects the
# generic decoder would, and proves on the way that the batch needs no JSON conversion, which the
# renderer would otherwise check value by value. Anything else (binary, a map inside an event,
# deeper nesting, extra batch fields, a bool rank, malformed input) fails it and takes the generic
# path below, which decides and reports exactly as before.

_Scalar = Union[bool, int, float, str, None]  # noqa: UP007 - a union of types, for msgspec
_PlainValue = Union[bool, int, float, str, list[Union[bool, int, float, str, list[_Scalar], None]], None]  # noqa: UP007
_PlainEvent = Union[dict[str, _PlainValue], list[_PlainValue]]  # noqa: UP007


class _PlainArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float  # (an integer one, RFC 1527 milliseconds, is told by its first byte: see MS_TS_ABOVE)
    events: list[_PlainEvent]
    rank: int | None = None
    more: Any = msgspec.UNSET  # set: the batch has extra elements (the generic path keeps them)


class _PlainMapBatch(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[_PlainEvent]
    data_parallel_rank: int | msgspec.UnsetType | None = msgspec.UNSET
    attn_dp_rank: int | msgspec.UnsetType | None = msgspec.UNSET


_plain_array = msgspec.msgpack.Decoder(_PlainArrayBatch)
_plain_map = msgspec.msgpack.Decoder(_PlainMapBatch)


def _decode_plain(payload: bytes) -> DecodedBatch | None:
    """The batch by the plain fast path; None when it is not plain (or not well formed)."""
    first = payload[0] if payload else 0
    try:
        if 0x92 <= first <= 0x9F or first in (0xDC, 0xDD):
            a = _plain_array.decode(payload)
            if a.more is not msgspec.UNSET:
                return None
            ts, events, rank = a.ts, a.events, a.rank
            if ts > MS_TS_ABOVE and first <= 0x9F and payload[1] in _INT64:
                ts /= 1000.0  # an integer ts: RFC 1527 milliseconds
        elif 0x82 <= first <= 0x8F or first in (0xDE, 0xDF):
            m = _plain_map.decode(payload)
            ts, events = m.ts, m.events
            dpr, attn = m.data_parallel_rank, m.attn_dp_rank  # as the generic path: the first key present
            rank = dpr if dpr is not msgspec.UNSET else (None if attn is msgspec.UNSET else attn)
        else:
            return None
        # A map event with its type first (every current release) is used as decoded; a batch of
        # only such events, as the decoder made it (no new list).
        for raw in events:
            if raw.__class__ is not dict or next(iter(raw), None) != "type" or "event_type" in raw:
                break
            t = raw["type"]
            if t.__class__ is not str or not t:
                break
        else:
            return DecodedBatch(ts, events, rank, plain=True)  # type: ignore[arg-type]  # only dicts, checked above
        out = [
            raw
            if raw.__class__ is dict
            and next(iter(raw), None) == "type"
            and raw["type"].__class__ is str
            and raw["type"]
            and "event_type" not in raw
            else normalise_event(raw)
            for raw in events
        ]
    except (msgspec.DecodeError, ValueError, RecursionError, DecodeError):
        return None  # the generic path decides, and reports a bad event without losing the others
    return DecodedBatch(ts, out, rank, plain=True)


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one batch payload (any generation). Raises DecodeError for a malformed batch."""
    plain = _decode_plain(payload)
    return plain if plain is not None else decode_generic(payload)


def decode_generic(payload: bytes) -> DecodedBatch:
    """:func:`decode_batch` without the plain fast path (what the fast path must agree with)."""
    try:
        obj = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise DecodeError("bad_msgpack", str(exc)) from None
    extra: Any = None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise DecodeError("bad_batch", f"batch array has {len(obj)} elements, expected 2 or more")
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
        if len(obj) > 3:
            extra = obj[3:]
    elif isinstance(obj, dict):
        if "events" not in obj or "ts" not in obj:
            raise DecodeError("bad_batch", "batch map without 'ts' and 'events'")
        ts, events = obj["ts"], obj["events"]
        rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
        rest = {k: v for k, v in obj.items() if k not in ("ts", "events", "data_parallel_rank", "attn_dp_rank")}
        extra = rest or None
    else:
        raise DecodeError("bad_batch", f"batch is a {_first_byte_kind(obj)}, expected an array or a map")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise DecodeError("bad_batch", f"batch ts is {type(ts).__name__}, expected a number")
    if not isinstance(events, list):
        raise DecodeError("bad_batch", f"batch events is {type(events).__name__}, expected an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        rank = None
    out: list[Event] = []
    bad: list[BadEvent] = []
    for i, raw in enumerate(events):
        try:
            out.append(normalise_event(raw))
        except DecodeError as exc:
            bad.append(BadEvent(i, exc.detail or exc.reason, raw))
    seconds = float(ts)
    if isinstance(ts, int) and isinstance(obj, list) and payload[0] <= 0x9F and ts > MS_TS_ABOVE:
        seconds = ts / 1000.0  # RFC 1527 milliseconds (its batches are small arrays: a fixarray header)
    return DecodedBatch(seconds, out, rank, bad, extra)


# -- counting without decoding ------------------------------------------------------------------
#
# When no sink needs the events themselves (every sink forwards the engine's bytes), a batch is
# only checked and its events counted by type (for ``kv_bridge_events_received_total``). Typed
# msgspec decoders skip every field but the type without building it, which is several times
# cheaper than decoding the batch. Only known event types are typed: anything else (an unknown
# type, a malformed event or batch) fails here and goes through decode_batch, which reports it
# exactly as before. What the skipped fields hold is not looked at (invalid UTF-8 inside a
# string field there passes): those bytes are forwarded untouched, as raw promises.


_TYPE_OF: dict[type, str] = {}


def _tagged(array: bool) -> Any:
    kind = "Array" if array else "Map"
    kw: dict[str, Any] = {"array_like": True} if array else {"tag_field": "type"}
    classes = [msgspec.defstruct(f"_{t}{kind}", [], tag=t, frozen=True, gc=False, **kw) for t in FIELDS]
    _TYPE_OF.update(zip(classes, FIELDS, strict=True))
    return Union[tuple(classes)]  # noqa: UP007 - a union built at run time


_MAP_EVENTS, _ARRAY_EVENTS = _tagged(False), _tagged(True)


def _tagged_rfc1527() -> Any:
    classes = [
        msgspec.defstruct(f"_Rfc1527{t}", [], tag=k, tag_field="event_type", frozen=True, gc=False)
        for k, t in RFC1527_TYPES.items()
    ]
    _TYPE_OF.update(zip(classes, RFC1527_TYPES.values(), strict=True))
    return Union[tuple(classes)]  # noqa: UP007 - a union built at run time


_RFC1527_EVENTS = _tagged_rfc1527()


def _counter(events: Any, array_batch: bool) -> msgspec.msgpack.Decoder[Any]:
    if array_batch:
        batch = msgspec.defstruct("_ArrayBatch", [("ts", float), ("events", list[events])], array_like=True)
    else:
        batch = msgspec.defstruct("_MapBatch", [("ts", float), ("events", list[events])])
    return msgspec.msgpack.Decoder(batch)


# (array batch?, event form) -> decoder; RFC 1527 maps are typed by ``event_type`` (normalise_rfc1527)
_EVENT_FORMS = {"map": _MAP_EVENTS, "array": _ARRAY_EVENTS, "rfc1527": _RFC1527_EVENTS}
_COUNTERS = {(b, e): _counter(events, b) for b in (True, False) for e, events in _EVENT_FORMS.items()}


class EventCount(msgspec.Struct, frozen=True, gc=False):
    """What :func:`count_batch` learns of a batch: its ``ts`` and its events' types, in order."""

    ts: float
    types: list[str]


def count_batch(payload: bytes) -> EventCount | None:
    """The batch's ts and event types without decoding the events; None when that is not enough
    (unknown event types, malformed input): then use :func:`decode_batch`.

    Accepts what decode_batch accepts without reporting anything (bad events, odd ranks aside).
    """
    if not payload:
        return None
    first = payload[0]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        array_batch = True
    elif 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        array_batch = False
    else:
        return None
    for form in _EVENT_FORMS:  # map events first: every current release
        try:
            batch = _COUNTERS[(array_batch, form)].decode(payload)
        except (msgspec.DecodeError, ValueError, RecursionError):
            continue
        type_of = _TYPE_OF
        ts = batch.ts
        if ts > MS_TS_ABOVE and first <= 0x9F and payload[1] in _INT64:
            ts /= 1000.0  # an integer ts: RFC 1527 milliseconds (as decode_batch)
        return EventCount(ts, [type_of[type(e)] for e in batch.events])
    return None


_struct_f64 = struct.Struct(">d")


def peek_ts(payload: bytes) -> float | None:
    """The batch's ``ts`` without decoding the events (array batches); None if not found cheaply.

    Array batches start with a fixarray header (``0x92``/``0x93``) and a float64 (``cb`` + 8
    bytes); anything else falls back to a full decode.
    """
    if len(payload) >= 10 and payload[0] in (0x92, 0x93, 0x94) and payload[1] == _FLOAT64:
        return float(_struct_f64.unpack_from(payload, 2)[0])
    try:
        return decode_batch(payload).ts
    except DecodeError:
        # What count_batch reads of it, if anything: a raw-only bridge delivers such a batch with
        # that ts (Record.ts, the checkpoint's fingerprint), and its sequencer must agree.
        counted = count_batch(payload)
        return counted.ts if counted is not None else None
