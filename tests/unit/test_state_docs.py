"""State documents (bridge.state_docs): the keys entries are written under, and the hash fields
of an entry in each hash form, as a consumer reads them back."""

from __future__ import annotations

import json

import pytest

from bridge.formats import hex64
from bridge.records import Stream
from bridge.state import BlockFact, EntryChange, Head
from bridge.state_docs import StateFormat, entry_key, parse, seed_entry, tier_text

A = Stream("engine", 0)
HEAD = Head(epoch=3, generation=1, seq=9, complete=True, live=1)


@pytest.mark.parametrize(
    ("medium", "group_idx", "text"),
    [
        (None, None, "-/-"),
        ("GPU", 0, "GPU/0"),
        ("cpu_tier", 12, "cpu_tier/12"),
        ("", None, "=/-"),  # an empty medium: not the "-" of one not sent
        ("-", None, "=2D/-"),  # a medium named "-": not one not sent either
        ("a/b", 1, "a=2Fb/1"),  # no "/" but the key's own
        ("é", None, "=C3=A9/-"),  # UTF-8 bytes
    ],
)
def test_a_tier_is_written_with_its_unsafe_characters_escaped(medium: str | None, group_idx: int | None, text: str) -> None:
    assert tier_text(medium, group_idx) == text
    assert entry_key(medium, group_idx, 255) == f"{text}/00000000000000ff"


def test_no_two_tiers_share_an_entry_key() -> None:
    tiers = [(None, None), ("", None), ("-", None), ("=", None), ("=2D", None), ("GPU", None), ("GPU", 0), (None, 0)]
    assert len({entry_key(m, g, 1) for m, g in tiers}) == len(tiers)


def fact(hash_: int | bytes, parent: int | bytes | None) -> BlockFact:
    return BlockFact(hash=hash_, parent=parent, token_ids=[1, 2], block_size=2, medium="GPU", group_idx=None)


def entry(fmt: StateFormat, f: BlockFact) -> dict[str, object]:
    doc = parse(fmt.entry(A, HEAD, EntryChange("GPU", None, 5, 2, f)))
    assert doc is not None
    return doc


@pytest.mark.parametrize("hash_hex", [False, True])
def test_an_entry_names_its_hash_and_its_parent_in_the_sinks_hash_form(hash_hex: bool) -> None:
    fmt = StateFormat(hash_hex=hash_hex)
    shown = hex64 if hash_hex else (lambda v: v)
    doc = entry(fmt, fact(2**64 - 2, 7))
    assert (doc["hash"], doc["parent"]) == (shown(2**64 - 2), shown(7))
    doc = entry(fmt, fact(7, None))  # a block without a parent: null, in either form
    assert "parent" in doc and doc["parent"] is None and doc["hash"] == shown(7)
    doc = entry(fmt, fact(b"\x01" * 32, b"\x02" * 32))  # binary digests: hex
    assert (doc["hash"], doc["parent"]) == ("01" * 32, "02" * 32)


def test_an_entry_read_back_has_the_parent_it_was_written_with() -> None:
    """(A fact is read back with a block still held more than once: count 2.)"""
    for hash_hex in (False, True):
        for parent in (None, 7, b"\x02" * 32):
            read = seed_entry(entry(StateFormat(hash_hex=hash_hex), fact(9, parent)))
            assert read is not None and read[5] is not None and read[5].parent == parent, (hash_hex, parent)


def test_a_sinks_format_takes_its_hash_form_and_token_policy() -> None:
    from bridge.config import SinkConfig
    from bridge.secret import Secret

    assert StateFormat.for_sink(SinkConfig(type="kafka", hash_format="hex")).hash_hex
    assert not StateFormat.for_sink(SinkConfig(type="kafka")).hash_hex
    fmt = StateFormat.for_sink(SinkConfig(type="kafka", token_ids="hash", token_ids_key=Secret("k" * 32)))
    assert "token_hashes" in entry(fmt, fact(7, None))
    assert not StateFormat().hash_hex  # by default, integer hashes are numbers


def test_hashing_token_ids_needs_a_key() -> None:
    with pytest.raises(ValueError, match="token_ids: hash needs a key"):
        StateFormat("hash")
    with pytest.raises(ValueError, match="token_ids: hash needs a key"):
        StateFormat("hash", b"")


@pytest.mark.parametrize(
    ("policy", "tokens"),
    [("keep", {"token_ids"}), ("drop", set()), ("hash", {"token_hashes"})],
)
def test_an_entry_carries_the_token_ids_as_its_sinks_policy_says(policy: str, tokens: set[str]) -> None:
    doc = entry(StateFormat(policy, b"k" * 16), fact(7, None))  # a key given even where not needed
    assert {k for k in doc if k.startswith("token")} == tokens
    if policy == "keep":
        assert doc["token_ids"] == [1, 2]
    if policy == "hash":
        assert isinstance(doc["token_hashes"], list) and len(doc["token_hashes"]) == 1  # one block of 2 tokens


def test_an_entry_with_token_hashes_read_back_writes_them_as_they_were() -> None:
    fmt = StateFormat("hash", b"k" * 16)
    back = BlockFact(hash=7, parent=None, token_ids=[], block_size=2, medium="GPU", group_idx=None, token_hashes=["h"])
    assert entry(fmt, back)["token_hashes"] == ["h"]
    no_tokens = BlockFact(hash=7, parent=None, token_ids=[], block_size=2, medium="GPU", group_idx=None)
    assert entry(fmt, no_tokens)["token_hashes"] == []  # none to hash: an empty list, not null


def test_an_entry_carries_the_blocks_other_facts_json_safe() -> None:
    f = BlockFact(
        hash="h-7",  # type: ignore[arg-type]  # a hash of a form the bridge does not know: as it came
        parent=None,
        token_ids=[1, 2],
        block_size=2,
        medium="GPU",
        group_idx=None,
        lora_id=3,
        lora_name="adapter",
        extra_keys=[b"\x01", {"k": b"\x02", 3: "x"}, ("t",), 5],
    )
    doc = entry(StateFormat(), f)
    assert doc["hash"] == "h-7"
    assert (doc["block_size"], doc["lora_id"], doc["lora_name"]) == (2, 3, "adapter")
    assert doc["extra_keys"] == ["01", {"k": "02", "3": "x"}, ["t"], 5]


def test_a_head_written_before_tracking_was_recorded_reads_as_tracking() -> None:
    from bridge.state_docs import head_of

    doc = {"epoch": 1, "gen": 2, "seq": 3, "complete": True, "live": 4}
    assert head_of(doc) == Head(epoch=1, generation=2, seq=3, complete=True, live=4, tracking=True)
    assert head_of({**doc, "tracking": False}) == Head(epoch=1, generation=2, seq=3, complete=True, live=4, tracking=False)


def entry_doc(**fields: object) -> dict[str, object]:
    return {"medium": "GPU", "group_idx": None, "block": "00000000000000ff", "count": 2, "seq": 3, **fields}


def test_an_entry_read_back_takes_its_hash_in_each_written_form() -> None:
    def hash_of(value: object) -> object:
        read = seed_entry(entry_doc(hash=value))
        assert read is not None and read[5] is not None
        return read[5].hash

    assert hash_of(7) == 7
    assert hash_of("0000000000000a0b") == 0xA0B  # 16 hex digits: an integer hash written as hex
    assert hash_of("0a" * 16) == b"\x0a" * 16  # a binary digest
    assert hash_of(None) == 255  # no hash written: the block id stands for it
    assert hash_of("0" * 15) == 255 and hash_of("0" * 17) == 255  # not hex of either form


def test_an_entry_read_back_is_refused_when_its_tier_is_not_one() -> None:
    assert seed_entry(entry_doc(medium=5)) is None
    assert seed_entry(entry_doc(group_idx="0")) is None
    assert seed_entry(entry_doc(medium=None, group_idx=1)) is not None


def test_an_entry_held_once_is_read_back_without_its_facts() -> None:
    once = seed_entry(entry_doc(count=1, hash=7))
    twice = seed_entry(entry_doc(count=2, hash=7))
    assert once == ("GPU", None, 255, 1, 3, None)
    assert twice is not None and twice[5] is not None and twice[5].hash == 7


def test_an_entry_written_without_its_fact_is_read_back_without_one() -> None:
    """breaker49 B3: an entry too large for the sink is written without its fact (count and version
    only). Read back held twice, it was given a made-up fact (its block id for its hash, no parent,
    no tokens), which the tracker wrote out once a copy was removed: a complete state then said the
    block was a root with no tokens (I6)."""
    written = StateFormat().entry(A, HEAD, EntryChange("GPU", None, 255, 2, None))
    read = seed_entry(json.loads(written))
    assert read == ("GPU", None, 255, 2, 9, None)


def test_a_stream_is_rebuilt_from_the_entries_of_its_heads_generation_only() -> None:
    from bridge.state_docs import seed_of

    head = {"epoch": 1, "gen": 2, "seq": 3, "complete": True, "live": 1}
    current = entry_doc(epoch=1, gen=2)
    older = entry_doc(epoch=1, gen=1, block="0000000000000001")
    unversioned = entry_doc(block="0000000000000002")  # no epoch, gen: not one to rebuild from
    rebuilt = seed_of(head, [unversioned, older, current, unversioned])
    assert rebuilt is not None
    assert [e[2] for e in rebuilt[1]] == [255]
    assert seed_of({"epoch": 1}, [current]) is None  # a head that cannot be read: cannot tell
