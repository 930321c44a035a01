"""The command line. Only this module chooses exit codes; everything else raises.

python -m bridge --config FILE            run the bridge
python -m bridge --config FILE --check    validate (parse, build connectors, reach sinks) -> 0 or 2
python -m bridge simulate [...]           a vLLM-compatible publisher
python -m bridge tail ENDPOINT [...]      print an engine's decoded events
python -m bridge demo                     simulator + bridge + stdout sink, no broker needed
python -m bridge schema [--check FILE]    print the output records' JSON Schema (or compare FILE with it)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from . import __version__, logs
from . import config as config_mod
from .config import Config
from .connector import Connector, Registry
from .errors import ConfigError, ConnectorError
from .runtime import run as run_bridge
from .secret import redact
from .simulator import DEFAULT_PROFILE, PROFILES, Faults, Simulator, SimulatorOptions

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2

log = logging.getLogger("bridge.cli")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bridge", description="KV-cache events from inference engines to Kafka, Redis Streams and NATS."
    )
    p.add_argument("--config", "-c", help="config file (.yaml, .yml or .toml)")
    p.add_argument("--check", action="store_true", help="validate the config and exit (0 ok, 2 problems)")
    p.add_argument("--offline", action="store_true", help="with --check: do not contact the sinks")
    p.add_argument("--version", action="version", version=f"kv-event-bridge {__version__}")
    sub = p.add_subparsers(dest="command")

    s = sub.add_parser("simulate", help="run a vLLM-compatible KV-event publisher")
    s.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="PUB endpoint of rank 0 (rank r: port + r)")
    s.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558", help="ROUTER replay endpoint of rank 0; '' for none")
    s.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="engine release to imitate")
    s.add_argument("--ranks", type=int, default=1, help="data-parallel ranks")
    s.add_argument("--topic", default="", help="ZMQ topic")
    s.add_argument("--rate", type=float, default=100.0, help="batches per second per rank (0: as fast as possible)")
    s.add_argument("--count", type=int, default=0, help="batches per rank, then stop (0: forever)")
    s.add_argument("--events-per-batch", type=int, default=4)
    s.add_argument("--blocks-per-event", type=int, default=2)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--buffer-steps", type=int, default=10_000, help="replay buffer (batches)")
    s.add_argument("--drop-rate", type=float, default=0.0, help="fraction of live messages never sent (kept for replay)")
    s.add_argument("--replay-drop-rate", type=float, default=0.0, help="fraction of replay replies lost")
    s.add_argument("--restart-every", type=int, default=0, help="restart the engine every N batches")
    s.add_argument("--connect", action="store_true", help="connect to the endpoint instead of binding it")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--linger", type=float, default=0.0, help="keep serving replay this long after the last batch")

    t = sub.add_parser("tail", help="print decoded events of an engine")
    t.add_argument("endpoint")
    t.add_argument("--topic", default="")
    t.add_argument("--replay-endpoint", default=None)
    t.add_argument("--from-seq", type=int, default=None, help="replay from this seq first (needs --replay-endpoint)")
    t.add_argument("--count", type=int, default=0, help="stop after N batches")
    t.add_argument("--granularity", choices=["event", "batch"], default="event")

    d = sub.add_parser("demo", help="simulator + bridge + stdout sink (no broker needed)")
    d.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: until Ctrl-C)")
    d.add_argument("--rate", type=float, default=2.0, help="batches per second per rank")
    d.add_argument("--format", choices=["json", "msgpack", "raw"], default="json")
    d.add_argument("--granularity", choices=["event", "batch"], default="event")
    d.add_argument("--metrics", default="127.0.0.1:9300", help="metrics listen address ('' to disable)")

    sc = sub.add_parser("schema", help="print the JSON Schema of the records the json format writes")
    sc.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the schema (e.g. schema/kv-events.schema.json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "tail":
        from .tail import tail

        logs.setup()
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how tail usually ends
            _run(
                lambda: tail(
                    args.endpoint,
                    topic=args.topic,
                    replay_endpoint=args.replay_endpoint,
                    from_seq=args.from_seq,
                    count=args.count,
                    granularity=args.granularity,
                )
            )
        return EXIT_OK
    if args.command == "demo":
        return _demo(args)
    if args.command == "schema":
        return _schema(args.check)
    if not args.config:
        _parser().print_usage(sys.stderr)
        print("python -m bridge: error: --config FILE is required (or a command: simulate, tail, demo, schema)", file=sys.stderr)
        return EXIT_CONFIG
    if args.check:
        return check(args.config, offline=args.offline)
    try:
        cfg = config_mod.load(args.config)
    except ConfigError as exc:
        _print_problems(args.config, exc.problems)
        return EXIT_CONFIG
    logs.setup(cfg.log.format, cfg.log.level)
    return serve(cfg)


def _schema(check: str | None) -> int:
    """``schema``: print the output schema, or tell whether ``check`` holds exactly that text."""
    from .schema import render

    text = render()
    if check is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        with open(check, encoding="utf-8") as f:
            current = f.read()
    except OSError as exc:
        print(f"{check}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    if current != text:
        print(f"{check} is out of date: run python -m bridge schema > {check}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{check}: up to date")
    return EXIT_OK


def _print_problems(path: str, problems: Sequence[str]) -> None:
    print(f"{path}: {len(problems)} problem(s)", file=sys.stderr)
    for line in problems:
        print(f"  {redact(line)}", file=sys.stderr)


def check(path: str, *, offline: bool = False, registry: Registry | None = None) -> int:
    """``--check``: parse, validate each connector's keys, then (unless offline) reach every sink."""
    problems: list[str] = []
    cfg: Config | None = None
    try:
        data = config_mod.read(path)
    except ConfigError as exc:
        _print_problems(path, exc.problems)
        return EXIT_CONFIG
    try:
        cfg = config_mod.from_data(copy.deepcopy(data))
        print(f"parse: ok ({len(cfg.sources)} source(s), {len(cfg.sinks)} sink(s))")
    except ConfigError as exc:
        problems.extend(exc.problems)
        print(f"parse: {len(exc.problems)} problem(s)")
    reg = registry or Registry()
    connectors: list[Connector] = []
    for i, type_name, options in config_mod.raw_sink_options(data):
        try:
            factory = reg.get(type_name, f"sinks[{i}].type")
            config_mod.convert_options(options, factory.Options, f"sinks[{i}]")
            if cfg is not None:
                connectors.append(reg.build(cfg.sinks[i], i))
            print(f"sinks[{i}] ({type_name}): config ok")
        except ConfigError as exc:
            problems.extend(exc.problems)
            print(f"sinks[{i}] ({type_name}): {len(exc.problems)} problem(s)")
    if not problems and not offline:
        for i, conn in enumerate(connectors):
            reason = asyncio.run(_reach(conn))
            if reason is None:
                print(f"sinks[{i}] {conn.name}: reachable")
            else:
                problems.append(f"sinks[{i}]: {reason}")
                print(f"sinks[{i}] {conn.name}: unreachable")
    if problems:
        _print_problems(path, problems)
        return EXIT_CONFIG
    print("config ok")
    return EXIT_OK


async def _reach(conn: Connector) -> str | None:
    try:
        await asyncio.wait_for(conn.connect(), 15)
        return await asyncio.wait_for(conn.health(), 15)
    except (ConnectorError, TimeoutError, OSError) as exc:
        return str(exc) or type(exc).__name__
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), 5)


def _install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def on_signal(signame: str) -> None:
        hits["n"] += 1
        if hits["n"] > 1 and signame == "SIGINT":
            print("second SIGINT: exiting now", file=sys.stderr)
            os._exit(130)
        log.info("stopping", extra={"signal": signame})
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig.name)


def _run(coro_factory: Callable[[], Coroutine[Any, Any, int]]) -> int:
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro_factory())


def tune_gc() -> None:
    """Garbage collection for a long-running service that allocates many short-lived containers.

    Every decoded event is a dict holding lists, and the sink queues hold thousands of batches:
    with the default threshold (700) young collections run hundreds of times a second and
    promote queued batches, so full collections, which walk every object (modules included),
    come often too. Objects from start-up are frozen out of collections, and a young collection
    waits until 50,000 more containers are alive than at the last one (CPython counts allocations
    minus deallocations). The hot path makes no reference cycles, so this delays no memory's
    release: a burst in flight (256 batches of ~20 containers each, rendered messages included)
    stays below it, where 10,000 collected and promoted every burst (json/event: 3 us CPU per
    batch in collections, now ~0.1).
    """
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)


def serve(cfg: Config, registry: Registry | None = None) -> int:
    """Run the bridge until SIGTERM/SIGINT; 0 on a clean stop."""

    async def go() -> int:
        stop = asyncio.Event()
        _install_signals(stop)
        tune_gc()
        return await run_bridge(cfg, stop, registry=registry)

    try:
        return _run(go)
    except ConfigError as exc:
        _print_problems("config", exc.problems)
        return EXIT_CONFIG


def _simulate(args: argparse.Namespace) -> int:
    logs.setup()
    opts = SimulatorOptions(
        endpoint=args.endpoint,
        replay_endpoint=args.replay_endpoint or None,
        profile=args.profile,
        dp_ranks=args.ranks,
        topic=args.topic,
        rate=args.rate,
        count=args.count,
        events_per_batch=args.events_per_batch,
        blocks_per_event=args.blocks_per_event,
        block_size=args.block_size,
        buffer_steps=args.buffer_steps,
        faults=Faults(args.drop_rate, args.replay_drop_rate, args.restart_every),
        seed=args.seed,
        bind=not args.connect,
        linger=args.linger,
    )

    async def go() -> int:
        stop = asyncio.Event()
        _install_signals(stop)
        async with Simulator(opts) as sim:
            log.info("simulating", extra={"endpoint": opts.endpoint, "replay": opts.replay_endpoint, "profile": opts.profile})
            runner = asyncio.create_task(sim.run())
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
            for t in (runner, waiter):
                t.cancel()
            await asyncio.gather(runner, waiter, return_exceptions=True)
            log.info("simulator stopped", extra={"published": [r.published for r in sim.ranks]})
        return EXIT_OK

    return _run(go)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _demo(args: argparse.Namespace) -> int:
    """The embedded default: a simulated 2-rank engine feeding the bridge, events on stdout."""
    logs.setup()
    pub, rep = _free_port(), _free_port()
    while rep == pub + 1 or pub == rep + 1:
        rep = _free_port()
    cfg = config_mod.from_data(
        {
            "sources": [
                {
                    "name": "demo-engine",
                    "endpoint": f"tcp://127.0.0.1:{pub}",
                    "replay_endpoint": f"tcp://127.0.0.1:{rep}",
                    "dp_ranks": 1,
                    "labels": {"model": "demo"},
                }
            ],
            "sinks": [{"type": "file", "path": "-", "format": args.format, "granularity": args.granularity}],
            "metrics": {"listen": args.metrics},
        },
        env={},
    )
    opts = SimulatorOptions(
        endpoint=f"tcp://127.0.0.1:{pub}",
        replay_endpoint=f"tcp://127.0.0.1:{rep}",
        rate=args.rate,
        events_per_batch=3,
        faults=Faults(drop_rate=0.05),
    )

    async def go() -> int:
        stop = asyncio.Event()
        _install_signals(stop)
        async with Simulator(opts) as sim:
            runner = asyncio.create_task(sim.run())
            if args.duration > 0:
                asyncio.get_running_loop().call_later(args.duration, stop.set)
            log.info("demo: simulated vLLM engine -> bridge -> stdout (Ctrl-C to stop)", extra={"metrics": args.metrics})
            try:
                return await run_bridge(cfg, stop)
            finally:
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)

    return _run(go)
