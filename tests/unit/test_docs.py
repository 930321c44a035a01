"""The documentation states facts the code decides: each checked here against the code, so the page
and the code cannot drift apart (the site itself is built with ``mkdocs build --strict`` by
``make test``, which checks every link and anchor; its generated tables: test_config_reference.py;
its config blocks: test_config_blocks.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bridge import cli
from bridge.metrics import Metrics
from kv_consumer import KvIndex, position
from kv_consumer.state import LAST

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _section(text: str, heading: str) -> str:
    """The body of the Markdown section ``heading`` (up to the next heading of its level or above)."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n") + len(heading) + 1
    stop = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(text, start)
    return text[start : stop.start() if stop else len(text)]


# -- the ordering and dedup rule: the docs' definition is what the consumers do ---------------------

EPOCH, SEQ, INDEX = 1_000_007, 41, 3
RECORDS: dict[str, dict[str, Any]] = {
    "`SourceReset`": {"type": "SourceReset", "reason": "publisher_restart", "seq": 0},
    "a batch": {"type": "EventBatch", "seq": SEQ, "events": []},
    "an event": {"type": "BlockStored", "seq": SEQ, "index": INDEX, "block_hashes": [1]},
    "`EventsLost`": {"type": "EventsLost", "seq": SEQ, "from_seq": 5, "to_seq": SEQ, "count": SEQ - 4, "reason": "no_replay"},
}


TERMS: dict[str, float] = {"epoch": EPOCH, "seq + 1": SEQ + 1, "index + 1": INDEX + 1, "0": 0, "∞": float("inf")}
"""What the table's terms stand for, for the records above (a term not here fails the test: say it here)."""


def _documented_positions() -> dict[str, tuple[int, int, float]]:
    """The position table of concepts/streams.md, evaluated for the records above."""
    text = _section((DOCS / "concepts" / "streams.md").read_text(), "## Order and deduplication")
    out: dict[str, tuple[int, int, float]] = {}
    for row in re.finditer(r"^\| (?P<record>[^|]+?) \| `\((?P<pos>[^)]*)\)`", text, re.M):
        record = next(k for k in RECORDS if row.group("record").startswith(k))
        parts = [TERMS[p.strip()] for p in row.group("pos").split(",")]
        out[record] = (int(parts[0]), int(parts[1]), parts[2])
    assert set(out) == set(RECORDS), f"the position table names {sorted(out)}"
    return out


def test_the_documented_position_is_what_the_consumer_library_computes() -> None:
    for name, pos in _documented_positions().items():
        record = {"source": "a", "dp_rank": 0, "epoch": EPOCH, "schema_version": 1, **RECORDS[name]}
        expected = tuple(LAST if p == float("inf") else p for p in pos)
        assert position(record) == expected, (name, position(record), expected)
    # and a SourceReset sorts before its epoch's first batch, which shares (epoch, seq) with it
    first = {"epoch": EPOCH, "type": "EventBatch", "seq": 0, "events": []}
    assert position({"epoch": EPOCH, **RECORDS["`SourceReset`"]}) < position(first)


def test_a_reset_and_its_first_batch_are_both_applied() -> None:
    """The case the rule exists for: (source, dp_rank, epoch, seq) equal, both records kept."""
    index = KvIndex()
    head = {"source": "a", "dp_rank": 0, "epoch": EPOCH, "seq": 0, "schema_version": 1}
    index.apply({**head, "type": "SourceReset", "reason": "publisher_restart"})
    index.apply({**head, "type": "EventBatch", "ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [7]}]})
    assert index.applied == 2 and index.duplicates == 0
    index.apply({**head, "type": "EventBatch", "ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [7]}]})
    assert index.duplicates == 1  # a copy of the batch is skipped


# -- facts the pages state ---------------------------------------------------------------------------


def test_every_metric_is_on_the_metrics_page() -> None:
    page = (DOCS / "reference" / "metrics.md").read_text()
    names = {c._name for c in set(Metrics().registry._names_to_collectors.values())}
    discovery = {"kv_bridge_discovery_resolutions", "kv_bridge_discovery_addresses", "kv_bridge_discovery_sources"}
    missing = sorted(n for n in names | discovery if f"`{n}" not in page)
    assert not missing, f"docs/reference/metrics.md lacks {missing}"


def test_the_dashboard_panel_count_is_the_dashboard_s() -> None:
    dashboard = json.loads((ROOT / "helm" / "kv-event-bridge" / "files" / "dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    panels += [q for p in dashboard["panels"] for q in p.get("panels", [])]  # panels inside collapsed rows
    stated = re.findall(r"(\d+) panels", "\n".join(p.read_text() for p in DOCS.rglob("*.md")))
    assert stated and {int(n) for n in stated} == {len(panels)}


def test_the_compatibility_table_is_the_same_in_the_readme_and_the_site() -> None:
    readme = _section((ROOT / "README.md").read_text(), "## Compatibility")
    engines = _section((DOCS / "getting-started" / "engines.md").read_text(), "## Compatibility")
    assert readme.strip() == engines.strip(), "edit both, or copy README.md's table into docs/getting-started/engines.md"


def test_the_readme_is_a_first_visit() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 150, f"README.md has {lines} lines: move detail into docs/ and link it"


def test_the_checkpoint_path_is_the_one_the_chart_mounts() -> None:
    """The chart mounts /var/lib/kv-event-bridge; no page or example names another directory there."""
    texts = [p.read_text() for p in [*DOCS.rglob("*.md"), *(ROOT / "examples").glob("*.*"), ROOT / "README.md"]]
    assert not [t for t in texts if "/var/lib/kv-bridge" in t]
    mount = re.search(r"mountPath: (\S+)", (ROOT / "helm" / "kv-event-bridge" / "values.yaml").read_text())
    assert mount is not None and mount.group(1) == "/var/lib/kv-event-bridge"


def test_every_example_config_is_in_the_examples_readme() -> None:
    """examples/README.md names, for each config, the engine it expects and what reads it (or why nothing does)."""
    readme = (ROOT / "examples" / "README.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", readme, re.M)}
    configs = sorted(p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".yaml", ".yml", ".toml"))
    assert sorted(rows) == configs
    for name, row in rows.items():
        reader = row.rstrip(" |").rsplit("|", 1)[1]
        assert "consume_" in reader or "not" in reader or "tail" in reader, f"{name}: say what reads it, or why nothing does"


def test_the_cli_page_names_every_command_and_exit_code() -> None:
    page = (DOCS / "reference" / "cli.md").read_text()
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    commands = set(sub.choices)  # type: ignore[union-attr]
    assert commands and not [c for c in commands if f"python -m bridge {c}" not in page]
    codes = {int(m) for m in re.findall(r"^\| (\d+) \|", _section(page, "## Exit codes"), re.M)}
    exits = {v for k, v in vars(cli).items() if k.startswith("EXIT_")}
    assert codes == exits, f"the page lists {sorted(codes)}, bridge/cli.py has {sorted(exits)}"


def test_the_dedup_rule_is_defined_in_one_place() -> None:
    """Pages link "Order and deduplication" rather than restating a key (the old one dropped records)."""
    restated = [
        str(p.relative_to(ROOT))
        for p in [*DOCS.rglob("*.md"), ROOT / "README.md"]
        if re.search(r"deduplicat\w* on\W+\(?`?source", p.read_text())
    ]
    assert not restated, f"link docs/concepts/streams.md#order-and-deduplication instead: {restated}"
    assert len(list(DOCS.rglob("*.md"))) > 1 and "## Order and deduplication" in (DOCS / "concepts" / "streams.md").read_text()
