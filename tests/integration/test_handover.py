"""Handover without a shared volume (``checkpoint.from_sinks``), on the real brokers.

A bridge delivers part of an engine's streams to one sink and goes away: stopped, or killed
(SIGKILL, in a process of its own, while the engine publishes). A new bridge with no checkpoint
file and the switch on takes the streams over. Read back from the sink, every (epoch, seq, index)
is there exactly once, all in the epoch the first bridge opened, with no SourceReset; when the
engine restarted meanwhile (and counted on past the old seqs, so only the fingerprint of the last
batch the sink holds shows it), the new instance is in a new epoch opened by a SourceReset.

Each sink in another shape: Redis json/event (a batch may be held in part), NATS JetStream
msgpack/batch, Kafka raw/batch (the fingerprint holds the payload's CRC; two streams share one
partition, read backward to find each).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import TopicPartition

from bridge.checkpoint import SinkPosition
from bridge.config import from_data
from bridge.connector import Registry
from bridge.formats import Message
from bridge.records import Stream
from bridge.runtime import Bridge
from bridge.simulator import Faults, Simulator, SimulatorOptions
from tests.infra.servers import RedisServer
from tests.integration.conftest import own_server
from tests.support.harness import free_ports, wait_for
from tests.support.memory import MemoryConnector
from tests.support.process import BridgeProcess, bridge_config
from tests.support.readback import Readback, read_jetstream, read_kafka, read_redis
from tests.support.state_kafka import delete_records

pytestmark = pytest.mark.integration

RANKS = 2
EVENTS = 3
SOURCE = "eng"
Rows = list[tuple[int, int, int, int, str]]


class Sink:
    """One sink under test: its config and how to read it back."""

    def __init__(self, kind: str, config: dict[str, Any], read: Callable[[], Any], granularity: str) -> None:
        self.kind = kind
        self.config = config
        self.read = read
        self.granularity = granularity
        # Whether its last message ends a whole batch: Redis stores a batch's entries all or none.
        self.whole = granularity == "batch" or kind == "redis"


@pytest.fixture(params=["redis", "nats", "kafka"])
async def sink(request: pytest.FixtureRequest) -> Sink:
    uid = uuid.uuid4().hex[:8]
    kind = request.param
    retry = {"initial_backoff": "20ms", "max_backoff": "200ms", "write_timeout": "10s"}
    base = {"type": kind, "name": kind, "batch": {"linger": 0}, "retry": retry}
    if kind == "redis":
        server = request.getfixturevalue("fresh_redis")
        template = f"h{uid}:{{source}}:{{dp_rank}}"
        keys = [f"h{uid}:{SOURCE}:{r}" for r in range(RANKS)]
        cfg = {**base, "format": "json", "granularity": "event", "url": server.url, "stream": template}
        return Sink(kind, cfg, lambda: read_redis(server.url, keys), "event")
    if kind == "nats":
        server = request.getfixturevalue("nats_server")
        name = f"H{uid}"
        options = {"servers": server.url, "subject": f"h{uid}.{{source}}.{{dp_rank}}", "stream": {"create": True, "name": name}}
        cfg = {**base, "format": "msgpack", "granularity": "batch", **options}
        return Sink(kind, cfg, lambda: read_jetstream(server.url, name), "batch")
    server = request.getfixturevalue("kafka")
    topic = await server.anew_topic(1)  # both ranks in one partition
    cfg = {**base, "format": "raw", "bootstrap_servers": server.bootstrap_servers, "topic": topic}
    return Sink(kind, cfg, lambda: read_kafka(server.bootstrap_servers, topic, 1), "batch")


@contextlib.asynccontextmanager
async def engine(profile: str | None = None, replay: bool = True) -> AsyncIterator[tuple[Simulator, dict[str, Any]]]:
    """A simulated engine of ``RANKS`` ranks (``profile``: the simulator's, default its own;
    ``replay``: with a replay endpoint) and the bridge's source for it."""
    live, ports = free_ports(RANKS), free_ports(RANKS)
    opts = SimulatorOptions(
        endpoint=f"tcp://127.0.0.1:{live[0]}",
        replay_endpoint=f"tcp://127.0.0.1:{ports[0]}" if replay else None,
        dp_ranks=RANKS,
        rate=0,
        events_per_batch=EVENTS,
        **({"profile": profile} if profile else {}),
    )
    source = {"name": SOURCE, "endpoint": opts.endpoint, "dp_ranks": RANKS}
    if replay:
        source["replay_endpoint"] = opts.replay_endpoint
    async with Simulator(opts) as sim:
        yield sim, source


def config(tmp: Path, source: dict[str, Any], sink: Sink, *, from_sinks: bool, local: bool = False) -> dict[str, Any]:
    return bridge_config(
        tmp,
        [source],
        [sink.config],
        metrics={"listen": ""},
        checkpoint={"from_sinks": from_sinks, "from_sinks_timeout": "20s", "path": str(tmp / "ck.json") if local else None},
        replay={"timeout": "500ms", "initial_backoff": "50ms", "max_backoff": "500ms"},
        shutdown_timeout="10s",
    )


async def publish(sim: Simulator, n: int) -> None:
    for _ in range(n):
        for r in range(RANKS):
            await sim.step(r)


def epochs(bridge: Bridge) -> list[int]:
    """The epoch of each rank's stream in ``bridge``."""
    return [bridge.pipelines[f"{SOURCE}/{r}"].sequencer.epoch for r in range(RANKS)]


async def delivered_through(bridge: Bridge, sim: Simulator) -> None:
    """Until the bridge has handed every published batch on and every sink took it."""

    def caught_up() -> bool:
        for r, rank in enumerate(sim.ranks):
            p = bridge.pipelines.get(f"{SOURCE}/{r}")
            if p is None or p.sequencer.delivered != rank.seq - 1:
                return False
        return True

    # Traffic goes on meanwhile: a live batch is how a stream notices what it has not seen yet
    # (a restarted engine's batches published before the bridge subscribed).
    deadline = time.monotonic() + 30
    while not caught_up():
        state = {k: (p.sequencer.epoch, p.sequencer.delivered) for k, p in bridge.pipelines.items()}
        assert time.monotonic() < deadline, (
            f"not every published batch delivered: {state}, published {[r.seq for r in sim.ranks]}"
        )
        await publish(sim, 1)
        for _ in range(10):
            if caught_up():
                break
            await asyncio.sleep(0.05)
    for w in bridge.workers:
        assert await w.flush(20), f"sink {w.name} not flushed"


async def subscribed(bridge: Bridge) -> None:
    """Until every rank's SUB is connected (an engine without replay: what it publishes before
    is lost for good), and a moment for the subscription to reach the publisher."""
    await wait_for(lambda: all(bridge.readers[f"{SOURCE}/{r}"].connections > 0 for r in range(RANKS)), what="subscriptions")
    await asyncio.sleep(0.3)


def data(rows: Rows, rank: int) -> list[tuple[int, int, int]]:
    return [(e, s, i) for r, e, s, i, t in rows if r == rank and t not in ("SourceReset", "EventsLost")]


def control(rows: Rows, rank: int, kind: str) -> list[int]:
    return [e for r, e, _s, _i, t in rows if r == rank and t == kind]


def expect(epoch: int, seqs: range, granularity: str) -> list[tuple[int, int, int]]:
    indexes = range(EVENTS) if granularity == "event" else [-1]
    return [(epoch, s, i) for s in seqs for i in indexes]


async def read(sink: Sink) -> Rows:
    back: Readback = await sink.read()
    return back.rows


@pytest.mark.parametrize("stop", ["stopped", "killed"])
async def test_a_new_bridge_resumes_from_the_sink_exactly_once(tmp_path: Path, sink: Sink, stop: str) -> None:
    async with engine() as (sim, source):
        await publish(sim, 15)
        if stop == "stopped":
            first = Bridge(from_data(config(tmp_path, source, sink, from_sinks=True), env={}))
            await first.start()
            await publish(sim, 25)
            await delivered_through(first, sim)
            await first.stop()
        else:
            # Killed mid-traffic: whatever reached the sink, maybe half a batch's events.
            proc = BridgeProcess(tmp_path, {**config(tmp_path, source, sink, from_sinks=False), "metrics": {"listen": ""}})
            proc.start()
            try:
                stored = 0
                deadline = time.monotonic() + 30
                while stored < 20 * RANKS:
                    assert proc.alive(), proc.log()[-3000:]
                    assert time.monotonic() < deadline, "the first bridge delivered too little"
                    await publish(sim, 2)
                    await asyncio.sleep(0.02)
                    with contextlib.suppress(Exception):
                        stored = len({(r, s) for r, _e, s, _i, _t in await read(sink)})
            finally:
                proc.kill()
        held = await read(sink)
        opened: dict[int, int] = {}  # each stream's one epoch (the clock's when the stream was met)
        for r in range(RANKS):
            (opened[r],) = {e for rr, e, _s, _i, t in held if rr == r and t not in ("SourceReset", "EventsLost")}
        await publish(sim, 10)  # while no bridge runs: the replay buffer keeps it
        second = Bridge(from_data(config(tmp_path, source, sink, from_sinks=True), env={}))
        await second.start()
        try:
            for r in range(RANKS):
                # Resumed where the sink's last batch is (its first seq not there, for the
                # epoch's ids could hide copies in Redis and NATS), not afresh from seq 0.
                last = max(s for rr, _e, s, _i, t in held if rr == r and t not in ("SourceReset", "EventsLost"))
                resumed = second.pipelines[f"{SOURCE}/{r}"]._resumed_from
                assert resumed is not None and resumed[0] == opened[r], resumed
                assert resumed[1] == (last if sink.whole else last - 1), (resumed, last)
            await publish(sim, 5)
            await delivered_through(second, sim)
        finally:
            await second.stop()
        rows = await read(sink)
        for r, rank in enumerate(sim.ranks):
            got = data(rows, r)
            want = expect(opened[r], range(rank.seq), sink.granularity)
            assert len(got) == len(set(got)), f"rank {r}: {len(got) - len(set(got))} duplicates"
            assert got == want, f"rank {r}: missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}"
            assert control(rows, r, "SourceReset") == []
            assert control(rows, r, "EventsLost") == []
        skipped = sum(s.skipped for s in second.skips)
        if stop == "stopped":
            # Right after what the sink holds; at event granularity the last batch again (but on
            # Redis, the sink cannot tell it has all its events), whose events it has are left out.
            assert skipped == (0 if sink.whole else EVENTS * RANKS)


async def delete_events(sink: Sink, how: str) -> None:
    """Delete what the sink holds of the streams' events, as retention or an operator does:
    Kafka: DeleteRecords of the whole partition (its start goes above offset 0); Redis: DEL of the
    stream keys (the state hashes stay), or XTRIM of every entry (the keys stay, empty)."""
    if sink.kind == "kafka":
        await delete_records(sink.config["bootstrap_servers"], TopicPartition(sink.config["topic"], 0))
        return
    client = aioredis.Redis.from_url(sink.config["url"])
    try:
        for r in range(RANKS):
            key = sink.config["stream"].format(source=SOURCE, dp_rank=r)
            if how == "del":
                assert await client.delete(key) == 1
                assert await client.exists(key + ":state") == 1
            else:
                await client.xtrim(key, maxlen=0, approximate=False)
                assert await client.xlen(key) == 0 and await client.exists(key) == 1
    finally:
        await client.aclose()


@pytest.mark.parametrize(("sink", "how"), [("kafka", "delete"), ("redis", "del"), ("redis", "trim")], indirect=["sink"])
async def test_a_pod_that_finds_the_events_deleted_announces_its_fresh_epoch(tmp_path: Path, sink: Sink, how: str) -> None:
    """The first pod delivers and stops; the stream's events are then deleted while no bridge
    runs (Kafka: retention or DeleteRecords; Redis: the stream key deleted, its state hash kept,
    or its entries trimmed). The sink cannot tell where the stream stands: a new pod with no
    checkpoint file starts it afresh, in a new epoch opened by a SourceReset, before the engine's
    buffer goes out again under it. Without it (breaker31k Break 3) the sink's "holds nothing"
    let the pod write seqs 0.. again under a new epoch with no SourceReset and nothing logged,
    though the engine never restarted: a consumer took that for a complete fresh start."""
    if how == "del":
        sink.config = {**sink.config, "state": {"enabled": True, "key": sink.config["stream"] + ":state"}}
    async with engine() as (sim, source):
        first = Bridge(from_data(config(tmp_path, source, sink, from_sinks=True), env={}))
        await first.start()
        await publish(sim, 15)
        await delivered_through(first, sim)
        await first.stop()
        old = epochs(first)
        await delete_events(sink, how)
        assert await read(sink) == []
        second = Bridge(from_data(config(tmp_path, source, sink, from_sinks=True), env={}))
        await second.start()
        try:
            await publish(sim, 5)
            await delivered_through(second, sim)
            new = epochs(second)
        finally:
            await second.stop()
    rows = await read(sink)
    for r, rank in enumerate(sim.ranks):
        mine = [(e, t) for rr, e, _s, _i, t in rows if rr == r]
        assert new[r] > old[r] and mine[0] == (new[r], "SourceReset"), (r, old, new, mine[:3])
        assert control(rows, r, "SourceReset") == [new[r]] and control(rows, r, "EventsLost") == []
        assert data(rows, r) == expect(new[r], range(rank.seq), sink.granularity), f"rank {r}"


@pytest.mark.parametrize(("local", "after"), [(False, 30), (False, 5), (True, 30), (True, 5)])
async def test_an_engine_restart_meanwhile_opens_a_new_epoch(tmp_path: Path, sink: Sink, local: bool, after: int) -> None:
    """``after``: batches the restarted engine publishes before the next bridge starts (30: its
    seq counts on past the old one's; 5: it stays below). ``local``: the same with the checkpoint
    file instead of the sinks (the reference behaviour)."""
    async with engine() as (sim, source):
        first = Bridge(from_data(config(tmp_path, source, sink, from_sinks=True, local=local), env={}))
        await first.start()
        await publish(sim, 20)
        await delivered_through(first, sim)
        await first.stop()
        old = epochs(first)
        before = [rank.seq for rank in sim.ranks]
        # Restarted, and counted on past seq 19 before the next bridge looks: only the fingerprint
        # (ts, and the CRC for raw) of the last batch the sink holds tells the instances apart.
        for rank in sim.ranks:
            rank.restart()
        await asyncio.sleep(0.01)  # a later engine clock
        await publish(sim, after)
        second = Bridge(from_data(config(tmp_path, source, sink, from_sinks=not local, local=local), env={}))
        await second.start()
        try:
            await publish(sim, 5)
            await delivered_through(second, sim)
            news = epochs(second)
        finally:
            await second.stop()
        rows = await read(sink)
        for r in range(RANKS):
            got, epoch, new = data(rows, r), old[r], news[r]
            assert new > epoch
            assert len(got) == len(set(got)), f"rank {r}: duplicates"
            assert [x for x in got if x[0] == epoch] == expect(epoch, range(before[r]), sink.granularity)
            assert [x for x in got if x[0] not in (epoch, new)] == []
            assert [x for x in got if x[0] == new] == expect(new, range(sim.ranks[r].seq), sink.granularity)
            # What replay cannot prove the old instance's (at event granularity the last batch
            # the sink holds, maybe in part) is announced lost in the old epoch, never delivered
            # under the new one (I1), and before the SourceReset (I3).
            lost_at = [i for i, row in enumerate(rows) if row[0] == r and row[4] == "EventsLost"]
            assert all(rows[i][1] == epoch for i in lost_at), "losses belong to the old epoch"
            resets = [(e, s, i) for rr, e, s, i, t in rows if rr == r and t == "SourceReset"]
            assert [e for e, *_ in resets] == [new], resets
            position = next(i for i, row in enumerate(rows) if row[0] == r and row[4] == "SourceReset")
            assert all(row[1] == epoch for row in rows[:position] if row[0] == r), "the SourceReset precedes the new epoch"
            assert all(i < position for i in lost_at), "losses announced before the SourceReset"


async def test_a_pod_without_any_position_never_reuses_the_previous_pods_epoch(tmp_path: Path, sink: Sink) -> None:
    """Issue 29 case 12: a pod with no checkpoint and no ``from_sinks`` meets an engine that
    restarted since the previous pod's last epoch opened, within the same minute. It opens an
    epoch of its own (the clock's, in microseconds), so no sink and no consumer takes the new
    instance's batches for copies of the old one's (with minute epochs, 100 of 100 were lost)."""
    async with engine() as (sim, source):
        first = Bridge(from_data(config(tmp_path, source, sink, from_sinks=False), env={}))
        await first.start()
        await publish(sim, 20)
        await delivered_through(first, sim)
        await first.stop()
        old = epochs(first)
        before = [rank.seq for rank in sim.ranks]
        for rank in sim.ranks:
            rank.restart()
        await publish(sim, 10)  # below the old instance's seqs: the same (epoch, seq) positions
        second = Bridge(from_data(config(tmp_path, source, sink, from_sinks=False), env={}))
        await second.start()
        try:
            await publish(sim, 5)
            await delivered_through(second, sim)
            new = epochs(second)
        finally:
            await second.stop()
        rows = await read(sink)
        for r in range(RANKS):
            got = data(rows, r)
            assert new[r] > old[r] and {x[0] for x in got} == {old[r], new[r]}, (r, old, new)
            assert [x for x in got if x[0] == old[r]] == expect(old[r], range(before[r]), sink.granularity)
            assert [x for x in got if x[0] == new[r]] == expect(new[r], range(sim.ranks[r].seq), sink.granularity), f"rank {r}"


async def test_a_restart_meanwhile_is_certain_from_the_uuid_the_sink_holds(tmp_path: Path, sink: Sink) -> None:
    """vLLM #57789 and no replay endpoint (KAITO's default): the first pod writes each batch with
    its publisher UUID (the ``instance`` header) and goes away; the engine restarts and counts on
    past the old seqs; a pod without a checkpoint takes over from the sinks. The UUID the sink
    holds says the new instance is another: a new epoch opened by a SourceReset
    (``instance_changed``), the new instance's unseen 0..29 announced lost in it. (Without the
    header, seq 30 follows the old 19 with nothing to tell: the new instance went into the old
    epoch, I1.)"""
    async with engine("vllm-pr57789-uuid", replay=False) as (sim, source):
        first = Bridge(from_data(config(tmp_path, source, sink, from_sinks=True), env={}))
        await first.start()
        await subscribed(first)
        await publish(sim, 20)
        await delivered_through(first, sim)
        await first.stop()
        old = epochs(first)
        before = [rank.seq for rank in sim.ranks]
        for rank in sim.ranks:
            rank.restart()
        await publish(sim, 30)  # while no bridge runs, and no replay to get it back
        second = Bridge(from_data(config(tmp_path, source, sink, from_sinks=True), env={}))
        await second.start()
        try:
            await subscribed(second)
            await publish(sim, 5)
            await delivered_through(second, sim)
            new = epochs(second)
        finally:
            await second.stop()
        back: Readback = await sink.read()
        for r in range(RANKS):
            got = data(back.rows, r)
            assert new[r] > old[r], (r, old, new)
            assert [x for x in got if x[0] == old[r]] == expect(old[r], range(before[r]), sink.granularity)
            assert [x for x in got if x[0] == new[r]] == expect(new[r], range(30, sim.ranks[r].seq), sink.granularity)
            assert [(e, why) for rr, e, why in back.resets if rr == r] == [(new[r], "instance_changed")]
            # At event granularity the sink cannot tell it holds every event of its last batch (but
            # on Redis): that one is announced lost in the old epoch (docs/concepts/limits.md).
            tail = [] if sink.whole else [(before[r] - 1, before[r] - 1, "instance_changed")]
            assert [(f, t, why) for rr, f, t, why in back.lost if rr == r] == [*tail, (0, 29, "no_replay")]


@pytest.mark.parametrize("shown_by", ["replay", "heartbeat"])
async def test_two_pods_number_a_restart_alike_when_no_live_batch_shows_it(
    tmp_path: Path, fresh_redis: Any, shown_by: str
) -> None:
    """A rolling update: two pods read one engine that sends its publisher UUID. It restarts, and
    no live batch of the new instance reaches them: its first batches are kept off PUB and the
    idle probe's replay brings them (``replay``), or it stays quiet and only its idle heartbeat
    shows it (``heartbeat``). Both pods must open the same epoch for it, or the one left after
    the update writes below the other's epoch and Redis refuses everything it writes (before:
    each pod's own clock in microseconds, 7 of 7 runs apart, 12-18 batches dead-lettered and
    nothing announced)."""
    uid = uuid.uuid4().hex[:8]
    sink = Sink(
        "redis",
        {
            "type": "redis",
            "name": "redis",
            "batch": {"linger": 0},
            "format": "json",
            "granularity": "batch",
            "url": fresh_redis.url,
            "stream": f"p{uid}:{{source}}:{{dp_rank}}",
        },
        lambda: None,
        "batch",
    )
    async with engine("vllm-pr57789-uuid") as (sim, source):
        cfg = config(tmp_path, source, sink, from_sinks=True)
        cfg["replay"]["idle_probe"] = "300ms"
        pods = [Bridge(from_data(cfg, env={})), Bridge(from_data(cfg, env={}))]
        try:
            await pods[0].start()
            await subscribed(pods[0])
            await publish(sim, 5)
            await delivered_through(pods[0], sim)
            await pods[1].start()
            await subscribed(pods[1])
            await publish(sim, 5)
            for pod in pods:
                await delivered_through(pod, sim)
            old = epochs(pods[0])
            if time.time() % 60 > 50:  # (a restart seen either side of a minute's turn: see docs/concepts/limits.md)
                await asyncio.sleep(61 - time.time() % 60)
            for rank in sim.ranks:
                rank.restart()
                if shown_by == "replay":
                    rank.faults = Faults(drop_rate=1.0)  # published, kept for replay, never seen live
            if shown_by == "replay":
                await publish(sim, 3)
            else:
                for rank in sim.ranks:
                    await rank.heartbeat()

            def seen() -> bool:
                return all(e > o for pod in pods for e, o in zip(epochs(pod), old, strict=True))

            await wait_for(seen, what="the restart seen")
            assert epochs(pods[0]) == epochs(pods[1]), (old, epochs(pods[0]), epochs(pods[1]))
        finally:
            for pod in pods:
                await pod.stop()


# -- a sink that cannot say what it holds ---------------------------------------------------------

STORE: dict[str, list[Message]] = {}  # what each in-memory sink holds, across bridges


class HeldInMemory(MemoryConnector):
    """Keeps what it is given in STORE (it outlives the bridge) and says what it holds."""

    hang = False  # positions() never answers (the runtime's timeout must end it)

    async def write(self, messages: Sequence[Message]) -> None:
        await super().write(messages)
        STORE.setdefault(self.name, []).extend(messages)

    async def positions(self, streams: Sequence[Stream]) -> dict[str, SinkPosition | None]:
        if self.hang:
            await asyncio.Event().wait()
        out: dict[str, SinkPosition | None] = {}
        for s in streams:
            mine = [m for m in STORE.get(self.name, []) if m.record.stream.key == s.key]
            out[s.key] = SinkPosition.from_headers(mine[-1].headers, mine[-1].value) if mine else None
        return out


class Hanging(HeldInMemory):
    hang = True


def memory_config(tmp: Path, source: dict[str, Any], *, checkpoint: bool) -> Any:
    sinks = [
        {"type": kind, "name": kind, "format": "json", "granularity": "batch", "batch": {"linger": 0}}
        for kind in ("held", "hanging")
    ]
    cfg = bridge_config(
        tmp,
        [source],
        sinks,
        metrics={"listen": ""},
        checkpoint={"from_sinks": True, "from_sinks_timeout": "300ms", "path": str(tmp / "ck.json") if checkpoint else None},
        replay={"timeout": "500ms", "initial_backoff": "50ms", "max_backoff": "500ms"},
    )
    return from_data(cfg, env={})


@pytest.mark.parametrize("checkpoint", [False, True])
async def test_a_sink_that_does_not_answer_falls_back_and_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, checkpoint: bool
) -> None:
    """Its streams resume from the checkpoint file (every sink acknowledged that), or without one
    afresh in a new epoch announced by a SourceReset; a clear line names the sink and the streams."""
    STORE.clear()
    registry = Registry({"held": HeldInMemory, "hanging": Hanging}, entry_points=False)
    async with engine() as (sim, source):
        first = Bridge(memory_config(tmp_path, source, checkpoint=checkpoint), registry=registry)
        await first.start()
        await publish(sim, 10)
        await delivered_through(first, sim)
        await first.stop()
        opened = epochs(first)
        before = [rank.seq for rank in sim.ranks]
        caplog.clear()
        second = Bridge(memory_config(tmp_path, source, checkpoint=checkpoint), registry=registry)
        started = time.monotonic()
        await second.start()
        assert time.monotonic() - started < 5
        try:
            await publish(sim, 5)
            await delivered_through(second, sim)
        finally:
            await second.stop()
    failed = [r for r in caplog.records if r.getMessage().startswith("cannot read stream positions")]
    assert len(failed) == 1 and failed[0].levelname == "ERROR"
    assert failed[0].sink == "hanging" and f"{SOURCE}/0" in failed[0].stream and f"{SOURCE}/1" in failed[0].stream  # type: ignore[attr-defined]
    for name in ("held", "hanging"):
        for r in range(RANKS):
            mine = [m for m in STORE[name] if m.record.stream.dp_rank == r]
            batches = [(m.record.epoch, m.record.seq) for m in mine if m.record.kind == "batch"]
            resets = [m.record.epoch for m in mine if m.record.kind == "SourceReset"]
            published, epoch = sim.ranks[r].seq, opened[r]
            # The first pod started each stream afresh while "hanging" could not tell what it held:
            # announced, for it may have held an earlier epoch's records (breaker31k Break 3).
            if checkpoint:  # the file says where every sink is: on from there, same epoch
                assert batches == [(epoch, s) for s in range(published)] and resets == [epoch]
            else:  # afresh: the engine's whole buffer again, in a new epoch opened by a SourceReset
                new = second.pipelines[f"{SOURCE}/{r}"].sequencer.epoch
                assert new > epoch and resets == [epoch, new]
                assert batches == [(epoch, s) for s in range(before[r])] + [(new, s) for s in range(published)]


async def test_a_sink_ahead_of_the_others_gets_no_copies(tmp_path: Path, fresh_redis: Any, kafka: Any) -> None:
    """Kafka holds more than Redis (a bridge wrote to Kafka alone for a while): the stream resumes
    from Redis's position, and Kafka, which cannot drop copies itself, skips what it holds."""
    uid = uuid.uuid4().hex[:8]
    topic = await kafka.anew_topic(1)
    retry = {"initial_backoff": "20ms", "max_backoff": "200ms", "write_timeout": "10s"}
    redis_sink = {"type": "redis", "name": "redis", "format": "json", "granularity": "batch", "batch": {"linger": 0}}
    redis_sink |= {"retry": retry, "url": fresh_redis.url, "stream": f"h{uid}:{{source}}:{{dp_rank}}"}
    kafka_sink = {"type": "kafka", "name": "kafka", "format": "raw", "batch": {"linger": 0}, "retry": retry}
    kafka_sink |= {"bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    redis_of = Sink(
        "redis", redis_sink, lambda: read_redis(fresh_redis.url, [f"h{uid}:{SOURCE}:{r}" for r in range(RANKS)]), "batch"
    )
    kafka_of = Sink("kafka", kafka_sink, lambda: read_kafka(kafka.bootstrap_servers, topic, 1), "batch")

    def cfg(*sinks: Sink) -> Any:
        c = config(tmp_path, source, sinks[0], from_sinks=True)
        c["sinks"] = [s.config for s in sinks]
        return from_data(c, env={})

    async with engine() as (sim, source):
        for sinks, n in (((redis_of, kafka_of), 10), ((kafka_of,), 10), ((redis_of, kafka_of), 5)):
            bridge = Bridge(cfg(*sinks))
            await bridge.start()
            try:
                await publish(sim, n)
                await delivered_through(bridge, sim)
            finally:
                await bridge.stop()
        skipped = sum(s.skipped for s in bridge.skips)
        opened = epochs(bridge)
    for s in (redis_of, kafka_of):
        rows = await read(s)
        for r, rank in enumerate(sim.ranks):
            got = data(rows, r)
            assert got == expect(opened[r], range(rank.seq), "batch"), f"{s.kind} rank {r}: {len(got)} of {rank.seq}"
            assert control(rows, r, "SourceReset") == [] and control(rows, r, "EventsLost") == []
    assert skipped > 0  # the last bridge re-sent what Redis lacked, and Kafka left its copies out


# -- issue 29 case 19: a lagging sink behind an epoch another sink closed ----------------------------


class Fast(HeldInMemory):
    pass


class Slow(HeldInMemory):
    pass


async def test_a_sink_left_behind_an_epoch_another_sink_closed_is_told_what_it_lacks(tmp_path: Path) -> None:
    """Two sinks that say what they hold. The slow one stops taking writes after 0..4 (its queue
    holds the rest); the engine publishes 5..7, restarts, and its new instance's 0..1 open a new
    epoch, which the fast sink takes. The pod dies (nothing more reaches the slow sink). The next
    pod (checkpoint.from_sinks, no file) sees the slow sink behind an epoch the fast one closed:
    before its first record of a later epoch it must be told that the rest of its epoch, 5..7
    at least, is lost (before the fix it went on with a silent hole: I3)."""
    from tests.support.scripted_engine import ScriptedEngine

    STORE.clear()
    live, rep = free_ports(2)
    source = {"name": SOURCE, "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
    sinks = [{"type": k, "name": k, "format": "json", "granularity": "batch", "batch": {"linger": 0}} for k in ("fast", "slow")]
    cfg = from_data(
        bridge_config(
            tmp_path,
            [source],
            sinks,
            metrics={"listen": ""},
            checkpoint={"from_sinks": True, "from_sinks_timeout": "2s", "path": None},
            replay={"timeout": "300ms", "initial_backoff": "50ms", "max_backoff": "200ms"},
            shutdown_timeout="500ms",
        ),
        env={},
    )
    registry = Registry({"fast": Fast, "slow": Slow}, entry_points=False)
    key = f"{SOURCE}/0"

    def held(name: str) -> list[Any]:
        return [m.record for m in STORE.get(name, []) if m.record.stream.key == key]

    async with ScriptedEngine(live, rep) as engine:
        first = Bridge(cfg, registry=registry)
        await first.start()
        try:
            await engine.wait_subscribed()
            await engine.publish(5)
            await wait_for(lambda: len(held("slow")) == 5 and len(held("fast")) == 5, what="0..4 in both sinks")
            slow = first.workers[1].connector.inner
            assert isinstance(slow, Slow)
            slow.gate = asyncio.Event()  # its writes hang from here: its queue holds the rest
            await engine.publish(3)
            await engine.restart()
            await engine.wait_subscribed()
            await engine.publish(2)
            await wait_for(lambda: [r.kind for r in held("fast")][-3:] == ["SourceReset", "batch", "batch"], what="the new epoch")
        finally:
            await first.stop()  # (the slow sink cannot be flushed: what its queue held is gone with the pod)
        old_epoch, new_epoch = held("fast")[0].epoch, held("fast")[-1].epoch
        assert [(r.epoch, r.seq) for r in held("slow")] == [(old_epoch, s) for s in range(5)]
        second = Bridge(cfg, registry=registry)
        await second.start()
        try:
            await engine.publish(1)
            await wait_for(lambda: any(r.kind == "SourceReset" for r in held("slow")), what="the slow sink's SourceReset")
            await wait_for(lambda: (held("slow")[-1].kind, held("slow")[-1].seq) == ("batch", 2), what="the new instance's 2")
        finally:
            await second.stop()
    got = held("slow")
    reset = next(i for i, r in enumerate(got) if r.kind == "SourceReset")
    told = [r for r in got[:reset] if r.kind == "EventsLost" and r.epoch == old_epoch]
    assert [(r.from_seq, r.reason) for r in told] == [(5, "sink_behind:slow")] and told[0].seq >= 7, got[: reset + 1]
    assert got[reset].epoch > new_epoch


@pytest.fixture(scope="module")
def slow_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module's own: a test refuses its writes (maxmemory) for a while."""
    with own_server("redis (slow sink)", RedisServer(tmp_path_factory.mktemp("redis-slow"), persistent=False)) as server:
        yield server


async def test_a_lagging_redis_sink_is_told_what_a_killed_pod_left_in_its_queue(
    tmp_path: Path, fresh_redis: Any, slow_redis: RedisServer
) -> None:
    """Issue 29 case 19 on real brokers: two Redis sinks. 0..4 reach both; the slow one's Redis
    then refuses every write (maxmemory: retried, so its queue holds the rest) while the engine
    publishes 5..7, restarts, and its new instance's 0..1 open a new epoch in the fast sink. The
    pod is killed (SIGKILL); the slow Redis recovers. The next pod (checkpoint.from_sinks, no
    file) must tell the slow sink, before its SourceReset, that the rest of its epoch (5..7 at
    least) is lost (before the fix: a silent hole, I3)."""
    from tests.support.scripted_engine import ScriptedEngine

    uid = uuid.uuid4().hex[:8]
    live, rep = free_ports(2)
    source = {"name": SOURCE, "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
    retry = {"initial_backoff": "20ms", "max_backoff": "200ms", "write_timeout": "5s"}
    sinks = [
        {"type": "redis", "name": name, "url": url, "stream": f"h{uid}:{{source}}:{{dp_rank}}", "retry": retry}
        | {"format": "json", "granularity": "batch", "batch": {"linger": 0}}
        for name, url in (("fast", fresh_redis.url), ("slow", slow_redis.url))
    ]
    cfg = bridge_config(
        tmp_path,
        [source],
        sinks,
        checkpoint={"from_sinks": True, "from_sinks_timeout": "10s", "path": None},
        replay={"timeout": "300ms", "initial_backoff": "50ms", "max_backoff": "200ms"},
    )
    keys = [f"h{uid}:{SOURCE}:0"]

    async def rows(url: str) -> list[tuple[int, int, int, int, str]]:
        return (await read_redis(url, keys)).rows

    async def until(url: str, what: str, check: Callable[[list[tuple[int, int, int, int, str]]], bool]) -> None:
        deadline = time.monotonic() + 20
        while not check(await rows(url)):
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {await rows(url)}"
            await asyncio.sleep(0.05)

    admin = aioredis.Redis.from_url(slow_redis.url)
    try:
        async with ScriptedEngine(live, rep) as engine:
            first = BridgeProcess(tmp_path, cfg, name="first").start()
            try:
                await first.wait_ready()
                await engine.wait_subscribed()
                await engine.publish(5)
                for url in (fresh_redis.url, slow_redis.url):
                    await until(url, "0..4", lambda r: len(r) == 5)
                await admin.config_set("maxmemory", 1)  # every write refused (OOM), and retried
                await engine.publish(3)
                await engine.restart()
                await engine.wait_subscribed()
                await engine.publish(2)
                new = ["SourceReset", "EventBatch", "EventBatch"]
                await until(fresh_redis.url, "the new epoch", lambda r: [t for *_, t in r][-3:] == new)
            finally:
                first.kill()
            await admin.config_set("maxmemory", 0)
            old_epoch = (await rows(slow_redis.url))[-1][1]
            new_epoch = (await rows(fresh_redis.url))[-1][1]
            assert [(e, s) for _, e, s, _, _ in await rows(slow_redis.url)] == [(old_epoch, s) for s in range(5)]
            second = BridgeProcess(tmp_path, cfg, name="second").start()
            try:
                await second.wait_ready()
                await engine.wait_subscribed()
                await engine.publish(1)
                await until(slow_redis.url, "the new instance's 2", lambda r: bool(r) and r[-1][2:] == (2, -1, "EventBatch"))
            finally:
                assert await second.terminate() == 0, second.log()[-3000:]
        got = await read_redis(slow_redis.url, keys)
    finally:
        await admin.flushall()
        await admin.aclose()
    kinds = [(e, t) for _, e, _, _, t in got.rows]
    reset = kinds.index((kinds[-1][0], "SourceReset"))
    assert kinds[5:reset] == [(old_epoch, "EventsLost")], got.rows
    ((_, first_lost, last_lost, reason),) = got.lost
    assert (first_lost, reason) == (5, "sink_behind:slow") and last_lost >= 7
    assert kinds[-1][0] > new_epoch
