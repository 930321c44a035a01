"""A scripted engine that publishes a plausible cache history and keeps its true cache state.

:class:`CacheEngine` is a :class:`~tests.support.scripted_engine.ScriptedEngine` (real XPUB and
ROUTER sockets, restarts on the same ports, a replay buffer of ``buffer_steps`` batches, live
messages that can be kept off PUB) whose batches carry chosen events in vLLM 0.33's bytes: new
blocks stored (GPU), copies of held blocks stored again (vLLM does not de-duplicate: counts of 2
and more) or offloaded (medium CPU), one ``BlockRemoved`` per physical copy, and clears. It applies
each event to the current instance's true cache, a multiset of (hash, medium): what a consumer's
index must hold for the stream, whatever the bridge and the broker did in between.

With ``snapshot`` set it serves engine snapshots of that true cache (experimental designs, see
:mod:`bridge.snapshot`): on a snapshot ROUTER of its own (``snapshot_port``) or on the replay
socket (``vllm-50134``). A snapshot is taken when asked for (its cut: the last seq published
then) and sent when ``snapshot_gate`` (if set) opens, so a test can publish meanwhile; or it is
refused (``refuse_snapshots``: the unavailable answer of each design).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import zmq
import zmq.asyncio

from bridge.simulator import EngineCache, SnapshotDesign, encode_batch, snapshot_reply
from bridge.snapshot import REQUEST as SNAPSHOT_REQUEST
from bridge.wire import END_SEQ
from tests.support.scripted_engine import PROFILE, ScriptedEngine

Event = dict[str, Any]
Copy = tuple[int, str]  # (block hash, medium)


def event(kind: str, **values: Any) -> Event:
    """An event with vLLM 0.33's fields in declaration order (unset optional fields left out)."""
    out: Event = {"type": kind}
    for name in PROFILE.fields[kind]:
        value = values.get(name)
        if value is None and name in PROFILE.omit_none:
            continue
        out[name] = value
    return out


class CacheEngine(ScriptedEngine):
    """``async with CacheEngine(live_port, replay_port, seed=1) as engine:``; ``await engine.step(n)``."""

    def __init__(
        self,
        live_port: int,
        replay_port: int,
        *,
        seed: int,
        buffer_steps: int = 10_000,
        snapshot: SnapshotDesign = "off",
        snapshot_port: int | None = None,
    ) -> None:
        super().__init__(live_port, replay_port, buffer_steps=buffer_steps)
        self.rand = random.Random(seed)
        self.caches: list[Counter[Copy]] = []  # per instance: its true cache (index: instance number)
        self.last_events = 0  # events in the last batch published
        self.parent: int | None = None
        self.snapshot: SnapshotDesign = snapshot
        self.snapshot_port = snapshot_port
        self.snapshot_gate: asyncio.Event | None = None
        self.refuse_snapshots = False
        self.snapshot_cuts: list[int] = []  # the cut of each snapshot taken
        self.engine_cache = EngineCache()  # the current instance's, with the facts a snapshot sends
        self._snapshot_socket: zmq.asyncio.Socket | None = None
        self._snapshot_tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> CacheEngine:
        await super().__aenter__()
        return self

    @property
    def cache(self) -> Counter[Copy]:
        """The current instance's true cache: copies of each (hash, medium) it holds."""
        while len(self.caches) < len(self.instances):
            self.caches.append(Counter())  # a new instance starts empty
        return self.caches[len(self.instances) - 1]

    def blocks(self) -> set[int]:
        """The block hashes the current instance holds (on any medium)."""
        return {h for h, _ in self.cache}

    @property
    def last_seq(self) -> int:
        return len(self.current.payloads) - 1

    async def restart(self) -> None:
        """A new instance on the same ports: seq from 0, empty buffer and cache."""
        await super().restart()
        self.parent = None
        self.engine_cache = EngineCache()

    # -- snapshots --------------------------------------------------------------------------------
    async def _open(self) -> None:
        await super()._open()
        if self.snapshot in ("vllm-57789", "sglang-34407"):
            assert self.snapshot_port is not None
            self._snapshot_socket = sock = await self._bind(zmq.ROUTER, self.snapshot_port)
            self._spawn(self._serve_snapshots(sock))

    async def _close(self) -> None:
        for task in list(self._snapshot_tasks):
            task.cancel()
        if self._snapshot_socket is not None:
            self._snapshot_socket.close(linger=0)
            self._snapshot_socket = None
        await super()._close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._snapshot_tasks.add(task)
        task.add_done_callback(self._snapshot_tasks.discard)

    async def _serve_snapshots(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) == 3 and frames[2] == SNAPSHOT_REQUEST:
                self.serve_snapshot(sock, frames[0], "snapshot")

    @property
    def snapshot_uuid(self) -> bytes:
        """The UUID a vLLM #57789 snapshot carries: the live frames' (``uuid=True``), else a fixed one."""
        return self.current.uuid or bytes(16)

    def serve_snapshot(self, router: zmq.asyncio.Socket, identity: bytes, socket: str) -> bool:
        if self.snapshot == "off" or (socket == "replay") != (self.snapshot == "vllm-50134"):
            return False
        cut = self.last_seq
        if self.refuse_snapshots:
            end = END_SEQ.to_bytes(8, "big")
            unavailable = {
                "vllm-57789": [[b"", (-2).to_bytes(8, "big", signed=True), self.snapshot_uuid]],
                "vllm-50134": [[b"", b"", end, b""]],
                "sglang-34407": [[b"", b"\x83\xa5epoch\x00\xabbarrier_seq\xfe\xaaresume_seq\x00"]],
            }
            messages = unavailable[self.snapshot]
        else:
            self.snapshot_cuts.append(cut)
            messages = snapshot_reply(
                self.snapshot,
                PROFILE,
                self.engine_cache,
                cut=cut,
                ts=self.current.ts(max(cut, 0)),
                instance=self.snapshot_uuid,
                topic=b"",
                epoch=len(self.instances) - 1,
            )
        self._spawn(self._send_when_open(router, identity, messages))
        return True

    async def _send_when_open(self, router: zmq.asyncio.Socket, identity: bytes, messages: list[list[bytes]]) -> None:
        if self.snapshot_gate is not None:
            await self.snapshot_gate.wait()
        for message in messages:
            await router.send_multipart([identity, *message])

    # -- events -----------------------------------------------------------------------------------
    def _new_blocks(self) -> Event:
        hashes = [self.rand.getrandbits(64) for _ in range(2)]
        tokens = [self.rand.randrange(150_000) for _ in range(32)]
        parent, self.parent = self.parent, hashes[-1]
        return event(
            "BlockStored",
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=16,
            medium="GPU",
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def _again(self, medium: str) -> Event:
        h = self.rand.choice(sorted(self.cache))[0]  # a held block, stored once more
        return event(
            "BlockStored",
            block_hashes=[h],
            token_ids=[self.rand.randrange(150_000) for _ in range(16)],
            block_size=16,
            medium=medium,
            extra_keys=[None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def _remove(self) -> Event:
        h, medium = self.rand.choice(sorted(self.cache))  # one physical copy
        return event("BlockRemoved", block_hashes=[h], medium=medium, group_idx=0)

    def events(self, n: int) -> list[Event]:
        """``n`` events: new blocks, copies stored again (GPU) or offloaded (CPU), removals."""
        out: list[Event] = []
        for _ in range(n):
            r = self.rand.random()
            if not self.cache or r < 0.45:
                ev = self._new_blocks()
            elif r < 0.6:
                ev = self._again("GPU")
            elif r < 0.7:
                ev = self._again("CPU")
            else:
                ev = self._remove()
            self.apply(ev)
            out.append(ev)
        return out

    def apply(self, ev: Event) -> None:
        """``ev`` applied to the current instance's true cache."""
        cache = self.cache
        self.engine_cache.apply([ev])
        if ev["type"] == "AllBlocksCleared":
            cache.clear()
            self.parent = None
        for h in ev.get("block_hashes") or ():
            key = (h, ev["medium"])
            if ev["type"] == "BlockStored":
                cache[key] += 1
            else:
                assert cache[key] > 0, f"the script removes {key}, which the engine does not hold"
                cache[key] -= 1
                if not cache[key]:
                    del cache[key]

    # -- publishing -------------------------------------------------------------------------------
    async def send(self, events: list[Event], *, deliver: bool = True) -> int:
        """Publish one batch of ``events`` (already applied to the cache); returns its seq.
        ``deliver=False`` keeps it off PUB (a high-water-mark drop), in the replay buffer only."""
        self.cache  # noqa: B018 - the current instance has its cache before anything is sent
        inst = self.current
        seq = len(inst.payloads)
        payload = encode_batch(PROFILE, inst.ts(seq), events)
        inst.payloads.append(payload)
        self._buffer.append((seq, payload))
        self.last_events = len(events)
        if deliver:
            await self._poll_subscriptions()
            known = self._subscribed
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            if known:
                inst.live.add(seq)
        return seq

    async def step(self, n: int = 1, *, events_per_batch: int = 3, deliver: bool = True) -> None:
        """``n`` batches of generated events."""
        for _ in range(n):
            await self.send(self.events(events_per_batch), deliver=deliver)

    async def clear(self) -> None:
        """One batch: the engine drops its whole cache (``AllBlocksCleared``), then stores anew."""
        cleared = event("AllBlocksCleared")
        self.apply(cleared)
        await self.send([cleared, *self.events(2)])
