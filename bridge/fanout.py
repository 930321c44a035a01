"""Fan-out: every record goes to every sink's queue, in stream order.

With ``backpressure: block`` a full queue makes the stream wait here (ingest stops reading, the
engine's ZMQ high-water mark drops, and the replay socket repairs the gap later); ``drop`` sinks
never make anyone wait (see :mod:`bridge.sink`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from .records import Record
from .sink import SinkWorker


class Fanout:
    def __init__(self, workers: Sequence[SinkWorker]) -> None:
        self.workers = list(workers)

    def offer(self, record: Record) -> list[SinkWorker]:
        """Queue ``record`` on every sink with room; returns the blocking sinks still to wait for.

        The hot path calls this (no coroutine per batch) and :meth:`finish` only when needed.
        """
        return [w for w in self.workers if not w.offer(record)]

    def force(self, record: Record) -> None:
        """Queue ``record`` on every sink now, past a full queue's bounds (see StreamPipeline)."""
        for w in self.workers:
            if not w.offer(record):
                w.force(record)

    async def publish(self, record: Record) -> None:
        """Queue ``record`` on every sink, waiting for room only where a sink blocks."""
        waiting = self.offer(record)
        if waiting:
            await self.finish(record, waiting)

    async def finish(self, record: Record, waiting: list[SinkWorker]) -> None:
        """Queue ``record`` on the sinks :meth:`offer` returned, in order, as each makes room.

        Cancelled (its source removed while it waited), the record is queued anyway, past the
        bounds by that one record: the other sinks have it, and once its stream is gone nothing
        would bring it to these (I4).
        """
        try:
            while waiting:
                w = waiting[0]
                await w.wait_room()
                if w.offer(record):
                    waiting.pop(0)
        except asyncio.CancelledError:
            for w in waiting:
                w.force(record)
            raise
