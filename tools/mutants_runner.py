"""Test runner of tools/mutants.py: one per job, started in a copy of the tree.

It imports pytest and the libraries the code under test uses once, then for each request
forks a child that runs ``pytest.main`` on the copy, so that a mutant pays for importing the
bridge and its tests, not for importing pytest, hypothesis, zmq and the clients again. The code
under test is never imported here, only in the children (each reads the mutated file afresh).

Requests on stdin, one JSON object a line: ``{"args": [...], "timeout": seconds, "env": {...}}``
(``env``, optional: variables the child sets before pytest starts, e.g. ``KV_EXAMPLES_SCALE``);
answers on stdout, one a line: ``{"outcome": "passed" | "failed" | "timeout", "seconds": s,
"failed": [node ids], "properties": bool}``: the tests that failed, and whether one of them is a
hypothesis test (its example count is what ``KV_EXAMPLES_SCALE`` scales).
``KV_MUTANTS_LOG``: a file the children's output is appended to (to see why a mutant died).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

# Not the code under test: third-party modules only (a bridge module imported here would be the
# unmutated one in every child). The pytest plugins among them are not assert-rewritten then: the
# children ignore pytest's warning about that (ARGS), an error under the project's filterwarnings.
PRELOAD = (
    "pytest",
    "_pytest.python",
    "_pytest.assertion.rewrite",
    "pytest_asyncio",
    "pytest_timeout",
    "hypothesis",
    "hypothesis.strategies",
    "msgspec",
    "zmq",
    "zmq.asyncio",
    "prometheus_client",
    "yaml",
    "aiokafka",
    "aiokafka.admin",
    "redis.asyncio",
    "redis.exceptions",
    "nats.aio.client",
    "nats.js",
    "asyncio",
    "ssl",
    "tomllib",
    "difflib",
)


ARGS = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]


class Failures:
    """A pytest plugin (in the child): the tests that failed, and whether one is a property test."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.properties = False
        self._hypothesis: set[str] = set()

    def pytest_collection_modifyitems(self, items: list[Any]) -> None:
        from hypothesis import settings

        for item in items:
            func = getattr(item, "obj", None)
            stateful = isinstance(getattr(getattr(item, "cls", None), "settings", None), settings)
            if stateful or getattr(func, "is_hypothesis_test", False):
                self._hypothesis.add(item.nodeid)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed.append(report.nodeid)
            self.properties = self.properties or report.nodeid in self._hypothesis


def run(args: list[str], timeout: float, env: dict[str, str]) -> dict[str, Any]:
    start = time.monotonic()
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: pytest on the copy, its exit code as ours
        code = 3
        failures = Failures()
        try:
            os.close(readable)
            os.environ.update(env)
            out = os.open(os.environ.get("KV_MUTANTS_LOG", os.devnull), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(out, 1)
            os.dup2(out, 2)
            import pytest

            code = int(pytest.main([*ARGS, *args], plugins=[failures]))
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            with contextlib.suppress(Exception):  # a few node ids: far below the pipe's buffer
                os.write(writable, json.dumps({"failed": failures.failed[:20], "properties": failures.properties}).encode())
            os._exit(code)
    os.close(writable)
    deadline = start + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(readable)
            return {"outcome": "timeout", "seconds": time.monotonic() - start, "failed": [], "properties": False}
        time.sleep(0.01)
    code = os.waitstatus_to_exitcode(status)
    with os.fdopen(readable, "rb") as pipe:
        told = pipe.read()
    found = json.loads(told) if told else {"failed": [], "properties": False}
    # pytest: 0 passed, 1 tests failed, 2 interrupted, 3 internal error, 4 usage error, 5 no tests.
    # The tests asked for all ran in the baseline: a mutant that makes their module fail to import
    # makes pytest answer 4 (no test found by that id) or 5; a kill like any other.
    outcome = "passed" if code == 0 else "failed"
    return {"outcome": outcome, "seconds": time.monotonic() - start, **found}


def main() -> None:
    sys.dont_write_bytecode = True
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    sys.path.insert(0, os.getcwd())
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(run(request["args"], request["timeout"], request.get("env", {}))), flush=True)


if __name__ == "__main__":
    main()
