"""The checkpoint, part two: sinks at different kinds of position, forgetting, generations, and the
atomic save's crash-safety steps. Found missing by mutation testing (tools/mutants.py)."""

from __future__ import annotations

import os
import stat
import zlib
from pathlib import Path

import pytest

from bridge.checkpoint import Checkpointer, CheckpointFile, Instances, StreamPosition, load, save
from tests.unit.test_checkpoint import KEY, NOW, batch, batch_position, lost, reset

# -- positions -----------------------------------------------------------------------------------


def test_a_sink_that_announced_a_loss_ahead_does_not_carry_the_position_past_another_sink() -> None:
    """The position is the lowest seq over sinks, whatever batch each one's fingerprint is at."""
    cp = Checkpointer(2)
    cp.on_ack(0, [batch(1, 0), batch(1, 1), batch(1, 2), lost(1, 3, 7, "sink_queue_full:a")])  # anchor at 2
    cp.on_ack(1, [batch(1, s) for s in range(6)])  # anchor at 5, seq 5
    assert cp.position(KEY) == batch_position(1, 5)


def test_a_loss_after_a_loaded_position_anchored_below_it_keeps_that_anchor() -> None:
    loaded = StreamPosition(3, 50, 7.5, 1234, at=41)
    cp = Checkpointer(1, CheckpointFile(streams={KEY: loaded}))
    cp.on_ack(0, [lost(3, 51, 60)])
    assert cp.position(KEY) == StreamPosition(3, 60, 7.5, 1234, at=41)


def test_a_loss_in_an_epoch_opened_after_the_loaded_position_carries_no_older_fingerprint() -> None:
    """Resumed at the first batch of an epoch opened after the saved position (a crash right after
    a restart): a loss acknowledged first in that epoch has no batch of the old epoch to vouch for."""
    first = batch(5, 0)
    loaded = CheckpointFile(
        streams={KEY: batch_position(4, 9)},
        epochs={KEY: 5},
        opened={KEY: StreamPosition(5, 0, first.ts, zlib.crc32(first.payload))},
    )
    cp = Checkpointer(1, loaded)
    cp.on_ack(0, [lost(5, 1, 3)])
    assert cp.position(KEY) == StreamPosition(5, 3)


# -- epochs and forgetting -----------------------------------------------------------------------


def test_a_stream_met_first_before_the_clock_origin_opens_epoch_0() -> None:
    assert Checkpointer(1).first_epoch(KEY, -3600.0) == 0


def test_a_forgotten_stream_keeps_an_epoch_opened_in_this_very_minute() -> None:
    cp = Checkpointer(1)
    opened = cp.first_epoch(KEY, NOW)
    cp.forget(KEY, NOW)
    assert cp.first_epoch(KEY, NOW) > opened


def test_forgetting_drops_the_streams_position_and_first_batch_from_the_checkpoint() -> None:
    cp = Checkpointer(1)
    epoch = cp.first_epoch(KEY, NOW)
    cp.note_first(KEY, batch(epoch, 0))
    cp.on_ack(0, [batch(epoch, 0)])
    before = cp.generation
    cp.forget(KEY, NOW + 3601)
    assert cp.generation != before
    _, snap = cp.snapshot()
    assert KEY not in snap.streams and KEY not in snap.opened and KEY not in snap.epochs
    assert cp.position(KEY) is None and cp.resume_position(KEY) is None


def test_a_stream_met_again_after_being_forgotten_keeps_its_epoch_in_the_checkpoint() -> None:
    cp = Checkpointer(1)
    cp.first_epoch(KEY, NOW)
    cp.forget(KEY, NOW)
    again = cp.first_epoch(KEY, NOW)  # back before the clock passed its epoch
    cp.prune(NOW + 3600)
    assert cp.snapshot()[1].epochs[KEY] == again
    cp.prune(NOW + 86400)  # met again, it is no longer forgotten: its epoch stays however late
    assert cp.snapshot()[1].epochs[KEY] == again


# -- generations and writes ----------------------------------------------------------------------


def test_noting_an_epochs_first_batch_makes_a_newer_snapshot(tmp_path: Path) -> None:
    """The first batch of an epoch is saved before it goes out: the snapshot holding it is newer
    than the one saved before, so it is written."""
    path = tmp_path / "checkpoint.json"
    cp = Checkpointer(1)
    epoch = cp.first_epoch(KEY, NOW)
    assert cp.write(path, *cp.snapshot())
    before = cp.generation
    assert cp.note_first(KEY, batch(epoch, 0))
    assert cp.generation > before
    assert cp.write(path, *cp.snapshot())
    assert KEY in load(path).opened


def test_forgetting_makes_a_newer_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpointer(1)
    cp.on_ack(0, [batch(1, 0)])
    assert cp.write(path, *cp.snapshot())
    cp.forget(KEY, NOW)
    assert cp.write(path, *cp.snapshot())
    assert KEY not in load(path).streams


def test_an_untouched_checkpoint_is_still_saved(tmp_path: Path) -> None:
    """Shutdown right after start: the (empty or loaded) checkpoint is written all the same."""
    path = tmp_path / "checkpoint.json"
    cp = Checkpointer(1)
    assert cp.write(path, *cp.snapshot())
    assert load(path) == CheckpointFile()


# -- the file ------------------------------------------------------------------------------------


def test_the_file_is_the_documented_json(tmp_path: Path) -> None:
    """The format of the module docstring (a file other versions of the bridge read): keys in
    order whatever order the streams were met in, absent fingerprints left out."""
    path = tmp_path / "checkpoint.json"
    save(
        path,
        CheckpointFile(
            streams={KEY: StreamPosition(1013402, 1041, 1732870000.25, 3735928559), "b/1": StreamPosition(7, -1)},
            epochs={KEY: 1013402, "b/1": 7},
            instances={KEY: Instances(1013402, "5f" * 16)},
            ended={KEY: StreamPosition(1013380, 977)},
            state_sinks=["redis"],
            published={KEY: StreamPosition(1013402, 1050)},
            stored={KEY: {"redis": (1013402, 1051, 2**64 - 1)}},
        ),
    )
    assert path.read_bytes() == (
        b'{"version":1,"streams":{"b/1":{"epoch":7,"seq":-1},'
        b'"llama-a/0":{"epoch":1013402,"seq":1041,"ts":1732870000.25,"crc":3735928559}},'
        b'"epochs":{"b/1":7,"llama-a/0":1013402},"opened":{},'
        b'"instances":{"llama-a/0":{"epoch":1013402,"id":"5f5f5f5f5f5f5f5f5f5f5f5f5f5f5f5f"}},'
        b'"ended":{"llama-a/0":{"epoch":1013380,"seq":977}},"state_sinks":["redis"],'
        b'"published":{"llama-a/0":{"epoch":1013402,"seq":1050}},'
        b'"stored":{"llama-a/0":{"redis":[1013402,1051,18446744073709551615]}},"owed":{}}'
    )
    assert load(path).stored == {KEY: {"redis": (1013402, 1051, 2**64 - 1)}}


def test_a_file_of_the_release_before_without_published_is_read(tmp_path: Path) -> None:
    """``published`` came later: a file without it resumes as before (nothing known past it)."""
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b'{"version":1,"streams":{"llama-a/0":{"epoch":5,"seq":9}},"epochs":{"llama-a/0":5}}')
    cp = Checkpointer(1, load(path))
    assert cp.published_top(KEY, 5) is None
    cp.note_published(KEY, 5, 19)
    cp.note_published(KEY, 5, 12)  # (lower: kept at 19)
    assert (cp.published_top(KEY, 5), cp.published_top(KEY, 6)) == (19, None)
    assert cp.stored_through(KEY, "redis") is None  # (``stored`` came later still)
    cp.note_stored(KEY, "redis", (5, 20, 0))
    assert cp.stored_through(KEY, "redis") == (5, 20, 0) and cp.snapshot()[1].stored == {KEY: {"redis": (5, 20, 0)}}
    cp.note_stored(KEY, "redis", (5, 13, 0))  # (lower: the sink lost some since)
    assert cp.stored_through(KEY, "redis") == (5, 13, 0)
    cp.forget_stored(KEY, "redis")
    assert cp.stored_through(KEY, "redis") is None
    cp.note_stored(KEY, "redis", (5, 20, 0))
    cp.forget(KEY, 0.0)
    assert cp.stored_through(KEY, "redis") is None


def test_an_epoch_ended_below_its_published_top_is_owed_to_a_run_that_resumes_after_it(tmp_path: Path) -> None:
    """breaker119 4: every sink acknowledged up to 4 of epoch 5, whose instance published up to 14,
    when a restart opened epoch 6: the next run, resuming in epoch 6, announces 5..14 of epoch 5
    first; once the sinks acknowledged past it, or in the newer epoch, nothing is owed."""
    cp = Checkpointer(1)
    cp.on_ack(0, [batch(5, 4)])
    cp.note_published(KEY, 5, 14)
    cp.note_published(KEY, 6, 3)
    assert cp.published_top(KEY, 5) == 14 and cp.published_top(KEY, 6) == 3
    path = tmp_path / "checkpoint.json"
    save(path, cp.snapshot()[1])
    again = Checkpointer(1, load(path))
    assert again.owed_at_start(KEY, StreamPosition(6, -1)) == (5, 5, 14)
    assert again.owed_at_start(KEY, StreamPosition(5, 4)) is None  # (resumed in epoch 5: published_top settles it)
    again.on_ack(0, [batch(5, 14)])
    assert again.owed_at_start(KEY, StreamPosition(6, -1)) is None
    assert KEY not in again.snapshot()[1].owed
    fully = Checkpointer(1)
    fully.on_ack(0, [batch(5, 14)])
    fully.note_published(KEY, 5, 14)
    fully.note_published(KEY, 6, 0)
    assert fully.snapshot()[1].owed == {}  # (acknowledged to the end: nothing owed)
    nothing = Checkpointer(1)  # (breaker121 1: the sink acknowledged nothing of the stream)
    nothing.note_published(KEY, 5, 9)
    nothing.note_published(KEY, 6, 2)
    assert nothing.owed_at_start(KEY, StreamPosition(6, -1)) == (5, 0, 9)
    ahead = Checkpointer(2)  # (breaker121 2: one sink took epoch 6 already, the other stalled in 5)
    ahead.on_ack(0, [batch(5, 4)])
    ahead.on_ack(1, [batch(5, 14)])
    ahead.note_published(KEY, 5, 14)
    ahead.note_published(KEY, 6, 3)
    ahead.on_ack(1, [reset(6)])
    assert ahead.owed_at_start(KEY, StreamPosition(6, -1)) is None


def test_save_creates_missing_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "checkpoint.json"
    save(path, CheckpointFile(epochs={KEY: 3}))
    assert load(path).epochs == {KEY: 3}


def test_a_failed_save_raises_and_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.mkdir()
    (path / "occupied").write_text("")  # the rename onto a non-empty directory fails
    with pytest.raises(OSError):
        save(path, CheckpointFile(epochs={KEY: 3}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]


def test_save_syncs_the_whole_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crash-safety steps of the atomic save, observed at each fsync: the temp file complete
    when synced, the directory synced once the new file is in place."""
    path = tmp_path / "checkpoint.json"
    data = CheckpointFile(streams={KEY: batch_position(1, 2)}, epochs={KEY: 1})
    synced: list[tuple[str, int, bool]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
        synced.append((kind, st.st_size, path.exists()))
        real_fsync(fd)

    monkeypatch.setattr("bridge.checkpoint.os.fsync", fsync)
    open_before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    save(path, data)
    size = path.stat().st_size
    assert [(kind, exists) for kind, _, exists in synced] == [("file", False), ("dir", True)]
    assert synced[0][1] == size  # every byte written when the file was synced
    if open_before is not None:
        assert len(os.listdir("/proc/self/fd")) == open_before  # nothing left open
    assert load(path) == data


def test_where_the_epoch_before_the_newest_ended_is_kept_until_the_stream_is_forgotten(tmp_path: Path) -> None:
    """A state sink found behind at start in that epoch lost its tail too (runtime._behind_at_start)."""
    cp = Checkpointer(3)
    cp.on_ack(0, [batch(5, s) for s in range(10)] + [reset(6)])
    cp.on_ack(1, [batch(5, s) for s in range(4)])
    cp.on_ack(2, [batch(5, s) for s in range(10)])
    assert cp.ended[KEY] == StreamPosition(5, 9)  # (every sink acknowledges the same end before the reset)
    cp.on_ack(1, [batch(5, s) for s in range(4, 10)] + [reset(6), batch(6, 0), lost(6, 1, 3), reset(7)])
    assert cp.ended[KEY] == StreamPosition(6, 3)  # (an EventsLost ended it)
    cp.on_ack(2, [reset(6)])
    assert cp.ended[KEY] == StreamPosition(6, 3)  # (a slower sink's older reset)
    path = tmp_path / "checkpoint.json"
    cp.state_sinks = ["redis"]
    cp.write(path, *cp.snapshot())
    loaded = Checkpointer(3, load(path))
    assert loaded.ended[KEY] == StreamPosition(6, 3) and loaded.held_state == ["redis"]
    loaded.forget(KEY, 0.0)
    assert KEY not in loaded.ended


def test_the_position_says_when_the_last_batch_acknowledged_holds_no_event() -> None:
    """breaker55 B1: at event granularity a batch with no event renders no message, so a sink's last
    message is the batch before it; read back at start, that looked like a loss of the last batch
    (announced, the state cleared). The position says the batch is empty, and keeps saying it."""
    import msgspec

    c = Checkpointer(1)
    c.on_ack(0, [batch(1, 0, payload=msgspec.msgpack.encode([1000.0, [{"type": "AllBlocksCleared"}], 0]))])
    assert c.position(KEY) is not None and not c.position(KEY).empty  # type: ignore[union-attr]
    c.on_ack(0, [batch(1, 1, payload=msgspec.msgpack.encode([1001.0, [], 0]))])
    position = c.position(KEY)
    assert position is not None and position.empty and position.seq == 1
    again = Checkpointer(1, CheckpointFile(streams={KEY: position}))
    assert again.position(KEY) == position
