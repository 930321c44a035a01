"""A Redis sink run as the runtime runs it, every acknowledgement checked against Redis.

Shared by the delivery-contract tests (tests/integration/test_redis_delivery.py) and the fault
tests (test_redis_faults.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

import redis

from bridge import config
from bridge.config import SinkConfig
from bridge.connector import Registry, Template
from bridge.deadletter import DeadLetters
from bridge.formats import Message, Renderer
from bridge.metrics import Metrics
from bridge.records import Record
from bridge.sink import SinkWorker
from connectors.redis import entry_id, message_position


class RedisDelivery:
    """A SinkWorker over the real Redis connector, with short backoff.

    ``unbacked``: every acknowledged message whose entry Redis did not hold at the moment of the
    acknowledgement (with ``check_values``, also one whose entry's body differs). ``refused``: ids
    of messages expected to be dead-lettered (refused for themselves), not looked for.
    """

    def __init__(
        self,
        tmp: Path,
        url: str,
        options: Mapping[str, Any],
        *,
        granularity: str,
        retry: Mapping[str, str],
        refused: Set[str] = frozenset(),
        check_values: bool = False,
    ) -> None:
        sink = config.convert(
            {
                "type": "redis",
                "name": "redis",
                "format": "json",
                "granularity": granularity,
                "retry": dict(retry),
                "options": {"url": url, **options},
            },
            SinkConfig,
            "sink",
            [],
        )
        assert sink is not None
        self.renderer = Renderer(sink.format, sink.granularity)
        self.template = Template(options.get("stream", "kv:{source}:{dp_rank}"))
        self.refused = refused
        self.check_values = check_values
        self.metrics = Metrics()
        self.dead_path = tmp / f"dead-{time.monotonic_ns()}.jsonl"
        self.acked: list[Record] = []
        self.unbacked: list[str] = []
        self._check = redis.Redis.from_url(url, socket_timeout=10)
        self.worker = SinkWorker(
            0, sink, Registry().build(sink, 0), self.renderer, self.metrics, DeadLetters(str(self.dead_path)), self._on_ack
        )

    def key(self, m: Message) -> str:
        return self.template.render(m)

    def _on_ack(self, _index: int, records: list[Record]) -> None:
        # Synchronous on purpose: the check sees Redis as it is at the acknowledgement.
        messages = [m for r in records for m in self.renderer.render(r) if m.msg_id not in self.refused]
        pipe = self._check.pipeline(transaction=False)
        for m in messages:
            ident = entry_id(message_position(m))
            pipe.xrange(self.key(m), ident, ident)
        for m, found in zip(messages, pipe.execute(), strict=True):
            if not found or (self.check_values and found[0][1].get(b"data") != m.value):
                self.unbacked.append(f"{m.msg_id} acknowledged, not in {self.key(m)}")
        self.acked.extend(records)

    async def feed(self, records: list[Record]) -> None:
        for r in records:
            while not self.worker.offer(r):
                await self.worker.wait_room()

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def felt(self, reason: str) -> bool:
        return self.count("kv_bridge_sink_errors_total", sink="redis", reason=reason) > 0

    def errors(self) -> dict[str, float]:
        """sink error counts by reason (retries and dead letters)."""
        out: dict[str, float] = {}
        for metric in self.metrics.registry.collect():
            if metric.name == "kv_bridge_sink_errors":
                for s in metric.samples:
                    if s.name.endswith("_total") and s.value:
                        out[s.labels["reason"]] = s.value
        return out

    async def finish(self, records: list[Record]) -> None:
        """Wait until everything fed is acknowledged; check the acknowledgements."""
        assert await self.worker.flush(120), "not delivered within 120 s"
        assert len(self.acked) == len(records)
        assert not self.unbacked, self.unbacked[:5]

    def dead_letters(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.dead_path.read_text().splitlines()] if self.dead_path.exists() else []

    async def close(self) -> None:
        await self.worker.stop()
        self.worker.dead_letters.close()
        self._check.close()
