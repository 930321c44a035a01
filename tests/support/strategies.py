"""Hypothesis strategies shared by the unit tests."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import strategies as st


def msgpack_values(*, text: int, key: int, max_leaves: int) -> st.SearchStrategy[Any]:
    """Any value msgpack carries (no ext): scalars of every kind, u64 and i64 ints, binary, and
    lists and maps of them nested; ``text``/``key``: longest strings and map keys."""
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=text),
        st.binary(max_size=4),
    )

    def nest(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=key), inner, max_size=3)

    return st.recursive(leaf, nest, max_leaves=max_leaves)


def examples(n: int) -> int:
    """``max_examples`` for a property test whose own count is ``n``: ``n`` scaled by
    ``KV_EXAMPLES_SCALE`` (default 1), at least 1. tools/mutants.py's fast pass sets it below 1 (above 1: more examples)
    and runs every mutant that pass lets through again at full counts
    (docs/development/mutation-testing.md, "How a mutant is run")."""
    raw = os.environ.get("KV_EXAMPLES_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"KV_EXAMPLES_SCALE={raw!r} is not a number: set it to a fraction such as 0.1, or unset it") from None
    if not scale > 0:
        raise ValueError(f"KV_EXAMPLES_SCALE={raw!r} is not above 0: set a fraction such as 0.1, or unset it (full counts)")
    return max(1, round(n * scale))
