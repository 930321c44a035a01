"""The NATS sink's state helpers without a server: key tokens, folding a write's deltas into one
bucket write, the journal, and the state options."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

import connectors.nats as nats_connector
from bridge import config
from bridge.config import SinkConfig, convert_options
from bridge.errors import ConfigError, ConnectorError, Permanent, Retriable
from bridge.formats import Envelope, Message, state_message
from bridge.records import Record, Stream
from bridge.state import EntryChange, Head, StateDelta
from connectors.nats import NatsConnector, NatsOptions, fold_deltas, hpub, journal_parts, journal_redo, state_prefix, state_token

S = Stream("a", 0)


def test_a_put_without_headers_is_a_plain_pub() -> None:
    assert hpub("$KV.b.k", "_INBOX.1", b"", b"xy") == b"PUB $KV.b.k _INBOX.1 2\r\nxy\r\n"
    assert hpub("s", "", b"", b"") == b"PUB s 0\r\n\r\n"


def test_state_token_is_one_safe_token_and_injective() -> None:
    assert state_token("llama-3_1") == "llama-3_1"
    assert state_token("llama-3.1") == "llama-3=2e1"
    assert state_token("a b*>/=") == "a=20b=2a=3e=2f=3d"
    assert state_token("é") == "=c3=a9"
    assert state_token("") == "="
    assert state_token("_journal") == "=5fjournal" and state_token("a_") == "a_"
    names = ["a.b", "a_b", "a=2eb", "a-b", "a b", "a/b", "ab", "a=b", "_a", "=5fa"]
    assert len({state_token(n) for n in names}) == len(names)
    assert state_prefix("eng.a", 3) == "eng=2ea.3"


def head(seq: int, gen: int = 1, epoch: int = 1) -> Head:
    return Head(epoch, gen, seq, True, 0)


def change(block: int, count: int, medium: str = "GPU") -> EntryChange:
    return EntryChange(medium, 0, block, count, None)


def test_fold_deltas_keeps_the_newest_change_and_drops_what_a_clear_purges() -> None:
    d1 = StateDelta(S, head(1), changes=[change(1, 1), change(2, 1)])
    d2 = StateDelta(S, head(2), changes=[change(1, 2), change(3, 1)])
    op = fold_deltas([(d1, 10), (d2, 12)])
    assert op is not None and not op.clear and op.head == head(2) and op.next == 12
    assert [(c.block, c.count, h.seq) for c, h in op.changes.values()] == [(2, 1, 1), (1, 2, 2), (3, 1, 2)]
    d3 = StateDelta(S, head(3, gen=2), clear=True, changes=[change(4, 1)])
    d4 = StateDelta(S, head(4, gen=2), changes=[change(4, 0), change(5, 1, "CPU")])
    op = fold_deltas([(d1, 10), (d3, 13), (d4, None)])
    assert op is not None and op.clear and op.head == head(4, gen=2) and op.next is None
    assert [(c.block, c.count) for c, _ in op.changes.values()] == [(4, 0), (5, 1)]
    stale = StateDelta(S, head(0), stale=True, changes=[change(9, 1)])
    assert fold_deltas([(stale, 1)]) is None
    op = fold_deltas([(stale, 1), (d2, 12)])
    assert op is not None and 9 not in {b for _, _, b in op.changes}


def test_journal_round_trip_in_parts_and_only_when_ahead() -> None:
    ops: list[tuple[str, bytes | None]] = [(f"GPU/0/{i:016x}", b'{"count":%d}' % i) for i in range(50)] + [("CPU/0/01", None)]
    parts = journal_parts(head(7), b'{"seq":7}', ops, 300)
    assert len(parts) > 3
    assert journal_redo(parts, head(6)) == (False, ops, b'{"seq":7}')
    assert journal_redo(parts, None) == (False, ops, b'{"seq":7}')
    assert journal_redo(parts, head(7)) is None  # the write finished
    assert journal_redo(parts, head(3, gen=2)) is None  # a later generation
    assert journal_redo(parts[:-1], head(6)) is None  # written in part: nothing else of the write was
    old = journal_parts(head(5), b'{"seq":5}', ops[:1], 300)
    assert journal_redo([*parts[:-1], *old], head(4)) == (False, ops[:1], b'{"seq":5}')  # a complete older one
    assert journal_redo([b"junk", *parts], head(6)) == (False, ops, b'{"seq":7}')
    reset = journal_parts(head(-1, gen=2, epoch=2), b'{"seq":-1}', [], 300, clear=True)
    assert journal_redo(reset, None) == (True, [], b'{"seq":-1}')  # killed after the purge: no head


def sink(**state: Any) -> tuple[SinkConfig, NatsOptions]:
    options = {"state": {"enabled": True, **state}}
    cfg = config.convert({"type": "nats", "name": "n", "backpressure": state.pop("backpressure", "block")}, SinkConfig, "s", [])
    assert cfg is not None
    return cfg, convert_options(options, NatsOptions, "sinks[0]")


def test_state_options() -> None:
    cfg, options = sink()
    conn = NatsConnector("n", options, cfg)
    assert conn.writes_state and options.state.bucket == "KV_STATE" and not options.state.create
    assert not NatsConnector("n", NatsOptions(), cfg).writes_state
    with pytest.raises(ConfigError, match=r"sinks\[0\].state.enabled: the state needs mode: jetstream"):
        convert_options({"mode": "core", "state": {"enabled": True}}, NatsOptions, "sinks[0]")
    with pytest.raises(ConfigError, match=r"sinks\[0\].state: bucket 'a.b' is not a valid KV bucket name"):
        convert_options({"state": {"bucket": "a.b"}}, NatsOptions, "sinks[0]")
    # docs/output/state.md: a sink with state needs a destination template without {type} or {epoch}.
    for subject in ("kv.{source}.{dp_rank}.{type}", "kv.{source}.{dp_rank}.{epoch}"):
        with pytest.raises(ConfigError, match=r"sinks\[0\].subject: \{(type|epoch)\} not allowed with state.enabled"):
            convert_options({"subject": subject, "state": {"enabled": True}}, NatsOptions, "sinks[0]")


async def test_state_messages_wait_for_their_stream_and_carry_next() -> None:
    """Which state messages of a write are applied (those before the stream's first transient
    failure), with which ``next`` (the JetStream seq after the last stored message of the stream,
    else the last known one), and how a failed state write is reported."""
    cfg, options = sink()
    conn = NatsConnector("n", options, cfg)
    applied: list[tuple[str, list[tuple[int, int | None]]]] = []
    fail: list[ConnectorError] = []

    async def apply_state(_nc: object, stream: Stream, deltas: Any) -> None:
        if fail:
            raise fail[0]
        applied.append((stream.key, [(d.head.seq, nxt) for d, nxt in deltas]))

    async def bucket_keeps_entries(_nc: object) -> None:
        pass  # (no server: the bucket's settings are not looked at)

    conn._apply_state = apply_state  # type: ignore[method-assign]
    conn._recheck_bucket = bucket_keeps_entries  # type: ignore[method-assign]
    a, b = Stream("a", 0), Stream("b", 0)

    def rec(stream: Stream, seq: int) -> list[Message]:
        r = Record(stream=stream, epoch=1, seq=seq)
        r.state = StateDelta(stream, head(seq))
        event = Message(r, 0, "BlockStored", b"{}", Envelope(r, "", "application/json"))
        return [event, state_message(r)]

    # a0 a1 b0 a2 b1: a1's event failed (transient), b0's permanently (dead-lettered: b goes on)
    messages = [*rec(a, 0), *rec(a, 1), *rec(b, 0), *rec(a, 2), *rec(b, 1)]
    stored = {0: 100, 4: 104, 8: 108}  # a0, b0?, ... by index: JetStream seqs of stored messages
    errors: dict[int, ConnectorError] = {2: Retriable("x"), 4: Permanent("too big"), 6: Retriable("x")}
    seqs = {i: s for i, s in stored.items() if i not in errors}
    conn._next["b/0"] = 50
    await conn._write_state(None, messages, errors, seqs)  # type: ignore[arg-type]
    assert applied == [("a/0", [(0, 101)]), ("b/0", [(0, 50), (1, 109)])]
    assert set(errors) == {2, 3, 4, 6, 7}  # a1's and a2's state messages fail with a1's event
    assert errors[3] is errors[2] and errors[7] is errors[2]
    assert conn._next == {"a/0": 101, "b/0": 109}

    # a failed state write: its state messages fail, transient, whatever the cause
    applied.clear()
    fail.append(Permanent("refused"))
    errors = {}
    await conn._write_state(None, rec(a, 3) + rec(a, 4), errors, {0: 200, 2: 201})  # type: ignore[arg-type]
    assert set(errors) == {1, 3} and all(isinstance(e, Retriable) for e in errors.values())
    assert conn._next["a/0"] == 101 and conn._state_problem is not None and "refused" in conn._state_problem

    # An announcement refused for itself (a SourceReset whose subject another stream owns) is
    # kept and retried, so the state of its record and after waits with it: a state written
    # past it said complete, with `next`, for messages never stored (breaker30n3 B1).
    applied.clear()
    fail.clear()
    r = Record(stream=a, epoch=2, seq=0, kind="SourceReset", reason="publisher_restart")
    r.state = StateDelta(a, head(0))
    reset = [Message(r, None, "SourceReset", b"{}", Envelope(r, "SourceReset", "application/json")), state_message(r)]
    errors = {0: Permanent("subject taken", reason="subject_taken")}
    await conn._write_state(None, reset + rec(a, 5), errors, {})  # type: ignore[arg-type]
    assert applied == [] and set(errors) == {0, 1, 3}
    assert isinstance(errors[1], Retriable) and errors[1].reason == "subject_taken"


def test_a_journal_part_filled_to_its_budget_fits_the_value_limit() -> None:
    """A bucket's max_value_size sizes the parts: a part is the frame (target, part numbers, clear,
    writer id), the head document and entries up to the budget the sink gives it. With 16-digit
    epochs and generations and the writer id, a frame of 128 bytes was too small: a full part went
    over the limit and was refused for ever (breaker29k H2)."""
    size = 2048
    big = Head(epoch=1_796_000_000_000_000, generation=1_796_000_000_123_456, seq=2**40, complete=True, live=10**6)
    head_doc = b'{"source":"eng","dp_rank":0,"epoch":1796000000000000,"gen":1796000000123456,"seq":1099511627776}'
    budget = size - len(head_doc) - nats_connector._JOURNAL_FRAME
    key = len("GPU/999/0123456789abcdef")
    fills = [budget // k - key - 8 - d for k in range(1, 6) for d in range(12)]  # k entries filling a part to its budget
    for value in [*range(1, 60), *fills]:
        ops: list[tuple[str, bytes | None]] = [(f"GPU/999/{i:016x}", b"v" * value) for i in range(60)] + [("CPU/0/01", None)]
        parts = journal_parts(big, head_doc, ops, budget, clear=True, writer="f" * 16)
        assert max(len(p) for p in parts) <= size, (value, max(len(p) for p in parts))


def test_journal_parts_hold_about_limit_bytes_each() -> None:
    """An op counts its key, its document (4 for a delete: ``null``) and 8 bytes; a part takes ops
    while their count stays at or below ``limit``, and at least one."""
    put = ("k1", b'"01234567"')  # 2 + 10 + 8 = 20
    wide = ("k12", b'"01234567"')  # 21
    delete = ("k2", None)  # 2 + 4 + 8 = 14

    def shape(ops: list[tuple[str, bytes | None]], limit: int) -> list[int]:
        parts = journal_parts(head(7), b"{}", ops, limit)
        assert journal_redo(parts, None) == (False, ops, b"{}")
        return [len(msgspec.json.decode(p)["ops"]) for p in parts]

    assert shape([put, put, put], 40) == [2, 1]  # 40: full, not over
    assert shape([put, delete, put], 34) == [2, 1]
    assert shape([put, delete, put], 33) == [1, 1, 1]
    assert shape([put, put, put, put], 40) == [2, 2]  # each part counts from 0
    assert shape([put, put, wide, put], 40) == [2, 1, 1]
    assert shape([("big", b'"' + b"x" * 98 + b'"'), put], 40) == [1, 1]  # one op over the limit: a part of its own
    assert shape([], 40) == [0]


def test_the_newest_complete_journal_is_the_one_redone() -> None:
    ops: list[tuple[str, bytes | None]] = [("k", b"1")]
    older, newer = journal_parts(head(5), b'{"seq":5}', ops, 300), journal_parts(head(6), b'{"seq":6}', ops, 300)
    assert journal_redo([*newer, *older], head(4)) == journal_redo([*older, *newer], head(4)) == (False, ops, b'{"seq":6}')


def test_parts_of_two_tries_of_one_write_are_not_a_whole_journal() -> None:
    """Parts of the same write split differently (another try, another limit) do not make a whole
    one together, even when they are as many as one of them says."""
    ops: list[tuple[str, bytes | None]] = [(f"k{i}", b'"01234567"') for i in range(6)]
    two, three = journal_parts(head(7), b"{}", ops, 60), journal_parts(head(7), b"{}", ops, 40)
    assert (len(two), len(three)) == (2, 3)
    assert journal_redo([two[0], three[2]], head(6)) is None
