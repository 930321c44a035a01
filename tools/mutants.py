"""Mutation testing of the delivery core against the unit tests (a development check, not in CI).

    .venv/bin/python tools/mutants.py -m checkpoint        # one module (default: all, ~1 h on 1 CPU)
    .venv/bin/python tools/mutants.py --changed            # only the lines changed since main
    .venv/bin/python tools/mutants.py --changed HEAD~3     # ... since another base
    .venv/bin/python tools/mutants.py -m nats --function fold_deltas --lines 200-260
    .venv/bin/python tools/mutants.py --list -m fanout     # the mutants, not run
    .venv/bin/python tools/mutants.py --only sequencer:17  # one mutant (ids as listed)
    .venv/bin/python tools/mutants.py --equivalent         # the mutants listed as equivalent, why

The modules (``TARGETS``): the delivery core in ``bridge/`` whole, and the connectors' pure parts
(key, id and subject building, the state fold and journal) named function by function.

Each mutant is one classic change to one line: a comparison's boundary or sense (``<``/``<=``,
``>``/``>=``, ``==``/``!=``, ``is``/``is not``, ``in``/``not in``), an int constant +1 / -1,
``+``/``-``, ``and``/``or``, ``not`` removed, ``True``/``False``, ``max``/``min``, a ``return``
value replaced by None, or a simple statement deleted.

Exclusion rule (never mutated): docstrings, type annotations, a class's keywords
(``frozen=True``), the deletion of module-level statements (a NameError at import) and of
``...`` (a Protocol method's body: deleting it leaves ``pass``, the same), and logging (a
``log.*(...)`` call, the choice of its level in a ``log_*`` name and a call through that name, and
an ``if`` that only logs): log text, level and rate are not behaviour the tests promise. The
text of error messages *is* mutated (the tests pin the thing an error names).

Which tests run: the tree is copied to a temporary directory (one copy per job, removed at the
end; the working tree is never touched). The unit tests (``tests/unit``, not ``integration``)
run once on the copy under coverage, one coverage context per test (``tools/mutants_plugin.py``):
that baseline must pass, and it says which tests run which line. A mutant then runs only the
tests that run one of its lines (for a line run only at import, every test that runs the
module), fastest first, with ``pytest -x`` and a timeout of twice their baseline time (measured
under coverage, itself slower) plus 10 s. A mutant is *killed* when they fail (or time out),
*survived* when they pass, *uncovered* (a survivor, not run) when no test runs its line.

Equivalent mutants (``EQUIVALENT``: a change no behaviour can see) are listed with the reason,
still run, and kept out of the rate: killed % = killed / (mutants - equivalent). One that the tests
do kill is reported (the entry is wrong); an entry that matches no mutant is reported (stale).

``--changed [BASE]`` mutates only the lines that differ between the merge base of BASE (default
``main``) and the working tree, in the modules they touch; any survivor there fails the run (exit
1). Otherwise exit 1 when a module's rate is below ``--threshold`` (90%), 2 when the baseline fails
or pytest could not run a selection. Hypothesis runs with a fixed seed and no example database, so
a run is repeatable; ``KV_MODEL_EXAMPLES`` (``--examples``) bounds the sequencer model.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
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
from typing import Any

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
    end: int  # the mutated node's last line
    what: str
    apply: Callable[[ast.Module], None]  # mutates a fresh parse of the module in place
    nth: int = 0  # of the mutants with this ``what`` on this line (0: the leftmost)

    @property
    def id(self) -> str:
        return f"{self.module}:{self.number}"


def _is_logger(func: ast.expr) -> bool:
    """``log.error`` and the like, or a local alias of one (a name starting with ``log_``)."""
    if isinstance(func, ast.Attribute):
        return isinstance(func.value, ast.Name) and func.value.id in LOGGERS
    return isinstance(func, ast.Name) and func.id.startswith("log_")


def _is_log_call(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and _is_logger(stmt.value.func)


def _is_log_only(stmt: ast.stmt) -> bool:
    """A logging call, the choice of a logger method (``log_at = log.error if ... else
    log.warning``), or an ``if`` (without else) whose body only logs."""
    if _is_log_call(stmt):
        return True
    if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) and t.id.startswith("log_") for t in stmt.targets):
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


Site = tuple[int, int, int, str, Callable[[ast.AST, ast.AST | None, str, int | None], None]]


def _sites(tree: ast.Module) -> Iterator[Site]:
    """(position in _walk, first line, last line, description, mutation of the node there)."""
    for pos, (node, parent, field, index) in enumerate(_walk(tree)):
        line = getattr(node, "lineno", 0)
        end = getattr(node, "end_lineno", None) or line
        if isinstance(node, ast.Compare):
            for j, op in enumerate(node.ops):
                to = COMPARE_SWAP.get(type(op))
                if to is not None:

                    def swap(n: ast.AST, *_: object, j: int = j, to: type[ast.cmpop] = to) -> None:
                        assert isinstance(n, ast.Compare)
                        n.ops[j] = to()

                    yield pos, line, end, f"{SYMBOL[type(op)]} -> {SYMBOL[to]}", swap
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            for delta in (1, -1):

                def shift(n: ast.AST, *_: object, delta: int = delta) -> None:
                    assert isinstance(n, ast.Constant) and isinstance(n.value, int)
                    n.value = n.value + delta

                yield pos, line, end, f"{node.value} -> {node.value + delta}", shift
        elif isinstance(node, ast.Constant) and type(node.value) is bool:

            def flip(n: ast.AST, *_: object) -> None:
                assert isinstance(n, ast.Constant)
                n.value = not n.value

            yield pos, line, end, f"{node.value} -> {not node.value}", flip
        elif isinstance(node, ast.BinOp | ast.AugAssign) and isinstance(node.op, ast.Add | ast.Sub):
            other = ast.Sub if isinstance(node.op, ast.Add) else ast.Add

            def arith(n: ast.AST, *_: object, other: type[ast.operator] = other) -> None:
                assert isinstance(n, ast.BinOp | ast.AugAssign)
                n.op = other()

            yield pos, line, end, f"{SYMBOL[type(node.op)]} -> {SYMBOL[other]}", arith
        elif isinstance(node, ast.BoolOp):
            word, other_word = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")

            def logic(n: ast.AST, *_: object) -> None:
                assert isinstance(n, ast.BoolOp)
                n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()

            yield pos, line, end, f"{word} -> {other_word}", logic
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):

            def drop_not(n: ast.AST, parent: ast.AST | None, field: str, index: int | None) -> None:
                assert isinstance(n, ast.UnaryOp) and parent is not None
                _replace(parent, field, index, n.operand)

            yield pos, line, end, "not removed", drop_not
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
            other_name = "min" if node.func.id == "max" else "max"

            def minmax(n: ast.AST, *_: object, other_name: str = other_name) -> None:
                assert isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                n.func.id = other_name

            yield pos, line, end, f"{node.func.id} -> {other_name}", minmax
        if isinstance(node, ast.Return) and node.value is not None and not isinstance(node.value, ast.Constant):

            def return_none(n: ast.AST, *_: object) -> None:
                assert isinstance(n, ast.Return)
                n.value = ast.Constant(None)

            yield pos, line, end, "return value -> None", return_none
        if isinstance(node, SIMPLE_STATEMENTS) and isinstance(parent, ast.stmt | ast.excepthandler):
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node.value.value is Ellipsis:
                continue  # ``...`` (a Protocol's body): deleting it puts ``pass`` there, the same

            def delete(n: ast.AST, parent: ast.AST | None, field: str, index: int | None) -> None:
                assert parent is not None
                _replace(parent, field, index, ast.Pass())

            yield pos, line, end, "statement deleted", delete


def mutants(module: str, source: str) -> list[Mutant]:
    found: list[Mutant] = []
    for pos, line, end, what, mutate in _sites(ast.parse(source)):

        def apply(tree: ast.Module, pos: int = pos, mutate: Callable[..., None] = mutate) -> None:
            for i, (node, parent, field, index) in enumerate(_walk(tree)):
                if i == pos:
                    mutate(node, parent, field, index)
                    return
            raise AssertionError("mutation site not found")

        nth = sum(f.line == line and f.what == what for f in found)
        found.append(Mutant(module, len(found), line, end, what, apply, nth))
    return found


def mutated_source(m: Mutant, source: str) -> str:
    tree = ast.parse(source)
    m.apply(tree)
    return ast.unparse(ast.fix_missing_locations(tree))


ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Target:
    path: str  # relative to the repository root
    tests: tuple[str, ...]  # the unit test files that run it (tests/unit/...; see --map), besides test_<name>*.py
    parts: tuple[str, ...] = ()  # only these top-level functions / classes (``Class.method``); () = all


# The connectors' pure parts: key, id and subject building, the state fold and journal.
CONNECTOR_PARTS = {
    "redis": (
        "entry_id",
        "message_position",
        "index_delta",
        "_tier_text",
        "_member",
        "_Call",
        "state_args",
        "_slot",
    ),
    "nats": (
        "subject_token",
        "subject_problem",
        "subject_filter",
        "_Subjects",
        "fold_deltas",
        "_order",
        "journal_parts",
        "journal_redo",
        "header_block",
        "hpub",
        "_Held",
    ),
    "kafka": ("_Last", "_remember"),
}
# The consumer side (``consumer/kv_consumer``, its own distribution since 35725db): the bootstrap's
# state and ordering rule whole, and of each reader its pure parts (the entry ids, state keys and
# the state log the bridge's own rebuild shares).
CONSUMER_PARTS = {
    "kv_redis": ("entry_position",),
    "kv_nats": ("state_token", "state_prefix"),
    "kv_kafka": ("partition_of", "stream_of", "StateLog", "_merge"),
}
PIPELINE = ("count", "filters", "metrics")  # they drive a pipeline end to end
SINKS = (
    "fanout",
    "fanout_force",
    "sink",
    "sink_bounds",
    "sink_counts",
    "sink_fold",
    "sink_fold_causes",
    "sink_i6",
    "sink_worker",
)
CONNECTOR_TESTS = (
    "kafka_options",
    "kafka_state",
    "nats_connector",
    "nats_state_keys",
    "redis_errors",
    "redis_internals",
    "redis_index",
)
# Module -> test files (``test_<name>.py``), from a run of ``--map`` (which prints this).
TEST_MAP: dict[str, tuple[str, ...]] = {
    "sequencer": (*PIPELINE, "hostile_input", "stream", "stream_removal"),
    "checkpoint": (*PIPELINE, "handover", "state_sinks"),
    "fanout": (*PIPELINE, "fanout_force", "state_sinks", "stream", "stream_removal"),
    "sink": (*PIPELINE, *SINKS, "state_sinks"),
    "stream": (*PIPELINE, "stream_removal"),
    "wire": ("count", "formats", "hostile_input", "sink", "sink_counts", "sink_i6", "stream", "stream_removal"),
    "state_docs": ("bootstrap", "count", "examples", "state", "state_sinks", *CONNECTOR_TESTS),
    "state": ("bootstrap", "kafka_state", "state_sinks"),
    "formats": (
        *PIPELINE,
        *SINKS,
        "handover",
        "hostile_input",
        "kafka_state",
        "nats_connector",
        "nats_state_keys",
        "schema",
        "state_sinks",
        "wire",
    ),
    "records": (
        *PIPELINE,
        *SINKS,
        "bootstrap",
        "checkpoint",
        "formats",
        "handover",
        "hostile_input",
        "kafka_state",
        "nats_connector",
        "nats_state_keys",
        "schema",
        "state",
        "state_model",
        "state_sinks",
        "stream",
        "stream_removal",
        "wire",
    ),
    "bootstrap": ("kafka_state", "state_sinks"),
    "redis": ("redis_errors", "redis_ids", "redis_index"),
    "nats": ("nats_state_keys", "nats_connector"),
    "kafka": ("kafka_state", "kafka_options"),
    "kv_redis": ("redis_errors", "redis_ids", "redis_index", "redis_internals", "state_sinks"),
    "kv_nats": ("nats_state_keys", "nats_connector", "state_sinks"),
    "kv_kafka": ("kafka_state", "kafka_options", "state_sinks"),
}
CORE = ("sequencer", "checkpoint", "fanout", "sink", "stream", "wire", "state_docs", "state", "formats", "records")
TARGETS: dict[str, Target] = {
    **{name: Target(f"bridge/{name}.py", TEST_MAP[name]) for name in CORE},
    "bootstrap": Target("consumer/kv_consumer/state.py", TEST_MAP["bootstrap"]),
    **{name: Target(f"connectors/{name}.py", TEST_MAP[name], parts) for name, parts in CONNECTOR_PARTS.items()},
    **{
        name: Target(f"consumer/kv_consumer/{name.removeprefix('kv_')}.py", TEST_MAP[name], parts)
        for name, parts in CONSUMER_PARTS.items()
    },
}


def pythonpath(work: Path, *more: Path) -> str:
    """The copy first (``consumer/`` too: kv_consumer is installed editable from the working tree,
    which would shadow the mutated copy)."""
    return os.pathsep.join(str(p) for p in (work, work / "consumer", *more))


def test_files(module: str, tree: Path) -> list[str]:
    """The module's test files in the copy ``tree``: its map, and any test_<module>*.py."""
    unit = tree / "tests" / "unit"
    named = {p.name for p in unit.glob(f"test_{module}*.py")} | {f"test_{t}.py" for t in TARGETS[module].tests}
    return [f"tests/unit/{name}" for name in sorted(named) if (unit / name).exists()]


NOT_INTEGRATION = ["-m", "not integration"]


@dataclass(frozen=True)
class Equivalent:
    module: str
    text: str  # the mutated line, stripped
    what: str  # the mutation, as listed
    why: str
    nth: int = 0  # of the mutants with this ``what`` on the line (0: the leftmost)
    within: str = ""  # the function it is in, when the line's text is not unique


# A mutant no test can kill because no behaviour differs. Matched by line text, not number.
_GENERATION = "only ordered (Checkpointer.write: a snapshot older than the one saved is dropped): any positive step orders alike"
_NO_ANCHOR = "an anchor below 0 means none: it is only ever compared with < 0"
_EPOCHS = (
    "epochs are never negative (clock_epoch >= 0, each new one above the last): -1, -2 and 0 all sit at or below every epoch"
)
_NO_SEQ = (
    "-1 stands for no seq here: every use takes a max with values >= -1 (delivered, _heard, unsure) or compares it with "
    "delivered (>= -1) or a seq (>= 0), where -2 reads the same"
)
_FAST_PATH = (
    "decode_batch's plain fast path only saves time: what it does not take (or fails on) goes to decode_generic, "
    "which gives the same batch (test_wire checks the two agree); this mutant only moves a payload from one path "
    "to the other (an empty payload; an array or map of one, 2, 15 or 16 items; an array16/32 or map16/32 header "
    "or a byte next to one)"
)
_REPLAY_STATE = (
    "the state of the replay in flight: read only while one is (replayed, replay_finished, _check, or guarded by "
    "self._replay), and _request sets it before; the constructor's value is never read"
)
_TYPES_BOUND = (
    "the exact size of the memory bound on gathered event types only changes when they are applied, never what a "
    "collection shows (Metrics.defer flushes every owner first; test_stream checks the bound holds)"
)
_NOTED_AGAIN = (
    "it only leaves _first_pending set where it should be clear, so a later batch of an epoch whose first batch "
    "is noted is noted too: Checkpointer.note_first keeps the first of an epoch and answers False (no save) for the "
    "rest; it never leaves a first batch unnoted"
)
_ROOM = (
    "_room is only waited on (Fanout.finish, after offer() said no) once offer() has cleared it itself: whether "
    "the constructor sets it, or a push clears it too, changes no wait"
)
_SUSPECT = (
    "_suspect is only read as `_suspect == _replay_start`, and _replay_start is delivered + 1 when a replay is "
    "asked; delivered never goes down in an epoch (_restart clears _suspect): a _suspect at or below delivered "
    "never matches again, left or cleared alike"
)
_SLOTS = (
    "__slots__ only saves the memory of each object's __dict__: no code sets an attribute it does not list, so "
    "without it every object behaves the same"
)
_OLD_SLOT_0 = (
    "old slot 0 is always moved by then: a change moves the old slots from 0 up (_move_some) before it looks in the old "
    "arrays, and _old_slot never gives a moved slot, so j is never 0"
)
_NEW_STREAM = (
    "a new stream's value before its first record: apply sets it (and _clear sets ahead) on every path before it is "
    "read, save in the first delta's head, which apply replaces at its end; seed sets it too"
)
_AHEAD_ABOVE = (
    "st.ahead only has to cover the newest seeded seq when it is above the head: a record above every seeded entry's "
    "seq finds no version at or above its own and starts its skipped set empty, so a higher st.ahead (or 0 when no "
    "entry is above the head) skips nothing, and any value below 0 is none, as -1 is"
)
EQUIVALENT: list[Equivalent] = [
    *(
        Equivalent("sequencer", text, what, _REPLAY_STATE, within="__init__")
        for text, whats in (
            ("self._heard = -1  # the last reply seen while the verdict was pending", ("1 -> 2", "1 -> 0")),
            (
                "self._skipped = False  # and a reply that would have compared bytes did not come",
                ("statement deleted", "False -> True"),
            ),
            ("self._until = -1", ("statement deleted", "1 -> 2", "1 -> 0")),
            (
                "self._probing = False  # the replay in flight asks for one batch waiting (see replay_finished)",
                ("statement deleted", "False -> True"),
            ),
            (
                "self._asked_from = -1  # the first seq the replay in flight asks for",
                ("statement deleted", "1 -> 2", "1 -> 0"),
            ),
            ("self._floor = -1", ("statement deleted", "1 -> 2", "1 -> 0")),
            (
                "self._overlap: tuple[int, int] | None = None  # (seq, CRC-32) its first reply must repeat (_SORTING)",
                ("statement deleted",),
            ),
        )
        for what in whats
    ),
    *(
        Equivalent("sequencer", text, "1 -> 2", _NO_SEQ)
        for text in (
            "self._unkept_lo = self._unkept = -1",
            "self._top = max(self.delivered, self._anchor_seq, known_top if known_top is not None else -1)",
            "self._owed = -1",
            "self._unclaimed = -1  # the highest of replies read and dropped without a verdict: whose?",
        )
    ),
    Equivalent(
        "wire",
        "if parts and len(parts[0]) == 0 and len(parts) in (3, 4):",
        "3 -> 4",
        "a 3-frame reply that starts with an empty frame loses it either as the delimiter (here) or as the topic "
        "(next line): the same 2 frames are left",
    ),
    Equivalent(
        "state_docs",
        "blocks = self._hasher.blocks(fact.token_ids, len(fact.token_ids) or None, self.hash_hex)",
        "or -> and",
        "a block size of len(token_ids) and none at all (None) both hash the whole list as one block",
    ),
    *(
        Equivalent("stream", text, what, _TYPES_BOUND)
        for text, what in (
            ("_MAX_TYPES = 8192  # event types gathered for the metrics before they are applied (memory bound)", "8192 -> 8193"),
            ("_MAX_TYPES = 8192  # event types gathered for the metrics before they are applied (memory bound)", "8192 -> 8191"),
        )
    ),
    Equivalent("stream", "if len(self._types) > _MAX_TYPES:", "> -> >=", _TYPES_BOUND),
    Equivalent(
        "stream",
        "self._unread_top = -1",
        "1 -> 2",
        "read only through max() with the sequencer's known top (max(_top, delivered), never below -1) and in "
        "detached (max with _top): -1 and -2 give the same",
        within="__init__",
    ),
    *(
        Equivalent(
            "stream",
            text,
            what,
            "start() runs once per pipeline (Bridge._start_readers), and this flag is read only there",
        )
        for text in ("self._announce = False", "self._reattached = False")
        for what in ("statement deleted", "False -> True")
    ),
    *(
        Equivalent(
            "stream",
            "i = 0",
            what,
            "i is read only when the burst is cancelled, which happens at an await inside the loop (enumerate has set "
            "i) or after it: the initial value is never read",
        )
        for what in ("statement deleted", "0 -> 1", "0 -> -1")
    ),
    Equivalent(
        "stream",
        "async def _act(self, a: Action, received: float, persist: bool = True) -> Record | None:",
        "True -> False",
        "every call of _act passes persist",
    ),
    Equivalent(
        "stream",
        "self._pending: Record | None = None  # decided, being handed on (see _hand_decided)",
        "statement deleted",
        "_hand_decided (its only reader) runs only after a record went through _execute, which assigns _pending "
        "first: a pipeline's first batch always does (_first_pending), and the run path needs one handed before",
    ),
    *(
        Equivalent("stream", "first = False", what, _NOTED_AGAIN, within="_hand_decided")
        for what in ("statement deleted", "False -> True")
    ),
    Equivalent("stream", "self._first_pending = first", "statement deleted", _NOTED_AGAIN),
    Equivalent(
        "stream",
        'self.stream, epoch, seq, "batch", batch.ts, payload, batch.events, None, None, received, -1, batch.plain, n_bad',
        "1 -> 2",
        "event_count -1 and -2 both mean len(events) (Record.n_events takes it only when >= 0)",
    ),
    Equivalent(
        "stream",
        "if last is not None and last is not self._shown:",
        "and -> or",
        "_shown is only ever set to a non-None _decoded, which is never reset to None: when last is None so is "
        "_shown, and the condition is false either way",
    ),
    Equivalent(
        "stream",
        "self._shown = last",
        "statement deleted",
        "_shown only saves setting the gauges again to the same record's seq and ts, which changes nothing",
    ),
    Equivalent(
        "stream",
        "if not outcome.replies and time.monotonic() - self._replay_diagnosed >= REPLAY_DIAGNOSE_EVERY:",
        ">= -> >",
        "differs only at the instant exactly REPLAY_DIAGNOSE_EVERY after the last diagnosis, to the float",
    ),
    *(
        Equivalent(
            "formats",
            text,
            what,
            "only answers 'convert' where nothing needs it: json_event then copies the event and passes each field "
            "through _jsonable, which returns scalars and lists of scalars as they are: the same JSON",
            within=within,
        )
        for text, what, within in (
            ("return True", "True -> False", "_scalar_list"),
            ("continue", "statement deleted", "_needs_json_fix"),
            ("return False", "False -> True", "_needs_json_fix"),
            ("continue", "statement deleted", "json_event"),  # token ids: ints, passed as they are either way
            ("if t in scalars:", "in -> not in", "_needs_json_fix"),  # True at the event's type, a str
            # every event of a batch not proved plain goes through json_event: the same JSON
            (
                "if hash_hex or not header_keys.isdisjoint(event) or (check and _needs_json_fix(event)):",
                "and -> or",
                "_events",
            ),
        )
    ),
    *(
        Equivalent(
            "formats",
            text,
            what,
            "a bound of the shared renderer's cache of rendered batches: it decides how often a batch is "
            "rendered again for a sink, never what that sink gets",
            nth=nth,
        )
        for text, what, nth in (
            ("SHARED_MAX = 1024", "1024 -> 1025", 0),
            ("SHARED_MAX = 1024", "1024 -> 1023", 0),
            ("SHARED_MAX_BYTES = 8 * 2**20", "8 -> 9", 0),
            ("SHARED_MAX_BYTES = 8 * 2**20", "8 -> 7", 0),
            ("SHARED_MAX_BYTES = 8 * 2**20", "2 -> 3", 0),
            ("SHARED_MAX_BYTES = 8 * 2**20", "20 -> 21", 0),
            ("SHARED_MAX_BYTES = 8 * 2**20", "20 -> 19", 0),
            *(
                ("while len(shared) > SHARED_MAX or (self._shared_bytes > SHARED_MAX_BYTES and len(shared) > 1):", "> -> >=", n)
                for n in (0, 1, 2)
            ),
            ("while len(shared) > SHARED_MAX or (self._shared_bytes > SHARED_MAX_BYTES and len(shared) > 1):", "1 -> 0", 0),
        )
    ),
    Equivalent(
        "formats",
        "__hash__ = None  # type: ignore[assignment]",
        "statement deleted",
        "a class body that defines __eq__ gets __hash__ = None from Python itself (test_formats checks it is unhashable)",
    ),
    *(
        Equivalent(
            "formats",
            text,
            "4096 -> 4095",
            "_INDEX_TEXT[4095] is str(4095) (_INDEX[4095] its bytes): below the tables' end either gives the same",
        )
        for text in (
            'h["index"] = _INDEX_TEXT[i] if i < 4096 else str(i)',
            'items.append(("index", _INDEX[i] if i < 4096 else str(i).encode()))',
            'return self.envelope.id + "/" + (_INDEX_TEXT[i] if i < 4096 else str(i))',
            "index = index_bytes[i] if i < 4096 else str(i).encode()",
        )
    ),
    Equivalent(
        "sink",
        "span[0], span[1] = min(span[0], r.seq), max(span[1], r.seq)",
        "1 -> 0",
        "refusals come in write order, a stream's messages in seq order: r.seq is above both ends, max gives it either way",
        nth=1,
    ),
    Equivalent(
        "sink",
        "if runs and runs[-1][0].record is m.record:",
        "0 -> -1",
        "every message of a run is of one record: its first and its last name the same record",
    ),
    Equivalent(
        "sink",
        "gc.collect(1)",
        "1 -> 2",
        "a full collection frees everything collecting the young generations frees: only its cost differs",
    ),
    Equivalent("sink", "self._room.set()", "statement deleted", _ROOM, within="__init__"),
    *(Equivalent("sink", "if not self.has_room(0):", what, _ROOM) for what in ("0 -> 1", "0 -> -1")),
    *(
        Equivalent("sink", text, what, "_closing is written, never read")
        for text, whats in (
            ("self._closing = False", ("statement deleted", "False -> True")),
            ("self._closing = True", ("statement deleted", "True -> False")),
        )
        for what in whats
    ),
    Equivalent(
        "sink",
        "self._m_up.set(0)",
        "statement deleted",
        "labels() just above creates sink_up's child at 0: setting it to 0 changes nothing",
        within="__init__",
    ),
    *(
        Equivalent(
            "sink",
            "return not self._dropped and len(self._queue) + n <= self.max_batches and self._bytes + size <= self.max_bytes",
            what,
            "has_room_for is Fanout.offer_all's all-at-once fast path: a stricter answer makes it offer the records one "
            "by one, which queues the same records (has_room checks the same bounds record by record); only speed differs",
            nth=nth,
        )
        for what, nth in (("return value -> None", 0), ("<= -> <", 0), ("<= -> <", 1))
    ),
    Equivalent(
        "sink",
        "self.flush_metrics()",
        "statement deleted",
        "a stopped worker stays referenced from the registry by its queue gauges (set_function), so Metrics.defer "
        "flushes it at every collection after stop too: what stop applies, the next collection applies",
        within="stop",
    ),
    *(
        Equivalent(
            "sink",
            "if linger > 0 and len(self._queue) < self.config.batch.max_messages:",
            what,
            "with linger 0 the mutant adds an asyncio.sleep(0): one more turn of the loop, which may group more records "
            "into the write, never changes what is delivered or in what order",
        )
        for what in ("> -> >=", "0 -> -1")
    ),
    Equivalent(
        "sink",
        'if getattr(record.state, "clear", False):',
        "False -> True",
        "a record's state is a StateDelta, which always has clear",
    ),
    *(
        Equivalent(
            "sink",
            "events += n if n >= 0 else len(r.events)  # Record.n_events, inline",
            what,
            "event_count is 0 only for a counted batch with no events, whose events list is empty too: 0 either way",
        )
        for what in (">= -> >", "0 -> 1")
    ),
    Equivalent("sink", "lag(now - ts if now > ts else 0.0)", "> -> >=", "when now == ts both sides give a lag of 0"),
    *(
        Equivalent(
            "sink",
            "if self.has_room(0):",
            what,
            "at exactly the byte bound (or one byte past it) the mutant sets the room, or announces the dropped spans, at "
            "the next settle instead of this one (or this one instead of the next): the records still queued bring that "
            "settle, and offer() checks the bounds itself",
            within="_settle",
        )
        for what in ("0 -> 1", "0 -> -1")
    ),
    *(
        Equivalent(
            "sink",
            "if at in spans and m.record.seq > top.get(at, -1):",
            what,
            "a write holds each stream's messages of an epoch in seq order: the last one seen is the highest, and the "
            "entries of streams without a span are never read",
        )
        for what in ("and -> or", "> -> >=", "1 -> 2")
    ),
    Equivalent(
        "sink",
        "return self._audit is not None and self.connected and time.monotonic() >= self._audit_at",
        ">= -> >",
        "differs only at the instant the audit falls due, to the float",
    ),
    *(
        Equivalent(
            "records",
            "EMPTY_RECORD_BYTES = 64",
            what,
            "a weight for queue accounting: how many control records fit under queue.max_bytes, which no contract "
            "fixes to the byte (tests read Record.size)",
        )
        for what in ("64 -> 65", "64 -> 63")
    ),
    Equivalent(
        "records",
        "event_count: int = -1",
        "1 -> 2",
        "-1 and -2 both mean len(events): n_events takes event_count only when >= 0",
    ),
    *(
        Equivalent(
            "records",
            "return self.event_count if self.event_count >= 0 else len(self.events)",
            what,
            "event_count is 0 only for a counted batch with no events, whose events list is empty too: 0 either way",
        )
        for what in (">= -> >", "0 -> 1")
    ),
    Equivalent(
        "bootstrap",
        'NO_HEAD: Document = {"epoch": -1, "gen": 0, "seq": -1, "complete": False}',
        "1 -> 2",
        "epochs are never negative: -1 and -2 both sit below every epoch (why reads epoch < 0)",
    ),
    *(
        Equivalent(
            "bootstrap",
            'NO_HEAD: Document = {"epoch": -1, "gen": 0, "seq": -1, "complete": False}',
            what,
            "the head's gen only picks the entries of its generation, and a state without a head has none",
        )
        for what in ("0 -> 1", "0 -> -1")
    ),
    Equivalent(
        "bootstrap",
        'if int(doc.get("count", 0)) > 0:',
        "0 -> -1",
        "a missing count read as -1 or as 0: not live either way",
    ),
    Equivalent(
        "kv_redis",
        "if first < WIDE:",
        "< -> <=",
        "a wide id's first part is 2**63 + an epoch of at least WIDE_EPOCHS, never 2**63 itself",
    ),
    Equivalent(
        "bootstrap",
        "if key in self.floor and self.floor[key] >= version:",
        ">= -> >",
        "two entry documents of one key at the same (epoch, seq) are the same write's: either one gives the same state",
    ),
    Equivalent(
        "bootstrap",
        "return self.applied[:2] >= (self.ready_at[0], self.ready_at[1] + 1)",
        "2 -> 3",
        "applied[:3] is applied, and a 3-tuple compares with a 2-tuple by its first two items, then as the longer "
        "(greater): >= answers the same",
    ),
    Equivalent(
        "stream",
        "lag(received - ts if received > ts else 0.0)  # never NaN: a NaN ts compares false",
        "> -> >=",
        "when received == ts both sides give a lag of 0",
    ),
    Equivalent(
        "wire",
        "return float(_struct_f64.unpack_from(payload, 2)[0])",
        "0 -> -1",
        "unpack_from of one float64 gives a 1-tuple: [0] and [-1] are the same item",
    ),
    Equivalent(
        "wire",
        "event.update(zip(names, values[:n], strict=True))",
        "True -> False",
        "values[:n] has exactly n items here (len(values) > n): strict never has anything to refuse",
    ),
    *(
        Equivalent("wire", text, what, why)
        for text in (
            'classes = [msgspec.defstruct(f"_{t}{kind}", [], tag=t, frozen=True, gc=False, **kw) for t in FIELDS]',
            'msgspec.defstruct(f"_Rfc1527{t}", [], tag=k, tag_field="event_type", frozen=True, gc=False)',
        )
        for what, why in (
            (
                "True -> False",
                "the counting structs have no fields: frozen only forbids assigning one, and nothing assigns (they are "
                "read for their type only)",
            ),
            ("False -> True", "gc=False only keeps instances of a struct without fields out of the cycle collector"),
        )
    ),
    *(
        Equivalent(
            "wire",
            text,
            "True -> False",
            "classes is built from the same mapping, one class per item: the two always have the same length",
        )
        for text in (
            "_TYPE_OF.update(zip(classes, FIELDS, strict=True))",
            "_TYPE_OF.update(zip(classes, RFC1527_TYPES.values(), strict=True))",
        )
    ),
    *(
        Equivalent(
            "wire",
            "if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):",
            what,
            "0x90 is an empty array, no batch: counted as an array it fails to decode, counted as neither it is "
            "refused; None (decode_batch decides) either way",
        )
        for what in ("<= -> <", "144 -> 145")
    ),
    *(
        Equivalent(
            "wire",
            "elif 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):",
            what,
            "only moves a byte that is no batch (0x7F a positive int, 0x80 an empty map, 0x90 already taken as an "
            "array above) between refused and failing to decode: None (decode_batch decides) either way",
            within="count_batch",
        )
        for what in ("<= -> <", "128 -> 129", "128 -> 127", "143 -> 144")
    ),
    Equivalent(
        "wire",
        "if ts > MS_TS_ABOVE and first <= 0x9F and payload[1] in _INT64:",
        "159 -> 160",
        "first is an array or map header here (0x80-0x9F, 0xDC-0xDF), never 0xA0",
        within="count_batch",
    ),
    Equivalent(
        "wire",
        "if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):",
        "159 -> 160",
        "0xA0 is an empty string, no batch: counted as an array it fails to decode, counted as neither it is "
        "refused; None (decode_batch decides) either way",
    ),
    Equivalent(
        "state",
        "for k, v in zip(self.ids, self.vers, strict=True):",
        "True -> False",
        "ids and vers are allocated together at cap slots (_alloc), and _widen copies vers whole: always the same length",
    ),
    Equivalent(
        "state",
        "i = 0",
        "0 -> -1",
        "the probe's wrap: from -1 it reads the last slot once more (not the id, or the probe would have stopped "
        "there; or moved, skipped again), then slot 0: the same answer",
        within="_old_slot",
    ),
    Equivalent(
        "state",
        "return -1",
        "1 -> 2",
        "'not in the old arrays': every caller only asks whether it is below 0 (contains, count, version, add, remove)",
        within="_old_slot",
    ),
    Equivalent(
        "wire",
        "if isinstance(ts, int) and isinstance(obj, list) and payload[0] <= 0x9F and ts > MS_TS_ABOVE:",
        "159 -> 160",
        "obj is a list: its first byte is an array header (0x90-0x9F, 0xDC, 0xDD), never 0xA0",
    ),
    *(
        Equivalent(
            "wire",
            "if ts > MS_TS_ABOVE and first <= 0x9F and payload[1] in _INT64:",
            what,
            "the fast path reaches this line only with an array of 2 or 3 elements (a fourth sets `more`, and it "
            "returns None before): first is 0x92, 0x93, 0xDC or 0xDD, on the same side of 0x9E, 0x9F and 0xA0",
            within="_decode_plain",
        )
        for what in ("<= -> <", "159 -> 160", "159 -> 158")
    ),
    *(
        Equivalent("wire", text, what, _FAST_PATH, nth=nth)
        for text, what, nth in (
            ("first = payload[0] if payload else 0", "0 -> 1", 1),
            ("first = payload[0] if payload else 0", "0 -> -1", 1),
            ("if 0x92 <= first <= 0x9F or first in (0xDC, 0xDD):", "<= -> <", 1),
            ("if 0x92 <= first <= 0x9F or first in (0xDC, 0xDD):", "146 -> 145", 0),
            *(
                ("if 0x92 <= first <= 0x9F or first in (0xDC, 0xDD):", what, 0)
                for what in ("159 -> 160", "159 -> 158", "220 -> 221", "220 -> 219", "221 -> 222", "221 -> 220")
            ),
            ("elif 0x82 <= first <= 0x8F or first in (0xDE, 0xDF):", "in -> not in", 0),
            ("elif 0x82 <= first <= 0x8F or first in (0xDE, 0xDF):", "<= -> <", 0),
            ("elif 0x82 <= first <= 0x8F or first in (0xDE, 0xDF):", "<= -> <", 1),
            *(
                ("elif 0x82 <= first <= 0x8F or first in (0xDE, 0xDF):", what, 0)
                for what in (
                    "130 -> 131",
                    "130 -> 129",
                    "143 -> 144",
                    "143 -> 142",
                    "222 -> 223",
                    "222 -> 221",
                    "223 -> 224",
                    "223 -> 222",
                )
            ),
        )
    ),
    Equivalent(
        "sequencer",
        "self._resumed = delivered is not None and delivered >= 0  # until the first live message",
        "0 -> -1",
        "with delivered -1, _resumed is read only with `seq <= self.delivered` (live), false for every seq",
    ),
    *(
        Equivalent(
            "sequencer",
            "self._older_last = -1",
            what,
            "read (_late_of_older) only once _floor_ts is set, which only _restart (setting it to -1 itself) or the "
            "live restart path (setting it to the last live seq) do: the constructor's value is never read",
            within="__init__",
        )
        for what in ("statement deleted", "1 -> 2", "1 -> 0")
    ),
    Equivalent(
        "checkpoint",
        "Path(tmp).unlink(missing_ok=True)",
        "True -> False",
        "the temporary file always exists here: mkstemp made it, and only os.replace (the try's last call) "
        "removes it, by succeeding",
    ),
    Equivalent(
        "checkpoint",
        'if nxt.stream is not r.stream or r.kind != "batch" or nxt.kind != "batch":',
        "!= -> ==",
        "a batch's acknowledgement replaces the whole row: a record followed by a batch of its stream "
        "need not be noted, whatever its kind",
    ),
    Equivalent("checkpoint", "self._generation += 1", "1 -> 2", _GENERATION),
    Equivalent("checkpoint", "row[sink] = (r.epoch, -1, -1, None, None)", "1 -> 2", _NO_ANCHOR, nth=1),
    Equivalent(
        "checkpoint",
        "row[sink] = (r.epoch, r.seq, *last[2:]) if last is not None and same_epoch else (r.epoch, r.seq, -1, None, None)",
        "1 -> 2",
        _NO_ANCHOR,
    ),
    Equivalent(
        "checkpoint",
        "same = base is not None and base.epoch == epoch and (base.seq if base.at is None else base.at) == at",
        "and -> or",
        "a row without a payload and with an anchor was built from the loaded position, and lives only as long as it "
        "(adopt and forget drop both): `same` is always true here",
    ),
    Equivalent(
        "checkpoint",
        "crc = base.crc if base is not None and same else None",
        "and -> or",
        "as above: whenever base is set here, same is true",
    ),
    *(
        Equivalent(
            "checkpoint",
            "if resume is not None and resume == self.resume_position(key) and (handover.epoch or -1) <= resume.epoch:",
            what,
            _EPOCHS,
        )
        for what in ("1 -> 2", "1 -> 0")
    ),
    Equivalent(
        "checkpoint",
        "if handover.epoch is not None and handover.epoch > self.epochs.get(key, -1):",
        "> -> >=",
        "when equal, the epoch is set to the value it has",
    ),
    Equivalent(
        "checkpoint",
        "if handover.epoch is not None and handover.epoch > self.epochs.get(key, -1):",
        "1 -> 2",
        _EPOCHS,
    ),
    Equivalent(
        "checkpoint",
        "self._acked.pop(key, None)",
        "statement deleted",
        "adopt is only for a stream not started in this process (its docstring; Bridge calls it before any stream runs): "
        "nothing of it is acknowledged yet",
        within="adopt",
    ),
    Equivalent(
        "checkpoint",
        "for key in [k for k in self._forgotten if self.epochs.get(k, -1) < clock_epoch(now - FORGET_MARGIN)]:",
        "1 -> 2",
        _EPOCHS,
    ),
    Equivalent("checkpoint", "epoch = max(epoch, self.epochs.get(key, -1) + 1)", "1 -> 2", _EPOCHS),
    Equivalent(
        "checkpoint",
        "return CheckpointFile()",
        "return value -> None",
        "Checkpointer(sinks, None) starts from nothing, exactly as from an empty CheckpointFile",
        within="_load",
    ),
    Equivalent(
        "checkpoint",
        'if self.kind == "batch" and self.index is not None:',
        "and -> or",
        "a control record never has an index (from_headers: a control record is one without an index), and a whole batch "
        "is held through the same position either way",
        within="held_at_most",
    ),
    *(
        Equivalent(
            "checkpoint",
            "lost = False",
            what,
            "lost is read only when own is not None, i.e. for a SinkPosition, which assigns it first",
        )
        for what in ("statement deleted", "False -> True")
    ),
    Equivalent(
        "checkpoint",
        "tops = [h.seq for h in held if isinstance(h, SinkPosition) and resume is not None and h.epoch == resume.epoch "
        "and h.seq >= 0]",
        "0 -> -1",
        "a sink's position never has a negative seq (a SourceReset is seq 0; from_headers reads what the bridge wrote)",
    ),
    *(
        Equivalent(
            "redis",
            "@lru_cache(maxsize=65536)",
            what,
            "the size of the cache of a pure function (a key's hash slot) changes no result, only how often it is computed again",
        )
        for what in ("65536 -> 65537", "65536 -> 65535")
    ),
    *(
        Equivalent(
            "sequencer",
            "if top > max(self.delivered, self.last_live if self.last_live is not None else -1, max(self.held, default=-1)):",
            "1 -> 2",
            _NO_SEQ,
            nth=nth,
        )
        for nth in (0, 1)
    ),
    *(
        Equivalent(
            "sequencer",
            "max_held: int = 20000,",
            what,
            "the bridge always passes replay.max_held_batches (StreamPipeline); the default is only what a test that "
            "builds a sequencer without it gets, and none holds 20 000 batches",
        )
        for what in ("20000 -> 20001", "20000 -> 19999")
    ),
    *(
        Equivalent(
            "state",
            text,
            what,
            "the growth state's values before any growth: every read of _moved and _cursor is while _old is set, "
            "and _grow sets both before it sets _old",
            within="__init__",
        )
        for text, what in (
            ("self._moved = bytearray()", "statement deleted"),
            ("self._cursor = 0", "statement deleted"),
            ("self._cursor = 0", "0 -> 1"),
            ("self._cursor = 0", "0 -> -1"),
        )
    ),
    *(
        Equivalent(
            "state",
            "return max(_MIN_SIZE, int(n / load) + 1) | 1  # odd: ids that share low bits still spread",
            what,
            "an odd size only spreads ids that share low bits (fewer probes): the table's contents are the same",
            nth=1,
        )
        for what in ("1 -> 2", "1 -> 0")
    ),
    Equivalent(
        "state",
        'assert array(_NARROW).itemsize == 4 and array("Q").itemsize == 8',
        "and -> or",
        "an import-time check of the platform's array item sizes, both true wherever the bridge runs: either form passes",
    ),
    *(
        Equivalent(
            "state",
            text,
            what,
            "a tuning constant of BlockTable (old slots moved per change while it grows; its smallest size): the "
            "table holds the same blocks, counts and versions at every step, only the cost of a change differs",
        )
        for text, whats in (
            ("MOVE_STEP = 64  # old slots moved per change while a table grows (see BlockTable)", ("64 -> 65", "64 -> 63")),
            ("_MIN_SIZE = 7", ("7 -> 8", "7 -> 6")),
            (
                "return max(_MIN_SIZE, int(n / load) + 1) | 1  # odd: ids that share low bits still spread",
                ("+ -> -", "1 -> 2", "1 -> 0"),
            ),
            ("self._alloc(max(_MIN_SIZE, capacity), _NARROW)", ("max -> min",)),
        )
        for what in whats
    ),
    Equivalent(
        "kafka",
        "elif epoch == last[0] and seq > last[1]:",
        "> -> >=",
        "when equal, the seq is set to the value it has",
    ),
    *(
        Equivalent(
            "nats",
            "if len(self._cache) > 100_000:",
            what,
            "the exact size at which the subjects' cache is cleared changes no subject, only how often one is rendered again",
        )
        for what in ("> -> >=", "100000 -> 100001", "100000 -> 99999")
    ),
    *(
        Equivalent(
            "formats",
            "return EventRecordHeader(s.source, s.dp_rank, record.epoch, record.seq, 0, record.ts, SCHEMA_VERSION)",
            what,
            "its one caller (_events, msgpack) sets each event's own index over it; the key keeps its place in the "
            "header's order",
        )
        for what in ("0 -> 1", "0 -> -1")
    ),
    Equivalent(
        "formats",
        "if (t is int and hex_ints) or (t is list and (hex_ints or not _scalar_list(v))) or t in _CONVERT:",
        "and -> or",
        "it only also calls _jsonable for an int that is not to be made hex (returned as it is) and, with hex_ints, "
        "for a scalar (returned as it is) or a list, tuple or map (the same call the other tests make)",
    ),
    Equivalent(
        "formats",
        "if len(self._heads) >= 4096:",
        "4096 -> 4095",
        "the encoded headers kept per (source, dp_rank, epoch) are a cache: one fewer at most changes how often one is "
        "encoded again, never the bytes (test_formats checks the bound of 4096)",
    ),
    Equivalent(
        "formats",
        "_INDEX_TEXT = [str(i) for i in range(4096)]",
        "4096 -> 4097",
        "the tables are read only below 4096 (`_INDEX_TEXT[i] if i < 4096 else str(i)`): one entry more is never read",
    ),
    *(
        Equivalent(
            "nats",
            "message, record=Record(stream=clean, epoch=message.record.epoch, seq=0), type=subject_token(message.type)",
            what,
            "a name template has no seq placeholder (Template: source, dp_rank, type, epoch, labels): the probe's seq "
            "is never read",
        )
        for what in ("0 -> 1", "0 -> -1")
    ),
    Equivalent(
        "nats",
        "if chunks[-1] and size + n > limit:",
        "1 -> 0",
        "chunks[0] is empty exactly when chunks[-1] is when this runs: only before the first op (chunks is [[]]); after "
        "a new part is opened, an op goes into it before the next test",
    ),
    Equivalent(
        "nats",
        'pairs = [line[:-2].partition(": ") for line in lines]',
        "2 -> 1",
        "the CR left at the value's end becomes a space (translate) that strip() removes: the same header line",
    ),
    Equivalent(
        "nats",
        'first = record.from_seq if record.kind == "EventsLost" and record.from_seq is not None else record.seq',
        "and -> or",
        "only an EventsLost has a from_seq (events_lost sets it, always; every other record's is None)",
    ),
    Equivalent(
        "nats",
        "elif span.epoch == record.epoch and record.seq > span.last:",
        "> -> >=",
        "when equal, the last seq is set to the value it has",
    ),
    Equivalent(
        "sequencer",
        "if last is not None and seq <= last:",
        "<= -> <",
        "out of doubt (accept declines in doubt) the last live seq is never above _top: every way out of doubt "
        "raises _top over what was read in it (_trust) or sets both (_restart), and every live seq read out of doubt "
        "raises _top; accept has already declined seq <= _top, so seq > last here",
        within="accept",
    ),
    Equivalent(
        "sequencer",
        "self._retired.pop(instance, None)",
        "statement deleted",
        "a UUID reaching it is never retired: a retired one was dropped above (_instance_changed), the epoch's own is "
        "never in _retired, and _live cannot retire it on the way (it restarts only on a seq at or below last_live or "
        "_top, which the certain restart just cleared; one adopted in doubt is not retired)",
        within="live",
    ),
    Equivalent(
        "sequencer",
        "self.instance, self._instance_sure = instance, not self._doubt",
        "statement deleted",
        "both callers set the same right after (live once _live returns, which reads neither; heartbeat when "
        "self.instance is None, which _restart left it)",
        within="_instance_changed",
    ),
    Equivalent(
        "sequencer",
        "if self.last_live is None or seq > self.last_live:",
        "> -> >=",
        "when equal, last_live is set to the value it has",
        within="_same_instance",
    ),
    *(
        Equivalent(
            "sequencer",
            text,
            what,
            "under the epoch's UUID known for certain, _live's late-copy check (the only reader of _replayed_crc) is "
            "never reached again in this epoch (certain lasts until _restart, which empties it): forgetting the "
            "copies at or below this seq only frees memory, bounded by _LATE_COPIES either way",
            within="_same_instance",
        )
        for text, what in (
            ("for s in [s for s in self._replayed_crc if s <= seq]:", "<= -> <"),
            ("del self._replayed_crc[s]", "statement deleted"),
        )
    ),
    *(
        Equivalent(
            "sequencer",
            "if self._join and self.delivered < 0 and seq > 0:",
            what,
            "for seq 0 it would settle up to -1, i.e. nothing (delivered is -1), and clear _suspect, which with "
            "nothing delivered can only name a replay from seq 0: seq 0 is delivered right after, so none is asked again",
            nth=nth,
            within="_same_instance",
        )
        for what, nth in (("> -> >=", 0), ("0 -> -1", 1))
    ),
    Equivalent(
        "sequencer",
        "copy = False  # proven a copy of a batch of this epoch's instance, by its bytes",
        "False -> True",
        "copy is read only in doubt for a seq at or below delivered; the paths that leave it unset are a seq above "
        "_top (never below delivered) and a restart (delivered -1 after it): there it is never read",
    ),
    *(
        Equivalent(
            "sequencer",
            "self._early, self._heard, self._skipped = {}, -1, False",
            what,
            "_request, which _new_instance ends with, sets _heard and _skipped itself, and nothing before it reads "
            "them (_restart, _note_replayed, _keep, _deliver, _drain); only _early, which _keep counts, matters here",
            within="_new_instance",
        )
        for what in ("1 -> 2", "1 -> 0", "False -> True")
    ),
    *(
        Equivalent(
            "sequencer",
            "rest = max(self._unsorted(end), default=-1) if complete and cut and self._overlap is None else -1",
            "1 -> 2",
            "rest is only compared with 0 (rest >= 0): -2 reads as -1",
            nth=nth,
        )
        for nth in (0, 1)
    ),
    *(
        Equivalent(
            "sequencer",
            "if rest >= 0:",
            what,
            "rest is -1 or an unverified seq above the last reply of the replay (end = _heard, which sorting sets to "
            "a reply's seq, >= 0): it is never 0",
        )
        for what in (">= -> >", "0 -> 1")
    ),
    Equivalent(
        "sequencer",
        "for s in [s for s in self._replayed_crc if s <= seq]:",
        "<= -> <",
        "the late-copy check reads _replayed_crc only for a seq above last_live, which is set to this seq right before "
        "and only grows in an epoch (a seq at or below it restarts or is dropped above; _restart empties the dict): "
        "the entry at this seq is never read again, keeping it only holds memory, bounded by _LATE_COPIES",
        within="_live",
    ),
    *(
        Equivalent(
            "sequencer",
            "if self._join and self.delivered < 0 and seq > 0:  # the head (this batch goes out below: once)",
            what,
            "for seq 0 it would settle up to -1, i.e. nothing (delivered is -1), and clear _suspect, which with "
            "nothing delivered can only name a replay from seq 0: seq 0 is delivered right after, so none is asked again",
            nth=nth,
        )
        for what, nth in (("> -> >=", 0), ("0 -> -1", 1))
    ),
    Equivalent(
        "sequencer",
        "self._request(out, to_end=True)",
        "True -> False",
        "start() runs at start-up, before anything was read live (last_live None) or waits: _request then reads to "
        "the end marker either way",
        within="start",
    ),
    *(
        Equivalent(
            "sequencer",
            "top = max(self._top, max(self.held, default=-1))",
            what,
            "every batch held is at or below _top (each way into held raises _top first: _live, _same_instance, _take, "
            "_new_instance, _replayed_by_new_instance, _trust; _restart sets _top to last_live, at or above what it "
            "carries), and _top >= -1: the outer max is _top whatever the inner term",
            nth=nth,
        )
        for what, nth in (("max -> min", 1), ("1 -> 2", 0))
    ),
    Equivalent(
        "sequencer",
        "end = min(self.held) - 1 if self.held else (self.last_live if self.last_live is not None else self.delivered)",
        "1 -> 0",
        "_lose delivers a held batch at to_seq itself after announcing the span below it lost: settling up to the "
        "first held batch gives the same actions as settling just below it and draining (which _lose does last)",
    ),
    Equivalent("sequencer", "def detached(self, unread_top: int = -1) -> None:", "1 -> 2", _NO_SEQ),
    *(
        Equivalent(
            "sequencer",
            "top = max(self.last_live if self.last_live is not None else -1, max(self.held, default=-1))",
            "1 -> 2",
            _NO_SEQ,
            nth=nth,
        )
        for nth in (0, 1)
    ),
    Equivalent(
        "sequencer",
        "top = max(self.last_live if self.last_live is not None else -1, max(self.held, default=-1))",
        "max -> min",
        "every batch held is above delivered (_lose takes those it passes, _drain the next one): any of them, the "
        "least as the greatest, opens the gap (delivered < top)",
        nth=1,
    ),
    Equivalent(
        "sequencer",
        "if seq > self.delivered:",
        "> -> >=",
        "a batch waits unverified only above delivered (_live keeps it so), and delivered does not move in doubt "
        "while one waits (the only loss settled in doubt is when none waits; replies are taken after _trust): no "
        "batch waiting is ever at delivered",
        within="_trust",
    ),
    *(
        Equivalent(
            "sequencer",
            "if complete and not self._answered and self._asked_from > 0 and self._floor < 0 and not self._probing:",
            what,
            "_floor is -1 or the seq a replay from seq 0 was asked in place of, which this very test requires to be "
            "above 0: it is never 0",
            nth=nth,
        )
        for what, nth in (("< -> <=", 0), ("0 -> 1", 1))
    ),
    Equivalent(
        "sequencer",
        "if seq < self._anchor_seq:",
        "< -> <=",
        "a seq equal to the anchor's returned on the line above",
        within="_other_instance",
    ),
    Equivalent("sequencer", "early, self._early, self._heard, self._skipped = self._early, {}, -1, False", "1 -> 2", _NO_SEQ),
    Equivalent(
        "sequencer",
        "above = [s for s in batches if s > seq]",
        "> -> >=",
        "a batch at this seq was answered for on the line above (mine): none is left at it here",
    ),
    *(
        Equivalent(
            "sequencer",
            text,
            what,
            "it is only called with the epoch's UUID certain (replayed checks _instance_sure), so old is never None "
            "and _restart has retired it already",
            within="_replayed_by_new_instance",
        )
        for text, what in (("if old is not None:", "is not -> is"), ("self._retire(old)", "statement deleted"))
    ),
    *(
        Equivalent(
            "sequencer",
            "self._early, self._heard, self._skipped = {}, -1, False",
            what,
            "_unclaim runs only with a replay in flight that ends here (detached, disconnected, replay_finished); "
            "_heard and _skipped are read only with one in flight (_check, replay_finished, disconnected's "
            "`self._replay is not None`), i.e. after the next _request, which sets them itself",
            within="_unclaim",
        )
        for what in ("1 -> 2", "1 -> 0", "False -> True")
    ),
    *(
        Equivalent(
            "sequencer",
            "if 0 <= self._heard < seq - 1 and any(self._heard < w < seq for w in (*self.held, *self.unverified)):",
            what,
            "`_heard < seq - 1` only saves the scan: when the last reply is seq - 1 or later, no batch waits strictly "
            "between it and seq, and any() is false either way",
            nth=nth,
        )
        for what, nth in (("< -> <=", 0), ("- -> +", 0), ("1 -> 0", 0))
    ),
    Equivalent(
        "sequencer",
        "return _SAME",
        "return value -> None",
        "replayed, _check's only caller, tests the verdict for _LATER, _NEW and _UNSURE and takes anything else "
        "as the same instance: None reads as _SAME",
        within="_check",
    ),
    *(
        Equivalent(
            "sequencer",
            text,
            what,
            "held never holds a seq at or below delivered (_lose takes those it passes, _drain the next one, and "
            "nothing keeps a batch at or below delivered): the branch is never taken",
            within="_lose",
        )
        for text, what in (("if seq <= self.delivered:", "<= -> <"), ("continue", "statement deleted"))
    ),
    Equivalent(
        "sequencer",
        "def _request(self, out: list[Action], to_end: bool = False, probe: int | None = None, floor: int = -1) -> None:",
        "1 -> 2",
        "-1 stands for no floor: _floor is only compared with a seq (>= 0) and with 0",
    ),
    *(
        Equivalent(
            "sequencer",
            "self._asked_top = max([*self.held, *self.unverified], default=-1)",
            what,
            "_asked_top is only compared with 0 (replay_finished: were batches waiting when it was asked?): any seq "
            "waiting, the least as the greatest, is >= 0, and -2 reads as -1",
        )
        for what in ("max -> min", "1 -> 2")
    ),
    *(
        Equivalent(
            "sequencer",
            text,
            "1 -> 2",
            "until -1 means to the end marker: _request keeps it only as `until if until >= 0 else -1`, so -2 reads the same",
            within="_request",
        )
        for text in ("until = -1  # and whatever this instance published of the seqs it owes", "until = -1")
    ),
    Equivalent(
        "sequencer",
        "self._early, self._heard, self._skipped = {}, -1, False",
        "1 -> 2",
        _NO_SEQ,
        within="_request",
    ),
    *(
        Equivalent(
            "sequencer",
            "if floor >= 0:",
            what,
            "floor is -1 or the seq a replay from seq 0 is asked in place of, which replay_finished passes only "
            "when it is above 0: it is never 0",
            within="_request",
        )
        for what in (">= -> >", "0 -> 1")
    ),
    Equivalent(
        "sequencer",
        "start, until = 0, -1",
        "1 -> 2",
        "until -1 means to the end marker: _request keeps it only as `until if until >= 0 else -1`, so -2 reads the same",
    ),
    Equivalent(
        "sequencer",
        "self._last_payload = None",
        "statement deleted",
        "a cache: with the payload kept, the next call computes the same fingerprint of the same batch again "
        "(_deliver replaces both, _restart clears both)",
        within="_fingerprint",
    ),
    Equivalent(
        "sequencer",
        "known += [self._top, self.last_live if self.last_live is not None else -1]",
        "1 -> 2",
        _NO_SEQ,
    ),
    Equivalent("sequencer", "unsure = -1", "1 -> 2", _NO_SEQ, within="_restart"),
    Equivalent(
        "sequencer",
        "if ts_r is not None and (ts > ts_r or (ts == ts_r and seq > r)):",
        "> -> >=",
        "a batch at seq r was passed over on the line above (continue): seq >= r reads as seq > r here",
        nth=1,
    ),
    Equivalent(
        "sequencer",
        "unsure = max((seq for seq, p in self.unverified.items() if self._ts_of(p) is None or evidence[1] is None), default=-1)",
        "1 -> 2",
        _NO_SEQ,
        nth=1,
    ),
    Equivalent(
        "sequencer",
        "unsure = max((seq for seq, p in self.unverified.items() if self._ts_of(p) is None or evidence[1] is None), default=-1)",
        "max -> min",
        "any batch waiting unverified, the least as the greatest, is at or below last_live (each was read live, so "
        "last_live is set), and the next line raises unsure to last_live whenever it is >= 0",
    ),
    Equivalent(
        "sequencer",
        "if top > self.delivered:",
        "> -> >=",
        "at top == delivered nothing is held (every batch held is in known and above delivered): _lose(delivered) "
        "settles and drains nothing, and only clears _suspect, which the next lines clear too",
        within="_restart",
    ),
    Equivalent(
        "sequencer",
        "self._older_last = -1",
        "1 -> 2",
        "_older_last is only compared with 0 (_late_of_older: < 0 means unknown; live: >= 0) and with a seq (>= 0): "
        "-2 reads as -1",
        within="_restart",
    ),
    Equivalent("sequencer", "self._unclaimed = -1", "1 -> 2", _NO_SEQ, within="_restart"),
    *(
        Equivalent(
            "sequencer",
            "self.last_live = max(max(carried), last_live if last_live is not None else -1) if carried else None",
            what,
            "it is maxed with a carried seq (>= 0): -2, -1 and 0 all read the same",
        )
        for what in ("1 -> 2", "1 -> 0")
    ),
    Equivalent(
        "sequencer",
        "self._top = self.last_live if self.last_live is not None else -1",
        "1 -> 2",
        _NO_SEQ + " (_top is maxed with delivered, seqs and held, or compared with a seq)",
    ),
    Equivalent(
        "sequencer",
        "if self._replay_first and seq >= self._replay_start:",
        ">= -> >",
        "a first reply at exactly _replay_start (delivered + 1 when asked) leaves delivered at or above it (it is "
        "delivered, or was already): not counted, the next reply is, and `seq > _replay_start > delivered` is then "
        "false, which clears _suspect as this one would; with no next reply _suspect stays at or below that start. " + _SUSPECT,
    ),
    Equivalent(
        "sequencer",
        "if seq > self._replay_start > self.delivered:",
        "> -> >=",
        "the only case it adds is a first reply at exactly _replay_start with nothing delivered since it was asked "
        "(_replay_start = delivered + 1): _lose(seq - 1) settles up to delivered, i.e. nothing, and clears _suspect, "
        "or _suspect is set to that start; either way the reply is delivered right after, so delivered reaches it. " + _SUSPECT,
        nth=0,
    ),
    Equivalent(
        "sequencer",
        "self._suspect = None",
        "statement deleted",
        "reached when the first reply is at _replay_start or delivered is at or above it already: after this reply "
        "delivered is at or above _replay_start, and _suspect, a start asked before, is at most that. " + _SUSPECT,
        within="_take",
    ),
    Equivalent(
        "sequencer",
        "self._suspect = None",
        "statement deleted",
        "the gap is closed: delivered is at or above every batch held and the last live seq. A first reply that "
        "set _suspect above a start was kept in held (nothing else waits out of doubt, and max_held >= 1: config) "
        "or the bound was full of batches held at or above that start; either way delivered has passed the start. " + _SUSPECT,
        within="replay_finished",
    ),
    Equivalent(
        "sequencer",
        "self._suspect = None",
        "statement deleted",
        "every caller settles at least one seq (to_seq > delivered at each call), and _suspect is a start asked at "
        "most at the old delivered + 1: after it delivered is at or above _suspect. " + _SUSPECT,
        within="_lose",
    ),
    Equivalent(
        "sequencer",
        "if top > self.delivered:",
        "> -> >=",
        "at top == delivered nothing is held (every batch held is at or below _top and above delivered): _lose "
        "settles nothing and only clears _suspect; the first reply that set it, above a start, raised _top to its "
        "seq (_take), so delivered, at _top, is past that start. " + _SUSPECT,
        within="replay_finished",
    ),
    Equivalent(
        "sequencer",
        "rest = max(self._unsorted(end), default=-1) if complete and cut and self._overlap is None else -1",
        "1 -> 0",
        "the default is never taken: while sorting, a batch waiting above the last reply is always unsorted (after a "
        "reply that leaves none, replayed opens the new epoch at once; batches waiting only leave by _restart, which "
        "drops the replay, or _trust, which needs the epoch's UUID known for certain, under which none waits "
        "unverified: a live message under it ends the doubt, any other restarts)",
        nth=0,
    ),
    Equivalent(
        "sequencer",
        "if probed is not None and (probed in self.unverified or probed in self.held):",
        "and -> or",
        "a probe asks for a batch waiting (held or unverified), and neither loses a batch while it is in flight in "
        "doubt (only _trust, which ends the doubt, and _restart, which drops the replay, take batches out): with a "
        "probe, the test in brackets is always true, without one it is false",
    ),
    *(
        Equivalent(module, text, "statement deleted", _SLOTS)
        for module, text in (
            ("kafka", '__slots__ = ("ends", "stream")'),
            ("nats", '__slots__ = ("fresh", "spans")'),
            ("state", '__slots__ = ("_cursor", "_limit", "_moved", "_old", "_vmax", "cap", "ids", "multi", "n", "vers")'),
            (
                "state",
                '__slots__ = ("ahead", "complete", "epoch", "generation", "live", "lost", "position", "seq", "tiers", '
                '"tracking")',
            ),
            ("state", '__slots__ = ("count", "existed", "source")'),
        )
    ),
    Equivalent(
        "state",
        "for k, v, gone in zip(ids, vers, self._moved, strict=True):",
        "True -> False",
        "_grow allocates _moved at the old arrays' cap, the length of their ids and vers: always the same length",
    ),
    *(
        Equivalent("state", text, what, _OLD_SLOT_0, within=within)
        for text, within in (
            ("if j >= 0:", "add"),
            ("if j >= 0:", "remove"),
        )
        for what in (">= -> >", "0 -> 1")
    ),
    *(Equivalent("state", "if i < 0 and j < 0:", what, _OLD_SLOT_0, nth=1) for what in ("< -> <=", "0 -> 1")),
    *(
        Equivalent(
            "state",
            "j = -1 if i >= 0 else self._old_slot(k)",
            what,
            "a block found in the new arrays (at slot 0 too) is in no old slot: a block is in exactly one of the two "
            "arrays, so _old_slot gives the -1 this gives",
            within="remove",
        )
        for what in (">= -> >", "0 -> 1")
    ),
    *(
        Equivalent("state", text, "1 -> 2", "a flag: any value but 0 says moved (it is only tested for truth)", within=within)
        for text, within in (
            ("self._moved[j] = 1  # it moves now, with its new version", "add"),
            ("self._moved[j] = 1", "remove"),
            ("moved[c] = 1", "_move_some"),
        )
    ),
    Equivalent(
        "state",
        "self._moved = bytearray()",
        "statement deleted",
        "frees the old slots' flags when the move ends; kept, they are never read while _old is None and the next "
        "growth replaces them: only memory, a byte per old slot",
        within="_move_some",
    ),
    Equivalent("state", "self._move_some(-1)", "1 -> 2", "step is only compared with 0: -2 moves every old slot as -1 does"),
    Equivalent(
        "state",
        "self._finish()",
        "statement deleted",
        "_delete, its one caller, rebuilds only when no growth is in progress (_old is None): _finish does nothing there",
        within="_rebuild",
    ),
    Equivalent(
        "state",
        "for k, v in zip(old_ids, old_vers, strict=True):",
        "True -> False",
        "ids and vers are allocated together at cap slots (_alloc), and _widen copies vers whole: always the same length",
    ),
    Equivalent(
        "state",
        "pending[(tier, k)] = _Pending(c, (c - 1 if stored else c + 1) > 0, source)",
        "1 -> 2",
        "a removal's count here is 0 or more (an absent one went on before): c + 1 and c + 2 are both above 0",
        nth=1,
    ),
    *(
        Equivalent(
            "state",
            "if p.count > 0:",
            what,
            "a count of 0 comes only from a removal, whose source is None (BlockTable.remove gives no fact at 0): no "
            "fact either way",
        )
        for what in ("> -> >=", "0 -> -1")
    ),
    Equivalent(
        "state",
        "source = m[1]",
        "statement deleted",
        "m[1] was just made by _fact(event, i, n, medium, group); from the (event, i, n) left in source _changes "
        "makes the same fact, with the key's tier",
    ),
    Equivalent(
        "state",
        "ahead.add((tier, k))",
        "statement deleted",
        "a block skipped keeps its version, at or above the record's, until a clear ends the skipping: the version "
        "test skips it again, the set only saves that lookup",
    ),
    *(
        Equivalent(
            "state",
            text,
            "0 -> -1",
            "the probe's wrap: from -1 it reads the last slot again, the one it just left (occupied and not the id, or "
            "the probe would have stopped there; in _delete, the same decision as a moment before), then slot 0: the "
            "same result",
            within=within,
        )
        for text, within in (("i = 0", "add"), ("i = 0", "_put"), ("j = 0", "_delete"))
    ),
    *(
        Equivalent(
            "state", text, "1 -> 2", "j says 'not in the old arrays' by being below 0: only compared with 0", within="remove"
        )
        for text in ("j = -1 if i >= 0 else self._old_slot(k)", "i, j = self._slot(k), -1")
    ),
    Equivalent(
        "state",
        "if (i < h <= j) if i <= j else (h > i or h <= j):",
        "<= -> <",
        "j is never i: the probe ends at an empty slot before it comes round, the table being at most 70% full",
    ),
    *(
        Equivalent(
            "state",
            text,
            what,
            "an empty slot is told by its version (0): the id left in it is never read (every probe and scan tests "
            "the version first) and a store overwrites it",
        )
        for text in ("ids[i] = 0",)
        for what in ("statement deleted", "0 -> 1")
    ),
    *(
        Equivalent(
            "state",
            "if self.n < self.cap * MIN_LOAD and self.cap > 64 and self._old is None:",
            what,
            "a tuning constant of BlockTable (the size at or under which a table is never rebuilt smaller): the table "
            "holds the same blocks, counts and versions, only the memory of a table of 63 to 65 slots differs",
        )
        for what in ("> -> >=", "64 -> 65", "64 -> 63")
    ),
    Equivalent(
        "state",
        "self._vmax = U64",
        "statement deleted",
        "only cost: each later change past 2**32 - 1 widens the versions again (a copy of the same values)",
        within="_widen",
    ),
    *(
        Equivalent("state", text, what, _NEW_STREAM, within="__init__")
        for text, whats in (
            ("self.seq = -1", ("1 -> 2", "1 -> 0")),
            ("self.ahead = -1", ("statement deleted", "1 -> 2", "1 -> 0")),
            ("self.position = (epoch, -1)", ("statement deleted", "1 -> 2", "1 -> 0")),
            ("self.complete = False", ("False -> True",)),
        )
        for what in whats
    ),
    *(
        Equivalent(
            "state",
            "elif type(size) is int and size > 0:",
            what,
            "a block_size of 0 slices no tokens: [] either way",
        )
        for what in ("> -> >=", "0 -> -1")
    ),
    *(
        Equivalent("state", text, what, _AHEAD_ABOVE, nth=nth)
        for text, what, nth in (
            ("newest = max((v - 1 for t in st.tiers.values() for _k, _c, v in t.items()), default=-1)", "- -> +", 0),
            ("newest = max((v - 1 for t in st.tiers.values() for _k, _c, v in t.items()), default=-1)", "1 -> 0", 0),
            ("newest = max((v - 1 for t in st.tiers.values() for _k, _c, v in t.items()), default=-1)", "1 -> 2", 1),
            ("newest = max((v - 1 for t in st.tiers.values() for _k, _c, v in t.items()), default=-1)", "1 -> 0", 1),
            ("st.ahead = newest if newest > head.seq else -1", "> -> >=", 0),
            ("st.ahead = newest if newest > head.seq else -1", "1 -> 2", 0),
            ("st.ahead = newest if newest > head.seq else -1", "1 -> 0", 0),
        )
    ),
    *(
        Equivalent(
            "state",
            "self._alloc(_size_for(self.n + 1, MAX_LOAD / GROWTH), self.vers.typecode)",
            what,
            "a tuning of BlockTable (the new arrays sized for one block more than it holds): the table holds the same "
            "blocks, counts and versions, only its size differs by a slot or two",
        )
        for what in ("1 -> 2", "1 -> 0")
    ),
    Equivalent(
        "state",
        "def _move_some(self, step: int = 0) -> None:",
        "0 -> 1",
        "step is only compared with 0 (below it: move every old slot): 1 moves MOVE_STEP slots as 0 does",
    ),
    *(
        Equivalent(
            "state",
            "k = h if type(h) is int and 0 <= h <= U64 else block_id(h)",
            what,
            "the fast path only saves a call: block_id gives every int from 0 to U64 itself",
            nth=nth,
        )
        for what, nth in (("<= -> <", 0), ("<= -> <", 1), ("0 -> 1", 0))
    ),
    *(
        Equivalent(
            "state",
            "st.complete = False",
            what,
            "complete is read only with tracking (Head.complete is both), and tracking comes back on only in _restart, "
            "which sets complete first",
            within="_switch_off",
        )
        for what in ("statement deleted", "False -> True")
    ),
    *(
        Equivalent(
            "state",
            "st.ahead = -1",
            what,
            "after a clear the stream's tables hold only versions of its record or later ones, each below the next "
            "record's own, and a block its record touched has a pending entry (never skipped): whatever st.ahead "
            "says (kept, 0, -2), the skipping finds nothing to skip",
            within="_clear",
        )
        for what in ("statement deleted", "1 -> 2", "1 -> 0")
    ),
    *(
        Equivalent(
            "state",
            "if f is not None and f.parent is not None and order.get((key[0], block_id(f.parent)), -1) > i:",
            what,
            "only decides whether _parents_first runs: a block that is its own parent, or a missing one (any default "
            "at or below 0 is never above an index), and _parents_first keeps an order in which every parent comes "
            "first as it is",
        )
        for what in ("> -> >=", "1 -> 2", "1 -> 0")
    ),
    Equivalent(
        "state",
        "if st.ahead >= 0:",
        "0 -> -1",
        "st.ahead -1 then reaches the inner test, -1 >= record.seq, false for every seq: it is set to -1 again",
    ),
    *(
        Equivalent(
            "state",
            "st.ahead = -1",
            what,
            "the record is past st.ahead, and so is every later one of the epoch (seqs rise; a new epoch or a clear "
            "sets it to -1): whether it is reset, or to -2 or 0, no later record is at or below it",
            within="_events",
        )
        for what in ("statement deleted", "1 -> 2", "1 -> 0")
    ),
    Equivalent(
        "state",
        "if new_epoch and not fresh:",
        "and -> or",
        "inside 'fresh or new_epoch': a fresh stream's state is made with the record's epoch (new_epoch False), so "
        "new_epoch is 'not fresh' there and both forms say the same",
    ),
    Equivalent(
        "state",
        "st.lost = False",
        "statement deleted",
        "apply has cleared it already: a lost stream's record clears it whole first ('if fresh or st.lost')",
        within="apply",
    ),
]


def equivalent_of(m: Mutant, source: str) -> Equivalent | None:
    text = source.splitlines()[m.line - 1].strip()
    for e in EQUIVALENT:
        same = (e.module, e.text, e.what, e.nth) == (m.module, text, m.what, m.nth)
        if same and (not e.within or e.within == enclosing(source, m.line)):
            return e
    return None


@functools.cache
def _functions(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of every function, outermost first."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(ast.parse(source)) if isinstance(n, defs)]


def enclosing(source: str, line: int) -> str:
    """The name of the innermost function holding ``line`` ("" at module or class level)."""
    found = [(first, name) for first, last, name in _functions(source) if first <= line <= last]
    return max(found)[1] if found else ""


def part_lines(source: str, parts: tuple[str, ...]) -> set[int]:
    """The lines of the named top-level functions / classes (``Class.method`` for one method)."""
    tree = ast.parse(source)
    lines: set[int] = set()
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for part in parts:
        name, _, member = part.partition(".")
        found = [n for n in tree.body if isinstance(n, defs) and n.name == name]
        if found and member:
            found = [n for n in getattr(found[0], "body", []) if isinstance(n, defs) and n.name == member]
        if not found:
            raise SystemExit(f"no function or class {part!r} in the module: fix the name (TARGETS or --function)")
        for n in found:
            first = min([n.lineno, *(d.lineno for d in n.decorator_list)])
            lines.update(range(first, (n.end_lineno or n.lineno) + 1))
    return lines


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True, timeout=60).stdout


def changed_lines(base: str, path: str) -> set[int]:
    """Lines of ``path`` in the working tree that differ from the merge base of ``base`` and HEAD
    (for a deletion, the lines either side of it)."""
    merge_base = git("merge-base", base, "HEAD").strip()
    lines: set[int] = set()
    for hunk in git("diff", "-U0", "--no-color", merge_base, "--", path).splitlines():
        if hunk.startswith("@@"):
            new = hunk.split()[2].lstrip("+")  # +start[,count]
            start, _, count = new.partition(",")
            n = int(count) if count else 1
            lines.update(range(int(start), int(start) + n) if n else (int(start), int(start) + 1))
    return lines


RUNNING: set[subprocess.Popen[Any]] = set()  # test runs and runners, stopped if this script is


def run_pytest(
    work: Path, selection: list[str], seed: int, examples: int, timeout: float, coverage: dict[str, str] | None = None
) -> tuple[str, float]:
    """("passed" | "failed" | "timeout" | "error", seconds) for pytest on ``selection`` in the copy
    ``work``; with ``coverage`` (the plugin's environment), the baseline: all of it, logged."""
    shutil.rmtree(work / ".hypothesis", ignore_errors=True)  # no example database: each run stands alone
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath(work, work / "tools"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "KV_MODEL_EXAMPLES": str(examples),
        **(coverage or {}),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}"]
    cmd += ["-p", "mutants_plugin"] if coverage else ["-x"]
    start = time.monotonic()
    with open(work / "pytest.log", "wb") as out:
        proc = subprocess.Popen(
            [*cmd, *selection], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
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
    # import), 3 internal error; 4 (usage: a test missing) and 5 (no tests) are this script's.
    outcome = {0: "passed", 4: "error", 5: "error"}.get(code, "failed")
    return outcome, time.monotonic() - start


class Runner:
    """A tools/mutants_runner.py process in one copy: runs pytest in a fork of itself."""

    def __init__(self, work: Path, seed: int, examples: int) -> None:
        self.work, self.seed = work, seed
        env = {**os.environ, "PYTHONPATH": pythonpath(work), "PYTHONDONTWRITEBYTECODE": "1", "KV_MODEL_EXAMPLES": str(examples)}
        self.proc = subprocess.Popen(
            [sys.executable, str(work / "tools" / "mutants_runner.py")],
            cwd=work,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        RUNNING.add(self.proc)

    def run(self, tests: list[str], timeout: float, scale: float = 1.0) -> dict[str, Any]:
        """The runner's answer (outcome, failed tests, whether a property test failed) for
        ``tests``; ``scale`` < 1: their hypothesis example counts scaled by it (the fast pass)."""
        shutil.rmtree(self.work / ".hypothesis", ignore_errors=True)  # no example database: each run stands alone
        args = ["-x", "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={self.seed}", *tests]
        env = {"KV_EXAMPLES_SCALE": str(scale)}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"args": args, "timeout": timeout, "env": env}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the test runner in {self.work} stopped (exit {self.proc.wait()})")
        return dict(json.loads(answer))

    def outcome(self, tests: list[str], timeout: float, fast: float) -> tuple[str, str]:
        """(outcome, pass that decided it) of a mutant: a fast pass at ``fast`` times the example
        counts, then the full counts wherever the fast pass is not conclusive. Killed in the fast
        pass by a test without hypothesis: killed (the same test at full counts). By a property
        test: that test again at full counts must fail too. Anything else (passed, a timeout, a
        kill the full counts do not confirm): the full pass, whose outcome stands."""
        if fast < 1:
            first = self.run(tests, timeout, fast)
            if first["outcome"] == "failed" and not first["properties"]:
                return "failed", "fast"
            if first["outcome"] == "failed" and first["failed"]:
                again = self.run(first["failed"], timeout, 1.0)
                if again["outcome"] == "failed":
                    return "failed", "confirmed"
        return str(self.run(tests, timeout)["outcome"]), "full"


@dataclass
class Baseline:
    """Which unit tests run which line of each module, and each test's time (from one run)."""

    lines: dict[str, dict[int, set[str]]]  # module -> line -> test node ids ("" = at import)
    times: dict[str, float]  # node id (parameters dropped) -> seconds

    def tests(self, m: Mutant) -> list[str]:
        by_line = self.lines[m.module]
        found = set().union(*(by_line.get(n, set()) for n in range(m.line, m.end + 1)))
        if "" in found:  # run at import: whatever runs the module may see it
            found = set().union(*by_line.values())
        found.discard("")
        return sorted(found, key=lambda t: (self.times.get(t, 0.0), t))

    def seconds(self, tests: list[str]) -> float:
        return sum(self.times.get(t, 0.0) for t in tests)


def test_id(context: str) -> str:
    return context.split("[", 1)[0]  # a parametrized test runs all its cases


def baseline(work: Path, modules: list[str], selection: list[str], seed: int, examples: int) -> Baseline | None:
    from coverage import CoverageData

    data_file = work / "baseline.coverage"
    paths = {mod: os.path.realpath(work / TARGETS[mod].path) for mod in modules}
    env = {"KV_MUTANTS_COVERAGE": str(data_file), "KV_MUTANTS_INCLUDE": ",".join(paths.values())}
    outcome, took = run_pytest(work, [*selection, *NOT_INTEGRATION], seed, examples, 1800, env)
    if outcome != "passed":
        print((work / "pytest.log").read_text()[-4000:], file=sys.stderr)
        return None
    data = CoverageData(basename=str(data_file))
    data.read()
    lines: dict[str, dict[int, set[str]]] = {}
    for mod, path in paths.items():
        by_line = data.contexts_by_lineno(path)
        lines[mod] = {n: {test_id(c) for c in ctxs} for n, ctxs in by_line.items()}
    times: dict[str, float] = {}
    for row in Path(str(data_file) + ".times").read_text().splitlines():
        seconds, nodeid = row.split("\t", 1)
        times[test_id(nodeid)] = times.get(test_id(nodeid), 0.0) + float(seconds)
    print(f"baseline: {len(times)} unit tests passed in {took:.0f}s", flush=True)
    return Baseline(lines, times)


def print_map(base: Baseline, modules: list[str], tree: Path) -> None:
    """TEST_MAP as the baseline found it: the test files that run a line of each module (besides its own)."""
    for mod in modules:
        own = set(test_files(mod, tree)) - {f"tests/unit/test_{t}.py" for t in TARGETS[mod].tests}
        found = {t.split("::")[0] for tests in base.lines[mod].values() for t in tests if t}
        names = sorted(f.removeprefix("tests/unit/test_").removesuffix(".py") for f in found - own)
        print(f"{mod}: {', '.join(names)}")
        missing = sorted(set(TARGETS[mod].tests) - set(names))
        if missing:
            print(f"  (in TEST_MAP, running none of it: {', '.join(missing)})")


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".hypothesis", "*_cache", "*.egg-info", "mutants", "site")
    shutil.copytree(ROOT, dest, ignore=ignore)


def select(args: argparse.Namespace, module: str, source: str) -> list[Mutant]:
    """The module's mutants on the lines asked for (its parts, --function, --lines, --changed)."""
    found = mutants(module, source)
    target = TARGETS[module]
    keep: set[int] | None = None
    parts = tuple(args.function or ()) or target.parts
    if parts:
        keep = part_lines(source, parts)
    if args.lines:  # (repeated: any of the ranges)
        wanted: set[int] = set()
        for spec in args.lines:
            first, _, last = spec.partition("-")
            wanted.update(range(int(first), int(last or first) + 1))
        keep = wanted if keep is None else keep & wanted
    if args.changed:
        wanted = changed_lines(args.changed, target.path)
        keep = wanted if keep is None else keep & wanted
    if keep is not None:
        found = [m for m in found if keep.intersection(range(m.line, m.end + 1))]
    if args.only:
        found = [m for m in found if m.id in args.only]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "-m", "--module", action="append", choices=sorted(TARGETS), help="module to mutate (repeatable; default all)"
    )
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (default 1: the machine is shared)")
    parser.add_argument("--examples", type=int, default=150, help="KV_MODEL_EXAMPLES for the sequencer model")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    parser.add_argument(
        "--fast",
        type=float,
        default=0.1,
        help="the fast pass's share of each property test's examples (KV_EXAMPLES_SCALE; 1: one pass at full counts)",
    )
    parser.add_argument("--threshold", type=float, default=90.0, help="kill rate in percent a module must reach")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--equivalent", action="store_true", help="list the mutants held equivalent, with why, and exit")
    parser.add_argument("--all-tests", action="store_true", help="all of tests/unit, not the modules' test files (TEST_MAP)")
    parser.add_argument(
        "--map", action="store_true", help="run all of tests/unit once and print which test files run each module"
    )
    parser.add_argument("--only", action="append", metavar="MODULE:N", help="run only these mutants")
    parser.add_argument("--function", action="append", metavar="NAME", help="only this function or class (Class.method)")
    parser.add_argument("--lines", action="append", metavar="A-B", help="only mutants on these lines (repeatable: any of them)")
    parser.add_argument(
        "--changed",
        nargs="?",
        const="main",
        metavar="BASE",
        help="only lines changed since BASE (default main); any survivor fails",
    )
    args = parser.parse_args(argv)
    if not 0 < args.fast <= 1:
        parser.error(f"--fast {args.fast}: give the fast pass's share of the examples in (0, 1] (1: no fast pass)")

    modules = args.module or list(TARGETS)
    if args.only:
        modules = sorted({o.split(":")[0] for o in args.only})
    if args.changed:
        modules = [mod for mod in modules if changed_lines(args.changed, TARGETS[mod].path)]
    if args.list or args.equivalent:
        for mod in modules:
            source = (ROOT / TARGETS[mod].path).read_text()
            for m in select(args, mod, source):
                eq = equivalent_of(m, source)
                if args.list or eq is not None:
                    why = f"  equivalent: {eq.why}" if eq is not None else ""
                    print(f"{m.id:16} {TARGETS[mod].path}:{m.line:<4} {m.what}{why}")
        return 0

    # SIGTERM as well as ^C: stop the test runs and remove the copies.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    began = time.monotonic()
    results: list[tuple[Mutant, str]] = []
    with tempfile.TemporaryDirectory(prefix="kv-mutants-") as tmp:
        copies = [Path(tmp) / f"w{i}" for i in range(max(1, args.jobs))]
        for work in copies:
            copy_tree(work)
        # The sources as copied (the working tree may change meanwhile: others work in it).
        sources = {mod: (Path(tmp) / "w0" / TARGETS[mod].path).read_text() for mod in modules}
        todo = [m for mod in modules for m in select(args, mod, sources[mod])]
        if not todo:
            print("no mutant on the lines asked for")
            return 0
        modules = [mod for mod in modules if any(m.module == mod for m in todo)]
        w0 = Path(tmp) / "w0"
        selection = ["tests/unit"] if args.all_tests or args.map else sorted({f for mod in modules for f in test_files(mod, w0)})
        base = baseline(w0, modules, selection, args.seed, args.examples)
        if base is None:
            print("the unit tests fail without any mutation; fix them first", file=sys.stderr)
            return 2
        if args.map:
            print_map(base, modules, w0)
            return 0
        for mod in modules:
            print(f"{mod}: {sum(m.module == mod for m in todo)} mutants", flush=True)
        workers: queue.Queue[Runner] = queue.Queue()
        fastest = sorted(base.times, key=lambda t: (base.times[t], t))[:20]
        for work in copies:
            runner = Runner(work, args.seed, args.examples)
            if runner.run(fastest, 120)["outcome"] != "passed":  # the runner itself must not fail a test
                print(f"the test runner fails unmutated tests ({' '.join(fastest)}): see KV_MUTANTS_LOG", file=sys.stderr)
                return 2
            workers.put(runner)

        stopping = False
        passes = {"fast": 0, "confirmed": 0, "full": 0}  # which pass decided each mutant run

        def run(m: Mutant) -> tuple[Mutant, str]:
            tests = base.tests(m)
            if stopping:
                return m, "skipped"
            if not tests:
                return m, "uncovered"
            runner = workers.get()
            target = runner.work / TARGETS[m.module].path
            try:
                target.write_text(mutated_source(m, sources[m.module]))
                outcome, decided = runner.outcome(tests, 10 + 2 * base.seconds(tests), args.fast)
            finally:
                target.write_text(sources[m.module])
                workers.put(runner)
            passes[decided] += 1
            return m, outcome

        pool = ThreadPoolExecutor(max(1, args.jobs))
        interrupted = False
        try:
            for i, (m, outcome) in enumerate(pool.map(run, todo), 1):
                eq = equivalent_of(m, sources[m.module])
                results.append((m, "equivalent" if eq is not None and outcome in ("passed", "uncovered") else outcome))
                if eq is not None and outcome in ("failed", "timeout"):
                    print(f"  KILLED BUT LISTED EQUIVALENT {m.id} {m.line} {m.what}: remove it from EQUIVALENT", flush=True)
                elif eq is None and outcome in ("passed", "uncovered", "error"):
                    word = {"passed": "survived", "uncovered": "uncovered", "error": "ERROR"}[outcome]
                    print(f"  {word:9} {m.id:16} {TARGETS[m.module].path}:{m.line:<4} {m.what}", flush=True)
                if i % 50 == 0:
                    print(f"  ... {i}/{len(todo)} ({time.monotonic() - began:.0f}s)", flush=True)
            print(
                f"decided by the fast pass: {passes['fast']}, by a property test confirmed at full counts: "
                f"{passes['confirmed']}, by the full pass: {passes['full']}",
                flush=True,
            )
        except (KeyboardInterrupt, SystemExit):  # ^C, SIGTERM: the table of what ran, modules marked
            interrupted = True
        finally:
            stopping = True
            for proc in list(RUNNING):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            pool.shutdown(cancel_futures=True)

    totals = {mod: sum(m.module == mod for m in todo) for mod in modules}
    code = report(args, modules, results, sources, time.monotonic() - began, totals)
    return 143 if interrupted else code


def report(
    args: argparse.Namespace,
    modules: list[str],
    results: list[tuple[Mutant, str]],
    sources: dict[str, str],
    took: float,
    totals: dict[str, int],
) -> int:
    print("\n| module | mutants | killed | timeout | survived | of which uncovered | equivalent | killed % |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for mod in modules:
        mine = [o for m, o in results if m.module == mod]
        killed = sum(o in ("failed", "timeout") for o in mine)  # timeouts included
        survived = mine.count("passed") + mine.count("uncovered")
        counted = len(mine) - mine.count("equivalent")
        rate = 100.0 * killed / counted if counted else 100.0
        ok = ok and rate >= args.threshold
        name = mod if len(mine) == totals[mod] else f"{mod} (interrupted: {len(mine)} of {totals[mod]} run)"
        ok = ok and len(mine) == totals[mod]
        row = [name, len(mine), killed, mine.count("timeout"), survived, mine.count("uncovered"), mine.count("equivalent")]
        print("| " + " | ".join(map(str, row)) + f" | {rate:.1f}% |")
    print(f"\n{took:.0f}s")
    survivors = [m for m, o in results if o in ("passed", "uncovered")]
    if survivors:
        print("\nsurvivors:")
        for m in survivors:
            text = sources[m.module].splitlines()[m.line - 1].strip()
            print(f"  {m.id:16} {TARGETS[m.module].path}:{m.line:<4} {m.what:22} | {text}")
    # (an interrupted run did not reach every mutant: its unmatched entries are not stale)
    whole = not (args.only or args.changed or args.function or args.lines) and len(results) == sum(totals.values())
    seen = [equivalent_of(m, sources[m.module]) for m, _ in results]
    stale = [e for e in EQUIVALENT if whole and e.module in modules and e not in seen]
    for e in stale:
        print(f"STALE EQUIVALENT entry (no such mutant now): {e.module}: {e.text!r} {e.what}", file=sys.stderr)
    if any(o == "error" for _, o in results):
        print("\nERROR: pytest could not run the selection for some mutants (exit 4 or 5)", file=sys.stderr)
        return 2
    if args.changed:
        return 1 if survivors else 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
