"""The load side of the benchmarks: a paced vLLM-compatible publisher, and the bare drain loop.

Both run in processes of their own (``multiprocessing`` spawn), steered through shared values:

- :func:`publisher_main`: one PUB socket per rank (``port + rank``, like vLLM's data-parallel
  ranks), publishing pre-encoded batches from :class:`bridge.simulator.EventFactory` /
  :func:`bridge.simulator.encode_batch` (the simulator's realistic mix: chained BlockStored of
  16-token blocks, BlockRemoved of stored blocks, a rare AllBlocksCleared) at a rate the parent
  changes at run time. Only the batch's ``ts`` (the float64 right after the array header) is
  patched per message, so the publisher costs a few microseconds per batch and leaves the CPU to
  the bridge. Its sequence numbers never jump: what the bridge misses was dropped by ZMQ's
  high-water marks, as with a real engine that is faster than its subscriber.
- :func:`drain_main`: the limit that ingest is compared with, a minimal subscriber that does
  nothing but ``recv_multipart(NOBLOCK)`` in a loop and ``msgspec.msgpack.decode`` of each
  payload, on the same sockets options as the bridge.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import time
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from typing import Any

PROFILE = "vllm-0.33.0"
_F64 = struct.Struct(">d")


@dataclass(frozen=True)
class LoadShape:
    """What the publisher sends: ``ranks`` streams of batches of ``events`` events."""

    host: str
    port: int  # rank r publishes on port + r
    ranks: int = 4
    events: int = 4
    blocks_per_event: int = 2
    block_size: int = 16
    pool: int = 512  # distinct batches per rank, cycled
    seed: int = 1

    def endpoints(self) -> list[str]:
        return [f"tcp://{self.host}:{self.port + r}" for r in range(self.ranks)]


def payload_pool(shape: LoadShape, rank: int) -> list[bytes]:
    """``shape.pool`` encoded batches of one rank, each starting with ``[ts`` as float64."""
    from bridge.simulator import PROFILES, EventFactory, encode_batch

    profile = PROFILES[PROFILE]
    factory = EventFactory(
        profile, seed=shape.seed * 31 + rank, block_size=shape.block_size, blocks_per_event=shape.blocks_per_event
    )
    out = []
    for _ in range(shape.pool):
        payload = encode_batch(profile, 1.0, factory.batch(shape.events), rank)
        # vLLM's array batch: fixarray header, then ts as msgpack float64 (0xcb + 8 bytes).
        assert payload[1] == 0xCB, "expected an array batch with a float64 ts"
        out.append(payload)
    return out


def publisher_main(shape: LoadShape, rate: Synchronized[float], sent: Synchronized[int], ready: Any) -> None:
    """Publish at ``rate.value`` batches/s in total (0: paused, < 0: as fast as possible) until SIGTERM."""
    import zmq
    from zmq.backend import Socket as BackendSocket

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    ctx = zmq.Context()
    socks = []
    for ep in shape.endpoints():
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default
        s.bind(ep)
        socks.append(s)
    pools = [payload_pool(shape, r) for r in range(shape.ranks)]
    seqs = [0] * shape.ranks
    ready.set()
    pack = _F64.pack
    now = time.time
    n_ranks, pool = shape.ranks, shape.pool
    # The compiled socket's send: pyzmq's send_multipart converts flags to enums per frame, which
    # made the publisher, not the subscriber, the limit of the bare drain measurement.
    send, more = BackendSocket.send, zmq.SNDMORE
    count = 0
    tick = 0.001
    try:
        base_t, base_n, current = time.monotonic(), 0, rate.value
        while True:
            r = rate.value
            if r != current:
                base_t, base_n, current = time.monotonic(), count, r
            if r == 0:
                time.sleep(0.01)
                continue
            if r < 0:
                due = count + 256
            else:
                due = base_n + int((time.monotonic() - base_t) * r)
                due = min(due, count + max(64, int(r * 0.01)))  # no huge catch-up burst after a stall
            while count < due:
                rank = count % n_ranks
                seq = seqs[rank]
                seqs[rank] = seq + 1
                p = pools[rank][seq % pool]
                sock = socks[rank]
                send(sock, b"", more)
                send(sock, seq.to_bytes(8, "big"), more)
                send(sock, p[:2] + pack(now()) + p[10:])
                count += 1
            sent.value = count
            if r > 0:
                time.sleep(tick)
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        sent.value = count
        for s in socks:
            s.close(linger=0)
        ctx.term()


def drain_main(endpoints: list[str], received: Synchronized[int], events: Synchronized[int], ready: Any, hwm: int) -> None:
    """The bare limit: drain every socket with NOBLOCK reads and decode each payload, nothing else."""
    import msgspec
    import zmq

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for ep in endpoints:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, hwm)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(ep)
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    decode = msgspec.msgpack.Decoder().decode
    ready.set()
    n = e = 0
    try:
        while True:
            got = 0
            for s in socks:
                recv = s.recv_multipart
                try:
                    for _ in range(256):
                        frames = recv(zmq.NOBLOCK)
                        batch = decode(frames[2])
                        e += len(batch[1])
                        got += 1
                except zmq.Again:
                    pass
            n += got
            received.value = n
            events.value = e
            if not got:
                poller.poll(100)
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        for s in socks:
            s.close(linger=0)
        with contextlib.suppress(Exception):
            ctx.term()


def start_publisher(shape: LoadShape) -> tuple[Any, Synchronized[float], Synchronized[int]]:
    """A :func:`publisher_main` process for ``shape``, started (spawn) and ready, paused (rate 0):
    (process, rate, sent)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rate, sent, ready = ctx.Value("d", 0.0, lock=False), ctx.Value("q", 0, lock=False), ctx.Event()
    proc = ctx.Process(target=publisher_main, args=(shape, rate, sent, ready), daemon=True)
    proc.start()
    if not ready.wait(60):
        proc.terminate()
        raise RuntimeError("publisher did not start within 60 s")
    return proc, rate, sent


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> tuple[int, int]:
    """(current, peak) resident set size of a process, from /proc/PID/status."""
    cur = peak = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return cur, peak


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of a process (for profiling the split between loop and I/O threads)."""
    out: dict[str, float] = {}
    tck = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                head, rest = f.read().rsplit(b")", 1)
            name = head.split(b"(", 1)[1].decode()
            fields = rest.split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tck
        except OSError:
            continue
    return out
