"""The checkpoint: positions from sink acknowledgements, epoch numbering, snapshots and the file."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.checkpoint import (
    EPOCH_ORIGIN,
    Checkpointer,
    CheckpointError,
    CheckpointFile,
    StreamPosition,
    clock_epoch,
    load,
    save,
)
from bridge.records import Record, Stream, events_lost, source_reset

STREAM = Stream("llama-a", 0)
KEY = STREAM.key
NOW = EPOCH_ORIGIN + 100 * 60 + 5  # clock epoch 100


def batch(epoch: int, seq: int, ts: float | None = None, payload: bytes | None = None) -> Record:
    return Record(
        stream=STREAM,
        epoch=epoch,
        seq=seq,
        ts=1000.0 + seq if ts is None else ts,
        payload=f"{epoch}:{seq}".encode() if payload is None else payload,
    )


def batch_position(epoch: int, seq: int) -> StreamPosition:
    """The position of having delivered ``batch(epoch, seq)`` everywhere."""
    return StreamPosition(epoch, seq, 1000.0 + seq, zlib.crc32(f"{epoch}:{seq}".encode()))


def reset(epoch: int) -> Record:
    return source_reset(STREAM, epoch, "publisher_restart", 0.0)


def lost(epoch: int, from_seq: int, to_seq: int, reason: str = "replay_unavailable") -> Record:
    return events_lost(STREAM, epoch, from_seq, to_seq, reason, 0.0)


# -- positions -----------------------------------------------------------------------------------


def test_position_is_the_minimum_over_sinks() -> None:
    cp = Checkpointer(2)
    cp.on_ack(0, [batch(1, 0), batch(1, 1), batch(1, 2)])
    assert cp.position(KEY) is None  # sink 1 acknowledged nothing, nothing loaded
    cp.on_ack(1, [batch(1, 0)])
    assert cp.position(KEY) == batch_position(1, 0)
    cp.on_ack(1, [batch(1, 1), batch(1, 2), batch(1, 3)])
    assert cp.position(KEY) == batch_position(1, 2)  # now sink 0 is behind
    cp.on_ack(0, [batch(1, 3), reset(2), batch(2, 0)])
    assert cp.position(KEY) == batch_position(1, 3)  # a later epoch is ahead of any seq of an earlier one


def test_position_stays_the_loaded_one_while_a_sink_acknowledged_nothing() -> None:
    loaded = StreamPosition(3, 10, 7.5, 1234)
    cp = Checkpointer(2, CheckpointFile(streams={KEY: loaded}))
    assert cp.position(KEY) == loaded
    cp.on_ack(0, [batch(3, 11), batch(3, 12)])
    assert cp.position(KEY) == loaded  # fingerprint included: sink 1 is still at the loaded position
    cp.on_ack(1, [batch(3, 11)])
    assert cp.position(KEY) == batch_position(3, 11)
    assert cp.position("other/0") is None


def test_position_after_source_reset_is_new_epoch_minus_one() -> None:
    cp = Checkpointer(2)
    for sink in (0, 1):
        cp.on_ack(sink, [batch(1, 0), batch(1, 1), reset(2)])
    assert cp.position(KEY) == StreamPosition(2, -1, None, None)  # no batch to fingerprint


def test_position_carries_the_batch_ts_and_crc32_of_its_payload() -> None:
    payload = b"\x93\xcb engine bytes"
    cp = Checkpointer(1)
    cp.on_ack(0, [batch(5, 41, ts=1732870000.25, payload=payload)])
    assert cp.position(KEY) == StreamPosition(5, 41, 1732870000.25, zlib.crc32(payload))


def test_events_lost_position_has_no_fingerprint_of_its_own() -> None:
    """A loss has no batch to fingerprint: the position keeps the last batch delivered before it
    (at its seq), or none when the epoch delivered nothing yet."""
    cp = Checkpointer(1)
    cp.on_ack(0, [batch(1, 2), lost(1, 3, 7)])
    assert cp.position(KEY) == StreamPosition(1, 7, 1002.0, zlib.crc32(b"1:2"), at=2)
    cp.on_ack(0, [reset(2), lost(2, 0, 4)])
    assert cp.position(KEY) == StreamPosition(2, 4, None, None)
    cp = Checkpointer(1)
    cp.on_ack(0, [lost(5, 0, 9)])  # a stream whose first record is a loss
    assert cp.position(KEY) == StreamPosition(5, 9, None, None)


def test_loss_after_the_loaded_position_keeps_its_fingerprint() -> None:
    loaded = StreamPosition(3, 10, 7.5, 1234)
    cp = Checkpointer(1, CheckpointFile(streams={KEY: loaded}))
    cp.on_ack(0, [lost(3, 11, 12)])
    assert cp.position(KEY) == StreamPosition(3, 12, 7.5, 1234, at=10)


def test_dropped_span_lost_before_source_reset_leaves_the_position_at_the_reset() -> None:
    """A drop sink announces its dropped span when the SourceReset comes: both acknowledged in order."""
    cp = Checkpointer(2)
    cp.on_ack(0, [batch(1, 3), lost(1, 4, 6, "sink_queue_full:kafka-main"), reset(2)])
    cp.on_ack(1, [batch(1, 3), batch(1, 4), batch(1, 5), batch(1, 6), reset(2)])
    assert cp.position(KEY) == StreamPosition(2, -1)
    # The same in separate acknowledgements.
    cp = Checkpointer(1)
    cp.on_ack(0, [batch(1, 3)])
    cp.on_ack(0, [lost(1, 4, 6, "sink_queue_full:kafka-main")])
    assert cp.position(KEY) == StreamPosition(1, 6, 1003.0, zlib.crc32(b"1:3"), at=3)
    cp.on_ack(0, [reset(2)])
    assert cp.position(KEY) == StreamPosition(2, -1)


# -- epochs --------------------------------------------------------------------------------------


def test_clock_epoch_counts_minutes_since_origin() -> None:
    assert clock_epoch(EPOCH_ORIGIN) == 0
    assert clock_epoch(EPOCH_ORIGIN - 3600) == 0  # a clock before the origin
    assert clock_epoch(NOW) == 100
    assert clock_epoch(EPOCH_ORIGIN + 59.9) == 0 and clock_epoch(EPOCH_ORIGIN + 60) == 1


def test_epochs_follow_the_clock_and_never_repeat() -> None:
    cp = Checkpointer(1)
    assert cp.first_epoch(KEY, NOW) == 100
    assert cp.first_epoch(KEY, NOW) == 101  # the same minute again: not reused
    assert cp.next_epoch(KEY, 101, NOW) == 102
    assert cp.next_epoch(KEY, 5, NOW) == 103  # below one already opened: above it instead
    assert cp.next_epoch(KEY, 103, NOW + 3600) == 160  # the clock ran ahead
    assert cp.next_epoch(KEY, 160, NOW - 86400) == 161  # the clock went back: still above
    assert cp.first_epoch("other/0", NOW) == 100  # per stream
    assert cp.epochs == {KEY: 161, "other/0": 100}


def test_epochs_never_repeat_after_a_reload(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpointer(1)
    opened = [cp.first_epoch(KEY, NOW)]
    opened += [cp.next_epoch(KEY, opened[-1], NOW) for _ in range(3)]
    assert opened == [100, 101, 102, 103]
    generation, snap = cp.snapshot()
    assert cp.write(path, generation, snap)
    again = Checkpointer(1, load(path))
    assert again.first_epoch(KEY, NOW) == 104  # a bridge restarted within the same minute
    assert again.next_epoch(KEY, 100, NOW) == 105  # resumed from an older epoch's position


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from([KEY, "other/1"]), st.integers(-600, 600), st.integers(0, 300), st.booleans()),
        max_size=40,
    )
)
def test_epochs_strictly_increase_per_stream(steps: list[tuple[bool, str, int, int, bool]]) -> None:
    cp = Checkpointer(1)
    opened: dict[str, list[int]] = {}
    for first, key, minutes, from_epoch, reload in steps:
        if reload:
            _, snap = cp.snapshot()
            cp = Checkpointer(1, CheckpointFile(streams=snap.streams, epochs=snap.epochs))
        now = NOW + minutes * 60
        epoch = cp.first_epoch(key, now) if first else cp.next_epoch(key, from_epoch, now)
        assert epoch >= clock_epoch(now)
        if not first:
            assert epoch > from_epoch
        assert all(epoch > e for e in opened.get(key, [])), (key, epoch, opened.get(key))
        opened.setdefault(key, []).append(epoch)


# -- snapshots and the file ----------------------------------------------------------------------


def test_write_skips_a_snapshot_older_than_the_one_written(tmp_path: Path) -> None:
    """The periodic save took its snapshot, then the final save ran first: the stale one is dropped."""
    path = tmp_path / "checkpoint.json"
    cp = Checkpointer(1)
    cp.on_ack(0, [batch(1, 0)])
    periodic = cp.snapshot()  # taken on the loop, written late in a thread
    cp.on_ack(0, [batch(1, 1)])
    cp.next_epoch(KEY, 1, NOW)
    final = cp.snapshot()
    assert final[0] > periodic[0]
    assert cp.write(path, *final)
    assert cp.written == final[0]
    assert not cp.write(path, *periodic)
    assert load(path) == final[1]
    assert load(path).streams[KEY] == batch_position(1, 1)
    assert cp.written == final[0]
    assert cp.write(path, *final)  # the same generation again is fine


def test_generation_changes_with_acks_and_epochs() -> None:
    cp = Checkpointer(1)
    g0 = cp.generation
    cp.on_ack(0, [batch(1, 0)])
    g1 = cp.generation
    cp.first_epoch("other/0", NOW)
    assert g0 < g1 < cp.generation


def test_snapshot_keeps_loaded_streams_and_epochs() -> None:
    loaded = CheckpointFile(streams={"gone/0": StreamPosition(4, 9, 1.0, 7)}, epochs={"gone/0": 4, KEY: 1})
    cp = Checkpointer(1, loaded)
    cp.on_ack(0, [batch(1, 0)])
    _, snap = cp.snapshot()
    assert snap.streams == {"gone/0": StreamPosition(4, 9, 1.0, 7), KEY: batch_position(1, 0)}
    assert snap.epochs == {"gone/0": 4, KEY: 1}
    cp.forget("gone/0", NOW)  # epoch 4 is long past on the clock: dropped too
    _, snap = cp.snapshot()
    assert "gone/0" not in snap.streams and "gone/0" not in snap.epochs


def test_a_forgotten_stream_keeps_an_epoch_the_clock_has_not_passed() -> None:
    """Met again after being forgotten, a stream must still open an epoch above its last one."""
    cp = Checkpointer(1)
    first = cp.first_epoch(KEY, NOW)
    ahead = cp.next_epoch(KEY, cp.next_epoch(KEY, first, NOW), NOW)  # restarts ran ahead of the clock
    cp.forget(KEY, NOW)
    assert cp.first_epoch(KEY, NOW) > ahead
    cp.forget(KEY, NOW + 3600)
    assert KEY not in cp.snapshot()[1].epochs  # once the clock has passed it, nothing is kept


def test_resume_from_the_first_batch_of_an_epoch_opened_after_the_position() -> None:
    """A bridge killed after a restart, before that epoch's position was saved, resumes just
    before the first batch of that epoch (saved before it went out, not known acknowledged), with
    that batch's fingerprint to verify, and announces the epoch again; not at the older epoch's
    position."""
    cp = Checkpointer(1)
    e0 = cp.first_epoch(KEY, NOW)
    cp.on_ack(0, [batch(e0, s) for s in range(5)])
    assert not cp.needs_reset(KEY)
    e1 = cp.next_epoch(KEY, e0, NOW)
    assert cp.resume_position(KEY) is None  # opened, but no batch of it known yet: start fresh...
    assert cp.needs_reset(KEY)  # ...announced: sinks hold e0's records
    first = batch(e1, 3)
    assert cp.note_first(KEY, first) is True
    assert cp.note_first(KEY, batch(e1, 4)) is False  # only the first
    reloaded = Checkpointer(1, cp.snapshot()[1])
    assert reloaded.resume_position(KEY) == StreamPosition(e1, 2, first.ts, zlib.crc32(first.payload), 3)
    assert reloaded.needs_reset(KEY)  # e1's SourceReset is not known acknowledged
    reloaded.on_ack(0, [source_reset(STREAM, e1, "publisher_restart", 0.0), *(batch(e1, s) for s in range(3, 6))])
    assert reloaded.resume_position(KEY) == batch_position(e1, 5)  # the position, once it has caught up
    assert not reloaded.needs_reset(KEY)


def test_a_stream_with_a_trace_but_no_acknowledged_position_is_announced_on_resume() -> None:
    cp = Checkpointer(1)
    assert not cp.needs_reset(KEY)  # never met: its first epoch needs no SourceReset
    cp.first_epoch(KEY, NOW)
    reloaded = Checkpointer(1, cp.snapshot()[1])
    assert reloaded.resume_position(KEY) is None and reloaded.needs_reset(KEY)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "checkpoint.json"
    data = CheckpointFile(
        streams={
            KEY: StreamPosition(1013402, 1041, 1732870000.25, 3735928559),
            "b/1": StreamPosition(7, -1),
            "c/0": StreamPosition(2, 50, 1.0, 99, at=41),
        },
        epochs={KEY: 1013402, "b/1": 7, "c/0": 2},
    )
    save(path, data)
    assert load(path) == data
    assert not list(path.parent.glob("*.tmp"))  # no temp file left behind
    text = path.read_bytes()
    assert b'"crc"' in text and b'"at":41' in text and b"null" not in text  # None fields omitted


def test_missing_file_is_empty(tmp_path: Path) -> None:
    assert load(tmp_path / "nope.json") == CheckpointFile()


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"", b'{"streams": {"a/0": {"epoch": "one", "seq": 1}}}', b'{"epochs": {"a/0": 1.5}}', b"[]"],
    ids=["garbage", "empty", "bad_epoch", "bad_epochs_map", "not_an_object"],
)
def test_corrupt_file_raises_checkpoint_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="corrupt"):
        load(path)


def test_unreadable_path_raises_checkpoint_error(tmp_path: Path) -> None:
    """The error names the file and the system's reason, not Python's rendering of the exception."""
    with pytest.raises(CheckpointError) as caught:
        load(tmp_path)  # a directory
    assert str(caught.value) == f"checkpoint {tmp_path}: cannot read (Is a directory)"


def test_one_write_of_batches_of_two_streams_moves_both() -> None:
    other = Stream("llama-b", 0)
    cp = Checkpointer(1)
    b = Record(stream=other, epoch=1, seq=0, ts=1000.0, payload=b"1:0")
    cp.on_ack(0, [batch(1, 0), b, batch(1, 1), batch(1, 2)])
    assert cp.position(KEY) == batch_position(1, 2)
    assert cp.position(other.key) == StreamPosition(1, 0, 1000.0, zlib.crc32(b"1:0"))


def test_a_reset_acknowledged_is_the_position_before_its_epochs_first_seq() -> None:
    cp = Checkpointer(1)
    cp.on_ack(0, [batch(1, 4), reset(2)])
    assert cp.position(KEY) == StreamPosition(2, -1)


def test_a_forgotten_stream_whose_epoch_the_clock_passed_is_forgotten_for_good() -> None:
    cp = Checkpointer(1)
    epoch = cp.first_epoch(KEY, NOW)
    cp.forget(KEY, NOW)
    assert cp.snapshot()[1].epochs == {KEY: epoch}  # kept while the clock has not passed it
    cp.prune(NOW + 120)
    assert cp.snapshot()[1].epochs == {} and cp._forgotten == set()
    never = "never/0"  # forgotten without an epoch: nothing kept, even at the clock's origin
    cp.forget(never, EPOCH_ORIGIN)
    assert cp._forgotten == set()
