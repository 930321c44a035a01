"""Per-stream sequencing: deliver every batch once, in order, or say exactly what is lost.

Pure: no sockets, no asyncio, no clock. One :class:`StreamSequencer` per (source, dp_rank) keeps
the two watermarks of protocol.md section 3 (last seq seen live, last seq delivered) and turns
each input (a live message, a replay reply, the end of a replay) into a list of actions for the
runtime to carry out in order:

- :class:`Deliver` the next batch; :class:`Duplicate` (dropped, counted);
- :class:`Gap` (counted) and :class:`RequestReplay` from the first missing seq;
- :class:`Reset` when the engine restarted (a live seq at or below the last live one): a new
  epoch that is delivered from its seq 0;
- :class:`Lost` for a span that replay cannot fill.

Replay rules (protocol.md section 1): the first reply above the requested start means the span
left the engine's buffer, but a ROUTER under load may also drop replies, so a loss is declared
only when two attempts in a row start above the same point; a replay that goes silent is
uncertain and retried, up to ``max_attempts``, before its span is declared lost.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec


class Deliver(msgspec.Struct, frozen=True):
    seq: int
    payload: bytes
    replayed: bool = False


class Duplicate(msgspec.Struct, frozen=True):
    seq: int


class Gap(msgspec.Struct, frozen=True):
    """A jump in the sequence was seen: ``from_seq..to_seq`` is missing for now."""

    from_seq: int
    to_seq: int


class RequestReplay(msgspec.Struct, frozen=True):
    """Ask the replay socket for everything from ``start``; ``until`` is the last seq needed
    (-1: everything up to the end marker)."""

    request_id: int
    start: int
    until: int
    attempt: int


class Lost(msgspec.Struct, frozen=True):
    from_seq: int
    to_seq: int
    reason: str


class Reset(msgspec.Struct, frozen=True):
    epoch: int
    reason: str


Action = Deliver | Duplicate | Gap | RequestReplay | Lost | Reset


class StreamSequencer:
    """The sequencing state machine of one stream. See the module docstring."""

    def __init__(
        self,
        *,
        can_replay: bool,
        replay_on_start: bool,
        max_held: int = 20000,
        max_attempts: int = 5,
        epoch: int = 0,
        delivered: int | None = None,
        delivered_ts: float | None = None,
        ts_of: Callable[[bytes], float | None] | None = None,
    ) -> None:
        self.can_replay = can_replay
        self.replay_on_start = replay_on_start and can_replay
        self.max_held = max_held
        self.max_attempts = max_attempts
        self.epoch = epoch
        # Highest seq delivered in this epoch (-1: none yet); None: unknown until the first message.
        self.delivered: int = -1 if delivered is None else delivered
        self._resumed = delivered is not None
        self._join = not self._resumed and not self.replay_on_start
        self._first = True
        self.last_live: int | None = None
        self.held: dict[int, bytes] = {}
        self._request_id = 0
        self._replay: int | None = None  # id of the replay in flight
        self._replay_start = 0
        self._replay_first = True
        self._attempts = 0
        self._suspect: int | None = None  # a start that a previous attempt's first reply skipped
        # The engine ts of the last delivered batch. A replay starts one seq early and compares
        # it: a different ts there means the engine restarted even though the live seqs never
        # went backwards (it restarted and got past our position while we were not looking).
        self._ts_of = ts_of
        self.delivered_ts = delivered_ts
        self._verify: int | None = None
        self._last_payload: bytes | None = None

    # -- inputs ---------------------------------------------------------------------------------
    def live(self, seq: int, payload: bytes) -> list[Action]:
        """A message from the live PUB stream."""
        out: list[Action] = []
        if self.last_live is not None and seq <= self.last_live:
            self._restart(out, "publisher_restart")  # a live seq never repeats unless the engine restarted
        elif self._first:
            self._first = False
            if self._resumed and seq <= self.delivered:
                self._restart(out, "publisher_restart")  # the engine restarted while the bridge was down
            elif self._join:
                self.delivered = seq - 1  # no history asked for: join mid-stream
        self.last_live = seq
        if seq == self.delivered + 1 and not self.held:
            self._deliver(out, seq, payload)
            return out
        if seq <= self.delivered:
            out.append(Duplicate(seq))  # replay already delivered it
            return out
        if not self.can_replay:
            out.append(Gap(self.delivered + 1, seq - 1))
            out.append(Lost(self.delivered + 1, seq - 1, "no_replay"))
            self._deliver(out, seq, payload)
            return out
        if self._replay is None and not self.held:
            out.append(Gap(self.delivered + 1, seq - 1))
        self._hold(seq, payload)
        if self._replay is None:
            self._attempts = 0
            self._request(out)
        return out

    def start(self) -> list[Action]:
        """At start-up: replay the engine's buffered history (or from the checkpoint) right away."""
        out: list[Action] = []
        if self.replay_on_start and self._replay is None:
            self._request(out)
        return out

    def probe(self) -> list[Action]:
        """The stream has been quiet: ask the replay socket for anything after our position.

        A live message dropped at the end of a burst shows as a gap only when the next one
        arrives; an idle engine may send none for a long time. The probe fetches such a tail, and
        its verify reply also reveals a restart the live stream has not shown yet.
        """
        out: list[Action] = []
        if self.can_replay and self._replay is None and self.last_live is not None and not self.held:
            self._attempts = 0
            self._request(out, to_end=True)
        return out

    def replayed(self, request_id: int, seq: int, payload: bytes) -> list[Action]:
        """One reply of the replay ``request_id``."""
        out: list[Action] = []
        if request_id != self._replay:
            return out
        if self._verify is not None:
            verify, self._verify = self._verify, None
            if seq == verify:
                if self._ts_of is not None and self._ts_of(payload) != self.delivered_ts:
                    self._restart(out, "publisher_restart", keep_held=False)
                    self._request(out)
                    return out
                out.append(Duplicate(seq))
                return out
        if self._replay_first:
            self._replay_first = False
            if seq > self._replay_start > self.delivered:
                if self._suspect == self._replay_start:
                    self._lose(out, self._replay_start, seq - 1, "replay_buffer_exceeded")
                else:
                    self._suspect = self._replay_start
            else:
                self._suspect = None
        if seq <= self.delivered:
            out.append(Duplicate(seq))
            return out
        if seq == self.delivered + 1:
            self.held.pop(seq, None)
            self._deliver(out, seq, payload, replayed=True)
            self._drain(out)
            return out
        if seq in self.held:
            out.append(Duplicate(seq))
        else:
            self._hold(seq, payload)
        return out

    def replay_finished(self, request_id: int, complete: bool) -> list[Action]:
        """The replay ended: ``complete`` when its end marker (or everything needed) arrived."""
        out: list[Action] = []
        if request_id != self._replay:
            return out
        self._replay = None
        if not self._gap_open():
            self._attempts = 0
            self._suspect = None
            return out
        progressed = self.delivered >= self._replay_start
        if progressed:
            self._attempts = 0
        else:
            self._attempts += 1
        if self._attempts >= self.max_attempts:
            end = self._next_held() - 1 if self.held else (self.last_live or self.delivered)
            self._lose(out, self.delivered + 1, end, "replay_unavailable")
            self._attempts = 0
            if not self._gap_open():
                return out
        self._request(out)
        return out

    # -- state ----------------------------------------------------------------------------------
    @property
    def replaying(self) -> bool:
        return self._replay is not None

    def resume_point(self) -> tuple[int, int, float | None]:
        """(epoch, delivered, ts of that batch): what a new sequencer for this stream starts from."""
        return (self.epoch, self.delivered, self._delivered_ts())

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, highest seq delivered) — what a checkpoint of this stream would hold."""
        return (self.epoch, self.delivered)

    # -- internals ------------------------------------------------------------------------------
    def _gap_open(self) -> bool:
        top = max(self.last_live if self.last_live is not None else -1, max(self.held, default=-1))
        return self.delivered < top

    def _next_held(self) -> int:
        return min(self.held)

    def _hold(self, seq: int, payload: bytes) -> None:
        # Past the bound a live batch is simply not held: it is still in the engine's buffer and
        # the next replay fetches it. Memory stays bounded, nothing is declared lost for it.
        if len(self.held) < self.max_held:
            self.held[seq] = payload

    def _drain(self, out: list[Action]) -> None:
        while self.held:
            nxt = self.delivered + 1
            payload = self.held.pop(nxt, None)
            if payload is None:
                return
            self._deliver(out, nxt, payload)

    def _deliver(self, out: list[Action], seq: int, payload: bytes, replayed: bool = False) -> None:
        self.delivered = seq
        self._last_payload = payload
        out.append(Deliver(seq, payload, replayed))

    def _lose(self, out: list[Action], from_seq: int, to_seq: int, reason: str) -> None:
        if to_seq >= from_seq:
            out.append(Lost(from_seq, to_seq, reason))
            if to_seq > self.delivered:
                self.delivered = to_seq
                self.delivered_ts = self._last_payload = None  # nothing known to verify a replay against
        for s in [s for s in self.held if s <= self.delivered]:
            del self.held[s]
        self._suspect = None
        self._drain(out)

    def _request(self, out: list[Action], to_end: bool = False) -> None:
        self._request_id += 1
        self._replay = self._request_id
        self._replay_start = self.delivered + 1
        self._replay_first = True
        # The last seq this replay must bring; -1: read to the end marker (start-up history).
        until = self._next_held() - 1 if self.held else (-1 if self.last_live is None or to_end else self.last_live)
        start = self._replay_start
        self._verify = None
        if self._ts_of is not None and self.delivered >= 0 and self._delivered_ts() is not None:
            self._verify = start = self.delivered
        out.append(RequestReplay(self._request_id, start, until, self._attempts))

    def _delivered_ts(self) -> float | None:
        """The ts of the last delivered batch, computed lazily (only a replay needs it)."""
        if self._last_payload is not None and self._ts_of is not None:
            self.delivered_ts = self._ts_of(self._last_payload)
            self._last_payload = None
        return self.delivered_ts

    def _restart(self, out: list[Action], reason: str, keep_held: bool = True) -> None:
        """The engine restarted: close the old epoch (what is still missing is lost), open a new one.

        ``keep_held``: the held live batches belong to the old epoch (the restart showed on the
        live stream); when a replay revealed it, they may be the new engine's and are dropped
        (the new epoch is replayed from its seq 0).
        """
        if not keep_held:
            self.held.clear()
        if self.held:
            top = max(self.held)
            while self.delivered < top:
                nxt = self._next_held()
                if nxt > self.delivered + 1:
                    out.append(Lost(self.delivered + 1, nxt - 1, reason))
                self.delivered = nxt
                out.append(Deliver(nxt, self.held.pop(nxt)))
        self._replay = None
        self._attempts = 0
        self._suspect = None
        self.epoch += 1
        self.delivered = -1
        self.delivered_ts = None
        self._last_payload = None
        self._verify = None
        if keep_held:
            self.last_live = None
        out.append(Reset(self.epoch, reason))
