"""Engine snapshots in the sequencer model: snapshots asked for and served at any step.

The sequencer model's engine (tests/unit/test_sequencer_model.py: drops, restarts, sliding
buffers, replays half answered or silent, dropped connections, the source removed and added
back) now also keeps a true cache: batch ``s`` of instance ``i`` stores a copy of block
``(i, s % 2)`` and removes the copy batch ``s - 3`` stored (counts of 1 and 2). The bridge side
runs every record through the stream's :class:`~bridge.snapshot.StreamSnapshots` and a
:class:`~bridge.state.StateTracker`, as the pipeline and the fan-out do: a state left incomplete
(a head joined late, an ``EventsLost``) asks for a snapshot. The engine serves each one at any
later step, whichever instance runs then (also during a gap, and after a restart), or refuses it.

After every step, I1-I4 hold (the base model's checks, and its quiet phase at the end), and a
state the tracker marks complete equals the cache of its epoch's instance at the head's seq: a
snapshot never seeds one instance's cache into another's epoch, nor a cache at another seq.
With the publisher UUID on the wire (UuidSnapshotModel) the snapshot carries it too.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from bridge.records import Event, Record, Stream, events_lost, source_reset
from bridge.sequencer import Action, Deliver, Lost, Reset
from bridge.simulator import PROFILES, encode_batch
from bridge.snapshot import Snapshot, SnapshotRefused, StreamSnapshots
from bridge.state import StateTracker, block_id
from tests.unit.test_sequencer_model import SequencerModel, UuidReplayModel, parse

STREAM = Stream("m", 0)
PROFILE = PROFILES["vllm-0.33.0"]


def block(instance: int, n: int) -> int:
    return instance * 10 + n


def events_of(instance: int, seq: int) -> list[Event]:
    out: list[Event] = [{"type": "BlockStored", "block_hashes": [block(instance, seq % 2)], "medium": "GPU", "group_idx": 0}]
    if seq >= 3:
        out.append({"type": "BlockRemoved", "block_hashes": [block(instance, (seq - 3) % 2)], "medium": "GPU", "group_idx": 0})
    return out


def cache_at(instance: int, seq: int) -> Counter[int]:
    """The instance's true cache after its batch ``seq`` (-1: before any)."""
    cache: Counter[int] = Counter()
    for s in range(seq + 1):
        for ev in events_of(instance, s):
            h = ev["block_hashes"][0]
            cache[h] += 1 if ev["type"] == "BlockStored" else -1
    return +cache


class FakeClient:
    """What the engine answers the next snapshot request with (set by the serve rule)."""

    max_bytes = 1 << 30

    def __init__(self) -> None:
        self.answer: Snapshot | SnapshotRefused | None = None

    async def take(self, endpoint: str, design: str) -> Snapshot:
        answer = self.answer
        assert answer is not None
        if isinstance(answer, SnapshotRefused):
            raise answer
        return answer


class SnapshotModel(SequencerModel):
    def __init__(self) -> None:
        self.tracker = StateTracker()
        self.client = FakeClient()
        self.requests: list[Coroutine[Any, Any, None]] = []
        self.outcomes: Counter[str] = Counter()
        self.seeded_at: list[tuple[int, int]] = []  # (epoch, seq) of each batch that carried a seed
        self.snaps = StreamSnapshots(
            STREAM,
            "tcp://engine:5559",
            "vllm-57789",
            self.client,  # type: ignore[arg-type]
            self.tracker,
            lambda outcome: self.outcomes.update([outcome]),
            self._spawn,
            lambda: (self.seqr.epoch, self.seqr.instance, self.seqr.in_doubt),
            0.0,
        )
        super().__init__()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        self.requests.append(coro)
        return None  # type: ignore[return-value]  # (never awaited: the serve rule runs it)

    def teardown(self) -> None:
        super().teardown()
        for coro in self.requests:
            coro.close()

    # -- the pipeline and the fan-out ---------------------------------------------------------------
    def apply(self, actions: list[Action]) -> None:
        super().apply(actions)
        for a in actions:
            if isinstance(a, Deliver):
                instance, seq = parse(a.payload)
                record = Record(STREAM, a.epoch, a.seq, events=events_of(instance, seq))
            elif isinstance(a, Lost):
                record = events_lost(STREAM, a.epoch, a.from_seq, a.to_seq, a.reason, 0.0)
            elif isinstance(a, Reset):
                record = source_reset(STREAM, a.epoch, a.reason, 0.0)
            else:
                continue
            self.snaps.before(record)
            if record.seed is not None:
                self.seeded_at.append((record.epoch, record.seq))
            self.tracker.apply(record)
            self.snaps.after(record)

    def disconnect(self) -> None:
        self.snaps.disconnected()

    # The base model's steps that drop the live connection tell the snapshots too.
    @precondition(lambda self: not self.forged_waits())
    @rule(missed=st.integers(0, 3), late=st.integers(0, 2))
    def restart(self, missed: int, late: int) -> None:
        self.disconnect()
        super().restart(missed, late)

    @precondition(lambda self: not self.forged_waits())
    @rule()
    def blip(self) -> None:
        self.disconnect()
        super().blip()

    @precondition(lambda self: not self.forged_waits() and self.seqr._newcomer is None)  # (the base model's limit)
    @rule()
    def removed(self) -> None:
        self.disconnect()
        super().removed()

    @initialize(n=st.integers(0, 14))
    def published_before(self, n: int) -> None:
        """The engine published ``n`` batches before the bridge subscribed: past its buffer (8),
        the bridge meets it mid-epoch (its head joined late: incomplete)."""
        for _ in range(n):
            self.engine.publish()

    # -- the engine serves a snapshot -----------------------------------------------------------------
    def snapshot_uuid(self, instance: int) -> bytes | None:
        return None

    @precondition(lambda self: bool(self.requests))
    @rule(refuse=st.sampled_from([False, False, False, True]))
    def serve_snapshot(self, refuse: bool) -> None:
        """The request in flight is answered by the instance running now, with its cache at its last seq."""
        instance = self.engine.instance
        cut = self.engine.published.get(instance, 0) - 1
        if refuse:
            self.client.answer = SnapshotRefused("unavailable", "the engine has none now")
        else:
            events = [
                {"type": "BlockStored", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
                for h, n in cache_at(instance, cut).items()
                for _ in range(n)
            ]
            payloads = [encode_batch(PROFILE, 1.0, events)] if events else []
            self.client.answer = Snapshot("vllm-57789", cut, payloads, instance=self.snapshot_uuid(instance))
        coro = self.requests.pop()  # (the latest: the earlier ones' seedings were given up)
        for stale in self.requests:
            stale.close()
        self.requests.clear()
        try:
            coro.send(None)
        except StopIteration:
            pass
        else:  # pragma: no cover - the fake client never suspends
            raise AssertionError("a snapshot request suspended")

    # (Drawn as often as the steps that drop the connection, which give up a seeding without a UUID.)
    @precondition(lambda self: bool(self.requests))
    @rule()
    def serve_snapshot_again(self) -> None:
        self.serve_snapshot(refuse=False)

    @precondition(lambda self: bool(self.requests))
    @rule(n=st.integers(1, 3))
    def serve_snapshot_and_catch_up(self, n: int) -> None:
        """The snapshot is answered, then the engine publishes ``n`` batches the bridge reads, and
        every replay is answered: the seed goes out unless something else intervened."""
        self.serve_snapshot(refuse=False)
        for _ in range(n):
            self.publish(seen=True)
            while self.pending:
                self.serve("answer")

    @rule(n=st.integers(1, 3))
    def publish_seen(self, n: int) -> None:
        for _ in range(n):
            self.publish(seen=True)

    # -- the state ------------------------------------------------------------------------------------
    @invariant()
    def a_complete_state_is_the_engines_cache(self) -> None:
        head = self.tracker.head(STREAM)
        if head is None or not head.complete:
            return
        instance = self.down.instance_of.get(head.epoch)
        if instance is None:
            assert head.seq == -1 and head.live == 0, head
            return
        got = Counter({k: c for _m, _g, k, c, _v in self.tracker.entries(STREAM)})
        want = Counter({block_id(h): n for h, n in cache_at(instance, head.seq).items()})
        assert got == want, f"epoch {head.epoch} (instance {instance}) at seq {head.seq}: {got} != {want}"


# Longer runs than the base model's: a seed needs a request, its answer, and a batch above the cut.
SnapshotModel.TestCase.settings = settings(SequencerModel.TestCase.settings, stateful_step_count=80)
TestSnapshotModel = SnapshotModel.TestCase


class UuidSnapshotModel(SnapshotModel):
    """The same with a publisher UUID on live messages and replay replies (vLLM #57789), which the
    snapshot carries too: a snapshot certain to be the epoch's instance's survives a dropped
    connection; another instance's is refused."""

    uuid_of = UuidReplayModel.uuid_of
    reply_uuid = UuidReplayModel.reply_uuid

    def snapshot_uuid(self, instance: int) -> bytes | None:
        return instance.to_bytes(16, "big") if instance > 0 else None


UuidSnapshotModel.TestCase.settings = SnapshotModel.TestCase.settings
TestUuidSnapshotModel = UuidSnapshotModel.TestCase


def test_a_stream_joined_late_is_seeded_and_complete() -> None:
    """Not vacuous: a scripted run in which a snapshot seeds the state (during a gap, live
    batches published while it was read) and the state is then the engine's cache."""
    m = SnapshotModel()
    for _ in range(12):  # the buffer (8) no longer holds seq 0
        m.engine.publish()
    while m.pending:
        m.answer_replay("answer")
    m.a_complete_state_is_the_engines_cache()
    head = m.tracker.head(STREAM)
    assert head is not None and not head.complete  # joined late
    assert m.requests  # asked for a snapshot
    m.publish(seen=True)
    m.serve_snapshot(refuse=False)
    m.publish(seen=False)  # a gap opens: the seed waits for a batch above the cut
    m.publish(seen=True)
    while m.pending:
        m.answer_replay("answer")
    head = m.tracker.head(STREAM)
    assert head is not None and head.complete and m.seeded_at, (head, m.outcomes)
    m.a_complete_state_is_the_engines_cache()
    m.teardown()


def test_a_snapshot_answered_by_the_next_instance_is_never_seeded_into_the_old_epoch() -> None:
    """Across a restart: the request reached the old instance, the new one answers (its cache, its
    seqs). Without a UUID to tell whose it is, the dropped connection refuses it; the old epoch
    stays incomplete, the new one is complete from its own start, and I1-I4 hold."""
    m = SnapshotModel()
    for _ in range(12):
        m.engine.publish()
    while m.pending:
        m.answer_replay("answer")
    assert m.requests
    old = m.seqr.epoch
    m.restart(missed=0, late=0)
    m.engine.publish()  # the new instance's first batch, before it answers
    m.serve_snapshot(refuse=False)
    assert m.outcomes["other_instance"] == 1 and not m.seeded_at
    m.publish(seen=True)
    while m.pending:
        m.answer_replay("answer")
    m.a_complete_state_is_the_engines_cache()
    head = m.tracker.head(STREAM)
    assert head is not None and head.epoch > old and head.complete
    m.teardown()


def test_with_the_publishers_uuid_a_snapshot_survives_a_dropped_connection() -> None:
    """The same UUID on the snapshot as on the live stream: a blip while it is read does not
    refuse it (the instance is certain), and the seed makes the state complete."""
    m = UuidSnapshotModel()
    m.restart(missed=0, late=0)  # instance 1: it sends a UUID
    for _ in range(3):
        m.publish(seen=True)
        while m.pending:
            m.answer_replay("answer")
    m.slide(12)  # a burst the bridge misses, past the engine's buffer (8): EventsLost
    for _ in range(2):
        m.publish(seen=True)
        while m.pending:
            m.answer_replay("answer")
    assert m.requests, m.outcomes
    m.serve_snapshot(refuse=False)
    m.blip()
    m.publish(seen=True)
    while m.pending:
        m.answer_replay("answer")
    head = m.tracker.head(STREAM)
    assert head is not None and head.complete and m.seeded_at, (head, m.outcomes)
    m.a_complete_state_is_the_engines_cache()
    m.teardown()
