"""When CheckpointStore writes its file: only what is not saved yet, and every ``interval`` while the
bridge runs (a crash loses at most that much acknowledged progress; nothing forces a write that
brings nothing new)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from bridge.checkpoint import CheckpointStore, load
from bridge.records import Stream

STREAM = Stream("s", 0)


async def test_persist_writes_nothing_when_nothing_is_new(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.json"
    store = CheckpointStore(str(path), 1)
    await store.persist()  # a fresh store: nothing to save
    assert not path.exists()
    epoch = store.checkpointer.first_epoch(STREAM.key, 1.8e9)
    await store.persist()
    assert load(path).epochs == {STREAM.key: epoch}
    path.unlink()
    await store.persist()  # saved already: no second write of the same state
    assert not path.exists()


async def test_a_running_store_saves_every_interval_not_before(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.json"
    store = CheckpointStore(str(path), 1)
    epoch = store.checkpointer.first_epoch(STREAM.key, 1.8e9)
    task = asyncio.create_task(store.run(0.2))
    try:
        await asyncio.sleep(0.05)
        assert not path.exists()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if path.exists():
                break
        assert load(path).epochs == {STREAM.key: epoch}
        path.unlink()
        for _ in range(100):  # and again: it goes on saving
            await asyncio.sleep(0.02)
            if path.exists():
                break
        assert path.exists()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
