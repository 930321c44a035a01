"""The state contract: the keys and documents every sink's ``state:`` writer writes, and reads back.

Pure (no I/O). One stream's state is its *head* and one *entry* per live block, each a JSON
object; every sink stores them under its own names (docs/output/state.md), with the entry key
``{medium}/{group_idx}/{block id as 16 hex digits}`` inside the stream (``-`` for a medium or
group the engine did not send; characters other than letters, digits and ``_`` in a medium as
``=XX``, its UTF-8 bytes in hex; the document keeps the medium as sent).

Head: ``{"source", "dp_rank", "epoch", "gen", "seq", "complete", "live", "tracking", "next"}``:
the state reflects every record of the stream up to ``(epoch, seq)`` (``seq`` -1: the epoch's
``SourceReset`` and nothing after it); ``next`` says where the stream's messages continue in the
sink (its form is the sink's: docs/output/state.md). Entry: ``{"source", "dp_rank", "epoch", "gen", "seq",
"medium", "group_idx", "block", "count", "hash", "parent", "token_ids", "block_size", "lora_id",
"lora_name", "extra_keys"}`` where ``(epoch, seq)`` is the record that last changed it and ``gen``
the generation it was written in; the token policy of the sink applies (``drop``: no
``token_ids``; ``hash``: ``token_hashes`` instead) and ``hash_format: hex`` writes hashes as hex.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec

from .config import SinkConfig
from .filters import BlockHasher
from .formats import hex64
from .records import Stream
from .state import BlockFact, EntryChange, Head, SeedEntry, block_id

_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder(dict[str, Any])
_UNSAFE = re.compile(r"[^A-Za-z0-9_]+")


def _escape(m: re.Match[str]) -> str:
    return "".join(f"={b:02X}" for b in m.group(0).encode())


def tier_text(medium: str | None, group_idx: int | None) -> str:
    """``{medium}/{group_idx}`` as an entry key writes them: ``-`` for one not sent, a medium's
    characters other than letters, digits and ``_`` as ``=XX`` (UTF-8 bytes), so that two tiers
    never share a key."""
    m = "-" if medium is None else (_UNSAFE.sub(_escape, medium) or "=")
    return f"{m}/{'-' if group_idx is None else group_idx}"


def entry_key(medium: str | None, group_idx: int | None, block: int) -> str:
    """An entry's key inside its stream."""
    return f"{tier_text(medium, group_idx)}/{block:016x}"


class StateFormat:
    """How one sink writes its state documents: its token policy and hash form."""

    def __init__(self, token_ids: str = "keep", key: bytes | None = None, *, hash_hex: bool = False) -> None:
        if token_ids == "hash" and not key:
            raise ValueError("token_ids: hash needs a key")
        self.token_ids = token_ids
        self._hasher = BlockHasher(key) if token_ids == "hash" and key else None
        self.hash_hex = hash_hex

    @classmethod
    def for_sink(cls, sink: SinkConfig) -> StateFormat:
        key = sink.token_ids_key.reveal().encode() if sink.token_ids_key is not None else None
        return cls(sink.token_ids, key, hash_hex=sink.hash_format == "hex")

    def _hash(self, value: object) -> object:
        if type(value) is int:
            return hex64(value) if self.hash_hex else value
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value).hex()
        return value

    def head(self, stream: Stream, head: Head, next_: object = None) -> bytes:
        return _json.encode(
            {
                "source": stream.source,
                "dp_rank": stream.dp_rank,
                "epoch": head.epoch,
                "gen": head.generation,
                "seq": head.seq,
                "complete": head.complete,
                "live": head.live,
                "tracking": head.tracking,
                "next": next_,
            }
        )

    def entry(self, stream: Stream, head: Head, change: EntryChange) -> bytes:
        """The document of a live entry (``change.count`` > 0); its version is ``head``'s."""
        fact = change.fact
        doc: dict[str, Any] = {
            "source": stream.source,
            "dp_rank": stream.dp_rank,
            "epoch": head.epoch,
            "gen": head.generation,
            "seq": head.seq,
            "medium": change.medium,
            "group_idx": change.group_idx,
            "block": format(change.block, "016x"),
            "count": change.count,
        }
        if fact is not None:
            doc["hash"] = self._hash(fact.hash)
            doc["parent"] = None if fact.parent is None else self._hash(fact.parent)
            if self.token_ids == "keep":
                doc["token_ids"] = fact.token_ids
            elif self._hasher is not None:
                if fact.token_hashes is not None and not fact.token_ids:  # a fact read back: as it was written
                    doc["token_hashes"] = fact.token_hashes
                else:
                    blocks = self._hasher.blocks(fact.token_ids, len(fact.token_ids) or None, self.hash_hex)
                    doc["token_hashes"] = blocks or []
            doc["block_size"] = fact.block_size
            doc["lora_id"] = fact.lora_id
            doc["lora_name"] = fact.lora_name
            doc["extra_keys"] = _jsonable(fact.extra_keys)
        return _json.encode(doc)


def _jsonable(value: object) -> object:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


# -- reading back (a restarted bridge's rebuild, and the bootstrap library) ---------------------


def parse(value: bytes | str) -> dict[str, Any] | None:
    """A state document, or None when it is not one (a foreign or damaged value)."""
    try:
        doc = _decode.decode(value)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    return doc


def head_of(doc: dict[str, Any]) -> Head | None:
    """The :class:`Head` a head document holds; None when it is malformed."""
    try:
        head = Head(
            epoch=int(doc["epoch"]),
            generation=int(doc["gen"]),
            seq=int(doc["seq"]),
            complete=bool(doc["complete"]),
            live=int(doc["live"]),
            tracking=bool(doc.get("tracking", True)),
        )
    except (KeyError, TypeError, ValueError):
        return None
    return head


def _hash_back(value: object) -> int | bytes | None:
    """A hash as written (an int, 16 hex digits of an int, or the hex of a binary digest)."""
    if type(value) is int:
        return value
    if isinstance(value, str):
        try:
            return int(value, 16) if len(value) == 16 else bytes.fromhex(value)
        except ValueError:
            return None
    return None


def seed_entry(doc: dict[str, Any]) -> SeedEntry | None:
    """The tracker's view of an entry document (for StateTracker.seed); None when malformed."""
    try:
        medium, group = doc["medium"], doc["group_idx"]
        block = int(doc["block"], 16)
        count, seq = int(doc["count"]), int(doc["seq"])
    except (KeyError, TypeError, ValueError):
        return None
    if not (medium is None or isinstance(medium, str)) or not (group is None or type(group) is int):
        return None
    fact = None
    if count > 1 and "hash" in doc:  # (an entry written without its fact has none to give back)
        h = _hash_back(doc.get("hash"))
        fact = BlockFact(
            hash=block if h is None else h,
            parent=_hash_back(doc.get("parent")),
            token_ids=doc.get("token_ids") or [],
            block_size=doc.get("block_size"),
            medium=medium,
            group_idx=group,
            lora_id=doc.get("lora_id"),
            lora_name=doc.get("lora_name"),
            extra_keys=doc.get("extra_keys"),
            token_hashes=doc["token_hashes"] if isinstance(doc.get("token_hashes"), list) else None,
        )
    return (medium, group, block, count, seq, fact)


def seed_of(head_doc: dict[str, Any], entry_docs: Iterable[dict[str, Any]]) -> tuple[Head, list[SeedEntry]] | None:
    """What a restarted bridge rebuilds a stream from (``read_state``): the head and the entries of
    its (epoch, generation); others are left out (a clear the sink applies key by key may leave
    older ones behind, a write a crash cut after its clear newer ones, which the next clear, in a
    generation above both, makes irrelevant). None (cannot tell) when the head is unreadable."""
    head = head_of(head_doc)
    if head is None:
        return None
    current = (head.epoch, head.generation)
    entries: list[SeedEntry] = []
    for doc in entry_docs:
        try:
            generation = (int(doc["epoch"]), int(doc["gen"]))
        except (KeyError, TypeError, ValueError):
            continue
        entry = seed_entry(doc) if generation == current else None
        if entry is not None:
            entries.append(entry)
    return head, entries


__all__ = ["StateFormat", "block_id", "entry_key", "head_of", "parse", "seed_entry", "seed_of", "tier_text"]
