"""One drainer for every live socket of the process: ready sockets are read in one pass per tick.

A fleet is many streams at one batch per engine step each, so nearly every batch arrives on a
socket of its own. Woken per socket (a task per socket, an event per wake-up), the bridge paid
the event loop's task switch, the stream's lock and a fan-out for each batch, 10-20 times what
the batch itself costs. Here the loop's callback for a socket's descriptor only notes the socket
as ready; the first ready socket after a quiet spell schedules one pass ``ingest.tick`` later,
and that pass reads every socket noted by then, each up to ``ingest.drain_max`` messages, and
hands each burst to its stream's pipeline. Batches of many streams thus share one wake-up of
the drainer, and their records reach the sinks' queues together (the sink's own
``batch.linger`` then makes them one write). The tick bounds the latency it adds; 0 passes at the
loop's next turn (only what was ready in the same turn shares the pass).

The sockets' descriptors are watched by a selector of the drainer's own (epoll on Linux), and
the event loop watches only that selector's descriptor, and only between passes: the first
signal after a pass wakes the loop, which stops watching and schedules the pass; the signals of
every other socket during the tick wait in the selector, and the pass collects them with one
call. The loop thus wakes about twice per pass (the signal, the tick), not once per message. The
pass reads each signalled socket's ``ZMQ_EVENTS``, which consumes ZMQ's signal, and a socket that
still holds messages is not signalled again until a read finds it empty.

A burst's pipeline call (``StreamPipeline.on_live``) is a coroutine that returns without
suspending when the stream's lock is free and every sink has room: the pass runs it inline,
with no task switch. When it does suspend (a full sink with ``backpressure: block``, the lock
held by the stream's replay, a new epoch being saved), the pass hands the suspended coroutine to
the stream's own reader task (:func:`finish`), which runs it to its end exactly as a task would,
cancellation included, and the socket is not read again until it has. The other streams go on.
Every queue here is bounded by the number of sockets: a socket is noted at most once.
"""

from __future__ import annotations

import asyncio
import select
import selectors
import time
from collections.abc import Coroutine
from typing import Any, Protocol

DEFAULT_TICK = 0.001
_ONE_SHOT = getattr(select, "EPOLLIN", 1) | getattr(select, "EPOLLONESHOT", 0)


class Drained(Protocol):
    """A socket the drainer reads (:class:`bridge.source.SourceReader`)."""

    queued: bool
    """Noted ready, its pass not run yet (set and cleared by the drainer only)."""

    def signalled(self) -> bool:
        """The descriptor fired: whether to read the socket in this pass (True: the reads consume
        ZMQ's signal; False: it is consumed here)."""
        ...

    def drain(self, received: float) -> bool:
        """Read what is ready (at most ``ingest.drain_max``) and hand it on; True: more may be
        ready (the pass notes the socket again)."""
        ...


class Drainer:
    """Notes ready sockets and drains them in passes (see the module docstring)."""

    def __init__(self, tick: float = DEFAULT_TICK) -> None:
        self.tick = tick
        # The sockets' descriptors are watched by a selector of the drainer's own, and the loop
        # watches that selector only between passes: the first signal after a pass wakes the
        # loop, the others wait in the selector until the pass reads them with one call.
        self._selector = selectors.DefaultSelector()
        # On Linux the loop watches, for good, an epoll (the gate) holding the selector's epoll
        # as a one-shot entry: it fires once, is consumed, and is re-armed after the pass (one
        # epoll_ctl). Cheaper than asking the loop to stop and start watching (uvloop makes and
        # closes a handle each time) or taking the entry out and adding it back.
        self._gate = select.epoll() if hasattr(select, "epoll") else None
        self._gated = False  # the selector is in the gate
        self._watching = False  # the loop watches (the gate, or the selector while armed)
        self._armed = False  # the next signal wakes the loop
        self._ready: list[Drained] = []
        self._pass: asyncio.Handle | None = None
        self.passes = 0  # passes run, and bursts read in them: for benchmarks and tests
        self.bursts = 0

    def watch(self, fd: int, reader: Drained) -> None:
        reader.queued = False
        self._selector.register(fd, selectors.EVENT_READ, reader)
        if not self._watching:
            self._watching = True
            loop = asyncio.get_running_loop()
            if self._gate is not None:
                loop.add_reader(self._gate.fileno(), self._woken)
            self._arm()

    def unwatch(self, fd: int, reader: Drained) -> None:
        self._selector.unregister(fd)
        if reader.queued:
            reader.queued = False
            self._ready.remove(reader)

    def close(self) -> None:
        if self._watching:
            self._watching = False
            if self._gate is not None:
                asyncio.get_running_loop().remove_reader(self._gate.fileno())
            elif self._armed:
                asyncio.get_running_loop().remove_reader(self._selector.fileno())
            self._armed = False
        if self._pass is not None:
            self._pass.cancel()
            self._pass = None
        if self._gate is not None:
            self._gate.close()
        self._selector.close()

    def _arm(self) -> None:
        """Wake the loop at the next signal."""
        self._armed = True
        if self._gate is not None:
            if self._gated:
                self._gate.modify(self._selector.fileno(), _ONE_SHOT)
            else:
                self._gate.register(self._selector.fileno(), _ONE_SHOT)
                self._gated = True
        else:
            asyncio.get_running_loop().add_reader(self._selector.fileno(), self._woken)

    def _woken(self) -> None:
        # A socket signalled: the loop sleeps until the pass, which reads the selector.
        if not self._armed:
            return
        self._armed = False
        if self._gate is not None:
            self._gate.poll(0)  # consumes the one shot: the gate is quiet until re-armed
        else:
            asyncio.get_running_loop().remove_reader(self._selector.fileno())
        self._schedule()

    def note(self, reader: Drained) -> None:
        """Read ``reader`` in the next pass (it may hold messages that signal nothing more)."""
        if reader.queued:
            return
        reader.queued = True
        self._ready.append(reader)
        self._schedule()

    def _schedule(self) -> None:
        if self._pass is None:
            loop = asyncio.get_running_loop()
            self._pass = loop.call_later(self.tick, self._run) if self.tick > 0 else loop.call_soon(self._run)

    def _run(self) -> None:
        self._pass = None
        ready = self._ready
        for key, _ in self._selector.select(0):
            reader: Drained = key.data
            if reader.signalled() and not reader.queued:
                reader.queued = True
                ready.append(reader)
        self._ready = []
        self.passes += 1
        self.bursts += len(ready)
        received = time.time()
        again: list[Drained] = []
        for reader in ready:
            reader.queued = False
            if reader.drain(received):
                again.append(reader)
        for reader in again:  # after the others: a busy stream yields to them, as a burst did
            self.note(reader)
        if self._watching and not self._armed:
            self._arm()


def start_inline(coro: Coroutine[Any, Any, None]) -> tuple[bool, asyncio.Future[Any] | None]:
    """Run ``coro`` until it first suspends: (True, None) when it finished, else (False, what it
    waits for: a future, or None for a bare yield) to pass to :func:`finish`. Its exception
    propagates."""
    try:
        return False, coro.send(None)
    except StopIteration:
        return True, None


async def finish(coro: Coroutine[Any, Any, None], waiting: asyncio.Future[Any] | None, cancelled: bool = False) -> None:
    """Run ``coro``, suspended by :func:`start_inline` on ``waiting``, to its end as a task would:
    resumed once ``waiting`` is done, and a cancellation of the caller (or ``cancelled``) thrown in
    where it waits (``waiting`` cancelled first, as ``Task.cancel`` does)."""
    while True:
        exc: BaseException | None = asyncio.CancelledError() if cancelled else None
        cancelled = False
        if exc is None:
            try:
                if waiting is None:
                    await asyncio.sleep(0)
                elif not waiting.done():
                    await asyncio.wait([waiting])
            except asyncio.CancelledError as e:
                exc = e
        if waiting is not None:
            waiting._asyncio_future_blocking = False  # as Task.__step does with what it awaited
        try:
            if exc is not None:
                if waiting is not None:
                    waiting.cancel()
                waiting = coro.throw(exc)
            else:
                waiting = coro.send(None)
        except StopIteration:
            return
