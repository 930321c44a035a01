"""A source removed and added again (DNS discovery does this when a pod flaps) while one sink is full.

The stream is waiting to hand a batch to the full sink when its source goes away; the batch was
already queued on the other sink. When the source comes back it must resume from the last batch
every sink has (not from where its sequencer got to), so the full sink skips nothing and the
checkpoint never passes a batch one sink did not get (issue: compound faults, case 5).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.checkpoint import StreamPosition
from bridge.config import from_data
from bridge.connector import Registry
from bridge.runtime import Bridge
from tests.support.harness import free_ports, read_lines, wait_for
from tests.support.memory import MemoryConnector
from tests.support.scripted_engine import ScriptedEngine, check_invariants, identify

pytestmark = pytest.mark.integration


async def test_source_removed_while_a_sink_is_full_resumes_where_every_sink_has_it(tmp_path: Path) -> None:
    live, replay = free_ports(2)
    out = tmp_path / "out.jsonl"
    source = {"name": "flap", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    cfg = from_data(
        {
            "sources": [source],
            "sinks": [
                {"type": "file", "path": str(out), "format": "json", "granularity": "batch", "batch": {"linger": 0}},
                {"type": "memory", "format": "json", "granularity": "batch", "queue": {"max_batches": 2}, "batch": {"linger": 0}},
            ],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
            "checkpoint": {"path": str(tmp_path / "ck.json"), "interval": "100ms"},
            "replay": {"timeout": "300ms", "initial_backoff": "50ms", "max_backoff": "200ms", "idle_probe": "0s"},
        },
        env={},
    )
    async with ScriptedEngine(live, replay) as engine:
        bridge = Bridge(cfg, registry=Registry({"memory": MemoryConnector}))
        await bridge.start()
        try:
            memory = bridge.workers[1].connector
            assert isinstance(memory, MemoryConnector)
            memory.gate = asyncio.Event()  # the memory sink's writes hang: its queue fills
            await engine.wait_subscribed()
            await engine.publish(6)
            # The file sink has more than the memory sink's queue holds: the stream waits on it.
            await wait_for(lambda: len(read_lines(out)) >= 3, what="the file sink ahead of the full one")
            await asyncio.sleep(0.2)
            key = "flap/0"
            await bridge.remove_source("flap")
            assert key not in bridge.pipelines
            await engine.publish(3, deliver=False)  # published while the source was gone: replay brings them
            await bridge.add_source(cfg.sources[0])
            await engine.wait_subscribed()
            await engine.publish(2)
            memory.gate.set()
            await wait_for(lambda: any(identify(r) == (0, 10) for r in read_lines(out)), what="the last batch in the file")
            await wait_for(lambda: bridge.checkpointer.position(key) is not None and bridge.checkpointer.position(key).seq == 10)
            got = [int(m.headers["seq"]) for m in memory.messages if m.record.kind == "batch"]
        finally:
            await bridge.stop()
    assert sorted(set(got)) == list(range(11)), f"the full sink skipped batches: {got}"
    assert got == sorted(got), f"the full sink got batches out of order: {got}"
    check_invariants(read_lines(out), engine)


async def test_a_source_gone_for_forget_after_is_forgotten(tmp_path: Path) -> None:
    """Discovery churn must not grow per-source state forever: after ``discovery.forget_after``
    a removed source's resume point, checkpoint entry and metric series are dropped."""
    live, replay = free_ports(2)
    source = {"name": "gone", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    cfg = from_data(
        {
            "sources": [source],
            "sinks": [{"type": "file", "path": str(tmp_path / "out.jsonl"), "format": "json", "batch": {"linger": 0}}],
            "metrics": {"listen": ""},
            "checkpoint": {"path": str(tmp_path / "ck.json"), "interval": "1h"},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        },
        env={},
    )
    series = "kv_bridge_batches_received_total"
    async with ScriptedEngine(live, replay) as engine:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.publish(3)
            await wait_for(lambda: (bridge.checkpointer.position("gone/0") or StreamPosition(0, -1)).seq == 2)
            await bridge.remove_source("gone")
            bridge.forget_retired(time.monotonic() - 60)  # removed just now: kept
            assert bridge.checkpointer.position("gone/0") is not None
            assert bridge.metrics.registry.get_sample_value(series, {"source": "gone", "dp_rank": "0"}) == 3
            bridge.forget_retired(time.monotonic() + 1)
            assert bridge.checkpointer.position("gone/0") is None
            assert "gone/0" not in bridge.checkpointer.snapshot()[1].streams
            assert bridge.metrics.registry.get_sample_value(series, {"source": "gone", "dp_rank": "0"}) is None
            # Back after being forgotten: a stream met for the first time again, in a new epoch.
            await bridge.add_source(cfg.sources[0])
            await engine.wait_subscribed()
            await engine.publish(1)
            await wait_for(lambda: (bridge.checkpointer.position("gone/0") or StreamPosition(0, -1)).seq == 3)
        finally:
            await bridge.stop()


def _churn_config(tmp_path: Path, live: int, replay: int) -> Any:
    out = str(tmp_path / "out.jsonl")
    source = {"name": "flap", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    return from_data(
        {
            "sources": [source],
            "sinks": [{"type": "file", "path": out, "format": "json", "granularity": "batch", "batch": {"linger": 0}}],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
            "checkpoint": {"path": str(tmp_path / "ck.json"), "interval": "100ms"},
            "replay": {
                "timeout": "300ms",
                "max_attempts": 20,
                "initial_backoff": "50ms",
                "max_backoff": "200ms",
                "idle_probe": "300ms",
            },
        },
        env={},
    )


async def _flap_across_a_restart(bridge: Bridge, engine: ScriptedEngine, cfg: Any, out: Path) -> None:
    """Discovery removes the source; the engine restarts (0..1 published before the source is
    back); the source comes back; the new instance publishes 2 live, until it is in the output."""
    await bridge.remove_source("flap")
    await engine.restart()
    await engine.publish(2, deliver=False)
    engine.replay = "answer"
    await bridge.add_source(cfg.sources[0])
    await engine.wait_subscribed()
    await engine.publish(1)
    await wait_for(lambda: any("events" in r and identify(r) == (1, 2) for r in read_lines(out)), what="the new instance's 2")


async def test_batches_held_above_a_gap_are_delivered_after_a_removal_across_a_restart(tmp_path: Path) -> None:
    """Issue 29 case 17: 0..2 live, 3 dropped (replay ignored), 4..5 live, held above the gap.
    The source is removed and comes back after the engine restarted: 4..5 reached the bridge and
    are delivered under the old epoch, 3 announced lost (before the fix the stream resumed from a
    position alone and announced 3..5 lost: I4)."""
    live, replay = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = _churn_config(tmp_path, live, replay)
    async with ScriptedEngine(live, replay) as engine:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.publish(3)
            await wait_for(lambda: len(read_lines(out)) == 3, what="0..2 delivered")
            engine.replay = "ignore"
            await engine.publish(1, deliver=False)
            await engine.publish(2)
            await wait_for(lambda: len(bridge.pipelines["flap/0"].sequencer.held) == 2, what="4..5 held above the gap")
            await _flap_across_a_restart(bridge, engine, cfg, out)
        finally:
            await bridge.stop()
    views = check_invariants(read_lines(out), engine)
    assert [(v.instances, v.delivered, v.lost) for v in views] == [({0}, [0, 1, 2, 4, 5], [3]), ({1}, [0, 1, 2], [])]


async def test_batches_read_in_doubt_are_settled_after_a_removal_across_a_restart(tmp_path: Path) -> None:
    """Issue 29 case 17: 0..2 live; the connection drops and comes back (the same instance), 3..4
    are read in doubt and wait for a replay that is ignored. The source is removed and comes back
    after the engine restarted: 3..4 are announced lost under the old epoch (docs/concepts/correctness.md's I4
    exception for batches read in doubt: nothing tells whose they are), never forgotten (before
    the fix: neither delivered nor announced, I3)."""
    live, replay = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = _churn_config(tmp_path, live, replay)
    async with ScriptedEngine(live, replay) as engine:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.publish(3)
            await wait_for(lambda: len(read_lines(out)) == 3, what="0..2 delivered")
            engine.replay = "ignore"
            seqr = bridge.pipelines["flap/0"].sequencer
            await engine.blip()
            await wait_for(lambda: seqr.in_doubt, what="the drop noticed")
            await engine.wait_subscribed()
            await asyncio.sleep(0.2)  # (the monitor's event comes with the reconnect: nothing to wait for)
            await engine.publish(2)
            await wait_for(lambda: len(seqr.unverified) == 2, what="3..4 read in doubt")
            await _flap_across_a_restart(bridge, engine, cfg, out)
        finally:
            await bridge.stop()
    views = check_invariants(read_lines(out), engine, held_cap_exceeded=True)  # (I4 relaxed: read in doubt)
    assert [(v.instances, v.delivered, v.lost) for v in views] == [({0}, [0, 1, 2], [3, 4]), ({1}, [0, 1, 2], [])]
