"""CheckpointStore: the checkpoint of a running bridge, its file, and the epochs it saves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bridge.checkpoint import CheckpointFile, CheckpointStore, EpochUnsaved, StreamPosition, load, save
from bridge.records import Record, Stream

STREAM = Stream("e", 0)


def test_without_a_path_nothing_is_read_or_written(tmp_path: Path) -> None:
    store = CheckpointStore(None, 1)
    store.save_now()
    asyncio.run(store.persist())
    assert store.checkpointer.written == 0 and list(tmp_path.iterdir()) == []


def test_an_unusable_file_is_reported_and_the_bridge_starts_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ckpt.json"
    path.write_text("{not json")
    store = CheckpointStore(str(path), 1)
    assert store.checkpointer.position(STREAM.key) is None
    assert "checkpoint unusable, starting fresh" in caplog.text


def test_a_later_releases_file_is_not_read_and_kept_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A roll back after a release that wrote format version 2: its fields may mean something else."""
    path = tmp_path / "ckpt.json"
    text = '{"version": 2, "streams": {"e/0": {"epoch": 7, "seq": 41}}, "epochs": {"e/0": 7}}'
    path.write_text(text)
    store = CheckpointStore(str(path), 1)
    assert store.checkpointer.position(STREAM.key) is None
    assert "written by a later release (format version 2" in caplog.records[-1].error  # type: ignore[attr-defined]
    assert (tmp_path / "ckpt.json.unusable").read_text() == text  # the first save cannot overwrite it
    assert not path.exists()


def test_a_saved_checkpoint_is_resumed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.json"
    save(path, CheckpointFile(streams={STREAM.key: StreamPosition(7, 41, 1.5, 9)}, epochs={STREAM.key: 7}))
    store = CheckpointStore(str(path), 1)
    assert store.checkpointer.resume_position(STREAM.key) == StreamPosition(7, 41, 1.5, 9)
    assert store.next_epoch(STREAM.key, 7, 0.0) == 8


async def test_persist_writes_only_what_is_not_saved_yet_and_callers_share_a_write(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.json"
    store = CheckpointStore(str(path), 1)
    epoch = store.checkpointer.first_epoch(STREAM.key, 1.8e9)
    await asyncio.gather(store.persist(), store.persist(), store.persist())
    assert load(path).epochs == {STREAM.key: epoch}
    written = store.checkpointer.written
    await store.persist()  # nothing new: no write
    assert store.checkpointer.written == written
    first = Record(stream=STREAM, epoch=epoch, seq=0, ts=1.0, payload=b"x")
    assert store.note_first(STREAM.key, first)
    await store.persist()
    assert store.checkpointer.written > written


async def test_a_failed_write_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = CheckpointStore(str(blocker / "ckpt.json"), 1)  # a file where a directory should be
    store.checkpointer.first_epoch(STREAM.key, 1.8e9)
    await store.save()
    store.save_now()
    assert caplog.text.count("cannot save the checkpoint") == 2


async def test_every_save_first_collects_what_the_running_streams_know(tmp_path: Path) -> None:
    """``collect`` runs on the loop before each snapshot (periodic, persist, and the final save),
    so what it notes (an instance's UUID) is in the file that save writes."""
    path = tmp_path / "ckpt.json"
    store = CheckpointStore(str(path), 1)
    epoch = store.checkpointer.first_epoch(STREAM.key, 1.8e9)
    uuids = iter([b"\xaa" * 16, b"\xbb" * 16])
    store.collect = lambda: store.checkpointer.note_instance(STREAM.key, epoch, next(uuids), [])
    await store.save()
    assert load(path).instances[STREAM.key].id == "aa" * 16
    store.save_now()
    assert load(path).instances[STREAM.key].id == "bb" * 16


async def test_persist_returns_only_once_the_epoch_is_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """breaker93 B7: the checkpoint's directory not writable (the file itself was): persist tried
    once and returned, and 1,292 records reached the sink under epochs never saved, which a restart
    from the file could open again for another engine instance. A failed save is tried again
    until it goes through; the store names the problem meanwhile."""
    path = tmp_path / "ckpt.json"
    store = CheckpointStore(str(path), 1)
    epoch = store.checkpointer.first_epoch(STREAM.key, 1.8e9)
    monkeypatch.setattr("bridge.checkpoint._PERSIST_BACKOFF.delay", lambda attempt: 0.01)

    def refused(**_: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr("bridge.checkpoint.tempfile.mkstemp", refused)  # (a new file in the directory)
    waiting = asyncio.create_task(store.persist())
    await asyncio.sleep(0.2)
    assert not waiting.done() and not path.exists()
    assert store.problem is not None and "Permission denied" in store.problem
    monkeypatch.undo()
    await asyncio.wait_for(waiting, 5)
    assert load(path).epochs == {STREAM.key: epoch} and store.problem is None


async def test_persist_gives_up_with_epoch_unsaved_once_the_bridge_stops(tmp_path: Path) -> None:
    """breaker95 B1: once the bridge stops, a failing save is tried once more, then EpochUnsaved:
    the streams hand nothing of the epoch on (a restart from the file would number another engine
    instance the same)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = CheckpointStore(str(blocker / "ckpt.json"), 1)  # a file where a directory should be
    store.checkpointer.first_epoch(STREAM.key, 1.8e9)
    store.stopping = True
    with pytest.raises(EpochUnsaved, match="cannot save"):
        await asyncio.wait_for(store.persist(), 5)
