"""Command line for the test servers: ``python -m tests.infra install|start|stop|status|image``.

``start`` leaves servers running and records them in the state file, so pytest runs reuse them
(a fast edit-test loop); ``stop`` stops them and deletes their data.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from tests.infra import servers
from tests.infra.servers import InstallError, ServerError, StateFile

KINDS = tuple(servers.SERVER_KINDS)


def _kinds(names: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(names)) or list(KINDS)


def install(kinds: Sequence[str]) -> int:
    failed = 0
    for kind in kinds:
        began = time.monotonic()
        try:
            servers.SERVER_KINDS[kind].install()
            if kind == "prometheus":
                servers.promtool_binary()
        except InstallError as exc:
            print(f"FAILED {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"{kind:<11} ready ({time.monotonic() - began:.1f}s)")
    for name, version in servers.versions().items():
        print(f"  {name:<11} {version}")
    return 1 if failed else 0


def start(kinds: Sequence[str], targets: Sequence[str]) -> int:
    state = StateFile()
    recorded = state.servers()
    failed = 0
    for kind in kinds:
        running = state.running(kind)
        if running is not None:
            print(f"{kind:<11} already running  {running.address}  pid {running.pid}")
            continue
        stale = recorded.get(kind)
        if stale is not None:
            stale.remove()
        options = {"targets": list(targets)} if kind == "prometheus" else {}
        server = servers.create(kind, servers.run_dir() / kind, **options)
        server.registry = state
        began = time.monotonic()
        try:
            server.start()
        except ServerError as exc:
            print(f"FAILED {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"{kind:<11} started in {time.monotonic() - began:.1f}s  {server.address}  pid {server.pid}  log {server.log_path}")
    return 1 if failed else 0


def stop(kinds: Sequence[str], keep_data: bool) -> int:
    state = StateFile()
    for kind, server in state.servers().items():
        if kind not in kinds:
            continue
        was_running = server.is_running()
        try:
            server.stop()
            strays = server.stop_strays()
            if not keep_data:
                server.remove()
        except ServerError as exc:
            print(f"FAILED {exc}", file=sys.stderr)
            return 1
        state.forget(kind)
        note = f" (and stray pids {strays})" if strays else ""
        print(f"{kind:<11} {'stopped' if was_running else 'was not running'}{note}")
    return 0


def status() -> int:
    recorded = StateFile().servers()
    if not recorded:
        print("no servers recorded in", StateFile().path)
    for kind, server in recorded.items():
        if not server.is_running():
            print(f"{kind:<11} DOWN  (was {server.address})  log {server.log_path}")
            continue
        try:
            server.check_health(5)
            health = "healthy"
        except Exception as exc:
            health = f"UNHEALTHY ({exc!r})"
        print(f"{kind:<11} {health}  {server.address}  pid {server.pid}  log {server.log_path}")
    print("installed:")
    for name, version in servers.versions().items():
        print(f"  {name:<11} {version}")
    print(f"cache {servers.cache_dir()}  run {servers.run_dir()}")
    return 0


def build_image(mount: bool) -> int:
    from tests.infra import image

    try:
        print(image.build_and_describe(mount))
    except InstallError as exc:
        print(f"FAILED {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.infra", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("install", "install what is missing"),
        ("start", "start and leave running"),
        ("stop", "stop servers started with `start`"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument(
            "kinds", nargs="*", choices=[*KINDS, []], metavar="KIND", help=f"any of {', '.join(KINDS)} (default: all)"
        )
        if name == "start":
            cmd.add_argument(
                "--prometheus-target",
                action="append",
                default=[],
                metavar="HOST:PORT",
                help="what Prometheus scrapes (default: itself)",
            )
        if name == "stop":
            cmd.add_argument("--keep-data", action="store_true", help="keep logs and data directories")
    sub.add_parser("status", help="show recorded servers and installed versions")
    cmd = sub.add_parser("image", help="build the Dockerfile as kv-event-bridge:test (see tests/infra/image.py)")
    cmd.add_argument("--mount", action="store_true", help="also mount a working container and print its rootfs")
    args = parser.parse_args(argv)
    if args.command == "image":
        return build_image(args.mount)
    if args.command == "install":
        return install(_kinds(args.kinds))
    if args.command == "start":
        return start(_kinds(args.kinds), args.prometheus_target)
    if args.command == "stop":
        return stop(_kinds(args.kinds), args.keep_data)
    return status()
