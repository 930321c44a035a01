"""The bridge runtime: builds sources, pipelines, sinks and endpoints from a Config and runs them.

``Bridge`` is an async context manager (``async with Bridge(config) as b: ...``), which is what the
CLI and tests use; :func:`run` is the whole program given a config and a stop event. Shutdown
goes in a fixed order within ``shutdown_timeout``: stop ingest and replays, flush every sink
queue, save the checkpoint, close the connectors and the endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import zmq
import zmq.asyncio

from . import checkpoint as ckpt
from .config import Config, SourceConfig
from .connector import Registry
from .deadletter import DeadLetters
from .discovery import Discovery
from .endpoints import for_rank
from .errors import ConfigError, DecodeError
from .fanout import Fanout
from .formats import Renderer
from .health import HealthServer
from .metrics import Metrics
from .records import Record, Stream
from .sink import SinkWorker
from .source import SourceReader
from .stream import StreamPipeline

log = logging.getLogger("bridge")


class Checkpointer:
    """Tracks, per stream and sink, the last record acknowledged; the checkpoint is their minimum."""

    def __init__(self, sinks: int, loaded: dict[str, ckpt.StreamPosition]) -> None:
        self.sinks = sinks
        self.loaded = loaded
        self._acked: dict[str, list[tuple[int, int, float | None] | None]] = {}

    def on_ack(self, sink: int, records: list[Record]) -> None:
        acked = self._acked
        for r in records:
            key = r.stream.key
            row = acked.get(key)
            if row is None:
                base = self.loaded.get(key)
                init = (base.epoch, base.seq, base.ts) if base is not None else None
                row = acked[key] = [init] * self.sinks
            if r.kind == "SourceReset":
                row[sink] = (r.epoch, -1, None)
            else:
                row[sink] = (r.epoch, r.seq, r.ts if r.kind == "batch" else None)

    def position(self, key: str) -> ckpt.StreamPosition | None:
        """The checkpoint position of one stream (None: nothing known)."""
        row = self._acked.get(key) or []
        acked = [p for p in row if p is not None]
        if not acked or len(acked) < len(row):  # a sink that acknowledged nothing of it yet
            return self.loaded.get(key)
        epoch, seq, ts = min(acked, key=lambda p: (p[0], p[1]))
        return ckpt.StreamPosition(epoch, seq, ts)

    def snapshot(self) -> dict[str, ckpt.StreamPosition]:
        out = dict(self.loaded)
        for key in self._acked:
            pos = self.position(key)
            if pos is not None:
                out[key] = pos
        return out


class Bridge:
    """One running bridge. See the module docstring."""

    def __init__(self, config: Config, *, registry: Registry | None = None, metrics: Metrics | None = None) -> None:
        self.config = config
        self.registry = registry or Registry()
        self.metrics = metrics or Metrics()
        self.dead_letters = DeadLetters(config.dead_letter.path)
        self.zmq_context = zmq.asyncio.Context()
        # libzmq allows 1,023 sockets per context unless told otherwise, and every stream holds
        # three (SUB, and the two ends of its monitor): the process's descriptor limit is the bound.
        self.zmq_context.set(zmq.MAX_SOCKETS, max(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
        # Sockets accept IPv6 endpoints (tcp://[::1]:5557) as well as IPv4 ones.
        self.zmq_context.setsockopt(zmq.IPV6, 1)
        self.replay_slots = asyncio.Semaphore(config.replay.max_concurrent)
        self.workers: list[SinkWorker] = []
        self.fanout = Fanout([])
        # False when every sink forwards only the engine's bytes (format raw, and a connector that
        # says it reads nothing else): batches are then counted by event type, not decoded.
        self.needs_events = True
        self.pipelines: dict[str, StreamPipeline] = {}
        self.readers: dict[str, SourceReader] = {}
        self._reader_tasks: dict[str, asyncio.Task[None]] = {}
        self._retired: dict[str, ckpt.StreamPosition] = {}  # positions of removed sources, for their return
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed: BaseException | None = None
        self.stopped = asyncio.Event()
        self.checkpointer = Checkpointer(0, {})
        self.health: HealthServer | None = None
        self._checkpoint_task: asyncio.Task[None] | None = None
        self.discovery: Discovery | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> Bridge:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        cfg = self.config
        connectors = []
        problems: list[str] = []
        for i, sink in enumerate(cfg.sinks):
            try:
                connectors.append(self.registry.build(sink, i))
            except ConfigError as exc:
                problems.extend(exc.problems)
        if problems:
            raise ConfigError(problems)
        loaded = self._load_checkpoint()
        self.checkpointer = Checkpointer(len(cfg.sinks), loaded)
        renderers: dict[tuple[str, str, str], Renderer] = {}
        for i, (sink, conn) in enumerate(zip(cfg.sinks, connectors, strict=True)):
            key = (sink.format, sink.granularity, sink.hash_format)
            renderer = renderers.setdefault(key, Renderer(sink.format, sink.granularity, sink.hash_format))
            worker = SinkWorker(i, sink, conn, renderer, self.metrics, self.dead_letters, self.checkpointer.on_ack)
            self.workers.append(worker)
            self._watch(worker.start())
        self.fanout = Fanout(self.workers)
        self.needs_events = any(
            sink.format != "raw" or getattr(conn, "needs_events", True) for sink, conn in zip(cfg.sinks, connectors, strict=True)
        )
        if cfg.metrics.listen:
            self.health = HealthServer(cfg.metrics.listen, self.metrics.exposition, self.readiness)
            await self.health.start()
        for source in cfg.sources:
            await self.add_source(source)
        if cfg.discovery.dns is not None:
            self.discovery = Discovery(
                cfg.discovery.dns, self, registry=self.metrics.registry, reserved=[s.name for s in cfg.sources]
            )
            await self.discovery.start()
        if cfg.replay.idle_probe > 0:
            self.spawn(self._idle_probe_loop(), "idle-probe")
        if cfg.checkpoint.path:
            self._checkpoint_task = self._watch(asyncio.create_task(self._checkpoint_loop(), name="checkpoint"))
        log.info("bridge started", extra={"sources": len(self.readers), "sinks": len(self.workers)})

    async def add_source(self, source: SourceConfig) -> None:
        """Subscribe to every rank of ``source`` (also used by discovery at run time)."""
        replay_on_start = source.replay_on_start if source.replay_on_start is not None else source.replay_endpoint is not None
        for rank in range(source.dp_ranks):
            stream = Stream(source.name, rank, dict(source.labels))
            if stream.key in self.pipelines:
                continue
            # A stream read before in this process resumes exactly where it stopped; otherwise from
            # the checkpoint (what every sink acknowledged), or fresh.
            pos = self._retired.pop(stream.key, None) or self.checkpointer.position(stream.key)
            pipeline = StreamPipeline(
                self,
                stream,
                replay_endpoint=for_rank(source.replay_endpoint, rank) if source.replay_endpoint else None,
                replay_on_start=replay_on_start,
                epoch=pos.epoch if pos else 0,
                delivered=pos.seq if pos else None,
                delivered_ts=pos.ts if pos else None,
            )
            reader = SourceReader(
                pipeline,
                self.zmq_context,
                for_rank(source.endpoint, rank),
                bind=source.bind,
                topic=source.topic,
                ingest=self.config.ingest,
            )
            self.pipelines[stream.key] = pipeline
            self.readers[stream.key] = reader
            self._reader_tasks[stream.key] = self._watch(asyncio.create_task(reader.run(), name=f"source:{stream.key}"))
            await pipeline.start()

    async def remove_source(self, name: str) -> None:
        """Stop reading every rank of source ``name``; what it delivered stays checkpointed."""
        for key in [k for k, p in self.pipelines.items() if p.stream.source == name]:
            task = self._reader_tasks.pop(key)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pipeline = self.pipelines.pop(key)
            await pipeline.stop()
            self._retired[key] = ckpt.StreamPosition(*pipeline.sequencer.resume_point())
            self.readers.pop(key)

    async def stop(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        deadline = time.monotonic() + self.config.shutdown_timeout
        # 1. stop discovery (no source comes or goes from here on), ingest and replays
        if self.discovery is not None:
            await self.discovery.stop()
        for task in self._reader_tasks.values():
            task.cancel()
        await asyncio.gather(*self._reader_tasks.values(), return_exceptions=True)
        for p in self.pipelines.values():
            await p.stop()
        # 2. flush every sink queue (bounded)
        for w in self.workers:
            if not await w.flush(max(0.1, deadline - time.monotonic())):
                n, size = w.queued
                log.warning("sink not flushed before the shutdown deadline", extra={"sink": w.name, "batches": n, "bytes": size})
        # 3. checkpoint what every sink acknowledged
        if self._checkpoint_task is not None:
            self._checkpoint_task.cancel()
            await asyncio.gather(self._checkpoint_task, return_exceptions=True)
        self.save_checkpoint()
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

    async def _idle_probe_loop(self) -> None:
        quiet = self.config.replay.idle_probe
        while True:
            await asyncio.sleep(min(1.0, quiet))
            now = time.monotonic()
            for pipeline in list(self.pipelines.values()):
                if pipeline.replay_endpoint is not None and now - pipeline.last_activity >= quiet:
                    await pipeline.probe()

    # -- checkpoint -----------------------------------------------------------------------------
    def _load_checkpoint(self) -> dict[str, ckpt.StreamPosition]:
        path = self.config.checkpoint.path
        if not path:
            return {}
        try:
            loaded = ckpt.load(path)
        except ckpt.CheckpointError as exc:
            log.error("checkpoint unusable, starting fresh", extra={"error": str(exc)})
            return {}
        if loaded:
            log.info("resuming from checkpoint", extra={"path": path, "streams": len(loaded)})
        return loaded

    def save_checkpoint(self) -> None:
        path = self.config.checkpoint.path
        if not path:
            return
        try:
            ckpt.save(path, self.checkpointer.snapshot())
        except OSError as exc:
            log.error("cannot save the checkpoint", extra={"path": path, "error": str(exc)})

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint.interval)
            await asyncio.to_thread(self.save_checkpoint)

    # -- health ---------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        sinks = {w.name: ("ok" if w.connected else (w.last_error or "not connected")) for w in self.workers}
        waiting = sorted(k for k, r in self.readers.items() if not r.subscribed)
        ready = self.failed is None and all(w.connected for w in self.workers) and not waiting
        self.metrics.ready.set(1 if ready else 0)
        detail: dict[str, Any] = {"sinks": sinks, "sources_not_subscribed": waiting}
        if self.failed is not None:
            detail["failed"] = repr(self.failed)
        return ready, detail

    # -- shared helpers for pipelines -------------------------------------------------------------
    def decode_failure(
        self,
        stream: Stream,
        exc: DecodeError,
        seq: int | None,
        frames: Sequence[bytes] | None,
        payload: bytes | None = None,
        *,
        index: int | None = None,
    ) -> None:
        """Count, log (rate-limited by the log filter) and dead-letter one decode failure."""
        self.metrics.decode_failures.labels(stream.source, exc.reason).inc()
        self.metrics.dead_letters.labels(exc.reason).inc()
        if payload is None and frames is not None:
            payload = b"".join(bytes(f)[:4096] for f in frames[:4])
        log.warning("decode failure", extra={"stream": stream.key, "seq": seq, "reason": exc.reason, "error": exc.detail})
        self.dead_letters.write(
            reason=exc.reason,
            source=stream.source,
            dp_rank=stream.dp_rank,
            seq=seq,
            detail=exc.detail,
            payload=payload,
            extra={"index": index, "frames": len(frames)} if frames is not None else {"index": index},
        )


async def run(config: Config, stop: asyncio.Event, *, registry: Registry | None = None) -> int:
    """Run until ``stop`` is set (or a background task fails); returns the process exit code."""
    bridge = Bridge(config, registry=registry)
    await bridge.start()
    try:
        while not stop.is_set() and bridge.failed is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        await bridge.stop()
    return 1 if bridge.failed is not None else 0
