"""The dead-letter destination: what could not be decoded or written, with the reason.

One JSON object per line: ``{"time", "source", "dp_rank", "seq", "reason", "detail", "payload_hex"}``
(payload cut to ``max_payload_bytes``), to a file or stderr (``-``). Writes are synchronous and
small (dead letters are rare by nature); every one is also counted in
``kv_bridge_dead_letters_total{reason}`` by the caller.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import IO, Any

import msgspec

_json = msgspec.json.Encoder()


class DeadLetters:
    """Appends dead letters to ``path`` (``-`` is stderr)."""

    def __init__(self, path: str, max_payload_bytes: int = 1 << 20) -> None:
        self.path = path
        self.max_payload_bytes = max_payload_bytes
        self._file: IO[bytes] | None = None

    def _out(self) -> IO[bytes]:
        if self._file is None:
            if self.path == "-":
                self._file = sys.stderr.buffer
            else:
                p = Path(self.path)
                p.parent.mkdir(parents=True, exist_ok=True)
                self._file = p.open("ab")
        return self._file

    def write(
        self,
        *,
        reason: str,
        source: str | None = None,
        dp_rank: int | None = None,
        seq: int | None = None,
        detail: str = "",
        payload: bytes | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        entry: dict[str, Any] = {
            "time": time.time(),
            "source": source,
            "dp_rank": dp_rank,
            "seq": seq,
            "reason": reason,
            "detail": detail[:2000],
        }
        if payload is not None:
            entry["payload_size"] = len(payload)
            entry["payload_hex"] = payload[: self.max_payload_bytes].hex()
        if extra:
            entry.update(extra)
        try:
            line = _json.encode(entry)
        except (TypeError, ValueError, OverflowError):
            entry.pop("value", None)
            entry = {k: (v if isinstance(v, str | int | float | None) else repr(v)) for k, v in entry.items()}
            line = _json.encode(entry)
        out = self._out()
        out.write(line + b"\n")
        out.flush()

    def close(self) -> None:
        if self._file is not None and self.path != "-":
            self._file.close()
        self._file = None
