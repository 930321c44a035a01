"""Structured logging: text or JSON lines, stable keys, repeated warnings rate-limited.

Code logs with ``log.warning("sink unavailable, retrying", extra={"sink": ..., "attempt": ...})``;
the formatter renders the message plus those keys. The rate limiter lets the first few
occurrences of one (logger, message) through per interval and then reports how many it held back,
so an outage produces a handful of lines, not one per batch.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from .secret import redact

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        extras = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{ts} {record.levelname:<7} {record.name}: {record.getMessage()}" + (f" {extras}" if extras else "")
        if record.exc_info and record.levelno >= logging.ERROR:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info and record.levelno >= logging.ERROR:
            entry["exception"] = self.formatException(record.exc_info)
        return redact(json.dumps(entry, default=str))


class RateLimit(logging.Filter):
    """At most ``burst`` records per (logger, message) per ``interval`` seconds; then a summary."""

    def __init__(self, burst: int = 5, interval: float = 60.0) -> None:
        super().__init__()
        self.burst = burst
        self.interval = interval
        self._seen: dict[tuple[str, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.msg if isinstance(record.msg, str) else repr(record.msg))
        now = record.created
        state = self._seen.get(key)
        if state is None or now - state[0] >= self.interval:
            suppressed = int(state[2]) if state is not None else 0
            self._seen[key] = [now, 1.0, 0.0]
            if suppressed:
                record.suppressed = suppressed
            if len(self._seen) > 10_000:
                self._seen.clear()
            return True
        state[1] += 1
        if state[1] <= self.burst:
            return True
        state[2] += 1
        return False


def setup(fmt: str = "text", level: str = "info") -> None:
    """Configure the root logger once (the CLI calls this; library code never does)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RateLimit())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
