"""What every sink that keeps state needs of its own keys, checked once for all connectors."""

from __future__ import annotations

from typing import Any

import pytest

from bridge.config import ConfigError, from_data
from bridge.connector import Registry

OPTIONS = {
    "redis": {"url": "redis://x"},
    "kafka": {"bootstrap_servers": "x:9092"},
    "nats": {"servers": "nats://x:4222"},
}


def build(kind: str, **keys: Any) -> None:
    sink = {"type": kind, "name": "s", **OPTIONS[kind], "state": {"enabled": True}, **keys}
    cfg = from_data({"sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}], "sinks": [sink]}, env={})
    Registry().build(cfg.sinks[0], 0)


@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_state_needs_backpressure_block(kind: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(kind, backpressure="drop")
    assert "sinks[0].state.enabled: needs backpressure: block" in str(info.value)
    build(kind)  # block (the default) is fine


@pytest.mark.parametrize("kind", sorted(OPTIONS))
@pytest.mark.parametrize(
    ("fields", "where", "named"),
    [
        ({"drop": ["medium", "group_idx"]}, "sinks[0].fields:", "medium, group_idx"),
        ({"keep": ["block_hashes"]}, "sinks[0].fields:", "medium, group_idx"),
        ({"by_type": {"BlockRemoved": {"drop": ["block_hashes"]}}}, "sinks[0].fields.by_type.BlockRemoved:", "block_hashes"),
    ],
)
def test_state_needs_the_fields_a_consumer_follows(kind: str, fields: dict[str, Any], where: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(kind, fields=fields)
    assert where in str(info.value) and f"needs {named} in the messages" in str(info.value)


def test_other_field_selections_are_fine_with_state() -> None:
    build(
        "redis",
        fields={
            "drop": ["token_ids", "extra_keys"],
            "by_type": {"BlockStored": {"keep": [*["block_hashes", "medium", "group_idx", "parent_block_hash"]]}},
        },
    )
