"""The checkpoint: per stream, the epoch and the highest seq every sink has acknowledged.

Saved atomically (write to a temp file, fsync, rename, fsync the directory) as JSON:
``{"version": 1, "streams": {"llama-a/0": {"epoch": 2, "seq": 1041, "ts": 1732870000.25}}}``. A corrupt or unreadable
file is reported by the caller and the bridge starts fresh; it never crashes on it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec

from .errors import BridgeError


class StreamPosition(msgspec.Struct, frozen=True):
    """Epoch, highest seq every sink acknowledged, and that batch's engine ts (to detect a
    restart on resume: the replay's copy of ``seq`` must carry the same ts)."""

    epoch: int
    seq: int
    ts: float | None = None


class CheckpointFile(msgspec.Struct):
    version: int = 1
    streams: dict[str, StreamPosition] = msgspec.field(default_factory=dict)


class CheckpointError(BridgeError):
    """The checkpoint file exists but cannot be used."""


def load(path: str | Path) -> dict[str, StreamPosition]:
    """Positions by stream key; {} when the file does not exist; CheckpointError when unusable."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CheckpointError(f"checkpoint {p}: cannot read ({exc.strerror or exc})") from exc
    try:
        return msgspec.json.decode(data, type=CheckpointFile).streams
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"checkpoint {p}: corrupt ({exc})") from exc


def save(path: str | Path, streams: dict[str, StreamPosition]) -> None:
    """Write atomically: a crash leaves either the old or the new file, never a torn one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = msgspec.json.encode(CheckpointFile(streams=dict(sorted(streams.items()))))
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
