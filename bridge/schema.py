"""The output contract: the records the ``json`` format writes, as structs, and their JSON Schema.

The renderer (:mod:`bridge.formats`) encodes every record header and control record through the
record structs below, so the field names and their order live here and nowhere else; the event
structs name the known fields of each engine event type (docs/protocol.md section 2: every field of
:data:`bridge.wire.FIELDS` and SGLang's own) in the form the ``json`` format gives them, and the
hash fields the renderer converts for ``hash_format: hex`` are the ones typed :data:`BlockHash`.
:func:`build` turns the structs into a JSON Schema (draft 2020-12); the repository keeps the result
in ``schema/kv-events.schema.json`` and ``python -m bridge schema`` prints it. The state documents
(``state.enabled``: a head and one entry per live block, written by :mod:`bridge.state_docs`) have
their structs here too: :func:`build_state`, ``schema/kv-state.schema.json``,
``python -m bridge schema state``.

Every object is open: consumers must tolerate fields they do not know (newer engines add fields
and event types; a newer bridge may add optional header fields). :data:`SCHEMA_VERSION` travels in
every record (``schema_version``) and in every message's headers. Compatibility rule: additive
changes (a new optional field, a new event type, a new value of a free-text field such as
``reason`` or ``medium``) keep the version; removing or renaming a field, making one required,
changing a field's form or meaning, or a new kind of record bumps it. So far: batch records gained
``type`` ("EventBatch") after version 1 was published, an additive change (optional in the schema,
so earlier batch records still validate): the version stayed 1.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union, get_args, get_type_hints

import msgspec
from msgspec import UNSET, Meta, UnsetType

SCHEMA_VERSION = 1
"""Version of the output contract; bumped only by an incompatible change (see the module docstring)."""

SCHEMA_PATH = "schema/kv-events.schema.json"
"""Where the repository keeps the generated schema (relative to its root)."""
STATE_SCHEMA_PATH = "schema/kv-state.schema.json"
"""And the schema of the state documents."""

_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)
HEX_PATTERN = "^(?:[0-9a-f]{2})+$"

# msgspec refuses integer bounds outside int64 in Meta(ge/le): the unsigned bounds are given to the
# schema directly.
BlockHash = Annotated[
    Union[  # noqa: UP007 - the Annotated members must stay separate union arms
        Annotated[int, Meta(extra_json_schema={"minimum": _I64_MIN, "maximum": _U64_MAX})],
        Annotated[str, Meta(pattern=HEX_PATTERN)],
    ],
    Meta(
        title="BlockHash",
        description=(
            "A block hash. Integer hashes (signed 64-bit from vLLM <= 0.10.1 and SGLang, unsigned 64-bit "
            "from newer vLLM) are JSON integers, or 16 lowercase hex digits (two's complement for negatives) "
            "with hash_format: hex; binary hashes (32-byte digests) are lowercase hex strings."
        ),
    ),
]
TokenHash = Annotated[
    Union[  # noqa: UP007 - the Annotated members must stay separate union arms
        Annotated[int, Meta(ge=0, extra_json_schema={"maximum": _U64_MAX})],
        Annotated[str, Meta(pattern="^[0-9a-f]{16}$")],
    ],
    Meta(
        title="TokenHash",
        description=(
            "A keyed hash of one block of token ids (HMAC-SHA256, its first 8 bytes read big-endian): an unsigned "
            "64-bit integer, or 16 lowercase hex digits with hash_format: hex."
        ),
    ),
]
Seq = Annotated[int, Meta(ge=0, extra_json_schema={"maximum": _U64_MAX})]
Version = Annotated[
    int,
    Meta(
        description="Version of the output contract this record follows (same value as the schema_version header).",
        extra_json_schema={"const": SCHEMA_VERSION},
    ),
]
Ts = Annotated[
    float | None,
    Meta(description="The engine's wall clock (float seconds) when its step ended; null if it was not a finite number."),
]
Reason = Annotated[str, Meta(description="Why, as a stable token (see docs/output/records.md); new values may appear.")]
TokenIds = list[int]
_Opt = UnsetType  # an optional field: left out when the engine left it out
_NStr = str | UnsetType | None  # optional, null when unset (array-encoded engines send every field)
_NInt = int | UnsetType | None


# -- the records -----------------------------------------------------------------------------------


class StreamHeader(msgspec.Struct):
    """The stream identity every record starts with; (source, dp_rank, epoch, seq[, index]) is
    what consumers deduplicate on."""

    source: Annotated[str, Meta(description="Source name from the bridge's configuration.")]
    dp_rank: Annotated[int, Meta(ge=0, description="Data-parallel rank of the engine process.")]
    epoch: Annotated[int, Meta(ge=0, description="Grows along a stream; a new one after every engine restart.")]
    seq: Annotated[
        Seq,
        Meta(
            description="The engine's sequence number of the batch; in EventsLost where the record stands (to_seq, "
            "or later: see EventsLost), 0 in SourceReset; in StateSeeded the batch it follows."
        ),
    ]


class EventRecordHeader(StreamHeader):
    """The header of an event-granularity record; the event's own fields follow."""

    index: Annotated[int, Meta(ge=0, description="The event's position in its engine batch.")]
    ts: Ts
    schema_version: Version


class EventBatch(StreamHeader):
    """A batch-granularity record: one engine batch, its events in order."""

    ts: Ts
    schema_version: Version
    type: Annotated[
        Literal["EventBatch"],
        Meta(
            description="The record's kind, as in the type header (every record has one). Batch records of "
            "earlier bridges lack it: they are told by their events field."
        ),
    ]
    events: Annotated[
        list[dict[str, Any]],
        Meta(description="The batch's events, in engine order (each an Event)."),
    ]


class SourceReset(StreamHeader):
    """The engine restarted (or the bridge cannot prove every sink saw this epoch's start): drop
    what you hold for the stream; its epoch starts here (seq is 0)."""

    schema_version: Version
    type: Literal["SourceReset"]
    reason: Reason


class EventsLost(StreamHeader):
    """Batches from_seq to to_seq (inclusive) of this epoch will never be delivered; seq is where the
    record stands: to_seq, or later when a sink announces a batch it refused for itself after
    storing later batches of the stream (order by seq, not by to_seq)."""

    schema_version: Version
    type: Literal["EventsLost"]
    from_seq: Seq
    to_seq: Seq
    count: Annotated[int, Meta(ge=1, description="to_seq - from_seq + 1.")]
    reason: Reason


class StateSeeded(StreamHeader):
    """Experimental (engine snapshots): the stream's live-block state was re-seeded from an engine
    snapshot and is complete from (epoch, seq), this record's: re-bootstrap from the sink's state.
    It follows every event of the batch at seq; cut is the last seq the snapshot itself reflected
    (the batches between were applied on top of it)."""

    schema_version: Version
    type: Literal["StateSeeded"]
    cut: Annotated[int, Meta(ge=-1, description="The last seq the engine's snapshot reflected (-1: an empty cache).")]
    design: Annotated[str, Meta(description="The snapshot design the engine served: vllm-57789, vllm-50134 or sglang-34407.")]


# -- the engine events -----------------------------------------------------------------------------


class EventFields(msgspec.Struct, kw_only=True):
    """Fields the bridge may add to any event; every field an engine sends is kept by name, and
    each known field may be absent (map-encoded engines leave out unset fields)."""

    type: Annotated[str, Meta(description="The event type, as the engine named it.")]
    extra: Annotated[list[Any] | _Opt, Meta(description="Array positions past the known fields (array-encoded engines).")] = UNSET
    shadowed: Annotated[
        dict[str, Any] | _Opt,
        Meta(description="Event fields named like a header key, moved here so they never override the header."),
    ] = UNSET


class Rfc1527Fields(EventFields, kw_only=True):
    """RFC Mooncake #1527 events (Mooncake master, TokenSpeed) keep their own fields beside the
    names consumers read (docs/sources/producers.md): the three event types they map to carry them."""

    event_id: Annotated[_NInt, Meta(description="RFC 1527: the producer's event counter.")] = UNSET
    timestamp: Annotated[_NInt, Meta(description="RFC 1527: milliseconds since the epoch.")] = UNSET
    event_type: Annotated[
        _NStr, Meta(description="RFC 1527: stored, removed or cleared (type holds the name consumers read).")
    ] = UNSET
    model_name: Annotated[_NStr, Meta(description="RFC 1527.")] = UNSET
    additional_salt: Annotated[_NStr, Meta(description="RFC 1527: the hash namespace salt.")] = UNSET
    tenant_id: Annotated[_NStr, Meta(description="RFC 1527.")] = UNSET
    backend_id: Annotated[_NStr, Meta(description="RFC 1527: the cache owner (storage daemon, pool node).")] = UNSET
    group_id: Annotated[_NStr, Meta(description="RFC 1527 (Mooncake master).")] = UNSET
    object_key: Annotated[_NStr, Meta(description="Mooncake master: the store key.")] = UNSET
    seq_hashes: Annotated[
        list[BlockHash] | _Opt, Meta(description="RFC 1527: the blocks' hashes (block_hashes holds them too).")
    ] = UNSET
    base_block_idx: Annotated[_NInt, Meta(description="RFC 1527: depth of the first block.")] = UNSET
    parent_hash: Annotated[BlockHash | _Opt | None, Meta(description="RFC 1527 (parent_block_hash holds it too).")] = UNSET
    medium_rfc1527: Annotated[
        str | _Opt, Meta(description="RFC 1527: the producer's medium as sent, when medium upper-cased it.")
    ] = UNSET


class BlockStored(Rfc1527Fields, kw_only=True):
    """Blocks entered the engine's cache."""

    type: Literal["BlockStored"]
    block_hashes: Annotated[list[BlockHash] | _Opt, Meta(description="The blocks stored, in order.")] = UNSET
    parent_block_hash: Annotated[
        BlockHash | _Opt | None, Meta(description="The block before the first one; null at the start.")
    ] = UNSET
    token_ids: Annotated[TokenIds | _Opt, Meta(description="The tokens of the blocks, block_size per block.")] = UNSET
    token_hashes: Annotated[
        list[TokenHash] | _Opt | None,
        Meta(description="In place of token_ids on a sink with token_ids: hash: one keyed hash per block of tokens."),
    ] = UNSET
    block_size: Annotated[int | _Opt, Meta(description="Tokens per block.")] = UNSET
    lora_id: _NInt = UNSET
    medium: Annotated[_NStr, Meta(description='Where the blocks live: "GPU", "CPU", "STORAGE" or a connector name.')] = UNSET
    lora_name: _NStr = UNSET
    extra_keys: Annotated[
        list[list[Any] | None] | _Opt | None, Meta(description="One entry per block: null or a list of arbitrary values.")
    ] = UNSET
    group_idx: _NInt = UNSET
    kv_cache_spec_kind: _NStr = UNSET
    kv_cache_spec_sliding_window: _NInt = UNSET
    locality: _NStr = UNSET
    ownership: _NStr = UNSET
    session_id: _NStr = UNSET
    lookahead_token_ids: TokenIds | _Opt | None = UNSET
    block_offsets: Annotated[list[int] | _Opt | None, Meta(description="vLLM #44488 (open).")] = UNSET
    cache_salt: Annotated[_NStr, Meta(description="SGLang.")] = UNSET
    token_offset: Annotated[_NInt, Meta(description="ROCm ATOM: position of the first token of the first block.")] = UNSET


class BlockRemoved(Rfc1527Fields, kw_only=True):
    """Blocks left the engine's cache."""

    type: Literal["BlockRemoved"]
    block_hashes: Annotated[list[BlockHash] | _Opt, Meta(description="The blocks removed.")] = UNSET
    medium: _NStr = UNSET
    group_idx: _NInt = UNSET
    locality: _NStr = UNSET
    ownership: _NStr = UNSET
    remaining_copy_counts: Annotated[
        list[int] | _Opt | None, Meta(description="vLLM #48933 (open): copies left of each block, aligned with block_hashes.")
    ] = UNSET


class AllBlocksCleared(Rfc1527Fields, kw_only=True):
    """The engine's cache is empty (ROCm ATOM: of one medium, when medium is set)."""

    type: Literal["AllBlocksCleared"]
    medium: Annotated[_NStr, Meta(description="ROCm ATOM: the medium cleared.")] = UNSET


class BlockTransferred(EventFields, kw_only=True):
    """ROCm ATOM: blocks moved between media without changing identity."""

    type: Literal["BlockTransferred"]
    block_hashes: Annotated[list[BlockHash] | _Opt, Meta(description="The blocks moved.")] = UNSET
    from_medium: _NStr = UNSET
    to_medium: _NStr = UNSET
    group_idx: _NInt = UNSET


class BlockInactive(EventFields, kw_only=True):
    """vLLM #50732 (open): blocks still cached that no request references any more."""

    type: Literal["BlockInactive"]
    block_hashes: Annotated[list[BlockHash] | _Opt, Meta(description="The blocks.")] = UNSET
    medium: _NStr = UNSET
    group_idx: _NInt = UNSET


KNOWN_EVENTS: tuple[type[EventFields], ...] = (BlockStored, BlockRemoved, AllBlocksCleared, BlockTransferred, BlockInactive)
"""One struct per event type the contract knows."""


class UnknownEvent(EventFields, kw_only=True):
    """An event type the contract does not know yet (a newer engine's): passed on with its fields."""

    type: Annotated[str, Meta(extra_json_schema={"not": {"enum": [c.__name__ for c in KNOWN_EVENTS]}})]


RECORDS: tuple[type[msgspec.Struct], ...] = (EventRecordHeader, EventBatch, SourceReset, EventsLost, StateSeeded)

HEADER_KEYS = frozenset(EventRecordHeader.__struct_fields__)
"""Keys of an event-granularity record's header: an event field named like one goes under ``shadowed``."""


def _mentions(annotation: Any, target: Any) -> bool:
    return annotation == target or any(_mentions(a, target) for a in get_args(annotation))


HASH_FIELDS = frozenset(
    name for cls in KNOWN_EVENTS for name, hint in get_type_hints(cls, include_extras=True).items() if _mentions(hint, BlockHash)
)
"""Event fields that hold block hashes (``hash_format`` applies to them)."""


# -- the state documents ---------------------------------------------------------------------------


class StateDoc(msgspec.Struct):
    """What a head and an entry both start with: the stream, and the version they are of."""

    source: Annotated[str, Meta(description="Source name, as in the stream's records.")]
    dp_rank: Annotated[int, Meta(ge=0, description="Data-parallel rank, as in the stream's records.")]
    epoch: Annotated[int, Meta(ge=0, description="The epoch of the records this document reflects.")]
    gen: Annotated[
        int,
        Meta(
            ge=0,
            description="Generation: rises at every clear of the stream's state. Leave out entries of another "
            "(epoch, gen) than the head's.",
        ),
    ]


class StateHead(StateDoc):
    """A stream's head (key ``_head``): the entries reflect every record up to (epoch, seq)."""

    seq: Annotated[
        int,
        Meta(
            ge=-1,
            extra_json_schema={"maximum": _U64_MAX},
            description="The last record reflected; -1: the epoch's SourceReset only.",
        ),
    ]
    complete: Annotated[
        bool, Meta(description="The entries equal the engine's cache at (epoch, seq); false after a loss or a late join.")
    ]
    live: Annotated[int, Meta(ge=0, description="Live entries of the stream.")]
    tracking: Annotated[bool, Meta(description="False: the stream's state is switched off (state.max_entries).")]
    next: Annotated[
        int | str | None,
        Meta(
            description="Where the stream's messages continue in the sink: a Redis entry id to read after, a Kafka "
            "offset in the stream's partition, a JetStream sequence; null when the sink has none yet."
        ),
    ]


class StateEntry(StateDoc, kw_only=True):
    """One live block of a stream (key ``{medium}/{group_idx}/{block}``); a removed block has none.
    The fields after ``count`` are the block's facts, present once its BlockStored was seen."""

    seq: Annotated[Seq, Meta(description="With epoch: the batch that last changed this entry.")]
    medium: Annotated[str | None, Meta(description="As the engine sent it; null when it sent none.")]
    group_idx: Annotated[int | None, Meta(description="As the engine sent it; null when it sent none.")]
    block: Annotated[
        str, Meta(pattern="^[0-9a-f]{16}$", description="Block id: the hash's last 8 bytes, 16 lowercase hex digits.")
    ]
    count: Annotated[int, Meta(ge=1, description="Residency count: copies the engine holds (one BlockRemoved each).")]
    hash: BlockHash | _Opt = UNSET
    parent: BlockHash | _Opt | None = UNSET
    token_ids: Annotated[TokenIds | _Opt, Meta(description="With token_ids: keep.")] = UNSET
    token_hashes: Annotated[list[TokenHash] | _Opt, Meta(description="With token_ids: hash, in place of token_ids.")] = UNSET
    block_size: int | _Opt | None = UNSET
    lora_id: int | _Opt | None = UNSET
    lora_name: str | _Opt | None = UNSET
    extra_keys: list[Any] | _Opt | None = UNSET


STATE_DOCS: tuple[type[msgspec.Struct], ...] = (StateHead, StateEntry)


# -- the schema ------------------------------------------------------------------------------------

SCHEMA_ID = f"urn:kv-event-bridge:output:v{SCHEMA_VERSION}"
_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/$defs/{name}"}


_SHARED = ("BlockHash", "TokenHash")


def _hoist(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with the inlined schemas of :data:`BlockHash` and :data:`TokenHash` made references
    to ``$defs`` (msgspec inlines annotated types; one definition reads better and says they are
    the same)."""
    if isinstance(node, dict):
        title = node.get("title")
        if title in _SHARED:
            defs.setdefault(title, node)
            return _ref(title)
        return {k: _hoist(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_hoist(v, defs) for v in node]
    return node


def build() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of every record the ``json`` format writes, from the structs."""
    events: tuple[type[EventFields], ...] = (*KNOWN_EVENTS, UnknownEvent)
    _, defs = msgspec.json.schema_components((*RECORDS, *events), ref_template="#/$defs/{name}")
    for d in defs.values():
        # Open objects: consumers must tolerate fields they do not know (said, not left implicit).
        d["additionalProperties"] = True
    shared: dict[str, Any] = {}
    defs = {name: _hoist(d, shared) for name, d in defs.items()} | shared
    defs["Event"] = {
        "title": "Event",
        "description": "One engine event: a known type with its known fields, or a type the contract does not know yet.",
        "oneOf": [_ref(c.__name__) for c in events],
    }
    # The renderer hands events over as the engine's dicts; their schema is the Event union.
    defs["EventBatch"]["properties"]["events"]["items"] = _ref("Event")
    # type joined the batch record after schema version 1 was published: an additive change, so
    # batch records written before it (no type) still validate, and the version stays.
    defs["EventBatch"]["required"].remove("type")
    defs["EventRecord"] = {
        "title": "EventRecord",
        "description": "An event-granularity record: the header, then the event's own fields.",
        "allOf": [_ref("EventRecordHeader"), _ref("Event")],
    }
    return {
        "$schema": _DIALECT,
        "$id": SCHEMA_ID,
        "title": f"kv-event-bridge output record, schema version {SCHEMA_VERSION}",
        "description": (
            "A record the json format writes: an event (event granularity), an engine batch (batch granularity), "
            "or a control record (SourceReset, EventsLost, StateSeeded). Generated by `python -m bridge schema` from "
            "bridge/schema.py; every record and message header carries schema_version. Additive changes keep the version."
        ),
        "x-schema-version": SCHEMA_VERSION,
        "anyOf": [_ref("EventRecord"), *(_ref(c.__name__) for c in RECORDS[1:])],
        "$defs": dict(sorted(defs.items())),
    }


def build_state() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the state documents (head and entry), from the structs."""
    _, defs = msgspec.json.schema_components(STATE_DOCS, ref_template="#/$defs/{name}")
    for d in defs.values():
        d["additionalProperties"] = True
    shared: dict[str, Any] = {}
    defs = {name: _hoist(d, shared) for name, d in defs.items()} | shared
    return {
        "$schema": _DIALECT,
        "$id": f"urn:kv-event-bridge:state:v{SCHEMA_VERSION}",
        "title": f"kv-event-bridge state document, schema version {SCHEMA_VERSION}",
        "description": (
            "A document a sink with state.enabled holds per engine stream: its head (key _head) or one entry per live "
            "block. Generated by `python -m bridge schema state` from bridge/schema.py; it follows the records' "
            "schema_version and compatibility rule."
        ),
        "x-schema-version": SCHEMA_VERSION,
        "anyOf": [_ref(c.__name__) for c in STATE_DOCS],
        "$defs": dict(sorted(defs.items())),
    }


SCHEMAS = {"records": (build, SCHEMA_PATH), "state": (build_state, STATE_SCHEMA_PATH)}
"""What ``python -m bridge schema [records|state]`` prints, and where the repository keeps it."""


def render(which: str = "records") -> str:
    """A schema of :data:`SCHEMAS` as the committed file holds it (2-space indent, a final newline)."""
    return json.dumps(SCHEMAS[which][0](), indent=2, ensure_ascii=False) + "\n"
