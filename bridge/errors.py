"""The one exception hierarchy of the bridge.

Library code raises these; only the CLI turns them into exit codes. Connector failures are
classified so the shared delivery loop (``bridge.sink``) can decide between retrying, backing off
and dead-lettering without knowing any client library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import Stream


class BridgeError(Exception):
    """Base of every error the bridge raises on purpose."""


class ConfigError(BridgeError):
    """The configuration is invalid; ``problems`` holds one ``path: message`` line per mistake."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class StartupError(BridgeError):
    """Something the bridge needs at start-up is unavailable (a port in use, a path it cannot write):
    the message names the thing and the fix, in one line."""


class DecodeError(BridgeError):
    """A frame or payload could not be decoded; ``reason`` is a short, low-cardinality label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class ConnectorError(BridgeError):
    """Base of connector failures. ``reason`` is a short label used in metrics."""

    reason = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class NotConnected(ConnectorError):
    """The sink's server cannot be reached; the write is retried after backoff."""

    reason = "not_connected"


class Retriable(ConnectorError):
    """A transient failure; the write is retried, after ``retry_after`` seconds when given."""

    reason = "retriable"

    def __init__(self, message: str, *, retry_after: float | None = None, reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retry_after = retry_after


class Permanent(ConnectorError):
    """The messages can never be written (too large, rejected): they go to the dead-letter file."""

    reason = "permanent"


class StreamRefused(Permanent):
    """The sink refuses every message of the stream for as long as it runs (a NATS subject that
    another stream owns). Unlike another refusal, the stream's announcements are dead-lettered
    too: kept, they would hold every other stream of the sink back for good (I5), and the
    destination will never take them; the connector's health says why, naming the fix."""

    reason = "stream_refused"


class PartialFailure(ConnectorError):
    """Some messages of a write were not delivered; the others were.

    ``errors`` maps each failed index (into the sequence passed to ``write``) to its own failure:
    ``Permanent`` when the sink refused that message for itself, ``Retriable`` / ``NotConnected``
    otherwise. ``PartialFailure(failed, cause)`` is the short form for one cause. The runtime
    (:func:`bridge.sink.fold`) decides what is retried: from a stream's first transient failure
    on, every later message of that stream is written again, in order, even one the sink took.
    """

    reason = "partial"

    def __init__(self, failed: Sequence[int] | Mapping[int, ConnectorError], cause: ConnectorError | None = None) -> None:
        if isinstance(failed, Mapping):
            self.errors: dict[int, ConnectorError] = dict(failed)
        else:
            if cause is None:
                raise TypeError("PartialFailure(failed, cause): a cause is needed with a list of indexes")
            self.errors = dict.fromkeys(failed, cause)
        if not self.errors:
            raise ValueError("PartialFailure with no failed message")
        self.failed = sorted(self.errors)
        self.cause = cause if cause is not None else next(iter(self.errors.values()))
        super().__init__(f"{len(self.errors)} message(s) failed: {self.cause}", reason=self.cause.reason)


EPOCHS_REMEMBERED = 16
"""How many of a stream's newest epochs a connector remembers what it stored of, so that a loss
announces each (a crash-looping engine opens many between two writes of a sink): a loss older
than that is announced from the oldest epoch remembered on."""


class SinkLost(ConnectorError):
    """The sink no longer holds messages it acknowledged earlier (I6): raised by ``write`` when a
    connector finds, before storing anything of that write, that its broker lost, replaced or
    deleted data on its own (a restart from an older snapshot, a deleted topic, stream or bucket).

    ``spans`` lists, per stream, what is gone: ``(stream, epoch, from_seq, to_seq)``, inclusive,
    as far as the connector can tell (``from_seq`` 0 when it cannot tell where the loss starts).
    The runtime announces each span to this sink alone (an ``EventsLost``, reason
    ``sink_lost:<sink>``, written ahead of the stream's next messages), clears the state of each
    stream named (a new generation, incomplete) and writes the same messages again. Before raising,
    the connector resets what it expects of the sink, so the write that follows goes through.
    ``states`` names streams whose state alone the sink lost (cleared alike, nothing announced).
    ``at`` gives, per span ``(stream key, epoch, from_seq, to_seq)``, the seq its announcement must stand at when the sink
    still holds later messages of the stream than its ``to_seq`` (a lost announcement of a
    refusal, announced again where it stood).
    """

    reason = "sink_lost"

    def __init__(
        self,
        message: str,
        spans: Sequence[tuple[Stream, int, int, int]],
        *,
        states: Sequence[Stream] = (),
        at: Mapping[tuple[str, int, int, int], int] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message, reason=reason)
        self.spans = list(spans)
        self.states = list(states)
        self.at = dict(at or {})
