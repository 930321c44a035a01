"""State bootstrap from a NATS JetStream sink (nats-py; the ``nats`` extra).

With ``state.enabled`` the sink keeps each engine stream's state in a JetStream key-value bucket:
its head at ``{prefix}._head`` and one key per live block at ``{prefix}.{medium}/{group}/{block}``,
where the prefix is :func:`state_prefix` of the stream. The head's ``next`` is the JetStream
sequence of the events stream the stream's messages continue from.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy, DiscardPolicy, RetentionPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from .state import StreamState, follows_head, is_head, parse, swept

_KV_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
HEAD_KEY = "_head"
_SWEEP_STALLS = 20  # half-second waits without a message before a sweep gives up
KV_OPERATION = "KV-Operation"


def state_token(source: str) -> str:
    """``source`` as one KV key token: letters, digits, ``_`` and ``-`` as they are, every other
    byte of its UTF-8 as ``=XX`` (hex), so that two sources never share a token (``llama-3.1`` ->
    ``llama-3=2e1``) and every KV client accepts the key; a leading ``_`` too (``=5f``): the
    bucket's top-level names starting with ``_`` are the bridge's own (``_journal``)."""
    token = _KV_UNSAFE.sub(lambda m: "".join(f"={b:02x}" for b in m.group().encode()), source)
    return "=5f" + token[1:] if token.startswith("_") else token or "="


def state_prefix(source: str, dp_rank: int) -> str:
    """The key prefix of one engine stream's state in the bucket: ``{source token}.{dp_rank}``;
    its head is ``{prefix}._head``, its entries ``{prefix}.{entry_key}`` (``GPU/0/<16 hex>``), the
    journal of its last write ``_journal.{prefix}.{part}`` (outside the prefix: a clear's purge
    leaves it)."""
    return f"{state_token(source)}.{dp_rank}"


async def sweep(js: JetStreamContext, bucket: str, prefix: str) -> dict[str, bytes | None]:
    """The newest value of every key of bucket ``bucket`` under ``prefix`` (``{prefix}.>``), by key
    relative to the prefix (None: deleted or purged), as of about now: an ordered consumer with
    DeliverLastPerSubject, read until it has delivered the prefix's last message as the bucket
    held it once the consumer was made (writes made meanwhile may show, never an older value
    than that). The end is told by stream sequence, not by the server's pending counts: a purge
    while the consumer delivers can zero them with messages still to come (nats-server 2.9).
    NotFoundError when the bucket does not exist."""
    pre = f"$KV.{bucket}.{prefix}."
    kv_stream = f"KV_{bucket}"
    n = len(pre)
    out: dict[str, bytes | None] = {}
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    last: int | None = None  # the stream seq of the prefix's last message (0: none)
    newest = 0  # the highest stream seq delivered

    async def on_msg(msg: Msg) -> None:
        nonlocal newest
        headers = msg.headers
        out[msg.subject[n:]] = None if headers and headers.get(KV_OPERATION) in ("DEL", "PURGE") else msg.data
        newest = max(newest, msg.metadata.sequence.stream)
        if last is not None and newest >= last and not done.done():
            done.set_result(None)

    async def last_seq() -> int:
        try:
            return (await js.get_last_msg(kv_stream, pre + ">")).seq or 0
        except NotFoundError:
            return 0  # (no key under the prefix: a missing bucket failed the subscribe already)

    sub = await js.subscribe(
        pre + ">",
        stream=kv_stream,
        cb=on_msg,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        inactive_threshold=60.0,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    try:
        last = await last_seq()
        stalls = 0
        while not done.done() and newest < last:
            seen = newest
            # (asyncio.wait, not wait_for: before 3.12 wait_for can swallow a cancel of the caller)
            await asyncio.wait({done}, timeout=0.5)
            if not done.done() and newest == seen:
                # Nothing came: the last message may have been purged meanwhile (never delivered).
                last = await last_seq()
                stalls += 1
                if stalls >= _SWEEP_STALLS and newest < last:
                    raise TimeoutError(
                        f"sweep of {prefix!r} in bucket {bucket!r}: nothing delivered for {stalls * 0.5:.0f}s before "
                        f"stream seq {last} (read up to {newest}); check the NATS server's health and bootstrap again"
                    )
            else:
                stalls = 0
    finally:
        await sub.unsubscribe()
    return out


async def bootstrap(
    js_or_nc: JetStreamContext | Client,
    bucket: str,
    source: str,
    dp_rank: int,
    *,
    events_stream: str | None = None,
    subject: str | None = None,
    attempts: int = 20,
    pause: float = 0.1,
) -> tuple[StreamState, int]:
    """A consumer's start on one engine stream: its live blocks from the bridge's state bucket,
    and the JetStream sequence of the events stream to follow its messages from.

    1. read the head ``{source}.{dp_rank}._head`` (keys: :func:`state_prefix`);
    2. sweep the stream's entries (:func:`sweep`: newest per key);
    3. read the head again: when its (epoch, gen) moved, or it is missing (a clear purges every
       key of the stream, the head too, and writes it again at once), start over (``attempts``
       times, ``pause`` seconds apart; then LookupError);
    4. count the entries of the head's generation: fewer than its ``live`` is a write in flight
       (its removals land before its head) or entries lost outside the bridge (a bucket trimmed
       by hand): looked at again up to :data:`SHORT_SWEEPS` times, then returned incomplete. So
       is the state of a bucket whose settings drop entries (:func:`bucket_drops_entries`).

    Returns ``(state, start)``: ``state`` is a :class:`~kv_consumer.state.StreamState`; follow the
    stream's subject of the events stream from JetStream sequence ``start`` (the head's ``next``:
    a consumer with ``DeliverByStartSequence`` and the stream's subject as filter) and give every
    message, decoded, to ``state.apply``. ``state.ready`` says when it is exact. With
    ``events_stream``, the message right before ``next`` is checked to be one the head can have
    been written after (:func:`~kv_consumer.state.follows_head`): an events stream lost and created
    again since holds others there, or none. When it is not, or the head has no ``next`` (the
    bridge did not know it), ``start`` is the first message of ``subject`` in ``events_stream``
    if both are given, else 1 (every held message; ``apply`` skips the old ones). The events
    stream must keep the messages since the head was written (its ``max_age``).
    """
    js = js_or_nc.jetstream() if isinstance(js_or_nc, Client) else js_or_nc
    prefix = state_prefix(source, dp_rank)
    kv_stream = f"KV_{bucket}"
    head_subject = f"$KV.{bucket}.{prefix}.{HEAD_KEY}"
    drops = await bucket_drops_entries(js, bucket)
    short = 0  # sweeps that found fewer entries than the head counts
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(pause)
        first = await _head_doc(js, kv_stream, head_subject)
        if first is None:
            continue
        held = await sweep(js, bucket, prefix)
        again = await _head_doc(js, kv_stream, head_subject)
        if again is None or (again["epoch"], again["gen"]) != (first["epoch"], first["gen"]):
            continue  # a clear ran during the sweep
        docs = [d for k, v in held.items() if "/" in k and v for d in (parse(v),) if d is not None]
        state = swept(first, docs, f"KV bucket {bucket!r}: {drops}" if drops else "")
        if not state.complete and first.get("complete") and not drops:
            short += 1
            if short < SHORT_SWEEPS and attempt < attempts - 1:
                continue  # a write in flight removes entries before it writes its head: look again
        start = first.get("next")
        if type(start) is int and events_stream is not None and not await _follows_head(js, events_stream, start - 1, first):
            start = None  # not the events stream the head was written after: from the subject's first message
        if type(start) is not int:
            start = 1
            if events_stream is not None and subject is not None:
                try:
                    start = (await js.get_msg(events_stream, seq=1, subject=subject, next=True)).seq or 1
                except NotFoundError:
                    start = 1
        return state, start
    raise LookupError(f"no consistent state of {source}/{dp_rank} in bucket {bucket!r} after {attempts} attempts")


SHORT_SWEEPS = 5
"""Sweeps of one bootstrap that may find fewer entries than the head counts (a write removes
entries before it writes its next head) before the state is returned incomplete: entries lost
outside the bridge (a bucket trimmed by hand)."""


async def bucket_drops_entries(js: JetStreamContext, bucket: str) -> str:
    """Why bucket ``bucket`` can lose state entries on its own (a TTL; limits that discard the
    oldest; interest retention), or "" when it keeps them: a state read from such a bucket is
    never complete, whatever its head says (the bridge refuses such a bucket and notices an edit
    within seconds; this closes the time before it does). Empty too when the bucket cannot be looked up (missing, or a
    user without the JetStream API's ``STREAM.INFO``: the bridge's check stands alone then)."""
    try:
        config = (await js.stream_info(f"KV_{bucket}")).config
    except (NatsError, TimeoutError):
        return ""
    if config.retention == RetentionPolicy.INTEREST:
        return "its entries go once every consumer interested acknowledged them (interest retention)"
    if config.max_age:
        return f"its entries expire after {config.max_age:g} s"
    if config.discard == DiscardPolicy.OLD and ((config.max_msgs or 0) > 0 or (config.max_bytes or 0) > 0):
        return "it discards its oldest entries at its limits"
    return ""


async def _follows_head(js: JetStreamContext, events_stream: str, seq: int, head: Mapping[str, Any]) -> bool:
    """Whether the message at JetStream sequence ``seq`` of ``events_stream`` can be the one
    ``head`` was written after (:func:`~kv_consumer.state.follows_head`). A message gone (the
    stream's limits, or the stream itself) cannot tell: False, and the caller reads from further
    back, where the copies are skipped."""
    if seq < 1:
        return True  # (nothing before it: the stream's first message is the head's next)
    try:
        msg = await js.get_msg(events_stream, seq=seq)
    except NotFoundError:
        return False
    return follows_head(head, dict(msg.headers or {}))


async def _head_doc(js: JetStreamContext, kv_stream: str, subject: str) -> dict[str, Any] | None:
    try:
        msg = await js.get_last_msg(kv_stream, subject)
    except NotFoundError:
        return None
    doc = parse(msg.data) if msg.data else None
    return doc if doc is not None and is_head(doc) else None


__all__ = ["HEAD_KEY", "KV_OPERATION", "bootstrap", "state_prefix", "state_token", "sweep"]
