"""A consumer in another process (the Go consumer, an example consumer in a fresh virtual
environment), held to the same scenarios as the in-process :class:`kv_consumer.KvIndex`.

The process prints its whole index as one JSON line whenever it changed (``--json``: the
:meth:`kv_consumer.KvIndex.snapshot` document, which the Go consumer writes too); :func:`follow`
runs it and keeps :class:`SnapshotIndex` at its last line. :class:`SnapshotIndex` answers the
queries of tests/integration/test_example_consumers.py's checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_consumer import block_id

_LAST = 2**64  # the sub of an EventsLost or a head, as the Python index writes it (Go: 2**64 - 1)


@dataclass
class StreamView:
    epoch: int
    applied: tuple[int, int, int]
    complete: bool
    why: str
    blocks: Counter[tuple[Any, Any]]

    @property
    def seq(self) -> int:
        return self.applied[1] - 1


def _stream(name: str) -> tuple[str, int]:
    source, rank = name.rsplit("/", 1)
    return source, int(rank)


class SnapshotIndex:
    """The last index another process printed."""

    def __init__(self) -> None:
        self.streams: dict[tuple[str, int], StreamView] = {}
        self.holders: dict[int, set[tuple[str, int]]] = {}
        self.applied = self.duplicates = self.stale = 0
        self.lines = 0
        self.epochs: dict[tuple[str, int], set[int]] = {}  # every epoch printed, per stream

    def update(self, doc: dict[str, Any]) -> None:
        self.lines += 1
        self.applied, self.duplicates, self.stale = doc["applied"], doc["duplicates"], doc["stale"]
        streams = {}
        for s in doc["streams"]:
            epoch, slot, sub = s["applied"]
            blocks: Counter[tuple[Any, Any]] = Counter()
            for b in s["blocks"]:
                blocks[b["hash"], b["medium"]] += b["count"]
            streams[s["source"], s["dp_rank"]] = StreamView(
                s["epoch"], (epoch, slot, _LAST if sub >= _LAST - 1 else sub), s["complete"], s["why"], blocks
            )
        self.streams = streams
        for stream, view in streams.items():
            self.epochs.setdefault(stream, set()).add(view.epoch)
        self.holders = {int(k): {_stream(n) for n in names} for k, names in doc["holders"].items()}

    def residency(self, stream: tuple[str, int]) -> Counter[tuple[Any, Any]]:
        view = self.streams.get(stream)
        return Counter(view.blocks) if view else Counter()

    def incomplete(self) -> dict[tuple[str, int], str]:
        return {s: v.why for s, v in self.streams.items() if not v.complete}

    def streams_holding(self, block_hash: Any) -> set[tuple[str, int]]:
        k = block_id(block_hash)
        return set(self.holders.get(k, ())) if k is not None else set()

    def summary(self) -> str:
        lines = [f"{len(self.holders)} distinct blocks; {self.applied} applied, {self.duplicates} duplicates, {self.stale} stale"]
        for (source, rank), v in sorted(self.streams.items()):
            lines.append(f"  {source}/{rank} epoch {v.epoch} seq {v.seq}: {len(v.blocks)} blocks, {v.why or 'complete'}")
        return "\n".join(lines)


async def follow(
    index: SnapshotIndex,
    command: Sequence[str],
    stop: Callable[[], bool],
    log: Path,
    env: dict[str, str] | None = None,
    grace: float = 10.0,
    cwd: Path | None = None,
) -> int:
    """Run ``command`` (printing ``--json`` lines), keep ``index`` at its last line until
    ``stop()``, then stop it with SIGINT (``grace`` seconds, then SIGKILL); its exit code.
    AssertionError, with the end of its stderr (``log``), when it exits before."""
    with log.open("wb") as errors:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
            env={**os.environ, **(env or {})},
            limit=64 << 20,  # one line holds the whole index
            cwd=cwd,
        )
        assert proc.stdout is not None
        try:
            while not stop():
                try:
                    async with asyncio.timeout(0.2):  # (not wait_for: it may swallow a cancel)
                        line = await proc.stdout.readline()
                except TimeoutError:
                    continue
                if not line:
                    code = await proc.wait()
                    errors.flush()
                    raise AssertionError(f"{command[0]} exited with {code}: {_tail(log)}")
                index.update(json.loads(line))
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
                try:
                    rest, _ = await asyncio.wait_for(proc.communicate(), grace)
                    for line in rest.splitlines():  # what it printed last
                        index.update(json.loads(line))
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
    assert proc.returncode is not None
    return proc.returncode


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]
