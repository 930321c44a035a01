"""The epoch numbers the bridge opens (bridge/checkpoint.py, docs/concepts/streams.md "Epochs").

A stream met for the first time (no checkpoint for it) opens ``clock_epoch(now)``, minutes since
2025-01-01; each engine restart opens ``max(previous + 1, clock_epoch(now))``. So the restarts of a
stream within a minute of its first epoch are numbered first + 1, first + 2, ... with no hole.
"""

from __future__ import annotations

import time

from bridge.checkpoint import clock_epoch


def assert_first_epoch(epoch: int, since: float) -> int:
    """``epoch`` is the clock's: one a stream met for the first time opened between wall-clock
    ``since`` (taken before the bridge started) and now. Returns it."""
    lo, hi = clock_epoch(since), clock_epoch(time.time())
    assert lo <= epoch <= hi, f"first epoch {epoch} is not the clock's ({lo}..{hi})"
    return epoch
