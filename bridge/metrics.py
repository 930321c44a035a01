"""Prometheus metrics (design.md "Metrics and health"): prefix ``kv_bridge_``, base units.

One :class:`Metrics` per bridge, on its own registry (tests run several bridges in a process).
Everything is updated per batch, never per event, and labelled only by low-cardinality values:
source, dp_rank, sink, reason, type, outcome. The busiest counters and gauges (batches and events
received, the last seq and ts, batches and events a sink delivered) are gathered in plain
attributes by their owners and applied when the registry is collected (:meth:`Metrics.defer`):
a labelled prometheus_client update takes a lock and costs about a microsecond, and with one or
two batches per socket wake-up (many engines, each at its step rate) those were a large share of
a batch's cost.
"""

from __future__ import annotations

import asyncio
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from math import copysign
from operator import itemgetter
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from . import __version__

if TYPE_CHECKING:
    from .records import Record

# No ``_created`` series beside every counter: they doubled what a scrape renders (1,000 engines
# of one rank: 40,000 lines, 0.3 s of the event loop) and no dashboard or alert of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
SEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class HistogramChild:
    """One label set of a :class:`FastHistogram`: bucket counts (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # first bound >= value: Prometheus' "le"
        self.sum += value

    def observe_all(self, values: list[float]) -> None:
        """``observe`` each of ``values`` (none NaN), for a burst at once: sorted, then one bisect per
        bucket instead of one per value. Sorts ``values`` in place."""
        if len(values) < 4:  # (the usual burst of a quiet stream: a bisect each is cheaper)
            for v in values:
                self.observe(v)
            return
        values.sort()
        counts = self.counts
        below = 0
        for i, bound in enumerate(self._bounds):
            upto = bisect_right(values, bound, below)  # values <= bound: those whose first bound >= them is here or before
            counts[i] += upto - below
            below = upto
        counts[-1] += len(values) - below
        self.sum += sum(values)


class FastHistogram:
    """A histogram for the per-batch hot path, exposed exactly like prometheus_client's.

    prometheus_client's ``Histogram.observe`` takes a lock and walks the buckets in Python,
    twice per batch here (ingest lag, sink lag): ~2 us each, a fifth of the CPU of a raw
    batch (``benchmarks/pipeline.py`` under cProfile). This one bisects: ~0.3 us. It is
    updated and rendered (:meth:`Metrics.scrape`) on the event loop's thread only, without a
    lock; a reading in another thread (``exposition``) taken mid-update is still cumulative and
    consistent with its count (the sum may miss the last few observations).
    Samples: ``_bucket`` (cumulative, ``le``), ``_count``, ``_sum``.
    """

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        # _name, _type and _labelnames as prometheus_client's collectors call them
        self._name = name
        self._type = "histogram"
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(sorted(float(b) for b in buckets))
        self._les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str, **named: str) -> HistogramChild:
        if named:
            if values or set(named) != set(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values} {named}")
            values = tuple(named[n] for n in self._labelnames)
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = HistogramChild(self._bounds)
        return child

    def observe(self, value: float) -> None:
        """For a histogram without labels (hot paths: bind ``labels().observe`` once)."""
        self.labels().observe(value)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in list(self._children.items()):
            running, buckets = 0, []
            for le, n in zip(self._les, child.counts, strict=True):
                running += n
                buckets.append((le, float(running)))
            family.add_metric(list(key), buckets, child.sum)
        yield family


# Label values known in advance; their series start at 0 (dashboards show 0, not "no data").
SINK_OUTCOMES = ("delivered", "dropped", "dead_lettered")
SINK_ERROR_REASONS = ("not_connected", "retriable", "permanent", "timeout", "unexpected")
REPLAY_OUTCOMES = ("complete", "timeout", "error")
# Every DecodeError reason raised in bridge/ (a unit test keeps this complete).
DECODE_REASONS = ("bad_frames", "bad_seq", "bad_msgpack", "bad_batch", "bad_event", "bad_replay_reply")
DEAD_LETTER_REASONS = ("sink_rejected", "unrenderable", *DECODE_REASONS)
# Every EventsLost reason's kind (the part before ``:<sink>``; docs/output/records.md).
LOST_REASONS = (
    "replay_buffer_exceeded", "replay_unavailable", "no_replay", "joined_late", "publisher_restart", "undecodable",
    "unrenderable", "sink_queue_full", "sink_refused", "sink_lost", "sink_behind", "unrecoverable",
)  # fmt: skip


class Deferred(Protocol):
    def flush_metrics(self) -> None: ...


# A scrape's work on the loop (applying the gathered updates, rendering) goes in slices of about
# this long, with two turns of the loop between two (_pause).
_SLICE_SECONDS = 0.002
_CHECK_EVERY = 64  # steps (owners, series) between two readings of the clock


async def _pause() -> None:
    """Let the loop run what is ready, and what that makes ready: a stream's wake-up takes two
    turns of the loop (a timer's or a socket's callback, then the task it wakes). With one, each
    wake-up would wait for two slices."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


class _Pending:
    """Registered first: before every collection (a scrape, or a test reading a value), the hot
    path's gathered updates are applied (:meth:`Metrics.scrape` applies them in slices before
    it renders, and skips this collector)."""

    def __init__(self) -> None:
        # Weak references by id, not a WeakSet: a snapshot of a dict's values is one C-level copy,
        # where iterating a WeakSet of 10,000 streams took 3-6 ms of the loop at every scrape.
        owners: dict[int, weakref.KeyedRef[int, Deferred]] = {}
        self._owners = owners

        def forget(ref: weakref.KeyedRef[int, Deferred]) -> None:  # when the owner is freed, before its id can be another's
            owners.pop(ref.key, None)

        self._forget = forget

    def add(self, owner: Deferred) -> None:
        key = id(owner)
        self._owners[key] = weakref.KeyedRef(owner, self._forget, key)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.flush()
        return iter(())

    def flush(self) -> None:
        for ref in list(self._owners.values()):
            if (owner := ref()) is not None:
                owner.flush_metrics()

    async def flush_in_slices(self) -> None:
        """:meth:`flush`, yielding to the loop every ``_SLICE_SECONDS``: 10,000 streams' updates
        take about 100 ms to apply, which at once would stall every stream that long."""
        end = perf_counter() + _SLICE_SECONDS
        for n, ref in enumerate(list(self._owners.values()), 1):
            if (owner := ref()) is not None:
                owner.flush_metrics()
            if n % _CHECK_EVERY == 0 and perf_counter() >= end:
                await _pause()
                end = perf_counter() + _SLICE_SECONDS


class Metrics:
    """Every metric of the bridge, registered on ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self._pending = _Pending()
        r.register(self._pending)
        p = "kv_bridge_"
        # Ingest
        self.batches_received = Counter(p + "batches_received", "Live batches received.", ["source", "dp_rank"], registry=r)
        self.events_received = Counter(p + "events_received", "Events decoded, by event type.", ["source", "type"], registry=r)
        self.decode_failures = Counter(
            p + "decode_failures", "Frames, batches or events that could not be decoded.", ["source", "reason"], registry=r
        )
        self.sequence_gaps = Counter(p + "sequence_gaps", "Jumps in a stream's sequence.", ["source", "dp_rank"], registry=r)
        self.replay_requests = Counter(
            p + "replay_requests", "Replay requests by outcome (complete, timeout, error).", ["source", "outcome"], registry=r
        )
        self.batches_replayed = Counter(
            p + "batches_replayed", "Batches delivered from the replay socket.", ["source"], registry=r
        )
        self.batches_lost = Counter(
            p + "batches_lost",
            "Batches announced lost (EventsLost), by the reason's kind (sink_lost for sink_lost:<sink>).",
            ["source", "reason"],
            registry=r,
        )
        self.duplicates_dropped = Counter(p + "duplicates_dropped", "Duplicate batches dropped.", ["source"], registry=r)
        self.source_restarts = Counter(p + "source_restarts", "Engine restarts detected (new epochs).", ["source"], registry=r)
        self.source_last_seq = Gauge(p + "source_last_seq", "Last sequence number delivered.", ["source", "dp_rank"], registry=r)
        self.source_last_event_ts = Gauge(
            p + "source_last_event_timestamp_seconds", "Engine timestamp of the last batch.", ["source", "dp_rank"], registry=r
        )
        self.source_disconnects = Counter(
            p + "source_disconnects",
            "Engine connections dropped (engine gone, or a message over ingest.max_frame_bytes refused by ZMQ).",
            ["source", "dp_rank"],
            registry=r,
        )
        self.sources_connected = Gauge(
            p + "sources_connected",
            "Engine connections established whose source reads its engine's messages (none while kv_bridge_source_up is 0).",
            registry=r,
        )
        self.source_up = Gauge(
            p + "source_up", "1 while the stream's live socket is connected to its engine (handshake done).",
            ["source", "dp_rank"], registry=r,
        )  # fmt: skip
        self.source_problem = Gauge(
            p + "source_problem",
            "1 for why a stream's live socket is not connected: waiting, disconnected, refused, unresolvable, "
            "unreachable, no_answer, not_zmq, wrong_peer, wrong_topic, dropped_unread, perhaps_gone "
            "(docs/operations/monitoring.md).",
            ["source", "dp_rank", "reason"],
            registry=r,
        )
        self.sources_configured = Gauge(p + "sources_configured", "Streams the bridge subscribes to (all ranks).", registry=r)
        # Lag
        self.lag = FastHistogram(p + "lag_seconds", "Sink acknowledgement time minus engine ts.", ["sink"], LAG_BUCKETS, r)
        self.ingest_lag = FastHistogram(p + "ingest_lag_seconds", "Receive time minus engine ts.", [], LAG_BUCKETS, r)
        # Sinks
        self.sink_batches = Counter(p + "sink_batches", "Batches handled by a sink, by outcome.", ["sink", "outcome"], registry=r)
        self.sink_events = Counter(p + "sink_events", "Engine events delivered by a sink.", ["sink"], registry=r)
        self.sink_send_duration = FastHistogram(
            p + "sink_send_duration_seconds", "Duration of one connector write.", ["sink"], SEND_BUCKETS, r
        )
        self.sink_queue_batches = Gauge(p + "sink_queue_batches", "Batches queued for a sink.", ["sink"], registry=r)
        self.sink_queue_bytes = Gauge(p + "sink_queue_bytes", "Payload bytes queued for a sink.", ["sink"], registry=r)
        self.sink_queue_limit_batches = Gauge(p + "sink_queue_limit_batches", "Queue bound in batches.", ["sink"], registry=r)
        self.sink_queue_limit_bytes = Gauge(p + "sink_queue_limit_bytes", "Queue bound in bytes.", ["sink"], registry=r)
        self.sink_retries = Counter(p + "sink_retries", "Writes retried.", ["sink"], registry=r)
        self.sink_errors = Counter(p + "sink_errors", "Write failures by reason.", ["sink", "reason"], registry=r)
        self.sink_up = Gauge(p + "sink_up", "1 when the sink's last write or health check succeeded.", ["sink"], registry=r)
        self.dead_letters = Counter(p + "dead_letters", "Items written to the dead-letter destination.", ["reason"], registry=r)
        self.dead_letter_write_failures = Counter(
            p + "dead_letter_write_failures", "Dead letters not written (destination full or unwritable).", registry=r
        )
        # State (sinks with state.enabled)
        self.state_entries = Gauge(p + "state_entries", "Live blocks kept in the state, all streams.", registry=r)
        self.state_streams_off = Gauge(
            p + "state_streams_off", "Streams whose state is switched off (state.max_entries reached).", registry=r
        )
        self.snapshots = Counter(
            p + "snapshots",
            "Engine snapshots (experimental) by outcome: seeded, or why one was refused (timeout, too_large, ...).",
            ["source", "outcome"],
            registry=r,
        )
        self.state_switched_off = Counter(
            p + "state_switched_off", "Times a stream's state was switched off (state.max_entries).", ["source"], registry=r
        )
        self.state_rebuilds = Counter(
            p + "state_rebuilds",
            "Streams whose state was read back from the sinks at start (rebuilt) or could not be (fresh).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("rebuilt", "fresh"):
            self.state_rebuilds.labels(outcome)
        self.checkpoint_save_failures = Counter(
            p + "checkpoint_save_failures", "Checkpoint saves that failed (the volume full or unwritable).", registry=r
        )
        self.checkpoint_saved = Gauge(
            p + "checkpoint_last_save_timestamp_seconds", "Unix time of the last checkpoint saved (0: none yet).", registry=r
        )
        self.ready = Gauge(p + "ready", "1 when every sink is connected and every source subscribed.", registry=r)
        self.build_info = Gauge(p + "build_info", "Build information.", ["version"], registry=r)
        self.build_info.labels(__version__).set(1)
        for reason in DEAD_LETTER_REASONS:
            self.dead_letters.labels(reason)

    def defer(self, owner: Deferred) -> None:
        """Call ``owner.flush_metrics()`` before every collection, as long as ``owner`` lives (it
        also flushes when it stops, and when what it gathered grows past a bound)."""
        self._pending.add(owner)

    def start_sink(self, sink: str) -> None:
        """A configured sink's error series, at 0 for every known reason: a healthy bridge's
        panels show 0, not "no data" (its SinkWorker binds the outcome, event and retry series)."""
        for reason in SINK_ERROR_REASONS:
            self.sink_errors.labels(sink, reason)

    def announced_lost(self, record: Record) -> None:
        """Count the batches ``record`` (an ``EventsLost``) announces lost, once per announcement
        made: a sink's own (``sink_lost:<sink>``) under its reason's kind, so that the series stay
        a few per source."""
        reason = (record.reason or "unrecoverable").partition(":")[0]
        self.batches_lost.labels(record.stream.source, reason).inc(record.lost_count)

    def forget_source(self, source: str) -> None:
        """Drop every series of ``source`` (gone for good), so that label sets do not grow forever
        under discovery churn."""
        per_source = (
            self.batches_received,
            self.events_received,
            self.decode_failures,
            self.sequence_gaps,
            self.replay_requests,
            self.batches_replayed,
            self.batches_lost,
            self.duplicates_dropped,
            self.source_restarts,
            self.source_last_seq,
            self.source_last_event_ts,
            self.source_disconnects,
            self.source_up,
            self.source_problem,
            self.state_switched_off,
            self.snapshots,
        )
        for metric in per_source:
            metric.remove_by_labels({"source": source})

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def scrape(self) -> list[bytes]:
        """The exposition in pieces which joined are :meth:`exposition`'s bytes, rendered on the
        loop a slice at a time (:func:`render_in_slices`); the gathered updates are applied
        first, a slice of streams at a time."""
        await self._pending.flush_in_slices()
        return await render_in_slices(self.registry, skip=self._pending)


async def render_in_slices(registry: CollectorRegistry, skip: object = None) -> list[bytes]:
    """``generate_latest(registry)`` in pieces, yielding to the event loop between two (every
    ``_SLICE_SECONDS``); ``skip``: a collector left out.

    10,000 streams are 230,000 series (17 MB). generate_latest builds a sample object (and a
    dict of its labels) per series, 2-3 s per scrape. It ran in a worker thread, but the event
    loop then waits for the GIL whenever that thread holds it: the longest waits (a join or the
    release of a 60,000-series family, single C calls; the worker preempted by the OS while it
    holds the GIL) stalled every stream 17-40 ms. Here a series of a Counter or a Gauge is one
    line formatted from the child's value, about 2 us, a quarter of the time, and no slice
    holds the loop more than a few milliseconds. Any other collector (the histograms: a few
    series per sink) is rendered by generate_latest itself. A unit test keeps the output
    identical to generate_latest's."""
    pieces: list[bytes] = []
    lines: list[str] = []
    with registry._lock:  # as CollectorRegistry.collect takes them: in registration order
        collectors = list(registry._collector_to_names)
        if registry._target_info:  # (rendered first: none of ours has one)
            return [generate_latest(registry)]
    end = perf_counter() + _SLICE_SECONDS
    for collector in collectors:
        if collector is skip:
            continue
        # Exactly these types (a subclass may sample otherwise), without a unit (it changes the name).
        if type(collector) in (Counter, Gauge) and not collector._unit:  # type: ignore[attr-defined]
            for line in _family_lines(cast(Counter | Gauge, collector)):
                lines.append(line)
                if len(lines) % _CHECK_EVERY == 0 and perf_counter() >= end:
                    pieces.append("".join(lines).encode())
                    lines.clear()
                    await _pause()
                    end = perf_counter() + _SLICE_SECONDS
        else:
            lines.append(generate_latest(collector).decode())
    pieces.append("".join(lines).encode())
    return pieces


_GO_TEXT: dict[float, str] = {}  # a value's text in the exposition, as floatToGoString writes it


def _value_text(value: float) -> str:
    if value == 0.0:  # (most series; and -0.0 == 0.0 as a key, but not as text)
        return "0.0" if copysign(1.0, value) > 0 else "-0.0"
    text = _GO_TEXT.get(value)
    if text is None:
        if len(_GO_TEXT) >= 65_536:  # (counters and timestamps take ever new values)
            _GO_TEXT.clear()
        text = floatToGoString(value)  # type: ignore[no-untyped-call]
        if value == value:  # not NaN (never equal to itself, so never found again)
            _GO_TEXT[value] = text
    return text


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _family_lines(metric: Counter | Gauge) -> Iterator[str]:
    """What generate_latest writes for ``metric``, a line at a time (each ending in a newline)."""
    name = metric._name + ("_total" if metric._type == "counter" else "")
    doc = metric._documentation.replace("\\", r"\\").replace("\n", r"\n")
    yield f"# HELP {name} {doc}\n# TYPE {name} {metric._type}\n"
    sampled = type(metric)._child_samples  # what a child's samples are, unless set_function replaced them
    names = metric._labelnames
    if not names:
        yield f"{name} {_value_text(_value_of(metric, sampled))}\n"
        return
    order = sorted(range(len(names)), key=names.__getitem__)  # generate_latest sorts by label name
    pick = None if order == list(range(len(names))) else itemgetter(*order)  # (two or more names)
    template = name + "{" + ",".join(f'{names[i]}="%s"' for i in order) + "} "
    quotes = 2 * len(names)
    with metric._lock:
        children = metric._metrics.copy()
    for values, child in children.items():
        ordered = values if pick is None else pick(values)
        labels = template % ordered
        if "\\" in labels or "\n" in labels or labels.count('"') != quotes:
            labels = template % tuple(_escape(v) for v in ordered)
        yield f"{labels}{_value_text(_value_of(child, sampled))}\n"


def _value_of(child: Any, sampled: Any) -> float:
    """A child's value, as its samples carry it (a Gauge's ``set_function`` replaces those; read
    without ``__dict__``, which would give each child a dict of its own)."""
    samples = child._child_samples
    return float(child._value.get()) if samples.__func__ is sampled else float(samples()[0].value)


class StreamMetrics:
    """One stream's series (its children bound once: a labelled lookup per batch is costly), and
    the process-wide ones its pipeline and source reader update."""

    def __init__(self, metrics: Metrics, source: str, dp_rank: int) -> None:
        m, rank = metrics, str(dp_rank)
        self.source = source
        self.received = m.batches_received.labels(source, rank)
        self.gaps = m.sequence_gaps.labels(source, rank)
        self.replayed = m.batches_replayed.labels(source)
        self.duplicates = m.duplicates_dropped.labels(source)
        self.restarts = m.source_restarts.labels(source)
        self.last_seq = m.source_last_seq.labels(source, rank)
        self.last_ts = m.source_last_event_ts.labels(source, rank)
        self.disconnects = m.source_disconnects.labels(source, rank)
        self.connected = m.sources_connected
        self.metrics = m
        self.ingest_lag = m.ingest_lag.labels()
        self._events = m.events_received
        self._event_children: dict[str, Counter] = {}
        self._replays = {outcome: m.replay_requests.labels(source, outcome) for outcome in REPLAY_OUTCOMES}
        for reason in DECODE_REASONS:  # at 0 from the start
            m.decode_failures.labels(source, reason)
        for reason in LOST_REASONS:
            m.batches_lost.labels(source, reason)
        self._bad_replies = m.decode_failures.labels(source, "bad_replay_reply")

    def events(self, event_type: str) -> Counter:
        child = self._event_children.get(event_type)
        if child is None:
            child = self._event_children[event_type] = self._events.labels(self.source, event_type)
        return child

    def replay_finished(self, outcome: str, bad_replies: int) -> None:
        self._replays[outcome].inc()
        if bad_replies:
            self._bad_replies.inc(bad_replies)
