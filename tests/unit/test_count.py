"""Counting a batch's events without decoding them (all sinks raw): same answers as decoding."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge import config as config_mod
from bridge import wire
from bridge.connector import Registry
from bridge.records import Stream
from bridge.runtime import Bridge
from bridge.simulator import PROFILES, EventFactory, encode_batch
from bridge.stream import StreamPipeline
from tests.support.strategies import examples
from tests.support.vectors import load_all

LIVE = [v for v in load_all() if v.kind == "live"]


def _agrees(payload: bytes) -> None:
    """count_batch either declines or says exactly what decode_batch would.

    One difference is by design: text inside the fields count_batch skips is not checked, so a
    batch whose only fault is invalid UTF-8 there is counted (and forwarded untouched).
    """
    counted = wire.count_batch(payload)
    if counted is None:
        return
    try:
        decoded = wire.decode_batch(payload)
    except wire.DecodeError as exc:
        assert "utf-8" in (exc.detail or "").lower(), f"count_batch accepted a batch that decode_batch rejects: {exc}"
        return
    assert not decoded.bad_events
    assert counted.ts == decoded.ts
    assert counted.types == [e["type"] for e in decoded.events]


@pytest.mark.parametrize("vector", LIVE, ids=lambda v: f"{v.file}")
def test_every_vector_is_counted_like_it_is_decoded(vector: Any) -> None:
    payload = vector.frames[-1]
    assert wire.count_batch(payload) is not None  # every real generation takes the cheap path
    _agrees(payload)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_simulator_profile(name: str) -> None:
    factory = EventFactory(PROFILES[name], seed=3)
    for _ in range(20):
        payload = encode_batch(PROFILES[name], 1.5, factory.batch(5), 1)
        assert wire.count_batch(payload) is not None
        _agrees(payload)


@pytest.mark.parametrize(
    "payload",
    [
        msgspec.msgpack.encode([1.0, [{"type": "SomethingNew", "x": 1}]]),  # unknown type: decode reports it
        msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),  # no type
        msgspec.msgpack.encode([1.0, [["BlockStored", [1]], {"type": "BlockRemoved"}]]),  # mixed generations
        msgspec.msgpack.encode([True, []]),  # a bool ts
        msgspec.msgpack.encode({"events": []}),  # no ts
        msgspec.msgpack.encode([1.0, [], 0]) + b"\x00",  # trailing bytes
        b"",
        b"\xc1",
    ],
)
def test_anything_unusual_is_left_to_decode(payload: bytes) -> None:
    assert wire.count_batch(payload) is None


@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    _agrees(data)


@settings(max_examples=examples(200), suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(LIVE), st.data())
def test_mutated_vectors(vector: Any, data: st.DataObject) -> None:
    payload = bytearray(vector.frames[-1])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    _agrees(bytes(payload))


def _bridge(tmp_path: Path, sinks: list[dict[str, Any]]) -> Bridge:
    config = config_mod.from_data(
        {
            "sources": [{"name": "idle", "endpoint": "tcp://127.0.0.1:9"}],
            "sinks": sinks,
            "metrics": {"listen": ""},
            "replay": {"idle_probe": 0},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        },
        env={},
    )
    return Bridge(config)


@pytest.mark.parametrize(
    ("sinks", "needs"),
    [
        ([{"type": "file", "path": "/dev/null", "format": "raw"}], False),
        ([{"type": "file", "path": "/dev/null", "format": "raw"}, {"type": "file", "path": "/dev/null"}], True),
        ([{"type": "file", "path": "/dev/null", "format": "msgpack", "granularity": "batch"}], True),
    ],
)
async def test_events_are_decoded_only_when_a_sink_needs_them(tmp_path: Path, sinks: list[dict[str, Any]], needs: bool) -> None:
    bridge = _bridge(tmp_path, sinks)
    await bridge.start()
    try:
        assert bridge.context.needs_events is needs
    finally:
        await bridge.stop()


def test_which_connectors_read_events() -> None:
    registry = Registry()
    for i, (entry, needs) in enumerate(
        [
            ({"type": "kafka", "bootstrap_servers": "127.0.0.1:9", "format": "raw"}, False),
            ({"type": "nats", "format": "raw"}, False),
            ({"type": "redis", "url": "redis://127.0.0.1:9", "format": "raw"}, False),
            ({"type": "redis", "url": "redis://127.0.0.1:9", "format": "raw", "index": {"enabled": True}}, True),
        ]
    ):
        data = {"sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:9"}], "sinks": [entry]}
        sink = config_mod.from_data(data, env={}).sinks[0]
        assert registry.build(sink, i).needs_events is needs  # type: ignore[attr-defined]


async def test_raw_only_records_carry_counts_and_metrics(tmp_path: Path) -> None:
    out = tmp_path / "out.bin"
    bridge = _bridge(tmp_path, [{"type": "file", "path": str(out), "format": "raw", "binary": "length-prefixed"}])
    await bridge.start()
    try:
        assert bridge.context.needs_events is False
        profile = PROFILES["vllm-0.33.0"]
        factory = EventFactory(profile, seed=5)
        batches = [factory.batch(4) for _ in range(10)]
        payloads = [encode_batch(profile, 100.0 + i, b, 0) for i, b in enumerate(batches)]
        pipeline = StreamPipeline(bridge.context, Stream("e", 0), replay_endpoint=None, replay_on_start=False, epoch=0)
        await pipeline.on_live([[b"", i.to_bytes(8, "big"), p] for i, p in enumerate(payloads)], 200.0)
        assert await bridge.workers[0].flush(5)
        reg = bridge.metrics.registry
        for t in ("BlockStored", "BlockRemoved"):
            expected = sum(1 for b in batches for e in b if e["type"] == t)
            assert (reg.get_sample_value("kv_bridge_events_received_total", {"source": "e", "type": t}) or 0) == expected
        assert reg.get_sample_value("kv_bridge_sink_events_total", {"sink": "file"}) == 40
        assert reg.get_sample_value("kv_bridge_source_last_event_timestamp_seconds", {"source": "e", "dp_rank": "0"}) == 109.0
    finally:
        await bridge.stop()
    data = out.read_bytes()
    bodies = []
    while data:
        n = int.from_bytes(data[:4], "big")
        bodies.append(data[4 : 4 + n])
        data = data[4 + n :]
    assert bodies == payloads  # the engine's bytes, untouched


async def test_a_run_gives_each_connector_that_asks_the_configured_streams_before_it_connects(tmp_path: Path) -> None:
    """breaker46 B3: what a connector's connect checks of each configured stream (a Redis key's
    type) is checked at a run too, not only by --check: the runtime sets ``known_streams`` (every
    rank of every configured source) on a connector that has the attribute, before it connects."""
    from tests.support.memory import MemoryConnector

    seen: list[list[Stream]] = []

    class Knowing(MemoryConnector):
        known_streams: list[Stream]

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.known_streams = []

        async def connect(self) -> None:
            seen.append(list(self.known_streams))
            await super().connect()

    config = config_mod.from_data(
        {
            "sources": [
                {"name": "a", "endpoint": "tcp://127.0.0.1:9", "dp_ranks": 2},
                {"name": "b", "endpoint": "tcp://127.0.0.1:19"},
            ],
            "sinks": [{"type": "mem"}],
            "metrics": {"listen": ""},
            "replay": {"idle_probe": 0},
            "dead_letter": {"path": str(tmp_path / "dead.jsonl")},
        },
        env={},
    )
    bridge = Bridge(config, registry=Registry({"mem": Knowing}, entry_points=False))  # type: ignore[dict-item]
    await bridge.start()
    try:
        for _ in range(100):  # (the sink worker connects as it starts)
            if seen:
                break
            await asyncio.sleep(0.05)
        assert seen and seen[0] == [Stream("a", 0), Stream("a", 1), Stream("b", 0)], seen
    finally:
        await bridge.stop()
