"""The dead-letter destination: what could not be decoded or written, with the reason.

One JSON object per line: ``{"time", "source", "dp_rank", "seq", "reason", "detail", "payload_hex"}``
(payload cut to ``max_payload_bytes``), to a file or stderr (``-``). Writes are synchronous and
small (dead letters are rare by nature); every one is also counted in
``kv_bridge_dead_letters_total{reason}`` by the caller.

Writing a dead letter never raises (invariant I5: a full disk must not stop a stream or a sink):
a failed write is logged (the log filter rate-limits it), counted in ``write_failures``, and the
file is opened afresh on the next write, so the destination recovers once it is writable again.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from .connector import file_id
from .errors import DecodeError
from .metrics import Metrics
from .records import Stream
from .secret import redact

log = logging.getLogger("bridge.deadletter")

_json = msgspec.json.Encoder()


class DeadLetters:
    """Appends dead letters to ``path`` (``-`` is stderr)."""

    def __init__(self, path: str, max_payload_bytes: int = 1 << 20, on_failure: Callable[[], None] | None = None) -> None:
        self.path = path
        self.on_failure = on_failure  # e.g. a metric's inc
        self.max_payload_bytes = max_payload_bytes
        self.write_failures = 0
        """Dead letters lost because the destination could not be written."""
        self._failing = 0  # failures since the last successful write
        self._file: IO[bytes] | None = None
        self._inode: tuple[int, int] | None = None
        if path != "-":
            # Files are opened at the first dead letter; say now, not then, that it will fail.
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.warning("dead-letter directory cannot be created", extra={"path": path, "error": str(exc)})

    def _out(self) -> IO[bytes]:
        if self.path == "-":
            return sys.stderr.buffer
        if self._file is not None and self._inode != file_id(self.path):
            self._drop()  # removed or rotated under us: writes to the old file would be lost
        if self._file is None:
            p = Path(self.path)
            p.parent.mkdir(parents=True, exist_ok=True)
            self._file = p.open("ab")
            st = os.fstat(self._file.fileno())
            self._inode = (st.st_dev, st.st_ino)
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
        """Append one dead letter; never raises (a failure is logged and counted instead)."""
        entry: dict[str, Any] = {
            "time": time.time(),
            "source": source,
            "dp_rank": dp_rank,
            "seq": seq,
            "reason": reason,
            "detail": redact(detail[:2000]),
        }
        if payload is not None:
            entry["payload_size"] = len(payload)
            entry["payload_hex"] = payload[: self.max_payload_bytes].hex()
        if extra:
            entry.update(extra)
        try:
            out = self._out()
            out.write(_encode(entry) + b"\n")
            out.flush()
        except Exception as exc:  # anything (ENOSPC, EACCES, a directory in the way): never into the caller
            self.write_failures += 1
            self._failing += 1
            if self.on_failure is not None:
                self.on_failure()
            self._drop()
            log.error(
                "dead letter not written",
                extra={"path": self.path, "reason": reason, "source": source, "seq": seq, "error": str(exc) or repr(exc)},
            )
            return
        if self._failing:
            log.warning("dead letters written again", extra={"path": self.path, "lost": self._failing})
            self._failing = 0

    def _drop(self) -> None:
        """Forget the open file (so the next write opens it again); its unwritten buffer is lost."""
        f, self._file, self._inode = self._file, None, None
        if f is not None and self.path != "-":
            try:
                f.close()  # flushes first: on a full disk that fails again, but the descriptor is closed
            except OSError:
                pass

    def close(self) -> None:
        self._drop()


def _encode(entry: dict[str, Any]) -> bytes:
    try:
        return _json.encode(entry)
    except (TypeError, ValueError, OverflowError):  # a value JSON cannot hold: keep its text
        entry.pop("value", None)
        return _json.encode({k: (v if isinstance(v, str | int | float | None) else repr(v)) for k, v in entry.items()})


class DecodeFailures:
    """Reports what a stream could not decode: counted (``decode_failures`` and ``dead_letters``
    by reason), logged (the log filter rate-limits it) and dead-lettered with its bytes."""

    def __init__(self, metrics: Metrics, dead_letters: DeadLetters) -> None:
        self.metrics = metrics
        self.dead_letters = dead_letters

    def __call__(
        self,
        stream: Stream,
        exc: DecodeError,
        seq: int | None,
        frames: Sequence[bytes] | None,
        payload: bytes | None = None,
        *,
        index: int | None = None,
    ) -> None:
        self.metrics.decode_failures.labels(stream.source, exc.reason).inc()
        self.metrics.dead_letters.labels(exc.reason).inc()
        if payload is None and frames is not None:
            payload = b"".join(bytes(f)[:4096] for f in frames[:4])
        log.warning("decode failure", extra={"stream": stream.key, "seq": seq, "reason": exc.reason, "error": exc.detail})
        self.dead_letters.write(
            reason=exc.reason,
            source=stream.source,
            dp_rank=stream.dp_rank,
            seq=seq,
            detail=exc.detail,
            payload=payload,
            extra={"index": index, "frames": len(frames)} if frames is not None else {"index": index},
        )
