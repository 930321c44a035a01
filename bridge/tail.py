"""``python -m bridge tail ENDPOINT``: print an engine's decoded events as JSON lines (debugging)."""

from __future__ import annotations

import sys
import time

import zmq
import zmq.asyncio

from . import wire
from .errors import DecodeError
from .formats import Renderer
from .records import Record, Stream
from .replay import ReplayOutcome, replay


async def tail(
    endpoint: str,
    *,
    topic: str = "",
    replay_endpoint: str | None = None,
    from_seq: int | None = None,
    count: int = 0,
    granularity: str = "event",
    timeout: float = 2.0,
) -> int:
    """Print batches as they arrive (after replaying from ``from_seq`` if asked); returns how many."""
    ctx = zmq.asyncio.Context()
    renderer = Renderer("json", "batch" if granularity == "batch" else "event")
    stream = Stream(endpoint, 0)
    out = sys.stdout.buffer
    printed = 0

    def emit(seq: int, payload: bytes, source: str) -> None:
        nonlocal printed
        try:
            batch = wire.decode_batch(payload)
        except DecodeError as exc:
            print(f"# seq {seq}: undecodable batch ({exc})", file=sys.stderr)
            return
        for bad in batch.bad_events:
            print(f"# seq {seq}: bad event {bad.index} ({bad.reason})", file=sys.stderr)
        record = Record(
            stream=Stream(stream.source, batch.dp_rank or 0),
            epoch=0,
            seq=seq,
            ts=batch.ts,
            payload=payload,
            events=batch.events,
            received=time.time(),
        )
        try:
            messages = renderer.render(record)
        except Exception as exc:  # a hostile batch (e.g. nested past the recursion limit) must not end tail
            print(f"# seq {seq}: cannot render ({type(exc).__name__}: {exc})", file=sys.stderr)
            return
        for m in messages:
            out.write(m.value + b"\n")
        out.flush()
        printed += 1

    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    try:
        if replay_endpoint and from_seq is not None:
            outcome = ReplayOutcome()
            async for reply in replay(ctx, replay_endpoint, from_seq, -1, timeout, outcome, 64 << 20):
                emit(reply.seq, reply.payload, "replay")
                if count and printed >= count:
                    return printed
            if not outcome.complete:
                print("# replay went silent before its end marker", file=sys.stderr)
        while not count or printed < count:
            frames = await sub.recv_multipart()
            try:
                f = wire.parse_live(frames)
            except DecodeError as exc:
                print(f"# bad message: {exc}", file=sys.stderr)
                continue
            emit(f.seq, f.payload, "live")
    finally:
        sub.close(linger=0)
        ctx.destroy(linger=0)
    return printed
