"""The replay client: asks an engine's ROUTER socket for buffered batches (docs/protocol.md section 1).

A fresh DEALER per request (so late replies of an abandoned request can never be mistaken for
the next one's), sending ``[b"", start]`` itself because the ROUTER expects an empty delimiter.
Replies come with or without the topic frame and end with the ``-1`` marker. Silence longer
than ``timeout`` ends the request as *uncertain* (the caller retries with backoff); the request
also ends early once the reply ``until`` (the last seq the stream needs) has arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import zmq
import zmq.asyncio

from .errors import DecodeError
from .wire import END_SEQ, ReplayReply, parse_replay


class ReplayOutcome:
    """How a replay ended: ``complete`` (end marker or ``until`` reached, no reply skipped) or not."""

    def __init__(self) -> None:
        self.complete = False
        self.replies = 0
        self.bad_replies = 0
        self.foreign = 0  # replies under a topic other than the source's: skipped


class ReplayClient:
    """Replays for every stream of a bridge: one ZMQ context, at most ``max_concurrent`` requests
    at once (a request waits for a slot), the same silence timeout and frame bound for all."""

    def __init__(self, ctx: zmq.asyncio.Context, *, max_concurrent: int, timeout: float, max_frame_bytes: int) -> None:
        self.ctx = ctx
        self.slots = asyncio.Semaphore(max_concurrent)
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes

    async def fetch(
        self, endpoint: str, start: int, until: int, outcome: ReplayOutcome, topic: bytes = b""
    ) -> AsyncGenerator[ReplayReply, None]:
        """The replies of one request from ``start`` (see :func:`replay`), holding a slot throughout."""
        async with self.slots:
            async for reply in replay(self.ctx, endpoint, start, until, self.timeout, outcome, self.max_frame_bytes, topic=topic):
                yield reply


async def replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    until: int,
    timeout: float,
    outcome: ReplayOutcome,
    max_frame_bytes: int,
    max_buffered: int = 5000,
    *,
    topic: bytes = b"",
) -> AsyncIterator[ReplayReply]:
    """Yield the replies of one replay request; ``outcome`` says how it ended. A reply whose topic
    frame does not start with ``topic`` (the source's) is skipped and counted: the source drops
    such live messages as another topic's (``wrong_topic``), so replay must not deliver them. An
    answer that skipped a reply (that, or one it cannot parse) is not complete at its end marker.

    At most ``max_buffered`` replies wait in ZMQ's receive buffer while the stream is busy (a
    full sink queue): the engine's ROUTER drops the rest, the reply stream goes silent, and the
    next request resumes after what was delivered. So a long replay never sits in memory whole.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.RCVHWM, max(100, max_buffered))
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", min(start, END_SEQ - 1).to_bytes(8, "big")])
        timeout_ms = max(1, int(timeout * 1000))
        while True:
            if not await sock.poll(timeout_ms):
                return  # silence: uncertain, not proof of loss
            frames = await sock.recv_multipart()
            try:
                reply = parse_replay(frames)
            except DecodeError:
                outcome.bad_replies += 1
                continue
            if reply.end:
                # Complete only when no reply was skipped: one that could not be read, or came
                # under another topic, may have been a batch the stream needs (that one was
                # "not there" would read as a new instance: uncertain, as silence is). Likewise
                # when the last one needed came (below).
                outcome.complete = not (outcome.bad_replies or outcome.foreign)
                return
            if topic and reply.topic is not None and not reply.topic.startswith(topic):
                outcome.foreign += 1
                continue
            outcome.replies += 1
            yield reply
            if 0 <= until <= reply.seq:
                outcome.complete = not (outcome.bad_replies or outcome.foreign)
                return
    finally:
        sock.close(linger=0)
