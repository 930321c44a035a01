"""The Redis write script's call per engine stream (:class:`connectors.redis._Call`) and the
arguments of a state change (:func:`connectors.redis.state_args`), as the script reads them
(``WRITE_SCRIPT``: KEYS, then the head, the ids expected last, the state expected, then per entry
and state change its arguments)."""

from __future__ import annotations

from bridge.formats import state_message
from bridge.records import Record, Stream
from bridge.state import BlockFact, EntryChange, Head, StateDelta
from bridge.state_docs import StateFormat, entry_key
from connectors.redis import WRITE_SCRIPT, _Call, entry_id, state_args

STREAM = Stream("llama-a", 3)


def test_a_call_names_each_stream_key_once_and_its_entries_by_key_number() -> None:
    call = _Call("~1000", None, None, STREAM)
    assert call.announces == {}  # (the connector notes there each EventsLost entry it adds)
    call.add(0, "kv:a", "5-1", ["type", "BlockStored"])
    call.add(2, "kv:b", "5-2", ["x"])
    call.add(3, "kv:a", "5-3", [])
    call.add_state(4, [0, "1", "6-0", "9"])
    assert call.keys == ["kv:a", "kv:b"]
    assert call.indexes == [0, 2, 3, 4]
    assert call.items == [("kv:a", "5-1"), ("kv:b", "5-2"), ("kv:a", "5-3"), (None, ("6-0", "9"))]
    assert call.stream == STREAM
    entries = [1, "5-1", 2, "type", "BlockStored", 2, "5-2", 1, "x", 1, "5-3", 0]
    assert call.args == [*entries, 0, "1", "6-0", "9"]
    assert call.command({"kv:b": "4-7", "other": "1-1"}, {}) == [
        "EVAL",
        WRITE_SCRIPT,
        2,
        "kv:a",
        "kv:b",
        *["~1000", "0", "llama-a", "3", "0"],  # no index, no state
        1,
        2,
        "4-7",  # one id expected last: in key 2
        "",
        "",  # no state written
        *call.args,
    ]


def test_a_call_with_an_index_and_a_state_adds_their_keys_and_the_state_it_expects() -> None:
    call = _Call("0", "kv:a:blocks", "kv:a:state", STREAM)
    call.add(0, "kv:a", "5-1", ["f"])
    command = call.command({"kv:a": "5-0"}, {"kv:a:state": ("4-9", "2"), "kv:other:state": ("1-1", "1")})
    keys = ["kv:a", "kv:a:blocks", "kv:a:blocks:counts", "kv:a:state"]
    assert command == ["EVAL", WRITE_SCRIPT, 4, *keys, "0", "1", "llama-a", "3", "1", 1, 1, "5-0", "4-9", "2", *call.args]
    assert call.command({}, {})[-len(call.args) - 3 : -len(call.args)] == [0, "", ""]


def test_state_args_are_the_clear_flag_the_position_the_generation_the_deletes_the_puts_and_the_head() -> None:
    fmt = StateFormat()
    fact = BlockFact(0x1234, None, [1, 2, 3], 16, "GPU", 0)
    head = Head(7, 2, 10, True, 1)
    kept = EntryChange("GPU", 0, 0x1234, 1, fact)
    gone = [EntryChange("CPU", None, 0x99, 0, None), EntryChange("GPU", 1, 0x98, 0, None)]
    for clear in (False, True):
        record = Record(
            stream=STREAM, epoch=7, seq=10, state=StateDelta(STREAM, head, clear=clear, changes=[gone[0], kept, gone[1]])
        )
        message = state_message(record)
        at = entry_id(message.position)
        assert state_args(message, fmt) == [
            0,
            "1" if clear else "0",
            at,
            "2",
            2,
            entry_key("CPU", None, 0x99),
            entry_key("GPU", 1, 0x98),
            1,
            entry_key("GPU", 0, 0x1234),
            fmt.entry(STREAM, head, kept),
            fmt.head(STREAM, head, at),
        ]
