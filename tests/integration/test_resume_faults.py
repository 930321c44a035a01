"""A bridge restarted (crashed, or stopped while a sink is down) right after its engine restarted,
end to end: a :class:`ScriptedEngine` (real ZMQ sockets) -> an in-process :class:`Bridge` -> a
file sink that can be held down (:class:`tests.support.gated.GatedFile`), checked against
design.md's I1-I4 with ``check_invariants``.

In each case the new epoch (its SourceReset, and maybe its first batch) is on disk in the
checkpoint but never reached the sink; the engine is still the same instance and still buffers
everything it published, so the next bridge must lose nothing of it, deliver it in one epoch
opened by a SourceReset, and not take what the sink never got for delivered. Found by an
invariant breaker; the ``baseline`` tests are the same steps without the engine restart or the
source churn (they hold with and without the fix).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config, from_data
from bridge.runtime import Bridge
from tests.support.cache_engine import CacheEngine
from tests.support.gated import GATED, crash, gated_registry, gated_sink
from tests.support.harness import free_port, free_ports, metric, read_lines, wait_for
from tests.support.scripted_engine import EpochView, ScriptedEngine, check_invariants, identify

pytestmark = pytest.mark.integration

KEY = "eng/0"
REPLAY = {"timeout": "500ms", "initial_backoff": "50ms", "max_backoff": "500ms", "idle_probe": 0}
# An idle probe asks the engine's replay buffer for the tail after this much quiet: it is how a
# restart with nothing published yet is noticed.
PROBING = {**REPLAY, "idle_probe": "300ms"}
WAIT = 10.0


def config(
    tmp: Path,
    live: int,
    replay_port: int,
    *,
    replay: dict[str, Any],
    checkpoint_interval: str = "200ms",
    replay_endpoint: bool = True,
    queue: dict[str, Any] | None = None,
    backpressure: str = "block",
) -> Config:
    source = {"name": "eng", "endpoint": f"tcp://127.0.0.1:{live}"}
    if replay_endpoint:
        source["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    return from_data(
        {
            "sources": [source],
            "sinks": [
                {
                    "type": GATED,
                    "name": "out",
                    "path": str(tmp / "out.jsonl"),
                    "format": "json",
                    "granularity": "batch",
                    "batch": {"linger": 0},
                    "retry": {"write_timeout": "300ms", "initial_backoff": "20ms", "max_backoff": "100ms"},
                    **({"queue": queue} if queue else {}),
                    "backpressure": backpressure,
                }
            ],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp / "dead.jsonl")},
            "checkpoint": {"path": str(tmp / "checkpoint.json"), "interval": checkpoint_interval},
            "replay": replay,
            "shutdown_timeout": "1s",
        },
        env={},
    )


def on_disk(tmp: Path) -> dict[str, Any]:
    path = tmp / "checkpoint.json"
    return json.loads(path.read_text()) if path.exists() else {}


def has(out: Path, instance: int, seq: int) -> bool:
    return any("events" in r and identify(r) == (instance, seq) for r in read_lines(out))


def completed_replays(bridge: Bridge) -> float:
    return metric(bridge, "kv_bridge_replay_requests_total", source="eng", outcome="complete")


def dedupe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Without exact re-deliveries (what a consumer deduplicating on source/rank/epoch/seq/index
    does: at-least-once after a crash). A same key with another body stays, for the checker."""
    seen: set[str] = set()
    kept = []
    for r in records:
        k = json.dumps(r, sort_keys=True)
        if k not in seen:
            seen.add(k)
            kept.append(r)
    return kept


def layout(views: list[EpochView]) -> list[tuple[bool, set[int], list[int], list[int]]]:
    """Per epoch: (opened by SourceReset, instances, seqs delivered, seqs announced lost)."""
    return [(v.reset, v.instances, v.delivered, v.lost) for v in views]


def resets(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(r["epoch"], r["reason"]) for r in records if r.get("type") == "SourceReset"]


async def first_run_until_delivered(engine: ScriptedEngine, bridge: Bridge, out: Path, n: int) -> int:
    """The bridge subscribed, ``n`` batches of instance 0 delivered, acknowledged and saved; their epoch."""
    await engine.wait_subscribed()
    await engine.publish(n)
    await wait_for(lambda: has(out, 0, n - 1), timeout=WAIT, what=f"instance 0's 0..{n - 1} in the sink")
    await wait_for(lambda: (p := bridge.checkpointer.position(KEY)) is not None and p.seq == n - 1, timeout=WAIT)
    await bridge.store.save()
    return int(read_lines(out)[-1]["epoch"])


async def second_run_publishes_5(cfg: Config, engine: ScriptedEngine, out: Path, last: int) -> None:
    """The next bridge, subscribed, reads 5 batches of instance 1 live, up to ``last``; then stops."""
    second = Bridge(cfg, registry=gated_registry())
    await second.start()
    try:
        await engine.wait_subscribed()
        await asyncio.sleep(0.2)  # (the subscription settles: XPUB reports it a little early)
        await engine.publish(5)
        await wait_for(lambda: has(out, 1, last), timeout=WAIT, what=f"instance 1's batches up to {last}")
    finally:
        await second.stop()


async def until_probed(bridge: Bridge) -> None:
    """Until an idle probe (after what is delivered so far) got its answer from the engine."""
    done = completed_replays(bridge)
    await wait_for(lambda: completed_replays(bridge) > done, timeout=WAIT, what="an idle probe answered")


async def stop_first(bridge: Bridge, how: str) -> None:
    if how == "crash":
        await crash(bridge)  # kill -9: the checkpoint file as last saved
    else:
        await bridge.stop()  # SIGTERM: flush (times out: the sink is down), then save


# -- resumed from a checkpoint that holds the new epoch --------------------------------------------


@pytest.mark.parametrize("how", ["crash", "graceful"])
async def test_resumed_at_an_epochs_first_batch_announces_the_epoch_and_delivers_that_batch(tmp_path: Path, how: str) -> None:
    """0..9 delivered and saved; the sink goes down; the engine restarts and publishes 0..4: the
    bridge opens a new epoch and saves its first batch (seq 0) before it goes out, but neither the
    SourceReset nor any batch reaches the sink before the bridge stops (``how``). The next bridge
    (sink up, the engine still the same instance, buffering 0..4) must not take seq 0 for
    delivered: it announces the epoch and delivers 0..4, then 5..9."""
    live, rep = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = config(tmp_path, live, rep, replay=REPLAY)
    async with ScriptedEngine(live, rep) as engine:
        first = Bridge(cfg, registry=gated_registry())
        await first.start()
        try:
            e0 = await first_run_until_delivered(engine, first, out, 10)
            gated_sink(first).close_gate()
            await engine.restart()
            await engine.wait_subscribed()
            await engine.publish(5)
            await wait_for(
                lambda: on_disk(tmp_path).get("opened", {}).get(KEY, {}).get("epoch", e0) > e0,
                timeout=WAIT,
                what="the new epoch's first batch saved",
            )
            assert len(read_lines(out)) == 10  # nothing of the new epoch reached the sink
            await stop_first(first, how)
        finally:
            await first.stop()

        second = Bridge(cfg, registry=gated_registry())
        await second.start()
        try:
            await engine.wait_subscribed()
            await wait_for(lambda: has(out, 1, 4), timeout=WAIT, what="instance 1's 0..4 from the replay buffer")
            await engine.publish(5)
            await wait_for(lambda: has(out, 1, 9), timeout=WAIT, what="instance 1's 5..9")
        finally:
            await second.stop()
    records = read_lines(out)
    views = check_invariants(records, engine)
    assert layout(views) == [(False, {0}, list(range(10)), []), (True, {1}, list(range(10)), [])]
    assert records == dedupe(records), "a batch delivered twice"
    assert resets(records) == [(views[1].epoch, "bridge_restart")]


@pytest.mark.parametrize("how", ["crash", "graceful"])
async def test_resumed_after_an_epoch_opened_without_batches_announces_the_epoch(tmp_path: Path, how: str) -> None:
    """0..9 delivered and saved; the sink goes down; the engine restarts and publishes nothing: an
    idle probe finds its buffer empty, the bridge opens a new epoch (saved) and queues its
    SourceReset behind the down sink, and stops (``how``). The next bridge starts the stream in a
    new epoch, which a SourceReset must open before the new instance's 0..9."""
    live, rep = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = config(tmp_path, live, rep, replay=PROBING)
    async with ScriptedEngine(live, rep) as engine:
        first = Bridge(cfg, registry=gated_registry())
        await first.start()
        try:
            e0 = await first_run_until_delivered(engine, first, out, 10)
            await until_probed(first)  # the engine's buffer answers after 9
            gated_sink(first).close_gate()
            await engine.restart()
            await engine.wait_subscribed()
            await wait_for(lambda: first.checkpointer.epochs.get(KEY, e0) > e0, timeout=WAIT, what="the restart noticed")
            await wait_for(
                lambda: on_disk(tmp_path).get("epochs", {}).get(KEY, e0) > e0, timeout=WAIT, what="the new epoch saved"
            )
            assert len(read_lines(out)) == 10  # the SourceReset did not reach the sink
            await stop_first(first, how)
        finally:
            await first.stop()

        second = Bridge(cfg, registry=gated_registry())
        await second.start()
        try:
            await engine.wait_subscribed()
            await wait_for(lambda: completed_replays(second) >= 1, timeout=WAIT, what="the start-up replay")
            await engine.publish(10)
            await wait_for(lambda: has(out, 1, 9), timeout=WAIT, what="instance 1's 0..9")
        finally:
            await second.stop()
    records = read_lines(out)
    views = check_invariants(records, engine)
    assert layout(views) == [(False, {0}, list(range(10)), []), (True, {1}, list(range(10)), [])]
    assert records == dedupe(records), "a batch delivered twice"
    assert resets(records) == [(views[1].epoch, "bridge_restart")]


async def test_crash_without_an_engine_restart_resumes_after_what_was_delivered_baseline(tmp_path: Path) -> None:
    """Baseline of the first case: the sink goes down, the engine (not restarted) publishes
    10..14, the bridge crashes; the next one delivers 10..19 in the same epoch."""
    live, rep = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = config(tmp_path, live, rep, replay=REPLAY)
    async with ScriptedEngine(live, rep) as engine:
        first = Bridge(cfg, registry=gated_registry())
        await first.start()
        try:
            await first_run_until_delivered(engine, first, out, 10)
            gated_sink(first).close_gate()
            await engine.publish(5)
            await wait_for(lambda: metric(first, "kv_bridge_batches_received_total", source="eng", dp_rank="0") >= 15)
            await crash(first)
        finally:
            await first.stop()
        second = Bridge(cfg, registry=gated_registry())
        await second.start()
        try:
            await engine.wait_subscribed()
            await wait_for(lambda: has(out, 0, 14), timeout=WAIT, what="10..14 from the replay buffer")
            await engine.publish(5)
            await wait_for(lambda: has(out, 0, 19), timeout=WAIT, what="15..19")
        finally:
            await second.stop()
    records = read_lines(out)
    assert layout(check_invariants(dedupe(records), engine)) == [(False, {0}, list(range(20)), [])]


# -- a source removed and added again after the restart, then a crash -------------------------------


async def churn_then_crash(tmp: Path, *, churn: bool) -> tuple[list[dict[str, Any]], ScriptedEngine]:
    """0..9 delivered and saved; the sink is slow; the engine restarts (nothing published), an
    idle probe notices it and the SourceReset waits for the sink; discovery drops the source and
    brings it back (``churn``); the sink recovers; the engine publishes 0..4, delivered; the bridge
    is killed before its next periodic save. The next bridge gets 5..9 live."""
    live, rep = free_ports(2)
    out = tmp / "out.jsonl"
    cfg = config(tmp, live, rep, replay=PROBING, checkpoint_interval="60s")
    async with ScriptedEngine(live, rep) as engine:
        first = Bridge(cfg, registry=gated_registry())
        await first.start()
        try:
            e0 = await first_run_until_delivered(engine, first, out, 10)
            await until_probed(first)
            gated_sink(first).close_gate()
            await engine.restart()  # instance 1, nothing published yet
            await wait_for(lambda: first.checkpointer.epochs.get(KEY, e0) > e0, timeout=WAIT, what="the restart noticed")
            if churn:
                await first.remove_source("eng")
                await first.add_source(cfg.sources[0])
            gated_sink(first).open_gate()
            await engine.wait_subscribed()
            await wait_for(lambda: any(r.get("type") == "SourceReset" for r in read_lines(out)), timeout=WAIT)
            await engine.publish(5)
            await wait_for(lambda: has(out, 1, 4), timeout=WAIT, what="instance 1's 0..4")
            await crash(first)
        finally:
            await first.stop()

        second = Bridge(cfg, registry=gated_registry())
        await second.start()
        try:
            await engine.wait_subscribed()
            await wait_for(lambda: completed_replays(second) >= 1, timeout=WAIT, what="the start-up replay")
            await engine.publish(5)
            await wait_for(lambda: has(out, 1, 9), timeout=WAIT, what="instance 1's 5..9")
        finally:
            await second.stop()
    return read_lines(out), engine


def assert_one_epoch_per_instance(records: list[dict[str, Any]], engine: ScriptedEngine) -> None:
    views = check_invariants(dedupe(records), engine)
    assert layout(views) == [(False, {0}, list(range(10)), []), (True, {1}, list(range(10)), [])]
    # After the kill, only what the checkpoint did not cover may come again, as an exact copy.
    again = [identify(r) for r in records if "events" in r and records.count(r) > 1]
    assert set(again) <= {(1, s) for s in range(5)}, again


async def test_a_source_re_added_after_a_restart_notes_its_first_batch(tmp_path: Path) -> None:
    """The re-added stream's first batch (instance 1's seq 0, in the epoch the removed stream
    opened) is saved before it goes out, so that the bridge killed afterwards resumes in that
    epoch: instance 1 in one epoch, opened by a SourceReset (not in two, the second unannounced)."""
    records, engine = await churn_then_crash(tmp_path, churn=True)
    assert_one_epoch_per_instance(records, engine)


async def test_a_crash_after_a_restart_resumes_in_the_new_epoch_baseline(tmp_path: Path) -> None:
    """Baseline of the churn case: the same steps without the source removed and added again."""
    records, engine = await churn_then_crash(tmp_path, churn=False)
    assert_one_epoch_per_instance(records, engine)


# -- a publisher that sends its lifetime UUID (vLLM #57789) ----------------------------------------


@pytest.mark.parametrize("how", ["crash", "graceful"])
async def test_a_restart_while_the_bridge_was_away_is_certain_from_the_checkpointed_uuid(tmp_path: Path, how: str) -> None:
    """No replay endpoint (KAITO's default). Instance 0's 0..9 are delivered and saved with its
    UUID; while no bridge runs, the engine restarts and publishes 0..14; then 15..19 reach the next
    bridge live. Its seq 15 follows the old 9 with nothing to verify it by; the checkpointed UUID
    says another instance: a new epoch opened by a SourceReset (instance_changed), 0..14 announced
    lost in it, 15..19 delivered in it. (Without the UUID in the checkpoint, 15..19 went into
    instance 0's epoch: I1.)"""
    live, rep = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = config(tmp_path, live, rep, replay=REPLAY, replay_endpoint=False)
    async with ScriptedEngine(live, rep, uuid=True) as engine:
        first = Bridge(cfg, registry=gated_registry())
        await first.start()
        try:
            await first_run_until_delivered(engine, first, out, 10)
            assert on_disk(tmp_path)["instances"][KEY]["id"] == engine.current.uuid.hex()
            await stop_first(first, how)
        finally:
            await first.stop()
        await engine.restart()
        await engine.publish(15, deliver=False)
        await second_run_publishes_5(cfg, engine, out, 19)
    records = read_lines(out)
    assert resets(records)[-1][1] == "instance_changed"
    assert layout(check_invariants(dedupe(records), engine)) == [
        (False, {0}, list(range(10)), []),
        (True, {1}, list(range(15, 20)), list(range(15))),
    ]
    assert on_disk(tmp_path)["instances"][KEY]["id"] == engine.current.uuid.hex()


async def test_a_crash_keeps_how_far_the_engine_was_seen_to_publish_for_a_restart_found_after_it(tmp_path: Path) -> None:
    """breaker79 B2 (I3): 0..9 delivered and saved; 10..14 dropped live while the replay socket
    ignores requests, 15..19 read live and held behind that gap; the bridge crashes (its
    checkpoint at 9, and how far it saw instance 0 publish: 19); the engine restarts while no bridge
    runs. The next bridge finds the restart, and instance 0's 10..19 were neither delivered nor
    announced: the SourceReset closed its epoch at the checkpoint. Now they are announced lost in
    it (publisher_restart) before the new epoch opens."""
    live, rep = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = config(tmp_path, live, rep, replay=REPLAY)
    async with ScriptedEngine(live, rep) as engine:
        first = Bridge(cfg, registry=gated_registry())
        await first.start()
        try:
            await first_run_until_delivered(engine, first, out, 10)
            engine.replay = "ignore"
            await engine.publish(5, deliver=False)
            await engine.publish(5)
            await wait_for(lambda: first.pipelines[KEY].sequencer.known_top == 19, timeout=WAIT, what="15..19 read")
            await first.store.save()
            assert on_disk(tmp_path)["published"][KEY] == {"epoch": on_disk(tmp_path)["streams"][KEY]["epoch"], "seq": 19}
            await crash(first)
        finally:
            await first.stop()
        await engine.restart()
        engine.replay = "answer"
        await second_run_publishes_5(cfg, engine, out, 4)
    records = read_lines(out)
    # (I4 relaxed: 15..19 reached the bridge that crashed, and no sink; what a crash loses is lost.)
    assert layout(check_invariants(dedupe(records), engine, held_cap_exceeded=True)) == [
        (False, {0}, list(range(10)), list(range(10, 20))),
        (True, {1}, list(range(5)), []),
    ]
    assert [r["reason"] for r in records if r["type"] == "EventsLost"] == ["publisher_restart"]


async def test_a_stop_while_the_checkpoint_cannot_be_saved_hands_no_record_of_an_unsaved_epoch(tmp_path: Path) -> None:
    """breaker95 B1: saves failing (the checkpoint's directory gone, a file in its place), the
    engine restarted: its new epoch waited to be saved, and a SIGTERM then handed its records to
    the sinks anyway. The next start, from the file (which names only the old epoch), gave the
    same number to the engine's next instance: (epoch, 0) delivered twice with different events,
    4 of 5 runs. At a stop an epoch that cannot be saved hands nothing on; the next start reads it
    again from the last save."""
    volume, out = tmp_path / "vol", tmp_path / "out.jsonl"
    volume.mkdir()
    live, rep = free_port(), free_port()
    cfg = {
        "sources": [{"name": "eng", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}],
        "sinks": [{"type": "file", "path": str(out), "batch": {"linger": 0}}],
        "metrics": {"listen": ""},
        "checkpoint": {"path": str(volume / "c.json"), "interval": "100ms"},
        "shutdown_timeout": "3s",
    }

    def epochs() -> list[int]:
        return sorted({int(r["epoch"]) for r in read_lines(out)})

    async with CacheEngine(live, rep, seed=7) as engine:
        bridge = Bridge(from_data(cfg, env={}))
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(3)
            await wait_for(lambda: len(read_lines(out)) >= 3 and bridge.checkpointer.written > 0, what="3 batches, saved")
            first = epochs()
            volume.rename(tmp_path / "kept")  # (the last good save, put back before the next start)
            volume.write_text("a file where the checkpoint's directory was\n")
            await engine.restart()
            await engine.wait_subscribed()
            await engine.step(2)
            restarts = "kv_bridge_source_restarts_total"
            await wait_for(lambda: metric(bridge, restarts, source="eng") >= 1, what="the new epoch opened (not saved)")
            await wait_for(lambda: not bridge.readiness()[0], what="not ready: the new epoch cannot be saved")
            assert "cannot save" in bridge.readiness()[1]["checkpoint"]
        finally:
            await bridge.stop()
        assert epochs() == first, "a record of the unsaved epoch reached the sink"
        volume.unlink()
        (tmp_path / "kept").rename(volume)
        await engine.restart()  # (another instance: the number the unsaved epoch had must not be reused for it)
        again = Bridge(from_data(cfg, env={}))
        await again.start()
        try:
            await engine.wait_subscribed()
            await engine.step(2)
            await wait_for(lambda: len(epochs()) > 1, what="the new instance's batches")
        finally:
            await again.stop()
    held = read_lines(out)
    seen: dict[tuple[int, int], Any] = {}
    for h in held:
        if h.get("type") == "EventBatch":
            key = (int(h["epoch"]), int(h["seq"]))
            assert seen.setdefault(key, h["events"]) == h["events"], f"{key} delivered with two payloads"


async def restart_behind_a_stalled_sink(engine: ScriptedEngine, bridge: Bridge, out: Path) -> int:
    """10 batches delivered, then the sink stalls (its queue of 20 fills: the source's pipeline
    call parks) while the engine publishes 200 more, which wait in the socket, and restarts.
    Returns the first instance's epoch."""
    e0 = await first_run_until_delivered(engine, bridge, out, 10)
    gated_sink(bridge).close_gate()
    for _ in range(200):
        await engine.publish(1)
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.5)
    await engine.restart()
    await engine.wait_subscribed()
    return e0


async def test_the_tail_behind_a_stalled_sink_when_the_engine_restarts_is_delivered_in_its_epoch(tmp_path: Path) -> None:
    """breaker116 1: a sink stalls (its queue full, the source's pipeline call parked) while the
    engine publishes 200 more batches and restarts. The drop was told with that tail still unread
    in the socket; read afterwards in doubt, most of it was announced lost though received (I4;
    3 of 3: ``lost [31-209]``). The socket's messages are read at the drop now, parked call or not,
    and handed on (in the old epoch) before the drop is told."""
    live, rep = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = config(tmp_path, live, rep, replay=REPLAY, queue={"max_batches": 20})
    async with ScriptedEngine(live, rep) as engine:
        bridge = Bridge(cfg, registry=gated_registry())
        await bridge.start()
        try:
            await restart_behind_a_stalled_sink(engine, bridge, out)
            for _ in range(30):
                await engine.publish(1)
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)
            gated_sink(bridge).open_gate()
            await wait_for(lambda: has(out, 1, 29), timeout=WAIT, what="the new instance's 0..29")
        finally:
            await bridge.stop()
    views = check_invariants(read_lines(out), engine)
    assert layout(views) == [(False, {0}, list(range(210)), []), (True, {1}, list(range(30)), [])], [str(v) for v in views]


async def test_a_stop_while_a_drops_tail_waits_for_a_stalled_sink_keeps_how_far_the_engine_published(tmp_path: Path) -> None:
    """breaker117 1: the tail read at a drop waits, in memory, for a stalled sink; the bridge is
    stopped meanwhile (a rollout). The tail was neither delivered nor noted anywhere: the next run
    knew nothing of seqs 31..209 of the old instance, and announced none of them (I3; 3 of 3). The
    tail counts as published when it is read: the checkpoint keeps it, and the next run announces
    what the old instance published and the sink never got."""
    live, rep = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = config(tmp_path, live, rep, replay=REPLAY, queue={"max_batches": 20})
    async with ScriptedEngine(live, rep) as engine:
        first = Bridge(cfg, registry=gated_registry())
        await first.start()
        try:
            e0 = await restart_behind_a_stalled_sink(engine, first, out)
            await asyncio.sleep(0.5)
        finally:
            await first.stop()  # (the gate still closed)
        assert on_disk(tmp_path)["published"][KEY] == {"epoch": e0, "seq": 209}, on_disk(tmp_path)
        await second_run_publishes_5(cfg, engine, out, 4)
    # (I4 cannot hold here: the batches were in the stopped bridge's memory alone, the restarted
    # engine's buffer lacks them; what the sink lacks is announced, once: I3)
    views = check_invariants(read_lines(out), engine, held_cap_exceeded=True)
    assert (views[0].epoch, views[0].delivered + views[0].lost) == (e0, list(range(210))), [str(v) for v in views]


async def test_a_drop_sinks_dropped_tail_of_the_instance_before_a_restart_is_announced_after_a_stop(tmp_path: Path) -> None:
    """breaker119 4 (3 of 3 with SIGKILL, 2 of 2 with a clean stop): a ``drop`` sink stalls while
    the engine publishes 10 more batches (dropped past its queue of 5) and restarts; the bridge
    stops before the sink has room again. The checkpoint replaced how far the old instance
    published with the new instance's top, and the next run resumed in the new epoch: the old
    epoch's dropped tail was neither delivered nor announced (I3). The checkpoint keeps it as owed
    (``owed``), and the next run announces it in the old epoch before the new one's SourceReset."""
    live, rep = free_ports(2)
    out = tmp_path / "out.jsonl"
    cfg = config(tmp_path, live, rep, replay=REPLAY, queue={"max_batches": 5}, backpressure="drop")
    async with ScriptedEngine(live, rep) as engine:
        first = Bridge(cfg, registry=gated_registry())
        await first.start()
        try:
            e0 = await first_run_until_delivered(engine, first, out, 5)
            gated_sink(first).close_gate()
            await engine.publish(10)
            await asyncio.sleep(0.5)
            await engine.restart()
            await engine.wait_subscribed()
            await engine.publish(5)
            opened = lambda: on_disk(tmp_path).get("opened", {}).get(KEY, {}).get("epoch", 0)  # noqa: E731
            await wait_for(lambda: opened() > e0, timeout=WAIT, what="the new epoch saved")
            await asyncio.sleep(0.5)  # (a few saves more)
        finally:
            await first.stop()  # (the gate still closed)
        await second_run_publishes_5(cfg, engine, out, 9)
    views = check_invariants(read_lines(out), engine, held_cap_exceeded=True)
    assert (views[0].epoch, views[0].delivered + views[0].lost) == (e0, list(range(15))), [str(v) for v in views]
