"""Per-sink event transforms: field selection, the token policy, and hex hashes for msgpack.

Pure: no I/O. An :class:`EventFilter` is built once per sink configuration (:func:`for_sink`) and
applied by the renderer to a batch's events, once per batch and renderer (sinks with the same
format, granularity, hash form and filter share one). A sink without ``fields``, with
``token_ids: keep`` (and not msgpack with ``hash_format: hex``) has no filter at all: its records
are rendered exactly as before, with no per-event work added.

Order, per event (control records are never filtered):

1. field selection on the engine's field names: the event type's ``by_type`` rule, else the
   top-level one; ``keep`` writes only the fields named (and ``type``), ``drop`` all but those;
2. the token policy on what is left, for every field whose name ends in ``token_ids``
   (``token_ids``, ``lookahead_token_ids``, and such fields of newer engines): ``drop`` removes
   them; ``hash`` replaces ``token_ids`` by ``token_hashes`` (one keyed hash per block, see
   :class:`BlockHasher`) and removes the others (they are not whole blocks). Both also remove
   ``extra`` (array positions past the known fields: the bridge cannot tell what they hold);
3. for msgpack with ``hash_format: hex``: every block hash (integers of either sign, binary
   digests) becomes 16 / 64 lowercase hex digits, as the json format writes them.

The input events are shared by every sink and never changed: an event that changes is copied.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import struct
from collections.abc import Iterable
from typing import Any

import msgspec

from .config import FieldRule, FieldSelection, SinkConfig, TokenPolicy
from .records import Event
from .schema import HASH_FIELDS
from .wire import FIELDS

TOKEN_SUFFIX = "token_ids"
TOKEN_FIELD = "token_ids"
TOKEN_HASHES = "token_hashes"
"""The field ``token_ids: hash`` writes in place of ``token_ids``."""
EXTRA = "extra"
HASH_BYTES = 8
"""Token block hashes are HMAC-SHA256 truncated to its first 8 bytes."""

_PLAIN = frozenset({"type"} | {f for names in FIELDS.values() for f in names if not f.endswith(TOKEN_SUFFIX)})
"""Event fields that never hold token ids (every other field is looked at by name)."""
_TOKENS = (TOKEN_FIELD, *sorted({f for names in FIELDS.values() for f in names} - _PLAIN - {TOKEN_FIELD}), EXTRA)
"""The known fields the token policy removes (or, token_ids, hashes)."""
_KNOWN = _PLAIN | frozenset(_TOKENS)
_U64 = 0xFFFFFFFFFFFFFFFF
_BLOCK = 64  # SHA-256's block size, for HMAC's pads
_packers: dict[int, struct.Struct] = {}
_msgpack = msgspec.msgpack.Encoder()

# (keep, drop): keep holds "type" too; exactly one of them is set.
_Rule = tuple[frozenset[str] | None, frozenset[str]]


def token_bytes(tokens: list[Any]) -> bytes:
    """A block's canonical bytes: each token id as 8 bytes, big-endian (two's complement for a
    negative one). A block holding anything but integers in -2^63..2^64-1 (an engine breaking the
    protocol) is taken as its msgpack encoding (or repr) instead, so it still hashes without failing."""
    packed = _pack(tokens)
    return packed if packed is not None else _encode_any(tokens)


def _pack(tokens: list[Any]) -> bytes | None:
    """The 8-bytes-per-token form, or None when a value has none."""
    n = len(tokens)
    packer = _packers.get(n)
    if packer is None:
        packer = struct.Struct(f">{n}Q")
        if n <= 4096:  # block sizes and prompt lengths: bounded
            _packers[n] = packer
    try:
        return packer.pack(*tokens)
    except (struct.error, TypeError):
        pass
    if all(type(t) is int and -(2**63) <= t <= _U64 for t in tokens):
        return b"".join((t & _U64).to_bytes(8, "big") for t in tokens)
    return None


def _encode_any(value: Any) -> bytes:
    try:
        return _msgpack.encode(value)
    except (TypeError, ValueError, OverflowError):
        return repr(value).encode()


class BlockHasher:
    """HMAC-SHA256 of token blocks under one key, truncated to :data:`HASH_BYTES`.

    The inner and outer pads are hashed once: per block this costs two SHA-256 copies (HMAC as
    RFC 2104 defines it; ``hmac.digest(key, token_bytes(block), "sha256")[:8]`` gives the same).
    """

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > _BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def digest(self, data: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:HASH_BYTES]

    def blocks(self, tokens: Any, block_size: Any, hex_: bool) -> list[Any] | None:
        """One hash per block of ``block_size`` tokens (the last one may be short; without a
        positive block size, the whole list is one block): unsigned 64-bit integers (the digest
        read big-endian), or their 16 hex digits with ``hex_``."""
        if tokens is None:
            return None
        if type(tokens) is not list:
            data = [self.digest(_encode_any(tokens))]
        else:
            n = len(tokens)
            size = block_size if type(block_size) is int and block_size > 0 else max(n, 1)
            whole = _pack(tokens)
            if whole is None:
                data = [self.digest(token_bytes(tokens[i : i + size])) for i in range(0, n, size)]
            else:  # the usual case: one pack for the event, sliced per block, digest() inlined
                step, inner, outer, out = 8 * size, self._inner.copy, self._outer.copy, []
                for i in range(0, len(whole), step):
                    h = inner()
                    h.update(whole[i : i + step])
                    o = outer()
                    o.update(h.digest())
                    d = o.digest()[:HASH_BYTES]
                    out.append(d.hex() if hex_ else int.from_bytes(d, "big"))
                return out
        if hex_:
            return [d.hex() for d in data]
        return [int.from_bytes(d, "big") for d in data]


def _hex(value: Any) -> Any:
    t = type(value)
    if t is int:
        return format(value & _U64, "016x")
    if t is bytes or t is bytearray or t is memoryview:
        return bytes(value).hex()
    if t is list or t is tuple:
        return [_hex(v) for v in value]
    return value


def hex_hashes(event: Event) -> Event:
    """``event`` with every block hash field as lowercase hex (a copy when one is there)."""
    if HASH_FIELDS.isdisjoint(event):
        return event
    return {k: (_hex(v) if k in HASH_FIELDS else v) for k, v in event.items()}


_NAMES = frozenset({"type", "extra", "token_offset", *(name for names in FIELDS.values() for name in names)})
"""Every event field name the bridge knows (any producer's, any generation's)."""


def misspelt_fields(fields: FieldSelection | None, path: str) -> list[str]:
    """A warning for each name of ``fields`` (its keep/drop, and each of its by_type rules') that
    is no known field but close to one: a name an event does not have is ignored, so a typo in
    ``keep`` writes records with only ``type``, and one in ``drop`` drops nothing.
    Not a problem: a newer engine may send a field the bridge does not know yet."""
    if fields is None:
        return []
    rules = [(f"{path}.fields", fields), *((f"{path}.fields.by_type.{t}", r) for t, r in fields.by_type.items())]
    out = []
    for where, rule in rules:
        for key in ("keep", "drop"):
            for j, name in enumerate(getattr(rule, key) or ()):
                near = difflib.get_close_matches(name, _NAMES, n=1, cutoff=0.8) if name not in _NAMES else []
                if near:
                    out.append(f"{where}.{key}[{j}]: no event has a field {name!r} (did you mean {near[0]!r}?): it is ignored")
    return out


def _rule(rule: FieldRule | None) -> _Rule | None:
    if rule is None or (rule.keep is None and not rule.drop):
        return None
    if rule.keep is not None:
        return frozenset({*rule.keep, "type"}), frozenset()
    return None, frozenset(rule.drop or ())


class EventFilter:
    """One sink configuration's transform of a batch's events (see the module docstring).

    Filters compare equal when they write the same thing (the key is compared through its digest),
    so sinks configured alike share one renderer.
    """

    __slots__ = ("_default", "_hasher", "_hex_hashes", "_hex_tokens", "_identity", "_rules", "_tokens")

    def __init__(
        self,
        fields: FieldSelection | None = None,
        token_ids: TokenPolicy = "keep",
        key: bytes | None = None,
        *,
        hash_hex: bool = False,
        hex_hashes: bool = False,
    ) -> None:
        if token_ids == "hash" and not key:
            raise ValueError("token_ids: hash needs a key")
        self._default: _Rule | None = _rule(fields)
        self._rules: dict[str, _Rule | None] = {t: _rule(r) for t, r in (fields.by_type if fields else {}).items()}
        self._tokens = token_ids
        self._hasher = BlockHasher(key) if token_ids == "hash" and key else None
        self._hex_tokens = hash_hex
        self._hex_hashes = hex_hashes
        key_id = hashlib.sha256(key).digest() if token_ids == "hash" and key else None
        self._identity = (
            self._default,
            tuple(sorted(self._rules.items(), key=lambda kv: kv[0])),
            token_ids,
            key_id,
            hash_hex and token_ids == "hash",
            hex_hashes,
        )

    @property
    def identity(self) -> tuple[Any, ...]:
        return self._identity

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EventFilter) and other._identity == self._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def __repr__(self) -> str:
        return f"EventFilter(fields={self._default!r}, by_type={self._rules!r}, token_ids={self._tokens!r})"

    def with_hex_hashes(self) -> EventFilter:
        """This filter, also writing block hashes as hex (msgpack with ``hash_format: hex``)."""
        out = copy.copy(self)
        out._hex_hashes = True
        out._identity = (*self._identity[:-1], True)
        return out

    def __call__(self, events: Iterable[Event]) -> list[Event]:
        """The events as the sink writes them, in order (one per input event)."""
        one = self.event
        return [one(e) for e in events]

    def event(self, event: Event) -> Event:
        """One event as the sink writes it; ``event`` itself when nothing changes."""
        rules = self._rules
        rule = rules.get(event.get("type", ""), self._default) if rules else self._default
        if rule is not None:
            keep, drop = rule
            # Set operations and a C-level copy, then deletions: cheaper than rebuilding by key.
            gone = event.keys() - keep if keep is not None else drop.intersection(event)
            if gone:
                event = _without(event, gone)
        if self._tokens != "keep":
            event = self._private(event)
        if self._hex_hashes:
            event = hex_hashes(event)
        return event

    def _private(self, event: Event) -> Event:
        if _KNOWN.issuperset(event):  # the usual case: only fields the bridge knows by name
            gone = [k for k in _TOKENS if k in event]
        else:
            suffix = TOKEN_SUFFIX
            gone = [k for k in event.keys() - _PLAIN if k == EXTRA or _name(k).endswith(suffix)]
        if not gone:
            return event
        out = _without(event, gone)
        hasher = self._hasher
        if hasher is not None and TOKEN_FIELD in gone:
            out[TOKEN_HASHES] = hasher.blocks(event[TOKEN_FIELD], event.get("block_size"), self._hex_tokens)
        return out


def _name(key: object) -> str:
    """A field name as a consumer reads it: a binary key (msgpack ``bin``) is written as text
    too (base64 in JSON, bytes in msgpack), so it is matched by its UTF-8 text."""
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key).decode("utf-8", "replace")
    return key if isinstance(key, str) else ""


def _without(event: Event, gone: Iterable[str]) -> Event:
    out = event.copy()
    for k in gone:
        del out[k]
    return out


def for_sink(sink: SinkConfig) -> EventFilter | None:
    """The sink's filter, or None when it writes every event as the engine sent it (and for raw)."""
    if sink.format == "raw" or (sink.fields is None and sink.token_ids == "keep"):
        return None
    key = sink.token_ids_key.reveal().encode() if sink.token_ids_key is not None else None
    return EventFilter(sink.fields, sink.token_ids, key, hash_hex=sink.hash_format == "hex")


__all__ = [
    "HASH_BYTES",
    "TOKEN_HASHES",
    "BlockHasher",
    "EventFilter",
    "for_sink",
    "hex_hashes",
    "token_bytes",
]
