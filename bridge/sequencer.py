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
    """Ask the replay socket for everything from ``start``; ``until`` is the last seq needed."""

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
            self.delivered = seq
            out.append(Deliver(seq, payload))
            return out
        if seq <= self.delivered:
            out.append(Duplicate(seq))  # replay already delivered it
            return out
        if not self.can_replay:
            out.append(Gap(self.delivered + 1, seq - 1))
            out.append(Lost(self.delivered + 1, seq - 1, "no_replay"))
            self.delivered = seq
            out.append(Deliver(seq, payload))
            return out
        if self._replay is None and not self.held:
            out.append(Gap(self.delivered + 1, seq - 1))
        self._hold(seq, payload)
        if self._replay is None:
            self._attempts = 0
            self._request(out)
        return out

    def replayed(self, request_id: int, seq: int, payload: bytes) -> list[Action]:
        """One reply of the replay ``request_id``."""
        out: list[Action] = []
        if request_id != self._replay:
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
            self.delivered = seq
            out.append(Deliver(seq, payload, replayed=True))
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
            self.delivered = nxt
            out.append(Deliver(nxt, payload))

    def _lose(self, out: list[Action], from_seq: int, to_seq: int, reason: str) -> None:
        if to_seq >= from_seq:
            out.append(Lost(from_seq, to_seq, reason))
            self.delivered = max(self.delivered, to_seq)
        for s in [s for s in self.held if s <= self.delivered]:
            del self.held[s]
        self._suspect = None
        self._drain(out)

    def _request(self, out: list[Action]) -> None:
        self._request_id += 1
        self._replay = self._request_id
        self._replay_start = self.delivered + 1
        self._replay_first = True
        until = self._next_held() - 1 if self.held else (self.last_live or 0)
        out.append(RequestReplay(self._request_id, self._replay_start, max(until, self._replay_start), self._attempts))

    def _restart(self, out: list[Action], reason: str) -> None:
        """The engine restarted: close the old epoch (what is still missing is lost), open a new one."""
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
        self.last_live = None
        out.append(Reset(self.epoch, reason))
