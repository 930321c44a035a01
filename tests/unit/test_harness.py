"""The test harness's own contracts, where a race in it would fail unrelated tests."""

from __future__ import annotations

from pathlib import Path

from tests.support.harness import read_lines


def test_read_lines_skips_a_line_still_being_written(tmp_path: Path) -> None:
    """A reader polling a file sink's output sees whole lines only: what follows the last
    newline is a write in progress, possibly cut inside a UTF-8 character."""
    path = tmp_path / "out.jsonl"
    whole = '{"a": 1}\n{"b": "é"}\n'.encode()
    path.write_bytes(whole + '{"c": "é'.encode()[:-1])
    assert read_lines(path, records=False) == [{"a": 1}, {"b": "é"}]
    path.write_bytes(whole)
    assert read_lines(path, records=False) == [{"a": 1}, {"b": "é"}]
