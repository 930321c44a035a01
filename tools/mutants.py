"""Mutation testing of the delivery core against the unit tests (a development check, not in CI).

    .venv/bin/python tools/mutants.py                      # all four modules, a job per CPU (~30 min on 2)
    .venv/bin/python tools/mutants.py -m sink -m fanout    # some of them
    .venv/bin/python tools/mutants.py --list -m fanout     # the mutants, not run
    .venv/bin/python tools/mutants.py --only sequencer:17  # one mutant (ids as listed)

Each mutant is one classic change to one of ``bridge/{sequencer,checkpoint,fanout,sink}.py``:
a comparison's boundary or sense (``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``is``/``is not``,
``in``/``not in``), an int constant +1 / -1, ``+``/``-``, ``and``/``or``, ``not`` removed,
``True``/``False``, ``max``/``min``, a ``return`` value replaced by None, or a simple statement
deleted. Not mutated: docstrings, type annotations, a class's keywords (``frozen=True``), the
deletion of module-level statements (a NameError at import), and logging (a ``log.*(...)`` call,
and an ``if`` that only logs): log text and log rate are not behaviour the tests promise.

The tree is copied to a temporary directory (one copy per job, removed at the end); each mutant
is written there, the module's unit tests are run on it with ``pytest -x`` and a timeout, and the
original is put back. The working tree is never touched and nothing is left in it. A mutant is
*killed* when the tests fail (or time out), *survived* when they pass. Hypothesis runs with a fixed
seed and no example database, so a run is repeatable; ``KV_MODEL_EXAMPLES`` (``--examples``)
bounds the sequencer model; the captured vectors come with the copy (``tests/vectors``). Exit
status 1 when a module's kill rate is below ``--threshold`` (90%), 2 when the unmutated tests fail
or pytest could not run a selection.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Module -> the unit tests that exercise it, plus any tests/unit/test_<module>_*.py (the model
# and the hostile-input tests last: they are the slowest, and -x stops at the first failure).
HOSTILE = "tests/unit/test_hostile_input.py::"
TESTS: dict[str, list[str]] = {
    "sequencer": ["tests/unit/test_sequencer.py"],
    "checkpoint": ["tests/unit/test_checkpoint.py"],
    "fanout": ["tests/unit/test_fanout.py"],
    "sink": ["tests/unit/test_sink.py", "tests/unit/test_fanout.py"],
}
METRICS = "tests/unit/test_metrics.py::"
SLOW_TESTS: dict[str, list[str]] = {
    "sink": [  # the sink worker's metrics and health checks
        METRICS + "test_queue_gauges_follow_enqueueing_not_only_delivery",
        METRICS + "test_outcomes_and_lag_count_batches_not_events",
        METRICS + "test_a_dead_lettered_batch_is_not_also_delivered",
        METRICS + "test_an_idle_sink_is_health_checked",
        METRICS + "test_a_sink_outage_logs_per_state_change_not_per_retry",
    ],
    "sequencer": [
        "tests/unit/test_sequencer_model.py",
        HOSTILE + "test_sequencer_survives_any_interleaving",
        HOSTILE + "test_held_stays_bounded_under_a_flood_of_gaps",
    ],
}


def tests_for(module: str, tree: Path) -> list[str]:
    """The test selection in ``tree`` (the copy: a test file added meanwhile to the working tree
    is not there)."""
    first, last = TESTS[module], SLOW_TESTS.get(module, [])
    extra = sorted(str(p.relative_to(tree)) for p in (tree / "tests" / "unit").glob(f"test_{module}_*.py"))
    return [*first, *(f for f in extra if f not in first + last), *last]


COMPARE_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
SYMBOL = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Add: "+",
    ast.Sub: "-",
}
SIMPLE_STATEMENTS = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Raise, ast.Break, ast.Continue, ast.Delete)
LOGGERS = {"log", "logger", "logging"}


@dataclass(frozen=True)
class Mutant:
    module: str
    number: int  # the mutant's index in this module's list (its id: module:number)
    line: int
    what: str
    apply: Callable[[ast.Module], None]  # mutates a fresh parse of the module in place

    @property
    def id(self) -> str:
        return f"{self.module}:{self.number}"


def _is_log_call(stmt: ast.stmt) -> bool:
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return False
    func = stmt.value.func
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in LOGGERS


def _is_log_only(stmt: ast.stmt) -> bool:
    """A logging call, or an ``if`` (without else) whose body only logs."""
    if _is_log_call(stmt):
        return True
    return isinstance(stmt, ast.If) and not stmt.orelse and all(_is_log_only(s) for s in stmt.body)


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _walk(node: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None, str, int | None]]:
    """(node, parent, field, index in the field's list) in a fixed order, skipping what is not mutated."""
    stack: list[tuple[ast.AST, ast.AST | None, str, int | None]] = [(node, None, "", None)]
    while stack:
        current, parent, field, index = stack.pop()
        yield current, parent, field, index
        children: list[tuple[ast.AST, ast.AST | None, str, int | None]] = []
        for name, value in ast.iter_fields(current):
            if name in ("annotation", "returns", "type_comment") or (isinstance(current, ast.ClassDef) and name == "keywords"):
                continue
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if not isinstance(item, ast.AST):
                        continue
                    if isinstance(item, ast.stmt) and (_is_docstring(item) or _is_log_only(item)):
                        continue
                    children.append((item, current, name, i))
            elif isinstance(value, ast.AST):
                children.append((value, current, name, None))
        stack.extend(reversed(children))


def _replace(parent: ast.AST, field: str, index: int | None, new: ast.AST) -> None:
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new


def _sites(tree: ast.Module) -> Iterator[tuple[int, int, str, Callable[[ast.AST, ast.AST | None, str, int | None], None]]]:
    """(position in _walk, line, description, mutation of the node at that position)."""
    for pos, (node, parent, field, index) in enumerate(_walk(tree)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare):
            for j, op in enumerate(node.ops):
                to = COMPARE_SWAP.get(type(op))
                if to is not None:

                    def swap(n: ast.AST, *_: object, j: int = j, to: type[ast.cmpop] = to) -> None:
                        assert isinstance(n, ast.Compare)
                        n.ops[j] = to()

                    yield pos, line, f"{SYMBOL[type(op)]} -> {SYMBOL[to]}", swap
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            for delta in (1, -1):

                def shift(n: ast.AST, *_: object, delta: int = delta) -> None:
                    assert isinstance(n, ast.Constant) and isinstance(n.value, int)
                    n.value = n.value + delta

                yield pos, line, f"{node.value} -> {node.value + delta}", shift
        elif isinstance(node, ast.Constant) and type(node.value) is bool:

            def flip(n: ast.AST, *_: object) -> None:
                assert isinstance(n, ast.Constant)
                n.value = not n.value

            yield pos, line, f"{node.value} -> {not node.value}", flip
        elif isinstance(node, ast.BinOp | ast.AugAssign) and isinstance(node.op, ast.Add | ast.Sub):
            other = ast.Sub if isinstance(node.op, ast.Add) else ast.Add

            def arith(n: ast.AST, *_: object, other: type[ast.operator] = other) -> None:
                assert isinstance(n, ast.BinOp | ast.AugAssign)
                n.op = other()

            yield pos, line, f"{SYMBOL[type(node.op)]} -> {SYMBOL[other]}", arith
        elif isinstance(node, ast.BoolOp):
            word, other_word = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")

            def logic(n: ast.AST, *_: object) -> None:
                assert isinstance(n, ast.BoolOp)
                n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()

            yield pos, line, f"{word} -> {other_word}", logic
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):

            def drop_not(n: ast.AST, parent: ast.AST | None, field: str, index: int | None) -> None:
                assert isinstance(n, ast.UnaryOp) and parent is not None
                _replace(parent, field, index, n.operand)

            yield pos, line, "not removed", drop_not
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
            other_name = "min" if node.func.id == "max" else "max"

            def minmax(n: ast.AST, *_: object, other_name: str = other_name) -> None:
                assert isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                n.func.id = other_name

            yield pos, line, f"{node.func.id} -> {other_name}", minmax
        if isinstance(node, ast.Return) and node.value is not None and not isinstance(node.value, ast.Constant):

            def return_none(n: ast.AST, *_: object) -> None:
                assert isinstance(n, ast.Return)
                n.value = ast.Constant(None)

            yield pos, line, "return value -> None", return_none
        if isinstance(node, SIMPLE_STATEMENTS) and isinstance(parent, ast.stmt | ast.excepthandler):
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue

            def delete(n: ast.AST, parent: ast.AST | None, field: str, index: int | None) -> None:
                assert parent is not None
                _replace(parent, field, index, ast.Pass())

            yield pos, line, "statement deleted", delete


def mutants(module: str, source: str) -> list[Mutant]:
    found: list[Mutant] = []
    for pos, line, what, mutate in _sites(ast.parse(source)):

        def apply(tree: ast.Module, pos: int = pos, mutate: Callable[..., None] = mutate) -> None:
            for i, (node, parent, field, index) in enumerate(_walk(tree)):
                if i == pos:
                    mutate(node, parent, field, index)
                    return
            raise AssertionError("mutation site not found")

        found.append(Mutant(module, len(found), line, what, apply))
    return found


def mutated_source(m: Mutant, source: str) -> str:
    tree = ast.parse(source)
    m.apply(tree)
    return ast.unparse(ast.fix_missing_locations(tree))


RUNNING: set[subprocess.Popen[bytes]] = set()  # test runs in progress, stopped if this script is


def run_tests(work: Path, module: str, examples: int, seed: int, timeout: float) -> tuple[str, float]:
    """("passed" | "failed" | "timeout" | "error", seconds) for the module's tests in the copy ``work``."""
    shutil.rmtree(work / ".hypothesis", ignore_errors=True)  # no example database: each run stands alone
    env = {
        **os.environ,
        "PYTHONPATH": str(work),
        "PYTHONDONTWRITEBYTECODE": "1",
        "KV_MODEL_EXAMPLES": str(examples),
    }
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}"]
    cmd += tests_for(module, work)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    RUNNING.add(proc)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout", time.monotonic() - start
    finally:
        RUNNING.discard(proc)
    # pytest: 0 passed, 1 tests failed, 2 interrupted (a collection error: the mutant broke an
    # import), 3 internal error; 4 (usage: a test file missing) and 5 (no tests) are this script's.
    outcome = {0: "passed", 4: "error", 5: "error"}.get(code, "failed")
    return outcome, time.monotonic() - start


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".hypothesis", "*_cache", "*.egg-info", "mutants")
    shutil.copytree(ROOT, dest, ignore=ignore)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "-m", "--module", action="append", choices=sorted(TESTS), help="module to mutate (repeatable; default all)"
    )
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--examples", type=int, default=150, help="KV_MODEL_EXAMPLES for the sequencer model")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    parser.add_argument("--threshold", type=float, default=90.0, help="kill rate in percent a module must reach")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", metavar="MODULE:N", help="run only these mutants")
    args = parser.parse_args(argv)

    modules = args.module or list(TESTS)
    if args.only:
        modules = sorted({o.split(":")[0] for o in args.only})
    if args.list:
        for mod in modules:
            for m in mutants(mod, (ROOT / "bridge" / f"{mod}.py").read_text()):
                print(f"{m.id:16} bridge/{m.module}.py:{m.line:<4} {m.what}")
        return 0

    # SIGTERM as well as ^C: stop the test runs and remove the copies.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    began = time.monotonic()
    results: list[tuple[Mutant, str]] = []
    with tempfile.TemporaryDirectory(prefix="kv-mutants-") as tmp:
        workers: queue.Queue[Path] = queue.Queue()
        for i in range(max(1, args.jobs)):
            work = Path(tmp) / f"w{i}"
            copy_tree(work)
            workers.put(work)
        # The sources as copied (the working tree may change meanwhile: others work in it).
        sources = {mod: (Path(tmp) / "w0" / "bridge" / f"{mod}.py").read_text() for mod in modules}
        todo = [m for mod in modules for m in mutants(mod, sources[mod])]
        if args.only:
            todo = [m for m in todo if m.id in args.only]
        timeouts: dict[str, float] = {}
        for mod in modules:  # the unmutated tests must pass; their time sets the mutants' timeout
            work = workers.get()
            outcome, took = run_tests(work, mod, args.examples, args.seed, 600)
            workers.put(work)
            if outcome != "passed":
                print(f"{mod}: the unit tests fail without any mutation ({outcome}); fix them first", file=sys.stderr)
                return 2
            timeouts[mod] = max(20.0, 3 * took)
            print(f"{mod}: baseline {took:.1f}s, {sum(m.module == mod for m in todo)} mutants", flush=True)

        stopping = False

        def run(m: Mutant) -> tuple[Mutant, str]:
            if stopping:
                return m, "skipped"
            work = workers.get()
            target = work / "bridge" / f"{m.module}.py"
            try:
                target.write_text(mutated_source(m, sources[m.module]))
                outcome, _ = run_tests(work, m.module, args.examples, args.seed, timeouts[m.module])
            finally:
                target.write_text(sources[m.module])
                workers.put(work)
            return m, outcome

        pool = ThreadPoolExecutor(max(1, args.jobs))
        try:
            for i, (m, outcome) in enumerate(pool.map(run, todo), 1):
                results.append((m, outcome))
                if outcome in ("passed", "error"):
                    word = "survived" if outcome == "passed" else "ERROR"
                    print(f"  {word:8} {m.id:16} bridge/{m.module}.py:{m.line:<4} {m.what}", flush=True)
                if i % 50 == 0:
                    print(f"  ... {i}/{len(todo)} ({time.monotonic() - began:.0f}s)", flush=True)
        finally:
            stopping = True
            for proc in list(RUNNING):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            pool.shutdown(cancel_futures=True)

    print(f"\n{'module':12} {'mutants':>8} {'killed':>7} {'timeout':>8} {'survived':>9} {'errors':>7} {'killed %':>9}")
    ok = True
    for mod in modules:
        mine = [o for m, o in results if m.module == mod]
        killed = sum(o in ("failed", "timeout") for o in mine)  # timeouts included
        rate = 100.0 * killed / len(mine) if mine else 100.0
        ok = ok and rate >= args.threshold
        counts = f"{mine.count('timeout'):8} {mine.count('passed'):9} {mine.count('error'):7}"
        print(f"{mod:12} {len(mine):8} {killed:7} {counts} {rate:8.1f}%")
    print(f"\n{time.monotonic() - began:.0f}s")
    survivors = [m for m, o in results if o == "passed"]
    if survivors:
        print("\nsurvivors:")
        for m in survivors:
            text = sources[m.module].splitlines()[m.line - 1].strip()
            print(f"  {m.id:16} bridge/{m.module}.py:{m.line:<4} {m.what:22} | {text}")
    if any(o == "error" for _, o in results):
        print("\nERROR: pytest could not run the selection for some mutants (exit 4 or 5)", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
