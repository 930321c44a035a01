"""The playground (``make playground``, tools/playground.py) runs end to end and stops cleanly.

It is started as a user would (``python -m tools.playground --broker redis``: its own Redis from
tests/infra, the bridge with state on, two simulated engines with restarts, dropped live messages
and lost replay replies, the example consumer with ``--bootstrap``), its consumer printing its
index as JSON (``--json``). The engines stop after 200 batches per rank (10 s, llama-a restarting
every 60: the consumer follows it through restarts); the consumer's printed
index must then equal the live blocks the bridge's state holds for each engine stream (read with
``kv_consumer.redis.bootstrap``): residency counts, epoch and completeness. Then SIGINT stops
everything: exit code 0, every step logged.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from kv_consumer.redis import bootstrap
from tests.support.consumer_process import SnapshotIndex, follow

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STREAMS = {("llama-a", 0), ("llama-a", 1), ("llama-b", 0)}
BATCHES = 200  # per engine rank; llama-b does not restart: its last seq is BATCHES - 1


async def test_playground_consumer_index_matches_the_bridge_state(tmp_path: Path) -> None:
    index, stopped = SnapshotIndex(), False
    log = tmp_path / "playground.log"
    command = [sys.executable, "-m", "tools.playground", "--broker", "redis", "--json", "--every", "0.2"]
    command += ["--rate", "20", "--batches", str(BATCHES), "--restart-every", "60"]
    runner = asyncio.create_task(follow(index, command, lambda: stopped, log, grace=60, cwd=ROOT))
    client = None
    try:
        deadline = time.monotonic() + 90
        url = None
        while url is None:
            assert time.monotonic() < deadline and not runner.done(), log.read_text()[-3000:] if log.exists() else runner
            found = re.search(r"playground: redis at (redis://\S+)", log.read_text() if log.exists() else "")
            url = found.group(1) if found else None
            await asyncio.sleep(0.2)
        client = aioredis.Redis.from_url(url)
        differences: object = "no index printed"
        while True:
            differences = await compare(client, index)
            if differences is None:
                break
            assert time.monotonic() < deadline and not runner.done(), f"{differences}\n{log.read_text()[-3000:]}"
            await asyncio.sleep(0.3)
        assert len(index.epochs["llama-a", 0]) > 1, "the consumer did not follow llama-a through a restart"
        assert all(v.blocks for v in index.streams.values()), index.summary()
        assert index.streams["llama-b", 0].complete, index.summary()  # its dropped messages were repaired
    finally:
        stopped = True
        code = await runner
        if client is not None:
            await client.aclose()
    text = log.read_text()
    assert code == 0, text[-3000:]
    for step in ("bridge stopped (0)", "redis stopped"):
        assert f"playground: {step}" in text, text[-3000:]


async def compare(client: aioredis.Redis, index: SnapshotIndex) -> object:
    """None when the engines are done (llama-b's state at its last seq) and the printed index holds
    what the bridge's state holds for every engine stream; else what differs."""
    if set(index.streams) != STREAMS:
        return f"streams {sorted(index.streams)}"
    done, _ = await bootstrap(client, "kv:llama-b:0:state")
    if done.head.get("seq") != BATCHES - 1:
        return f"llama-b's state is at seq {done.head.get('seq')}"
    for source, rank in sorted(STREAMS):
        state, _ = await bootstrap(client, f"kv:{source}:{rank}:state", f"kv:{source}:{rank}")
        truth: Counter[tuple[object, object]] = Counter()
        for doc in state.entries.values():
            truth[doc["hash"], doc["medium"]] += int(doc["count"])
        view = index.streams[source, rank]
        if (view.epoch, view.complete, view.blocks) != (state.epoch, state.complete, truth):
            return f"{source}/{rank}: printed epoch {view.epoch} {len(view.blocks)} blocks, state {state.epoch} {len(truth)}"
    return None
