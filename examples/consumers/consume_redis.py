"""Keep a KV block index from the bridge's Redis streams (redis-py).

    python examples/consumers/consume_redis.py --url redis://localhost:6379/0 --match 'kv:*' [--bootstrap]

The sink: ``format: json`` (event or batch granularity), a ``stream`` template without ``{type}``
or ``{epoch}`` (default ``kv:{source}:{dp_rank}``). The consumer finds the stream keys with
``SCAN MATCH --match TYPE stream`` (again every few seconds, for new engines) and reads each from
its first entry with ``XREAD``; entry ids grow along a stream, so the last id read resumes exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from common import main

from kv_consumer import KvIndex, decode
from kv_consumer.redis import bootstrap as read_state


async def consume(
    index: KvIndex,
    url: str,
    stop: Callable[[], bool],
    match: str = "kv:*",
    block_ms: int = 200,
    rescan: float = 2.0,
    bootstrap: str | None = None,
) -> None:
    """Apply every entry of the streams matching ``match`` to ``index`` until ``stop()`` is true.

    ``bootstrap``: the suffix that makes a stream key its state key (the sink's ``state.key``,
    e.g. ``:state`` for the defaults): each stream starts from its state and reads only the
    entries after it (README "State bootstrap"); a stream without state is read from its start.
    """
    client = aioredis.Redis.from_url(url)
    last: dict[bytes, bytes] = {}  # stream key -> last entry id read
    scanned = 0.0

    async def start(key: bytes) -> bytes:
        if bootstrap is None:
            return b"0-0"
        state, after = await read_state(client, key.decode() + bootstrap, key.decode())
        head = state.head
        if after is None or "source" not in head:
            return b"0-0"  # no state (yet): the whole stream
        index.seed((head["source"], int(head["dp_rank"])), state)
        return str(after).encode()

    try:
        while not stop():
            if time.monotonic() - scanned > rescan:
                async for key in client.scan_iter(match=match, _type="stream"):
                    if key not in last:
                        last[key] = await start(key)
                scanned = time.monotonic()
            if not last:  # no stream yet
                await asyncio.sleep(block_ms / 1000)
                continue
            reply: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]
            reply = await client.xread(dict(last), count=5000, block=block_ms)  # type: ignore[arg-type,assignment]
            for key, entries in reply or []:
                for entry_id, fields in entries:
                    last[key] = entry_id
                    if b"data" in fields:  # json bodies (raw sinks write 'payload' instead)
                        index.apply(decode(fields[b"data"]))
    finally:
        await client.aclose()


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--url", default="redis://localhost:6379/0")
    cli.add_argument("--match", default="kv:*", help="SCAN pattern of the bridge's stream keys")
    cli.add_argument(
        "--bootstrap",
        nargs="?",
        const=":state",
        default=None,
        metavar="SUFFIX",
        help="start each stream from its state (the sink's state.enabled; state key = stream key + SUFFIX, default :state)",
    )
    main(cli, lambda index, args, stop: consume(index, args.url, stop, match=args.match, bootstrap=args.bootstrap))
