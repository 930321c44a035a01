"""The checkpoint: per stream, the epoch and the highest seq every sink has acknowledged.

Saved atomically (write to a temp file, fsync, rename, fsync the directory) as JSON::

    {"version": 1,
     "streams": {"llama-a/0": {"epoch": 1013402, "seq": 1041, "ts": 1732870000.25, "crc": 3735928559}},
     "epochs": {"llama-a/0": 1013402},
     "opened": {},
     "instances": {"llama-a/0": {"epoch": 1013402, "id": "5f5f5f5f5f5f5f5f5f5f5f5f5f5f5f5f"}},
     "ended": {"llama-a/0": {"epoch": 1013380, "seq": 977}},
     "published": {"llama-a/0": {"epoch": 1013402, "seq": 1050}},
     "stored": {"llama-a/0": {"redis": [1013402, 1051, 18446744073709551615, 2285210148]}},
     "owed": {},
     "state_sinks": ["redis"]}

``ts`` and ``crc`` fingerprint the batch at ``seq`` (engine ts, CRC-32 of its payload): on resume
the replay's copy of that seq must match, or the engine restarted while the bridge was away.
``epochs`` holds the highest epoch each stream ever opened, saved before that epoch's first
record reaches a sink, so a restarted bridge never opens it again. ``ended`` holds where the
epoch before the newest one ended (the last seq acknowledged in it): a state sink found behind at
start in that epoch lost its tail too, announced up to there. ``state_sinks`` names the sinks that
kept state when it was saved: one of them found holding nothing of a stream at the next start lost
what it held. ``published`` holds the highest seq the bridge saw the instance of a stream's
newest epoch publish (live, replayed or claimed by a heartbeat), past what every sink
acknowledged: a bridge that crashed and finds at its next start that the engine restarted
meanwhile announces the seqs between as lost in that epoch, rather than nothing (I3). ``owed``
keeps the epoch before's top when a restart opened a newer one while what every sink acknowledged
was still below it in that epoch (a drop sink's dropped tail, a stalled sink's queue): a next run
that resumes in the newer epoch announces the seqs between in the older one first.
``stored`` holds, per stream and sink, a mark of what the sink was seen to store, for a
connector that can tell (``stored_through``, see bridge.connector; integers only that connector
reads: Redis the positions of the stream key's last entry and of each earlier epoch's last one,
Kafka the last seq of each epoch in the stream's partition and its end offset, NATS the last seq
of each epoch and the events stream's last sequence and creation time): the next run has the
sink check that it still holds it, so a loss while no bridge ran (a key, topic or stream
deleted, a restart from an older snapshot) is announced (I6).
``instances`` holds, for a stream whose publisher sends its lifetime UUID (vLLM #57789), the UUID
of its instance in its newest epoch, known for certain, and those of the instances before it: a
stream resumed in that epoch knows its instance at the first message, with or without a replay
endpoint. A corrupt or
unreadable file, or one of a later release (a roll back), is reported by the caller and kept aside
as ``FILE.unusable``, and the bridge starts fresh; it never crashes on it.

Epoch numbers. A stream met for the first time opens epoch :func:`clock_epoch` (the wall clock
in microseconds since 1970), and every later epoch is above the previous one, the saved one and
the clock's (a restart's: the engine's clock at the batch that showed it, see
:meth:`Checkpointer.next_epoch`). So a bridge that starts without its checkpoint (a new pod, a lost volume, a stale
backup of the file) opens an epoch above every epoch a previous run opened for the stream, as
long as the clocks of the two hosts agree to within the time between that run's last restart of
the stream and this start (seconds at the least: a pod has to stop and another to start). Epochs
stay below 2**53, exact in every JSON reader, until the year 2255. Checkpoints of earlier
releases hold minutes since 2025-01-01 (about 1,000,000); the next epoch such a stream opens is
the clock's, far above them.

Handover (``checkpoint.from_sinks``). A pod that takes over a stream without its previous owner's
file asks each sink for the last message it holds of it (:class:`SinkPosition`); :func:`combine`
turns those and the file's position into where the stream resumes (the lowest position a sink
needs, never before the file's) and, per sink, what it skips (everything at or below what it
holds), and :meth:`Checkpointer.adopt` takes the result: the stream goes on in the epoch the sinks
hold, and any epoch it opens later is above every epoch a sink holds. The last batch a sink holds
fingerprints the engine instance as a checkpoint's ``ts``/``crc`` do.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import re
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from .backoff import Backoff
from .errors import BridgeError
from .formats import CONTENT_TYPES
from .records import Record
from .wire import count_batch

log = logging.getLogger("bridge.checkpoint")

FORGET_MARGIN = 3600.0
"""Seconds a forgotten stream's epoch number is kept after the clock passed it."""
RESTART_QUANTUM = 60.0
"""Seconds a restart's epoch is rounded down to (see :meth:`Checkpointer.next_epoch`)."""
ENGINE_CLOCK_TRUSTED = 300.0
"""Seconds an engine ts may be behind the bridge's clock and still number a restart's epoch."""
ENGINE_CLOCK_AHEAD = 1.0
"""Seconds an engine ts may be ahead of the bridge's clock and still number a restart's epoch."""


def clock_epoch(now: float) -> int:
    """The smallest epoch a stream may open at wall-clock time ``now``: microseconds since 1970
    (see the module docstring)."""
    return max(0, int(now * 1_000_000))


class StreamPosition(msgspec.Struct, frozen=True, omit_defaults=True):
    """Epoch, highest seq every sink acknowledged (delivered or announced lost), and the
    fingerprint (engine ts, CRC-32 of the payload) of the last batch delivered in that epoch, at
    seq ``at`` (omitted: ``seq``; None, None: no batch of the epoch delivered yet)."""

    epoch: int
    seq: int
    ts: float | None = None
    crc: int | None = None
    at: int | None = None
    # The batch at ``seq`` holds no event: a sink at event granularity got no message of it (its
    # last message is the batch before's; see Bridge._behind_at_start).
    empty: bool = False


_INSTANCE_ID = "[0-9a-f]{32}"
InstanceId = Annotated[str, msgspec.Meta(pattern=f"^{_INSTANCE_ID}$")]
"""A publisher lifetime UUID, in lower-case hex (in the file, and in the ``instance`` header)."""

VERSION = 1
"""The checkpoint format this release writes and reads; a file of a later one is not read."""

RETIRED_KEPT = 16
"""UUIDs of instances gone a checkpoint keeps per stream (their late messages are dropped)."""


class Instances(msgspec.Struct, frozen=True, omit_defaults=True):
    """The publisher UUID of a stream's instance in ``epoch`` and those of instances gone, oldest first."""

    epoch: int
    id: InstanceId
    retired: list[InstanceId] = msgspec.field(default_factory=list)


class CheckpointFile(msgspec.Struct):
    version: int = VERSION
    streams: dict[str, StreamPosition] = msgspec.field(default_factory=dict)
    epochs: dict[str, int] = msgspec.field(default_factory=dict)
    opened: dict[str, StreamPosition] = msgspec.field(default_factory=dict)
    instances: dict[str, Instances] = msgspec.field(default_factory=dict)
    ended: dict[str, StreamPosition] = msgspec.field(default_factory=dict)
    state_sinks: list[str] = msgspec.field(default_factory=list)  # (none in a file of an earlier release)
    published: dict[str, StreamPosition] = msgspec.field(default_factory=dict)  # (likewise)
    stored: dict[str, dict[str, tuple[int, ...]]] = msgspec.field(default_factory=dict)  # (likewise)
    owed: dict[str, StreamPosition] = msgspec.field(default_factory=dict)  # (likewise)


class CheckpointError(BridgeError):
    """The checkpoint file exists but cannot be used."""


def load(path: str | Path) -> CheckpointFile:
    """The saved checkpoint; empty when the file does not exist; CheckpointError when unusable."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return CheckpointFile()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {p}: cannot read ({exc.strerror or exc})") from exc
    try:
        loaded = msgspec.json.decode(data, type=CheckpointFile)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"checkpoint {p}: corrupt ({exc})") from exc
    if loaded.version > VERSION:
        # A later release's fields may mean something else: guessing could resume a stream at a
        # wrong position. Roll forward again, or start afresh (safe, see the epoch numbers above).
        raise CheckpointError(
            f"checkpoint {p}: written by a later release (format version {loaded.version}; this release reads "
            f"version {VERSION} and earlier); run that release again, or move the file away to start afresh"
        )
    return loaded


def save(path: str | Path, checkpoint: CheckpointFile) -> None:
    """Write atomically: a crash leaves either the old or the new file, never a torn one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = CheckpointFile(
        streams=dict(sorted(checkpoint.streams.items())),
        epochs=dict(sorted(checkpoint.epochs.items())),
        opened=dict(sorted(checkpoint.opened.items())),
        instances=dict(sorted(checkpoint.instances.items())),
        ended=dict(sorted(checkpoint.ended.items())),
        state_sinks=list(checkpoint.state_sinks),
        published=dict(sorted(checkpoint.published.items())),
        stored={k: dict(sorted(v.items())) for k, v in sorted(checkpoint.stored.items())},
        owed=dict(sorted(checkpoint.owed.items())),
    )
    data = msgspec.json.encode(checkpoint)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# epoch, seq, and the last batch delivered in that epoch: its seq, ts and payload (fingerprinted when saved)
_Acked = tuple[int, int, int, float | None, bytes | None]


class Checkpointer:
    """Tracks, per stream and sink, the last record acknowledged; the checkpoint is their minimum.

    Also numbers epochs (:meth:`next_epoch`) and writes snapshots so that a slow write finishing
    late never replaces a newer one (:meth:`write`).
    """

    def __init__(self, sinks: int, loaded: CheckpointFile | None = None) -> None:
        self.sinks = sinks
        self.loaded: dict[str, StreamPosition] = dict(loaded.streams) if loaded else {}
        self.epochs: dict[str, int] = dict(loaded.epochs) if loaded else {}
        # Per stream, the first batch delivered in its newest epoch (saved before it reaches a
        # sink): a bridge that crashed before its epoch's position was saved resumes there.
        self.opened: dict[str, StreamPosition] = dict(loaded.opened) if loaded else {}
        self.instances: dict[str, Instances] = dict(loaded.instances) if loaded else {}
        # Per stream, the epoch before its newest one and the last seq acknowledged in it.
        self.ended: dict[str, StreamPosition] = dict(loaded.ended) if loaded else {}
        # Per stream, the highest seq its newest epoch's instance was seen to publish (note_published).
        self.published: dict[str, StreamPosition] = dict(loaded.published) if loaded else {}
        # Per stream, an earlier epoch's published top while what every sink acknowledged is still
        # in that epoch, below it (note_published, owed_at_start).
        self.owed: dict[str, StreamPosition] = dict(loaded.owed) if loaded else {}
        # Per stream and sink name, the mark of what the sink was seen to store (note_stored).
        self.stored: dict[str, dict[str, tuple[int, ...]]] = {k: dict(v) for k, v in loaded.stored.items()} if loaded else {}
        # The state sinks of the run that saved the file (none named by an earlier release), and of this run.
        self.held_state: list[str] = list(loaded.state_sinks) if loaded else []
        self.state_sinks: list[str] = []
        self._forgotten: set[str] = set()  # keys whose epoch numbers are kept until the clock passes them
        # Streams about to start afresh of which a sink could not tell what it holds (adopt): it
        # may hold an earlier epoch's records, so the new epoch is announced (needs_reset).
        self._unsure: set[str] = set()
        self._acked: dict[str, list[_Acked | None]] = {}
        self._generation = 0  # of the state; a snapshot carries the one it was taken at
        self._written = 0
        self._write_lock = threading.Lock()

    # -- acknowledgements -------------------------------------------------------------------------
    def on_ack(self, sink: int, records: list[Record]) -> None:
        """``sink`` acknowledged ``records`` (a write's, in order)."""
        # A batch followed by the next batch of its stream is replaced by it: of a run of one
        # stream's batches (what a write mostly holds) only the last is noted.
        for r, nxt in itertools.pairwise(records):
            if nxt.stream is not r.stream or r.kind != "batch" or nxt.kind != "batch":
                self._ack(sink, r)
        if records:
            self._ack(sink, records[-1])
        self._generation += 1

    def _ack(self, sink: int, r: Record) -> None:
        key = r.stream.key
        row = self._acked.get(key)
        if row is None:
            base = self.loaded.get(key)
            init: _Acked | None = None
            if base is not None:
                init = (base.epoch, base.seq, base.seq if base.at is None else base.at, base.ts, None)
            row = self._acked[key] = [init] * self.sinks
        if r.kind == "SourceReset":
            last = row[sink]
            ended = self.ended.get(key)
            if last is not None and last[0] < r.epoch and last[1] >= 0 and (ended is None or ended.epoch <= last[0]):
                # (every sink acknowledges the old epoch's end before its reset: the same for each;
                # a slower sink's older reset does not move it back)
                self.ended[key] = StreamPosition(last[0], last[1])
            row[sink] = (r.epoch, -1, -1, None, None)
        elif r.kind == "batch":
            row[sink] = (r.epoch, r.seq, r.seq, r.ts, r.payload)
        else:  # a loss: the anchor stays at the batch before it
            last = row[sink]
            same_epoch = last is not None and last[0] == r.epoch
            row[sink] = (r.epoch, r.seq, *last[2:]) if last is not None and same_epoch else (r.epoch, r.seq, -1, None, None)

    def position(self, key: str) -> StreamPosition | None:
        """The checkpoint position of one stream (None: nothing known)."""
        row = self._acked.get(key) or []
        if not row or any(p is None for p in row):  # a sink that acknowledged nothing of it yet
            return self.loaded.get(key)
        epoch, seq, at, ts, payload = min((p for p in row if p is not None), key=lambda p: (p[0], p[1]))
        if at < 0:
            return StreamPosition(epoch, seq)
        empty = False
        if payload is None:
            base = self.loaded.get(key)  # a position carried over from the file keeps its fingerprint
            same = base is not None and base.epoch == epoch and (base.seq if base.at is None else base.at) == at
            crc = base.crc if base is not None and same else None
            empty = base is not None and same and base.empty and base.seq == seq
        else:
            crc = zlib.crc32(payload)
            if at == seq:
                counted = count_batch(payload)
                empty = counted is not None and not counted.types
        return StreamPosition(epoch, seq, ts, crc, None if at == seq else at, empty)

    def resume_position(self, key: str) -> StreamPosition | None:
        """Where a stream starts at start-up: its position; or, when an epoch was opened after it
        (a crash before that epoch's position was saved; or its ``SourceReset`` was, and none of
        its batches), just before that epoch's first batch,
        with the batch's fingerprint at ``at`` (= ``seq + 1``): a replay that brings that very
        batch shows the same instance, and the batch is delivered again (no sink is known to have
        it); None (fresh, in a new epoch) when an epoch was opened after it but no batch of it is
        known."""
        pos = self.position(key)
        first = self.opened.get(key)
        if first is not None and (
            pos is None
            or first.epoch > pos.epoch
            # The position is the epoch's SourceReset alone, below its first batch, and no later
            # epoch was opened: that batch's fingerprint is all a replay can verify the instance by.
            or (first.epoch == pos.epoch and first.seq > pos.seq and self.epochs.get(key, pos.epoch) <= pos.epoch)
        ):
            return StreamPosition(first.epoch, first.seq - 1, first.ts, first.crc, first.seq)
        if pos is not None and self.epochs.get(key, pos.epoch) > pos.epoch:
            return None
        return pos

    def needs_reset(self, key: str) -> bool:
        """Must a stream starting now announce its epoch with a ``SourceReset``? Yes when a sink
        may hold records of it from an earlier run and no ``SourceReset`` of the epoch it is about
        to run in is known acknowledged: it resumes in an epoch opened after its position, or
        starts afresh after it, or never had a position acknowledged, or starts afresh where a sink
        could not tell what it holds (see :meth:`adopt`)."""
        pos = self.position(key)
        if pos is None:
            return key in self.epochs or key in self.opened or key in self._unsure
        first = self.opened.get(key)
        return (first is not None and first.epoch > pos.epoch) or self.epochs.get(key, pos.epoch) > pos.epoch

    def adopt(self, key: str, handover: Handover, unsure: bool = False) -> None:
        """Take what the sinks hold for a stream (see :func:`combine`) as its position: it resumes
        from ``handover.resume``, and any epoch it opens is above every epoch a sink holds. Only
        for a stream not started yet in this process (its position then is what was loaded).
        ``unsure``: a sink could not tell what it holds of the stream, or something else the sinks
        hold says it was written (a state head); started afresh, its new epoch is then announced
        by a ``SourceReset`` (:meth:`needs_reset`): the sink may hold an earlier epoch's records,
        the engine's replay buffer among them, and the consumers must drop what they built."""
        resume = handover.resume
        if resume is not None and resume == self.resume_position(key) and (handover.epoch or -1) <= resume.epoch:
            # The sinks hold no more than the file says: the file's state stands as it is (an epoch
            # it opened after its position is still to be announced, see needs_reset). A sink
            # holding a later epoch than that (another pod ran the stream since) makes it fresh.
            return
        if handover.resume is None:
            self.loaded.pop(key, None)
            self.opened.pop(key, None)
            if unsure:
                self._unsure.add(key)
        else:
            self.loaded[key] = handover.resume
            first = self.opened.get(key)
            if first is not None and first.epoch < handover.resume.epoch:
                del self.opened[key]
            known = self.instances.get(key)
            if handover.instance is not None and (known is None or known.epoch <= handover.resume.epoch):
                retired = known.retired if known is not None and known.id == handover.instance else []
                self.instances[key] = Instances(handover.resume.epoch, handover.instance, retired)
        if handover.epoch is not None and handover.epoch > self.epochs.get(key, -1):
            self.epochs[key] = handover.epoch
        self._acked.pop(key, None)
        self._generation += 1

    def note_first(self, key: str, record: Record) -> bool:
        """Record ``record`` as the first batch of its epoch if it is; True: save before it goes out."""
        first = self.opened.get(key)
        if first is not None and first.epoch >= record.epoch:
            return False
        self.opened[key] = StreamPosition(record.epoch, record.seq, record.ts, zlib.crc32(record.payload))
        self._generation += 1
        return True

    def note_instance(self, key: str, epoch: int, instance: bytes, retired: Sequence[bytes]) -> None:
        """``instance`` is, for certain, the publisher UUID of the stream's engine in ``epoch``;
        ``retired``: those of instances gone, oldest first (see ``StreamSequencer.sure_instance``)."""
        known = self.instances.get(key)
        if known is not None and (known.epoch > epoch or (known.epoch == epoch and known.id == instance.hex())):
            return  # (an older epoch's, or what it holds already: the UUIDs retired change with the instance)
        self.instances[key] = Instances(epoch, instance.hex(), [r.hex() for r in retired[-RETIRED_KEPT:]])
        self._generation += 1

    def note_published(self, key: str, epoch: int, seq: int) -> None:
        """The instance of ``key``'s epoch ``epoch`` was seen to publish up to ``seq`` (see
        ``published`` in the module docstring)."""
        known = self.published.get(key)
        if seq < 0 or (known is not None and (known.epoch, known.seq) >= (epoch, seq)):
            return
        if known is not None and known.epoch < epoch:
            # The epoch before ends: what its instance published past what every sink acknowledged
            # is owed to them still (a drop sink's dropped tail, a stalled sink's queue). A next
            # run that resumes in the new epoch announces it (owed_at_start, breaker119 4).
            acked = self.position(key)
            if acked is None or (acked.epoch == known.epoch and acked.seq < known.seq):
                self.owed[key] = known  # (None: a sink acknowledged nothing of the stream, breaker121 1)
        self.published[key] = StreamPosition(epoch, seq)
        self._generation += 1

    def owed_at_start(self, key: str, resume: StreamPosition | None) -> tuple[int, int, int] | None:
        """(epoch, from_seq, to_seq): what an earlier epoch's instance published that no sink is
        known to have, when the stream resumes in a later epoch (its batches will never come
        again: announced lost before that epoch's first record); None: nothing owed."""
        owed = self.owed.get(key)
        if owed is None:
            return None
        acked = self.position(key)
        ended = self.ended.get(key)
        if (acked is not None and (acked.epoch != owed.epoch or acked.seq >= owed.seq)) or (
            # A sink took the next epoch already: told of the older one now, it would go back an
            # epoch (breaker121 2). A sink behind it keeps its hole then (docs/concepts/limits.md).
            ended is not None and ended.epoch >= owed.epoch
        ):
            self.owed.pop(key, None)
            return None
        if resume is not None and resume.epoch <= owed.epoch:
            return None  # (resumed in that very epoch: the published top settles it, published_top)
        return owed.epoch, acked.seq + 1 if acked is not None else 0, owed.seq

    def note_stored(self, key: str, sink: str, position: tuple[int, ...]) -> None:
        """Sink ``sink`` was seen to store ``key``'s messages up to the mark ``position`` (see
        ``stored`` in the module docstring; a lower one than before after the sink lost some)."""
        known = self.stored.setdefault(key, {})
        if known.get(sink) == position:
            return
        known[sink] = position
        self._generation += 1

    def forget_stored(self, key: str, sink: str) -> None:
        """What sink ``sink`` stored of ``key`` is no longer known (it lost it, or the mark was not
        its own): no mark of it is saved."""
        known = self.stored.get(key)
        if known is not None and known.pop(sink, None) is not None:
            self._generation += 1
            if not known:
                del self.stored[key]

    def stored_through(self, key: str, sink: str) -> tuple[int, ...] | None:
        """The mark of the last message of ``key`` sink ``sink`` was seen to store, if known."""
        return self.stored.get(key, {}).get(sink)

    def published_top(self, key: str, epoch: int) -> int | None:
        """The highest seq the instance of ``key``'s epoch ``epoch`` was seen to publish by an
        earlier run, if the checkpoint knows it for that very epoch."""
        known = self.published.get(key)
        if known is not None and known.epoch == epoch:
            return known.seq
        owed = self.owed.get(key)
        return owed.seq if owed is not None and owed.epoch == epoch else None

    def resume_instance(self, key: str, epoch: int) -> tuple[bytes | None, list[bytes]]:
        """The publisher UUID of the stream's instance in ``epoch`` and those of instances gone,
        if the checkpoint knows them for that very epoch (else None, []: it is verified anew)."""
        known = self.instances.get(key)
        if known is None or known.epoch != epoch:
            return None, []
        return bytes.fromhex(known.id), [bytes.fromhex(r) for r in known.retired]

    def forget(self, key: str, now: float) -> None:
        """Drop everything known of a stream (a source gone for good). Its epoch number is kept
        while the clock has not passed it, so that the stream, met again, opens a higher one."""
        self._acked.pop(key, None)
        self.loaded.pop(key, None)
        self.opened.pop(key, None)
        self.instances.pop(key, None)
        self.ended.pop(key, None)
        self.published.pop(key, None)
        self.owed.pop(key, None)
        self.stored.pop(key, None)
        self._unsure.discard(key)
        self._forgotten.add(key)
        self.prune(now)

    def prune(self, now: float) -> None:
        """Drop the epoch numbers of forgotten streams that the clock passed ``FORGET_MARGIN`` ago
        (kept that long so that a clock stepped back by less still opens above them)."""
        for key in [k for k in self._forgotten if self.epochs.get(k, -1) < clock_epoch(now - FORGET_MARGIN)]:
            self.epochs.pop(key, None)
            self._forgotten.discard(key)
        self._generation += 1

    # -- epochs -----------------------------------------------------------------------------------
    def first_epoch(self, key: str, now: float) -> int:
        """The epoch of a stream met without a position (see the module docstring)."""
        return self._open(key, clock_epoch(now))

    def next_epoch(self, key: str, epoch: int, now: float, shown_at: float | None = None) -> int:
        """The epoch after ``epoch`` for a restarted engine. Its clock reading is the engine ts of
        what showed the restart (``shown_at``), down to its whole minute (``RESTART_QUANTUM``): two
        pods that read the engine at once (a rolling update) see the restart through the same
        batch, or through batches of the same minute, and open the same epoch, so their copies
        stay copies (unless the minute turned between the batches each saw first). A pod without
        a checkpoint still opens above it: its first epoch is its clock in microseconds. Only when
        that ts is at most ``ENGINE_CLOCK_TRUSTED`` behind ``now`` and at most
        ``ENGINE_CLOCK_AHEAD`` ahead (an engine clock ahead of the bridge's would put the epoch
        above the one a new pod without a checkpoint opens later, from its own clock); else (no
        batch showed it: a heartbeat under a new UUID) ``now``, down to its minute too, so that
        pods still agree within the minute."""
        trusted = shown_at is not None and -ENGINE_CLOCK_TRUSTED <= shown_at - now <= ENGINE_CLOCK_AHEAD
        at = shown_at if trusted and shown_at is not None else now
        return self._open(key, max(epoch + 1, clock_epoch(math.floor(at / RESTART_QUANTUM) * RESTART_QUANTUM)))

    def _open(self, key: str, epoch: int) -> int:
        self._forgotten.discard(key)
        epoch = max(epoch, self.epochs.get(key, -1) + 1)
        self.epochs[key] = epoch
        self._generation += 1
        return epoch

    # -- saving -----------------------------------------------------------------------------------
    def snapshot(self) -> tuple[int, CheckpointFile]:
        """The checkpoint as it stands (taken on the event loop), with its generation."""
        streams = dict(self.loaded)
        for key in self._acked:
            pos = self.position(key)
            if pos is not None:
                streams[key] = pos
        return self._generation, CheckpointFile(
            streams=streams,
            epochs=dict(self.epochs),
            opened=dict(self.opened),
            instances=dict(self.instances),
            ended=dict(self.ended),
            state_sinks=list(self.state_sinks),
            published=dict(self.published),
            stored={k: dict(v) for k, v in self.stored.items()},
            owed=dict(self.owed),
        )

    def write(self, path: str | Path, generation: int, checkpoint: CheckpointFile) -> bool:
        """Save a snapshot unless a newer one was saved already (a slow write that finishes late,
        e.g. in a thread after the final save at shutdown, must not replace it). Thread-safe."""
        with self._write_lock:
            if generation < self._written:
                return False
            save(path, checkpoint)
            self._written = generation
            return True

    @property
    def generation(self) -> int:
        """Changes with every acknowledgement and every epoch opened."""
        return self._generation

    @property
    def written(self) -> int:
        """The generation of the snapshot last saved."""
        return self._written


PERSIST_MAX_DELAY = 5.0
_PERSIST_BACKOFF = Backoff(0.2, PERSIST_MAX_DELAY)


class EpochUnsaved(Exception):
    """The bridge stops while the epochs a stream opened cannot be saved: what the stream decided
    of them is not handed to any sink (the next start reads it again from the last save's
    position; records of an unsaved epoch out there would let it number another engine instance
    the same)."""


class CheckpointStore:
    """The checkpoint of a running bridge: a :class:`Checkpointer` and the file it is saved to
    (``path`` None: nothing saved, every stream starts fresh). Saves are snapshotted on the event
    loop (the state changes only there) and written in a thread, one at a time; callers waiting
    for a save share the next one."""

    def __init__(self, path: str | None, sinks: int) -> None:
        self.path = path
        self.checkpointer = Checkpointer(sinks, self._load())
        self._lock = asyncio.Lock()
        # The last save's failure (None: it succeeded, or none was tried), and the wall-clock time
        # of the last good one (None: none since start). Called (in the saving thread) after each
        # save: with its time, or None when it failed (the metrics).
        self.error: str | None = None
        self.saved_at: float | None = None
        self.on_save: Callable[[float | None], None] = lambda at: None
        # Called on the loop before each save: notes what the running streams know and the
        # checkpointer is not told as it happens (their instances' UUIDs, see note_instance).
        self.collect: Callable[[], None] = lambda: None
        # Set as the bridge stops: persist tries once more and gives up (see persist).
        self.stopping = False

    def _load(self) -> CheckpointFile:
        if not self.path:
            return CheckpointFile()
        try:
            loaded = load(self.path)
        except CheckpointError as exc:
            # Kept aside rather than overwritten by the first save: a later release's file is its
            # own again after a roll forward, and a corrupt one is there to look at.
            kept = f"{self.path}.unusable"
            try:
                os.replace(self.path, kept)
            except OSError:
                kept = "(not kept: cannot rename it)"
            log.error("checkpoint unusable, starting fresh", extra={"error": str(exc), "kept_as": kept})
            return CheckpointFile()
        if loaded.streams:
            log.info("resuming from checkpoint", extra={"path": self.path, "streams": len(loaded.streams)})
        return loaded

    # -- the epochs a pipeline opens (see StreamPipeline) ----------------------------------------
    def next_epoch(self, key: str, epoch: int, now: float, shown_at: float | None = None) -> int:
        return self.checkpointer.next_epoch(key, epoch, now, shown_at)

    def note_first(self, key: str, record: Record) -> bool:
        return self.checkpointer.note_first(key, record)

    async def persist(self) -> None:
        """Return once the epochs opened so far are saved (at once without a file). A save that
        fails is tried again (backoff up to PERSIST_MAX_DELAY), for as long as it takes: an epoch's
        first record reaches no sink before the epoch is saved, else a restart from the file could
        open that epoch again for another engine instance, whose batches consumers would then drop
        as copies. Meanwhile the bridge is not ready, naming the file and the fix.

        Once the bridge stops (``stopping``), one try more and no other: :class:`EpochUnsaved` if
        it fails."""
        if not self.path:
            return
        needed = self.checkpointer.generation
        async with self._lock:
            for attempt in itertools.count(1):
                if self.checkpointer.written >= needed:
                    return
                if attempt > 1 and self.stopping:
                    raise EpochUnsaved(f"checkpoint.path: cannot save {self.path} ({self.error})")
                if attempt > 1:
                    await asyncio.sleep(_PERSIST_BACKOFF.delay(attempt - 1))
                await self._save()

    # -- saving ------------------------------------------------------------------------------------
    async def save(self) -> None:
        async with self._lock:
            await self._save()

    async def _save(self) -> None:
        assert self.path
        self.collect()
        await asyncio.to_thread(self._write, *self.checkpointer.snapshot())  # snapshot on the loop

    def save_now(self) -> None:
        """Save from the event loop itself (at shutdown: a save still writing in its thread
        cannot replace this one, see :meth:`Checkpointer.write`)."""
        if self.path:
            self.collect()
            self._write(*self.checkpointer.snapshot())

    def _write(self, generation: int, snapshot: CheckpointFile) -> None:
        assert self.path
        try:
            self.checkpointer.write(self.path, generation, snapshot)
        except OSError as exc:
            self.error = exc.strerror or str(exc)
            self.on_save(None)
            log.error("cannot save the checkpoint", extra={"path": self.path, "error": str(exc)})
        else:
            self.error, self.saved_at = None, time.time()
            self.on_save(self.saved_at)

    @property
    def problem(self) -> str | None:
        """Why the checkpoint is not being saved now (None: it is, or there is none), for /readyz:
        a restart would resume from the last save, as far back as that is."""
        if self.error is None:
            return None
        last = "none since start" if self.saved_at is None else f"the last one {time.time() - self.saved_at:.0f}s ago"
        return (
            f"checkpoint.path: cannot save {self.path} ({self.error}); a restart would resume from the last save "
            f"({last}): free space on its volume, or fix its permissions"
        )

    async def run(self, interval: float) -> None:
        """Save every ``interval`` seconds, for ever."""
        while True:
            await asyncio.sleep(interval)
            await self.save()


# -- handover: the position a sink holds ----------------------------------------------------------

_HEX_ID = re.compile(_INSTANCE_ID)

MAX_SUB = (1 << 64) - 1
"""The last sub-position of a slot: a whole batch (every event of it), or an ``EventsLost``."""

SinkRecordKind = Literal["batch", "SourceReset", "EventsLost"]


class SinkPosition(msgspec.Struct, frozen=True, omit_defaults=True):
    """The last message of one stream a sink holds (what a connector's ``positions()`` answers).

    ``index``: the event's index at event granularity (None: the message holds the whole batch, or
    is a control record); the batch may then be there only in part, up to that event. ``ts``: the
    engine's timestamp of that batch; ``crc``: CRC-32 of the engine's payload when the sink holds
    the bytes (``format: raw``), else None. Both fingerprint the batch, so that a restart of the
    engine that kept counting on from this seq is still seen (see :class:`StreamPosition`).
    ``instance``: the batch's publisher UUID in hex, when the bridge that wrote it knew it for
    certain (the ``instance`` header), else None."""

    epoch: int
    seq: int
    kind: SinkRecordKind = "batch"
    index: int | None = None
    ts: float | None = None
    crc: int | None = None
    instance: str | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str | bytes], payload: bytes | None = None) -> SinkPosition:
        """The position of a message from its stream header (Kafka / NATS headers, Redis entry
        fields) and its body (the engine's payload when the header says ``raw``: its CRC-32 is kept;
        ignored otherwise). ValueError when the header is not
        one the bridge writes."""

        def text(name: str) -> str | None:
            value = headers.get(name)
            return value.decode() if isinstance(value, bytes) else value

        epoch, seq, type_ = text("epoch"), text("seq"), text("type")
        if epoch is None or seq is None or type_ is None:
            raise ValueError("not a bridge message: no epoch, seq or type header")
        index_text, ts_text = text("index"), text("ts")
        # A control record has no index; an event message's type is the engine's (which may be
        # named anything, "SourceReset" too), and the message is a batch's.
        control = index_text is None and type_ in ("SourceReset", "EventsLost")
        kind: SinkRecordKind = type_ if control else "batch"  # type: ignore[assignment]
        ts = float(ts_text) if ts_text else None
        raw = kind == "batch" and index_text is None and text("content-type") == CONTENT_TYPES["raw"]
        crc = zlib.crc32(payload) if payload is not None and raw else None
        instance = text("instance")
        if instance is not None and not _HEX_ID.fullmatch(instance):
            raise ValueError(f"not a bridge message: instance header {instance[:40]!r} is not a UUID in hex")
        # The last message of its batch (header ``last``): the batch is held whole, as one that
        # holds a whole-batch message.
        index = int(index_text) if index_text and text("last") != "1" else None
        return cls(int(epoch), int(seq), kind, index, ts, crc, instance if kind == "batch" else None)

    @property
    def fingerprinted(self) -> bool:
        """Whether this is a batch with a fingerprint (a finite ts, or a CRC) to verify an engine
        instance with; a control record, or a batch without either, has none."""
        finite = self.ts is not None and math.isfinite(self.ts)
        return self.kind == "batch" and (finite or self.crc is not None)

    def held_through(self) -> tuple[int, int, int]:
        """The message position (epoch, slot, sub) up to which the sink holds the stream; a message
        at or below it is one the sink has (see :meth:`bridge.formats.Message.position`)."""
        if self.kind == "SourceReset":
            return (self.epoch, 0, 0)
        if self.kind == "batch" and self.index is not None:
            return (self.epoch, self.seq + 1, self.index + 1)
        return (self.epoch, self.seq + 1, MAX_SUB)

    def holds_more_than(self, other: SinkPosition) -> bool:
        """Whether the sink holding this holds more of its stream than holding ``other`` says."""
        return (self.epoch, self.first_missing()) > (other.epoch, other.first_missing())

    def first_missing(self) -> int:
        """The first seq of its epoch this sink does not hold whole: after a batch or a loss it
        holds, at a batch it holds only in part (event granularity), 0 after a SourceReset."""
        if self.kind == "SourceReset":
            return 0
        return self.seq if self.kind == "batch" and self.index is not None else self.seq + 1

    def resume(self) -> StreamPosition:
        """Where a stream resumes for this sink to miss nothing. A batch held in part (event
        granularity: its last event message held is not the one that says ``last``) counts as not
        delivered; its fingerprint is kept at ``at`` so that the replay of it still verifies the
        engine instance (the events the sink has are skipped, see :class:`Handover`)."""
        if self.kind == "SourceReset":
            return StreamPosition(self.epoch, -1)
        if self.kind == "EventsLost":
            return StreamPosition(self.epoch, self.seq)  # the batch before the loss is not known here
        if self.index is not None:  # (held in part: its last event's message says ``last``)
            return StreamPosition(self.epoch, self.seq - 1, self.ts, self.crc, self.seq)
        return StreamPosition(self.epoch, self.seq, self.ts, self.crc)


Held = SinkPosition | None | Literal["unknown"]
"""What one sink says of one stream: its last message; None: nothing of the stream; ``"unknown"``:
the sink cannot tell (no ``positions()``, a template it cannot resolve, a failed or timed-out read)."""


def _order(p: StreamPosition) -> tuple[int, int]:
    return (p.epoch, p.seq)


def _held_through(p: StreamPosition) -> tuple[int, int, int]:
    return (p.epoch, 0, 0) if p.seq < 0 else (p.epoch, p.seq + 1, MAX_SUB)


class Handover(msgspec.Struct, frozen=True):
    """Where one stream resumes when the sinks said what they hold (see :func:`combine`).

    ``resume``: the position to resume from (None: fresh, in a new epoch); ``skip[i]``: sink i
    already holds every message at or below this position (None: nothing to skip); ``epoch``: the
    highest epoch any sink holds (a new epoch must be above it), or None; ``top``: the highest seq
    a sink holds in the resume epoch (known published by its instance: if the engine restarted
    since, the sinks below it are told those seqs are lost), or None. ``behind[i]``: (epoch, first
    seq it lacks) when sink i holds an epoch that another sink holds a later one of: that epoch
    was closed, and what sink i lacks of it will never reach it (a pod killed while its queue
    still held that epoch's tail: :class:`bridge.runtime.SkipHeld` announces it), else None.
    ``instance``: the publisher UUID (hex) of the resume epoch's instance, when the batches the
    sinks hold of that epoch name one and no two disagree, else None."""

    resume: StreamPosition | None
    skip: list[tuple[int, int, int] | None]
    epoch: int | None
    top: int | None = None
    behind: list[tuple[int, int] | None] = msgspec.field(default_factory=list)
    instance: str | None = None


def combine(local: StreamPosition | None, held: Sequence[Held], acked: StreamPosition | None = None) -> Handover:
    """The rule for resuming one stream from the local checkpoint ``local`` and what each sink holds.

    Per sink, the position it needs the stream from: the later of ``local`` (every sink
    acknowledged it) and what it says it holds; ``local`` alone when it holds nothing or cannot
    tell (nothing at all without a local checkpoint: fresh start). The stream resumes from the
    lowest of those, so no sink misses anything, never before ``local`` unless a sink holds less
    than ``acked`` (it lost what it acknowledged: I6; the engine's replay buffer gives it back, or
    the gap is announced lost as usual). A sink that holds more
    skips, once, every message at or below what it holds: no duplicates even for a sink that
    cannot drop them itself (Kafka). Positions compare by (epoch, seq): epochs grow along a stream.

    A resume in a sink's epoch must be able to tell the engine instance: its last record must be a
    batch with a fingerprint, or another sink must hold one of that epoch at or below the resume
    point (+1, delivered again). A sink whose last record is a control record (a ``SourceReset``
    right before a crash; an ``EventsLost``), with no such batch elsewhere, cannot anchor a resume:
    it counts as unknown for where the stream resumes (the checkpoint file's position, or afresh
    in a new epoch), while it still skips what it holds. ``acked``: what every sink is known to
    have acknowledged (default ``local``; lower when ``local`` is the first batch of an epoch opened
    after it, whose ``SourceReset`` no sink is known to hold).
    """
    acked = local if acked is None else acked
    anchors = [h for h in held if isinstance(h, SinkPosition) and h.fingerprinted]
    needs: list[StreamPosition | None] = []
    skip: list[tuple[int, int, int] | None] = []
    epochs: list[int] = []
    acked_through = _held_through(acked) if acked is not None else None
    for h in held:
        own: StreamPosition | None
        through: tuple[int, int, int] | None
        lost = False
        if isinstance(h, SinkPosition):
            epochs.append(h.epoch)
            own = _own_need(h, anchors)
            # Below what every sink acknowledged: the sink lost it (a broker restarted from an older
            # snapshot, I6). It needs the stream from what it still holds, and skips only that.
            lost = acked_through is not None and own is not None and h.held_through() < acked_through
            through = h.held_through() if acked_through is None or lost else max(h.held_through(), acked_through)
        else:
            own, through = None, acked_through
        skip.append(through)
        needs.append(own if own is not None and (local is None or lost or _order(own) > _order(local)) else local)
    resume: StreamPosition | None
    if not needs or any(n is None for n in needs):
        resume = None if needs else local
    else:
        resume = min((n for n in needs if n is not None), key=_order)
    tops = [h.seq for h in held if isinstance(h, SinkPosition) and resume is not None and h.epoch == resume.epoch and h.seq >= 0]
    latest = max(epochs) if epochs else None
    behind = [
        (h.epoch, h.first_missing()) if isinstance(h, SinkPosition) and latest is not None and h.epoch < latest else None
        for h in held
    ]
    named = {h.instance for h in held if isinstance(h, SinkPosition) and resume is not None and h.epoch == resume.epoch}
    named.discard(None)
    instance = named.pop() if len(named) == 1 else None
    return Handover(resume, skip, latest, max(tops) if tops else None, behind, instance)


def resumes_from(h: SinkPosition, held: Sequence[Held]) -> bool:
    """Whether :func:`combine` can resume the stream from what this sink holds (``held``: what every
    sink holds of it): its last record is a batch with a fingerprint, or another sink holds one of
    its epoch at or right after it. What it lacks then comes again from the engine's buffer."""
    return _own_need(h, [a for a in held if isinstance(a, SinkPosition) and a.fingerprinted]) is not None


def _own_need(h: SinkPosition, anchors: Sequence[SinkPosition]) -> StreamPosition | None:
    """Where one sink needs its stream from, with a fingerprint to verify the instance; None when
    no batch of its epoch anchors it (see :func:`combine`)."""
    if h.fingerprinted:
        return h.resume()
    need = h.resume()
    # A batch another sink holds in this epoch at or below the point (or right after it, which
    # is then delivered again) verifies the instance; the highest such.
    fits = [a for a in anchors if a.epoch == need.epoch and a.seq <= need.seq + 1]
    if not fits:
        return None
    a = max(fits, key=lambda a: a.seq)
    return StreamPosition(need.epoch, need.seq, a.ts, a.crc, None if a.seq == need.seq else a.seq)
