"""Memory and CPU of the state tracker (bridge.state): bytes per live block, ns per block operation.

``python -m benchmarks.state [--rounds 3] [--big 1000000]`` prints one table:

- bytes per live entry after storing N random u64 blocks (16 per BlockStored, the way vLLM sends
  them) through ``StateTracker.apply``, once every table's growth has finished: Python heap
  growth by tracemalloc, and RSS growth after ``malloc_trim``, each measured in a fresh process;
  the table arrays alone; and the arrays right after the last store ("while growing": a table in
  the middle of its growth holds the old arrays too until the next changes moved them);
- ns per block operation in steady state (a table of N live blocks, each record storing 16 new
  blocks and removing the 16 oldest), through ``apply`` (deltas and facts included) and on the
  bare table;
- a SourceReset of a stream with 1e5 live blocks (detaching its tables), and the enumeration of
  its keys that a sink writing tombstones then does;
- the slowest single store while a table of N blocks grows (incremental: a few slots per change).

CPU is process time (``time.process_time``), the best of ``--rounds``; the machine is shared.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import subprocess
import sys
import time
import tracemalloc
from typing import Any

from bridge.records import Record, Stream, source_reset
from bridge.state import BlockTable, StateTracker

STREAM = Stream("bench", 0)
PER_EVENT = 16


def ids(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def store(hashes: list[int], parent: int | None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(PER_EVENT * len(hashes))),
        "block_size": PER_EVENT,
        "medium": "GPU",
    }


def remove(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def fill(tracker: StateTracker, blocks: list[int], seq: int = 0) -> int:
    """Store ``blocks`` into the stream, 16 per record; the next seq."""
    for i in range(0, len(blocks), PER_EVENT):
        tracker.apply(Record(stream=STREAM, epoch=1, seq=seq, events=[store(blocks[i : i + PER_EVENT], None)]))
        seq += 1
    return seq


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def child(kind: str, n: int) -> dict[str, float]:
    """One memory measurement in this (fresh) process."""
    blocks = ids(n)
    tracker = StateTracker()
    growing = 0.0
    if kind == "tracemalloc":
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        fill(tracker, blocks)
        growing = tracker.nbytes() / n
        settle(tracker)
        _trim()
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
    else:
        _trim()
        base = _rss()
        fill(tracker, blocks)
        growing = tracker.nbytes() / n
        settle(tracker)
        _trim()
        grown = _rss() - base
    assert tracker.total == n
    out = {"bytes": grown / n, "arrays": tracker.nbytes() / n, "growing": growing}
    if kind == "tracemalloc" and n <= 100_000:  # each block stored a second time: the side dict's cost
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        fill(tracker, blocks, seq=n)
        _trim()
        out["dup_bytes"] = (tracemalloc.get_traced_memory()[0] - base) / n
        tracemalloc.stop()
    return out


def settle(tracker: StateTracker) -> None:
    """Finish every table's growth (what the next few thousand changes of the stream do)."""
    for st in tracker._streams.values():
        for table in st.tiers.values():
            table._finish()


def memory(kind: str, n: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.state", "--child", kind, str(n)], check=True, capture_output=True, text=True
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def steady(n: int, ops: int, rounds: int) -> dict[str, float]:
    """ns per block operation with ``n`` live blocks: through apply, and on the bare table."""
    blocks = ids(n + ops, seed=2)
    best_apply = best_add = best_remove = float("inf")
    for _ in range(rounds):
        tracker = StateTracker()
        seq = fill(tracker, blocks[:n])
        gc.collect()
        t0 = time.process_time()
        for i in range(n, n + ops, PER_EVENT):
            new, old = blocks[i : i + PER_EVENT], blocks[i - n : i - n + PER_EVENT]
            tracker.apply(Record(stream=STREAM, epoch=1, seq=seq, events=[store(new, None), remove(old)]))
            seq += 1
        best_apply = min(best_apply, (time.process_time() - t0) / (2 * ops) * 1e9)
        assert tracker.total == n

        table = BlockTable()
        for k in blocks[:n]:
            table.add(k, 1)
        gc.collect()
        add, rm = table.add, table.remove
        t_add = t_rm = 0.0
        for i in range(n, n + ops, 1000):
            t0 = time.process_time()
            for k in blocks[i : i + 1000]:
                add(k, 2)
            t1 = time.process_time()
            for k in blocks[i - n : i - n + 1000]:
                rm(k, 3)
            t_add += t1 - t0
            t_rm += time.process_time() - t1
        best_add = min(best_add, t_add / ops * 1e9)
        best_remove = min(best_remove, t_rm / ops * 1e9)
    return {"apply": best_apply, "add": best_add, "remove": best_remove}


def reset(n: int, rounds: int) -> dict[str, float]:
    best_reset = best_enum = float("inf")
    for _ in range(rounds):
        tracker = StateTracker()
        fill(tracker, ids(n, seed=3))
        gc.collect()
        t0 = time.process_time()
        delta = tracker.apply(source_reset(STREAM, 2, "publisher_restart", 0.0))
        t1 = time.process_time()
        keys = [f"{k:016x}" for tier in delta.cleared for k in tier.blocks]
        t2 = time.process_time()
        assert len(keys) == n and tracker.total == 0
        best_reset, best_enum = min(best_reset, t1 - t0), min(best_enum, t2 - t1)
    return {"reset_ms": best_reset * 1e3, "enumerate_ms": best_enum * 1e3}


def growth_pause(n: int, rounds: int) -> float:
    """ms of the slowest single store while a table grows past ``n`` blocks (what one unlucky
    store pays: before incremental growth, the whole rebuild)."""
    best = float("inf")
    keys = ids(n, seed=4)
    for _ in range(rounds):
        table = BlockTable()
        for k in keys:
            table.add(k, 1)
        worst = 0.0
        extra = ids(n // 2, seed=5)  # past the next growth, which starts and ends in here
        for k in extra:
            t0 = time.perf_counter()
            table.add(k, 2)
            worst = max(worst, time.perf_counter() - t0)
        best = min(best, worst)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big", type=int, default=1_000_000)
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    print(f"state tracker, Python {sys.version.split()[0]}; CPU: process time, best of {args.rounds}")
    print(
        f"{'live blocks':>12} {'B/entry heap':>13} {'B/entry RSS':>12} {'B/entry arrays':>15} "
        f"{'while growing':>14} {'apply ns/op':>12} {'add ns':>7} {'remove ns':>10}"
    )
    dup = 0.0
    for n in (100_000, args.big):
        heap, rss = memory("tracemalloc", n), memory("rss", n)
        dup = heap.get("dup_bytes", dup)
        cpu = steady(n, args.ops, args.rounds)
        print(
            f"{n:>12,} {heap['bytes']:>13.1f} {rss['bytes']:>12.1f} {heap['arrays']:>15.1f} "
            f"{heap['growing']:>14.1f} {cpu['apply']:>12.0f} {cpu['add']:>7.0f} {cpu['remove']:>10.0f}"
        )
    print(f"a block stored twice (count 2: side dict with its fact, 16 tokens) costs {dup:.0f} B more")
    r = reset(100_000, args.rounds)
    print(
        f"SourceReset of 100,000 live blocks: {r['reset_ms']:.3f} ms in apply, "
        f"{r['enumerate_ms']:.1f} ms to enumerate the keys as hex (a sink's tombstones)"
    )
    print(f"slowest single store while growing past {args.big:,} blocks: {growth_pause(args.big, args.rounds):.2f} ms")


if __name__ == "__main__":
    main()
