"""ZMQ ingest: one SUB socket per (source, dp_rank), read by the process's drainer.

The SUB socket is a plain (synchronous) socket read with non-blocking calls. Its file descriptor
is watched by the process's :class:`bridge.ingest.Drainer`, which reads every ready socket in one
pass per ``ingest.tick`` (up to ``ingest.drain_max`` messages each) and hands each burst to the
stream's pipeline: one call per burst, not per message, and for a fleet one wake-up for many
streams. The reader's own task only finishes a pipeline call that had to wait (see
:mod:`bridge.ingest`). ZMQ's
``MAXMSGSIZE`` refuses oversized messages before allocating them (the connection is dropped and
re-established; the sequence gap is then repaired through replay). A source whose connections are
dropped ``_UNREAD_DROPS`` times in a row before any message is read counts as not connected
(reason ``dropped_unread``) until one is: every message may be over the limit. A monitor socket tracks
connections for ``kv_bridge_sources_connected`` (those of a source with no problem, handshaken:
see ``_monitor``) and the logs.

Health (docs/operations/monitoring.md): a connection counts once its ZMTP handshake succeeded (a
SUB that reached the engine's replay ROUTER connects, then is dropped without one). While a
source is not connected, the reader finds out why, at most every ``_DIAGNOSE_EVERY`` seconds, by
asking the endpoint itself (:mod:`bridge.probe`): a name that does not resolve, a refused port, no
answer, or a peer of the wrong type (named, with the likely fix). ``problem`` holds the answer for
``/readyz`` and ``kv_bridge_source_problem``.

Until a message of the configured topic prefix arrives after a connection, the socket also
subscribes to every topic and drops the others itself (ZMQ's own filter would drop them unseen):
a source whose engine publishes under another topic receives nothing, which looks exactly like
an idle engine, so the reader counts it as not connected (reason ``wrong_topic``, naming the
topics seen). Once one has arrived, the socket subscribes to its prefix alone again, so the
publisher filters other topics (a busy one costs nothing); a new connection (a redeployed
engine) probes again. Dropped messages count toward ``ingest.drain_max``: a flood of them yields
to the other streams like any burst. With the default prefix (``""``) nothing is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.backend import Socket as _BackendSocket
from zmq.utils.monitor import parse_monitor_message

from . import probe
from .config import IngestConfig
from .errors import StartupError
from .ingest import Drainer, finish, start_inline
from .stream import StreamPipeline

log = logging.getLogger("bridge.source")

_MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED
)
# While a source is not connected, how often the reader asks the endpoint why (one TCP connection).
_DIAGNOSE_EVERY = 15.0
# Connections in a row dropped before any message was read: a message over ingest.max_frame_bytes
# (ZMQ ends the session and says nothing else), or an engine restarting before it publishes.
_UNREAD_DROPS = 3
# libzmq does not reconnect a session it ended for a protocol error (e.g. a message over
# MAXMSGSIZE): if a dropped connection shows no sign of retrying within this time, re-dial.
_REDIAL_AFTER = 1.0
_HANDSHAKE_WITHIN_MS = 10_000
# A connection still open this long after it was accepted has handshaken (libzmq drops one that
# has not within _HANDSHAKE_WITHIN_MS): a handshake left unplaced among several is then its.
_HANDSHAKEN_BY = _HANDSHAKE_WITHIN_MS / 1000 + 2.0
# Frames are read with the compiled socket's own recv: pyzmq's recv_multipart converts flags and
# options to enums on every call, which took half the time of a 3-frame read. Each frame is read
# as a zmq Frame (copy=False) for its ``more`` flag, then copied out: a getsockopt(RCVMORE) per
# frame cost more than that (each checks the socket and the pid first), 1.9 of 5.8 us a message.
_recv = _BackendSocket.recv
# ZMQ_EVENTS read with the compiled socket's own get and plain ints: the sugar's enums made the
# option lookup and the ``&`` Python-level calls (2.3 us -> 1.4 us a read).
_get = cast(Callable[[zmq.Socket[bytes], int], int], _BackendSocket.get)  # an int for EVENTS
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def bind_problem(where: str, endpoint: str, exc: zmq.ZMQError) -> str:
    """The one line for a ``bind: true`` source whose address cannot be taken (also --check's)."""
    why = (
        "another process holds the port: stop it, or choose another"
        if exc.errno == zmq.EADDRINUSE
        else "the address is not this host's: use one of its addresses (or * for all), or another"
    )
    fix = f"{why} address, or set bind: false to connect to the engine"
    return f"{where}: cannot bind {endpoint} ({zmq.strerror(exc.errno) if exc.errno is not None else exc}); {fix}"


def try_bind(where: str, endpoint: str) -> tuple[str, bool] | None:
    """Bind ``endpoint`` on a throwaway socket (what --check does for a ``bind: true`` source):
    None if it can be taken, else the problem and whether another process holds it now."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        return bind_problem(where, endpoint, exc), exc.errno == zmq.EADDRINUSE
    finally:
        sock.close(linger=0)
    return None


def _outlived(waiting: dict[int, float], now: float, loose: int) -> list[int]:
    """The waiting connections (fd: when accepted) that must have handshaken by ``now``, oldest
    first, at most ``loose`` of them (the handshakes not placed yet)."""
    old = sorted((t, fd) for fd, t in waiting.items() if now - t >= _HANDSHAKEN_BY)
    return [fd for _, fd in old[:loose]]


def _handshaken(left: int, loose: int) -> tuple[bool | None, int]:
    """Whether a connection dropped while it was among those waiting (``left`` of them waiting
    still) had handshaken, and ``loose`` after it: no when none of them had (``loose``, the
    handshakes of one of them), yes when more had than are left, else it cannot be told (None)."""
    if not loose:
        return False, 0
    if left < loose:
        return True, loose - 1
    return None, loose


class SourceReader:
    """Reads one stream's live socket. ``subscribed`` is True once the socket is set up."""

    def __init__(
        self,
        pipeline: StreamPipeline,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        bind: bool,
        topic: str,
        ingest: IngestConfig,
        on_connection: asyncio.Event | None = None,
        drainer: Drainer | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.ctx = ctx
        self.endpoint = endpoint
        self.bind = bind
        self._opened: tuple[zmq.Socket[bytes], zmq.asyncio.Socket] | None = None  # by open(), for run()
        self.topic = topic
        self.ingest = ingest
        self.subscribed = False
        self.connections = 0
        self.problem: str | None = "not connected yet"
        """Why the source is not connected (None while it is), for /readyz and the metrics."""
        self._reason = "waiting"
        self._diagnosed_at = -_DIAGNOSE_EVERY
        self._diagnosing: asyncio.Task[None] | None = None
        self._topic = topic.encode()
        # Subscribed to every topic too: no message of the source's own topic since the connection.
        self._probing = False
        self._foreign_topics: list[str] = []  # the first few other topics seen, for the problem
        self._heard = False  # a message was read since the last connection came up
        self._unread_drops = 0  # connections in a row dropped before one was (see _UNREAD_DROPS)
        self._connected_gauge = pipeline.metrics.connected
        self._counted = 0  # this reader's part of kv_bridge_sources_connected (see _recount)
        self._disconnects = pipeline.metrics.disconnects
        metrics = pipeline.metrics.metrics
        labels = (pipeline.stream.source, str(pipeline.stream.dp_rank))
        self._up = metrics.source_up.labels(*labels)
        self._problem_metric = metrics.source_problem
        self._labels = labels
        self._up.set(0)
        # Read by the process's drainer (bridge.ingest); a reader made alone has its own.
        self._drainer = drainer
        self._reading: Drainer | None = None  # the drainer reading the socket (run)
        self.queued = False
        self._sock: zmq.Socket[bytes] | None = None
        self._busy = False  # a burst's pipeline call not finished: the socket is not read
        self._drop_waits: asyncio.Event | None = None  # a drop waiting for that call (see _read_tail)
        # Open connections by file descriptor (see _monitor): waiting for their handshake (fd: when
        # seen), handshaken, and handshakes not placed among those waiting.
        self._waiting: dict[int, float] = {}
        self._shaken: set[int] = set()
        self._loose = 0
        self._parked: tuple[Coroutine[Any, Any, None], asyncio.Future[Any] | None] | Exception | None = None
        self._wake = asyncio.Event()
        self._problem_metric.labels(*labels, self._reason).set(1)

    def _socket(self) -> tuple[zmq.Socket[bytes], zmq.asyncio.Socket]:
        # A plain socket (see the module docstring), made by the context so that its options
        # (IPv6...) apply.
        sock: zmq.Socket[bytes] = zmq.Context.socket(self.ctx, zmq.SUB, socket_class=zmq.Socket)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.ingest.receive_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.ingest.max_frame_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        # A peer whose host died (no FIN, no RST) is dropped after 30 + 3 x 10 s, not the
        # kernel's default 11 minutes of probes.
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
        # A connection that has not handshaken within this is dropped (libzmq's default: 30 s). A TCP
        # probe accepted while an engine's handshake is in flight makes the counts ambiguous (see
        # _handshaken) until it goes; an engine's ZMTP handshake takes a few round trips.
        sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_WITHIN_MS)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        if self._topic:
            sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic, until one of its own: see the module docstring
            self._probing = True
        # The monitor is attached before connecting so that no connection event is missed. It is
        # made by the asyncio context, so it is an asyncio socket.
        monitor: zmq.asyncio.Socket = sock.get_monitor_socket(_MONITOR_EVENTS)  # type: ignore[assignment]
        if self.bind:
            sock.bind(self.endpoint)
        else:
            sock.connect(self.endpoint)
        return sock, monitor

    def open(self, where: str) -> None:
        """Make the socket now (bind or connect), before :meth:`run`: a ``bind`` address the
        bridge cannot take is a start-up error naming the thing (``where``) and the fix, not a
        task that dies later."""
        try:
            self._opened = self._socket()
        except zmq.ZMQError as exc:
            if not self.bind:
                raise
            raise StartupError(bind_problem(where, self.endpoint, exc)) from None

    async def run(self) -> None:
        """Set the socket up, have the process's drainer read it (see :mod:`bridge.ingest`), and
        finish here what a burst's pipeline call could not finish inline."""
        opened, self._opened = self._opened, None
        sock, monitor = opened if opened is not None else self._socket()
        # Watched like every background task: a monitor that dies would hide reconnects (and
        # with them the check that the engine on the other end is still the same instance).
        monitor_task = self.pipeline.ctx.spawn(self._monitor(monitor, sock), f"monitor:{self.endpoint}")
        self.subscribed = True
        log.info("source subscribed", extra={"stream": self.pipeline.stream.key, "endpoint": self.endpoint, "bind": self.bind})
        fd = sock.fileno()
        drainer = self._drainer if self._drainer is not None else Drainer(self.ingest.tick)
        self._reading = drainer
        self._sock = sock
        drainer.watch(fd, self)
        drainer.note(self)  # whatever arrived before the descriptor was watched
        try:
            try:
                while True:
                    await self._wake.wait()
                    self._wake.clear()
                    parked, self._parked = self._parked, None
                    if isinstance(parked, BaseException):
                        raise parked  # the pipeline's failure, as if this task had made the call
                    if parked is not None:
                        self._parked = parked  # until finished: a cancellation meanwhile is thrown into it
                        await finish(*parked)
                        self._parked = None
                    if self._drop_waits is not None:  # the socket is the drop's now (see _read_tail)
                        self._drop_waits.set()
                        continue
                    self._busy = False
                    drainer.note(self)
            except asyncio.CancelledError:
                parked = self._parked
                if isinstance(parked, tuple):
                    self._parked = None
                    await finish(*parked, cancelled=True)
                raise
        finally:
            drainer.unwatch(fd, self)
            if drainer is not self._drainer:
                drainer.close()
            self._sock = None
            self.subscribed = False
            monitor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await monitor_task
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
            if self._diagnosing is not None:
                self._diagnosing.cancel()
            self.connections = self._loose = 0
            self._waiting.clear()
            self._shaken.clear()
            self._recount()
            self._up.set(0)
            with contextlib.suppress(KeyError):
                self._problem_metric.remove(*self._labels, self._reason)
            sock.close(linger=0)

    # -- called by the drainer (bridge.ingest) ----------------------------------------------------
    def signalled(self) -> bool:
        sock = self._sock
        if sock is None:
            return False
        if self._busy:
            _get(sock, _EVENTS)  # consumes the signal (see bridge.ingest); read once the call finished
            return False
        return True  # the reads consume it (one ZMQ call fewer per quiet batch than asking first)

    def drain(self, received: float) -> bool:
        sock = self._sock
        if sock is None or self._busy:
            return False
        burst, foreign = self._read(sock)
        self._noted(sock, burst, foreign)
        if burst:
            coro = self.pipeline.on_live(burst, received)
            try:
                done, waiting = start_inline(coro)
            except Exception as exc:  # the stream's failure: its task raises it, and is watched
                self._park(exc)
                return False
            if not done:
                self._park((coro, waiting))
                return False
        return len(burst) + foreign == self.ingest.drain_max

    def _park(self, parked: tuple[Coroutine[Any, Any, None], asyncio.Future[Any] | None] | Exception) -> None:
        """Hand ``run`` a burst's suspended pipeline call (or its failure); the socket is not read
        until it has finished."""
        self._busy = True
        self._parked = parked
        self._wake.set()

    def _read(self, sock: zmq.Socket[bytes], limit: int = 0) -> tuple[list[list[bytes]], int]:
        """What is ready on ``sock``, up to ``limit`` (``ingest.drain_max`` if 0) messages: the burst
        of the source's topic, and how many messages of other topics were read (and dropped)."""
        burst: list[list[bytes]] = []
        foreign = 0
        recv, noblock, topic = _recv, zmq.NOBLOCK, self._topic
        try:
            for _ in range(limit or self.ingest.drain_max):
                frame = recv(sock, noblock, False)  # only the first frame can be missing: multipart is atomic
                frames = [frame.bytes]
                while frame.more:
                    frame = recv(sock, noblock, False)
                    frames.append(frame.bytes)
                if topic and not frames[0].startswith(topic):
                    foreign += 1
                    self._foreign(frames[0])
                    continue
                burst.append(frames)
                # A quiet stream's pass brings one message: ask whether another is there rather
                # than read until zmq.Again, whose exception costs 3x more. Either way the socket
                # signals again when the next message arrives (see bridge.ingest).
                if len(burst) == 1 and not _get(sock, _EVENTS) & _POLLIN:
                    break
        except zmq.Again:
            pass
        return burst, foreign

    async def _monitor(self, monitor: zmq.asyncio.Socket, sock: zmq.Socket[bytes]) -> None:
        key = self.pipeline.stream.key
        redial: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        # Open connections by file descriptor, which ACCEPTED, CONNECTED and DISCONNECTED carry:
        # a connection dropped before its handshake (a TCP or TLS probe of a bound port, a port
        # scan, a peer of the wrong kind) is no engine going away (breaker110, breaker112). A
        # handshake's event carries none: it is the connection's when one alone waited, else
        # ``loose``, one of those waiting (see _handshaken).
        waiting, shaken = self._waiting, self._shaken
        backlog: list[Any] = []  # events read ahead (see _read_tail)
        while True:
            if backlog:
                msg = backlog.pop(0)
            else:
                # With handshakes unplaced, wake when the oldest waiting connection must have had one.
                due = min(waiting.values()) + _HANDSHAKEN_BY - time.monotonic() if self._loose and waiting else None
                try:
                    async with asyncio.timeout(None if due is None else max(0.0, due)):
                        msg = parse_monitor_message(await monitor.recv_multipart())
                except TimeoutError:
                    for fd in _outlived(waiting, time.monotonic(), self._loose):
                        del waiting[fd]
                        shaken.add(fd)
                        self._loose -= 1
                    if not self._loose and self._reason == "perhaps_gone" and self.connections:
                        self._set_problem(None, "")  # (the counts are right again: the engine's connection is open)
                    continue
            event, fd = msg["event"], msg["value"]
            shook: bool | None = self.connections > 0  # (a DISCONNECTED: of a handshaken connection?)
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                waiting[fd] = time.monotonic()
            elif event == zmq.EVENT_DISCONNECTED and fd in shaken:
                shaken.discard(fd)
            elif event == zmq.EVENT_DISCONNECTED and fd in waiting:
                del waiting[fd]
                shook, self._loose = _handshaken(len(waiting), self._loose)
            if event == zmq.EVENT_DISCONNECTED and shook is None:
                # Perhaps the engine's: told, so that whoever comes next is verified (a missed
                # restart would put a new instance in the old epoch); counted still, but not
                # connected until a message says the engine is there, or the counts come right.
                log.info("a connection dropped, perhaps the engine's", extra={"stream": key, "endpoint": self.endpoint})
                self._heard = False
                self._set_problem(
                    "a connection dropped while another waited for its handshake, perhaps the engine's: not known to be "
                    "connected until a message is read",
                    "perhaps_gone",
                )
                await self.pipeline.disconnected()
            elif event == zmq.EVENT_DISCONNECTED and not shook:
                if not self.connections:
                    self._diagnose()  # (never handshaken: a peer of the wrong type?)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # a PUB at the other end (or an engine connected in)
                # A bound source's engine connected while one is still counted: a new instance of
                # it whose old connection is not seen to drop (its host died: half-open until the
                # keep-alive ends it). Told as a drop, so that what comes next is verified (I1).
                another = self.connections > 0
                if len(waiting) == 1 and not self._loose:
                    shaken.add(waiting.popitem()[0])
                elif waiting:
                    self._loose += 1
                self.connections += 1
                if self._topic and not self._probing:  # a new engine (a redeploy) may publish under another topic
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
                    self._probing = True
                self._heard = False
                if self._unread_drops < _UNREAD_DROPS:  # (else not connected until a message is read)
                    self._set_problem(None, "")
                self._recount()
                log.info("source connected", extra={"stream": key, "endpoint": self.endpoint})
                if another:
                    log.info("another engine connection while one is open", extra={"stream": key, "endpoint": self.endpoint})
                    await self.pipeline.disconnected()
            elif event == zmq.EVENT_DISCONNECTED and shook and self.connections > 0:
                self.connections -= 1
                tail = await self._read_tail(monitor, backlog) if not self.connections else None
                self._disconnects.inc()
                if not self._heard:
                    self._unread_drops += 1
                if self._unread_drops >= _UNREAD_DROPS:
                    self._dropped_unread()
                elif not self.connections:
                    self._set_problem("the engine went away: reconnecting", "disconnected")
                self._recount()
                log.warning("source disconnected", extra={"stream": key, "endpoint": self.endpoint})
                if tail is not None:
                    await self._before_drop(tail[0])
                # Whoever is there when it reconnects may be a new engine instance.
                await self.pipeline.disconnected()
                if tail is not None:
                    await self._after_drop(tail[1])
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED) and not self.connections:
                self._diagnose()  # never handshaken (a peer of the wrong type?), or not reachable
            if redial is not None and event in (zmq.EVENT_CONNECTED, zmq.EVENT_CONNECT_RETRIED):
                redial.cancel()
                redial = None
            if event == zmq.EVENT_DISCONNECTED and not self.bind:
                if redial is not None:
                    redial.cancel()
                redial = loop.call_later(_REDIAL_AFTER, self._redial, sock)

    async def _read_tail(
        self, monitor: zmq.asyncio.Socket, backlog: list[Any]
    ) -> tuple[list[list[bytes]], list[list[bytes]]] | None:
        """The last connection dropped: the messages the socket holds came through it, up to the
        read that ends once a new connection has handshaken (its event is read ahead from the
        monitor into ``backlog`` after each read of up to ``ingest.drain_max``: libzmq reports a
        handshake before the connection's first message). They are read now, into memory and without waiting for the pipeline
        (a few microseconds each, well within the 100 ms before libzmq dials again), even while
        a pipeline call is parked on a full sink queue, and up to ``ingest.receive_hwm`` of them
        (what the socket holds at most). :meth:`_before_drop` hands them on before the drop is
        told: the engine's last batches, published before it stopped, are its own, not read in
        doubt as perhaps a new instance's, which only their clocks could tell, and not within
        ``clock_skew`` (breaker111 H1; breaker116: a tail read after a new connection's handshake,
        or left in the socket behind a parked call, was announced lost though received). Returns
        them, and the message read past that point (for :meth:`_after_drop`, once the drop is
        told); None when the socket is gone. The drainer leaves the socket alone until then."""
        sock = self._sock
        if sock is None or self._reading is None:
            return None
        if self._busy:  # a parked pipeline call: run() hands the socket to the drop once it finished
            self._drop_waits = asyncio.Event()
        self._busy = True
        before: list[list[bytes]] = []
        past: list[list[bytes]] = []  # (perhaps with the new connection's: read in doubt, after the drop)
        try:
            while len(before) < self.ingest.receive_hwm:
                burst, foreign = self._read(sock, self.ingest.drain_max)
                self._noted(sock, burst, foreign)
                while cast(int, monitor.get(zmq.EVENTS)) & zmq.POLLIN:  # (read ahead: no wait)
                    backlog.append(parse_monitor_message(await monitor.recv_multipart()))
                if any(e["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED for e in backlog):
                    past = burst
                    break
                before += burst
                if not burst and not foreign:
                    break
        except BaseException:
            self._release()
            raise
        # Published, for a checkpoint saved while they wait (a stop meanwhile: I3).
        self.pipeline.note_unread(before)
        return before, past

    async def _before_drop(self, before: list[list[bytes]]) -> None:
        """The tail read by :meth:`_read_tail`, to the pipeline (after the call that was parked, if
        one was), in bursts of ``ingest.drain_max``."""
        try:
            if self._drop_waits is not None:
                await self._drop_waits.wait()
                self._drop_waits = None
            for at in range(0, len(before), self.ingest.drain_max):
                await self._hand_on(before[at : at + self.ingest.drain_max])
        except BaseException:
            self._release()
            raise

    async def _hand_on(self, burst: list[list[bytes]]) -> None:
        """A burst read outside the drainer (see _before_drop), to the pipeline."""
        if burst:
            await self.pipeline.on_live(burst, time.time())

    def _noted(self, sock: zmq.Socket[bytes], burst: list[list[bytes]], foreign: int) -> None:
        """What a read of ``sock`` showed: the engine's messages get through; one of the source's
        own topic ends the probing of every topic."""
        if not self._heard and (burst or foreign):
            self._heard_now()
        if burst and self._probing:
            self._own_topic(sock)

    async def _after_drop(self, after: list[list[bytes]]) -> None:
        """The drop told: the message read past the new connection's handshake, if any, then the
        socket back to the drainer."""
        try:
            await self._hand_on(after)
        finally:
            self._release()

    def _release(self) -> None:
        """The socket back to the drainer, after a drop (see _read_tail)."""
        self._drop_waits = None
        self._busy = False
        if self._reading is not None:
            self._reading.note(self)

    def _foreign(self, topic: bytes) -> None:
        """A message under a topic outside the prefix: dropped, and a problem while none of the
        source's own topic came since the connection (a publisher of several topics whose KV events
        are idle looks the same until its first one: not told apart, it counts as not connected)."""
        if not self._probing:
            return
        seen = topic[:64].decode(errors="replace")
        if seen in self._foreign_topics or len(self._foreign_topics) >= 3:
            if self._reason == "wrong_topic":
                return
        else:
            self._foreign_topics.append(seen)
        problem = (
            f"{self.endpoint}: the engine publishes under {', '.join(map(repr, self._foreign_topics))} and "
            f"nothing yet under a topic starting with {self.topic!r}: set the source's topic to the engine's "
            'KV events topic ("" for every topic)'
        )
        if problem == self.problem:
            return
        self._set_problem(problem, "wrong_topic")
        log.error("source receives no message of its topic", extra={"stream": self.pipeline.stream.key, "error": problem})

    def _own_topic(self, sock: zmq.Socket[bytes]) -> None:
        """A message of the source's topic came: the publisher may filter the others again."""
        sock.setsockopt(zmq.UNSUBSCRIBE, b"")
        self._probing = False
        if self._reason == "wrong_topic" and self.connections:
            self._set_problem(None, "")

    def _heard_now(self) -> None:
        """The first message read since the connection came up: the engine's messages get through."""
        self._heard = True
        self._unread_drops = 0
        if self._loose == 1 and len(self._waiting) == 1 and not self._shaken:
            # A message, and one connection open that can have sent it: its handshake is placed.
            self._shaken.add(self._waiting.popitem()[0])
            self._loose = 0
        if self._reason in ("dropped_unread", "perhaps_gone") and self.connections:
            self._set_problem(None, "")

    def _dropped_unread(self) -> None:
        """``_UNREAD_DROPS`` connections or more in a row dropped before a message was read: not
        connected (reason ``dropped_unread``) across the reconnects, until one is."""
        problem = (
            f"{self.endpoint}: the connection was dropped {self._unread_drops} times in a row before any message was "
            f"read. ZMQ drops it at a message over ingest.max_frame_bytes ({self.ingest.max_frame_bytes} bytes) and says "
            "nothing else: raise that above the engine's largest batch; or the engine restarts before it publishes"
        )
        if self._reason != "dropped_unread":
            log.error("source reads nothing", extra={"stream": self.pipeline.stream.key, "error": problem})
        self._set_problem(problem, "dropped_unread")

    def _set_problem(self, problem: str | None, reason: str) -> None:
        """Record why the source is not connected (None: it is), in the metrics too."""
        self.problem = problem
        self._up.set(1 if problem is None else 0)
        if reason != self._reason:
            with contextlib.suppress(KeyError):
                self._problem_metric.remove(*self._labels, self._reason)
            if problem is not None:
                self._problem_metric.labels(*self._labels, reason).set(1)
            self._reason = reason if problem is not None else ""
        self.pipeline.foreign_only = self._reason == "wrong_topic"
        self._recount()

    def _recount(self) -> None:
        """``kv_bridge_sources_connected`` counts this reader's connections while it has no problem:
        a connection that reads nothing of its own (``wrong_topic``, ``dropped_unread``) is none, as
        in ``/readyz`` and ``kv_bridge_source_up``."""
        n = self.connections if self.problem is None else 0
        if n != self._counted:
            self._connected_gauge.inc(n - self._counted)
            self._counted = n

    def _diagnose(self) -> None:
        """Find out, in the background and at most every ``_DIAGNOSE_EVERY``, why nothing connects."""
        now = time.monotonic()
        if self.bind:
            self._set_problem(f"no engine has connected to {self.endpoint} yet", "waiting")
            return
        if now - self._diagnosed_at < _DIAGNOSE_EVERY or (self._diagnosing is not None and not self._diagnosing.done()):
            return
        self._diagnosed_at = now
        self._diagnosing = self.pipeline.ctx.spawn(self._ask_peer(), f"diagnose:{self.endpoint}")

    async def _ask_peer(self) -> None:
        """Ask the endpoint what it is (see bridge.probe) and record the answer as the problem."""
        answer = await probe.diagnose(self.endpoint, "live")
        if answer is None:
            return  # a PUB (libzmq connects on its next try), or neither a TCP nor an ipc endpoint
        if self.connections:
            return  # connected meanwhile
        problem, reason = f"{self.endpoint}: {answer[0]}", answer[1]
        was = self._reason
        self._set_problem(problem, reason)
        if reason != was:
            log_at = log.error if reason == "wrong_peer" else log.warning
            key = self.pipeline.stream.key
            log_at("source not connected", extra={"stream": key, "endpoint": self.endpoint, "error": problem})

    def _redial(self, sock: zmq.Socket[bytes]) -> None:
        if self.connections > 0 or sock.closed:
            return
        log.warning("connection ended without retry (protocol error?): re-dialing", extra={"endpoint": self.endpoint})
        try:
            sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # a timer callback: nobody else would see this
            log.error("re-dial failed", extra={"endpoint": self.endpoint, "error": str(exc)})
