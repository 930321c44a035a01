"""One stream's pipeline: frames -> sequencer -> decoder -> fan-out, plus its replays.

A :class:`StreamPipeline` is the single place where a stream's sequencer is driven. Live bursts
(from the source reader) and replay replies (from the stream's replay task) both go through
:meth:`_execute` under the stream's lock, so actions are carried out in exactly the order the
sequencer decided them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import operator
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from . import probe, wire
from .backoff import Backoff
from .config import ReplayConfig
from .deadletter import DecodeFailures
from .errors import DecodeError
from .fanout import Fanout
from .metrics import Metrics, StreamMetrics
from .records import Record, Stream, events_lost, source_reset
from .replay import ReplayClient, ReplayOutcome
from .sequencer import (
    PUBLISHER_RESTART,
    Action,
    Deliver,
    Duplicate,
    Fingerprint,
    Gap,
    Lost,
    RequestReplay,
    Reset,
    StreamSequencer,
    Suspect,
    fingerprint,
)
from .snapshot import StreamSnapshots

log = logging.getLogger("bridge.stream")

REPLAY_DIAGNOSE_EVERY = 60.0
"""At most this often (seconds) a stream asks its replay endpoint why a replay got no reply."""
REPLAY_DIAGNOSE_AGAIN = 5.0
"""As often as this (seconds) when a live batch came since the last diagnosis (its silence cleared);
and how long without a live batch a stream found unanswered must be to count as silent."""
_type_of = operator.itemgetter("type")
_MAX_TYPES = 8192  # event types gathered for the metrics before they are applied (memory bound)
UNDECODABLE_AFTER = 5
"""A stream whose last this many batches in a row failed to decode, none since, counts as not
answering usefully in readiness (one bad batch among good ones does not)."""


class Epochs(Protocol):
    """Where the epochs a stream opens are kept (:class:`bridge.checkpoint.CheckpointStore`)."""

    def next_epoch(self, key: str, epoch: int, now: float, shown_at: float | None = None) -> int: ...

    def note_first(self, key: str, record: Record) -> bool: ...

    async def persist(self) -> None: ...


@dataclass
class StreamContext:
    """What a pipeline needs from the process, and nothing more: a pipeline is built and tested
    with fakes of these, without a Bridge."""

    fanout: Fanout
    metrics: Metrics
    decode_failures: DecodeFailures
    replay: ReplayClient
    epochs: Epochs
    spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]
    replay_config: ReplayConfig
    # False when every sink forwards only the engine's bytes (format raw, and a connector that
    # says it reads nothing else): batches are then counted by event type, not decoded.
    needs_events: bool = True


class StreamPipeline:
    """Sequencing, decoding and fan-out of one (source, dp_rank)."""

    def __init__(
        self,
        ctx: StreamContext,
        stream: Stream,
        *,
        replay_endpoint: str | None,
        replay_on_start: bool,
        topic: str = "",
        epoch: int,
        delivered: int | None = None,
        delivered_fp: Fingerprint | None = None,
        anchor: int | None = None,
        known_top: int | None = None,
        announce: bool = False,
        owed: tuple[int, int, int] | None = None,
        sequencer: StreamSequencer | None = None,
        instance: bytes | None = None,
        retired: Sequence[bytes] = (),
    ) -> None:
        self.ctx = ctx
        self.stream = stream
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()  # the source's: replies under another are not this stream's
        # The source reads only other topics' messages (wrong_topic): it drops them, so the idle
        # probe must not take them from the replay socket (old engines' replies carry no topic).
        self.foreign_only = False
        self.replay_problem: str | None = None  # why the replay endpoint does not answer, once asked
        self._unanswered: float | None = None  # when the replay endpoint was found not answering at all
        self._replied_at = 0.0  # when a replay last got a reply
        self._last_live = 0.0  # when the last live burst was read
        # How far the engine's clock is behind the bridge's, as the latest burst of batches taken in
        # order showed it (received less the ts of its first: the clock offset plus the delivery
        # delay; see _engine_time). None until such a batch with a ts was read.
        self._behind: float | None = None
        self._newest: float | None = None  # the engine ts of the last batch taken in order
        self._replay_diagnosed = -REPLAY_DIAGNOSE_EVERY
        cfg = ctx.replay_config
        key = stream.key
        # ``sequencer``: the one of this stream's earlier pipeline (its source removed and added
        # again, see ``retire``), resumed with what it had read and not settled.
        self._reattached = sequencer is not None
        self.sequencer = sequencer or StreamSequencer(
            can_replay=replay_endpoint is not None,
            replay_on_start=replay_on_start,
            max_held=cfg.max_held_batches,
            max_attempts=cfg.max_attempts,
            epoch=epoch,
            delivered=delivered,
            delivered_fp=delivered_fp,
            anchor=anchor,
            known_top=known_top,
            ts_of=wire.peek_ts,
            next_epoch=lambda e, shown_at: ctx.epochs.next_epoch(key, e, time.time(), shown_at),
            instance=instance,
            retired=retired,
        )
        self._resumed_from = (epoch, delivered, delivered_fp, anchor) if delivered is not None else None
        # The first batch this pipeline hands on is noted (and saved before it goes out) if it is
        # its epoch's first (see Checkpointer.resume_position); again after every restart.
        self._first_pending = True
        self._announce = announce
        self._owed = owed  # (epoch, from_seq, to_seq) an earlier run owed the sinks (checkpoint.owed_at_start)
        self._pending: Record | None = None  # decided, being handed on (see _hand_decided)
        self._run: list[Record] = []  # decided in order, to be handed on together (see on_live)
        self._decoded: Record | None = None  # the last batch decoded (see StreamSequencer.reference)
        self._bad_run = 0  # batches in a row that failed to decode (see ``undecodable``)
        self._bad_why = ""  # why the last of them failed
        self.backoff = Backoff(cfg.initial_backoff, cfg.max_backoff)
        self.lock = asyncio.Lock()
        self._replay_task: asyncio.Task[None] | None = None
        self.last_activity = time.monotonic()
        self.metrics = StreamMetrics(ctx.metrics, stream.source, stream.dp_rank)
        # The busiest metric updates are gathered here and applied when the metrics are collected
        # (see bridge.metrics), or once _types grows past _MAX_TYPES.
        self._received = 0  # live messages read since the last flush
        self._types: list[str] = []  # the types of the events handed on since the last flush
        ctx.metrics.defer(self)
        self._shown: Record | None = None  # the decoded batch the last_seq / last_ts gauges show
        # The last record (and batch) handed to every sink, as a position to resume from: a
        # stream removed while a full sink made it wait resumes there, not where the sequencer
        # got to. _unread: the epoch and highest seq of live messages read and not sequenced (a
        # burst cut short by that removal, a drop's tail), of the instance of that epoch.
        self._handed: Record | None = None
        self._handed_batch: Record | None = None
        self._unread: tuple[int, int] = (self.sequencer.epoch, -1)
        # Engine snapshots (experimental, bridge.snapshot): set by the runtime for a source with
        # snapshot on and a sink that keeps state; sees each record as it is handed on.
        self.snapshots: StreamSnapshots | None = None

    # -- inputs ---------------------------------------------------------------------------------
    async def start(self) -> None:
        async with self.lock:
            now = time.time()
            if self._owed is not None:
                # What the instance before this epoch's published that no sink got, its restart
                # seen by the run before (a drop sink's dropped tail, a stalled sink's queue at a
                # stop): announced in its own epoch, before this one's SourceReset (I3).
                epoch, first, last = self._owed
                self._owed = None
                await self._execute([Lost(first, last, PUBLISHER_RESTART, epoch)], now, persist=False)
            if self._announce:
                # Sinks may hold records of this stream from an earlier run, and no SourceReset of
                # the epoch it runs in now is known acknowledged: announce it (again) first.
                self._announce = False
                await self._execute([Reset(self.sequencer.epoch, "bridge_restart")], now, persist=False)
            if self._reattached:
                self._reattached = False
                # Whoever answers now may be another instance.
                await self._execute(self.sequencer.disconnected(self._engine_time(now), readded=True), now)
            await self._execute(self.sequencer.start(), now)

    async def on_live(self, burst: Sequence[list[bytes]], received: float) -> None:
        """A burst of live messages drained from the SUB socket.

        The common batch (the next seq, see ``StreamSequencer.accept``) joins ``_run`` and the
        run is handed to the sinks in one call at the end of the burst, or before anything else
        the sequencer decides; everything else goes through ``live`` and ``_execute``."""
        self._received += len(burst)
        self.last_activity = self._last_live = time.monotonic()
        lags: list[float] = []  # observed per burst (ingest_lag.observe_all)
        lag = lags.append
        parse, peek_ts = wire.parse_live, wire.peek_ts
        sequencer = self.sequencer
        accept, live, decode = sequencer.accept, sequencer.live, self._decode
        needs_events, decode_batch, count_batch = self.ctx.needs_events, wire.decode_batch, wire.count_batch
        run = self._run
        oldest: float | None = None  # the engine ts of the burst's first batch taken in order (see _engine_time)
        newest: float | None = None  # and of its last
        sequenced = 0  # frames of the burst the sequencer has seen (the rest is unread if cut short)
        decided: list[Action] = []  # decided by live(), not yet taken by _execute
        try:
            async with self.lock:
                i = 0
                try:
                    for i, frames in enumerate(burst):  # noqa: B007 (i is read when cut short)
                        # wire.parse_live inline for the well-formed message (what the socket gives: bytes)
                        instance: bytes | None = None
                        if (
                            len(frames) == 3
                            and len(seq_frame := frames[1]) == wire.SEQ_BYTES
                            and seq_frame != wire.END_FRAME
                            and (payload := frames[2]).__class__ is bytes
                            and payload
                        ):
                            seq = int.from_bytes(seq_frame, "big")
                            beat = False
                        else:
                            try:
                                f = parse(frames)
                            except DecodeError as exc:
                                self.ctx.decode_failures(self.stream, exc, None, frames)
                                self._bad_run += 1  # (a message of other frames: see undecodable)
                                self._bad_why = str(exc)
                                continue
                            seq, payload, instance, beat = f.seq, f.payload, f.instance, f.heartbeat
                        if beat:  # an idle publisher's next seq (and UUID): no batch
                            actions = sequencer.heartbeat(seq, instance)
                        else:
                            # Decoded (or counted) before it is sequenced: the ts comes with it. A
                            # batch that fails here is decoded again once delivered, which reports it.
                            counted: wire.EventCount | None = None
                            batch: wire.DecodedBatch | None = None
                            ts: float | None
                            if needs_events:
                                try:
                                    batch = decode_batch(payload)
                                    ts = batch.ts
                                except DecodeError:
                                    ts = peek_ts(payload)
                            elif (counted := count_batch(payload)) is not None:
                                ts = counted.ts
                            else:
                                ts = peek_ts(payload)
                            if ts is not None:
                                lag(received - ts if received > ts else 0.0)  # never NaN: a NaN ts compares false
                            # An epoch's first batch is noted (and saved) before it goes out: not here.
                            if not self._first_pending and accept(seq, payload, ts, instance):
                                run.append(decode(seq, payload, received, sequencer.epoch, counted, batch))
                                if oldest is None:  # (taken in order: no stray frame's clock; the first: the
                                    oldest = ts  # longest delay, one batch stamped ahead does not count)
                                newest = ts
                                continue
                            actions = live(seq, payload, ts, instance)
                        if run:
                            decided = actions
                            await self._hand_run()
                            decided = []
                        await self._execute(actions, received)
                    if run:
                        await self._hand_run()
                except asyncio.CancelledError:
                    # Removed while waiting for a full sink: what the sequencer decided is handed on
                    # all the same (the run, and the actions of frame i if _execute had not taken them).
                    sequenced = i + 1
                    await self._hand_decided(decided, received)
                    raise
                finally:
                    self.metrics.ingest_lag.observe_all(lags)
                    if oldest is not None:
                        self._clock_seen(received, oldest, newest)
                if len(self._types) > _MAX_TYPES:
                    self.flush_metrics()
        except asyncio.CancelledError:
            # Removed (waiting for the lock or for a sink): the rest of the burst was read from the
            # engine but never sequenced; if the engine restarts before the stream resumes, those
            # seqs are announced lost with the old epoch.
            self.note_unread(burst[sequenced:])
            raise

    def note_unread(self, frames: Sequence[list[bytes]]) -> None:
        """Raise the unread top (``_unread``, of the epoch open now) to the seqs of ``frames`` (read,
        not sequenced yet: perhaps never, if the stream stops first) up to the first that does not
        follow the one before it: from there on they are another instance's. The checkpoint keeps
        it as how far the instance was seen to publish (I3: announced lost if it restarted before
        they were delivered)."""
        last = self.sequencer.last_live
        for f in frames:
            try:
                seq = wire.parse_live(f).seq
            except DecodeError:
                continue
            if last is not None and seq <= last:
                return
            last = seq
            epoch = self.sequencer.epoch
            self._unread = (epoch, max(self._unread[1], seq) if self._unread[0] == epoch else seq)

    @property
    def _unread_top(self) -> int:
        """The unread top of the epoch open now: one noted in an earlier epoch was its instance's,
        which published nothing of this one (breaker119 1: it was saved as the next instance's)."""
        epoch, top = self._unread
        return top if epoch == self.sequencer.epoch else -1

    async def _hand_run(self) -> None:
        """Hand ``_run`` (records decided in order, not yet offered) to every sink: in one call
        when every sink has room for all of it, else one by one, waiting for blocking sinks."""
        run = self._run
        snaps = self.snapshots
        if snaps is not None and (snaps.seeding is not None or snaps.check):
            while run:  # (rare: a snapshot to ask for, or in flight) each record as _publish hands one
                await self._publish(run.pop(0))
            return
        fanout = self.ctx.fanout
        if fanout.offer_all(run):
            self._handed = run[-1]
            for record in reversed(run):
                if record.kind == "batch":
                    self._handed_batch = record
                    break
            run.clear()
            return
        while run:
            record = run.pop(0)
            self._handed = record  # every sink has it once offered (see Fanout.finish)
            if record.kind == "batch":
                self._handed_batch = record
            await fanout.publish(record)

    async def probe(self) -> None:
        """Called when the stream has been quiet for ``replay.idle_probe`` (see StreamSequencer.probe)."""
        self.last_activity = time.monotonic()
        if self.foreign_only:
            return
        async with self.lock:
            await self._execute(self.sequencer.probe(), time.time())

    def _clock_seen(self, received: float, ts: float, newest: float | None) -> None:
        """A burst read at ``received`` (bridge clock) whose first batch taken in order the engine
        stamped ``ts``, and its last ``newest``."""
        behind = received - ts
        if behind == behind and abs(behind) != math.inf:  # (a ts that is no time: not a sample)
            self._behind = behind
            self._newest = newest if newest is not None and math.isfinite(newest) else ts

    def _engine_time(self, now: float) -> float | None:
        """Bridge time ``now`` on the engine's clock: what the sequencer compares engine ts with when
        it judges which batches were published before a drop (the engine's host clock may be off
        the bridge's by more than ``clock_skew``). Taken from the latest burst, and never past the
        last batch taken in order (plus ``clock_skew``, which the sequencer takes off again): a
        step back of the engine's clock since cannot make it late. It errs only early (fewer
        batches taken as published before the drop: announced lost rather than put in the wrong
        epoch). None (no batch read yet): nothing is taken as published before the drop."""
        if self._behind is None or self._newest is None:
            return None
        return min(now - self._behind, self._newest + self.sequencer.clock_skew)

    async def disconnected(self) -> None:
        """The live connection dropped (from the source's socket monitor)."""
        if self.snapshots is not None:
            self.snapshots.disconnected()
        async with self.lock:
            now = time.time()
            await self._execute(self.sequencer.disconnected(self._engine_time(now)), now)
        task = self._replay_task
        if task is not None and not task.done() and not self.sequencer.replaying:
            task.cancel()  # it asked the instance that went away; the sequencer no longer listens

    def retire(self) -> StreamSequencer:
        """The stream's source was removed (after ``stop``): its sequencer, to resume the stream
        with when the source comes back, so that the live batches it read and has not settled
        (held above a gap, or in doubt) are delivered or announced, never forgotten (I3)."""
        self.sequencer.detached(self._unread_top)
        return self.sequencer

    def resume_point(self) -> tuple[tuple[int, int, Fingerprint | None, int | None] | None, int]:
        """Where a stream removed now resumes: (epoch, seq, fingerprint, its seq) of the last record
        every sink has in its queue (None: none yet), and the highest seq known to be published."""
        top = max(self.sequencer.known_top, self._unread_top)
        r = self._handed
        if r is None:
            return self._resumed_from, top
        if r.kind == "SourceReset":
            return (r.epoch, -1, None, None), top
        b = self._handed_batch
        fp, at = (fingerprint(b.ts, b.payload), b.seq) if b is not None and b.epoch == r.epoch else (None, None)
        return (r.epoch, r.seq, fp, at), top

    async def stop(self) -> None:
        self.flush_metrics()
        if self.snapshots is not None:
            self.snapshots.stop()
        task = self._replay_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- actions ----------------------------------------------------------------------------------
    async def _execute(self, actions: list[Action], received: float, *, persist: bool = True) -> None:
        for i, a in enumerate(actions):
            try:
                record = await self._act(a, received, persist)
                if record is not None:
                    self._pending = record
                    await self._publish(record)
                    self._pending = None
            except asyncio.CancelledError:
                await self._hand_decided(actions[i + 1 :], received)
                raise

    async def _act(self, a: Action, received: float, persist: bool = True) -> Record | None:
        """Carry out one action; the record it hands on, if any."""
        if isinstance(a, Deliver):
            if a.replayed:
                self.metrics.replayed.inc()
            return self._decode(a.seq, a.payload, received, a.epoch)
        if isinstance(a, Duplicate):
            self.metrics.duplicates.inc()
        elif isinstance(a, Gap):
            self.metrics.gaps.inc()
            log.info("sequence gap", extra={"stream": self.stream.key, "from_seq": a.from_seq, "to_seq": a.to_seq})
        elif isinstance(a, RequestReplay):
            self._start_replay(a)
        elif isinstance(a, Suspect):
            self.ctx.decode_failures(self.stream, DecodeError("bad_seq", a.detail), a.seq, None, a.payload)
        elif isinstance(a, Lost):
            span = {"from_seq": a.from_seq, "to_seq": a.to_seq, "reason": a.reason}
            log.warning("batches lost", extra={"stream": self.stream.key, "epoch": a.epoch, **span})
            lost = events_lost(self.stream, a.epoch, a.from_seq, a.to_seq, a.reason, received)
            self.ctx.metrics.announced_lost(lost)
            return lost
        elif isinstance(a, Reset):
            if a.reason != "bridge_restart":
                self.metrics.restarts.inc()
                log.warning("engine restarted: new epoch", extra={"stream": self.stream.key, "epoch": a.epoch})
            if a.epoch == self.sequencer.shown_by_replay:
                since, when = (
                    (" since the bridge started", " while the bridge was down") if self.sequencer.shown_at_start else ("", "")
                )
                log.warning(
                    f"the restart shows only in the replay socket's answer (the live connection never dropped{since}): "
                    f"if the engine did not restart{when}, the source's replay_endpoint is another engine's; check it with "
                    "python -m bridge --check while the engine publishes",
                    extra={"stream": self.stream.key, "epoch": a.epoch, "endpoint": self.replay_endpoint},
                )
            record = self._pending = source_reset(self.stream, a.epoch, a.reason, received)
            self._first_pending = True
            if persist:
                # The new epoch is on disk before any sink holds a record of it (a bridge that
                # crashes now must not open the same number again).
                await self.ctx.epochs.persist()
            return record
        return None

    async def _hand_decided(self, rest: list[Action], received: float) -> None:
        """Cancelled (the stream removed, the bridge stopping) while a full sink made it wait:
        what the sequencer already decided is handed to every sink all the same, past the queue
        bounds (at most one burst's or one reply's decisions), so that the stream resumes after
        it. Decisions stand: a batch decided delivered is never dropped (I4), nor a loss or a
        restart left unannounced (I3), and the epochs and first batches they open are saved first
        (the bridge stopping while they cannot be: :class:`bridge.checkpoint.EpochUnsaved`, and
        nothing is handed; the next start reads from the last save's position, without knowing of
        a restart decided here: docs Limits)."""
        pending = self._pending
        self._pending = None
        first = self._first_pending  # of the records decided so far; a restart in ``rest`` opens an epoch
        records = self._run[:]  # decided before anything else
        self._run.clear()
        if pending is not None and pending is not self._handed:
            records.append(pending)
        for a in rest:
            if isinstance(a, RequestReplay):
                continue  # the stream is going away: no new replay
            record = await self._act(a, received, persist=False)
            if record is not None:
                records.append(record)
        if not records:
            return
        for record in records:
            if record.kind == "SourceReset":
                first = True
            elif first and record.kind == "batch":
                first = False
                self.ctx.epochs.note_first(self.stream.key, record)
        self._first_pending = first
        await self.ctx.epochs.persist()
        for record in records:
            self._handed = record
            if record.kind == "batch":
                self._handed_batch = record
            self.ctx.fanout.force(record)
        self._pending = None

    async def _note_first(self, record: Record) -> None:
        if record.kind == "batch":
            self._first_pending = False
            if self.ctx.epochs.note_first(self.stream.key, record):
                await self.ctx.epochs.persist()

    async def _publish(self, record: Record) -> None:
        if self._first_pending:
            await self._note_first(record)
        snaps = self.snapshots
        if snaps is not None:
            snaps.before(record)
        self._handed = record  # every sink has it once offered (see Fanout.finish)
        if record.kind == "batch":
            self._handed_batch = record
        await self.ctx.fanout.publish(record)
        if snaps is not None:
            snaps.after(record)

    def _decode(
        self,
        seq: int,
        payload: bytes,
        received: float,
        epoch: int,
        counted: wire.EventCount | None = None,
        batch: wire.DecodedBatch | None = None,
    ) -> Record:
        """The record of a delivered batch (``counted`` or ``batch``: already counted or decoded)."""
        if not self.ctx.needs_events:
            if counted is None:
                counted = wire.count_batch(payload)
            if counted is not None:  # else: decode it, which reports what is wrong with it
                self._bad_run = 0
                types = counted.types
                self._types.extend(types)
                record = self._decoded = Record(
                    self.stream, epoch, seq, "batch", counted.ts, payload, [], None, None, received, len(types),
                    instance=self._instance_of(epoch),
                )  # fmt: skip
                return record
        try:
            if batch is None:
                batch = wire.decode_batch(payload)
        except DecodeError as exc:
            self.ctx.decode_failures(self.stream, exc, seq, None, payload)
            self._bad_run += 1
            self._bad_why = str(exc)
            good = self._decoded
            if good is not None and good.epoch == epoch:
                self.sequencer.reference(good.seq, good.ts)
            lost = events_lost(self.stream, epoch, seq, seq, "undecodable", received)
            self.ctx.metrics.announced_lost(lost)
            return lost
        for bad in batch.bad_events:
            self.ctx.decode_failures(self.stream, DecodeError("bad_event", bad.reason), seq, None, None, index=bad.index)
        if batch.bad_events and not batch.events:  # every event of it undecodable: see undecodable
            self._bad_run += 1
            self._bad_why = str(DecodeError("bad_event", batch.bad_events[0].reason))
        else:
            self._bad_run = 0
        self._types.extend(map(_type_of, batch.events))
        n_bad = len(batch.bad_events)
        record = self._decoded = Record(
            self.stream, epoch, seq, "batch", batch.ts, payload, batch.events, None, None, received, -1, batch.plain, n_bad,
            instance=self._instance_of(epoch),
        )  # fmt: skip
        return record

    def _instance_of(self, epoch: int) -> bytes | None:
        """The publisher UUID of ``epoch``'s engine instance, when the sequencer knows it for
        certain (a batch of an epoch that ended in this burst: not known here)."""
        sequencer = self.sequencer
        return sequencer.sure_instance if sequencer.epoch == epoch else None

    def flush_metrics(self) -> None:
        """Apply the metric updates gathered since the last flush (see ``__init__``)."""
        if self._received:
            self.metrics.received.inc(self._received)
            self._received = 0
        if self._types:
            for t, n in Counter(self._types).items():
                label = t if t in wire.KNOWN_TYPES else "other"  # keyed by label: unknown type names must not grow the cache
                self.metrics.events(label).inc(n)
            self._types.clear()
        last = self._decoded
        if last is not None and last is not self._shown:
            self.metrics.last_seq.set(last.seq)
            if last.ts is not None:  # always, for a decoded or counted batch
                self.metrics.last_ts.set(last.ts)
            self._shown = last

    # -- replay ---------------------------------------------------------------------------------
    def _start_replay(self, req: RequestReplay) -> None:
        current = asyncio.current_task()
        old = self._replay_task
        if old is not None and old is not current and not old.done():
            old.cancel()  # superseded (e.g. the engine restarted): its replies would be ignored anyway
        self._replay_task = self.ctx.spawn(self._replay(req), f"replay:{self.stream.key}")

    async def _diagnose_replay(self) -> None:
        """A replay that got no reply at all: ask the endpoint what it is (bridge.probe). A socket
        of the wrong type (the engine's PUB, easy with dp ranks) or a dead port is logged once per
        change, as what it is and how to fix it, and kept for /readyz (``replay_problem``)."""
        assert self.replay_endpoint is not None
        asked = time.monotonic()
        answer = await probe.diagnose(self.replay_endpoint, "replay")
        if self._replied_at >= asked:
            return  # (a replay got replies meanwhile: whatever this found is past)
        if answer is None and not probe.probed(self.replay_endpoint):
            answer = (
                f"no reply to a replay request within {self.ctx.replay_config.timeout:g}s (neither a TCP nor an ipc "
                "endpoint, so not probed: check that the engine's replay_endpoint is this one and that the engine is running)",
                "no_answer",
            )
        if answer is None:
            # The right socket answers its handshake (libzmq's own thread does, whatever the engine
            # does), yet the replay got no reply at all: the engine's process is hung, or too busy
            # to answer. As good as no answer, while no live batch comes either (``silent``).
            answer = (
                f"a ROUTER socket answers its handshake, but no replay request within "
                f"{self.ctx.replay.timeout:g}s (the engine is hung, or too busy to answer)",
                "no_answer",
            )
        problem = f"{self.replay_endpoint}: {answer[0]}"
        if problem != self.replay_problem:
            log_at = log.error if answer[1] == "wrong_peer" else log.warning
            log_at("replay endpoint not usable", extra={"stream": self.stream.key, "error": problem})
        self.replay_problem = problem
        # No answer; or refused, reset or unreachable (an engine gone behind a proxy that keeps the
        # live connection open, breaker119 2): nothing vouches for the engine now. Another kind of
        # socket answering is a configuration error, named as such, not a sign of the engine.
        self._unanswered = time.monotonic() if answer[1] != "wrong_peer" else None

    @property
    def silent(self) -> bool:
        """The engine answers nothing: its replay endpoint does not answer a replay (a frozen or
        hung process, whose TCP connections the kernel keeps up; or it refuses, resets or cannot
        be reached: an engine gone behind a proxy that holds the live connection open), and no
        live batch came since that was found, nor for ``REPLAY_DIAGNOSE_AGAIN`` seconds (an engine
        publishing every few seconds beside a refused replay endpoint does not flap between the
        two). An idle engine answers its replay endpoint."""
        unanswered, last = self._unanswered, self._last_live
        return unanswered is not None and last < unanswered and time.monotonic() - last >= REPLAY_DIAGNOSE_AGAIN

    @property
    def undecodable(self) -> str | None:
        """Why nothing this engine sends can be decoded, when its last ``UNDECODABLE_AFTER``
        batches in a row failed to decode (the message's frames, the batch, or every event of it)
        and none decoded since (a publisher of the right topic whose payloads are not KV event
        batches: another encoder, another program); else None."""
        return self._bad_why if self._bad_run >= UNDECODABLE_AFTER else None

    async def _replay(self, req: RequestReplay) -> None:
        assert self.replay_endpoint is not None
        if req.attempt > 0:
            await asyncio.sleep(self.backoff.delay(req.attempt))
        outcome = ReplayOutcome()
        label = "error"
        try:
            fetched = self.ctx.replay.fetch(self.replay_endpoint, req.start, req.until, outcome, self.topic)
            async with contextlib.aclosing(fetched) as replies:
                async for reply in replies:
                    async with self.lock:
                        await self._execute(
                            self.sequencer.replayed(req.request_id, reply.seq, reply.payload, reply.instance), time.time()
                        )
                        if len(self._types) > _MAX_TYPES:
                            self.flush_metrics()
            label = "complete" if outcome.complete else "timeout"
            # The endpoint answers (again): the next replay without a reply is asked about at once.
            # Its end marker alone is an answer too (an idle engine restarted with an empty buffer).
            if outcome.replies or outcome.complete:
                self._replied_at = time.monotonic()
                self.replay_problem = self._unanswered = None
                self._replay_diagnosed = -REPLAY_DIAGNOSE_EVERY
        except zmq.ZMQError as exc:
            log.warning("replay failed", extra={"stream": self.stream.key, "error": str(exc)})
        self.metrics.replay_finished(label, outcome.bad_replies)
        if label != "complete":
            log.info(
                "replay incomplete, will retry",
                extra={"stream": self.stream.key, "start": req.start, "attempt": req.attempt, "outcome": label},
            )
            now = time.monotonic()
            # At most once a minute while the problem lasts; again (after a few seconds) once a live
            # batch came since the last diagnosis, which cleared the silence it found (breaker120
            # 2: a frozen engine was not found for up to 60 s after that).
            again = self._last_live > self._replay_diagnosed and now - self._replay_diagnosed >= REPLAY_DIAGNOSE_AGAIN
            if not outcome.replies and (now - self._replay_diagnosed >= REPLAY_DIAGNOSE_EVERY or again):
                self._replay_diagnosed = now
                self.ctx.spawn(self._diagnose_replay(), f"diagnose-replay:{self.stream.key}")
        async with self.lock:
            await self._execute(self.sequencer.replay_finished(req.request_id, outcome.complete), time.time())
