"""State bootstrap from a Redis Streams sink (redis-py; the ``redis`` extra).

The sink writes one Redis stream per engine stream, each entry with an explicit id built from the
record's (epoch, slot, sub) (:func:`entry_position` reads it back: the record's
:func:`~kv_consumer.state.position`; the bridge's ``connectors.redis.entry_id`` writes it), so ids
grow along the stream and ``XREAD`` from the last id
read resumes exactly. With ``state.enabled`` each engine stream also has a HASH: field ``_head``
(the head document) and one field per live block (its entry document).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from .state import NO_HEAD, StreamState, parse, swept

SLOT_BITS = 40
"""Bits that hold the slot (engine seq + 1) in either id layout."""
MAX_SLOT = (1 << SLOT_BITS) - 1
MAX_SUB = (1 << 64) - 1
WIDE_EPOCHS = 1 << (63 - SLOT_BITS)
"""The first epoch of the wide layout (8,388,608). Below it, the narrow layout
``<epoch * 2**40 + slot>-<sub>``: the minute epochs of streams written by earlier releases (about
1,000,000 in 2026) and small numbers; epochs are microseconds now, far above."""
WIDE = 1 << 63
"""The wide layout, ``<2**63 + epoch>-<slot * 2**24 + sub>``, has this bit of its first part set;
no narrow id has, so every narrow id sorts below every wide one."""
SUB_BITS = 24
"""Bits of a wide id's second part that hold the sub (event index + 1; all ones: the slot's last)."""
MAX_WIDE_SUB = (1 << SUB_BITS) - 1


def entry_position(entry: str | bytes) -> tuple[int, int, int]:
    """(epoch, slot, sub) of an entry id the bridge wrote, in either layout (an EventsLost's or a
    state change's sub, after everything of its slot, reads as ``2**64 - 1``)."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    first_text, _, sub_text = text.partition("-")
    first, sub = int(first_text), int(sub_text or 0)
    if first < WIDE:
        return (first >> SLOT_BITS, first & MAX_SLOT, sub)
    low = sub & MAX_WIDE_SUB
    return (first & ~WIDE, sub >> SUB_BITS, MAX_SUB if low == MAX_WIDE_SUB else low)


async def hash_fields(client: aioredis.Redis | aioredis.RedisCluster, key: str) -> dict[bytes, bytes]:
    """Every field of a hash, read with HSCAN (no single long command on a big hash). The client
    must not decode responses."""
    out: dict[bytes, bytes] = {}
    cursor: int = 0
    while True:
        cursor, chunk = await client.hscan(key, cursor, count=1000)
        out.update(chunk)  # type: ignore[arg-type]  # bytes: the client does not decode responses
        if not cursor:
            return out


async def bootstrap(
    client: aioredis.Redis | aioredis.RedisCluster, state_key: str, stream_key: str | None = None, *, attempts: int = 5
) -> tuple[StreamState, str | None]:
    """A consumer's state bootstrap of one engine stream: its head, its state hash read with
    HSCAN, then its head read again (a clear that ran meanwhile, or a head gone back: Redis
    restarted from an older snapshot, makes it start over, up to ``attempts`` times). With
    ``stream_key``, also that the stream still holds everything after the head (``maxlen`` trims
    the oldest entries: a sweep slower than the trimming starts over too). Returns the state and
    the entry id to follow the stream key from (``XRANGE key (ID +`` or ``XREAD ... ID``), then
    :meth:`StreamState.apply` each entry's ``data``; None (no state yet): follow from the
    stream's first entry. Keep up with the trimming while following, too. Raises redis-py's
    errors, and RuntimeError when clears or trimming kept cutting the sweep."""
    for _ in range(attempts):
        # The head first: every entry the sweep reads afterwards is at or after it (one read
        # before the head may predate changes the head already covers, and would miss them).
        raw_head = await client.hget(state_key, "_head")
        if raw_head is None:
            return StreamState(NO_HEAD, []), None
        head = parse(raw_head) or {}
        fields = await hash_fields(client, state_key)
        fields.pop(b"_head", None)
        again = parse(await client.hget(state_key, "_head") or b"") or {}
        if (again.get("epoch"), again.get("gen")) != (head.get("epoch"), head.get("gen")) or b"_w" in fields:
            continue
        if _seq(again) < _seq(head):
            continue  # the hash went back (Redis restarted from an older snapshot): the sweep mixes both
        after = head.get("next")
        if stream_key is not None and isinstance(after, str) and await _trimmed_after(client, stream_key, after):
            continue
        docs = [d for f, v in fields.items() if b"/" in f and (d := parse(v)) is not None]
        # Counted only when no write landed during the sweep (one script call writes entries and head).
        return swept(head, docs, counted=again == head), after
    raise RuntimeError(
        f"{state_key}: the state was cleared, or its stream trimmed past its head, during each of {attempts} sweeps"
    )


def _seq(head: dict[str, Any]) -> int:
    seq = head.get("seq")
    return seq if type(seq) is int else -1


async def _trimmed_after(client: aioredis.Redis | aioredis.RedisCluster, stream_key: str, after: str) -> bool:
    """Whether the stream may have lost entries after ``after``: its first entry is past it (the
    head's own entries, and maybe more, trimmed away; a stream that still holds the head's record
    or an earlier one lost nothing after it)."""
    first: Any = await client.xrange(stream_key, "-", "+", count=1)
    return bool(first) and entry_position(first[0][0]) > entry_position(after)


__all__ = [
    "MAX_SLOT",
    "MAX_SUB",
    "MAX_WIDE_SUB",
    "SLOT_BITS",
    "SUB_BITS",
    "WIDE",
    "WIDE_EPOCHS",
    "bootstrap",
    "entry_position",
    "hash_fields",
]
