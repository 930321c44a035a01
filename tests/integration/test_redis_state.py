"""The Redis sink's live-block state (``state.enabled``), bootstrapped by a consumer, on a real Redis.

A :class:`~tests.support.cache_engine.CacheEngine` (real ZMQ sockets, a true cache multiset per
instance) feeds a bridge writing json events and the state hash to Redis. A consumer bootstraps
with :func:`kv_consumer.redis.bootstrap` (HSCAN sweep, head read again), then follows the stream
key from the head's ``next`` with :meth:`kv_consumer.state.StreamState.apply`; once it has applied
the engine's last batch, its blocks must equal the engine's true cache:

- at cut points taken while the engine publishes (the sweep interleaved with writes), across
  duplicates, CPU copies, removals, an engine restart, a lost span (incomplete: never a block the
  engine lacks) and a cache clear;
- after the bridge is SIGKILLed at random points and restarted (it rebuilds its tables from the
  hash: ``kv_bridge_state_rebuilds_total{outcome="rebuilt"}``);
- a reset of a stream with 10^5 live blocks leaves no old key, and no bootstrap mixes epochs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from bridge.config import Config, from_data
from bridge.records import Record, Stream, events_lost, source_reset
from bridge.runtime import Bridge
from kv_consumer.redis import bootstrap
from kv_consumer.state import StreamState, block_id
from tests.infra.servers import RedisServer
from tests.support.cache_engine import CacheEngine, event
from tests.support.harness import free_port, one_run, wait_for
from tests.support.process import BridgeProcess, bridge_config, metric
from tests.support.readback import CONTROL, read_redis
from tests.support.snapshots import seeded_mid_epoch_and_after_a_loss, snapshot_source

pytestmark = pytest.mark.integration

REPLAY = {"timeout": "300ms", "max_attempts": 20, "initial_backoff": "50ms", "max_backoff": "200ms", "idle_probe": 0}


def truth(engine: CacheEngine) -> Counter[tuple[Any, Any, int]]:
    """The engine's true cache as the state keys it: (medium, group_idx, block id) -> copies."""
    out: Counter[tuple[Any, Any, int]] = Counter()
    for (h, medium), n in engine.cache.items():
        k = block_id(h)
        assert k is not None
        out[(medium, 0, k)] += n
    return out


def sink(url: str, prefix: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "redis",
        "name": "out",
        "url": url,
        "format": "json",
        "stream": prefix + ":{source}:{dp_rank}",
        "state": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:state"},
        "batch": {"linger": 0},
        **extra,
    }


def in_process(tmp: Path, engines: list[tuple[str, int, int]], sink_entry: dict[str, Any], **sections: Any) -> Config:
    """The config of an in-process bridge: ``engines`` as (source, live port, replay port)."""
    config = {
        "sources": [
            {"name": n, "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
            for n, live, rep in engines
        ],
        "sinks": [sink_entry],
        "metrics": {"listen": ""},
        "dead_letter": {"path": str(tmp / "dead.jsonl")},
        "replay": REPLAY,
        "shutdown_timeout": "3s",
        **sections,
    }
    return from_data(config, env={})


async def remove_keys(client: aioredis.Redis, prefix: str) -> None:
    """Delete the keys a test wrote (its prefix)."""
    keys = [k async for k in client.scan_iter(match=prefix + ":*")]
    if keys:
        await client.delete(*keys)


async def top_seq(client: aioredis.Redis, key: str) -> int | None:
    """The seq of the stream key's last entry (None when empty)."""
    last = await client.xrevrange(key, "+", "-", count=1)
    return int(last[0][1][b"seq"]) if last else None


async def follow(client: aioredis.Redis, key: str, state: StreamState, after: str | None) -> None:
    """Apply every entry of ``key`` after ``after`` (exclusive; None: from the first)."""
    start = "-" if after is None else "(" + after
    while True:
        entries = await client.xrange(key, start, "+", count=2000)
        if not entries:
            return
        for entry_id, fields in entries:
            state.apply(json.loads(fields[b"data"]))
            start = "(" + entry_id.decode()


async def bootstrapped(client: aioredis.Redis, prefix: str, source: str) -> StreamState:
    state, after = await bootstrap(client, f"{prefix}:{source}:0:state", f"{prefix}:{source}:0")
    await follow(client, f"{prefix}:{source}:0", state, after)
    return state


async def settled(client: aioredis.Redis, prefix: str, engine: CacheEngine, source: str) -> None:
    """Until the bridge has written the engine's last batch."""
    key = f"{prefix}:{source}:0"

    async def at_top() -> bool:
        return await top_seq(client, key) == engine.last_seq

    deadline = asyncio.get_running_loop().time() + 20
    while not await at_top():
        assert asyncio.get_running_loop().time() < deadline, f"{key}: the bridge did not write seq {engine.last_seq}"
        await asyncio.sleep(0.05)


async def run_settled(cfg: Config, engine: CacheEngine, client: aioredis.Redis, prefix: str, steps: int) -> None:
    """One bridge run: the engine publishes ``steps`` batches, written up to the last, then the bridge stops."""
    await one_run(cfg, engine, steps, lambda: settled(client, prefix, engine, "a"))


def check(state: StreamState, engine: CacheEngine, *, complete: bool = True) -> None:
    __tracebackhide__ = True
    mine, want = Counter(state.blocks()), truth(engine)
    assert state.ready
    if complete:
        assert state.complete
        assert mine == want, f"missing {want - mine}, extra {mine - want}"
    else:
        assert not state.complete
        assert not mine - want, f"blocks the engine does not hold: {mine - want}"


@pytest.fixture
async def client(redis_server: RedisServer) -> Any:
    c = aioredis.Redis.from_url(redis_server.url)
    yield c
    await c.aclose()


async def test_bootstrap_at_any_cut_equals_the_engine(tmp_path: Path, redis_server: RedisServer, client: Any) -> None:
    prefix = f"kvs{uuid.uuid4().hex[:8]}"
    (la, ra), (lb, rb) = (free_port(), free_port()), (free_port(), free_port())
    cfg = in_process(tmp_path, [("a", la, ra), ("b", lb, rb)], sink(redis_server.url, prefix))
    rand = random.Random(7)
    async with CacheEngine(la, ra, seed=1) as a, CacheEngine(lb, rb, seed=2, buffer_steps=4) as b:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await a.wait_subscribed()
            await b.wait_subscribed()

            async def cuts(engine: CacheEngine, source: str, steps: int) -> list[StreamState]:
                """Bootstraps taken while ``engine`` publishes ``steps`` batches."""
                states: list[Any] = []

                async def publish() -> None:
                    for _ in range(steps):
                        await engine.step(1)
                        await asyncio.sleep(0.01)

                publishing = asyncio.create_task(publish())
                while not publishing.done():
                    await asyncio.sleep(rand.uniform(0, 0.02))
                    states.append(await bootstrap(client, f"{prefix}:{source}:0:state", f"{prefix}:{source}:0"))
                await publishing
                await settled(client, prefix, engine, source)
                assert len(states) >= 5, len(states)  # cuts all along
                out = []
                for state, after in states:
                    await follow(client, f"{prefix}:{source}:0", state, after)
                    out.append(state)
                return out

            # 1. stores, copies, CPU offloads, removals; bootstraps cut anywhere meanwhile. Enough
            # blocks that a sweep takes several HSCAN calls, writes landing between them.
            for first in range(1, 4_001, 1_000):
                ev = event("BlockStored", block_hashes=list(range(first, first + 1_000)), medium="GPU", group_idx=0)
                a.apply(ev)
                await a.send([ev])
            for state in await cuts(a, "a", 60):
                check(state, a)
            assert any(n > 1 for n in a.cache.values()) and any(m == "CPU" for _, m in a.cache)
            await b.step(10)
            await settled(client, prefix, b, "b")
            check(await bootstrapped(client, prefix, "b"), b)
            # 2. engine a restarts: only the new instance's blocks, whatever the cut
            await a.restart()
            await a.wait_subscribed()
            for state in await cuts(a, "a", 30):
                check(state, a)
            assert a.caches[0] and not set(a.caches[0]) <= set(a.cache)
            # 3. engine b loses 6 batches its buffer (4) cannot replay: incomplete, never a false block
            await b.step(6, deliver=False)
            await b.step(3)
            await settled(client, prefix, b, "b")
            check(await bootstrapped(client, prefix, "b"), b, complete=False)
            # 4. engine b clears its cache: complete and exact again
            await b.clear()
            for state in await cuts(b, "b", 20):
                check(state, b)
        finally:
            await bridge.stop()
            await remove_keys(client, prefix)


async def test_a_sigkilled_bridge_rebuilds_its_state_from_redis(tmp_path: Path, redis_server: RedisServer, client: Any) -> None:
    """SIGKILL at random points while the engine publishes (between an entry and the next, a
    write and its acknowledgement...); the restarted bridge reads the hash back and goes on."""
    prefix = f"kvk{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    source = {"name": "a", "endpoint": f"tcp://127.0.0.1:{live}", "replay_endpoint": f"tcp://127.0.0.1:{rep}"}
    cfg = bridge_config(
        tmp_path,
        [source],
        [sink(redis_server.url, prefix)],
        checkpoint={"path": str(tmp_path / "checkpoint.json"), "interval": "50ms"},
        replay=REPLAY,
    )
    rand = random.Random(3)
    rebuilt = 0.0
    async with CacheEngine(live, rep, seed=5) as engine:
        bridge = BridgeProcess(tmp_path, cfg).start()
        try:
            for kill in range(4):
                await bridge.wait_ready()
                await engine.wait_subscribed()
                publishing = asyncio.create_task(engine.step(40, events_per_batch=4))
                await asyncio.sleep(rand.uniform(0.05, 0.4))
                bridge.kill()  # SIGKILL
                await publishing
                if kill == 2:
                    await engine.restart()  # a restart while the bridge is down
                bridge = BridgeProcess(tmp_path, cfg, name=f"bridge{kill}").start()
                await bridge.wait_ready()
                rebuilt = metric(await bridge.metrics(), "kv_bridge_state_rebuilds_total", outcome="rebuilt")
            await engine.step(10)
            await settled(client, prefix, engine, "a")
            await wait_for(lambda: True, 0.1)
            check(await bootstrapped(client, prefix, "a"), engine)
            assert rebuilt == 1, bridge.log()[-3000:]  # the last start rebuilt its one stream
        finally:
            await bridge.terminate()
            await remove_keys(client, prefix)


async def test_a_reset_of_100k_blocks_leaves_no_old_key(tmp_path: Path, redis_server: RedisServer, client: Any) -> None:
    prefix = f"kvr{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    cfg = in_process(tmp_path, [("a", live, rep)], sink(redis_server.url, prefix, granularity="batch"))
    n, per = 100_000, 2_000
    state_key = f"{prefix}:a:0:state"
    async with CacheEngine(live, rep, seed=9) as engine:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            for first in range(1, n + 1, per):
                hashes = list(range(first, first + per))
                ev = event("BlockStored", block_hashes=hashes, token_ids=[], block_size=16, medium="GPU", group_idx=0)
                engine.apply(ev)
                await engine.send([ev])
            await settled(client, prefix, engine, "a")
            assert await client.hlen(state_key) == n + 3  # the entries, _head, _gen, _at
            before = json.loads(await client.hget(state_key, "_head"))
            # the restart's SourceReset clears the hash while consumers bootstrap
            await engine.restart()
            await engine.wait_subscribed()
            sweeps = [asyncio.create_task(bootstrap(client, state_key)) for _ in range(3)]  # type: ignore[arg-type]
            await engine.step(5)
            await settled(client, prefix, engine, "a")
            for state, _after in await asyncio.gather(*sweeps):
                epochs = {(d["epoch"], d["gen"]) for d in state.entries.values()}
                assert epochs <= {(state.epoch, state.head["gen"])}, "a bootstrap mixed epochs"
            fields = await client.hgetall(state_key)
            head = json.loads(fields[b"_head"])
            assert head["epoch"] > before["epoch"] and head["complete"]
            old = [f for f, v in fields.items() if b"/" in f and json.loads(v)["epoch"] != head["epoch"]]
            assert not old, f"{len(old)} keys of the old epoch survived"
            assert len(fields) - 3 == len(truth(engine))
            check(await bootstrapped(client, prefix, "a"), engine)
        finally:
            await bridge.stop()
            with contextlib.suppress(Exception):
                await remove_keys(client, prefix)


async def test_a_forgotten_source_gives_its_room_back_and_is_rebuilt_when_back(
    tmp_path: Path, redis_server: RedisServer, client: Any
) -> None:
    """Discovery churn: a removed source's blocks leave the tracker after discovery.forget_after;
    when it comes back (add_source), its state is read back from the hash (then, as a stream met
    anew, it opens a new epoch: replay brings the engine's batches again from seq 0)."""
    prefix = f"kvf{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    cfg = in_process(tmp_path, [("a", live, rep)], sink(redis_server.url, prefix))
    async with CacheEngine(live, rep, seed=4) as engine:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(20)
            await settled(client, prefix, engine, "a")
            assert bridge.tracker is not None and bridge.tracker.total == len(truth(engine)) > 0
            await bridge.remove_source("a")
            bridge.forget_retired(asyncio.get_running_loop().time() + 10**6)
            assert bridge.tracker.total == 0 and bridge.tracker.head(Stream("a", 0)) is None
            await bridge.add_source(cfg.sources[0])
            assert bridge.metrics.registry.get_sample_value("kv_bridge_state_rebuilds_total", {"outcome": "rebuilt"}) == 1
            await engine.wait_subscribed()
            await engine.step(10)
            await settled(client, prefix, engine, "a")
            check(await bootstrapped(client, prefix, "a"), engine)
        finally:
            await bridge.stop()
            await remove_keys(client, prefix)


async def test_a_bootstrap_whose_head_the_stream_was_trimmed_past_starts_over(client: Any) -> None:
    """maxlen trimmed entries after the head's next (the state lagging, or a slow sweep): following
    from there would miss them silently, so the bootstrap tries again, then gives up."""
    key = f"kvt{uuid.uuid4().hex[:8]}"
    head = {"source": "a", "dp_rank": 0, "epoch": 1, "gen": 1, "seq": 0, "complete": True, "live": 0, "next": "1-5"}
    try:
        await client.hset(key + ":state", "_head", json.dumps(head))
        await client.xadd(key, {"data": "{}"}, id="1-5")  # the head's own entry
        for i in range(2, 12):
            await client.xadd(key, {"data": "{}"}, id=f"{i}-0")
        assert (await bootstrap(client, key + ":state", key))[1] == "1-5"  # nothing after the head is gone
        await client.xtrim(key, maxlen=3, approximate=False)  # 1-5 .. 8-0 gone
        with pytest.raises(RuntimeError, match="trimmed past its head"):
            await bootstrap(client, key + ":state", key, attempts=2)
    finally:
        await client.delete(key, key + ":state")


async def test_a_bootstrap_of_a_hash_short_of_its_heads_count_is_incomplete(client: Any) -> None:
    """Fields deleted from the state hash by hand (HDEL; a restore of part of it): the head still
    counts them, and a bootstrap said complete without them. It counts the entries of the head's
    generation against ``live`` when no write landed during its sweep: fewer, incomplete."""
    key = f"kvt{uuid.uuid4().hex[:8]}"
    head = {"source": "a", "dp_rank": 0, "epoch": 1, "gen": 1, "seq": 0, "complete": True, "live": 2, "next": None}
    entry = {"medium": "GPU", "group_idx": 0, "count": 1, "epoch": 1, "gen": 1, "seq": 0}
    try:
        await client.hset(key + ":state", "_head", json.dumps(head))
        await client.hset(key + ":state", "GPU/0/01", json.dumps({**entry, "block": "01"}))
        await client.hset(key + ":state", "GPU/0/02", json.dumps({**entry, "block": "02"}))
        whole, _ = await bootstrap(client, key + ":state")
        assert whole.complete and len(whole.blocks()) == 2
        await client.hdel(key + ":state", "GPU/0/02")
        short, _ = await bootstrap(client, key + ":state")
        assert not short.complete and "the sink holds 1 entries where the head counts 2" in short.why
    finally:
        await client.delete(key + ":state")


async def test_a_state_key_of_another_type_stops_only_the_state(redis_server: RedisServer, client: Any) -> None:
    """The stream's entries are written; the state message fails on its own, transient (an operator
    fixes the key), and nothing of the stream after it is written meanwhile."""
    from bridge.config import SinkConfig
    from bridge.errors import PartialFailure, Permanent, Retriable
    from bridge.formats import Renderer, state_message
    from bridge.state import StateTracker
    from connectors.redis import RedisConnector, RedisOptions

    prefix = f"kvw{uuid.uuid4().hex[:8]}"
    cfg = SinkConfig(type="redis", name="r")
    options = msgspec.convert(
        {
            "url": redis_server.url,
            "stream": prefix + ":{source}:{dp_rank}",
            "state": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:s"},
        },
        RedisOptions,
    )
    conn = RedisConnector("r", options, cfg)
    tracker, renderer, stream = StateTracker(), Renderer("json", "batch"), Stream("a", 0)
    store = {"type": "BlockStored", "block_hashes": [1], "medium": "GPU", "token_ids": [], "block_size": 1}
    messages = []
    for seq in range(2):
        r = Record(stream=stream, epoch=1, seq=seq, ts=1.0, events=[store])
        r.state = tracker.apply(r)
        messages += [*renderer.render(r), state_message(r)]
    try:
        await conn.connect()
        await client.set(prefix + ":a:0:s", "not a hash")
        with pytest.raises(PartialFailure) as info:
            await conn.write(messages)
        errors = info.value.errors
        assert sorted(errors) == [1, 2, 3] and all(isinstance(e, Retriable) for e in errors.values())
        assert errors[1].reason == "state_key_type" and "holds a string" in str(errors[1])
        assert await client.xlen(prefix + ":a:0") == 1  # the first record's entry is written
        # a record beyond what entry ids hold: its state message is refused alone, not the write
        await client.delete(prefix + ":a:0:s")
        far = Record(stream=stream, epoch=1, seq=2**41, ts=1.0, events=[store])
        far.state = tracker.apply(far)
        with pytest.raises(PartialFailure) as info:
            await conn.write([*messages, *renderer.render(far), state_message(far)])
        assert {i: e.reason for i, e in info.value.errors.items()} == {4: "id_range", 5: "id_range"}
        assert all(isinstance(e, Permanent) for e in info.value.errors.values())
        assert await client.xlen(prefix + ":a:0") == 2 and await client.hexists(prefix + ":a:0:s", "_head")
    finally:
        await conn.close()
        await client.delete(prefix + ":a:0", prefix + ":a:0:s")


async def test_past_state_max_entries_a_streams_state_is_switched_off_and_its_events_flow(
    tmp_path: Path, redis_server: RedisServer, client: Any
) -> None:
    prefix = f"kvm{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    cfg = in_process(tmp_path, [("a", live, rep)], sink(redis_server.url, prefix), state={"max_entries": 10})
    async with CacheEngine(live, rep, seed=6) as engine:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(30)  # far more than 10 live blocks
            await settled(client, prefix, engine, "a")
            head = json.loads(await client.hget(f"{prefix}:a:0:state", "_head"))
            assert head["tracking"] is False and head["complete"] is False and head["seq"] == engine.last_seq
            assert await client.hlen(f"{prefix}:a:0:state") == 3  # _head, _gen, _at: no entries
            registry = bridge.metrics.registry
            assert registry.get_sample_value("kv_bridge_state_switched_off_total", {"source": "a"}) == 1
            assert registry.get_sample_value("kv_bridge_state_streams_off") == 1
            assert registry.get_sample_value("kv_bridge_state_entries") == 0
            assert await client.xlen(f"{prefix}:a:0") > 30  # the events flow on
            # the engine clears its cache: the stream is tracked again, as long as it fits
            await engine.clear()
            await settled(client, prefix, engine, "a")
            head = json.loads(await client.hget(f"{prefix}:a:0:state", "_head"))
            assert head["tracking"] is True and head["complete"] is True
            assert registry.get_sample_value("kv_bridge_state_streams_off") == 0
            check(await bootstrapped(client, prefix, "a"), engine)
        finally:
            await bridge.stop()
            await remove_keys(client, prefix)


async def test_a_state_entry_over_proto_max_bulk_len_is_written_without_its_fact(
    tmp_path: Path, redis_server: RedisServer, client: Any
) -> None:
    """breaker45 B1: proto-max-bulk-len 1 MiB, and one block stored with 300,000 token ids: its
    state entry (about 1.2 MB of JSON) was one argument of the stream's script call, which the
    server refused whole, and the connector retried it for ever (a protocol error): the stream
    stopped at the batch before it, every later batch queued (I5). Now the entry is written without
    its fact, as Kafka and NATS write it: the stream goes on and its state equals the engine's."""
    prefix = f"kvb{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    small_events = {"keep": ["block_hashes", "parent_block_hash", "medium", "group_idx", "block_size"]}  # (no token ids)
    cfg = in_process(tmp_path, [("a", live, rep)], sink(redis_server.url, prefix, fields=small_events))
    await client.config_set("proto-max-bulk-len", 1024 * 1024)
    try:
        async with CacheEngine(live, rep, seed=7) as engine:
            bridge = Bridge(cfg)
            await bridge.start()
            try:
                await engine.wait_subscribed()
                await engine.step(3)
                await settled(client, prefix, engine, "a")
                big = event("BlockStored", block_hashes=[123456789], token_ids=[100] * 300_000, block_size=16, medium="GPU",
                            group_idx=0)  # fmt: skip
                engine.apply(big)
                await engine.send([big])
                await engine.step(3)
                await settled(client, prefix, engine, "a")
                check(await bootstrapped(client, prefix, "a"), engine)
                docs = [json.loads(v) for k, v in (await client.hgetall(f"{prefix}:a:0:state")).items() if not k.startswith(b"_")]
                assert docs and max(len(json.dumps(d)) for d in docs) < 1024 * 1024
                assert bridge.workers[0].problem is None
            finally:
                await bridge.stop()
                await remove_keys(client, prefix)
    finally:
        await client.config_set("proto-max-bulk-len", 512 * 1024 * 1024)


# -- Redis losing what it acknowledged (I6) ------------------------------------------------------


@pytest.fixture
def forgetful_redis(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A redis-server of the test's own without AOF (``save ""``): a restart comes back empty, or
    with the last snapshot a test took with SAVE."""
    from tests.integration.conftest import own_server

    with own_server("redis (no AOF)", RedisServer(tmp_path_factory.mktemp("redis-lost"), persistent=False)) as server:
        yield server


async def around_a_snapshot(client: aioredis.Redis, prefix: str, engine: CacheEngine, save: bool = True) -> tuple[int, int]:
    """10 batches, a SAVE (the snapshot Redis will come back from; none unless ``save``), 10 more,
    each settled: (the last seq in the snapshot, -1 for none; the last seq acknowledged)."""
    await engine.step(10)
    await settled(client, prefix, engine, "a")
    kept = -1
    if save:
        await client.save()
        kept = engine.last_seq
    await engine.step(10)
    await settled(client, prefix, engine, "a")
    return kept, engine.last_seq


async def restarted(server: RedisServer, client: aioredis.Redis) -> aioredis.Redis:
    """Kill the server without AOF and start it again (back empty, or from its last SAVE): a new client."""
    await client.aclose()
    await server.akill()
    await server.astart()
    return aioredis.Redis.from_url(server.url)


def lost_exactly(back: Any, kept: int, acknowledged: int, last: int) -> None:
    """The sink's copy lacks exactly kept+1..acknowledged, announced by one EventsLost (sink_lost:out),
    and holds every other seq up to ``last``."""
    assert [x for x in back.lost if x[3].startswith("sink_lost")] == [(0, kept + 1, acknowledged, "sink_lost:out")], back.lost
    present = {seq for _, _, seq, _, kind in back.rows if kind not in ("SourceReset", "EventsLost")}
    gone = set(range(kept + 1, acknowledged + 1))
    assert present | gone == set(range(last + 1)) and not present & gone, sorted(present)


@pytest.mark.parametrize("restart", ["empty", "snapshot"])
async def test_entries_redis_lost_are_announced_and_the_state_cleared(
    tmp_path: Path, forgetful_redis: RedisServer, restart: str
) -> None:
    """Redis restarts without persistence (empty) or from an older RDB snapshot, mid-run. The
    bridge wrote the next batches on top of what was left: the stream silently lacked acknowledged
    batches and the state, rebuilt on nothing or on an old snapshot, stayed complete: true. Now
    the next write finds the stream's top below the last entry stored: an EventsLost (reason
    sink_lost:out) covers exactly the seqs lost, and the state is incomplete (never a block the
    engine lacks), or exact."""
    prefix = "kvl"
    live, rep = free_port(), free_port()
    cfg = in_process(tmp_path, [("a", live, rep)], sink(forgetful_redis.url, prefix, retry={"initial_backoff": "20ms"}))
    client = aioredis.Redis.from_url(forgetful_redis.url)
    async with CacheEngine(live, rep, seed=11) as engine:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            kept, acknowledged = await around_a_snapshot(client, prefix, engine, save=restart == "snapshot")
            check(await bootstrapped(client, prefix, "a"), engine)
            client = await restarted(forgetful_redis, client)
            assert await top_seq(client, f"{prefix}:a:0") == (kept if kept >= 0 else None)
            await engine.step(10)
            await settled(client, prefix, engine, "a")
            lost_exactly(await read_redis(forgetful_redis.url, [f"{prefix}:a:0"]), kept, acknowledged, engine.last_seq)
            state = await bootstrapped(client, prefix, "a")
            check(state, engine, complete=False)  # cleared into a new generation: incomplete, no false block
        finally:
            await bridge.stop()
            await client.aclose()
            (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("source", "restart", "mode"),
    [(s, r, "file") for s in ("configured", "discovered") for r in ("snapshot", "empty")]
    + [("configured", r, "from_sinks") for r in ("snapshot", "empty")],
)
async def test_entries_redis_lost_while_no_bridge_ran_are_announced_at_the_next_start(
    tmp_path: Path, forgetful_redis: RedisServer, source: str, restart: str, mode: str
) -> None:
    """Issue 29 (breaker33 B2, breaker35 B2, breaker37 B1): Redis comes back from an older RDB
    snapshot, or empty, while the bridge is stopped. The restarted bridge read the state head back
    behind what its checkpoint says every sink acknowledged (or no head at all), cleared the state
    (incomplete), and said so in its log only: the stream silently lacked the acknowledged
    batches, and no EventsLost came. Now the span the sink lost is announced to it (reason
    sink_lost:out) before the stream's first record, for a source in the config and for one added
    at run time (what DNS discovery does). With checkpoint.from_sinks (breaker45 B2), a sink that
    still holds a batch gets the rest again from the engine's buffer (the stream resumes from it:
    nothing lost, the state exact); one that holds nothing had the announcement made for it and
    dropped (it was handed to the SkipHeld wrapper's id, never to the worker): now it gets it."""
    prefix = f"kvs{source[0]}{restart[0]}{mode[0]}"
    live, rep = free_port(), free_port()
    checkpoint = {"path": str(tmp_path / "cp.json"), "interval": "100ms", "from_sinks": mode == "from_sinks"}
    cfg = in_process(tmp_path, [("a", live, rep)], sink(forgetful_redis.url, prefix), checkpoint=checkpoint)
    other = in_process(tmp_path, [("z", free_port(), free_port())], sink(forgetful_redis.url, prefix), checkpoint=checkpoint)
    client = aioredis.Redis.from_url(forgetful_redis.url)
    async with CacheEngine(live, rep, seed=12) as engine:
        try:
            first = Bridge(cfg)
            await first.start()
            try:
                await engine.wait_subscribed()
                kept, acknowledged = await around_a_snapshot(client, prefix, engine, save=restart == "snapshot")
            finally:
                await first.stop()
            client = await restarted(forgetful_redis, client)
            assert await top_seq(client, f"{prefix}:a:0") == (kept if kept >= 0 else None)
            second = Bridge(cfg if source == "configured" else other)
            await second.start()
            try:
                if source == "discovered":
                    await second.add_source(cfg.sources[0])
                await engine.wait_subscribed()
                await engine.step(10)
                await settled(client, prefix, engine, "a")
            finally:
                await second.stop()
            back = await read_redis(forgetful_redis.url, [f"{prefix}:a:0"])
            if mode == "from_sinks" and kept >= 0:
                assert not back.lost, back.lost
                held = {seq for _, _, seq, _, kind in back.rows if kind not in ("SourceReset", "EventsLost")}
                assert held == set(range(engine.last_seq + 1))
                check(await bootstrapped(client, prefix, "a"), engine)
            else:
                lost_exactly(back, kept, acknowledged, engine.last_seq)
                check(await bootstrapped(client, prefix, "a"), engine, complete=False)
        finally:
            await client.aclose()
            (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("restart", "granularity", "resume"),
    [(r, g, "acknowledged") for r in ("snapshot", "empty") for g in ("batch", "event")]
    + [("snapshot", "event", "below"), ("intact", "event", "acknowledged")],
)
async def test_entries_an_events_only_sink_lost_while_no_bridge_ran_are_announced_at_the_next_start(
    tmp_path: Path, forgetful_redis: RedisServer, restart: str, granularity: str, resume: str
) -> None:
    """Issue 29 (note 48, left alone): a sink without state lost entries while no bridge ran (Redis
    back from an older snapshot, or empty). The next bridge read nothing back (no state to read),
    expected nothing of the key, and wrote on top: the entries lost were never announced. Now the
    checkpoint keeps the last entry each such sink stored (``stored``), and the first write checks
    the key still holds it: the span lost is announced (sink_lost:out) ahead of the stream's next
    entries. Where the stream resumes below what the sink stored (``below``: another sink was
    behind), only the seqs up to the resume point are announced; the rest are written again. An
    intact Redis gets no announcement and no copy."""
    prefix = f"kve{restart[0]}{granularity[0]}{resume[0]}"
    live, rep = free_port(), free_port()
    index = {"enabled": granularity == "event", "key": prefix + ":{source}:{dp_rank}:blocks"}  # (a key of the stream's too)
    events_only = sink(forgetful_redis.url, prefix, state={"enabled": False}, granularity=granularity, index=index)
    cfg = in_process(
        tmp_path, [("a", live, rep)], events_only, checkpoint={"path": str(tmp_path / "cp.json"), "interval": "100ms"}
    )
    client = aioredis.Redis.from_url(forgetful_redis.url)
    key = f"{prefix}:a:0"
    async with CacheEngine(live, rep, seed=13) as engine:
        try:
            first = Bridge(cfg)
            await first.start()
            try:
                await engine.wait_subscribed()
                kept, acknowledged = await around_a_snapshot(client, prefix, engine, save=restart != "empty")
            finally:
                await first.stop()
            saved = json.loads((tmp_path / "cp.json").read_text())
            stored = saved.get("stored", {}).get("a/0", {}).get("out")
            if resume == "below":  # as if a second sink had acknowledged only up to kept + 3
                saved["streams"]["a/0"]["seq"] = kept + 3
                saved["streams"]["a/0"].pop("ts", None), saved["streams"]["a/0"].pop("crc", None)
                (tmp_path / "cp.json").write_text(json.dumps(saved))
            if restart != "intact":
                client = await restarted(forgetful_redis, client)
                assert await top_seq(client, key) == (kept if kept >= 0 else None)
            await run_settled(cfg, engine, client, prefix, 5)
            back = await read_redis(forgetful_redis.url, [key])
            present = [seq for _, _, seq, _, kind in back.rows if kind not in ("SourceReset", "EventsLost")]
            if restart == "intact":
                assert not back.lost, back.lost
                assert len(set(back.rows)) == len(back.rows) and set(present) == set(range(engine.last_seq + 1))
            elif resume == "below":
                assert [x for x in back.lost if x[3].startswith("sink_lost")] == [(0, kept + 1, kept + 3, "sink_lost:out")]
                assert set(present) == set(range(engine.last_seq + 1)) - set(range(kept + 1, kept + 4))
            else:
                lost_exactly(back, kept, acknowledged, engine.last_seq)
            assert stored is not None and stored[1] == acknowledged + 1, stored  # (a slot is seq + 1)
        finally:
            await client.aclose()
            (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("how", "mode", "quiet"),
    [
        ("deleted", "file", 0),
        ("trimmed", "file", 0),
        ("deleted", "from_sinks", 0),
        ("deleted", "file", 2),
        ("deleted", "from_sinks", 2),
    ],
)
async def test_a_state_sinks_stream_key_emptied_while_no_bridge_ran_is_announced_at_the_next_start(
    tmp_path: Path, redis_server: RedisServer, how: str, mode: str, quiet: int
) -> None:
    """breaker82 B2 (I6): a sink with state, its stream key deleted (or trimmed to nothing) while no
    bridge ran, the state hash intact. The start check found "cannot tell" (the state not behind),
    and the next bridge wrote on: the entries lost were never announced, 3 of 3. The bridge never
    empties a key itself, so an empty one lost its entries (announced at start, the state cleared);
    a key gone cannot tell by itself (batches with no event leave no entry, a template may have
    changed: breaker85 B1, B5), and the checkpoint's mark of what the sink stored there decides at
    the first write: announced (sink_lost) ahead of the stream's next records. breaker96 N2: after
    ``quiet`` runs that wrote nothing (the sink not told the mark: it read its state back), the
    first of them had dropped the mark at its first save, and the loss went unannounced (8 of 8)."""
    prefix = f"kvk{how[0]}{mode[0]}{quiet}"
    live, rep = free_port(), free_port()
    checkpoint = {"path": str(tmp_path / "cp.json"), "interval": "100ms", "from_sinks": mode == "from_sinks"}
    cfg = in_process(tmp_path, [("a", live, rep)], sink(redis_server.url, prefix), checkpoint=checkpoint)
    client = aioredis.Redis.from_url(redis_server.url)
    key = f"{prefix}:a:0"
    try:
        async with CacheEngine(live, rep, seed=14) as engine:
            await run_settled(cfg, engine, client, prefix, 10)
            acknowledged = engine.last_seq
            for _ in range(quiet):
                idle = Bridge(cfg)
                await idle.start()
                try:
                    await wait_for(lambda b=idle: b.store.saved_at is not None, what="a save of the quiet run")
                finally:
                    await idle.stop()
            if how == "deleted":
                await client.delete(key)
            else:
                await client.xtrim(key, maxlen=0)
            await run_settled(cfg, engine, client, prefix, 5)
        back = await read_redis(redis_server.url, [key])
        lost_exactly(back, -1, acknowledged, engine.last_seq)
        state = await bootstrapped(client, prefix, "a")
        check(state, engine, complete=state.complete)  # cleared (at the stream's next record), or exact: never wrong
    finally:
        await client.delete(key, f"{key}:state")
        await client.aclose()


@pytest.mark.parametrize("case", ["empty_batches", "empty_batches_from_sinks", "key_renamed", "key_renamed_from_sinks"])
async def test_a_state_sinks_stream_key_that_never_held_entries_is_no_loss(
    tmp_path: Path, redis_server: RedisServer, case: str
) -> None:
    """breaker85 B1, B5: a state sink whose stream key is missing while its state hash is there was
    taken for one whose entries were deleted, and 0..N announced lost (the state cleared) though
    Redis lost nothing: batches with no event leave no entry at event granularity (5 of 5), and a
    changed stream template renders a key never written (6 of 6). A missing key cannot tell; the
    checkpoint's mark (none for a key without entries, another key's for a new template) decides."""
    prefix = f"kvz{case[0]}{case[-1]}"
    live, rep = free_port(), free_port()
    checkpoint = {"path": str(tmp_path / "cp.json"), "interval": "100ms", "from_sinks": case.endswith("from_sinks")}
    first_sink = sink(
        redis_server.url, prefix, granularity="event", state={"enabled": True, "key": f"{prefix}:{{source}}:{{dp_rank}}:state"}
    )
    second_sink = {**first_sink, "stream": f"{prefix}n:{{source}}:{{dp_rank}}"} if case.startswith("key_renamed") else first_sink
    client = aioredis.Redis.from_url(redis_server.url)
    key = second_sink["stream"].format(source="a", dp_rank=0)
    try:
        async with CacheEngine(live, rep, seed=16) as engine:
            first = Bridge(in_process(tmp_path, [("a", live, rep)], first_sink, checkpoint=checkpoint))
            await first.start()
            try:
                await engine.wait_subscribed()
                if case.startswith("empty_batches"):
                    for _ in range(3):
                        await engine.send([])
                    await _state_at(client, f"{prefix}:a:0:state", engine.last_seq)
                else:
                    await engine.step(5)
                    await settled(client, prefix, engine, "a")
            finally:
                await first.stop()
            again = in_process(tmp_path, [("a", live, rep)], second_sink, checkpoint=checkpoint)
            await run_settled(again, engine, client, key.rsplit(":", 2)[0], 3)
        back = await read_redis(redis_server.url, [key])
        assert not [x for x in back.lost if x[3].startswith("sink_lost")], back.lost
    finally:
        await client.delete(f"{prefix}:a:0", f"{prefix}n:a:0", f"{prefix}:a:0:state")
        await client.aclose()


async def test_an_events_only_key_emptied_while_no_bridge_ran_is_announced_with_from_sinks(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """breaker85 B6: a sink without state, checkpoint.from_sinks and a checkpoint file; its stream
    key emptied (XTRIM MAXLEN 0) while no bridge ran. The key read back empty "cannot tell", so the
    checkpoint's mark was not checked, and 0..4 were gone unannounced (3 of 3). An empty key's
    entries were deleted: its mark is checked."""
    live, rep = free_port(), free_port()
    checkpoint = {"path": str(tmp_path / "cp.json"), "interval": "100ms", "from_sinks": True}
    cfg = in_process(tmp_path, [("a", live, rep)], sink(redis_server.url, "kvx", state={"enabled": False}), checkpoint=checkpoint)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        async with CacheEngine(live, rep, seed=17) as engine:
            await run_settled(cfg, engine, client, "kvx", 5)
            acknowledged = engine.last_seq
            await client.xtrim("kvx:a:0", maxlen=0)
            await run_settled(cfg, engine, client, "kvx", 5)
        lost_exactly(await read_redis(redis_server.url, ["kvx:a:0"]), -1, acknowledged, engine.last_seq)
    finally:
        await client.delete("kvx:a:0")
        await client.aclose()


async def _state_at(client: aioredis.Redis, state_key: str, seq: int) -> None:
    """Until the state hash's head is at ``seq``."""
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        head = await client.hget(state_key, "_head")
        if head is not None and json.loads(head)["seq"] == seq:
            return
        assert asyncio.get_running_loop().time() < deadline, f"{state_key}: the state did not reach seq {seq}"
        await asyncio.sleep(0.05)


async def test_a_mark_of_another_key_is_not_taken_for_a_loss(tmp_path: Path, forgetful_redis: RedisServer) -> None:
    """breaker84 B2: the sink's stream template changed between runs (same sink name): the mark the
    checkpoint kept of the old key was checked against the new one, and its 0..9 announced lost
    (sink_lost) though the old key held them all, 5 of 5. A mark names its key."""
    live, rep = free_port(), free_port()
    checkpoint = {"path": str(tmp_path / "cp.json"), "interval": "100ms"}
    old = sink(forgetful_redis.url, "kvo", state={"enabled": False})
    new = {**old, "stream": "kvn:{source}:{dp_rank}"}
    client = aioredis.Redis.from_url(forgetful_redis.url)
    try:
        async with CacheEngine(live, rep, seed=15) as engine:
            await run_settled(in_process(tmp_path, [("a", live, rep)], old, checkpoint=checkpoint), engine, client, "kvo", 10)
            await run_settled(in_process(tmp_path, [("a", live, rep)], new, checkpoint=checkpoint), engine, client, "kvn", 5)
        back = await read_redis(forgetful_redis.url, ["kvn:a:0"])
        assert not back.lost, back.lost
    finally:
        await client.aclose()


@pytest.mark.parametrize("mkstream", [False, True])
async def test_a_key_a_consumer_created_empty_is_not_taken_for_deleted_entries(
    tmp_path: Path, redis_server: RedisServer, mkstream: bool
) -> None:
    """breaker88 B3: the stream template changed between runs (kvm -> kvn, the state key kept). A
    consumer's usual ``XGROUP CREATE kvn:a:0 g $ MKSTREAM`` made the new key exist, empty, which the
    next start read as entries deleted: 0..9 announced lost (sink_lost) and the state cleared,
    incomplete, while kvm:a:0 held them all (3 of 3). A key no entry was ever added to (XINFO
    entries-added 0) tells no more than a missing one."""
    prefix = f"kvm{int(mkstream)}"
    live, rep = free_port(), free_port()
    old = {**sink(redis_server.url, prefix), "state": {"enabled": True, "key": f"{prefix}s:{{source}}:{{dp_rank}}"}}
    new = {**old, "stream": prefix + "n:{source}:{dp_rank}"}
    checkpoint = {"path": str(tmp_path / "cp.json"), "interval": "100ms"}
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        async with CacheEngine(live, rep, seed=21) as engine:
            await run_settled(in_process(tmp_path, [("a", live, rep)], old, checkpoint=checkpoint), engine, client, prefix, 10)
            if mkstream:
                await client.xgroup_create(f"{prefix}n:a:0", "g", "$", mkstream=True)
            await run_settled(
                in_process(tmp_path, [("a", live, rep)], new, checkpoint=checkpoint), engine, client, prefix + "n", 5
            )
            back = await read_redis(redis_server.url, [f"{prefix}n:a:0"])
            assert not back.lost, back.lost
            state, _ = await bootstrap(client, f"{prefix}s:a:0", f"{prefix}n:a:0")
            check(state, engine)
    finally:
        await client.delete(f"{prefix}:a:0", f"{prefix}n:a:0", f"{prefix}s:a:0")
        await client.aclose()


@pytest.mark.parametrize("sinks", ["one", "two", "one_without_state"])
async def test_an_older_epochs_lost_tail_is_announced_at_start_to_the_sink_that_lost_it(
    tmp_path: Path, forgetful_redis: RedisServer, redis_server: RedisServer, sinks: str
) -> None:
    """Issue 29 (breaker37 B2, B3): epoch E0's seqs 0..4, a SAVE, 5..9; the engine restarts (E1 0..9);
    the bridge stops, and Redis comes back from the SAVE. Before, only E1 0..9 was announced (E0
    5..9 never), and with a second, intact state sink nothing at all (the sinks' heads disagree).
    Now the sink that lost them gets both spans, in order; the intact one gets none. breaker84 B1:
    so does a sink without state (the checkpoint's mark of what it stored names each epoch's end)."""
    prefix = f"kvt{sinks[0]}{sinks[-1]}"
    live, rep = free_port(), free_port()
    intact = {**sink(redis_server.url, prefix), "name": "out2"}
    lossy = sink(forgetful_redis.url, prefix, **({"state": {"enabled": False}} if sinks == "one_without_state" else {}))
    cfg = in_process(tmp_path, [("a", live, rep)], lossy, checkpoint={"path": str(tmp_path / "cp.json"), "interval": "100ms"},
                     sinks=[lossy, intact] if sinks == "two" else [lossy])  # fmt: skip
    client = aioredis.Redis.from_url(forgetful_redis.url)
    key = f"{prefix}:a:0"
    async with CacheEngine(live, rep, seed=6) as engine:
        try:
            first = Bridge(cfg)
            await first.start()
            try:
                await engine.wait_subscribed()
                await engine.step(5)
                await settled(client, prefix, engine, "a")
                await client.save()  # Redis comes back with E0 0..4
                await engine.step(5)
                await settled(client, prefix, engine, "a")
                e0 = int((await client.xrevrange(key, "+", "-", count=1))[0][1][b"epoch"])
                await engine.restart()
                await engine.wait_subscribed()
                await engine.step(10)

                async def in_e1_at(seq: int) -> None:
                    deadline = asyncio.get_running_loop().time() + 20
                    while True:
                        last = (await client.xrevrange(key, "+", "-", count=1))[0][1]
                        if int(last[b"epoch"]) != e0 and int(last[b"seq"]) == seq:
                            return
                        assert asyncio.get_running_loop().time() < deadline, f"{key}: E1 seq {seq} not written"
                        await asyncio.sleep(0.05)

                await in_e1_at(9)
                e1 = int((await client.xrevrange(key, "+", "-", count=1))[0][1][b"epoch"])
            finally:
                await first.stop()
            client = await restarted(forgetful_redis, client)
            second = Bridge(cfg)
            await second.start()
            try:
                await engine.wait_subscribed()
                await engine.step(5)
                await in_e1_at(engine.last_seq)
            finally:
                await second.stop()
            back = await read_redis(forgetful_redis.url, [key])
            lost = [(epoch, seq) for _, epoch, seq, _, kind in back.rows if kind == "EventsLost"]
            assert lost == [(e0, 9), (e1, 9)], lost  # (an EventsLost stands at its to_seq)
            assert back.lost == [(0, 5, 9, "sink_lost:out"), (0, 0, 9, "sink_lost:out")]
            if sinks == "two":
                assert not (await read_redis(redis_server.url, [key])).lost  # the intact sink lost nothing
                check(await bootstrapped(client, prefix, "a"), engine, complete=False)
        finally:
            await client.aclose()
            (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)
            other = aioredis.Redis.from_url(redis_server.url)
            await other.delete(key, f"{key}:state")
            await other.aclose()


@pytest.mark.parametrize("how", ["deleted", "toggled"])
async def test_a_state_lost_alone_while_no_bridge_ran_is_cleared_and_no_record_announced_lost(
    tmp_path: Path, redis_server: RedisServer, how: str
) -> None:
    """breaker39 B1: the state hash alone deleted (or evicted) while no bridge ran, or not written
    for a run (state.enabled off): every record stays in the stream key. The start check took the
    missing or behind hash for lost records and told the sink's consumers EventsLost (sink_lost)
    for batches it still held (I4, I6). Now it asks the sink what it holds: the state starts a new
    generation, incomplete, and nothing is announced."""
    prefix = f"kvg{how[0]}"
    live, rep = free_port(), free_port()
    checkpoint = {"path": str(tmp_path / "cp.json"), "interval": "100ms"}
    on = in_process(tmp_path, [("a", live, rep)], sink(redis_server.url, prefix), checkpoint=checkpoint)
    plain = {k: v for k, v in sink(redis_server.url, prefix).items() if k != "state"}
    off = in_process(tmp_path, [("a", live, rep)], plain, checkpoint=checkpoint)
    client = aioredis.Redis.from_url(redis_server.url)
    key = f"{prefix}:a:0"
    async with CacheEngine(live, rep, seed=7) as engine:
        try:
            for run, config in enumerate([on, off, on] if how == "toggled" else [on, on]):
                await run_settled(config, engine, client, prefix, 10)
                if how == "deleted" and run == 0:
                    assert await client.delete(f"{key}:state") == 1
            back = await read_redis(redis_server.url, [key])
            assert {seq for _, _, seq, _, kind in back.rows if kind not in CONTROL} == set(range(engine.last_seq + 1))
            assert not back.lost, back.lost
            check(await bootstrapped(client, prefix, "a"), engine, complete=False)
        finally:
            await remove_keys(client, prefix)
            await client.aclose()


async def test_a_loss_on_a_quiet_stream_is_announced_without_waiting_for_its_next_batch(
    tmp_path: Path, forgetful_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 B2: Redis restarts from an older snapshot while the engine is quiet. Before, nothing
    looked until the stream's next write: the lost seqs went unannounced and the state hash, back
    from the snapshot, said complete: true over blocks the engine had removed. Now the sink's audit
    (between writes, every AUDIT_INTERVAL) finds it: the EventsLost comes with no engine traffic,
    and the hash is emptied (no state rather than a wrong one) until the next generation."""
    import bridge.sink

    monkeypatch.setattr(bridge.sink, "AUDIT_INTERVAL", 0.3, raising=False)
    monkeypatch.setattr(bridge.sink, "HEALTH_INTERVAL", 0.3)
    prefix = "kvq"
    live, rep = free_port(), free_port()
    cfg = in_process(tmp_path, [("a", live, rep)], sink(forgetful_redis.url, prefix, retry={"initial_backoff": "20ms"}))
    client = aioredis.Redis.from_url(forgetful_redis.url)
    async with CacheEngine(live, rep, seed=11) as engine:
        bridge_ = Bridge(cfg)
        await bridge_.start()
        try:
            await engine.wait_subscribed()
            kept, acknowledged = await around_a_snapshot(client, prefix, engine)
            check(await bootstrapped(client, prefix, "a"), engine)
            client = await restarted(forgetful_redis, client)
            assert await top_seq(client, f"{prefix}:a:0") == kept
            stale = await bootstrapped(client, prefix, "a")
            assert stale.complete and Counter(stale.blocks()) != truth(engine)  # what the snapshot brought back

            async def announced() -> bool:
                back = await read_redis(forgetful_redis.url, [f"{prefix}:a:0"])
                return any(x[3].startswith("sink_lost") for x in back.lost)

            deadline = asyncio.get_running_loop().time() + 15
            while not await announced():  # the engine stays quiet
                assert asyncio.get_running_loop().time() < deadline, "the loss was not announced while the stream was quiet"
                await asyncio.sleep(0.1)
            back = await read_redis(forgetful_redis.url, [f"{prefix}:a:0"])
            assert [x for x in back.lost if x[3].startswith("sink_lost")] == [(0, kept + 1, acknowledged, "sink_lost:out")]
            assert await client.exists(f"{prefix}:a:0:state") == 0
            check(await bootstrapped(client, prefix, "a"), engine, complete=False)
            await engine.step(10)  # the stream goes on: a new generation, incomplete, never a false block
            await settled(client, prefix, engine, "a")
            check(await bootstrapped(client, prefix, "a"), engine, complete=False)
        finally:
            await bridge_.stop()
            await client.aclose()
            (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)


async def test_a_deleted_state_hash_is_never_rebuilt_partial_and_complete(
    tmp_path: Path, redis_server: RedisServer, client: Any
) -> None:
    """The state hash is deleted (or evicted) mid-run. The bridge applied the next changes to the
    empty hash, whose head said complete: true over a few blocks. Now the change is refused
    (state_lost: the hash is emptied, the runtime opens a new generation, incomplete): a
    bootstrap is incomplete with no block the engine lacks, or exact."""
    prefix = f"kvd{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    cfg = in_process(tmp_path, [("a", live, rep)], sink(redis_server.url, prefix))
    async with CacheEngine(live, rep, seed=12) as engine:
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            await engine.wait_subscribed()
            await engine.step(15)
            await settled(client, prefix, engine, "a")
            check(await bootstrapped(client, prefix, "a"), engine)
            assert await client.delete(f"{prefix}:a:0:state") == 1
            for _ in range(3):
                await engine.step(5)
                await settled(client, prefix, engine, "a")
                state = await bootstrapped(client, prefix, "a")
                check(state, engine, complete=state.complete)
            assert not state.complete
        finally:
            await bridge.stop()
            await remove_keys(client, prefix)


@pytest.mark.parametrize("restart", ["empty", "snapshot", "snapshot, then an engine restart"])
async def test_the_write_after_redis_lost_entries_raises_sink_lost_with_the_span(
    forgetful_redis: RedisServer, restart: str
) -> None:
    """The connector's part, without the runtime: the first write after Redis lost seqs it stored
    raises SinkLost with exactly the lost spans (in the epoch before the last one too, when the
    engine restarted since the snapshot), storing nothing; the next write goes through."""
    from bridge.config import SinkConfig
    from bridge.errors import NotConnected, SinkLost
    from bridge.formats import Renderer
    from connectors.redis import RedisConnector, RedisOptions
    from tests.support.records import batch

    s = SinkConfig(type="redis", name="r", format="json", granularity="batch")
    renderer, stream = Renderer(s.format, s.granularity), Stream("a", 0)
    records = [batch(stream, q, epoch=3) for q in range(13)]
    spans = [(stream, 3, 0, 11)]
    if restart == "snapshot, then an engine restart":  # seqs 10-12 are epoch 4's 0-2, after its SourceReset
        records[10:] = [source_reset(stream, 4, "publisher_restart", 0.0), *(batch(stream, q, epoch=4) for q in range(3))]
        spans = [(stream, 3, 5, 9), (stream, 4, 0, 1)]
    elif restart == "snapshot":
        spans = [(stream, 3, 5, 11)]
    conn = RedisConnector("r", msgspec.convert({"url": forgetful_redis.url}, RedisOptions), s)
    client = aioredis.Redis.from_url(forgetful_redis.url)
    try:
        await conn.connect()
        await conn.write([m for r in records[:5] for m in renderer.render(r)])
        if restart != "empty":
            await client.save()  # seqs 0-4 of epoch 3
        await conn.write([m for r in records[5:-1] for m in renderer.render(r)])
        kept = await client.xrange("kv:a:0")
        await client.aclose()
        await forgetful_redis.akill()
        await forgetful_redis.astart()
        client = aioredis.Redis.from_url(forgetful_redis.url)
        later = renderer.render(records[-1])
        with pytest.raises(SinkLost) as info:
            for _ in range(3):  # the first, on the connection the restart closed: NotConnected
                with contextlib.suppress(NotConnected):
                    await conn.write(later)
        assert info.value.spans == spans, info.value.spans
        assert "appendonly yes" in str(info.value), info.value
        held = await client.xrange("kv:a:0")
        assert held == ([] if restart == "empty" else kept[:5])  # nothing stored by the refused write
        await conn.write(later)
        after = await client.xrange("kv:a:0")
        assert after[:-1] == held and int(after[-1][1][b"seq"]) == records[-1].seq
    finally:
        await conn.close()
        await client.aclose()
        (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)


async def test_a_server_that_may_lose_the_state_is_warned_about_at_connect_and_in_check(
    tmp_path: Path, forgetful_redis: RedisServer, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """With state.enabled, a server without AOF or evicting any key at maxmemory would lose the
    state the bridge builds on: connect (and so ``--check``) logs one WARNING per problem naming
    the consequence and the fix, and so does a health check that finds it so later. A server with
    AOF and noeviction, or a sink without state, none."""
    from bridge.cli import check
    from bridge.config import SinkConfig
    from connectors.redis import RedisConnector, RedisOptions

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "connectors.redis"]

    async def connect(url: str, state: bool) -> None:
        options = msgspec.convert({"url": url, "state": {"enabled": state}}, RedisOptions)
        conn = RedisConnector("r", options, SinkConfig(type="redis", name="r"))
        try:
            await conn.connect()
            await conn.connect()  # a reconnect warns no more
        finally:
            await conn.close()

    admin = aioredis.Redis.from_url(forgetful_redis.url)
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with caplog.at_level("WARNING", logger="connectors.redis"):
            await connect(redis_server.url, True)  # AOF, noeviction
            await connect(forgetful_redis.url, False)  # no state
            assert warnings() == []
            await connect(forgetful_redis.url, True)
            lines = warnings()
            assert len(lines) == 2, lines
            assert "appendonly no" in lines[0] and "set appendonly yes" in lines[0], lines[0]
            assert "allkeys-lru" in lines[1] and "set maxmemory-policy noeviction" in lines[1], lines[1]
            caplog.clear()
            path = tmp_path / "bridge.yaml"
            sink_entry = {"type": "redis", "name": "out", "url": forgetful_redis.url, "state": {"enabled": True}}
            source = {"name": "a", "endpoint": f"tcp://127.0.0.1:{free_port()}", "bind": True}  # nothing to probe
            path.write_text(json.dumps({"sources": [source], "sinks": [sink_entry]}))
            assert await asyncio.to_thread(check, str(path)) == 0  # warned, not refused
            assert len(warnings()) == 2, warnings()
            # Turned on during the run (breaker31k): the next health check warns, once.
            caplog.clear()
            options = msgspec.convert({"url": redis_server.url, "state": {"enabled": True}}, RedisOptions)
            conn = RedisConnector("r", options, SinkConfig(type="redis", name="r"))
            good = aioredis.Redis.from_url(redis_server.url)
            try:
                await conn.connect()
                assert await conn.health() is None and warnings() == []
                await good.config_set("maxmemory-policy", "allkeys-lfu")
                assert await conn.health() is None  # warned, not refused
                assert await conn.health() is None
                lines = warnings()
                assert len(lines) == 1 and "allkeys-lfu" in lines[0], lines
            finally:
                await good.config_set("maxmemory-policy", "noeviction")
                await good.aclose()
                await conn.close()
    finally:
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.aclose()


async def test_a_restarted_bridge_checks_the_state_it_read_back(redis_server: RedisServer, client: Any) -> None:
    """A connector that read the state back (a restarted bridge's rebuild) expects it at its first
    write: the hash deleted in between is found lost (state_lost), emptied, never built on."""
    from bridge.config import SinkConfig
    from bridge.errors import PartialFailure, Permanent
    from bridge.formats import Renderer, state_message
    from bridge.state import StateTracker
    from connectors.redis import RedisConnector, RedisOptions

    prefix = f"kvb{uuid.uuid4().hex[:8]}"
    options = {"url": redis_server.url, "stream": prefix + ":{source}:{dp_rank}", "state": {"enabled": True}}
    options["state"]["key"] = prefix + ":{source}:{dp_rank}:s"

    def connector() -> RedisConnector:
        return RedisConnector("r", msgspec.convert(options, RedisOptions), SinkConfig(type="redis", name="r"))

    tracker, renderer, stream = StateTracker(), Renderer("json", "batch"), Stream("a", 0)

    def record(seq: int) -> list[Any]:
        store = {"type": "BlockStored", "block_hashes": [seq], "medium": "GPU", "token_ids": [], "block_size": 1}
        r = Record(stream=stream, epoch=1, seq=seq, ts=1.0, events=[store])
        r.state = tracker.apply(r)
        return [*renderer.render(r), state_message(r)]

    first, second = connector(), connector()
    try:
        await first.write(record(0) + record(1))
        assert (await second.read_state([stream]))[stream.key] is not None
        await client.delete(prefix + ":a:0:s")
        with pytest.raises(PartialFailure) as info:
            await second.write(record(2))
        assert {i: (type(e), e.reason) for i, e in info.value.errors.items()} == {1: (Permanent, "state_lost")}
        assert await client.exists(prefix + ":a:0:s") == 0
        assert await client.xlen(prefix + ":a:0") == 3
    finally:
        await first.close()
        await second.close()
        await remove_keys(client, prefix)


async def test_a_restart_without_persistence_announces_every_epoch_it_held(forgetful_redis: RedisServer) -> None:
    """Breaker find (a crash loop): epochs 3 (seqs 0-4), 4 (seq 0) and 5 (seqs 0-2) stored, then
    Redis restarts empty: each epoch's span is announced, not the two newest alone."""
    from bridge.config import SinkConfig
    from bridge.errors import NotConnected, SinkLost
    from bridge.formats import Renderer
    from connectors.redis import RedisConnector, RedisOptions
    from tests.support.records import batch

    s = SinkConfig(type="redis", name="r", format="json", granularity="batch")
    renderer, stream = Renderer(s.format, s.granularity), Stream("a", 0)
    records = [batch(stream, q, epoch=3) for q in range(5)]
    records += [source_reset(stream, 4, "publisher_restart", 0.0), batch(stream, 0, epoch=4)]
    records += [source_reset(stream, 5, "publisher_restart", 0.0), *(batch(stream, q, epoch=5) for q in range(3))]
    conn = RedisConnector("r", msgspec.convert({"url": forgetful_redis.url}, RedisOptions), s)
    try:
        await conn.connect()
        await conn.write([m for r in records for m in renderer.render(r)])
        await forgetful_redis.akill()
        await forgetful_redis.astart()
        with pytest.raises(SinkLost) as info:
            for _ in range(3):  # the first, on the connection the restart closed: NotConnected
                with contextlib.suppress(NotConnected):
                    await conn.audit()
        assert sorted(info.value.spans) == [(stream, 3, 0, 4), (stream, 4, 0, 0), (stream, 5, 0, 2)]
    finally:
        await conn.close()


@pytest.mark.parametrize("after", [False, True], ids=["last", "then a batch"])
async def test_an_announcement_lost_after_its_batch_is_announced_again(forgetful_redis: RedisServer, after: bool) -> None:
    """Found by the invariant breaker (B3): a refusal's EventsLost stands in the slot of the last
    batch of its write; a snapshot taken between that batch and the announcement lost only the
    announcement, and the span computed per slot was empty: nothing was announced again. Then
    (second round) batch 4 was announced instead, which Redis held, and seq 2 never again; and
    (third round) with a batch stored after the announcement and lost with it, seq 2 was not."""
    from bridge.config import SinkConfig
    from bridge.errors import NotConnected, SinkLost
    from bridge.formats import Renderer
    from connectors.redis import RedisConnector, RedisOptions
    from tests.support.records import batch

    s = SinkConfig(type="redis", name="r", format="json", granularity="batch")
    renderer, stream = Renderer(s.format, s.granularity), Stream("a", 0)
    refusal = events_lost(stream, 3, 2, 2, "sink_refused:r", 0.0)
    refusal.seq, refusal.to_seq = 4, 2  # seq 2 refused, announced after batch 4 (stored by the same write)
    conn = RedisConnector("r", msgspec.convert({"url": forgetful_redis.url}, RedisOptions), s)
    client = aioredis.Redis.from_url(forgetful_redis.url)
    try:
        await conn.connect()
        await conn.write([m for q in (0, 1, 3, 4) for m in renderer.render(batch(stream, q, epoch=3))])
        await client.save()  # the batches, not the announcement
        await conn.write(renderer.render(refusal))
        if after:
            await conn.write(renderer.render(batch(stream, 5, epoch=3)))
        await client.aclose()
        await forgetful_redis.akill()
        await forgetful_redis.astart()
        client = aioredis.Redis.from_url(forgetful_redis.url)
        with pytest.raises(SinkLost) as info:
            for _ in range(3):  # the first, on the connection the restart closed: NotConnected
                with contextlib.suppress(NotConnected):
                    await conn.write(renderer.render(batch(stream, 6, epoch=3)))
        # The lost announcement again, as it was (seq 2, not batch 4, which Redis still holds: I4),
        # standing where it stood, after batch 4 (an id below the top would be refused); and the
        # batch after it, when there was one.
        assert info.value.spans == [(stream, 3, 2, 2)] + ([(stream, 3, 5, 5)] if after else [])
        assert info.value.at == {(stream.key, 3, 2, 2): 4}
    finally:
        await conn.close()
        await client.aclose()
        (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)


async def test_an_announcement_lost_with_its_batch_is_not_hidden_by_the_batchs_own(forgetful_redis: RedisServer) -> None:
    """Breaker find (D1): the snapshot held batches 0, 1 and 3, not batch 4 nor the refusal of seq 2
    announced after it. Both are announced again, the refusal right after the top (at the slot of
    batch 4 it would have the id of batch 4's own announcement, and be taken as there already)."""
    from bridge.config import SinkConfig
    from bridge.errors import NotConnected, SinkLost
    from bridge.formats import Renderer
    from connectors.redis import RedisConnector, RedisOptions
    from tests.support.records import batch

    s = SinkConfig(type="redis", name="r", format="json", granularity="batch")
    renderer, stream = Renderer(s.format, s.granularity), Stream("a", 0)
    refusal = events_lost(stream, 3, 2, 2, "sink_refused:r", 0.0)
    refusal.seq, refusal.to_seq = 4, 2
    conn = RedisConnector("r", msgspec.convert({"url": forgetful_redis.url}, RedisOptions), s)
    client = aioredis.Redis.from_url(forgetful_redis.url)
    try:
        await conn.connect()
        await conn.write([m for q in (0, 1, 3) for m in renderer.render(batch(stream, q, epoch=3))])
        await client.save()
        await conn.write([*renderer.render(batch(stream, 4, epoch=3)), *renderer.render(refusal)])
        await client.aclose()
        await forgetful_redis.akill()
        await forgetful_redis.astart()
        client = aioredis.Redis.from_url(forgetful_redis.url)
        with pytest.raises(SinkLost) as info:
            for _ in range(3):  # the first, on the connection the restart closed: NotConnected
                with contextlib.suppress(NotConnected):
                    await conn.write(renderer.render(batch(stream, 5, epoch=3)))
        assert info.value.spans == [(stream, 3, 2, 2), (stream, 3, 4, 4)]
        assert info.value.at == {(stream.key, 3, 2, 2): 3}  # right after batch 3, the top
    finally:
        await conn.close()
        await client.aclose()
        (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)


async def test_a_bridge_restarted_after_redis_lost_what_it_acknowledged_gives_it_back(
    tmp_path: Path, forgetful_redis: RedisServer, client: Any
) -> None:
    """Found by the invariant breaker (B4): the bridge stops with its checkpoint at seq 19; Redis
    (no AOF) comes back from a snapshot at seq 9; the bridge starts again. With
    ``checkpoint.from_sinks`` it reads what Redis holds, sees it below the checkpoint, and resumes
    that sink from there: the engine's replay buffer gives it back (before: seqs 10-19 missing,
    nothing announced, the state rebuilt from the snapshot and resumed at 20, marked complete)."""
    del client  # the session's Redis: this test runs its own
    prefix = f"kvg{uuid.uuid4().hex[:8]}"
    live, rep = free_port(), free_port()
    cfg = in_process(
        tmp_path,
        [("a", live, rep)],
        sink(forgetful_redis.url, prefix),
        checkpoint={"path": str(tmp_path / "ckpt.json"), "interval": "200ms", "from_sinks": True},
    )
    redis = aioredis.Redis.from_url(forgetful_redis.url)
    try:
        async with CacheEngine(live, rep, seed=5) as engine:
            bridge = Bridge(cfg)
            await bridge.start()
            try:
                await engine.wait_subscribed()
                await engine.step(10)
                await settled(redis, prefix, engine, "a")
                await redis.save()  # the snapshot: seqs 0-9
                await engine.step(10)
                await settled(redis, prefix, engine, "a")
            finally:
                await bridge.stop()  # the checkpoint says 19
            await redis.aclose()
            await forgetful_redis.akill()
            await forgetful_redis.astart()
            redis = aioredis.Redis.from_url(forgetful_redis.url)
            assert await top_seq(redis, f"{prefix}:a:0") == 9
            bridge = Bridge(cfg)
            await bridge.start()
            try:
                await engine.wait_subscribed()
                await engine.step(5)
                await settled(redis, prefix, engine, "a")
                back = await read_redis(forgetful_redis.url, [f"{prefix}:a:0"])
                seqs = sorted({seq for _, _, seq, _, kind in back.rows if kind not in CONTROL})
                assert seqs == list(range(engine.last_seq + 1)) and not back.lost
                check(await bootstrapped(redis, prefix, "a"), engine)  # complete and equal to the engine's cache
            finally:
                await bridge.stop()
    finally:
        await redis.aclose()
        (forgetful_redis.workdir / "data" / "dump.rdb").unlink(missing_ok=True)


@pytest.mark.parametrize("design", ["vllm-57789", "vllm-50134", "sglang-34407"])
async def test_a_stream_met_mid_epoch_is_seeded_from_an_engine_snapshot(
    tmp_path: Path, redis_server: RedisServer, client: Any, design: str
) -> None:
    """Engine snapshots (experimental): the scenario of tests/support/snapshots.py on Redis; the
    stream holds the StateSeeded record after the seeded batch, and the seeds are counted."""
    prefix = f"kvs{uuid.uuid4().hex[:8]}"
    live, replay, snap = free_port(), free_port(), free_port()
    port = None if design == "vllm-50134" else snap
    cfg = from_data(
        {
            "sources": [snapshot_source("a", live, replay, design, port)],
            "sinks": [sink(redis_server.url, prefix)],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
            "replay": REPLAY,
            "shutdown_timeout": "3s",
        },
        env={},
    )
    async with CacheEngine(live, replay, seed=3, buffer_steps=4, snapshot=design, snapshot_port=port) as engine:  # type: ignore[arg-type]
        engine.snapshot_gate = asyncio.Event()
        await engine.step(10)  # before the bridge: more than the buffer holds
        bridge = Bridge(cfg)
        await bridge.start()
        try:

            async def state() -> StreamState:
                await settled(client, prefix, engine, "a")
                return await bootstrapped(client, prefix, "a")

            await seeded_mid_epoch_and_after_a_loss(bridge, engine, "a/0", state, truth)
            seeds = [json.loads(f[b"data"]) for _i, f in await client.xrange(f"{prefix}:a:0") if b'"StateSeeded"' in f[b"data"]]
            assert [(s["cut"], s["design"]) for s in seeds] == [(c, design) for c in engine.snapshot_cuts]
            assert bridge.metrics.snapshots.labels("a", "seeded")._value.get() == 2
        finally:
            await bridge.stop()
            await remove_keys(client, prefix)


async def test_a_refused_snapshot_leaves_the_state_incomplete_and_is_counted(
    tmp_path: Path, redis_server: RedisServer, client: Any
) -> None:
    prefix = f"kvs{uuid.uuid4().hex[:8]}"
    live, replay, snap = free_port(), free_port(), free_port()
    cfg = from_data(
        {
            "sources": [snapshot_source("a", live, replay, "auto", snap)],
            "sinks": [sink(redis_server.url, prefix)],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
            "replay": REPLAY,
            "shutdown_timeout": "3s",
        },
        env={},
    )
    async with CacheEngine(live, replay, seed=4, buffer_steps=4, snapshot="vllm-57789", snapshot_port=snap) as engine:
        engine.refuse_snapshots = True
        await engine.step(10)
        bridge = Bridge(cfg)
        await bridge.start()
        try:
            refused = bridge.metrics.snapshots.labels("a", "unavailable")
            await wait_for(lambda: refused._value.get() == 1, what="the refusal to be counted")
            for _ in range(3):
                await engine.step(1)
                await settled(client, prefix, engine, "a")
                check(await bootstrapped(client, prefix, "a"), engine, complete=False)
        finally:
            await bridge.stop()
            await remove_keys(client, prefix)


@pytest.mark.parametrize(("buffer", "checkpoint", "restart"), [(5, "file", False), (10_000, "none", True)])
async def test_a_redis_sink_restored_alone_is_told_from_its_first_missing_batch_and_the_intact_one_nothing(
    tmp_path: Path, fresh_redis: RedisServer, buffer: int, checkpoint: str, restart: bool
) -> None:
    """breaker49 B2: two Redis state sinks at event granularity under checkpoint.from_sinks; sink A's
    stream and state are restored to seq 7 while no bridge runs (B is intact), the engine buffering
    its last 5 batches, or restarted meanwhile. Redis stores a batch's entries all or none, yet its
    last entry (an event index) was taken for a batch held in part: A was told 7.. lost though it
    holds 7 whole, and intact B was told its last batch lost. Now each is told only what it lacks."""
    uid = uuid.uuid4().hex[:6]
    live, rep = free_port(), free_port()
    sinks = [{**sink(fresh_redis.url, f"{n}{uid}"), "name": f"r{n}", "granularity": "event"} for n in ("a", "b")]
    path = str(tmp_path / "cp.json") if checkpoint == "file" else None
    cfg = in_process(tmp_path, [("a", live, rep)], sinks[0], sinks=sinks, replay={**REPLAY, "max_attempts": 3},
                     checkpoint={"path": path, "interval": "100ms", "from_sinks": True})  # fmt: skip
    ka, kb = f"a{uid}:a:0", f"b{uid}:a:0"
    client = aioredis.Redis.from_url(fresh_redis.url)
    try:
        async with CacheEngine(live, rep, seed=7, buffer_steps=buffer) as engine:
            first = Bridge(cfg)
            await first.start()
            try:
                await engine.wait_subscribed()
                await engine.step(8, events_per_batch=3)
                await all_at(client, [ka, kb], 7)
                snapshot = {k: await client.dump(k) for k in (ka, ka + ":state")}
                await engine.step(12, events_per_batch=3)
                epoch = await all_at(client, [ka, kb], 19)
            finally:
                await first.stop()
            for k, v in snapshot.items():
                await client.restore(k, 0, v, replace=True)
            if restart:
                await engine.restart()
                await engine.step(2, events_per_batch=3)
            second = Bridge(cfg)
            await second.start()
            try:
                await engine.wait_subscribed()
                await engine.step(3, events_per_batch=3)
                await all_at(client, [ka, kb], engine.last_seq, epoch if restart else epoch - 1)
            finally:
                await second.stop()
        for key in (ka, kb):
            rows = [json.loads(f[b"data"]) for _, f in await client.xrange(key)]
            lost = [(r["epoch"], r["from_seq"], r["to_seq"]) for r in rows if r["type"] == "EventsLost"]
            held: dict[tuple[int, int], set[int]] = {}
            for r in rows:
                if r["type"] not in ("EventsLost", "SourceReset"):
                    held.setdefault((r["epoch"], r["seq"]), set()).add(r["index"])
            falsely = [(e, s) for e, a, b in lost for s in range(a, b + 1) if held.get((e, s)) == {0, 1, 2}]
            assert not falsely, f"{key}: told lost what it holds whole: {falsely}"
            if key == kb:
                assert not lost, f"the intact sink was told a loss: {lost}"
            state, after = await bootstrap(client, key + ":state", key)
            await follow(client, key, state, after)
            assert not state.complete or Counter(state.blocks()) == truth(engine)
    finally:
        await client.aclose()


async def all_at(client: aioredis.Redis, keys: list[str], seq: int, above: int = -1) -> int:
    """Until every stream key's last entry is at ``seq`` or past it in an epoch above ``above``
    (event granularity: read from its data); the epoch of the last one."""
    deadline = asyncio.get_running_loop().time() + 20
    epoch = -1
    for key in keys:
        while True:
            last = await client.xrevrange(key, count=1)
            data = json.loads(last[0][1][b"data"]) if last else {"epoch": -1, "seq": -1}
            if data["epoch"] > above and data["seq"] >= seq:
                break
            assert asyncio.get_running_loop().time() < deadline, f"{key}: seq {seq} never written"
            await asyncio.sleep(0.05)
        epoch = data["epoch"]
    return epoch


class _RestoredMidSweep:
    """A consumer's client whose Redis goes back to ``dump`` of ``key`` (RESTORE ... REPLACE: what a
    restart from an older snapshot leaves) right before the sweep's second HSCAN call."""

    def __init__(self, client: aioredis.Redis, key: str, dump: bytes) -> None:
        self.client, self.key, self.dump, self.calls = client, key, dump, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def hscan(self, key: str, cursor: int = 0, **kw: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            await self.client.restore(self.key, 0, self.dump, replace=True)
        return await self.client.hscan(key, cursor, **kw)


async def test_a_bootstrap_whose_state_went_back_mid_sweep_starts_over(client: Any) -> None:
    """breaker88 B4: Redis restarted from an older snapshot during a consumer's sweep. The head read
    again had the same (epoch, gen), only an older seq, so the sweep was taken: the newer head over
    entries partly of the older state; the bridge's EventsLost for what Redis lost then stood at
    that head and was skipped as a copy, and the consumer ended complete with 1,793 blocks where
    the engine held 2,284 (3 of 3). A head gone back makes the sweep start over."""
    key = f"kvback{uuid.uuid4().hex[:8]}:a:0:state"

    def entry(block: int, seq: int) -> bytes:
        return json.dumps({"epoch": 1, "gen": 1, "seq": seq, "block": f"{block:016x}", "medium": "GPU", "count": 1}).encode()

    def head(seq: int, live: int) -> bytes:
        return json.dumps(
            {"source": "a", "dp_rank": 0, "epoch": 1, "gen": 1, "seq": seq, "live": live, "complete": True}
        ).encode()

    older = {f"GPU//{b:016x}".encode(): entry(b, 10) for b in range(3000)}  # (several HSCAN calls)
    await client.hset(key, mapping={**older, b"_head": head(10, 3000)})
    try:
        dump = await client.dump(key)
        newer = {f"GPU//{b:016x}".encode(): entry(b, 20) for b in range(3000, 3500)}
        await client.hset(key, mapping={**newer, b"_head": head(20, 3500)})
        state, _ = await bootstrap(_RestoredMidSweep(client, key, dump), key)
        assert (state.head["seq"], len(state.entries), state.complete) == (10, 3000, True)
    finally:
        await client.delete(key)
