"""What flows from the sequencer to the sinks: streams, records and their identities.

A *stream* is one (source name, dp rank). A *record* is one item of a stream, in order: an engine
batch (with its raw payload and decoded events) or a control record (``SourceReset``,
``EventsLost``; ``StateSeeded`` travels with the batch it is seeded with, see ``Record.seed``).
Records are created once and shared, read-only, by every sink.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Event = dict[str, Any]
"""One normalised engine event: ``{"type": name, field: value, ...}`` in wire order."""

RecordKind = Literal["batch", "SourceReset", "EventsLost", "StateSeeded"]

EMPTY_RECORD_BYTES = 64
"""What a record without payload (a control record) counts for in queue bounds (``Record.size``)."""


class Stream(msgspec.Struct, frozen=True):
    """One (source, dp_rank): the unit of ordering, sequencing and checkpointing."""

    source: str
    dp_rank: int
    labels: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def key(self) -> str:
        """Stable text key of the stream (Kafka message key, checkpoint key): ``source/dp_rank``."""
        return f"{self.source}/{self.dp_rank}"


class Record(msgspec.Struct):
    """One ordered item of a stream, handed to every sink.

    ``seq`` is the engine sequence number for batches; for ``EventsLost`` it is ``to_seq`` (the
    record stands where the lost span ends; ``to_seq`` has the one exception) and for
    ``SourceReset`` it is 0 (the first seq of the new epoch). ``position`` orders every record of
    a stream, control records included.
    """

    stream: Stream
    epoch: int
    seq: int
    kind: RecordKind = "batch"
    ts: float | None = None
    payload: bytes = b""
    events: list[Event] = msgspec.field(default_factory=list)
    from_seq: int | None = None
    reason: str | None = None
    received: float = 0.0
    event_count: int = -1
    """Events in the batch when ``events`` was left empty because no sink needs them (only the
    engine's bytes are forwarded); -1: ``len(events)``."""
    plain: bool = False
    """The decoder proved every event holds only JSON scalars and lists of them (see
    ``wire.DecodedBatch.plain``): the JSON renderer has nothing to check or convert."""
    bad_events: int = 0
    """Events of the batch that could not be decoded (dead-lettered; ``events`` holds the rest)."""
    state: Any = None
    """What this record changed in its stream's live-block state (a ``bridge.state.StateDelta``),
    when a sink keeps state; set once, as the record is handed to the sinks."""
    to_seq: int | None = None
    """An ``EventsLost`` whose lost span ends below where it stands (``seq``): a sink's announcement
    of a batch it refused for itself, written after later batches of the stream it stored, so
    that a consumer ordering by position does not take it for a copy. None: ``seq``."""
    instance: bytes | None = None
    """A batch's publisher lifetime UUID (vLLM #57789), when the sequencer knows it for certain:
    the ``instance`` header, which a pod taking the stream over reads (``SinkPosition``)."""
    seed: Record | None = None
    """A ``StateSeeded`` record (``bridge.snapshot``) this batch carries: the stream's state is
    re-seeded from an engine snapshot before the batch's own events, and the sinks write the
    record after the batch's messages. A ``StateSeeded`` record's ``from_seq`` is the snapshot's
    cut, ``reason`` its design, ``events`` the snapshot's events and those of the batches between
    the cut and ``seq``."""

    @property
    def n_events(self) -> int:
        """Events in the batch, whether or not they were decoded."""
        return self.event_count if self.event_count >= 0 else len(self.events)

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, slot): strictly increasing along a stream, control records included."""
        if self.kind == "SourceReset":
            return (self.epoch, 0)
        return (self.epoch, self.seq + 1)

    @property
    def size(self) -> int:
        """Bytes this record accounts for in queue bounds (its payload, or ``EMPTY_RECORD_BYTES``).
        Hot paths compute it inline, from the same constant."""
        return len(self.payload) or EMPTY_RECORD_BYTES

    def control(self) -> dict[str, Any]:
        """The body of a control record (everything but the common header)."""
        if self.kind == "SourceReset":
            return {"type": "SourceReset", "reason": self.reason or "publisher_restart"}
        if self.kind == "StateSeeded":
            return {"type": "StateSeeded", "cut": self.from_seq, "design": self.reason or ""}
        return {
            "type": "EventsLost",
            "from_seq": self.from_seq,
            "to_seq": self.lost_to,
            "count": self.lost_count,
            "reason": self.reason or "unrecoverable",
        }

    @property
    def lost_to(self) -> int:
        """The last seq an ``EventsLost`` announces lost (its ``seq``, unless it stands later)."""
        return self.seq if self.to_seq is None else self.to_seq

    @property
    def lost_count(self) -> int:
        """The batches an ``EventsLost`` announces lost (``from_seq`` to ``to_seq``, inclusive)."""
        to_seq = self.lost_to
        return to_seq - (self.from_seq if self.from_seq is not None else to_seq) + 1


def source_reset(stream: Stream, epoch: int, reason: str, received: float) -> Record:
    """The control record announcing that ``stream`` starts a new epoch (its engine restarted)."""
    return Record(stream=stream, epoch=epoch, seq=0, kind="SourceReset", reason=reason, received=received)


def events_lost(stream: Stream, epoch: int, from_seq: int, to_seq: int, reason: str, received: float) -> Record:
    """The control record announcing that ``from_seq..to_seq`` (inclusive) will never be delivered."""
    return Record(
        stream=stream,
        epoch=epoch,
        seq=to_seq,
        kind="EventsLost",
        from_seq=from_seq,
        reason=reason,
        received=received,
    )
