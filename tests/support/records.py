"""Records for tests: realistic engine batches and control records without any socket."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from bridge.records import Event, Record, Stream, events_lost, source_reset


def block_stored(i: int, *, parent: int | None = None, n_blocks: int = 2, block_size: int = 16) -> Event:
    hashes = [(i * 1_000_003 + k) * 0x9E3779B97F4A7C15 % 2**64 for k in range(n_blocks)]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(i * 100, i * 100 + n_blocks * block_size)),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
    }


def batch(stream: Stream, seq: int, *, epoch: int = 0, n_events: int = 3, binary: bool = False) -> Record:
    """An engine batch record: BlockStored events then a BlockRemoved, with a msgpack payload."""
    events: list[Event] = [block_stored(seq * 10 + k) for k in range(max(1, n_events - 1))]
    removed: Event = {"type": "BlockRemoved", "block_hashes": [seq * 7 + 1, 2**64 - 1 - seq], "medium": "GPU"}
    if binary:
        for e in events:
            e["block_hashes"] = [int(h).to_bytes(32, "big") for h in e["block_hashes"]]
        removed["block_hashes"] = [int(h).to_bytes(32, "big") for h in removed["block_hashes"]]
    events.append(removed)
    ts = 1_700_000_000.0 + seq * 0.01
    payload = msgspec.msgpack.encode([ts, events, stream.dp_rank])
    return Record(stream=stream, epoch=epoch, seq=seq, ts=ts, payload=payload, events=events, received=ts)


def stream_records(stream: Stream, count: int, *, epoch: int = 0, start: int = 0) -> list[Record]:
    return [batch(stream, s, epoch=epoch) for s in range(start, start + count)]


def control_records(stream: Stream, epoch: int) -> list[Record]:
    """A SourceReset for ``epoch`` and an EventsLost for seqs 0..4 of it."""
    return [source_reset(stream, epoch, "publisher_restart", 0.0), events_lost(stream, epoch, 0, 4, "replay_unavailable", 0.0)]


class CacheModel:
    """The engine's cache as vLLM keeps it, to compare a block index with: copies counted per
    (block, medium, group_idx) (two stores and one removal leave one copy; a removal of an absent
    copy changes nothing); ``blocks``: the members of the blocks with a copy held."""

    def __init__(self, member: Callable[[Any], str]) -> None:
        self.member = member
        self.copies: Counter[tuple[str, Any, Any]] = Counter()

    @property
    def blocks(self) -> set[str]:
        return {m for (m, _, _), n in self.copies.items() if n > 0}

    def apply(self, record: Record) -> None:
        if record.kind == "SourceReset":
            self.copies.clear()
            return
        for event in record.events:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                self.copies.clear()
            elif kind in ("BlockStored", "BlockRemoved"):
                for h in event["block_hashes"]:
                    copy = (self.member(h), event.get("medium"), event.get("group_idx"))
                    if kind == "BlockStored":
                        self.copies[copy] += 1
                    elif self.copies[copy] > 0:
                        self.copies[copy] -= 1
