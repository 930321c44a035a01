"""The limits the bridge is compared with: each client's bare batch-produce rate.

The messages are the ones the bridge would send for the load publisher's batches: the same
payload pool (:func:`benchmarks.load.payload_pool`), decoded with :mod:`bridge.wire` and rendered
with :class:`bridge.formats.Renderer`, ranks interleaved as they arrive. Each client writes them in
writes of ``batch.max_messages`` (2000) messages and waits for every acknowledgement of a write
before the next, the way the runtime does, with the same delivery settings as the connector:

- Kafka: aiokafka's batch API (``create_batch`` / ``send_batch`` per partition, murmur2 routing by
  stream key, acks=all, idempotent), :func:`benchmarks.kafka_client_bench.run_bare_batch`;
- Redis: redis-py pipelined ``XADD`` with the connector's explicit ids, fields and ``MAXLEN ~``
  (also measured with the connector's one-pass packer: ``redis+one-pass``);
- NATS: nats-py JetStream ``publish_async`` with ``Nats-Msg-Id``, then ``publish_async_completed``.

What is left out on purpose: ingest, decoding, rendering, queues, retries, metrics. The ratio
bridge / limit is therefore the share of the client's own ceiling that the whole bridge reaches.
The clients are timed on :class:`Rendered` messages, whose headers, id and position are built
beforehand, outside the CPU and time measured (``Message`` builds them when read), as they
were before that change.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

import msgspec

from bridge import wire
from bridge.formats import Message, Renderer
from bridge.records import Record, Stream

from .load import LoadShape, payload_pool

WRITE = 2000  # the runtime's default batch.max_messages


def messages_for(shape: LoadShape, fmt: str, granularity: str, batches: int, source: str = "bench") -> list[Rendered]:
    """The messages the bridge renders for ``batches`` batches of the load publisher, everything a
    client reads built (:class:`Rendered`)."""
    renderer = Renderer(fmt, granularity)  # type: ignore[arg-type]
    pools = [payload_pool(shape, r) for r in range(shape.ranks)]
    streams = [Stream(source, r) for r in range(shape.ranks)]
    out: list[Message] = []
    now = time.time()
    for i in range(batches):
        r = i % shape.ranks
        seq = i // shape.ranks
        payload = pools[r][seq % shape.pool]
        decoded = wire.decode_batch(payload)
        record = Record(stream=streams[r], epoch=0, seq=seq, ts=now, payload=payload, events=decoded.events, received=now)
        out.extend(renderer.render(record))
    return rendered(out)


class Rendered(msgspec.Struct):
    """A message with its headers, id and position built (what a bare client is timed on)."""

    record: Record
    index: int | None
    type: str
    value: bytes
    headers: dict[str, str]
    msg_id: str
    position: tuple[int, int, int]

    @property
    def key(self) -> bytes:
        return self.record.stream.key.encode()


def rendered(messages: Sequence[Message]) -> list[Rendered]:
    """``messages`` with everything a client reads built beforehand, outside its timing."""
    return [Rendered(m.record, m.index, m.type, m.value, m.headers, m.msg_id, m.position) for m in messages]


def events_in(messages: Sequence[Rendered]) -> int:
    return sum(1 if m.index is not None else len(m.record.events) for m in messages)


def _writes(messages: Sequence[Rendered]) -> list[Sequence[Rendered]]:
    return [messages[i : i + WRITE] for i in range(0, len(messages), WRITE)]


async def kafka_bare(servers: str, messages: Sequence[Rendered], partitions: int = 4) -> float:
    """Seconds aiokafka's batch API takes to deliver ``messages`` to a fresh topic."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from .kafka_client_bench import run_bare_batch

    topic = f"kvb-limit-{uuid.uuid4().hex[:10]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
        await asyncio.sleep(1.0)  # leaders elected
        started = time.perf_counter()
        await run_bare_batch(servers, topic, _writes(messages))  # type: ignore[arg-type]
        return time.perf_counter() - started
    finally:
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()


async def redis_bare(url: str, messages: Sequence[Rendered], maxlen: int, *, raw: bool, one_pass: bool = False) -> float:
    """Seconds redis-py's pipelined XADD takes for ``messages`` (the connector's ids and fields).

    ``one_pass``: with the connector's pipeline packer (:func:`connectors.redis.one_pass_packing`)
    instead of redis-py's own, i.e. the fastest way we know to drive the client.
    """
    import redis.asyncio as aioredis

    from connectors.redis import entry_id, message_position, one_pass_packing

    prefix = f"kvb-limit-{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(url)
    if one_pass:
        client.connection_pool.connection_class = one_pass_packing(client.connection_pool.connection_class)
    trim = ["MAXLEN", "~", str(maxlen)]
    try:
        started = time.perf_counter()
        for write in _writes(messages):
            pipe = client.pipeline(transaction=False)
            for m in write:
                s = m.record.stream
                fields: list[str | bytes] = []
                for k, v in m.headers.items():
                    fields += (k, v)
                fields += ("payload" if raw else "data", m.value)
                pipe.execute_command("XADD", f"{prefix}:{s.source}:{s.dp_rank}", *trim, entry_id(message_position(m)), *fields)  # type: ignore[arg-type]
            await pipe.execute()
        return time.perf_counter() - started
    finally:
        keys = [k async for k in client.scan_iter(match=prefix + ":*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def nats_bare(url: str, messages: Sequence[Rendered], max_pending: int = 4000) -> float:
    """Seconds nats-py's JetStream publish_async takes for ``messages`` (with Nats-Msg-Id)."""
    import nats

    from .nats_client_bench import run_bare_jetstream

    name = f"KVBLIMIT{uuid.uuid4().hex[:8].upper()}"
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=10)
    await js.add_stream(name=name, subjects=[f"{name}.>"], max_bytes=2**30)
    subjects = [f"{name}.{m.record.stream.source}.{m.record.stream.dp_rank}" for m in messages]
    try:
        started = time.perf_counter()
        await run_bare_jetstream(nc, subjects, _writes(messages), max_pending, ack_timeout=30)  # type: ignore[arg-type]
        return time.perf_counter() - started
    finally:
        try:
            await js.delete_stream(name)
        finally:
            await nc.close()
