"""Events per second of NatsConnector.write against bare nats-py publishing of the same messages.

    .venv/bin/python -m benchmarks.nats_client_bench [--url nats://127.0.0.1:4222] [--events 60000]

Without ``--url`` a nats-server with JetStream is started on a free port (tests/infra). Each run
writes the same rendered messages (JSON, event granularity, realistic BlockStored batches) in
writes of ``--batch`` messages: core (publish all, one flush per write) and JetStream (async
publishes, every ack awaited per write), through the connector and through plain nats-py calls.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import nats

from bridge.config import SinkConfig, convert_options
from bridge.formats import Message, Renderer
from bridge.records import Stream
from connectors.nats import MSG_ID_HEADER, NatsConnector, NatsOptions
from tests.support.records import stream_records


def messages(events: int) -> list[Message]:
    renderer = Renderer("json", "event")
    streams = [Stream("llama-a", r, {"model": "m"}) for r in range(4)]
    out: list[Message] = []
    seq = 0
    while len(out) < events:
        for s in streams:
            for rec in stream_records(s, 1, start=seq, epoch=1):
                out.extend(renderer.render(rec))
        seq += 1
    return out[:events]


async def timed(label: str, n: int, run: Callable[[], Awaitable[None]]) -> None:
    started = time.perf_counter()
    await run()
    elapsed = time.perf_counter() - started
    print(f"{label:<34} {n / elapsed:>12,.0f} events/s  ({elapsed:.2f}s)")


def chunks(items: Sequence[Message], size: int) -> list[Sequence[Message]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def run_bare_jetstream(
    nc: nats.NATS, subjects: Sequence[str], writes: Sequence[Sequence[Message]], max_pending: int, ack_timeout: float = 10.0
) -> None:
    """nats-py's own JetStream publishing: ``publish_async`` of each message with its
    ``Nats-Msg-Id`` (``subjects[i]`` for the i-th message overall), every ack awaited per write."""
    pub = nc.jetstream(publish_async_max_pending=max_pending)
    i = 0
    for w in writes:
        for m in w:
            headers = dict(m.headers)
            headers[MSG_ID_HEADER] = m.msg_id
            await pub.publish_async(subjects[i], m.value, headers=headers)
            i += 1
        await asyncio.wait_for(pub.publish_async_completed(), ack_timeout)


async def bench(url: str, events: int, batch: int, max_pending: int) -> None:
    msgs = messages(events)
    writes = chunks(msgs, batch)
    sink = SinkConfig(type="nats", name="bench", format="json")
    admin = await nats.connect(url)
    js = admin.jetstream(timeout=10)
    names: list[str] = []
    print(f"{events} events, writes of {batch}, max_pending {max_pending}, {sum(len(m.value) for m in msgs) / events:.0f} B each")
    try:
        for mode in ("core", "jetstream"):
            # The connector.
            dest = f"BENCH{uuid.uuid4().hex[:8].upper()}"
            names.append(dest)
            options = convert_options(
                {
                    "servers": url,
                    "subject": dest + ".{source}.{dp_rank}",
                    "mode": mode,
                    "stream": {"create": True, "name": dest, "subjects": [f"{dest}.>"]},
                },
                NatsOptions,
                "bench",
            )
            conn = NatsConnector("bench", options, sink)
            await conn.connect()

            async def via_connector(conn: NatsConnector = conn) -> None:
                for w in writes:
                    await conn.write(w)

            await timed(f"NatsConnector.write  {mode}", events, via_connector)
            await conn.close()

            # Bare nats-py, same subjects and headers.
            dest = f"BENCH{uuid.uuid4().hex[:8].upper()}"
            names.append(dest)
            await js.add_stream(name=dest, subjects=[f"{dest}.>"])
            nc = await nats.connect(url)
            subjects = [f"{dest}.{m.record.stream.source}.{m.record.stream.dp_rank}" for m in msgs]

            async def bare_core(nc: nats.NATS = nc, subjects: list[str] = subjects) -> None:
                i = 0
                for w in writes:
                    for m in w:
                        await nc.publish(subjects[i], m.value, headers=m.headers)
                        i += 1
                    await nc.flush(timeout=10)

            async def bare_js(nc: nats.NATS = nc, subjects: list[str] = subjects) -> None:
                await run_bare_jetstream(nc, subjects, writes, max_pending)

            await timed(f"bare nats-py         {mode}", events, bare_core if mode == "core" else bare_js)
            await nc.close()
    finally:
        for name in names:
            try:
                await js.delete_stream(name)
            except nats.errors.Error:
                pass
        await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="NATS server with JetStream (default: start one)")
    parser.add_argument("--events", type=int, default=60000)
    parser.add_argument("--batch", type=int, default=2000, help="messages per write (the runtime's batch.max_messages)")
    parser.add_argument("--max-pending", type=int, default=4000)
    args = parser.parse_args()
    if args.url:
        asyncio.run(bench(args.url, args.events, args.batch, args.max_pending))
        return
    from tests.infra.servers import NatsServer

    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp))
        server.start()
        try:
            asyncio.run(bench(server.url, args.events, args.batch, args.max_pending))
        finally:
            server.remove()


if __name__ == "__main__":
    main()
