"""The file sink writes each batch to the file at its path now, not to a file removed or renamed
under it (breaker31x B1: the file deleted mid-run, 296 seqs counted delivered went nowhere, the
sink ready; renamed by logrotate, the path got nothing more)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bridge.config import SinkConfig, convert
from bridge.connector import Registry
from bridge.formats import Renderer
from bridge.records import Stream
from tests.support.records import batch


def file_sink(path: Path) -> tuple[object, Renderer]:
    problems: list[str] = []
    entry = {"type": "file", "name": "f", "format": "json", "granularity": "batch", "options": {"path": str(path)}}
    cfg = convert(entry, SinkConfig, "sink", problems)
    assert cfg is not None, problems
    return Registry().build(cfg, 0), Renderer(cfg.format, cfg.granularity)


def seqs(path: Path) -> list[int]:
    return [json.loads(line)["seq"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("how", ["removed", "renamed"])
async def test_a_file_removed_or_renamed_under_the_sink_gets_no_more_writes_the_path_does(tmp_path: Path, how: str) -> None:
    path = tmp_path / "out" / "kv.jsonl"
    conn, renderer = file_sink(path)
    stream = Stream("a", 0)
    await conn.connect()  # type: ignore[attr-defined]
    try:
        await conn.write(renderer.render(batch(stream, 0)))  # type: ignore[attr-defined]
        if how == "removed":
            path.unlink()
        else:
            path.rename(path.with_suffix(".1"))
        await conn.write(renderer.render(batch(stream, 1)))  # type: ignore[attr-defined]
        await conn.write(renderer.render(batch(stream, 2)))  # type: ignore[attr-defined]
    finally:
        await conn.close()  # type: ignore[attr-defined]
    assert seqs(path) == [1, 2]
    if how == "renamed":
        assert seqs(path.with_suffix(".1")) == [0]
