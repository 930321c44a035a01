"""Observability end to end: /metrics, /healthz, /readyz, the Grafana dashboard, the alert rules, logs.

- promtool: the bridge's real /metrics output, the rules file and its unit tests are clean;
- a real Prometheus scrapes a bridge fed by the simulator (with drops, a restart, a gap beyond
  the replay buffer), a raw publisher of garbage and a sink that fails now and then: every
  PromQL query of every dashboard panel returns data, every template variable finds values,
  every alert expression is valid and the rules load and evaluate without error (the decode
  failure and lost batch alerts fire);
- /readyz follows a real Redis sink going away and coming back, idle and while writing;
- logs: one line per state change (gap, restart, loss), repeated warnings rate-limited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import yaml
import zmq
import zmq.asyncio

import bridge.sink
from bridge.config import from_data
from bridge.connector import Registry
from bridge.errors import Permanent, Retriable
from bridge.formats import Message
from bridge.logs import RateLimit
from bridge.runtime import Bridge
from bridge.simulator import Faults, Simulator, SimulatorOptions
from tests.infra.servers import PrometheusServer, RedisServer
from tests.support.epochs import assert_first_epoch, assert_next_epoch
from tests.support.harness import free_port, free_ports, metric, read_lines, running_bridge, wait_for

pytestmark = pytest.mark.integration

FILES = Path(__file__).resolve().parents[2] / "helm" / "kv-event-bridge" / "files"
RULES = FILES / "alerts.rules.yaml"

# What Grafana puts in place of its variables when the test evaluates a panel's query.
GRAFANA_VARIABLES = {
    "namespace": ".*",
    "pod": ".*",
    "source": ".*",
    "sink": ".*",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "5m",
}


def grafana_expr(expr: str) -> str:
    """A panel query with the template variables replaced ($var, ${var} and [[var]] forms)."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)|\[\[(\w+)\]\]", sub, expr)


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    """GET from the bridge's endpoints in a thread (the bridge serves them on this loop)."""

    def get() -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    return await asyncio.to_thread(get)


async def prometheus_api(prom: PrometheusServer, path: str, **params: str | list[str]) -> Any:
    """GET /api/v1/<path>; returns ``data`` (raises on an error status, e.g. an invalid query)."""
    query = urllib.parse.urlencode(params, doseq=True)

    def get() -> Any:
        try:
            with urllib.request.urlopen(f"{prom.url}/api/v1/{path}?{query}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            with exc:
                raise AssertionError(f"{path} {params}: {exc.code} {exc.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        return body["data"]

    return await asyncio.to_thread(get)


def _sim(ports: Sequence[int], **kw: Any) -> SimulatorOptions:
    return SimulatorOptions(
        endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}", rate=0, events_per_batch=2, **kw
    )


def _source(name: str, ports: Sequence[int]) -> dict[str, Any]:
    return {"name": name, "endpoint": f"tcp://127.0.0.1:{ports[0]}", "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}"}


async def _subscribed(b: Bridge, keys: list[str] | None = None) -> None:
    """Until the readers of ``keys`` (default: all) are connected."""
    readers = [r for k, r in b.readers.items() if keys is None or k in keys]
    await wait_for(lambda: all(r.connections > 0 for r in readers), what="subscriptions")
    await asyncio.sleep(0.3)  # the subscription reaches the PUB (slow joiner)


# -- promtool -----------------------------------------------------------------------------------


def test_promtool_checks_the_rules_and_runs_their_unit_tests(promtool: str) -> None:
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in check.stdout
    test = subprocess.run([promtool, "test", "rules", "alerts.tests.yaml"], cwd=FILES, capture_output=True, text=True, timeout=60)
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout


async def test_metrics_endpoint_passes_promtool_and_health_endpoints_answer(tmp_path: Path, promtool: str) -> None:
    ports = free_ports(2)
    port = free_port()
    async with Simulator(_sim(ports)) as sim:
        async with running_bridge(tmp_path, [_source("engine", ports)], metrics={"listen": f"127.0.0.1:{port}"}) as (b, out):
            await _subscribed(b)
            for _ in range(20):
                await sim.step()
            await wait_for(lambda: len(read_lines(out)) >= 20, what="20 batches")
            status, text = await http_get(port, "/metrics")
            assert status == 200
            assert (await http_get(port, "/healthz")) == (200, b"ok\n")
            status, body = await http_get(port, "/readyz")
            assert status == 200
            assert json.loads(body) == {"ready": True, "sinks": {"file": "ok"}, "sources_not_subscribed": []}
            assert (await http_get(port, "/nope"))[0] == 404
    check = await asyncio.to_thread(subprocess.run, [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert check.returncode == 0 and not check.stdout and not check.stderr, check.stdout + check.stderr
    exposition = text.decode()
    # kv_bridge_ready is current at every scrape, not only after a /readyz
    assert "\nkv_bridge_ready 1.0\n" in exposition
    assert 'kv_bridge_batches_received_total{dp_rank="0",source="engine"} 20.0' in exposition
    assert 'kv_bridge_sink_batches_total{outcome="delivered",sink="file"} 20.0' in exposition
    assert 'kv_bridge_lag_seconds_count{sink="file"} 20.0' in exposition  # per batch, not per event
    assert 'kv_bridge_events_received_total{source="engine",type="BlockStored"}' in exposition
    # low cardinality: only these label names, and no seq / hash / topic values anywhere
    names = set(re.findall(r"[{,]([a-z_]+)=", exposition))
    assert names <= {"source", "dp_rank", "sink", "reason", "type", "outcome", "version", "le"}, names
    assert len([line for line in exposition.splitlines() if line.startswith("kv_bridge_")]) < 300


# -- a real Prometheus: every dashboard query and alert expression --------------------------------


class FlakySink:
    """A sink that fails now and then: a transient error every ``fail_every`` writes, one rejection.
    It says it keeps state (and keeps none), so that the state series exist."""

    writes_state = True

    class Options(msgspec.Struct, forbid_unknown_fields=True):
        fail_every: int = 5
        reject_at: int = 12

    def __init__(self, name: str, options: FlakySink.Options, sink: object) -> None:
        self.name = name
        self.options = options
        self.writes = 0

    async def connect(self) -> None:
        pass

    async def write(self, messages: Sequence[Message]) -> None:
        self.writes += 1
        if self.writes == self.options.reject_at:
            raise Permanent("rejected by the test", reason="rejected")
        if self.writes % self.options.fail_every == 0:
            raise Retriable("flaky by design", reason="flaky")

    async def close(self) -> None:
        pass

    async def health(self) -> str | None:
        return None


@asynccontextmanager
async def _bridge(config: dict[str, Any], registry: Registry | None = None) -> AsyncIterator[Bridge]:
    b = Bridge(from_data(config, env={}), registry=registry)
    await b.start()
    try:
        yield b
    finally:
        await b.stop()


def _panel_targets() -> list[tuple[str, str]]:
    dash = json.loads((FILES / "dashboard.json").read_text())
    return [(f"{p['title']} [{t['refId']}]", t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def _variable_queries() -> dict[str, str]:
    dash = json.loads((FILES / "dashboard.json").read_text())
    return {v["name"]: v["query"] for v in dash["templating"]["list"] if v["type"] == "query"}


def _alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


async def _label_values(prom: PrometheusServer, query: str) -> list[str]:
    """What Grafana does for label_values(selector, label): the series API, then that label's values."""
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", grafana_expr(query))
    assert m, query
    series = await prometheus_api(prom, "series", **{"match[]": m.group(1)})
    return sorted({s[m.group(2)] for s in series if m.group(2) in s})


async def test_every_dashboard_query_and_alert_on_a_real_prometheus(tmp_path: Path, prometheus_factory: Any) -> None:
    sim_ports, (junk_port, dead_port), port = free_ports(2), free_ports(2), free_port()
    config = {
        "sources": [
            {**_source("engine", sim_ports), "snapshot": "vllm-50134"},  # (its state is switched off: none asked for)
            {"name": "junk", "endpoint": f"tcp://127.0.0.1:{junk_port}"},
            {"name": "dead", "endpoint": f"tcp://127.0.0.1:{dead_port}"},  # nothing listens: not connected
        ],
        "sinks": [
            {"type": "file", "name": "file", "path": str(tmp_path / "out.jsonl"), "format": "json", "granularity": "batch"},
            {"type": "flaky", "name": "flaky", "retry": {"initial_backoff": "10ms", "max_backoff": "20ms"}},
        ],
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        "checkpoint": {"path": str(tmp_path / "checkpoint.json"), "interval": "1s"},
        "replay": {"timeout": "300ms", "initial_backoff": "20ms", "max_backoff": "200ms"},
        "state": {"max_entries": 50},  # the simulated engine stores more: a stream's state is switched off
    }
    registry = Registry({"flaky": FlakySink})
    ctx = zmq.asyncio.Context()
    junk = ctx.socket(zmq.PUB)
    junk.setsockopt(zmq.LINGER, 0)
    junk.bind(f"tcp://127.0.0.1:{junk_port}")
    prom = prometheus_factory([f"127.0.0.1:{port}"], job="kv-event-bridge", rule_files=[str(RULES)])
    targets = _panel_targets()
    try:
        async with Simulator(_sim(sim_ports, buffer_steps=200, faults=Faults(drop_rate=0.02), seed=11)) as sim:
            async with _bridge(config, registry) as b:
                await _subscribed(b, ["engine/0", "junk/0"])
                rank = sim.ranks[0]

                async def steady(n: int) -> None:
                    for i in range(n):
                        await sim.step()
                        if i % 5 == 4:
                            await asyncio.sleep(0.01)

                async def publish() -> None:
                    await steady(200)
                    await junk.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])  # decode failure
                    await steady(100)
                    rank.faults.drop_rate = 1.0  # more than the replay buffer holds: lost
                    await steady(300)
                    rank.faults.drop_rate = 0.02
                    await steady(100)
                    rank.restart()  # a new epoch
                    while True:  # then steady traffic, so that every rate has samples
                        await sim.step()
                        await asyncio.sleep(0.02)

                publisher = asyncio.create_task(publish())
                try:
                    # every panel query returns data
                    pending = dict(targets)
                    deadline = asyncio.get_running_loop().time() + 40
                    while pending:
                        for name, expr in list(pending.items()):
                            if await prometheus_api(prom, "query", query=grafana_expr(expr)) != {
                                "resultType": "vector",
                                "result": [],
                            }:
                                del pending[name]
                        if asyncio.get_running_loop().time() > deadline:
                            raise AssertionError(f"no data for {sorted(pending)}")
                        await asyncio.sleep(0.5)
                    for name, expr in targets:  # and still does, all at once
                        data = await prometheus_api(prom, "query", query=grafana_expr(expr))
                        assert data["result"], name
                    # template variables find their values
                    variables = _variable_queries()
                    assert set(variables) == {"namespace", "pod", "source", "sink"}
                    assert await _label_values(prom, variables["source"]) == ["dead", "engine", "junk"]
                    assert await _label_values(prom, variables["sink"]) == ["file", "flaky"]
                    assert await _label_values(prom, variables["namespace"]) == []  # not scraped in Kubernetes
                    assert await _label_values(prom, variables["pod"]) == []
                    # every alert expression is a valid query; the rules load and evaluate cleanly
                    for rule in _alert_rules():
                        await prometheus_api(prom, "query", query=rule["expr"])
                    firing: set[str] = set()
                    deadline = asyncio.get_running_loop().time() + 15
                    while not {"KvBridgeDecodeFailures", "KvBridgeBatchesLost"} <= firing:
                        assert asyncio.get_running_loop().time() < deadline, f"firing: {firing}"
                        await asyncio.sleep(0.5)
                        alerts = (await prometheus_api(prom, "alerts"))["alerts"]
                        firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
                    groups = (await prometheus_api(prom, "rules"))["groups"]
                    rules = [r for g in groups for r in g["rules"]]
                    assert len(rules) == len(_alert_rules())
                    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
                    states = {r["name"]: r["state"] for r in rules}
                    # Only what happened fires: every stream's and reason's series starts at 0, and
                    # a stream with no batch yet exports a last-event time of 0 (breaker30h3 B3, B4:
                    # both alerts fired for every reason and for the never-trafficked streams).
                    decode = {
                        (a["labels"]["source"], a["labels"]["reason"])
                        for a in (await prometheus_api(prom, "alerts"))["alerts"]
                        if a["labels"]["alertname"] == "KvBridgeDecodeFailures"
                    }
                    assert decode == {("junk", "bad_msgpack")}, decode
                    assert states["KvBridgeSourceSilent"] == "inactive"  # "junk" and "dead" never had a batch
                    assert states["KvBridgeSinkErrors"] == "pending"  # failing, not yet for 5 minutes
                    assert states["KvBridgeDown"] == "inactive"
                    assert states["KvBridgeNotReady"] != "firing"  # the flaky sink is not ready for moments
                finally:
                    publisher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await publisher
                # what the queries saw happened
                assert metric(b, "kv_bridge_decode_failures_total", source="junk", reason="bad_msgpack") == 1
                assert metric(b, "kv_bridge_batches_lost_total", source="engine", reason="replay_buffer_exceeded") >= 1
                assert metric(b, "kv_bridge_source_restarts_total", source="engine") == 1
                assert metric(b, "kv_bridge_sink_batches_total", sink="flaky", outcome="dead_lettered") >= 1
                assert metric(b, "kv_bridge_sink_errors_total", sink="flaky", reason="flaky") >= 1
    finally:
        junk.close(linger=0)
        ctx.destroy(linger=0)


# -- /readyz with a real Redis sink ------------------------------------------------------------------


async def _readyz(port: int) -> tuple[int, dict[str, Any]]:
    status, body = await http_get(port, "/readyz")
    return status, json.loads(body)


async def _until_status(port: int, status: int, timeout: float = 15.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got, body = await _readyz(port)
        if got == status:
            return body
        assert loop.time() < deadline, f"/readyz still {got} after {timeout}s: {body}"
        await asyncio.sleep(0.1)


async def test_readyz_follows_a_redis_sink_going_away_and_back(
    tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bridge.sink, "HEALTH_INTERVAL", 0.5)  # idle health checks, faster than the default
    prefix = f"obs-{uuid.uuid4().hex[:8]}"
    sim_ports, port = free_ports(2), free_port()
    sinks = [
        {
            "type": "redis",
            "name": "redis",
            "url": redis_server.url,
            "stream": prefix + ":{source}:{dp_rank}",
            "format": "json",
            "granularity": "batch",
            "timeout": "1s",
            "retry": {"initial_backoff": "50ms", "max_backoff": "300ms"},
        }
    ]
    client = aioredis.from_url(redis_server.url)
    async with Simulator(_sim(sim_ports)) as sim:
        async with running_bridge(
            tmp_path, [_source("engine", sim_ports)], sinks=sinks, metrics={"listen": f"127.0.0.1:{port}"}
        ) as (b, _):
            await _subscribed(b)
            for _ in range(20):
                await sim.step()
            await wait_for(lambda: metric(b, "kv_bridge_sink_batches_total", sink="redis", outcome="delivered") >= 20)
            assert await _readyz(port) == (200, {"ready": True, "sinks": {"redis": "ok"}, "sources_not_subscribed": []})

            # 1. Redis goes away while the bridge has nothing to write: the idle health check sees it
            await redis_server.astop()
            body = await _until_status(port, 503)
            assert body["ready"] is False and body["sources_not_subscribed"] == []
            assert body["sinks"]["redis"].startswith("health: sinks[redis]: redis://"), body  # which, and why
            assert b"\nkv_bridge_ready 0.0\n" in (await http_get(port, "/metrics"))[1]
            assert metric(b, "kv_bridge_sink_up", sink="redis") == 0
            await redis_server.astart()
            assert (await _until_status(port, 200))["sinks"] == {"redis": "ok"}
            assert b"\nkv_bridge_ready 1.0\n" in (await http_get(port, "/metrics"))[1]

            # 2. Redis goes away while the bridge is writing: the failed writes show it
            stop = asyncio.Event()

            async def publish() -> None:
                while not stop.is_set():
                    await sim.step()
                    await asyncio.sleep(0.01)

            publisher = asyncio.create_task(publish())
            try:
                await asyncio.sleep(0.5)
                retries = metric(b, "kv_bridge_sink_retries_total", sink="redis")
                await redis_server.astop()
                body = await _until_status(port, 503)
                assert not body["sinks"]["redis"].startswith("health: "), body  # a write failed
                assert metric(b, "kv_bridge_sink_retries_total", sink="redis") > retries
                await asyncio.sleep(0.5)
                assert (await _readyz(port))[0] == 503
                await redis_server.astart()
                await _until_status(port, 200)
            finally:
                stop.set()
                await publisher
            published = sim.ranks[0].seq
            await wait_for(
                lambda: metric(b, "kv_bridge_sink_batches_total", sink="redis", outcome="delivered") >= published,
                what=f"{published} batches delivered after the outage",
            )
            assert metric(b, "kv_bridge_sink_queue_batches", sink="redis") == 0
    try:
        assert await client.xlen(f"{prefix}:engine:0") == published  # every batch once, none lost
    finally:
        await client.delete(f"{prefix}:engine:0")
        await client.aclose()


async def test_readyz_says_not_ready_while_the_checkpoint_cannot_be_saved(tmp_path: Path) -> None:
    """A bridge whose checkpoint saves fail (its volume full or gone) would resume, after a restart,
    from a save as old as the failure: not ready, with the path and the error, until one succeeds."""
    sim_ports, port = free_ports(2), free_port()
    volume = tmp_path / "volume"
    checkpoint = {"path": str(volume / "c.json"), "interval": "100ms"}
    async with Simulator(_sim(sim_ports)) as sim:
        async with running_bridge(
            tmp_path, [_source("engine", sim_ports)], checkpoint=checkpoint, metrics={"listen": f"127.0.0.1:{port}"}
        ) as (b, _):
            await _subscribed(b)
            for _ in range(5):
                await sim.step()
            await wait_for(lambda: metric(b, "kv_bridge_checkpoint_last_save_timestamp_seconds") > 0, what="a save")
            assert (await _readyz(port))[0] == 200
            for n in range(50):  # every save fails once a file stands where the checkpoint's directory was
                # (moved away whole: a save writing into it meanwhile must not make a removal fail;
                # one that makes the directory again before the file is written is moved away too)
                with contextlib.suppress(FileNotFoundError):
                    volume.rename(tmp_path / f"gone-{n}")
                try:
                    volume.write_text("a file where the checkpoint's directory was\n")
                    break
                except IsADirectoryError:
                    continue
            body = await _until_status(port, 503)
            assert body["checkpoint"].startswith(f"checkpoint.path: cannot save {volume / 'c.json'} ("), body
            assert "a restart would resume from the last save (the last one " in body["checkpoint"], body
            assert metric(b, "kv_bridge_checkpoint_save_failures_total") > 0
            assert b"\nkv_bridge_ready 0.0\n" in (await http_get(port, "/metrics"))[1]
            volume.unlink()  # the volume is back: the next save succeeds
            body = await _until_status(port, 200)
            assert "checkpoint" not in body
            await sim.step()
            saved = metric(b, "kv_bridge_checkpoint_last_save_timestamp_seconds")
            await wait_for(lambda: metric(b, "kv_bridge_checkpoint_last_save_timestamp_seconds") > saved, what="saves again")


# -- logs -----------------------------------------------------------------------------------------


async def test_gaps_restarts_and_losses_log_one_line_per_state_change(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bridge")
    ports = free_ports(2)
    since = time.time()
    async with Simulator(_sim(ports, buffer_steps=100)) as sim:
        async with running_bridge(tmp_path, [_source("engine", ports)]) as (b, out):
            await _subscribed(b)
            rank = sim.ranks[0]

            async def steps(n: int, drop: float = 0.0) -> None:
                rank.faults.drop_rate = drop
                for _ in range(n):
                    await sim.step()
                rank.faults.drop_rate = 0.0

            def delivered() -> int:
                return len([ln for ln in read_lines(out) if "events" in ln])

            await steps(20)
            await steps(50, drop=1.0)  # a gap of 50, recovered through replay
            await steps(1)
            await wait_for(lambda: delivered() >= 71, what="the gap repaired")
            rank.restart()  # a new epoch
            await steps(30)
            await wait_for(lambda: delivered() >= 101, what="the new epoch")
            await steps(150, drop=1.0)  # beyond the replay buffer (100)
            await steps(1)
            await wait_for(
                lambda: metric(b, "kv_bridge_batches_lost_total", source="engine", reason="replay_buffer_exceeded") >= 1,
                what="the loss",
            )
            await wait_for(lambda: delivered() >= 201, what="the rest")
            gaps = metric(b, "kv_bridge_sequence_gaps_total", source="engine", dp_rank="0")
            restarts = metric(b, "kv_bridge_source_restarts_total", source="engine")
            lost = metric(b, "kv_bridge_batches_lost_total", source="engine", reason="replay_buffer_exceeded")

    def lines(message: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage() == message]

    # logs and metrics agree, and neither counts per event or per batch
    assert gaps == 2 and len(lines("sequence gap")) == 2
    assert [(r.from_seq, r.to_seq) for r in lines("sequence gap")] == [(20, 69), (30, 179)]  # type: ignore[attr-defined]
    assert restarts == 1 and len(lines("engine restarted: new epoch")) == 1
    # The line names the epoch the restart opened (the clock's, above the first); the same as the
    # SourceReset written.
    first = assert_first_epoch(read_lines(out)[0]["epoch"], since)
    resets = [ln["epoch"] for ln in read_lines(out) if ln.get("type") == "SourceReset"]
    assert lines("engine restarted: new epoch")[0].epoch == assert_next_epoch(resets[0], first, since)  # type: ignore[attr-defined]
    assert len(resets) == 1
    assert lost == 51 and len(lines("batches lost")) == 1  # 30..80: only 81..180 were still in the buffer
    assert (lines("batches lost")[0].from_seq, lines("batches lost")[0].to_seq) == (30, 80)  # type: ignore[attr-defined]
    assert all(r.stream == "engine/0" for r in caplog.records if hasattr(r, "from_seq"))  # type: ignore[attr-defined]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 3


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_repeated_decode_failures_are_counted_each_but_logged_rate_limited(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    handler = ListHandler()
    shown = handler.records
    handler.addFilter(RateLimit(burst=5, interval=1.0))  # what logs.setup() installs (there 60 s)
    logger = logging.getLogger("bridge")
    logger.addHandler(handler)
    try:
        async with running_bridge(tmp_path, [{"name": "junk", "endpoint": f"tcp://127.0.0.1:{port}"}]) as (b, _):
            await _subscribed(b)
            for seq in range(50):
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
            await wait_for(lambda: metric(b, "kv_bridge_decode_failures_total", source="junk", reason="bad_msgpack") == 50)
            failures = [r for r in shown if r.getMessage() == "decode failure"]
            assert len(failures) == 5
            await asyncio.sleep(1.1)  # the interval is over: the next one passes and says what was held back
            await pub.send_multipart([b"", (50).to_bytes(8, "big"), b"\xc1 not msgpack"])
            await wait_for(lambda: len([r for r in shown if r.getMessage() == "decode failure"]) == 6)
            assert [r for r in shown if r.getMessage() == "decode failure"][-1].suppressed == 45  # type: ignore[attr-defined]
            assert metric(b, "kv_bridge_dead_letters_total", reason="bad_msgpack") == 51
    finally:
        logger.removeHandler(handler)
        pub.close(linger=0)
        ctx.destroy(linger=0)
