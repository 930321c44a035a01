"""An in-process bridge whose file sink can be held down, and a crash of it.

:class:`GatedFile` is the file connector with a gate: while ``gate`` is an unset Event its writes
wait (a sink that is down or very slow; the sink's ``write_timeout`` gives up on them and retries),
and nothing reaches the file. :func:`crash` stops a :class:`~bridge.runtime.Bridge` leaving its
checkpoint file as a ``kill -9`` would: as last saved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from bridge.config import SinkConfig
from bridge.connector import Registry
from bridge.formats import Message
from bridge.runtime import Bridge
from connectors.file import FileConnector, FileOptions

GATED = "gated"  # the sink type to configure


class GatedFile(FileConnector):
    """The file connector, whose writes wait while ``gate`` is set to an unset Event."""

    def __init__(self, name: str, options: FileOptions, sink: SinkConfig) -> None:
        super().__init__(name, options, sink)
        self.gate: asyncio.Event | None = None

    def close_gate(self) -> None:
        self.gate = asyncio.Event()

    def open_gate(self) -> None:
        if self.gate is not None:
            self.gate.set()

    async def write(self, messages: Sequence[Message]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        await super().write(messages)


def gated_registry() -> Registry:
    return Registry({GATED: GatedFile}, entry_points=False)


def gated_sink(bridge: Bridge, index: int = 0) -> GatedFile:
    connector = bridge.workers[index].connector
    assert isinstance(connector, GatedFile)
    return connector


async def crash(bridge: Bridge) -> None:
    """Stop ``bridge`` without saving its checkpoint again: the file stays as last saved (a save
    already writing in its thread completes, as it would before a kill). The sinks still get what
    they can within ``shutdown_timeout``, as a kill just after it would leave them."""
    store = bridge.store

    async def no_save() -> None:
        return None

    store.path = None  # persist(), save_now(): nothing
    store._save = no_save  # type: ignore[method-assign]  # callers already waiting for the lock
    if bridge._checkpoint_task is not None:
        bridge._checkpoint_task.cancel()
    await bridge.stop()
