"""Every configuration a reader may copy passes ``python -m bridge --config FILE --check --offline``:
each example config in ``examples/``, each YAML and TOML block of the documentation site
(``docs/``), and the ``config`` of each of the Helm chart's values files, without a warning (a
warning means a secret written in plain text).

- A docs block that is a fragment (a ``sinks:`` list alone, say) is completed with only what it
  lacks to be a whole file: a placeholder engine when it names neither ``sources`` nor
  ``discovery``, a stdout sink when it names no sink. Everything it does write is checked as written.
- A block of chart values (top-level keys of ``values.yaml`` that the bridge's config does not
  have, e.g. ``mode``, ``config``, ``serviceMonitor``) is checked against the chart's
  ``values.schema.json``, and its ``config`` is merged into the chart's default ``config`` the way
  Helm merges values (maps key by key, lists replaced, ``null`` removes) and checked as a bridge
  config. The chart's values files are checked the same way.
- Kubernetes manifests (``apiVersion`` and ``kind``) must parse; they are not bridge configs.
- ``${VAR}`` without a default is given a placeholder value (secrets come from the environment).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from bridge import cli
from bridge.config import Config
from tests.support import tls

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kv-event-bridge"
FENCE = re.compile(r"^```(?P<lang>yaml|yml|toml)[^\n]*\n(?P<body>.*?)^```", re.M | re.S)
UNSET = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
MOUNTED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*_FILE):-")
"""A file the deployment mounts (``${KAFKA_CA_FILE:-/etc/kafka-ca/ca.crt}``): validation reads it."""
PLACEHOLDER_SOURCE = {"name": "docs-example", "endpoint": "tcp://127.0.0.1:5557"}
PLACEHOLDER_SINK = {"type": "file", "path": "-"}
BRIDGE_KEYS = frozenset(Config.__struct_fields__)


def _blocks() -> list[tuple[str, str, str]]:
    """(where, language, text) of every YAML and TOML block of docs/."""
    out = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            lang = "toml" if m.group("lang") == "toml" else "yaml"
            out.append((f"{page.relative_to(ROOT)}:{line}", lang, m.group("body")))
    return out


BLOCKS = _blocks()
EXAMPLES = sorted(p for p in (ROOT / "examples").iterdir() if p.suffix in (".yaml", ".yml", ".toml"))
VALUES_FILES = [CHART / "values.yaml", *sorted((CHART / "ci").glob("*.yaml"))]


def _load(lang: str, text: str) -> Any:
    return tomllib.loads(text) if lang == "toml" else yaml.safe_load(text)


def _helm_merge(base: Any, override: Any) -> Any:
    """Helm's merge of user values over the chart's: maps key by key, anything else replaced, null removes."""
    if not isinstance(base, dict) or not isinstance(override, dict):
        return override
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _helm_merge(base.get(key), value)
    return out


def _check(
    config: dict[str, Any], tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run the CLI's --check --offline on ``config`` written as a YAML file; assert it passes cleanly."""
    text = yaml.safe_dump(config, sort_keys=False)
    _placeholders(text, monkeypatch)
    path = tmp_path / f"{re.sub(r'[^A-Za-z0-9]+', '-', name)}.yaml"
    path.write_text(text)
    code = cli.main(["--config", str(path), "--check", "--offline"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_OK, f"{name}: --check --offline exits {code}:\n{err}\n--- the config checked:\n{text}"
    assert "warning" not in err, f"{name}: {err}"


def _placeholders(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in set(UNSET.findall(text)):
        monkeypatch.setenv(var, f"placeholder-{var.lower()}-0123456789abcdef")


def _completed(config: dict[str, Any]) -> dict[str, Any]:
    out = dict(config)
    if "sources" not in out and "discovery" not in out:
        out["sources"] = [PLACEHOLDER_SOURCE]
    if "sinks" not in out:
        out["sinks"] = [PLACEHOLDER_SINK]
    return out


def _chart_values_schema() -> Draft202012Validator:
    return Draft202012Validator(json.loads((CHART / "values.schema.json").read_text()))


def _check_values(
    values: dict[str, Any], where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _chart_values_schema().iter_errors(values)]
    assert not errors, f"{where}: not valid chart values: {errors}"
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    config = _helm_merge(defaults, values.get("config") or {})
    # the chart adds DNS discovery (or, in sidecar mode, the loopback engine) when config names no engine
    _check(_completed(config), tmp_path, where, monkeypatch, capsys)


def test_the_docs_have_config_blocks_of_every_kind() -> None:
    """The extraction finds what the pages hold (a regex that matched nothing would pass every test below)."""
    kinds = {_kind(_load(lang, text)) for _where, lang, text in BLOCKS}
    assert {"bridge", "chart", "manifest"} <= kinds and len(BLOCKS) >= 12


def _kind(doc: Any) -> str:
    if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc:
        return "manifest"
    if isinstance(doc, dict) and set(doc) - BRIDGE_KEYS:
        return "chart"
    return "bridge"


@pytest.mark.parametrize(("where", "lang", "text"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_config_block_of_the_docs_passes_check(
    where: str, lang: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _load(lang, text)
    assert isinstance(doc, dict), f"{where}: not a mapping"
    kind = _kind(doc)
    if kind == "manifest":
        return  # parsed above; a Kubernetes object, not a bridge config
    if kind == "chart":
        _check_values(doc, where, tmp_path, monkeypatch, capsys)
    else:
        _check(_completed(doc), tmp_path, where, monkeypatch, capsys)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_passes_check(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The example files are checked as they are (not completed, not re-serialised); a file the
    deployment mounts is given as a test one of its kind (a CA certificate)."""
    text = path.read_text()
    _placeholders(text, monkeypatch)
    mounted = set(MOUNTED.findall(text))
    if mounted:
        if not tls.available():
            pytest.skip("openssl is not installed")
        ca = tls.make_certificates(tmp_path / "certs").ca
        for var in mounted:
            monkeypatch.setenv(var, str(ca))
    code = cli.main(["--config", str(path), "--check", "--offline"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_OK, err
    assert "warning" not in err, err


@pytest.mark.parametrize("path", VALUES_FILES, ids=lambda p: p.name)
def test_every_chart_values_file_passes_check(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _check_values(yaml.safe_load(path.read_text()), str(path.relative_to(ROOT)), tmp_path, monkeypatch, capsys)


def test_a_broken_block_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The check is real: a typo in a block fails it, naming the key."""
    with pytest.raises(AssertionError, match=r"sinks\[0\]\.pathh: unknown key"):
        _check(_completed({"sinks": [{"type": "file", "pathh": "-"}]}), tmp_path, "broken", monkeypatch, capsys)
    with pytest.raises(AssertionError, match="not valid chart values"):
        _check_values({"mode": "daemonset"}, "broken values", tmp_path, monkeypatch, capsys)
