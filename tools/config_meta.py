"""The configuration's field metadata, read in one place for the tools that publish it.

``tools/chart_schema.py`` turns it into the Helm values schema and ``tools/config_reference.py``
into the README's option tables. Both see the same structs (``bridge.config.Config``, the keys every
sink has, and the ``Options`` of every installed connector) and the same text: a field's
``msgspec.Meta(description=...)`` (``bridge.config.doc``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bridge.config import SINK_KEYS, ByteSize, Config, Duration, SinkConfig  # noqa: E402
from bridge.connector import Registry  # noqa: E402
from bridge.secret import Secret  # noqa: E402

__all__ = [
    "ROOT",
    "SINK_OPTIONS",
    "ByteSize",
    "Config",
    "Duration",
    "Field",
    "Secret",
    "SinkConfig",
    "connectors",
    "description",
    "fields",
    "nested_struct",
    "sink_common_keys",
    "struct_type",
    "unwrap",
]

SINK_OPTIONS = "options"
"""SinkConfig's field that holds the connector's own keys (written beside the common ones in a file)."""


def struct_type(cls: type) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType), cls
    return info


def connectors(registry: Registry | None = None) -> list[tuple[str, type[msgspec.Struct]]]:
    """(type name, Options struct) of every installed connector, by name."""
    registry = registry or Registry()
    return [(name, registry.get(name).Options) for name in registry.names()]


def sink_common_keys() -> list[str]:
    """The keys every sink has (SinkConfig without its ``options``), as a file spells them."""
    keys = [f.encode_name for f in struct_type(SinkConfig).fields if f.encode_name != SINK_OPTIONS]
    assert set(keys) <= SINK_KEYS, "SinkConfig and SINK_KEYS disagree"
    return keys


def unwrap(t: mi.Type) -> mi.Type:
    """``t`` without its ``Annotated`` metadata."""
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def description(t: mi.Type) -> str | None:
    """The field's own description: the outermost ``Meta(description=...)``."""
    while isinstance(t, mi.Metadata):
        text = (t.extra_json_schema or {}).get("description")
        if text:
            return " ".join(str(text).split())
        t = t.type
    return None


def nested_struct(t: mi.Type) -> tuple[type[msgspec.Struct] | None, bool]:
    """(the struct, whether null is allowed) for a ``S`` / ``S | None`` field, else (None, False)."""
    t = unwrap(t)
    if isinstance(t, mi.StructType):
        return t.cls, False
    if isinstance(t, mi.UnionType):
        others = [unwrap(a) for a in t.types if not isinstance(unwrap(a), mi.NoneType)]
        if len(others) == 1 and isinstance(others[0], mi.StructType):
            return others[0].cls, len(others) < len(t.types)
    return None, False


@dataclass(frozen=True)
class Field:
    """One key of a config struct, as the tools show it."""

    key: str
    """Dotted path from the walk's start (``batch.max_bytes``)."""
    info: mi.Type
    """The type without its metadata (constraints stay: ``IntType(ge=1)``)."""
    description: str | None
    required: bool
    default: Any
    """The default value (a factory's product), ``msgspec.NODEFAULT`` when required."""
    struct: type[msgspec.Struct] | None
    """The nested struct when the key holds one (``S`` or ``S | None``)."""


def fields(cls: type, prefix: str = "", *, skip: frozenset[str] = frozenset()) -> Iterator[Field]:
    """The keys of ``cls`` in declaration order (not descending into nested structs)."""
    for f in struct_type(cls).fields:
        if f.encode_name in skip:
            continue
        default = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        struct, _ = nested_struct(f.type)
        yield Field(
            key=prefix + f.encode_name,
            info=unwrap(f.type),
            description=description(f.type),
            required=f.required,
            default=default,
            struct=struct,
        )
