"""StreamPipeline built from a StreamContext of fakes: no Bridge, no sockets, no sinks.

The fakes record what the pipeline hands on (the fan-out), which epochs it saves and when (the
epochs store), and answer replays from a script (the replay client)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from bridge import probe
from bridge.checkpoint import SinkPosition
from bridge.config import Duration, ReplayConfig
from bridge.deadletter import DeadLetters, DecodeFailures
from bridge.fanout import Fanout
from bridge.formats import Renderer
from bridge.metrics import Metrics
from bridge.records import Record, Stream, events_lost, source_reset
from bridge.replay import ReplayClient, ReplayOutcome, replay
from bridge.sequencer import fingerprint
from bridge.sink import SinkWorker
from bridge.stream import UNDECODABLE_AFTER, StreamContext, StreamPipeline
from bridge.wire import ReplayReply, peek_ts
from tests.support.records import batch, block_stored

STREAM = Stream("engine", 0)


class Recording(Fanout):
    """Every record offered, in order; never full."""

    def __init__(self, log: list[tuple[str, object]]) -> None:
        super().__init__([])
        self.log = log
        self.records: list[Record] = []
        self.room_for_runs = True  # False: a sink has no room for a whole run (offered one by one)

    def offer(self, record: Record) -> list[SinkWorker]:
        self.records.append(record)
        self.log.append(("record", (record.kind, record.epoch, record.seq)))
        return []

    def offer_all(self, records: Sequence[Record]) -> bool:
        if not self.room_for_runs:
            return False
        for record in records:
            self.offer(record)
        return True


class Epochs:
    def __init__(self, log: list[tuple[str, object]]) -> None:
        self.log = log
        self.opened: list[int] = []

    def next_epoch(self, key: str, epoch: int, now: float, shown_at: float | None = None) -> int:
        self.opened.append(epoch + 1)
        return epoch + 1

    def note_first(self, key: str, record: Record) -> bool:
        self.log.append(("first", (record.epoch, record.seq)))
        return True

    async def persist(self) -> None:
        self.log.append(("persist", None))


class Replays(ReplayClient):
    """Answers each request with the scripted payloads at or after its start, then the end marker."""

    def __init__(self, payloads: dict[int, bytes]) -> None:
        self.payloads = payloads
        self.requests: list[tuple[int, int]] = []
        self.silent = False  # every request gets no reply at all (a dead or wrong endpoint)
        self.error: Exception | None = None  # raised by every request

    async def fetch(
        self, endpoint: str, start: int, until: int, outcome: ReplayOutcome, topic: bytes = b""
    ) -> AsyncGenerator[ReplayReply, None]:
        self.requests.append((start, until))
        if self.error is not None:
            raise self.error
        if self.silent:
            return
        for seq in sorted(s for s in self.payloads if s >= start):
            yield ReplayReply(seq, self.payloads[seq], False)
        outcome.complete = True


def payload(seq: int, instance: int = 0) -> bytes:
    return batch(STREAM, seq, epoch=instance).payload if instance == 0 else batch(Stream("other", 0), seq + 1000).payload


@dataclass
class Fakes:
    pipeline: StreamPipeline
    fanout: Recording
    epochs: Epochs
    replays: Replays
    metrics: Metrics
    dead_letters: DeadLetters
    log: list[tuple[str, object]]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Fakes]]:
    made: list[Fakes] = []

    def build(replays: dict[int, bytes] | None = None, *, needs_events: bool = True, announce: bool = False) -> Fakes:
        log: list[tuple[str, object]] = []
        metrics = Metrics()
        dead_letters = DeadLetters(str(tmp_path / "dead.jsonl"))
        fanout, epochs, client = Recording(log), Epochs(log), Replays(replays or {})
        ctx = StreamContext(
            fanout=fanout,
            metrics=metrics,
            decode_failures=DecodeFailures(metrics, dead_letters),
            replay=client,
            epochs=epochs,
            spawn=lambda coro, name: asyncio.get_running_loop().create_task(coro, name=name),
            replay_config=ReplayConfig(initial_backoff=Duration(0.001), max_backoff=Duration(0.002)),
            needs_events=needs_events,
        )
        endpoint = "tcp://fake:1" if replays is not None else None
        pipeline = StreamPipeline(ctx, STREAM, replay_endpoint=endpoint, replay_on_start=False, epoch=5, announce=announce)
        made.append(Fakes(pipeline, fanout, epochs, client, metrics, dead_letters, log))
        return made[-1]

    yield build
    for f in made:
        f.dead_letters.close()


def frames(seq: int, data: bytes | None = None) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), data if data is not None else payload(seq)]


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def settle(pipeline: StreamPipeline) -> None:
    task = pipeline._replay_task
    if task is not None:
        await task


async def settle_all(pipeline: StreamPipeline) -> None:
    """Until no replay is in flight (each retry is a new task)."""
    while (task := pipeline._replay_task) is not None and not task.done():
        await task


async def test_a_burst_is_sequenced_decoded_and_handed_on_in_order(make: Callable[..., Fakes]) -> None:
    f = make()
    pipeline = f.pipeline
    await pipeline.start()
    await pipeline.on_live([frames(0), frames(1), frames(2)], received=1_700_000_001.0)
    assert [(r.kind, r.epoch, r.seq) for r in f.fanout.records] == [("batch", 5, 0), ("batch", 5, 1), ("batch", 5, 2)]
    assert f.fanout.records[0].events and f.fanout.records[0].events[-1]["type"] == "BlockRemoved"
    # The first batch of the epoch is noted (and saved) before it goes out.
    assert f.log[:2] == [("first", (5, 0)), ("persist", None)]
    assert sample(f.metrics, "kv_bridge_batches_received_total", source="engine", dp_rank="0") == 3
    assert sample(f.metrics, "kv_bridge_source_last_seq", source="engine", dp_rank="0") == 2
    assert sample(f.metrics, "kv_bridge_events_received_total", source="engine", type="BlockStored") == 6


async def test_a_gap_is_fetched_from_the_replay_client_and_filled_in_order(make: Callable[..., Fakes]) -> None:
    f = make({q: payload(q) for q in range(4)})
    pipeline = f.pipeline
    await pipeline.start()
    await pipeline.on_live([frames(0), frames(3)], received=1_700_000_001.0)
    await settle(pipeline)
    assert [r.seq for r in f.fanout.records] == [0, 1, 2, 3]
    # From the last seq delivered (its copy is checked against what went out) to the live batch
    # past the gap (the reply at its seq confirms it: see the next test).
    assert f.replays.requests == [(0, 3)]
    assert sample(f.metrics, "kv_bridge_replay_requests_total", source="engine", outcome="complete") == 1
    assert sample(f.metrics, "kv_bridge_batches_replayed_total", source="engine") == 3
    assert sample(f.metrics, "kv_bridge_sequence_gaps_total", source="engine", dp_rank="0") == 1


async def test_a_live_frame_ahead_of_its_engine_is_dead_lettered_and_the_stream_goes_on(make: Callable[..., Fakes]) -> None:
    """Issue 29 (breaker31x B2): one frame far ahead of the engine, then the engine's own next
    seqs: one epoch, nothing lost, the frame dead-lettered (``bad_seq``); and a frame with the end
    marker's seq, read on the socket's fast path, too."""
    f = make({q: payload(q) for q in range(4)})  # (what the engine holds: it publishes 3 before it is asked)
    pipeline = f.pipeline
    await pipeline.start()
    await pipeline.on_live(
        [frames(0), frames(1), frames(2**63, payload(9)), frames(2), frames(2**64 - 1, payload(8))], received=1_700_000_001.0
    )
    await settle_all(pipeline)
    await pipeline.on_live([frames(3)], received=1_700_000_002.0)
    await settle_all(pipeline)
    assert [(r.kind, r.epoch, r.seq) for r in f.fanout.records] == [("batch", 5, q) for q in range(4)]
    assert sample(f.metrics, "kv_bridge_decode_failures_total", source="engine", reason="bad_seq") == 2
    f.dead_letters.close()
    dead = [msgspec.json.decode(line) for line in Path(f.dead_letters.path).read_bytes().splitlines()]  # noqa: ASYNC240
    assert sorted(d["seq"] for d in dead if d["reason"] == "bad_seq" and d["seq"] is not None) == [2**63]


async def test_a_restart_saves_the_new_epoch_before_its_reset_goes_out(make: Callable[..., Fakes]) -> None:
    f = make()
    pipeline = f.pipeline
    await pipeline.start()
    await pipeline.on_live([frames(0), frames(1), frames(2)], received=1_700_000_001.0)
    f.log.clear()
    await pipeline.on_live([frames(0, payload(0, instance=1))], received=1_700_000_002.0)  # seq went back
    assert f.epochs.opened == [6]
    assert f.log[0] == ("persist", None) and f.log[1] == ("record", ("SourceReset", 6, 0))
    assert ("first", (6, 0)) in f.log and f.log[-1] == ("record", ("batch", 6, 0))
    assert sample(f.metrics, "kv_bridge_source_restarts_total", source="engine") == 1


async def test_an_undecodable_batch_is_dead_lettered_and_announced_lost(make: Callable[..., Fakes]) -> None:
    f = make()
    pipeline = f.pipeline
    await pipeline.start()
    await pipeline.on_live([frames(0), frames(1, b"\xc1not msgpack"), frames(2)], received=1_700_000_001.0)
    assert [(r.kind, r.seq) for r in f.fanout.records] == [("batch", 0), ("EventsLost", 1), ("batch", 2)]
    assert sample(f.metrics, "kv_bridge_decode_failures_total", source="engine", reason="bad_msgpack") == 1
    assert sample(f.metrics, "kv_bridge_dead_letters_total", reason="bad_msgpack") == 1
    # announced lost, so counted so (breaker30h M1: it was not)
    assert sample(f.metrics, "kv_bridge_batches_lost_total", source="engine", reason="undecodable") == 1
    (line,) = Path(f.dead_letters.path).read_text().splitlines()  # noqa: ASYNC240 (a small local file)
    assert '"seq":1' in line and '"reason":"bad_msgpack"' in line and b"not msgpack".hex() in line


@pytest.mark.parametrize("needs_events", [True, False])
async def test_a_stream_is_undecodable_after_a_run_of_bad_batches_not_after_one(
    make: Callable[..., Fakes], needs_events: bool
) -> None:
    """Breaker30h U1: an engine whose every batch fails to decode counts as delivering nothing
    (readiness); one bad batch among good ones does not, and a good batch clears it."""
    f = make(needs_events=needs_events)
    pipeline = f.pipeline
    await pipeline.start()
    bad = b"\xc1not msgpack"
    await pipeline.on_live([frames(0), frames(1, bad), frames(2)], received=1_700_000_001.0)
    assert pipeline.undecodable is None
    run = UNDECODABLE_AFTER
    await pipeline.on_live([frames(3 + i, bad) for i in range(run - 1)], received=1_700_000_002.0)
    assert pipeline.undecodable is None  # one short of the run
    await pipeline.on_live([frames(2 + run, bad)], received=1_700_000_003.0)
    assert pipeline.undecodable is not None and pipeline.undecodable.startswith("bad_msgpack")
    await pipeline.on_live([frames(3 + run)], received=1_700_000_004.0)
    assert pipeline.undecodable is None


@pytest.mark.parametrize("bad", ["frames", "events"])
async def test_messages_of_which_nothing_decodes_count_as_undecodable_whatever_fails(
    make: Callable[..., Fakes], bad: str
) -> None:
    """Breaker30h2 B1, B4: an engine whose messages fail before the batch (a 4-byte seq frame),
    or whose batches decode but hold no event that does, delivers nothing either: the same run
    makes the stream undecodable, and a good batch clears it."""
    f = make()
    pipeline = f.pipeline
    await pipeline.start()
    await pipeline.on_live([frames(0)], received=1_700_000_001.0)
    no_events = msgspec.msgpack.encode([1_700_000_001.5, [1, 2], 0])  # events that are not events
    run = [
        [b"kv", (1 + i).to_bytes(4, "big"), payload(1 + i)] if bad == "frames" else frames(1 + i, no_events)
        for i in range(UNDECODABLE_AFTER)
    ]
    await pipeline.on_live(run[:-1], received=1_700_000_002.0)
    assert pipeline.undecodable is None  # one short of the run
    await pipeline.on_live(run[-1:], received=1_700_000_003.0)
    assert pipeline.undecodable is not None and pipeline.undecodable.startswith("bad_seq" if bad == "frames" else "bad_event")
    await pipeline.on_live([frames(1 + UNDECODABLE_AFTER)], received=1_700_000_004.0)
    assert pipeline.undecodable is None


async def test_raw_only_sinks_get_counted_batches_not_decoded_events(make: Callable[..., Fakes]) -> None:
    f = make(needs_events=False)
    pipeline = f.pipeline
    await pipeline.start()
    await pipeline.on_live([frames(0)], received=1_700_000_001.0)
    (record,) = f.fanout.records
    assert record.events == [] and record.n_events == 3  # counted from the bytes, not decoded
    assert sample(f.metrics, "kv_bridge_events_received_total", source="engine", type="BlockRemoved") == 1


async def test_the_resume_point_is_the_last_record_handed_on(make: Callable[..., Fakes]) -> None:
    f = make()
    pipeline = f.pipeline
    assert pipeline.resume_point() == (None, -1)
    await pipeline.start()
    await pipeline.on_live([frames(0), frames(1)], received=1_700_000_001.0)
    point, top = pipeline.resume_point()
    assert point is not None and point[:2] == (5, 1) and point[3] == 1 and top >= 1


async def test_a_stream_resumed_without_an_acknowledged_reset_announces_its_epoch_first(make: Callable[..., Fakes]) -> None:
    f = make(announce=True)
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0)], received=1_700_000_001.0)
    assert [(r.kind, r.epoch, r.seq, r.reason) for r in f.fanout.records] == [
        ("SourceReset", 5, 0, "bridge_restart"),
        ("batch", 5, 0, None),
    ]
    assert sample(f.metrics, "kv_bridge_source_restarts_total", source="engine") == 0  # not an engine restart
    # The epoch announced is the one it resumes in, saved by an earlier run: only its first batch is.
    assert f.log == [("record", ("SourceReset", 5, 0)), ("first", (5, 0)), ("persist", None), ("record", ("batch", 5, 0))]


async def resumed_then_disconnected(f: Fakes, *, delivered: int, undecodable: int) -> StreamPipeline:
    """A pipeline resumed at ``delivered`` (its checkpoint fingerprint), whose start-up replay
    brings the engine's batches up to ``undecodable``, which cannot be decoded; then the
    connection drops."""
    old = {s: payload(s) for s in range(undecodable)} | {undecodable: b"\xc1\xc1 not msgpack"}
    f.replays.payloads = old
    pipeline = StreamPipeline(
        f.pipeline.ctx,
        STREAM,
        replay_endpoint="tcp://fake:1",
        replay_on_start=True,
        epoch=5,
        delivered=delivered,
        delivered_fp=fingerprint(peek_ts(old[delivered]), old[delivered]),
    )
    await pipeline.start()
    await settle(pipeline)
    await pipeline.disconnected()
    return pipeline


async def test_an_undecodable_last_batch_does_not_hide_a_restart_of_a_resumed_stream(make: Callable[..., Fakes]) -> None:
    """Resumed at 7, the stream replays 8 and 9, and 9 cannot be decoded (no engine ts to tell
    instances apart by). The engine restarts; the new instance publishes 0..13, every batch read
    live, its replay buffer keeping the last 4. The restart shows at its first batch (checked
    against 8, the last batch with a ts, as the checkpoint would): all of 0..13 are delivered in
    the new epoch, none announced lost (I4)."""
    f = make({})
    pipeline = await resumed_then_disconnected(f, delivered=7, undecodable=9)
    new = {s: payload(s, instance=1) for s in range(14)}
    for s in range(14):
        f.replays.payloads = {k: v for k, v in new.items() if s - 4 < k <= s}
        await pipeline.on_live([frames(s, new[s])], 1_800_000_000.0)
        await settle(pipeline)
    shown = [(r.kind, r.epoch, r.from_seq, r.seq) for r in f.fanout.records]
    assert shown == [
        ("batch", 5, None, 8),
        ("EventsLost", 5, 9, 9),
        ("SourceReset", 6, None, 0),
        *[("batch", 6, None, s) for s in range(14)],
    ]


async def test_an_undecodable_batch_sent_twice_is_a_duplicate_not_a_restart(make: Callable[..., Fakes]) -> None:
    """The live stream repeats its last batch, which could not be decoded: it is still the very
    batch delivered last (same bytes), not a new instance."""
    f = make({})
    bad = b"\xc1\xc1 not msgpack"
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(1, bad)], 1_700_000_001.0)
    await f.pipeline.on_live([frames(1, bad)], 1_700_000_001.5)
    await f.pipeline.on_live([frames(2), frames(3)], 1_700_000_002.0)
    await settle(f.pipeline)
    assert [(r.kind, r.epoch, r.seq) for r in f.fanout.records] == [
        ("batch", 5, 0),
        ("EventsLost", 5, 1),
        ("batch", 5, 2),
        ("batch", 5, 3),
    ]


async def test_a_resumed_stream_whose_replay_brings_only_an_undecodable_batch_still_sees_a_restart(
    make: Callable[..., Fakes],
) -> None:
    """Resumed at 10 (a checkpoint with its fingerprint), the start-up replay brings only 11, which
    cannot be decoded. The engine restarts and its new instance publishes 0..14: the restart is
    seen (against 11's CRC), and nothing of the new instance goes out in the old epoch (I1)."""
    f = make({})
    pipeline = await resumed_then_disconnected(f, delivered=10, undecodable=11)
    f.replays.payloads = {s: payload(s, instance=1) for s in range(15)}
    await pipeline.on_live([frames(14, f.replays.payloads[14])], 1_800_000_000.0)
    for _ in range(3):
        await settle(pipeline)
        await pipeline.probe()
    await settle(pipeline)
    new_instance = {f.replays.payloads[s] for s in range(15)}
    in_old_epoch = [r.seq for r in f.fanout.records if r.epoch == 5 and r.kind == "batch" and r.payload in new_instance]
    assert in_old_epoch == []
    assert [r.seq for r in f.fanout.records if r.epoch > 5 and r.kind == "batch"] == list(range(15))


async def test_a_burst_cut_short_counts_its_unread_seqs_up_to_the_first_out_of_order(make: Callable[..., Fakes]) -> None:
    """A burst read from the engine but never sequenced (the stream removed meanwhile) raises the
    published top to its seqs while each follows the one before: a seq at or below the previous
    one starts another instance's, which is not this epoch's; an undecodable frame is skipped."""
    f = make()
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(1), frames(2)], received=1_700_000_001.0)
    assert f.pipeline.resume_point()[1] == 2
    f.pipeline.note_unread([frames(3), [b"kv", b"short"], frames(4), frames(4), frames(9)])
    assert f.pipeline.resume_point()[1] == 4  # 4 again: another instance's, and so is its 9
    f.pipeline.note_unread([frames(2), frames(7)])  # at or below the last live seq: not this instance's
    assert f.pipeline.resume_point()[1] == 4
    f.pipeline.note_unread([frames(3)])  # lower than the top already noted: the top stays
    assert f.pipeline.resume_point()[1] == 4


async def test_unread_seqs_count_for_their_epoch_only(make: Callable[..., Fakes]) -> None:
    """A drop's tail read and noted in one epoch is its instance's: once a restart opens the next
    epoch, it is not how far the next instance published (breaker119 1: saved as the next
    instance's top, the next run announced seqs it never published lost)."""
    f = make()
    await f.pipeline.start()
    await f.pipeline.on_live([frames(s) for s in range(3)], received=1_700_000_001.0)
    f.pipeline.note_unread([frames(s) for s in range(3, 15)])
    assert f.pipeline.resume_point()[1] == 14
    epoch = f.pipeline.sequencer.epoch
    await f.pipeline.on_live([frames(0, payload(0, instance=1))], received=1_700_000_100.0)  # a restart
    await settle(f.pipeline)
    assert f.pipeline.sequencer.epoch > epoch
    assert f.pipeline.resume_point()[1] < 3


async def test_unread_seqs_of_a_stream_that_saw_nothing_live_count_from_the_first(make: Callable[..., Fakes]) -> None:
    f = make()
    f.pipeline.note_unread([frames(6), frames(7), frames(3)])
    assert f.pipeline.resume_point() == (None, 7)


@pytest.mark.parametrize("same_epoch", [True, False])
async def test_the_resume_point_carries_the_last_batch_fingerprint_only_within_its_epoch(
    make: Callable[..., Fakes], same_epoch: bool
) -> None:
    """After a loss announced past the last batch, the resume point is the loss, anchored at that
    batch (its fingerprint and seq); a batch of an earlier epoch anchors nothing."""
    f = make()
    pipeline = f.pipeline
    last = batch(STREAM, 3, epoch=5 if same_epoch else 4)
    pipeline._handed_batch = last
    pipeline._handed = events_lost(STREAM, 5, 4, 6, "replay failed", 1.0)
    point, _ = pipeline.resume_point()
    if same_epoch:
        assert point == (5, 6, fingerprint(last.ts, last.payload), 3)
    else:
        assert point == (5, 6, None, None)


async def test_the_resume_point_of_a_restart_is_before_the_new_epoch(make: Callable[..., Fakes]) -> None:
    f = make()
    f.pipeline._handed = source_reset(STREAM, 6, "restart", 1.0)
    f.pipeline._handed_batch = batch(STREAM, 3, epoch=5)
    assert f.pipeline.resume_point() == ((6, -1, None, None), -1)


async def test_a_live_message_not_shaped_as_the_socket_gives_it_is_read_as_wire_parse_live_reads_it(
    make: Callable[..., Fakes],
) -> None:
    """Frames that are not [topic, 8-byte seq, bytes]: a payload in another buffer type is read as
    bytes; a message with 2 or 4 frames, or a seq frame of 7 bytes, is a decode failure (dead
    lettered, nothing handed on); a topic that happens to be 8 bytes long is not read as the seq."""
    f = make()
    await f.pipeline.start()
    seq = (0).to_bytes(8, "big")
    await f.pipeline.on_live(
        [[b"kvevents", seq, payload(0)], [b"kv", (1).to_bytes(8, "big"), bytearray(payload(1))]], received=1_700_000_001.0
    )
    assert [(r.kind, r.seq, type(r.payload)) for r in f.fanout.records] == [("batch", 0, bytes), ("batch", 1, bytes)]
    assert f.fanout.records[1].payload == payload(1)
    bad = [
        [b"kv", (2).to_bytes(8, "big")],
        [b"kv", (2).to_bytes(8, "big"), payload(2), b"more"],
        [b"kv", b"\x00" * 7, payload(2)],
        [b"kv", b"\x00" * 7, b"\x00" * 8],  # the payload, not the seq frame, is 8 bytes long
    ]
    await f.pipeline.on_live(bad, received=1_700_000_002.0)
    assert len(f.fanout.records) == 2
    failures = sum(
        sample(f.metrics, "kv_bridge_decode_failures_total", source="engine", reason=reason)
        for reason in ("bad_frames", "bad_seq")
    )
    assert failures == 4


async def test_the_ingest_lag_is_the_receive_time_after_the_engine_ts_never_negative(make: Callable[..., Fakes]) -> None:
    f = make()
    await f.pipeline.start()
    ts0, ts1 = peek_ts(payload(0)), peek_ts(payload(1))
    assert ts0 is not None and ts1 is not None
    await f.pipeline.on_live([frames(0)], received=ts0 + 2.0)
    await f.pipeline.on_live([frames(1)], received=ts1 - 5.0)  # the engine's clock ahead: 0, not -5
    f.pipeline.flush_metrics()
    assert sample(f.metrics, "kv_bridge_ingest_lag_seconds_count") == 2
    assert sample(f.metrics, "kv_bridge_ingest_lag_seconds_sum") == pytest.approx(2.0)


async def test_the_resume_point_after_a_run_is_its_last_record_and_last_batch(make: Callable[..., Fakes]) -> None:
    f = make()
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(1), frames(2), frames(3)], received=1_700_000_001.0)
    ts3 = peek_ts(payload(3))
    assert f.pipeline.resume_point() == ((5, 3, fingerprint(ts3, payload(3)), 3), 3)


async def test_losses_and_duplicates_are_counted_per_batch(make: Callable[..., Fakes]) -> None:
    f = make()  # no replay endpoint: a gap is lost at once
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(3), frames(3), frames(7)], received=1_700_000_001.0)
    assert [(r.kind, r.from_seq, r.seq) for r in f.fanout.records if r.kind == "EventsLost"] == [
        ("EventsLost", 1, 2),
        ("EventsLost", 4, 6),
    ]
    assert sample(f.metrics, "kv_bridge_batches_lost_total", source="engine", reason="no_replay") == 5
    assert sample(f.metrics, "kv_bridge_duplicates_dropped_total", source="engine") == 1


async def test_a_replay_endpoint_that_cannot_be_probed_is_not_said_to_answer(make: Callable[..., Fakes]) -> None:
    """breaker66 B3: a replay endpoint that is neither TCP nor ipc, and never replies, was reported as
    "a ROUTER socket answers its handshake" although nothing was asked of it."""
    f = make({})
    f.pipeline.replay_endpoint = "inproc://kv-replay-nobody"  # (an ipc:// path is probed: see bridge.probe)
    f.replays.silent = True
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(2)], received=1_700_000_001.0)
    await settle_all(f.pipeline)
    for _ in range(10):  # the diagnosis runs in its own task
        await asyncio.sleep(0)
    problem = f.pipeline.replay_problem
    assert problem is not None and problem.startswith("inproc://kv-replay-nobody: no reply to a replay request")
    assert "not probed" in problem and "answers its handshake" not in problem


async def test_a_replay_without_any_reply_asks_the_endpoint_why_at_most_once_a_minute(
    make: Callable[..., Fakes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gap whose replays get no reply at all: the first such replay asks the endpoint what it is
    (bridge.probe) and keeps the answer for /readyz; its retries within the minute do not ask again.
    Each retry waits its backoff; after max_attempts the gap is announced lost."""
    asked: list[tuple[str, str]] = []

    async def diagnose(endpoint: str, role: str, timeout: float = 2.0) -> tuple[str, str]:
        asked.append((endpoint, role))
        return ("a PUB socket answers, not a ROUTER", "wrong_peer")

    monkeypatch.setattr(probe, "diagnose", diagnose)
    f = make({})
    f.replays.silent = True
    assert f.pipeline.replay_problem is None
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(2)], received=1_700_000_001.0)
    await settle_all(f.pipeline)
    for _ in range(10):  # the diagnosis runs in its own task
        await asyncio.sleep(0)
    assert asked == [("tcp://fake:1", "replay")]
    assert f.pipeline.replay_problem == "tcp://fake:1: a PUB socket answers, not a ROUTER"
    attempts = f.pipeline.ctx.replay_config.max_attempts
    assert len(f.replays.requests) == attempts
    assert sample(f.metrics, "kv_bridge_replay_requests_total", source="engine", outcome="timeout") == attempts
    assert [(r.kind, r.from_seq, r.seq) for r in f.fanout.records] == [
        ("batch", None, 0),
        ("EventsLost", 1, 1),
        ("batch", None, 2),
    ]


async def test_a_retried_replay_waits_its_backoff_and_the_first_attempt_does_not(make: Callable[..., Fakes]) -> None:
    waited: list[int] = []

    class Recorded:
        def delay(self, attempt: int) -> float:
            waited.append(attempt)
            return 0.0

    f = make({})
    f.replays.silent = True
    f.pipeline.backoff = Recorded()  # type: ignore[assignment]
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(2)], received=1_700_000_001.0)
    await settle_all(f.pipeline)
    assert waited == list(range(1, f.pipeline.ctx.replay_config.max_attempts))


async def test_a_replay_that_fails_on_the_socket_counts_as_an_error_and_is_retried(make: Callable[..., Fakes]) -> None:
    f = make({})
    f.replays.error = zmq.ZMQError(zmq.EHOSTUNREACH)
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(2)], received=1_700_000_001.0)
    await settle_all(f.pipeline)
    attempts = f.pipeline.ctx.replay_config.max_attempts
    assert sample(f.metrics, "kv_bridge_replay_requests_total", source="engine", outcome="error") == attempts
    assert [(r.kind, r.seq) for r in f.fanout.records] == [("batch", 0), ("EventsLost", 1), ("batch", 2)]


async def test_event_types_gathered_between_collections_stay_bounded(make: Callable[..., Fakes]) -> None:
    """The event types a stream gathers for the metrics are applied once they pass a bound, live
    or replayed, not only when the registry is collected (memory bound); none is lost."""
    many = {s: batch(STREAM, s, n_events=1000).payload for s in range(20)}
    f = make(dict(many))
    await f.pipeline.start()
    await f.pipeline.on_live([frames(s, many[s]) for s in range(10)], received=1_700_000_001.0)
    assert len(f.pipeline._types) <= 8192
    await f.pipeline.on_live([frames(19, many[19])], received=1_700_000_001.0)  # 10..18 replayed
    await settle_all(f.pipeline)
    assert len(f.pipeline._types) <= 8192
    assert len(f.fanout.records) == 20
    assert sample(f.metrics, "kv_bridge_events_received_total", source="engine", type="BlockStored") == 20 * 999


async def test_live_messages_are_counted_once_across_collections(make: Callable[..., Fakes]) -> None:
    f = make()
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(1)], received=1_700_000_001.0)
    assert sample(f.metrics, "kv_bridge_batches_received_total", source="engine", dp_rank="0") == 2
    await f.pipeline.on_live([frames(2)], received=1_700_000_001.0)
    assert sample(f.metrics, "kv_bridge_batches_received_total", source="engine", dp_rank="0") == 3
    assert sample(f.metrics, "kv_bridge_source_last_seq", source="engine", dp_rank="0") == 2


async def test_what_a_stream_gathered_for_the_metrics_is_counted_when_it_stops(make: Callable[..., Fakes]) -> None:
    """A stream removed (stopped, then dropped) before the next collection: its counts still show."""
    f = make()
    pipeline = StreamPipeline(f.pipeline.ctx, STREAM, replay_endpoint=None, replay_on_start=False, epoch=5)
    await pipeline.start()
    await pipeline.on_live([frames(0), frames(1)], received=1_700_000_001.0)
    await pipeline.stop()
    del pipeline
    gc.collect()
    assert sample(f.metrics, "kv_bridge_batches_received_total", source="engine", dp_rank="0") == 2
    assert sample(f.metrics, "kv_bridge_events_received_total", source="engine", type="BlockRemoved") == 2


async def test_a_heartbeat_past_the_last_batch_fetches_the_tail_by_replay(make: Callable[..., Fakes]) -> None:
    """An idle publisher's heartbeat (an empty payload) carries its next seq: batches below it the
    stream has not seen were dropped at the end of a burst, and are replayed."""
    f = make({2: payload(2), 3: payload(3)})
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(1)], received=1_700_000_001.0)
    await f.pipeline.on_live([[b"kv", (4).to_bytes(8, "big"), b""]], received=1_700_000_002.0)
    await settle_all(f.pipeline)
    assert [(r.kind, r.seq) for r in f.fanout.records] == [("batch", s) for s in range(4)]


@pytest.mark.parametrize("needs_events", [True, False], ids=["decoded", "counted"])
async def test_an_unreadable_batch_has_no_ingest_lag_and_is_announced_lost(
    make: Callable[..., Fakes], needs_events: bool
) -> None:
    """A batch that can be neither decoded nor counted: no engine ts, so no lag observed for it
    (the previous batch's ts is not reused); it is dead-lettered and announced lost."""
    f = make(needs_events=needs_events)
    await f.pipeline.start()
    bad = b"\xc1\xc1 not msgpack"
    assert peek_ts(bad) is None
    await f.pipeline.on_live([frames(0), frames(1, bad)], received=1_700_000_001.0)
    assert sample(f.metrics, "kv_bridge_ingest_lag_seconds_count") == 1
    assert [(r.kind, r.seq) for r in f.fanout.records] == [("batch", 0), ("EventsLost", 1)]


async def test_a_decoded_batch_counts_its_events_and_dead_letters_each_bad_one(make: Callable[..., Fakes]) -> None:
    f = make()
    await f.pipeline.start()
    good = block_stored(1)
    data = msgspec.msgpack.encode([1_700_000_000.5, [good, 5, good], 0])
    await f.pipeline.on_live([frames(0, data)], received=1_700_000_001.0)
    (record,) = f.fanout.records
    assert (record.n_events, record.bad_events) == (2, 1)
    assert sample(f.metrics, "kv_bridge_decode_failures_total", source="engine", reason="bad_event") == 1


async def test_a_run_offered_one_by_one_leaves_the_same_resume_point(make: Callable[..., Fakes]) -> None:
    """A sink without room for a whole run: the records go out one by one, in order, and the resume
    point is the last of them, anchored at its batch."""
    f = make()
    f.fanout.room_for_runs = False
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(1), frames(2), frames(3)], received=1_700_000_001.0)
    assert [r.seq for r in f.fanout.records] == [0, 1, 2, 3]
    ts3 = peek_ts(payload(3))
    assert f.pipeline.resume_point() == ((5, 3, fingerprint(ts3, payload(3)), 3), 3)


async def test_a_quiet_stream_probed_fetches_what_it_has_not_seen(make: Callable[..., Fakes]) -> None:
    """The runtime probes a stream quiet since ``last_activity``: a new stream, a live burst and a
    probe each count as activity (the next probe is a full idle period away)."""
    before = time.monotonic()
    f = make({2: payload(2)})
    assert f.pipeline.last_activity >= before
    await f.pipeline.start()
    f.pipeline.last_activity = 0.0
    await f.pipeline.on_live([frames(0), frames(1)], received=1_700_000_001.0)
    assert f.pipeline.last_activity >= before
    f.pipeline.last_activity = 0.0
    await f.pipeline.probe()
    assert f.pipeline.last_activity >= before
    await settle_all(f.pipeline)
    assert [(r.kind, r.seq) for r in f.fanout.records] == [("batch", 0), ("batch", 1), ("batch", 2)]


async def test_a_stream_whose_source_reads_only_other_topics_is_not_probed(make: Callable[..., Fakes]) -> None:
    """breaker77 B1: the source drops every live message as another topic's (wrong_topic), yet the
    idle probe took them from the replay socket (an older engine's replies carry no topic), and a
    restart then left what was dropped live unannounced. Such a stream is not probed."""
    f = make({1: payload(1)})
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0)], received=1_700_000_001.0)
    await settle_all(f.pipeline)
    f.pipeline.foreign_only = True  # (the engine moved to another topic, say)
    await f.pipeline.probe()
    await settle_all(f.pipeline)
    assert f.replays.requests == [] and [r.seq for r in f.fanout.records] == [0]
    f.pipeline.foreign_only = False  # (its topic came: the source says so)
    await f.pipeline.probe()
    await settle_all(f.pipeline)
    assert [r.seq for r in f.fanout.records] == [0, 1]


def hanging(f: Fakes) -> asyncio.Event:
    """Make every replay request wait for the returned event before it answers."""
    gate = asyncio.Event()
    fetch = f.replays.fetch

    async def held(
        endpoint: str, start: int, until: int, outcome: ReplayOutcome, topic: bytes = b""
    ) -> AsyncGenerator[ReplayReply, None]:
        await gate.wait()
        async for reply in fetch(endpoint, start, until, outcome, topic):
            yield reply

    f.replays.fetch = held  # type: ignore[method-assign]
    return gate


async def test_a_disconnect_cancels_the_probe_asked_of_the_instance_that_went_away(make: Callable[..., Fakes]) -> None:
    f = make({})
    hanging(f)
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(1)], received=1_700_000_001.0)
    await f.pipeline.probe()  # quiet: the tail is asked for
    task = f.pipeline._replay_task
    assert task is not None and not task.done()
    await f.pipeline.disconnected()
    assert f.pipeline.sequencer.in_doubt  # whatever comes next may be another instance
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_disconnect_with_a_gap_open_asks_again_and_that_replay_repairs_it(make: Callable[..., Fakes]) -> None:
    """The replay of a gap asked the instance that went away: it is asked again at once, of whoever
    answers now, and that replay goes on (it is not cancelled with the old one)."""
    f = make({s: payload(s) for s in range(3)})
    gate = hanging(f)
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(2)], received=1_700_000_001.0)
    old = f.pipeline._replay_task
    await f.pipeline.disconnected()
    new = f.pipeline._replay_task
    assert new is not None and new is not old and not new.done()
    gate.set()
    await settle_all(f.pipeline)
    assert old is not None
    with pytest.raises(asyncio.CancelledError):
        await old  # superseded: its replies would be ignored
    assert [(r.kind, r.seq) for r in f.fanout.records] == [("batch", 0), ("batch", 1), ("batch", 2)]
    ts2 = peek_ts(payload(2))
    assert f.pipeline.resume_point() == ((5, 2, fingerprint(ts2, payload(2)), 2), 2)


async def test_a_retired_sequencer_resumes_its_stream_and_repairs_its_gap(make: Callable[..., Fakes]) -> None:
    """A source removed and added again: the new pipeline takes the old one's sequencer (retire),
    so the batches it held behind a gap are delivered once the gap is replayed, in the same epoch."""
    f = make({})
    f.replays.silent = True
    await f.pipeline.start()
    await f.pipeline.on_live([frames(0), frames(2), frames(3)], received=1_700_000_001.0)
    task = f.pipeline._replay_task
    await f.pipeline.stop()
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)
    sequencer = f.pipeline.retire()
    f.replays.silent = False
    f.replays.payloads = {s: payload(s) for s in range(4)}
    again = StreamPipeline(
        f.pipeline.ctx, STREAM, replay_endpoint="tcp://fake:1", replay_on_start=False, epoch=5, sequencer=sequencer
    )
    await again.start()
    await settle_all(again)
    assert [(r.kind, r.epoch, r.seq) for r in f.fanout.records] == [("batch", 5, s) for s in range(4)]


async def test_the_resume_point_before_any_batch_is_the_loss_handed_on(make: Callable[..., Fakes]) -> None:
    """A stream resumed at 3 whose first record is a loss (4..6), its next batch (7) waiting for
    its epoch to be saved: it resumes after the loss, with no batch of its own to anchor at."""
    f = make()
    gate = asyncio.Event()

    async def slow_save() -> None:
        await gate.wait()

    f.epochs.persist = slow_save  # type: ignore[method-assign]
    pipeline = StreamPipeline(f.pipeline.ctx, STREAM, replay_endpoint=None, replay_on_start=False, epoch=5, delivered=3)
    await pipeline.start()
    task = asyncio.create_task(pipeline.on_live([frames(7)], received=1_700_000_001.0))
    await asyncio.sleep(0.01)
    assert [(r.kind, r.from_seq, r.seq) for r in f.fanout.records] == [("EventsLost", 4, 6)]
    assert pipeline.resume_point() == ((5, 6, None, None), 7)
    gate.set()
    await task
    assert [r.seq for r in f.fanout.records] == [6, 7]


async def test_an_undecodable_batch_leaves_an_earlier_ts_to_tell_a_restart_by(make: Callable[..., Fakes]) -> None:
    """Resumed at 7, the start-up replay brings 8 and 9, and 9 cannot be decoded (no ts: its
    fingerprint is only a CRC). The engine restarted: its new instance's first live batches (0..2,
    below 9) carry later ts than 8, the last batch with one: a restart, not old batches again."""
    f = make({})
    old = {s: payload(s) for s in range(9)} | {9: b"\xc1\xc1 not msgpack"}
    f.replays.payloads = old
    pipeline = StreamPipeline(
        f.pipeline.ctx,
        STREAM,
        replay_endpoint="tcp://fake:1",
        replay_on_start=True,
        epoch=5,
        delivered=7,
        delivered_fp=fingerprint(peek_ts(old[7]), old[7]),
    )
    await pipeline.start()
    await settle_all(pipeline)
    f.replays.payloads = {}
    await pipeline.on_live([frames(s, payload(s, instance=1)) for s in range(3)], received=1_800_000_000.0)
    await settle_all(pipeline)
    shown = [(r.kind, r.epoch, r.seq) for r in f.fanout.records]
    assert shown == [("batch", 5, 8), ("EventsLost", 5, 9), ("SourceReset", 6, 0), *(("batch", 6, s) for s in range(3))]


@pytest.mark.parametrize("needs_events", [True, False], ids=["decoded", "counted"])
async def test_batches_carry_the_publisher_uuid_the_stream_is_sure_of(make: Callable[..., Fakes], needs_events: bool) -> None:
    """A publisher that sends its lifetime UUID with each seq: every batch handed on names it (the
    ``instance`` header a pod taking the stream over reads); one that sends none, none."""
    uuid = bytes(range(16))
    f = make(needs_events=needs_events)
    await f.pipeline.start()
    await f.pipeline.on_live([[b"kv", s.to_bytes(8, "big") + uuid, payload(s)] for s in range(3)], received=1_700_000_001.0)
    assert [r.instance for r in f.fanout.records] == [uuid] * 3
    g = make(needs_events=needs_events)
    await g.pipeline.start()
    await g.pipeline.on_live([frames(0), frames(1)], received=1_700_000_001.0)
    assert [r.instance for r in g.fanout.records] == [None, None]


async def test_a_uuid_met_in_doubt_is_named_by_the_batches_the_replay_verified(make: Callable[..., Fakes]) -> None:
    """breaker31h F1 through the pipeline: the connection drops twice, then the new instance's
    live 3..6 come under its UUID (published before the second drop: its epoch opens in doubt)
    and the replay of its 0..2 verifies them. Every batch of the new epoch names the UUID, the
    ``instance`` header a pod resuming from the sinks reads (``checkpoint.from_sinks``), and the
    sequencer is sure of it, which is what the runtime notes in the checkpoint (before: neither,
    and a bridge restarted after its buffer slid opened another epoch for the same instance)."""
    old, new = bytes(range(16)), bytes(range(16, 32))
    f = make({})
    await f.pipeline.start()
    await f.pipeline.on_live([[b"kv", s.to_bytes(8, "big") + old, payload(s)] for s in range(2)], received=1_700_000_001.0)
    await f.pipeline.disconnected()
    await f.pipeline.disconnected()
    f.replays.payloads = {s: payload(s, instance=1) for s in range(7)}
    later = [[b"kv", s.to_bytes(8, "big") + new, payload(s, instance=1)] for s in range(3, 7)]
    await f.pipeline.on_live(later, received=1_700_000_002.0)
    await settle_all(f.pipeline)
    shown = [(r.kind, r.epoch, r.seq, r.instance) for r in f.fanout.records]
    assert shown[:3] == [("batch", 5, 0, old), ("batch", 5, 1, old), ("SourceReset", 6, 0, None)]
    assert shown[3:] == [("batch", 6, s, new) for s in range(7)]
    assert f.pipeline.sequencer.sure_instance == new
    (message,) = Renderer("json", "batch").render(f.fanout.records[-1])
    assert SinkPosition.from_headers(message.headers).instance == new.hex()


@pytest.mark.parametrize(
    ("behind", "before"),
    [
        (0.0, "read"),
        (5.0, "read"),
        (30.0, "read"),
        (30.0, "stepped back"),
        (0.0, "one stamped ahead"),
        (30.0, "none read"),
        (0.0, "stepped back while idle"),
    ],
)
async def test_batches_read_in_doubt_are_judged_on_the_engines_clock_not_the_bridges(
    make: Callable[..., Fakes], monkeypatch: pytest.MonkeyPatch, behind: float, before: str
) -> None:
    """breaker47 B3: the engine host's clock ``behind`` seconds behind the bridge's. A's 0..9 go out;
    the drop is seen; B (the engine restarted) published 0..14 after it, of which the bridge reads
    12..14 in doubt; B crashes before the replay that would verify them is answered, and C's seq 0
    shows a restart. B's batches may not go out in A's epoch (I1): they were published after the
    drop, on the engine's clock. Before, the drop was taken on the bridge's clock: with the engine 5 s
    or 30 s behind, B's 12..14 were taken as published before it, A's, and went out in epoch 5.
    breaker48 B3, where the clock's offset is not known well: A's clock ran 40 s ahead and was
    stepped back 30 s before the drop (an NTP step), one frame out of order stamped an hour ahead
    was read, or no batch of A was read at all (an idle engine); breaker50 B2: A's clock stepped
    back 30 s while it was idle after its last batch (no batch to show it): the drop may be taken
    early on the engine's clock, never late."""
    f = make({})
    hanging(f)  # (the replay socket never answers in time)
    clock = [0.0]
    monkeypatch.setattr("bridge.stream.time.time", lambda: clock[0])
    engine = 1_700_000_000.0  # the engine's clock when A publishes; the bridge's reads engine + behind

    def stamped(seq: int, ts: float) -> list[bytes]:
        return frames(seq, msgspec.msgpack.encode([ts, [block_stored(seq)], 0]))

    clock[0] = engine + behind - 30.0
    await f.pipeline.start()
    if before == "stepped back":  # 30 s before the drop, A's clock ran 40 s ahead of what it reads now
        await f.pipeline.on_live([stamped(n, engine + 10.0 - 1.0 + n * 0.1) for n in range(5)], received=clock[0])
    clock[0] = engine + behind
    if before != "none read":
        first = 5 if before == "stepped back" else 0
        burst = [stamped(n, engine - 1.0 + n * 0.1) for n in range(first, 10)]
        if before == "one stamped ahead":
            burst[-1] = stamped(9, engine + 3600.0)  # (a clock glitch, or a corrupt ts)
        await f.pipeline.on_live(burst, received=clock[0])
    if before == "stepped back while idle":  # idle 40 s after its batches, meanwhile its clock stepped back 30 s
        behind, engine = behind + 30.0, engine + 10.0
    clock[0] = engine + behind + 2.0
    await f.pipeline.disconnected()  # noticed 2 s after A's last batch
    clock[0] = engine + behind + 3.0  # B up 1 s later: 0..11 published while the bridge reconnected
    await f.pipeline.on_live([stamped(n, engine + 3.0 + n * 0.1) for n in (12, 13, 14)], received=clock[0])
    clock[0] = engine + behind + 6.0
    await f.pipeline.disconnected()
    clock[0] = engine + behind + 7.0
    await f.pipeline.on_live([stamped(0, engine + 7.0)], received=clock[0])
    batches = [(r.epoch, r.seq) for r in f.fanout.records if r.kind == "batch"]
    assert not [b for b in batches if b[0] == 5 and b[1] >= 12], batches
    if before != "none read":
        assert batches[:10] == [(5, n) for n in range(10)]
        lost = [(r.epoch, r.from_seq, r.lost_to) for r in f.fanout.records if r.kind == "EventsLost"]
        assert (5, 10, 14) in lost, lost


async def test_replay_skips_replies_under_another_topic_than_the_sources() -> None:
    """breaker77 B1: with a source topic the engine does not publish under, its live messages are
    dropped as another topic's (not connected, ``wrong_topic``), yet the idle probe's replay
    delivered them, and a restart then left the seqs dropped live unannounced. A reply whose topic
    frame is not the source's is skipped (counted); one without a topic frame cannot tell.
    breaker83 B1: an answer that skipped a reply (that, or one it cannot parse) is not complete at
    its end marker: a batch the stream needs may have been among them, and "not there" reads as a
    new instance (false restarts, seqs that reached the bridge announced lost)."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://replay-topics")

    async def answer() -> None:
        while True:
            ident, _, _start = await router.recv_multipart()
            for topic, seq in ((b"kv-events", 0), (b"other", 1), (None, 2), (b"kv-events", 3)):
                head = [b""] if topic is None else [b"", topic]
                extra = [b"?"] if seq == 3 else []  # (a frame more than the protocol has: unreadable)
                await router.send_multipart([ident, *head, seq.to_bytes(8, "big"), payload(seq), *extra])
            await router.send_multipart([ident, b"", b"kv-events", (2**64 - 1).to_bytes(8, "big"), b""])

    server = asyncio.create_task(answer())
    try:
        for topic, seqs, foreign in ((b"kv", [0, 2], 1), (b"", [0, 1, 2], 0)):
            outcome = ReplayOutcome()
            got = [r.seq async for r in replay(ctx, "inproc://replay-topics", 0, -1, 2.0, outcome, 1 << 20, topic=topic)]
            assert (got, outcome.foreign, outcome.bad_replies, outcome.complete) == (seqs, foreign, 1, False)
            outcome = ReplayOutcome()
            got = [r.seq async for r in replay(ctx, "inproc://replay-topics", 0, 2, 2.0, outcome, 1 << 20, topic=topic)]
            assert (got[-1], outcome.complete) == (2, not foreign)  # (the last one needed came, after a skipped one)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        ctx.destroy(linger=0)
