"""Fan-out (bridge.fanout.Fanout): every record to every sink, in order, waiting only on blocking sinks."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bridge.fanout import Fanout
from bridge.formats import Message
from bridge.records import Record, Stream
from bridge.sink import SinkWorker
from bridge.state import StateTracker
from tests.support.memory import MemoryConnector, MemoryOptions
from tests.support.records import batch, stream_records
from tests.support.strategies import examples
from tests.unit.test_sink import make

STREAM = Stream("f", 0)


async def publish_all(fanout: Fanout, records: list[Record]) -> None:
    for r in records:
        await fanout.publish(r)


class OneAtATime(MemoryConnector):
    """Each write takes a token: the test lets writes through one by one."""

    tokens: asyncio.Semaphore

    async def write(self, messages: Sequence[Message]) -> None:
        await self.tokens.acquire()
        await super().write(messages)


async def test_a_full_block_sink_holds_the_stream_and_gets_every_record(tmp_path: Path) -> None:
    """Room that opens but is too small for the waiting record must not let it be skipped."""
    records = [batch(STREAM, seq, n_events=40 if seq % 3 == 2 else 2) for seq in range(12)]
    small = records[0].size
    assert records[2].size > 2 * small
    free, free_conn, _, _ = make(tmp_path, batch={"linger": 0})
    # Room for the big record and half a small one: when a small record settles, the queue is below
    # its bounds (room is signalled) while the big record waiting still does not fit.
    full, _, _, _ = make(tmp_path, batch={"linger": 0, "max_messages": 1}, queue={"max_bytes": records[2].size + small // 2})
    slow = OneAtATime("mem", MemoryOptions(), full.config)
    slow.tokens = asyncio.Semaphore(0)
    full.connector = slow
    fanout = Fanout([free, full])
    free.start()
    full.start()
    task = asyncio.create_task(publish_all(fanout, records))
    await asyncio.sleep(0.05)
    assert not task.done(), "the stream must wait for the full block sink"
    for _ in range(12):
        slow.tokens.release()
        await asyncio.sleep(0.01)
    await asyncio.wait_for(task, 5)
    assert await free.flush(5) and await full.flush(5)
    for w in (free, full):
        await w.stop()
        w.dead_letters.close()
    assert [m.record.seq for m in slow.messages] == list(range(12))
    assert [m.record.seq for m in free_conn.messages] == list(range(12))


async def test_a_record_waiting_when_its_stream_is_removed_still_reaches_every_sink(tmp_path: Path) -> None:
    """Cancelled while waiting for room (its source removed), the record is queued anyway: the
    other sinks have it and nothing would bring it to the full one later."""
    free, free_conn, _, _ = make(tmp_path, batch={"linger": 0})
    full, full_conn, _, _ = make(tmp_path, batch={"linger": 0}, queue={"max_batches": 1})
    full_conn.gate = asyncio.Event()
    fanout = Fanout([free, full])
    free.start()
    full.start()
    records = stream_records(STREAM, 3)
    task = asyncio.create_task(publish_all(fanout, records))
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    full_conn.gate.set()
    assert await free.flush(5) and await full.flush(5)
    for w in (free, full):
        await w.stop()
        w.dead_letters.close()
    assert [m.record.seq for m in free_conn.messages] == [m.record.seq for m in full_conn.messages]
    assert len(full_conn.messages) >= 2


async def test_a_drop_sink_never_makes_the_stream_wait(tmp_path: Path) -> None:
    blocked, conn, _, _ = make(tmp_path, backpressure="drop", queue={"max_batches": 1}, batch={"linger": 0})
    conn.gate = asyncio.Event()
    fanout = Fanout([blocked])
    blocked.start()
    records = stream_records(STREAM, 10)
    await asyncio.wait_for(publish_all(fanout, records), 1)  # returns at once: nothing waits
    assert fanout.offer(stream_records(STREAM, 1, start=10)[0]) == []
    conn.gate.set()
    await blocked.flush(5)
    await blocked.stop()
    blocked.dead_letters.close()


async def test_a_record_waiting_on_several_full_sinks_reaches_each_of_them(tmp_path: Path) -> None:
    sinks = [make(tmp_path, batch={"linger": 0}, queue={"max_batches": 1}) for _ in range(3)]
    gates = [asyncio.Event() for _ in sinks]
    for (_, conn, _, _), gate in zip(sinks, gates, strict=True):
        conn.gate = gate
    workers = [w for w, _, _, _ in sinks]
    fanout = Fanout(workers)
    for w in workers:
        w.start()
    records = stream_records(STREAM, 4)
    task = asyncio.create_task(publish_all(fanout, records))
    await asyncio.sleep(0.05)
    assert not task.done()
    for gate in reversed(gates):  # room opens on the last sink first
        gate.set()
        await asyncio.sleep(0.01)
    await asyncio.wait_for(task, 5)
    for w, conn, _, _ in sinks:
        assert await w.flush(5)
        await w.stop()
        w.dead_letters.close()
        assert [m.record.seq for m in conn.messages] == list(range(4))


def _queue_state(w: SinkWorker) -> tuple[object, ...]:
    shown = [(r.kind, r.epoch, r.from_seq, r.seq) for r in w._queue]
    return shown, w._bytes, sorted(w._dropped), w._room.is_set(), w._work.is_set(), w._idle.is_set()


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sinks=st.lists(
        st.tuples(st.sampled_from(["block", "drop"]), st.integers(1, 8), st.integers(1, 6), st.integers(0, 6)),
        min_size=1,
        max_size=3,
    ),
    run=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    freed=st.integers(0, 3),
)
@example(sinks=[("drop", 3, 6, 5)], run=[0, 0], freed=2)  # room for the run, not for the span's EventsLost too
async def test_offer_all_queues_a_run_exactly_as_offering_it_record_by_record_would(
    tmp_path: Path, sinks: list[tuple[str, int, int, int]], run: list[int], freed: int
) -> None:
    """Per sink (backpressure, max_batches, max_bytes in records, records already queued, forced or
    dropped, some written since): ``offer_all`` either takes the whole run, leaving every queue as one ``offer`` per
    record would have (no record waiting), or takes nothing and changes nothing."""
    unit = batch(STREAM, 0).size
    runs = [[batch(STREAM, 100 + i, n_events=1 + n % 3) for i, n in enumerate(run)] for _ in range(2)]
    sides: list[list[SinkWorker]] = [[], []]
    for side in sides:
        for policy, max_batches, max_bytes, before in sinks:
            queue = {"max_batches": max_batches, "max_bytes": max_bytes * unit * 2}
            w, _, _, _ = make(tmp_path, backpressure=policy, queue=queue)
            for seq in range(before):  # a drop sink drops past its bounds (a span pending), a block sink is forced
                if not w.offer(record := batch(STREAM, seq)):
                    w.force(record)
            written = list(w._queue)[:freed]  # written since: room again, a dropped span still pending
            w._settle(written, set(), sum(r.size for r in written))
            side.append(w)
    try:
        one, other = Fanout(sides[0]), Fanout(sides[1])
        untouched = [_queue_state(w) for w in sides[0]]
        if one.offer_all(runs[0]):
            for r in runs[1]:
                assert other.offer(r) == [], "offer_all took a run that a sink would have made wait"
            assert [_queue_state(w) for w in sides[0]] == [_queue_state(w) for w in sides[1]]
        else:
            assert [_queue_state(w) for w in sides[0]] == untouched
    finally:
        for side in sides:
            for w in side:
                w.dead_letters.close()


def test_with_a_tracker_each_record_is_applied_once_in_order_however_it_is_queued() -> None:
    """offer, offer_all and force each apply a record to the state tracker once, before the sinks
    get it (``record.state``: its delta); a stream switched off calls ``on_switched_off`` once."""
    tracker = StateTracker()
    switched: list[Record] = []
    fanout = Fanout([], tracker, switched.append)
    records = stream_records(STREAM, 4)
    assert fanout.offer(records[0]) == []
    assert fanout.offer_all(records[1:3])
    fanout.force(records[3])
    for r in records:
        assert r.state is not None and not r.state.stale and r.state.stream == STREAM
    head = tracker.head(STREAM)
    assert head is not None and head.seq == 3
    assert tracker.stats.stale_records == 0  # none applied twice
    assert switched == []


def test_a_stream_switched_off_by_the_tracker_is_reported_once() -> None:
    tracker = StateTracker(max_entries=0)  # no room: a new stream is off from the start
    switched: list[Record] = []
    fanout = Fanout([], tracker, switched.append)
    first, second = stream_records(STREAM, 2)
    fanout.offer(first)
    fanout.offer(second)
    assert switched == [first]
    assert first.state is not None and first.state.switched_off
    Fanout([], StateTracker(max_entries=0)).offer(batch(Stream("other", 0), 0))  # no callback: nothing to call
