"""Fan-out: every record goes to every sink's queue, in stream order.

With ``backpressure: block`` a full queue makes the stream wait here (ingest stops reading, the
engine's ZMQ high-water mark drops, and the replay socket repairs the gap later); ``drop`` sinks
never make anyone wait (see :mod:`bridge.sink`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .records import Record
from .sink import SinkWorker


class Fanout:
    def __init__(self, workers: Sequence[SinkWorker]) -> None:
        self.workers = list(workers)

    async def publish(self, record: Record) -> None:
        """Queue ``record`` on every sink, waiting for room only where a sink blocks."""
        waiting = [w for w in self.workers if not w.offer(record)]
        while waiting:
            w = waiting[0]
            await w.wait_room()
            if w.offer(record):
                waiting.pop(0)
