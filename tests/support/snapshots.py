"""The engine-snapshot scenario every state-keeping sink is tested with (see bridge.snapshot).

A :class:`~tests.support.cache_engine.CacheEngine` that serves snapshots (``snapshot_gate``
closed) has published more than its replay buffer holds before the bridge subscribes: the bridge
meets it mid-epoch, its state is incomplete, and it asks for a snapshot. The engine keeps
publishing while the snapshot is held back; then the snapshot arrives, is seeded with the next
batch, and the state is complete; then a span is lost beyond replay (an ``EventsLost``): the
bridge asks again and the state is complete again. After every step a consumer bootstraps from
the sink (``state()``: waits for the engine's last batch, then bootstraps and follows) and its
blocks are held against the engine's true cache: a subset while incomplete, equal once complete.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from bridge.runtime import Bridge
from kv_consumer.state import StreamState
from tests.support.cache_engine import CacheEngine
from tests.support.harness import wait_for

WAIT = 30.0


def snapshot_source(name: str, live: int, replay: int, design: str, snapshot_port: int | None) -> dict[str, Any]:
    """A source entry with the engine's snapshot design on."""
    entry: dict[str, Any] = {
        "name": name,
        "endpoint": f"tcp://127.0.0.1:{live}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "snapshot": design,
    }
    if snapshot_port is not None:
        entry["snapshot_endpoint"] = f"tcp://127.0.0.1:{snapshot_port}"
    return entry


def held_against(state: StreamState, truth: dict[tuple[Any, Any, int], int], *, complete: bool) -> None:
    """A complete state equals the engine's cache; an incomplete one holds no block it lacks."""
    __tracebackhide__ = True
    mine = state.blocks()
    assert state.complete == complete, (state.complete, state.why)
    if complete:
        assert mine == truth, f"missing {set(truth) - set(mine)}, extra {set(mine) - set(truth)}"
    else:
        assert all(truth.get(k, 0) >= n for k, n in mine.items()), "blocks the engine does not hold"


async def seeded_mid_epoch_and_after_a_loss(
    bridge: Bridge,
    engine: CacheEngine,
    key: str,
    state: Callable[[], Awaitable[StreamState]],
    truth: Callable[[CacheEngine], dict[tuple[Any, Any, int], int]],
) -> None:
    """The scenario (see the module docstring); ``engine`` published past its buffer before
    ``bridge`` started, with its ``snapshot_gate`` closed."""
    gate = engine.snapshot_gate
    assert gate is not None and not gate.is_set()
    snaps = bridge.pipelines[key].snapshots
    assert snaps is not None
    # 1. met mid-epoch: a snapshot is asked for; the engine publishes while it is held back
    await wait_for(lambda: bool(engine.snapshot_cuts), WAIT, "the bridge to ask for a snapshot")
    cut = engine.snapshot_cuts[0]
    for _ in range(3):
        await engine.step(1)
        held_against(await state(), truth(engine), complete=False)
    # 2. the snapshot arrives: seeded with the first batch after it is read, complete from there
    gate.set()
    await wait_for(lambda: snaps.seeding is None or snaps.seeding.snapshot is not None, WAIT, "the snapshot to be read")
    assert snaps.seeding is not None, "the snapshot was refused"
    for _ in range(4):
        await engine.step(1)
        held_against(await state(), truth(engine), complete=True)
    assert engine.last_seq > cut + 4  # (batches after the cut were applied over it)
    # 3. a span lost beyond replay: EventsLost, incomplete; asked again and complete again
    asked = len(engine.snapshot_cuts)
    await engine.step(engine.buffer_steps + 2, deliver=False)
    await engine.step(1)
    await wait_for(lambda: len(engine.snapshot_cuts) > asked, WAIT, "a snapshot asked for after the loss")
    await wait_for(lambda: snaps.seeding is None or snaps.seeding.snapshot is not None, WAIT, "the second snapshot to be read")
    assert snaps.seeding is not None, "the second snapshot was refused"
    for _ in range(3):
        await engine.step(1)
        held_against(await state(), truth(engine), complete=True)
