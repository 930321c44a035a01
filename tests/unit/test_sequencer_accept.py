"""``StreamSequencer.accept``, the hot path of a steady stream: it takes the next batch exactly
when ``live`` would only deliver it (the next seq, nothing held, no doubt, not older than this
epoch's instance), with the same effect on the sequencer, and changes nothing when it declines.

``test_sequencer_model.py`` checks that contract wherever its model takes the hot path; these are
the states the model does not reach: a stream resumed without a replay endpoint, an anchor
known published above the last batch delivered, an epoch's floor (the engine ts of its first
batch) met exactly or by a batch without a ts, and replayed batches whose late copies can no
longer come.

Payloads are ``instance:seq`` and the engine ts is ``instance * 1e6 + seq`` (a later instance has
a later clock), as in ``test_sequencer_instances.py``; ``instance:x`` has no ts (undecodable).
"""

from __future__ import annotations

import copy

from bridge.sequencer import Deliver, Duplicate, RequestReplay, Reset, StreamSequencer, fingerprint


def p(instance: int, seq: int | str) -> bytes:
    return f"{instance}:{seq}".encode()


def ts(payload: bytes) -> float | None:
    instance, seq = payload.decode().split(":")
    return int(instance) * 1e6 + int(seq) if seq.isdigit() else None


def take(s: StreamSequencer, seq: int, payload: bytes, stamp: float | None = None, instance: bytes | None = None) -> bool:
    """What the stream pipeline does with a live message (``accept``, else ``live``), checked
    against ``live`` on a copy: True when ``accept`` took it."""
    before = copy.deepcopy(s)
    if s.accept(seq, payload, stamp, instance):
        assert before.live(seq, payload, stamp, instance) == [Deliver(seq, payload, before.epoch)]
        assert vars(s) == vars(before), "accept and live left the sequencer in different states"
        return True
    assert vars(s) == vars(before), "accept declined but changed the sequencer"
    return False


def test_a_stream_resumed_without_replay_takes_its_next_batches_on_the_hot_path() -> None:
    """No replay endpoint: nothing to verify the instance with, so no doubt; the batch after the
    checkpoint's position is taken as ``live`` would (which also ends the resume's own rules)."""
    s = StreamSequencer(can_replay=False, replay_on_start=False, delivered=4, ts_of=ts)
    assert take(s, 5, p(0, 5)) and take(s, 6, p(0, 6))
    assert s.position == (0, 6)


def test_a_batch_at_an_anchor_known_published_is_checked_by_live_not_taken() -> None:
    """Resumed with seq 3 known published but not known delivered (anchor = delivered + 1): a
    live seq 3 is compared with what was published. Other bytes are a new instance's (a restart),
    the same bytes the batch itself (delivered in this epoch): neither on the hot path."""

    def resumed() -> StreamSequencer:
        return StreamSequencer(
            can_replay=False, replay_on_start=False, delivered=2, anchor=3, delivered_fp=fingerprint(3.0, p(0, 3)), ts_of=ts
        )

    s = resumed()
    assert not take(s, 3, p(1, 3))
    out = s.live(3, p(1, 3))
    assert Reset(1, "publisher_restart") in out and out[-1] == Deliver(3, p(1, 3), 1)
    same = resumed()
    assert not take(same, 3, p(0, 3))
    assert same.live(3, p(0, 3)) == [Deliver(3, p(0, 3), 0)]


def restarted() -> StreamSequencer:
    """Instance 0 published 0..2, then instance 1 showed (its seq 0, stamped 1e6: the epoch's floor)."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    for q in range(3):
        assert take(s, q, p(0, q))
    assert not take(s, 0, p(1, 0))
    assert isinstance(s.live(0, p(1, 0))[-2], Reset)
    return s


def test_after_a_restart_batches_stamped_at_the_floor_or_without_a_ts_take_the_hot_path() -> None:
    """Only a batch stamped *before* the epoch's first one may be an older instance's, read late
    (``live`` decides those); one stamped at it, or one whose ts is unknown, is simply the next."""
    s = restarted()
    assert take(s, 1, p(1, 1), stamp=1e6)  # the floor's own ts: not older
    assert take(s, 2, p(1, "x"))  # no ts (undecodable): nothing says older
    assert not take(s, 3, p(0, 3))  # stamped before the floor: live tells whose it is
    assert s.live(3, p(0, 3)) == [Duplicate(3)]  # the older instance's late batch, next of both


def test_taking_a_batch_forgets_the_replayed_batches_whose_late_copies_it_outran() -> None:
    """A replay brought 2..3 above the live stream; their late live copies could follow, and the
    stream recognises them by their bytes. Once a later live seq is taken none can: ``accept``
    forgets them as ``live`` does (the memory of late copies is bounded)."""
    s = StreamSequencer(can_replay=True, replay_on_start=False, ts_of=ts)
    assert take(s, 0, p(0, 0)) and take(s, 1, p(0, 1))
    (req,) = s.probe()  # a quiet stream asks for its tail
    assert isinstance(req, RequestReplay)
    out = [a for q in (1, 2, 3) for a in s.replayed(req.request_id, q, p(0, q))] + s.replay_finished(req.request_id, True)
    assert [a.seq for a in out if isinstance(a, Deliver)] == [2, 3]
    assert take(s, 4, p(0, 4))
