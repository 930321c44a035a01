"""Fan-out: every record goes to every sink's queue, in stream order.

With ``backpressure: block`` a full queue makes the stream wait here (ingest stops reading, the
engine's ZMQ high-water mark drops, and the replay socket repairs the gap later); ``drop`` sinks
never make anyone wait (see :mod:`bridge.sink`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from .records import EMPTY_RECORD_BYTES, Record
from .sink import SinkWorker
from .state import StateTracker


class Fanout:
    """Hands each record to every sink; with a state tracker (a sink keeps state), applies the
    record to it first, once, in stream order (``record.state``)."""

    def __init__(
        self,
        workers: Sequence[SinkWorker],
        tracker: StateTracker | None = None,
        on_switched_off: Callable[[Record], None] | None = None,
    ) -> None:
        self.workers = list(workers)
        self.tracker = tracker
        self.on_switched_off = on_switched_off

    def _track(self, record: Record) -> None:
        assert self.tracker is not None
        delta = record.state = self.tracker.apply(record)
        if delta.switched_off and self.on_switched_off is not None:
            self.on_switched_off(record)

    def offer(self, record: Record) -> list[SinkWorker]:
        """Queue ``record`` on every sink with room; returns the blocking sinks still to wait for.

        The hot path calls this (no coroutine per batch) and :meth:`finish` only when needed.
        """
        if self.tracker is not None:
            self._track(record)
        return [w for w in self.workers if not w.offer(record)]

    def offer_all(self, records: Sequence[Record]) -> bool:
        """Queue ``records`` (one stream's, in order) on every sink at once when each has room for
        all of them now (True); else nothing is queued or tracked (False: offer them one by one)."""
        size = 0
        for r in records:
            size += len(r.payload) or EMPTY_RECORD_BYTES  # Record.size, inline (the hot path)
        n = len(records)
        for w in self.workers:
            if not w.has_room_for(n, size):
                return False
        if self.tracker is not None:
            for r in records:
                self._track(r)
        for w in self.workers:
            w.push_all(records, size)
        return True

    def force(self, record: Record) -> None:
        """Queue ``record`` on every sink now, past a full queue's bounds (see StreamPipeline)."""
        if self.tracker is not None:
            self._track(record)
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
