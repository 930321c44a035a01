"""CPU cost of the bridge's pipeline per batch, without sockets: the A/B tool for code changes.

    .venv/bin/python -m benchmarks.pipeline [--formats raw/batch,json/event] [--batches 200000] [--rounds 5]

A format may name a filter as a third part (bridge/filters.py): ``json/event/drop`` (token_ids:
drop), ``json/event/hash`` (token_ids: hash), ``json/event/keep`` (fields: keep block_hashes,
parent_block_hash), e.g. ``--formats json/event,json/event/drop,json/event/hash``.

End-to-end numbers on a shared 2-core machine move by tens of percent with whatever else runs;
this one does not need the scheduler's goodwill. One process, one event loop (uvloop when
installed): a real :class:`bridge.runtime.Bridge` with a file sink writing to ``/dev/null``, one
stream fed with the load publisher's frames (:func:`benchmarks.load.payload_pool`) in bursts of
``ingest.drain_max`` through :meth:`StreamPipeline.on_live`, exactly what the source reader calls.
Measured: process CPU time per batch from the first burst until the sink has delivered the last
batch, i.e. sequencing, decoding, metrics, fan-out, the sink queue, rendering and the connector
write. ZMQ's own receive cost is not in it (see ``benchmarks.run`` for that).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bridge import config as config_mod
from bridge.records import Stream
from bridge.runtime import Bridge
from bridge.stream import StreamPipeline

from .load import LoadShape, payload_pool

FILTERS: dict[str, dict[str, object]] = {
    "": {},
    "drop": {"token_ids": "drop"},
    "hash": {"token_ids": "hash", "token_ids_key": "benchmark-key-0123456789"},
    "keep": {"fields": {"keep": ["block_hashes", "parent_block_hash"]}},
}


async def one(fmt: str, batches: int, burst: int) -> float:
    """CPU microseconds per batch for ``batches`` batches in format ``fmt`` (FORMAT/GRANULARITY[/FILTER])."""
    f, g, *rest = fmt.split("/")
    filter_ = FILTERS[rest[0] if rest else ""]
    config = config_mod.from_data(
        {
            "sources": [{"name": "idle", "endpoint": "tcp://127.0.0.1:9"}],  # required; nothing publishes there
            "sinks": [
                {"type": "file", "path": "/dev/null", "format": f, "granularity": g, "binary": "length-prefixed", **filter_}
            ],
            "metrics": {"listen": ""},
            "replay": {"idle_probe": 0},
        },
        env={},
    )
    bridge = Bridge(config)
    await bridge.start()
    try:
        pipeline = StreamPipeline(bridge.context, Stream("bench", 0), replay_endpoint=None, replay_on_start=False, epoch=0)
        pool = payload_pool(LoadShape("127.0.0.1", 0, ranks=1), 0)
        frames = [[b"", seq.to_bytes(8, "big"), pool[seq % len(pool)]] for seq in range(batches)]
        worker = bridge.workers[0]
        started = time.process_time()
        for i in range(0, batches, burst):
            await pipeline.on_live(frames[i : i + burst], time.time())
            await asyncio.sleep(0)  # the sink worker's turn, as the event loop would give it
        assert await worker.flush(60), "sink did not drain"
        return (time.process_time() - started) / batches * 1e6
    finally:
        await bridge.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="raw/batch,json/event")
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--burst", type=int, default=256, help="batches per on_live call (ingest.drain_max)")
    parser.add_argument("--rounds", type=int, default=5, help="runs per format; the best is shown")
    args = parser.parse_args()
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    for fmt in args.formats.split(","):
        runs = []
        for _ in range(args.rounds):
            with asyncio.Runner(loop_factory=factory) as runner:
                runs.append(runner.run(one(fmt, args.batches, args.burst)))
        best = min(runs)
        print(f"{fmt:14s} {best:6.1f} us CPU per batch (best of {args.rounds}; all: {', '.join(f'{r:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
