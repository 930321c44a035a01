"""Engine restarts on top of other faults, end to end: a :class:`ScriptedEngine` (real ZMQ sockets)
-> ``python -m bridge`` -> file sink (json, batch), checked against design.md's I1-I4.

Each case is driven step by step (see its docstring); ``check_invariants`` then holds the whole
output against what the engine published, and each case asserts its own expected layout:
which instance each epoch holds, what it delivered and what it announced lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import free_port, read_lines, wait_for
from tests.support.process import BridgeProcess, bridge_config
from tests.support.scripted_engine import EpochView, ReplayMode, ScriptedEngine, check_invariants, identify

pytestmark = pytest.mark.integration

RECEIVED = "kv_bridge_batches_received_total"
# Replays time out fast; enough attempts that a gap stays open across the engine's restart.
REPLAY = {"timeout": "300ms", "max_attempts": 20, "initial_backoff": "50ms", "max_backoff": "200ms", "idle_probe": 0}


@asynccontextmanager
async def scenario(
    tmp: Path, *, replay: ReplayMode = "answer", **replay_config: Any
) -> AsyncIterator[tuple[ScriptedEngine, BridgeProcess, Path]]:
    """An engine and a bridge reading it (one source, a file sink), the bridge subscribed."""
    live, rep = free_port(), free_port()
    out = tmp / "out.jsonl"
    source = {"name": "engine", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
    sink = {"type": "file", "name": "out", "path": str(out), "format": "json", "granularity": "batch", "batch": {"linger": 0}}
    config = bridge_config(tmp, [source], [sink], replay={**REPLAY, **replay_config})
    async with ScriptedEngine(live, rep, replay=replay) as engine:
        bridge = BridgeProcess(tmp, config).start()
        try:
            await bridge.wait_ready()
            await engine.wait_subscribed()
            yield engine, bridge, out
        finally:
            bridge.kill()


async def finish(engine: ScriptedEngine, bridge: BridgeProcess, out: Path) -> list[dict[str, Any]]:
    """Wait (10 s at most) for the engine's last batch in the output, stop the bridge, read it all."""
    last = (engine.current.number, len(engine.current.payloads) - 1)
    with contextlib.suppress(AssertionError):  # if it never comes, the checker says what is missing
        await wait_for(lambda: any("events" in r and identify(r) == last for r in read_lines(out)), timeout=10)
    await asyncio.sleep(0.5)  # room for anything the bridge would still add
    assert await bridge.terminate() == 0, bridge.log()[-3000:]
    return read_lines(out)


async def restart_unseen(engine: ScriptedEngine, hidden: int, shown: int) -> None:
    """Restart; ``hidden`` batches before the bridge's SUB is back (PUB drops them: only replay
    has them), until a replay request reached the new instance; then ``shown`` live batches."""
    await engine.restart()
    await engine.publish(hidden)
    await engine.wait_request(engine.current.number)
    await asyncio.sleep(0.3)  # the bridge takes in the replies before anything live
    await engine.wait_subscribed()
    await engine.publish(shown)


def layout(views: list[EpochView]) -> list[tuple[bool, set[int], list[int], list[int]]]:
    """Per epoch: (opened by SourceReset, instances, seqs delivered, seqs announced lost)."""
    return [(v.reset, v.instances, v.delivered, v.lost) for v in views]


async def test_no_fault_baseline(tmp_path: Path) -> None:
    """The harness on its own: ten live batches, one epoch, nothing else."""
    async with scenario(tmp_path) as (engine, bridge, out):
        await engine.publish(10)
        records = await finish(engine, bridge, out)
    assert layout(check_invariants(records, engine)) == [(False, {0}, list(range(10)), [])]


async def test_visible_restart_baseline(tmp_path: Path) -> None:
    """A restart the live stream shows (seq back to 0 after the SUB is back): two epochs."""
    async with scenario(tmp_path) as (engine, bridge, out):
        await engine.publish(5)
        await bridge.wait_metric(RECEIVED, 5, timeout=10)
        await engine.restart()
        await engine.wait_subscribed()
        await engine.publish(5)
        records = await finish(engine, bridge, out)
    assert layout(check_invariants(records, engine)) == [(False, {0}, list(range(5)), []), (True, {1}, list(range(5)), [])]


async def test_restart_while_a_gap_is_open(tmp_path: Path) -> None:
    """Case 1: 0..2 live; 3..5 dropped while replay is ignored; 6..8 live (held); the engine
    restarts; its 0..3 come before the SUB is back and the gap's retry reaches the new instance
    (answered); 4..5 live."""
    async with scenario(tmp_path) as (engine, bridge, out):
        await engine.publish(3)
        engine.replay = "ignore"
        await engine.publish(3, deliver=False)
        await engine.publish(3)
        await bridge.wait_metric(RECEIVED, 6, timeout=10)
        engine.replay = "answer"
        await restart_unseen(engine, hidden=4, shown=2)
        records = await finish(engine, bridge, out)
    assert layout(check_invariants(records, engine)) == [
        (False, {0}, [0, 1, 2, 6, 7, 8], [3, 4, 5]),
        (True, {1}, list(range(6)), []),
    ]


async def test_restart_while_a_gap_is_open_beyond_held_cap(tmp_path: Path) -> None:
    """Case 2: case 1 with ``max_held_batches: 2`` and 6..12 live: the bridge holds only two of
    them; everything of the old instance is delivered or announced lost under the old epoch."""
    async with scenario(tmp_path, max_held_batches=2) as (engine, bridge, out):
        await engine.publish(3)
        engine.replay = "ignore"
        await engine.publish(3, deliver=False)
        await engine.publish(7)
        await bridge.wait_metric(RECEIVED, 10, timeout=10)
        engine.replay = "answer"
        await restart_unseen(engine, hidden=4, shown=2)
        records = await finish(engine, bridge, out)
    old, new = check_invariants(records, engine, held_cap_exceeded=True)
    assert old.instances == {0} and not old.reset and {3, 4, 5} <= set(old.lost)
    assert sorted(old.delivered + old.lost) == list(range(13))
    assert (new.reset, new.instances, new.delivered) == (True, {1}, list(range(6)))


async def test_startup_replay_answered_by_the_next_instance(tmp_path: Path) -> None:
    """Case 6: the start-up replay is ignored; 0..2 never go live, 3..5 do (held behind the
    history the bridge asked for); the engine restarts and the retry of that history is answered
    by the new instance (0..5 in its buffer, before the SUB is back); then 6..7 live."""
    async with scenario(tmp_path, replay="ignore") as (engine, bridge, out):
        await engine.publish(3, deliver=False)
        await engine.publish(3)
        await bridge.wait_metric(RECEIVED, 3, timeout=10)
        engine.replay = "answer"
        await restart_unseen(engine, hidden=6, shown=2)
        records = await finish(engine, bridge, out)
    assert layout(check_invariants(records, engine)) == [
        (False, {0}, [3, 4, 5], [0, 1, 2]),
        (True, {1}, list(range(8)), []),
    ]


async def test_restart_hidden_by_a_continuing_seq(tmp_path: Path) -> None:
    """Case 7: 0..L live; the engine restarts and publishes 0..L before the SUB is back (PUB drops
    them, its replay buffer has them); then L+1, L+2 live, which look like the old stream going on."""
    last = 4
    async with scenario(tmp_path) as (engine, bridge, out):
        await engine.publish(last + 1)
        await bridge.wait_metric(RECEIVED, last + 1, timeout=10)
        await engine.restart()
        await engine.publish(last + 1)
        await engine.wait_subscribed()
        await engine.publish(2)
        records = await finish(engine, bridge, out)
    assert layout(check_invariants(records, engine)) == [
        (False, {0}, list(range(last + 1)), []),
        (True, {1}, list(range(last + 3)), []),
    ]


async def test_epoch_survives_a_kill_right_after_a_restart(tmp_path: Path) -> None:
    """Case 12: the engine restarts, the bridge opens a new epoch and is SIGKILLed before any
    periodic checkpoint save; the next bridge (same checkpoint file) must not open that epoch
    number again for another instance. (Without a checkpoint, fresh epochs come from the clock in
    minutes: tests/unit/test_checkpoint.py holds that rule.)"""
    live, rep = free_port(), free_port()
    out = tmp_path / "out.jsonl"
    source = {"name": "engine", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
    sink = {"type": "file", "name": "out", "path": str(out), "format": "json", "granularity": "batch", "batch": {"linger": 0}}
    checkpoint = {"path": str(tmp_path / "ck.json"), "interval": "1h"}  # only the epoch's own save happens
    config = bridge_config(tmp_path, [source], [sink], replay=REPLAY, checkpoint=checkpoint)

    async def run_until(engine: ScriptedEngine, last: tuple[int, int]) -> None:
        bridge = BridgeProcess(tmp_path, config).start()
        try:
            await bridge.wait_ready()
            await engine.wait_subscribed()
            await engine.publish(3)
            await wait_for(lambda: any("events" in r and identify(r) == last for r in read_lines(out)), timeout=10)
        finally:
            bridge.kill()

    async with ScriptedEngine(live, rep) as engine:
        first = BridgeProcess(tmp_path, config).start()
        try:
            await first.wait_ready()
            await engine.wait_subscribed()
            await engine.publish(5)
            await first.wait_metric(RECEIVED, 5, timeout=10)
            await engine.restart()
            await engine.wait_subscribed()
            await engine.publish(3)
            await wait_for(lambda: any("events" in r and identify(r) == (1, 2) for r in read_lines(out)), timeout=10)
        finally:
            first.kill()  # SIGKILL: no shutdown save
        await engine.restart()  # another instance meets the next bridge
        await run_until(engine, (2, 2))
    owner: dict[int, int] = {}
    for r in read_lines(out):
        if "events" in r:
            instance, _ = identify(r)
            assert owner.setdefault(r["epoch"], instance) == instance, f"epoch {r['epoch']} reused: {owner}"
    assert sorted(owner.values()) == [0, 1, 2]
    assert sorted(owner) == [e for e, _ in sorted(owner.items(), key=lambda kv: kv[1])], "epochs grow with instances"


async def test_first_contact_without_history_announces_the_head(tmp_path: Path) -> None:
    """Case 13: a bridge meeting an engine that published before it connected, without replay
    of seq 0 (the buffer slid): the missing head is announced as ``joined_late``."""
    async with scenario(tmp_path) as (engine, bridge, out):
        await engine.publish(5)
        records = await finish(engine, bridge, out)
    assert [r for r in records if r.get("type") == "EventsLost"] == []  # the replay had everything
    async with ScriptedEngine(free_port(), free_port(), buffer_steps=4) as engine:
        await engine.publish(10, deliver=False)  # before any bridge: 6..9 stay in the buffer
        live, rep = engine.ports
        source = {"name": "late", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
        out = tmp_path / "late.jsonl"
        sink = {"type": "file", "name": "out", "path": str(out), "format": "json", "granularity": "batch", "batch": {"linger": 0}}
        bridge = BridgeProcess(tmp_path, bridge_config(tmp_path, [source], [sink], replay=REPLAY), name="late").start()
        try:
            await bridge.wait_ready()
            await engine.wait_subscribed()
            await engine.publish(2)
            records = await finish(engine, bridge, out)
        finally:
            bridge.kill()
    lost = [(r["from_seq"], r["to_seq"], r["reason"]) for r in records if r.get("type") == "EventsLost"]
    assert lost == [(0, 5, "joined_late")], lost
    assert [r["seq"] for r in records if "events" in r] == list(range(6, 12))


# -- issue 29 case 16: a quiet engine is never left behind ------------------------------------------


async def test_a_quiet_engine_restarted_below_the_position_is_found(tmp_path: Path) -> None:
    """0..4 live (no replay ever brought a batch: nothing tells that the engine buffers at all);
    the engine restarts, publishes 0..1 before the SUB is back, and goes quiet. The replay from
    the position (seq 4) answers nothing: the idle probe must still open the new epoch with 0..1
    (before the fix the stream stayed in doubt under epoch 0 until the engine published again)."""
    async with scenario(tmp_path, idle_probe="300ms") as (engine, bridge, out):
        await engine.publish(5)
        await bridge.wait_metric(RECEIVED, 5, timeout=10)
        await engine.restart()
        await engine.publish(2, deliver=False)
        await engine.wait_subscribed()
        records = await finish(engine, bridge, out)
    assert layout(check_invariants(records, engine)) == [(False, {0}, list(range(5)), []), (True, {1}, [0, 1], [])]


async def test_a_quiet_engine_after_a_replay_opened_the_new_epoch(tmp_path: Path) -> None:
    """A replay filled a gap (so the engine is known to buffer); the engine restarts, its 0..1
    are missed live, a replay opens the new epoch with them; then 2..3 are missed live too and the
    engine goes quiet. The idle probe must fetch 2..3 (before the fix it was off until the new
    instance's first live message)."""
    async with scenario(tmp_path, idle_probe="300ms") as (engine, bridge, out):
        await engine.publish(2)
        await engine.publish(1, deliver=False)
        await engine.publish(1)
        await bridge.wait_metric(RECEIVED, 3, timeout=10)
        # the replay filled the gap before the restart (else the old instance's 2 is gone with it)
        await wait_for(lambda: any("events" in r and identify(r) == (0, 2) for r in read_lines(out)), timeout=10)
        await engine.restart()
        await engine.publish(2, deliver=False)
        await engine.wait_subscribed()
        await wait_for(lambda: any("events" in r and identify(r) == (1, 1) for r in read_lines(out)), timeout=10)
        await engine.publish(2, deliver=False)
        records = await finish(engine, bridge, out)
    assert layout(check_invariants(records, engine)) == [(False, {0}, list(range(4)), []), (True, {1}, list(range(4)), [])]


# -- issue 29 case 18: an engine clock stepping back right after a restart ---------------------------


async def test_a_clock_stepping_back_after_a_restart_loses_nothing_received(tmp_path: Path) -> None:
    """No replay endpoint. 0..2 live; the engine restarts and its seq 0 shows it live; then its
    clock steps back 2.5 ms: its 1 and 2 are stamped before its 0, 3 after. All four reached the
    bridge: delivered in the new epoch (before the fix 1 and 2 were dropped as a late batch of
    the old instance, then announced lost as no_replay: I4)."""
    live = free_port()
    out = tmp_path / "out.jsonl"
    source = {"name": "engine", "endpoint": f"tcp://127.0.0.1:{live}"}
    sink = {"type": "file", "name": "out", "path": str(out), "format": "json", "granularity": "batch", "batch": {"linger": 0}}
    config = bridge_config(tmp_path, [source], [sink], replay=REPLAY)
    async with ScriptedEngine(live, free_port()) as engine:
        bridge = BridgeProcess(tmp_path, config).start()
        try:
            await bridge.wait_ready()
            await engine.wait_subscribed()
            await engine.publish(3)
            await bridge.wait_metric(RECEIVED, 3, timeout=10)
            await engine.restart()
            await engine.wait_subscribed()
            await engine.publish(1)
            await bridge.wait_metric(RECEIVED, 4, timeout=10)
            engine.step_back(0.0025)
            await engine.publish(3)
            records = await finish(engine, bridge, out)
        finally:
            bridge.kill()
    assert layout(check_invariants(records, engine)) == [(False, {0}, [0, 1, 2], []), (True, {1}, [0, 1, 2, 3], [])]
