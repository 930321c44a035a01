"""A generated file written, or checked against what its generator makes now (``--check``)."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(path: Path, text: str, *, check: bool, shown: str, command: str) -> int:
    """With ``check``: 0 when ``path`` holds ``text``, else 1 and a line naming ``command``;
    otherwise write it. ``shown``: how ``path`` is named in the messages."""
    if check:
        if (path.read_text() if path.exists() else "") != text:
            print(f"{shown} is out of date: run {command}", file=sys.stderr)
            return 1
        print(f"{shown} is up to date")
        return 0
    path.write_text(text)
    print(f"wrote {shown}")
    return 0
