"""Fan-out past the bounds (bridge.fanout.Fanout.force): a record StreamPipeline must hand on
without waiting (see bridge/stream.py) reaches every sink exactly once, in order, whether its
queue is full or not (I4: nothing it decided is left out; I2: nothing written twice)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bridge.fanout import Fanout
from bridge.records import Stream
from tests.support.records import stream_records
from tests.unit.test_sink import make

STREAM = Stream("f", 0)


async def test_a_forced_record_reaches_every_sink_once_whether_its_queue_is_full_or_not(tmp_path: Path) -> None:
    free, free_conn, _, _ = make(tmp_path, batch={"linger": 0})
    full, full_conn, _, _ = make(tmp_path, batch={"linger": 0}, queue={"max_batches": 1})
    full_conn.gate = asyncio.Event()
    fanout = Fanout([free, full])
    free.start()
    full.start()
    first, second = stream_records(STREAM, 2)
    assert fanout.offer(first) == []
    await asyncio.sleep(0.02)
    assert not full.offer(second) and free.has_room(second.size)  # one full queue, one with room
    fanout.force(second)
    full_conn.gate.set()
    assert await free.flush(5) and await full.flush(5)
    for w in (free, full):
        await w.stop()
        w.dead_letters.close()
    assert [m.record.seq for m in free_conn.messages] == [0, 1]
    assert [m.record.seq for m in full_conn.messages] == [0, 1]
