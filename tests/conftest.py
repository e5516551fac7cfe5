"""Suite-wide guards: no test may hang the run, and no process a test started may outlive it.

* A watchdog per test (a timer thread and ``faulthandler``, standard library): a test (its
  fixtures included) that runs past ``TOOLKIT_TEST_LIMIT_S`` seconds (default 900) dumps every
  thread's stack and ends pytest, so CI fails in minutes with the place it hung instead of timing
  out silently.
* Every process started through ``procutil`` carries ``TOOLKIT_TEST_SESSION=<id>`` in its
  environment; after each test module any of them still alive is killed. torchrun starts its
  workers in sessions of their own, so killing a launcher's process group does not reach them,
  and an orphaned rank can hold DeepSpeed's op-build lock or a port for the rest of the run.
* ``tests/site`` on ``PYTHONPATH``: py-cpuinfo's answer, which DeepSpeed asks for twice in every
  process that loads a CPU op and which takes a second each time, is cached in a file for the run
  (``tests/site/sitecustomize.py`` says why; it changes no value, only the wait).
* pytest-xdist (``scripts/test.sh`` runs 2 workers): a test file is one unit of work, so that its
  module fixtures (a trained run, a search) run once; the real-cluster tests are one unit, since
  their session fixtures own the Slurm daemons and the sshd. The slowest files are handed out
  first (:data:`SLOW_FILES`), so that no worker starts one at the end while the other idles.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import logging
import os
import signal
import sys
import tempfile
import threading

import pytest

from helpers import procutil
from toolkit.launch.procs import find_trial_processes, kill_until_gone

_LIMIT_S = float(os.environ.get("TOOLKIT_TEST_LIMIT_S", "900"))
# Every descendant of this pytest, in-process launches included, inherits the mark.
os.environ[procutil.SESSION_ENV] = procutil.SESSION_ID

_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)
_CPUINFO_DIR = tempfile.TemporaryDirectory(prefix="toolkit-tests-cpuinfo-")
os.environ["PYTEST_CPUINFO_CACHE"] = os.path.join(_CPUINFO_DIR.name, "cpuinfo.json")
sys.path.insert(0, _SITE)
import sitecustomize  # noqa: E402  (this process: cpuinfo may already be imported, or come later)

sitecustomize.install()


def _hung(item) -> None:
    """On the watchdog's thread: show where every thread is, then end the run."""
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)  # so that the stacks reach the real stderr
    sys.stderr.write(f"\n\n{item.nodeid} ran past {_LIMIT_S:.0f} s (TOOLKIT_TEST_LIMIT_S); stacks:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    for pid in find_trial_processes(procutil.SESSION_ID, variable=procutil.SESSION_ENV):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # no orphan may keep the CI job (or a lock) alive
    os._exit(3)


#: Test files (or directories) that take a minute or more, slowest first, from ``--durations=0``.
#: Only the order of hand-out depends on it; a file missing here runs after them.
SLOW_FILES: tuple[str, ...] = (
    "tests/test_examples.py", "tests/cluster/", "tests/compat/test_determined_e2e.py",
    "tests/test_preemption.py", "tests/dsat/test_e2e.py", "tests/dsat/test_cli.py",
    "tests/reliability/test_chaos.py", "tests/checkpoint/test_exact_resume.py",
    "tests/dsat/trial/test_reporting.py", "tests/checkpoint/test_api.py", "tests/runtime/test_context.py",
    "tests/runtime/test_op_builds.py", "tests/run/test_scheduler.py",
    "tests/compat/test_determined_launcher.py", "tests/dsat/execution/test_runner.py",
    "tests/runtime/test_multinode.py", "tests/reliability/test_dsat_faults.py",
    "tests/runtime/test_ds_shm.py", "tests/config/test_ds_verdicts.py", "tests/dsat/execution/test_hosts.py",
)


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the real-cluster tests together."""
    path = nodeid.split("::", 1)[0]
    return "tests/cluster/" if path.startswith("tests/cluster/") else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable: file order kept


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config, log):
        """Units of work by :func:`_unit`, handed out in collection order (slow files first).
        (xdist's own ``--dist loadgroup`` marks do not take under pytest 9: its workers rename
        ``item._nodeid``, which pytest 9 no longer reads.)"""
        from xdist.scheduler import LoadScopeScheduling

        class ByUnit(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _unit(nodeid)

        config.option.loadscopereorder = False
        return ByUnit(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Around the whole protocol, so that module fixtures set up for this test count too.
    timer = threading.Timer(_LIMIT_S, _hung, args=(item,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(autouse=True, scope="module")
def _no_leftover_processes():
    yield
    def find(table):
        return find_trial_processes(procutil.SESSION_ID, variable=procutil.SESSION_ENV, table=table)

    leftover = find(None)
    if leftover:
        logging.getLogger(__name__).warning("killing %d processes a test left behind: %s",
                                            len(leftover), sorted(leftover))
        kill_until_gone(find, grace_s=2.0, what="test leftovers")
