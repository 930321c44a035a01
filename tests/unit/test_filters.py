"""Per-sink event filters: field selection, token policy (drop / keyed hash), hash form, config."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge import config as config_mod
from bridge.config import FieldRule, FieldSelection
from bridge.errors import ConfigError
from bridge.filters import BlockHasher, EventFilter, for_sink, hex_hashes, misspelt_fields, token_bytes
from bridge.formats import Renderer
from bridge.records import Record, Stream, events_lost, source_reset

KEY = b"0123456789abcdef-test-key"
OTHER = b"another-key-0123456789"
STREAM = Stream("llama-a", 0)
STORED = {
    "type": "BlockStored",
    "block_hashes": [2**64 - 1, -5],
    "parent_block_hash": b"\xab" * 32,
    "token_ids": [101, 102, 103, 104, 105],
    "block_size": 2,
    "medium": "GPU",
    "lookahead_token_ids": [7, 8],
    "extra_keys": None,
}
REMOVED = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
CLEARED = {"type": "AllBlocksCleared"}
EVENTS = [STORED, REMOVED, CLEARED]


def record(events: list[dict[str, Any]] = EVENTS, seq: int = 1) -> Record:
    return Record(stream=STREAM, epoch=1, seq=seq, ts=1.0, payload=b"\x93", events=events)


def mac(key: bytes, tokens: list[int]) -> int:
    """The documented token block hash, computed independently of the bridge's code."""
    data = b"".join(t.to_bytes(8, "big") for t in tokens)
    return int.from_bytes(hmac.digest(key, data, "sha256")[:8], "big")


# -- field selection ------------------------------------------------------------------------------


def test_drop_removes_the_named_fields_and_leaves_the_shared_event_alone() -> None:
    f = EventFilter(FieldSelection(drop=["medium", "extra_keys"]))
    out = f(EVENTS)
    assert "medium" not in out[0] and "extra_keys" not in out[0] and out[0]["token_ids"] == STORED["token_ids"]
    assert out[1] == {"type": "BlockRemoved", "block_hashes": [3]}
    assert out[2] is CLEARED  # nothing to change: not copied
    assert STORED["medium"] == "GPU" and REMOVED["medium"] == "GPU"


def test_keep_writes_only_the_named_fields_and_the_type() -> None:
    f = EventFilter(FieldSelection(keep=["block_hashes", "parent_block_hash"]))
    out = f(EVENTS)
    assert out[0] == {"type": "BlockStored", "block_hashes": [2**64 - 1, -5], "parent_block_hash": b"\xab" * 32}
    assert list(out[0]) == ["type", "block_hashes", "parent_block_hash"]  # the engine's order
    assert out[1] == {"type": "BlockRemoved", "block_hashes": [3]}
    assert out[2] is CLEARED


def test_by_type_rule_replaces_the_top_level_one_for_that_type() -> None:
    f = EventFilter(FieldSelection(drop=["medium"], by_type={"BlockStored": FieldRule(keep=["block_hashes"])}))
    out = f(EVENTS)
    assert out[0] == {"type": "BlockStored", "block_hashes": [2**64 - 1, -5]}
    assert out[1] == {"type": "BlockRemoved", "block_hashes": [3]}
    only = EventFilter(FieldSelection(by_type={"BlockRemoved": FieldRule(drop=["medium"])}))
    assert only(EVENTS)[0] is STORED and only(EVENTS)[1] == {"type": "BlockRemoved", "block_hashes": [3]}


def test_unknown_event_types_and_fields_follow_the_top_level_rule() -> None:
    event = {"type": "BlockMoved", "block_hashes": [1], "to": "CPU"}
    assert EventFilter(FieldSelection(drop=["to"]))([event]) == [{"type": "BlockMoved", "block_hashes": [1]}]
    assert EventFilter(FieldSelection(keep=["to"]))([event]) == [{"type": "BlockMoved", "to": "CPU"}]


# -- token policy ----------------------------------------------------------------------------------


def test_drop_removes_every_token_field_and_unnamed_positions() -> None:
    event = {**STORED, "prompt_token_ids": [1], "extra": [[9, 9]]}
    (out,) = EventFilter(token_ids="drop")([event])
    assert set(out) == {"type", "block_hashes", "parent_block_hash", "block_size", "medium", "extra_keys"}
    assert EventFilter(token_ids="drop")([REMOVED])[0] is REMOVED


def test_a_token_field_under_a_binary_key_is_dropped_too() -> None:
    """A hostile engine's map event with ``token_ids`` as a msgpack bin key (found by a breaker:
    it went out as base64 in JSON and as bytes in msgpack)."""
    event = {**STORED, b"token_ids": [900001, 900002], b"lora_token_ids": [3]}
    del event["token_ids"]
    (out,) = EventFilter(token_ids="drop")([event])
    assert b"token_ids" not in out and b"lora_token_ids" not in out


def test_hash_gives_one_keyed_hash_per_block_in_place_of_the_tokens() -> None:
    (out,) = EventFilter(token_ids="hash", key=KEY)([STORED])
    assert list(out) == ["type", "block_hashes", "parent_block_hash", "block_size", "medium", "extra_keys", "token_hashes"]
    assert out["token_hashes"] == [mac(KEY, [101, 102]), mac(KEY, [103, 104]), mac(KEY, [105])]
    (hexed,) = EventFilter(token_ids="hash", key=KEY, hash_hex=True)([STORED])
    assert hexed["token_hashes"] == [format(h, "016x") for h in out["token_hashes"]]


def test_equal_blocks_hash_alike_across_events_and_filters_and_not_under_another_key() -> None:
    a = {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [5, 6, 7, 8], "block_size": 2}
    b = {"type": "BlockStored", "block_hashes": [9], "token_ids": [7, 8], "block_size": 2}
    one, two = EventFilter(token_ids="hash", key=KEY), EventFilter(token_ids="hash", key=KEY)
    assert one([a])[0]["token_hashes"][1] == two([b])[0]["token_hashes"][0]
    other = EventFilter(token_ids="hash", key=OTHER)([b])[0]["token_hashes"][0]
    assert other != two([b])[0]["token_hashes"][0]


def test_hash_without_a_block_size_is_one_block_and_odd_values_do_not_fail() -> None:
    hasher = BlockHasher(KEY)
    assert hasher.blocks([1, 2, 3], None, False) == [mac(KEY, [1, 2, 3])]
    assert hasher.blocks([], 16, False) == [] and hasher.blocks(None, 16, False) is None
    assert hasher.blocks([-1], 1, False) == [mac(KEY, [2**64 - 1])]  # two's complement, as documented
    assert len(hasher.blocks(["x", 2**70], 1, True) or []) == 2  # an engine off the protocol still hashes
    assert len(hasher.blocks("text", 1, False) or []) == 1


def test_a_long_key_is_hashed_first_as_hmac_says() -> None:
    key = b"k" * 100
    assert BlockHasher(key).blocks([1], 1, False) == [mac(key, [1])]


@given(st.lists(st.integers(0, 2**64 - 1), max_size=40), st.integers(1, 8))
def test_hashes_match_hmac_sha256_truncated(tokens: list[int], size: int) -> None:
    blocks = [tokens[i : i + size] for i in range(0, len(tokens), size)]
    assert BlockHasher(KEY).blocks(tokens, size, False) == [mac(KEY, b) for b in blocks]
    assert token_bytes(tokens) == b"".join(t.to_bytes(8, "big") for t in tokens)


def test_a_hash_filter_needs_a_key() -> None:
    with pytest.raises(ValueError, match="key"):
        EventFilter(token_ids="hash")


def test_fields_apply_before_the_token_policy() -> None:
    f = EventFilter(FieldSelection(keep=["block_hashes", "token_ids", "block_size"]), "hash", KEY)
    assert f([STORED])[0] == {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, -5],
        "token_hashes": [mac(KEY, [101, 102]), mac(KEY, [103, 104]), mac(KEY, [105])],
        "block_size": 2,
    }


# -- identity (renderer sharing) -------------------------------------------------------------------


def test_filters_configured_alike_are_equal_and_the_key_is_not_shown() -> None:
    a = EventFilter(FieldSelection(drop=["medium"]), "hash", KEY)
    b = EventFilter(FieldSelection(drop=["medium"]), "hash", KEY)
    assert a == b and hash(a) == hash(b)
    assert a != EventFilter(FieldSelection(drop=["medium"]), "hash", OTHER)
    assert a != EventFilter(FieldSelection(drop=["medium"]), "drop")
    assert KEY.decode() not in repr(a) and KEY.decode() not in repr(a.identity)


# -- rendering -------------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["event", "batch"])
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_rendered_messages_hold_no_token_ids_with_drop(fmt: str, granularity: str) -> None:
    tokens = [1234567, 7654321]
    event = {"type": "BlockStored", "block_hashes": [1], "token_ids": tokens, "block_size": 1}
    r = Renderer(fmt, granularity, event_filter=EventFilter(token_ids="drop"))  # type: ignore[arg-type]
    values = b"".join(m.value for m in r.render(record([event, CLEARED])))
    for t in tokens:
        assert str(t).encode() not in values and msgspec.msgpack.encode(t) not in values
    assert b"block_hashes" in values


def test_json_output_of_a_hash_sink() -> None:
    r = Renderer("json", "event", "hex", EventFilter(token_ids="hash", key=KEY, hash_hex=True))
    body = json.loads(r.render(record([STORED]))[0].value)
    assert body["token_hashes"] == [
        format(mac(KEY, [101, 102]), "016x"),
        format(mac(KEY, [103, 104]), "016x"),
        format(mac(KEY, [105]), "016x"),
    ]
    assert body["block_hashes"] == ["ffffffffffffffff", "fffffffffffffffb"] and body["parent_block_hash"] == "ab" * 32
    assert "token_ids" not in body and "lookahead_token_ids" not in body


def test_control_records_are_not_filtered() -> None:
    r = Renderer("json", "event", event_filter=EventFilter(FieldSelection(keep=[]), "drop"))
    reset = json.loads(r.render(source_reset(STREAM, 3, "publisher_restart", 0.0))[0].value)
    lost = json.loads(r.render(events_lost(STREAM, 3, 1, 4, "no_replay", 0.0))[0].value)
    assert reset["reason"] == "publisher_restart" and lost["count"] == 4


def test_raw_is_never_filtered() -> None:
    r = Renderer("raw", "batch", event_filter=EventFilter(token_ids="drop"))
    assert r.event_filter is None and r.render(record())[0].value == b"\x93"


def test_no_filter_means_the_events_are_rendered_as_they_are() -> None:
    assert Renderer("json", "event").event_filter is None and Renderer("msgpack", "batch").event_filter is None


# -- hash form: every hash field, every encoding, both formats --------------------------------------


def test_msgpack_hex_hashes_every_hash_field_and_encoding() -> None:
    for granularity in ("event", "batch"):
        (first, *_) = Renderer("msgpack", granularity, "hex").render(record())  # type: ignore[arg-type]
        body = msgspec.msgpack.decode(first.value)
        event = body["events"][0] if granularity == "batch" else body
        assert event["block_hashes"] == ["ffffffffffffffff", "fffffffffffffffb"]  # unsigned, signed
        assert event["parent_block_hash"] == "ab" * 32  # binary
        assert event["token_ids"] == STORED["token_ids"]
    int_body = msgspec.msgpack.decode(Renderer("msgpack", "event").render(record())[0].value)
    assert int_body["block_hashes"] == [2**64 - 1, -5] and int_body["parent_block_hash"] == b"\xab" * 32


def test_json_hex_covers_parent_and_all_encodings() -> None:
    for granularity in ("event", "batch"):
        (first, *_) = Renderer("json", granularity, "hex").render(record())  # type: ignore[arg-type]
        body = json.loads(first.value)
        event = body["events"][0] if granularity == "batch" else body
        assert event["block_hashes"] == ["ffffffffffffffff", "fffffffffffffffb"] and event["parent_block_hash"] == "ab" * 32
    int_parent = {**STORED, "parent_block_hash": -2}
    body = json.loads(Renderer("json", "event", "hex").render(record([int_parent]))[0].value)
    assert body["parent_block_hash"] == "fffffffffffffffe"


def test_hex_hashes_leaves_events_without_hashes_alone() -> None:
    assert hex_hashes(CLEARED) is CLEARED
    assert hex_hashes({"type": "BlockStored", "parent_block_hash": None})["parent_block_hash"] is None


# -- configuration ---------------------------------------------------------------------------------


def load(sink: dict[str, Any], env: dict[str, str] | None = None) -> config_mod.Config:
    data = {"sources": [{"name": "a", "endpoint": "tcp://h:1"}], "sinks": [{"type": "file", **sink}]}
    return config_mod.from_data(data, env or {})


def problems(sink: dict[str, Any], env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load(sink, env)
    return exc.value.problems


def test_raw_sinks_refuse_filters_and_say_why() -> None:
    assert problems({"format": "raw", "fields": {"drop": ["medium"]}, "token_ids": "drop"}) == [
        "sinks[0].fields: format raw forwards the engine's bytes untouched, so it cannot select fields; "
        "use format json or msgpack, or remove fields",
        "sinks[0].token_ids: format raw forwards the engine's bytes untouched, so it cannot drop the token ids "
        "(they stay in the payload); use format json or msgpack, or remove token_ids",
    ]


def test_hash_needs_a_key_of_sixteen_characters_from_the_environment() -> None:
    assert problems({"token_ids": "hash"}) == [
        "sinks[0].token_ids_key: required with token_ids: hash (a secret, e.g. ${KV_TOKEN_KEY})"
    ]
    assert problems({"token_ids": "hash", "token_ids_key": "${K}"}, {"K": "short"}) == [
        "sinks[0].token_ids_key: 5 characters is too short a key; give at least 16 (e.g. the output of openssl rand -hex 32)"
    ]
    sink = load({"token_ids": "hash", "token_ids_key": "${K}"}, {"K": KEY.decode()}).sinks[0]
    assert KEY.decode() not in repr(sink) and str(sink.token_ids_key) == "***"
    f = for_sink(sink)
    assert f is not None and f([STORED])[0]["token_hashes"][0] == mac(KEY, [101, 102])


def test_field_rules_are_checked_with_their_paths() -> None:
    fields = {"keep": ["a"], "drop": ["seq", "type"], "by_type": {"BlockStore": {"keep": ["x"]}, "EventsLost": {}}}
    assert problems({"fields": fields}) == [
        "sinks[0].fields: give keep or drop, not both",
        "sinks[0].fields.drop[0]: seq is a header key, written in every record (not an event field)",
        "sinks[0].fields.drop[1]: type cannot be dropped: consumers tell events apart by it",
        "sinks[0].fields.by_type.BlockStore: unknown event type (did you mean BlockStored?)",
        "sinks[0].fields.by_type.EventsLost: EventsLost records are written whole (field selection applies to engine events)",
    ]
    assert problems({"fields": {"by_type": {"A": {"keep": [1]}, "B": {"dorp": []}}}}) == [
        "sinks[0].fields.by_type.A.keep[0]: expected str, got int",
        "sinks[0].fields.by_type.B.dorp: unknown key (did you mean drop?)",
    ]
    assert problems({"token_ids": "hsh"}) == ['sinks[0].token_ids: expected "keep" | "drop" | "hash", got "hsh"']


def test_sinks_without_filters_get_none_and_alike_sinks_share() -> None:
    assert for_sink(load({}).sinks[0]) is None
    assert for_sink(load({"format": "msgpack", "hash_format": "hex"}).sinks[0]) is None  # the renderer adds hex
    a = for_sink(load({"fields": {"drop": ["medium"]}, "token_ids": "drop"}).sinks[0])
    b = for_sink(load({"fields": {"drop": ["medium"]}, "token_ids": "drop"}).sinks[0])
    assert a is not None and a == b


def test_a_new_known_block_key_is_hashed_the_same_in_a_fresh_process() -> None:
    # The hash is a function of the key and the tokens only: a restarted bridge (or a consumer
    # that holds the tokens and the key) gets the same values. Pinned against a constant.
    digest = hmac.new(KEY, (1).to_bytes(8, "big") + (2).to_bytes(8, "big"), hashlib.sha256).digest()[:8]
    assert BlockHasher(KEY).blocks([1, 2], 2, True) == [digest.hex()]


def test_check_refuses_a_filter_on_a_raw_sink_and_says_why(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from bridge.cli import check

    path = tmp_path / "raw.yaml"
    path.write_text(
        "sources: [{name: a, endpoint: 'tcp://127.0.0.1:5557'}]\nsinks: [{type: file, path: '-', format: raw, token_ids: drop}]\n"
    )
    assert check(str(path), offline=True) == 2
    out = capsys.readouterr()
    assert "sinks[0].token_ids: format raw forwards the engine's bytes untouched, so it cannot drop the token ids" in (
        out.out + out.err
    )


def test_hostile_field_names_do_not_break_the_filter() -> None:
    event = {"type": "BlockStored", 7: "x", "prompt_token_ids": [1], "token_ids": [2], "block_size": 1}
    assert EventFilter(token_ids="drop")([event]) == [{"type": "BlockStored", 7: "x", "block_size": 1}]
    (hashed,) = EventFilter(token_ids="hash", key=KEY)([event])
    assert list(hashed) == ["type", 7, "block_size", "token_hashes"] and hashed["token_hashes"] == [mac(KEY, [2])]


async def test_the_runtime_shares_one_renderer_per_format_and_filter(tmp_path: Any) -> None:
    from bridge.runtime import Bridge

    def sink(n: int, **extra: Any) -> dict[str, Any]:
        return {"type": "file", "name": f"s{n}", "path": str(tmp_path / f"{n}.jsonl"), **extra}

    drop = {"token_ids": "drop", "fields": {"drop": ["medium"]}}
    data = {
        "sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:9"}],
        "sinks": [sink(0), sink(1), sink(2, **drop), sink(3, **drop), sink(4, token_ids="drop")],
        "metrics": {"listen": ""},
        "replay": {"idle_probe": 0},
    }
    bridge = Bridge(config_mod.from_data(data, env={}))
    await bridge.start()
    try:
        r = [w.renderer for w in bridge.workers]
        assert r[0] is r[1] and r[0].event_filter is None
        assert r[2] is r[3] and r[2] is not r[0] and r[4] is not r[2]
    finally:
        await bridge.stop()


def test_a_name_close_to_a_known_field_is_warned_and_an_unknown_one_is_not() -> None:
    """A typo in keep writes records holding only type (the name is ignored): said at start and by
    --check. A name far from every known one may be a newer engine's field: nothing said."""
    fields = FieldSelection(keep=["block_hashs", "new_field", "medium"], by_type={"BlockRemoved": FieldRule(drop=["grop_idx"])})
    assert misspelt_fields(fields, "sinks[0]") == [
        "sinks[0].fields.keep[0]: no event has a field 'block_hashs' (did you mean 'block_hashes'?): it is ignored",
        "sinks[0].fields.by_type.BlockRemoved.drop[0]: no event has a field 'grop_idx' (did you mean 'group_idx'?): "
        "it is ignored",
    ]
    assert misspelt_fields(FieldSelection(drop=["token_ids", "lora_name"]), "sinks[1]") == []
    assert misspelt_fields(None, "sinks[2]") == []
