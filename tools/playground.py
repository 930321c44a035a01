"""The broker playground: simulated engines -> the bridge (state on) -> a real local broker -> the example consumer.

    make playground                    # Kafka
    make playground BROKER=redis       # or nats
    python -m tools.playground --broker redis --seconds 60

One command between ``make demo`` (no broker) and a cluster. It starts, in this order:

1. the broker, as the test servers are started (tests/infra: installed on first use, own ports
   on 127.0.0.1, data in a temporary directory removed at the end);
2. the bridge (``python -m bridge --config``) with one sink on that broker, ``format: json``,
   ``state.enabled``, and ``/metrics`` on a free port;
3. two simulated vLLM engines (``python -m bridge simulate``): ``llama-a`` with 2 data-parallel
   ranks that restarts every ``--restart-every`` batches, drops a live message now and then and
   loses some replay replies too (a gap the bridge cannot repair shows as EventsLost: the
   consumer marks the stream incomplete until the engine restarts); ``llama-b`` drops 5% of its
   live messages, which the bridge repairs from the replay socket;
4. the example consumer of that broker (examples/consumers/), with ``--bootstrap``: it prints
   its index (blocks per engine stream, complete or not) whenever it changed.

Ctrl-C (or SIGTERM) stops everything in order: the engines, the bridge (it drains what it holds),
the consumer (it prints its index a last time), the broker. A second Ctrl-C kills what is left.
The consumer's lines go to stdout; the playground's own lines, and where the logs are, to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.infra import servers
from tests.infra.servers import ManagedServer, ServerError
from tests.support.harness import free_ports
from tests.support.process import BridgeProcess, bridge_config

ROOT = Path(__file__).resolve().parents[1]
CONSUMERS = ROOT / "examples" / "consumers"
BROKERS = ("kafka", "redis", "nats")


def say(text: str) -> None:
    print(f"playground: {text}", file=sys.stderr, flush=True)


def wiring(broker: str, server: Any) -> tuple[dict[str, Any], list[str]]:
    """The bridge's sink on ``server`` and the example consumer's command line that reads it."""
    common = {"name": "playground", "format": "json", "granularity": "batch"}
    if broker == "kafka":
        servers_ = server.bootstrap_servers
        sink = {
            "type": "kafka",
            "bootstrap_servers": servers_,
            "topic": "kv-events",
            "create_topics": {"enabled": True, "partitions": 2},
            "state": {"enabled": True, "topic": "kv-state", "create": True, "partitions": 2},
        }
        consumer = ["consume_kafka.py", "--bootstrap-servers", servers_, "--topic", "kv-events", "--bootstrap", "kv-state"]
    elif broker == "redis":
        sink = {"type": "redis", "url": server.url, "stream": "kv:{source}:{dp_rank}", "state": {"enabled": True}}
        consumer = ["consume_redis.py", "--url", server.url, "--match", "kv:*", "--bootstrap", ":state"]
    else:
        sink = {
            "type": "nats",
            "servers": server.url,
            "subject": "kv.{source}.{dp_rank}",
            "mode": "jetstream",
            "stream": {"create": True, "name": "KV_EVENTS"},
            "state": {"enabled": True, "bucket": "KV_STATE", "create": True},
        }
        consumer = ["consume_nats.py", "--servers", server.url, "--subject", "kv.>", "--bootstrap", "KV_STATE"]
    return {**sink, **common}, [sys.executable, str(CONSUMERS / consumer[0]), *consumer[1:]]


def engines(args: argparse.Namespace) -> list[tuple[dict[str, Any], list[str]]]:
    """Each simulated engine: its source in the bridge's config, and its ``simulate`` options."""
    out = []
    for name, ranks, faults in [
        ("llama-a", 2, ["--restart-every", str(args.restart_every), "--drop-rate", "0.02", "--replay-drop-rate", "0.3"]),
        ("llama-b", 1, ["--drop-rate", "0.05"]),
    ]:
        pub, rep = free_ports(ranks), free_ports(ranks)
        source = {
            "name": name,
            "endpoint": f"tcp://127.0.0.1:{pub[0]}",
            "replay_endpoint": f"tcp://127.0.0.1:{rep[0]}",
            "dp_ranks": ranks,
        }
        options = [
            "--endpoint", source["endpoint"], "--replay-endpoint", source["replay_endpoint"],
            "--ranks", str(ranks), "--rate", str(args.rate), "--count", str(args.batches),
            "--seed", str(len(out) + 1), "--linger", "3600", *faults,
        ]  # fmt: skip
        out.append((source, options))
    return out


class Playground:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.server: ManagedServer | None = None
        self.bridge: BridgeProcess | None = None
        self.engines: dict[str, subprocess.Popen[bytes]] = {}
        self.consumer: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        args = self.args
        say(f"starting {args.broker} (tests/infra) in {self.workdir}")
        server = self.server = servers.create(args.broker, self.workdir / args.broker)
        await asyncio.to_thread(server.start)
        say(f"{args.broker} at {server.address}")
        sink, consumer = wiring(args.broker, server)
        running = engines(args)
        config = bridge_config(self.workdir, [source for source, _ in running], [sink], shutdown_timeout="10s")
        self.bridge = BridgeProcess(self.workdir, config).start(new_session=True)
        say(f"bridge: config {self.bridge.config_path}, log {self.bridge.log_path}")
        await self.bridge.wait_ready(60)
        say(f"bridge ready: http://127.0.0.1:{self.bridge.metrics_port}/metrics")
        for (source, options), seed in zip(running, range(len(running)), strict=True):
            log = self.workdir / f"{source['name']}.log"
            self.engines[source["name"]] = spawn([sys.executable, "-m", "bridge", "simulate", *options], log)
            say(f"engine {source['name']} (seed {seed + 1}): {' '.join(options)}")
        await self.bridge.wait_metric("kv_bridge_sink_events_total", 1, timeout=60, sink="playground")
        command = [*consumer, "--every", str(args.every), *(["--json"] if args.json else [])]
        say(f"consumer: {' '.join(command[1:])}")
        self.consumer = spawn(command, None)

    def alive(self) -> str | None:
        """What has stopped on its own (None: everything runs)."""
        procs = {**self.engines, "the consumer": self.consumer}
        for name, proc in procs.items():
            if proc is not None and proc.poll() is not None:
                return f"{name} exited with {proc.returncode} (logs in {self.workdir})"
        if self.bridge is not None and not self.bridge.alive():
            return f"the bridge exited (log {self.bridge.log_path})"
        return None

    async def stop(self) -> None:
        """The engines, the bridge (draining), the consumer (its last index), the broker."""
        for proc in self.engines.values():
            await _stop(proc, signal.SIGINT, 10)
        if self.bridge is not None and self.bridge.alive():
            code = await self.bridge.terminate(30)
            say(f"bridge stopped ({code})")
        if self.consumer is not None:
            await _stop(self.consumer, signal.SIGINT, 15)
        if self.server is not None:
            with contextlib.suppress(ServerError):
                await asyncio.to_thread(self.server.stop)
            say(f"{self.args.broker} stopped")

    def kill(self) -> None:
        for proc in [*self.engines.values(), self.consumer]:
            if proc is not None and proc.poll() is None:
                proc.kill()
        if self.bridge is not None:
            self.bridge.kill()
        if self.server is not None:
            with contextlib.suppress(ServerError):
                self.server.kill()


def spawn(command: list[str], log: Path | None) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session (a terminal's Ctrl-C reaches only the playground, which
    stops everything in order), its output to ``log``, or to the playground's own when None."""
    with contextlib.ExitStack() as files:
        out = files.enter_context(log.open("ab")) if log is not None else None
        errors = subprocess.STDOUT if out is not None else None
        return subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=errors, start_new_session=True)


async def _stop(proc: subprocess.Popen[bytes], sig: signal.Signals, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return
        await asyncio.sleep(0.05)


async def main(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvb-playground-"))
    playground = Playground(args, workdir)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stopping.is_set():  # the second one
            say("killing what is left")
            playground.kill()
            raise SystemExit(130)
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    code = 0
    try:
        starting = asyncio.create_task(playground.start())
        waiter = asyncio.create_task(stopping.wait())
        await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()
            say("running: Ctrl-C stops everything" + (f" (or {args.seconds:g}s)" if args.seconds else ""))
            end = time.monotonic() + args.seconds if args.seconds else float("inf")
            while not stopping.is_set() and time.monotonic() < end:
                problem = playground.alive()
                if problem is not None:
                    say(f"stopping: {problem}")
                    code = 1
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 0.5)
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
        waiter.cancel()
    except (ServerError, AssertionError, OSError) as exc:
        say(f"could not start: {exc}")
        code = 1
    finally:
        say("stopping")
        await playground.stop()
        if args.keep:
            say(f"logs and data kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.playground", description=__doc__.splitlines()[0])
    p.add_argument("--broker", choices=BROKERS, default="kafka", help="the broker to start (default kafka)")
    p.add_argument("--rate", type=float, default=5.0, help="batches per second per engine rank")
    p.add_argument("--batches", type=int, default=0, help="batches per rank, then the engines idle (0: forever)")
    p.add_argument("--restart-every", type=int, default=150, help="llama-a restarts every N batches")
    p.add_argument("--every", type=float, default=2.0, help="the consumer prints its index this often, when it changed")
    p.add_argument("--json", action="store_true", help="the consumer prints its whole index as JSON lines")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: until Ctrl-C)")
    p.add_argument("--keep", action="store_true", help="keep the logs and the broker's data")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
