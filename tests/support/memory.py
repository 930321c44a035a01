"""An in-memory connector for runtime tests: records what it is given, fails on demand."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec

from bridge.config import SinkConfig
from bridge.errors import ConnectorError
from bridge.formats import Message


class MemoryOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class MemoryConnector:
    """``failures`` is a queue of exceptions raised by the next writes (None: succeed)."""

    Options = MemoryOptions
    needs_events = True

    def __init__(self, name: str, options: MemoryOptions, sink: SinkConfig) -> None:
        self.name = name
        self.messages: list[Message] = []
        self.writes: list[int] = []
        self.failures: list[ConnectorError | None] = []
        self.gate: asyncio.Event | None = None  # when set to an unset Event, writes wait on it
        self.connected = False

    async def connect(self) -> None:
        self.connected = True

    async def write(self, messages: Sequence[Message]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.writes.append(len(messages))
        if self.failures:
            exc = self.failures.pop(0)
            if exc is not None:
                raise exc
        self.messages.extend(messages)

    async def close(self) -> None:
        self.connected = False

    async def health(self) -> str | None:
        return None if self.connected else "closed"
