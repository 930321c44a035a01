"""What every sink that keeps state needs of its own keys, checked once for all connectors."""

from __future__ import annotations

from typing import Any

import pytest

from bridge.config import ConfigError, from_data
from bridge.connector import Registry

OPTIONS = {
    "redis": {"url": "redis://x"},
    "kafka": {"bootstrap_servers": "x:9092"},
    "nats": {"servers": "nats://x:4222"},
}


def build(kind: str, **keys: Any) -> None:
    sink = {"type": kind, "name": "s", **OPTIONS[kind], "state": {"enabled": True}, **keys}
    cfg = from_data({"sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}], "sinks": [sink]}, env={})
    Registry().build(cfg.sinks[0], 0)


@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_state_needs_backpressure_block(kind: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(kind, backpressure="drop")
    assert "sinks[0].state.enabled: needs backpressure: block" in str(info.value)
    build(kind)  # block (the default) is fine


@pytest.mark.parametrize("kind", sorted(OPTIONS))
@pytest.mark.parametrize(
    ("fields", "where", "named"),
    [
        ({"drop": ["medium", "group_idx"]}, "sinks[0].fields:", "medium, group_idx"),
        ({"keep": ["block_hashes"]}, "sinks[0].fields:", "medium, group_idx"),
        ({"by_type": {"BlockRemoved": {"drop": ["block_hashes"]}}}, "sinks[0].fields.by_type.BlockRemoved:", "block_hashes"),
        # breaker101 B5: a clear of one tier (ROCm ATOM) reached consumers as a clear of all, and
        # they said complete with 6 copies where the engine held 50
        ({"by_type": {"AllBlocksCleared": {"drop": ["medium"]}}}, "sinks[0].fields.by_type.AllBlocksCleared:", "medium"),
        ({"by_type": {"AllBlocksCleared": {"keep": []}}}, "sinks[0].fields.by_type.AllBlocksCleared:", "medium"),
    ],
)
def test_state_needs_the_fields_a_consumer_follows(kind: str, fields: dict[str, Any], where: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(kind, fields=fields)
    assert where in str(info.value) and f"needs {named} in the messages" in str(info.value)


def test_other_field_selections_are_fine_with_state() -> None:
    build(
        "redis",
        fields={
            "drop": ["token_ids", "extra_keys"],
            "by_type": {"BlockStored": {"keep": [*["block_hashes", "medium", "group_idx", "parent_block_hash"]]}},
        },
    )


# -- the runtime's side: state messages in a write ------------------------------------------------


async def test_skipheld_never_leaves_out_a_state_message() -> None:
    """A sink that holds the records still gets their state messages: its own guard drops a change
    it holds, and a clear of a new generation (a loss, a fresh start) must reach it."""
    from bridge.formats import Renderer, state_message
    from bridge.records import Record, Stream, events_lost
    from bridge.runtime import SkipHeld
    from bridge.state import StateTracker
    from tests.support.memory import MemoryConnector, MemoryOptions

    inner = MemoryConnector("m", MemoryOptions(), None)  # type: ignore[arg-type]
    skip = SkipHeld(inner)
    skip.through["a/0"] = (5, 4, 0)  # holds batches 0..3
    tracker, renderer, stream = StateTracker(), Renderer("json", "batch"), Stream("a", 0)
    records = [Record(stream=stream, epoch=5, seq=s, ts=1.0, events=[]) for s in range(3)]
    records.append(events_lost(stream, 5, 3, 3, "replay_exhausted", 0.0))
    messages = []
    for r in records:
        r.state = tracker.apply(r)
        messages += [*renderer.render(r), state_message(r)]
    await skip.write(messages)
    kept = [(m.type, m.record.seq) for m in inner.messages]
    assert kept == [("StateDelta", 0), ("StateDelta", 1), ("StateDelta", 2), ("EventsLost", 3), ("StateDelta", 3)]
    assert inner.messages[0].record.state.clear  # the fresh start's clear


@pytest.mark.parametrize(
    ("refused", "reason"),
    [
        # a state change refused for itself: not dead-lettered with its record (whose events were written)
        (1, "rejected"),
        # an event refused for itself (too large for the broker, say): the state says what it said,
        # the sink's messages do not
        (0, "too_large"),
    ],
)
async def test_a_message_refused_for_itself_clears_its_streams_state_at_the_next_record(
    tmp_path: Any, refused: int, reason: str
) -> None:
    """Either way the tracker makes the stream's next delta a clear, in a new generation, incomplete."""
    from bridge.errors import PartialFailure, Permanent
    from bridge.records import Record, Stream
    from bridge.state import StateTracker
    from tests.unit.test_sink import make

    worker, conn, acked, metrics = make(tmp_path)
    tracker = StateTracker()
    worker.writes_state = True
    worker.on_state_lost = tracker.invalidate
    stream = Stream("llama-a", 0)
    store = {"type": "BlockStored", "block_hashes": [1], "medium": "GPU", "token_ids": [], "block_size": 1}
    first = Record(stream=stream, epoch=1, seq=0, ts=1.0, events=[store])
    first.state = tracker.apply(first)
    conn.failures = [PartialFailure({refused: Permanent("refused by the test", reason=reason)})]
    worker.start()
    assert worker.offer(first)
    await worker.flush(5.0)
    assert acked == [first]
    dead = metrics.registry.get_sample_value("kv_bridge_sink_batches_total", {"sink": "mem", "outcome": "dead_lettered"})
    assert (dead in (None, 0.0)) == (refused == 1)  # only a refused event dead-letters its record
    delta = tracker.apply(Record(stream=stream, epoch=1, seq=1, ts=1.0, events=[store]))
    assert delta.clear and not delta.head.complete and delta.head.generation > first.state.head.generation
    await worker.stop()
    worker.dead_letters.close()


async def test_a_refusal_learned_after_the_engine_cleared_leaves_the_state_complete(tmp_path: Any) -> None:
    """breaker99 B5: an event of batch 0 is refused after the tracker applied batch 1, which
    clears the cache (an OOM held the write back meanwhile). The sink writes batch 1's clear (a
    new generation) and what follows, so its state is the tracker's again: clearing it once more
    at the next record kept it incomplete until the engine's clear after that (4 of 4 runs)."""
    from bridge.errors import PartialFailure, Permanent, Retriable
    from bridge.records import Record, Stream
    from bridge.state import StateTracker
    from tests.unit.test_sink import make

    worker, conn, _, _ = make(tmp_path, batch={"linger": 0})
    tracker = StateTracker()
    worker.writes_state = True
    worker.on_state_lost = tracker.invalidate
    stream = Stream("llama-a", 0)
    store = {"type": "BlockStored", "block_hashes": [1], "medium": "GPU", "token_ids": [], "block_size": 1}
    cleared = [{"type": "AllBlocksCleared"}, {**store, "block_hashes": [2]}]
    records = [Record(stream=stream, epoch=1, seq=s, ts=1.0, events=e) for s, e in enumerate([[store], cleared])]
    for r in records:
        r.state = tracker.apply(r)
    # batch 0's event refused, batch 1 (and its state change) held back behind it (Stops)
    held = Retriable("behind a refusal", reason="not_sent")
    conn.failures = [PartialFailure({0: Permanent("too large", reason="too_large"), 2: held, 3: held}), None]
    worker.start()
    for r in records:
        assert worker.offer(r)
    await worker.flush(5.0)
    states = [m.record.state for m in conn.messages if m.type == "StateDelta"]
    assert [(d.clear, d.head.seq, d.head.complete) for d in states] == [(True, 1, True)], states
    delta = tracker.apply(Record(stream=stream, epoch=1, seq=2, ts=1.0, events=[{**store, "block_hashes": [3]}]))
    assert not delta.clear and delta.head.complete
    # a refusal of a record after the clear still clears the state at the next record
    tracker.invalidate(stream, (1, 2))
    delta = tracker.apply(Record(stream=stream, epoch=1, seq=3, ts=1.0, events=[store]))
    assert delta.clear and not delta.head.complete
    await worker.stop()
    worker.dead_letters.close()


def test_a_generation_is_above_the_process_base_after_a_rebuild() -> None:
    """Seeded from a head of generation g, the next clear opens a generation at or above this
    process's base, not g + 1, which a write an earlier process's crash cut may already hold."""
    from bridge.records import Record, Stream, events_lost
    from bridge.state import Head, StateTracker

    t = StateTracker(generation_base=10**15)
    stream = Stream("a", 0)
    assert t.seed(stream, Head(epoch=1, generation=5, seq=3, complete=True, live=0), [])
    d = t.apply(events_lost(stream, 1, 4, 5, "replay_exhausted", 0.0))
    assert d.clear and d.head.generation == 10**15
    d = t.apply(Record(stream=stream, epoch=1, seq=6, events=[{"type": "AllBlocksCleared"}]))
    assert d.head.generation == 10**15 + 1


def test_a_consumer_leaves_out_entries_of_any_other_generation() -> None:
    from kv_consumer.state import StreamState

    head = {"epoch": 2, "gen": 7, "seq": 4, "complete": True}

    def doc(gen: int, block: int) -> dict[str, Any]:
        return {"epoch": 2, "gen": gen, "seq": 3, "medium": "GPU", "group_idx": 0, "block": f"{block:016x}", "count": 1}

    state = StreamState(head, [doc(6, 1), doc(7, 2), doc(9, 3)])
    assert state.blocks() == {("GPU", 0, 2): 1}


async def test_a_stream_taken_over_past_its_state_head_is_cleared_at_its_next_record(tmp_path: Any) -> None:
    """checkpoint.from_sinks: the sink holds messages up to seq 5 but its state only up to seq 3
    (the previous pod was killed between the two writes). The stream resumes after seq 5, so
    seqs 4-5 never reach the tracker: it must not go on saying complete."""
    from bridge.checkpoint import SinkPosition
    from bridge.records import Record, Stream
    from bridge.runtime import Bridge, SkipHeld
    from bridge.state import Head, StateTracker
    from tests.support.memory import MemoryConnector, MemoryOptions

    stream = Stream("a", 0)

    class Holder(MemoryConnector):
        writes_state = True

        async def positions(self, streams: Any) -> dict[str, SinkPosition | None]:
            return {stream.key: SinkPosition(epoch=1, seq=5, ts=1.0)}

        async def read_state(self, streams: Any) -> dict[str, Any]:
            return {stream.key: (Head(epoch=1, generation=3, seq=3, complete=True, live=1), [("GPU", 0, 9, 1, 2, None)])}

    cfg = from_data(
        {
            "sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}],
            "sinks": [{"type": "file", "path": str(tmp_path / "x")}],
            "checkpoint": {"from_sinks": True},
            "metrics": {"listen": ""},
        },
        env={},
    )
    bridge = Bridge(cfg)
    conn = Holder("h", MemoryOptions(), cfg.sinks[0])
    bridge.tracker, bridge._state_sinks, bridge.skips = StateTracker(), [conn], [SkipHeld(conn)]
    await bridge.load_state([stream])
    assert bridge.tracker.total == 1
    await bridge.take_over([stream])
    delta = bridge.tracker.apply(Record(stream=stream, epoch=1, seq=6, events=[]))
    assert delta.clear and not delta.head.complete
    bridge.zmq_context.destroy(linger=0)
    bridge.dead_letters.close()


async def test_a_state_behind_what_every_sink_acknowledged_is_not_rebuilt(tmp_path: Any) -> None:
    """No from_sinks, a checkpoint file at seq 19, the sink's state at seq 9 (restored from an
    older backup while no bridge ran): the stream resumes after 19, so 10..19 never reach the
    tracker. Rebuilt from the head, it said complete with their changes missing (breaker29f N4,
    R3: 23-25 blocks missing, on NATS and Redis). It is cleared at its first record instead."""
    from bridge.checkpoint import CheckpointFile, CheckpointStore, StreamPosition, save
    from bridge.records import Record, Stream
    from bridge.runtime import Bridge
    from bridge.state import Head, StateTracker
    from tests.support.memory import MemoryConnector, MemoryOptions

    stream = Stream("a", 0)
    save(tmp_path / "ck.json", CheckpointFile(streams={stream.key: StreamPosition(1, 19, 1.0, 7)}, epochs={stream.key: 1}))

    class Holder(MemoryConnector):
        writes_state = True

        async def read_state(self, streams: Any) -> dict[str, Any]:
            return {stream.key: (Head(epoch=1, generation=3, seq=9, complete=True, live=1), [("GPU", 0, 9, 1, 2, None)])}

    cfg = from_data(
        {
            "sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}],
            "sinks": [{"type": "file", "path": str(tmp_path / "x")}],
            "checkpoint": {"path": str(tmp_path / "ck.json")},
            "metrics": {"listen": ""},
        },
        env={},
    )
    bridge = Bridge(cfg)
    bridge.store = bridge.context.epochs = CheckpointStore(str(tmp_path / "ck.json"), 1)
    conn = Holder("h", MemoryOptions(), cfg.sinks[0])
    bridge.tracker, bridge._state_sinks = StateTracker(), [conn]
    await bridge.load_state([stream])
    assert bridge.tracker.total == 0
    assert bridge._lost_at_start == {id(conn): [(stream, 1, 10, 19)]}  # (announced to it: breaker33 B2)
    delta = bridge.tracker.apply(Record(stream=stream, epoch=1, seq=20, events=[]))
    assert delta.clear and not delta.head.complete
    bridge.zmq_context.destroy(linger=0)
    bridge.dead_letters.close()


@pytest.mark.parametrize(("held", "sinks"), [(1, 1), (3, 1), (1, 2)])
async def test_a_state_holding_fewer_entries_than_its_head_counts_is_not_rebuilt(tmp_path: Any, held: int, sinks: int) -> None:
    """The sink's state lost entries that no write removed (a Kafka state topic's retention or
    DeleteRecords while no bridge ran, a bucket or hash trimmed by hand): its head counts 3 live
    entries, the sink holds 1 of them. Rebuilt from it, the stream went on complete with the rest
    missing (breaker30r2 R1: 76-91 blocks missing, 4 of 4 runs). It is cleared at its first
    record instead; a state holding all of them is rebuilt. With two state sinks the short one
    may be either: only the one the rebuild read from was counted (breaker30z2 M1)."""
    from bridge.records import Record, Stream
    from bridge.runtime import Bridge
    from bridge.state import Head, StateTracker
    from tests.support.memory import MemoryConnector, MemoryOptions

    stream = Stream("a", 0)

    class Holder(MemoryConnector):
        writes_state = True
        entries: list[Any] = []

        async def read_state(self, streams: Any) -> dict[str, Any]:
            return {stream.key: (Head(epoch=1, generation=3, seq=9, complete=True, live=3), self.entries)}

    cfg = from_data(
        {
            "sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}],
            "sinks": [{"type": "file", "path": str(tmp_path / "x")}],
            "metrics": {"listen": ""},
        },
        env={},
    )
    bridge = Bridge(cfg)
    holders = [Holder("h", MemoryOptions(), cfg.sinks[0]) for _ in range(sinks)]
    for i, holder in enumerate(holders):  # the short one last, behind a whole one the rebuild reads from
        holder.entries = [("GPU", 0, k, 1, 2, None) for k in range(held if i == sinks - 1 else 3)]
    bridge.tracker, bridge._state_sinks = StateTracker(), holders
    await bridge.load_state([stream])
    assert bridge.tracker.total == (3 if held == 3 else 0)
    delta = bridge.tracker.apply(Record(stream=stream, epoch=1, seq=10, events=[]))
    assert delta.clear == (held < 3) and delta.head.complete == (held == 3)
    bridge.zmq_context.destroy(linger=0)
    bridge.dead_letters.close()
