"""bridge.sink.fold: the one rule for partial failures, checked as a property against a model of
a sink that stores in write order (hypothesis), plus the cases the issue reported."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bridge.errors import ConnectorError, NotConnected, Permanent, Retriable
from bridge.formats import Message, Renderer
from bridge.records import Record, Stream
from bridge.sink import fold
from tests.support.records import stream_records

STREAMS = [Stream("a", 0), Stream("a", 1), Stream("b", 0)]
RENDER = Renderer("json", "batch")


def write_of(picks: list[int]) -> list[Message]:
    """One message per pick, the streams' seqs consecutive in write order."""
    records = {s.key: iter(stream_records(s, len(picks))) for s in STREAMS}
    out: list[Message] = []
    for k in picks:
        record: Record = next(records[STREAMS[k].key])
        out.extend(RENDER.render(record))
    return out


def test_a_transient_failure_retries_its_stream_from_there_and_nothing_of_the_others() -> None:
    messages = write_of([0, 1, 0, 1, 0])  # a0 b0 a1 b1 a2 (a = stream 0, b = stream 1)
    out = fold(messages, {2: Retriable("oom")})
    assert out.retry == [2, 4] and out.dead == [] and isinstance(out.cause, Retriable)


def test_a_refusal_after_a_transient_failure_of_its_stream_is_retried_not_dead_lettered() -> None:
    messages = write_of([0, 0, 0])
    too_large = Permanent("too large")
    out = fold(messages, {0: Retriable("full"), 1: too_large})
    assert out.retry == [0, 1, 2] and out.dead == []


def test_a_refusal_alone_is_dead_lettered_and_its_neighbours_are_done() -> None:
    messages = write_of([0, 0, 0, 1])
    too_large = Permanent("too large")
    out = fold(messages, {1: too_large})
    assert out.retry == [] and out.dead == [(1, too_large)] and out.cause is None


def test_not_connected_outranks_retriable_and_the_longest_wait_is_kept() -> None:
    messages = write_of([0, 1, 2])
    out = fold(messages, {0: Retriable("busy", retry_after=0.5), 1: NotConnected("gone"), 2: Retriable("x", retry_after=2.0)})
    assert isinstance(out.cause, NotConnected) and out.retry_after == 2.0 and out.retry == [0, 1, 2]


KINDS = st.sampled_from(["ok", "ok", "ok", "transient", "refused"])


@given(picks=st.lists(st.integers(0, len(STREAMS) - 1), min_size=1, max_size=12), data=st.data())
def test_a_sink_that_stores_in_write_order_keeps_every_streams_order(picks: list[int], data: st.DataObject) -> None:
    """Write, fold, retry until nothing is left: per stream, the first stored copies are in seq
    order, every message is stored or dead-lettered once, and only refused ones are dead.

    The sink keeps the connector's side of the contract: after a message failed transiently, no
    later message of its stream is stored in the same write (it may still be reported as taken:
    the fold rewrites it anyway)."""
    messages = write_of(picks)
    stored: list[Message] = []  # first copies only (the sink's idempotence drops the rest)
    dead: list[Message] = []
    refused = {id(m) for m in messages if data.draw(st.booleans(), label="refused") and data.draw(st.booleans())}
    pending = list(range(len(messages)))
    for _ in range(50):
        if not pending:
            break
        errors: dict[int, ConnectorError] = {}
        stopped: set[str] = set()  # streams with a transient failure in this write
        for pos, i in enumerate(pending):
            m = messages[i]
            if m.record.stream.key in stopped:
                if data.draw(st.booleans(), label="reported as failed"):
                    errors[pos] = Retriable("not sent")
                continue
            if id(m) in refused:
                errors[pos] = Permanent("refused")
                continue
            if data.draw(st.integers(0, 3), label="transient") == 0:
                errors[pos] = Retriable("later")
                stopped.add(m.record.stream.key)
                continue
            if all(s is not m for s in stored):
                stored.append(m)
        out = fold([messages[i] for i in pending], errors)
        dead += [messages[pending[pos]] for pos, _ in out.dead]
        pending = [pending[pos] for pos in out.retry]
    else:
        return  # hypothesis drew transient failures for ever: nothing to check
    for s in STREAMS:
        mine = [m.record.seq for m in stored if m.record.stream.key == s.key]
        assert mine == sorted(mine)
    assert {id(m) for m in dead} <= refused
    assert sorted(id(m) for m in stored + dead) == sorted(id(m) for m in messages)
