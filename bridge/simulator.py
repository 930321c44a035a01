"""A vLLM-compatible KV-event publisher for demos, tests and benchmarks (``python -m bridge simulate``).

Byte-compatible with the real publishers: the same ZMQ sockets (PUB ``[topic, seq, payload]``
and a ROUTER replay socket answering ``[b"", start]`` with or without the topic frame and the
``-1`` end marker), and the same msgpack bytes for each engine release (:data:`PROFILES`),
checked against the captured vectors (``tests/vectors``). It can publish several data-parallel ranks (port + rank),
at a chosen rate and batch shape, and inject faults: live messages that never reach
subscribers (still in the replay buffer, as a PUB high-water-mark drop would be), replay
replies that go missing, and engine restarts (sequence back to 0, buffer emptied).

Other producers have a profile each too (see docs/sources/producers.md): ROCm ATOM (#1316:
arrays with a trailing ``token_offset``, replay without topic, an end marker
carrying ``[oldest, latest]``), the Mooncake master (#2214: RFC 1527 maps, ms timestamps, no
replay), TensorRT-LLM (signed 64-bit hashes, coalesced blocks), vLLM #57789 (24-byte sequence
frames with the publisher's lifetime UUID, idle heartbeats) and vLLM's open optional fields.

Snapshots (experimental, :mod:`bridge.snapshot`): with ``snapshot`` set, each rank keeps its true
cache (:class:`EngineCache`) and serves it in the chosen design: vLLM #57789 and SGLang #34407 on
a snapshot socket of their own (``snapshot_endpoint``, port + rank), vLLM #50134 on the replay
socket. The snapshot is taken between two batches, so its cut is the last seq published.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from .endpoints import for_rank
from .errors import StartupError
from .records import Event
from .snapshot import REQUEST as SNAPSHOT_REQUEST
from .wire import ARRAY_FIELDS, END_SEQ, FIELDS

_enc = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Profile:
    """How one engine release encodes batches and events."""

    name: str
    events: Literal["array", "map"]
    batch: Literal["array", "map"] = "array"
    fields: dict[str, tuple[str, ...]] = field(default_factory=dict)  # declared fields per type
    omit_none: frozenset[str] = frozenset()  # map generation: fields left out when None
    with_rank: bool = True
    replay_topic: bool = False  # replay replies carry the topic frame
    hashes: Literal["int64", "uint64", "bytes"] = "uint64"
    end_window: bool = False  # the replay end marker carries msgpack [oldest, latest] (ROCm ATOM)
    rfc1527: bool = False  # RFC Mooncake #1527 map events, ts in milliseconds
    instance_id: bool = False  # 24-byte sequence frames: seq + the publisher's lifetime UUID
    blocks_per_event: int = 0  # coalesced blocks: this many per BlockStored (0: the simulator's option)


def _vllm(n_stored: int, n_removed: int) -> dict[str, tuple[str, ...]]:
    return {
        "BlockStored": FIELDS["BlockStored"][:n_stored],
        "BlockRemoved": FIELDS["BlockRemoved"][:n_removed],
        "AllBlocksCleared": (),
    }


_SGLANG_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_LATE = frozenset({"kv_cache_spec_sliding_window", "locality", "ownership", "session_id", "lookahead_token_ids"})

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile("vllm-0.9.0", "array", fields=_vllm(5, 1), with_rank=False, hashes="int64"),
        Profile("vllm-0.10.2", "array", fields=_vllm(6, 2)),
        Profile("vllm-0.22.0", "array", fields=_vllm(11, 3)),
        Profile("vllm-0.24.0", "map", fields=_vllm(11, 3), omit_none=_LATE),
        Profile("vllm-0.26.0", "map", fields=_vllm(11, 3), omit_none=_LATE, replay_topic=True),
        Profile("vllm-0.33.0", "map", fields=_vllm(15, 5), omit_none=_LATE, replay_topic=True),
        Profile("vllm-0.33.0-bytes-hashes", "map", fields=_vllm(15, 5), omit_none=_LATE, replay_topic=True, hashes="bytes"),
        Profile(
            "vllm-unreleased-map-batch",
            "map",
            batch="map",
            fields={
                "BlockStored": (*FIELDS["BlockStored"][:7], *FIELDS["BlockStored"][8:11]),
                "BlockRemoved": FIELDS["BlockRemoved"][:3],
                "AllBlocksCleared": (),
            },
            omit_none=_LATE,
            replay_topic=True,
        ),
        Profile(
            "sglang-0.5.8",
            "array",
            fields={"BlockStored": _SGLANG_STORED[:5], "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()},
            hashes="int64",
        ),
        Profile(
            "sglang-0.5.23",
            "map",
            fields={
                "BlockStored": (*_SGLANG_STORED, "cache_salt", "session_id", "lora_name"),
                "BlockRemoved": ("block_hashes", "medium"),
                "AllBlocksCleared": (),
            },
            omit_none=frozenset({"cache_salt", "session_id", "lora_name"}),
            replay_topic=True,
            hashes="int64",
        ),
    ]
}
_RFC1527_STORED = (
    "event_id", "timestamp", "event_type", "type", "model_name", "block_size", "additional_salt", "lora_name",
    "tenant_id", "backend_id", "group_id", "medium", "dp_rank", "object_key", "seq_hashes", "block_hashes",
    "base_block_idx", "parent_hash", "token_ids", "parent_block_hash",
)  # fmt: skip
_RFC1527_REMOVED = (*_RFC1527_STORED[:16], "base_block_idx")
_V33 = _vllm(15, 5)
PROFILES.update(
    (p.name, p)
    for p in [
        Profile(
            "atom-pr1316",
            "array",
            fields={
                "BlockStored": ARRAY_FIELDS["BlockStored"],
                "BlockRemoved": ARRAY_FIELDS["BlockRemoved"][:3],
                "AllBlocksCleared": ("medium",),
                "BlockTransferred": FIELDS["BlockTransferred"],
            },
            end_window=True,
        ),
        Profile(
            "mooncake-master-pr2214",
            "map",
            fields={"BlockStored": _RFC1527_STORED, "BlockRemoved": _RFC1527_REMOVED},
            rfc1527=True,
        ),
        Profile("tensorrt-llm-pr16869", "array", fields=_vllm(6, 2), hashes="int64", replay_topic=True, blocks_per_event=4),
        Profile("vllm-pr57789-uuid", "map", fields=_V33, omit_none=_LATE, replay_topic=True, instance_id=True),
        Profile(
            "vllm-open-prs",
            "map",
            fields={
                **_V33,
                "BlockStored": FIELDS["BlockStored"],
                "BlockRemoved": FIELDS["BlockRemoved"],
                "BlockInactive": FIELDS["BlockInactive"],
            },
            omit_none=_LATE | {"block_offsets", "remaining_copy_counts"},
            replay_topic=True,
        ),
    ]
)
DEFAULT_PROFILE = "vllm-0.33.0"


# -- encoding -------------------------------------------------------------------------------------


def _map_header(n: int, declared: int) -> bytes:
    # msgspec sizes a struct's map header for all its fields (+ the tag), then writes the count.
    return bytes([0x80 | n]) if declared + 1 <= 15 else b"\xde" + n.to_bytes(2, "big")


def encode_event(profile: Profile, event: Event) -> bytes:
    """One event as the release encodes it (keys / positions in the event's order)."""
    if profile.rfc1527:
        return _enc.encode(event)  # the producer's own map (see rfc1527_event)
    tag = event["type"]
    declared = profile.fields.get(tag)
    if profile.events == "array":
        names = declared if declared is not None else tuple(k for k in event if k not in ("type", "extra"))
        return _enc.encode([tag, *(event.get(n) for n in names), *event.get("extra", ())])
    parts = [_enc.encode(k) + _enc.encode(v) for k, v in event.items()]
    return _map_header(len(parts), len(declared) if declared is not None else len(parts)) + b"".join(parts)


def encode_batch(profile: Profile, ts: float, events: Sequence[Event], dp_rank: int = 0) -> bytes:
    """One batch payload, byte-identical to the release's publisher for the same events."""
    body = [msgspec.Raw(encode_event(profile, e)) for e in events]
    if profile.rfc1527:
        return _enc.encode([round(ts * 1000), body, dp_rank])  # int64 milliseconds, as the Mooncake master
    if profile.batch == "map":
        return _enc.encode({"ts": ts, "events": body, "data_parallel_rank": dp_rank})
    return _enc.encode([ts, body, dp_rank] if profile.with_rank else [ts, body])


def rfc1527_event(kind: str, seq_hash: int, *, event_id: int, ts_ms: int, medium: str, backend_id: str = "mooncake-0") -> Event:
    """One event as the Mooncake master (#2214) writes it with its defaults (legacy aliases and
    object_key on): ``kind`` is "stored" or "removed"."""
    stored = kind == "stored"
    values: dict[str, Any] = {
        "event_id": event_id,
        "timestamp": ts_ms,
        "event_type": kind,
        "type": "BlockStored" if stored else "BlockRemoved",
        "tenant_id": "default",
        "backend_id": backend_id,
        "medium": medium,
        "object_key": str(seq_hash),
        "seq_hashes": [seq_hash],
        "block_hashes": [seq_hash - 2**64 if seq_hash >= 2**63 else seq_hash],  # static_cast<int64_t>
        "base_block_idx": 0 if stored else None,
    }
    return {k: values.get(k) for k in (_RFC1527_STORED if stored else _RFC1527_REMOVED)}


# -- realistic events -------------------------------------------------------------------------------


class EventFactory:
    """Generates a plausible cache history: chained BlockStored, BlockRemoved of stored blocks, rare clears."""

    def __init__(self, profile: Profile, *, seed: int = 0, block_size: int = 16, blocks_per_event: int = 2) -> None:
        self.profile = profile
        self.rand = random.Random(seed)
        self.block_size = block_size
        self.blocks_per_event = profile.blocks_per_event or blocks_per_event
        self.event_id = 0
        self.stored: deque[Any] = deque(maxlen=4096)
        self.parent: Any = None
        self.token = 0

    def _hash(self) -> Any:
        h = self.rand.getrandbits(64)
        if self.profile.hashes == "int64":
            return h - 2**64 if h >= 2**63 else h
        if self.profile.hashes == "bytes":
            return h.to_bytes(32, "big")
        return h

    def _fill(self, tag: str, values: dict[str, Any]) -> Event:
        event: Event = {"type": tag}
        for name in self.profile.fields.get(tag, ()):
            value = values.get(name)
            if value is None and self.profile.events == "map" and name in self.profile.omit_none:
                continue
            event[name] = value
        return event

    def _rfc1527(self, kind: str, h: int) -> Event:
        self.event_id += 1
        return rfc1527_event(kind, h, event_id=self.event_id, ts_ms=round(time.time() * 1000), medium="cpu")

    def stored_event(self) -> Event:
        n = self.blocks_per_event
        hashes = [self._hash() for _ in range(n)]
        if self.profile.rfc1527:  # one block per event, the master's way
            self.stored.append(hashes[0])
            return self._rfc1527("stored", hashes[0])
        tokens = list(range(self.token, self.token + n * self.block_size))
        event = self._fill(
            "BlockStored",
            {
                "block_hashes": hashes,
                "parent_block_hash": self.parent,
                "token_ids": tokens,
                "block_size": self.block_size,
                "medium": "GPU",
                "extra_keys": [None] * n,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
                "token_offset": self.token,
                "block_offsets": list(range(n)),
            },
        )
        self.token = (self.token + n * self.block_size) % 150_000
        self.parent = hashes[-1]
        self.stored.extend(hashes)
        return event

    def removed_event(self) -> Event:
        k = min(len(self.stored), self.rand.randint(1, self.blocks_per_event))
        hashes = [self.stored.popleft() for _ in range(k)] or [self._hash()]
        if self.profile.rfc1527:
            return self._rfc1527("removed", hashes[0])
        return self._fill(
            "BlockRemoved", {"block_hashes": hashes, "medium": "GPU", "group_idx": 0, "remaining_copy_counts": [0] * len(hashes)}
        )

    def other_event(self) -> Event | None:
        """A producer's own event type, when its profile has one (ATOM's BlockTransferred, vLLM
        #50732's BlockInactive), of a block stored before; None otherwise."""
        if not self.stored:
            return None
        if "BlockTransferred" in self.profile.fields:  # swapped out: no longer on the GPU
            return self._fill("BlockTransferred", {"block_hashes": [self.stored.pop()], "from_medium": "GPU", "to_medium": "CPU"})
        h = self.stored[-1]
        if "BlockInactive" in self.profile.fields:
            return self._fill("BlockInactive", {"block_hashes": [h], "medium": "GPU", "group_idx": 0})
        return None

    def batch(self, n_events: int) -> list[Event]:
        """``n_events`` events: mostly BlockStored, about a quarter BlockRemoved, a clear per ~2000."""
        out: list[Event] = []
        for _ in range(n_events):
            r = self.rand.random()
            if r < 0.0005 and not self.profile.rfc1527:  # (the Mooncake master sends no clears)
                out.append(self._fill("AllBlocksCleared", {}))
                self.stored.clear()
                self.parent = None
            elif r < 0.25 and self.stored:
                out.append(self.removed_event())
            elif r < 0.3 and (other := self.other_event()) is not None:
                out.append(other)
            else:
                out.append(self.stored_event())
        return out


# -- the engine's cache, and its snapshots ------------------------------------------------------------

SnapshotDesign = Literal["off", "vllm-57789", "vllm-50134", "sglang-34407"]
SNAPSHOT_CHUNK_EVENTS = 256  # events per snapshot chunk (each an ordinary batch payload)


class EngineCache:
    """An engine's true cache, kept from the events it publishes: per (hash, medium, group_idx), its
    residency count and the facts of its last store (vLLM does not de-duplicate: counts above 1).
    Insertion order is kept, so a parent stored before its child comes first in a snapshot."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[Any, Any, Any]] = Counter()
        self.facts: dict[tuple[Any, Any, Any], dict[str, Any]] = {}

    def apply(self, events: Sequence[Event]) -> None:
        for ev in events:
            kind = ev.get("type")
            if kind == "AllBlocksCleared":
                self.counts.clear()
                self.facts.clear()
                continue
            if kind not in ("BlockStored", "BlockRemoved"):
                continue
            hashes = ev.get("block_hashes") or []
            medium, group = ev.get("medium"), ev.get("group_idx")
            size = ev.get("block_size")
            tokens = ev.get("token_ids") or []
            for i, h in enumerate(hashes):
                key = (h, medium, group)
                if kind == "BlockStored":
                    self.counts[key] += 1
                    own = tokens[i * size : (i + 1) * size] if isinstance(size, int) and size > 0 else []
                    parent = hashes[i - 1] if i else ev.get("parent_block_hash")
                    self.facts[key] = {"parent_block_hash": parent, "token_ids": own, "block_size": size}
                elif self.counts[key] > 0:
                    self.counts[key] -= 1
                    if not self.counts[key]:
                        del self.counts[key]
                        del self.facts[key]

    def events(self, profile: Profile) -> list[Event]:
        """The cache as ``BlockStored`` events, one block each, one per copy, parents first."""
        out: list[Event] = []
        for key, n in self.counts.items():
            h, medium, group = key
            facts = self.facts[key]
            values = {"block_hashes": [h], "medium": medium, "group_idx": group, "extra_keys": [None], **facts}
            ev = _fill(profile, "BlockStored", values)
            out.extend(ev for _ in range(n))
        return out


def _fill(profile: Profile, tag: str, values: dict[str, Any]) -> Event:
    event: Event = {"type": tag}
    for name in profile.fields.get(tag, ()):
        value = values.get(name)
        if value is None and profile.events == "map" and name in profile.omit_none:
            continue
        event[name] = value
    return event


def snapshot_chunks(profile: Profile, events: Sequence[Event], ts: float, dp_rank: int = 0) -> list[bytes]:
    """A snapshot's events as ordinary batch payloads of at most ``SNAPSHOT_CHUNK_EVENTS`` each."""
    step = SNAPSHOT_CHUNK_EVENTS
    return [encode_batch(profile, ts, events[i : i + step], dp_rank) for i in range(0, len(events), step)]


def snapshot_reply(
    design: SnapshotDesign,
    profile: Profile,
    cache: EngineCache,
    *,
    cut: int,
    ts: float,
    instance: bytes = b"",
    topic: bytes = b"",
    epoch: int = 0,
    dp_rank: int = 0,
) -> list[list[bytes]]:
    """The messages (each after the requester's identity) an engine sends for one snapshot."""
    events = cache.events(profile)
    if design == "vllm-50134":
        # Ordinary replay replies, AllBlocksCleared first, each seq frame the resume point.
        chunks = snapshot_chunks(profile, [_fill(profile, "AllBlocksCleared", {}), *events], ts, dp_rank)
        frame = (cut + 1).to_bytes(8, "big") + instance
        replies = [[b"", topic, frame, c] if profile.replay_topic else [b"", frame, c] for c in chunks]
        end = END_SEQ.to_bytes(8, "big")
        return [*replies, [b"", topic, end, b""] if profile.replay_topic else [b"", end, b""]]
    chunks = snapshot_chunks(profile, events, ts, dp_rank)
    if design == "vllm-57789":
        return [[b"", cut.to_bytes(8, "big", signed=True), instance or bytes(16), *chunks]]
    if design == "sglang-34407":
        header = _enc.encode({"epoch": epoch, "barrier_seq": cut, "resume_seq": cut + 1})
        return [[b"", header, *chunks]]
    raise ValueError(f"no snapshot design {design!r}")


# -- the publisher ----------------------------------------------------------------------------------


@dataclass
class Faults:
    drop_rate: float = 0.0  # live messages that never reach subscribers (kept for replay)
    # Replay replies (end marker included) that go missing, never the first of an answer: a
    # ROUTER's high-water mark does not drop a fresh DEALER's first message, and the bridge
    # relies on that (docs/concepts/correctness.md).
    replay_drop_rate: float = 0.0
    restart_every: int = 0  # restart the engine after this many batches (0: never)


class RankPublisher:
    """One engine rank: PUB + ROUTER, a sequence counter and the replay buffer."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        profile: Profile,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        rank: int = 0,
        topic: str = "",
        buffer_steps: int = 10_000,
        faults: Faults | None = None,
        seed: int = 0,
        bind: bool = True,
        snapshot: SnapshotDesign = "off",
        snapshot_endpoint: str | None = None,
    ) -> None:
        self.profile = profile
        self.snapshot: SnapshotDesign = snapshot
        self.cache = EngineCache()  # the true cache, kept while snapshots are served
        self.snapshots_served = 0
        self.rank = rank
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.faults = faults or Faults()
        self.rand = random.Random(seed * 7919 + rank)
        self.seq = 0
        self.published = 0
        self.dropped = 0  # live messages not sent (fault injection)
        self.restarts = 0
        self.instance = uuid.UUID(int=self.rand.getrandbits(128)).bytes if profile.instance_id else b""
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.router: zmq.asyncio.Socket | None = None
        self.snapshot_socket: zmq.asyncio.Socket | None = None
        doing = f"{'bind' if bind else 'connect'} the PUB socket to {endpoint}"
        try:
            if bind:
                self.pub.bind(endpoint)
            else:
                self.pub.connect(endpoint)
            if replay_endpoint:
                doing = f"bind the replay ROUTER socket to {replay_endpoint}"
                self.router = ctx.socket(zmq.ROUTER)
                self.router.setsockopt(zmq.LINGER, 0)
                self.router.bind(replay_endpoint)
            if snapshot in ("vllm-57789", "sglang-34407"):
                if not snapshot_endpoint:
                    raise ValueError(f"snapshot {snapshot} is served on a snapshot socket: give snapshot_endpoint")
                doing = f"bind the snapshot ROUTER socket to {snapshot_endpoint}"
                self.snapshot_socket = ctx.socket(zmq.ROUTER)
                self.snapshot_socket.setsockopt(zmq.LINGER, 0)
                self.snapshot_socket.bind(snapshot_endpoint)
        except zmq.ZMQError as exc:
            self.pub.close(linger=0)
            for sock in (self.router, self.snapshot_socket):
                if sock is not None:
                    sock.close(linger=0)
            fix = (
                "another process holds the port: stop it, or choose another port"
                if exc.errno == errno.EADDRINUSE
                else "give an endpoint such as tcp://127.0.0.1:5557"
            )
            raise StartupError(f"rank {rank}: cannot {doing} ({exc.strerror}); {fix}") from exc
        self._replay_task: asyncio.Task[None] | None = None
        self._snapshot_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.router is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name=f"sim-replay:{self.rank}")
        if self.snapshot_socket is not None:
            self._snapshot_task = asyncio.create_task(self._serve_snapshots(), name=f"sim-snapshot:{self.rank}")

    def snapshot_messages(self) -> list[list[bytes]]:
        """A snapshot of the rank's cache now, in its design (see :func:`snapshot_reply`)."""
        assert self.snapshot != "off"
        self.snapshots_served += 1
        return snapshot_reply(
            self.snapshot,
            self.profile,
            self.cache,
            cut=self.seq - 1,
            ts=time.time(),
            instance=self.instance,
            topic=self.topic,
            epoch=self.restarts,
            dp_rank=self.rank,
        )

    async def _serve_snapshots(self) -> None:
        assert self.snapshot_socket is not None
        while True:
            frames = await self.snapshot_socket.recv_multipart()
            if len(frames) != 3 or frames[2] != SNAPSHOT_REQUEST:
                continue
            for message in self.snapshot_messages():
                await self.snapshot_socket.send_multipart([frames[0], *message])

    async def publish(self, payload: bytes) -> int:
        """Publish one batch payload; returns its seq."""
        seq = self.seq
        self.seq += 1
        self.published += 1
        self.buffer.append((seq, payload))
        if self.faults.drop_rate and self.rand.random() < self.faults.drop_rate:
            self.dropped += 1
        else:
            await self.pub.send_multipart([self.topic, self.seq_frame(seq), payload])
        if self.faults.restart_every and self.seq >= self.faults.restart_every:
            self.restart()
        return seq

    def seq_frame(self, seq: int) -> bytes:
        """The sequence frame: 8 bytes, or 24 with the publisher's UUID (``instance_id`` profiles)."""
        return seq.to_bytes(8, "big") + self.instance

    async def heartbeat(self) -> None:
        """An idle heartbeat (vLLM #57789): an empty payload carrying the next seq."""
        await self.pub.send_multipart([self.topic, self.seq_frame(self.seq), b""])

    def restart(self) -> None:
        """What a restarted engine looks like on the wire: seq from 0, empty replay buffer (and a
        new lifetime UUID where the profile sends one)."""
        self.seq = 0
        self.buffer.clear()
        self.cache = EngineCache()
        self.restarts += 1
        if self.instance:
            self.instance = uuid.UUID(int=self.rand.getrandbits(128)).bytes

    def _reply(self, identity: bytes, seq: int, payload: bytes) -> list[bytes]:
        frame = END_SEQ.to_bytes(8, "big") if seq == END_SEQ else self.seq_frame(seq)
        if self.profile.replay_topic:
            return [identity, b"", self.topic, frame, payload]
        return [identity, b"", frame, payload]

    def _end(self, identity: bytes) -> list[bytes]:
        window = b""
        if self.profile.end_window:  # ROCm ATOM: [oldest, latest] of its buffer
            window = _enc.encode([self.buffer[0][0], self.buffer[-1][0]] if self.buffer else [None, None])
        return self._reply(identity, END_SEQ, window)

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            drop = self.faults.replay_drop_rate  # (read per request: a test may change the faults)
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # the engines ignore malformed requests too
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            if self.snapshot == "vllm-50134" and frames[2] == SNAPSHOT_REQUEST:
                for message in self.snapshot_messages():
                    await self.router.send_multipart([identity, *message])
                continue
            first = True
            for seq, payload in list(self.buffer):
                if seq >= start and (first or not (drop and self.rand.random() < drop)):
                    await self.router.send_multipart(self._reply(identity, seq, payload))
                    first = False
            if first or not (drop and self.rand.random() < drop):
                await self.router.send_multipart(self._end(identity))

    async def close(self) -> None:
        for task in (self._replay_task, self._snapshot_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self.pub.close(linger=0)
        for sock in (self.router, self.snapshot_socket):
            if sock is not None:
                sock.close(linger=0)


@dataclass
class SimulatorOptions:
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    profile: str = DEFAULT_PROFILE
    dp_ranks: int = 1
    topic: str = ""
    rate: float = 100.0  # batches per second per rank; 0: as fast as possible
    count: int = 0  # batches per rank, 0: forever
    events_per_batch: int = 4
    blocks_per_event: int = 2
    block_size: int = 16
    buffer_steps: int = 10_000
    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    bind: bool = True
    linger: float = 0.0  # keep serving replay this long after the last batch
    snapshot: SnapshotDesign = "off"  # serve snapshots in this design (experimental)
    snapshot_endpoint: str | None = None  # the snapshot socket of rank 0 (vllm-57789, sglang-34407)


class Simulator:
    """Several ranks of one simulated engine. ``async with Simulator(opts) as sim: await sim.run()``."""

    def __init__(self, options: SimulatorOptions, ctx: zmq.asyncio.Context | None = None) -> None:
        if options.profile not in PROFILES:
            raise ValueError(f"unknown profile {options.profile!r}; known: {', '.join(PROFILES)}")
        self.options = options
        self.profile = PROFILES[options.profile]
        if options.snapshot != "off" and (self.profile.rfc1527 or "BlockTransferred" in self.profile.fields):
            raise ValueError(f"profile {options.profile} has no snapshot design: its events move blocks between media")
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.ranks: list[RankPublisher] = []
        self.factories: list[EventFactory] = []

    async def __aenter__(self) -> Simulator:
        try:
            self._open_ranks()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    def _open_ranks(self) -> None:
        o = self.options
        for r in range(o.dp_ranks):
            pub = RankPublisher(
                self.ctx,
                self.profile,
                for_rank(o.endpoint, r),
                for_rank(o.replay_endpoint, r) if o.replay_endpoint else None,
                rank=r,
                topic=o.topic,
                buffer_steps=o.buffer_steps,
                faults=o.faults,
                seed=o.seed,
                bind=o.bind,
                snapshot=o.snapshot,
                snapshot_endpoint=for_rank(o.snapshot_endpoint, r) if o.snapshot_endpoint else None,
            )
            pub.start()
            self.ranks.append(pub)
            self.factories.append(
                EventFactory(self.profile, seed=o.seed * 31 + r, block_size=o.block_size, blocks_per_event=o.blocks_per_event)
            )

    async def __aexit__(self, *exc: object) -> None:
        for pub in self.ranks:
            await pub.close()
        if self._own_ctx:
            self.ctx.destroy(linger=0)

    async def step(self, rank: int = 0, events: Sequence[Event] | None = None, ts: float | None = None) -> int:
        """Publish one batch on ``rank`` (generated unless ``events`` given); returns its seq."""
        evs = list(events) if events is not None else self.factories[rank].batch(self.options.events_per_batch)
        payload = encode_batch(self.profile, time.time() if ts is None else ts, evs, rank)
        pub = self.ranks[rank]
        if pub.snapshot != "off":
            pub.cache.apply(evs)
        return await pub.publish(payload)

    async def run(self) -> None:
        """Publish at the configured rate until ``count`` batches per rank (forever if 0)."""
        o = self.options
        interval = 1.0 / o.rate if o.rate > 0 else 0.0
        start = time.monotonic()
        n = 0
        while o.count == 0 or n < o.count:
            for r in range(len(self.ranks)):
                await self.step(r)
            n += 1
            if interval:
                delay = start + n * interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif n % 64 == 0:
                    await asyncio.sleep(0)
            elif n % 64 == 0:
                await asyncio.sleep(0)
        if o.linger > 0:
            await asyncio.sleep(o.linger)
