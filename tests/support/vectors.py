"""The captured frames of real vLLM and SGLang publishers, carried in ``tests/vectors``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VECTORS_DIR = Path(__file__).resolve().parents[1] / "vectors"
"""``tests/vectors``: one ``ENGINE-VERSION.jsonl`` per captured release (see its README)."""


def vectors_dir() -> Path:
    """``tests/vectors``; a missing or empty directory is an error, never an empty parametrization."""
    if not any(VECTORS_DIR.glob("*.jsonl")):
        raise FileNotFoundError(f"no captured vectors (*.jsonl) in {VECTORS_DIR}")
    return VECTORS_DIR


@dataclass(frozen=True)
class Vector:
    file: str
    producer: str
    version: str
    kind: str
    dp_rank: int
    request_from: int | None
    frames: list[bytes]
    decoded: Any
    expected: Any = None
    """The events as the bridge normalises them, where that is not the plain array/map naming
    (RFC 1527 maps); None: :func:`expected_events` derives them from ``decoded``."""
    window: Any = None

    @property
    def profile(self) -> str:
        return self.file


def load_all() -> list[Vector]:
    out: list[Vector] = []
    for path in sorted(vectors_dir().glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.append(
                Vector(
                    file=path.stem,
                    producer=row["producer"],
                    version=row["version"],
                    kind=row["kind"],
                    dp_rank=row["dp_rank"],
                    request_from=row.get("request_from"),
                    frames=[bytes.fromhex(f) for f in row["frames"]],
                    decoded=row["decoded"],
                    expected=row.get("expected"),
                    window=row.get("window"),
                )
            )
    return out


def plain(value: Any) -> Any:
    """A decoded value in the vectors' JSON form (binary as ``{"bin": hex}``)."""
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def expected_events(decoded: Any, expected: Any = None) -> list[dict[str, Any]]:
    """The vector's events by field name, as the bridge must normalise them (docs/protocol.md 2);
    ``expected``: the row's own normalised events, when it carries them (RFC 1527 maps)."""
    from bridge.wire import ARRAY_FIELDS as FIELDS

    if expected is not None:
        return list(expected)
    events = decoded[1] if isinstance(decoded, list) else decoded["events"]
    out = []
    for e in events:
        if isinstance(e, dict):
            out.append(e)
            continue
        names = FIELDS.get(e[0], ())
        event: dict[str, Any] = {"type": e[0]}
        event.update(zip(names, e[1:], strict=False))
        if len(e) - 1 > len(names):
            event["extra"] = e[1 + len(names) :]
        out.append(event)
    return out


def expected_ts(decoded: Any) -> float:
    """The batch ts the bridge gives: seconds (RFC 1527 producers send integer milliseconds)."""
    ts = decoded[0] if isinstance(decoded, list) else decoded["ts"]
    return ts / 1000 if ts > 1e11 else ts
