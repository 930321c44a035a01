"""Every example config in examples/ is valid (parse and connector keys, offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.cli import check

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.*"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(str(path), offline=True) == 0, capsys.readouterr().err
