"""Test runner of tools/mutants.py: one per job, started in a copy of the tree.

It imports pytest and the libraries the code under test uses once, then for each request
forks a child that runs ``pytest.main`` on the copy, so that a mutant pays for importing the
bridge and its tests, not for importing pytest, hypothesis, zmq and the clients again. The code
under test is never imported here, only in the children (each reads the mutated file afresh).

Requests on stdin, one JSON object a line: ``{"args": [...], "timeout": seconds}``; answers on
stdout, one a line: ``{"outcome": "passed" | "failed" | "timeout", "seconds": s}``.
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


def run(args: list[str], timeout: float) -> tuple[str, float]:
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: pytest on the copy, its exit code as ours
        code = 3
        try:
            out = os.open(os.environ.get("KV_MUTANTS_LOG", os.devnull), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(out, 1)
            os.dup2(out, 2)
            import pytest

            code = int(pytest.main([*ARGS, *args]))
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    deadline = start + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - start
        time.sleep(0.01)
    code = os.waitstatus_to_exitcode(status)
    # pytest: 0 passed, 1 tests failed, 2 interrupted, 3 internal error, 4 usage error, 5 no tests.
    # The tests asked for all ran in the baseline: a mutant that makes their module fail to import
    # makes pytest answer 4 (no test found by that id) or 5; a kill like any other.
    return ("passed" if code == 0 else "failed"), time.monotonic() - start


def main() -> None:
    sys.dont_write_bytecode = True
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    sys.path.insert(0, os.getcwd())
    for line in sys.stdin:
        request = json.loads(line)
        outcome, seconds = run(request["args"], request["timeout"])
        print(json.dumps({"outcome": outcome, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
