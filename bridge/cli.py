"""The command line. Only this module chooses exit codes; everything else raises.

python -m bridge --config FILE            run the bridge
python -m bridge --config FILE --check    validate (parse, build connectors, reach sinks) -> 0, 2 or 3
python -m bridge simulate [...]           a vLLM-compatible publisher
python -m bridge tail ENDPOINT [...]      print an engine's decoded events
python -m bridge demo                     simulator + bridge + stdout sink, no broker needed
python -m bridge schema [state] [--check FILE]   print the records' (or state documents') JSON Schema, or compare FILE
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import logging
import os
import select
import signal
import socket
import stat
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from . import __version__, checkpoint, discovery, filters, logs
from . import config as config_mod
from . import tail as tail_mod
from .config import Config
from .connector import Connector, Registry, local_file_problems, template_labels, unwritable
from .endpoints import for_rank
from .errors import ConfigError, ConnectorError, NotConnected, StartupError
from .health import listen_problem
from .probe import diagnose, probed
from .records import Stream
from .runtime import run as run_bridge
from .runtime import streams_of
from .secret import redact
from .simulator import DEFAULT_PROFILE, PROFILES, Faults, Simulator, SimulatorOptions
from .source import try_bind

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143

log = logging.getLogger("bridge.cli")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bridge", description="KV-cache events from inference engines to Kafka, Redis Streams and NATS."
    )
    p.add_argument("--config", "-c", help="config file (.yaml, .yml or .toml)")
    p.add_argument(
        "--check", action="store_true", help="validate the config and exit (0 ok, 2 invalid, 3 valid but something unreachable)"
    )
    p.add_argument("--offline", action="store_true", help="with --check: contact no sink or engine, look at no path")
    p.add_argument("--version", action="version", version=f"kv-event-bridge {__version__}")
    sub = p.add_subparsers(dest="command")

    s = sub.add_parser("simulate", help="run a vLLM-compatible KV-event publisher")
    s.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="PUB endpoint of rank 0 (rank r: port + r)")
    s.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558", help="ROUTER replay endpoint of rank 0; '' for none")
    s.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES), help="engine release to imitate")
    s.add_argument("--ranks", type=_positive, default=1, help="data-parallel ranks")
    s.add_argument("--topic", default="", help="ZMQ topic")
    s.add_argument("--rate", type=_rate, default=100.0, help="batches per second per rank (0: as fast as possible)")
    s.add_argument("--count", type=_count, default=0, help="batches per rank, then stop (0: forever)")
    s.add_argument("--events-per-batch", type=_count, default=4)
    s.add_argument("--blocks-per-event", type=_count, default=2)
    s.add_argument("--block-size", type=_positive, default=16)
    s.add_argument("--buffer-steps", type=_positive, default=10_000, help="replay buffer (batches)")
    s.add_argument("--drop-rate", type=_fraction, default=0.0, help="fraction of live messages never sent (kept for replay)")
    s.add_argument(
        "--replay-drop-rate", type=_fraction, default=0.0, help="fraction of replay replies lost (never the first of an answer)"
    )
    s.add_argument("--restart-every", type=_count, default=0, help="restart the engine every N batches")
    s.add_argument("--connect", action="store_true", help="connect to the endpoint instead of binding it")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--linger", type=_rate, default=0.0, help="keep serving replay this long after the last batch")
    s.add_argument(
        "--snapshot",
        choices=["off", "vllm-57789", "vllm-50134", "sglang-34407"],
        default="off",
        help="serve engine snapshots in this design (experimental; vllm-50134 on the replay socket)",
    )
    s.add_argument("--snapshot-endpoint", default=None, help="snapshot socket of rank 0 (vllm-57789, sglang-34407)")

    t = sub.add_parser("tail", help="print decoded events of an engine")
    t.add_argument("endpoint", help="the engine's PUB endpoint of rank 0, e.g. tcp://vllm-host:5557")
    t.add_argument("--topic", default="")
    t.add_argument("--replay-endpoint", default=None, help="the engine's ROUTER replay endpoint of rank 0")
    t.add_argument("--from-seq", type=_count, default=None, help="replay from this seq first (needs --replay-endpoint)")
    t.add_argument(
        "--snapshot",
        choices=["auto", "vllm-57789", "vllm-50134", "sglang-34407"],
        default=None,
        help="first ask for an engine snapshot (experimental) and show its cut (vllm-50134: on --replay-endpoint)",
    )
    t.add_argument("--snapshot-endpoint", default=None, help="the engine's snapshot socket of rank 0 (vllm-57789, sglang-34407)")
    t.add_argument("--count", type=_count, default=0, help="stop after N batches")
    t.add_argument("--granularity", choices=["event", "batch"], default="event")
    t.add_argument("--dp-ranks", type=_positive, default=1, help="read ranks 0..n-1 (rank r at port + r)")
    t.add_argument("--bind", action="store_true", help="bind the endpoint and let the engine connect in")

    d = sub.add_parser("demo", help="simulator + bridge + stdout sink (no broker needed)")
    d.add_argument("--duration", type=_rate, default=0.0, help="stop after this many seconds (0: until Ctrl-C)")
    d.add_argument("--rate", type=_rate, default=2.0, help="batches per second per rank")
    d.add_argument("--format", choices=["json", "msgpack", "raw"], default="json")
    d.add_argument("--granularity", choices=["event", "batch"], default="event")
    d.add_argument("--metrics", default="127.0.0.1:9300", help="metrics listen address ('' to disable)")

    sc = sub.add_parser("schema", help="print the JSON Schema of the records the json format writes, or of the state documents")
    sc.add_argument(
        "which", nargs="?", choices=["records", "state"], default="records", help="records (default) or state (head and entry)"
    )
    sc.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the schema (e.g. schema/kv-events.schema.json)")
    return p


def _number(kind: type[int] | type[float], low: float, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


_positive = _number(int, 1, "a whole number of at least 1")
_count = _number(int, 0, "a whole number of at least 0")
_rate = _number(float, 0, "a number of at least 0")


def _fraction(text: str) -> float:
    value = float(_rate(text))
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, got {text}")
    return value


class _Terminated(BaseException):
    """SIGTERM before the event loop handles it (a BaseException: nothing on the way may swallow it)."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Every command; the exit code. A user sees one line per problem, never a traceback."""
    previous: Any = None
    with contextlib.suppress(ValueError):  # not the main thread (a program calling main): its own signals
        previous = signal.signal(signal.SIGTERM, _terminated)  # until the event loop takes SIGTERM over
    try:
        return _main(argv)
    except _Terminated:
        print("python -m bridge: stopped by SIGTERM during start-up", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:  # the reader of stdout went away (``... | head -1``): that is how it ends
        _quiet_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except (ConfigError, StartupError) as exc:
        for line in exc.problems if isinstance(exc, ConfigError) else [str(exc)]:
            print(f"python -m bridge: {redact(line)}", file=sys.stderr)
        return EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FAILED
    except Exception as exc:  # a bug: say what, in one line; KVB_TRACEBACK=1 shows where
        if os.environ.get("KVB_TRACEBACK"):
            raise
        print(
            f"python -m bridge: unexpected {type(exc).__name__}: {redact(str(exc))} (please report it; run with "
            "KVB_TRACEBACK=1 to see where it happened)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "tail":
        return _tail(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "schema":
        return _schema(args.which, args.check)
    if not args.config:
        parser.print_usage(sys.stderr)
        print("python -m bridge: error: --config FILE is required (or a command: simulate, tail, demo, schema)", file=sys.stderr)
        return EXIT_CONFIG
    if args.check:
        return check(args.config, offline=args.offline)
    try:
        data = config_mod.read(args.config)
        result = validate(data)
    except ConfigError as exc:
        _print_problems(args.config, exc.problems)
        return EXIT_CONFIG
    if result.problems or result.config is None:
        _print_problems(args.config, result.problems)
        return EXIT_CONFIG
    cfg = result.config
    logs.setup(cfg.log.format, cfg.log.level)
    for line in result.warnings:
        log.warning(redact(line))
    unwritable_paths = _unwritable_paths(cfg)  # fail at once, not with an error at every save
    for line in unwritable_paths:
        log.error(f"cannot start: {line}")
    if unwritable_paths:
        return EXIT_FAILED
    if any(s.type == "file" and s.options.get("path", "-") == "-" for s in cfg.sinks):
        _exit_when_stdout_closes()
    return serve(cfg)


def _bad_endpoint(command: str, *given: tuple[str, str | None]) -> bool:
    """Say (one line) the first endpoint argument of ``command`` that is not one; True if one was."""
    for flag, endpoint in given:
        problem = config_mod.endpoint_problem(endpoint) if endpoint else None
        if problem is not None:
            print(f"python -m bridge {command}: {flag}: {problem}", file=sys.stderr)
            return True
    return False


def _snapshot_socket_missing(command: str, args: argparse.Namespace) -> bool:
    """A design served on a snapshot socket of its own without --snapshot-endpoint (said on stderr)."""
    if args.snapshot in ("vllm-57789", "sglang-34407") and not args.snapshot_endpoint:
        print(
            f"python -m bridge {command}: --snapshot {args.snapshot} is served on a snapshot socket: give --snapshot-endpoint",
            file=sys.stderr,
        )
        return True
    return False


def _tail(args: argparse.Namespace) -> int:
    from .tail import tail

    if _bad_endpoint(
        "tail",
        ("endpoint", args.endpoint),
        ("--replay-endpoint", args.replay_endpoint),
        ("--snapshot-endpoint", args.snapshot_endpoint),
    ):
        return EXIT_CONFIG
    if _snapshot_socket_missing("tail", args):
        return EXIT_CONFIG
    if args.snapshot is not None and not (args.snapshot_endpoint or args.replay_endpoint):
        print("python -m bridge tail: --snapshot needs --snapshot-endpoint, or --replay-endpoint (vLLM #50134)", file=sys.stderr)
        return EXIT_CONFIG
    if args.from_seq is not None and not args.replay_endpoint:
        print(
            "python -m bridge tail: --from-seq needs --replay-endpoint (the engine's ROUTER replay socket, "
            "e.g. tcp://vllm-host:5558)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    logs.setup()
    _exit_when_stdout_closes()

    async def go() -> int:
        stop = asyncio.Event()
        _install_signals(stop)
        task = asyncio.ensure_future(
            tail(
                args.endpoint,
                topic=args.topic,
                replay_endpoint=args.replay_endpoint,
                from_seq=args.from_seq,
                count=args.count,
                granularity=args.granularity,
                dp_ranks=args.dp_ranks,
                bind=args.bind,
                snapshot=args.snapshot,
                snapshot_endpoint=args.snapshot_endpoint,
            )
        )
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return EXIT_OK

    return _run(go)


def _schema(which: str, check: str | None) -> int:
    """``schema``: print the records' or state documents' schema, or tell whether ``check`` holds exactly that text."""
    from .schema import render

    text = render(which)
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
        command = "python -m bridge schema" + ("" if which == "records" else f" {which}")
        print(f"{check} is out of date: run {command} > {check}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{check}: up to date")
    return EXIT_OK


def _print_problems(path: str, problems: Sequence[str], lead: str = "") -> None:
    print(f"{path}: {lead + ' ' if lead else ''}{len(problems)} problem(s)", file=sys.stderr)
    for line in problems:
        print(f"  {redact(line)}", file=sys.stderr)


@dataclass
class Validation:
    """What :func:`validate` found: the problems (each once), the warnings, and what it built."""

    config: Config | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    connectors: list[tuple[int, Connector]] = field(default_factory=list)

    def of_sink(self, index: int, name: str) -> list[str]:
        return [p for p in self.problems if p.startswith((f"sinks[{index}]", f"sinks[{name}]"))]


def validate(data: Any, registry: Registry | None = None, env: Mapping[str, str] | None = None) -> Validation:
    """The whole offline validation of parsed config ``data``: the config, then each sink's own keys
    and connector (built, no I/O), each sink's even while other parts are wrong. ``--check`` and the
    start of a run both use it, so what ``--check --offline`` accepts starts."""
    problems: list[str] = []
    cfg: Config | None = None
    try:
        cfg = config_mod.from_data(copy.deepcopy(data), env)
    except ConfigError as exc:
        problems.extend(exc.problems)
    reg = registry or Registry()
    result = Validation(cfg)
    labels = config_mod.label_names(data)
    for i, type_name, options in config_mod.raw_sink_options(data, env):
        try:
            factory = reg.get(type_name, f"sinks[{i}].type")
            result.warnings.extend(config_mod.plain_secrets(_unsubstituted(data, i), factory.Options, f"sinks[{i}]"))
            sink = cfg.sinks[i] if cfg is not None else config_mod.sink_config(data, i, env)
            if sink is not None:
                conn = reg.build(sink, i, labels)
                if cfg is not None:
                    result.connectors.append((i, conn))
            else:
                with template_labels(labels):
                    converted = config_mod.convert_options(options, factory.Options, f"sinks[{i}]")
                problems.extend(local_file_problems(converted, f"sinks[{i}]"))
        except ConfigError as exc:
            problems.extend(exc.problems)
        except Exception as exc:  # a plugin's constructor must not end validation with a traceback
            problems.append(f"sinks[{i}]: connector {type_name!r} failed to build: {type(exc).__name__}: {exc}")
    result.warnings.extend(config_mod.plain_secrets(data, config_mod.Config, ""))
    if cfg is not None:
        streams = [s for source in cfg.sources for s in streams_of(source)]
        problems.extend(_shared_destinations(streams, result.connectors))
        for i, conn in result.connectors:
            conflicts = getattr(conn, "conflicts", None)
            problems.extend(f"sinks[{i}] ({conn.name}): {line}" for line in (conflicts(streams) if conflicts else []))
        problems.extend(_shared_places(result.connectors, streams))
        for i, sink in enumerate(cfg.sinks):
            result.warnings.extend(filters.misspelt_fields(sink.fields, f"sinks[{i}]"))
    result.problems = list(dict.fromkeys(problems))  # a problem found two ways is told once
    result.warnings = list(dict.fromkeys(result.warnings))
    return result


def _shared_destinations(streams: Sequence[Stream], connectors: Sequence[tuple[int, Connector]]) -> list[str]:
    """Two configured ``streams`` that a sink would write to one destination meant for one stream
    each (a connector's ``destination()``, see :mod:`bridge.connector`): one line per stream refused."""
    lines = []
    for i, conn in connectors:
        destination = getattr(conn, "destination", None)
        if destination is None:
            continue
        owners: dict[str, str] = {}
        for stream in streams:
            where = destination(stream)
            owner = owners.setdefault(where, stream.key) if where is not None else stream.key
            if owner != stream.key:
                lines.append(
                    f"sinks[{i}] ({conn.name}): streams {owner!r} and {stream.key!r} would both be written to {where!r}, "
                    "which is meant for one stream: their source names differ only in characters the sink turns into "
                    "the same one; rename one of the two sources"
                )
    return lines


def _shared_places(connectors: Sequence[tuple[int, Connector]], streams: Sequence[Stream]) -> list[str]:
    """Two sinks that would write one place on one server (a connector's ``places()`` for the
    configured ``streams``, see :mod:`bridge.connector`): their messages would mix there, one
    sink's taken for copies of the other's. One line per pair of sinks, naming the first place
    they share."""
    lines = []
    seen: list[tuple[int, str, dict[str, frozenset[str]]]] = []  # per sink: each place -> its servers
    for i, conn in connectors:
        places = getattr(conn, "places", None)
        if places is None:
            continue
        mine = places(streams)
        for j, other, theirs in seen:
            pairs = ((place, servers & theirs.get(place, frozenset())) for servers, place in mine)
            shared = next(((place, min(common)) for place, common in pairs if common), None)
            if shared is not None:
                lines.append(
                    f"sinks[{i}] ({conn.name}): writes {shared[0]} on {shared[1]}, as sinks[{j}] ({other}) does: two sinks in "
                    "one place mix their messages, and the broker takes one sink's for copies of the other's; give each "
                    "sink its own, or keep one of the two"
                )
        held: dict[str, frozenset[str]] = {}
        for servers, place in mine:
            held[place] = held.get(place, frozenset()) | servers
        seen.append((i, conn.name, held))
    return lines


def _unsubstituted(data: Any, index: int) -> dict[str, Any]:
    """The connector keys of sink ``index`` as written (``${VAR}`` not replaced yet)."""
    raw = data["sinks"][index]
    return {k: v for k, v in raw.items() if k not in config_mod.SINK_KEYS}


def check(path: str, *, offline: bool = False, registry: Registry | None = None) -> int:
    """``--check``: parse, validate each connector's keys, then (unless offline) reach every sink and
    look at the checkpoint and dead-letter directories. Writes nothing. 0 ok, 2 invalid, 3 valid but
    something unreachable or unwritable."""
    try:
        data = config_mod.read(path)
    except ConfigError as exc:
        _print_problems(path, exc.problems)
        return EXIT_CONFIG
    with _quiet_logs():
        result = validate(data, registry)
    cfg = result.config
    sinks = config_mod.raw_sink_options(data)
    names = {i: cfg.sinks[i].name if cfg is not None else str(data["sinks"][i].get("name") or t) for i, t, _ in sinks}
    if cfg is not None:
        print(f"parse: ok ({len(cfg.sources)} source(s), {len(cfg.sinks)} sink(s))")
    else:
        own = sum(len(result.of_sink(i, name)) for i, name in names.items())
        print(f"parse: {len(result.problems) - own} problem(s)")
    for i, name in names.items():
        found = result.of_sink(i, name)
        print(f"sinks[{i}] ({name}): {f'{len(found)} problem(s)' if found else 'config ok'}")
    for line in result.warnings:
        print(f"warning: {redact(line)}", file=sys.stderr)
    if result.problems or cfg is None:
        _print_problems(path, result.problems)
        return EXIT_CONFIG
    if offline:
        print("config ok (offline: sinks not contacted)")
        return EXIT_OK
    unreachable = _unwritable_paths(cfg)
    if cfg.checkpoint.path:
        try:
            checkpoint.load(cfg.checkpoint.path)
        except checkpoint.CheckpointError as exc:
            print(f"warning: checkpoint.path: {exc} (the bridge would start every stream afresh)", file=sys.stderr)
    # The addresses the bridge listens on. One another process holds now may be this bridge's
    # own, running with this config (--check in its pod): a warning, not a failure.
    taken = [listen_problem(cfg.metrics.listen)] if cfg.metrics.listen else []
    for i, source in enumerate(cfg.sources):
        if source.bind:
            taken += (try_bind(f"sources[{i}].endpoint", for_rank(source.endpoint, r)) for r in range(source.dp_ranks))
    for problem, in_use in filter(None, taken):
        if in_use:
            print(f"warning: {problem} (nothing to fix if it is this bridge, running with this config)", file=sys.stderr)
        else:
            unreachable.append(problem)
    probed, answering, wrong, shapes = asyncio.run(_probe_engines(cfg))
    if probed or wrong:
        print(f"engines: {answering} of {probed} endpoint(s) answer as they should")
    for line, fix in shapes:
        print(f"engines: {line}")
        if isinstance(fix, tail_mod.Caution):  # (it cannot tell a problem from an engine's habits)
            print(f"warning: {fix}", file=sys.stderr)
        elif fix is not None:
            wrong.append(f"{line}: {fix}")
    unreachable.extend(wrong)
    with _quiet_clients():
        for i, conn in result.connectors:
            reason, reached = asyncio.run(_reach(conn, [s for source in cfg.sources for s in streams_of(source)]))
            verdict = "reachable" if reason is None else "reachable, not usable as configured" if reached else "unreachable"
            print(f"sinks[{i}] ({conn.name}): {verdict}")
            if reason is not None:
                line = reason if reason.startswith("sinks[") else f"sinks[{i}] ({conn.name}): {reason}"
                hint = "" if reached else " (is the server up and reachable from here? --offline skips this step)"
                unreachable.append(line + hint)
    if unreachable:
        _print_problems(path, unreachable, "valid, but")
        return EXIT_UNREACHABLE
    print("config ok")
    return EXIT_OK


def _unwritable_paths(cfg: Config) -> list[str]:
    """The bridge's own files (checkpoint, dead letters) that could not be written, one line each."""
    lines = []
    for key, target in (("checkpoint.path", cfg.checkpoint.path), ("dead_letter.path", cfg.dead_letter.path)):
        problem = unwritable(target, replaced=key == "checkpoint.path") if target and target != "-" else None
        if problem is not None:
            lines.append(f"{key}: {problem}")
    return lines


PROBE_TIMEOUT = 3.0
SHAPE_TIMEOUT = 1.5
"""How long ``--check`` listens on a live endpoint for a first message to show its wire shape."""
PROBE_MAX = 32
"""Discovered engines probed by ``--check``, at most (the first addresses in sorted order)."""


async def _probe_engines(cfg: Config) -> tuple[int, int, list[str], list[tuple[str, str | None]]]:
    """``--check``: ask every engine endpoint the bridge connects to which ZMQ socket answers (ZMTP
    greeting; nothing subscribed or requested), DNS discovery's engines included: how many were
    asked, how many answered as they should, one line per problem; then, for each configured
    source's live endpoints that answered, what its first message shows of the wire (publisher
    UUID or none, producer shape; see ``tail.wire_shape``), one line each, with the problem when it
    could not be decoded, or the caution when only other topics than the source's arrived."""
    from .tail import wire_shape

    checks: list[tuple[str, str, int, Coroutine[Any, Any, tuple[str, str] | None]]] = []
    lines: list[str] = []
    targets = [(f"sources[{i}]", source) for i, source in enumerate(cfg.sources)]
    dns = cfg.discovery.dns
    if dns is not None:
        resolver = discovery.UdpResolver(dns.resolver) if dns.resolver else discovery.SystemResolver()
        try:
            async with asyncio.timeout(dns.timeout):
                addresses = await resolver.resolve(dns.name)
        except (discovery.ResolveError, TimeoutError) as exc:
            detail = exc.detail if isinstance(exc, discovery.ResolveError) else f"no answer in {dns.timeout:g}s"
            lines.append(
                f"discovery.dns.name: {dns.name} finds no engine ({detail}); check the Service name and namespace "
                "(a headless Service with no ready pods does not resolve either)"
            )
            addresses = frozenset()
        prefix = dns.name_prefix or discovery.default_prefix(dns.name)
        targets += [(f"discovery.dns ({a})", discovery.source_for(dns, a, prefix)) for a in sorted(addresses)[:PROBE_MAX]]
    for where_from, source in targets:
        for key in ("endpoint", "replay_endpoint", "snapshot_endpoint"):
            endpoint = getattr(source, key, None)  # (discovered sources have no snapshot_endpoint)
            if endpoint is None or (key == "endpoint" and source.bind):
                continue  # (the bridge's own address: see check)
            for rank in range(source.dp_ranks):
                ep = for_rank(endpoint, rank)
                if not probed(ep):
                    continue
                role = {"endpoint": "live", "replay_endpoint": "replay"}.get(key, "snapshot")
                checks.append((f"{where_from}.{key}", ep, rank, diagnose(ep, role, PROBE_TIMEOUT)))
    found = await asyncio.gather(*(c[3] for c in checks))
    listen = []
    for (path, ep, rank, _), got in zip(checks, found, strict=True):
        where = f"{path}: {ep}" + (f" (rank {rank})" if rank else "")
        if got is not None:
            lines.append(f"{where}: {got[0]}")
        elif path.endswith(".endpoint") and path.startswith("sources["):
            source = cfg.sources[int(path[len("sources[") : path.index("]")])]
            replay = for_rank(source.replay_endpoint, rank) if source.replay_endpoint else None
            listen.append((where, wire_shape(ep, source.topic, SHAPE_TIMEOUT, cfg.ingest.max_frame_bytes, replay)))
    shapes = await asyncio.gather(*(c for _, c in listen))
    shown = [(f"{w}: {s}", problem) for (w, _), (s, problem) in zip(listen, shapes, strict=True)]
    shown += [
        (
            f"sources[{i}].replay_endpoint: {source.replay_endpoint}: not checked (bind: true: the engine connects "
            "to the bridge, not to --check, so there is no live batch to compare its answers with)",
            None,
        )
        for i, source in enumerate(cfg.sources)
        if source.bind and source.replay_endpoint is not None
    ]
    return len(checks), sum(got is None for got in found), lines, shown


CLIENT_LOGGERS = ("aiokafka", "kafka", "nats", "redis", "asyncio")
"""Loggers of the client libraries, silenced while ``--check`` reaches the sinks."""


@contextlib.contextmanager
def _quiet_clients() -> Iterator[None]:
    """While ``--check`` reaches the sinks: the client libraries' log lines would interleave with
    its report, but a connector's own warnings (a server that may lose what the bridge builds on,
    I6) are part of it."""
    loggers = [logging.getLogger(name) for name in CLIENT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """``--check`` speaks for itself: client libraries' log lines would interleave with its report."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


async def _reach(conn: Connector, streams: Sequence[Stream]) -> tuple[str | None, bool]:
    """Why ``conn`` cannot be used, or None; and whether its server answered (a refusal of what
    it found there: a replica, a missing permission, a bucket's settings) rather than not at all.
    Changes nothing (a connector's ``probe`` when it has one). ``streams``: the configured ones,
    for a connector that checks what it needs for each."""
    probe = getattr(conn, "probe", None)
    try:
        if probe is not None:
            async with asyncio.timeout(15):
                return cast("str | None", await probe()), True
        if hasattr(conn, "creates_nothing"):
            conn.creates_nothing = True
        for known in ("configured_streams", "known_streams"):
            if hasattr(conn, known):
                setattr(conn, known, list(streams))
        async with asyncio.timeout(15):
            await conn.connect()
        async with asyncio.timeout(15):
            return await conn.health(), True
    except ConnectorError as exc:
        return str(exc) or type(exc).__name__, exc.reason != NotConnected.reason
    except (TimeoutError, OSError) as exc:
        return str(exc) or type(exc).__name__, False
    finally:
        if probe is None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await conn.close()


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
    except StartupError as exc:
        log.error(redact(str(exc)))
        return EXIT_FAILED


def _exit_when_stdout_closes() -> None:
    """End the process (exit 0) once the reader of a stdout pipe goes away (``... | head -1``).

    Nothing written later could reach anyone: waiting for the sinks' queues to drain into a closed
    pipe would only hold the process until the shutdown timeout. A pipe's write end reports POLLERR
    when its reader closes, whatever events are asked for, so a thread waits for that alone; a
    terminal or a file never reports it."""
    try:
        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            return
    except (OSError, ValueError, AttributeError):
        return
    fd = sys.stdout.fileno()

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)
        while True:
            if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll()):
                _quiet_stdout()
                os._exit(EXIT_OK)

    threading.Thread(target=watch, name="stdout-watch", daemon=True).start()


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail on a closed pipe."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _simulate(args: argparse.Namespace) -> int:
    if _bad_endpoint(
        "simulate",
        ("--endpoint", args.endpoint),
        ("--replay-endpoint", args.replay_endpoint),
        ("--snapshot-endpoint", args.snapshot_endpoint),
    ):
        return EXIT_CONFIG
    if _snapshot_socket_missing("simulate", args):
        return EXIT_CONFIG
    if args.snapshot == "vllm-50134" and not args.replay_endpoint:
        print(
            "python -m bridge simulate: --snapshot vllm-50134 is served on the replay socket: give --replay-endpoint",
            file=sys.stderr,
        )
        return EXIT_CONFIG
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
        snapshot=args.snapshot,
        snapshot_endpoint=args.snapshot_endpoint,
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
    problem = config_mod.listen_problem(args.metrics)
    if problem is not None:
        print(f"python -m bridge demo: --metrics: {problem}", file=sys.stderr)
        return EXIT_CONFIG
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

    _exit_when_stdout_closes()

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
            except StartupError as exc:  # the demo's metrics address is its --metrics flag
                raise StartupError(str(exc).replace("in metrics.listen", "with --metrics")) from None
            finally:
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)

    return _run(go)
