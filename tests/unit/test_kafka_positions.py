"""The Kafka sink's own bookkeeping, pure: the last batch acknowledged per stream and epoch in a
partition (what a partition lost is announced from), and its bounded memories of message ids."""

from __future__ import annotations

from bridge.errors import EPOCHS_REMEMBERED
from bridge.records import Stream
from connectors.kafka import _MEMORY, _Last, _remember

STREAM = Stream("llama-a", 0)


def test_the_last_batch_of_each_epoch_is_the_highest_seq_acknowledged_in_it() -> None:
    last = _Last(STREAM)
    assert last.stream == STREAM and last.ends == []  # (the stream a lost partition announces)
    last.note(5, 3)
    last.note(5, 7)
    last.note(5, 6)  # (acknowledged out of order: the highest stays)
    assert last.ends == [[5, 7]]
    last.note(6, 0)
    last.note(6, 0)
    last.note(5, 9)  # an older epoch's, late: the newest epoch is the one that goes on
    assert last.ends == [[5, 7], [6, 0]]
    last.note(6, 2)
    assert last.ends == [[5, 7], [6, 2]]


def test_only_the_newest_epochs_are_remembered() -> None:
    last = _Last(STREAM)
    for epoch in range(1, EPOCHS_REMEMBERED + 3):
        last.note(epoch, epoch * 10)
    assert last.ends == [[e, e * 10] for e in range(3, EPOCHS_REMEMBERED + 3)]


def test_a_memory_keeps_its_newest_entries_up_to_its_bound() -> None:
    memory: dict[str, int] = {}
    _remember(memory, {f"m{i}": i for i in range(_MEMORY - 1)})
    _remember(memory, {"next": -1})
    assert len(memory) == _MEMORY and "m0" in memory  # (at the bound: nothing forgotten yet)
    _remember(memory, {"a": 1, "b": 2})
    assert len(memory) == _MEMORY
    assert "m0" not in memory and "m1" not in memory and "m2" in memory  # the oldest go first
    assert memory["a"] == 1 and memory["b"] == 2 and memory["next"] == -1
