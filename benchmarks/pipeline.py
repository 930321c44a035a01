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

Beside each format, a *floor* measured in the same run on the same frames: the least any
implementation of that output does per batch, with no sequencing, queue, metrics or sink.

- ``json/event``: msgspec-decode the batch, build each event's JSON object with its header (a
  copy of the batch's header dict, its index, the event's fields), ``encode_into`` one buffer
  (a write's worth, newline-separated, cleared every ``batch.max_messages`` messages);
- ``raw/batch``: parse the seq frame, count the events by type (``wire.count_batch``, what the
  bridge does for raw-only sinks), collect the payload (cleared every 2,000 batches).

The ratio bridge / floor is what the targets are stated in (docs/development/benchmarks.md). Garbage collection is
set as ``python -m bridge`` sets it (``bridge.cli.tune_gc``); ``--gc default`` keeps Python's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import Callable

import msgspec

from bridge import config as config_mod
from bridge import wire
from bridge.cli import tune_gc
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


async def one(fmt: str, batches: int, burst: int, sinks: int = 1) -> float:
    """CPU microseconds per batch for ``batches`` batches in format ``fmt`` (FORMAT/GRANULARITY[/FILTER])."""
    f, g, *rest = fmt.split("/")
    filter_ = FILTERS[rest[0] if rest else ""]
    config = config_mod.from_data(
        {
            "sources": [{"name": "idle", "endpoint": "tcp://127.0.0.1:9"}],  # required; nothing publishes there
            "sinks": [
                {
                    "type": "file",
                    "name": f"null{i}",
                    "path": "/dev/null",
                    "format": f,
                    "granularity": g,
                    "binary": "length-prefixed",
                    **filter_,
                }
                for i in range(sinks)
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
        frames = _frames(batches)
        started = time.process_time()
        for i in range(0, batches, burst):
            await pipeline.on_live(frames[i : i + burst], time.time())
            await asyncio.sleep(0)  # the sink worker's turn, as the event loop would give it
        for worker in bridge.workers:
            assert await worker.flush(60), f"sink {worker.name} did not drain"
        return (time.process_time() - started) / batches * 1e6
    finally:
        await bridge.stop()


def _frames(batches: int) -> list[list[bytes]]:
    pool = payload_pool(LoadShape("127.0.0.1", 0, ranks=1), 0)
    return [[b"", seq.to_bytes(8, "big"), pool[seq % len(pool)]] for seq in range(batches)]


def floor_json_event(frames: list[list[bytes]], write_every: int = 2000) -> float:
    """CPU microseconds per batch of the json/event floor (see the module's docstring)."""
    decode, encode_into = msgspec.msgpack.Decoder().decode, msgspec.json.Encoder().encode_into
    buf = bytearray()
    pending = 0
    started = time.process_time()
    for _topic, seq_frame, payload in frames:
        seq = int.from_bytes(seq_frame, "big")
        ts, events, *_rank = decode(payload)
        header = {"source": "bench", "dp_rank": 0, "epoch": 1, "seq": seq, "index": 0, "ts": ts, "schema_version": 1}
        for i, event in enumerate(events):
            obj = header.copy()
            obj["index"] = i
            obj.update(event)
            encode_into(obj, buf, -1)
            buf.append(10)
        pending += len(events)
        if pending >= write_every:
            buf.clear()
            pending = 0
    return (time.process_time() - started) / len(frames) * 1e6


def floor_raw_batch(frames: list[list[bytes]], write_every: int = 2000) -> float:
    """CPU microseconds per batch of the raw/batch floor (ingest + count; see the module's docstring)."""
    count = wire.count_batch
    counts: dict[str, int] = {}
    out: list[bytes] = []
    started = time.process_time()
    for _topic, seq_frame, payload in frames:
        int.from_bytes(seq_frame, "big")
        counted = count(payload)
        assert counted is not None
        for t in counted.types:
            counts[t] = counts.get(t, 0) + 1
        out.append(payload)
        if len(out) >= write_every:
            out.clear()
    return (time.process_time() - started) / len(frames) * 1e6


FLOORS: dict[str, Callable[[list[list[bytes]]], float]] = {"json/event": floor_json_event, "raw/batch": floor_raw_batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="raw/batch,json/event")
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--burst", type=int, default=256, help="batches per on_live call (ingest.drain_max)")
    parser.add_argument("--rounds", type=int, default=5, help="runs per format; the best is shown")
    parser.add_argument("--sinks", type=int, default=1, help="identical file sinks (they share one renderer)")
    parser.add_argument("--gc", choices=("cli", "default"), default="cli", help="GC settings: as python -m bridge, or Python's")
    args = parser.parse_args()
    if args.gc == "cli":
        tune_gc()
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    print(f"{'format':16s} {'bridge us/batch':>16s} {'floor us/batch':>15s} {'bridge/floor':>13s}   all rounds (bridge | floor)")
    for fmt in args.formats.split(","):
        floor = FLOORS.get(fmt) if args.sinks == 1 else None
        frames = _frames(args.batches) if floor else []
        runs: list[float] = []
        floors: list[float] = []
        for _ in range(args.rounds):  # alternating, so that the machine's drift touches both alike
            with asyncio.Runner(loop_factory=factory) as runner:
                runs.append(runner.run(one(fmt, args.batches, args.burst, args.sinks)))
            if floor is not None:
                gc.collect()
                floors.append(floor(frames))
        best = min(runs)
        best_floor = f"{min(floors):15.1f}" if floors else f"{'-':>15s}"
        ratio = f"{best / min(floors):12.2f}x" if floors else f"{'-':>13s}"
        rounds = ", ".join(f"{r:.1f}" for r in runs) + (" | " + ", ".join(f"{r:.1f}" for r in floors) if floors else "")
        print(f"{fmt:16s} {best:16.1f} {best_floor} {ratio}   {rounds}")


if __name__ == "__main__":
    main()
