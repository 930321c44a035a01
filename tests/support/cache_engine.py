"""A scripted engine that publishes a plausible cache history and keeps its true cache state.

:class:`CacheEngine` is a :class:`~tests.support.scripted_engine.ScriptedEngine` (real XPUB and
ROUTER sockets, restarts on the same ports, a replay buffer of ``buffer_steps`` batches, live
messages that can be kept off PUB) whose batches carry chosen events in vLLM 0.33's bytes: new
blocks stored (GPU), copies of held blocks stored again (vLLM does not de-duplicate: counts of 2
and more) or offloaded (medium CPU), one ``BlockRemoved`` per physical copy, and clears. It applies
each event to the current instance's true cache, a multiset of (hash, medium): what a consumer's
index must hold for the stream, whatever the bridge and the broker did in between.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from bridge.simulator import encode_batch
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

    def __init__(self, live_port: int, replay_port: int, *, seed: int, buffer_steps: int = 10_000) -> None:
        super().__init__(live_port, replay_port, buffer_steps=buffer_steps)
        self.rand = random.Random(seed)
        self.caches: list[Counter[Copy]] = []  # per instance: its true cache (index: instance number)
        self.last_events = 0  # events in the last batch published
        self.parent: int | None = None

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
