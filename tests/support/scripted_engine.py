"""A step-controlled fake engine on real ZMQ sockets, and the checker of design.md's I1-I4.

:class:`ScriptedEngine` binds an XPUB (wire-compatible with the engines' PUB, and it tells when
the bridge's subscription is in place) and a ROUTER replay socket, and publishes one batch per
:meth:`~ScriptedEngine.publish` step, in vLLM 0.33's bytes. Every payload names its publisher:
its ts is ``instance start + seq * 1ms`` (each instance starts later) and its first event is a
``BlockStored`` whose first block hash is ``instance * 10**6 + seq``. The engine records the truth
(per instance: every payload published, and which seqs surely reached a subscribed bridge), and
:func:`check_invariants` holds the bridge's file-sink output (json, batch granularity) against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Literal

import zmq
import zmq.asyncio

from bridge.simulator import PROFILES, EventFactory, encode_batch
from bridge.snapshot import REQUEST as SNAPSHOT_REQUEST
from bridge.wire import END_SEQ

ReplayMode = Literal["answer", "ignore", "drop_end_marker", "half", "garbled"]
PROFILE = PROFILES["vllm-0.33.0"]
MARK = 10**6  # block hash marker: instance * MARK + seq


@dataclass
class Instance:
    """One life of the engine, from a start to a restart."""

    number: int
    start: float
    uuid: bytes = b""  # its lifetime UUID in every sequence frame (vLLM #57789); b"": 8-byte frames
    payloads: list[bytes] = field(default_factory=list)  # index: seq
    live: set[int] = field(default_factory=set)  # sent on PUB while the bridge was known subscribed
    back: dict[int, float] = field(default_factory=dict)  # seq -> how far the clock had stepped back

    def ts(self, seq: int) -> float:
        return self.start + seq * 0.001 - self.back.get(seq, 0.0)


class ScriptedEngine:
    """``async with ScriptedEngine(live_port, replay_port) as engine:`` then drive it step by step.

    ``replay`` (settable at any time): ``answer``; ``ignore``; ``drop_end_marker`` (every reply,
    then silence); ``half`` (the first half of the replies, then silence); ``garbled`` (every reply
    with a frame more than the protocol has, which the bridge cannot read, then the end marker:
    it must not take that for "nothing there"). ``buffer_steps``: the
    replay buffer keeps the last that many batches. ``uuid``: 24-byte sequence frames, seq and
    each instance's lifetime UUID (vLLM #57789).
    """

    def __init__(
        self, live_port: int, replay_port: int, *, replay: ReplayMode = "answer", buffer_steps: int = 10_000, uuid: bool = False
    ) -> None:
        self.ports = (live_port, replay_port)
        self.uuid = uuid
        self.replay: ReplayMode = replay
        self.buffer_steps = buffer_steps
        self.instances: list[Instance] = []
        self.requests: list[tuple[int, int]] = []  # (instance, start) of each replay request served
        self.ctx = zmq.asyncio.Context()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._subscribed = False
        self.pub: zmq.asyncio.Socket
        self.router: zmq.asyncio.Socket
        self._serving: asyncio.Task[None] | None = None
        self._factory = EventFactory(PROFILE)
        self.clock_back = 0.0  # how far the current instance's clock has stepped back (step_back)

    @property
    def current(self) -> Instance:
        return self.instances[-1]

    async def __aenter__(self) -> ScriptedEngine:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()
        self.ctx.destroy(linger=0)

    # -- steps ------------------------------------------------------------------------------------
    async def publish(self, n: int = 1, *, deliver: bool = True, payload: bytes | None = None) -> list[int]:
        """Publish ``n`` batches; ``deliver=False`` keeps them out of PUB (a high-water-mark drop)
        but in the replay buffer; ``payload``: these bytes instead of a batch (a publisher that
        is not a KV event encoder). Returns their seqs."""
        inst, seqs = self.current, []
        for _ in range(n):
            seq = len(inst.payloads)
            if self.clock_back:
                inst.back[seq] = self.clock_back
            data = payload
            if data is None:
                event = self._factory.stored_event()
                event["block_hashes"] = [inst.number * MARK + seq, *event["block_hashes"][1:]]
                data = encode_batch(PROFILE, inst.ts(seq), [event])
            inst.payloads.append(data)
            self._buffer.append((seq, data))
            if deliver:
                await self._poll_subscriptions()
                known = self._subscribed  # a subscription that arrives during the send is "maybe"
                await self.pub.send_multipart([b"", seq.to_bytes(8, "big") + inst.uuid, data])
                if known:
                    inst.live.add(seq)
            seqs.append(seq)
        return seqs

    def step_back(self, seconds: float) -> None:
        """The engine's clock steps back (NTP): the current instance's next batches are stamped
        ``seconds`` earlier than they would be."""
        self.clock_back += seconds

    async def restart(self) -> None:
        """Close both sockets, bind new ones on the same ports: seq from 0, empty buffer."""
        self.clock_back = 0.0
        await self._close()
        self._buffer = deque(maxlen=self.buffer_steps)
        await self._open()

    async def blip(self) -> None:
        """Close the live socket and bind a new one on the same port: the bridge sees the connection
        drop and come back; the same instance goes on (its seqs and replay buffer)."""
        self.pub.close(linger=0)
        self.pub = await self._bind(zmq.XPUB, self.ports[0])
        self._subscribed = False

    async def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Until the bridge's SUB has subscribed to the current instance's socket."""
        deadline = time.monotonic() + timeout
        while not self._subscribed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the bridge did not subscribe within {timeout}s")
            await self.pub.poll(int(left * 1000) + 1)
            await self._poll_subscriptions()

    async def wait_request(self, instance: int, timeout: float = 10.0) -> None:
        """Until ``instance`` has served (or ignored) a replay request."""
        deadline = time.monotonic() + timeout
        while not any(i == instance for i, _ in self.requests):
            if time.monotonic() > deadline:
                raise AssertionError(f"no replay request reached instance {instance} within {timeout}s")
            await asyncio.sleep(0.02)

    def serve_snapshot(self, router: zmq.asyncio.Socket, identity: bytes, socket: str) -> bool:
        """A ``b"snapshot"`` request on ``socket`` ("replay"): True when this engine serves it
        (see CacheEngine); otherwise it is read as a start seq, as an engine without snapshots does."""
        return False

    # -- sockets ----------------------------------------------------------------------------------
    async def _open(self) -> None:
        prev = self.instances[-1] if self.instances else None
        start = time.time() if prev is None else max(time.time(), prev.ts(len(prev.payloads)) + 1.0)
        self.instances.append(Instance(len(self.instances), start, os.urandom(16) if self.uuid else b""))
        self.pub = await self._bind(zmq.XPUB, self.ports[0])
        self.router = await self._bind(zmq.ROUTER, self.ports[1])
        self._subscribed = False
        self._serving = asyncio.create_task(self._serve(self.router, self.current.number), name="scripted-replay")

    async def _close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
        self.pub.close(linger=0)
        self.router.close(linger=0)

    async def _bind(self, kind: int, port: int) -> zmq.asyncio.Socket:
        for _ in range(200):  # a port just closed may take a moment to be free again
            sock = self.ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
                return sock
            except zmq.ZMQError:
                sock.close(linger=0)
                await asyncio.sleep(0.01)
        raise AssertionError(f"port {port} did not become free")

    async def _poll_subscriptions(self) -> None:
        while True:
            try:
                msg = await self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] in (b"\x00", b"\x01"):
                self._subscribed = msg[:1] == b"\x01"

    async def _serve(self, router: zmq.asyncio.Socket, instance: int) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            if frames[2] == SNAPSHOT_REQUEST and self.serve_snapshot(router, ident, "replay"):
                continue
            uuid = self.instances[instance].uuid
            mode = self.replay
            replies = [(s, p) for s, p in self._buffer if s >= start] if mode != "ignore" else []
            if mode == "half":
                replies = replies[: len(replies) // 2]
            extra = [b"?"] if mode == "garbled" else []
            for seq, payload in replies:
                await router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big") + uuid, payload, *extra])
            if mode in ("answer", "garbled"):
                await router.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big"), b""])
            self.requests.append((instance, start))


# -- the checker ------------------------------------------------------------------------------------


@dataclass
class EpochView:
    """What the output holds for one epoch, in file order."""

    epoch: int
    reset: bool = False  # opened by a SourceReset
    batches: list[tuple[int, int]] = field(default_factory=list)  # (seq, instance)
    lost: list[int] = field(default_factory=list)  # seqs inside its EventsLost records
    records: int = 0

    @property
    def instances(self) -> set[int]:
        return {i for _, i in self.batches}

    @property
    def delivered(self) -> list[int]:
        return [s for s, _ in self.batches]

    def __str__(self) -> str:
        parts = [f"i{i} {_spans([s for s, j in self.batches if j == i])}" for i in sorted(self.instances)]
        if self.lost:
            parts.append(f"lost {_spans(self.lost)}")
        return f"epoch {self.epoch}{' (reset)' if self.reset else ''}: " + ", ".join(parts)


def identify(record: dict[str, Any]) -> tuple[int, int]:
    """(instance, seq) of a batch record, from its payload marker."""
    return divmod(int(record["events"][0]["block_hashes"][0]), MARK)


def _spans(seqs: list[int]) -> str:
    runs: list[list[int]] = []
    for s in seqs:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return "[" + " ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "]"


def epochs(records: list[dict[str, Any]]) -> list[EpochView]:
    """The records grouped by epoch, in the order epochs first appear."""
    views: dict[int, EpochView] = {}
    for r in records:
        v = views.setdefault(r["epoch"], EpochView(r["epoch"]))
        if "events" in r:
            v.batches.append((r["seq"], identify(r)[0]))
        elif r["type"] == "SourceReset":
            v.reset = v.reset or v.records == 0
        elif r["type"] == "EventsLost":
            v.lost.extend(range(r["from_seq"], r["to_seq"] + 1))
        v.records += 1
    return list(views.values())


def check_invariants(
    records: list[dict[str, Any]], engine: ScriptedEngine, *, held_cap_exceeded: bool = False
) -> list[EpochView]:
    """Assert I1-I4 of design.md over one stream's records; returns its epochs. ``held_cap_exceeded``:
    live batches past ``replay.max_held_batches`` may be announced lost (I4 relaxed)."""
    __tracebackhide__ = True
    problems: list[str] = []
    covered: dict[int, int] = {}  # per epoch: the highest seq its records reached so far
    for n, r in enumerate(records):
        epoch, kind = r["epoch"], r["type"]
        if covered and epoch < max(covered):
            problems.append(f"I3: line {n}: epoch {epoch} after epoch {max(covered)}")
        if kind == "SourceReset":
            if epoch in covered:
                problems.append(f"I3: line {n}: SourceReset of epoch {epoch} is not its first record")
            covered.setdefault(epoch, -1)
            continue
        lo, hi = (r["from_seq"], r["to_seq"]) if kind == "EventsLost" else (r["seq"], r["seq"])
        if lo <= covered.get(epoch, -1):
            problems.append(f"I2: line {n}: epoch {epoch}: {kind} {lo}..{hi} after seq {covered[epoch]}")
        covered[epoch] = max(hi, covered.get(epoch, -1))
        if "events" in r:
            inst, seq = identify(r)
            truth = engine.instances[inst] if inst < len(engine.instances) else None
            if truth is None or seq != r["seq"] or seq >= len(truth.payloads) or r["ts"] != truth.ts(seq):
                problems.append(f"I2: line {n}: (epoch {epoch}, seq {r['seq']}) carries i{inst}'s seq {seq}")
    views = epochs(records)
    owner: dict[int, list[EpochView]] = {}
    for k, v in enumerate(views):
        if k and not v.reset:
            problems.append(f"I3: epoch {v.epoch} is not opened by a SourceReset")
        if len(v.instances) != 1:
            problems.append(f"I1: epoch {v.epoch} holds {len(v.instances)} instances: {v}")
        for i in v.instances:
            owner.setdefault(i, []).append(v)
    for inst in engine.instances:
        mine = owner.get(inst.number, [])
        if len(mine) > 1:
            problems.append(f"I1: i{inst.number} spread over epochs {[v.epoch for v in mine]}")
        if not mine:
            if inst.payloads:
                problems.append(f"I3: i{inst.number} published {_spans(list(range(len(inst.payloads))))}, no epoch holds any")
            continue
        v = mine[0]
        got = Counter(s for s, i in v.batches if i == inst.number) + Counter(v.lost)
        published = range(len(inst.payloads))
        for what, seqs in [
            ("neither delivered nor announced lost", [s for s in published if got[s] == 0]),
            ("delivered or announced lost more than once", [s for s in published if got[s] > 1]),
            ("announced lost but never published", sorted({s for s in v.lost if s >= len(inst.payloads)})),
        ]:
            if seqs:
                problems.append(f"I3: i{inst.number} (epoch {v.epoch}): {_spans(seqs)} {what}")
        received_lost = sorted(inst.live & set(v.lost))
        if received_lost and not held_cap_exceeded:
            problems.append(f"I4: i{inst.number} (epoch {v.epoch}): {_spans(received_lost)} reached the bridge, announced lost")
    order = [min(v.instances) for v in views if v.instances]
    if order != sorted(order):
        problems.append(f"I1: epochs hold instances out of order: {order}")
    assert not problems, "\n".join(problems) + "\noutput: " + " | ".join(map(str, views))
    return views
