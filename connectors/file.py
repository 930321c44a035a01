"""The ``file`` connector: messages as lines in a file, or on stdout (``path: "-"``).

Each message is written as one line. For ``json`` that is the JSON object itself; for ``msgpack``
and ``raw`` (binary bodies) each line is a JSON envelope ``{"headers": {...}, "value_b64": "..."}``
unless ``binary: length-prefixed`` is chosen, which writes a 4-byte big-endian length and the raw
body instead (no newline). ``fsync: true`` makes a write durable before it counts as delivered.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Annotated, Literal

import msgspec

from bridge.connector import ConnectorOptions, Message, NotConnected, SinkConfig, doc, file_id, unwritable

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


class FileOptions(ConnectorOptions):
    path: Annotated[str, doc("File to append to (its directory is created); - is standard output.")] = "-"
    binary: Annotated[
        Literal["envelope", "length-prefixed"],
        doc(
            "How non-JSON bodies (msgpack, raw) are written: envelope, one JSON line "
            '{"headers": {...}, "value_b64": "..."}; length-prefixed, a 4-byte big-endian length then the body.'
        ),
    ] = "envelope"
    fsync: Annotated[bool, doc("fsync after every write: durable before it counts as delivered, slower.")] = False


class FileConnector:
    """Appends messages to a file or stdout."""

    Options = FileOptions
    needs_events = False  # writes only the rendered value (and headers): raw batches need no decoding

    def __init__(self, name: str, options: FileOptions, sink: SinkConfig) -> None:
        self.name = name
        self.options = options
        self.text = sink.format == "json"
        self._out: IO[bytes] | None = None
        self._id: tuple[int, int] | None = None  # (device, inode) of the file opened

    async def connect(self) -> None:
        if self._out is not None:
            return
        if self.options.path == "-":
            self._out = sys.stdout.buffer
            return
        try:
            p = Path(self.options.path)
            p.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: a write that fails half-way (a full disk) is cut back (see write), never
            # left in a buffer that a later flush or close would tear.
            self._out = p.open("a+b", buffering=0)  # noqa: ASYNC230 - a local file, opened once (read: see _cut_torn_tail)
            st = os.fstat(self._out.fileno())
            self._id = (st.st_dev, st.st_ino)
            self._cut_torn_tail(self._out.fileno(), st.st_size)
        except OSError as exc:
            raise NotConnected(f"sinks[{self.name}].path: cannot open {self.options.path} ({exc.strerror or exc})") from exc

    def _cut_torn_tail(self, fd: int, size: int) -> None:
        """A line-per-record file (JSON, the envelope) that does not end with a newline holds a
        record torn by a crash in the middle of a write: cut back to its last whole line, so the
        next record starts a line of its own (appended to the torn one, both would be unreadable)."""
        if size == 0 or (not self.text and self.options.binary == "length-prefixed"):
            return
        start = max(0, size - 1_048_576)
        tail = os.pread(fd, size - start, start)
        if tail.endswith(b"\n"):
            return
        end = tail.rfind(b"\n")
        keep = start + end + 1 if end >= 0 else (0 if start == 0 else size)
        if keep == size:
            return  # (no newline in its last MiB: not a file of lines; left as it is)
        os.ftruncate(fd, keep)
        log.warning(
            "the file ended in a torn record (a write cut short by a crash or a full disk): cut back to its last whole line",
            extra={"sink": self.name, "path": self.options.path, "bytes_cut": size - keep},
        )

    async def _reopen_if_moved(self) -> None:
        """Before a write: the path removed or renamed since it was opened (logrotate) makes the
        next write go to a new file at the path, never into the old file, where a removed
        file's records would be lost while counted delivered."""
        if self.options.path != "-" and self._out is not None and file_id(self.options.path) != self._id:
            await self.close()
            await self.connect()

    def _encode(self, messages: Sequence[Message]) -> bytes:
        if self.text:
            values = [m.value for m in messages]
            values.append(b"")  # a newline after the last line too
            return b"\n".join(values)
        if self.options.binary == "length-prefixed":
            parts: list[bytes] = []  # prefix, value, ...: one copy of each value, into the join
            add = parts.append
            for m in messages:
                value = m.value
                add(len(value).to_bytes(4, "big"))
                add(value)
            return b"".join(parts)
        return b"".join(
            _json.encode({"headers": m.headers, "value_b64": base64.b64encode(m.value).decode()}) + b"\n" for m in messages
        )

    async def write(self, messages: Sequence[Message]) -> None:
        await self._reopen_if_moved()
        if self._out is None:
            raise NotConnected(f"sinks[{self.name}]: not open")
        data = self._encode(messages)
        out = self._out
        if self.options.path == "-":
            try:
                out.write(data)
                out.flush()
            except OSError as exc:
                raise NotConnected(f"sinks[{self.name}]: cannot write to standard output ({exc.strerror or exc})") from exc
            return
        fd = out.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.options.fsync:
                await asyncio.to_thread(os.fsync, fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)  # (what was written of it: a torn record)
            raise NotConnected(f"sinks[{self.name}]: cannot write {self.options.path} ({exc.strerror or exc})") from exc

    async def close(self) -> None:
        out, self._out = self._out, None
        if out is not None and self.options.path != "-":
            with contextlib.suppress(OSError):
                out.close()
        elif out is not None:
            with contextlib.suppress(OSError, ValueError):
                out.flush()

    async def health(self) -> str | None:
        return None if self._out is not None else "not open"

    async def probe(self) -> str | None:
        """For ``--check``: whether the file could be opened, without creating it or its directory."""
        if self.options.path == "-":
            return None
        problem = unwritable(self.options.path)
        return None if problem is None else f"sinks[{self.name}].path: {problem}"
