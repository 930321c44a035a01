"""Configuration: every problem reported with its path, env substitution, YAML and TOML."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge import config
from bridge.cli import check
from bridge.errors import ConfigError

GOOD = """
sources:
  - name: llama-a
    endpoint: tcp://${ENGINE_HOST:-127.0.0.1}:5557
    replay_endpoint: tcp://127.0.0.1:5558
    dp_ranks: 2
    labels: {model: meta-llama/Llama-3.1-8B}
checkpoint: {path: /tmp/ck.json, interval: 10s}
sinks:
  - type: file
    name: out
    path: ${OUT_PATH}
    format: json
    granularity: batch
    batch: {max_messages: 500, linger: 5ms, max_bytes: 2MiB}
    queue: {max_batches: 100, max_bytes: 64MiB}
metrics: {listen: "127.0.0.1:9300"}
"""


def test_good_yaml_with_env(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(GOOD)
    cfg = config.load(p, env={"OUT_PATH": "/tmp/x.jsonl"})
    assert cfg.sources[0].endpoint == "tcp://127.0.0.1:5557"
    assert cfg.sinks[0].options == {"path": "/tmp/x.jsonl"}
    assert cfg.sinks[0].batch.linger == pytest.approx(0.005)
    assert cfg.sinks[0].batch.max_bytes == 2 * 2**20
    assert cfg.checkpoint.interval == 10.0
    cfg = config.load(p, env={"OUT_PATH": "o", "ENGINE_HOST": "vllm-0"})
    assert cfg.sources[0].endpoint == "tcp://vllm-0:5557"


def test_missing_env_variable_is_a_problem_with_its_path(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(GOOD)
    with pytest.raises(ConfigError) as exc:
        config.load(p, env={})
    assert exc.value.problems == ["sinks[0].path: environment variable OUT_PATH is not set (or give ${OUT_PATH:-default})"]


def test_toml(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(
        '[[sources]]\nname = "a"\nendpoint = "tcp://h:5557"\n\n[[sinks]]\ntype = "file"\npath = "-"\nformat = "msgpack"\n'
    )
    cfg = config.load(p, env={})
    assert cfg.sinks[0].format == "msgpack" and cfg.sinks[0].name == "file"


def test_every_problem_has_its_path() -> None:
    data = {
        "sources": [{"name": "a", "endpoint": "tcp://x:1", "dp_rank": 2}, {"name": "a", "endpoint": "tcp://y:1"}],
        "sinks": [{"type": "file", "batch": {"max_messages": "ten"}}, {"type": "file", "format": "xml"}],
        "checkpoint": {"interval": "5x"},
        "nope": 1,
    }
    with pytest.raises(ConfigError) as exc:
        config.from_data(data, env={})
    assert exc.value.problems == [
        "sources[0].dp_rank: unknown key (did you mean dp_ranks?)",
        'checkpoint.interval: expected a duration such as 15s or 250ms, got "5x"',
        "nope: unknown key; expected one of: checkpoint, dead_letter, discovery, ingest, log, metrics, replay, "
        "shutdown_timeout, sinks, sources",
        'sinks[0].batch.max_messages: expected int, got "ten"',
        'sinks[1].format: expected "json" | "msgpack" | "raw", got "xml"',
        "sources[1].name: 'a' is already used by sources[0]",
    ]


def test_no_sources_no_sinks() -> None:
    with pytest.raises(ConfigError) as exc:
        config.from_data({}, env={})
    assert exc.value.problems == [
        "sources: no sources and no discovery: nothing to read from",
        "sinks: at least one sink is required",
    ]


def test_check_prints_three_paths_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(
        "sources:\n  - name: a\n    endpoint: tcp://127.0.0.1:5557\n    dp_ranks: two\n"
        "sinks:\n  - type: file\n    batch: {max_messages: ten}\n    pathh: out.jsonl\n"
    )
    assert check(str(p), offline=True) == 2
    err = capsys.readouterr().err
    assert 'sources[0].dp_ranks: expected int, got "two"' in err
    assert 'sinks[0].batch.max_messages: expected int, got "ten"' in err
    assert "sinks[0].pathh: unknown key (did you mean path?)" in err
    assert err.count("\n  ") == 3


def test_check_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "ok.yaml"
    p.write_text(f"sources:\n  - name: a\n    endpoint: tcp://127.0.0.1:5557\nsinks:\n  - type: file\n    path: {tmp_path}/o\n")
    assert check(str(p)) == 0
    assert "sinks[0] file: reachable" in capsys.readouterr().out


def test_unknown_sink_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("sources:\n  - {name: a, endpoint: 'tcp://h:1'}\nsinks:\n  - type: kafak\n")
    assert check(str(p), offline=True) == 2
    assert "sinks[0].type: unknown sink type 'kafak'" in capsys.readouterr().err


def test_durations_and_sizes() -> None:
    assert config._dec_hook(config.Duration, "250ms") == 0.25
    assert config._dec_hook(config.Duration, "2m") == 120
    assert config._dec_hook(config.ByteSize, "16MiB") == 16 * 2**20
    with pytest.raises(ValueError):
        config._dec_hook(config.ByteSize, "-1")


def test_sink_repr_hides_secrets() -> None:
    sink = config.SinkConfig(type="kafka", options={"sasl_password": "hunter2", "token": "t0k", "topic": "kv"})
    text = repr(sink)
    assert "hunter2" not in text and "t0k" not in text and "'topic': 'kv'" in text
