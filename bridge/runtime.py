"""The bridge runtime: builds sources, pipelines, sinks and endpoints from a Config and runs them.

``Bridge`` is an async context manager (``async with Bridge(config) as b: ...``), which is what the
CLI and tests use; :func:`run` is the whole program given a config and a stop event. Shutdown
goes in a fixed order within ``shutdown_timeout``: stop ingest and replays, flush every sink
queue, save the checkpoint, close the connectors and the endpoints.

With ``checkpoint.from_sinks``, every stream about to start (configured, or found by discovery)
that this process has not run yet first asks each sink what it holds of it
(:meth:`Bridge.take_over`): it resumes from the lowest position a sink needs (never before the
checkpoint file's), and each sink drops, once per stream, the messages at or below what it holds
(:class:`SkipHeld`). That is how a pod takes over streams without their previous owner's checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import resource
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from . import checkpoint as ckpt
from .backoff import Backoff
from .config import Config, SinkConfig, SourceConfig
from .connector import Connector, PositionReader, Registry, StateReader
from .deadletter import DeadLetters, DecodeFailures
from .discovery import Discovery
from .endpoints import for_rank
from .errors import ConfigError, PartialFailure
from .fanout import Fanout
from .filters import EventFilter, for_sink
from .formats import STATE_TYPE, Message, Renderer
from .health import HealthServer
from .ingest import Drainer
from .metrics import Metrics
from .records import Record, Stream, events_lost
from .replay import ReplayClient
from .sequencer import StreamSequencer
from .sink import SinkWorker
from .snapshot import SnapshotClient, StreamSnapshots
from .source import SourceReader
from .state import StateTracker
from .stream import StreamContext, StreamPipeline

log = logging.getLogger("bridge")

MAX_SHOWN = 50
"""Streams named at most in /readyz's sources_not_connected (a fleet has thousands)."""


def _inner(conn: Any) -> Connector:
    """The sink's connector, under the SkipHeld that wraps it with ``checkpoint.from_sinks``
    (what load_state keys the losses it finds by)."""
    return conn.inner if isinstance(conn, SkipHeld) else conn


def _as_held(conn: Any, found: Mapping[str, ckpt.SinkPosition | None]) -> dict[str, ckpt.SinkPosition | None]:
    """What a connector's ``positions`` found, as each stream's last record held: for one that
    stores a batch's messages all or none (``whole_batches``: Redis), the whole batch its last
    event belongs to (the start check and the handover both read them so)."""
    if not getattr(conn, "whole_batches", False):
        return dict(found)
    return {
        k: msgspec.structs.replace(v, index=None) if v is not None and v.kind == "batch" and v.index is not None else v
        for k, v in found.items()
    }


def _told_by_worker(record: Record) -> bool:
    """An ``EventsLost`` a sink worker made for its sink alone (I6: what that sink lost or refused):
    never a message the sink holds already, whatever position it stands at."""
    return record.kind == "EventsLost" and (record.reason or "").startswith(("sink_lost:", "sink_refused:"))


class SkipHeld:
    """A sink's connector that leaves out, per stream and once, the messages the sink already holds
    (``through``: stream key -> message position, from :func:`bridge.checkpoint.combine`). A stream
    that resumed below what this sink holds is re-sent from there for the other sinks' sake; this sink
    gets only what follows. A stream's entry goes once a message past it was written (positions
    grow along a stream, and an epoch opened now is above every epoch a sink holds)."""

    def __init__(self, inner: Connector, metrics: Metrics | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.metrics = metrics  # counts the sink_behind announcements, once written
        self.needs_events = getattr(inner, "needs_events", True)
        self.writes_state = getattr(inner, "writes_state", False)
        audit = getattr(inner, "audit", None)
        if audit is not None:  # (the worker asks its connector for one: I6 on a quiet stream)
            self.audit = audit
        self.through: dict[str, tuple[int, int, int]] = {}
        self.skipped = 0  # messages left out (tests, logs)
        self.renderer: Renderer | None = None  # the sink's, to narrow or announce an EventsLost (see write)
        # stream key -> (epoch, first seq): the sink was behind in an epoch another sink closed
        # (Handover.behind); announced before its first record of a later epoch (see _behind).
        self.behind: dict[str, tuple[int, int]] = {}
        # How many seqs past its last record the sink can have lacked: its queue's bound (the
        # previous pod's queue held the rest when it died), plus one burst forced past it.
        self.lag_bound = 1

    def _narrowed(self, m: Message, limit: tuple[int, int, int]) -> Message | None:
        """An ``EventsLost`` that reaches down into batches this sink holds whole (the stream
        resumed below it for another sink, and the engine's buffer no longer had those), told to
        this sink from its first batch it does not hold (I4); None: nothing to narrow."""
        r = m.record
        epoch, slot, sub = limit
        # The first batch not held whole: the one after slot - 1, or slot - 1 itself when it is
        # held only in part (its other events are lost, and the loss is told from it).
        missing = slot if sub == ckpt.MAX_SUB else slot - 1
        if self.renderer is None or r.epoch != epoch or r.from_seq is None or r.from_seq >= missing:
            return None
        rest = events_lost(r.stream, r.epoch, missing, r.seq, r.reason or "unrecoverable", r.received)
        return self.renderer.render(rest)[0]

    async def connect(self) -> None:
        await self.inner.connect()

    async def close(self) -> None:
        await self.inner.close()

    async def health(self) -> str | None:
        return await self.inner.health()

    def _behind(self, m: Message) -> list[Message]:
        """The ``EventsLost`` this sink is told before ``m``, the first record it gets of a later
        epoch than one it was behind in (reason ``sink_behind:<sink>``): the rest of that epoch,
        which no pod will deliver to it any more (I3). Where that epoch ended is not known here
        (the sinks that got it whole hold a later epoch now): the span reaches as far as the sink
        can have lagged (``lag_bound``)."""
        epoch, first = self.behind[m.record.stream.key]
        if self.renderer is None or m.record.epoch <= epoch:
            return []
        r = m.record
        loss = events_lost(r.stream, epoch, first, first + self.lag_bound - 1, f"sink_behind:{self.name}", r.received)
        return self.renderer.render(loss)

    async def write(self, messages: Sequence[Message]) -> None:
        through = self.through
        if not through and not self.behind:
            await self.inner.write(messages)
            return
        keep: list[int] = []
        past: set[str] = set()  # streams with a message past what the sink holds in this write
        narrowed: dict[int, Message] = {}
        told: dict[int, list[Message]] = {}  # announced before message i (see _behind)
        for i, m in enumerate(messages):
            key = m.record.stream.key
            if key in self.behind and key not in past and m.type != STATE_TYPE:
                limit = through.get(key)
                position = m.position if m.record.kind != "EventsLost" else (m.position[0], m.position[1], ckpt.MAX_SUB)
                if limit is None or position > limit:
                    told[i] = self._behind(m)
                    past.add(key)  # (the first record it gets: its epoch decides, once)
            limit = through.get(key)
            if limit is not None and m.type == STATE_TYPE:
                # Never left out: the sink's own guard drops a change it holds, and a change it does
                # not hold (a clear of a new generation, after a loss or a fresh start) must reach it.
                keep.append(i)
                continue
            if limit is not None and not _told_by_worker(m.record):
                position = m.position
                if m.record.kind == "EventsLost":  # it sorts after the batch at its to_seq
                    position = (position[0], position[1], ckpt.MAX_SUB)
                    if position > limit:
                        narrow = self._narrowed(m, limit)
                        if narrow is not None:
                            narrowed[i] = narrow
                if position <= limit:
                    continue
                past.add(key)
            keep.append(i)
        skipped = len(messages) - len(keep)
        if keep:
            origin: list[int] = []  # per message written: the index in ``messages`` it stands for
            out: list[Message] = []
            for i in keep:
                for loss in told.get(i, ()):
                    origin.append(i)  # (a failure of the announcement is one of the record it precedes)
                    out.append(loss)
                origin.append(i)
                out.append(narrowed.get(i, messages[i]))
            try:
                await self.inner.write(messages if len(out) == len(messages) and not narrowed else out)
            except PartialFailure as exc:
                if len(out) == len(messages):
                    raise
                raise PartialFailure({origin[j]: e for j, e in exc.errors.items() if 0 <= j < len(out)}) from None
        # Only once written: a write that fails is tried again with the same messages, and what
        # the sink holds must still be left out (and what it lacks announced) then.
        self.skipped += skipped
        if self.metrics is not None:
            for losses in told.values():  # (one announcement each, rendered)
                if losses:
                    self.metrics.announced_lost(losses[0].record)
        for key in past:
            through.pop(key, None)
            self.behind.pop(key, None)


_NOWHERE = (1 << 62, 0)
"""Above every (epoch, seq): a state sink that cannot tell where its state stands is never behind."""
_UNKNOWN = object()


class Bridge:
    """One running bridge. See the module docstring."""

    def __init__(self, config: Config, *, registry: Registry | None = None, metrics: Metrics | None = None) -> None:
        self.config = config
        self.registry = registry or Registry()
        self.metrics = metrics or Metrics()
        self.dead_letters = DeadLetters(config.dead_letter.path, on_failure=self.metrics.dead_letter_write_failures.inc)
        self.zmq_context = zmq.asyncio.Context()
        # libzmq allows 1,023 sockets per context unless told otherwise, and every stream holds
        # three (SUB, and the two ends of its monitor): the process's descriptor limit is the bound.
        self.zmq_context.set(zmq.MAX_SOCKETS, max(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
        # Sockets accept IPv6 endpoints (tcp://[::1]:5557) as well as IPv4 ones.
        self.zmq_context.setsockopt(zmq.IPV6, 1)
        self.workers: list[SinkWorker] = []
        self._built: list[Connector] = []  # the connectors start() built (closed by the workers once they run)
        self.store = ckpt.CheckpointStore(None, 0)  # the real one is made at start (it reads the file)
        self.context = StreamContext(
            fanout=Fanout([]),
            metrics=self.metrics,
            decode_failures=DecodeFailures(self.metrics, self.dead_letters),
            replay=ReplayClient(
                self.zmq_context,
                max_concurrent=config.replay.max_concurrent,
                timeout=config.replay.timeout,
                max_frame_bytes=config.ingest.max_frame_bytes,
            ),
            epochs=self.store,
            spawn=self.spawn,
            replay_config=config.replay,
        )
        self.snapshot_client = SnapshotClient(
            self.zmq_context,
            max_concurrent=config.snapshots.max_concurrent,
            timeout=config.snapshots.timeout,
            max_bytes=config.snapshots.max_bytes,
        )
        self.pipelines: dict[str, StreamPipeline] = {}
        self.readers: dict[str, SourceReader] = {}
        self.drainer = Drainer(config.ingest.tick)  # reads every source's socket (see bridge.ingest)
        self._reader_tasks: dict[str, asyncio.Task[None]] = {}
        # Removed sources' streams, for their return: where to resume, the highest seq known,
        # when (monotonic) the source was removed, and the stream's sequencer (what it read and
        # has not settled); forgotten after discovery.forget_after.
        self._retired: dict[str, tuple[ckpt.StreamPosition | None, int, float, StreamSequencer]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed: BaseException | None = None
        # Per state sink (its connector's id): spans it was found at start-up to have lost (see
        # _behind_at_start), for its worker to announce.
        self._lost_at_start: dict[int, list[tuple[Stream, int, int, int]]] = {}
        self.stopped = asyncio.Event()
        self.health: HealthServer | None = None
        self._checkpoint_task: asyncio.Task[None] | None = None
        self.discovery: Discovery | None = None
        self._started_at: float | None = None  # monotonic; ingest.connect_grace counts from here
        self._starting: str | None = "starting"  # what start() waits for (None: started)
        self.skips: list[SkipHeld] = []  # with checkpoint.from_sinks: every sink's connector, wrapped
        # The sinks whose connector tells what it stored (stored_through), to check at the next
        # start that they still hold it (_resume_stored); with from_sinks, only where the sink said
        # it holds nothing of a stream (_holds_nothing: stream key, sink name).
        self._stored_by: list[Connector] = []
        self._holds_nothing: set[tuple[str, str]] = set()
        # (stream key, sink name) of state sinks that could not tell what they hold of a stream at
        # start, and announced nothing of it: their mark is checked (_resume_stored)
        self._held_unknown: set[tuple[str, str]] = set()
        # (stream key, sink name) whose checkpointed mark the sink was not told (_resume_stored):
        # kept as saved until the sink stores something of the stream (_collect)
        self._untold: set[tuple[str, str]] = set()
        self._held_top: dict[str, int] = {}  # from_sinks: the highest seq a sink holds in a stream's resume epoch
        self.tracker: StateTracker | None = None  # when a sink keeps state (state.enabled)
        self._state_sinks: list[Connector] = []

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> Bridge:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        cfg = self.config
        self._started_at = time.monotonic()
        self.metrics.sources_configured.set_function(lambda: len(self.readers))
        connectors: list[Connector] = []
        problems: list[str] = []
        for i, sink in enumerate(cfg.sinks):
            try:
                connectors.append(self.registry.build(sink, i))
            except ConfigError as exc:
                problems.extend(exc.problems)
        if problems:
            raise ConfigError(problems)
        configured = [s for source in cfg.sources for s in streams_of(source)]
        for conn in connectors:  # (see bridge.connector: what a connect checks of each, --check checks too)
            if hasattr(conn, "known_streams"):
                conn.known_streams = list(configured)
        self._built = connectors
        if cfg.metrics.listen:
            # Up before the sinks are read: a start-up waiting for them (up to state.load_timeout
            # and checkpoint.from_sinks_timeout) answers /healthz, and /readyz says what it waits for.
            self.health = HealthServer(cfg.metrics.listen, self.metrics.scrape, self.readiness)
            await self.health.start()
        try:
            await self._start(connectors)
        except BaseException:
            if self.health is not None:
                await self.health.stop()
            raise
        self._starting = None
        log.info("bridge started", extra={"sources": len(self.readers), "sinks": len(self.workers)})

    async def _start(self, connectors: list[Connector]) -> None:
        """The rest of :meth:`start`: the sinks read first, then every sink worker and source."""
        cfg = self.config
        self.store = self.context.epochs = ckpt.CheckpointStore(cfg.checkpoint.path, len(cfg.sinks))
        self.store.collect = self._collect
        self.store.on_save = self._saved
        configured = [s for source in cfg.sources for s in streams_of(source)]
        self._state_sinks = [c for c in connectors if getattr(c, "writes_state", False)]
        self.checkpointer.state_sinks = [c.name for c in self._state_sinks]
        if self._state_sinks:
            # Generations start at the clock in microseconds plus a random part: above an earlier
            # process's, and unlike another's started at the same time (see StateTracker).
            base = int(time.time() * 1_000_000) + random.randrange(1000)
            tracker = self.tracker = StateTracker(cfg.state.max_entries, generation_base=base)
            self.metrics.state_entries.set_function(lambda: tracker.total)
            self.metrics.state_streams_off.set_function(tracker.streams_off)
        early: list[tuple[Connector, SinkConfig]] = [
            (c, sink)
            for c, sink in zip(connectors, cfg.sinks, strict=True)
            if (isinstance(c, StateReader) and c in self._state_sinks)
            or (cfg.checkpoint.from_sinks and isinstance(c, PositionReader))
        ]
        if early:
            self._starting = f"connecting to the sinks read before any stream starts: {', '.join(c.name for c, _ in early)}"
            await self._connect_early(early)
        if self._state_sinks:
            self._starting = "reading the streams' state back from the state sinks (state.load_timeout)"
            await self.load_state(configured)
        self._stored_by = [c for c in connectors if hasattr(c, "stored_before") and hasattr(c, "stored_through")]
        if cfg.checkpoint.from_sinks:
            self._starting = "asking the sinks what they hold of each stream (checkpoint.from_sinks_timeout)"
            self.skips = [SkipHeld(c, self.metrics) for c in connectors]
            connectors = [skip for skip in self.skips]
            await self.take_over(configured)
        self._starting = "starting the sinks and sources"
        renderers: dict[tuple[str, str, str, EventFilter | None], Renderer] = {}
        for i, (sink, conn) in enumerate(zip(cfg.sinks, connectors, strict=True)):
            event_filter = for_sink(sink)
            key = (sink.format, sink.granularity, sink.hash_format, event_filter)
            renderer = renderers.get(key)
            if renderer is None:
                renderer = renderers[key] = Renderer(sink.format, sink.granularity, sink.hash_format, event_filter)
            elif sink.format != "raw":  # a raw message costs less to render than to share
                renderer.sharers += 1
            if self.skips:
                self.skips[i].renderer = renderer
                self.skips[i].lag_bound = sink.queue.max_batches + cfg.ingest.drain_max
            worker = SinkWorker(
                i, sink, conn, renderer, self.metrics, self.dead_letters, self.checkpointer.on_ack, self._state_lost
            )
            worker.lost_at_start = self._lost_at_start.pop(id(_inner(conn)), [])
            self.metrics.start_sink(worker.name)
            self.workers.append(worker)
            self._watch(worker.start())
        self.context.fanout = Fanout(self.workers, self.tracker, self._state_switched_off)
        self.context.needs_events = self.tracker is not None or any(
            sink.format != "raw" or getattr(conn, "needs_events", True) for sink, conn in zip(cfg.sinks, connectors, strict=True)
        )
        added = [(source, self._add_pipelines(source)) for source in cfg.sources]
        await self.persist_epochs()  # one write for every epoch opened at start-up
        for source, pipelines in added:
            await self._start_readers(source, pipelines)
        if cfg.discovery.dns is not None:
            self.discovery = Discovery(
                cfg.discovery.dns, self, registry=self.metrics.registry, reserved=[s.name for s in cfg.sources]
            )
            await self.discovery.start()
            self.spawn(self._forget_loop(), "forget-retired")
        if cfg.replay.idle_probe > 0:
            self.spawn(self._idle_probe_loop(), "idle-probe")
        if cfg.checkpoint.path:
            self._checkpoint_task = self._watch(asyncio.create_task(self.store.run(cfg.checkpoint.interval), name="checkpoint"))

    async def add_source(self, source: SourceConfig) -> None:
        """Subscribe to every rank of ``source`` (also used by discovery at run time)."""
        await self.load_state(streams_of(source))
        if self.skips:
            await self.take_over(streams_of(source))
        for worker in self.workers:  # (running: each announces them before its next records)
            worker.lost_at_start += self._lost_at_start.pop(id(_inner(worker.connector)), [])
        added = self._add_pipelines(source)
        await self.persist_epochs()  # epochs opened here are on disk before any record of them
        await self._start_readers(source, added)

    def _add_pipelines(self, source: SourceConfig) -> list[tuple[StreamPipeline, str]]:
        replay_on_start = source.replay_on_start if source.replay_on_start is not None else source.replay_endpoint is not None
        added: list[tuple[StreamPipeline, str]] = []
        for rank in range(source.dp_ranks):
            stream = Stream(source.name, rank, dict(source.labels))
            key = stream.key
            if key in self.pipelines:
                continue
            # A stream read before in this process resumes exactly where it stopped; otherwise from
            # the checkpoint (what every sink acknowledged), or fresh in a new epoch.
            top: int | None
            sequencer: StreamSequencer | None = None
            owed: tuple[int, int, int] | None = None
            if key in self._retired:
                pos, top, _, sequencer = self._retired.pop(key)
                announce = False  # every sink has what it handed on, its SourceReset included
            else:
                pos = self.checkpointer.resume_position(key)
                top = self._held_top.pop(key) if key in self._held_top else None
                # Seen published by the run before (a crash loses what it read past the sinks):
                # an engine restart found now settles the old epoch up to there (I3).
                seen = self.checkpointer.published_top(key, pos.epoch) if pos is not None else None
                if seen is not None and (top is None or seen > top):
                    top = seen
                announce = self.checkpointer.needs_reset(key)
                owed = self.checkpointer.owed_at_start(key, pos) if announce else None
            instance, retired = self.checkpointer.resume_instance(key, pos.epoch) if pos and sequencer is None else (None, [])
            if self.tracker is not None:
                self.metrics.state_switched_off.labels(source.name)  # at 0 from the start
            pipeline = StreamPipeline(
                self.context,
                stream,
                replay_endpoint=for_rank(source.replay_endpoint, rank) if source.replay_endpoint else None,
                replay_on_start=replay_on_start,
                topic=source.topic,
                epoch=pos.epoch if pos else self.checkpointer.first_epoch(key, time.time()),
                delivered=pos.seq if pos else None,
                delivered_fp=(pos.ts, pos.crc) if pos and (pos.ts is not None or pos.crc is not None) else None,
                anchor=pos.at if pos else None,
                known_top=top,
                announce=announce,
                owed=owed,
                sequencer=sequencer,
                instance=instance,
                retired=retired,
            )
            acked = self.checkpointer.position(key) if sequencer is None else None
            if acked is not None and acked.seq >= 0:
                for worker in self.workers:
                    told = getattr(_inner(worker.connector), "acknowledged_before", None)
                    if told is not None:
                        told(stream, acked.epoch, acked.seq)
            if sequencer is None:
                self._resume_stored(stream, pos)
            pipeline.snapshots = self._snapshots(source, rank, pipeline)
            self.pipelines[key] = pipeline
            added.append((pipeline, for_rank(source.endpoint, rank)))
        return added

    def _snapshots(self, source: SourceConfig, rank: int, pipeline: StreamPipeline) -> StreamSnapshots | None:
        """The stream's engine snapshots (experimental): for a source with ``snapshot`` on, when a
        sink keeps state (only a state is seeded from them)."""
        if source.snapshot == "off" or self.tracker is None:
            return None
        design = source.snapshot
        endpoint = source.snapshot_endpoint
        if design == "vllm-50134" or (design == "auto" and endpoint is None):
            design, endpoint = "vllm-50134", source.replay_endpoint
        assert endpoint is not None  # (config: each design has its socket)
        counter = self.metrics.snapshots
        name = source.name
        counter.labels(name, "seeded")  # at 0 from the start (a rate over it has data before the first)
        sequencer = pipeline.sequencer
        return StreamSnapshots(
            pipeline.stream,
            for_rank(endpoint, rank),
            design,
            self.snapshot_client,
            self.tracker,
            lambda outcome: counter.labels(name, outcome).inc(),
            self.spawn,
            lambda: (sequencer.epoch, sequencer.instance, sequencer.in_doubt),
            self.config.snapshots.retry_interval,
        )

    async def _start_readers(self, source: SourceConfig, added: list[tuple[StreamPipeline, str]]) -> None:
        for pipeline, endpoint in added:
            key = pipeline.stream.key
            ingest = self.config.ingest
            reader = SourceReader(
                pipeline, self.zmq_context, endpoint, bind=source.bind, topic=source.topic, ingest=ingest, drainer=self.drainer
            )
            configured = [i for i, s in enumerate(self.config.sources) if s is source]
            reader.open(f"sources[{configured[0]}].endpoint" if configured else f"source {source.name}: endpoint")
            self.readers[key] = reader
            self._reader_tasks[key] = self._watch(asyncio.create_task(reader.run(), name=f"source:{key}"))
            await pipeline.start()

    def _collect(self) -> None:
        """Tell the checkpoint each running stream's instance, where its publisher's UUID makes it
        certain, how far the instance was seen to publish, and how far each sink that can tell
        stored it (before every save, see CheckpointStore.collect)."""
        note, published = self.checkpointer.note_instance, self.checkpointer.note_published
        for key, pipeline in self.pipelines.items():
            sequencer = pipeline.sequencer
            instance = sequencer.sure_instance
            if instance is not None:
                note(key, sequencer.epoch, instance, sequencer.retired_instances)
            published(key, sequencer.epoch, pipeline.resume_point()[1])
        for conn in self._stored_by:
            through = conn.stored_through  # type: ignore[attr-defined]
            for key, pipeline in self.pipelines.items():
                mark = through(pipeline.stream)
                if mark is not None:
                    self._untold.discard((key, conn.name))
                    self.checkpointer.note_stored(key, conn.name, mark)
                elif (key, conn.name) not in self._untold:
                    # (lost since, or the mark was another key's: a next run must not check it; a
                    # mark the sink was not told, with nothing stored since, stays for the next run,
                    # which may need it: breaker96 N2)
                    self.checkpointer.forget_stored(key, conn.name)

    def _resume_stored(self, stream: Stream, resume: ckpt.StreamPosition | None) -> None:
        """Before ``stream`` starts: each sink whose connector tells what it stored is told what an
        earlier run saw it store, to check at its next write that it still holds it
        (``stored_before``, see bridge.connector; I6 for a loss while no bridge ran), and where the
        stream resumes (what it lost after that comes again, or is announced to every sink as a
        gap). A state sink only when it could not tell at start what it holds of the stream, and
        announced nothing of it (load_state); with from_sinks, a sink that said it holds nothing."""
        for conn in self._stored_by:
            at = (stream.key, conn.name)
            if getattr(conn, "writes_state", False) and at not in self._held_unknown:
                self._untold.add(at)  # (a state sink: what it holds was read back at start, and a loss announced)
                continue
            if self.skips and at not in self._holds_nothing and at not in self._held_unknown:
                self._untold.add(at)  # (from_sinks: what the sink holds was read back, and the stream resumes by it)
                continue
            position = self.checkpointer.stored_through(stream.key, conn.name)
            if position is not None:
                again = (resume.epoch, resume.seq) if resume is not None else None
                conn.stored_before(stream, position, again)  # type: ignore[attr-defined]

    async def remove_source(self, name: str) -> None:
        """Stop reading every rank of source ``name``; what it delivered stays checkpointed."""
        for key in [k for k, p in self.pipelines.items() if p.stream.source == name]:
            task = self._reader_tasks.pop(key)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pipeline = self.pipelines.pop(key)
            await pipeline.stop()
            # Where every sink has it queued (not where the sequencer got to: a full sink may
            # not have taken the record the stream was waiting to hand it).
            point, top = pipeline.resume_point()
            pos = None
            if point is not None:
                epoch, seq, fp, at = point
                pos = ckpt.StreamPosition(epoch, seq, *(fp or (None, None)), None if at == seq else at)
            self._retired[key] = (pos, top, time.monotonic(), pipeline.retire())
            self.readers.pop(key)

    async def close_unstarted(self) -> None:
        """After a stop during start-up, before any sink worker: close the connectors start()
        built (each bounded; some are connected already), never raising."""
        self.stopped.set()
        for conn in self._built:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await conn.close()
        if self.health is not None:
            await self.health.stop()
        self.dead_letters.close()
        self.zmq_context.destroy(linger=0)

    async def stop(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.store.stopping = True  # (a stream waiting for its epoch to be saved stops waiting)
        deadline = time.monotonic() + self.config.shutdown_timeout
        # 1. stop discovery (no source comes or goes from here on), ingest and replays
        if self.discovery is not None:
            await self.discovery.stop()
        for task in self._reader_tasks.values():
            task.cancel()
        ended = await asyncio.gather(*self._reader_tasks.values(), return_exceptions=True)
        unsaved = [e for e in ended if isinstance(e, ckpt.EpochUnsaved)]
        if unsaved:
            log.error(
                "records of a new epoch not handed to the sinks: the epoch could not be saved; the next start reads "
                "from the last save's position and does not know of the engine restart this run saw (docs: Limits)",
                extra={"streams": len(unsaved), "error": str(unsaved[0])},
            )
        self.drainer.close()
        for p in self.pipelines.values():
            await p.stop()
        # 2. flush every sink queue (bounded)
        for w in self.workers:
            if not await w.flush(max(0.1, deadline - time.monotonic())):
                n, size = w.queued
                log.warning("sink not flushed before the shutdown deadline", extra={"sink": w.name, "batches": n, "bytes": size})
        # 2b. announce what a sink found lost at its last writes (see SinkWorker.last_audit)
        for w in self.workers:
            await w.last_audit(max(0.1, deadline - time.monotonic()))
        # 3. checkpoint what every sink acknowledged (a periodic save still writing in its thread
        # cannot replace this one: see Checkpointer.write)
        if self._checkpoint_task is not None:
            self._checkpoint_task.cancel()
            await asyncio.gather(self._checkpoint_task, return_exceptions=True)
        self.store.save_now()
        # 4. close connectors, endpoints, background tasks
        for w in self.workers:
            await w.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.health is not None:
            await self.health.stop()
        self.dead_letters.close()
        self.zmq_context.destroy(linger=0)
        log.info("bridge stopped")

    # -- background tasks -----------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._watch(asyncio.create_task(coro, name=name))

    def _watch(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        """Every background task is watched: if one dies, the bridge says so and stops."""
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self.stopped.is_set():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task failed", extra={"task": task.get_name(), "error": repr(exc)}, exc_info=exc)
            if self.failed is None:
                self.failed = exc

    async def _forget_loop(self) -> None:
        """Forget sources gone for ``discovery.forget_after``: state and label sets stay bounded
        under discovery churn."""
        keep = self.config.discovery.forget_after
        while True:
            await asyncio.sleep(min(60.0, max(0.05, keep / 4)))
            self.forget_retired(time.monotonic() - keep)

    def forget_retired(self, removed_before: float) -> None:
        """Forget the streams of sources removed before ``removed_before`` (monotonic) and not back."""
        gone = {k for k, (_pos, _top, at, _seqr) in self._retired.items() if at < removed_before}
        now = time.time()
        for key in gone:
            del self._retired[key]
            self.checkpointer.forget(key, now)
            if self.tracker is not None:  # its room back; what the sinks hold of it stays there
                source, _, rank = key.rpartition("/")
                self.tracker.forget(Stream(source, int(rank)))
        self.checkpointer.prune(now)
        active = {p.stream.source for p in self.pipelines.values()}
        retired = {k.rsplit("/", 1)[0] for k in self._retired}
        for source in {k.rsplit("/", 1)[0] for k in gone} - active - retired:
            self.metrics.forget_source(source)
            log.info("removed source forgotten", extra={"source": source})

    async def _idle_probe_loop(self) -> None:
        quiet = self.config.replay.idle_probe
        while True:
            await asyncio.sleep(min(1.0, quiet))
            now = time.monotonic()
            for pipeline in list(self.pipelines.values()):
                if pipeline.replay_endpoint is not None and now - pipeline.last_activity >= quiet:
                    await pipeline.probe()

    # -- state (sinks with state.enabled) ----------------------------------------------------------
    def _state_switched_off(self, record: Record) -> None:
        s = record.stream
        self.metrics.state_switched_off.labels(s.source).inc()
        log.warning(
            "state.max_entries reached: this stream's state is switched off (cleared, complete: false) until its "
            "next reset; its events keep flowing",
            extra={"stream": s.key, "entries": self.tracker.total if self.tracker else None},
        )

    def _state_lost(self, stream: Stream, after: tuple[int, int] | None) -> None:
        if self.tracker is not None:
            self.tracker.invalidate(stream, after)

    async def load_state(self, streams: Sequence[Stream]) -> None:
        """Before ``streams`` start: read back what every state sink holds of them (all at once, each
        within ``state.load_timeout``) and rebuild the tracker from it, so that a restarted bridge
        goes on changing the sinks' state key by key. A stream is rebuilt only when every state sink
        holds it in the same (epoch, generation), from the one that is furthest behind (a sink
        ahead gets the records since again: each change sets a key to its value, so that is
        harmless); otherwise its first record clears it everywhere (a new generation, incomplete
        until the engine's next reset)."""
        tracker = self.tracker
        if tracker is None:
            return
        wanted = [s for s in streams if tracker.head(s) is None]
        if not wanted:
            return
        reads = await asyncio.gather(*(self._read_state(c, wanted) for c in self._state_sinks))
        got_of = {s.key: [r.get(s.key, "unknown") for r in reads] for s in wanted}  # per stream, each sink's
        acked_of = {s.key: self.checkpointer.position(s.key) for s in wanted}
        # What records each state sink still holds, of every stream it holds a state of or should
        # (a loss of records alone, the state intact, is a loss all the same: an events topic
        # deleted, a stream kept in memory).
        asked: list[list[Stream]] = [[] for _ in self._state_sinks]
        for stream in wanted:
            if acked_of.get(stream.key) is not None:
                for i, held in enumerate(got_of[stream.key]):
                    if self._state_at(i, held) != _NOWHERE:
                        asked[i].append(stream)
        records = await asyncio.gather(*(self._records_held(c, a) for c, a in zip(self._state_sinks, asked, strict=True)))
        for conn, streams_asked, held_records in zip(self._state_sinks, asked, records, strict=True):
            # (what the sink holds could not be told: its mark of what it stored is checked instead)
            self._held_unknown.update((s.key, conn.name) for s in streams_asked if s.key not in held_records)
        rebuilt = fresh = 0
        for stream in wanted:
            got = got_of[stream.key]
            held = [g for g in got if isinstance(g, tuple)]
            for head, _ in held:  # a stream started afresh must open a generation above what sinks hold
                tracker.generation_base = max(tracker.generation_base, head.generation + 1)
            acked = acked_of.get(stream.key)
            if acked is not None and self._behind_at_start(stream, got, acked, records):
                # A sink acknowledged records past the state it holds (restored from an older
                # backup, say): they will not come again, so its state cannot follow them (I6).
                fresh += 1
                continue
            if held and len(held) == len(got) and len({(h.epoch, h.generation) for h, _ in held}) == 1:
                head, entries = min(held, key=lambda g: (g[0].epoch, g[0].seq))
                short = [(len(e), h.live) for h, e in held if len(e) < h.live]
                if short:
                    # A sink's entries gone that no write removed (a topic's retention or
                    # DeleteRecords, a hash or bucket trimmed by hand), here or while no bridge ran:
                    # its head no longer describes what it holds (I6), whichever sink it is.
                    log.warning(
                        "a sink's state of this stream holds fewer entries than its head counts (entries lost outside "
                        "the bridge): it is cleared at its first record and incomplete until the engine's next reset",
                        extra={"stream": stream.key, "entries": short[0][0], "live": short[0][1]},
                    )
                    fresh += 1
                    continue
                if tracker.seed(stream, head, entries):
                    rebuilt += 1
                    continue
            fresh += 1
            if held:
                log.warning(
                    "the sinks' state of this stream cannot be rebuilt (a sink holds none, or another generation): "
                    "it is cleared at its first record and incomplete until the engine's next reset",
                    extra={"stream": stream.key},
                )
        self.metrics.state_rebuilds.labels("rebuilt").inc(rebuilt)
        self.metrics.state_rebuilds.labels("fresh").inc(fresh)
        if rebuilt:
            log.info("state rebuilt from the sinks", extra={"count": rebuilt, "entries": tracker.total})

    def _state_at(self, i: int, held: Any) -> tuple[int, int]:
        """Where state sink ``i``'s state of a stream stands (what ``read_state`` gave of it):
        (epoch, seq) of its head; (-1, -1) for none where that sink kept state in the run that
        saved the checkpoint (it lost it); above every position when it cannot tell, or kept none."""
        if isinstance(held, tuple):
            return held[0].epoch, held[0].seq
        if held is None and self._state_sinks[i].name in self.checkpointer.held_state:
            return -1, -1
        return _NOWHERE

    def _behind_at_start(
        self, stream: Stream, got: Sequence[Any], acked: ckpt.StreamPosition, records: Sequence[Mapping[str, Any]]
    ) -> bool:
        """What each state sink lost of ``stream`` while no bridge ran (``got``: what each state
        sink's state holds, in their order; ``records``: the last record each holds, from
        ``_records_held``), against what every sink acknowledged (``acked``, the checkpoint's
        position): a server restored from an older snapshot, restarted empty, an events topic or
        stream deleted. A sink's state behind is cleared at the stream's first record (True when
        one is). The records it lost are announced to that sink alone, ahead of the stream's first
        record (``SinkWorker.lost_at_start``), as a loss found at run time is (I6): from the first
        record it does not hold, or from its state's head when it cannot tell; in the epoch before
        the position's too (the last one with a batch), as far as the checkpoint knows where it
        ended (``ended``; an older epoch's tail is not known). A state lost alone (its key
        deleted, or not written for a run) loses no record; records lost alone clear the state as
        the announcement does."""
        ended = self.checkpointer.ended.get(stream.key)
        known = [p for p in (ended, acked) if p is not None and p.seq >= 0 and p.epoch <= acked.epoch]
        if len(known) == 2 and known[0].epoch == known[1].epoch:
            known = known[1:]
        top = (acked.epoch, acked.seq)
        behind = False
        for i, (conn, held) in enumerate(zip(self._state_sinks, got, strict=True)):
            state_at = self._state_at(i, held)
            if state_at == _NOWHERE:
                continue  # (it cannot tell, or kept no state: nothing to compare)
            last = records[i].get(stream.key, _UNKNOWN)
            at = state_at
            if (
                isinstance(last, ckpt.SinkPosition)
                and self.config.checkpoint.from_sinks
                and ckpt.resumes_from(last, [r.get(stream.key) for r in records])
            ):
                # The stream resumes from what this sink holds (take_over): what it lacks comes
                # again from the engine's buffer, or is announced as a gap, to it as to every sink.
                # (Not from a control record with no batch to verify the instance: announced here.)
                continue
            if isinstance(last, ckpt.SinkPosition):
                at = (last.epoch, last.first_missing() - 1)
                if acked.empty and at == (acked.epoch, acked.seq - 1):
                    at = top  # (the batch every sink acknowledged last holds no event: no message of it at event granularity)
            elif stream.key in getattr(conn, "records_gone", ()) or (
                last is None and (state_at < top or bool(getattr(conn, "nothing_held_is_known", False)))
            ):
                # It holds no record of the stream, and none was removed by its own limits: its
                # state is behind too, or the connector knows (Kafka says "nothing" only of a
                # partition that starts at offset 0, or a topic gone; NATS names the streams whose
                # events stream it found created again or gone, ``records_gone``).
                at = (-1, -1)
            elif state_at >= top:
                # Its state is not behind, and what its records hold cannot be told, or nothing
                # that may be its own limits' doing (a stream idle past the sink's retention).
                continue
            spans = [(stream, p.epoch, at[1] + 1 if at[0] == p.epoch else 0, p.seq) for p in known if at < (p.epoch, p.seq)]
            if state_at >= top and not spans:
                continue
            behind = True
            log.warning(
                "a sink lost what it held of this stream while no bridge ran: its state is cleared at the stream's first "
                "record, incomplete until the engine's next reset"
                + ("; the records it lost are announced to it" if spans else ""),
                extra={"sink": conn.name, "stream": stream.key, "held_seq": at[1], "acknowledged_seq": acked.seq},
            )
            if spans:
                self._lost_at_start.setdefault(id(conn), []).extend(spans)
                self._held_unknown.discard((stream.key, conn.name))  # (told: the mark adds nothing)
        return behind

    async def _records_held(self, conn: Connector, streams: list[Stream]) -> Mapping[str, Any]:
        """The last record one state sink holds of each of ``streams`` (``positions``; None: none);
        a stream it cannot tell of (or a sink that cannot say, or does not answer in time) is
        left out."""
        if not streams or not isinstance(conn, PositionReader):
            return {}
        try:
            async with asyncio.timeout(self.config.state.load_timeout):
                return _as_held(conn, await conn.positions(streams))
        except Exception as exc:  # TimeoutError, a connector error, a client's own
            log.error(
                "cannot read back what the sink holds: a state behind is announced lost from its head; records lost "
                "beside a state that is not behind are not seen",
                extra={"sink": conn.name, "count": len(streams), "error": str(exc) or type(exc).__name__},
            )
            return {}

    async def _read_state(self, conn: Connector, streams: list[Stream]) -> dict[str, Any]:
        """What one state sink holds of ``streams``; nothing (every stream unknown) when it cannot say."""
        if not isinstance(conn, StateReader):
            return {}
        try:
            async with asyncio.timeout(self.config.state.load_timeout):
                return dict(await conn.read_state(streams))
        except Exception as exc:  # TimeoutError, a connector error, a client's own
            log.error(
                "cannot read the state back from the sink: these streams' state starts afresh (cleared)",
                extra={"sink": conn.name, "count": len(streams), "error": str(exc) or type(exc).__name__},
            )
            return {}

    # -- handover (checkpoint.from_sinks) --------------------------------------------------------
    async def _connect_early(self, connectors: Sequence[tuple[Connector, SinkConfig]]) -> None:
        """Connect the sinks read before streams start (positions, state), each retried with capped,
        jittered backoff within its bound (a sink that comes up a few seconds after the bridge must
        not start every stream afresh), before their workers start (``connect()`` again is a no-op
        for them); one still unreachable at its bound is read as unknown."""

        async def connect(conn: Connector, sink: SinkConfig) -> None:
            timeout = max(
                self.config.checkpoint.from_sinks_timeout if isinstance(conn, PositionReader) else 0.0,
                self.config.state.load_timeout if conn in self._state_sinks else 0.0,
            )
            retry = sink.retry
            backoff = Backoff(retry.initial_backoff, retry.max_backoff, retry.multiplier, retry.jitter)
            deadline = time.monotonic() + timeout
            attempt = 0
            while True:
                attempt += 1
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        await conn.connect()
                    return
                except Exception as exc:  # TimeoutError, NotConnected, a client's own error
                    error = str(exc) or type(exc).__name__
                pause = backoff.delay(attempt)
                if time.monotonic() + pause >= deadline:
                    break
                if attempt == 1:
                    log.warning(
                        "sink not reachable before streams start: retrying until its bound",
                        extra={"sink": conn.name, "error": error, "timeout": timeout},
                    )
                await asyncio.sleep(pause)
            log.error(
                "sink not reachable before streams start: their positions (checkpoint.from_sinks) and state are read as unknown",
                extra={"sink": conn.name, "error": error, "attempts": attempt},
            )

        await asyncio.gather(*(connect(c, sink) for c, sink in connectors))

    async def take_over(self, streams: Sequence[Stream]) -> None:
        """Before ``streams`` start: ask every sink what it holds of them (all sinks at once, each
        within ``checkpoint.from_sinks_timeout``), set where each resumes and what each sink skips
        (:func:`bridge.checkpoint.combine`). Streams this process ran already resume where they
        stopped and are not asked for."""
        wanted = [s for s in streams if s.key not in self.pipelines and s.key not in self._retired]
        if not wanted or not self.skips:
            return
        held = await asyncio.gather(*(self._positions(skip, wanted) for skip in self.skips))
        for stream in wanted:
            key = stream.key
            local = self.checkpointer.resume_position(key)
            acked = self.checkpointer.position(key)  # below local when local is an epoch opened after it
            handover = ckpt.combine(local, [h.get(key, "unknown") for h in held], acked)
            head = self.tracker.head(stream) if self.tracker is not None else None
            if handover.resume is None and head is not None and head.epoch > (handover.epoch or -1):
                # The state sinks hold the stream's state (read back by load_state) and no sink's
                # events anchor a resume: the new epoch goes above the state's, announced.
                handover = msgspec.structs.replace(handover, epoch=head.epoch)
            # A sink that reads positions and could not tell what it holds of the stream (its
            # events deleted, its read failed): a fresh start is announced (a SourceReset).
            unsure = any(isinstance(s.inner, PositionReader) and key not in h for s, h in zip(self.skips, held, strict=True))
            for skip, h in zip(self.skips, held, strict=True):
                # (holds nothing, or its records were deleted: had it held some before, it lost them)
                if (key in h and h[key] is None) or key in getattr(skip.inner, "records_gone", ()):
                    self._holds_nothing.add((key, skip.name))
            self.checkpointer.adopt(key, handover, unsure)
            resumed, top = self.checkpointer.resume_position(key), handover.top
            if resumed is not None:
                self._not_lost_after(stream, resumed)
            if head is not None and resumed is not None and (resumed.epoch, resumed.seq) > (head.epoch, head.seq):
                # The sinks hold messages past their state (a pod killed between the two writes):
                # the records in between will not come again, so the state cannot follow them.
                assert self.tracker is not None
                self.tracker.invalidate(stream)
                log.warning(
                    "the sinks hold messages past the stream's state (a pod killed between the two writes): its "
                    "state starts again, incomplete until the engine's next clear or restart",
                    extra={"stream": key, "state_seq": head.seq, "resume_seq": resumed.seq},
                )
            if top is not None and resumed is not None and handover.resume is not None and resumed.epoch == handover.resume.epoch:
                self._held_top[key] = top
            else:
                self._held_top.pop(key, None)  # a fresh start (a new epoch) knows nothing of the old one's seqs
            behind = handover.behind or [None] * len(self.skips)
            for skip, through, lag in zip(self.skips, handover.skip, behind, strict=True):
                if through is not None:
                    skip.through[key] = through
                else:
                    skip.through.pop(key, None)
                if lag is not None:
                    skip.behind[key] = lag
                else:
                    skip.behind.pop(key, None)
            if handover.resume != local:
                log.debug(
                    "stream resumes from what the sinks hold",
                    extra={
                        "stream": key,
                        "epoch": handover.resume.epoch if handover.resume else None,
                        "seq": handover.resume.seq if handover.resume else None,
                    },
                )

    def _not_lost_after(self, stream: Stream, resume: ckpt.StreamPosition) -> None:
        """What the start check found a sink lost of ``stream`` (load_state) past where the stream
        resumes is not lost: it comes again from the engine's buffer (or a gap says what does not).
        The check spares a sink the stream resumes from (``resumes_from``), but it sees only the
        state sinks' positions; another sink's batch can anchor the resume too (combine)."""
        for conn, spans in self._lost_at_start.items():
            kept = []
            for span in spans:
                s, epoch, first, last = span
                if s.key == stream.key and epoch == resume.epoch and last > resume.seq:
                    if first <= resume.seq:
                        kept.append((s, epoch, first, resume.seq))
                    continue
                kept.append(span)
            self._lost_at_start[conn] = kept

    async def _positions(self, skip: SkipHeld, streams: list[Stream]) -> dict[str, ckpt.Held]:
        """What one sink holds of ``streams``; nothing (every stream unknown) when it cannot say."""
        reader = skip.inner
        if not isinstance(reader, PositionReader):
            return {}
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.checkpoint.from_sinks_timeout):
                found = await reader.positions(streams)
        except Exception as exc:  # TimeoutError, a connector error, a client's own
            names = [s.key for s in streams]
            log.error(
                "cannot read stream positions from the sink: these streams resume from the checkpoint file "
                "(or afresh, in a new epoch announced by a SourceReset), and the sink may get records it holds again",
                extra={
                    "sink": skip.name,
                    "stream": ", ".join(names[:20]) + (f" (+{len(names) - 20} more)" if len(names) > 20 else ""),
                    "count": len(names),
                    "error": str(exc) or type(exc).__name__,
                },
            )
            return {}
        found = _as_held(reader, found)
        unknown = [s.key for s in streams if s.key not in found]
        if unknown:
            log.warning(
                "the sink cannot tell what it holds of these streams: they resume from the checkpoint file (or afresh, "
                "in a new epoch announced by a SourceReset)",
                extra={"sink": skip.name, "stream": ", ".join(unknown[:20]), "count": len(unknown)},
            )
        log.info(
            "stream positions read from the sink",
            extra={
                "sink": skip.name,
                "count": len(streams),
                "held": sum(1 for v in found.values() if v is not None),
                "seconds": round(time.perf_counter() - started, 4),
            },
        )
        return dict(found)

    # -- checkpoint -----------------------------------------------------------------------------
    @property
    def checkpointer(self) -> ckpt.Checkpointer:
        return self.store.checkpointer

    async def persist_epochs(self) -> None:
        """Return once the epochs opened so far are saved (see CheckpointStore.persist)."""
        await self.store.persist()

    # -- health ---------------------------------------------------------------------------------
    def _saved(self, at: float | None) -> None:
        """A checkpoint save ended (in its thread): at ``at``, or failed (None)."""
        if at is None:
            self.metrics.checkpoint_save_failures.inc()
        else:
            self.metrics.checkpoint_saved.set(at)

    def readiness(self, detail: bool = True) -> tuple[bool, dict[str, Any]]:
        """Ready: no background task failed, every sink connected, every source subscribed, the
        checkpoint (if any) saved at its last try, and,
        once ``ingest.connect_grace`` has passed since start-up, at least one engine connected
        and answering with batches it can decode (a bridge that reads nothing is not ready; one
        engine down among several is not enough to say so). The detail names each sink's state,
        and why sources are not connected, not answering or not decodable.

        ``detail=False``: the verdict alone, with an empty detail (what every scrape keeps
        ``kv_bridge_ready`` current with): one pass over the streams that stops at the first
        one not subscribed, or the first connected and answering. With 10,000 streams the detail
        takes 5-20 ms of the loop."""
        if self._starting is not None:
            self.metrics.ready.set(0)
            return False, ({"not_ready": f"starting: {self._starting}"} if detail else {})
        readers = self.readers
        pipelines = self.pipelines
        waiting: list[str] = []
        down: dict[str, str] = {}
        silent: list[str] = []
        garbled: dict[str, str] = {}
        if detail:
            waiting = sorted(k for k, r in readers.items() if not r.subscribed)
            down = {k: r.problem for k, r in readers.items() if r.problem is not None}
            silent = [k for k, p in pipelines.items() if p.silent and k not in down]
            garbled = {
                k: why for k, p in pipelines.items() if (why := p.undecodable) is not None and k not in down and not p.silent
            }
            any_waiting, all_down = bool(waiting), len(down) == len(readers)
            all_quiet = len(down) + len(silent) + len(garbled) >= len(readers)
        else:
            any_waiting = not all(r.subscribed for r in readers.values())
            # (not ready anyway while one waits; otherwise these stop at the first one connected)
            all_down = not any_waiting and all(r.problem is not None for r in readers.values())
            all_quiet = not any_waiting and all(
                r.problem is not None or (k in pipelines and _quiet(pipelines[k])) for k, r in readers.items()
            )
        unsaved = self.store.problem
        ready = self.failed is None and all(w.problem is None for w in self.workers) and not any_waiting and unsaved is None
        why = None
        if self._started_at is not None and time.monotonic() - self._started_at >= self.config.ingest.connect_grace:
            if not readers:
                why = f"discovery finds no engine at {self.discovery.config.name}" if self.discovery else "no source configured"
            elif all_down:
                why = "no source connected: see sources_not_connected"
            elif all_quiet and not silent and garbled:
                why = "no source sends anything decodable: see sources_not_decodable (the engine's kv-events encoder or topic)"
            elif all_quiet:
                why = "no source answers: see sources_not_answering and replay_not_usable (an engine frozen, hung or unreachable)"
            if why is not None:
                ready = False
        self.metrics.ready.set(1 if ready else 0)
        if not detail:
            return ready, {}
        sinks = {w.name: w.problem or "ok" for w in self.workers}
        out: dict[str, Any] = {"sinks": sinks, "sources_not_subscribed": waiting}
        if down:
            shown = dict(sorted(down.items())[:MAX_SHOWN])
            out["sources_not_connected"] = shown
            if len(down) > len(shown):
                out["sources_not_connected_more"] = len(down) - len(shown)
        replay = {k: p.replay_problem for k, p in pipelines.items() if p.replay_problem is not None}
        if replay:
            out["replay_not_usable"] = dict(sorted(replay.items())[:MAX_SHOWN])
        if silent:
            out["sources_not_answering"] = sorted(silent)[:MAX_SHOWN]
        if garbled:
            out["sources_not_decodable"] = dict(sorted(garbled.items())[:MAX_SHOWN])
        if why is not None:
            out["not_ready"] = why
        if unsaved is not None:
            out["checkpoint"] = unsaved
        if self.failed is not None:
            out["failed"] = repr(self.failed)
        return ready, out


async def run(config: Config, stop: asyncio.Event, *, registry: Registry | None = None) -> int:
    """Run until ``stop`` is set (or a background task fails); returns the process exit code."""
    bridge = Bridge(config, registry=registry)
    if not await _started(bridge, stop):
        return 0
    try:
        while not stop.is_set() and bridge.failed is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await stop.wait()
    finally:
        await bridge.stop()
    return 1 if bridge.failed is not None else 0


async def _started(bridge: Bridge, stop: asyncio.Event) -> bool:
    """Start ``bridge`` unless ``stop`` is set first: a SIGTERM while start-up waits for its sinks
    (up to ``state.load_timeout`` and ``checkpoint.from_sinks_timeout``) stops it at once. Stopped
    before any sink worker runs, nothing was read: the connectors opened are closed and the
    checkpoint file stays as it was. False when stopped."""
    starting = asyncio.ensure_future(bridge.start())
    waiting = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if starting.done():
        starting.result()  # its error, if it failed
        return True
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await starting
    log.info("stopped during start-up")
    if bridge.workers:
        await bridge.stop()
    else:
        await bridge.close_unstarted()
    return False


def streams_of(source: SourceConfig) -> list[Stream]:
    """The engine streams of one source: one per data-parallel rank."""
    return [Stream(source.name, rank, dict(source.labels)) for rank in range(source.dp_ranks)]


def _quiet(pipeline: StreamPipeline) -> bool:
    """A connected stream that delivers nothing usable: its engine frozen, or all it sends undecodable."""
    return pipeline.silent or pipeline.undecodable is not None
