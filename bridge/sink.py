"""One sink's delivery loop: bounded queue, batching, retries, backpressure, acknowledgements.

This is the one shared mechanism every connector uses (style.md: "retry, backoff, batching,
bounded queues and backpressure live once"). A :class:`SinkWorker` owns a queue of records
bounded in batches and bytes, takes up to ``batch.max_messages`` / ``batch.max_bytes`` at a
time, renders them in the sink's format, and calls ``connector.write`` until it succeeds:

- ``NotConnected`` / ``Retriable`` / a write timeout: retried after capped, jittered backoff
  (forever: retried is not dropped); the sink is not ready meanwhile and its queue fills, which
  blocks ingest (``backpressure: block``) or drops new batches (``drop``, announced downstream
  with one ``EventsLost`` per dropped span once there is room again);
- ``Permanent``: the batches go to the dead-letter destination, and the stream goes on; the
  batches refused are announced to this sink (an ``EventsLost``, reason ``sink_refused:<sink>``,
  written next, after what goes again), so its consumers know what they miss (I6). A control
  record refused (an announcement: ``EventsLost``, ``SourceReset``, ...; see :func:`announces`)
  is never dead-lettered: what refuses it (a key of another type, a size limit lowered below it)
  refuses the whole stream, and its consumers would never learn what they lack. It is kept and
  retried like a transient failure (backoff, the sink not ready, the queue backing up) until the
  sink takes it, before anything later of its stream; except when the refusal is
  ``StreamRefused`` (the sink refuses the stream for as long as it runs: see :func:`kept_back`);
- ``SinkLost``: the sink lost messages it had acknowledged: each span is announced to this sink
  (``EventsLost``, reason ``sink_lost:<sink>``) ahead of the write, which goes again; a connector
  with ``audit()`` is also asked between writes (every ``AUDIT_INTERVAL``), so that a loss on a
  quiet stream is announced without waiting for the stream's next record;
- any other exception (a connector's bug, or a record it cannot handle): retried; when it comes
  again, the write is cut into single records, and a record whose write keeps failing that way
  while the connector's health check passes is dead-lettered and announced (I5: one record never
  stops a sink);
- ``PartialFailure``: :func:`fold` decides, per stream: from the stream's first transient failure
  on, every message of the stream is written again (in order, even those the sink took: its
  idempotence drops the copies); a message refused for itself (``Permanent``) before that point
  is dead-lettered; streams with no failure are done.

Records stay in the queue while they are written, so the byte bound covers in-flight data.
Control records (``SourceReset``, ``EventsLost``) are never dropped.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .backoff import Backoff
from .checkpoint import SinkPosition
from .config import SinkConfig
from .connector import Connector
from .deadletter import DeadLetters
from .errors import ConnectorError, NotConnected, PartialFailure, Permanent, Retriable, SinkLost, StreamRefused
from .formats import STATE_TYPE, Message, Renderer, state_message
from .metrics import Metrics
from .records import EMPTY_RECORD_BYTES, Record, Stream, events_lost
from .state import StateDelta

log = logging.getLogger("bridge.sink")

AckCallback = Callable[[int, list[Record]], None]

# How often an idle sink asks its connector's health(): a sink learns of an outage from a failed
# write, so without this an idle sink whose server went away would stay "ready" until traffic.
HEALTH_INTERVAL = 5.0

# How often a sink whose connector has ``audit()`` checks that its broker still holds what it
# acknowledged: a write checks it for its own streams, a quiet stream would wait for its next one.
AUDIT_INTERVAL = 15.0

# Batches in a row the sink refused for themselves (dead-lettered, announced) with none stored
# between: a sink refusing every batch (a size limit below every batch's size) is not ready,
# though connected; one refused batch among stored ones is not. Like UNDECODABLE_AFTER of sources.
REFUSED_AFTER = 5


UNEXPECTED_TRIES = 2
"""Writes of the same messages that may fail with an unclassified exception before the runtime
looks for the record that causes it (see ``SinkWorker._isolate``)."""

RETRY_FLOOR = 0.001
"""The shortest pause before a connector call is tried again, whatever ``retry.initial_backoff``
(which may be 0) or a connector's ``retry_after`` says: a sink that fails at once must not spin."""


def _batch_messages(messages: list[Message]) -> int:
    """How many of ``messages`` carry a batch's events (not its state change, nor an announcement)."""
    return sum(1 for m in messages if m.record.kind == "batch" and m.type != STATE_TYPE)


def _collect_failure() -> None:
    """Collect the young generations after a failed connector call, before its backoff.

    A failure leaves reference cycles (an exception, its traceback and the frames it holds, with
    whatever buffers those reference, in the connector and its client), which only the cycle
    collector frees; with ``python -m bridge``'s high young threshold (``cli.tune_gc``) and little
    else allocated during an outage, they would pile up for a long time. At most once per retry
    (every ``retry.initial_backoff`` at most), and the young generations are small.

    Call it where nothing refers to the failure any more: a collection survived is a promotion,
    and a failure promoted to the oldest generation stays until a full collection, which an
    outage may not see for minutes (one failure's buffers per retry)."""
    gc.collect(1)


@dataclass
class Outcome:
    """What to do after a write some of whose messages failed (see :func:`fold`)."""

    retry: list[int] = field(default_factory=list)  # indexes to write again, in write order
    dead: list[tuple[int, Permanent]] = field(default_factory=list)  # refused for themselves
    cause: ConnectorError | None = None  # why ``retry`` is retried (reported, counted)
    retry_after: float | None = None  # the longest wait a failure asked for, if any did


def announces(message: Message) -> bool:
    """Whether ``message`` tells consumers what they lack or must drop (a control record's own
    message: ``EventsLost``, ``SourceReset``, ``StateSeeded``), which is never dead-lettered: a
    refusal of it is retried as a transient failure is (see the module docstring)."""
    return message.record.kind != "batch" and message.type != STATE_TYPE


def kept_back(message: Message, error: ConnectorError | None) -> bool:
    """Whether ``message``, refused for itself with ``error``, is kept and retried rather than
    dead-lettered: an announcement (:func:`announces`), unless the sink refuses its whole stream
    for good (:class:`~bridge.errors.StreamRefused`)."""
    return announces(message) and not isinstance(error, StreamRefused)


def fold(messages: Sequence[Message], errors: Mapping[int, ConnectorError]) -> Outcome:
    """The one rule for partial failures, for every connector (design.md, "Delivery").

    Per stream (``message.record.stream``): every message from the first one that failed
    transiently on is retried, whether or not the sink took it, so a retried message is never
    written after a later message of its stream; a message refused for itself (``Permanent``)
    before that point is dead-lettered, never one that only followed a failure. An announcement
    refused for itself (:func:`announces`) counts as a transient failure: kept, never
    dead-lettered. The cause reported is the most severe transient one (``NotConnected`` over
    ``Retriable``), waiting the longest ``retry_after`` asked for.
    """
    first: dict[str, int] = {}  # stream key -> index of its first transient failure
    for i in sorted(errors):
        if not isinstance(errors[i], Permanent) or kept_back(messages[i], errors[i]):
            first.setdefault(messages[i].record.stream.key, i)
    out = Outcome()
    for i, m in enumerate(messages):
        start = first.get(m.record.stream.key)
        if start is not None and i >= start:
            out.retry.append(i)
            continue
        error = errors.get(i)
        if isinstance(error, Permanent):
            out.dead.append((i, error))
    transient = [errors[i] for i in sorted(first.values())]
    if transient:
        out.cause = next((e for e in transient if isinstance(e, NotConnected)), transient[0])
        waits = [e.retry_after for e in errors.values() if isinstance(e, Retriable) and e.retry_after is not None]
        out.retry_after = max(waits) if waits else None
    return out


def _held_back(messages: Sequence[Message], errors: Mapping[int, ConnectorError]) -> bool:
    """Whether every message of a write that goes again only waits behind a refusal (``not_sent``,
    see bridge.connector ``Stops``): no failure of the sink's, nothing to back off from."""
    return all(e.reason == "not_sent" for i, e in errors.items() if not isinstance(e, Permanent) or kept_back(messages[i], e))


def _reflected(record: Record) -> bool:
    """Whether the sink's state is past ``record`` already (a re-delivery: its change is stale)."""
    return isinstance(record.state, StateDelta) and record.state.stale


def _firsts(messages: Iterable[Message]) -> dict[str, tuple[Stream, tuple[int, int]]]:
    """Per stream of ``messages``, the stream and its lowest record position among them."""
    out: dict[str, tuple[Stream, tuple[int, int]]] = {}
    for m in messages:
        r = m.record
        if r.stream.key not in out or r.position < out[r.stream.key][1]:
            out[r.stream.key] = (r.stream, r.position)
    return out


def _placed(kept: Sequence[Message], announcements: Sequence[Message]) -> list[Message]:
    """``kept`` (messages to write again, in order) with each refusal announcement of
    :meth:`SinkWorker._refusals` before the first message of a later record of its stream: it is
    written where it stands (its ``seq``), after what remains of its batch."""
    out = list(kept)
    for a in announcements:
        key, at = a.record.stream.key, a.record.position
        where = next((n for n, m in enumerate(out) if m.record.stream.key == key and m.record.position > at), len(out))
        out.insert(where, a)
    return out


def _past(spans: Iterable[tuple[int, int]], first: int, last: int) -> int:
    """Where a loss the connector's own check finds (``first``..``last``), while announcements made
    at start (``spans``) are written, goes beyond them: the first seq after the start span it
    overlaps (what the sink holds before it, ``positions`` read it; what is past it is announced
    too: an engine that restarted meanwhile will not send it again); ``first`` when none does."""
    for f, t in spans:
        if f <= last and first <= t:
            first = max(first, t + 1)
    return first


class SinkWorker:
    """Delivers records to one connector. See the module docstring."""

    def __init__(
        self,
        index: int,
        config: SinkConfig,
        connector: Connector,
        renderer: Renderer,
        metrics: Metrics,
        dead_letters: DeadLetters,
        on_ack: AckCallback,
        on_state_lost: Callable[[Stream, tuple[int, int] | None], None] | None = None,
    ) -> None:
        self.index = index
        self.on_state_lost = on_state_lost
        self.config = config
        self.name = config.name
        self.connector = connector
        self.renderer = renderer
        self.metrics = metrics
        self.dead_letters = dead_letters
        self.on_ack = on_ack
        self.block = config.backpressure == "block"
        # Its connector writes the live-block state: each record's messages are followed by its
        # state message (formats.STATE_TYPE), written in the same write.
        self.writes_state = bool(getattr(connector, "writes_state", False))
        self.max_batches = config.queue.max_batches
        self.max_bytes = config.queue.max_bytes
        self.backoff = Backoff(
            config.retry.initial_backoff, config.retry.max_backoff, config.retry.multiplier, config.retry.jitter
        )
        self._queue: deque[Record] = deque()
        self._bytes = 0
        self._room = asyncio.Event()
        self._room.set()
        self._work = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._dropped: dict[str, Record] = {}  # per stream: the EventsLost of the span being dropped
        # Dropped spans queued and not yet checked against what the sink holds (ids), and the
        # (stream, epoch) pairs found past what it held before this process (see _unheld).
        self._unchecked: set[int] = set()
        self._past_held: set[tuple[str, int]] = set()
        self._state_gone: set[str] = set()  # streams whose state changes are not written until a clear
        # (stream, epoch, from_seq, to_seq) the runtime found this sink lost before the stream
        # started (at start-up, or a source added at run time): announced ahead of its records.
        self.lost_at_start: list[tuple[Stream, int, int, int]] = []
        # The records (ids) of the announcements made from lost_at_start, while they are written:
        # the connector's own check may find the same loss at that write (NATS reads its heads
        # against its stream), and what those not stored yet cover is not announced twice.
        self._start_records: set[int] = set()
        # Stream key -> reason of the refusal of its state last logged: told once while the sink
        # refuses it again and again (a state record too large for the sink at every write), until
        # the stream's state is written again.
        self._state_refusals_told: dict[str, str] = {}
        self.connected = False
        self.last_error: str | None = "not connected yet"
        # Why the sink refuses a stream for as long as it runs (a StreamRefused met): not ready
        # for good, though its other streams are written (see kept_back).
        self.refusing: str | None = None
        # Batches refused in a row (see REFUSED_AFTER), and the last refusal's reason.
        self._refused_run = 0
        self._refused_why = ""
        self._refused_messages = 0  # messages of batches the sink refused for themselves, ever
        self._task: asyncio.Task[None] | None = None
        self.health_interval = HEALTH_INTERVAL
        self._audit = getattr(connector, "audit", None)
        self._audit_at = time.monotonic() + AUDIT_INTERVAL
        # The last audit found the broker not answering (a frozen server keeps a client
        # "connected"): not ready, and audited again at each health check, until an audit or a
        # write succeeds.
        self._audit_failed = False
        # Read when scraped: always current, and nothing to update per record on the hot path.
        metrics.sink_queue_batches.labels(self.name).set_function(lambda: len(self._queue))
        metrics.sink_queue_bytes.labels(self.name).set_function(lambda: self._bytes)
        self._m_ok = metrics.sink_batches.labels(self.name, "delivered")
        self._m_events = metrics.sink_events.labels(self.name)
        self._m_dropped = metrics.sink_batches.labels(self.name, "dropped")
        self._m_dead = metrics.sink_batches.labels(self.name, "dead_lettered")
        self._m_send = metrics.sink_send_duration.labels(self.name)
        self._m_lag = metrics.lag.labels(self.name)
        self._n_ok = self._n_events = 0  # delivered since the last flush_metrics (see bridge.metrics)
        metrics.defer(self)
        self._m_retries = metrics.sink_retries.labels(self.name)
        self._m_up = metrics.sink_up.labels(self.name)
        metrics.sink_queue_limit_batches.labels(self.name).set(self.max_batches)
        metrics.sink_queue_limit_bytes.labels(self.name).set(self.max_bytes)
        self._m_up.set(0)

    # -- queue ------------------------------------------------------------------------------
    def has_room(self, size: int) -> bool:
        return not self._queue or (len(self._queue) < self.max_batches and self._bytes + size <= self.max_bytes)

    def has_room_for(self, n: int, size: int) -> bool:
        """Room for ``n`` more records of ``size`` bytes in all, within both bounds, and no dropped
        span waiting to be announced (its EventsLost takes a place too: offer them one by one)."""
        return not self._dropped and len(self._queue) + n <= self.max_batches and self._bytes + size <= self.max_bytes

    def push_all(self, records: Sequence[Record], size: int) -> None:
        """Queue ``records`` (``size`` bytes in all) after :meth:`has_room_for` said yes."""
        self._queue.extend(records)
        self._bytes += size
        self._idle.clear()
        self._work.set()
        if not self.has_room(0):
            self._room.clear()

    def _push(self, record: Record) -> None:
        self._queue.append(record)
        self._bytes += record.size
        self._idle.clear()
        self._work.set()
        if not self.has_room(0):
            self._room.clear()

    def offer(self, record: Record) -> bool:
        """Queue ``record`` if there is room (or apply the drop policy). False: caller must wait."""
        if record.kind != "batch":
            if self._dropped:
                self._flush_dropped(record.stream.key)
            self._push(record)  # control records are tiny and must never be dropped
            return True
        if self.has_room(record.size):
            if self._dropped:
                self._flush_dropped(record.stream.key)
            self._push(record)
            return True
        if self.block:
            self._room.clear()  # wait for the next settle, even if the queue is below its bounds
            return False
        self._drop(record)
        return True

    def force(self, record: Record) -> None:
        """Queue ``record`` even past the bounds (see Fanout.finish)."""
        self._push(record)

    async def wait_room(self) -> None:
        await self._room.wait()

    def _drop(self, record: Record) -> None:
        key = record.stream.key
        span = self._dropped.get(key)
        if span is not None and span.epoch == record.epoch and span.seq + 1 == record.seq:
            span.seq = record.seq
        else:
            self._flush_dropped(key)
            self._dropped[key] = events_lost(
                record.stream, record.epoch, record.seq, record.seq, f"sink_queue_full:{self.name}", time.time()
            )
        self._m_dropped.inc()
        # Not acknowledged here: the EventsLost that announces the span is, once delivered in
        # order after what is still queued, so the checkpoint never passes undelivered batches.

    def _flush_all_dropped(self) -> None:
        for key in list(self._dropped):
            self._flush_dropped(key)

    def _flush_dropped(self, key: str) -> None:
        span = self._dropped.pop(key, None)
        if span is not None:
            self._unchecked.add(id(span))  # (counted once checked: see _unheld)
            self._push(span)

    async def _unheld(self, records: list[Record], messages: list[Message]) -> list[Message]:
        """``messages`` with each dropped span among ``records`` announced only from the first
        batch the sink does not hold: the replay after a restart sends again what the last run
        stored, a full queue drops some of it, and those were delivered (I3). The connector's
        ``positions()`` says the last message it holds of the stream (``positions_before_run()``,
        where a sink keeps copies, with this process's copies left out); a span it holds whole is
        acknowledged unannounced. Once a span reaches past what it holds, the stream's later spans
        in that epoch are this process's own losses (not asked again). A connector without
        ``positions()``, or one that cannot tell, gets the span whole."""
        spans = [r for r in records if id(r) in self._unchecked]
        self._unchecked.difference_update(id(r) for r in spans)
        reader = getattr(self.connector, "positions_before_run", None) or getattr(self.connector, "positions", None)
        asked = {id(r) for r in spans if (r.stream.key, r.epoch) not in self._past_held} if reader is not None else set()
        held: Mapping[str, SinkPosition | None] = {}
        if reader is not None and asked:
            try:
                async with asyncio.timeout(self.config.retry.write_timeout):
                    held = await reader(list({r.stream.key: r.stream for r in spans if id(r) in asked}.values()))
            except Exception as exc:  # (cannot tell: announced whole)
                log.debug("reading what the sink holds failed", extra={"sink": self.name, "error": repr(exc)})
        changed: dict[int, list[Message]] = {}
        for r in spans:
            key, first = r.stream.key, r.from_seq if r.from_seq is not None else r.seq
            pos = held.get(key) if id(r) in asked else None
            if pos is not None and pos.epoch >= r.epoch:
                first = max(first, pos.first_missing() if pos.epoch == r.epoch else r.seq + 1)
            if id(r) in asked and key in held and first <= r.seq:  # (the sink's copy of the epoch ends before it)
                self._past_held.add((key, r.epoch))
            if first > r.seq:
                changed[id(r)] = []
                log.info(
                    "dropped batches the sink holds already (sent again after a restart): not announced",
                    extra={"sink": self.name, "stream": key, "from_seq": r.from_seq, "to_seq": r.seq},
                )
                continue
            if first != r.from_seq:
                r.from_seq = first
                changed[id(r)] = self.renderer.render(r)
            self.metrics.announced_lost(r)
        if not changed:
            return messages
        out: list[Message] = []
        for m in messages:
            again = changed.pop(id(m.record), None)
            if again is not None:
                out.extend(again)
            elif id(m.record) not in changed:
                out.append(m)
        return out

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._run(), name=f"sink:{self.name}")
        return self._task

    async def flush(self, timeout: float) -> bool:
        """Wait until everything queued is delivered (True) or ``timeout`` passes (False)."""
        self._flush_all_dropped()
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def last_audit(self, timeout: float) -> None:
        """At shutdown, once flushed: one audit more (bounded by ``timeout``), so that a loss the
        sink found during its last writes and keeps for the next one (a NATS stream whose
        sequence went back) is announced now, not never (I6)."""
        if self._audit is None or not self.connected or not self._idle.is_set():
            return
        try:
            async with asyncio.timeout(timeout):
                await self._run_audit()
        except TimeoutError:
            log.warning("sink's last audit timed out at shutdown", extra={"sink": self.name, "timeout": timeout})

    def flush_metrics(self) -> None:
        """Apply the counts gathered since the last flush (see bridge.metrics)."""
        if self._n_ok:
            self._m_ok.inc(self._n_ok)
            self._m_events.inc(self._n_events)
            self._n_ok = self._n_events = 0

    async def stop(self) -> None:
        task = self._task
        if task is not None:
            # Cancelled again until it ends: a cancel can be swallowed by a client call that
            # completes as it arrives (Python 3.11's wait_for inside a connect, seen with redis-py
            # over TLS at shutdown), and the worker would retry for ever with stop() waiting on it.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            if not task.cancelled():
                task.exception()  # (retrieved: its done-callback reported it already)
        self.flush_metrics()
        try:
            # Bounded here, like every call into a connector: a connector adds no timeout of its own.
            async with asyncio.timeout(self.config.retry.write_timeout):
                await self.connector.close()
        except TimeoutError:
            log.warning("sink close timed out", extra={"sink": self.name, "timeout": self.config.retry.write_timeout})
        except Exception as exc:  # close must not raise; if it does, say so once
            log.warning("sink close failed", extra={"sink": self.name, "error": str(exc)})

    @property
    def queued(self) -> tuple[int, int]:
        return len(self._queue), self._bytes

    # -- the loop ---------------------------------------------------------------------------
    async def _connect(self) -> None:
        attempt = 0
        while True:
            try:
                async with asyncio.timeout(self.config.retry.write_timeout):
                    await self.connector.connect()
                self._set_up()
                # A connect can succeed on a broker that refuses every write (a NATS stream that
                # takes no acks): ready only once the health check agrees, not a health_interval later.
                await self._check_health()
                return
            except (ConnectorError, TimeoutError, OSError) as exc:
                attempt += 1
                self._set_down(exc, attempt)
            _collect_failure()  # out of the except block: ``exc`` is gone
            await asyncio.sleep(max(RETRY_FLOOR, self.backoff.delay(attempt)))

    def _set_up(self) -> None:
        if not self.connected:
            log.info("sink connected", extra={"sink": self.name})
        self._audit_failed = False
        self.connected = True
        self.last_error = None
        self._m_up.set(1)

    def _set_down(self, exc: BaseException, attempt: int) -> None:
        reason = exc.reason if isinstance(exc, ConnectorError) else ("timeout" if isinstance(exc, TimeoutError) else "error")
        self.metrics.sink_errors.labels(self.name, reason).inc()
        message = str(exc) or type(exc).__name__
        if self.connected or attempt == 1 or attempt % 30 == 0:  # one line per state change, then rarely
            log.warning(
                "sink unavailable, retrying", extra={"sink": self.name, "reason": reason, "error": message, "attempt": attempt}
            )
        self.connected = False
        self.last_error = f"{reason}: {message}"
        self._m_up.set(0)

    async def _run(self) -> None:
        await self._connect()
        linger = self.config.batch.linger
        while True:
            await self._announce_lost_at_start()
            if not self._queue:
                self._idle.set()
                self._work.clear()
                await self._wait_for_work()
                if linger > 0 and len(self._queue) < self.config.batch.max_messages:
                    await asyncio.sleep(linger)
                await self._announce_lost_at_start()  # (handed on meanwhile: ahead of what woke it)
            records, messages, unrendered, size = self._take()
            if self._unchecked:
                messages = await self._unheld(records, messages)
            refused_before = self._refused_messages
            dead = await self._deliver(messages) if messages else set()
            if dead or self._refused_run:  # (else nothing refused and no run to end: no pass over the write)
                self._note_refusals(_batch_messages(messages) - (self._refused_messages - refused_before), len(dead))
            dead |= unrendered
            self._settle(records, dead, size)
            if self._audit_due():
                await self._run_audit()

    async def _announce_lost_at_start(self) -> None:
        """Announce what the runtime found this sink lost before its stream started (see
        ``lost_at_start``), ahead of anything of the stream queued after that."""
        if self.lost_at_start:
            exc = SinkLost("it holds less than it acknowledged before the stream started", self.lost_at_start)
            self.lost_at_start = []
            announced = self._announce_lost(exc, [])
            self._start_records = {id(m.record) for m in announced}
            try:
                if await self._deliver(announced):
                    log.error("announcements of lost messages dead-lettered", extra={"sink": self.name})
            finally:
                # Only the connector's own check of the same loss, while they are written, is told
                # by them: a loss found later (the topic deleted again) is announced whole.
                self._start_records = set()

    async def _wait_for_work(self) -> None:
        """Wait for records; meanwhile check the connector's health every ``health_interval``."""
        while True:
            try:
                async with asyncio.timeout(self.health_interval):  # unlike wait_for, no task per wait
                    await self._work.wait()
                return
            except TimeoutError:
                await self._check_health()
                if self._audit_due():
                    await self._run_audit()

    async def _check_health(self) -> None:
        problem = await self._health()
        if problem is None:
            if not self._audit_failed:  # (else the next audit says)
                self._set_up()
            return
        self._set_unhealthy("health", problem)

    def _set_unhealthy(self, what: str, problem: str) -> None:
        """Not a write failure (no sink_errors, no retry): only readiness and sink_up change, until
        the next health check or write that succeeds."""
        if self.connected:
            log.warning("sink unhealthy while idle", extra={"sink": self.name, "error": f"{what}: {problem}"})
        self.connected = False
        self.last_error = f"{what}: {problem}"
        self._m_up.set(0)

    def _take(self) -> tuple[list[Record], list[Message], set[int], int]:
        """Records from the head of the queue (left there), their messages, within the batch
        bounds, the ids of records that could not be rendered (dead-lettered, an EventsLost
        goes in their place), and the records' size (``Record.size``) in all."""
        records: list[Record] = []
        messages: list[Message] = []
        unrendered: set[int] = set()
        size = 0
        max_messages, max_bytes = self.config.batch.max_messages, self.config.batch.max_bytes
        render, state, gone = self.renderer.render, self.writes_state, self._state_gone
        written: set[str] = set()  # streams with a batch in this write
        for record in self._queue:
            record_size = len(record.payload) or EMPTY_RECORD_BYTES  # Record.size, inline (the hot path)
            if records and (len(messages) >= max_messages or size + record_size > max_bytes or record.kind == "SourceReset"):
                # A new epoch starts a write of its own: what a write refused of the old epoch is
                # announced (in that epoch) before the SourceReset reaches the sink (I3).
                break
            if record.kind == "batch":
                written.add(record.stream.key)
            elif record.stream.key in written:
                # An announcement after a batch of its stream starts a write of its own: a refusal
                # of that batch is announced where it stands, never at the announcement's seq
                # (see _refusals, for a connector that writes on past a refusal).
                break
            try:
                rendered = render(record)
            except Exception as exc:  # I5: any record (e.g. nested past the recursion limit) must not kill the sink
                self._dead_letter_record(record, "unrenderable", f"{type(exc).__name__}: {exc}")
                unrendered.add(id(record))
                lost = events_lost(record.stream, record.epoch, record.seq, record.seq, "unrenderable", record.received)
                self.metrics.announced_lost(lost)
                rendered = self.renderer.render(lost)
                if state and record.state is not None:
                    # Its events are not written, so neither is its state change: clear, incomplete.
                    self._state_lost(record.stream, record.position)
            records.append(record)
            messages.extend(rendered)
            if (
                state
                and record.state is not None
                and id(record) not in unrendered
                and (not gone or self._writes_state_of(record))
            ):
                messages.append(state_message(record))
            size += record_size
        return records, messages, unrendered, size

    def _writes_state_of(self, record: Record) -> bool:
        """Whether ``record``'s state change is written, while some stream's state is gone (see
        ``_state_lost``): yes unless it is of such a stream and does not clear it (the first one
        that does starts the sink's state afresh, and the stream's changes are written again)."""
        key = record.stream.key
        if key not in self._state_gone:
            return True
        if getattr(record.state, "clear", False):
            self._state_gone.discard(key)
            return True
        return False

    def _note_refusals(self, stored: int, refused: int) -> None:
        """After a write: ``stored`` messages of batches the sink took, ``refused`` batches it
        refused for themselves (dead-lettered). Any batch message stored ends a run of refusals
        (see REFUSED_AFTER); batches the bridge could not render are none of the sink's doing."""
        if stored > 0:
            self._refused_run = 0
        elif refused:
            run, self._refused_run = self._refused_run, self._refused_run + refused
            if run < REFUSED_AFTER <= self._refused_run:
                log.error(
                    "the sink refuses every batch: not ready until one is stored",
                    extra={"sink": self.name, "count": self._refused_run, "error": self._refused_why},
                )

    def _settle(self, records: list[Record], dead: set[int], size: int) -> None:
        """Remove ``records`` (``size`` bytes in all) from the queue and acknowledge them; ``dead``:
        ids of dead-lettered ones."""
        now = time.time()
        pop = self._queue.popleft
        lags: list[float] = []
        lag = lags.append
        delivered = events = dead_batches = 0
        for r in records:  # one pass: a write holds up to batch.max_messages records
            pop()
            if r.kind != "batch":
                continue
            if dead and id(r) in dead:  # each record once, however many of its messages were refused
                dead_batches += 1
                continue
            delivered += 1
            n = r.event_count
            events += n if n >= 0 else len(r.events)  # Record.n_events, inline
            ts = r.ts
            if ts is not None:
                lag(now - ts if now > ts else 0.0)
        self._bytes -= size
        self._m_lag.observe_all(lags)
        if self._state_refusals_told:  # a stream out of _state_gone here had its state written again
            gone = self._state_gone
            for key in [k for k in self._state_refusals_told if k not in gone]:
                del self._state_refusals_told[key]
        if dead_batches:
            self._m_dead.inc(dead_batches)
        self._n_ok += delivered
        self._n_events += events
        self.on_ack(self.index, records)
        if self.has_room(0):
            if self._dropped:  # announce each dropped span now that there is room, not at its stream's next batch
                self._flush_all_dropped()
            self._room.set()

    async def _deliver(self, messages: list[Message]) -> set[int]:
        """Write until delivered; returns the ids of records dead-lettered (counted once, not as delivered)."""
        attempt = unexpected = 0
        timeout = self.config.retry.write_timeout
        dead: set[int] = set()
        announced: set[int] = set()  # ids of refused records announced already (a record may be refused in two tries)
        while messages:
            start = time.perf_counter()
            retry_after: float | None = None
            error: BaseException
            try:
                async with asyncio.timeout(timeout):  # unlike wait_for, no task per write
                    await self.connector.write(messages)
                self._m_send.observe(time.perf_counter() - start)
                self._set_up()
                return dead
            except PartialFailure as exc:
                failed = {i: e for i, e in exc.errors.items() if 0 <= i < len(messages)}
                outcome = fold(messages, failed)
                refusals: list[Message] = []
                for cause, group in _by_cause(outcome.dead):
                    dead |= self._dead_letter_messages([messages[i] for i in group], cause)
                if outcome.dead:
                    taken = set(range(len(messages))).difference(outcome.retry, failed)
                    refusals = self._refusals(messages, [i for i, _ in outcome.dead], announced, taken)
                if outcome.cause is None or (outcome.dead and _held_back(messages, failed)):
                    # (held back only behind a refusal: the rest goes after its announcement, at once)
                    self._m_send.observe(time.perf_counter() - start)
                    self._set_up()
                    messages, attempt = _placed([messages[i] for i in outcome.retry], refusals), 0
                    continue
                n_kept = sum(
                    1 for i in outcome.retry if isinstance(exc.errors.get(i), Permanent) and kept_back(messages[i], exc.errors[i])
                )
                messages = _placed([messages[i] for i in outcome.retry], refusals)
                error = self._kept(outcome.cause, n_kept) if isinstance(outcome.cause, Permanent) else outcome.cause
                retry_after = outcome.retry_after
                del outcome, failed  # they hold the failure too (see _collect_failure)
            except Permanent as exc:
                kept = [m for m in messages if kept_back(m, exc)]
                refused = [m for m in messages if not kept_back(m, exc)]
                if refused:
                    dead |= self._dead_letter_messages(refused, exc)
                    attempt = 0  # progress: the announcements' retries back off from the start
                refusals = self._refusals(messages, range(len(messages)), announced)
                if not kept:
                    messages, attempt = refusals, 0
                    continue
                messages = _placed(kept, refusals)
                error = self._kept(exc, len(kept))
            except SinkLost as exc:
                messages = self._announce_lost(exc, messages)
                error = exc
                retry_after = RETRY_FLOOR if attempt == 0 else None  # at once, unless it comes again
            except (ConnectorError, TimeoutError, OSError) as exc:
                error = exc
                retry_after = getattr(exc, "retry_after", None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an unclassified error: the client's, or a record the connector cannot handle
                unexpected += 1
                detail = f"{type(exc).__name__}: {exc}"
                error = NotConnected(detail, reason="unexpected")
            if unexpected >= UNEXPECTED_TRIES:
                # Out of the except block, where the failure is still the one being handled (alive
                # while the isolation waits for the connector's health): see _collect_failure.
                del error
                _collect_failure()
                return dead | await self._isolate(messages, detail)
            attempt += 1
            self._m_retries.inc()
            if isinstance(error, SinkLost):  # the sink is up: only this write goes again
                self.metrics.sink_errors.labels(self.name, error.reason).inc()
            else:
                self._set_down(error, attempt)
            del error  # see _collect_failure
            _collect_failure()
            await asyncio.sleep(max(RETRY_FLOOR, retry_after if retry_after is not None else self.backoff.delay(attempt)))
        return dead

    def _kept(self, exc: Permanent, count: int) -> Permanent:
        """The failure reported (log, ``/readyz``) while ``count`` announcements the sink refused
        are kept and retried: ``exc``, saying so."""
        return Permanent(
            f"{exc} ({count} announcement(s) to this sink's consumers refused: kept and retried, nothing "
            "later of their stream is written until the destination takes them; fix the destination)",
            reason=exc.reason,
        )

    async def _isolate(self, messages: list[Message], detail: str) -> set[int]:
        """Deliver ``messages`` after an unclassified exception came again: record by record (in
        order, so each stream's order holds). A lone record is written once more when the
        connector's health check passes; if that raises it again, the record is what causes it:
        dead-lettered and announced, never retried as if the network had failed; a control record
        (an announcement) is kept instead, and written again after backoff until it goes through.
        Returns the ids of records dead-lettered."""
        runs: list[list[Message]] = []
        for m in messages:
            if runs and runs[-1][0].record is m.record:
                runs[-1].append(m)
            else:
                runs.append([m])
        if len(runs) > 1:
            dead: set[int] = set()
            for run in runs:
                dead |= await self._deliver(run)
            return dead
        attempt = 0
        while True:
            while (problem := await self._health()) is not None:  # the sink is not well: not this record's fault
                attempt += 1
                self._set_down(NotConnected(f"{detail} (health: {problem})", reason="unexpected"), attempt)
                await asyncio.sleep(max(RETRY_FLOOR, self.backoff.delay(attempt)))
            try:  # once more, with the connector healthy
                async with asyncio.timeout(self.config.retry.write_timeout):
                    await self.connector.write(messages)
                self._set_up()
                return set()
            except asyncio.CancelledError:
                raise
            except (ConnectorError, TimeoutError, OSError):  # a failure it knows: the usual handling
                return await self._deliver(messages)
            except Exception as exc:
                detail = f"{type(exc).__name__}: {exc}"
            refused = Permanent(f"unexpected error in the connector: {detail}", reason="unexpected")
            if not announces(messages[0]):
                break
            attempt += 1
            self._set_down(self._kept(refused, 1), attempt)
            del refused  # see _collect_failure
            _collect_failure()
            await asyncio.sleep(max(RETRY_FLOOR, self.backoff.delay(attempt)))
        dead = self._dead_letter_messages(messages, refused)
        return dead | await self._deliver(self._refusals(messages, range(len(messages)), set()))

    def _refusals(
        self, messages: Sequence[Message], refused: Sequence[int], announced: set[int], stored: Iterable[int] = ()
    ) -> list[Message]:
        """The ``EventsLost`` messages announcing the batches of ``messages[i] for i in refused``
        (dead-lettered) to this sink, to be written with the messages of the write that go again,
        placed by :func:`_placed` (I6). One per stream and epoch: its span runs from the first to
        the last batch refused (a batch between them that the sink stored is covered too: a
        consumer drops the stream's view either way). A record in ``announced`` is not announced
        again; those announced now are added to it.

        It stands right after the last batch refused (its ``seq``), unless the sink stored a later
        record of the stream in this write (``stored``: indexes of messages the sink took): a
        connector stops a stream at the record after one it refused (bridge.connector), so the
        place is the same however writes are cut, and a refusal met again (a replay after a
        restart) is announced at the same place, which the sink and consumers take for a copy.
        Otherwise it stands at the highest seq of its stream in the write, so that a consumer that
        orders by position does not take it for a copy (a write holds one epoch of a stream: see
        ``_take``)."""
        spans: dict[tuple[str, int], list[int]] = {}  # (stream, epoch) -> [first, last] refused
        streams: dict[str, Stream] = {}
        for i in refused:
            r = messages[i].record
            # not for a refused state change: its record's events were stored (the state is cleared)
            if r.kind != "batch" or messages[i].type == STATE_TYPE or id(r) in announced:
                continue
            announced.add(id(r))
            streams[r.stream.key] = r.stream
            span = spans.get((r.stream.key, r.epoch))
            if span is None:
                spans[(r.stream.key, r.epoch)] = [r.seq, r.seq]
            else:
                span[0], span[1] = min(span[0], r.seq), max(span[1], r.seq)
        if not spans:
            return []
        top = {at: last for at, (_, last) in spans.items()}  # where each span's announcement stands
        passed = set()  # spans of which the sink stored a later record (a connector that went on)
        for i in stored:
            r = messages[i].record
            at = (r.stream.key, r.epoch)
            if at in spans and r.position > (r.epoch, spans[at][1] + 1):
                passed.add(at)
        for m in messages if passed else ():
            at = (m.record.stream.key, m.record.epoch)
            if at in passed and m.record.seq > top[at]:
                top[at] = m.record.seq
        out: list[Message] = []
        now = time.time()
        for (stream_key, epoch), (first, last) in spans.items():
            lost = events_lost(streams[stream_key], epoch, first, last, f"sink_refused:{self.name}", now)
            lost.seq, lost.to_seq = top[(stream_key, epoch)], last
            self.metrics.announced_lost(lost)
            out.extend(self.renderer.render(lost))
        return out

    def _audit_due(self) -> bool:
        return self._audit is not None and (self.connected or self._audit_failed) and time.monotonic() >= self._audit_at

    async def _run_audit(self) -> None:
        """Ask the connector whether its broker still holds what it acknowledged; announce what it
        lost (as a write's SinkLost is), at once rather than at the stream's next write."""
        assert self._audit is not None
        self._audit_at = time.monotonic() + AUDIT_INTERVAL
        try:
            async with asyncio.timeout(self.config.retry.write_timeout):
                await self._audit()
            if self._audit_failed:
                self._set_up()  # (the broker answers again)
        except SinkLost as exc:
            if self._audit_failed:
                self._set_up()  # (it answers again: what it lost is announced below)
            self.metrics.sink_errors.labels(self.name, exc.reason).inc()
            announcements = self._announce_lost(exc, [])
            del exc  # see _collect_failure
            dead = await self._deliver(announcements)
            if dead:
                log.error("announcements of lost messages dead-lettered", extra={"sink": self.name, "count": len(dead)})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an audit that fails proves no loss: the next write checks again
            log.warning("sink audit failed", extra={"sink": self.name, "error": f"{type(exc).__name__}: {exc}"})
            if isinstance(exc, ConnectorError | TimeoutError | OSError):  # (the broker did not answer it: not ready)
                self._set_unhealthy("audit", str(exc) or type(exc).__name__)
                self._audit_failed = True
                self._audit_at = time.monotonic() + self.health_interval  # (again a health interval later, not after each write)

    def _announce_lost(self, exc: SinkLost, messages: list[Message]) -> list[Message]:
        """``messages`` preceded by the announcement of each span ``exc`` names that they do not
        announce already (I6); each stream named has its state cleared."""
        reason = f"sink_lost:{self.name}"
        have = {
            (m.record.stream.key, m.record.epoch, m.record.from_seq, m.record.lost_to)
            for m in messages
            if m.record.kind == "EventsLost" and m.record.reason == reason
        }
        out: list[Message] = []
        now = time.time()
        for stream in exc.states:
            extra = {"sink": self.name, "stream": stream.key, "error": str(exc)}
            log.error("the sink lost the state of a stream: cleared", extra=extra)
            self._state_lost(stream)
        # The announcements made at start that this write carries still (none stored yet).
        starting: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for m in messages:
            r = m.record
            if id(r) in self._start_records and r.from_seq is not None:
                starting.setdefault((r.stream.key, r.epoch), []).append((r.from_seq, r.lost_to))
        # The lowest seq each (stream, epoch) of the write carries whole (a batch, or an
        # announcement made since the start's): it comes again after the announcement, so it is
        # not lost (seqs would go back in the epoch: I2; and be delivered as well as announced:
        # I3). A batch carried from one of its later events on (the write goes again from the
        # failed message) is not whole: its first events were stored, and lost with the rest.
        carried: dict[tuple[str, int], int] = {}
        for m in messages:
            r = m.record
            if r.kind != "SourceReset" and id(r) not in self._start_records:
                at = (r.stream.key, r.epoch)
                low = r.from_seq if r.kind == "EventsLost" and r.from_seq is not None else r.seq
                low += 1 if m.index else 0
                if low < carried.get(at, low + 1):
                    carried[at] = low
        for stream, epoch, whole_first, whole_last in exc.spans:
            self._state_lost(stream)
            last = min(whole_last, carried.get((stream.key, epoch), whole_last + 1) - 1)
            first = _past(starting.get((stream.key, epoch), ()), whole_first, last)
            if first > last or {(stream.key, epoch, whole_first, last), (stream.key, epoch, first, last)} & have:
                continue  # (told at start, or by this write already)
            log.error(
                "the sink lost messages it had acknowledged: announced to its consumers",
                extra={
                    "sink": self.name,
                    "stream": stream.key,
                    "epoch": epoch,
                    "from_seq": first,
                    "to_seq": last,
                    "error": str(exc),
                },
            )
            lost = events_lost(stream, epoch, first, last, reason, now)
            lost.seq, lost.to_seq = max(last, exc.at.get((stream.key, epoch, whole_first, whole_last), last)), last
            self.metrics.announced_lost(lost)
            out.extend(self.renderer.render(lost))
        if starting:
            # Beside the announcements made at start (``messages``): each stream's in seq order.
            return sorted(out + messages, key=lambda m: (m.record.stream.key, m.record.position))
        return out + messages

    def _state_lost(self, stream: Stream, after: tuple[int, int] | None = None) -> None:
        """What the sink holds of ``stream``'s state is not what the tracker says any more: the
        tracker clears it at the stream's next record (a new generation, incomplete), and this sink
        writes none of the stream's state changes queued before that clear (each was computed on
        what the sink no longer holds: written, they would leave a partial state marked complete).
        ``after``: the position of the first record whose change the sink did not take (a
        refusal), when the loss is of that record alone (see StateTracker.invalidate)."""
        if self.writes_state:
            self._state_gone.add(stream.key)
            if self.on_state_lost is not None:
                self.on_state_lost(stream, after)

    async def _health(self) -> str | None:
        """The connector's health check, bounded: None when healthy, else why not."""
        try:
            async with asyncio.timeout(self.config.retry.write_timeout):
                return await self.connector.health()
        except TimeoutError:
            return "health check timed out"
        except Exception as exc:  # a health hook must not raise; if it does, that is its answer
            return f"health check failed: {type(exc).__name__}: {exc}"

    @property
    def problem(self) -> str | None:
        """Why the sink is not ready (None: it is): not connected, refusing a stream, or refusing
        every batch it is given (its last REFUSED_AFTER, none stored since)."""
        if not self.connected:
            return self.last_error or "not connected"
        if self.refusing is None and self._refused_run >= REFUSED_AFTER:
            return f"refusing every batch: the last {self._refused_run} were refused, none stored since ({self._refused_why})"
        return self.refusing

    def _dead_letter_messages(self, messages: list[Message], exc: ConnectorError) -> set[int]:
        self.metrics.sink_errors.labels(self.name, exc.reason).inc()
        self._refused_why = f"{exc.reason}: {exc}"
        self._refused_messages += _batch_messages(messages)
        if isinstance(exc, StreamRefused) and self.refusing is None:
            self.refusing = f"{exc.reason}: {exc}"
        state = [m for m in messages if m.type == STATE_TYPE]
        if state:
            # A state change the sink refused: nothing to dead-letter (it has no body), and its
            # record's events were written; the sink's state now differs from the tracker's.
            messages = [m for m in messages if m.type != STATE_TYPE]
            for stream, first in _firsts(state).values():
                if self._state_refusals_told.get(stream.key) != exc.reason:  # counted each time, told once
                    self._state_refusals_told[stream.key] = exc.reason
                    log.error(
                        "state change refused by the sink: the stream's state is cleared at its next clear",
                        extra={"sink": self.name, "stream": stream.key, "error": str(exc)},
                    )
                self._state_lost(stream, first)
        dead = {id(m.record) for m in messages if m.record.kind == "batch"}
        # The sink's state holds what the refused messages said, its messages do not: a consumer
        # following them would disagree with one bootstrapped later. Clear, incomplete; not for a
        # record the sink's state is past (a replay after a restart: cleared then already).
        for stream, first in _firsts([m for m in messages if not _reflected(m.record)]).values():
            self._state_lost(stream, first)
        if messages:
            log.error(
                "messages rejected by the sink, dead-lettered",
                extra={"sink": self.name, "count": len(messages), "error": str(exc)},
            )
        for m in messages:
            self.metrics.dead_letters.labels("sink_rejected").inc()
            s = m.record.stream
            self.dead_letters.write(
                reason="sink_rejected",
                source=s.source,
                dp_rank=s.dp_rank,
                seq=m.record.seq,
                detail=f"{self.name}: {exc}",
                payload=m.value,
                extra={"sink": self.name, "epoch": m.record.epoch, "index": m.index},
            )
        return dead

    def _dead_letter_record(self, record: Record, reason: str, detail: str) -> None:
        self.metrics.dead_letters.labels(reason).inc()
        s = record.stream
        self.dead_letters.write(
            reason=reason, source=s.source, dp_rank=s.dp_rank, seq=record.seq, detail=detail, payload=record.payload
        )


def _by_cause(dead: list[tuple[int, Permanent]]) -> list[tuple[Permanent, list[int]]]:
    """Dead-lettered indexes grouped by their error (one log line and count per distinct refusal)."""
    groups: dict[int, tuple[Permanent, list[int]]] = {}
    for i, error in dead:
        groups.setdefault(id(error), (error, []))[1].append(i)
    return list(groups.values())
