"""Hypothesis strategies shared by the unit tests."""

from __future__ import annotations

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
