"""The NATS sink when the server loses, limits or keeps in memory what the bridge relies on (issue
29, I6), on a real nats-server with JetStream:

- a stream or bucket kept in memory is warned about at connect and in ``--check``: one WARNING
  each, with the consequence and the fix;
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client

from bridge.cli import check
from bridge.config import SinkConfig, convert_options
from bridge.formats import Message, Renderer
from bridge.records import Stream
from connectors.nats import NatsConnector, NatsOptions, subject_token
from tests.infra.servers import NatsServer
from tests.support.records import stream_records

pytestmark = pytest.mark.integration

SINK = SinkConfig(type="nats", name="nats-l", format="json", granularity="batch")
A, B = Stream("eng-a", 0), Stream("eng-b", 1)


def _options(url: str, dest: str, **extra: Any) -> NatsOptions:
    base: dict[str, Any] = {
        "servers": url,
        "subject": dest + ".{source}.{dp_rank}",
        "connect_timeout": 5.0,
        "reconnect_wait": 0.2,
        "stream": {"create": True, "name": dest, "duplicate_window": "90s", "max_age": "1h"},
    }
    base.update(extra)
    return convert_options(base, NatsOptions, "sinks[0]")


def _render(streams: Sequence[Stream], start: int, count: int, epoch: int = 1) -> list[Message]:
    r = Renderer("json", "batch")
    return [m for s in streams for rec in stream_records(s, count, start=start, epoch=epoch) for m in r.render(rec)]


async def _subject_seqs(nc: Client, dest: str, stream: Stream) -> list[int]:
    """The engine seqs held on ``stream``'s subject of JetStream stream ``dest``, in stream order."""
    js = nc.jetstream(timeout=5)
    subject = f"{dest}.{subject_token(stream.source)}.{stream.dp_rank}"
    out: list[int] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(dest, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return out
        out.append(int((msg.headers or {})["seq"]))
        assert msg.seq is not None
        seq = msg.seq + 1


@pytest.fixture
async def reader(nats_server: NatsServer) -> AsyncIterator[Client]:
    nc = await nats.connect(nats_server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    yield nc
    await nc.close()


@pytest.fixture
async def dest(reader: Client) -> AsyncIterator[str]:
    name = f"KVL{uuid.uuid4().hex[:10].upper()}"
    yield name
    with contextlib.suppress(nats.errors.Error):
        await reader.jetstream(timeout=5).delete_stream(name)


# -- case 13: memory storage under a sink that relies on what it stored ---------------------------


async def test_memory_storage_is_warned_about_at_connect_and_in_check(
    nats_server: NatsServer, reader: Client, dest: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = f"ST{dest}"
    options = {
        "servers": nats_server.url,
        "subject": dest + ".{source}.{dp_rank}",
        "stream": {"create": True, "name": dest, "storage": "memory"},
        "state": {"enabled": True, "bucket": bucket, "create": True, "storage": "memory"},
    }
    sink = SinkConfig(type="nats", name="nats-m", format="json", granularity="batch")
    try:
        conn = NatsConnector("nats-m", convert_options(options, NatsOptions, "sinks[0]"), sink)
        with caplog.at_level(logging.WARNING, logger="connectors.nats"):
            await conn.connect()
        await conn.close()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        print("\n" + "\n".join(warnings))
        assert len(warnings) == 2, warnings  # one for the stream, one for the bucket
        stream_warning, bucket_warning = sorted(warnings, key=lambda w: "KV bucket" in w)
        assert f"JetStream stream {dest!r} keeps its data in memory" in stream_warning
        assert "sink_lost:nats-m" in stream_warning and "stream.storage: file" in stream_warning
        assert f"KV bucket {bucket!r} keeps its data in memory" in bucket_warning
        assert "incomplete" in bucket_warning and "state.storage: file" in bucket_warning

        caplog.clear()
        path = tmp_path / "bridge.yaml"
        source = {"name": "e", "endpoint": "tcp://127.0.0.1:1"}
        path.write_text(json.dumps({"sources": [source], "sinks": [{"type": "nats", "name": "nats-m", **options}]}))
        with caplog.at_level(logging.WARNING, logger="connectors.nats"):
            assert await asyncio.to_thread(check, str(path)) == 0  # a warning, not a refusal
        assert len([r for r in caplog.records if "keeps its data in memory" in r.getMessage()]) == 2
    finally:
        with contextlib.suppress(nats.errors.Error):
            await reader.jetstream(timeout=5).delete_key_value(bucket)
