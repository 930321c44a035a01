"""The output schema: generated from the structs, committed, printed by the CLI, and every record
the renderer makes from the captured vectors (every JSON-bearing form) valid against it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from bridge import cli, wire
from bridge.config import FieldRule, FieldSelection
from bridge.filters import EventFilter
from bridge.formats import HASH_FIELDS, Renderer
from bridge.records import Record, Stream, events_lost, source_reset
from bridge.schema import (
    HEADER_KEYS,
    KNOWN_EVENTS,
    SCHEMA_PATH,
    SCHEMA_VERSION,
    STATE_SCHEMA_PATH,
    EventBatch,
    EventRecordHeader,
    EventsLost,
    SourceReset,
    StateEntry,
    StateHead,
    render,
)
from bridge.state import BlockFact, EntryChange, Head
from bridge.state_docs import StateFormat
from tests.support.schema import SCHEMA_FILE, as_json, check_message, check_record, valid_by_parts, validator
from tests.support.strategies import examples, msgpack_values
from tests.support.vectors import load_all

STREAM = Stream("llama-a", 1, {"model": "m"})


def test_the_committed_schema_is_the_generated_one() -> None:
    """Fails when a struct of bridge/schema.py changed and schema/kv-events.schema.json did not."""
    assert SCHEMA_FILE.read_text() == render(), f"{SCHEMA_PATH} is out of date: run python -m bridge schema > {SCHEMA_PATH}"


def test_the_schema_is_a_valid_draft_2020_12_schema() -> None:
    schema = validator().schema
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"].endswith(f":v{SCHEMA_VERSION}") and schema["x-schema-version"] == SCHEMA_VERSION


def test_the_cli_prints_it_and_checks_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["schema"]) == cli.EXIT_OK
    assert capsys.readouterr().out == render()
    assert cli.main(["schema", "--check", str(SCHEMA_FILE)]) == cli.EXIT_OK
    stale = tmp_path / "old.json"
    stale.write_text(render().replace('"minimum": 1', '"minimum": 0'))
    assert cli.main(["schema", "--check", str(stale)]) == cli.EXIT_FAILED
    assert "out of date" in capsys.readouterr().err


def test_every_known_event_field_of_the_wire_is_in_the_schema() -> None:
    structs = {c.__name__: c for c in KNOWN_EVENTS}
    assert set(structs) == wire.KNOWN_TYPES
    for name, fields in wire.FIELDS.items():
        assert set(fields) <= set(structs[name].__struct_fields__), name
    assert {"block_hashes", "parent_block_hash"} <= HASH_FIELDS  # the fields hash_format applies to


def _keys(value: bytes) -> list[str]:
    return list(json.loads(value))


def test_records_carry_the_struct_fields_in_order() -> None:
    events = [{"type": "BlockStored", "block_hashes": [1], "token_ids": [2]}, {"type": "AllBlocksCleared"}]
    record = Record(stream=STREAM, epoch=2, seq=7, ts=1.5, payload=b"x", events=events)
    header = list(EventRecordHeader.__struct_fields__)
    for fmt in ("json", "msgpack"):
        decode = json.loads if fmt == "json" else msgspec.msgpack.decode
        first, second = Renderer(fmt, "event").render(record)  # type: ignore[arg-type]
        assert list(decode(first.value)) == [*header, "type", "block_hashes", "token_ids"]
        assert list(decode(second.value)) == [*header, "type"]
        assert decode(second.value)["index"] == 1
        (batch,) = Renderer(fmt, "batch").render(record)  # type: ignore[arg-type]
        assert list(decode(batch.value)) == list(EventBatch.__struct_fields__)
        (reset,) = Renderer(fmt, "event").render(source_reset(STREAM, 3, "publisher_restart", 0.0))  # type: ignore[arg-type]
        assert list(decode(reset.value)) == list(SourceReset.__struct_fields__)
        (lost,) = Renderer(fmt, "event").render(events_lost(STREAM, 3, 1, 4, "no_replay", 0.0))  # type: ignore[arg-type]
        assert list(decode(lost.value)) == list(EventsLost.__struct_fields__)
    for m in [*Renderer("raw").render(record), *Renderer("json").render(record)]:
        assert m.headers["schema_version"] == str(SCHEMA_VERSION)


def test_a_field_named_schema_version_is_shadowed() -> None:
    assert "schema_version" in HEADER_KEYS
    event = {"type": "Future", "schema_version": 99, "seq": "x"}
    record = Record(stream=STREAM, epoch=2, seq=7, ts=1.5, events=[event])
    for fmt in ("json", "msgpack"):
        (m,) = Renderer(fmt, "event").render(record)  # type: ignore[arg-type]
        body = check_message(m.value, m.headers)
        assert body is not None
        assert body["schema_version"] == SCHEMA_VERSION and body["seq"] == 7
        assert body["shadowed"] == {"schema_version": 99, "seq": "x"}


# -- the captured vectors, every form that carries JSON -------------------------------------------

FORMS = [
    ("json", "event", "int"),
    ("json", "event", "hex"),
    ("json", "batch", "int"),
    ("json", "batch", "hex"),
    ("msgpack", "event", "int"),
    ("msgpack", "event", "hex"),
    ("msgpack", "batch", "int"),
    ("msgpack", "batch", "hex"),
    ("raw", "batch", "int"),
]


def _vector_records() -> list[tuple[str, Record]]:
    out = []
    for v in load_all():
        if v.kind not in ("live", "replay"):
            continue  # (an end marker or a heartbeat: no batch)
        payload = v.frames[-1]
        seq = int.from_bytes(v.frames[-2][:8], "big")
        batch = wire.decode_batch(payload)
        assert not batch.bad_events, v.file
        stream = Stream(v.producer, v.dp_rank)
        record = Record(stream=stream, epoch=1_000_000, seq=seq, ts=batch.ts, payload=payload, events=batch.events)
        out.append((f"{v.file}/{v.kind}/{v.dp_rank}/{seq}", record))
    return out


VECTOR_RECORDS = _vector_records()


@pytest.mark.parametrize(("fmt", "granularity", "hash_format"), FORMS)
def test_every_vector_renders_to_valid_records(fmt: str, granularity: str, hash_format: str) -> None:
    renderer = Renderer(fmt, granularity, hash_format)  # type: ignore[arg-type]
    checked = 0
    files = set()
    for name, record in VECTOR_RECORDS:
        files.add(name.split("/")[0])
        control = [
            source_reset(record.stream, record.epoch, "publisher_restart", 0.0),
            events_lost(record.stream, record.epoch, 0, record.seq, "replay_buffer_exceeded", 0.0),
        ]
        for rec in (record, *control):
            for m in renderer.render(rec):
                body = check_message(m.value, m.headers)
                if fmt != "raw" or rec.kind != "batch":
                    assert body is not None, name
                    checked += 1
    assert files == {p.stem for p in Path(SCHEMA_FILE.parents[1] / "tests" / "vectors").glob("*.jsonl")}
    assert checked >= 2 * len(VECTOR_RECORDS)


def test_vector_hash_forms_are_the_documented_ones() -> None:
    """int: JSON integers (or hex for binary digests); hex: 16 hex digits for integer hashes."""
    seen: dict[str, set[str]] = {"int": set(), "hex": set()}
    for _name, record in VECTOR_RECORDS:
        for hash_format in ("int", "hex"):
            for m in Renderer("json", "event", hash_format).render(record):  # type: ignore[arg-type]
                body = json.loads(m.value)
                for h in [*body.get("block_hashes", []), body.get("parent_block_hash")]:
                    if h is None:
                        continue
                    kind = "int" if isinstance(h, int) else f"hex{len(h)}"
                    seen[hash_format].add(kind)
    assert seen == {"int": {"int", "hex64"}, "hex": {"hex16", "hex64"}}


# -- what the schema refuses and what it lets through ---------------------------------------------


def _event(**fields: Any) -> dict[str, Any]:
    base = {"source": "a", "dp_rank": 0, "epoch": 1, "seq": 2, "index": 0, "ts": 1.0, "schema_version": SCHEMA_VERSION}
    return base | fields


REFUSED = [
    _event(type="BlockStored", block_hashes=[2**64]),  # past unsigned 64-bit
    _event(type="BlockStored", block_hashes=[-(2**63) - 1]),
    _event(type="BlockStored", block_hashes=["ABCD"]),  # hex is lowercase
    _event(type="BlockStored", block_hashes=["abc"]),  # whole bytes
    _event(type="BlockStored", parent_block_hash=1.5),
    _event(type="BlockStored", token_ids="1,2"),
    _event(type="BlockRemoved", block_hashes=None),
    _event(type="AllBlocksCleared", schema_version=SCHEMA_VERSION + 1),
    {k: v for k, v in _event(type="AllBlocksCleared").items() if k != "seq"},
    {k: v for k, v in _event(type="AllBlocksCleared").items() if k != "schema_version"},
    _event(type=7),
    {"source": "a", "dp_rank": 0, "epoch": 1, "seq": 0, "schema_version": 1, "type": "SourceReset"},  # no reason
    {"source": "a", "dp_rank": 0, "epoch": 1, "seq": 0, "ts": 1.0, "schema_version": 1, "events": [{"medium": "GPU"}]},
    {"source": "a", "dp_rank": 0, "epoch": 1, "seq": 0, "ts": "x", "schema_version": 1, "events": []},
    {"source": "a", "dp_rank": 0, "epoch": 1, "seq": 0, "ts": 1.0, "schema_version": 1, "type": "Batch", "events": []},
]


@pytest.mark.parametrize("record", REFUSED)
def test_the_schema_refuses(record: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match="does not match"):
        check_record(record)


ACCEPTED = [
    _event(type="BlockStored", block_hashes=[2**64 - 1, -(2**63), "00ff", "0123456789abcdef"], parent_block_hash=None),
    _event(type="BlockStored"),  # every event field may be absent (field selection, map engines)
    _event(type="BlockStored", block_hashes=[1], future_field={"x": [1]}),  # unknown fields
    _event(type="KvSnapshotTaken", anything=[b"x".hex(), None]),  # unknown event types
    _event(type="AllBlocksCleared", ts=None, shadowed={"seq": 1}, extra=[1, "a"]),
    _event(type="AllBlocksCleared", added_header="later"),
    {"source": "a", "dp_rank": 0, "epoch": 1, "seq": 0, "ts": 1.0, "schema_version": 1, "type": "EventBatch", "events": []},
    # a batch record of a bridge from before batches carried their type: type was added compatibly
    {"source": "a", "dp_rank": 0, "epoch": 1, "seq": 0, "ts": 1.0, "schema_version": 1, "events": [{"type": "X"}]},
]


@pytest.mark.parametrize("record", ACCEPTED)
def test_the_schema_lets_through(record: dict[str, Any]) -> None:
    check_record(record)


def test_msgpack_binary_is_checked_as_hex() -> None:
    assert as_json({"a": [b"\x00\xff"], "b": (1, b"")}) == {"a": ["00ff"], "b": [1, ""]}


# -- any event an engine may send, in any form: the rendered records are valid ---------------------

_hash = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32))
_value = msgpack_values(text=5, key=4, max_leaves=8)
_unknown_name = st.text(min_size=1, max_size=8).filter(lambda k: k not in {"type", "extra", "shadowed"})
_known = {
    "BlockStored": {
        "block_hashes": st.lists(_hash, max_size=3),
        "parent_block_hash": st.none() | _hash,
        "token_ids": st.lists(st.integers(0, 2**31), max_size=5),
        "block_size": st.integers(1, 64),
        "lora_id": st.none() | st.integers(0, 100),
        "medium": st.none() | st.sampled_from(["GPU", "CPU"]),
        "extra_keys": st.none() | st.lists(st.none() | st.lists(_value, max_size=2), max_size=2),
        "session_id": st.none() | st.text(max_size=4),
    },
    "BlockRemoved": {"block_hashes": st.lists(_hash, max_size=3), "medium": st.none() | st.text(max_size=3)},
    "AllBlocksCleared": {},
}


@st.composite
def _events(draw: st.DrawFn) -> dict[str, Any]:
    tag = draw(st.sampled_from([*_known, "FutureEvent"]))
    event: dict[str, Any] = {"type": tag}
    for name, strategy in _known.get(tag, {}).items():
        if draw(st.booleans()):
            event[name] = draw(strategy)
    names = st.sampled_from(sorted(HEADER_KEYS)) | _unknown_name  # header names go under "shadowed"
    event.update(draw(st.dictionaries(names, _value, max_size=3)))
    if draw(st.booleans()):
        event["extra"] = draw(st.lists(_value, max_size=2))
    return event


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(_events(), min_size=1, max_size=4), st.floats(allow_nan=True), st.sampled_from(FORMS))
def test_any_event_renders_to_valid_records(events: list[dict[str, Any]], ts: float, form: tuple[str, str, str]) -> None:
    fmt, granularity, hash_format = form
    record = Record(stream=STREAM, epoch=5, seq=9, ts=ts, payload=b"\x93", events=events)
    for m in Renderer(fmt, granularity, hash_format).render(record):  # type: ignore[arg-type]
        body = check_message(m.value, m.headers)
        if body is not None:
            assert validator().is_valid(body)  # the whole schema too, not only the part-by-part check


def test_the_part_by_part_check_never_says_valid_where_the_schema_does_not() -> None:
    """tests/support/schema.py decides event and batch records part by part (header, each event):
    exact only while those parts share no property and require only their own."""
    defs = validator().schema["$defs"]
    header = set(defs["EventRecordHeader"]["properties"])
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "UnknownEvent"):
        assert header.isdisjoint(defs[name]["properties"]) and set(defs[name]["required"]) <= set(defs[name]["properties"])
    assert defs["EventRecord"]["allOf"] == [{"$ref": "#/$defs/EventRecordHeader"}, {"$ref": "#/$defs/Event"}]
    assert defs["EventBatch"]["properties"]["events"] == {
        "description": defs["EventBatch"]["properties"]["events"]["description"],
        "type": "array",
        "items": {"$ref": "#/$defs/Event"},
    }
    records = [json.loads(m.value) for _n, r in VECTOR_RECORDS for g in ("event", "batch") for m in Renderer("json", g).render(r)]
    assert records and all(valid_by_parts(r) for r in records)
    for case in [*REFUSED, *ACCEPTED]:
        assert not valid_by_parts(case) or validator().is_valid(case), case


# -- per-sink filters (field selection, token policy): what they write is in the schema too --------

# (filter for a hash_format, whether the events keep token_ids, whether they carry token_hashes)
FILTERS = [
    pytest.param(lambda hex_: EventFilter(None, "drop"), False, False, id="token_ids-drop"),
    pytest.param(lambda hex_: EventFilter(None, "hash", b"k" * 32, hash_hex=hex_), False, True, id="token_ids-hash"),
    pytest.param(lambda hex_: EventFilter(FieldSelection(keep=["block_hashes"])), False, False, id="keep-block_hashes"),
    pytest.param(
        lambda hex_: EventFilter(FieldSelection(drop=["medium"], by_type={"BlockRemoved": FieldRule(keep=[])})),
        True,
        False,
        id="drop-by-type",
    ),
]


@pytest.mark.parametrize(("make", "tokens", "hashes"), FILTERS)
@pytest.mark.parametrize(("fmt", "granularity", "hash_format"), [f for f in FORMS if f[0] != "raw"])
def test_filtered_vectors_render_to_valid_records(
    make: Any, tokens: bool, hashes: bool, fmt: str, granularity: str, hash_format: str
) -> None:
    renderer = Renderer(fmt, granularity, hash_format, make(hash_format == "hex"))  # type: ignore[arg-type]
    stored = []
    for _name, record in VECTOR_RECORDS:
        for m in renderer.render(record):
            body = check_message(m.value, m.headers)
            assert body is not None
            stored += body["events"] if granularity == "batch" else [body]
    # (RFC 1527 stores without tokens leave token_ids out: the Mooncake master sends none.)
    blocks = [e for e in stored if e["type"] == "BlockStored" and "event_type" not in e]
    assert blocks and all(("token_ids" in e) == tokens and ("token_hashes" in e) == hashes for e in blocks)


# -- the state documents (state.enabled): their schema, from the same command --------------------

STATE_FILE = SCHEMA_FILE.parent / Path(STATE_SCHEMA_PATH).name


def _state_validator() -> Draft202012Validator:
    schema = json.loads(STATE_FILE.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def test_the_committed_state_schema_is_the_generated_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert STATE_FILE.read_text() == render("state"), f"run python -m bridge schema state > {STATE_SCHEMA_PATH}"
    assert cli.main(["schema", "state"]) == cli.EXIT_OK and capsys.readouterr().out == render("state")
    assert cli.main(["schema", "state", "--check", str(STATE_FILE)]) == cli.EXIT_OK
    assert cli.main(["schema", "state", "--check", str(SCHEMA_FILE)]) == cli.EXIT_FAILED  # the records' is another
    assert "python -m bridge schema state >" in capsys.readouterr().err


_FACT = BlockFact(
    hash=2**64 - 1, parent=-5, token_ids=list(range(16)), block_size=16, medium="GPU", group_idx=0, extra_keys=[b"\x01"]
)
_DIGEST_FACT = BlockFact(hash=b"\xab" * 32, parent=None, token_ids=[1], block_size=None, medium=None, group_idx=None)


@pytest.mark.parametrize("token_ids", ["keep", "drop", "hash"])
@pytest.mark.parametrize("hash_hex", [False, True])
def test_every_state_document_the_sinks_write_is_valid(token_ids: str, hash_hex: bool) -> None:
    """What bridge/state_docs.py writes (head, entries with and without their facts, every token
    policy and hash form) validates, and names no key the schema does not know."""
    fmt = StateFormat(token_ids, b"k" * 32 if token_ids == "hash" else None, hash_hex=hash_hex)
    check = _state_validator()
    head = Head(epoch=7, generation=2, seq=41, complete=False, live=3, tracking=True)
    docs = [
        fmt.head(STREAM, head, "1700000000000-0"),
        fmt.head(STREAM, Head(7, 3, -1, True, 0), None),
        fmt.head(STREAM, head, 12345),
        fmt.entry(STREAM, head, EntryChange("GPU", 0, 2**64 - 1, 2, _FACT)),
        fmt.entry(STREAM, head, EntryChange(None, None, 0xABABABABABABABAB, 1, _DIGEST_FACT)),
        fmt.entry(STREAM, head, EntryChange("CPU", 1, 5, 1, None)),
    ]
    known = {name for c in (StateHead, StateEntry) for name in c.__struct_fields__}
    for doc in map(json.loads, docs):
        errors = [e.message for e in check.iter_errors(doc)]
        assert not errors, (doc, errors)
        assert set(doc) <= known, set(doc) - known


_DOC = {"source": "a", "dp_rank": 0, "epoch": 1, "gen": 0, "seq": 3}


@pytest.mark.parametrize(
    "doc",
    [
        {**_DOC, "seq": -1, "complete": "yes", "live": 0, "tracking": True, "next": None},
        {**_DOC, "medium": None, "group_idx": None, "block": "AB", "count": 1},  # block: 16 lowercase hex digits
        {**_DOC, "medium": None, "group_idx": None, "block": "00" * 8, "count": 0},  # a removed block has no entry
        _DOC,  # neither a head nor an entry
    ],
)
def test_the_state_schema_refuses(doc: dict[str, Any]) -> None:
    assert not _state_validator().is_valid(doc)
