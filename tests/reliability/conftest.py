"""The reliability suite's switches and its tally of (tried, survived, lost) per category.

* ``TOOLKIT_RELIABILITY_FULL=1`` (set by ``scripts/reliability.py``) runs the long parts: 20
  chaos signals instead of 3, 10 kills during a save instead of 2, more fuzzing examples. Without
  it (CI, the everyday ``bash scripts/test.sh``) the short parts run and the tests marked
  ``reliability_full`` skip.
* ``TOOLKIT_RELIABILITY_REPORT=<file>``: every test appends one JSON line ``{"category", "tried",
  "survived", "lost"}`` there. A test that counts its own attempts uses the :func:`tally` fixture;
  any other test of a module with a ``CATEGORY`` counts as one attempt, survived if it passed
  (unless the test function has ``uncounted = True``: a check of the suite itself).
"""

from __future__ import annotations

import json
import os

import pytest

FULL = os.environ.get("TOOLKIT_RELIABILITY_FULL") == "1"
REPORT_ENV = "TOOLKIT_RELIABILITY_REPORT"


class Tally:
    """Attempts of one category within one test: ``tried``, ``survived``, ``lost`` (and notes)."""

    def __init__(self, category: str) -> None:
        self.category, self.tried, self.survived, self.lost = category, 0, 0, 0
        self.notes: list[str] = []
        self.detail = ""  # one line for the table, e.g. where the signals landed

    def record(self, ok: bool, note: str = "") -> None:
        self.tried += 1
        if ok:
            self.survived += 1
        else:
            self.lost += 1
            if note:
                self.notes.append(note)


def _report(line: dict) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")


@pytest.fixture
def tally(request):
    """Counts the test's own attempts; reported when the test ends (whatever its outcome)."""
    made: list[Tally] = []

    def make(category: str) -> Tally:
        made.append(Tally(category))
        return made[-1]

    yield make
    for t in made:
        _report({"category": t.category, "tried": t.tried, "survived": t.survived, "lost": t.lost,
                 "test": request.node.nodeid, "notes": t.notes[:5], "detail": t.detail})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    category = getattr(item.module, "CATEGORY", None)
    if category is None or "tally" in item.fixturenames or getattr(item.function, "uncounted", False):
        return
    if report.when == "call" or (report.when == "setup" and report.failed):
        _report({"category": category, "tried": 1, "survived": int(report.passed), "lost": int(report.failed),
                 "test": item.nodeid, "notes": [] if report.passed else [str(report.longrepr)[-300:]]})


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="long part of the reliability suite: run scripts/reliability.py "
                                   "(TOOLKIT_RELIABILITY_FULL=1)")
    for item in items:
        if "reliability_full" in item.keywords:
            item.add_marker(skip)
