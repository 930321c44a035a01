"""``python -m bridge tail ENDPOINT``: print an engine's decoded events as JSON lines (debugging).

Events go to stdout, one JSON line each; what tail notices goes to stderr as ``#`` lines: where it
connects and whether anything answers, a silent engine, a gap or restart in an engine's seqs, a
message it cannot decode. Where the engine sends its publisher UUID in the sequence frame (vLLM
#57789), tail shows it when it first appears and when it changes (a restart for certain; a seq
going back under the same UUID is not one), and says when an idle heartbeat shows a missed tail.
With ``--snapshot`` (experimental engine snapshots, :mod:`bridge.snapshot`) it first asks each
rank for a snapshot, says its design and cut (and UUID), prints the cache it holds as events at
the cut's seq, and then follows the live stream from there (a live seq past cut + 1 is a gap).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from . import wire
from .endpoints import for_rank
from .errors import DecodeError, StartupError
from .formats import Renderer
from .records import Record, Stream
from .replay import ReplayOutcome, replay
from .snapshot import SnapshotRefused, request

IDLE_NOTICE = 10.0
"""Seconds without an event after which tail says it is still waiting (and why that may be)."""


def _note(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


async def tail(
    endpoint: str,
    *,
    topic: str = "",
    replay_endpoint: str | None = None,
    from_seq: int | None = None,
    count: int = 0,
    granularity: str = "event",
    timeout: float = 2.0,
    dp_ranks: int = 1,
    bind: bool = False,
    idle_notice: float = IDLE_NOTICE,
    snapshot: str | None = None,
    snapshot_endpoint: str | None = None,
) -> int:
    """Print batches as they arrive (after replaying from ``from_seq`` if asked); returns how many.

    Reads ranks 0..dp_ranks-1 (rank r at port + r); ``bind``: bind the endpoints and let the engine
    connect in. Raises :class:`StartupError` when an endpoint cannot be bound or connected."""
    ctx = zmq.asyncio.Context()
    renderer = Renderer("json", "batch" if granularity == "batch" else "event")
    out = sys.stdout.buffer
    printed = 0
    last: dict[int, int] = {}  # rank -> last seq printed
    instances: dict[int, bytes | None] = {}  # rank -> the publisher UUID last seen (None: sends none)

    def instance(rank: int, seen: bytes | None) -> bool:
        """Note the publisher UUID of a live message when it appears or changes; True when it changed."""
        if rank in instances and instances[rank] == seen:
            return False
        changed = rank in instances
        instances[rank] = seen
        if seen is None:
            if changed:  # (an engine that never sent one is said nothing of)
                _note(f"rank {rank}: the publisher stopped sending its UUID: a restart (a downgrade?)")
        else:
            what = "a new publisher instance (the engine restarted, for certain)" if changed else "publisher instance"
            _note(f"rank {rank}: {what} {uuid.UUID(bytes=seen)} (24-byte sequence frames, vLLM #57789)")
        if changed:
            last.pop(rank, None)
        return changed

    def heartbeat(rank: int, next_seq: int, seen: bytes | None) -> None:
        instance(rank, seen)
        before = last.get(rank)
        if before is not None and next_seq > before + 1:
            _note(f"rank {rank}: idle heartbeat: next seq {next_seq}, so seq {before + 1}..{next_seq - 1} were missed")

    def emit(rank: int, seq: int, payload: bytes) -> None:
        nonlocal printed
        before = last.get(rank)
        if before is not None and seq > before + 1:
            fetch = f"--from-seq {before + 1}" if replay_endpoint else "--replay-endpoint, --from-seq"
            _note(
                f"rank {rank}: gap: seq {before + 1}..{seq - 1} missed (tail fetches no gap; the engine's replay socket "
                f"keeps them: {fetch})"
            )
        elif before is not None and seq <= before:
            if instances.get(rank) is not None:
                _note(f"rank {rank}: seq went back from {before} to {seq} under the same publisher UUID: not a restart")
            else:
                _note(f"rank {rank}: seq went back from {before} to {seq}: the engine restarted (or a replay repeats)")
        last[rank] = max(seq, before) if before is not None and instances.get(rank) is not None else seq
        try:  # (after the seq is noted: an undecodable batch was received all the same, not missed)
            batch = wire.decode_batch(payload)
        except DecodeError as exc:
            _note(f"rank {rank} seq {seq}: undecodable batch ({exc})")
            return
        for bad in batch.bad_events:
            _note(f"rank {rank} seq {seq}: bad event {bad.index} ({bad.reason})")
        record = Record(
            stream=Stream(endpoint, batch.dp_rank if batch.dp_rank is not None else rank),
            epoch=0,
            seq=seq,
            ts=batch.ts,
            payload=payload,
            events=batch.events,
            received=time.time(),
        )
        try:
            messages = renderer.render(record)
        except Exception as exc:  # a hostile batch (e.g. nested past the recursion limit) must not end tail
            _note(f"rank {rank} seq {seq}: cannot render ({type(exc).__name__}: {exc})")
            return
        for m in messages:
            out.write(m.value + b"\n")
        out.flush()
        printed += 1

    socks: list[tuple[int, str, zmq.asyncio.Socket]] = []
    monitors: list[zmq.asyncio.Socket] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        for rank in range(dp_ranks):
            ep = for_rank(endpoint, rank)
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            # Every topic: one the engine publishes under other than --topic is said, not taken for silence.
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            socks.append((rank, ep, sub))
            monitor = sub.get_monitor_socket()
            monitors.append(monitor)
            tasks.append(asyncio.create_task(_watch(rank, ep, monitor, bind)))
            try:
                sub.bind(ep) if bind else sub.connect(ep)
            except zmq.ZMQError as exc:
                fix = "another process holds the port: stop it or choose another" if bind else "check the address"
                raise StartupError(f"tail: cannot {'bind' if bind else 'connect to'} {ep} ({exc.strerror}); {fix}") from None
        where = ", ".join(ep for _, ep, _ in socks)
        _note(
            f"{'bound' if bind else 'connecting to'} {where} (topic {topic!r}); waiting for events: an engine publishes "
            "only when its cache changes, so an idle one prints nothing"
        )
        if replay_endpoint and from_seq is not None:
            for rank in range(dp_ranks):
                outcome = ReplayOutcome()
                rep = for_rank(replay_endpoint, rank)
                async for reply in replay(ctx, rep, from_seq, -1, timeout, outcome, 64 << 20):
                    emit(rank, reply.seq, reply.payload)
                    if count and printed >= count:
                        return printed
                if not outcome.complete:
                    _note(f"rank {rank}: replay from {rep} went silent before its end marker (is it the engine's replay port?)")
        if snapshot is not None:
            at = snapshot_endpoint or replay_endpoint
            design = "vllm-50134" if snapshot == "auto" and snapshot_endpoint is None else snapshot
            assert at is not None  # (the CLI checks)
            for rank in range(dp_ranks):
                printed += await _snapshot(ctx, rank, for_rank(at, rank), design, timeout, renderer, endpoint, last)
        queue: asyncio.Queue[tuple[int, list[bytes]]] = asyncio.Queue(maxsize=1000)
        tasks += [asyncio.create_task(_read(rank, sub, queue)) for rank, _, sub in socks]
        own, foreign, heard = topic.encode(), list[str](), False
        while not count or printed < count:
            try:
                async with asyncio.timeout(idle_notice):
                    rank, frames = await queue.get()
            except TimeoutError:
                if foreign and not heard:
                    _note(
                        f"no events from {where} in {idle_notice:g}s: {foreign_topics(foreign, topic)} so far: give --topic "
                        "the engine's KV events topic"
                    )
                    continue
                _note(
                    f"no events from {where} in {idle_notice:g}s: the engine may be idle, or not publishing here "
                    "(is it started with KV events on, and is this its PUB port?)"
                )
                continue
            if frames[0].startswith(own):
                heard = True  # (its own topic came: the idle notice no longer blames the others)
            else:  # another topic: said (the first few), never printed
                seen = frames[0][:64].decode(errors="replace")
                if seen not in foreign and len(foreign) < 3:
                    foreign.append(seen)
                    _note(f"rank {rank}: a message under topic {seen!r}, not under {topic!r}: skipped (is --topic the engine's?)")
                continue
            try:
                f = wire.parse_live(frames)
            except DecodeError as exc:
                _note(f"rank {rank}: bad message: {exc}")
                continue
            if f.heartbeat:
                heartbeat(rank, f.seq, f.instance)
                continue
            instance(rank, f.instance)
            emit(rank, f.seq, f.payload)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for (_, _, sub), monitor in zip(socks, monitors, strict=False):  # (a failed start: one socket more)
            # The monitor is stopped before its socket is closed, as in bridge.source (closed first,
            # libzmq may hang in disable_monitor or at the context's end: pyzmq #1020, libzmq #1279).
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
        for _, _, sub in socks:
            sub.close(linger=0)
        ctx.destroy(linger=0)
    return printed


SNAPSHOT_MAX_BYTES = 1 << 30
"""The largest snapshot tail reads (1 GiB)."""


async def _snapshot(
    ctx: zmq.asyncio.Context,
    rank: int,
    endpoint: str,
    design: str,
    timeout: float,
    renderer: Renderer,
    stream: str,
    last: dict[int, int],
) -> int:
    """Ask ``endpoint`` for a snapshot; say its cut, print its events at the cut's seq; 1 if printed."""
    try:
        snap = await request(ctx, endpoint, design, max(timeout, 10.0), SNAPSHOT_MAX_BYTES)  # type: ignore[arg-type]
    except SnapshotRefused as exc:
        _note(f"rank {rank}: no snapshot from {endpoint} ({exc.reason}: {exc.detail})")
        return 0
    who = f", publisher {uuid.UUID(bytes=snap.instance)}" if snap.instance else ""
    epoch = f", engine epoch {snap.epoch}" if snap.epoch is not None else ""
    events = []
    for payload in snap.payloads:
        try:
            events.extend(wire.decode_batch(payload).events)
        except DecodeError as exc:
            _note(f"rank {rank}: a snapshot chunk cannot be decoded ({exc})")
    _note(
        f"rank {rank}: snapshot ({snap.design}{who}{epoch}) cut at seq {snap.cut}: {len(events)} event(s), the engine's "
        f"cache after seq {snap.cut}; the live stream resumes at {snap.cut + 1}"
    )
    if snap.cut >= 0:
        last[rank] = snap.cut
    record = Record(stream=Stream(stream, rank), epoch=0, seq=snap.cut, events=events, received=time.time())
    out = sys.stdout.buffer
    for m in renderer.render(record):
        out.write(m.value + b"\n")
    out.flush()
    return 1


class Caution(str):
    """What ``wire_shape`` found that may or may not be a problem (``--check`` says it as a
    warning): a window with only other topics' messages cannot tell a wrong ``topic`` from an
    engine that publishes its own rarely beside busier ones."""


UNDECODABLE_FIX = (
    "nothing of the engine's first message could be decoded, and the bridge would deliver nothing of such messages "
    "(is it a vLLM or SGLang KV event publisher with the msgpack encoder, and the source's topic its own?)"
)


def foreign_topics(topics: list[str], prefix: str) -> str:
    """The other topics seen, for a line saying that nothing came under ``prefix``."""
    return f"the engine publishes under {', '.join(map(repr, topics))} and nothing under a topic starting with {prefix!r}"


async def wire_shape(
    endpoint: str, topic: str, timeout: float, max_frame_bytes: int = 64 << 20, replay_endpoint: str | None = None
) -> tuple[str, str | None]:
    """What the first live message of the source's ``topic`` read from ``endpoint`` within
    ``timeout`` shows of the wire (for ``--check``): whether its sequence frame carries the
    publisher UUID (vLLM #57789), and the producer shape its payload has; "nothing within ..." for
    an idle engine. Listens as the run does, to every topic: messages only under other topics are
    no idle engine but perhaps a wrong ``topic`` (the run would receive nothing, reason
    ``wrong_topic``); an idle heartbeat is read past, to the first batch within ``timeout``. Second:
    the problem, with its fix (nothing of the message could be
    decoded: its frames, its batch, or any of its events; or a frame over ``max_frame_bytes``,
    the run's ``ingest.max_frame_bytes``, at which ZMQ drops the connection: this listener reads
    past it to say so; or a ``replay_endpoint`` that answers for the message's seq with another
    batch, see :func:`foreign_replay`); a :class:`Caution` (only other topics: a warning); or None."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    own, foreign = topic.encode(), list[str]()
    frames: list[bytes] | None = None
    beat: list[bytes] | None = None  # an idle heartbeat: said only if no batch follows in time
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, max(64 << 20, max_frame_bytes))
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic, as the run until one of its own: see bridge.source
        sub.connect(endpoint)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and await sub.poll(max(1, int(left * 1000))):
            got = await sub.recv_multipart()
            if got[0].startswith(own):
                if _heartbeat(got):
                    beat = beat or got  # (the batches that follow tell whether the run can read them)
                    continue
                frames = got
                break
            seen = got[0][:64].decode(errors="replace")
            if seen not in foreign and len(foreign) < 3:
                foreign.append(seen)
    finally:
        sub.close(linger=0)
        ctx.destroy(linger=0)
    if frames is None and beat is not None:
        frames = beat
    if frames is None:
        if foreign:
            said = f"{foreign_topics(foreign, topic)} within {timeout:g}s"
            return said, Caution(
                f"{said}: if its KV events go under another topic, the run receives nothing (not ready, reason "
                f"wrong_topic): set the source's topic to it; an engine that publishes under {topic!r} only now and "
                "then needs nothing"
            )
        unchecked = (
            "; replay_endpoint not checked (its answer is compared with a batch the engine publishes: run --check "
            "while it publishes)"
            if replay_endpoint is not None
            else ""
        )
        said = f"nothing published within {timeout:g}s (an idle engine: the wire shape shows with its first batch)"
        return said + unchecked, None
    largest = max(map(len, frames))
    if largest > max_frame_bytes:
        return f"a message with a {largest}-byte frame", (
            f"it is over ingest.max_frame_bytes ({max_frame_bytes} bytes): ZMQ drops the connection at every such "
            "message, and the run reads nothing of them (not ready, reason dropped_unread): raise "
            "ingest.max_frame_bytes above the engine's largest batch"
        )
    try:
        f = wire.parse_live(frames)
    except DecodeError as exc:
        return f"a message the bridge cannot read ({exc})", UNDECODABLE_FIX
    ident = (
        f"publisher UUID {uuid.UUID(bytes=f.instance)} (24-byte sequence frames: restarts are certain)"
        if f.instance is not None
        else "no publisher UUID (8-byte sequence frames: restarts are inferred)"
    )
    if f.heartbeat:
        return f"{ident}; an idle heartbeat (next seq {f.seq})", None
    try:
        batch = wire.decode_batch(f.payload)
    except DecodeError as exc:
        return f"{ident}; an undecodable batch ({exc})", UNDECODABLE_FIX
    kinds = sorted({"RFC 1527 maps" if "event_type" in e else e["type"] for e in batch.events})
    bad = len(batch.bad_events)
    if bad and not batch.events:
        return f"{ident}; seq {f.seq}, {bad} event(s), none of which decodes ({batch.bad_events[0].reason})", UNDECODABLE_FIX
    undecoded = f", and {bad} that do not decode" if bad else ""
    said = f"{ident}; seq {f.seq}, {len(batch.events)} event(s): {', '.join(kinds) or 'none'}{undecoded}"
    if replay_endpoint is None:
        return said, None
    problem, unchecked = await foreign_replay(replay_endpoint, f.seq, f.payload, timeout, max(64 << 20, max_frame_bytes))
    return said + unchecked, problem


def _heartbeat(frames: list[bytes]) -> bool:
    """Whether a live message is an idle heartbeat (it says nothing of the batches' shape)."""
    try:
        return wire.parse_live(frames).heartbeat
    except DecodeError:
        return False


async def foreign_replay(endpoint: str, seq: int, payload: bytes, timeout: float, max_frame_bytes: int) -> tuple[str | None, str]:
    """Whether the replay socket at ``endpoint`` is this engine's: it answers for ``seq`` with
    ``payload`` (what the live endpoint sent at that seq). First: the problem, when it answers
    with another batch: it is another engine's (or another rank's), and the run would take its
    batches for this engine's (a restart, and another engine's cache). Second: what to add to the
    source's line when it could not tell (no answer, or no batch at ``seq`` to compare: it may
    still be another engine's, one that started later or has moved past that seq), else ""."""
    ctx = zmq.asyncio.Context()
    outcome = ReplayOutcome()
    try:
        async for reply in replay(ctx, endpoint, seq, seq, timeout, outcome, max_frame_bytes):
            if reply.payload == payload and reply.seq == seq:
                return None, ""
            if reply.seq != seq:
                break
            return (
                f"the replay endpoint {endpoint} answers for seq {seq} with another batch than the live endpoint sent: "
                "it is another engine's replay socket (or another rank's: rank r uses port + r on both sockets), and the "
                "run would take that engine's batches for this one's; give this engine's replay_endpoint"
            ), ""
    finally:
        ctx.destroy(linger=0)
    why = f"no answer within {timeout:g}s" if not outcome.complete and not outcome.replies else f"it holds no batch at seq {seq}"
    return None, f"; replay_endpoint not checked ({why}: it may still be another engine's, one started later or past this seq)"


async def _read(rank: int, sub: zmq.asyncio.Socket, queue: asyncio.Queue[tuple[int, list[bytes]]]) -> None:
    while True:
        await queue.put((rank, await sub.recv_multipart()))


async def _watch(rank: int, endpoint: str, monitor: zmq.asyncio.Socket, bind: bool) -> None:
    """Say when the connection comes up, cannot be made, or goes away (the SUB socket's monitor)."""
    retried = False
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            retried = False
            _note(f"rank {rank}: {'a publisher connected to' if bind else 'connected to'} {endpoint}")
        elif event == zmq.EVENT_CONNECT_RETRIED and not retried:
            retried = True
            _note(f"rank {rank}: nothing answers at {endpoint} yet (engine down, or a wrong host or port?); retrying")
        elif event == zmq.EVENT_DISCONNECTED:
            _note(f"rank {rank}: {endpoint} went away; {'waiting for it' if bind else 'reconnecting'}")
