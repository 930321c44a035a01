"""Every record the tests read back, checked against the committed output schema.

``schema/kv-events.schema.json`` (what consumers are given; ``tests/unit/test_schema.py`` keeps it
equal to what ``bridge/schema.py`` generates) is loaded once into a ``jsonschema``
Draft 2020-12 validator. The read-back helpers (``tests/support/readback.py``,
``tests/support/harness.py``, the conformance suite) call :func:`check_message` or
:func:`check_line` on everything they read, so a test that reads records back through them
validates them without asking.

- JSON bodies (``json`` sinks, control records of ``raw`` sinks) are validated as they are.
- msgpack bodies ("the same structures in msgpack, binary stays binary") are validated with their
  binary values as lowercase hex, the form the json format gives them.
- ``raw`` batches are the engine's bytes: only their headers are checked.
Every message's headers must carry the same ``schema_version`` as its body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from bridge.schema import SCHEMA_PATH, SCHEMA_VERSION

SCHEMA_FILE = Path(__file__).resolve().parents[2] / SCHEMA_PATH
JSON = "application/json"
MSGPACK = "application/msgpack"


@cache
def validator() -> Draft202012Validator:
    """The committed schema's validator (the schema itself checked against the 2020-12 metaschema)."""
    schema = json.loads(SCHEMA_FILE.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _part(name: str) -> Draft202012Validator:
    """A validator of the committed schema's ``$defs/name`` (same resource: its references resolve)."""
    schema = {k: v for k, v in validator().schema.items() if k not in ("anyOf", "title", "description")}
    return Draft202012Validator({**schema, "$ref": f"#/$defs/{name}"})


@cache
def _parts() -> tuple[frozenset[str], Draft202012Validator, Draft202012Validator, Draft202012Validator]:
    """The event header's keys, and validators of the event header, the batch and one event."""
    header_keys = frozenset(validator().schema["$defs"]["EventRecordHeader"]["properties"])
    return header_keys, _part("EventRecordHeader"), _part("EventBatch"), _part("Event")


_valid_events: set[str] = set()


def _event_valid(event: Any, check: Draft202012Validator) -> bool:
    key = json.dumps(event, separators=(",", ":"))
    if key in _valid_events:
        return True
    if not check.is_valid(event):
        return False
    if len(_valid_events) > 200_000:
        _valid_events.clear()
    _valid_events.add(key)
    return True


def valid_by_parts(record: Any) -> bool:
    """True only if ``record`` is valid, decided part by part (False: undecided, validate it whole).

    jsonschema takes about a millisecond for an event record (every token id is a descent), and
    the reliability tests read back tens of thousands that repeat the same few events. An event
    record is valid as ``EventRecord`` (``allOf`` of ``EventRecordHeader`` and ``Event``), and a
    batch as ``EventBatch`` (``items: Event``), exactly when its header part and each event part
    are valid on their own: both are open objects whose properties and required keys do not
    overlap (``tests/unit/test_schema.py`` checks that, and that this never says valid where the
    whole schema does not). Each distinct event is validated once.
    """
    if type(record) is not dict:
        return False
    header_keys, header_check, batch_check, event_check = _parts()
    if "index" in record:
        header = {k: v for k, v in record.items() if k in header_keys}
        event = {k: v for k, v in record.items() if k not in header_keys}
        return header_check.is_valid(header) and _event_valid(event, event_check)
    events = record.get("events")
    if type(events) is list:  # the batch part checks its type (EventBatch, or absent from earlier bridges)
        return batch_check.is_valid({**record, "events": []}) and all(_event_valid(e, event_check) for e in events)
    return False


def check_record(record: Any) -> None:
    """Fail (AssertionError, the most relevant schema error first) unless ``record`` is valid."""
    if valid_by_parts(record):
        return
    error = best_match(validator().iter_errors(record))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(the record)"
        raise AssertionError(f"record does not match {SCHEMA_PATH} at {where}: {error.message}\n{str(record)[:800]}")


def as_json(value: Any) -> Any:
    """A decoded msgpack value in the json format's form: binary as lowercase hex."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


def check_message(value: bytes, headers: Mapping[str, str]) -> dict[str, Any] | None:
    """Check one stored message (body and text headers); returns the decoded record, None for raw."""
    version = headers.get("schema_version")
    assert version == str(SCHEMA_VERSION), f"schema_version header {version!r}, expected {SCHEMA_VERSION}: {dict(headers)}"
    ctype = headers.get("content-type")
    if ctype == JSON:
        record = json.loads(value)
    elif ctype == MSGPACK:
        record = as_json(msgspec.msgpack.decode(value))
    else:
        return None  # the engine's bytes, forwarded untouched
    check_record(record)
    assert record["schema_version"] == SCHEMA_VERSION, record
    return dict(record)


_valid_lines: set[int] = set()


def check_line(line: str) -> dict[str, Any]:
    """One JSON line a ``json`` file sink wrote, decoded and checked (a line seen before is not
    checked again: polling readers read the same file many times)."""
    record: dict[str, Any] = json.loads(line)
    key = hash(line)
    if key not in _valid_lines:
        check_record(record)
        _valid_lines.add(key)
    return record


def check_if_written_by_bridge(value: bytes, headers: Mapping[str, str]) -> None:
    """:func:`check_message` for a message the bridge wrote (it has a ``content-type`` header);
    what a test wrote itself to play another client (a foreign entry, a filler) is let through."""
    if "content-type" in headers:
        check_message(value, headers)


def check_entry(fields: Mapping[bytes, bytes]) -> None:
    """One Redis stream entry (fields as redis-py returns them), checked like a message."""
    body = fields.get(b"data", fields.get(b"payload", b""))
    headers = {k.decode(): v.decode() for k, v in fields.items() if k not in (b"data", b"payload")}
    check_if_written_by_bridge(body, headers)
