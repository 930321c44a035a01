"""pytest plugin of tools/mutants.py: which test runs which line, and how long each test takes.

Loaded with ``-p mutants_plugin`` (``tools/`` on ``PYTHONPATH``) when ``KV_MUTANTS_COVERAGE``
names a data file. Coverage starts when the plugin is imported, before any conftest or test
module imports the code under test, so a line run at import is recorded too (with the empty
context ``""``); from each test's setup on, the context is the test's node id. Durations go to
``<data file>.times`` as ``seconds<TAB>node id`` lines.
"""

from __future__ import annotations

import os
from typing import Any

import coverage

_OUT = os.environ.get("KV_MUTANTS_COVERAGE")
_cov: coverage.Coverage | None = None
_times: dict[str, float] = {}
if _OUT:
    _include = os.environ.get("KV_MUTANTS_INCLUDE", "").split(",")
    _cov = coverage.Coverage(data_file=_OUT, include=_include, config_file=False)
    _cov.start()


def pytest_runtest_setup(item: Any) -> None:
    if _cov is not None:
        _cov.switch_context(item.nodeid)


def pytest_runtest_logreport(report: Any) -> None:
    if _cov is not None:
        _times[report.nodeid] = _times.get(report.nodeid, 0.0) + report.duration


def pytest_unconfigure(config: Any) -> None:
    if _cov is not None and _OUT:
        _cov.stop()
        _cov.save()
        with open(_OUT + ".times", "w") as f:
            f.writelines(f"{t:.4f}\t{nodeid}\n" for nodeid, t in _times.items())
