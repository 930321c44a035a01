"""Engine snapshots (bridge.snapshot): the three designs' replies, the seed, and what the state and
the output make of it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from bridge.config import from_data
from bridge.errors import ConfigError
from bridge.formats import SEED_SUB, SEED_TYPE, Renderer
from bridge.records import Record, Stream, events_lost, source_reset
from bridge.simulator import PROFILES, EngineCache, encode_batch, snapshot_reply
from bridge.snapshot import Seeding, SnapshotRefused, parse_reply, replay_socket_snapshot, snapshot_events
from bridge.state import StateTracker, block_id
from bridge.wire import parse_replay
from connectors.redis import entry_id
from kv_consumer.redis import WIDE_EPOCHS, entry_position

PROFILE = PROFILES["vllm-0.33.0"]
UUID = bytes(range(16))
S = Stream("a", 0)


def stored(*hashes: int, medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": [1] * (2 * len(hashes)),
        "block_size": 2,
        "medium": medium,
        "group_idx": 0,
    }


def removed(*hashes: int, medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": 0}


def cache_of(*batches: list[dict[str, Any]]) -> EngineCache:
    cache = EngineCache()
    for events in batches:
        cache.apply(events)
    return cache


def keyed(cache: EngineCache) -> Counter[tuple[Any, Any, int]]:
    return Counter({(m, g, block_id(h)): n for (h, m, g), n in cache.counts.items()})


CACHE = cache_of([stored(1, 2, 3), stored(2), stored(2, medium="CPU")], [removed(3), stored(7)])


def reply(design: Any, cut: int = 41) -> list[list[bytes]]:
    return snapshot_reply(design, PROFILE, CACHE, cut=cut, ts=1.0, instance=UUID, epoch=3)


@pytest.mark.parametrize("design", ["vllm-57789", "sglang-34407"])
@pytest.mark.parametrize("given", ["auto", "design"])
def test_a_snapshot_socket_reply_gives_the_cut_and_the_whole_cache(design: Any, given: str) -> None:
    (message,) = reply(design)
    snap = parse_reply(design if given == "design" else "auto", message[1:])
    assert (snap.design, snap.cut) == (design, 41)
    assert snap.instance == (UUID if design == "vllm-57789" else None)
    assert snap.epoch == (3 if design == "sglang-34407" else None)
    tracker = StateTracker()
    tracker.apply(Record(S, 1, 42, seed=Record(S, 1, 42, "StateSeeded", events=snapshot_events(snap))))
    assert Counter({(m, g, k): c for m, g, k, c, _v in tracker.entries(S)}) == keyed(CACHE)
    assert any(c == 2 for c in CACHE.counts.values())  # duplicate residency survives the snapshot


def test_the_replay_socket_design_brings_the_cache_as_replies_with_the_resume_point() -> None:
    messages = reply("vllm-50134")
    replies = [parse_replay(m) for m in messages]
    assert replies[-1].end and all(not r.end for r in replies[:-1])
    snap = replay_socket_snapshot(replies[:-1], 0)
    assert (snap.design, snap.cut) == ("vllm-50134", 41)
    events = snapshot_events(snap)
    assert events[0]["type"] == "AllBlocksCleared"
    tracker = StateTracker()
    tracker.apply(Record(S, 1, 42, seed=Record(S, 1, 42, "StateSeeded", events=events)))
    assert Counter({(m, g, k): c for m, g, k, c, _v in tracker.entries(S)}) == keyed(CACHE)


def test_an_empty_cache_has_cut_minus_one() -> None:
    (message,) = snapshot_reply("vllm-57789", PROFILE, EngineCache(), cut=-1, ts=1.0, instance=UUID)
    snap = parse_reply("vllm-57789", message[1:])
    assert (snap.cut, snap.payloads) == (-1, [])


@pytest.mark.parametrize(
    ("design", "frames", "reason"),
    [
        ("vllm-57789", [(-2).to_bytes(8, "big", signed=True), UUID], "unavailable"),
        ("vllm-57789", [b"\x00" * 8], "bad_reply"),
        ("auto", [b"hello"], "bad_reply"),
        ("sglang-34407", [b"\x83\xa5epoch\x00\xabbarrier_seq\x05\xaaresume_seq\x05"], "bad_reply"),
        ("sglang-34407", [b"\xc1"], "bad_reply"),
        ("vllm-50134", [], "bad_reply"),
    ],
)
def test_a_reply_that_is_no_usable_snapshot_is_refused_with_its_reason(design: Any, frames: list[bytes], reason: str) -> None:
    with pytest.raises(SnapshotRefused) as e:
        parse_reply(design, frames)
    assert e.value.reason == reason


def test_a_replay_socket_without_the_design_is_told_by_its_answer() -> None:
    """An engine without #50134 reads b"snapshot" as a start seq past its buffer: the end marker alone."""
    with pytest.raises(SnapshotRefused) as e:
        replay_socket_snapshot([], 0)
    assert e.value.reason == "unsupported"
    batch = parse_replay([b"", b"", (5).to_bytes(8, "big"), encode_batch(PROFILE, 1.0, [stored(1)])])
    with pytest.raises(SnapshotRefused) as e:
        replay_socket_snapshot([batch], 0)
    assert e.value.reason == "unsupported"  # an ordinary replay, not a snapshot (no AllBlocksCleared first)


def test_a_replay_socket_snapshot_it_cannot_verify_whole_is_refused() -> None:
    """breaker32 B1, B5: vLLM #50134's replies carry no count, and a ROUTER past its high-water
    mark drops replies silently while the end marker still comes (45,510 of 60,016 blocks gone
    over real sockets, the state marked complete): only a snapshot of one reply is taken. And a
    first reply that does not decode is refused, never raised into the stream's task (it stopped
    the bridge)."""
    cleared = encode_batch(PROFILE, 1.0, [{"type": "AllBlocksCleared"}, stored(1)])
    one = parse_replay([b"", b"", (42).to_bytes(8, "big"), cleared])
    assert replay_socket_snapshot([one], 0).cut == 41
    more = parse_replay([b"", b"", (42).to_bytes(8, "big"), encode_batch(PROFILE, 1.0, [stored(2)])])
    with pytest.raises(SnapshotRefused) as e:
        replay_socket_snapshot([one, more], 0)
    assert e.value.reason == "unverifiable"
    with pytest.raises(SnapshotRefused) as e:
        replay_socket_snapshot([parse_replay([b"", b"", (42).to_bytes(8, "big"), b"\xc1 not msgpack"])], 0)
    assert e.value.reason == "undecodable"


def test_a_cut_below_what_was_handed_before_the_request_is_stale() -> None:
    """breaker32 B2: an engine that answers with an older cache (lagging, cached) than the batches
    the bridge had handed on before it asked: seeded, the state held blocks the engine had removed."""
    seeding = Seeding(1, None, 1000, handed=37)
    snap = snap_at(34)
    with pytest.raises(SnapshotRefused) as e:
        seeding.ready(snap, snapshot_events(snap), None)
    assert e.value.reason == "stale"
    fine = Seeding(1, None, 1000, handed=37)
    snap = snap_at(37)
    fine.ready(snap, snapshot_events(snap), None)
    assert fine.note(batch(38, stored(9))) is not None


def test_two_sources_sharing_a_snapshot_endpoint_are_a_config_error() -> None:
    """breaker32 B3: one engine's snapshot would seed another's state."""
    with pytest.raises(ConfigError) as e:
        from_data(
            {
                "sources": [
                    {"name": "a", "endpoint": "tcp://h:5557", "snapshot": "sglang-34407", "snapshot_endpoint": "tcp://s:6000"},
                    {"name": "b", "endpoint": "tcp://h:5567", "snapshot": "sglang-34407", "snapshot_endpoint": "tcp://s:6000"},
                ],
                "sinks": [{"type": "file", "path": "-"}],
            }
        )
    assert any(p.startswith("sources[1].snapshot_endpoint: rank 0 uses snapshot port 6000 on s") for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        config(snapshot="sglang-34407", snapshot_endpoint="tcp://h:5558", dp_ranks=2)
    assert any("overlaps its live ports 5557-5558" in p or "overlap its live ports 5557-5558" in p for p in e.value.problems), (
        e.value.problems
    )


def test_an_undecodable_chunk_refuses_the_whole_snapshot() -> None:
    (message,) = reply("vllm-57789")
    snap = parse_reply("vllm-57789", [*message[1:], b"\xc1"])
    with pytest.raises(SnapshotRefused) as e:
        snapshot_events(snap)
    assert e.value.reason == "undecodable"


# -- the seed ---------------------------------------------------------------------------------------


def batch(seq: int, *events: dict[str, Any], epoch: int = 1) -> Record:
    return Record(S, epoch, seq, events=list(events), payload=b"x" * 10)


def snap_at(cut: int) -> Any:
    (message,) = reply("vllm-57789", cut)
    return parse_reply("vllm-57789", message[1:])


def test_the_seed_goes_with_the_first_batch_above_the_cut_with_the_batches_between() -> None:
    seeding = Seeding(1, UUID, 1000)
    assert seeding.note(batch(40, stored(50))) is None  # before the snapshot came: kept
    assert seeding.note(batch(42, stored(51))) is None
    snap = snap_at(41)
    seeding.ready(snap, snapshot_events(snap), UUID)
    assert [r.seq for r in seeding.kept] == [42]  # the one at or below the cut is in the snapshot
    seed = seeding.note(batch(43, stored(52)))
    assert seed is not None and (seed.kind, seed.seq, seed.from_seq, seed.reason) == ("StateSeeded", 43, 41, "vllm-57789")
    assert seed.events == [*snapshot_events(snap), stored(51)]


def test_a_seed_waits_for_a_batch_above_its_cut() -> None:
    seeding = Seeding(1, None, 1000)
    snap = snap_at(41)
    seeding.ready(snap, snapshot_events(snap), None)
    assert seeding.note(batch(40)) is None
    assert seeding.note(batch(41)) is None
    assert seeding.note(events_lost(S, 1, 30, 41, "unrecoverable", 0.0)) is None  # at or below the cut: the snapshot covers it
    assert seeding.note(batch(42)) is not None


@pytest.mark.parametrize(
    "record",
    [events_lost(S, 1, 42, 44, "replay_buffer_exceeded", 0.0), source_reset(S, 2, "publisher_restart", 0.0), batch(42, epoch=2)],
)
def test_a_loss_above_the_cut_or_a_new_epoch_abandons_the_seed(record: Record) -> None:
    seeding = Seeding(1, None, 1000)
    snap = snap_at(41)
    seeding.ready(snap, snapshot_events(snap), None)
    with pytest.raises(SnapshotRefused) as e:
        seeding.note(record)
    assert e.value.reason == "overtaken"


def test_a_loss_above_the_cut_before_the_snapshot_came_abandons_it() -> None:
    seeding = Seeding(1, None, 1000)
    seeding.note(events_lost(S, 1, 42, 44, "replay_buffer_exceeded", 0.0))
    snap = snap_at(41)
    with pytest.raises(SnapshotRefused) as e:
        seeding.ready(snap, snapshot_events(snap), None)
    assert e.value.reason == "overtaken"


def test_a_snapshot_of_another_publisher_is_refused() -> None:
    seeding = Seeding(1, UUID, 1000)
    snap = snap_at(41)
    with pytest.raises(SnapshotRefused) as e:
        seeding.ready(snap, snapshot_events(snap), bytes(16))
    assert e.value.reason == "other_instance"


def test_the_span_kept_while_the_snapshot_is_read_is_bounded() -> None:
    seeding = Seeding(1, None, 25)
    seeding.note(batch(1))
    seeding.note(batch(2))
    with pytest.raises(SnapshotRefused) as e:
        seeding.note(batch(3))
    assert e.value.reason == "too_large"


def test_a_seed_over_an_undecoded_batch_is_abandoned() -> None:
    seeding = Seeding(1, None, 1000)
    seeding.note(Record(S, 1, 42, event_count=3))  # counted, not decoded
    snap = snap_at(41)
    seeding.ready(snap, snapshot_events(snap), None)
    with pytest.raises(SnapshotRefused) as e:
        seeding.note(batch(43))
    assert e.value.reason == "undecodable"


# -- the state and the output -------------------------------------------------------------------------


def test_a_seeded_batch_makes_an_incomplete_state_complete_and_equal_to_the_cache() -> None:
    tracker = StateTracker()
    tracker.apply(batch(40, stored(99)))  # met mid-epoch: incomplete, with a block the engine dropped since
    tracker.apply(events_lost(S, 1, 41, 41, "replay_buffer_exceeded", 0.0))
    head = tracker.head(S)
    assert head is not None and not head.complete
    snap = snap_at(41)
    seeding = Seeding(1, None, 1000)
    seeding.ready(snap, snapshot_events(snap), None)
    record = batch(42, stored(8))  # the first batch above the cut: it carries the seed
    record.seed = seeding.note(record)
    delta = tracker.apply(record)
    assert delta.clear and delta.head.complete and delta.head.seq == 42
    want = keyed(CACHE)
    want[("GPU", 0, 8)] += 1
    assert Counter({(m, g, k): c for m, g, k, c, _v in tracker.entries(S)}) == want
    assert 99 not in {k for _m, _g, k, _c, _v in tracker.entries(S)}


@pytest.mark.parametrize(("fmt", "granularity"), [("json", "event"), ("json", "batch"), ("msgpack", "event"), ("raw", "batch")])
def test_a_seeded_batch_is_followed_by_its_state_seeded_record(fmt: Any, granularity: Any) -> None:
    record = batch(42, stored(8))
    record.payload = encode_batch(PROFILE, 1.0, record.events)
    record.seed = Record(S, 1, 42, "StateSeeded", events=[], from_seq=41, reason="vllm-57789")
    messages = Renderer(fmt, granularity).render(record)
    last = messages[-1]
    assert last.type == SEED_TYPE and last.position == (1, 43, SEED_SUB)
    assert all(m.position < last.position for m in messages[:-1])
    assert last.msg_id == "a/0/1/42/seeded"
    if fmt == "json":
        import json

        body = json.loads(last.value)
        assert {k: body[k] for k in ("type", "epoch", "seq", "cut", "design")} == {
            "type": "StateSeeded",
            "epoch": 1,
            "seq": 42,
            "cut": 41,
            "design": "vllm-57789",
        }


def test_a_state_seeded_entry_id_sorts_between_its_batch_and_its_state_in_both_layouts() -> None:
    for epoch in (1, WIDE_EPOCHS + 1):
        ids = [entry_id((epoch, 43, sub)) for sub in (0, 5, SEED_SUB, SEED_SUB + 1)]
        positions = [entry_position(i) for i in ids]
        assert positions == sorted(positions) and len(set(ids)) == 4


# -- configuration ----------------------------------------------------------------------------------


def config(**source: Any) -> Any:
    return from_data({"sources": [{"name": "a", "endpoint": "tcp://h:5557", **source}], "sinks": [{"type": "file", "path": "-"}]})


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ({"snapshot_endpoint": "tcp://h:5559"}, "sources[0].snapshot_endpoint: set, but snapshot is off"),
        (
            {"snapshot": "vllm-57789"},
            "sources[0].snapshot: vllm-57789 is served on a snapshot socket of its own: set snapshot_endpoint",
        ),
        ({"snapshot": "sglang-34407"}, "sources[0].snapshot: sglang-34407 is served on a snapshot socket"),
        ({"snapshot": "vllm-50134"}, "sources[0].snapshot: vllm-50134 is served on the replay socket: set replay_endpoint"),
        ({"snapshot": "auto"}, "sources[0].snapshot: auto needs snapshot_endpoint"),
        ({"snapshot": "yes"}, "sources[0].snapshot"),
        ({"snapshot": "auto", "snapshot_endpoint": "h:5559"}, "sources[0].snapshot_endpoint"),
    ],
)
def test_a_snapshot_without_its_socket_is_a_config_error(source: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as e:
        config(**source)
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_snapshot_bounds_have_defaults_and_are_checked() -> None:
    cfg = config(snapshot="auto", snapshot_endpoint="tcp://h:5559")
    assert (cfg.snapshots.max_concurrent, cfg.snapshots.timeout, cfg.snapshots.max_bytes) == (2, 30.0, 256 * 2**20)
    with pytest.raises(ConfigError) as e:
        from_data(
            {
                "sources": [{"name": "a", "endpoint": "tcp://h:5557"}],
                "sinks": [{"type": "file", "path": "-"}],
                "snapshots": {"max_concurrent": 0, "timeout": "0s"},
            }
        )
    assert any(p.startswith("snapshots.max_concurrent") for p in e.value.problems), e.value.problems
    assert any(p.startswith("snapshots.timeout") for p in e.value.problems), e.value.problems


# -- consumers --------------------------------------------------------------------------------------


def test_a_consumer_following_an_incomplete_stream_is_told_to_bootstrap_again() -> None:
    from kv_consumer.state import StreamState

    state = StreamState()
    header = {"source": "a", "dp_rank": 0, "epoch": 1}
    state.apply({**header, "seq": 4, "type": "EventsLost", "from_seq": 0, "to_seq": 4, "count": 5, "reason": "joined_late"})
    state.apply({**header, "seq": 5, "type": "EventBatch", "events": [stored(8)]})
    assert not state.complete and not state.rebootstrap
    assert state.apply({**header, "seq": 5, "type": "StateSeeded", "cut": 4, "design": "vllm-50134"})
    assert state.rebootstrap and not state.complete and "(1, 5): bootstrap again" in state.why
    assert state.blocks() == {("GPU", 0, 8): 1}  # what the messages brought stays, a subset
    state.apply({**header, "seq": 6, "type": "EventBatch", "events": [{"type": "AllBlocksCleared"}]})
    assert state.complete and not state.rebootstrap


# -- --check ----------------------------------------------------------------------------------------


def test_check_probes_each_snapshot_endpoint(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A snapshot endpoint is asked which socket answers, like the others (nothing is requested):
    a ROUTER is right; the engine's PUB there is named, with the fix."""
    import zmq

    from bridge.cli import EXIT_UNREACHABLE, check

    ctx = zmq.Context()
    try:
        pub, pub2, router, snap = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        stray = ctx.socket(zmq.PUB)  # another engine's live port (a's own would be refused by the config check)
        live, live2, replay, good, wrong = (s.bind_to_random_port("tcp://127.0.0.1") for s in (pub, pub2, router, snap, stray))
        p = tmp_path / "c.yaml"
        p.write_text(
            "sources:\n"
            f"  - {{name: a, endpoint: 'tcp://127.0.0.1:{live}', snapshot: auto, snapshot_endpoint: 'tcp://127.0.0.1:{good}'}}\n"
            f"  - {{name: b, endpoint: 'tcp://127.0.0.1:{live2}', replay_endpoint: 'tcp://127.0.0.1:{replay}',"
            f" snapshot: vllm-57789, snapshot_endpoint: 'tcp://127.0.0.1:{wrong}'}}\n"
            "sinks:\n  - {type: file, path: '-'}\n"
        )
        assert check(str(p)) == EXIT_UNREACHABLE
    finally:
        ctx.destroy(linger=0)
    out, err = capsys.readouterr()
    assert "engines: 4 of 5 endpoint(s) answer as they should" in out
    assert (
        f"sources[1].snapshot_endpoint: tcp://127.0.0.1:{wrong}: a PUB socket answers, not ROUTER or REP; this looks like "
        "the engine's live PUB port: give its snapshot_endpoint port here"
    ) in err


# -- the client's bounds (real sockets) ------------------------------------------------------------


async def test_the_client_bounds_time_bytes_and_concurrent_snapshots() -> None:
    """A snapshot socket that never answers: ``timeout``; a second snapshot while the only slot is
    held: ``busy``; a reply larger than ``max_bytes``: ``too_large``. Each a SnapshotRefused."""
    import asyncio

    import zmq
    import zmq.asyncio

    from bridge.snapshot import SnapshotClient

    ctx = zmq.asyncio.Context()
    silent, big = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    try:
        quiet = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
        large = f"tcp://127.0.0.1:{big.bind_to_random_port('tcp://127.0.0.1')}"
        client = SnapshotClient(ctx, max_concurrent=1, timeout=0.3, max_bytes=1000)
        await client.slots.acquire()  # another stream's snapshot holds the only slot
        with pytest.raises(SnapshotRefused) as e:
            await client.take(quiet, "vllm-57789")
        assert e.value.reason == "busy"
        client.slots.release()
        with pytest.raises(SnapshotRefused) as e:
            await client.take(quiet, "vllm-57789")
        assert e.value.reason == "timeout"
        assert not client.slots.locked()  # (its slot given back)

        async def answer_big() -> None:
            ident, _empty, _request = await big.recv_multipart()
            await big.send_multipart([ident, b"", (5).to_bytes(8, "big"), UUID, *([b"\x90" * 400] * 3)])

        server = asyncio.ensure_future(answer_big())
        with pytest.raises(SnapshotRefused) as e:
            await SnapshotClient(ctx, max_concurrent=1, timeout=2.0, max_bytes=1000).take(large, "auto")
        assert e.value.reason == "too_large"  # (each frame under it; one frame over it: ZMQ drops it, a timeout)
        await server
    finally:
        silent.close(linger=0)
        big.close(linger=0)
        ctx.destroy(linger=0)


def test_discovered_engines_take_the_discovery_snapshot_settings() -> None:
    from bridge.discovery import source_for

    cfg = from_data(
        {
            "discovery": {"dns": {"name": "vllm.default.svc", "snapshot": "auto", "snapshot_port": 5560}},
            "sinks": [{"type": "file", "path": "-"}],
        }
    )
    assert cfg.discovery.dns is not None
    source = source_for(cfg.discovery.dns, "10.0.0.7", "vllm")
    assert (source.snapshot, source.snapshot_endpoint) == ("auto", "tcp://10.0.0.7:5560")
    with pytest.raises(ConfigError) as e:
        from_data({"discovery": {"dns": {"name": "x", "snapshot": "vllm-57789"}}, "sinks": [{"type": "file", "path": "-"}]})
    assert any("discovery.dns" in p and "set snapshot_port" in p for p in e.value.problems), e.value.problems
