"""The checkpoint: positions from sink acknowledgements, epoch numbering, snapshots and the file."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.checkpoint import (
    ENGINE_CLOCK_AHEAD,
    ENGINE_CLOCK_TRUSTED,
    FORGET_MARGIN,
    RETIRED_KEPT,
    Checkpointer,
    CheckpointError,
    CheckpointFile,
    Instances,
    StreamPosition,
    clock_epoch,
    load,
    save,
)
from bridge.records import Record, Stream, events_lost, source_reset
from tests.support.strategies import examples

STREAM = Stream("llama-a", 0)
KEY = STREAM.key
NOW = 1_780_000_000.25  # 2026-05-28
E = clock_epoch(NOW)


def minute(t: float) -> int:
    """The epoch of the minute of ``t``: what a restart opens when no trusted engine ts showed it."""
    return clock_epoch(math.floor(t / 60) * 60)


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


def test_clock_epoch_counts_microseconds() -> None:
    assert E == 1_780_000_000_250_000
    assert clock_epoch(-3600.0) == 0  # a clock before 1970
    assert clock_epoch(NOW + 0.000001) == E + 1
    assert clock_epoch(4_102_444_800.0) < 2**53  # 2100: exact in every JSON reader


def test_epochs_follow_the_clock_and_never_repeat() -> None:
    cp = Checkpointer(1)
    assert cp.first_epoch(KEY, NOW) == E
    assert cp.first_epoch(KEY, NOW) == E + 1  # the same microsecond again: not reused
    assert cp.next_epoch(KEY, E + 1, NOW) == E + 2
    assert cp.next_epoch(KEY, 5, NOW) == E + 3  # below one already opened: above it instead
    later = minute(NOW + 60)
    assert cp.next_epoch(KEY, E + 3, NOW + 60) == later  # the clock ran ahead (a restart: its minute)
    assert cp.next_epoch(KEY, later, NOW - 86400) == later + 1  # the clock went back: still above
    assert cp.first_epoch("other/0", NOW) == E  # per stream
    assert cp.epochs == {KEY: later + 1, "other/0": E}


def test_epochs_never_repeat_after_a_reload(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpointer(1)
    opened = [cp.first_epoch(KEY, NOW)]
    opened += [cp.next_epoch(KEY, opened[-1], NOW) for _ in range(3)]
    assert opened == [E, E + 1, E + 2, E + 3]
    generation, snap = cp.snapshot()
    assert cp.write(path, generation, snap)
    again = Checkpointer(1, load(path))
    assert again.first_epoch(KEY, NOW) == E + 4  # a bridge restarted within the same microsecond
    assert again.next_epoch(KEY, E, NOW) == E + 5  # resumed from an older epoch's position


def test_a_bridge_without_its_checkpoint_opens_above_the_previous_run() -> None:
    """Issue 29 case 12: the previous run opened an epoch and the engine restarted twice within
    the same minute; a new pod (no checkpoint) that meets the stream a second later opens above
    all of them, and so does one whose clock is 100 ms behind the old pod's."""
    before = Checkpointer(1)
    epoch = before.first_epoch(KEY, NOW)
    epoch = before.next_epoch(KEY, epoch, NOW + 0.2)
    epoch = before.next_epoch(KEY, epoch, NOW + 0.4)
    for skew in (0.0, -0.1):
        assert Checkpointer(1).first_epoch(KEY, NOW + 1.4 + skew) > epoch


def test_a_restart_is_numbered_by_the_engine_clock_so_two_pods_agree() -> None:
    """Two pods reading one engine at once (a rolling update), both in epoch ``old``, see its
    restart through the same batch or batches of the same minute, at different times on their own
    clocks: they open the same epoch, so their copies are copies (the same ids). An engine clock
    ahead of the bridge's, or far behind, is not trusted."""
    old = clock_epoch(NOW - 3600)
    a, b = Checkpointer(1), Checkpointer(1)
    shown = NOW + 10.25
    shown_minute = minute(shown)
    assert a.next_epoch(KEY, old, NOW + 10.3, shown) == b.next_epoch(KEY, old, NOW + 10.9, shown + 0.9) == shown_minute
    assert a.next_epoch(KEY, shown_minute, NOW + 11, shown) == shown_minute + 1  # never below the last
    ahead = NOW + 20.5  # ahead of the bridge by less than a second: trusted
    assert Checkpointer(1).next_epoch(KEY, old, NOW + 20, ahead) == clock_epoch(math.floor(ahead / 60) * 60)
    # an engine clock ahead (a new pod without a checkpoint would open below it), an hour behind,
    # or none (a heartbeat under a new UUID showed the restart): the bridge's, down to its minute
    assert Checkpointer(1).next_epoch(KEY, old, NOW + 20, NOW + 200) == minute(NOW + 20)
    assert Checkpointer(1).next_epoch(KEY, old, NOW + 20, NOW - 3600) == minute(NOW + 20)
    assert Checkpointer(1).next_epoch(KEY, old, NOW + 20, None) == Checkpointer(1).next_epoch(KEY, old, NOW + 40, None)
    # a stream met this minute (its first epoch the clock's, in microseconds) goes on above it
    assert Checkpointer(1).next_epoch(KEY, E, NOW + 10.3, shown) == E + 1
    # and a pod without a checkpoint that meets the stream later opens above all of them
    assert Checkpointer(1).first_epoch(KEY, NOW + 12) > shown_minute + 1


def test_a_trusted_engine_clock_numbers_the_restart_by_its_own_minute_not_the_bridges() -> None:
    """The engine ts decides the minute whenever it is trusted, up to ``ENGINE_CLOCK_TRUSTED``
    behind the bridge's clock and ``ENGINE_CLOCK_AHEAD`` ahead, both bounds included."""
    old = clock_epoch(NOW - 3600)
    now = 1_780_000_019.5  # the bridge's minute starts at ...960, the next one at ...020
    for shown in (now - 60, now - ENGINE_CLOCK_TRUSTED, now + ENGINE_CLOCK_AHEAD):
        assert minute(shown) != minute(now)
        assert Checkpointer(1).next_epoch(KEY, old, now, shown) == minute(shown)
    assert Checkpointer(1).next_epoch(KEY, old, now, now - ENGINE_CLOCK_TRUSTED - 1) == minute(now)
    assert Checkpointer(1).next_epoch(KEY, old, now, now + ENGINE_CLOCK_AHEAD + 0.5) == minute(now)


def test_a_checkpoint_of_minute_epochs_goes_on_above_them() -> None:
    """A checkpoint of an earlier release (minutes since 2025): the stream resumes in its epoch,
    and its next restart opens the clock's."""
    cp = Checkpointer(1, CheckpointFile(streams={KEY: StreamPosition(1_010_000, 7)}, epochs={KEY: 1_010_000}))
    assert cp.next_epoch(KEY, 1_010_000, NOW) == minute(NOW)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from([KEY, "other/1"]), st.integers(-600, 600), st.integers(0, 300), st.booleans()),
        max_size=40,
    )
)
def test_epochs_strictly_increase_per_stream(steps: list[tuple[bool, str, int, int, bool]]) -> None:
    cp = Checkpointer(1)
    opened: dict[str, list[int]] = {}
    for first, key, micros, from_epoch, reload in steps:
        if reload:
            _, snap = cp.snapshot()
            cp = Checkpointer(1, CheckpointFile(streams=snap.streams, epochs=snap.epochs))
        now = NOW + micros / 1_000_000
        from_epoch += E - 150  # below, at and above the clock
        epoch = cp.first_epoch(key, now) if first else cp.next_epoch(key, from_epoch, now)
        assert epoch >= (clock_epoch(now) if first else minute(now))
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
    again = cp.epochs[KEY]
    cp.forget(KEY, NOW + 60)
    assert cp.first_epoch(KEY, NOW - 1) > again  # passed a minute ago, and the clock stepped back a minute
    cp.forget(KEY, NOW + 3600 + 61)
    assert KEY not in cp.snapshot()[1].epochs  # once the clock passed it an hour ago, nothing is kept


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


def test_resume_verifies_the_first_batch_when_only_the_epochs_reset_was_saved() -> None:
    """The save landed after the new epoch's SourceReset was acknowledged and before any of its
    batches was: the position is (e1, -1), with no fingerprint. Resumed from there, a restart of
    the engine while the bridge was away went unseen, its batches delivered as e1's and dropped
    by the sinks as copies of the old instance's (breaker30n4 B1, with and without the UUID). It
    resumes just before e1's first batch, with that batch's fingerprint to verify."""
    cp = Checkpointer(1)
    e0 = cp.first_epoch(KEY, NOW)
    cp.on_ack(0, [batch(e0, s) for s in range(5)])
    e1 = cp.next_epoch(KEY, e0, NOW)
    first = batch(e1, 0)
    assert cp.note_first(KEY, first) is True
    cp.on_ack(0, [source_reset(STREAM, e1, "publisher_restart", 0.0)])
    reloaded = Checkpointer(1, cp.snapshot()[1])
    assert reloaded.position(KEY) == StreamPosition(e1, -1)
    assert reloaded.resume_position(KEY) == StreamPosition(e1, -1, first.ts, zlib.crc32(first.payload), 0)
    assert not reloaded.needs_reset(KEY)  # (its SourceReset is acknowledged)
    reloaded.on_ack(0, [batch(e1, 0), batch(e1, 1)])
    assert reloaded.resume_position(KEY) == batch_position(e1, 1)


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
        instances={KEY: Instances(1013402, "ab" * 16, ["cd" * 16])},
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
    [
        b"{not json",
        b"",
        b'{"streams": {"a/0": {"epoch": "one", "seq": 1}}}',
        b'{"epochs": {"a/0": 1.5}}',
        b"[]",
        b'{"instances": {"a/0": {"epoch": 1, "id": "not hex"}}}',
    ],
    ids=["garbage", "empty", "bad_epoch", "bad_epochs_map", "not_an_object", "bad_instance_id"],
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
    cp.prune(NOW + 60)
    assert cp.snapshot()[1].epochs == {KEY: epoch}  # nor passed it an hour ago (a clock stepping back)
    cp.prune(NOW + FORGET_MARGIN)
    assert cp.snapshot()[1].epochs == {KEY: epoch}  # (an hour to the microsecond: not passed yet)
    cp.prune(NOW + 3601)
    assert cp.snapshot()[1].epochs == {} and cp._forgotten == set()
    never = "never/0"  # forgotten without an epoch: nothing kept, even at the clock's origin
    cp.forget(never, 0.0)
    assert cp._forgotten == set()


def test_the_instance_uuid_is_kept_for_its_epoch_only(tmp_path: Path) -> None:
    """A stream whose publisher sends its UUID resumes knowing its instance, but only in the epoch
    the UUID was noted for: in any other epoch it is verified anew."""
    a, b, c = b"\xaa" * 16, b"\xbb" * 16, b"\xcc" * 16
    ck = Checkpointer(1)
    assert ck.resume_instance(KEY, E) == (None, [])
    ck.note_instance(KEY, E, a, [])
    generation = ck.generation
    ck.note_instance(KEY, E, a, [])
    assert ck.generation == generation  # (nothing new: no save needed for it)
    ck.note_instance(KEY, E + 5, b, [c, a])
    assert ck.generation > generation  # (a new instance: the next snapshot is newer, and saved)
    ck.note_instance(KEY, E, a, [])  # an older epoch's, noted late: the newer one stands
    path = tmp_path / "checkpoint.json"
    save(path, ck.snapshot()[1])
    loaded = Checkpointer(1, load(path))
    assert loaded.resume_instance(KEY, E + 5) == (b, [c, a])
    assert loaded.resume_instance(KEY, E) == (None, [])
    loaded.forget(KEY, NOW)
    assert loaded.resume_instance(KEY, E + 5) == (None, [])


def test_a_new_instance_in_the_same_epoch_or_the_same_one_in_a_later_epoch_is_noted() -> None:
    a, b = b"\xaa" * 16, b"\xbb" * 16
    ck = Checkpointer(1)
    ck.note_instance(KEY, E, a, [])
    ck.note_instance(KEY, E, b, [a])  # (the epoch's instance known for certain only now)
    assert ck.resume_instance(KEY, E) == (b, [a])
    ck.note_instance(KEY, E + 1, b, [a])  # one instance on through a new epoch (e.g. a bridge restart)
    assert ck.resume_instance(KEY, E + 1) == (b, [a])
    assert ck.resume_instance(KEY, E) == (None, [])


def test_a_checkpoint_keeps_the_last_retired_uuids_only() -> None:
    """The file's bound per stream: the 16 UUIDs retired last (``RETIRED_KEPT``)."""
    assert RETIRED_KEPT == 16
    ck = Checkpointer(1)
    retired = [bytes([i]) * 16 for i in range(40)]
    ck.note_instance(KEY, E, b"\xff" * 16, retired)
    assert ck.resume_instance(KEY, E)[1] == retired[-16:]
