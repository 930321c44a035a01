"""bridge.sink.fold: what it reports besides the retry and dead lists (the cause the sink is
marked down with, and how long to wait), for writes that fail in more than one stream or not
transiently at all."""

from __future__ import annotations

from bridge.errors import Permanent, Retriable
from bridge.sink import fold
from tests.unit.test_sink_fold import write_of


def test_among_equally_severe_failures_the_first_in_write_order_is_the_cause() -> None:
    """Deterministic reporting: the error of the first message that has to be written again."""
    messages = write_of([0, 1, 2])
    first, second = Retriable("broker busy"), Retriable("leader moved")
    out = fold(messages, {1: first, 2: second})
    assert out.cause is first and out.retry == [1, 2] and out.retry_after is None


def test_refusals_alone_ask_for_no_retry_and_no_wait() -> None:
    messages = write_of([0, 1])
    refused = Permanent("too large")
    out = fold(messages, {0: refused})
    assert out.cause is None and out.retry == [] and out.retry_after is None and out.dead == [(0, refused)]
