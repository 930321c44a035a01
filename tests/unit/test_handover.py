"""Handover (checkpoint.from_sinks): combining what each sink holds with the local checkpoint.

The model: one stream in one epoch, its messages in order (a SourceReset, then each batch as one
message or one per event); each sink holds a prefix of them (what a bridge that died got through
to it, possibly ending inside a batch); the local checkpoint, if any, is at or below every sink's
last whole batch (every sink acknowledged it). After :func:`combine`, the stream is re-sent from
the resume position and each sink drops what its skip position covers: every sink that said what
it holds must then hold every message exactly once, in order; one that could not tell loses
nothing (it may get copies).
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.checkpoint import (
    MAX_SUB,
    Checkpointer,
    Handover,
    Held,
    SinkPosition,
    StreamPosition,
    combine,
)
from bridge.formats import CONTENT_TYPES
from bridge.records import Record, Stream, source_reset
from bridge.runtime import SkipHeld
from tests.support.strategies import examples

E = 7
Position = tuple[int, int, int]


def messages(events_per_batch: list[int]) -> list[tuple[Position, SinkPosition]]:
    """Every message of the stream in order: its position, and what a sink holding it up to there says."""
    out: list[tuple[Position, SinkPosition]] = [((E, 0, 0), SinkPosition(E, 0, "SourceReset"))]
    for seq, n in enumerate(events_per_batch):
        ts = 1000.0 + seq
        if n == 0:  # batch granularity: one message
            out.append(((E, seq + 1, 0), SinkPosition(E, seq, ts=ts)))
        else:
            # (the last event's message says ``last``: a sink holding it holds the batch whole)
            out += [((E, seq + 1, i + 1), SinkPosition(E, seq, index=i if i < n - 1 else None, ts=ts)) for i in range(n)]
    return out


def last_whole_batch(stream: list[tuple[Position, SinkPosition]], held: int) -> int:
    """The highest seq whose every message is among the first ``held`` messages (-1: none)."""
    if held == 0:
        return -2
    complete = -1
    for i, (pos, _) in enumerate(stream[:held]):
        nxt = stream[i + 1][0] if i + 1 < len(stream) else None
        if pos[1] > 0 and (nxt is None or nxt[1] != pos[1]):
            complete = pos[1] - 1
    return complete


@st.composite
def worlds(draw: Any) -> tuple[list[tuple[Position, SinkPosition]], list[int], list[bool], StreamPosition | None]:
    granularity = draw(st.sampled_from(["batch", "event", "mixed"]))
    n = draw(st.integers(1, 8))
    sizes = [
        0 if granularity == "batch" else draw(st.integers(1, 4)) if granularity == "event" else draw(st.integers(0, 3))
        for _ in range(n)
    ]
    stream = messages(sizes)
    sinks = draw(st.integers(1, 4))
    held = [draw(st.integers(0, len(stream))) for _ in range(sinks)]
    known = [draw(st.booleans()) or True if i == 0 else draw(st.booleans()) for i in range(sinks)]
    floor = min(last_whole_batch(stream, h) for h in held)
    local: StreamPosition | None = None
    if floor >= -1 and draw(st.booleans()):
        seq = draw(st.integers(-1, floor))
        local = StreamPosition(E, seq, 1000.0 + seq if seq >= 0 else None)
    return stream, held, known, local


def resend(stream: list[tuple[Position, SinkPosition]], resume: StreamPosition) -> list[Position]:
    """What the bridge hands every sink after resuming at ``resume``: every batch above its seq."""
    return [pos for pos, _ in stream if pos[1] > resume.seq + 1]


@settings(max_examples=examples(400), deadline=None)
@given(worlds())
def test_every_sink_that_tells_ends_with_every_message_once(world: Any) -> None:
    stream, held, known, local = world
    says: list[Held] = [("unknown" if not k else None if h == 0 else stream[h - 1][1]) for h, k in zip(held, known, strict=True)]
    result = combine(local, says)
    everything = [pos for pos, _ in stream]
    if local is not None:
        assert result.resume is not None and (result.resume.epoch, result.resume.seq) >= (local.epoch, local.seq)
    if result.resume is None:
        # Fresh start: a new epoch above every epoch held, so no skip can drop any of it. Only
        # without a checkpoint, when a sink holds nothing or cannot tell, or holds only the
        # SourceReset while no sink holds a batch to verify the instance by.
        first_batch = any(isinstance(s, SinkPosition) and s.fingerprinted and s.seq == 0 for s in says)
        only_reset = any(isinstance(s, SinkPosition) and s.kind == "SourceReset" for s in says)
        assert local is None
        assert any(s is None or s == "unknown" for s in says) or (only_reset and not first_batch)
        assert result.epoch in (None, E)
        return
    # A resume inside the epoch verifies the engine instance: a fingerprint, unless it starts the
    # epoch from the checkpoint file's own position.
    assert result.resume == local or result.resume.ts is not None
    again = resend(stream, result.resume)
    for h, say, through in zip(held, says, result.skip, strict=True):
        got = [pos for pos, _ in stream[:h]]
        if isinstance(say, SinkPosition) or (say is None and local is not None):
            assert through is not None
        for pos in again:
            if through is None or pos > through:
                through = None  # once: the first message past it ends the skip
                got.append(pos)
        if say == "unknown":
            assert set(got) == set(everything), "a sink that could not tell loses nothing"
        else:
            assert got == everything, f"sink holding {h} of {len(stream)}: {says} -> {result}"


def test_fingerprint_of_a_partly_held_batch_is_kept_for_its_replay() -> None:
    held = SinkPosition(E, 5, index=2, ts=1005.0)
    h = combine(None, [held])
    assert h.resume == StreamPosition(E, 4, 1005.0, None, 5)  # batch 5 again, verified by its ts
    assert h.skip == [(E, 6, 3)]


def test_whole_batch_resumes_after_it_with_its_fingerprint() -> None:
    h = combine(None, [SinkPosition(E, 5, ts=1005.0, crc=99)])
    assert h.resume == StreamPosition(E, 5, 1005.0, 99)
    assert h.skip == [(E, 6, MAX_SUB)] and h.epoch == E


def test_lowest_sink_wins_and_the_higher_one_skips() -> None:
    h = combine(StreamPosition(E, 2, 1002.0, 1), [SinkPosition(E, 9, ts=1009.0), SinkPosition(E, 4, ts=1004.0)])
    assert h.resume == StreamPosition(E, 4, 1004.0)
    assert h.skip == [(E, 10, MAX_SUB), (E, 5, MAX_SUB)]


def test_never_before_the_local_checkpoint() -> None:
    local = StreamPosition(E, 20, 1020.0, 5)
    h = combine(local, [SinkPosition(E, 3), None, "unknown"])
    assert h.resume == local  # a sink that lost data (trimmed, deleted) does not pull the stream back


def test_a_sink_that_cannot_tell_without_a_checkpoint_starts_fresh() -> None:
    h = combine(None, [SinkPosition(E, 9, ts=1.0), "unknown"])
    assert h.resume is None and h.epoch == E
    assert h.skip == [(E, 10, MAX_SUB), None]


def test_control_records() -> None:
    """A control record last cannot verify the engine instance (no batch to compare a replay with):
    alone it counts as unknown (fresh start, a new epoch), or takes the fingerprint of a batch
    another sink holds in its epoch at or below it (or right after it, delivered again)."""
    reset = SinkPosition(E, 0, "SourceReset")
    alone = combine(None, [reset])
    assert alone.resume is None and alone.skip == [(E, 0, 0)] and alone.epoch == E
    beside = combine(None, [reset, SinkPosition(E, 0, ts=1000.0, crc=3)])
    assert beside.resume == StreamPosition(E, -1, 1000.0, 3, 0)
    assert beside.skip == [(E, 0, 0), (E, 1, MAX_SUB)]
    assert combine(None, [reset, SinkPosition(E, 4, ts=1004.0)]).resume is None  # batch 4 cannot verify from seq 0
    lost = SinkPosition(E, 30, "EventsLost")
    assert combine(None, [lost]).resume is None
    both = combine(None, [lost, SinkPosition(E, 28, ts=1028.0)])
    assert both.resume == StreamPosition(E, 28, 1028.0)  # the batch holder needs 29 on; the loss is skipped by its holder
    assert both.skip == [(E, 31, MAX_SUB), (E, 29, MAX_SUB)]
    ahead = combine(None, [lost, SinkPosition(E, 40, ts=1040.0)])
    assert ahead.resume is None  # nothing verifies from 30: fresh
    local = StreamPosition(E, 12, 1012.0, 9)
    assert combine(local, [lost]).resume == local  # the file's own fingerprint


def test_header_reading() -> None:
    raw = CONTENT_TYPES["raw"]
    payload = b"\x93\xcb"
    headers = {"source": "a", "dp_rank": "0", "epoch": "7", "seq": "12", "type": "EventBatch", "ts": "1.25", "content-type": raw}
    assert SinkPosition.from_headers(headers, payload) == SinkPosition(7, 12, ts=1.25, crc=zlib.crc32(payload))
    as_json = {**headers, "content-type": CONTENT_TYPES["json"]}
    assert SinkPosition.from_headers(as_json, b"{}") == SinkPosition(7, 12, ts=1.25)
    event = {**as_json, "type": "BlockStored", "index": "3"}
    assert SinkPosition.from_headers({k: v.encode() for k, v in event.items()}).index == 3
    assert SinkPosition.from_headers({**headers, "type": "EventsLost"}).kind == "EventsLost"
    # An engine event may be named anything: with an index, the message is a batch's event.
    for named in ("SourceReset", "EventsLost"):
        held = SinkPosition.from_headers({**as_json, "type": named, "index": "0"})
        assert held == SinkPosition(7, 12, index=0, ts=1.25) and held.fingerprinted
    with pytest.raises(ValueError):
        SinkPosition.from_headers({"source": "a"})


def test_the_instance_header_names_a_batchs_publisher() -> None:
    headers = {"epoch": "7", "seq": "12", "type": "EventBatch", "ts": "1.25", "instance": "ab" * 16}
    assert SinkPosition.from_headers(headers).instance == "ab" * 16
    assert SinkPosition.from_headers({**headers, "type": "SourceReset"}).instance is None  # (a batch's only)
    for bad in ("AB" * 16, "ab" * 15, "zz" * 16):
        with pytest.raises(ValueError, match="instance header"):
            SinkPosition.from_headers({**headers, "instance": bad})
    # a header of any length is quoted by its first 40 characters only
    with pytest.raises(ValueError) as caught:
        SinkPosition.from_headers({**headers, "instance": "0123456789" * 4 + "x" * 1000})
    assert f"instance header {'0123456789' * 4!r} is not a UUID in hex" in str(caught.value)


def test_the_sinks_name_the_resume_epochs_instance_only_when_they_agree() -> None:
    a, b = "aa" * 16, "bb" * 16
    at = SinkPosition(E, 4, ts=1.0, instance=a)
    assert combine(None, [at, SinkPosition(E, 6, ts=1.5, instance=a)]).instance == a
    assert combine(None, [at, SinkPosition(E, 6, ts=1.5)]).instance == a  # (one that names none: older bridge)
    assert combine(None, [at, SinkPosition(E, 6, ts=1.5, instance=b)]).instance is None
    assert combine(None, [at, SinkPosition(E + 1, 0, ts=2.0, instance=b)]).instance == a  # (the resume epoch's)
    c = Checkpointer(1)
    c.note_instance("a/0", E, bytes.fromhex(a), [bytes.fromhex(b)])
    c.adopt("a/0", Handover(StreamPosition(E, 6, 1.5), [None], E, instance=a))
    assert c.resume_instance("a/0", E) == (bytes.fromhex(a), [bytes.fromhex(b)])  # (what the file knew stays)
    c = Checkpointer(1)
    c.adopt("a/0", Handover(StreamPosition(E, 6, 1.5), [None], E, instance=a))
    assert c.resume_instance("a/0", E) == (bytes.fromhex(a), [])


def test_adopt_takes_the_instance_the_sinks_name_for_the_resume_epoch_over_the_files() -> None:
    a, b, other = bytes.fromhex("aa" * 16), bytes.fromhex("bb" * 16), "cc" * 16
    c = Checkpointer(1)
    c.note_instance("a/0", E, a, [b])
    c.adopt("a/0", Handover(StreamPosition(E, 6, 1.5), [None], E, instance=other))
    # Another instance published that epoch since the file was written: its UUID, none retired known.
    assert c.resume_instance("a/0", E) == (bytes.fromhex(other), [])
    c = Checkpointer(1)
    c.note_instance("a/0", E + 1, a, [b])
    c.adopt("a/0", Handover(StreamPosition(E, 6, 1.5), [None], E, instance=other))
    assert c.resume_instance("a/0", E + 1) == (a, [b])  # the file's later epoch stands
    assert c.resume_instance("a/0", E) == (None, [])
    c = Checkpointer(1)
    c.adopt("a/0", Handover(StreamPosition(E, 6, 1.5), [None], E))  # no sink named the instance
    assert c.resume_instance("a/0", E) == (None, [])  # verified anew


def test_adopt_resumes_there_and_opens_epochs_above_what_sinks_hold() -> None:
    c = Checkpointer(2)
    c.adopt("a/0", Handover(StreamPosition(E, 4, 1.0), [None, None], E + 3))
    assert c.resume_position("a/0") is None  # a sink holds a later epoch than the resume point: fresh
    assert c.needs_reset("a/0")
    c = Checkpointer(2)
    c.adopt("a/0", Handover(StreamPosition(E, 4, 1.0), [None, None], E))
    assert c.resume_position("a/0") == StreamPosition(E, 4, 1.0)
    assert not c.needs_reset("a/0")  # continuing the epoch the sinks hold: no SourceReset
    assert c.next_epoch("a/0", E, 0.0) == E + 1
    c.adopt("b/0", Handover(None, [None, None], E))
    assert c.resume_position("b/0") is None and c.needs_reset("b/0")
    assert c.first_epoch("b/0", 0.0) == E + 1


def test_adopt_keeps_the_announcement_of_an_epoch_the_file_opened() -> None:
    """A crash right after the bridge opened a new epoch (its first batch saved, nothing of it
    acknowledged): with the sinks holding no more than the file says, the stream still announces
    that epoch with a SourceReset, and no sink's skip covers that SourceReset."""
    from bridge.checkpoint import CheckpointFile

    loaded = CheckpointFile(
        streams={"a/0": StreamPosition(E - 1, 50, 0.5, 9)}, epochs={"a/0": E}, opened={"a/0": StreamPosition(E, 0, 2.0, 5)}
    )
    c = Checkpointer(2, loaded)
    assert c.needs_reset("a/0")
    local, acked = c.resume_position("a/0"), c.position("a/0")
    handover = combine(local, [SinkPosition(E - 1, 50, ts=0.5, crc=9), None], acked)
    assert all(t is not None and t < (E, 0, 0) for t in handover.skip)
    c.adopt("a/0", handover)
    assert c.resume_position("a/0") == local and c.needs_reset("a/0")


def test_a_file_epoch_below_the_epoch_the_sinks_hold_starts_afresh() -> None:
    """The file opened E+1 after its position (a crash), and since then another pod ran the stream
    and the sinks hold E+2 (its SourceReset): resuming in the file's E+1 would put every message
    below what the sinks hold, skipped by all of them (found by the second breaker round)."""
    from bridge.checkpoint import CheckpointFile

    loaded = CheckpointFile(
        streams={"a/0": StreamPosition(E, 9, 1.0, 11)}, epochs={"a/0": E + 1}, opened={"a/0": StreamPosition(E + 1, 0, 2.0, 22)}
    )
    c = Checkpointer(2, loaded)
    local, acked = c.resume_position("a/0"), c.position("a/0")
    held = SinkPosition(E + 2, 0, "SourceReset")
    c.adopt("a/0", combine(local, [held, held], acked))
    assert c.resume_position("a/0") is None and c.needs_reset("a/0")
    assert c.next_epoch("a/0", E + 1, 0.0) > E + 2


class _Sink:
    name = "s"
    needs_events = False

    def __init__(self) -> None:
        self.written: list[Position] = []

    async def connect(self) -> None: ...
    async def close(self) -> None: ...
    async def health(self) -> str | None:
        return None

    async def write(self, messages: Any) -> None:
        self.written += [m.position for m in messages]


async def test_skip_held_drops_what_the_sink_has_once() -> None:
    from bridge.formats import Renderer

    inner = _Sink()
    skip = SkipHeld(inner)
    skip.through["a/0"] = (E, 3, 2)  # holds batch 2 up to its second event
    renderer = Renderer("json", "event")
    stream = Stream("a", 0)

    def rec(seq: int) -> Record:
        return Record(stream=stream, epoch=E, seq=seq, ts=1.0, events=[{"type": "AllBlocksCleared"}] * 3)

    await skip.write([m for seq in (1, 2) for m in renderer.render(rec(seq))])
    assert inner.written == [(E, 3, 3)]
    assert "a/0" not in skip.through and skip.skipped == 5
    await skip.write(renderer.render(rec(1)))  # past it once: nothing is skipped any more
    assert inner.written[-1] == (E, 2, 3)


async def test_a_write_that_fails_is_retried_with_the_same_messages_left_out() -> None:
    """The skip ends only once a message past it was written: a failed write (the worker retries
    the same messages) must leave out again what the sink holds."""
    from bridge.errors import NotConnected
    from bridge.formats import Renderer

    class Failing(_Sink):
        fail = True

        async def write(self, messages: Any) -> None:
            if self.fail:
                self.fail = False
                raise NotConnected("down")
            await super().write(messages)

    inner = Failing()
    skip = SkipHeld(inner)
    skip.through["a/0"] = (E, 3, MAX_SUB)  # holds batches 0..2
    renderer = Renderer("json", "batch")
    batches = [m for seq in range(5) for m in renderer.render(Record(stream=Stream("a", 0), epoch=E, seq=seq, ts=1.0))]
    with pytest.raises(NotConnected):
        await skip.write(batches)
    assert skip.through == {"a/0": (E, 3, MAX_SUB)} and skip.skipped == 0
    await skip.write(batches)
    assert inner.written == [(E, 4, 0), (E, 5, 0)] and skip.skipped == 3 and not skip.through


async def test_a_loss_reaching_into_batches_the_sink_holds_is_told_from_its_first_missing_batch() -> None:
    """The stream resumed below this sink (another sink held less) and the engine's buffer had slid:
    the EventsLost the bridge announces covers batches this sink holds whole. It is told to this
    sink from the first batch it lacks (I4); a batch it holds only in part stays in it."""
    from bridge.formats import Renderer
    from bridge.records import events_lost

    renderer = Renderer("json", "batch")
    stream = Stream("a", 0)
    loss = renderer.render(events_lost(stream, E, 6, 13, "replay_exhausted", 0.0))
    inner = _Sink()
    skip = SkipHeld(inner)
    skip.renderer = renderer
    skip.through["a/0"] = (E, 7, MAX_SUB)  # holds batch 6 whole
    sent: list[Any] = []

    async def capture(messages: Any) -> None:
        sent.extend(messages)

    inner.write = capture  # type: ignore[method-assign]
    await skip.write(loss)
    assert [(m.record.from_seq, m.record.seq, m.msg_id) for m in sent] == [(7, 13, "a/0/7/lost/7-13")]
    sent.clear()
    skip.through["a/0"] = (E, 7, 2)  # batch 6 held up to its second event: the loss of 6 stands
    await skip.write(loss)
    assert [(m.record.from_seq, m.record.seq) for m in sent] == [(6, 13)]
    sent.clear()
    skip.through["a/0"] = (E, 7, 2)  # an event-granularity sink: batches below 6 are held whole
    await skip.write(renderer.render(events_lost(stream, E, 3, 13, "replay_exhausted", 0.0)))
    assert [(m.record.from_seq, m.record.seq) for m in sent] == [(6, 13)]


def test_the_highest_seq_held_in_the_resume_epoch_is_known_published() -> None:
    """If the engine restarted while no pod read it, the sinks below the highest held seq are told
    the rest of that epoch is lost (known_top), not left without it (I3)."""
    h = combine(None, [SinkPosition(E, 10, ts=1010.0), SinkPosition(E, 5, ts=1005.0)])
    assert h.resume == StreamPosition(E, 5, 1005.0) and h.top == 10


# -- issue 29 case 19: a sink behind an epoch another sink closed ------------------------------------


def test_a_sink_behind_an_epoch_another_sink_closed_is_told_where_it_stands() -> None:
    """The fast sink holds epoch E + 1 (the engine restarted); the slow one's last record is batch
    5 of epoch E (its queue held the rest when the pod died): it lacks epoch E from seq 6. A sink
    in the latest epoch, or one that cannot tell, is behind nothing."""
    fast, slow = SinkPosition(E + 1, 2, ts=2000.0), SinkPosition(E, 5, ts=1005.0)
    assert combine(None, [fast, slow, "unknown"]).behind == [None, (E, 6), None]
    partial = SinkPosition(E, 5, index=1, ts=1005.0)  # batch 5 held only in part
    assert combine(None, [fast, partial]).behind == [None, (E, 5)]
    assert combine(None, [fast, SinkPosition(E, 0, "SourceReset")]).behind == [None, (E, 0)]
    assert combine(None, [SinkPosition(E, 5, ts=1.0), SinkPosition(E, 3, ts=1.0)]).behind == [None, None]


async def test_a_sink_behind_is_told_what_it_lacks_before_the_next_epoch_reaches_it() -> None:
    """Before its first record of a later epoch, the sink gets an EventsLost of its own (reason
    ``sink_behind:<sink>``) for the rest of the epoch it was behind in, as far as it can have
    lagged; once. A sink whose epoch the stream goes on in is told nothing (the stream settles it).
    The announcement counts in kv_bridge_batches_lost_total once written (breaker30h M1: it did
    not count), not again when the write failed and went again."""
    from bridge.formats import Renderer
    from bridge.metrics import Metrics
    from bridge.records import source_reset

    renderer = Renderer("json", "batch")
    stream = Stream("a", 0)
    inner = _Sink()
    sent: list[Any] = []
    fail = [ConnectionError("down")]

    async def capture(messages: Any) -> None:
        if fail:
            raise fail.pop()
        sent.extend(messages)

    inner.write = capture  # type: ignore[method-assign]
    metrics = Metrics()
    skip = SkipHeld(inner, metrics)
    skip.name = "slow"
    skip.renderer, skip.lag_bound = renderer, 100
    skip.behind["a/0"] = (E, 6)
    skip.through["a/0"] = (E, 6, MAX_SUB)
    new = [source_reset(stream, E + 2, "publisher_restart", 0.0), Record(stream=stream, epoch=E + 2, seq=0, ts=1.0)]
    with pytest.raises(ConnectionError):
        await skip.write([m for r in new for m in renderer.render(r)])
    await skip.write([m for r in new for m in renderer.render(r)])
    assert [(m.record.kind, m.record.epoch, m.record.from_seq, m.record.seq, m.record.reason) for m in sent] == [
        ("EventsLost", E, 6, 105, "sink_behind:slow"),
        ("SourceReset", E + 2, None, 0, "publisher_restart"),
        ("batch", E + 2, None, 0, None),
    ]
    assert not skip.behind and not skip.through
    lost = metrics.registry.get_sample_value("kv_bridge_batches_lost_total", {"source": "a", "reason": "sink_behind"})
    assert lost == 100
    sent.clear()
    skip.behind["a/0"] = (E, 6)
    await skip.write(renderer.render(Record(stream=stream, epoch=E, seq=6, ts=1.0)))  # the stream goes on in E
    assert [(m.record.kind, m.record.seq) for m in sent] == [("batch", 6)] and not skip.behind


def test_a_sink_holding_less_than_every_sink_acknowledged_is_fed_again_from_what_it_holds() -> None:
    """I6 (breaker B4): a sink whose broker lost what it acknowledged (a restart from an older
    snapshot) says it holds seq 9 of a stream checkpointed at 19. The stream resumes from 9 (the
    engine's replay buffer gives 10..19 back); that sink skips only what it holds, the others
    everything up to the checkpoint."""
    local = StreamPosition(E, 19, 1019.0)
    lossy, whole = SinkPosition(E, 9, ts=1009.0), SinkPosition(E, 19, ts=1019.0)
    result = combine(local, [lossy, whole])
    assert result.resume is not None and (result.resume.epoch, result.resume.seq) == (E, 9)
    assert result.skip == [lossy.held_through(), whole.held_through()]
    # A batch held up to an event that is not its last (no ``last`` header) is held in part: it
    # goes again, and the sink skips the events it has.
    partial = SinkPosition(E, 19, index=0, ts=1019.0)
    assert combine(local, [partial, whole]).resume == StreamPosition(E, 18, 1019.0, None, 19)


def test_adopting_what_the_file_already_says_changes_nothing_of_it() -> None:
    """A handover that resumes exactly where the file does, in no later epoch, leaves the
    checkpoint as it was loaded (a first batch noted of an older epoch included)."""
    from bridge.checkpoint import CheckpointFile

    loaded = CheckpointFile(
        streams={"a/0": StreamPosition(E, 9, 1.0, 11)}, epochs={"a/0": E}, opened={"a/0": StreamPosition(E - 1, 0, 2.0, 22)}
    )
    c = Checkpointer(2, loaded)
    generation = c.generation
    c.adopt("a/0", Handover(StreamPosition(E, 9, 1.0, 11), [None, None], E))
    assert c.snapshot()[1] == loaded
    assert c.generation == generation  # nothing to save


def test_adopting_a_fresh_start_drops_the_files_position_and_first_batch() -> None:
    from bridge.checkpoint import CheckpointFile

    loaded = CheckpointFile(
        streams={"a/0": StreamPosition(E, 9, 1.0, 11)}, epochs={"a/0": E + 1}, opened={"a/0": StreamPosition(E + 1, 0, 2.0, 22)}
    )
    c = Checkpointer(2, loaded)
    generation = c.generation
    c.adopt("a/0", Handover(None, [None, None], E + 2))
    assert c.snapshot()[1] == CheckpointFile(epochs={"a/0": E + 2})
    assert c.generation > generation  # to be saved
    assert c.resume_position("a/0") is None and c.needs_reset("a/0")


def test_adopting_a_position_keeps_the_first_batch_of_its_own_epoch() -> None:
    """The sinks hold (E, 3) and the file noted E's first batch: a later batch of E is not a first
    one (no save needed before it goes out); an older epoch's first batch is dropped."""
    from bridge.checkpoint import CheckpointFile

    first = StreamPosition(E, 0, 2.0, 22)
    c = Checkpointer(2, CheckpointFile(epochs={"a/0": E}, opened={"a/0": first}))
    c.adopt("a/0", Handover(StreamPosition(E, 3, 1.0, 5), [None, None], E))
    assert c.snapshot()[1].opened == {"a/0": first}
    assert not c.note_first("a/0", Record(stream=Stream("a", 0), epoch=E, seq=4, ts=1.0, payload=b"x"))
    c = Checkpointer(2, CheckpointFile(epochs={"a/0": E}, opened={"a/0": StreamPosition(E - 1, 0, 2.0, 22)}))
    c.adopt("a/0", Handover(StreamPosition(E, 3, 1.0, 5), [None, None], E))
    assert c.snapshot()[1].opened == {}


def test_adopting_without_an_epoch_held_keeps_the_epochs_and_epoch_zero_counts() -> None:
    c = Checkpointer(2)
    c.adopt("a/0", Handover(StreamPosition(E, 3, 1.0, 5), [None, None], None))
    assert c.snapshot()[1].epochs == {}
    assert c.first_epoch("a/0", 0.0) == 0  # the clock's origin (1970)
    c = Checkpointer(2)
    c.adopt("b/0", Handover(None, [None, None], 0))  # a sink holds epoch 0: the next one is above it
    assert c.first_epoch("b/0", 0.0) == 1


@pytest.mark.parametrize(
    ("local", "through"),
    [
        (StreamPosition(E, 5, 1.0, 9), (E, 6, MAX_SUB)),  # every message of batch 5
        (StreamPosition(E, 0, 1.0, 9), (E, 1, MAX_SUB)),  # batch 0: still a batch
        (StreamPosition(E, -1), (E, 0, 0)),  # a SourceReset acknowledged: only it
    ],
)
def test_a_sink_that_holds_nothing_or_cannot_tell_skips_what_every_sink_acknowledged(
    local: StreamPosition, through: Position
) -> None:
    result = combine(local, ["unknown", None])
    assert result.skip == [through, through]
    assert result.resume == local


def test_a_sink_at_the_checkpoint_resumes_from_the_checkpoint_with_its_fingerprint() -> None:
    """The checkpoint knows the batch's CRC, the sink only its ts: the checkpoint's position stands."""
    local = StreamPosition(E, 5, 1005.0, 9)
    assert combine(local, [SinkPosition(E, 5, ts=1005.0)]).resume == local


def test_seq_zero_held_in_the_resume_epoch_is_known_published() -> None:
    assert combine(None, [SinkPosition(E, 0, ts=1.0)]).top == 0


def test_a_whole_batch_is_held_through_its_state_message_and_one_held_in_part_to_its_event() -> None:
    """The state message of a record comes after all of the record's messages: a sink that holds
    the batch whole (its last event message says ``last``) holds that too, and nothing of the next;
    one held up to an event that is not its batch's last holds only that far (breaker51 B1: taken
    for a batch that may be whole, a restored topic lacking its last events was neither sent again
    nor announced)."""
    from bridge.formats import state_message

    record = Record(stream=Stream("a", 0), epoch=E, seq=5, ts=1.0, payload=b"x")
    state = state_message(record).position
    headers = {"epoch": str(E), "seq": "5", "type": "BlockStored", "index": "2", "ts": "1.0"}
    whole = SinkPosition.from_headers({**headers, "last": "1"})
    assert whole == SinkPosition(E, 5, ts=1.0) and whole.held_through() == state
    part = SinkPosition.from_headers(headers)
    assert part == SinkPosition(E, 5, index=2, ts=1.0) and part.held_through() == (E, 6, 3) < state
    assert combine(StreamPosition(E, 5, 1.0), [part]).resume == StreamPosition(E, 4, 1.0, None, 5)  # sent again
    assert combine(StreamPosition(E, 5, 1.0), [whole]).resume == StreamPosition(E, 5, 1.0)


def test_a_header_without_its_epoch_seq_or_type_is_not_a_bridge_message() -> None:
    whole = {"epoch": "7", "seq": "3", "type": "BlockStored"}
    assert SinkPosition.from_headers(whole) == SinkPosition(7, 3)
    for name in whole:
        with pytest.raises(ValueError, match="not a bridge message"):
            SinkPosition.from_headers({k: v for k, v in whole.items() if k != name})


def test_a_control_record_is_anchored_by_the_highest_batch_of_its_epoch_at_most_one_past_it() -> None:
    """A sink whose last record is a loss (no fingerprint) needs the stream from after it, verified
    by the highest batch another sink holds of that epoch at or below the loss (+1: delivered again)."""
    from bridge.checkpoint import _own_need

    lost = SinkPosition(E, 5, "EventsLost")
    anchors = [SinkPosition(E, s, ts=1000.0 + s) for s in (3, 6, 7)] + [SinkPosition(E + 1, 6, ts=1.0)]
    assert _own_need(lost, anchors) == StreamPosition(E, 5, 1006.0, None, 6)
    assert _own_need(lost, anchors[:1]) == StreamPosition(E, 5, 1003.0, None, 3)
    assert _own_need(lost, anchors[2:]) is None  # 7 is two past it; E+1 another epoch


def test_a_fresh_start_where_a_sink_could_not_tell_is_announced() -> None:
    """No checkpoint file, and a sink cannot tell what it holds of the stream (its events deleted
    by retention; its read failed): the stream starts afresh, and its new epoch is announced by a
    SourceReset, for that sink may hold an earlier epoch's records (breaker31k Break 3). Every
    sink sure it holds nothing: a stream met for the first time, no SourceReset. Once the
    SourceReset is acknowledged, no more."""
    c = Checkpointer(2)
    c.adopt("a/0", combine(None, [None, "unknown"]), unsure=True)
    assert c.resume_position("a/0") is None and c.needs_reset("a/0")
    c.adopt("b/0", combine(None, [None, None]))
    assert c.resume_position("b/0") is None and not c.needs_reset("b/0")
    epoch = c.first_epoch("a/0", 0.0)
    c.on_ack(0, [source_reset(Stream("a", 0), epoch, "bridge_restart", 0.0)])
    c.on_ack(1, [source_reset(Stream("a", 0), epoch, "bridge_restart", 0.0)])
    assert not c.needs_reset("a/0")
