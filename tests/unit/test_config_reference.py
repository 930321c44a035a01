"""tools/config_reference.py: the site's option tables rendered from the field metadata, written into docs/."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import pytest

from bridge.config import ByteSize, Duration, doc
from bridge.connector import ConnectorOptions, Secret, TlsOptions
from tools import config_reference as ref


class Inner(ConnectorOptions):
    enabled: Annotated[bool, doc("Turn it on.")] = False
    limit: Annotated[int, msgspec.Meta(ge=1, le=10, description="At most | this many.")] = 3


class Shard(ConnectorOptions):
    count: Annotated[int, msgspec.Meta(ge=1, description="Replicas.")]


class Small(ConnectorOptions):
    """A connector's options with one field of every kind the tables show."""

    url: Annotated[str, doc("Where the <server> is.")]
    password: Annotated[Secret | None, doc("Use ${PASSWORD}.")] = None
    mode: Annotated[Literal["fast", "safe"], doc("How to write.")] = "safe"
    timeout: Annotated[Duration, doc("Bound on one call.")] = Duration(0.25)
    max_bytes: Annotated[ByteSize | None, doc("Size cap.")] = ByteSize(16 * 2**20)
    servers: Annotated[str | list[str], doc("One or several.")] = "a:1"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    prefix: str = ""
    tls: Annotated[TlsOptions | None, doc("TLS settings.")] = None
    inner: Inner = msgspec.field(default_factory=Inner)
    shard: Annotated[Shard | None, doc("Optional part.")] = None


EXPECTED = """\
| key | type | default | description |
|---|---|---|---|
| `url` | string | required | Where the &lt;server> is. |
| `password` | secret string or null | `null` | Use ${PASSWORD}. |
| `mode` | `fast` or `safe` | `safe` | How to write. |
| `timeout` | duration | `250ms` | Bound on one call. |
| `max_bytes` | size or null | `16MiB` | Size cap. |
| `servers` | string or list of strings | `a:1` | One or several. |
| `labels` | map of strings | `{}` |  |
| `prefix` | string | `""` |  |
| `tls` | TLS block or null | `null` | TLS settings. |
| `inner.enabled` | boolean | `false` | Turn it on. |
| `inner.limit` | integer (1-10) | `3` | At most \\| this many. |
| `shard` | object or null | `null` | Optional part. |
| `shard.count` | integer (>= 1) | required | Replicas. |
"""


def test_a_struct_renders_as_one_row_per_key() -> None:
    assert ref.render(ref.Section("sinks.small", Small)) == EXPECTED


def test_a_prefix_and_skipped_and_whole_keys() -> None:
    section = ref.Section("x", Small, prefix="small.", skip=frozenset({"url", "password"}), whole=frozenset({"inner"}))
    keys = [line.split(" | ")[0].strip("| `") for line in ref.render(section).splitlines()[2:]]
    assert keys[:2] == ["small.mode", "small.timeout"]
    assert "small.inner" in keys and "small.inner.enabled" not in keys
    assert "small.url" not in keys


DURATIONS = [(0.002, "2ms"), (0.25, "250ms"), (5.0, "5s"), (90.0, "90s"), (120.0, "2m"), (3600.0, "1h")]


@pytest.mark.parametrize(("seconds", "text"), DURATIONS)
def test_durations_read_as_written_in_a_file(seconds: float, text: str) -> None:
    assert ref.duration(seconds) == text


@pytest.mark.parametrize(("n", "text"), [(4 * 2**20, "4MiB"), (2**30, "1GiB"), (1024, "1KiB"), (1000, "1000"), (0, "0")])
def test_sizes_read_as_written_in_a_file(n: int, text: str) -> None:
    assert ref.size(n) == text


def test_every_section_of_the_real_config_renders() -> None:
    tables = ref.tables()
    sections = {"config", "sources", "discovery", "sinks", "sinks.tls", "sinks.file", "sinks.kafka", "sinks.redis", "sinks.nats"}
    assert sections <= set(tables)
    assert "| `batch.max_bytes` | size | `4MiB` |" in tables["sinks"]
    assert "| `checkpoint.interval` | duration | `5s` |" in tables["config"]
    assert "`options`" not in tables["sinks"]


README = """\
# Title

Prose before.

<!-- BEGIN generated: a -->
| old table |
<!-- END generated -->

Prose between.

<!-- BEGIN generated: b -->
<!-- END generated -->
Prose after.
"""


def test_markers_are_filled_and_prose_kept() -> None:
    out = ref.update(README, {"a": "| new a |\n", "b": "| new b |\n"})
    assert out == README.replace("| old table |\n", "| new a |\n").replace(
        "<!-- BEGIN generated: b -->\n", "<!-- BEGIN generated: b -->\n| new b |\n"
    )
    assert ref.update(out, {"a": "| new a |\n", "b": "| new b |\n"}) == out


@pytest.mark.parametrize(
    ("generated", "problem"),
    [
        ({"a": "x\n"}, "unknown section 'b'"),
        ({"a": "x\n", "b": "y\n", "c": "z\n"}, "no markers for section 'c'"),
    ],
)
def test_markers_and_sections_must_match(generated: dict[str, str], problem: str) -> None:
    with pytest.raises(ref.MarkerError, match=problem):
        ref.update(README, generated)


def test_unpaired_and_repeated_markers_are_refused() -> None:
    with pytest.raises(ref.MarkerError, match="unpaired"):
        ref.update(README + "<!-- BEGIN generated: a -->\n", {"a": "x\n", "b": "y\n"})
    with pytest.raises(ref.MarkerError, match="more than once"):
        ref.update(README + "<!-- BEGIN generated: a -->\n<!-- END generated -->\n", {"a": "x\n", "b": "y\n"})


def _site(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A docs/ tree with section a on one page, b on another, and a page without markers."""
    docs = tmp_path / "docs"
    (docs / "sinks").mkdir(parents=True)
    first, second = docs / "index.md", docs / "sinks" / "b.md"
    first.write_text(README.split("Prose between.")[0])
    second.write_text("# B\n\n<!-- BEGIN generated: b -->\n<!-- END generated -->\n")
    (docs / "plain.md").write_text("# No tables\n")
    return docs, first, second


def test_check_reports_drift_and_the_command_that_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs, first, second = _site(tmp_path)
    before = first.read_text(), second.read_text()
    generated = {"a": "| new a |\n", "b": "| new b |\n"}

    def generate() -> dict[str, str]:
        return dict(generated)

    assert ref.main(["--check", "--docs", str(docs)], generate=generate) == 1
    err = capsys.readouterr().err
    assert "out of date" in err and "(a, b)" in err and "run python tools/config_reference.py" in err
    assert (first.read_text(), second.read_text()) == before  # --check never writes

    assert ref.main(["--docs", str(docs)], generate=generate) == 0
    assert "| new a |" in first.read_text() and "| new b |" in second.read_text()  # each page its own section
    assert ref.main(["--check", "--docs", str(docs)], generate=generate) == 0

    generated["b"] = "| changed b |\n"  # a description changed in the code
    assert ref.main(["--check", "--docs", str(docs)], generate=generate) == 1
    assert "(b)" in capsys.readouterr().err


def test_check_reports_broken_markers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs, _first, _second = _site(tmp_path)
    assert ref.main(["--check", "--docs", str(docs)], generate=lambda: {"a": "x\n"}) == 1
    assert "unknown section 'b' in sinks/b.md" in capsys.readouterr().err


def test_a_section_on_two_pages_is_refused() -> None:
    page = "<!-- BEGIN generated: a -->\n<!-- END generated -->\n"
    with pytest.raises(ref.MarkerError, match=r"section 'a' appears more than once \(x.md, y.md\)"):
        ref.update_pages({"x.md": page, "y.md": page}, {"a": "t\n"})


def test_the_real_site_is_current() -> None:
    """Every generated section has its markers once in docs/, and the tables there are current
    (the same check as make test's ``python tools/config_reference.py --check``)."""
    pages = {str(p): t for p, t in ref.pages_of(ref.DOCS).items()}
    assert ref.update_pages(pages, ref.tables()) == pages, "run python tools/config_reference.py"
