"""Output formats: json / msgpack / raw, event and batch granularity, control records, hashes."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.formats import SEED_TYPE, STATE_TYPE, Envelope, Message, Renderer, hex64, json_event, sample_message
from bridge.records import Record, Stream, events_lost, source_reset
from bridge.schema import SCHEMA_VERSION, EventRecordHeader
from tests.support.strategies import examples

STREAM = Stream("llama-a", 1, {"model": "m"})
EVENTS = [
    {"type": "BlockStored", "block_hashes": [2**64 - 1, 5], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 16},
    {"type": "BlockRemoved", "block_hashes": [b"\xab" * 32], "medium": "GPU"},
    {"type": "AllBlocksCleared"},
]
RECORD = Record(stream=STREAM, epoch=2, seq=42, ts=1732870000.25, payload=b"\x93raw", events=EVENTS)


def test_json_event() -> None:
    msgs = Renderer("json", "event").render(RECORD)
    assert [m.index for m in msgs] == [0, 1, 2]
    first = json.loads(msgs[0].value)
    assert first == {
        "source": "llama-a",
        "dp_rank": 1,
        "epoch": 2,
        "seq": 42,
        "index": 0,
        "ts": 1732870000.25,
        "schema_version": 1,
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, 5],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 16,
    }
    assert json.loads(msgs[1].value)["block_hashes"] == ["ab" * 32]
    assert json.loads(msgs[2].value) == {k: first[k] for k in ("source", "dp_rank", "epoch", "seq", "ts", "schema_version")} | {
        "index": 2,
        "type": "AllBlocksCleared",
    }
    assert msgs[1].msg_id == "llama-a/1/2/42/1" and msgs[1].position == (2, 43, 2)
    assert msgs[0].headers["index"] == "0" and msgs[0].headers["type"] == "BlockStored"
    assert msgs[0].key == b"llama-a/1"
    assert EVENTS[1]["block_hashes"] == [b"\xab" * 32]  # the shared record is not modified


def test_hex_hash_format() -> None:
    msgs = Renderer("json", "event", "hex").render(RECORD)
    assert json.loads(msgs[0].value)["block_hashes"] == ["ffffffffffffffff", "0000000000000005"]
    assert hex64(-1) == "ffffffffffffffff"


def test_json_batch() -> None:
    (m,) = Renderer("json", "batch").render(RECORD)
    body = json.loads(m.value)
    assert body["seq"] == 42 and "index" not in body and len(body["events"]) == 3
    assert body["events"][1]["block_hashes"] == ["ab" * 32]
    assert m.msg_id == "llama-a/1/2/42" and m.type == "EventBatch"
    assert body["type"] == "EventBatch" == m.headers["type"]  # every record says its kind, as its headers do


def test_msgpack_keeps_binary_and_uint64() -> None:
    msgs = Renderer("msgpack", "event").render(RECORD)
    assert msgspec.msgpack.decode(msgs[1].value)["block_hashes"] == [b"\xab" * 32]
    assert msgspec.msgpack.decode(msgs[0].value)["block_hashes"][0] == 2**64 - 1
    (b,) = Renderer("msgpack", "batch").render(RECORD)
    assert msgspec.msgpack.decode(b.value)["events"] == EVENTS
    assert msgspec.msgpack.decode(b.value)["type"] == "EventBatch"


def test_raw_is_the_payload_untouched() -> None:
    (m,) = Renderer("raw", "event").render(RECORD)
    assert m.value == b"\x93raw"
    assert m.headers == {
        "source": "llama-a",
        "dp_rank": "1",
        "epoch": "2",
        "seq": "42",
        "type": "EventBatch",
        "content-type": "application/vnd.kv-events.msgpack",
        "schema_version": "1",
        "ts": "1732870000.25",
    }


def test_control_records() -> None:
    reset = source_reset(STREAM, 3, "publisher_restart", 0.0)
    lost = events_lost(STREAM, 3, 0, 4, "replay_unavailable", 0.0)
    for fmt in ("json", "raw"):
        (r,) = Renderer(fmt, "event").render(reset)
        (lo,) = Renderer(fmt, "event").render(lost)
        assert json.loads(r.value) == {
            "source": "llama-a",
            "dp_rank": 1,
            "epoch": 3,
            "seq": 0,
            "schema_version": 1,
            "type": "SourceReset",
            "reason": "publisher_restart",
        }
        assert json.loads(lo.value) == {
            "source": "llama-a", "dp_rank": 1, "epoch": 3, "seq": 4, "schema_version": 1, "type": "EventsLost",
            "from_seq": 0, "to_seq": 4, "count": 5, "reason": "replay_unavailable",
        }  # fmt: skip
        assert r.position < lo.position
        assert r.msg_id == "llama-a/1/3/reset" and lo.msg_id == "llama-a/1/3/lost/0-4"
    (m,) = Renderer("msgpack", "event").render(lost)
    assert msgspec.msgpack.decode(m.value)["type"] == "EventsLost"


def test_a_ts_of_zero_is_a_ts_not_a_missing_one() -> None:
    """0.0 is falsy: the header and the body still carry it (a clock at the epoch is still a clock)."""
    payload = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}], 0])
    record = Record(stream=Stream("z", 0), epoch=1, seq=3, ts=0.0, payload=payload, events=[{"type": "AllBlocksCleared"}])
    for fmt in ("json", "msgpack", "raw"):
        for granularity in ("event", "batch"):
            (message,) = Renderer(fmt, granularity).render(record)
            assert message.headers["ts"] == "0.0", (fmt, granularity, message.headers)
            if fmt == "json":
                assert json.loads(message.value)["ts"] == 0.0


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_an_engines_own_shadowed_field_is_kept_under_shadowed_not_replaced(fmt: str) -> None:
    """Found by a breaker: an event with its own ``shadowed`` and a header-named field lost the
    engine's ``shadowed`` value."""
    event = {"type": "Future", "shadowed": {"engine": "data"}, "seq": 7}
    record = Record(stream=Stream("s", 0), epoch=1, seq=3, ts=1.0, payload=b"x", events=[event])
    (message,) = Renderer(fmt, "event").render(record)
    body = msgspec.json.decode(message.value) if fmt == "json" else msgspec.msgpack.decode(message.value)
    assert body["seq"] == 3 and body["shadowed"] == {"shadowed": {"engine": "data"}, "seq": 7}


@pytest.mark.parametrize("fmt", ["json/event", "json/batch", "msgpack/event", "msgpack/batch"])
def test_a_batch_the_decoder_proved_plain_renders_as_when_every_value_is_checked(fmt: str) -> None:
    """``Record.plain`` only skips the renderer's checks: the bytes written are the same, for
    every engine generation the simulator speaks, both hash formats and a header-named field."""
    from bridge.simulator import PROFILES, EventFactory, encode_batch
    from bridge.wire import decode_batch

    f, g = fmt.split("/")
    for name, profile in PROFILES.items():
        events = EventFactory(profile, seed=3).batch(6)
        events[0] = {**events[0], "seq": 7}  # a field named like a header key goes under "shadowed"
        batch = decode_batch(encode_batch(profile, 2.5, events, 0))
        assert batch.plain == ("bytes" not in name), name
        for hash_format in ("int", "hex"):
            renderer = Renderer(f, g, hash_format)
            checked = Record(stream=Stream("e", 0), epoch=1, seq=4, ts=batch.ts, events=batch.events, plain=False)
            trusted = msgspec.structs.replace(checked, plain=batch.plain)
            assert [m.value for m in renderer.render(trusted)] == [m.value for m in renderer.render(checked)], (name, hash_format)


def test_sinks_sharing_a_renderer_take_one_rendering_of_each_batch() -> None:
    from bridge import formats

    renderer = Renderer("json", "event")
    renderer.sharers = 3
    stream = Stream("e", 0)
    batches = [Record(stream=stream, epoch=1, seq=s, events=[{"type": "BlockRemoved", "block_hashes": [s]}]) for s in range(3)]
    first = [renderer.render(b) for b in batches]
    # The other two sinks get the very same messages; after the last, the batch is forgotten.
    assert all(renderer.render(b) is m for b, m in zip(batches, first, strict=True))
    assert all(renderer.render(b) is m for b, m in zip(batches, first, strict=True))
    again = renderer.render(batches[0])
    assert again is not first[0] and [m.value for m in again] == [m.value for m in first[0]]
    renderer.render(batches[0])
    renderer.render(batches[0])  # the three sharers of the second rendering have taken it
    # Control records are rendered per sink (rare, and tiny).
    reset = source_reset(stream, 2, "publisher_restart", 0.0)
    assert renderer.render(reset) is not renderer.render(reset)
    # A sink far behind (or one that dropped a batch) renders it again: the kept ones are bounded.
    many = [Record(stream=stream, epoch=1, seq=s, events=[{"type": "AllBlocksCleared"}]) for s in range(formats.SHARED_MAX + 5)]
    kept = [renderer.render(b) for b in many]
    assert renderer.render(many[0]) is not kept[0]
    assert renderer.render(many[-1]) is kept[-1]
    assert len(renderer._shared) <= formats.SHARED_MAX


def test_the_batches_kept_for_sharing_sinks_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from bridge import formats

    monkeypatch.setattr(formats, "SHARED_MAX_BYTES", 6_000)
    renderer = Renderer("json", "batch")
    renderer.sharers = 2
    stream = Stream("e", 0)
    big = [{"type": "BlockStored", "token_ids": list(range(1000))}]  # ~4 KB rendered: one fits
    batches = [Record(stream=stream, epoch=1, seq=s, events=big) for s in range(5)]
    kept = [renderer.render(b) for b in batches]
    assert len(renderer._shared) == 1 and renderer._shared_bytes == len(kept[-1][0].value)
    assert renderer.render(batches[-1]) is kept[-1] and renderer._shared_bytes == 0
    assert renderer.render(batches[0]) is not kept[0]  # pushed out: rendered again, the same bytes


@pytest.mark.parametrize("fmt", ["json/event", "json/batch", "msgpack/event", "msgpack/batch", "raw/batch"])
def test_every_messages_headers_follow_the_contract_and_their_encoded_pairs_agree(fmt: str) -> None:
    """Headers are built from the record's envelope when read: the same fields, in the same order,
    for every kind of message, and ``header_items`` is exactly them encoded (what Kafka sends)."""
    f, g = fmt.split("/")
    renderer = Renderer(f, g)
    no_ts = msgspec.structs.replace(RECORD, ts=None)
    named = msgspec.structs.replace(RECORD, instance=b"\x5f" * 16)  # (a publisher that sends its UUID)
    records = [RECORD, no_ts, named, source_reset(STREAM, 3, "publisher_restart", 0.0), events_lost(STREAM, 3, 0, 4, "gap", 0.0)]
    for record in records:
        messages = renderer.render(record)
        for m in messages:
            expected = {
                "source": "llama-a",
                "dp_rank": "1",
                "epoch": str(record.epoch),
                "seq": str(record.seq),
                "type": m.type,
                "content-type": m.headers["content-type"],
                "schema_version": "1",
            }
            if record.ts is not None:
                expected["ts"] = repr(record.ts)
            if record.instance is not None:
                expected["instance"] = "5f" * 16
            if m.index is not None:
                expected["index"] = str(m.index)
                if m is messages[-1]:
                    expected["last"] = "1"  # (the batch's last event: a sink holding it holds the batch whole)
            assert list(m.headers.items()) == list(expected.items())
            assert m.header_items() == [(k, v.encode()) for k, v in expected.items()]
            m.headers["type"] = "changed"  # each read is the message's own copy
            assert m.headers["type"] == m.type


@settings(max_examples=examples(300), deadline=None)
@given(
    source=st.text(min_size=1, max_size=12),
    dp_rank=st.integers(0, 2**31),
    epoch=st.integers(0, 2**63),
    seq=st.integers(0, 2**64 - 1),
    ts=st.none() | st.floats(allow_nan=True) | st.integers(-(2**53), 2**53),
    n=st.integers(1, 3),
)
def test_a_json_event_is_its_header_then_its_fields_byte_for_byte(
    source: str, dp_rank: int, epoch: int, seq: int, ts: float | int | None, n: int
) -> None:
    """The header spliced in front of each event (cached per stream and epoch across batches)
    is exactly the schema's EventRecordHeader encoded, with the event's fields after it."""
    renderer = Renderer("json", "event")
    stream = Stream(source, dp_rank)
    events: list[dict[str, Any]] = [{"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU"} for i in range(n)]
    for s in (seq, seq // 2):  # a second batch of the same stream and epoch takes the kept header
        record = Record(stream=stream, epoch=epoch, seq=s, ts=ts, payload=b"x", events=events, plain=True)
        for i, m in enumerate(renderer.render(record)):
            header = msgspec.json.encode(EventRecordHeader(source, dp_rank, epoch, s, i, ts, SCHEMA_VERSION))
            assert m.value == header[:-1] + b"," + msgspec.json.encode(events[i])[1:]


def test_envelopes_are_equal_by_header_and_id_and_never_hashed() -> None:
    s = Stream("e", 0)
    a = Envelope(Record(stream=s, epoch=1, seq=2, ts=1.5), "EventBatch", "application/json")
    same = Envelope(Record(stream=s, epoch=1, seq=2, ts=1.5), "EventBatch", "application/json")
    other_id = Envelope(Record(stream=s, epoch=1, seq=2, ts=1.5), "EventBatch", "application/json", given_id="x")
    other_ts = Envelope(Record(stream=s, epoch=1, seq=2, ts=2.5), "EventBatch", "application/json")
    assert a == same
    assert not a == other_id and not a == other_ts and not a == "e/0/1/2"  # noqa: SIM201 (__eq__ itself)
    with pytest.raises(TypeError):
        hash(a)  # mutable (its fields are built on first use): never a dict key


def test_an_event_past_the_4096th_names_its_index_too() -> None:
    events = [{"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU"} for i in range(4098)]
    record = Record(stream=Stream("e", 0), epoch=1, seq=2, ts=1.5, events=events)
    msgs = Renderer("json", "event").render(record)
    assert [m.headers["index"] for m in msgs[4095:]] == ["4095", "4096", "4097"]
    assert [dict(m.header_items())["index"] for m in msgs[4095:]] == [b"4095", b"4096", b"4097"]
    assert [m.msg_id for m in msgs[4095:]] == ["e/0/1/2/4095", "e/0/1/2/4096", "e/0/1/2/4097"]


def test_a_message_s_event_is_the_one_it_carries() -> None:
    events = [{"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU"} for i in range(3)]
    record = Record(stream=Stream("e", 0), epoch=1, seq=2, ts=1.5, events=events)
    assert [m.event for m in Renderer("json", "event").render(record)] == events
    assert [m.event for m in Renderer("json", "batch").render(record)] == [None]
    (lost,) = Renderer("json", "event").render(events_lost(Stream("e", 0), 1, 3, 3, "x", 1.0))
    assert lost.event is None


def test_a_sample_message_is_its_stream_s_seq_0_of_epoch_0_unless_told() -> None:
    assert sample_message(Stream("e", 0)).record.position == (0, 1)
    assert sample_message(Stream("e", 0), epoch=4).record.position == (4, 1)


@pytest.mark.parametrize("granularity", ["batch", "event"])
def test_binary_anywhere_in_an_event_goes_out_as_hex_in_json(granularity: str) -> None:
    """A batch not proven plain by the decoder: bytes in a list, as a field, or inside a map are
    written as hex; scalars and lists of scalars as they are."""
    binary = {"type": "BlockStored", "block_hashes": [b"\x01\x02", 7], "extra": b"\xff", "nested": {"a": b"\x01"}}
    scalars = {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU", "token_ids": [3, 4], "lora_name": None}
    record = Record(stream=Stream("e", 0), epoch=1, seq=2, ts=1.5, events=[binary, scalars])
    bodies = [json.loads(m.value) for m in Renderer("json", granularity).render(record)]
    events = bodies[0]["events"] if granularity == "batch" else bodies
    assert {k: events[0][k] for k in ("block_hashes", "extra", "nested")} == {
        "block_hashes": ["0102", 7],
        "extra": "ff",
        "nested": {"a": "01"},
    }
    assert {k: events[1][k] for k in scalars} == scalars


def test_binary_outside_any_list_goes_out_as_hex_in_json() -> None:
    event = {"type": "Future", "extra": b"\xff", "nested": {"a": b"\x01"}}
    record = Record(stream=Stream("e", 0), epoch=1, seq=2, ts=1.5, events=[event])
    (body,) = [json.loads(m.value) for m in Renderer("json", "event").render(record)]
    assert (body["extra"], body["nested"]) == ("ff", {"a": "01"})


def test_a_json_event_keeps_integer_hashes_as_numbers_without_hash_hex_even_when_it_is_fixed_up() -> None:
    event = {"type": "BlockStored", "block_hashes": [7, 2**64 - 1], "parent_block_hash": 5, "extra": b"\x01"}
    assert json_event(event, False) == {**event, "extra": "01"}  # (the bytes made JSON, the hashes as they are)
    assert json_event(event, True) == {
        **event,
        "block_hashes": [hex64(7), hex64(2**64 - 1)],
        "parent_block_hash": hex64(5),
        "extra": "01",
    }


def test_a_state_seeded_record_sorts_after_its_batchs_events_and_before_its_state() -> None:
    seed = sample_message(STREAM, SEED_TYPE, epoch=2)
    state = sample_message(STREAM, STATE_TYPE, epoch=2)
    event = Message(seed.record, 2**24, "BlockStored", b"", seed.envelope)
    assert event.position < seed.position < state.position
    assert (seed.position[2], state.position[2]) == (2**64 - 2, 2**64 - 1)  # the last two subs of 64 bits


def test_a_renderer_starts_with_one_sink_that_keeps_nothing_for_others_and_each_sink_added_counts() -> None:
    renderer = Renderer("json", "event")
    batch = Record(stream=Stream("e", 0), epoch=1, seq=0, events=[{"type": "AllBlocksCleared"}])
    first = renderer.render(batch)
    assert renderer.render(batch) is not first and renderer._shared == {}  # no other sink to keep it for
    renderer.sharers += 1  # what the runtime does for each further sink of the same renderer
    shared = renderer.render(batch)
    assert renderer.render(batch) is shared and renderer._shared == {}  # taken by both: forgotten


def test_a_batch_seeded_from_a_snapshot_renders_its_own_messages_then_its_state_seeded_record() -> None:
    seed = Record(stream=STREAM, epoch=2, seq=42, kind="StateSeeded", events=[], from_seq=40, reason="d1")
    seeded = Record(stream=STREAM, epoch=2, seq=42, ts=RECORD.ts, payload=RECORD.payload, events=EVENTS, seed=seed)
    for fmt, granularity in (("json", "event"), ("json", "batch"), ("raw", "batch")):
        renderer = Renderer(fmt, granularity)
        messages = renderer.render(seeded)
        plain = Renderer(fmt, granularity).render(RECORD)
        assert [m.value for m in messages[:-1]] == [m.value for m in plain]
        last = messages[-1]
        assert (last.type, last.record, last.index) == (SEED_TYPE, seed, None)
        assert last.position == (2, 43, 2**64 - 2) and last.msg_id == "llama-a/1/2/42/seeded"


def test_an_event_whose_type_is_not_text_goes_out_as_unknown() -> None:
    events = [{"type": "BlockStored"}, {"type": 5, "block_hashes": [1]}, {"block_hashes": [2]}]
    record = Record(stream=STREAM, epoch=2, seq=1, events=events)
    for fmt in ("json", "msgpack"):
        assert [m.type for m in Renderer(fmt, "event").render(record)] == ["BlockStored", "Unknown", "Unknown"]


def test_the_encoded_headers_kept_per_stream_and_epoch_are_bounded() -> None:
    renderer = Renderer("json", "event")
    for epoch in range(4100):
        renderer.render(Record(stream=STREAM, epoch=epoch, seq=0, events=[{"type": "AllBlocksCleared"}]))
        assert len(renderer._heads) <= 4096
