"""State documents (bridge.state_docs): the keys entries are written under, and the hash fields
of an entry in each hash form, as a consumer reads them back."""

from __future__ import annotations

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
