"""The drainer (bridge.ingest): ready sockets read in coalesced passes, and a burst's pipeline
call run inline or finished later as a task would.

The drainer is driven here with fake sockets whose descriptor is a pipe and whose signalling
follows ZMQ's: a socket signals when a message arrives while it was found empty, and reading
its ``ZMQ_EVENTS`` consumes the signal. A hypothesis model publishes and lets the loop turn in
random order and checks that every message is read exactly once, in order, by passes that read a
socket at most once each; and a long tick makes every socket that signals during it share one
pass.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.ingest import Drainer, finish, start_inline
from tests.support.harness import wait_for
from tests.support.strategies import examples


class FakeSocket:
    """A socket read by the drainer: a pipe as its descriptor, ZMQ's signalling rules."""

    def __init__(self, name: int, drain_max: int, drainer: Drainer) -> None:
        self.name = name
        self.drainer = drainer
        self.drain_max = drain_max
        self.queued = False
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.pending: list[int] = []
        self.read: list[int] = []
        self.active = False  # messages there since a read last found it empty: no new signal
        self.signal_pending = False
        self.drained_in: list[int] = []  # the pass of each drain, to check one read per pass

    def publish(self, message: int) -> None:
        self.pending.append(message)
        if not self.active:
            self.active = True
            if not self.signal_pending:
                self.signal_pending = True
                os.write(self.write_fd, b"x")

    def signalled(self) -> bool:
        if self.signal_pending:
            os.read(self.read_fd, 1)
            self.signal_pending = False
        return bool(self.pending)

    def drain(self, received: float) -> bool:
        self.drained_in.append(self.drainer.passes)
        take = self.pending[: self.drain_max]
        del self.pending[: len(take)]
        self.read.extend(take)
        if not self.pending:
            self.active = False  # found empty: the next message signals
        return len(take) == self.drain_max

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.integers(0, 4), st.integers(1, 7)),
        st.tuples(st.just("wait"), st.sampled_from([0, 1, 3]), st.just(0)),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=examples(60), deadline=None)
@given(steps=STEPS, tick=st.sampled_from([0.0, 0.001]), drain_max=st.integers(1, 5))
def test_every_message_read_once_in_order(steps: list[tuple[str, int, int]], tick: float, drain_max: int) -> None:
    async def run() -> None:
        drainer = Drainer(tick)
        sockets = [FakeSocket(i, drain_max, drainer) for i in range(5)]
        published: list[list[int]] = [[] for _ in sockets]
        n = 0
        try:
            for s in sockets:
                drainer.watch(s.read_fd, s)
            for kind, which, count in steps:
                if kind == "publish":
                    for _ in range(count):
                        sockets[which].publish(n)
                        published[which].append(n)
                        n += 1
                else:
                    for _ in range(which):
                        await asyncio.sleep(0)
            for _ in range(2000):
                if all(not s.pending for s in sockets) and drainer._pass is None:
                    break
                await asyncio.sleep(0.001)
            for s, sent in zip(sockets, published, strict=True):
                assert s.read == sent  # each message once, in its socket's order
            for s in sockets:
                assert len(s.drained_in) == len(set(s.drained_in))  # read at most once per pass
        finally:
            for s in sockets:
                drainer.unwatch(s.read_fd, s)
                s.close()
            drainer.close()

    asyncio.run(run())


def test_a_tick_makes_the_sockets_ready_meanwhile_share_one_pass() -> None:
    async def run() -> None:
        drainer = Drainer(0.05)
        sockets = [FakeSocket(i, 256, drainer) for i in range(20)]
        try:
            for s in sockets:
                drainer.watch(s.read_fd, s)
            for i, s in enumerate(sockets):
                s.publish(i)
                await asyncio.sleep(0)  # each signal handled on its own turn of the loop
            for _ in range(1000):
                if drainer.passes:
                    break
                await asyncio.sleep(0.005)
            assert drainer.passes == 1 and all(s.drained_in == [1] for s in sockets)  # one pass for all
            assert [s.read for s in sockets] == [[i] for i in range(20)]
        finally:
            for s in sockets:
                drainer.unwatch(s.read_fd, s)
                s.close()
            drainer.close()

    asyncio.run(run())


def test_a_socket_unwatched_before_its_pass_is_not_read() -> None:
    async def run() -> None:
        drainer = Drainer(0.5)  # a pass long after the signal
        a, b = FakeSocket(0, 256, drainer), FakeSocket(1, 256, drainer)
        try:
            drainer.watch(a.read_fd, a)
            drainer.watch(b.read_fd, b)
            a.publish(1)
            b.publish(2)
            await wait_for(lambda: drainer._pass is not None, 5, "the signal")
            drainer.unwatch(a.read_fd, a)  # e.g. its source removed before the pass
            await wait_for(lambda: drainer.passes > 0, 5, "the pass")
            assert a.read == [] and b.read == [2]
        finally:
            drainer.unwatch(b.read_fd, b)
            a.close()
            b.close()
            drainer.close()

    asyncio.run(run())


# -- a burst's pipeline call: inline, or finished as a task would --------------------------------
async def _locked(lock: asyncio.Lock, log: list[str]) -> None:
    try:
        async with lock:
            log.append("acquired")
            await asyncio.sleep(0)
            log.append("done")
    except asyncio.CancelledError:
        log.append("cancelled")
        await asyncio.sleep(0)  # a handler that awaits (as StreamPipeline.on_live's does)
        log.append("handled")
        raise


def test_a_call_that_does_not_suspend_finishes_inline() -> None:
    async def run() -> None:
        log: list[str] = []

        async def quick() -> None:
            log.append("ran")

        assert start_inline(quick()) == (True, None)
        assert log == ["ran"]

    asyncio.run(run())


def test_a_suspended_call_finishes_in_a_task_once_what_it_waits_for_is_done() -> None:
    async def run() -> None:
        lock, log = asyncio.Lock(), []
        await lock.acquire()
        coro: Coroutine[Any, Any, None] = _locked(lock, log)
        done, waiting = start_inline(coro)
        assert not done and waiting is not None
        task = asyncio.create_task(finish(coro, waiting))
        await asyncio.sleep(0.01)
        assert log == []
        lock.release()
        await task
        assert log == ["acquired", "done"]
        assert not lock.locked()

    asyncio.run(run())


@pytest.mark.parametrize("when", ["waiting", "before_the_task_ran"])
def test_cancelling_the_task_throws_into_the_call_where_it_waits(when: str) -> None:
    async def run() -> None:
        lock, log = asyncio.Lock(), []
        await lock.acquire()
        coro: Coroutine[Any, Any, None] = _locked(lock, log)
        done, waiting = start_inline(coro)
        assert not done
        if when == "waiting":
            task = asyncio.create_task(finish(coro, waiting))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:  # SourceReader.run cancelled before it took the parked call up
            with pytest.raises(asyncio.CancelledError):
                await finish(coro, waiting, cancelled=True)
        assert log == ["cancelled", "handled"]
        lock.release()
        async with asyncio.timeout(1):  # the lock's cancelled waiter is gone: it is free
            await lock.acquire()

    asyncio.run(run())


def test_a_failure_after_resuming_propagates() -> None:
    async def run() -> None:
        event = asyncio.Event()

        async def failing() -> None:
            await event.wait()
            raise ValueError("boom")

        coro = failing()
        _, waiting = start_inline(coro)
        task = asyncio.create_task(finish(coro, waiting))
        event.set()
        with pytest.raises(ValueError, match="boom"):
            await task

    asyncio.run(run())


@pytest.mark.parametrize(
    ("left", "loose", "said"),
    [(0, 0, (False, 0)), (3, 0, (False, 0)), (0, 1, (True, 0)), (1, 2, (True, 1)), (1, 1, (None, 1)), (2, 1, (None, 1))],
)
def test_a_dropped_connection_had_handshaken_only_when_the_counts_say_so(
    left: int, loose: int, said: tuple[bool | None, int]
) -> None:
    """breaker114: a handshake's monitor event names no connection; with several waiting at once
    it is one of them (``loose``). A connection dropped from among them had handshaken for certain
    only when more handshakes were loose than connections are left; else it cannot be told."""
    from bridge.source import _handshaken

    assert _handshaken(left, loose) == said


def test_a_connection_open_past_the_handshake_interval_takes_an_unplaced_handshake() -> None:
    """breaker117 3: with the engine's handshake unplaced (a probe was waiting beside it), every
    later probe's drop read as perhaps the engine's, for good. libzmq drops a connection that has
    not handshaken within the interval: one still open after it has, oldest first, as many as
    the handshakes not placed."""
    from bridge.source import _HANDSHAKEN_BY, _outlived

    waiting = {7: 100.0, 9: 103.0, 11: 104.0}
    assert _outlived(waiting, 100.0 + _HANDSHAKEN_BY - 0.1, 2) == []
    assert _outlived(waiting, 103.0 + _HANDSHAKEN_BY, 1) == [7]
    assert _outlived(waiting, 104.0 + _HANDSHAKEN_BY, 2) == [7, 9]
    assert _outlived(waiting, 104.0 + _HANDSHAKEN_BY, 0) == []
