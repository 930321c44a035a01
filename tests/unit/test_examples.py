"""Every example config in examples/ is valid (parse and connector keys, offline) and writes no
secret in plain text. (The chart's rendered configs: tests/integration/test_helm.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.cli import check

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.*"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(str(path), offline=True) == 0, capsys.readouterr().err
    assert "warning" not in capsys.readouterr().err
