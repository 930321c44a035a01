"""Wire decoding: every captured vector, both replay shapes, round trips and hostile bytes."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge import wire
from bridge.errors import DecodeError
from bridge.simulator import PROFILES, EventFactory, encode_batch
from tests.support.strategies import examples, msgpack_values
from tests.support.vectors import expected_events, expected_ts, load_all, plain

VECTORS = load_all()
PAYLOADS = [v for v in VECTORS if v.kind in ("live", "replay")]


def _payload(v: Any) -> tuple[int, bytes]:
    if v.kind == "live":
        f = wire.parse_live(v.frames)
        return f.seq, f.payload
    r = wire.parse_replay(v.frames)
    return r.seq, r.payload


def test_vectors_are_present() -> None:
    files = {v.file for v in VECTORS}
    assert len(files) >= 10 and {"vllm-0.9.0", "vllm-0.33.0", "sglang-0.5.8", "vllm-unreleased-map-batch"} <= files


@pytest.mark.parametrize("vector", PAYLOADS, ids=lambda v: f"{v.file}-{v.kind}-r{v.dp_rank}")
def test_every_vector_decodes_to_its_content(vector: Any) -> None:
    _seq, payload = _payload(vector)
    batch = wire.decode_batch(payload)
    assert not batch.bad_events
    assert [plain(e) for e in batch.events] == expected_events(vector.decoded, vector.expected)
    d = vector.decoded
    assert batch.ts == expected_ts(d)
    if isinstance(d, list):
        assert batch.dp_rank == (d[2] if len(d) > 2 else None)
    else:
        assert batch.dp_rank == d["data_parallel_rank"]


@pytest.mark.parametrize("vector", [v for v in VECTORS if v.kind.startswith("replay")], ids=lambda v: f"{v.file}-{v.kind}")
def test_replay_replies_with_and_without_topic_frame(vector: Any) -> None:
    reply = wire.parse_replay([b"", *vector.frames])  # as the DEALER receives it
    assert reply.end == (vector.kind == "replay_end")
    assert wire.parse_replay(vector.frames) == reply  # without the delimiter too
    if not reply.end:
        assert reply.seq >= vector.request_from


@pytest.mark.parametrize("vector", PAYLOADS, ids=lambda v: f"{v.file}-{v.kind}-r{v.dp_rank}")
def test_simulator_reproduces_vector_bytes(vector: Any) -> None:
    _seq, payload = _payload(vector)
    batch = wire.decode_batch(payload)
    profile = PROFILES[vector.file]
    # An RFC 1527 profile writes the producer's own maps (the bridge's normalisation adds names).
    events = vector.decoded[1] if profile.rfc1527 else batch.events
    assert encode_batch(profile, batch.ts, events, batch.dp_rank or 0) == payload


def _shape(e: Any) -> Any:
    return len(e) if isinstance(e, list) else tuple(e)


# (The RFC 1527 profile writes the producer's own maps, checked byte for byte above.)
@pytest.mark.parametrize("name", sorted(set(PROFILES) - {"vllm-unreleased-map-batch", "mooncake-master-pr2214"}))
def test_simulator_events_have_the_release_shape(name: str) -> None:
    """Generated events carry exactly the keys (map) or arity (array) of the release's vector."""
    shapes: dict[str, set[Any]] = {}
    for v in VECTORS:
        if v.file == name and v.kind == "live":
            for e in v.decoded[1]:
                shapes.setdefault(e[0] if isinstance(e, list) else e["type"], set()).add(_shape(e))
    factory = EventFactory(PROFILES[name], seed=1)
    got: dict[str, set[Any]] = {}
    for _ in range(50):
        raw = msgspec.msgpack.decode(encode_batch(PROFILES[name], 1.0, factory.batch(8), 0))
        for e in raw[1]:
            got.setdefault(e[0] if isinstance(e, list) else e["type"], set()).add(_shape(e))
    for tag in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        if tag in shapes and tag in got:
            assert got[tag] == shapes[tag], (tag, got[tag], shapes[tag])


def test_live_frame_errors() -> None:
    good = [b"", (5).to_bytes(8, "big"), b"\x92\xcb" + b"\x00" * 8 + b"\x90"]
    assert wire.parse_live(good).seq == 5
    for frames, reason in [
        (good[:2], "bad_frames"),
        ([*good, b"x"], "bad_frames"),
        ([b"", b"\x00" * 7, good[2]], "bad_seq"),
        ([b"", b"\x00" * 9, good[2]], "bad_seq"),
        ([b"", b"\xff" * 8, good[2]], "bad_seq"),  # the replay end marker's seq, never a batch's
        ([b"", b"\xff" * 8 + b"A" * 16, good[2]], "bad_seq"),
    ]:
        with pytest.raises(DecodeError) as exc:
            wire.parse_live(frames)
        assert exc.value.reason == reason


def test_malformed_event_is_isolated() -> None:
    payload = msgspec.msgpack.encode(
        [1.5, [["BlockStored", [1], None, [1, 2], 16, None], 7, {"no": "type"}, ["AllBlocksCleared"], [], ["NewThing", 1, 2]], 3]
    )
    batch = wire.decode_batch(payload)
    assert [e["type"] for e in batch.events] == ["BlockStored", "AllBlocksCleared", "NewThing"]
    assert [b.index for b in batch.bad_events] == [1, 2, 4]
    assert batch.events[2] == {"type": "NewThing", "extra": [1, 2]}
    assert batch.dp_rank == 3


def test_unknown_fields_kept() -> None:
    # (Array position 12 is ROCm ATOM's token_offset: vLLM's array generation ended at 11 fields.)
    stored = ["BlockStored", [1], None, [0] * 16, 16, None, "GPU", None, None, 0, "full", None, 48, "future"]
    batch = wire.decode_batch(
        msgspec.msgpack.encode([1.0, [stored, {"type": "BlockRemoved", "block_hashes": [2], "new_key": 9}]])
    )
    assert batch.events[0]["token_offset"] == 48 and batch.events[0]["extra"] == ["future"]
    assert batch.events[1]["new_key"] == 9


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "bad_msgpack"),
        (b"\xc1", "bad_msgpack"),
        (msgspec.msgpack.encode([1.0]), "bad_batch"),
        (msgspec.msgpack.encode("str"), "bad_batch"),
        (msgspec.msgpack.encode(["ts", []]), "bad_batch"),
        (msgspec.msgpack.encode([1.0, {}]), "bad_batch"),
        (msgspec.msgpack.encode({"ts": 1.0}), "bad_batch"),
        (msgspec.msgpack.encode([1.0, [["BlockStored"]]])[:-3], "bad_msgpack"),
    ],
)
def test_malformed_batches(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as exc:
        wire.decode_batch(payload)
    assert exc.value.reason == reason


def test_uint64_and_binary_hashes_are_exact() -> None:
    h = [2**64 - 1, -(2**63), b"\x01" * 32]
    batch = wire.decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", h, "GPU"]], 0]))
    assert batch.events[0]["block_hashes"] == h


# -- properties ---------------------------------------------------------------------------------

hashes = st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1), st.binary(min_size=32, max_size=32))


@st.composite
def events(draw: st.DrawFn, profile: str) -> dict[str, Any]:
    p = PROFILES[profile]
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    event: dict[str, Any] = {"type": tag}
    for name in p.fields[tag]:
        if name in ("block_hashes",):
            value: Any = draw(st.lists(hashes, min_size=1, max_size=4))
        elif name == "token_ids":
            value = draw(st.lists(st.integers(0, 2**31), max_size=64))
        elif name in ("parent_block_hash",):
            value = draw(st.one_of(st.none(), hashes))
        elif name in ("block_size", "group_idx", "lora_id", "kv_cache_spec_sliding_window"):
            value = draw(st.one_of(st.none(), st.integers(0, 2**20)))
        elif name == "extra_keys":
            value = draw(
                st.one_of(
                    st.none(),
                    st.lists(st.one_of(st.none(), st.lists(st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5), max_size=3))),
                )
            )
        else:
            value = draw(st.one_of(st.none(), st.text(max_size=12)))
        if value is None and p.events == "map" and name in p.omit_none:
            continue
        event[name] = value
    return event


@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_roundtrip_every_generation(data: st.DataObject) -> None:
    profile = data.draw(st.sampled_from(sorted(p for p in PROFILES if not PROFILES[p].rfc1527)))  # (RFC 1527: below)
    evs = data.draw(st.lists(events(profile), max_size=6))
    ts = data.draw(st.floats(allow_nan=False, allow_infinity=False))
    rank = data.draw(st.integers(0, 64))
    payload = encode_batch(PROFILES[profile], ts, evs, rank)
    batch = wire.decode_batch(payload)
    assert batch.events == evs and not batch.bad_events
    assert batch.ts == ts
    assert batch.dp_rank == (rank if PROFILES[profile].with_rank else None)
    assert wire.peek_ts(payload) == ts
    assert encode_batch(PROFILES[profile], batch.ts, batch.events, rank) == payload


@settings(max_examples=examples(1000), deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape(data: bytes) -> None:
    try:
        wire.decode_batch(data)
    except DecodeError:
        pass
    wire.peek_ts(data)


@settings(max_examples=examples(500), deadline=None)
@given(st.sampled_from(PAYLOADS), st.data())
def test_mutated_vectors_never_escape(vector: Any, data: st.DataObject) -> None:
    _seq, payload = _payload(vector)
    buf = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del buf[pos : pos + data.draw(st.integers(1, 16))]
        else:
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        batch = wire.decode_batch(bytes(buf))
        assert len(batch.events) + len(batch.bad_events) >= 0
    except DecodeError:
        pass
    frames = [*vector.frames[:1], bytes(buf[:8]), bytes(buf)]
    try:
        wire.parse_live(frames)
        wire.parse_replay(frames)
    except DecodeError:
        pass


# -- the plain fast path agrees with the generic decode --------------------------------------------

_values = msgpack_values(text=4, key=3, max_leaves=12)
_event_shapes = st.one_of(
    st.dictionaries(st.sampled_from(["type", "block_hashes", "x", "medium"]), _values, max_size=4).map(
        lambda d: {"type": "BlockRemoved", **d} if "type" not in d else d
    ),
    st.lists(_values, max_size=4).map(lambda v: ["BlockStored", *v]),
    _values,
)
_batches = st.one_of(
    st.tuples(st.floats() | st.integers(-(2**63), 2**64 - 1) | st.booleans(), st.lists(_event_shapes, max_size=4)).flatmap(
        lambda te: st.lists(_values, max_size=3).map(lambda tail: [te[0], te[1], *tail])
    ),
    st.fixed_dictionaries(
        {"ts": st.floats() | st.integers(-(2**63), 2**64 - 1), "events": st.lists(_event_shapes, max_size=4)},
        optional={"data_parallel_rank": _values, "attn_dp_rank": _values, "other": _values},
    ),
)


def _outcome(decode: Any, payload: bytes) -> Any:
    try:
        b = decode(payload)
    except DecodeError as exc:
        return ("error", exc.reason)
    return (b.ts, b.events, b.dp_rank, b.bad_events, b.extra)


@settings(max_examples=examples(1500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches)
def test_the_plain_fast_path_decodes_exactly_as_the_generic_path(batch: Any) -> None:
    """decode_batch (the typed fast path first) and decode_generic give the same result for any
    batch; a batch decoded as plain holds nothing the JSON renderer would convert."""
    from bridge.formats import json_event

    payload = msgspec.msgpack.encode(batch)
    fast, generic = _outcome(wire.decode_batch, payload), _outcome(wire.decode_generic, payload)
    assert repr(fast) == repr(generic)  # repr: NaN equals itself, and 1 == 1.0 == True would hide a type change
    decoded = None if fast[0] == "error" else wire.decode_batch(payload)
    if decoded is not None and decoded.plain:
        assert all(json_event(e, False) == e for e in decoded.events)


def test_common_batches_take_the_plain_path_and_odd_ones_do_not() -> None:
    payload = encode_batch(PROFILES["vllm-0.33.0"], 1.0, EventFactory(PROFILES["vllm-0.33.0"], seed=1).batch(4), 0)
    assert wire.decode_batch(payload).plain
    assert not wire.decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", [b"\x01" * 32], "GPU"]], 0])).plain
    assert not wire.decode_batch(msgspec.msgpack.encode([1.0, [], 0, "extra"])).plain
    assert wire.decode_batch(msgspec.msgpack.encode([1.0, [], 0, "extra"])).extra == ["extra"]
    lone_attn = wire.decode_batch(msgspec.msgpack.encode({"ts": 1.0, "events": [], "attn_dp_rank": 0}))
    assert lone_attn.plain and lone_attn.dp_rank == 0


def test_peek_ts_agrees_with_count_batch_on_a_batch_only_counting_accepts() -> None:
    """A map batch whose event holds invalid UTF-8 in a string field: decode_batch refuses it,
    count_batch (a raw-only bridge) accepts it and delivers it with its ts. peek_ts (the
    sequencer's clock of a batch) must read the same ts, or the checkpoint's fingerprint of that
    batch would never match it again (a false restart on resume)."""
    enc = msgspec.msgpack.encode
    event = (
        b"\x83" + enc("type") + enc("BlockRemoved") + enc("block_hashes") + enc([7]) + enc("medium") + b"\xa1\xff"
    )  # "medium": a one-byte str that is not UTF-8
    payload = b"\x82" + enc("ts") + enc(1001.5) + enc("events") + b"\x91" + event
    with pytest.raises(DecodeError):
        wire.decode_batch(payload)
    counted = wire.count_batch(payload)
    assert counted is not None and counted.ts == 1001.5
    assert wire.peek_ts(payload) == 1001.5
    assert wire.peek_ts(b"\xc1 not msgpack") is None


@pytest.mark.parametrize("header", [0x92, 0x93, 0x94])
def test_peek_ts_reads_an_array_batch_ts_from_its_first_ten_bytes_whatever_follows(header: int) -> None:
    """The sequencer's clock of a batch: an array batch's ts is its header's float64, read without
    decoding the events (even when they would not decode); one byte short, there is no ts."""
    head = bytes([header, 0xCB]) + struct.pack(">d", 12.5)
    assert wire.peek_ts(head) == 12.5
    assert wire.peek_ts(head + b"\xc1") == 12.5  # 0xc1: never valid msgpack
    assert wire.peek_ts(head[:-1]) is None


def test_peek_ts_of_what_is_not_an_array_batch_is_what_decoding_reads() -> None:
    ts = struct.pack(">d", 12.5)
    assert wire.peek_ts(b"\x91\xcb" + ts) is None  # [ts] alone: not a batch
    assert wire.peek_ts(b"\x95\xcb" + ts + b"\x90\x00\x00\x00") == 12.5  # decoded: a batch with extra fields
    assert wire.peek_ts(b"\x92\xca" + struct.pack(">f", 1.5) + b"\x90") == 1.5  # a float32 ts
    assert wire.peek_ts(b"\x92\xcb" + ts[:4]) is None


def test_a_live_message_keeps_its_topic() -> None:
    f = wire.parse_live([b"kv@engine-0", (7).to_bytes(8, "big"), b"payload"])
    assert (f.topic, f.seq, f.payload) == (b"kv@engine-0", 7, b"payload")


@pytest.mark.parametrize(("value", "kind"), [(5, "int"), ("s", "str"), (None, "NoneType"), (1.5, "float")])
def test_a_batch_that_is_neither_an_array_nor_a_map_is_refused_naming_what_it_is(value: object, kind: str) -> None:
    with pytest.raises(DecodeError, match=f"^bad_batch: batch is a {kind}, expected an array or a map$"):
        wire.decode_batch(msgspec.msgpack.encode(value))


def test_a_map_event_with_its_type_not_first_is_read_with_the_type_first_and_every_field() -> None:
    event = wire.normalise_event({"block_hashes": [1, 2], "medium": "GPU", "type": "BlockRemoved"})
    assert list(event.items()) == [("type", "BlockRemoved"), ("block_hashes", [1, 2]), ("medium", "GPU")]


@pytest.mark.parametrize(("marker", "layout"), [(b"\xcf", ">Q"), (b"\xd3", ">q")], ids=["uint64", "int64"])
def test_an_integer_ts_of_an_array_batch_is_milliseconds_whether_unsigned_or_signed(marker: bytes, layout: str) -> None:
    """RFC 1527 producers send an int64 of milliseconds; msgpack writers encode it as uint64 or as
    int64 (one that always writes signed): either is read as seconds, on every path."""
    ms = 1_780_000_000_250
    payload = b"\x92" + marker + struct.pack(layout, ms) + msgspec.msgpack.encode([["BlockRemoved", [1], "GPU"]])
    assert wire.decode_batch(payload).ts == wire.decode_generic(payload).ts == 1_780_000_000.25
    counted = wire.count_batch(payload)
    assert counted is not None and counted.ts == 1_780_000_000.25


def test_an_integer_ts_at_the_milliseconds_bound_is_seconds_and_one_above_is_milliseconds() -> None:
    """MS_TS_ABOVE is exclusive on every path: an integer ts of exactly 10^11 (seconds, year 5138)
    stays seconds; one more is RFC 1527 milliseconds."""
    for ts, seconds in ((100_000_000_000, 1e11), (100_000_000_001, 100_000_000.001)):
        payload = msgspec.msgpack.encode([ts, [["BlockRemoved", [1], "GPU"]]])
        assert payload[1] == 0xCF  # a uint64, as a producer of milliseconds writes it
        assert wire.decode_batch(payload).ts == wire.decode_generic(payload).ts == seconds
        counted = wire.count_batch(payload)
        assert counted is not None and counted.ts == seconds


def test_a_map_event_with_its_type_first_and_an_event_type_is_read_by_its_event_type_on_every_path() -> None:
    """The fast path takes a map event with ``type`` first as it is, but not an RFC 1527 one: its
    ``event_type`` decides over the legacy ``type``, as the generic path and count_batch read it."""
    event = {"type": "BlockRemoved", "event_type": "stored", "block_hashes": [1], "medium": "GPU"}
    payload = msgspec.msgpack.encode([1.5, [event]])
    expected = {"type": "BlockStored", "event_type": "stored", "block_hashes": [1], "medium": "GPU"}
    assert wire.decode_batch(payload).events == wire.decode_generic(payload).events == [expected]


def test_an_array_event_named_type_is_an_unknown_event_on_every_path_not_a_crash() -> None:
    """An array event whose type name is the string "type" is an unknown type kept with its
    values as extra (the fast path must not read it as a map event with a ``type`` key)."""
    payload = msgspec.msgpack.encode([1.5, [["type", 1]], 0])
    assert wire.decode_batch(payload) == msgspec.structs.replace(wire.decode_generic(payload), plain=True)
    assert wire.decode_batch(payload).events == [{"type": "type", "extra": [1]}]


@pytest.mark.parametrize("tag", ["", 5], ids=["empty", "int"])
def test_a_type_first_map_event_without_a_string_type_is_a_bad_event_on_every_path(tag: object) -> None:
    """An event whose ``type`` comes first but is empty or not a string is reported as a bad
    event (its batch position and the reason kept), the good event beside it delivered, by
    either decoder."""
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    bad = {"type": tag, "block_hashes": [2]}
    for events, kept, bad_at in (([good, bad], [good], [1]), ([bad], [], [0])):
        payload = msgspec.msgpack.encode([1.5, events])
        for decoded in (wire.decode_batch(payload), wire.decode_generic(payload)):
            assert decoded.events == kept
            assert [(b.index, b.reason) for b in decoded.bad_events] == [(i, "map event without a string 'type'") for i in bad_at]


def test_a_map_batch_keeps_its_unknown_fields_as_extra() -> None:
    payload = msgspec.msgpack.encode({"ts": 1.5, "events": [], "data_parallel_rank": 2, "note": "x"})
    decoded = wire.decode_batch(payload)
    assert (decoded.extra, decoded.dp_rank) == ({"note": "x"}, 2)


@pytest.mark.parametrize("rank", [True, "1", 1.0], ids=["bool", "str", "float"])
def test_a_rank_that_is_not_an_int_is_read_as_none(rank: object) -> None:
    """A bool, string or float rank is no rank: the batch is read with its rank None, on both
    configured rank applies), on both batch forms."""
    for batch in ([1.5, [], rank], {"ts": 1.5, "events": [], "data_parallel_rank": rank}):
        decoded = wire.decode_batch(msgspec.msgpack.encode(batch))
        assert decoded.dp_rank is None and decoded.events == []


def test_milliseconds_are_told_by_a_fixarray_header_up_to_15_elements_not_by_an_array16_one() -> None:
    """RFC 1527 batches are small arrays: an integer ts above MS_TS_ABOVE in a fixarray of any
    size up to 15 (the last fixarray header, 0x9F) is milliseconds on every path; in an array16
    one it is read as sent."""
    ms = 1_780_000_000_250
    head = b"\xcf" + struct.pack(">Q", ms) + msgspec.msgpack.encode([["BlockRemoved", [1], "GPU"]])
    rest = [0] * 12 + [None]  # rank and 12 extra elements: 15 in all, the last one a nil
    fifteen = b"\x9f" + head + b"".join(msgspec.msgpack.encode(x) for x in rest)
    array16 = b"\xdc\x00\x02" + head
    for payload, ts in ((fifteen, 1_780_000_000.25), (array16, float(ms))):
        assert wire.decode_batch(payload).ts == wire.decode_generic(payload).ts == wire.peek_ts(payload) == ts
        counted = wire.count_batch(payload)
        assert counted is not None and counted.ts == ts
    assert wire.decode_batch(fifteen).extra == rest[1:]


def test_a_map_batch_of_15_fields_is_counted_as_decoded() -> None:
    """The last fixmap header (0x8F): count_batch reads such a batch as a map, as decode_batch
    does (the 13 other fields kept as extra there, skipped here)."""
    batch: dict[str, Any] = {"ts": 1.5, "events": [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]}
    batch.update((f"f{i}", i) for i in range(13))
    payload = msgspec.msgpack.encode(batch)
    assert payload[0] == 0x8F
    decoded = wire.decode_batch(payload)
    assert wire.count_batch(payload) == wire.EventCount(decoded.ts, [e["type"] for e in decoded.events])
    assert decoded.ts == 1.5 and len(decoded.extra) == 13


@pytest.mark.parametrize(
    "header",
    [b"\xdc\x00\x02", b"\xdd\x00\x00\x00\x02", b"\xde\x00\x02", b"\xdf\x00\x00\x00\x02"],
    ids=["array16", "array32", "map16", "map32"],
)
def test_a_batch_under_a_16_or_32_bit_header_is_counted_as_decoded(header: bytes) -> None:
    """Writers that always use the wide headers: count_batch reads such a batch as decode_batch does."""
    events = [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}, {"type": "AllBlocksCleared"}]
    parts: list[Any] = [1.5, events] if header[0] in (0xDC, 0xDD) else ["ts", 1.5, "events", events]
    payload = header + b"".join(msgspec.msgpack.encode(p) for p in parts)
    decoded = wire.decode_batch(payload)
    assert (decoded.ts, decoded.events) == (1.5, events)
    assert wire.count_batch(payload) == wire.EventCount(1.5, ["BlockRemoved", "AllBlocksCleared"])


def test_an_array_block_removed_names_five_fields_and_keeps_the_rest_as_extra() -> None:
    payload = msgspec.msgpack.encode([1.5, [["BlockRemoved", [1], "GPU", 0, "loc", "own", [2]]]])
    (event,) = wire.decode_batch(payload).events
    assert event == {
        "type": "BlockRemoved",
        "block_hashes": [1],
        "medium": "GPU",
        "group_idx": 0,
        "locality": "loc",
        "ownership": "own",
        "extra": [[2]],
    }


def test_a_sequence_frame_of_8_or_24_bytes_gives_the_seq() -> None:
    assert wire.parse_seq((7).to_bytes(8, "big")) == 7
    assert wire.parse_seq((2**64 - 2).to_bytes(8, "big") + b"\x01" * 16) == 2**64 - 2
    with pytest.raises(DecodeError, match="bad_seq"):
        wire.parse_seq(b"\x00" * 9)


END = b"\xff" * 8


@pytest.mark.parametrize(
    ("window", "read"),
    [
        ([3, 9], (3, 9)),
        ([0, 0], (0, 0)),
        ([None, None], (None, None)),
        ([None, 5], (None, 5)),
        ([4, None], (4, None)),
        ([3], None),
        ([1, 2, 3], None),
        ([-1, 5], None),
        ([3, -1], None),
        ([True, 5], None),
        (["3", 5], None),
        ([3.0, 5], None),
        ({"a": 1, "b": 2}, None),
    ],
)
def test_rocm_atoms_end_marker_carries_its_buffered_window_and_nothing_else_reads_as_one(window: Any, read: Any) -> None:
    reply = wire.parse_replay([b"", b"topic", END, msgspec.msgpack.encode(window)])
    assert reply.end and reply.payload == b"" and reply.window == read


def test_an_end_marker_without_a_window() -> None:
    for payload in (b"", b"\xc1", b"\x92\x01"):  # empty (everyone else), not msgpack, cut short
        reply = wire.parse_replay([b"", END, payload])
        assert reply.end and reply.window is None


def test_a_reply_of_two_frames_is_its_seq_and_payload_even_when_the_seq_frame_is_empty() -> None:
    """Only a reply of 3 or 4 frames starts with the ROUTER's delimiter: 2 frames are seq and
    payload, and an empty seq frame is a bad sequence frame, not a delimiter."""
    assert wire.parse_replay([(5).to_bytes(8, "big"), b"x"]).seq == 5
    with pytest.raises(DecodeError, match="bad_seq"):
        wire.parse_replay([b"", b"x"])


def test_an_rfc1527_event_is_read_under_the_names_consumers_read_every_original_field_kept() -> None:
    raw = {"event_type": "stored", "type": "Old", "seq_hashes": [1], "parent_hash": 0, "medium": "gpu", "block_size": None}
    assert wire.normalise_rfc1527(raw) == {
        "type": "BlockStored",  # event_type decides over the producer's legacy type
        "event_type": "stored",
        "seq_hashes": [1],
        "parent_hash": 0,
        "medium_rfc1527": "gpu",
        "medium": "GPU",
        "block_hashes": [1],
        "parent_block_hash": 0,
    }
    both = wire.normalise_rfc1527({"event_type": "removed", "seq_hashes": [1], "block_hashes": [9], "medium": "CPU"})
    assert both == {"type": "BlockRemoved", "event_type": "removed", "seq_hashes": [1], "block_hashes": [9], "medium": "CPU"}


def test_an_rfc1527_event_type_this_bridge_does_not_know_takes_the_producers_type_or_is_refused() -> None:
    moved = wire.normalise_rfc1527({"event_type": "moved", "type": "BlockMoved", "seq_hashes": [1]})
    assert moved == {"type": "BlockMoved", "event_type": "moved", "seq_hashes": [1], "block_hashes": [1]}
    for raw in ({"event_type": "moved"}, {"event_type": "moved", "type": ""}, {"event_type": 5, "type": 7}):
        with pytest.raises(
            DecodeError, match=r"bad_event: RFC 1527 event with event_type .*, expected stored, removed or cleared"
        ):
            wire.normalise_rfc1527(raw)
