"""The bridge as a user runs it: ``python -m bridge`` processes, signals, crash and resume."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bridge.simulator import Faults, Simulator, SimulatorOptions
from tests.support.epochs import assert_first_epoch
from tests.support.harness import free_ports, read_lines, wait_for
from tests.support.schema import check_line

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp: Path, ports: list[int], out: Path, extra: str = "") -> Path:
    p = tmp / "bridge.yaml"
    p.write_text(
        f"""
sources:
  - name: engine
    endpoint: tcp://127.0.0.1:{ports[0]}
    replay_endpoint: tcp://127.0.0.1:{ports[1]}
checkpoint: {{path: {tmp}/checkpoint.json, interval: 200ms}}
sinks:
  - type: file
    path: ${{OUT}}
    format: json
    granularity: batch
metrics: {{listen: "127.0.0.1:0"}}
{extra}
"""
    )
    return p


def _start(cfg: Path, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUT": str(out), "PYTHONUNBUFFERED": "1"}
    with open(out.with_suffix(".log"), "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "bridge", "--config", str(cfg)], cwd=ROOT, env=env, stderr=log)


async def _exit_code(proc: subprocess.Popen[bytes], timeout: float) -> int:
    for _ in range(int(timeout * 20)):
        if proc.poll() is not None:
            return proc.returncode
        await asyncio.sleep(0.05)
    proc.kill()
    proc.wait(10)
    raise AssertionError("the bridge did not exit in time")


def _batch_seqs(lines: list[dict[str, Any]]) -> list[int]:
    return [ln["seq"] for ln in lines if "events" in ln]


async def test_sigterm_flushes_checkpoints_and_exits_0(tmp_path: Path) -> None:
    ports = free_ports(2)
    out = tmp_path / "out.jsonl"
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}", rate=200)
    since = time.time()
    async with Simulator(opts) as sim:
        proc = _start(_config(tmp_path, ports, out), out)
        try:
            runner = asyncio.create_task(sim.run())
            await wait_for(lambda: len(read_lines(out)) >= 200, what="output")
            proc.send_signal(signal.SIGTERM)
            assert await _exit_code(proc, 20) == 0
            runner.cancel()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    seqs = _batch_seqs(read_lines(out))
    assert seqs == list(range(len(seqs)))
    epoch = assert_first_epoch(read_lines(out)[0]["epoch"], since)  # the clock's: no checkpoint before
    assert all(ln["epoch"] == epoch for ln in read_lines(out))
    ck = json.loads((tmp_path / "checkpoint.json").read_text())
    assert ck["streams"]["engine/0"]["seq"] == seqs[-1] and ck["streams"]["engine/0"]["epoch"] == epoch
    assert ck["epochs"] == {"engine/0": epoch}


async def test_sigkill_then_resume_loses_nothing_the_engine_buffered(tmp_path: Path) -> None:
    ports = free_ports(2)
    out1, out2 = tmp_path / "run1.jsonl", tmp_path / "run2.jsonl"
    cfg = _config(tmp_path, ports, out1)
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}", rate=300)
    async with Simulator(opts) as sim:
        runner = asyncio.create_task(sim.run())
        proc = _start(cfg, out1)
        try:
            await wait_for(lambda: len(read_lines(out1)) >= 300, what="first run output")
            await asyncio.sleep(0.5)  # let a checkpoint land mid-stream
            proc.send_signal(signal.SIGKILL)
            await _exit_code(proc, 10)
            await asyncio.sleep(1.0)  # the engine goes on publishing while the bridge is down
            proc = _start(cfg, out2)
            await wait_for(lambda: len(read_lines(out2)) >= 300, timeout=30, what="second run output")
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            last = sim.ranks[0].seq - 1
            await wait_for(lambda: (_batch_seqs(read_lines(out2)) or [-1])[-1] == last, what="catch-up")
            proc.send_signal(signal.SIGTERM)
            assert await _exit_code(proc, 20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)  # reaped, or a later test's collection reports it still running
    run1, run2 = _batch_seqs(read_lines(out1)), _batch_seqs(read_lines(out2))
    assert run1 == list(range(len(run1)))  # in order within each run
    assert run2 == list(range(run2[0], run2[0] + len(run2)))
    assert run2[0] <= run1[-1] + 1  # resumed at or before where the first run stopped: no hole
    assert set(run1) | set(run2) == set(range(last + 1))  # every seq at least once
    assert not [ln for ln in read_lines(out2) if ln.get("type") in ("EventsLost", "SourceReset")]


def test_demo_shows_events_flowing() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bridge", "demo", "--duration", "3", "--rate", "10", "--metrics", ""],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    lines = [check_line(x) for x in proc.stdout.decode().splitlines()]
    assert len(lines) >= 20
    assert {"source", "dp_rank", "epoch", "seq", "index", "ts", "schema_version", "type"} <= set(lines[0])


async def test_simulate_and_tail_commands(tmp_path: Path) -> None:
    ports = free_ports(2)
    sim = subprocess.Popen(
        [sys.executable, "-m", "bridge", "simulate", "--endpoint", f"tcp://127.0.0.1:{ports[0]}",
         "--replay-endpoint", f"tcp://127.0.0.1:{ports[1]}", "--rate", "50", "--profile", "vllm-0.22.0"],
        cwd=ROOT, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await asyncio.sleep(1.0)
        tail = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bridge", "tail", f"tcp://127.0.0.1:{ports[0]}",
            "--replay-endpoint", f"tcp://127.0.0.1:{ports[1]}", "--from-seq", "0", "--count", "5", "--granularity", "batch",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        stdout, _ = await asyncio.wait_for(tail.communicate(), 30)
        lines = [check_line(x) for x in stdout.decode().splitlines()]
        assert [ln["seq"] for ln in lines] == [0, 1, 2, 3, 4]
        assert all(ln["events"] and "block_hashes" in ln["events"][0] for ln in lines)
    finally:
        sim.send_signal(signal.SIGTERM)
        assert sim.wait(10) == 0


def _first_line_then_close(args: list[str], bound: float) -> tuple[int, bytes, str]:
    """Run ``python -m bridge ARGS | head -1``: read one line, close the pipe, wait for the exit."""
    proc = subprocess.Popen([sys.executable, "-m", "bridge", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        proc.stdout.close()
        code = proc.wait(bound)
        return code, line, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_demo_piped_into_head_exits_0_without_draining_into_the_closed_pipe() -> None:
    # The bound is below the 20 s shutdown timeout, which is what waiting on a closed pipe used to cost.
    code, line, err = _first_line_then_close(["demo", "--metrics", "", "--rate", "20"], bound=15)
    assert json.loads(line)["source"] == "demo-engine"
    assert code == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


async def test_tail_piped_into_head_exits_0_and_says_where_it_waits(tmp_path: Path) -> None:
    ports = free_ports(2)
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=None, rate=50, dp_ranks=2)
    async with Simulator(opts) as sim:
        runner = asyncio.create_task(sim.run())
        try:
            args = ["tail", f"tcp://127.0.0.1:{ports[0]}", "--dp-ranks", "2", "--granularity", "batch"]
            code, line, err = await asyncio.to_thread(_first_line_then_close, args, 15)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    assert json.loads(line)["dp_rank"] in (0, 1)
    assert code == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
    assert f"# connecting to tcp://127.0.0.1:{ports[0]}, tcp://127.0.0.1:{ports[0] + 1} (topic ''); waiting for events" in err


async def test_tail_says_the_topics_an_engine_publishes_under_instead_of_calling_it_idle() -> None:
    """breaker46 B2 (tail's side): with a --topic the engine does not publish under, tail subscribed
    to it alone and said only "the engine may be idle". It names the topics seen now (once each)
    and prints none of their messages (its idle notice says them too, with the --topic to give)."""
    live = free_ports(1)[0]
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{live}", replay_endpoint=None, topic="kv-events", rate=20)
    said = "# rank 0: a message under topic 'kv-events', not under 'vllm-kv': skipped (is --topic the engine's?)"
    lines: list[str] = []
    async with Simulator(opts) as sim:
        runner = asyncio.create_task(sim.run())
        tail = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bridge", "tail", f"tcp://127.0.0.1:{live}", "--topic", "vllm-kv",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # (SIGABRT: its threads' stacks, should it hang)
        )  # fmt: skip
        try:
            assert tail.stderr is not None and tail.stdout is not None
            async with asyncio.timeout(60):
                while said not in lines:
                    line = await tail.stderr.readline()
                    assert line, "\n".join(lines)
                    lines.append(line.decode().rstrip("\n"))
            await asyncio.sleep(1.0)  # 20 more messages of that topic: said once
            tail.send_signal(signal.SIGTERM)
            try:
                stdout, stderr = await asyncio.wait_for(tail.communicate(), 30)
            except TimeoutError:
                tail.send_signal(signal.SIGABRT)
                stdout, stderr = await asyncio.wait_for(tail.communicate(), 10)
                pytest.fail(f"tail did not stop in 30 s after SIGTERM; where it was:\n{stderr.decode()[-6000:]}")
        finally:
            if tail.returncode is None:
                tail.kill()
                await tail.wait()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    err = "\n".join(lines) + "\n" + stderr.decode()
    assert tail.returncode == 0 and "Traceback" not in err, err
    assert stdout == b"", stdout[:200]
    assert [ln for ln in err.splitlines() if "a message under topic" in ln] == [said], err


async def test_tail_marks_the_gaps_it_sees() -> None:
    """Live messages the engine never sent (kept for its replay): tail says which seqs it missed."""
    ports = free_ports(1)
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=None, rate=100, faults=Faults(0.3), seed=7)
    async with Simulator(opts) as sim:
        tail = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bridge", "tail", f"tcp://127.0.0.1:{ports[0]}", "--count", "30", "--granularity", "batch",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        runner = asyncio.create_task(sim.run())
        try:
            stdout, stderr = await asyncio.wait_for(tail.communicate(), 60)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    seqs = [json.loads(x)["seq"] for x in stdout.decode().splitlines()]
    err = stderr.decode()
    assert tail.returncode == 0 and "Traceback" not in err, err
    missed = [(a + 1, b - 1) for a, b in itertools.pairwise(seqs) if b > a + 1]
    assert missed, seqs  # 30% dropped: some gap among 30 batches
    for first, last in missed:
        assert f"# rank 0: gap: seq {first}..{last} missed" in err, err
    assert "--replay-endpoint, --from-seq)" in err, err  # (given none: both to give)
    # breaker77 B2: an engine that never sent its UUID (this profile) was said to have stopped sending it.
    assert "stopped sending its UUID" not in err, err


async def test_tail_calls_an_undecodable_batch_received_not_missed() -> None:
    """breaker83 B4: seqs 0, 1, 2 with 1 undecodable: tail said so, then "gap: seq 1..1 missed (...
    the engine's replay socket keeps them)", which was false: it had received seq 1."""
    import zmq
    import zmq.asyncio

    from bridge.simulator import PROFILES, EventFactory, encode_batch

    profile = PROFILES["vllm-0.33.0"]
    factory = EventFactory(profile)
    (port,) = free_ports(1)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        tail = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bridge", "tail", f"tcp://127.0.0.1:{port}", "--count", "2",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert await pub.poll(30_000), "tail did not subscribe"
        await pub.recv()
        await asyncio.sleep(0.3)
        batches = [encode_batch(profile, time.time(), [factory.stored_event()]), b"\xc1 not msgpack"]
        batches.append(batches[0])
        for seq, data in enumerate(batches):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), data])
            await asyncio.sleep(0.05)
        _, stderr = await asyncio.wait_for(tail.communicate(), 60)
    finally:
        pub.close(linger=0)
        ctx.destroy(linger=0)
    err = stderr.decode()
    assert tail.returncode == 0 and "rank 0 seq 1: undecodable batch" in err, err
    assert "gap:" not in err, err


async def test_tail_shows_the_publisher_uuid_and_a_certain_restart() -> None:
    """vLLM #57789 frames: tail names the publisher's UUID, a new one as a certain restart, and
    reads an idle heartbeat (an empty payload) as the next seq, not as a batch."""
    ports = free_ports(1)
    opts = SimulatorOptions(endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=None, profile="vllm-pr57789-uuid", rate=0)
    async with Simulator(opts) as sim:
        tail = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bridge", "tail", f"tcp://127.0.0.1:{ports[0]}", "--count", "40", "--granularity", "batch",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        rank = sim.ranks[0]
        first = uuid.UUID(bytes=rank.instance)

        async def publish() -> None:
            while True:  # until tail has subscribed (slow joiner), then as many as it asks for
                for _ in range(3):
                    await sim.step()
                rank.seq += 2  # two batches never sent: the heartbeat shows them
                await rank.heartbeat()
                await asyncio.sleep(0.2)

        runner = asyncio.create_task(publish())
        try:
            await asyncio.sleep(1.5)
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            rank.restart()
            second = uuid.UUID(bytes=rank.instance)
            runner = asyncio.create_task(publish())
            stdout, stderr = await asyncio.wait_for(tail.communicate(), 60)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    err = stderr.decode()
    assert tail.returncode == 0 and "Traceback" not in err, err
    assert f"# rank 0: publisher instance {first}" in err, err
    assert f"# rank 0: a new publisher instance (the engine restarted, for certain) {second}" in err, err
    assert "idle heartbeat: next seq" in err and "undecodable" not in err, err
    assert all("events" in json.loads(x) for x in stdout.decode().splitlines())  # (no heartbeat printed as a batch)


@pytest.mark.parametrize("design", ["vllm-57789", "vllm-50134", "sglang-34407"])
async def test_tail_shows_a_snapshots_cut_then_follows_from_it(design: str) -> None:
    """``tail --snapshot``: the engine's snapshot (experimental) is asked for first; tail names its
    design and cut, prints the cache it holds at the cut's seq, then the live batches after it."""
    live, replay, snap = free_ports(3)
    profile = "vllm-pr57789-uuid" if design == "vllm-57789" else "vllm-0.33.0"
    opts = SimulatorOptions(
        endpoint=f"tcp://127.0.0.1:{live}", replay_endpoint=f"tcp://127.0.0.1:{replay}", profile=profile, rate=0,
        snapshot=design, snapshot_endpoint=None if design == "vllm-50134" else f"tcp://127.0.0.1:{snap}",
    )  # fmt: skip
    where = (
        ["--replay-endpoint", f"tcp://127.0.0.1:{replay}"]
        if design == "vllm-50134"
        else ["--snapshot-endpoint", f"tcp://127.0.0.1:{snap}"]
    )
    async with Simulator(opts) as sim:
        for _ in range(5):
            await sim.step()
        cut = sim.ranks[0].seq - 1
        tail = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bridge", "tail", f"tcp://127.0.0.1:{live}", "--snapshot", "auto", *where,
            "--count", "4", "--granularity", "batch",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await wait_for(lambda: sim.ranks[0].snapshots_served == 1, 30, "the snapshot request")

        async def publish() -> None:
            while True:  # until tail has subscribed (slow joiner), then as many as it asks for
                await sim.step()
                await asyncio.sleep(0.05)

        runner = asyncio.create_task(publish())
        try:
            stdout, stderr = await asyncio.wait_for(tail.communicate(), 60)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    err = stderr.decode()
    assert tail.returncode == 0 and "Traceback" not in err, err
    assert f"snapshot ({design}" in err and f"cut at seq {cut}:" in err and f"resumes at {cut + 1}" in err, err
    batches = [json.loads(x) for x in stdout.decode().splitlines()]
    assert batches[0]["seq"] == cut and batches[0]["events"], batches[0]
    assert all(b["seq"] > cut for b in batches[1:]), [b["seq"] for b in batches]
