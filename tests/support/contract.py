"""Running a connector through the runtime's delivery loop for the conformance suite's contract tests.

:class:`Scenario` is what a connector's harness sets up (a connector, the records of one write, a
way to read back, how to heal the failure); :func:`run` feeds every record to a real
:class:`bridge.sink.SinkWorker` (retries with backoff, :func:`bridge.sink.fold`, dead letters,
acknowledgements) so the first write carries them all, heals the failure once the worker met it,
and waits until everything is acknowledged. :class:`Observed` wraps the connector to record how
each write ended, so a test can tell that the failure it meant to cause did happen.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bridge.config import BatchConfig, ByteSize, Duration, RetryConfig, SinkConfig
from bridge.connector import Connector
from bridge.deadletter import DeadLetters
from bridge.errors import PartialFailure, Permanent
from bridge.formats import Message, Renderer
from bridge.metrics import Metrics
from bridge.records import Event, Record, Stream
from bridge.sink import SinkWorker

# The fields a consumer of an at-least-once sink deduplicates on (the stream header).
IDENTITY = ("source", "dp_rank", "epoch", "seq", "index", "type")


@dataclass
class Scenario:
    """One write a harness prepared to fail on its real server.

    ``records`` go to the worker before it starts, so its first write carries them all. ``read``
    returns everything stored for a stream (server order), as ``(value, headers)`` pairs.
    ``heal`` (transient failures) runs once the worker counted a sink error with one of the
    ``struck`` reasons (or once ``struck()`` is true). ``refused``: the record whose one message the server refuses for itself.
    """

    connector: Connector
    records: list[Record]
    read: Callable[[Stream, int], Awaitable[list[tuple[bytes, dict[str, str]]]]]
    heal: Callable[[], Awaitable[None]] | None = None
    struck: tuple[str, ...] | Callable[[], bool] = ()
    refused: Record | None = None
    write_timeout: float = 10.0
    cleanup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


class Observed:
    """A connector wrapper that records how each write ended (None: returned)."""

    def __init__(self, inner: Connector) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs_events = inner.needs_events
        self.outcomes: list[tuple[int, BaseException | None]] = []

    async def connect(self) -> None:
        await self.inner.connect()

    async def write(self, messages: Sequence[Message]) -> None:
        try:
            await self.inner.write(messages)
        except BaseException as exc:  # CancelledError too: the runtime's write timeout
            self.outcomes.append((len(messages), exc))
            raise
        self.outcomes.append((len(messages), None))

    async def close(self) -> None:
        await self.inner.close()

    async def health(self) -> str | None:
        return await self.inner.health()


class BeforeFirstWrite(Observed):
    """A connector wrapper that runs ``action`` (say, stall the server) as the first write starts."""

    def __init__(self, inner: Connector, action: Callable[[], Awaitable[None]]) -> None:
        super().__init__(inner)
        self._action: Callable[[], Awaitable[None]] | None = action

    async def write(self, messages: Sequence[Message]) -> None:
        if self._action is not None:
            action, self._action = self._action, None
            await action()
        await super().write(messages)


@dataclass
class Result:
    """What :func:`run` saw: every write's outcome, the dead letters, the acknowledged records."""

    outcomes: list[tuple[int, BaseException | None]]
    dead: list[dict[str, Any]]
    acked: list[Record]
    errors: dict[str, float]  # sink error reason -> count


def worker_config(sink: SinkConfig, write_timeout: float, max_messages: int = 100_000) -> SinkConfig:
    """``sink`` with the runtime settings of these tests: short backoff, one write for everything
    (or writes of ``max_messages``)."""
    return msgspec.structs.replace(
        sink,
        retry=RetryConfig(
            initial_backoff=Duration(0.05), max_backoff=Duration(0.3), jitter=0.0, write_timeout=Duration(write_timeout)
        ),
        batch=BatchConfig(max_messages=max_messages, max_bytes=ByteSize(64 << 20), linger=Duration(0)),
    )


async def run(
    scenario: Scenario, sink: SinkConfig, tmp: Path, *, budget: float = 60.0, max_messages: int = 100_000, cleanup: bool = True
) -> Result:
    """Deliver ``scenario.records`` through a SinkWorker over the scenario's connector (its
    ``cleanup`` steps after, unless not ``cleanup``: the scenario runs again)."""
    cfg = worker_config(sink, scenario.write_timeout, max_messages)
    observed = Observed(scenario.connector)
    dead_path = tmp / "dead-letters.jsonl"
    acked: list[Record] = []
    metrics = Metrics()
    worker = SinkWorker(
        0,
        cfg,
        observed,
        Renderer(cfg.format, cfg.granularity, cfg.hash_format),
        metrics,
        DeadLetters(str(dead_path)),
        lambda _i, records: acked.extend(records),
    )

    def errors() -> dict[str, float]:
        out: dict[str, float] = {}
        for family in metrics.registry.collect():
            for sample in family.samples:
                if sample.name == "kv_bridge_sink_errors_total" and sample.value:
                    out[sample.labels["reason"]] = sample.value
        return out

    for r in scenario.records:
        worker.force(r)
    worker.start()
    try:
        if scenario.heal is not None:
            deadline = time.monotonic() + budget
            struck = scenario.struck
            while not (struck() if callable(struck) else any(errors().get(reason) for reason in struck)):
                assert time.monotonic() < deadline, (
                    f"the failure never struck ({scenario.struck}): errors {errors()}, writes {observed.outcomes}, "
                    f"last error {worker.last_error}"
                )
                await asyncio.sleep(0.02)
            await scenario.heal()
        assert await worker.flush(budget), f"not delivered within {budget} s: {worker.last_error}"
    finally:
        await worker.stop()
        worker.dead_letters.close()
        for step in scenario.cleanup if cleanup else ():
            await step()
    dead = [json.loads(line) for line in dead_path.read_text().splitlines()] if dead_path.exists() else []
    return Result(observed.outcomes, dead, acked, errors())


# -- records of a chosen size ---------------------------------------------------------------------


def _event(seq: int, tokens: int) -> Event:
    return {
        "type": "BlockStored",
        "block_hashes": [(seq * 1_000_003 + 1) * 0x9E3779B97F4A7C15 % 2**64],
        "parent_block_hash": None,
        "token_ids": list(range(100_000, 100_000 + tokens)),  # fixed width in every format
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }


def _record(stream: Stream, seq: int, tokens: int) -> Record:
    events = [_event(seq, tokens)]
    ts = 1_700_000_000.0 + seq * 0.01
    payload = msgspec.msgpack.encode([ts, events, stream.dp_rank])
    return Record(stream=stream, epoch=1, seq=seq, ts=ts, payload=payload, events=events, received=ts)


def sized(renderer: Renderer, stream: Stream, seq: int, size: int) -> Record:
    """An engine batch of one event whose one message (in ``renderer``'s format and granularity)
    is about ``size`` bytes (never less than the smallest such message)."""
    (small,) = renderer.render(_record(stream, seq, 0))
    (large,) = renderer.render(_record(stream, seq, 100))
    per_token = (len(large.value) - len(small.value)) / 100
    tokens = max(0, round((size - len(small.value)) / per_token))
    for _ in range(3):  # list headers and number widths grow with the count: correct the estimate
        (m,) = renderer.render(_record(stream, seq, tokens))
        if abs(len(m.value) - size) < per_token:
            break
        tokens = max(0, tokens + round((size - len(m.value)) / per_token))
    return _record(stream, seq, tokens)


def interleaved(renderer: Renderer, streams: Sequence[Stream], count: int, size: Callable[[Stream, int], int]) -> list[Record]:
    """``count`` records of each stream, the streams interleaved as an engine's ranks arrive."""
    return [sized(renderer, s, seq, size(s, seq)) for seq in range(count) for s in streams]


def identity(headers: dict[str, str]) -> tuple[str | None, ...]:
    return tuple(headers.get(k) for k in IDENTITY)


def first_copy_items(stored: Sequence[tuple[bytes, dict[str, str]]]) -> list[tuple[bytes, dict[str, str]]]:
    """The first copy of each message (by its stream header), value and headers, in stored order."""
    seen: set[tuple[str | None, ...]] = set()
    out: list[tuple[bytes, dict[str, str]]] = []
    for value, headers in stored:
        key = identity(headers)
        if key not in seen:
            seen.add(key)
            out.append((value, headers))
    return out


def first_copies(stored: Sequence[tuple[bytes, dict[str, str]]]) -> list[bytes]:
    """The first copy of each message (by its stream header), in stored order."""
    return [value for value, _ in first_copy_items(stored)]


def transient_partial(outcomes: Sequence[tuple[int, BaseException | None]]) -> bool:
    """Some write failed in part: some of its messages transiently, others taken."""
    for total, exc in outcomes:
        if isinstance(exc, PartialFailure):
            transient = [i for i, e in exc.errors.items() if not isinstance(e, Permanent)]
            if transient and len(exc.errors) < total:
                return True
    return False
