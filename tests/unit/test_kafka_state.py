"""The Kafka sink's state writer and reader without a broker: options, keys, order, the cut.

A fake producer (``create_batch`` / ``send_batch`` over in-memory partition logs, failures on
demand) stands for aiokafka under ``KafkaConnector.write``: the state of a record goes out only
after its stream's earlier messages are stored, with the head's ``next`` the offset after the
record's last message; a failure holds back what follows it in its stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from bridge.config import SinkConfig, convert_options
from bridge.errors import ConfigError, PartialFailure, Permanent, Retriable
from bridge.formats import STATE_TYPE, Message, Renderer, state_message
from bridge.records import Record, Stream, source_reset
from bridge.state import StateTracker
from bridge.state_docs import parse, seed_of
from connectors.kafka import KafkaConnector, KafkaOptions
from kv_consumer.kafka import StateLog, partition_of, stream_of

A, B = Stream("llama-a", 0), Stream("llama-b", 1)
TOPIC, STATE = "kv-events", "kv-state"


def options(**values: Any) -> KafkaOptions:
    return convert_options({"bootstrap_servers": "k1:9092", **values}, KafkaOptions, "sinks[0]")


def connector(**sink: Any) -> KafkaConnector:
    cfg = SinkConfig(type="kafka", name="k", **sink)
    return KafkaConnector("k", options(state={"enabled": True}), cfg)


def stored(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": list(range(2 * len(hashes))),
        "block_size": 2,
        "medium": medium,
    }


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


# -- options ------------------------------------------------------------------------------------------


def test_state_options_default_off_and_checked() -> None:
    assert options().state.enabled is False
    assert (options().state.topic, options().state.create, options().state.partitions) == ("kv-state", False, 6)
    with pytest.raises(ConfigError, match=r"state\.topic: must differ from topic"):
        options(topic="x", state={"enabled": True, "topic": "x"})
    with pytest.raises(ConfigError, match=r"state.enabled: topic may not use \{type\}"):
        options(topic="kv-{type}", state={"enabled": True})
    with pytest.raises(ConfigError, match="not a valid Kafka topic name"):
        options(state={"enabled": True, "topic": "a b"})
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.state\.partitions"):
        options(state={"partitions": 0})


def test_state_is_on_only_when_enabled() -> None:
    assert connector().writes_state is True
    assert KafkaConnector("k", options(), SinkConfig(type="kafka", backpressure="drop")).writes_state is False


# -- keys and the log reader ---------------------------------------------------------------------------


def test_a_head_deleted_by_hand_leaves_the_stream_without_a_cut() -> None:
    log = StateLog(["s/0"])
    log.add(b"s/0/GPU/0/01", b"v1")
    log.add(b"s/0/_head", b"h1")
    log.add(b"s/0/_head", None)  # a tombstone the bridge never writes
    assert log.cut("s/0") == (None, [])


def test_a_key_s_partition_is_one_of_the_topic_s_whatever_its_type() -> None:
    for key in ("llama-a/0", "llama-a/1", "b/0"):
        got = partition_of(key, [0, 1, 2, 3])
        assert got in (0, 1, 2, 3) and got == partition_of(key.encode(), [0, 1, 2, 3])
    assert partition_of("llama-a/0", [7]) == 7


def test_stream_of_a_key() -> None:
    assert stream_of(b"llama-a/0/_head") == b"llama-a/0"
    assert stream_of(b"llama-a/0/GPU/0/00000000000000ff") == b"llama-a/0"
    assert stream_of(b"a/b/3/-/-/00000000000000ff") == b"a/b/3"  # a '/' in a source name


def test_state_log_cut_stops_at_the_last_head_newest_adds_the_tail() -> None:
    log = StateLog(["s/0"])
    log.add(b"s/0/GPU/0/01", b"v1")
    log.add(b"s/0/GPU/0/02", b"v2")
    log.add(b"t/0/GPU/0/01", b"other")  # not wanted
    log.add(b"s/0/_head", b"h1")
    log.add(b"s/0/GPU/0/01", None)  # the next record: a tombstone and a new entry, no head yet
    log.add(b"s/0/GPU/0/03", b"v3")
    assert log.open("s/0")
    assert log.cut("s/0") == (b"h1", [b"v1", b"v2"])
    assert log.newest("s/0") == (b"h1", [b"v2", b"v3"])
    log.add(b"s/0/_head", b"h2")
    assert not log.open("s/0")
    assert log.cut("s/0") == (b"h2", [b"v2", b"v3"]) == log.newest("s/0")
    assert log.cut("t/0") == (None, []) and log.records == 6


def test_a_rebuild_keeps_the_heads_generation_only() -> None:
    tracker = StateTracker()
    delta = tracker.apply(Record(stream=A, epoch=1, seq=0, events=[stored([1, 2])]))
    conn = connector()
    records = dict(conn._state_records(A, delta, 7))
    head = json.loads(records[b"llama-a/0/_head"] or b"")
    assert head["next"] == 7 and head["live"] == 2
    values = [v for k, v in records.items() if v is not None and not k.endswith(b"_head")]
    old = json.dumps({**json.loads(values[0]), "gen": head["gen"] - 1}).encode()  # left behind by a fresh start
    assert delta.head is not None
    seed = seed_of(head, [d for v in [*values, old, b"not json"] if (d := parse(v)) is not None])  # as read_state does
    assert seed is not None and sorted(s[2] for s in seed[1]) == [1, 2]


def test_state_records_order_tombstones_changes_head() -> None:
    tracker = StateTracker()
    tracker.apply(Record(stream=A, epoch=1, seq=0, events=[stored([1, 2]), stored([2])]))
    delta = tracker.apply(Record(stream=A, epoch=1, seq=1, events=[removed([2]), {"type": "AllBlocksCleared"}, stored([5])]))
    assert delta.clear
    keys = [(k.decode(), v is None) for k, v in connector()._state_records(A, delta, None)]
    assert keys[:2] == sorted(keys[:2]) and {k for k, _ in keys[:2]} == {
        "llama-a/0/GPU/-/0000000000000001",
        "llama-a/0/GPU/-/0000000000000002",
    }
    assert all(tomb for _, tomb in keys[:2])
    assert keys[2:] == [("llama-a/0/GPU/-/0000000000000005", False), ("llama-a/0/_head", False)]


# -- the write path, with a fake producer --------------------------------------------------------------


class FakeBuilder:
    def __init__(self, limit: int) -> None:
        self.records: list[tuple[bytes, bytes | None]] = []
        self.used, self.limit = 0, limit

    def append(self, *, timestamp: Any, key: bytes, value: bytes | None, headers: Any) -> Any:
        size = len(key) + len(value or b"") + 20
        if self.records and self.used + size > self.limit:
            return None
        self.records.append((key, value))
        self.used += size
        return SimpleNamespace(size=size)

    def record_count(self) -> int:
        return len(self.records)


class FakeProducer:
    """Partition logs in memory; ``fail(topic, partition, n)`` says whether the n-th batch sent there fails."""

    def __init__(
        self, fail: Callable[[str, int, int], bool] = lambda *_: False, limit: int = 2**20, state_limit: int | None = None
    ) -> None:
        self.logs: dict[tuple[str, int], list[tuple[bytes, bytes | None]]] = {}
        self.sent: list[tuple[str, int]] = []
        self.fail, self.limit = fail, limit
        self.state_limit = state_limit  # the state topic's max.message.bytes: larger batches refused (too large)
        parts = {TOPIC: {0, 1}, STATE: {0, 1}}
        self.client = SimpleNamespace(cluster=SimpleNamespace(partitions_for_topic=parts.get))

    def create_batch(self) -> FakeBuilder:
        return FakeBuilder(self.limit)

    async def send_batch(self, builder: FakeBuilder, topic: str, *, partition: int) -> asyncio.Future[Any]:
        from aiokafka import errors

        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        log = self.logs.setdefault((topic, partition), [])
        self.sent.append((topic, partition))
        if self.fail(topic, partition, sum(1 for s in self.sent if s == (topic, partition))):
            done.set_exception(errors.KafkaTimeoutError())
        elif topic == STATE and self.state_limit is not None and builder.used > self.state_limit:
            done.set_exception(errors.MessageSizeTooLargeError())
        else:
            done.set_result(SimpleNamespace(offset=len(log)))
            log.extend(builder.records)
        return done


def ready(conn: KafkaConnector, producer: FakeProducer) -> KafkaConnector:
    conn._producer = producer
    conn._partitions = {TOPIC: [0, 1], STATE: [0, 1]}
    return conn


def messages(tracker: StateTracker, records: list[Record]) -> list[Message]:
    renderer = Renderer("json", "event")
    out: list[Message] = []
    for r in records:
        r.state = tracker.apply(r)
        out += renderer.render(r)
        out.append(state_message(r))
    return out


def heads(producer: FakeProducer, stream: Stream) -> list[dict[str, Any]]:
    key = f"{stream.key}/_head".encode()
    return [json.loads(v) for log in producer.logs.values() for k, v in log if k == key and v is not None]


def events_partition(conn: KafkaConnector, stream: Stream) -> list[tuple[bytes, bytes | None]]:
    from kv_consumer.kafka import _PARTITIONER

    return conn._producer.logs.get((TOPIC, _PARTITIONER(stream.key.encode(), [0, 1], [0, 1])), [])  # type: ignore[no-any-return]


async def test_head_next_is_the_offset_after_the_records_last_message() -> None:
    producer = FakeProducer()
    conn = ready(connector(), producer)
    tracker = StateTracker()
    batch = messages(
        tracker,
        [
            Record(stream=A, epoch=1, seq=0, events=[stored([1]), stored([2])]),
            Record(stream=B, epoch=1, seq=0, events=[stored([9])]),
            Record(stream=A, epoch=1, seq=1, events=[removed([1])]),
            Record(stream=A, epoch=1, seq=2, events=[]),  # writes no message: the last head's next
        ],
    )
    await conn.write(batch)
    got = [(h["seq"], h["next"]) for h in heads(producer, A)]
    mine = [offset for offset, (k, _) in enumerate(events_partition(conn, A)) if k == A.key.encode()]
    assert got == [(0, mine[1] + 1), (1, mine[2] + 1), (2, mine[2] + 1)]
    # every state batch went out after every events batch of the write
    last_event = max(i for i, s in enumerate(producer.sent) if s[0] == TOPIC)
    assert all(i > last_event for i, s in enumerate(producer.sent) if s[0] == STATE)
    # A reset: tombstones for the live keys, then the head of the new epoch
    reset = messages(tracker, [source_reset(A, 2, "publisher_restart", 0.0)])
    await conn.write(reset)
    part = next(log for (t, _), log in producer.logs.items() if t == STATE and any(k.startswith(b"llama-a/0/") for k, _ in log))
    tail = part[-2:]
    assert tail[0] == (b"llama-a/0/GPU/-/0000000000000002", None)
    assert json.loads(tail[1][1] or b"")["epoch"] == 2


async def test_a_failed_event_batch_holds_back_its_streams_state() -> None:
    from kv_consumer.kafka import _PARTITIONER

    a_part = _PARTITIONER(A.key.encode(), [0, 1], [0, 1])
    producer = FakeProducer(fail=lambda t, p, n: t == TOPIC and p == a_part and n == 1)
    conn = ready(connector(), producer)
    tracker = StateTracker()
    batch = messages(tracker, [Record(stream=A, epoch=1, seq=0, events=[stored([1])])])
    with pytest.raises((PartialFailure, Retriable)) as info:
        await conn.write(batch)
    if isinstance(info.value, PartialFailure):
        assert 1 in info.value.errors  # the state message
    assert heads(producer, A) == []
    # retried (the runtime writes the stream again from the failed message): state follows
    conn._stale = False  # (a new producer: the fake has nothing to discard)
    await conn.write(batch)
    assert [h["next"] for h in heads(producer, A)] == [1]


async def test_a_failed_state_write_is_transient_at_its_index_and_remembers_next() -> None:
    producer = FakeProducer(fail=lambda t, p, n: t == STATE and n == 1)
    conn = ready(connector(), producer)
    tracker = StateTracker()
    batch = messages(tracker, [Record(stream=A, epoch=1, seq=0, events=[stored([1]), stored([2])])])
    with pytest.raises((PartialFailure, Retriable)) as info:
        await conn.write(batch)
    error = info.value
    if isinstance(error, PartialFailure):
        assert list(error.errors) == [2]
        assert not any(isinstance(e, Permanent) for e in error.errors.values())
    # The retry carries the state message alone: its head still points after the record's events.
    conn._stale = False
    await conn.write(batch[2:])
    assert [h["next"] for h in heads(producer, A)] == [2]


async def test_a_large_clear_spans_batches_sent_one_after_the_other() -> None:
    producer = FakeProducer(limit=2_000)
    conn = ready(connector(), producer)
    tracker = StateTracker()
    first = messages(tracker, [Record(stream=A, epoch=1, seq=0, events=[stored(list(range(1, 301)))])])
    await conn.write(first)
    await conn.write(messages(tracker, [Record(stream=A, epoch=1, seq=1, events=[{"type": "AllBlocksCleared"}])]))
    state_batches = [s for s in producer.sent if s[0] == STATE]
    assert len(state_batches) > 10
    log = StateLog([A.key])
    for (t, _), records in producer.logs.items():
        if t == STATE:
            for k, v in records:
                log.add(k, v)
    head, values = log.cut(A.key)
    assert head is not None and json.loads(head)["live"] == 0 and values == []


async def test_after_a_size_refusal_the_state_batch_limit_stays_below_what_was_refused() -> None:
    # The state topic's limit lowered below the 1024 bytes the sink assumed a batch could take
    # (since connect): each refusal must lower the limit below the refused batch, never floor it
    # back above, or the same batch is refused for ever and the sink stops (I5).
    producer = FakeProducer(state_limit=500)
    conn = ready(connector(), producer)
    tracker = StateTracker()
    batch = messages(tracker, [Record(stream=A, epoch=1, seq=0, events=[stored([k]) for k in range(1, 21)])])
    limits: list[int] = []
    for _ in range(20):
        try:
            await conn.write(batch)
            break
        except (PartialFailure, Retriable) as exc:
            errors = exc.errors.values() if isinstance(exc, PartialFailure) else [exc]
            assert all(e.reason == "state_refused" for e in errors), errors
            limits.append(conn._batch_limit[STATE])
            batch = [m for m in batch if m.type == STATE_TYPE]  # what the runtime writes again
            conn._partitions = {TOPIC: [0, 1], STATE: [0, 1]}  # (its configs read again: the fake has none)
            conn._stale = False  # (a new producer: the fake has nothing to discard)
    else:
        raise AssertionError(f"the state was refused for ever, limits {limits}")
    assert limits == sorted(limits, reverse=True) and len(set(limits)) == len(limits)
    assert [h["live"] for h in heads(producer, A)] == [20]


# -- the consumer's bootstrap, with a fake consumer ----------------------------------------------------


PARTITIONS = {STATE: [0], TOPIC: [0, 1]}  # the partition ids of both topics, as topic_partitions() reads them


class FakeConsumer:
    """One state partition and one events partition; ``grow`` records appear at the second
    end_offsets() of the state partition. ``events``: the headers of each record of the events
    partition (the bootstrap reads the one before a head's next)."""

    def __init__(
        self,
        records: list[tuple[bytes, bytes | None]],
        grow: list[tuple[bytes, bytes | None]],
        events: list[dict[str, str]] | None = None,
    ) -> None:
        self.records, self.grow = records, grow
        self.events = events or []
        self.positions: dict[Any, int] = {}
        self.assigned: list[Any] = []
        self.ends = 0

    def assign(self, tps: list[Any]) -> None:
        self.assigned = list(tps)

    async def beginning_offsets(self, tps: list[Any]) -> dict[Any, int]:
        return dict.fromkeys(tps, 0)

    async def end_offsets(self, tps: list[Any]) -> dict[Any, int]:
        if all(tp.topic == TOPIC for tp in tps):
            return dict.fromkeys(tps, len(self.events))
        self.ends += 1
        if self.ends == 2:
            self.records += self.grow
        return dict.fromkeys(tps, len(self.records))

    def seek(self, tp: Any, offset: int) -> None:
        self.positions[tp] = offset

    async def position(self, tp: Any) -> int:
        return self.positions[tp]

    async def getmany(self, tp: Any, timeout_ms: int, max_records: int) -> dict[Any, list[Any]]:
        at = self.positions[tp]
        if tp.topic == TOPIC:
            held = [(None, None, [(k, v.encode()) for k, v in h.items()]) for h in self.events[at : at + max_records]]
        else:
            held = [(k, v, []) for k, v in self.records[at : at + max_records]]
        chunk = [SimpleNamespace(offset=at + i, key=k, value=v, headers=h) for i, (k, v, h) in enumerate(held)]
        self.positions[tp] = at + len(chunk)
        return {tp: chunk}


def batch_headers(stream: Stream, epoch: int, seq: int) -> dict[str, str]:
    return {"source": stream.source, "dp_rank": str(stream.dp_rank), "epoch": str(epoch), "seq": str(seq), "type": "EventBatch"}


def events_log(ends: dict[int, tuple[int, int]]) -> list[dict[str, str]]:
    """An events partition whose record at each offset ``next - 1`` is stream A's batch (epoch,
    seq) of ``ends[next]``, other streams' between."""
    last = max(ends)
    return [batch_headers(A, *ends[at + 1]) if at + 1 in ends else batch_headers(B, 1, at) for at in range(last)]


def state_of(tracker: StateTracker, conn: KafkaConnector, record: Record, next_: int) -> list[tuple[bytes, bytes | None]]:
    return list(conn._state_records(record.stream, tracker.apply(record), next_))


async def test_bootstrap_reads_on_past_a_state_write_in_progress() -> None:
    from kv_consumer.kafka import bootstrap

    tracker, conn = StateTracker(), connector()
    first = state_of(tracker, conn, Record(stream=A, epoch=5, seq=0, events=[stored([1, 2])]), 10)
    second = state_of(tracker, conn, Record(stream=A, epoch=5, seq=1, events=[removed([1]), stored([3])]), 12)
    # The pass ends inside the second record's state write (its tombstone, no head yet).
    consumer = FakeConsumer(first + second[:1], second[1:], events_log({10: (5, 0), 12: (5, 1)}))
    state, tp, start = await bootstrap(consumer, "llama-a", 0, topic=TOPIC, state_topic=STATE, partitions=PARTITIONS)  # type: ignore[arg-type]
    assert (state.head["seq"], start) == (1, 12) and consumer.ends >= 2
    assert sorted(k[2] for k in state.blocks()) == [2, 3] and state.ready
    assert consumer.assigned == [tp] and consumer.positions[tp] == 12


async def test_bootstrap_of_a_torn_write_is_not_ready_before_the_next_record() -> None:
    from kv_consumer.kafka import bootstrap

    tracker, conn = StateTracker(), connector()
    first = state_of(tracker, conn, Record(stream=A, epoch=5, seq=0, events=[stored([1, 2])]), 10)
    second = state_of(tracker, conn, Record(stream=A, epoch=5, seq=1, events=[removed([1])]), 11)
    consumer = FakeConsumer(first + second[:1], [], events_log({10: (5, 0)}))  # a crashed bridge: no head comes
    state, _, start = await bootstrap(consumer, "llama-a", 0, topic=TOPIC, state_topic=STATE, partitions=PARTITIONS, settle=0.1)  # type: ignore[arg-type]
    assert (state.head["seq"], start) == (0, 10)
    assert not state.ready  # the tombstone of seq 1 is in: exact only once seq 1 is applied
    assert state.apply({"source": "llama-a", "dp_rank": 0, "epoch": 5, "seq": 1, "index": 0, **removed([1])})
    assert state.ready and sorted(k[2] for k in state.blocks()) == [2]


@pytest.mark.parametrize("events", ["past_the_end", "another_stream_there", "a_later_batch_there"])
async def test_bootstrap_follows_from_the_start_of_a_partition_the_head_was_not_written_after(events: str) -> None:
    """breaker88 B2: an events topic deleted and created again while no bridge ran (refilled since,
    or not yet) still has the old head's next in the state: the record before it is not the head's
    (or there is none), and following from next would skip what the bridge wrote there first."""
    from kv_consumer.kafka import bootstrap

    tracker, conn = StateTracker(), connector()
    head = state_of(tracker, conn, Record(stream=A, epoch=5, seq=3, events=[stored([1, 2])]), 10)
    partition = {
        "past_the_end": events_log({4: (5, 3)}),
        "another_stream_there": [batch_headers(B, 1, n) for n in range(12)],
        "a_later_batch_there": events_log({10: (5, 7)}),
    }[events]
    consumer = FakeConsumer(head, [], partition)
    _, tp, start = await bootstrap(consumer, "llama-a", 0, topic=TOPIC, state_topic=STATE, partitions=PARTITIONS, settle=0.1)  # type: ignore[arg-type]
    assert start == 0 and consumer.positions[tp] == 0


async def test_bootstrap_without_a_head_follows_from_the_start() -> None:
    from kv_consumer.kafka import bootstrap

    consumer = FakeConsumer([], [])
    state, _, start = await bootstrap(consumer, "llama-a", 0, topic=TOPIC, state_topic=STATE, partitions=PARTITIONS, settle=0.1)  # type: ignore[arg-type]
    assert start == 0 and state.blocks() == {}
    assert state.apply({"source": "llama-a", "dp_rank": 0, "epoch": 0, "seq": 0, "type": "SourceReset"})
    assert state.complete
