"""State bootstrap from a Kafka sink (aiokafka; the ``kafka`` extra).

The sink routes every record of an engine stream (key ``source/dp_rank``) to one partition of its
topic (murmur2 of the key, as Java's client does: :func:`partition_of`). With ``state.enabled``
it also writes a log-compacted state topic: per stream, its head (key ``source/dp_rank/_head``)
and one record per live block (key ``source/dp_rank/medium/group/block``; a tombstone deletes it),
all in the partition of the stream's key. Public aiokafka API only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import DefaultPartitioner

from .state import NO_HEAD, StreamState, follows_head, is_head, parse, swept

HEAD = "_head"
"""The last part of a head's key: ``source/dp_rank/_head``."""
_PARTITIONER = DefaultPartitioner()


def partition_of(key: str | bytes, partitions: Sequence[int]) -> int:
    """The partition (of ``partitions``, the topic's ids) the bridge writes ``key`` to."""
    raw = key.encode() if isinstance(key, str) else key
    return int(_PARTITIONER(raw, list(partitions), list(partitions)))


async def topic_partitions(admin: AIOKafkaAdminClient, topics: Iterable[str]) -> dict[str, list[int]]:
    """The partition ids of each of ``topics`` that exists, asked of the cluster now. (It asks for
    every topic: a metadata request naming a missing topic creates it on a broker with
    ``auto.create.topics.enable``.)"""
    wanted = set(topics)
    described = await admin.describe_topics()
    return {
        t["topic"]: sorted(p["partition"] for p in t["partitions"])
        for t in described
        if t["topic"] in wanted and not t["error_code"] and t["partitions"]
    }


def stream_of(key: bytes) -> bytes:
    """The stream key (``source/dp_rank``) of a state record's key."""
    if key.endswith(b"/" + HEAD.encode()):
        return key[: -len(HEAD) - 1]
    return key.rsplit(b"/", 3)[0]  # source/dp_rank/medium/group/block (medium and group hold no '/')


class StateLog:
    """The state records of some streams, fed in partition order (pure).

    Per stream: the newest value of each key (a tombstone deletes it) as of its last head, the
    head, and the *tail*: the records after the last head (a state write in progress, or cut
    short by a crash). :meth:`cut` is the exact state of the head (the bridge's rebuild);
    :meth:`newest` adds the tail (consumers: the versions sort it out)."""

    def __init__(self, streams: Iterable[str]) -> None:
        self._wanted = {s.encode() for s in streams}
        self._heads: dict[bytes, bytes] = {}
        self._entries: dict[bytes, dict[bytes, bytes]] = {}
        self._tails: dict[bytes, dict[bytes, bytes | None]] = {}
        self.records = 0  # records fed that belong to a wanted stream

    def add(self, key: bytes, value: bytes | None) -> None:
        stream = stream_of(key)
        if stream not in self._wanted:
            return
        self.records += 1
        if len(key) - len(stream) == len(HEAD) + 1:  # the head
            entries = self._entries.setdefault(stream, {})
            tail = self._tails.pop(stream, None)
            if tail:
                _merge(entries, tail)
            if value is None:
                self._heads.pop(stream, None)  # never written by the bridge: a head deleted by hand
            else:
                self._heads[stream] = value
        else:
            self._tails.setdefault(stream, {})[key] = value

    def open(self, stream: str) -> bool:
        """Whether records of ``stream`` follow its last head (a state write not finished)."""
        return bool(self._tails.get(stream.encode()))

    def cut(self, stream: str) -> tuple[bytes | None, list[bytes]]:
        """(last head, entry values as of it); (None, []) when the stream has no head."""
        s = stream.encode()
        head = self._heads.get(s)
        return (None, []) if head is None else (head, list(self._entries.get(s, {}).values()))

    def newest(self, stream: str) -> tuple[bytes | None, list[bytes]]:
        """(last head, newest value of every live key, the tail included)."""
        s = stream.encode()
        entries = dict(self._entries.get(s, {}))
        _merge(entries, self._tails.get(s, {}))
        return self._heads.get(s), list(entries.values())


def _merge(entries: dict[bytes, bytes], records: dict[bytes, bytes | None]) -> None:
    for key, value in records.items():
        if value is None:
            entries.pop(key, None)
        else:
            entries[key] = value


async def read_log(consumer: Any, tp: Any, lo: int, hi: int, log: StateLog) -> None:
    """Feed ``log`` the records of offsets ``lo``..``hi - 1`` of one partition, in order."""
    consumer.seek(tp, lo)
    while await consumer.position(tp) < hi:
        got = await consumer.getmany(tp, timeout_ms=200, max_records=10_000)
        for record in got.get(tp, []):
            if record.offset >= hi:
                break
            if record.offset >= lo and record.key is not None:
                log.add(record.key, record.value)


async def bootstrap(
    consumer: AIOKafkaConsumer,
    source: str,
    dp_rank: int,
    *,
    topic: str = "kv-events",
    state_topic: str = "kv-state",
    partitions: Mapping[str, Sequence[int]],
    partition: int | None = None,
    settle: float = 2.0,
) -> tuple[StreamState, TopicPartition, int]:
    """A consumer's state bootstrap of one engine stream , from a sink
    with ``state.enabled``; ``topic``, ``state_topic`` and ``partition`` as the sink's options,
    ``partitions`` the partition ids of both topics (:func:`topic_partitions`).

    1. Read the stream's state partition (murmur2 of ``source/dp_rank``, as the bridge routes
       it) from its start to the end offset taken first: the newest value per key (tombstones
       delete) and the last head ``H`` of the pass.
    2. Read the head again: if records of the stream follow ``H`` (a state write in progress),
       read on to the new end offsets until a head closes them (up to ``settle`` seconds).
    3. Return the :class:`~kv_consumer.state.StreamState` of ``H`` and those entries, the stream's
       events partition and the offset to follow it from (``H["next"]``; the partition's start
       when there is no head yet or it says nothing), with ``consumer`` assigned to that partition
       and positioned there: :meth:`StreamState.apply` each message of the stream read from it
       (the value decoded; the key is ``source/dp_rank``).

    The head is a fuzzy cut, not a transaction: entries written after ``H`` (by the next
    records) may be in the pass. Their versions make it exact: ``StreamState`` applies an event
    to a key only if it is newer than the entry read, and is ``ready`` once the events passed the
    newest version read. A tombstone has no version: when the pass ends in a state write that
    never closes (a crashed bridge), the state is not ready before the next record is applied.
    Raises aiokafka's errors; ``consumer`` must be started (``group_id=None`` suits it)."""
    key = f"{source}/{dp_rank}"
    known = partitions
    missing = [t for t in (state_topic, topic) if t not in known]
    if missing:
        raise ValueError(f"topic {missing[0]!r} does not exist")
    state_parts, event_parts = known[state_topic], known[topic]
    stp = TopicPartition(state_topic, partition_of(key, state_parts))
    etp = TopicPartition(topic, partition if partition is not None else partition_of(key, event_parts))
    consumer.assign([stp])
    log = StateLog([key])
    lo = (await consumer.beginning_offsets([stp]))[stp]
    deadline = asyncio.get_running_loop().time() + settle
    while True:
        hi = (await consumer.end_offsets([stp]))[stp]
        await read_log(consumer, stp, lo, hi, log)
        lo = hi
        if not log.open(key) or asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(0.05)
    raw, values = log.newest(key)
    head = None if raw is None else parse(raw)
    if head is None or not is_head(head):
        state = StreamState(NO_HEAD, [])
        start = None
    else:
        docs = [d for v in values if (d := parse(v)) is not None]
        open_ = log.open(key)  # a state write in progress: its tombstones may be in the pass
        state = swept(head, docs, counted=not open_)
        if open_:  # not exact before that record is applied
            state.ready_at = max(state.ready_at, (state.epoch, int(head["seq"]) + 1))
        start = head.get("next")
    consumer.assign([etp])
    begin = (await consumer.beginning_offsets([etp]))[etp]
    if type(start) is int and head is not None:
        end = (await consumer.end_offsets([etp]))[etp]
        if start > end or (start > begin and not await _follows_head(consumer, etp, start - 1, head)):
            start = None  # not the partition the head was written after: from its start
    if type(start) is not int:
        start = begin
    consumer.seek(etp, start)
    return state, etp, start


async def _follows_head(consumer: Any, tp: Any, offset: int, head: Mapping[str, Any], wait: float = 5.0) -> bool:
    """Whether the record at ``offset`` of the events partition can be the one ``head`` was
    written after (:func:`~kv_consumer.state.follows_head`); False when none comes in ``wait`` s."""
    consumer.seek(tp, offset)
    got = await consumer.getmany(tp, timeout_ms=int(wait * 1000), max_records=1)
    for record in got.get(tp, []):
        if record.offset == offset:
            headers = {k: v.decode(errors="replace") for k, v in record.headers or ()}
            return follows_head(head, headers)
    return False


__all__ = ["HEAD", "StateLog", "bootstrap", "partition_of", "read_log", "stream_of", "topic_partitions"]
