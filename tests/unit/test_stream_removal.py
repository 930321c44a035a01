"""A stream removed (discovery drops its source) while a full ``block`` sink makes it wait, right
after its engine restarted, and added again: what reaches the sinks keeps I1, I3 and I4.

The pipeline was handing on the old instance's settlement (a loss, then held batches) when the
sink filled up; the sequencer had already opened the new epoch for the new instance's burst. The
old pipeline must hand on everything its sequencer decided (the old instance's held batches are
not lost, I4), and the re-added one must resume in the new epoch, not take the new instance's
seqs for the old one's (an ``EventsLost`` of the old epoch covering seqs only the new instance
published: I1, I3). Found by an invariant breaker; the pipeline is the real one, the fan-out,
epochs store and replay client are fakes, and the second pipeline is built from the first one's
resume point exactly as ``Bridge.remove_source`` / ``Bridge.add_source`` do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path

import pytest

from bridge.checkpoint import StreamPosition
from bridge.config import Duration, ReplayConfig
from bridge.deadletter import DeadLetters, DecodeFailures
from bridge.fanout import Fanout
from bridge.metrics import Metrics
from bridge.records import Record
from bridge.replay import ReplayClient, ReplayOutcome
from bridge.sequencer import fingerprint
from bridge.sink import SinkWorker
from bridge.stream import StreamContext, StreamPipeline
from bridge.wire import ReplayReply
from tests.unit.test_stream import STREAM, frames, payload

OLD_EPOCH = 5
OLD_TOP = 12  # the old instance published 0..12; 10 only into its replay buffer
NEW_TOP = 30  # the new instance's first burst: 0..30


class FullSink:
    """A ``block`` sink whose queue stays full: a record waits in ``Fanout.finish`` until the
    stream is cancelled, and is then queued past the bounds (``force``)."""

    def __init__(self, got: list[Record]) -> None:
        self.got = got
        self.waiting = asyncio.Event()

    async def wait_room(self) -> None:
        self.waiting.set()
        await asyncio.Event().wait()

    def offer(self, record: Record) -> bool:
        self.got.append(record)
        return True

    def force(self, record: Record) -> None:
        self.got.append(record)


class Out(Fanout):
    """Every record queued, in order; while ``full`` is set every offer waits for it."""

    def __init__(self) -> None:
        super().__init__([])
        self.got: list[Record] = []
        self.full: FullSink | None = None

    def offer(self, record: Record) -> list[SinkWorker]:
        if self.full is not None:
            return [self.full]  # type: ignore[list-item]
        self.got.append(record)
        return []

    def offer_all(self, records: Sequence[Record]) -> bool:
        if self.full is not None:
            return False
        self.got.extend(records)
        return True

    def force(self, record: Record) -> None:
        self.got.append(record)


class Epochs:
    """Epoch numbers unique across the test, as the checkpoint store makes them."""

    def __init__(self) -> None:
        self.top = OLD_EPOCH

    def next_epoch(self, key: str, epoch: int, now: float, shown_at: float | None = None) -> int:
        self.top = max(self.top, epoch) + 1
        return self.top

    def note_first(self, key: str, record: Record) -> bool:
        return True

    async def persist(self) -> None:
        pass


class Replays(ReplayClient):
    """Answers with ``payloads`` at or after the start, then the end marker; ``None``: the
    request is never answered."""

    def __init__(self, payloads: dict[int, bytes] | None) -> None:
        self.payloads = payloads

    async def fetch(
        self, endpoint: str, start: int, until: int, outcome: ReplayOutcome, topic: bytes = b""
    ) -> AsyncGenerator[ReplayReply, None]:
        if self.payloads is None:
            await asyncio.Event().wait()
            return
        for seq in sorted(s for s in self.payloads if s >= start):
            yield ReplayReply(seq, self.payloads[seq], False)
        outcome.complete = True


def new_instance() -> dict[int, bytes]:
    return {s: payload(s, instance=1) for s in range(NEW_TOP + 1)}


Build = Callable[[Fanout, Epochs, Replays], StreamContext]


@pytest.fixture
def context(tmp_path: Path) -> Iterator[Build]:
    letters: list[DeadLetters] = []

    def build(fanout: Fanout, epochs: Epochs, replays: Replays) -> StreamContext:
        metrics = Metrics()
        letters.append(DeadLetters(str(tmp_path / "dead.jsonl")))
        return StreamContext(
            fanout=fanout,
            metrics=metrics,
            decode_failures=DecodeFailures(metrics, letters[-1]),
            replay=replays,
            epochs=epochs,
            spawn=lambda coro, name: asyncio.get_running_loop().create_task(coro, name=name),
            replay_config=ReplayConfig(initial_backoff=Duration(0.001), max_backoff=Duration(0.002)),
        )

    yield build
    for d in letters:
        d.close()


async def until(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def shown(records: list[Record]) -> list[tuple[object, ...]]:
    return [(r.kind, r.epoch, r.from_seq, r.seq) if r.kind == "EventsLost" else (r.kind, r.epoch, r.seq) for r in records]


async def readd(pipe: StreamPipeline, ctx: StreamContext) -> Out:
    """The source comes back (Bridge.add_source): a pipeline from the removed one's resume point,
    run until its replay is done; what it handed on."""
    point, top = pipe.resume_point()
    assert point is not None
    epoch, seq, fp, at = point
    pos = StreamPosition(epoch, seq, *(fp or (None, None)), None if at == seq else at)
    pipe2 = StreamPipeline(
        ctx,
        STREAM,
        replay_endpoint="tcp://x:1",
        replay_on_start=True,
        epoch=pos.epoch,
        delivered=pos.seq,
        delivered_fp=(pos.ts, pos.crc) if pos.ts is not None or pos.crc is not None else None,
        anchor=pos.at,
        known_top=top,
    )
    await pipe2.start()
    await until(lambda: pipe2._replay_task is not None and pipe2._replay_task.done(), what="the re-added stream's replay")
    await pipe2.stop()
    assert isinstance(ctx.fanout, Out)
    return ctx.fanout


async def remove(pipe: StreamPipeline, task: asyncio.Task[None]) -> None:
    """Discovery removes the source (Bridge.remove_source): reader cancelled, pipeline stopped."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await pipe.stop()


async def test_a_restart_decided_in_a_burst_cut_short_by_removal_is_handed_on(context: Build) -> None:
    """One burst: the old instance's last in-order batches 10, 11, then the restarted instance's
    0..30. The sequencer decides the restart at the new 0 while the run 10, 11 waits for a full
    sink; the source is removed there, then added again. The restart it decided (SourceReset, the
    new 0) is handed on with the run, the unread 1..30 count for the new epoch, not the old one:
    the old epoch ends at 11, with no EventsLost for seqs its instance never published."""
    epochs = Epochs()
    out1 = Out()
    pipe = StreamPipeline(
        context(out1, epochs, Replays(None)), STREAM, replay_endpoint="tcp://x:1", replay_on_start=False, epoch=OLD_EPOCH
    )
    await pipe.start()
    await pipe.on_live([frames(s) for s in range(10)], 1.0)
    full = out1.full = FullSink(out1.got)
    burst = [frames(10), frames(11), *(frames(s, payload(s, instance=1)) for s in range(NEW_TOP + 1))]
    task = asyncio.create_task(pipe.on_live(burst, 2.0))
    await until(full.waiting.is_set, what="the run waiting for the full sink")
    await remove(pipe, task)
    out2 = await readd(pipe, context(Out(), epochs, Replays(new_instance())))
    everything = out1.got + out2.got
    new_epoch = epochs.top
    assert new_epoch > OLD_EPOCH
    assert shown(everything) == (
        [("batch", OLD_EPOCH, s) for s in range(12)]
        + [("SourceReset", new_epoch, 0)]
        + [("batch", new_epoch, s) for s in range(NEW_TOP + 1)]
    )


async def test_a_burst_removed_while_waiting_for_the_lock_is_announced_if_the_engine_restarts(context: Build) -> None:
    """The replay task holds the stream's lock, waiting for a full sink, while a live burst (8..10)
    waits for the lock; the source is removed, and the engine restarts before it is added again.
    Those batches were read from the engine: they are delivered or announced lost in the old
    epoch, never silently missing (I3)."""
    epochs = Epochs()
    out1 = Out()
    old = {s: payload(s) for s in range(11)}
    pipe = StreamPipeline(
        context(out1, epochs, Replays(old)), STREAM, replay_endpoint="tcp://x:1", replay_on_start=False, epoch=OLD_EPOCH
    )
    await pipe.start()
    await pipe.on_live([frames(s) for s in range(5)], 1.0)
    full = out1.full = FullSink(out1.got)
    await pipe.on_live([frames(7)], 1.0)  # 5, 6 dropped by the PUB: 7 held, replay asked
    await until(full.waiting.is_set, what="the replay waiting for the full sink, holding the lock")
    assert pipe.lock.locked()
    task = asyncio.create_task(pipe.on_live([frames(s) for s in (8, 9, 10)], 2.0))
    await asyncio.sleep(0.02)
    assert not task.done()
    await remove(pipe, task)
    restarted = {s: payload(s, instance=1) for s in range(13)}  # the new instance got past seq 10
    out2 = await readd(pipe, context(Out(), epochs, Replays(restarted)))
    settled: set[int] = set()
    for r in out1.got + out2.got:
        if r.epoch == OLD_EPOCH and r.kind == "batch":
            settled.add(r.seq)
        elif r.epoch == OLD_EPOCH and r.kind == "EventsLost":
            assert r.from_seq is not None
            settled.update(range(r.from_seq, r.seq + 1))
    assert sorted(settled) == list(range(11)), shown(out1.got + out2.got)


@pytest.mark.parametrize("doubt", [False, True], ids=["restart-seen-live", "disconnect-noticed-first"])
async def test_a_stream_removed_while_a_full_sink_waits_after_a_restart_keeps_each_instance_in_its_epoch(
    context: Build, doubt: bool
) -> None:
    """Instance 0: 0..9 live and delivered; 10 dropped by the PUB (its replay never answers); 11,
    12 live, held behind the gap. The sink fills up; the engine restarts and its first burst
    (0..30) arrives (``doubt``: the disconnect is noticed first, and the new instance answers
    replays). The source is removed while the stream waits for the sink, then added again from
    its resume point, and the new instance's replay answers.

    Expected, in order: epoch 5 holds instance 0's 0..9, 10 announced lost, 11 and 12 (they
    reached the bridge); a SourceReset opens the next epoch, which holds instance 1's 0..30, each
    once; no other record."""
    build = context
    epochs = Epochs()
    out1, replays1 = Out(), Replays(None)
    pipe = StreamPipeline(
        build(out1, epochs, replays1), STREAM, replay_endpoint="tcp://x:1", replay_on_start=False, epoch=OLD_EPOCH
    )
    await pipe.start()
    await pipe.on_live([frames(s) for s in range(10)], 1.0)
    await pipe.on_live([frames(11), frames(12)], 1.0)  # 10 dropped by the PUB: 11, 12 held, replay asked
    assert shown(out1.got) == [("batch", OLD_EPOCH, s) for s in range(10)]
    full = out1.full = FullSink(out1.got)
    if doubt:
        old = pipe._replay_task
        replays1.payloads = new_instance()
        await pipe.disconnected()
        if old is not None:
            old.cancel()
    task = asyncio.create_task(pipe.on_live([frames(s, payload(s, instance=1)) for s in range(NEW_TOP + 1)], 2.0))
    await until(full.waiting.is_set, what="the stream waiting for the full sink")
    assert pipe.sequencer.epoch > OLD_EPOCH  # the sequencer already took the burst for a restart
    await remove(pipe, task)
    out2 = await readd(pipe, build(out2 := Out(), epochs, Replays(new_instance())))

    everything = out1.got + out2.got
    new_epoch = next((r.epoch for r in everything if r.kind == "SourceReset"), None)
    assert new_epoch is not None and new_epoch > OLD_EPOCH, shown(everything)
    expected = (
        [("batch", OLD_EPOCH, s) for s in range(10)]
        + [("EventsLost", OLD_EPOCH, 10, 10), ("batch", OLD_EPOCH, 11), ("batch", OLD_EPOCH, 12)]
        + [("SourceReset", new_epoch, 0)]
        + [("batch", new_epoch, s) for s in range(NEW_TOP + 1)]
    )
    assert shown(everything) == expected
    # Each batch carries its own instance's payload: instance 0's in the old epoch, 1's in the new.
    for r in everything:
        if r.kind == "batch":
            assert r.payload == payload(r.seq, instance=0 if r.epoch == OLD_EPOCH else 1), (r.epoch, r.seq)


class NotedEpochs(Epochs):
    """Also what is noted as an epoch's first batch, and each save, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, object]] = []

    def note_first(self, key: str, record: Record) -> bool:
        self.log.append(("first", (record.epoch, record.seq)))
        return True

    async def persist(self) -> None:
        self.log.append(("persist", None))


async def test_a_burst_cut_short_by_removal_notes_the_first_batch_of_the_epoch_it_opened(context: Build) -> None:
    """The restart decided in a burst cut short (the old instance's run 10, 11 waiting for a full
    sink, then the new instance's 0): the new epoch's first batch is noted and saved before it is
    queued (Checkpointer.resume_position resumes just before it after a crash), not the old
    epoch's batch of the run."""
    epochs = NotedEpochs()
    out = Out()
    pipe = StreamPipeline(
        context(out, epochs, Replays(None)), STREAM, replay_endpoint="tcp://x:1", replay_on_start=False, epoch=OLD_EPOCH
    )
    await pipe.start()
    await pipe.on_live([frames(s) for s in range(10)], 1.0)
    epochs.log.clear()
    full = out.full = FullSink(out.got)
    task = asyncio.create_task(pipe.on_live([frames(10), frames(11), frames(0, payload(0, instance=1))], 2.0))
    await until(full.waiting.is_set, what="the run waiting for the full sink")
    await remove(pipe, task)
    new_epoch = epochs.top
    assert task.cancelled()
    assert shown(out.got)[-4:] == [
        ("batch", OLD_EPOCH, 10),
        ("batch", OLD_EPOCH, 11),
        ("SourceReset", new_epoch, 0),
        ("batch", new_epoch, 0),
    ]
    assert epochs.log == [("first", (new_epoch, 0)), ("persist", None)], epochs.log


async def test_a_burst_cut_short_inside_counts_only_the_frames_after_the_one_decided(context: Build) -> None:
    """Live 0..9; then 10 (in order), 12 (a gap: replay asked) and 13, while the sink is full: the
    stream waits at 12 with 10 in its run and is removed there. 10 is handed on; 13, read but never
    sequenced, counts for the epoch's published top."""
    out = Out()
    pipe = StreamPipeline(
        context(out, Epochs(), Replays(None)), STREAM, replay_endpoint="tcp://x:1", replay_on_start=False, epoch=OLD_EPOCH
    )
    await pipe.start()
    await pipe.on_live([frames(s) for s in range(10)], 1.0)
    full = out.full = FullSink(out.got)
    task = asyncio.create_task(pipe.on_live([frames(10), frames(12), frames(13)], 2.0))
    await until(full.waiting.is_set, what="the run waiting for the full sink")
    await remove(pipe, task)
    assert task.cancelled()
    assert shown(out.got)[-1] == ("batch", OLD_EPOCH, 10)
    assert pipe.resume_point()[1] == 13


async def test_a_burst_removed_while_waiting_for_the_lock_counts_from_its_first_frame(context: Build) -> None:
    """Every frame of a burst that never got the lock is unread: its top is its first frame (9)
    when the next one (8) goes back (another instance's)."""
    pipe = StreamPipeline(
        context(Out(), Epochs(), Replays(None)), STREAM, replay_endpoint="tcp://x:1", replay_on_start=False, epoch=OLD_EPOCH
    )
    await pipe.start()
    await pipe.on_live([frames(s) for s in range(5)], 1.0)
    async with pipe.lock:
        task = asyncio.create_task(pipe.on_live([frames(9), frames(8)], 2.0))
        await asyncio.sleep(0)
        await remove(pipe, task)
    assert task.cancelled()
    assert pipe.resume_point()[1] == 9


async def test_a_decision_waiting_for_a_full_sink_is_handed_on_when_the_stream_is_removed(context: Build) -> None:
    """No replay: a gap (1, 2) is lost at once. The loss waits for a full sink, the batch after it
    is decided too; the stream is removed: both are handed on, in order (I3, I4)."""
    out = Out()
    pipe = StreamPipeline(context(out, Epochs(), Replays(None)), STREAM, replay_endpoint=None, replay_on_start=False, epoch=5)
    await pipe.start()
    await pipe.on_live([frames(0)], 1.0)
    full = out.full = FullSink(out.got)
    task = asyncio.create_task(pipe.on_live([frames(3)], 2.0))
    await until(full.waiting.is_set, what="the loss waiting for the full sink")
    await remove(pipe, task)
    assert task.cancelled()
    assert shown(out.got) == [("batch", 5, 0), ("EventsLost", 5, 1, 2), ("batch", 5, 3)]
    assert out.got[-1].events  # decoded: a context decodes events unless told no sink needs them
    b3 = out.got[-1]
    assert pipe.resume_point() == ((5, 3, fingerprint(b3.ts, b3.payload), 3), 3)


class SlowSave(Epochs):
    """Its first save waits for ``saved``."""

    def __init__(self) -> None:
        super().__init__()
        self.saved = asyncio.Event()
        self.saving = asyncio.Event()
        self.calls = 0

    async def persist(self) -> None:
        self.calls += 1
        if self.calls == 1:
            self.saving.set()
            await self.saved.wait()


async def test_a_first_batch_whose_epoch_is_being_saved_is_handed_on_when_the_stream_is_removed(context: Build) -> None:
    """A pipeline's first batch is noted and its epoch saved before it goes out; the stream is
    removed during that save: the batch, decided delivered, is handed on all the same (I4)."""
    out, epochs = Out(), SlowSave()
    pipe = StreamPipeline(context(out, epochs, Replays(None)), STREAM, replay_endpoint=None, replay_on_start=False, epoch=5)
    await pipe.start()
    task = asyncio.create_task(pipe.on_live([frames(0)], 1.0))
    await until(epochs.saving.is_set, what="the first batch's save")
    assert out.got == []
    await remove(pipe, task)
    assert task.cancelled()
    assert shown(out.got) == [("batch", 5, 0)]
    assert pipe.resume_point()[0] == (5, 0, fingerprint(out.got[0].ts, out.got[0].payload), 0)


async def test_a_retired_stream_s_unread_seqs_are_announced_lost_if_its_engine_restarted(context: Build) -> None:
    """Live 0..4; a burst 5..7 waits for the lock and the source is removed: 5..7 were read from
    the engine, never sequenced. The source comes back with the same sequencer (retire), and the
    engine has restarted meanwhile: 5..7 are announced lost in the old epoch (I3), then the new
    instance's batches go out in a new epoch."""
    epochs = Epochs()
    out = Out()
    ctx = context(out, epochs, Replays(None))
    pipe = StreamPipeline(ctx, STREAM, replay_endpoint="tcp://x:1", replay_on_start=False, epoch=OLD_EPOCH)
    await pipe.start()
    await pipe.on_live([frames(s) for s in range(5)], 1.0)
    async with pipe.lock:
        task = asyncio.create_task(pipe.on_live([frames(s) for s in (5, 6, 7)], 2.0))
        await asyncio.sleep(0)
        await remove(pipe, task)
    sequencer = pipe.retire()
    restarted = {s: payload(s, instance=1) for s in range(3)}
    again = StreamPipeline(
        context(out, epochs, Replays(restarted)),
        STREAM,
        replay_endpoint="tcp://x:1",
        replay_on_start=False,
        epoch=OLD_EPOCH,
        sequencer=sequencer,
    )
    await again.start()
    await again.on_live([frames(s, restarted[s]) for s in range(3)], 3.0)
    await until(lambda: again._replay_task is None or again._replay_task.done(), what="the replay")
    await again.stop()
    old_lost = [(r.from_seq, r.seq) for r in out.got if r.kind == "EventsLost" and r.epoch == OLD_EPOCH]
    assert old_lost == [(5, 7)], shown(out.got)
    assert [(r.kind, r.seq) for r in out.got if r.epoch > OLD_EPOCH] == [("SourceReset", 0), *(("batch", s) for s in range(3))]
