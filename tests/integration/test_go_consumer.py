"""The Go consumer (go/kvconsumer) keeps the same index as the Python one, on real brokers.

The test session builds it (``go build``; modules through the Go proxy, pinned by go.sum, kept in
the Go module cache) and runs it as a process printing its index as JSON (``--json``), held to the
scenarios the Python example consumers pass (tests/integration/test_example_consumers.py): two
scripted engines through the bridge to Redis Streams or Kafka; copies (Kafka: every message
stored twice), an engine restart, a loss the replay buffer cannot repair (EventsLost: incomplete),
a cache clear; and the state bootstrap on both. The engines' hashes are unsigned 64-bit numbers:
a float64 would round them, and the residency counts would not match.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.infra.servers import InstallError, KafkaServer, RedisServer, cache_dir, ensure_apt_package
from tests.integration.conftest import unavailable
from tests.integration.test_example_consumers import (
    delete_keys,
    kafka_heads_at,
    kafka_state_sink,
    resend,
    run_bootstrap_scenario,
    run_lost_events_bootstrap,
    run_scenario,
    topic_created_again,
    wait_written,
)
from tests.support.cache_engine import CacheEngine
from tests.support.consumer_process import SnapshotIndex, follow

pytestmark = pytest.mark.integration

MODULE = Path(__file__).resolve().parents[2] / "go" / "kvconsumer"


@pytest.fixture(scope="session")
def go_consumer() -> Path:
    """The kvconsumer binary, built from go/kvconsumer (skipped without Go; failed under CI)."""
    go = shutil.which("go")
    if go is None:
        try:
            go = ensure_apt_package("go", "golang-go", server="go")
        except InstallError as exc:
            unavailable("go", f"no Go toolchain (https://go.dev/dl/, or apt-get install golang-go): {exc}")
    binary = cache_dir() / "bin" / "kvconsumer"
    binary.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOFLAGS": "-mod=mod -buildvcs=false"}  # modules through the Go proxy, pinned by go.sum
    built = subprocess.run(
        [go, "build", "-o", str(binary), "./cmd/kvconsumer"], cwd=MODULE, env=env, capture_output=True, text=True, timeout=600
    )
    assert built.returncode == 0, f"go build failed in {MODULE}:\n{built.stderr}"
    return binary


def go_follow(binary: Path, tmp: Path, *args: str) -> Callable[[Any, Callable[[], bool]], Coroutine[Any, Any, None]]:
    def consume(index: Any, stop: Callable[[], bool]) -> Coroutine[Any, Any, None]:
        return follow(index, [str(binary), *args, "--json", "--every", "50ms"], stop, tmp / "kvconsumer.log")

    return consume


async def test_go_consumer_on_redis(tmp_path: Path, redis_server: RedisServer, go_consumer: Path) -> None:
    prefix = f"kvg{uuid.uuid4().hex[:8]}"
    sink = {"type": "redis", "url": redis_server.url, "stream": prefix + ":{source}:{dp_rank}"}
    consume = go_follow(go_consumer, tmp_path, "redis", "--url", redis_server.url, "--match", prefix + ":*")
    try:
        index = await run_scenario(tmp_path, sink, consume, "batch", index=SnapshotIndex())
        assert index.lines > 0
    finally:
        await delete_keys(redis_server.url, prefix)


async def test_go_consumer_on_kafka_skips_copies(tmp_path: Path, kafka: KafkaServer, go_consumer: Path) -> None:
    topic = await kafka.anew_topic(partitions=2)
    sink = {"type": "kafka", "bootstrap_servers": kafka.bootstrap_servers, "topic": topic}
    consume = go_follow(go_consumer, tmp_path, "kafka", "--brokers", kafka.bootstrap_servers, "--topic", topic)

    async def copies() -> int:
        return await resend(kafka.bootstrap_servers, topic, 2)

    index = await run_scenario(tmp_path, sink, consume, "event", copies, index=SnapshotIndex())
    assert index.duplicates > 0


async def test_go_consumer_bootstraps_from_redis_state(tmp_path: Path, redis_server: RedisServer, go_consumer: Path) -> None:
    """``--bootstrap :state`` after the stream was trimmed (``maxlen``): the blocks from the state."""
    prefix = f"kvgb{uuid.uuid4().hex[:8]}"
    sink = {
        "type": "redis",
        "url": redis_server.url,
        "stream": prefix + ":{source}:{dp_rank}",
        "maxlen": 40,
        "state": {"enabled": True, "key": prefix + ":{source}:{dp_rank}:state"},
    }
    client = aioredis.Redis.from_url(redis_server.url)

    async def heads_at(engines: dict[tuple[str, int], CacheEngine]) -> None:
        await wait_written(client, prefix, engines)
        assert await client.xlen(f"{prefix}:a:0") < 100  # trimmed: the history alone no longer tells

    args = ["redis", "--url", redis_server.url, "--match", prefix + ":*", "--bootstrap", ":state"]
    consume = go_follow(go_consumer, tmp_path, *args)
    try:
        await run_bootstrap_scenario(tmp_path, sink, consume, heads_at, index=SnapshotIndex())
    finally:
        await client.aclose()
        await delete_keys(redis_server.url, prefix)


async def test_go_consumer_bootstraps_from_kafka_state(tmp_path: Path, kafka: KafkaServer, go_consumer: Path) -> None:
    """``--bootstrap STATE_TOPIC``: each stream from the compacted state topic, each partition
    from where its streams' heads continue (fewer records than the topic holds)."""

    from aiokafka import TopicPartition

    from tests.support.state_kafka import offsets

    servers = kafka.bootstrap_servers
    topic = await kafka.anew_topic(partitions=2)
    state_topic = f"kvg-state-{uuid.uuid4().hex[:12]}"
    sink = kafka_state_sink(servers, topic, state_topic)

    heads_at = kafka_heads_at(servers, state_topic)

    consume = go_follow(go_consumer, tmp_path, "kafka", "--brokers", servers, "--topic", topic, "--bootstrap", state_topic)
    index = await run_bootstrap_scenario(tmp_path, sink, consume, heads_at, index=SnapshotIndex())
    written = sum(end for _, end in [await offsets(servers, TopicPartition(topic, p)) for p in range(2)])
    assert index.applied + index.duplicates + index.stale < written / 2, (index.summary(), written)


async def test_go_consumer_bootstrapping_over_a_topic_created_again_ends_exact(
    tmp_path: Path, kafka: KafkaServer, go_consumer: Path
) -> None:
    """breaker88 B2: the Go library followed the head's ``next`` (80) into the events topic created
    again, whose offsets 0-79 held the bridge's EventsLost and the next 79 batches: complete, and
    145 blocks where the engine held 203 (5 of 5)."""
    servers = kafka.bootstrap_servers
    topic = await kafka.anew_topic(partitions=1)
    state_topic = f"kvg-state-{uuid.uuid4().hex[:12]}"
    sink = kafka_state_sink(servers, topic, state_topic)
    consume = go_follow(go_consumer, tmp_path, "kafka", "--brokers", servers, "--topic", topic, "--bootstrap", state_topic)
    lose = topic_created_again(kafka, topic)
    await run_lost_events_bootstrap(tmp_path, sink, consume, kafka_heads_at(servers, state_topic), lose, index=SnapshotIndex())
