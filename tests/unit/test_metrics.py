"""Metrics, logs and observability files without servers.

- the contract of design.md "Metrics and health": every name, type and label set exactly, and
  nothing else with a high-cardinality label;
- per batch, never per event: sink queue gauges follow enqueueing, lag and outcomes count
  batches; a dead-lettered batch is not also counted delivered;
- an idle sink's health check drives readiness;
- logs: one line per state change, repeated warnings rate-limited;
- the Grafana dashboard and the alert rules are well formed and only use metrics that exist.

The promtool checks and the queries against a real Prometheus are in
tests/integration/test_observability.py.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from bridge import __version__
from bridge import config as config_mod
from bridge.config import BatchConfig, DnsDiscovery, Duration, QueueConfig, RetryConfig, SinkConfig
from bridge.deadletter import DeadLetters
from bridge.discovery import Discovery
from bridge.errors import Permanent, Retriable
from bridge.formats import Message, Renderer
from bridge.logs import JsonFormatter, RateLimit
from bridge.metrics import (
    DEAD_LETTER_REASONS,
    DECODE_REASONS,
    LAG_BUCKETS,
    LOST_REASONS,
    REPLAY_OUTCOMES,
    SINK_ERROR_REASONS,
    SINK_OUTCOMES,
    Metrics,
    StreamMetrics,
)
from bridge.records import Record, Stream
from bridge.runtime import Bridge
from bridge.sink import SinkWorker
from tests.support.records import stream_records
from tests.support.strategies import examples

FILES = Path(__file__).resolve().parents[2] / "helm" / "kv-event-bridge" / "files"

# design.md "Metrics and health": exposed name -> (type, labels)
CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    name: (kind, frozenset(labels))
    for name, kind, labels in [
        ("kv_bridge_batches_received_total", "counter", ["source", "dp_rank"]),
        ("kv_bridge_dead_letter_write_failures_total", "counter", []),
        ("kv_bridge_events_received_total", "counter", ["source", "type"]),
        ("kv_bridge_decode_failures_total", "counter", ["source", "reason"]),
        ("kv_bridge_sequence_gaps_total", "counter", ["source", "dp_rank"]),
        ("kv_bridge_replay_requests_total", "counter", ["source", "outcome"]),
        ("kv_bridge_batches_replayed_total", "counter", ["source"]),
        ("kv_bridge_batches_lost_total", "counter", ["source", "reason"]),
        ("kv_bridge_duplicates_dropped_total", "counter", ["source"]),
        ("kv_bridge_source_restarts_total", "counter", ["source"]),
        ("kv_bridge_source_last_seq", "gauge", ["source", "dp_rank"]),
        ("kv_bridge_source_last_event_timestamp_seconds", "gauge", ["source", "dp_rank"]),
        ("kv_bridge_sources_connected", "gauge", []),
        ("kv_bridge_sources_configured", "gauge", []),
        ("kv_bridge_source_up", "gauge", ["source", "dp_rank"]),
        ("kv_bridge_source_problem", "gauge", ["source", "dp_rank", "reason"]),
        ("kv_bridge_lag_seconds", "histogram", ["sink"]),
        ("kv_bridge_ingest_lag_seconds", "histogram", []),
        ("kv_bridge_sink_batches_total", "counter", ["sink", "outcome"]),
        ("kv_bridge_sink_send_duration_seconds", "histogram", ["sink"]),
        ("kv_bridge_sink_queue_batches", "gauge", ["sink"]),
        ("kv_bridge_sink_queue_bytes", "gauge", ["sink"]),
        ("kv_bridge_sink_retries_total", "counter", ["sink"]),
        ("kv_bridge_sink_errors_total", "counter", ["sink", "reason"]),
        ("kv_bridge_dead_letters_total", "counter", ["reason"]),
        ("kv_bridge_build_info", "gauge", ["version"]),
        # beyond the contract, used by the dashboard and the alerts
        ("kv_bridge_ready", "gauge", []),
        ("kv_bridge_sink_up", "gauge", ["sink"]),
        ("kv_bridge_sink_queue_limit_batches", "gauge", ["sink"]),
        ("kv_bridge_sink_queue_limit_bytes", "gauge", ["sink"]),
        ("kv_bridge_source_disconnects_total", "counter", ["source", "dp_rank"]),
        ("kv_bridge_sink_events_total", "counter", ["sink"]),
        ("kv_bridge_state_entries", "gauge", []),
        ("kv_bridge_state_streams_off", "gauge", []),
        ("kv_bridge_state_switched_off_total", "counter", ["source"]),
        ("kv_bridge_snapshots_total", "counter", ["source", "outcome"]),
        ("kv_bridge_state_rebuilds_total", "counter", ["outcome"]),
        ("kv_bridge_checkpoint_save_failures_total", "counter", []),
        ("kv_bridge_checkpoint_last_save_timestamp_seconds", "gauge", []),
    ]
}
LOW_CARDINALITY = frozenset({"source", "dp_rank", "sink", "reason", "type", "outcome", "version"})


def _collector(metrics: Metrics, name: str) -> Any:
    return metrics.registry._names_to_collectors[name]  # the registry's own index of exposed names


def _families(metrics: Metrics) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}


# -- the contract ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_metric_has_the_contract_name_type_and_labels(name: str) -> None:
    kind, labels = CONTRACT[name]
    metrics = Metrics()
    collector = _collector(metrics, name)
    assert collector._type == kind
    assert frozenset(collector._labelnames) == labels
    child = collector.labels(**{label: "x" for label in labels}) if labels else collector
    {"counter": lambda: child.inc(), "gauge": lambda: child.set(1), "histogram": lambda: child.observe(0.1)}[kind]()
    samples = [s for f in _families(metrics).values() for s in f.samples if s.name.startswith(name)]
    exposed = {s.name for s in samples}
    if kind == "histogram":
        assert {f"{name}_bucket", f"{name}_count", f"{name}_sum"} <= exposed
    else:
        assert name in exposed
    for s in samples:
        if s.name == name or s.name in (f"{name}_count", f"{name}_sum"):
            assert set(s.labels) == labels


def test_every_metric_is_prefixed_and_low_cardinality() -> None:
    metrics = Metrics()
    for name in metrics.registry._names_to_collectors:
        assert name.startswith("kv_bridge_"), name
    for collector in set(metrics.registry._names_to_collectors.values()):
        assert set(collector._labelnames) <= LOW_CARDINALITY, collector._name
    # nothing beyond the list above (a new metric gets a line there, in docs/reference/metrics.md and on the dashboard)
    assert {c._name for c in set(metrics.registry._names_to_collectors.values())} == {_family(n) for n in CONTRACT}


def test_build_info_names_the_version() -> None:
    metrics = Metrics()
    assert metrics.registry.get_sample_value("kv_bridge_build_info", {"version": __version__}) == 1


# -- sink worker: per batch, queue gauges, outcomes, health ----------------------------------------


class MemoryConnector:
    """In-memory connector: fails as told, records what it was given."""

    name = "mem"

    def __init__(self) -> None:
        self.written: list[Message] = []
        self.failures: list[Exception] = []  # raised by the next writes, in order
        self.health_answer: str | None = None
        self.health_calls = 0

    async def connect(self) -> None:
        pass

    async def write(self, messages: Sequence[Message]) -> None:
        if self.failures:
            raise self.failures.pop(0)
        self.written.extend(messages)

    async def close(self) -> None:
        pass

    async def health(self) -> str | None:
        self.health_calls += 1
        return self.health_answer


def _worker(
    tmp_path: Path, connector: MemoryConnector, *, granularity: str = "event", max_batches: int = 100, **kw: Any
) -> tuple[SinkWorker, Metrics, list[Record]]:
    config = SinkConfig(
        type="memory",
        name="mem",
        granularity=granularity,  # type: ignore[arg-type]
        batch=BatchConfig(linger=Duration(0)),
        queue=QueueConfig(max_batches=max_batches),
        retry=RetryConfig(initial_backoff=Duration(0.001), max_backoff=Duration(0.002)),
        **kw,
    )
    metrics = Metrics()
    acked: list[Record] = []
    worker = SinkWorker(
        0,
        config,
        connector,
        Renderer("json", config.granularity, "int"),
        metrics,
        DeadLetters(str(tmp_path / "dead.jsonl")),
        lambda _i, records: acked.extend(records),
    )
    return worker, metrics, acked


async def _stop(worker: SinkWorker) -> None:
    await worker.stop()
    worker.dead_letters.close()


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


STREAM = Stream("llama-a", 0)


async def test_queue_gauges_follow_enqueueing_not_only_delivery(tmp_path: Path) -> None:
    worker, metrics, _ = _worker(tmp_path, MemoryConnector())
    records = stream_records(STREAM, 3)
    for r in records:
        assert worker.offer(r)
    # nothing delivered yet (the worker is not running): the queue shows what waits
    assert _value(metrics, "kv_bridge_sink_queue_batches", sink="mem") == 3
    assert _value(metrics, "kv_bridge_sink_queue_bytes", sink="mem") == sum(r.size for r in records)
    assert _value(metrics, "kv_bridge_sink_queue_limit_batches", sink="mem") == 100
    worker.start()
    try:
        assert await worker.flush(5)
    finally:
        await _stop(worker)
    assert _value(metrics, "kv_bridge_sink_queue_batches", sink="mem") == 0
    assert _value(metrics, "kv_bridge_sink_queue_bytes", sink="mem") == 0


async def test_outcomes_and_lag_count_batches_not_events(tmp_path: Path) -> None:
    connector = MemoryConnector()
    worker, metrics, _ = _worker(tmp_path, connector, granularity="event")
    records = stream_records(STREAM, 10)  # 3 events each
    worker.start()
    try:
        for r in records:
            assert worker.offer(r)
        assert await worker.flush(5)
    finally:
        await _stop(worker)
    assert len(connector.written) == 30
    assert _value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="delivered") == 10
    assert _value(metrics, "kv_bridge_lag_seconds_count", sink="mem") == 10
    assert _value(metrics, "kv_bridge_sink_send_duration_seconds_count", sink="mem") >= 1


async def test_a_dead_lettered_batch_is_not_also_delivered(tmp_path: Path) -> None:
    connector = MemoryConnector()
    connector.failures = [Permanent("message too large", reason="too_large")]
    worker, metrics, acked = _worker(tmp_path, connector, granularity="batch")
    records = stream_records(STREAM, 2)
    for r in records:
        worker.offer(r)
    worker.start()
    try:
        assert await worker.flush(5)
    finally:
        await _stop(worker)
    # both batches went in one write, which was rejected
    assert _value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="dead_lettered") == 2
    assert _value(metrics, "kv_bridge_sink_batches_total", sink="mem", outcome="delivered") == 0
    assert _value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="too_large") == 1
    assert _value(metrics, "kv_bridge_dead_letters_total", reason="sink_rejected") == 2
    assert _value(metrics, "kv_bridge_lag_seconds_count", sink="mem") == 0
    assert acked == records  # settled all the same: the checkpoint moves on
    dead = [json.loads(line) for line in (tmp_path / "dead.jsonl").read_text().splitlines()]
    assert [d["seq"] for d in dead] == [0, 1]


async def test_an_idle_sink_is_health_checked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bridge.sink")
    connector = MemoryConnector()
    worker, metrics, _ = _worker(tmp_path, connector)
    worker.health_interval = 0.02
    worker.start()
    try:
        await _until(lambda: worker.connected)
        connector.health_answer = "PING refused"
        await _until(lambda: not worker.connected)
        assert worker.last_error == "health: PING refused"
        assert _value(metrics, "kv_bridge_sink_up", sink="mem") == 0
        calls = connector.health_calls
        await _until(lambda: connector.health_calls >= calls + 5)  # still down, checked again and again...
        connector.health_answer = None
        await _until(lambda: worker.connected)
        assert worker.last_error is None
        assert _value(metrics, "kv_bridge_sink_up", sink="mem") == 1
    finally:
        await _stop(worker)
    # ...but logged once per change of state, and not counted as write errors
    messages = [r.getMessage() for r in caplog.records if r.name == "bridge.sink"]
    assert messages.count("sink unhealthy while idle") == 1
    assert messages.count("sink connected") == 2
    assert not [s for s in metrics.registry.collect() if s.name == "kv_bridge_sink_errors" and s.samples]


async def test_a_sink_outage_logs_per_state_change_not_per_retry(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bridge.sink")
    connector = MemoryConnector()
    connector.failures = [Retriable("broker unavailable", reason="unavailable") for _ in range(40)]
    worker, metrics, _ = _worker(tmp_path, connector)
    worker.start()
    try:
        for r in stream_records(STREAM, 3):
            worker.offer(r)
        assert await worker.flush(10)
    finally:
        await _stop(worker)
    assert _value(metrics, "kv_bridge_sink_retries_total", sink="mem") == 40
    assert _value(metrics, "kv_bridge_sink_errors_total", sink="mem", reason="unavailable") == 40
    warnings = [r for r in caplog.records if r.getMessage() == "sink unavailable, retrying"]
    assert [r.attempt for r in warnings] == [1, 30]  # type: ignore[attr-defined]
    assert all(r.sink == "mem" and r.reason == "unavailable" for r in warnings)  # type: ignore[attr-defined]
    assert [r.getMessage() for r in caplog.records].count("sink connected") == 2  # at start, after the outage


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


# -- logs: rate limit ---------------------------------------------------------------------------


def _record(msg: str, created: float, level: int = logging.WARNING, **extra: Any) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": "bridge", "msg": msg, "levelno": level, "levelname": "WARNING", **extra})
    record.created = created
    return record


def test_repeated_warnings_are_rate_limited_then_summarised() -> None:
    limit = RateLimit(burst=5, interval=60.0)
    passed = [r for r in (_record("decode failure", 1000.0 + i * 0.1) for i in range(100)) if limit.filter(r)]
    assert len(passed) == 5
    assert not any(hasattr(r, "suppressed") for r in passed)
    # another message is limited on its own
    assert limit.filter(_record("sink unavailable, retrying", 1001.0))
    # once the interval is over, the next one passes and says how many were held back
    later = _record("decode failure", 1061.0)
    assert limit.filter(later)
    assert later.suppressed == 95  # type: ignore[attr-defined]
    assert '"suppressed": 95' in JsonFormatter().format(later)


def test_info_and_debug_are_never_rate_limited() -> None:
    limit = RateLimit(burst=1, interval=60.0)
    assert all(limit.filter(_record("sequence gap", 1000.0 + i, level=logging.INFO)) for i in range(50))


# -- dashboard and alert rules ------------------------------------------------------------------

_METRIC = re.compile(r"\b(kv_bridge_[a-z_]+)")


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FILES / "dashboard.json").read_text())
    return data


def _families_of_metrics() -> set[str]:
    """Family names (counters without ``_total``) of every metric the bridge has."""
    return {c._name for c in set(Metrics().registry._names_to_collectors.values())}


def _families_of_discovery() -> set[str]:
    """Family names of the metrics DNS discovery adds when it is on."""
    registry = CollectorRegistry()
    config = msgspec.convert({"name": "vllm.default.svc", "port": 5557}, DnsDiscovery)
    Discovery(config, None, registry=registry, hostname=lambda: "kv-event-bridge-0")  # type: ignore[arg-type]
    return {c._name for c in set(registry._names_to_collectors.values())}


def _family(name: str) -> str:
    """The family a series name in a query belongs to."""
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_dashboard_panels_have_units_datasource_and_queries() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and "__inputs" not in dash  # importable as is, and by provisioning
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 20
    assert len({p["title"] for p in panels}) == len(panels)
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["fieldConfig"]["defaults"]["unit"] in {"ops", "s", "bytes", "short", "percentunit"}, p["title"]
        assert p["targets"], p["title"]
        assert p["description"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert _METRIC.search(t["expr"]), t["expr"]
            assert 'namespace=~"$namespace"' in t["expr"] and 'pod=~"$pod"' in t["expr"], t["expr"]
    # no two panels overlap
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        assert g["x"] + g["w"] <= 24
        cells |= mine


def test_dashboard_template_variables() -> None:
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "pod", "source", "sink"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}"
        assert v["query"].startswith("label_values(") and v["query"].endswith(f", {name})")
        assert v["includeAll"] and v["allValue"] == ".*"


def test_dashboard_shows_every_metric_and_only_existing_ones() -> None:
    used = {_family(m) for p in _dashboard()["panels"] for t in p.get("targets", []) for m in _METRIC.findall(t["expr"])}
    assert used == _families_of_metrics(), used ^ _families_of_metrics()


def test_alert_rules_are_labelled_annotated_and_use_existing_metrics() -> None:
    rules = yaml.safe_load((FILES / "alerts.rules.yaml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    names = {r["alert"] for r in alerts}
    assert names == {
        "KvBridgeDown",
        "KvBridgeNotReady",
        "KvBridgeDecodeFailures",
        "KvBridgeBatchesLost",
        "KvBridgeLagHigh",
        "KvBridgeSinkErrors",
        "KvBridgeSinkQueueNearFull",
        "KvBridgeSourceSilent",
        "KvBridgeNoSourceConnected",
        "KvBridgeSourceNotConnected",
        "KvBridgeDiscoveryEmpty",
    }
    families = _families_of_metrics() | _families_of_discovery()
    for r in alerts:
        assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert {_family(m) for m in _METRIC.findall(r["expr"])} <= families, r["alert"]
    tests = yaml.safe_load((FILES / "alerts.tests.yaml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", [])}
    assert tested == names
    for name in names:  # each alert is seen firing and seen quiet
        evals = [t for case in tests["tests"] for t in case.get("alert_rule_test", []) if t["alertname"] == name]
        assert any(t["exp_alerts"] for t in evals) and any(not t["exp_alerts"] for t in evals), name


def test_rules_file_holds_no_helm_templating() -> None:
    # the chart embeds the groups with .Files.Get: only Prometheus's own {{ $labels }} / {{ $value }}
    text = (FILES / "alerts.rules.yaml").read_text()
    assert set(re.findall(r"\{\{\s*(\S+)", text)) <= {
        "$labels.instance",
        "$labels.job",
        "$labels.namespace",
        "$labels.pod",
        "$labels.source",
        "$labels.reason",
        "$labels.sink",
        "$labels.dp_rank",
        "$value",
    }


# -- the fast histogram ------------------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.floats(min_value=0, max_value=400, allow_nan=False)),
        max_size=60,
    )
)
def test_fast_histogram_exposes_what_prometheus_client_does(observations: list[tuple[str, float]]) -> None:
    """Same samples as prometheus_client's Histogram (bar its ``_created``), edges included."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from bridge.metrics import LAG_BUCKETS, FastHistogram

    mine, theirs = CollectorRegistry(), CollectorRegistry()
    fast = FastHistogram("h_seconds", "doc", ["sink"], LAG_BUCKETS, mine)
    slow = Histogram("h_seconds", "doc", ["sink"], buckets=LAG_BUCKETS, registry=theirs)
    for sink, v in [*observations, ("a", LAG_BUCKETS[3]), ("b", LAG_BUCKETS[-1])]:  # values on an edge count under it
        fast.labels(sink).observe(v)
        slow.labels(sink=sink).observe(v)

    def samples(registry: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]], float]]:
        text = generate_latest(registry).decode()
        return sorted(
            (s.name, sorted(s.labels.items()), round(s.value, 6))
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.name.endswith("_created")
        )

    assert samples(mine) == samples(theirs)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.floats(min_value=0, max_value=400, allow_nan=False) | st.sampled_from([0.0, *LAG_BUCKETS]), max_size=80),
    st.integers(1, 5),
)
def test_observing_a_burst_at_once_counts_as_observing_each_value(values: list[float], parts: int) -> None:
    """``observe_all`` (per burst: sort, one bisect per bucket) leaves the same bucket counts as
    ``observe`` per value, edges included, and the same sum up to rounding."""
    from prometheus_client import CollectorRegistry

    from bridge.metrics import FastHistogram

    one = FastHistogram("h_seconds", "doc", [], LAG_BUCKETS, CollectorRegistry()).labels()
    many = FastHistogram("h_seconds", "doc", [], LAG_BUCKETS, CollectorRegistry()).labels()
    for v in values:
        one.observe(v)
    step = max(1, len(values) // parts)
    for i in range(0, len(values), step):  # several bursts, and an empty one
        many.observe_all(values[i : i + step])
    many.observe_all([])
    assert many.counts == one.counts
    assert many.sum == pytest.approx(one.sum, rel=1e-9, abs=1e-9)


def test_fast_histogram_refuses_wrong_labels() -> None:
    from prometheus_client import CollectorRegistry

    from bridge.metrics import FastHistogram

    h = FastHistogram("h_seconds", "doc", ["sink"], (1.0,), CollectorRegistry())
    assert h.labels(sink="x") is h.labels("x")
    for bad in ((), ("x", "y")):
        with pytest.raises(ValueError, match="expected labels"):
            h.labels(*bad)
    with pytest.raises(ValueError, match="expected labels"):
        h.labels(source="x")


class _Gathering:
    """An owner of deferred updates (like a stream pipeline): counts in a plain attribute."""

    def __init__(self, metrics: Metrics) -> None:
        self.pending = 0
        self.flushed_on: set[int] = set()
        self.child = metrics.batches_received.labels("engine", "0")
        metrics.defer(self)

    def flush_metrics(self) -> None:
        import threading

        self.flushed_on.add(threading.get_ident())
        self.child.inc(self.pending)
        self.pending = 0


async def test_deferred_updates_are_applied_before_every_reading_on_the_loops_thread() -> None:
    """What the hot path gathers shows in a scrape and in a direct read, never twice; a scrape
    renders in a worker thread, and the gathered updates are applied before, on the loop."""
    import threading

    metrics = Metrics()
    owner = _Gathering(metrics)
    name = "kv_bridge_batches_received_total"
    labels = {"source": "engine", "dp_rank": "0"}
    owner.pending = 3
    assert metrics.registry.get_sample_value(name, labels) == 3
    owner.pending = 4
    interval = sys.getswitchinterval()
    text = b"".join(await metrics.scrape()).decode()
    assert sys.getswitchinterval() == interval  # shortened only while rendering
    assert f'{name}{{dp_rank="0",source="engine"}} 7.0' in text
    assert metrics.registry.get_sample_value(name, labels) == 7
    assert owner.flushed_on == {threading.get_ident()}
    assert "_created" not in text  # (not rendered: see bridge.metrics)


_LABEL = st.text(max_size=6)  # quotes, backslashes and newlines included: they are escaped


@settings(max_examples=examples(80), deadline=None)
@given(
    series=st.lists(st.tuples(_LABEL, _LABEL, st.floats()), max_size=12),
    counts=st.lists(st.floats(min_value=0, max_value=1e12), max_size=4),
    queued=st.integers(min_value=0, max_value=10**9),
)
def test_a_scrape_is_exactly_what_generate_latest_renders(
    series: list[tuple[str, str, float]], counts: list[float], queued: int
) -> None:
    """/metrics renders Counters and Gauges itself, a slice at a time (bridge.metrics.render_in_slices):
    byte for byte what prometheus_client's generate_latest gives for the same registry, with
    label values to escape, any float (NaN, infinities, -0.0, exponents), set_function gauges
    and histograms, cut in pieces mid-family."""
    from unittest import mock

    import bridge.metrics as metrics_mod

    metrics = Metrics()
    for source, rank, value in series:
        metrics.source_last_seq.labels(source, rank).set(value)
        metrics.source_problem.labels(source, rank, "wrong_topic").set(1)
        StreamMetrics(metrics, source, 0).events("BlockStored").inc(3)
    for i, n in enumerate(counts):
        metrics.sink_events.labels(f"sink-{i}").inc(n)
        metrics.lag.labels(f"sink-{i}").observe(n / 1e9)
    metrics.sink_queue_batches.labels("queue").set_function(lambda: queued)
    metrics.sources_configured.set(len(series))
    with mock.patch.object(metrics_mod, "_SLICE_SECONDS", 0), mock.patch.object(metrics_mod, "_CHECK_EVERY", 3):
        pieces = asyncio.run(metrics.scrape())  # a piece every 3 series
    assert b"".join(pieces) == metrics.exposition()
    assert len(pieces) > 1


def test_an_owner_gone_is_no_longer_flushed() -> None:
    import gc

    metrics = Metrics()
    owner = _Gathering(metrics)
    owner.pending = 2
    del owner
    gc.collect()
    assert metrics.registry.get_sample_value("kv_bridge_batches_received_total", {"source": "engine", "dp_rank": "0"}) == 0


# -- series at 0 -------------------------------------------------------------------------------


async def test_known_label_values_start_at_zero_for_every_configured_sink_and_source(tmp_path: Path) -> None:
    """A healthy bridge's panels show 0, not "no data": every counter whose label values are
    known in advance has its series from the start."""
    config = config_mod.from_data(
        {
            "sources": [{"name": "eng", "endpoint": "tcp://127.0.0.1:9", "dp_ranks": 2}],
            "sinks": [{"type": "file", "name": "out", "path": str(tmp_path / "out.jsonl")}],
            "metrics": {"listen": ""},
            "replay": {"idle_probe": 0},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        },
        env={},
    )
    async with Bridge(config) as bridge:
        get = bridge.metrics.registry.get_sample_value
        for outcome in SINK_OUTCOMES:
            assert get("kv_bridge_sink_batches_total", {"sink": "out", "outcome": outcome}) == 0
        for reason in SINK_ERROR_REASONS:
            assert get("kv_bridge_sink_errors_total", {"sink": "out", "reason": reason}) == 0
        for outcome in REPLAY_OUTCOMES:
            assert get("kv_bridge_replay_requests_total", {"source": "eng", "outcome": outcome}) == 0
        for reason in DECODE_REASONS:
            assert get("kv_bridge_decode_failures_total", {"source": "eng", "reason": reason}) == 0
        for reason in DEAD_LETTER_REASONS:
            assert get("kv_bridge_dead_letters_total", {"reason": reason}) == 0
        assert get("kv_bridge_sink_retries_total", {"sink": "out"}) == 0
        for reason in LOST_REASONS:
            assert get("kv_bridge_batches_lost_total", {"source": "eng", "reason": reason}) == 0


async def test_a_scrapes_readiness_verdict_is_the_one_readyz_gives(tmp_path: Path) -> None:
    """/metrics keeps kv_bridge_ready current with ``readiness(detail=False)`` (one pass that stops
    early, for 10,000 streams): in every mix of streams subscribed, connected, the connect grace
    over or not, a sink down, engines not answering (frozen, or nothing they send decodable), its
    verdict and the gauge are /readyz's."""
    import itertools
    import time
    from types import SimpleNamespace

    config = config_mod.from_data(
        {
            "sources": [{"name": "eng", "endpoint": "tcp://127.0.0.1:9", "dp_ranks": 3}],
            "sinks": [{"type": "file", "name": "out", "path": str(tmp_path / "out.jsonl")}],
            "metrics": {"listen": ""},
            "replay": {"idle_probe": 0},
        },
        env={},
    )
    async with Bridge(config) as bridge:
        readers, pipelines, started, worker = bridge.readers, bridge.pipelines, bridge._started_at, bridge.workers[0]
        was_up = worker.connected
        verdicts = set()
        try:
            for subscribed, problems, silent, garbled, grace_over, sink_up in itertools.product(
                ((1, 1, 1), (1, 0, 1), (0, 0, 0)),
                ((0, 0, 0), (1, 0, 1), (1, 1, 1)),
                ((0, 0, 0), (0, 1, 0), (1, 1, 1)),
                ((0, 0, 0), (1, 0, 0), (1, 0, 1)),
                (False, True),
                (True, False),
            ):
                bridge.readers = {
                    f"eng/{i}": SimpleNamespace(subscribed=bool(s), problem="refused" if p else None)
                    for i, (s, p) in enumerate(zip(subscribed, problems, strict=True))
                }  # type: ignore[assignment]
                bridge.pipelines = {
                    f"eng/{i}": SimpleNamespace(
                        silent=bool(q), replay_problem="no answer" if q else None, undecodable="bad_msgpack: x" if g else None
                    )
                    for i, (q, g) in enumerate(zip(silent, garbled, strict=True))
                }  # type: ignore[assignment]
                bridge._started_at = time.monotonic() - (config.ingest.connect_grace + 1 if grace_over else 0)
                worker.connected = sink_up
                ready = bridge.readiness(True)[0]
                assert bridge.readiness(False) == (ready, {})
                assert bridge.metrics.registry.get_sample_value("kv_bridge_ready") == (1 if ready else 0)
                verdicts.add(ready)
        finally:
            bridge.readers, bridge.pipelines, bridge._started_at, worker.connected = readers, pipelines, started, was_up
    assert verdicts == {True, False}


def test_every_loss_reason_announced_in_bridge_starts_at_zero() -> None:
    """LOST_REASONS is complete: the reason (its kind, before ``:<sink>``) of every EventsLost made
    in bridge/ with a literal reason (``events_lost``, the sequencer's ``_lose`` and
    ``_head_reason``) is in it, so kv_bridge_batches_lost_total{reason} starts at 0 for it."""
    at = {"events_lost": 4, "_lose": 2, "_head_reason": 0}
    found = set()
    for path in (Path(__file__).resolve().parents[2] / "bridge").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name not in at or len(node.args) <= at[name]:
                continue
            arg = node.args[at[name]]
            if isinstance(arg, ast.JoinedStr) and arg.values:
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value.partition(":")[0])
    assert {"undecodable", "unrenderable", "sink_refused", "sink_behind", "no_replay"} <= found
    assert found <= set(LOST_REASONS), found - set(LOST_REASONS)


def test_every_decode_failure_reason_raised_in_bridge_starts_at_zero() -> None:
    """DECODE_REASONS is complete: every DecodeError("reason", ...) in bridge/ is in it."""
    raised = set()
    for path in (Path(__file__).resolve().parents[2] / "bridge").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DecodeError" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    raised.add(first.value)
    assert raised and raised <= set(DECODE_REASONS)
