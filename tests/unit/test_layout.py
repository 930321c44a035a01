"""The rules between parts (design.md "The house"), checked on the source: no import circle in
bridge/, bridge/ never imports a connector, and a connector needs nothing of bridge/ but the
plugin surface (bridge.connector) and the secret redaction it re-exports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path, package: str) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved against ``package``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package if node.level == 1 else package.rsplit(".", node.level - 1)[0]
                if node.module:
                    out.add(f"{base}.{node.module}")
                else:
                    out.update(f"{base}.{a.name}" for a in node.names)
            elif node.module:
                out.add(node.module)
    return out


def test_bridge_has_no_import_circle() -> None:
    modules = (ROOT / "bridge").glob("*.py")
    graph = {f"bridge.{p.stem}": {m for m in imports(p, "bridge") if m.startswith("bridge.")} for p in modules}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*path, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def test_bridge_never_imports_a_connector() -> None:
    for p in (ROOT / "bridge").glob("*.py"):
        assert not {m for m in imports(p, "bridge") if m.startswith("connectors")}, p.name
