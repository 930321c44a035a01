"""Per-stream sequencing: deliver every batch once, in order, or say exactly what is lost.

Pure: no sockets, no asyncio, no clock. One :class:`StreamSequencer` per (source, dp_rank) keeps
the two watermarks of docs/protocol.md section 3 (last seq seen live, last seq delivered) and turns
each input (a live message, a replay reply, the end of a replay, a dropped connection) into a
list of actions for the runtime to carry out in order:

- :class:`Deliver` the next batch; :class:`Duplicate` (dropped, counted);
- :class:`Gap` (counted) and :class:`RequestReplay` from the first missing seq;
- :class:`Reset` when the engine restarted: a new epoch that is delivered from its seq 0;
- :class:`Lost` for a span that replay cannot fill;
- :class:`Suspect` for a live batch whose seq its instance never published (dead-lettered).

Every :class:`Deliver` and :class:`Lost` carries the epoch it belongs to, stamped when it is
decided: the epoch changes in one place (``_restart``), after everything still owed for the old
engine instance has been emitted under the old epoch (design.md, invariants I1-I4).

Engine instances. The protocol carries no instance id, so the sequencer infers one:

- a live seq at or below the last one seen live is a new instance (seqs never repeat);
- continuity is *in doubt* after the live connection dropped and at start-up from a checkpoint:
  live batches are then held, unverified, until a replay has been checked against what was
  delivered (the new instance may have published its first messages while the socket was
  reconnecting, so its first seq seen can be exactly the old last + 1);
- every replay asks from the last delivered seq and compares that batch's fingerprint (engine ts
  and CRC-32 of the payload) with the one delivered; without one, it compares its first reply
  with a held live batch of the same seq, and a replayed seq below a held one but with a later
  engine ts comes from a later instance;
- where a batch has no ts (it could not be decoded), bytes decide: in doubt, a replay also
  brings the seqs of the batches waiting without one, and its replies are kept until the reply
  of such a seq compares bytes (``_LATER``; when another instance answers, its replies sort the
  batches waiting into its own and not its own: ``_SORTING``); a replay that stops before that
  reply is followed by one for exactly that seq, whose first reply is never dropped ("nothing":
  the answering instance never published it); a late live copy of a replayed batch is told by
  its CRC-32. What cannot be told this way is announced lost rather than delivered under the
  wrong epoch (docs/concepts/correctness.md, "Instance detection").

Instance identity from the wire (vLLM #57789: a 16-byte publisher lifetime UUID in the sequence
frame). Where a message carries one, it decides, and nothing above is inferred for it:

- the first UUID met on a stream without history in this process is adopted; a stream resumed
  from a checkpoint that kept its epoch's UUID (``instance``) starts with it, for certain, and
  one resumed without it verifies the first UUID it meets by replay first, as any stream: a UUID
  adopted in doubt is certain once the doubt ends with live batches under it among those it held
  (verified by replies under it or under none, or presumed continuous); one known only from a
  reply or a heartbeat, or verified by replies under another UUID, with the first live message
  under it;
- a UUID other than the epoch's instance's, or one where the epoch's instance sent none (an
  upgrade), or none where it sent one, is a restart for certain: the epoch ends, a new one opens
  with the reason ``instance_changed`` (:data:`INSTANCE_CHANGED`), and the old UUID is retired;
  at once after a dropped connection (a restart drops it first), else once confirmed: one frame
  could be a corrupt one (``_await_newcomer``; docs/concepts/correctness.md, "A new UUID"); one
  stamped before the epoch's first batch, an instance's before it read late, only by its replay
  (``_predates_epoch``);
- under the epoch's own UUID a seq at or below the last one seen is not a restart (a heartbeat's
  next seq, interleaving): it is a duplicate, or a batch the stream still needs; and a message
  under that UUID ends any doubt about continuity at once;
- a retired UUID (a late message of an instance gone, or a second publisher on the stream) is
  dropped as a duplicate: nothing of it goes under another instance's epoch (I1);
- replay replies that carry a UUID decide the same way once the epoch's UUID is known.
  Before that, a reply under the UUID that the live batches waiting carried is their
  instance's (no clock or bytes compared with them); it is still verified against the anchor.

A live seq that jumps past everything this instance is known to have published (a gap, with
replay) is taken on the engine's word only when confirmed (docs/concepts/correctness.md, "A seq
ahead of the engine"): it waits aside (``_aside``), outside both watermarks, until a later live
seq or a reply at or past it confirms it. The reply at its seq with other bytes, two replays of
this instance that end before reaching it, or a live seq below it read after it (once a replay
verified the instance) show it was never published (a corrupt or hostile frame): it is
dead-lettered as a :class:`Suspect`. Until then the seqs below it flow as usual, so a frame far
ahead of the engine neither turns the engine's next seq into a restart nor announces lost a span
nobody published.

Replay rules (docs/protocol.md section 1): the first reply above the requested start means the span
left the engine's buffer, but a ROUTER under load may also drop replies, so a loss is declared
only when two attempts in a row start above the same point; a replay that goes silent is
uncertain and retried, up to ``max_attempts``, before its span is declared lost.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import msgspec

Fingerprint = tuple[float | None, int | None]
"""What identifies a delivered batch across engine instances: (engine ts, CRC-32 of the payload);
a checkpoint written before CRCs were kept has the ts only."""


def fingerprint(ts: float | None, payload: bytes) -> Fingerprint:
    return (_finite(ts), zlib.crc32(payload))


def _finite(ts: float | None) -> float | None:
    return ts if ts is not None and math.isfinite(ts) else None


def _matches(fp: Fingerprint, ts: float | None, payload: bytes) -> bool:
    return ts == fp[0] and (fp[1] is None or zlib.crc32(payload) == fp[1])


def _name(instance: bytes | None) -> str:
    return instance.hex() if instance is not None else "no UUID"


class Deliver(msgspec.Struct, frozen=True):
    seq: int
    payload: bytes
    epoch: int
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


class Suspect(msgspec.Struct, frozen=True):
    """A live batch at a seq its instance is not known to have published (``detail`` says why):
    dead-lettered, never delivered (see ``_aside``)."""

    seq: int
    payload: bytes
    detail: str


class Lost(msgspec.Struct, frozen=True):
    from_seq: int
    to_seq: int
    reason: str
    epoch: int


class Reset(msgspec.Struct, frozen=True):
    epoch: int
    reason: str


Action = Deliver | Duplicate | Gap | RequestReplay | Lost | Reset | Suspect

PUBLISHER_RESTART = "publisher_restart"
"""``Reset.reason`` of a restart the sequencer inferred (seqs, fingerprints, clocks, replay)."""
INSTANCE_CHANGED = "instance_changed"
"""``Reset.reason`` of a certain restart: the publisher's lifetime UUID changed (vLLM #57789)."""
_RETIRED_MAX = 64  # retired UUIDs a stream remembers (oldest forgotten first)

# Verdicts on the instance answering a replay (see _check); _LATER: a later reply will tell.
_SAME, _NEW, _UNSURE, _LATER = "same", "new", "unsure", "later"
_SORTING = "sorting"  # another instance answers: its next replies tell whose the batches waiting are
_LATE_COPIES = 1024  # replayed batches whose late live copy a stream recognises by its bytes
_STASH_MAX = 16  # batches under another UUID a stream keeps for that UUID's confirmation
_STASH_AFTER = 64  # messages of the epoch's instance after which such a batch is dead-lettered


_NOBODY = b""
"""No UUID (a publisher's is 16 bytes; None stands for a message without one)."""

_Batch = tuple[int, bytes, float | None]  # a live batch: (seq, payload, engine ts)
_Stashed = tuple[bytes | None, _Batch, int]  # (its UUID, the batch, messages of the epoch's instance since)


class _Newcomer(msgspec.Struct):
    """A live message or heartbeat under a publisher UUID other than this epoch's instance's (or
    none where it sent one, or one where it sent none): a restart for certain, once confirmed
    (see StreamSequencer._await_newcomer)."""

    instance: bytes | None
    batch: _Batch | None  # the live message's; None: a heartbeat
    ts: float | None  # its engine ts: what numbers the new epoch alike in every pod
    seq: int  # its seq (a heartbeat's: the last one published)
    silent: int = 0  # replays about it that told nothing
    contradicted: bool = False  # a message of the epoch's instance came after it
    # Perhaps an instance's before the epoch's (stamped before it, or a heartbeat met while only
    # batches waiting bound the epoch): confirmed by its replay only, never taken on its word.
    older: bool = False


class StreamSequencer:
    """The sequencing state machine of one stream. See the module docstring.

    ``delivered``/``delivered_fp``/``anchor``: the position to resume from (a checkpoint), or None
    for a stream seen for the first time: the highest seq delivered or announced lost, and the
    fingerprint of the last batch delivered, at seq ``anchor`` (default: ``delivered``; lower when
    a loss was announced after it; ``delivered + 1`` for a batch known published but not known
    delivered, which the verifying replay then delivers again). ``known_top``: the highest seq the instance is known to have
    published (a stream resumed in the same process), announced lost if it restarted since.
    ``next_epoch(epoch, shown_at)`` numbers the epoch after ``epoch``; ``shown_at`` is the engine
    ts of what showed the new instance (None: unknown), the same for every bridge that reads the
    engine, so that two pods reading it at once number its new epoch alike (the runtime makes
    epochs unique across bridge runs; see ``bridge.checkpoint``). ``instance``/``retired``: the
    publisher UUID of the resume epoch's instance and those of instances gone, as a checkpoint
    kept them (see ``sure_instance``).
    """

    # The replay in flight, set by ``_request`` before any reply or end of it is read.
    _replay_start: int  # its first seq needed
    _anchor: tuple[int, Fingerprint] | None  # what it verifies
    _verdict: str  # is it this epoch's instance?
    _until: int  # the last seq it brings (-1: to the end marker)
    _replay_first: bool  # no reply at or above _replay_start yet
    _replied_below: bool  # a reply of this epoch's instance below _replay_start came (see _take)
    _answered: bool  # a reply came
    _asked_unverified: bool  # unverified batches were waiting when it was asked for
    _asked_top: int  # the highest seq waiting then (-1: none)
    _asked_claim: int  # and the highest a heartbeat of the epoch's instance said was published (-1: none)

    def __init__(
        self,
        *,
        can_replay: bool,
        replay_on_start: bool,
        max_held: int = 20000,
        max_attempts: int = 5,
        epoch: int = 0,
        delivered: int | None = None,
        delivered_fp: Fingerprint | None = None,
        anchor: int | None = None,
        known_top: int | None = None,
        ts_of: Callable[[bytes], float | None] = lambda _payload: None,
        next_epoch: Callable[[int, float | None], int] = lambda epoch, _shown_at: epoch + 1,
        clock_skew: float = 1.0,
        instance: bytes | None = None,
        retired: Iterable[bytes] = (),
    ) -> None:
        self.can_replay = can_replay
        self.replay_on_start = replay_on_start and can_replay
        self.max_held = max_held
        self.max_attempts = max_attempts
        # How far the estimate of when a disconnect was noticed, on the engine's clock, may be off:
        # a batch stamped earlier than that, by more than this, was published before it.
        self.clock_skew = clock_skew
        self.epoch = epoch
        # A ts that is not a finite number (NaN never equals itself; JSON keeps neither NaN nor
        # inf) says nothing about an instance: it counts as unknown.
        self._raw_ts_of = ts_of
        self._next_epoch = next_epoch
        # Highest seq delivered (or announced lost) in this epoch; -1: none yet.
        self.delivered: int = -1 if delivered is None else delivered
        # The last batch delivered in this epoch (-1: none), what a replay verifies the instance against.
        self._anchor_seq = self.delivered if anchor is None else anchor
        if delivered_fp is not None:
            delivered_fp = (_finite(delivered_fp[0]), delivered_fp[1])
        usable = delivered_fp is not None and delivered_fp != (None, None)
        self._fp = delivered_fp if usable and delivered is not None and self._anchor_seq >= 0 else None
        if self._fp is None:
            self._anchor_seq = -1
        self._last_payload: bytes | None = None  # the batch at _anchor_seq, fingerprinted when needed
        # First contact without history: a missing head is announced as ``joined_late``.
        self._fresh = delivered is None
        self._join = self._fresh and not self.replay_on_start
        self._resumed = delivered is not None and delivered >= 0  # until the first live message
        self.last_live: int | None = None
        self.held: dict[int, bytes] = {}  # live batches of this epoch's instance, above a gap
        # Continuity in doubt (see the module docstring): live batches wait here until verified.
        self._doubt = delivered is not None and can_replay
        self._doubt_at_start = self._doubt  # (in doubt since the start from a checkpoint, no drop since)
        self.unverified: dict[int, bytes] = {}
        # The lowest and highest live seqs read in doubt and not kept (past max_held): whose?
        self._unkept_lo = self._unkept = -1
        # Known published by this instance (an anchor above delivered: published, not known delivered).
        self._top = max(self.delivered, self._anchor_seq, known_top if known_top is not None else -1)
        self._request_id = 0
        self._replay: int | None = None  # id of the replay in flight (its state: set by _request)
        self._buffers = False  # a replay ever brought a batch (the engine's buffer is not empty by design)
        # seq -> (bytes, UUID) of frames refuted as a newcomer's (the last few): a reply without a
        # UUID that brings those very bytes is that UUID's instance's (a genuine one, refuted
        # while its replay socket could not tell).
        self._refuted: dict[int, tuple[bytes, bytes]] = {}
        # The UUID adopted in doubt (unsure) when a replay under another showed a restart: retired
        # once the new epoch's instance is read live (see live).
        self._prior: bytes | None = None
        self._attempts = 0
        self._suspect: int | None = None  # a start that a previous attempt's first reply skipped
        # Seen live, announced lost with the previous epoch, perhaps this instance's: settled by
        # this epoch too (delivered, or lost when it ends first; see _restart).
        self._owed = -1
        self._unclaimed = -1  # the highest of replies read and dropped without a verdict: whose?
        # seq -> (CRC-32, engine ts) of batches replayed above last_live: their late live copies.
        self._replayed_crc: dict[int, tuple[int, float | None]] = {}
        # Replies of the replay in flight kept until a later reply tells whose they are (_LATER).
        self._early: dict[int, bytes] = {}
        self._heard = -1  # the last reply seen while the verdict was pending
        self._skipped = False  # and a reply that would have compared bytes did not come
        self._verdict = _UNSURE
        self._until = -1
        self._probing = False  # the replay in flight asks for one batch waiting (see replay_finished)
        self._asked_from = -1  # the first seq the replay in flight asks for
        # >= 0: the replay in flight asks from seq 0 because one from this seq (published by this
        # epoch's instance) answered nothing: a reply below it is another instance's (see _check).
        self._floor = -1
        self._overlap: tuple[int, int] | None = None  # (seq, CRC-32) its first reply must repeat (_SORTING)
        # The held batch whose reply decides replies only the clocks contradict (see _check), or
        # -1; and how many times it was asked for alone (see _finished).
        self._decides_at, self._decides_tries = -1, 0
        # (seq, ts) of a batch of this epoch below an anchor without a ts (see reference()).
        self._ref: tuple[int, float] | None = None
        self._floor_ts: float | None = None  # engine ts of the batch that showed this epoch's instance
        # A restart a replay inferred by answering nothing from our position: no batch showed the
        # new instance, so the first batch delivered in its epoch sets _floor_ts. (A batch of
        # this instance dropped below it, its clock stepped back, is fetched by replay.)
        self._floor_pending = False
        self._first_ts: float | None = None  # engine ts of the first batch delivered in this epoch (in this process)
        # The last live seq of the instance before it, when the live stream showed the restart
        # (-1: unknown; see _late_of_older).
        self._older_last = -1
        self._doubt_since: float | None = None  # when the disconnect was noticed (the engine's clock: disconnected)
        self._drops = 0  # disconnects noticed since continuity came into doubt
        # The last epoch opened on a replay reply alone, the live connection never having dropped
        # since the instance was last verified: the engine restarted (its drop not noticed yet), or
        # the replay socket is another engine's (docs/concepts/limits.md): the wire cannot tell.
        self.shown_by_replay: int | None = None
        self.shown_at_start = False  # (and the live connection not known to have dropped since the start)
        # This epoch was opened for a UUID by a certain restart (``_restart_under``): its instance
        # is that UUID's, and the live batches that came under it are its, even in doubt.
        self._opened_for: bytes | None = None
        # And the doubt it opened in was the one before it (``_restart``'s ``again``), no drop
        # since: a message under another UUID is a newcomer to confirm, not a restart at once (it
        # may be a late frame of an instance gone before this one).
        self._reopened = False
        self._last_drop: float | None = None  # and the latest one (likewise)
        # The publisher UUID of this epoch's instance (None: unknown, or it sends none) and the
        # UUIDs of instances gone (see the module docstring).
        # A UUID a checkpoint kept for this epoch is certain; but only with a batch to verify a
        # replay against: without one, the replay that ends the doubt is taken on trust (whoever
        # answers), and a UUID kept would then contradict that presumption: it is met afresh.
        instance = instance if self._fp is not None else None
        self.instance: bytes | None = instance
        self._instance_sure = instance is not None  # else adopted out of doubt (in doubt: verified first)
        # Live batches under the UUID adopted in doubt wait with the others: the doubt's end makes
        # them this epoch's, and the UUID with them (see _trust).
        self._vouched = False
        # The seqs of those batches (unverified, read live under it): a reply under the same UUID
        # is their instance's, whatever the clocks say (see _check).
        self._vouching: set[int] = set()
        # The highest seq of replies in doubt that nothing could attribute (no UUID, nothing of the
        # epoch to compare): a heartbeat or live batch under the epoch's UUID read since that says
        # its instance published above that seq ends the doubt, another UUID is the restart, and a
        # reply at a held batch's seq compares bytes (see _check); -1: none.
        self._unattributed = -1
        # UUIDs whose set-aside frames were kept across a source removed and added again: a drop
        # confirms none of them (they were read before the instance running now showed, which it
        # would retire); a message or reply under the UUID itself does, and a new UUID taking the
        # epoch at once gives them their epochs first (see detached, _welcome_stashed).
        self._readded: set[bytes | None] = set()
        # Without a replay endpoint (no doubt to settle): the connection dropped and nothing was
        # read since, so a new UUID now is a restart at once.
        self._dropped = False
        self._anonymous = False  # live messages without a UUID were read in this epoch
        # (seq, payload) of a live batch that jumped past what this instance is known to have
        # published, not confirmed yet (see the module docstring); None: none.
        self._aside: tuple[int, bytes] | None = None
        self._aside_asked = False  # a replay was asked for since it came (only such a one can refute it)
        self._aside_refuted = 0  # replays since then that refute it (see _settle_aside)
        self._aside_silent = 0  # replays in a row since then that never came to an end
        self._aside_below = False  # a live seq below it was read after it (see _trust)
        self._replied_top = -1  # the highest reply of the replay in flight (what a Suspect's detail says)
        self._replier: bytes | None = None  # the UUID its replies came under (None: none, or none yet)
        # The highest seq an idle heartbeat of this instance said was published, above what was
        # seen (-1: none), and the replays since that refute it (see _settle_claim).
        self._claimed = -1
        self._claim_refuted = 0
        self._claimed_by: bytes | None = None  # the UUID of the heartbeat that said so
        self._retired: dict[bytes, None] = dict.fromkeys(r for r in retired if r != instance)
        # A message under another UUID than this epoch's instance's, not confirmed yet (see
        # _await_newcomer); None: none. The replay in flight that asks about it, if any.
        self._newcomer: _Newcomer | None = None
        self._newcomer_replay: int | None = None
        # (UUID, (seq, payload, ts), messages of the epoch's instance since) of newcomers a live
        # message of the epoch's instance came after (see _stash_newcomer), oldest first.
        self._stash: list[_Stashed] = []

    def _ts_of(self, payload: bytes) -> float | None:
        return _finite(self._raw_ts_of(payload))

    def _stamp(self, payload: bytes, ts: float | None) -> float | None:
        """A live message's engine ts: the caller's, else its payload's."""
        return _finite(ts) if ts is not None else self._ts_of(payload)

    def _late_of_older(self, seq: int) -> bool:
        """Can a live batch stamped before this epoch's first be a late one of the instance before
        it, rather than this instance's with a clock that stepped back (NTP)? The older
        instance's seqs grow on its connection: not at or below the last one read of it. And
        this instance's next seq in order, where the older one's next is another, is this one's.
        Unknown (-1, a restart a replay showed, which replay also repairs): always."""
        older = self._older_last
        if older < 0:
            return True
        if seq <= older:
            return False
        last = self.last_live
        return last is None or seq != last + 1 or seq == older + 1

    # -- inputs ---------------------------------------------------------------------------------
    def accept(self, seq: int, payload: bytes, ts: float | None = None, instance: bytes | None = None) -> bool:
        """:meth:`live` for its common case, without building actions: True when ``live`` would
        return exactly ``[Deliver(seq, payload, epoch)]`` (the next seq, nothing held, in doubt
        or older than this instance), with the same effect on the sequencer; False, and nothing
        changed, otherwise (then call ``live``). The hot path of every steady stream."""
        if seq != self.delivered + 1 or seq <= self._top or self.held or self._doubt or instance != self.instance:
            return False
        if (
            self._aside is not None
            or self._newcomer is not None
            or self._stash
            or self._dropped
            or self._floor_pending
            or self._prior is not None
        ):  # (live() settles these)
            return False
        last = self.last_live
        if last is not None and seq <= last:
            return False
        floor = self._floor_ts
        if floor is not None:
            ts = self._stamp(payload, ts)
            if ts is not None and ts < floor:
                return False
        # seq == delivered + 1 > _top >= delivered: no restart, no head to lose (seq 0 when
        # nothing was delivered), nothing held to drain; what live() and _deliver() set.
        self._resumed = False
        if instance is None:
            self._anonymous = True
        else:
            self._instance_sure = True  # (out of doubt, as live() would have it)
        self.last_live = self._top = self.delivered = self._anchor_seq = seq
        self._last_payload = payload
        if self._first_ts is None:
            self._first_ts = self._ts_of(payload)  # (as _deliver: see _predates_epoch)
        if self._replayed_crc:
            self._replayed_crc.clear()  # all at or below _top < seq: no late copy can follow
        return True

    def live(self, seq: int, payload: bytes, ts: float | None = None, instance: bytes | None = None) -> list[Action]:
        """A message from the live PUB stream (``ts``: its engine ts, when the caller has it;
        ``instance``: the publisher UUID its sequence frame carries, if any)."""
        out: list[Action] = []
        dropped, self._dropped = self._dropped, False
        if self._older_newcomer(out, seq, payload, ts, instance):
            return out
        if not self._meet(out, instance):
            out.append(Duplicate(seq))  # a retired instance's
            return out
        if instance is not None or self.instance is not None:
            if instance == self.instance and self._instance_sure:
                return self._same_instance(out, seq, payload)
            if instance != self.instance and self._restarts(instance):
                ts = self._stamp(payload, ts)
                if (not self._doubt or self._reopened or self._predates_epoch(ts)) and not dropped:
                    self._await_newcomer(out, _Newcomer(instance, (seq, payload, ts), ts, seq))
                    return out
                self._changed(out, instance, ts)  # (after a drop: a restart at once)
            # (the new epoch's first message, below; else first contact, or an id adopted in
            # doubt, not verified yet)
        # (At a first contact, not the epoch's next seq: that one may be its instance's whose clock
        # stepped back, or the epoch's first ts a corrupt one; as _late_of_older spares it.)
        first_contact = instance is not None and self.instance is None and seq != self.delivered + 1
        if self._before_epoch(seq, payload, ts) or (first_contact and self._predates_epoch(self._stamp(payload, ts))):
            out.append(Duplicate(seq))
            return out  # (an instance's before this epoch's: its UUID, if any, is not this epoch's)
        out += self._live(seq, payload, ts)
        if instance is None:
            self._anonymous = True
        else:
            if self._prior is not None and instance == self.instance:
                # The epoch's instance, read live: the UUID adopted in doubt before a replay under
                # this one showed the restart is an earlier instance's (its batches were settled
                # in the epoch that ended); a message under it now is a late one.
                self._retire(self._prior)
                self._prior = None
            self.instance = instance
            self._retired.pop(instance, None)
            self._instance_sure = not self._doubt
            if self._doubt and (seq in self.unverified or seq == self._unkept):
                self._vouched = True
                if self.unverified.get(seq) == payload:
                    self._vouching.add(seq)
        return out

    def heartbeat(self, next_seq: int, instance: bytes | None = None) -> list[Action]:
        """An idle heartbeat (vLLM #57789): the publisher's next seq, so everything below it was
        published. Its UUID is checked like a live message's; a tail the stream has not seen is
        fetched by replay (without replay the next batch shows the gap)."""
        out: list[Action] = []
        dropped, self._dropped = self._dropped, False
        if instance is not None and instance != self.instance and instance not in self._retired and self._older_uuid(instance):
            return out  # (an instance's whose frame was stamped before the epoch: a heartbeat shows nothing more)
        if not self._meet(out, instance):
            return out  # a retired instance's
        if instance is not None or self.instance is not None:
            if instance != self.instance:
                if not self._restarts(instance):
                    if self._first_ts is None:  # (first contact; with batches of the epoch delivered, whose
                        # UUID nothing said, a heartbeat's, with no ts to compare, may be an earlier instance's)
                        self.instance, self._instance_sure = instance, not self._doubt
                elif dropped or (self._doubt and not self._reopened and not self._first_waiting()):
                    self._changed(out, instance, None)  # (after a drop: a restart at once)
                else:
                    older = not dropped and self._doubt and self._first_waiting()
                    self._await_newcomer(out, _Newcomer(instance, None, None, next_seq - 1, older=older))
                    return out
            elif (self._unattributed < 0 and self._instance_sure) or 0 <= self._unattributed < next_seq:
                # (With a reply waiting that nothing could attribute, a heartbeat that does not say
                # its instance published that seq tells nothing: one of the old instance read late,
                # or the reply is the next one's, whose own message decides then.)
                self._certain(out)
        if instance is None and self.instance is None and self._doubt:
            return out  # (without an id a heartbeat proves nothing about the instance)
        top = next_seq - 1
        if top > max(self.delivered, self.last_live if self.last_live is not None else -1, max(self.held, default=-1)):
            if (self.instance is not None or instance is not None) and top > self._claimed:
                # (Under a UUID the epoch's instance is not known by, when none is: its own, or a
                # newer instance's, whose epoch then takes the claim: _restart_under, _new_instance.)
                self._claimed, self._claim_refuted, self._claimed_by = top, 0, self.instance or instance
            if self.can_replay and self._replay is None:
                self._attempts = 0
                self._request(out, to_end=True)
        return out

    def _meet(self, out: list[Action], instance: bytes | None) -> bool:
        """A live message or heartbeat under ``instance``: False for a retired instance's (dropped);
        else True, after what it settles of a batch under another UUID waiting or set aside."""
        if instance is not None and instance in self._retired:
            return False
        if self._stash and instance == self.instance:
            if instance is not None and any(i == instance for i, _, _ in self._stash):
                # Set aside for this UUID (kept across a re-add) while its epoch came by another
                # route (a replay under it, first contact): its own, not to age out as another's.
                self._take_stashed(out, instance)
            self._stash_counts(out)
        if self._newcomer is not None:
            self._newcomer_meets(out, instance)
        return True

    def _changed(self, out: list[Action], instance: bytes | None, ts: float | None) -> None:
        """The certain restart shown by a message (or a reply) under ``instance`` (engine ts ``ts``),
        at once: frames set aside across a re-add for UUIDs before it get their epochs first, and
        its own go out first in its epoch."""
        self._welcome_stashed(out, but=instance, kept=True)
        self._restart_under(out, instance, ts)
        self._take_stashed(out, instance)

    def _restart_under(self, out: list[Action], instance: bytes | None, ts: float | None) -> None:
        """The restart to ``instance``'s epoch: the old instance retired."""
        old = self.instance
        claim = self._claim_of(instance)
        self._restart(out, INSTANCE_CHANGED, trigger_ts=ts)
        if claim >= 0:
            self._claimed, self._claimed_by = claim, instance
        if old is not None:
            self._retire(old)  # (also one adopted in doubt: another id has come since)
        self.instance, self._instance_sure = instance, not self._doubt
        self._opened_for = instance
        self._reopened = self._doubt
        if ts is not None and self._floor_ts is None:
            self._floor_ts = ts  # (what showed the instance: a frame stamped before it is an earlier one's)

    def _take_stashed(self, out: list[Action], instance: bytes | None) -> None:
        """``instance`` has its epoch now: what was set aside for it (read before, kept across a
        source removed and added again) goes out first, in its seq order."""
        for batch in self._unstash(instance):
            out += self.live(*batch, instance)

    def _claim_of(self, instance: bytes | None) -> int:
        """A heartbeat's claim made under ``instance``, the new epoch's, taken from the epoch that
        ends (which would settle it); -1: none."""
        if instance is None or self._claimed_by != instance or self._claimed < 0:
            return -1
        claim, self._claimed, self._claimed_by = self._claimed, -1, None
        return claim

    def _restarts(self, instance: bytes | None) -> bool:
        """Is a message under ``instance`` (not this epoch's, not retired) another instance's, for
        certain? Not at first contact (a stream without history here): then it opens nothing."""
        return self.instance is not None or self._anonymous

    def _await_newcomer(self, out: list[Action], newcomer: _Newcomer) -> None:
        """A message under another UUID than this epoch's instance's (or none where it sent one,
        or one where it sent none) is a restart for certain, once confirmed: a single corrupt or
        forged frame must not retire the engine's own UUID (its batches would then be dropped
        as a retired instance's). It waits, outside the epoch, until a second message under its
        UUID (or a third UUID), a replay reply under it (or, without UUIDs on replies, its own
        bytes at its seq) confirms it; a reply under the epoch's UUID, or a replay that shows the
        engine never published that seq, refutes it (dead-lettered: a refuted genuine batch is
        fetched again by the new epoch's replay). One that the replay socket cannot tell about
        (``max_attempts`` times) is taken on its word, unless the epoch's instance went on
        meanwhile; without replay a message of the epoch's instance sets it aside for its UUID
        (_stash_newcomer). (Docs: concepts/correctness.md, "A new UUID".)"""
        self._newcomer = newcomer
        first = next((batch for i, batch, _ in self._stash if i == newcomer.instance), None)
        if first is not None and not self._predates_epoch(newcomer.ts) and not self._predates_epoch(first[2]):
            newcomer.ts = first[2]  # (what numbers the epoch: its first message)
            self._welcome(out)  # its second message: the first was set aside (_stash_newcomer)
            return
        if self._replay is not None:
            # Asked before it came: it cannot refute it, and no other restart may be shown while
            # it waits (what the replay brought and did not settle is fetched again).
            self._drop_replay()
        if self.can_replay:
            self._ask_newcomer(out)

    def _ask_newcomer(self, out: list[Action]) -> None:
        """Ask the replay socket for the newcomer's seq and the epoch's last batch delivered,
        whichever comes first, up to the other: the engine holding the socket answers (a fresh
        DEALER's first reply is never dropped), with the newcomer's batch or the epoch's."""
        nc = self._newcomer
        assert nc is not None
        self._newcomer_replay = self._next_request()
        self._verdict, self._early, self._heard, self._skipped = _UNSURE, {}, -1, False
        self._answered = False
        fp = self._fingerprint()
        self._anchor = (self._anchor_seq, fp) if fp is not None else None
        at = max(nc.seq, 0)
        start, until = (min(at, self._anchor_seq), max(at, self._anchor_seq)) if self._anchor is not None else (at, at)
        if self._anchor is None and self.instance is not None and self.unverified:
            # Nothing delivered to compare with: the first batch waiting under the epoch's UUID is
            # its instance's, which answers with it (see _newcomer_replied).
            first = min(self.unverified)
            start, until = min(at, first), max(at, first)
        out.append(RequestReplay(self._newcomer_replay, start, until, nc.silent))

    def _older_newcomer(self, out: list[Action], seq: int, payload: bytes, ts: float | None, instance: bytes | None) -> bool:
        """A second message under the waiting newcomer's UUID, stamped before the epoch's last
        batch delivered (less ``clock_skew``), while the replay about the newcomer is in flight:
        the newcomer may be an instance before the epoch's, whose last batches are read late,
        interleaved with its successor's (several connections into one bound socket; a stream met
        for the first time at an engine restart). It confirms nothing: the replay decides, and
        the message is set aside for the newcomer's UUID (delivered if it is confirmed, else
        dead-lettered as the newcomer is). True when it is."""
        nc = self._newcomer
        if nc is None or instance is None or instance != nc.instance or self._replay is None:
            return False
        if self._replay != self._newcomer_replay:
            return False
        ts = self._stamp(payload, ts)
        if not self._predates_epoch(ts):
            return False
        # Past the bound, not kept (as a live batch past max_held): the engine's buffer still has
        # it, fetched by the epoch's replay if the newcomer is confirmed. Nothing else is pushed out.
        if sum(1 for i, _, _ in self._stash if i == instance) < _STASH_MAX:
            self._stash.append((instance, (seq, payload, ts), 1))
        return True

    def _predates_epoch(self, ts: float | None) -> bool:
        """Is a frame stamped ``ts`` older than this epoch's instance: before the first batch
        delivered in the epoch (in this process; with none yet, the one that showed the instance,
        else the first one waiting in doubt under its UUID), less ``clock_skew``? Under another
        UUID such a frame is an instance's before the epoch's, read late (its pipe drained after
        its successor's), unless the replay shows otherwise: nothing else confirms it (a drop, a
        second message, a third UUID, time), or it would open an epoch after the running
        instance's and retire it."""
        if ts is None or not self.can_replay:
            return False
        bound = self._first_ts if self._first_ts is not None else self._floor_ts
        if bound is None and self.instance is not None:
            # (nothing delivered yet: the first batch read under its UUID, waiting in doubt)
            bound = min((t for p in self.unverified.values() if (t := self._ts_of(p)) is not None), default=None)
        return bound is not None and ts < bound - self.clock_skew

    def _is_older(self, nc: _Newcomer) -> bool:
        """Is the newcomer perhaps an instance's before the epoch's (stamped before it, or a
        heartbeat met while only batches waiting bound the epoch)? Then its replay alone confirms
        it: not a drop (perhaps its own dead connection's), a second message, a third UUID, time."""
        return nc.older or self._predates_epoch(nc.ts)

    def _first_waiting(self) -> bool:
        """Is the epoch bounded only by batches waiting in doubt (nothing delivered in it in this
        process, no floor; see _predates_epoch)? A heartbeat under another UUID, which has no ts
        to compare, may be an earlier instance's then: it waits as a newcomer."""
        return self._first_ts is None and self._floor_ts is None and bool(self.unverified)

    def _older_uuid(self, instance: bytes) -> bool:
        """Is ``instance`` the UUID of a frame waiting (the newcomer's, or set aside) stamped
        before the epoch's instance? Its heartbeat, read late too, shows nothing more."""
        nc = self._newcomer
        if nc is not None and nc.instance == instance and self._is_older(nc):
            return True
        return any(i == instance and self._predates_epoch(b[2]) for i, b, _ in self._stash)

    def _newcomer_meets(self, out: list[Action], instance: bytes | None) -> None:
        """A live message or heartbeat (under ``instance``, not retired) while a newcomer waits:
        any other than the epoch's UUID confirms it (a second one under its UUID; one under a third
        UUID: the newcomer came and went, and the third waits in its place). One under the epoch's
        UUID does not refute it by itself (late batches of the instance before it, read
        interleaved): the replay about it decides, or without one it is kept aside
        (_stash_newcomer)."""
        nc = self._newcomer
        assert nc is not None
        if instance != self.instance and self._is_older(nc):
            self._stash_newcomer(out)  # (the third one waits in its place; this one ages out, or its UUID's reply confirms it)
        elif instance != self.instance:
            self._welcome(out, instance)
        elif self._replay is not None and self._replay == self._newcomer_replay:
            nc.contradicted = True  # (the replay about it decides: late batches of this instance prove nothing)
        else:
            self._stash_newcomer(out)
            self._resume(out)  # (the replay it cancelled, if the stream still needs one)

    def _welcome(self, out: list[Action], by: bytes | None = _NOBODY) -> None:
        """The newcomer is confirmed: the certain restart, then its batch as the new epoch's.
        ``by``: the third UUID whose message confirmed it, if one did (its batches set aside go in
        its own epoch, after the newcomer's: see _await_newcomer)."""
        nc = self._settle_newcomer()
        if nc.instance is not None and nc.instance in self._retired:
            if nc.batch is not None:  # (retired since it came)
                out.append(Duplicate(nc.batch[0]))
            return
        self._welcome_stashed(out, nc.instance, by)
        if nc.instance != self.instance and self._restarts(nc.instance):
            self._restart_under(out, nc.instance, nc.ts)
        for batch in [*self._unstash(nc.instance), *([nc.batch] if nc.batch is not None else [])]:
            out += self.live(*batch, nc.instance)
        if nc.batch is None:
            out += self.heartbeat(nc.seq + 1, nc.instance)  # (what it says was published: the new epoch's)

    def _welcome_stashed(
        self, out: list[Action], but: bytes | None = _NOBODY, by: bytes | None = _NOBODY, kept: bool = False
    ) -> None:
        """What confirms a newcomer (a dropped connection; a UUID after it) confirms the batches
        set aside for other UUIDs too: each came and went, an instance of its own (a crash loop),
        in the order they came; ``but``'s go with it (see _welcome), and ``by``'s (the UUID whose
        message confirms it) in the epoch after it. Those kept across a re-add only when ``kept``:
        a new UUID taking the epoch at once came after them (not a drop: they were read before the
        instance running since the re-add showed, which a drop would retire)."""
        skip = set() if kept else self._readded
        # (Frames older than this epoch's batches are an instance's before it: never an epoch after it.)
        skip |= {i for i, batch, _ in self._stash if self._predates_epoch(batch[2])}
        # Every group taken out first: delivering one goes through live(), whose _meet ages (and
        # may dead-letter) what is still set aside.
        chosen = dict.fromkeys(i for i, _, _ in self._stash if i not in (but, by) and i not in skip)
        groups = [(i, self._unstash(i)) for i in chosen]
        for instance, batches in groups:
            if instance is not None and instance in self._retired:
                out += [Duplicate(seq) for seq, _, _ in batches]
                continue
            if instance != self.instance and self._restarts(instance):
                self._restart_under(out, instance, batches[0][2])
            for batch in batches:
                out += self.live(*batch, instance)

    def _stash_newcomer(self, out: list[Action]) -> None:
        """A live message of the epoch's instance while a newcomer waits: the newcomer is not the
        engine now, but it may be the next instance, read interleaved with the late batches of
        this one (several connections into one bound socket are read fair-queued): its batch is
        kept aside for its UUID (``_stash``), delivered in that UUID's epoch if it is confirmed
        later, and dead-lettered as not the engine's after ``_STASH_AFTER`` more messages of the
        epoch's instance (the one whose epoch it is then), or past the bound."""
        nc = self._settle_newcomer()
        if nc.batch is None:
            return
        self._stash.append((nc.instance, nc.batch, 1))
        if len(self._stash) > _STASH_MAX:
            self._drop_stashed(out, self._stash.pop(0), "more such batches came")

    def _stash_counts(self, out: list[Action]) -> None:
        """Another message of the epoch's instance: stashed batches age (see _stash_newcomer)."""
        kept = []
        for instance, batch, n in self._stash:
            if n + 1 >= _STASH_AFTER:
                self._drop_stashed(out, (instance, batch, n), f"its engine went on under {_name(self.instance)}")
            else:
                kept.append((instance, batch, n + 1))
        self._stash = kept
        self._readded.intersection_update(i for i, _, _ in kept)

    def _drop_stashed(self, out: list[Action], stashed: _Stashed, why: str) -> None:
        self._not_the_engines(out, stashed[0], stashed[1], why)
        self._owe([stashed[1]])

    @staticmethod
    def _not_the_engines(out: list[Action], instance: bytes | None, batch: _Batch, why: str) -> None:
        """A live batch under another UUID than the engine's, shown not to be its: dead-lettered."""
        seq, payload, _ = batch
        out.append(
            Suspect(
                seq,
                payload,
                f"live seq {seq} under publisher {_name(instance)} is not the running engine's (a late frame of "
                f"an instance gone, or a corrupt or forged one): {why}",
            )
        )

    def _unstash(self, instance: bytes | None) -> list[_Batch]:
        """The batches kept for ``instance`` (confirmed now), in seq order, taken from the stash."""
        mine = sorted(batch for i, batch, _ in self._stash if i == instance)
        self._stash = [x for x in self._stash if x[0] != instance]
        self._readded.discard(instance)
        return mine

    def _read_under(self, seq: int, payload: bytes) -> bytes | None:
        """The UUID a reply without one (``seq``, ``payload``) was read under live, when it is the
        very batch of a frame set aside, waiting or refuted under another UUID than the epoch's:
        the replier is that frame's instance (its bytes say so where its UUID does not). Asked
        only while the epoch's UUID is unsure: under a sure one, the frame may be the engine's own
        batch under a corrupt UUID, which must never name a restart."""
        refuted = self._refuted.get(seq)
        if refuted is not None and refuted[0] == payload:
            return refuted[1]
        nc = self._newcomer
        if nc is not None and nc.batch is not None and nc.batch[:2] == (seq, payload):
            return nc.instance
        return next((i for i, (n, p, _), _ in self._stash if (n, p) == (seq, payload)), None)

    def _refute(self, out: list[Action], why: str) -> None:
        """The newcomer is shown not to be the engine's: dead-lettered, never delivered, with what
        was set aside for its UUID."""
        nc = self._settle_newcomer()
        batches = [*([nc.batch] if nc.batch is not None else []), *self._unstash(nc.instance)]
        for batch in batches:
            self._not_the_engines(out, nc.instance, batch, why)
        if nc.instance is not None:
            for seq, payload, _ in batches:
                self._refuted[seq] = (payload, nc.instance)
            while len(self._refuted) > _STASH_MAX:
                del self._refuted[next(iter(self._refuted))]
        self._owe(batches)

    def _owe(self, batches: Sequence[_Batch]) -> None:
        """Frames under another UUID dead-lettered (refuted, or aged out of the stash) that may be
        this epoch's own next seqs, while its UUID is not known for certain: the epoch settles
        them (see _perhaps_ours)."""
        if not self._instance_sure:
            self._owed = max([self._owed, *(seq for seq, _, ts in batches if self._perhaps_ours(seq, ts, batches))])

    def _perhaps_ours(self, seq: int, ts: float | None, batches: Sequence[_Batch]) -> bool:
        """May a frame refuted or set aside under another UUID (``seq``, engine ts ``ts``, among
        ``batches``) be this epoch's own instance's next seq, its UUID not known for certain (read
        after its successor's first)? Then the epoch settles it: delivered, or announced lost when
        it ends (I3). Yes when it is stamped at or after the epoch's last batch delivered (less
        ``clock_skew``), or its seqs follow what was delivered without a hole; a seq far past it,
        stamped before it, says nothing of the epoch."""
        if seq <= self.delivered:
            return False
        fp = self._fingerprint()
        if fp is not None and fp[0] is not None and ts is not None and ts >= fp[0] - self.clock_skew:
            return True
        seqs = {b[0] for b in batches}
        return all(n in seqs for n in range(self.delivered + 1, seq))

    def _settle_newcomer(self) -> _Newcomer:
        nc, self._newcomer = self._newcomer, None
        assert nc is not None
        if self._replay is not None and self._replay == self._newcomer_replay:
            # Its later replies are dropped; those read are fetched again, and settled by this
            # epoch if it ends first (they may be the epoch's instance's: see _unclaim).
            self._drop_replay()
        self._newcomer_replay = None
        return nc

    def _drop_replay(self) -> None:
        """The replay in flight is given up: its later replies are ignored, those kept without a
        verdict are fetched again (see _unclaim)."""
        self._unclaim()
        self._replay = self._newcomer_replay = None

    def _resume(self, out: list[Action], to_end: bool = False) -> None:
        """After a newcomer is settled: the replay the stream needs, if any."""
        needed = self._doubt or self._gap_open() or self._aside is not None or self._owed > self.delivered
        if self.can_replay and self._replay is None and (to_end or needed):
            self._attempts = 0
            self._request(out, to_end=to_end)

    def _newcomer_replied(self, out: list[Action], seq: int, payload: bytes, instance: bytes | None) -> None:
        """A reply to the replay about the newcomer: its UUID decides, when it has one (a third
        UUID: the newcomer came and went, and the third is the engine now). Without, the
        newcomer's own batch confirms it; the epoch's last batch delivered (with none, one
        waiting under the epoch's UUID), or any other batch at or past the newcomer's seq,
        refutes it (the engine holding the socket never published it:
        the newcomer, which did, would answer with it; out of doubt, no drop showed an instance
        in between). A reply below both tells nothing."""
        nc = self._newcomer
        assert nc is not None
        self._heard = max(self._heard, seq)
        if instance is not None:
            if instance == self.instance:
                refuted = True
            elif instance != nc.instance:
                self._welcome(out)
                if self._instance_sure and instance != self.instance and instance not in self._retired:
                    self._replayed_by_new_instance(out, seq, payload, instance, self._ts_of(payload))
                else:
                    self._resume(out, to_end=True)
                return
            else:
                refuted = False
        elif nc.batch is not None and seq >= nc.batch[0]:
            refuted = seq != nc.batch[0] or payload != nc.batch[1]
        elif self._anchor is not None and seq == self._anchor[0] and _matches(self._anchor[1], self._ts_of(payload), payload):
            refuted = True
        elif self._anchor is None and self.instance is not None and self.unverified.get(seq) == payload:
            refuted = True  # (a batch waiting under the epoch's UUID: its instance holds the socket)
        else:
            return
        if refuted:
            self._refute(out, f"its engine answers the replay with its seq {seq} under {_name(instance)}")
            self._resume(out, to_end=True)  # (what it brought: fetched again)
        else:
            self._welcome(out)
            self._resume(out, to_end=True)  # (what the new instance published after it: a quiet engine)

    def _newcomer_finished(self, out: list[Action], complete: bool) -> None:
        """The replay about the newcomer ended without a reply that decides."""
        nc = self._newcomer
        assert nc is not None
        heard = self._heard
        self._drop_replay()
        if complete and (self._buffers or self._predates_epoch(nc.ts)) and nc.batch is not None and heard < nc.seq:
            # Its end marker before its seq, from an engine whose buffer was seen at work: whoever
            # holds the replay socket never published it (the newcomer, which did, would hold it).
            self._refute(out, f"its engine holds nothing from seq {nc.seq} on")
            self._resume(out, to_end=heard >= 0)  # (what it brought: fetched again)
            return
        nc.silent += 1
        if nc.silent >= self.max_attempts:
            # The replay socket cannot tell: taken on its word, unless the epoch's instance went on.
            if nc.contradicted:
                self._refute(out, f"its engine went on under {_name(self.instance)}, and its replay socket cannot tell")
                self._resume(out)
            elif self._is_older(nc):
                self._refute(out, "it was stamped before the epoch's instance, and its replay socket cannot tell")
                self._resume(out)
            else:
                self._welcome(out)
                self._resume(out, to_end=True)
            return
        self._ask_newcomer(out)

    def _retire(self, instance: bytes) -> None:
        self._retired[instance] = None
        if len(self._retired) > _RETIRED_MAX:
            del self._retired[next(iter(self._retired))]

    def _certain(self, out: list[Action]) -> None:
        """A live message under this epoch's UUID: the live publisher is the same instance, for
        certain, and so is every batch waiting (each was checked by its UUID): doubt ends. (Not
        the replay in flight: whoever holds the replay socket when it is served answers it.)"""
        if self._doubt:
            self._trust(out)

    def _same_instance(self, out: list[Action], seq: int, payload: bytes) -> list[Action]:
        """A live message under this epoch's UUID: never a restart. It ends the doubt, unless a reply
        nothing could attribute waits at its seq or above (see _check): then it is a late batch of
        this epoch's instance, which says nothing of who answered the replay."""
        if seq > self._unattributed:
            self._certain(out)
        self._resumed = False
        if self._confirm_aside(out, seq, payload):
            out.append(Duplicate(seq))
            return out
        # (A seq below the batch set aside proves nothing here: under one UUID seqs may interleave.)
        if self._set_aside(out, seq, payload):
            return out
        if self.last_live is None or seq > self.last_live:
            self.last_live = seq
        self._forget_replayed(seq)
        self._top = max(self._top, seq)
        if self._join and self.delivered < 0 and seq > 0:
            self._lose(out, seq - 1, "joined_late")
        if seq <= self.delivered or seq in self.held:
            out.append(Duplicate(seq))
        elif seq == self.delivered + 1:
            self._deliver(out, seq, payload)
            self._drain(out)
        elif not self.can_replay:
            out.append(Gap(self.delivered + 1, seq - 1))
            self._lose(out, seq - 1, self._head_reason("no_replay"))
            self._deliver(out, seq, payload)
        else:
            if self._replay is None and not self.held:
                out.append(Gap(self.delivered + 1, seq - 1))
            self._keep(self.held, seq, payload)
            if self._replay is None:
                self._request(out)
        return out

    def _set_aside(self, out: list[Action], seq: int, payload: bytes) -> bool:
        """Set a live batch aside if its seq jumps past everything this instance is known to have
        published (out of doubt, with replay; see the module docstring): True if it was."""
        last = self.last_live
        if not self.can_replay or self._aside is not None:
            return False
        if last is None:
            return False  # an epoch's first live batch: no seq of it to jump from (docs: "A seq ahead of the engine")
        if seq <= max(last, self._top, self._claimed, self.delivered, max(self.held, default=-1)) + 1:
            return False
        if self._replay is None and not self.held:
            out.append(Gap(self.delivered + 1, seq - 1))
        self._aside, self._aside_asked, self._aside_refuted, self._aside_silent = (seq, payload), False, 0, 0
        self._aside_below = False
        if self._replay is None:
            self._attempts = 0
            self._request(out)
        return True

    def _confirm_aside(self, out: list[Action], seq: int, payload: bytes, reply: bool = False) -> bool:
        """Seq ``seq`` of this epoch's instance came (live, or a reply if ``reply``) at or past the
        batch set aside: that seq was published, and the batch joins those held. The reply at
        that very seq, or another live batch there, with other bytes makes it a :class:`Suspect`
        instead (the reply is the engine's; the later live batch is verified in its place). True
        when the message is that batch itself again (a live copy: a duplicate)."""
        aside = self._aside
        if aside is None or seq < aside[0]:
            return False
        if seq == aside[0] and payload != aside[1]:
            self._aside = None
            where = "its engine's reply" if reply else "another live batch"
            out.append(Suspect(seq, aside[1], f"live seq {seq} differs from {where} at that seq"))
            return False
        self._hold_aside(aside)
        return seq == aside[0] and not reply

    def _hold_aside(self, aside: tuple[int, bytes]) -> None:
        """The batch set aside is taken as this instance's: held, as any live batch above a gap."""
        self._aside = None
        if aside[0] > self.delivered:
            self._keep(self.held, *aside)
        self._top = max(self._top, aside[0])
        self.last_live = max(aside[0], self.last_live if self.last_live is not None else -1)
        self._forget_replayed(self.last_live)

    def _forget_replayed(self, seq: int) -> None:
        """The live stream reached ``seq``: no late live copy of a batch replayed at or below it
        can come any more."""
        if self._replayed_crc:
            for s in [s for s in self._replayed_crc if s <= seq]:
                del self._replayed_crc[s]

    def _settle_claim(self, complete: bool) -> None:
        """The replay in flight ended: does it refute what a heartbeat said was published? One
        to the end marker, answered by this epoch's instance, that brought nothing up to it does;
        twice in a row (a ROUTER under load may drop a reply), and the claim is dropped: a forged
        or corrupt heartbeat far ahead is then never announced lost at the engine's restart."""
        if self._claimed <= self._top:
            self._claimed = -1  # (reached: what is published is known without it)
            return
        if complete and self._until < 0 and self._verdict is _SAME and self._replied_top < self._claimed:
            self._claim_refuted += 1
            if self._claim_refuted >= 2:
                self._claimed = -1

    def _settle_aside(self, out: list[Action], complete: bool) -> None:
        """The replay in flight ended: does it refute the batch set aside? Only one asked for
        after it came, answered by this epoch's instance and asked for that seq, can: its end
        marker came first (a reply at or past that seq would have confirmed it). One that tells
        neither leaves it waiting, for the next replay or a live seq past it; except after
        ``max_attempts`` replays in a row that never came to an end, or brought nothing from an
        engine whose buffer was never seen at work (a replay that cannot tell anything: then it
        is taken on its word, as a batch above a gap, rather than held for ever by a quiet
        engine; unless a live seq below it came after it: see _trust)."""
        aside = self._aside
        if aside is None or not self._aside_asked:
            return
        if not complete or not (self._answered or self._buffers):
            self._aside_silent += 1
            if self._aside_silent >= self.max_attempts and not self._aside_below:
                self._hold_aside(aside)  # (the live stream contradicted it: the doubt's end settles it)
            return
        self._aside_silent = 0
        reached = self._until < 0 or self._until >= aside[0]  # (a reply at or past it would have confirmed it)
        # Answered by this epoch's instance; or with nothing at all from seq 0 on by an engine whose
        # buffer was seen at work (from a later seq, nothing at all shows another instance:
        # _finished).
        empty = not self._answered and self._buffers and self._replay_start == 0
        if reached and not self._probing and (self._verdict is _SAME or empty):
            # Twice: a ROUTER under load may drop a reply (the one at that seq).
            self._aside_refuted += 1
            if self._aside_refuted >= 2:
                self._aside = None
                detail = f"live seq {aside[0]} is ahead of its engine: two replays hold nothing past seq {self._replied_top}"
                out.append(Suspect(aside[0], aside[1], detail))

    def _before_epoch(self, seq: int, payload: bytes, ts: float | None) -> bool:
        """Is a live batch stamped before the first one known of this epoch's instance a late batch of
        an instance that came before it (read after the restart showed), never this one's? (If
        not, this instance's clock stepped back: its batches are stamped from there on.)"""
        floor = self._floor_ts
        if floor is None:
            return False
        ts = self._stamp(payload, ts)
        if ts is None or ts >= floor:
            return False
        if self._late_of_older(seq):
            if self._older_last >= 0:
                self._older_last = seq
            return True
        self._floor_ts = ts
        return False

    def _live(self, seq: int, payload: bytes, ts: float | None) -> list[Action]:
        """:meth:`live` by inference (no UUID decides), for a batch not older than the epoch."""
        out: list[Action] = []
        if not self._doubt and self._confirm_aside(out, seq, payload):
            out.append(Duplicate(seq))
            return out
        last = self.last_live
        copy = False  # proven a copy of a batch of this epoch's instance, by its bytes
        if last is not None and seq <= last:
            fp = self._fingerprint() if seq == self._anchor_seq else None
            if fp is not None and _matches(fp, self._ts_of(payload), payload):
                out.append(Duplicate(seq))  # the very batch delivered last, sent twice: not a restart
                return out
            self._restart(out, PUBLISHER_RESTART, trigger_ts=self._ts_of(payload))  # a live seq never repeats
            self._floor_ts = self._ts_of(payload)
            self._older_last = last
        elif seq <= self._top:
            # At or below what this instance is known to have published, yet above anything seen
            # live: a late copy of a replayed batch, or a new instance starting over. The same
            # bytes as a batch replayed is a copy (no clock needed). Other bytes: another
            # instance's, older (a late batch) or newer, which the two clocks tell; without both,
            # newer (an older one's late batch would be older than the epoch's first: _floor_ts).
            replayed = self._replayed_crc.get(seq)
            if replayed is None:
                other = self._other_instance(seq, payload)
                copy = not other and seq == self._anchor_seq and self._fingerprint() is not None
            elif zlib.crc32(payload) == replayed[0]:
                other, copy = False, True
            else:
                ts, theirs = self._ts_of(payload), replayed[1]
                other = ts is None or theirs is None or ts > theirs
            if other:
                self._restart(out, PUBLISHER_RESTART, evidence=(seq, self._ts_of(payload)))
            elif self._resumed and seq <= self.delivered and self._fingerprint() is None:
                self._restart(out, PUBLISHER_RESTART)  # nothing to compare with: the plain rule
        self._resumed = False
        if not self._doubt:
            if self._aside is not None and seq < self._aside[0]:
                # Below the batch set aside, read after it: one instance never publishes so. Either
                # that batch is not its, or this is another instance's: continuity is in doubt.
                self._aside_below = True
                self._into_doubt(out)
            elif self._set_aside(out, seq, payload):
                return out
        self.last_live = seq
        self._forget_replayed(seq)
        if self._doubt:
            if seq > self.delivered:
                self._keep(self.unverified, seq, payload)
                if seq not in self.unverified:
                    self._unkept = seq
                    if self._unkept_lo < 0:
                        self._unkept_lo = seq
                if self._replay is None:
                    self._attempts = 0
                    self._request(out)
            else:
                out.append(Duplicate(seq))
                if self._replay is None and not copy:
                    # A late copy or a new instance's batch that the checks above could not tell
                    # (no ts to compare): a replay can.
                    self._attempts = 0
                    self._request(out)
            return out
        self._top = max(self._top, seq)
        if self._join and self.delivered < 0 and seq > 0:  # the head (this batch goes out below: once)
            self._lose(out, seq - 1, "joined_late")
        if seq == self.delivered + 1:
            self._deliver(out, seq, payload)
            if self.held:
                self.held.pop(seq, None)
                self._drain(out)
            return out
        if seq <= self.delivered:
            out.append(Duplicate(seq))  # replay already delivered it
            return out
        if not self.can_replay:
            out.append(Gap(self.delivered + 1, seq - 1))
            self._lose(out, seq - 1, self._head_reason("no_replay"))
            self._deliver(out, seq, payload)
            return out
        if self._replay is None and not self.held:
            out.append(Gap(self.delivered + 1, seq - 1))
        self._keep(self.held, seq, payload)
        if self._replay is None:
            self._request(out)  # a first attempt: out of doubt, no replay in flight means none counted
        return out

    def start(self) -> list[Action]:
        """At start-up: replay the engine's buffered history (or from the checkpoint) right away."""
        out: list[Action] = []
        if self.replay_on_start and self._replay is None:
            self._request(out, to_end=True)
        return out

    def detached(self, unread_top: int = -1) -> None:
        """The stream stopped (discovery removed its source); this sequencer resumes it when the
        source is added again, with everything it had read and not settled (I3), after
        :meth:`disconnected`. The replay in flight is gone with its task: replies kept for a
        verdict are dropped, to be fetched again (their seqs owed). ``unread_top``: the highest
        seq of live messages read but never sequenced (settled by this epoch if it ends first)."""
        if self._replay is not None:
            self._drop_replay()
        # A message under another UUID waiting for its confirmation: set aside for its UUID, as
        # the batches set aside with it (_older_newcomer), unconfirmed (adding the source again is
        # no evidence either way: disconnected(readded=True) confirms none of them). A message
        # under its UUID confirms it later, and it goes out first (_take_stashed: without a replay
        # endpoint nothing else would bring it, I4); else it ages out (_stash_counts).
        nc, self._newcomer = self._newcomer, None
        if nc is not None and nc.batch is not None and len(self._stash) < _STASH_MAX:
            self._stash.append((nc.instance, nc.batch, 1))
        self._readded.update(i for i, _, _ in self._stash)
        self._top = max(self._top, unread_top)

    def disconnected(self, now: float | None = None, readded: bool = False) -> list[Action]:
        """The live connection dropped (noticed at ``now``, if given, on the engine's clock: the
        caller's wall clock less the engine's offset, see StreamPipeline._engine_time): whatever arrives
        next may come from a new instance. A batch set aside was read before the drop: it counts
        as any batch read then (held; a live seq at or below it is then another instance's)."""
        out: list[Action] = []
        if self._newcomer is not None and self._is_older(self._newcomer):
            self._stash_newcomer(out)  # (the drop may be its own dead connection's: see _predates_epoch)
        elif self._newcomer is not None:
            self._welcome(out)  # (a restart drops the connection: as if it came after the drop)
        elif self._stash and not readded:
            # (every one of them; not when the source was added again: no evidence either way, so
            # each waits for a message under its UUID, and ages out under the engine's: _stash_counts)
            self._welcome_stashed(out)
        if self._aside is not None:
            self._hold_aside(self._aside)
        self._dropped = not self.can_replay  # (with a replay endpoint, the doubt says it)
        self._into_doubt(out, now)
        return out

    def _into_doubt(self, out: list[Action], now: float | None = None) -> None:
        if not self.can_replay:
            return  # nothing to verify an instance with
        if self._verdict is _SORTING and self._replay is not None:
            # The rest of what the answering instance was asked for may now come from another.
            self._new_instance(out)
        elif self._heard >= 0 and self._replay is not None:
            # Replies kept for a verdict: the rest may now come from another instance. Ask again.
            self._unclaim()
            self._request(out)
        self._drops += 1
        self._last_drop = now
        self._reopened = False
        self._doubt_at_start = False
        if not self._doubt:
            self._doubt = True
            self._doubt_since = now  # (_drops was 0: it is whenever continuity is not in doubt)
            # A replay in flight asked the instance that is going away; the next one must verify
            # whoever answers now. With a gap open, ask at once (retried while the engine is down).
            self._replay = None
            if self._gap_open():
                self._attempts = 0
                self._request(out)

    def probe(self) -> list[Action]:
        """The stream has been quiet: ask the replay socket for anything after our position.

        A live message dropped at the end of a burst shows as a gap only when the next one
        arrives; an idle engine may send none for a long time. The probe fetches such a tail, and
        its verification also reveals a restart the live stream has not shown yet. Every stream
        that has a position probes, a new epoch's included before any live message of it came
        (a quiet engine is never left behind); only one that joins late and has heard nothing
        yet, with no doubt to settle, has no history to ask for.
        """
        out: list[Action] = []
        if self._newcomer is not None:
            if self.can_replay and self._replay is None:
                self._ask_newcomer(out)
            return out
        heard = not self._join or self.last_live is not None or self._doubt or bool(self.held)
        if self.can_replay and self._replay is None and heard:
            self._attempts = 0
            self._request(out, to_end=True)
        return out

    def replayed(self, request_id: int, seq: int, payload: bytes, instance: bytes | None = None) -> list[Action]:
        """One reply of the replay ``request_id`` (``instance``: the publisher UUID its sequence
        frame carries, if any: where this epoch's is known, it decides as on the live stream)."""
        out: list[Action] = []
        if request_id != self._replay:
            return out
        self._answered = True
        self._buffers = True
        if instance is None and not self._instance_sure:
            instance = self._read_under(seq, payload)
        if instance is not None:
            self._replier = instance
        if request_id == self._newcomer_replay:
            self._newcomer_replied(out, seq, payload, instance)
            return out
        self._replied_top = max(self._replied_top, seq)
        if instance is not None and instance in self._retired:
            return out  # (a retired instance's reply: nothing of it is taken, the epoch's UUID sure or not)
        if instance is not None and self._instance_sure:
            if instance != self.instance:
                if instance not in self._retired:
                    self._replayed_by_new_instance(out, seq, payload, instance, self._ts_of(payload))
                return out  # (a retired instance's reply: nothing of it is taken)
            if self._doubt:
                self._trust(out)
            if self._verdict is _UNSURE:  # this epoch's instance answers: no verification needed
                self._verdict = _SAME
                early, self._early, self._heard, self._skipped = self._early, {}, -1, False
                for s in sorted(early):
                    self._take(out, s, early[s])
        if self._verdict is _SORTING:
            if self._overlap is not None:
                if (seq, zlib.crc32(payload)) != self._overlap:
                    self._new_instance(out)  # not the instance that answered before: sort no further
                    return out
                self._overlap = None
                return out  # (kept already)
            self._hold(seq, payload)
            if next(self._unsorted(seq), None) is None:
                self._new_instance(out)
            return out
        if self._verdict is _UNSURE:
            verdict = self._check(seq, payload, instance)
            if verdict is _LATER:
                self._hold(seq, payload)
                return out
            if verdict is _NEW:
                self._hold(seq, payload, always=True)  # this reply and those held before it are the new instance's
                if next(self._unsorted(seq), None) is not None:
                    self._verdict = _SORTING
                else:
                    self._new_instance(out)
                return out
            early, self._early, self._heard, self._skipped = self._early, {}, -1, False
            if verdict is _UNSURE:
                out.append(Duplicate(seq))  # below the verification point: already delivered
                return out
            self._verdict = _SAME
            self._trust(out, instance)
            for s in sorted(early):
                self._take(out, s, early[s])
            if self._anchor is not None and seq == self._anchor[0] and seq <= self.delivered:
                self._replied_below = True  # (see _take)
                out.append(Duplicate(seq))  # the verification reply itself (delivered before)
                return out
        if instance is not None and self.instance is None and not self._anonymous and not self._doubt:
            # The epoch's batches are this UUID's replies: a live message under another one is
            # not a first contact but a newcomer (perhaps a late one of an instance before it).
            # Unsure: the replay socket answered, not the live publisher.
            self.instance = instance
        self._take(out, seq, payload)
        return out

    def _replayed_by_new_instance(self, out: list[Action], seq: int, payload: bytes, instance: bytes, ts: float | None) -> None:
        """A replay answered under another UUID than this epoch's: a restart, for certain, shown
        by this reply (``ts``: its engine ts, which numbers the new epoch alike in every pod). The
        new epoch takes this reply and asks its instance for the rest from seq 0 to the end: the
        replay given up (its later replies are dropped from now on) may have been bringing seqs
        above this one that no live message will show (a quiet engine)."""
        self._changed(out, instance, ts)
        self._top = max(self._top, seq)
        if seq <= self.delivered:
            out.append(Duplicate(seq))
        elif seq == self.delivered + 1:
            self._deliver(out, seq, payload, replayed=True)
        else:
            self._keep(self.held, seq, payload)
        self._note_replayed(seq, payload)
        self._request(out, rest=True)

    def _hold(self, seq: int, payload: bytes, always: bool = False) -> None:
        """Keep a reply until the verdict (past the bound it is not kept: fetched again later)."""
        self._heard = seq
        if always or len(self.held) + len(self.unverified) + len(self._early) < self.max_held:
            self._early[seq] = payload

    def _unclaim(self) -> None:
        """The replies kept for a verdict that never came are dropped, to be fetched again; the
        epoch settles their seqs if it ends first (they may be another instance's that goes away)."""
        self._owed = self._unclaimed = max(self._owed, self._unclaimed, self._heard)
        self._early, self._heard, self._skipped = {}, -1, False

    def _next_request(self) -> int:
        """A new replay in flight (replies of any earlier one are ignored from now on)."""
        self._replier = None
        self._request_id += 1
        self._replay = self._request_id
        return self._request_id

    def _request_more(self, out: list[Action], start: int, until: int, attempt: int | None = None) -> None:
        """Ask the instance that answered for the rest of what tells whose the batches waiting are
        (the verdict's state stays as it is, unlike _request); ``attempt``: for its back-off
        (default: the replay's)."""
        self._until = until
        out.append(RequestReplay(self._next_request(), start, until, self._attempts if attempt is None else attempt))

    def _note_replayed(self, seq: int, payload: bytes) -> None:
        """A reply of this epoch's instance above the live stream: its live copy may still come
        (see live())."""
        if len(self._replayed_crc) < _LATE_COPIES and (self.last_live is None or seq > self.last_live):
            self._replayed_crc[seq] = (zlib.crc32(payload), self._ts_of(payload))

    def _unsorted(self, seq: int) -> Iterator[int]:
        """The unverified batches above reply ``seq`` whose instance only a later reply of this
        replay can tell, by its bytes: their ts, or that of the first reply, is unknown. The
        latest read first: asked for one, it is found at once (this runs for every reply)."""
        first = self._ts_of(self._early[min(self._early)]) if self._early else None
        return (u for u, p in reversed(self.unverified.items()) if u > seq and (first is None or self._ts_of(p) is None))

    def _new_instance(self, out: list[Action]) -> None:
        """The replay in flight was answered by another instance than this epoch's: the replies
        kept (``_early``) are its."""
        replies, heard, replier = self._early, self._heard, self._replier
        self._early, self._heard, self._skipped = {}, -1, False
        first = min(replies)
        old = self.instance
        claim = self._claim_of(replier)
        self._restart(out, PUBLISHER_RESTART, evidence=(first, self._ts_of(replies[first])), theirs=replies, by=replier)
        if claim >= 0:
            self._claimed, self._claimed_by = claim, replier
        if replier is not None and old not in (None, replier):
            self._prior = old  # (adopted in doubt, its batches settled in the epoch that ended: see live)
        if replier is not None and replier not in self._retired:
            # Its batches are the replies under this UUID: a message under another one is not a
            # first contact but a newcomer (perhaps a late one of an instance in between).
            # Unsure: the replay socket answered, not the live publisher.
            self.instance = replier
        if heard > max(replies):
            self._owed = max(self._owed, heard)  # its replies read but not kept (past max_held)
        # A live batch stamped before the new instance's first one known is an older instance's,
        # read late (as after a restart shown on the live stream).
        self._floor_ts = min((t for t in map(self._ts_of, replies.values()) if t is not None), default=None)
        for seq in sorted(replies):
            self._top = max(self._top, seq)
            self._note_replayed(seq, replies[seq])
            self.held.pop(seq, None)  # the new instance's own copy of this seq wins
            if seq == self.delivered + 1:
                self._deliver(out, seq, replies[seq], replayed=True)
            else:
                self._keep(self.held, seq, replies[seq])
        self._drain(out)
        self._request(out)

    def _take(self, out: list[Action], seq: int, payload: bytes) -> None:
        """A reply of this epoch's instance."""
        self._confirm_aside(out, seq, payload, reply=True)
        self._top = max(self._top, seq)
        self._note_replayed(seq, payload)
        if seq < self._replay_start:
            self._replied_below = True
        elif self._replay_first:
            self._replay_first = False
            # Skipped from the start: the buffer no longer holds it (twice in a row: lost). Not
            # after a reply below it: an engine's buffer holds consecutive seqs, so it held this
            # one too, and a ROUTER at its high-water mark dropped the reply (asked again).
            if seq > self._replay_start > self.delivered and not self._replied_below:
                if self._suspect == self._replay_start:
                    self._lose(out, seq - 1, self._head_reason("replay_buffer_exceeded"))
                else:
                    self._suspect = self._replay_start
            else:
                self._suspect = None
        if seq <= self.delivered:
            out.append(Duplicate(seq))
        elif seq == self.delivered + 1:
            self.held.pop(seq, None)
            self._deliver(out, seq, payload, replayed=True)
            self._drain(out)
        elif seq in self.held:
            out.append(Duplicate(seq))
        else:
            self._keep(self.held, seq, payload)

    def replay_finished(self, request_id: int, complete: bool) -> list[Action]:
        """The replay ended: ``complete`` when its end marker (or everything needed) arrived."""
        out: list[Action] = []
        if request_id != self._replay:
            return out
        if request_id == self._newcomer_replay:
            self._newcomer_finished(out, complete)
            return out
        self._settle_aside(out, complete)
        self._settle_claim(complete)
        self._finished(out, complete)
        if self._aside is not None and not self.replaying:
            self._request(out)  # until it is confirmed or refuted
        return out

    def _finished(self, out: list[Action], complete: bool) -> None:
        self._replay = None
        if self._verdict is _UNSURE and self._decides_at >= 0 and self._early:
            # Replies only the clocks contradict, kept for the reply at a held batch's seq (see
            # _check): asked for alone (a fresh DEALER's first reply is never dropped) when this
            # replay stopped before it, again after a replay cut short or silent, up to
            # max_attempts times; if it never comes, the clocks decide.
            if self._decides_tries < self.max_attempts and self._heard < self._decides_at:
                # (A replay cut short, or silent, is asked again, as any replay is, up to max_attempts.)
                self._decides_tries += 1
                self._request_more(out, self._decides_at, self._decides_at, attempt=self._decides_tries - 1)
                return
            self._new_instance(out)
            return
        if self._verdict is _SORTING:
            end = self._heard
            cut = 0 <= self._until <= end  # it stopped at the last seq asked for, not at the engine's last
            rest = max(self._unsorted(end), default=-1) if complete and cut and self._overlap is None else -1
            if rest >= 0:
                # The rest from the same instance: from its last reply, which the first reply of
                # the next replay must repeat (a fresh DEALER's first reply is never dropped).
                self._overlap = (end, zlib.crc32(self._early[end])) if end in self._early else None
                if self._overlap is not None:
                    self._request_more(out, end, rest)
                    return
            self._new_instance(out)
            return
        heard, verdict_pending = self._heard, self._heard >= 0 and self._verdict is _UNSURE and not self._skipped
        probed = self._until if self._probing else None
        self._unclaim()  # (no verdict came of them)
        if complete and verdict_pending and not self._probing:
            # It stopped (at the last seq asked for, or at the engine's last) before the reply that
            # would compare bytes: ask for exactly that seq. The first reply of a fresh DEALER is
            # never dropped: that batch, or nothing (its instance would hold it). A held batch
            # (this epoch's instance's) first: the unverified ones may be the answering one's.
            mine = [w for w, p in self.held.items() if w > heard and self._ts_of(p) is None]
            above = mine or [w for w in (*self.held, *self.unverified) if w > heard]
            if above:
                self._attempts = 0  # an answer came: the probe's attempts start afresh
                self._request(out, probe=min(above))
                return
        # (A heartbeat of the epoch's instance saying, before it was asked, that it published past
        # our position counts as a batch read live: that instance would hold it.)
        claimed = self._asked_claim >= self._replay_start and self._until < 0 and not self._probing
        if complete and not self._answered and (self._asked_unverified or claimed or (self._replay_start > 0 and self._buffers)):
            # The engine holds nothing from our position on, yet the instance that published it
            # still holds its latest seq (a fresh DEALER's first reply is never dropped by the
            # ROUTER's high-water mark), and the one that published the unverified batches would
            # hold those: another instance, which has not got this far yet. (Unless its buffer
            # is off by configuration: then only after it was seen to work.) Only batches read
            # before the replay was asked for count: those read since may have been published
            # after the engine answered (from seq 0, nothing buffered yet is no proof).
            self._restart(out, PUBLISHER_RESTART)
            if not self._doubt:
                # No batch of the new instance is known yet: one read live before its replay
                # answers may be a late one of an instance in between. It waits, unverified,
                # and that replay tells (no drop time: nothing is taken as published before it).
                self._doubt, self._doubt_since = True, None
            self._request(out)
            return
        if complete and not self._answered and self._asked_from > 0 and self._floor < 0 and not self._probing:
            # Nothing from a seq this epoch's instance published, and no replay has shown the
            # engine's buffer at work: an engine whose buffer is off answers so, and so does a new
            # instance that has not got this far (and may never, when the engine stays quiet).
            # Ask from seq 0: a batch below that seq is the new instance's.
            self._request(out, floor=self._asked_from)
            return
        if complete and not self._answered and self.unverified:
            self._request(out)  # ask again, now that the batches waiting are known published
            return
        if self._doubt:
            if self._unattributed >= 0:
                return  # (it answered: whose the replies are, a message under a UUID says; probed again)
            # Nothing in this replay could tell whether the instance is the same one. (One asked
            # for before the batches waiting now came could not check them: it does not count.)
            if self._asked_top >= 0 or not self.unverified:
                self._attempts += 1
            if self._attempts < self.max_attempts:
                if probed is not None and (probed in self.unverified or probed in self.held):
                    self._request(out, probe=probed)  # the answer before it told nothing more
                elif self.unverified or self._gap_open():
                    self._request(out)
                return
            self._attempts = 0
            if not self.unverified:
                # The old instance's gap cannot be filled by anyone who can be trusted: settle it
                # (its held batches delivered, the rest lost) and stay in doubt. Live seqs above it
                # (read in doubt, past the bound) are not known to be its: verify them afresh.
                top = max(self._top, self._claimed, max(self.held, default=-1))  # (what its heartbeat said it published too)
                if top > self.delivered:
                    self._lose(out, top, "replay_unavailable")
                if self._gap_open():
                    self._request(out)
                return
            # The replay socket cannot tell: presume continuity (docs/concepts/correctness.md, "Instance detection")
            # rather than hold live batches forever.
            self._trust(out)
        if not self._gap_open():
            self._attempts = 0
            self._suspect = None
            return
        progressed = self.delivered >= self._replay_start
        if progressed:
            self._attempts = 0
        else:
            self._attempts += 1
        if self._attempts >= self.max_attempts and self._aside is not None and not self.held:
            # The gap is there only by the batch set aside, neither confirmed nor refuted yet: it
            # is not lost before _settle_aside decides (refuted by two answers; or held, its gap
            # then lost so, after max_attempts replays that never came to an end).
            self._attempts = 0
        if self._attempts >= self.max_attempts:
            if self._answered and not complete and not progressed:
                # The engine answers but breaks off right at our next seq, every time (a batch over
                # ingest.max_frame_bytes makes ZMQ drop the connection): only that batch is lost.
                end = self.delivered + 1
            else:
                end = min(self.held) - 1 if self.held else (self.last_live if self.last_live is not None else self.delivered)
            self._lose(out, end, self._head_reason("replay_unavailable"))
            self._attempts = 0
            if not self._gap_open():
                return
        self._request(out)

    # -- state ----------------------------------------------------------------------------------
    @property
    def replaying(self) -> bool:
        return self._replay is not None

    @property
    def waiting(self) -> set[int]:
        """The seqs of live batches waiting: held above a gap, the one set aside, and a newcomer's
        (under another UUID, not confirmed yet), if any."""
        nc = self._newcomer
        return {*self.held, *(self._aside[:1] if self._aside is not None else ()), *(nc.batch[:1] if nc and nc.batch else ())}

    @property
    def in_doubt(self) -> bool:
        return self._doubt

    @property
    def known_top(self) -> int:
        """The highest seq this epoch's instance is known to have published."""
        return max(self._top, self.delivered, self._claimed)  # carried batches delivered after a restart count too

    @property
    def sure_instance(self) -> bytes | None:
        """The UUID of this epoch's instance, when known for certain (what a checkpoint keeps)."""
        return self.instance if self._instance_sure else None

    @property
    def retired_instances(self) -> list[bytes]:
        """The UUIDs of instances gone, oldest first."""
        return list(self._retired)

    def resume_point(self) -> tuple[int, int, Fingerprint | None, int]:
        """(epoch, delivered, fingerprint, its seq): what a new sequencer for this stream starts from."""
        return (self.epoch, self.delivered, self._fingerprint(), self._anchor_seq)

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, highest seq delivered) — what a checkpoint of this stream would hold."""
        return (self.epoch, self.delivered)

    # -- internals ------------------------------------------------------------------------------
    def _head_reason(self, reason: str) -> str:
        """Seqs missing from the very start of a stream met for the first time were published
        before the bridge joined."""
        return "joined_late" if self._fresh and self.delivered < 0 else reason

    def _gap_open(self) -> bool:
        top = max(self.last_live if self.last_live is not None else -1, max(self.held, default=-1))
        if self._aside is not None:
            top = max(top, self._aside[0] - 1)  # (the seqs below it: itself waits to be confirmed)
        return self.delivered < top

    def _keep(self, where: dict[int, bytes], seq: int, payload: bytes) -> None:
        # Past the bound a live batch is simply not held: it is still in the engine's buffer and
        # the next replay fetches it (or it is announced lost). Memory stays bounded.
        if len(self.held) + len(self.unverified) + len(self._early) < self.max_held:
            where[seq] = payload

    def _trust(self, out: list[Action], by: bytes | None = None) -> None:
        """Continuity confirmed (or presumed): unverified live batches join the held ones. Where
        live batches under the UUID adopted in doubt waited among them, that UUID is this epoch's
        instance's for certain from now on, as a live message under it out of doubt would make it:
        its batches go out under this epoch (records carry it, the checkpoint keeps it); unless
        the reply that confirmed it came under another UUID (``by``): then nothing says the live
        publisher is the one that answered, and its UUID stays unsure. A UUID known only from a
        replay reply or a heartbeat stays unsure: the replay is answered by whoever holds its
        socket, and nothing compared the live publisher's batches."""
        self._doubt = self._doubt_at_start = False  # (_doubt_since matters only in doubt, and every way into doubt sets it)
        self._drops = 0
        self._reopened = False
        self._unattributed = -1
        aside = self._aside
        if aside is not None and self._aside_below:
            # The same instance went on below the batch set aside, after it: never published.
            self._aside = None
            out.append(
                Suspect(aside[0], aside[1], f"live seq {aside[0]} is ahead of its engine: the same instance went on below it")
            )
        if self._vouched and self.instance is not None and by in (None, self.instance):
            self._instance_sure = True
        self._vouched = False
        self._vouching.clear()
        for seq, payload in self.unverified.items():
            self._top = max(self._top, seq)
            if seq > self.delivered:
                self.held.setdefault(seq, payload)
        self._top = max(self._top, self._unkept)  # read in doubt, not kept: its too (I3 if it restarts)
        self.unverified.clear()
        self._unkept_lo = self._unkept = -1
        self._drain(out)

    def _other_instance(self, seq: int, payload: bytes) -> bool:
        """Does a live batch at or below this instance's top contradict what it published?"""
        fp = self._fingerprint()
        ts = self._ts_of(payload)
        if fp is not None:
            if seq == self._anchor_seq:
                return not _matches(fp, ts, payload)
            if seq < self._anchor_seq:
                bound = fp[0]
                if bound is None and self._ref is not None and seq <= self._ref[0]:
                    bound = self._ref[1]  # the anchor has no ts: an earlier batch's
                return ts is not None and bound is not None and ts > bound  # an earlier seq, a later clock
        return self._contradicts(self.held, seq, payload, ts)

    def _held_reply_decides(self, seq: int) -> bool:
        """Can the reply at the first batch held above reply ``seq`` decide, by its bytes, whose
        the replies are? Only out of doubt (the held batches are this epoch's instance's), with
        room to keep every reply up to it (past the bound, the clocks decide). If this replay
        stops before it, that seq alone is asked for (_finished)."""
        if len(self.held) + len(self.unverified) + len(self._early) >= self.max_held:
            return False
        self._decides_at = min(s for s in self.held if s > seq)
        return True

    def _contradicts(self, batches: dict[int, bytes], seq: int, payload: bytes, ts: float | None) -> bool:
        """Is (seq, payload) from a later instance than ``batches``? The same seq with other bytes,
        or an earlier seq with a later engine ts."""
        mine = batches.get(seq)
        if mine is not None:
            return mine != payload
        above = [s for s in batches if s > seq]
        if not above or ts is None:
            return False
        their_ts = self._ts_of(batches[min(above)])
        return their_ts is not None and ts > their_ts

    def _check(self, seq: int, payload: bytes, instance: bytes | None = None) -> str:
        """Does this reply come from this epoch's instance? (_SAME, _NEW, or _UNSURE: look further.)

        ``instance``: the reply's publisher UUID. Live batches waiting that carried the same one
        (the UUID adopted in doubt) are the answering instance's for certain: neither their clock
        nor their bytes are compared with it (an engine clock that stepped back between two of
        its seqs would otherwise split one instance over two epochs). What the reply is compared
        with otherwise is unchanged: the anchor (the epoch's batch delivered last, perhaps
        another instance's) and the batches held."""
        ts = self._ts_of(payload)
        unverified = self.unverified
        if instance is not None and instance == self.instance and self._vouching:
            unverified = {u: b for u, b in unverified.items() if u not in self._vouching}
        # The epoch's instance is the UUID it was opened for, or the one live batches waiting were
        # read under: a reply under another is another instance's, whatever the clocks say (its
        # host's may run behind).
        if (
            instance is not None
            and self.instance not in (None, instance)
            and (self._opened_for == self.instance or self._vouching & self.unverified.keys())
        ):
            return _NEW
        if seq < self._floor:
            # It answered nothing from _floor on, yet holds this earlier seq: the instance that
            # published _floor would hold every seq after this one too.
            return _NEW
        nothing_to_compare = self._anchor is None and not self.held and not unverified
        if nothing_to_compare and instance is not None and self.instance not in (None, instance):
            # Another UUID than the epoch's (adopted unsure: from a heartbeat), and no batch of the
            # epoch to compare with: the instance that answers is another one.
            return _NEW
        mine = self.held.get(seq) if self._unattributed >= 0 and instance is None else None
        if mine is not None:
            # A batch of this epoch's instance (held: read under its UUID) at the reply's seq: the
            # bytes tell who answers, as the anchor's do.
            return _SAME if mine == payload else _NEW
        if (
            self._unattributed >= 0
            and instance is None
            and self.instance is not None
            and unverified.get(seq) == payload
            and self._ts_of(payload) is not None
        ):
            # A batch read live under the UUID adopted in doubt, with the reply's very bytes (and
            # its engine ts: undecodable bytes can be two instances' alike, breaker73 Z23): that
            # instance answers (breaker71 Z21: else a busy engine's every reply waited for a
            # heartbeat, and the doubt never ended). Other bytes prove nothing here: a batch
            # waiting may be a late one of the instance before.
            return _SAME
        if (nothing_to_compare or self._unattributed >= 0) and instance is None and self.instance is not None and self._doubt:
            # No UUID on the reply, none of the epoch's batches to compare it with, and the live
            # publisher may have changed: whoever holds the replay socket now answered, this
            # epoch's instance or the next. The next message under a UUID decides: another UUID
            # is a restart, the epoch's own says who holds the engine now when it is above the
            # reply's seq (a heartbeat's next seq too); once one waits, every later one does.
            self._unattributed = max(self._unattributed, seq)
            return _LATER
        if self._anchor is not None:
            at, fp = self._anchor
            anchor_ts = fp[0]
            if seq < at:
                return _UNSURE
            if seq == at:
                return _SAME if _matches(fp, ts, payload) else _NEW
            # Later seq, earlier clock: another instance; unless the reply comes under the UUID of
            # the replies this epoch's batches came from (unsure: the live publisher may be
            # another), the same instance's whoever holds the socket, whose clock stepped back
            # (breaker120 3).
            own = instance is not None and instance == self.instance
            if anchor_ts is not None and ts is not None and ts < anchor_ts and not own:
                return _NEW
        # Against live batches: those of this epoch's instance, then unverified ones.
        if self._decides_at >= 0 and seq >= self._decides_at and self.held.get(seq) == payload:
            return _SAME  # (a held batch's very bytes: the reply waited for, or one past it if it left the buffer)
        if self._contradicts(self.held, seq, payload, ts):
            if seq not in self.held and not self._doubt and self._held_reply_decides(seq):
                # Only the clocks contradict it (an earlier seq, a later ts): the engine's clock may
                # have stepped back between the two (an NTP step right after a restart, breaker119
                # 3). The reply at that held batch's seq, which this replay brings, compares bytes.
                return _LATER
            return _NEW
        if self._contradicts(unverified, seq, payload, ts):
            return _NEW
        # No clock to compare with a batch waiting above (one of them could not be decoded): the
        # reply at its seq, which this replay brings, compares bytes. If that reply was skipped
        # (dropped under load), nothing can be told: this attempt ends without a verdict.
        if self._probing:
            # The batch asked for compared, and nothing contradicts; a first reply above it (it
            # left the engine's buffer) tells nothing.
            return _SAME if seq == self._until else _LATER
        # (Replies come in seq order: only one that jumped past the last can have skipped one.)
        if 0 <= self._heard < seq - 1 and any(self._heard < w < seq for w in (*self.held, *unverified)):
            self._skipped = True
        if self._skipped:
            return _LATER
        if self._doubt:
            for where in (self.held, unverified):
                # (The latest read first: they are the ones above a reply; this runs for every reply.)
                if any(u > seq and (ts is None or self._ts_of(p) is None) for u, p in reversed(where.items())):
                    return _LATER  # (if the replay stops before that reply, the rest is asked for)
        return _SAME

    def _adopt_published_before_doubt(self) -> None:
        """Unverified batches stamped before the disconnect was noticed (both on the engine's clock,
        less ``clock_skew``) were published by the instance connected then: this epoch's."""
        if self._doubt_since is None:
            return
        cutoff = self._doubt_since - self.clock_skew
        for seq in list(self.unverified):
            ts = self._ts_of(self.unverified[seq])
            if ts is not None and ts < cutoff:
                self.held[seq] = self.unverified.pop(seq)

    def _drain(self, out: list[Action]) -> None:
        while self.held:
            nxt = self.delivered + 1
            payload = self.held.pop(nxt, None)
            if payload is None:
                return
            self._deliver(out, nxt, payload)

    def _deliver(self, out: list[Action], seq: int, payload: bytes, replayed: bool = False) -> None:
        if self._first_ts is None:
            self._first_ts = self._ts_of(payload)
        if self._floor_pending:
            self._floor_pending = False
            if self._floor_ts is None:
                self._floor_ts = self._ts_of(payload)
        self.delivered = self._anchor_seq = seq
        self._last_payload = payload  # its fingerprint replaces _fp when next asked for
        out.append(Deliver(seq, payload, self.epoch, replayed))

    def _lose(self, out: list[Action], to_seq: int, reason: str) -> None:
        """Settle everything not yet settled up to ``to_seq`` (from ``delivered + 1``: every caller
        settles from there): held batches in it are delivered, only the rest is lost (the batch
        set aside too, if in it: it reached the bridge, I4)."""
        if self._aside is not None and self._aside[0] <= to_seq:
            self._hold_aside(self._aside)
        for seq in sorted(s for s in self.held if s <= to_seq):
            payload = self.held.pop(seq)
            if seq <= self.delivered:
                continue
            if seq > self.delivered + 1:
                self._lost(out, self.delivered + 1, seq - 1, reason)
            self._deliver(out, seq, payload)
        if to_seq > self.delivered:
            self._lost(out, self.delivered + 1, to_seq, reason)
        self._suspect = None
        self._drain(out)

    def _lost(self, out: list[Action], from_seq: int, to_seq: int, reason: str) -> None:
        out.append(Lost(from_seq, to_seq, reason, self.epoch))
        self.delivered = to_seq  # the anchor stays at the last batch delivered

    def _request(
        self, out: list[Action], to_end: bool = False, probe: int | None = None, floor: int = -1, rest: bool = False
    ) -> None:
        """Ask for a replay from our position (``to_end``: to the end marker when nothing waits;
        ``rest``: even when batches wait; ``probe``, ``floor``: see replay_finished)."""
        request_id = self._next_request()
        self._replied_top = -1
        if self._aside is not None:
            self._aside_asked = True
        self._replay_start = self.delivered + 1
        self._replay_first, self._replied_below = True, False
        self._answered = False
        # (In doubt, held batches too: read before it, their instance would hold their seqs.)
        self._asked_unverified = bool(self.unverified) or (self._doubt and bool(self.held))
        self._asked_top = max([*self.held, *self.unverified], default=-1)
        self._asked_claim = self._claimed
        waiting = [*self.held, *self.unverified, *(self._aside[:1] if self._aside is not None else ())]
        # The last seq this replay must bring; -1: read to the end marker. In doubt, batches
        # waiting without a ts too: the replies of their seqs tell whose they are (_check).
        if waiting:
            until = min(waiting) - 1
            if self._doubt:
                until = max([until, *(u for u, p in (*self.held.items(), *self.unverified.items()) if self._ts_of(p) is None)])
            if self._owed > self.delivered:
                until = -1  # and whatever this instance published of the seqs it owes
        elif to_end or self.last_live is None:
            until = -1
        else:
            until = self.last_live
        if rest:
            until = -1
        elif self._aside is not None and until >= 0:
            until = max(until, self._aside[0])  # its reply confirms it; the end marker before it refutes it
        start = self._replay_start
        fp = self._fingerprint()
        self._anchor = (self._anchor_seq, fp) if fp is not None else None
        self._verdict = _UNSURE
        self._early, self._heard, self._skipped = {}, -1, False
        self._probing, self._overlap = probe is not None, None
        self._decides_at, self._decides_tries = -1, 0
        if probe is not None:
            start = until = probe  # one batch waiting, read before this was asked for
            self._asked_unverified = True
        elif self._anchor is not None:
            start = self._anchor_seq  # its reply verifies the instance against the fingerprint
        elif self.delivered >= 0:
            start = self.delivered  # one early: shows the engine answering even when the next batch never comes
        self._floor = floor
        if floor >= 0:
            start, until = 0, -1
        self._asked_from = start
        self._until = max(until, start) if until >= 0 else -1
        out.append(RequestReplay(request_id, start, self._until, self._attempts))

    def reference(self, seq: int, ts: float | None) -> None:
        """The last delivered batch has no engine ts (it could not be decoded); ``seq``, ``ts``: an
        earlier batch of this epoch that has one. A live batch at or below ``seq`` with a later ts
        is then another instance's (the anchor, whose fingerprint has only a CRC, cannot say)."""
        ts = _finite(ts)
        if ts is not None:
            self._ref = (seq, ts)

    def _fingerprint(self) -> Fingerprint | None:
        """The fingerprint of the last delivered batch, taken lazily (only a replay needs it)."""
        if self._last_payload is not None:
            self._fp = fingerprint(self._ts_of(self._last_payload), self._last_payload)
            self._last_payload = None
        return self._fp

    def _restart(
        self,
        out: list[Action],
        reason: str,
        evidence: tuple[int, float | None] | None = None,
        trigger_ts: float | None = None,
        theirs: dict[int, bytes] | None = None,
        by: bytes | None = None,
    ) -> None:
        """The engine restarted: settle the old epoch, then open a new one.

        Everything the old instance owes is emitted first, stamped with the old epoch: its held
        batches delivered, every other seq up to the last one it was seen to publish announced
        lost (its buffer went with it). Without ``evidence`` the restart showed on the live stream
        and every batch held so far is the old instance's. With it, a replay revealed the restart
        through its reply (seq, engine ts): held batches with a later engine ts than that reply
        (or an equal one at a higher seq) were published by the new instance and move to the new
        epoch. A batch whose ts or the reply's is unknown (undecodable) proves nothing: a held one
        stays the old instance's; an unverified one is not carried either (it may be a late batch
        of the old instance): it is announced lost with the old epoch's tail, and the new epoch
        fetches the new instance's own copy of its seq by replay (I1 before I4). ``theirs``: the
        new instance's replies; a batch with the same seq and bytes as one of them is its. ``by``:
        the UUID they came under; batches read live under this epoch's UUID, when it is another,
        are never carried, whatever the clocks say (the new instance's may run behind).
        """
        # (after a drop, a restart is what the replay is asked to show; since a start from a
        # checkpoint, with no drop seen, it may be one while the bridge was down, or not)
        shown_by_replay = evidence is not None and (not self._doubt or self._doubt_at_start)
        at_start = self._doubt_at_start
        if self._replay is not None and self._heard >= 0:
            self._unclaim()  # (replies kept for a verdict, perhaps the old instance's: it settles their seqs)
        carried: dict[int, bytes] = {}
        last_live = self.last_live
        # The batch set aside, not confirmed: the new instance's if the clocks say so as for a
        # held batch (set aside again in the new epoch, for its instance to confirm); else the
        # old instance's, which can confirm it no more: settled as its held batches are (I4).
        aside, self._aside = self._aside, None
        theirs_aside = False
        if evidence is not None:
            r, ts_r = evidence
            theirs = theirs or {}

            def newer(seq: int, payload: bytes) -> bool:
                """Stamped after the reply that showed the new instance (at r itself: the new
                instance's copy of that seq differs, so this one is older)."""
                ts = self._ts_of(payload)
                return seq != r and ts is not None and ts_r is not None and (ts > ts_r or (ts == ts_r and seq > r))

            other = by is not None and self.instance is not None and by != self.instance
            mine = {*self.held, *self._vouching} if other else set()
            for where in (self.held, self.unverified):
                for seq in list(where):
                    if where[seq] == theirs.get(seq) or (seq not in mine and newer(seq, where[seq])):
                        carried[seq] = where.pop(seq)
            if aside is not None:
                if aside[1] == theirs.get(aside[0]):
                    aside = None  # (their own copy of it goes into the new epoch with their replies)
                else:
                    theirs_aside = newer(*aside)
        if aside is not None and not theirs_aside:
            self._keep(self.held, *aside)
        # What is left unverified was published before the connection dropped (then it is the
        # old instance's, read late: a stream waiting on a full sink reads its queue late), or
        # by an instance in between that came and went before a replay could tell. The first are
        # told by their engine ts; the rest cannot be proven and is announced lost with the old
        # epoch's tail rather than delivered under it (I1 before I4).
        self._adopt_published_before_doubt()
        if self._opened_for is not None and self._opened_for == self.instance:
            # Read live under the UUID this epoch was opened for: its instance's, whoever took
            # the epoch since (a frame kept across a re-add, welcomed just before).
            for seq in self._vouching & self.unverified.keys():
                self.held[seq] = self.unverified.pop(seq)
        self._opened_for = None
        # The anchor is the old instance's even when above delivered (a batch known published,
        # resumed from the checkpoint, not known delivered).
        known = [self.delivered, self._anchor_seq, self._owed, *self.held, *self.unverified]
        if aside is not None and not theirs_aside:
            known.append(aside[0])
        if not self._instance_sure and self._stash:
            # Set aside under other UUIDs (a drop came before the replay could refute them):
            # those that may be this epoch's own are settled by it, as refuted ones are; not
            # one stamped after what showed the new instance (perhaps the new instance's).
            shown = trigger_ts if trigger_ts is not None else evidence[1] if evidence is not None else None
            stashed = [batch for _, batch, _ in self._stash]
            known += [
                seq
                for seq, _, ts in stashed
                if self._perhaps_ours(seq, ts, stashed) and (shown is None or ts is None or ts < shown)
            ]
        known.append(self._claimed)  # (a heartbeat's, under the old instance's UUID)
        self._claimed = -1
        if not carried:
            # Seen live or replayed (perhaps not kept, past the bound) before the new instance
            # showed.
            known += [self._top, self.last_live if self.last_live is not None else -1]
        elif self._doubt:
            # With carried batches, last_live may count the new instance's live seqs; _top does
            # not (live batches in doubt do not raise it). Live seqs in doubt grow, so those not
            # kept below the first carried one were read before it and may be the old instance's:
            # the old epoch settles them (I3; announcing lost a seq the old instance never
            # published hides nothing).
            known.append(self._top)
            if 0 <= self._unkept_lo < min(carried):
                known.append(min(carried) - 1)
        top = max(known)
        # Unverified batches whose clock could not be compared may be the new instance's:
        # announced lost here, they are fetched again in the new epoch, which settles their seqs
        # too (delivered, or lost if it never published them).
        unsure = -1
        if evidence is not None:
            unsure = max((seq for seq, p in self.unverified.items() if self._ts_of(p) is None or evidence[1] is None), default=-1)
            if unsure >= 0 and last_live is not None:
                unsure = max(unsure, last_live)  # and those seen live but not kept (past max_held)
            if not carried:  # (with carried batches, last_live carries over: see below)
                unsure = max(unsure, self._unkept)  # read in doubt, not kept: perhaps the new instance's
        self.unverified.clear()
        self._unkept_lo = self._unkept = -1
        # The connection may have dropped again since continuity came into doubt: if what showed
        # the new instance was published before that, the instance connected now is unknown too.
        shown_at = evidence[1] if evidence is not None else trigger_ts
        last = self._last_drop
        again = self._drops > 1 and (shown_at is None or last is None or shown_at < last - self.clock_skew)
        self._doubt, self._unattributed = False, -1
        if top > self.delivered:
            self._lose(out, top, reason)
        self._replay = None
        self._attempts = 0
        self._suspect = None
        self._fresh = self._join = self._resumed = False
        self._floor_ts = self._first_ts = None
        self._floor_pending = reason == PUBLISHER_RESTART  # (the caller may set the floor first)
        self._older_last = -1
        if self.instance is not None and self._instance_sure:  # (one adopted in doubt was never this epoch's for certain)
            self._retire(self.instance)
        self.instance, self._instance_sure, self._anonymous, self._vouched = None, False, False, False
        self._vouching = set()
        self.epoch = self._next_epoch(self.epoch, shown_at)
        self.delivered = -1
        self._owed = max(unsure, self._unclaimed)  # (replies without a verdict may be its too)
        self._unclaimed = -1
        self._fp = self._last_payload = self._ref = None
        self._replayed_crc = {}
        self._anchor_seq = -1
        # Live seqs seen after the carried batches (some perhaps not kept, past the bound) are the
        # new instance's too: the gap up to them is fetched by replay.
        self.held = carried
        self.last_live = max(max(carried), last_live if last_live is not None else -1) if carried else None
        # Known published by it (so settled by its epoch if it restarts first: I3).
        self._top = self.last_live if self.last_live is not None else -1
        out.append(Reset(self.epoch, reason))
        if shown_by_replay:
            self.shown_by_replay, self.shown_at_start = self.epoch, at_start
        if theirs_aside:
            self._aside, self._aside_asked, self._aside_refuted, self._aside_silent = aside, False, 0, 0
            self._aside_below = False
        self._reopened = False  # (set by _restart_under, whose epoch this is)
        if again:
            self._doubt, self._doubt_since, self._drops = True, last, 1
            self.unverified, self.held = self.held, {}  # what was carried is not verified against it either
        else:
            self._drops = 0
