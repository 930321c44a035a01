"""Capped exponential backoff with jitter (pure: the random source is passed in)."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Delay before retry ``attempt`` (1-based): ``initial * multiplier**(attempt-1)``, capped.

    ``jitter`` is the fraction of each delay drawn at random ("equal jitter"), so many sinks or
    streams retrying after the same outage do not come back in lockstep.
    """

    def __init__(
        self,
        initial: float,
        maximum: float,
        multiplier: float = 2.0,
        jitter: float = 0.2,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.multiplier = multiplier
        self.jitter = jitter
        self._rand = rand

    def delay(self, attempt: int) -> float:
        if attempt <= 0:
            return 0.0
        base = min(self.maximum, self.initial * self.multiplier ** min(attempt - 1, 64))
        return base * (1.0 - self.jitter) + base * self.jitter * self._rand()
