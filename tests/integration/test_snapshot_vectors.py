"""The snapshot exchange vectors (tests/vectors/snapshots) through a running bridge, on Redis.

A fake engine on real ZMQ sockets plays each vector: live seqs 5 and 6 (the bridge meets it
mid-epoch: incomplete), the snapshot request it must receive (byte for byte, on the socket of
its design), the vector's reply frames, then live seqs 7 and 8. The source says only
``snapshot: auto``: the design is told by the socket and the reply. The Redis state must then
equal the vector's cache, and the stream hold the StateSeeded record after seq 7 (the first batch
above the cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import zmq
import zmq.asyncio

from bridge.config import from_data
from bridge.runtime import Bridge
from kv_consumer.redis import bootstrap
from tests.infra.servers import RedisServer
from tests.support.harness import free_port, wait_for
from tests.support.vectors import VECTORS_DIR

pytestmark = pytest.mark.integration

SNAPSHOT_VECTORS = sorted((VECTORS_DIR / "snapshots").glob("*.jsonl"))


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def frames(row: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(f) for f in row["frames"]]


@contextlib.asynccontextmanager
async def bound(ctx: zmq.asyncio.Context, kind: int, port: int) -> AsyncIterator[zmq.asyncio.Socket]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        yield sock
    finally:
        sock.close(linger=0)


async def settled(client: aioredis.Redis, key: str, seq: int) -> None:
    """Until the stream key's last entry is of ``seq``."""
    for _ in range(1000):
        top = await client.xrevrange(key, "+", "-", count=1)
        if top and int(top[0][1][b"seq"]) == seq:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{key}: seq {seq} never written")


def test_there_is_a_vector_per_design() -> None:
    assert [p.stem for p in SNAPSHOT_VECTORS] == ["sglang-34407", "vllm-50134", "vllm-57789"]


@pytest.mark.parametrize("path", SNAPSHOT_VECTORS, ids=lambda p: p.stem)
async def test_a_snapshot_vector_seeds_the_state_through_the_bridge(
    tmp_path: Path, redis_server: RedisServer, path: Path
) -> None:
    rows = rows_of(path)
    live = [r for r in rows if r["kind"] == "live"]
    (request,) = [r for r in rows if r["kind"] == "snapshot_request"]
    replies = [frames(r) for r in rows if r["kind"] == "snapshot_reply"]
    (expected,) = [r for r in rows if r["kind"] == "expected_state"]
    on_replay = request["socket"] == "replay"
    prefix = f"kvv{uuid.uuid4().hex[:8]}"
    lp, rp, sp = free_port(), free_port(), free_port()
    source: dict[str, Any] = {
        "name": "v",
        "endpoint": f"tcp://127.0.0.1:{lp}",
        "replay_endpoint": f"tcp://127.0.0.1:{rp}",
        "replay_on_start": False,
        "snapshot": "auto",
    }
    if not on_replay:
        source["snapshot_endpoint"] = f"tcp://127.0.0.1:{sp}"
    cfg = from_data(
        {
            "sources": [source],
            "sinks": [
                {
                    "type": "redis",
                    "name": "out",
                    "url": redis_server.url,
                    "format": "json",
                    "stream": prefix + ":{source}:{dp_rank}",
                    "state": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:state"},
                    "batch": {"linger": 0},
                }
            ],
            "metrics": {"listen": ""},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
            "replay": {"timeout": "300ms", "idle_probe": 0},
            "shutdown_timeout": "3s",
        },
        env={},
    )
    ctx = zmq.asyncio.Context()
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        async with (
            bound(ctx, zmq.XPUB, lp) as pub,
            bound(ctx, zmq.ROUTER, rp) as replay,
            bound(ctx, zmq.ROUTER, sp) as snapshot,
        ):
            bridge = Bridge(cfg)
            await bridge.start()
            try:
                async with asyncio.timeout(20):
                    assert (await pub.recv())[:1] == b"\x01"  # the bridge subscribed
                    for row in live[:2]:
                        await pub.send_multipart(frames(row))
                    sock = replay if on_replay else snapshot
                    got = await sock.recv_multipart()
                    assert got[1:] == frames(request), "the request is not the design's"
                    for reply in replies:
                        await sock.send_multipart([got[0], b"", *reply])
                    snaps = bridge.pipelines["v/0"].snapshots
                    assert snaps is not None
                    await wait_for(lambda: snaps.seeding is None or snaps.seeding.snapshot is not None, what="the snapshot read")
                    assert snaps.seeding is not None, "the snapshot was refused"
                    for row in live[2:]:
                        await pub.send_multipart(frames(row))
                    key = f"{prefix}:v:0"
                    await settled(client, key, 8)
                state, after = await bootstrap(client, f"{key}:state", key)
                entries = await client.xrange(key, "(" + after if after else "-", "+")
                for _id, fields in entries:
                    state.apply(json.loads(fields[b"data"]))
                assert state.complete
                want = {(m, g, int(h, 16)): n for m, g, h, n in expected["blocks_at_end"]}
                assert state.blocks() == want
                records = [json.loads(f[b"data"]) for _i, f in await client.xrange(key)]
                seeded = [r for r in records if r["type"] == "StateSeeded"]
                assert [(r["seq"], r["cut"], r["design"]) for r in seeded] == [
                    (expected["seeded_at"], expected["cut"], path.stem)
                ]
                at = records.index(seeded[0])
                assert records[at - 1]["seq"] == expected["seeded_at"] and records[at + 1]["seq"] == expected["seeded_at"] + 1
            finally:
                await bridge.stop()
    finally:
        keys = [k async for k in client.scan_iter(match=prefix + ":*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        ctx.destroy(linger=0)
