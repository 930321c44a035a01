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


def test_no_asyncio_wait_for_in_the_service() -> None:
    """On Python 3.11, asyncio.wait_for returns the result and drops a cancellation that comes as
    its awaitable finishes (fixed in 3.12): a task cancelled at shutdown then runs on. ``tail``
    hung so after SIGTERM (stop 46's CI). ``async with asyncio.timeout(...)`` is used instead.
    (consumer/ supports 3.10, which has no asyncio.timeout.)"""
    found = []
    for path in [*(ROOT / "bridge").glob("*.py"), *(ROOT / "connectors").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "wait_for"
                and isinstance(node.value, ast.Name)
                and node.value.id == "asyncio"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
