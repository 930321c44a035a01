"""Write the generated reference tables of the documentation site (docs/) from the code.

    python tools/config_reference.py           rewrite the tables in docs/
    python tools/config_reference.py --check   exit 1 when a page is out of date (CI, tests)

Each table sits between marker comments naming its section, in whichever page of ``docs/`` shows
it (each section exactly once across the site), and everything between them is replaced (prose
around them is kept):

    <!-- BEGIN generated: sinks.kafka -->
    | key | type | default | description |
    ...
    <!-- END generated -->

Sections: ``config`` (the top level), ``sources``, ``discovery``, ``sinks`` (the keys every sink has),
``sinks.tls`` (the ``tls`` block of the connectors that speak TLS) and ``sinks.NAME`` for every
installed connector (those render from the config structs); ``chart.values`` (every value of
the Helm chart, as ``tools/chart_readme.py`` lists them) and ``chart.production`` (the chart's
production values file). A row's description is the field's ``msgspec.Meta(description=...)``
(``bridge.config.doc``), the same text as the Helm values schema (``tools/chart_schema.py``); nested
structs are flattened into dotted keys. Run it after changing a config struct or a connector's options.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import msgspec.inspect as mi

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bridge.config import DiscoveryConfig, Interval, SourceConfig  # noqa: E402
from bridge.connector import TlsOptions  # noqa: E402
from tools.config_meta import (  # noqa: E402
    SINK_OPTIONS,
    ByteSize,
    Config,
    Duration,
    Field,
    Secret,
    SinkConfig,
    connectors,
    fields,
)

DOCS = ROOT / "docs"
COMMAND = "python tools/config_reference.py"

BLOCKS: dict[type, str] = {TlsOptions: "TLS block"}
"""Structs shown as one row (they have a table of their own) instead of being flattened."""


@dataclass(frozen=True)
class Section:
    """One generated table: the keys of ``cls`` (nested structs flattened, ``whole`` kept as one row)."""

    name: str
    cls: type[msgspec.Struct]
    prefix: str = ""
    skip: frozenset[str] = frozenset()
    whole: frozenset[str] = frozenset()


def sections() -> list[Section]:
    """Every configuration table the site carries (its markers may come in any order)."""
    out = [
        Section("config", Config, whole=frozenset({"sources", "discovery", "sinks"})),
        Section("sources", SourceConfig),
        Section("discovery", DiscoveryConfig, prefix="discovery."),
        Section("sinks", SinkConfig, skip=frozenset({SINK_OPTIONS})),
        Section("sinks.tls", TlsOptions, prefix="tls."),
    ]
    out += [Section(f"sinks.{name}", options) for name, options in connectors()]
    return out


# -- rows ----------------------------------------------------------------------------------------


def rows(
    cls: type, prefix: str = "", *, skip: frozenset[str] = frozenset(), whole: frozenset[str] = frozenset()
) -> Iterator[Field]:
    """The keys of ``cls``; a nested struct's keys follow its own row (shown when it says something)."""
    for f in fields(cls, prefix, skip=skip):
        name = f.key[len(prefix) :]
        if f.struct is None or f.struct in BLOCKS or name in whole:
            yield f
            continue
        if f.description or (not f.required and f.default is None):
            yield f
        yield from rows(f.struct, f.key + ".")


def type_text(t: mi.Type) -> str:
    """A field's type in words: ``integer (1-1024)``, ``duration or null``, ```block` or `drop```."""
    if isinstance(t, mi.Metadata):
        return type_text(t.type)
    if isinstance(t, mi.UnionType):
        parts = [type_text(a) for a in t.types if not isinstance(a, mi.NoneType)]
        if any(isinstance(a, mi.NoneType) for a in t.types):
            parts.append("null")
        return _either(parts)
    if isinstance(t, mi.LiteralType):
        return _either([f"`{v}`" for v in t.values])
    if isinstance(t, mi.BoolType):
        return "boolean"
    if isinstance(t, mi.IntType | mi.FloatType):
        return ("integer" if isinstance(t, mi.IntType) else "number") + _bounds(t)
    if isinstance(t, mi.StrType):
        return "non-empty string" if t.min_length else "string"
    if isinstance(t, mi.CustomType):
        names = {Duration: "duration", Interval: "duration", ByteSize: "size", Secret: "secret string"}
        if t.cls not in names:
            raise NotImplementedError(f"no reference type for {t.cls!r}")
        return names[t.cls]
    if isinstance(t, mi.StructType):
        return BLOCKS.get(t.cls, "object")
    if isinstance(t, mi.DictType):
        return f"map of {_plural(t.value_type)}"
    if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        return f"list of {_plural(t.item_type)}"
    if isinstance(t, mi.AnyType):
        return "any"
    if isinstance(t, mi.NoneType):
        return "null"
    raise NotImplementedError(f"no reference type for {t!r}")


def _either(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def _plural(t: mi.Type) -> str:
    text = type_text(t)
    return "objects" if text == "object" else text if " " in text else text + "s"


def _bounds(t: mi.IntType | mi.FloatType) -> str:
    if t.ge is not None and t.le is not None:
        return f" ({t.ge}-{t.le})"
    shown = [f"{op} {v}" for op, v in ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt)) if v is not None]
    return f" ({', '.join(shown)})" if shown else ""


def default_text(f: Field) -> str:
    """The default as a file would spell it (``2ms``, ``4MiB``), ``required``, or blank for a struct."""
    if f.required:
        return "required"
    value = f.default
    if isinstance(value, msgspec.Struct):
        return ""
    if isinstance(value, Duration):
        return f"`{duration(value)}`"
    if isinstance(value, ByteSize):
        return f"`{size(value)}`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value and value.strip() == value and "`" not in value else f'`"{value}"`'
    return f"`{msgspec.json.encode(value).decode()}`"


def duration(seconds: float) -> str:
    """``2ms``, ``15s``, ``2m``, ``1h``: the largest unit that shows the value exactly."""
    for unit, scale in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= scale and (seconds / scale).is_integer():
            return f"{int(seconds / scale)}{unit}"
    ms = seconds * 1000
    if math.isclose(ms, round(ms)):
        return f"{round(ms)}ms"
    return f"{seconds}s"


def size(n: int) -> str:
    """``64MiB``, ``1KiB``, ``1000``: binary units when exact, else bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# -- tables --------------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Text safe in a Markdown table cell: no line breaks, pipes escaped, no stray HTML or emphasis."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def table(items: Iterator[Field] | list[Field]) -> str:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for f in items:
        lines.append(f"| `{f.key}` | {cell(type_text(f.info))} | {default_text(f)} | {cell(f.description or '')} |")
    return "\n".join(lines) + "\n"


def render(section: Section) -> str:
    return table(list(rows(section.cls, section.prefix, skip=section.skip, whole=section.whole)))


def chart_tables() -> dict[str, str]:
    """The chart's values table and its production values file, as tools/chart_readme.py shows them."""
    from tools import chart_readme

    chart = chart_readme.CHART
    production = (chart / chart_readme.PRODUCTION).read_text().rstrip("\n")
    return {
        "chart.values": chart_readme.values_table((chart / "values.yaml").read_text()) + "\n",
        "chart.production": f"```yaml\n{production}\n```\n",
    }


def tables(all_sections: list[Section] | None = None) -> dict[str, str]:
    """Section name -> its table (the config structs' and, with the default sections, the chart's)."""
    out = {s.name: render(s) for s in (all_sections if all_sections is not None else sections())}
    return out if all_sections is not None else out | chart_tables()


# -- markers -------------------------------------------------------------------------------------

MARKER = re.compile(r"<!-- BEGIN generated: (?P<name>[^ ]+) -->\n(?P<body>.*?)<!-- END generated -->", re.DOTALL)


class MarkerError(Exception):
    """The pages' markers do not match the sections (unknown, missing or repeated names)."""


def update_pages(pages: Mapping[str, str], generated: Mapping[str, str]) -> dict[str, str]:
    """Each page's text with the body of every marker pair replaced by its section's table; every
    section must have its markers exactly once across all pages."""
    problems: list[str] = []
    found: dict[str, list[str]] = {}
    out: dict[str, str] = {}
    for page, text in pages.items():
        seen: list[str] = []

        def replace(m: re.Match[str], page: str = page, seen: list[str] = seen) -> str:
            name = m.group("name")
            seen.append(name)
            found.setdefault(name, []).append(page)
            if name not in generated:
                problems.append(f"unknown section {name!r}{_where(page)} (known: {', '.join(generated)})")
                return m.group(0)
            return f"<!-- BEGIN generated: {name} -->\n{generated[name]}<!-- END generated -->"

        out[page] = MARKER.sub(replace, text)
        if text.count("<!-- BEGIN generated:") != len(seen) or text.count("<!-- END generated -->") != len(seen):
            problems.append(f"unpaired BEGIN/END generated markers{_where(page)}")
    problems += [
        f"section {name!r} appears more than once ({', '.join(p or 'the text' for p in where)})"
        for name, where in sorted(found.items())
        if len(where) > 1
    ]
    problems += [f"no markers for section {name!r}" for name in generated if name not in found]
    if problems:
        raise MarkerError("; ".join(problems))
    return out


def _where(page: str) -> str:
    return f" in {page}" if page else ""


def update(text: str, generated: Mapping[str, str]) -> str:
    """``text`` (the only page) with the body of every marker pair replaced by its section's table."""
    return update_pages({"": text}, generated)[""]


def stale(text: str, generated: Mapping[str, str]) -> list[str]:
    """The sections whose table in ``text`` differs from the generated one."""
    current = {m.group("name"): m.group("body") for m in MARKER.finditer(text)}
    return [name for name in generated if name in current and current[name] != generated[name]]


def pages_of(docs: Path) -> dict[Path, str]:
    """The pages under ``docs`` that hold markers, by path."""
    texts = {p: p.read_text(encoding="utf-8") for p in sorted(docs.rglob("*.md"))}
    return {p: text for p, text in texts.items() if "<!-- BEGIN generated:" in text}


def main(argv: list[str] | None = None, *, generate: Callable[[], dict[str, str]] = tables) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a page is out of date")
    p.add_argument("--docs", type=Path, default=DOCS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    docs: Path = args.docs
    shown = docs.relative_to(ROOT) if docs.is_relative_to(ROOT) else docs
    pages = pages_of(docs)
    named = {str(path.relative_to(docs)): text for path, text in pages.items()}
    generated = generate()
    try:
        new = update_pages(named, generated)
    except MarkerError as exc:
        print(f"{shown}: {exc}", file=sys.stderr)
        return 1
    changed = {name: text for name, text in new.items() if text != named[name]}
    if args.check:
        if changed:
            names = ", ".join(n for name in changed for n in stale(named[name], generated))
            print(
                f"{shown}: the generated tables are out of date with the code ({names}): run {COMMAND}",
                file=sys.stderr,
            )
            return 1
        print(f"{shown}: generated tables are up to date")
        return 0
    for name, text in changed.items():
        (docs / name).write_text(text, encoding="utf-8")
    if changed:
        print(f"wrote {len(generated)} tables into {len(changed)} page(s) of {shown}")
    else:
        print(f"{shown}: tables already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
