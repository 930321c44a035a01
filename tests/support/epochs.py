"""The epoch numbers the bridge opens (bridge/checkpoint.py, docs/concepts/streams.md "Epochs").

A stream met for the first time (no checkpoint for it) opens ``clock_epoch(now)``, microseconds
since 1970; each engine restart opens ``max(previous + 1, clock_epoch(now))``.
"""

from __future__ import annotations

import math
import time

from bridge.checkpoint import clock_epoch


def assert_first_epoch(epoch: int, since: float) -> int:
    """``epoch`` is the clock's: one a stream met for the first time opened between wall-clock
    ``since`` (taken before the bridge started) and now. Returns it."""
    lo, hi = clock_epoch(since), clock_epoch(time.time())
    assert lo <= epoch <= hi, f"first epoch {epoch} is not the clock's ({lo}..{hi})"
    return epoch


def assert_next_epoch(epoch: int, previous: int, since: float) -> int:
    """``epoch`` is one an engine restart opened after ``previous``, at wall-clock ``since`` or
    later: the clock's (the whole minute of the engine ts that showed it), or ``previous + 1`` when
    ``previous`` was ahead of the clock. Returns it."""
    lo, hi = clock_epoch(math.floor(since / 60) * 60), clock_epoch(time.time())
    assert epoch > previous and (epoch == previous + 1 or lo <= epoch <= hi), (
        f"epoch {epoch} is not the one after {previous} (the clock's: {lo}..{hi})"
    )
    return epoch
