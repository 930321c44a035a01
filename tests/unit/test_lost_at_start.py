"""What a state sink lost while no bridge ran, announced at the next start (I6; runtime
``Bridge._behind_at_start``), as a model: an engine history of up to three epochs that every sink
acknowledged, saved in the checkpoint; then each state sink's state holds a prefix of it (restored
from an older snapshot), nothing (restarted empty), or cannot say; and its records any prefix (more
than the state: its key alone deleted, or not written for a run; less: an events topic or stream
lost alone), nothing, or it cannot tell. Each sink is announced exactly what it lost of the records
in the checkpoint's epoch and the last one before it with a batch (an older epoch's tail is not
known: the documented limit): from its last record, or its state's head when it cannot tell;
nothing it still holds; nothing where its state cannot say, or where nothing at all is held beside
a state that is not behind (a stream idle past the sink's retention)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.checkpoint import Checkpointer, SinkPosition, StreamPosition, load
from bridge.records import Record, Stream, source_reset
from bridge.runtime import Bridge
from bridge.state import Head
from tests.support.strategies import examples

STREAM = Stream("e", 0)
SINKS = ("s0", "s1", "s2")


def history(sizes: list[int]) -> list[Record]:
    """Epochs 10, 11, ... of ``sizes`` batches each, every epoch opened by its SourceReset."""
    out: list[Record] = []
    for i, n in enumerate(sizes):
        epoch = 10 + i
        out.append(source_reset(STREAM, epoch, "publisher_restart", 0.0))
        out += [Record(STREAM, epoch, s, "batch", ts=1.0 + s, payload=b"%d:%d" % (epoch, s)) for s in range(n)]
    return out


def bridge_after(tmp: Path, records: list[Record], from_sinks: bool = False) -> Any:
    """What ``Bridge._behind_at_start`` reads of a bridge starting from the checkpoint a run that
    delivered ``records`` to every sink saved (no sockets, no tasks)."""
    before = Checkpointer(len(SINKS))
    before.state_sinks = list(SINKS)
    for sink in range(len(SINKS)):
        before.on_ack(sink, records)
    path = tmp / "checkpoint.json"
    before.write(path, *before.snapshot())
    fake = SimpleNamespace(
        checkpointer=Checkpointer(len(SINKS), load(path)),
        _state_sinks=[SimpleNamespace(name=name) for name in SINKS],
        _lost_at_start={},
        _held_unknown=set(),
        config=SimpleNamespace(checkpoint=SimpleNamespace(from_sinks=from_sinks)),
    )
    fake._state_at = lambda i, held: Bridge._state_at(fake, i, held)  # type: ignore[arg-type]
    return fake


@settings(max_examples=examples(300), deadline=None)
@given(sizes=st.lists(st.integers(0, 4), min_size=1, max_size=3), data=st.data())
def test_each_sink_is_announced_exactly_what_it_lost_in_the_last_two_epochs(
    tmp_path_factory: Any, sizes: list[int], data: st.DataObject
) -> None:
    records = history(sizes)
    batches = [(r.epoch, r.seq) for r in records if r.kind == "batch"]
    if not batches:
        return  # (nothing acknowledged: nothing to lose)
    # checkpoint.from_sinks: a sink that holds a batch with its fingerprint gets the rest again (the
    # stream resumes from it), nothing announced; one that holds nothing, or a batch nothing
    # verifies (no fingerprint anywhere), is told as without it.
    from_sinks, fingerprints = data.draw(st.booleans()), data.draw(st.booleans())
    bridge = bridge_after(tmp_path_factory.mktemp("ck"), records, from_sinks)
    acked = bridge.checkpointer.position(STREAM.key)
    assert acked is not None
    top = (acked.epoch, acked.seq)
    got: list[Any] = []
    records: list[dict[str, Any]] = []
    held: list[int | None] = []  # per sink: how many of ``batches`` it is expected to hold (None: nothing announced)
    expect_behind = False
    for _ in SINKS:
        k = data.draw(st.integers(-1, len(batches)))  # how many its state still reflects (-1: cannot say)
        if k < 0:
            got.append("unknown")
        elif k == 0:
            got.append(None)
        else:
            epoch, seq = batches[k - 1]
            got.append((Head(epoch=epoch, generation=1, seq=seq, live=0, complete=True), {}))
        state_behind = k >= 0 and (batches[k - 1] if k > 0 else (-1, -1)) < top
        # What its records hold: any prefix (more than the state: the state key alone deleted, or
        # not written for a run; less: an events topic or stream lost alone), nothing, or it
        # cannot tell.
        r = data.draw(st.sampled_from(["unknown", "none", "prefix"]))
        n = data.draw(st.integers(1, len(batches))) if r == "prefix" else 0
        records.append(
            {}
            if r == "unknown"
            else {STREAM.key: None}
            if r == "none"
            else {STREAM.key: SinkPosition(*batches[n - 1], ts=1.0 if fingerprints else None)}
        )
        if k < 0 or (from_sinks and fingerprints and r == "prefix"):
            held.append(None)  # (a state that cannot say: nothing to compare; or what it lacks comes again)
        elif r == "prefix":
            held.append(n)  # (the records decide)
            expect_behind |= state_behind or n < len(batches)
        elif state_behind:
            held.append(k if r == "unknown" else 0)  # (from the state's head, or nothing held)
            expect_behind = True
        else:
            held.append(None)  # (nothing held at all proves no loss: the sink's own limits)
    behind = Bridge._behind_at_start(bridge, STREAM, got, acked, records)
    # The checkpoint's epoch and the last one before it with a batch (an epoch with none has no tail).
    with_batches = sorted({e for e, _ in batches})
    last_two = set(with_batches[-2:] if sizes[-1] else with_batches[-1:])
    for i, conn in enumerate(bridge._state_sinks):
        spans = [x for x in bridge._lost_at_start.get(id(conn), [])]
        announced = [(e, s) for _, e, first, last in spans for s in range(first, last + 1)]
        h = held[i]
        assert announced == ([] if h is None else [b for b in batches[h:] if b[0] in last_two]), (sizes, h, spans)
    assert behind == expect_behind


def test_what_a_sink_gets_again_after_where_the_stream_resumes_is_not_announced_lost() -> None:
    """The reviewer's case: with checkpoint.from_sinks, the start check saw only the state sinks'
    positions and announced a state sink's loss past where the stream then resumed (another sink's
    batch anchored it): those seqs came again after their announcement. What lies past the resume
    point, in its epoch, is dropped from the announcement; older epochs are kept."""
    other = Stream("other", 0)
    spans = [(STREAM, 5, 0, 9), (STREAM, 4, 3, 7), (other, 5, 0, 9)]
    fake = SimpleNamespace(_lost_at_start={1: list(spans)})
    Bridge._not_lost_after(fake, STREAM, StreamPosition(5, 4))  # type: ignore[arg-type]
    assert fake._lost_at_start[1] == [(STREAM, 5, 0, 4), (STREAM, 4, 3, 7), (other, 5, 0, 9)]
    Bridge._not_lost_after(fake, STREAM, StreamPosition(5, -1))  # type: ignore[arg-type]
    assert fake._lost_at_start[1] == [(STREAM, 4, 3, 7), (other, 5, 0, 9)]
