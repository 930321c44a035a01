"""Engine snapshots (experimental): the engine's whole cache at an exact seq, to seed a stream's state.

Three open upstream designs (docs/protocol.md section 4; none merged, so each is followed as its
pull request describes it, and each may change before it lands):

- ``vllm-57789``: a snapshot socket of its own (REP/ROUTER, ``snapshot_endpoint``, port + rank)
  answers the single frame ``b"snapshot"`` with ``[cut int64 BE, uuid(16), chunk1..chunkN]``:
  each chunk an ordinary batch payload; cut -1 is an empty cache, <= -2 unavailable; the UUID
  is the live publisher's (a snapshot of another instance is refused).
- ``vllm-50134``: ``b"snapshot"`` sent to the existing replay ROUTER; the snapshot comes back as
  ordinary replay replies (topic, seq, payload) closed by the end marker, ``AllBlocksCleared``
  first, parents before children; every reply's seq frame is the resume point (the next live
  seq), so the cut is that seq - 1. An engine without the design reads the 8 bytes
  ``b"snapshot"`` as a start seq far past its buffer and sends the end marker alone: refused
  as ``unsupported``.
- ``sglang-34407``: a snapshot socket per DP rank (``snapshot_endpoint``, base port + rank) whose
  reply is ``[header, chunk1..chunkN]``, the header a msgpack map naming ``epoch``,
  ``barrier_seq`` (the last seq the chunks reflect: the cut) and ``resume_seq`` (the next live
  seq, above the barrier).

``auto`` tells the two snapshot-socket designs apart by their reply's first frame (8 bytes then a
16-byte UUID, or a msgpack map), and uses the replay socket when there is no snapshot socket.

The pure part (:func:`parse_reply`, :func:`snapshot_events`, :class:`Seeding`) has no sockets and
no clock; :class:`SnapshotClient` is the thin async shell: one fresh DEALER per snapshot, at most
``max_concurrent`` per process (waiting for a slot counts against the timeout), every frame
counted against ``max_bytes``.

Seeding. A snapshot in flight for a stream is a :class:`Seeding`: from the moment it is asked
for, the batches handed to the sinks are kept (up to ``max_bytes``); once the snapshot is read,
the first batch above its cut carries the seed (``Record.seed``, a ``StateSeeded`` record): the
snapshot's events, then those of the batches kept between the cut and that batch (the live
stream went on while the engine answered). The state tracker applies them as one clear before the
batch's own events, so the state is complete at that batch, and the sinks tell consumers with the
``StateSeeded`` record. A loss or a restart of the stream above the cut, or a span that cannot be
applied, abandons the seed: the state stays incomplete, as without snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, Protocol

import msgspec
import zmq
import zmq.asyncio

from . import wire
from .errors import BridgeError, DecodeError
from .records import Event, Record, Stream

log = logging.getLogger("bridge.snapshot")

Design = Literal["vllm-57789", "vllm-50134", "sglang-34407"]
DESIGNS: tuple[Design, ...] = ("vllm-57789", "vllm-50134", "sglang-34407")
REQUEST = b"snapshot"
"""The request of every design: one frame (a DEALER sends the ROUTER's empty delimiter first)."""
EMPTY_CUT = -1
"""vLLM #57789's cut of an empty cache (nothing published yet)."""

REASONS = (
    "unavailable",
    "unsupported",
    "timeout",
    "busy",
    "too_large",
    "bad_reply",
    "undecodable",
    "other_instance",
    "overtaken",
    "stale",
    "unverifiable",
    "error",
)
"""Why a snapshot was refused (the ``reason`` label of ``kv_bridge_snapshots_total``)."""


class SnapshotRefused(BridgeError):
    """No usable snapshot: ``reason`` is one of :data:`REASONS`; the stream's state stays incomplete."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


class Snapshot(msgspec.Struct, frozen=True):
    """A snapshot as read: the engine's cache after seq ``cut`` as batch payloads (``payloads``)."""

    design: Design
    cut: int
    payloads: list[bytes]
    instance: bytes | None = None  # the publisher UUID (vllm-57789)
    epoch: int | None = None  # the engine's own epoch (sglang-34407)
    size: int = 0  # bytes of every frame read


class _SglangHeader(msgspec.Struct):
    epoch: int
    barrier_seq: int
    resume_seq: int


_header = msgspec.msgpack.Decoder(_SglangHeader)


def detect(frames: Sequence[bytes]) -> Design:
    """The snapshot-socket design a reply (after the delimiter) follows; raises SnapshotRefused."""
    if len(frames) >= 2 and len(frames[0]) == wire.SEQ_BYTES and len(frames[1]) == wire.INSTANCE_BYTES:
        return "vllm-57789"
    if frames and frames[0][:1] and (0x80 <= frames[0][0] <= 0x8F or frames[0][0] in (0xDE, 0xDF)):
        return "sglang-34407"
    raise SnapshotRefused("bad_reply", f"a reply of {len(frames)} frames that follows no snapshot design")


def parse_reply(design: Design | Literal["auto"], frames: Sequence[bytes]) -> Snapshot:
    """The snapshot in one snapshot-socket reply (its frames after the empty delimiter)."""
    if design == "auto":
        design = detect(frames)
    size = sum(len(f) for f in frames)
    if design == "vllm-57789":
        if len(frames) < 2 or len(frames[0]) != wire.SEQ_BYTES or len(frames[1]) != wire.INSTANCE_BYTES:
            sizes = [len(f) for f in frames]
            raise SnapshotRefused("bad_reply", f"vllm-57789 reply is [cut(8), uuid(16), chunks...], got frames of {sizes} bytes")
        cut = int.from_bytes(frames[0], "big", signed=True)
        if cut <= -2:
            raise SnapshotRefused("unavailable", f"the engine answered cut {cut}: no snapshot now")
        return Snapshot(design, cut, [bytes(f) for f in frames[2:]], instance=bytes(frames[1]), size=size)
    if design == "sglang-34407":
        if not frames:
            raise SnapshotRefused("bad_reply", "sglang-34407 reply without its header")
        try:
            head = _header.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SnapshotRefused("bad_reply", f"sglang-34407 header: {exc}") from None
        if head.barrier_seq < -1 or head.resume_seq <= head.barrier_seq:
            raise SnapshotRefused(
                "unavailable" if head.barrier_seq < -1 else "bad_reply",
                f"barrier_seq {head.barrier_seq}, resume_seq {head.resume_seq}: the live stream must resume above the barrier",
            )
        return Snapshot(design, head.barrier_seq, [bytes(f) for f in frames[1:]], epoch=head.epoch, size=size)
    raise SnapshotRefused("bad_reply", f"{design} is not served on a snapshot socket")


def replay_socket_snapshot(replies: Sequence[wire.ReplayReply], size: int) -> Snapshot:
    """The snapshot in the replies of a vllm-50134 request (end marker excluded)."""
    if not replies:
        raise SnapshotRefused("unsupported", "the replay socket answered b'snapshot' with the end marker alone (no vLLM #50134)")
    resume = replies[0].seq
    if any(r.seq != resume for r in replies):
        raise SnapshotRefused("bad_reply", "vllm-50134 replies must all carry the resume point as their seq")
    try:
        first = wire.decode_batch(replies[0].payload).events if replies[0].payload else []
    except DecodeError as exc:
        raise SnapshotRefused("undecodable", f"vllm-50134 first reply: {exc}") from None
    if not first or first[0].get("type") != "AllBlocksCleared":
        raise SnapshotRefused("unsupported", "the replay socket's answer does not start with AllBlocksCleared: not a snapshot")
    if len(replies) > 1:
        # The replies carry no count or index, and a ROUTER past its high-water mark drops some
        # silently while the end marker still comes: a snapshot of more than one reply may lack
        # blocks nobody can tell are missing, and a state seeded from it would be complete in name only (I6).
        raise SnapshotRefused(
            "unverifiable", f"{len(replies)} replies without a count: one dropped on the way could not be noticed"
        )
    return Snapshot("vllm-50134", resume - 1, [r.payload for r in replies], instance=replies[0].instance, size=size)


def snapshot_events(snapshot: Snapshot) -> list[Event]:
    """Every event of the snapshot's chunks, in order; raises SnapshotRefused when one cannot be
    decoded (a state seeded from part of a cache would claim blocks complete that are not)."""
    events: list[Event] = []
    for i, payload in enumerate(snapshot.payloads):
        try:
            batch = wire.decode_batch(payload)
        except DecodeError as exc:
            raise SnapshotRefused("undecodable", f"chunk {i}: {exc}") from None
        if batch.bad_events:
            raise SnapshotRefused("undecodable", f"chunk {i}: event {batch.bad_events[0].index}: {batch.bad_events[0].reason}")
        events.extend(batch.events)
    return events


class Seeding:
    """A snapshot in flight for one stream, from the request to the batch that carries its seed.

    Pure. ``epoch``/``instance``: the stream's when it was asked for. The caller passes every
    record it hands on (:meth:`note`) and, once read, the snapshot (:meth:`ready`); :meth:`note`
    returns the seed record to attach to a batch (``Record.seed``), or raises SnapshotRefused
    when the seed can no longer make the state complete.
    """

    def __init__(self, epoch: int, instance: bytes | None, max_bytes: int, handed: int = -1) -> None:
        self.epoch = epoch
        self.instance = instance
        # The highest seq handed on when it was asked for: published before the request, so a cut
        # below it is an older cache than the state's (a lagging or cached snapshot).
        self.handed = handed
        self.max_bytes = max_bytes
        self.kept: list[Record] = []  # batches handed since the request (above the cut, once known)
        self.kept_bytes = 0
        self.snapshot: Snapshot | None = None
        self.events: list[Event] | None = None
        self.lost_to = -1  # the highest to_seq of an EventsLost handed since the request
        # The live connection dropped since the request: the engine may have restarted, and a
        # snapshot without the live stream's UUID may be the new instance's (see disconnected).
        self.tainted = False
        self.certain = False  # the snapshot carries the live stream's own publisher UUID

    def ready(self, snapshot: Snapshot, events: list[Event], instance: bytes | None) -> None:
        """The snapshot was read; ``instance``: the stream's publisher UUID now (if known)."""
        instance = instance if instance is not None else self.instance
        if snapshot.instance is not None and instance is not None and snapshot.instance != instance:
            raise SnapshotRefused("other_instance", "the snapshot's publisher UUID is not the live stream's")
        self.certain = snapshot.instance is not None and snapshot.instance == instance
        self._check_tainted()
        if snapshot.cut < self.handed:
            raise SnapshotRefused("stale", f"cut {snapshot.cut} is below seq {self.handed}, handed on before it was asked for")
        if self.lost_to > snapshot.cut:
            raise SnapshotRefused("overtaken", f"seqs up to {self.lost_to} were lost after the cut {snapshot.cut}")
        self.snapshot, self.events = snapshot, events
        self.kept = [r for r in self.kept if r.seq > snapshot.cut]  # (the snapshot holds the rest)
        self.kept_bytes = sum(len(r.payload) for r in self.kept)

    def note(self, record: Record) -> Record | None:
        """``record`` is about to be handed on: the StateSeeded record to attach to it, if it is the
        batch that carries the seed."""
        if record.epoch != self.epoch:
            raise SnapshotRefused("overtaken", f"the stream opened epoch {record.epoch} before the snapshot was seeded")
        snap = self.snapshot
        if record.kind != "batch":
            if record.kind == "EventsLost":
                self.lost_to = max(self.lost_to, record.seq)
                if snap is not None and record.seq > snap.cut:
                    raise SnapshotRefused("overtaken", f"seqs {record.from_seq}-{record.seq} were lost after the cut {snap.cut}")
            return None
        if snap is None or record.seq <= snap.cut:
            if snap is None:
                self._keep(record)
            return None
        assert self.events is not None
        self._check_tainted()
        events = list(self.events)
        for r in self.kept:
            if (r.n_events and not r.events) or r.bad_events:
                raise SnapshotRefused("undecodable", f"batch {r.seq} between the cut and the seed was not decoded")
            events.extend(r.events)
        return seeded(record, snap, events)

    def disconnected(self) -> None:
        """The stream's live connection dropped while this seeding was under way."""
        self.tainted = True

    def _check_tainted(self) -> None:
        if self.tainted and not self.certain:
            raise SnapshotRefused(
                "other_instance",
                "the live connection dropped while the snapshot was read: the engine may have restarted, and the "
                "snapshot carries no publisher UUID that says whose it is",
            )

    def _keep(self, record: Record) -> None:
        self.kept.append(record)
        self.kept_bytes += len(record.payload)
        if self.kept_bytes > self.max_bytes:
            raise SnapshotRefused(
                "too_large",
                f"more than {self.max_bytes} bytes of batches came while the snapshot was read (raise snapshots.max_bytes)",
            )


def seeded(batch: Record, snapshot: Snapshot, events: list[Event]) -> Record:
    """The ``StateSeeded`` record that goes out with ``batch`` (see the module docstring)."""
    return Record(
        stream=batch.stream,
        epoch=batch.epoch,
        seq=batch.seq,
        kind="StateSeeded",
        ts=batch.ts,
        events=events,
        from_seq=snapshot.cut,
        reason=snapshot.design,
        received=batch.received,
    )


# -- the client (I/O) ---------------------------------------------------------------------------------


class SnapshotClient:
    """Snapshots for every stream of a bridge: one ZMQ context, at most ``max_concurrent`` at once."""

    def __init__(self, ctx: zmq.asyncio.Context, *, max_concurrent: int, timeout: float, max_bytes: int) -> None:
        self.ctx = ctx
        self.slots = asyncio.Semaphore(max_concurrent)
        self.timeout = timeout
        self.max_bytes = max_bytes

    async def take(self, endpoint: str, design: Design | Literal["auto"]) -> Snapshot:
        """One snapshot from ``endpoint``; raises SnapshotRefused (``timeout`` past the bound,
        ``busy`` when no slot came free within it)."""
        deadline = time.monotonic() + self.timeout
        try:
            async with asyncio.timeout(self.timeout):
                await self.slots.acquire()
        except TimeoutError:
            raise SnapshotRefused("busy", f"no snapshot slot within {self.timeout:g}s (snapshots.max_concurrent)") from None
        try:
            return await request(self.ctx, endpoint, design, deadline - time.monotonic(), self.max_bytes)
        finally:
            self.slots.release()


async def request(
    ctx: zmq.asyncio.Context, endpoint: str, design: Design | Literal["auto"], timeout: float, max_bytes: int
) -> Snapshot:
    """Ask ``endpoint`` for a snapshot and read it whole within ``timeout`` and ``max_bytes``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max(1, max_bytes))  # a larger reply drops the connection: then silence
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", REQUEST])
        async with asyncio.timeout(max(0.001, timeout)):
            if design == "vllm-50134":
                return await _read_replies(sock, max_bytes)
            frames = await sock.recv_multipart()
    except TimeoutError:
        raise SnapshotRefused("timeout", f"{endpoint} sent no whole snapshot within {timeout:.3g}s (snapshots.timeout)") from None
    except zmq.ZMQError as exc:
        raise SnapshotRefused("error", f"{endpoint}: {exc}") from None
    finally:
        sock.close(linger=0)
    if frames[:1] == [b""]:
        frames = frames[1:]
    size = sum(len(f) for f in frames)
    if size > max_bytes:
        raise SnapshotRefused("too_large", f"{size} bytes, above snapshots.max_bytes {max_bytes}")
    return parse_reply(design, frames)


async def _read_replies(sock: zmq.asyncio.Socket, max_bytes: int) -> Snapshot:
    replies: list[wire.ReplayReply] = []
    size = 0
    while True:
        frames = await sock.recv_multipart()
        size += sum(len(f) for f in frames)
        if size > max_bytes:
            raise SnapshotRefused("too_large", f"above snapshots.max_bytes {max_bytes}")
        try:
            reply = wire.parse_replay(frames)
        except DecodeError as exc:
            raise SnapshotRefused("bad_reply", str(exc)) from None
        if reply.end:
            return replay_socket_snapshot(replies, size)
        replies.append(reply)


# -- one stream's snapshots (the shell around Seeding) ------------------------------------------------


class Heads(Protocol):
    """Where a stream's state head is read (:class:`bridge.state.StateTracker`)."""

    def head(self, stream: Stream) -> Any: ...


class StreamSnapshots:
    """When one stream asks for a snapshot, and the :class:`Seeding` in flight.

    The stream's pipeline calls :meth:`before` with each record it is about to hand to the sinks
    while ``seeding`` is set (it may attach the seed), and :meth:`after` with the record it
    handed while ``check`` is set: a state left incomplete (the stream met mid-epoch, or an
    ``EventsLost``) asks for a snapshot, unless one is in flight or was refused less than
    ``retry_interval`` ago. Refusals are logged with their fix and counted
    (``kv_bridge_snapshots_total{outcome=<reason>}``); the state then stays incomplete."""

    def __init__(
        self,
        stream: Stream,
        endpoint: str,
        design: Design | Literal["auto"],
        client: SnapshotClient,
        heads: Heads,
        count: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
        position: Callable[[], tuple[int, bytes | None, bool]],
        retry_interval: float,
    ) -> None:
        self.stream = stream
        self.endpoint = endpoint
        self.design = design
        self.client = client
        self.heads = heads
        self.count = count
        self.spawn = spawn
        self.position = position  # the stream's (epoch, publisher UUID, continuity in doubt) now
        self.retry_interval = retry_interval
        self.seeding: Seeding | None = None
        self.check = True  # look at the state after the next record handed on
        self._task: asyncio.Task[None] | None = None
        self._not_before = 0.0  # monotonic: no new request before (after a refusal)

    def before(self, record: Record) -> None:
        if record.kind != "batch":
            self.check = True  # (a loss or a reset: look at the state once it is handed on)
        seeding = self.seeding
        if seeding is None:
            return
        try:
            seed = seeding.note(record)
        except SnapshotRefused as exc:
            self._refused(exc)
            return
        if seed is not None:
            record.seed = seed
            self.seeding = None
            self.count("seeded")
            log.info(
                "state seeded from an engine snapshot",
                extra={
                    "stream": self.stream.key,
                    "epoch": record.epoch,
                    "seq": record.seq,
                    "cut": seed.from_seq,
                    "design": seed.reason,
                    "events": len(seed.events),
                },
            )

    def after(self, record: Record) -> None:
        if not self.check:
            return
        if self.seeding is not None or time.monotonic() < self._not_before:
            self.check = record.kind != "batch"  # (a loss or a reset since: look again after the next batch)
            return
        head = self.heads.head(self.stream)
        if head is None or head.complete or not head.tracking:
            self.check = record.kind != "batch"
            return
        epoch, instance, in_doubt = self.position()
        if in_doubt or epoch != record.epoch:
            # Whose would the snapshot be? Asked once the instance is verified, or once the new
            # epoch the sequencer opened meanwhile is handed on: after a later record.
            return
        self.check = False
        handed = record.seq if record.kind != "SourceReset" else -1  # (a reset's seq 0 is not yet published)
        self.seeding = Seeding(epoch, instance, self.client.max_bytes, handed)
        self._task = self.spawn(self._take(self.seeding), f"snapshot:{self.stream.key}")

    async def _take(self, seeding: Seeding) -> None:
        try:
            snapshot = await self.client.take(self.endpoint, self.design)
            events = snapshot_events(snapshot)
            if self.seeding is seeding:
                seeding.ready(snapshot, events, self.position()[1])
        except SnapshotRefused as exc:
            if self.seeding is seeding:
                self._refused(exc)
        except Exception as exc:  # (a snapshot never stops the bridge: refused, the state stays incomplete)
            if self.seeding is seeding:
                self._refused(SnapshotRefused("error", f"{type(exc).__name__}: {exc}"))

    def _refused(self, exc: SnapshotRefused) -> None:
        self.seeding = None
        self.count(exc.reason)
        log.warning(
            "engine snapshot refused: the state stays incomplete",
            extra={
                "stream": self.stream.key,
                "endpoint": self.endpoint,
                "reason": exc.reason,
                "error": exc.detail,
                "fix": FIXES.get(exc.reason, ""),
            },
        )
        if self.retry_interval > 0 and exc.reason != "overtaken":  # (after a loss: asked again at once)
            wait = self.retry_interval * random.uniform(0.5, 1.5)
            self._not_before = time.monotonic() + wait
            self.spawn(self._retry_later(wait), f"snapshot-retry:{self.stream.key}")

    async def _retry_later(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self.check = True

    def disconnected(self) -> None:
        """The stream's live connection dropped (see Seeding.disconnected)."""
        if self.seeding is not None:
            self.seeding.disconnected()

    def stop(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()


FIXES = {
    "unavailable": "the engine has no snapshot now; it is asked again after snapshots.retry_interval",
    "unsupported": "the engine does not serve this snapshot design: set the source's snapshot to the engine's design, or off",
    "timeout": "raise snapshots.timeout, or check that snapshot_endpoint is the engine's snapshot socket",
    "busy": "raise snapshots.max_concurrent, or snapshots.timeout",
    "too_large": "raise snapshots.max_bytes (and ingest.max_frame_bytes) above the engine's snapshot",
    "bad_reply": "the endpoint answers, but not with a snapshot: check snapshot_endpoint and the source's snapshot design",
    "undecodable": "the snapshot's chunks are not engine batches this bridge decodes: see the dead letters of the stream",
    "other_instance": "the engine restarted during the snapshot; the new epoch starts complete, or is asked again",
    "overtaken": "batches were lost or the engine restarted while the snapshot was read; it is asked again after the loss",
    "stale": "the engine answered with a cache older than what the bridge had read: check that it snapshots at the request",
    "unverifiable": "vllm-50134 replies carry no count: only a snapshot of one reply is used (a smaller cache, or vllm-57789)",
    "error": "check that snapshot_endpoint is reachable",
}
"""What to do about each refusal reason (said in the log line)."""
