"""The example consumers' command line: consume into a :class:`kv_consumer.KvIndex`, print it.

The index, its rules and the state bootstrap readers come from the ``kv-event-consumer``
distribution (``pip install './consumer[redis]'``, or ``[kafka]``, ``[nats]``); the bridge need
not be installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Awaitable, Callable

from kv_consumer import Hash, KvIndex

# -- the examples' command line -------------------------------------------------------------------


def main(
    parser: argparse.ArgumentParser, consume: Callable[[KvIndex, argparse.Namespace, Callable[[], bool]], Awaitable[None]]
) -> None:
    """Parse the arguments, consume until Ctrl-C (or ``--seconds``), print the index's summary
    when it changed (checked every ``--every`` seconds) and at the end; ``--lookup HASH`` prints
    the streams holding a block."""
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: until Ctrl-C)")
    parser.add_argument("--every", type=float, default=1.0, help="print the summary this often, when it changed")
    parser.add_argument("--lookup", action="append", default=[], help="a block hash: print the streams holding it")
    parser.add_argument("--json", action="store_true", help="print the whole index as one JSON line instead of the summary")
    args = parser.parse_args()
    index, stopping = KvIndex(), asyncio.Event()
    end = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")

    async def report() -> None:
        printed = ""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), args.every)
            summary = json.dumps(index.snapshot()) if args.json else index.summary()
            if summary != printed or stopping.is_set():
                print(summary, flush=True)
                printed = summary

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        printer = asyncio.create_task(report())
        await consume(index, args, lambda: stopping.is_set() or time.monotonic() > end)
        stopping.set()
        await printer
        for text in args.lookup:  # as text (hex hashes) or as a number (integer hashes)
            forms: list[Hash] = [text, int(text)] if text.lstrip("-").isdigit() else [text]
            holding = set().union(*(index.streams_holding(h) for h in forms))
            print(f"{text}: {sorted(holding) or 'held by no stream'}")

    asyncio.run(run())
