"""Keep a KV block index from the bridge's NATS JetStream stream (nats-py).

    python examples/consumers/consume_nats.py --servers nats://localhost:4222 --subject 'kv.>' [--bootstrap]

The sink: ``mode: jetstream``, ``format: json`` (event or batch granularity), a subject template
without ``{type}`` or ``{epoch}`` (default ``kv.{source}.{dp_rank}``). The consumer reads the
JetStream stream that captures ``--subject`` from its first message, with an ephemeral pull
consumer (no acks): the index is rebuilt from what the stream holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable

import nats
from common import main
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from kv_consumer import KvIndex, decode
from kv_consumer.nats import bootstrap as read_state


async def seed(index: KvIndex, js: JetStreamContext, bucket: str, events: str | None) -> int:
    """Seed ``index`` with every engine stream that has a head in KV ``bucket``; the lowest
    JetStream sequence of events stream ``events`` one of them continues from (1: no state, or
    no events stream yet: one lost and not created again yet holds none of what the heads count)."""
    try:  # the heads' subjects: $KV.<bucket>.<source>.<dp_rank>._head
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.*.*._head")
    except NotFoundError:  # no bucket (yet): every message
        return 1
    starts = []
    for subject in info.state.subjects or {}:
        try:
            head = json.loads((await js.get_last_msg(f"KV_{bucket}", subject)).data or b"")
        except (NotFoundError, ValueError):
            continue  # removed meanwhile (a delete marker is no JSON)
        state, start = await read_state(js, bucket, head["source"], head["dp_rank"], events_stream=events)
        index.seed((head["source"], head["dp_rank"]), state)
        starts.append(start if events is not None else 1)
    return min(starts, default=1)


async def consume(
    index: KvIndex,
    servers: str,
    stop: Callable[[], bool],
    subject: str = "kv.>",
    stream: str | None = None,
    wait: float = 0.2,
    bootstrap: str | None = None,
) -> None:
    """Apply every message on ``subject`` (JetStream ``stream``, found by subject when None) to
    ``index`` until ``stop()`` is true (checked after each fetch).

    ``bootstrap``: the sink's KV bucket (``state.bucket``, e.g. ``KV_STATE``): each engine stream
    with a head there starts from its state, and the messages are read from the lowest sequence
    they continue from (README "State bootstrap"); older ones are skipped as duplicates.
    """
    nc = await nats.connect(servers)
    try:
        js = nc.jetstream()
        start = 1
        if bootstrap:
            try:
                events = stream or await js.find_stream_name_by_subject(subject)
            except NotFoundError:
                events = None
            start = await seed(index, js, bootstrap, events)
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        while True:  # until the bridge has created the stream
            try:
                sub = await js.pull_subscribe(subject, stream=stream, config=config)
                break
            except NotFoundError:
                if stop():
                    return
                await asyncio.sleep(1)
        while not stop():
            try:
                messages = await sub.fetch(1000, timeout=wait)
            except (NatsTimeout, TimeoutError):  # (nats-py raises either)
                continue
            for message in messages:  # in stream order
                index.apply(decode(message.data))
        await sub.unsubscribe()
    finally:
        await nc.close()


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--servers", default="nats://localhost:4222")
    cli.add_argument("--subject", default="kv.>", help="subjects the bridge's sink writes (its template, wildcarded)")
    cli.add_argument("--stream", default=None, help="JetStream stream name (default: the one capturing --subject)")
    cli.add_argument(
        "--bootstrap",
        nargs="?",
        const="KV_STATE",
        default=None,
        metavar="BUCKET",
        help="start each stream from its state (the sink's state.enabled; its state.bucket, default KV_STATE)",
    )
    main(
        cli,
        lambda index, args, stop: consume(
            index, args.servers, stop, subject=args.subject, stream=args.stream, bootstrap=args.bootstrap
        ),
    )
