"""The sink's write bound in bytes, at its edge: a write is filled while the next record fits,
and never passes ``batch.max_bytes`` by even one byte (a broker's message-size limit is exact)."""

from __future__ import annotations

from pathlib import Path

from bridge.records import Stream
from tests.support.records import stream_records
from tests.unit.test_sink import fill, make

STREAM = Stream("b", 0)


async def test_a_write_stops_one_byte_short_of_the_next_record_and_takes_it_at_exactly_the_bound(tmp_path: Path) -> None:
    records = stream_records(STREAM, 5)[1:]  # the same size each
    size = records[0].size
    assert all(r.size == size for r in records)
    for limit, per_write in ((2 * size - 1, 1), (2 * size, 2)):
        worker, conn, _, _ = make(tmp_path, granularity="batch", batch={"linger": 0, "max_bytes": limit})
        await fill(worker, records)  # all queued before the first write
        worker.start()
        assert await worker.flush(5)
        await worker.stop()
        worker.dead_letters.close()
        assert conn.writes == [per_write] * (4 // per_write), limit
        assert [m.record.seq for m in conn.messages] == [1, 2, 3, 4]
