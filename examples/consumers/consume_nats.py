"""Keep a KV block index from the bridge's NATS JetStream stream (nats-py).

    python examples/consumers/consume_nats.py --servers nats://localhost:4222 --subject 'kv.>'

The sink: ``mode: jetstream``, ``format: json`` (event or batch granularity), a subject template
without ``{type}`` or ``{epoch}`` (default ``kv.{source}.{dp_rank}``). The consumer reads the
JetStream stream that captures ``--subject`` from its first message, with an ephemeral pull
consumer (no acks): the index is rebuilt from what the stream holds.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

import nats
from kv_index import KvIndex, decode, main
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError


async def consume(
    index: KvIndex, servers: str, stop: Callable[[], bool], subject: str = "kv.>", stream: str | None = None, wait: float = 0.2
) -> None:
    """Apply every message on ``subject`` (JetStream ``stream``, found by subject when None) to
    ``index`` until ``stop()`` is true (checked after each fetch)."""
    nc = await nats.connect(servers)
    try:
        js = nc.jetstream()
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL)
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
            except NatsTimeout:
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
    main(cli, lambda index, args, stop: consume(index, args.servers, stop, subject=args.subject, stream=args.stream))
