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
* pytest-xdist (``scripts/test.sh`` runs 3 workers): a test file is one unit of work, so that its
  module fixtures (a trained run, a search) run once, except in :data:`SPLIT_FILES`, where each
  test is one; the real-cluster tests are one unit, since their session fixtures own the Slurm
  daemons and the sshd. The slowest units are handed out first (:data:`SLOW_UNITS`), so that no
  worker starts one at the end while the others idle.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import json
import logging
import os
import resource
import signal
import sys
import tempfile
import threading
import time

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

# Tests stop the processes they start with Ctrl-C (SIGINT), as a user would. A shell starts a
# background job (`bash scripts/test.sh &`, nohup) with SIGINT ignored, and every child would
# inherit that: a rank that cannot be interrupted, and tests failing for the invocation's sake.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


#: Test files whose tests share no costly module fixture: each test (each parametrization) is a
#: unit of work of its own, so that their minutes spread over the workers.
SPLIT_FILES: tuple[str, ...] = (
    "tests/test_examples.py", "tests/test_preemption.py", "tests/dsat/test_e2e.py",
    "tests/runtime/test_op_builds.py", "tests/dsat/test_tuner_cli.py", "tests/runtime/test_context.py",
    "tests/dsat/execution/test_runner.py", "tests/dsat/test_conventions_e2e.py",
)

#: Units that take a minute or more, slowest first, from the wall times of a 3-worker run (the
#: junit XML of ``scripts/test.sh --junitxml FILE``): a file, a directory, or (in SPLIT_FILES) a
#: test's id or its prefix. Only the order of hand-out depends on it; a unit missing here runs
#: after them.
SLOW_UNITS: tuple[str, ...] = (
    "tests/compat/test_determined_e2e.py",
    "tests/dsat/test_e2e.py::test_binary_search_on_the_example_then_train_with_the_best_config",
    "tests/cluster/", "tests/checkpoint/test_api.py", "tests/checkpoint/test_store.py",
    "tests/compat/test_determined_storage.py",
    "tests/test_examples.py::test_sigterm", "tests/checkpoint/test_exact_resume.py",
    "tests/dsat/trial/test_reporting.py", "tests/dsat/test_e2e.py", "tests/compat/test_determined_launcher.py",
    "tests/dsat/test_conventions_e2e.py",
    "tests/reliability/test_chaos.py", "tests/test_examples.py", "tests/runtime/test_multinode.py",
    "tests/test_preemption.py::test_sigterm_to_torchrun_with_dataloader_workers",
    "tests/test_preemption.py::test_the_deepspeed_launcher_killed_alone",
    "tests/runtime/test_ds_shm.py", "tests/run/test_scheduler.py", "tests/compat/test_determined_legacy.py",
    "tests/reliability/test_dsat_faults.py",
    "tests/dsat/test_tuner_cli.py::test_sigkilled_search", "tests/dsat/test_tuner_cli.py::test_binary_search",
    "tests/dsat/test_tuner_cli.py::test_the_global_batch_is_kept",
    "tests/dsat/execution/test_multihost.py", "tests/config/test_ds_verdicts.py",
    "tests/runtime/test_context.py::test_deepspeed_launcher",
)


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, the test itself in a file of SPLIT_FILES, or
    the real-cluster tests together."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/cluster/"):
        return "tests/cluster/"
    return nodeid if path in SPLIT_FILES else path


def _rank(nodeid: str) -> int:
    """Where a test's unit stands in SLOW_UNITS (after them all when it is not there)."""
    unit = _unit(nodeid)
    return next((i for i, slow in enumerate(SLOW_UNITS) if unit.startswith(slow)), len(SLOW_UNITS))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: file order kept within a rank


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config, log):
        """Units of work by :func:`_unit`, handed out in collection order (slow units first), each
        worker holding at most one unit ahead of the one it runs.
        (xdist's own ``--dist loadgroup`` marks do not take under pytest 9: its workers rename
        ``item._nodeid``, which pytest 9 no longer reads.)"""
        from xdist.scheduler import LoadScopeScheduling

        class ByUnit(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _unit(nodeid)

            def _reschedule(self, node) -> None:
                # xdist tops a worker up when 2 of its tests are left: a whole unit then waits
                # behind a long last test while another worker idles. A worker holds its last
                # test until it gets the next one or is told to stop (it needs the next item to
                # tear fixtures down), so 1 left is the moment to send the next unit.
                if node.shutting_down:
                    return
                if not self.workqueue:
                    node.shutdown()
                    return
                if self._pending_of(self.assigned_work[node]) <= 1:
                    self._assign_work_unit(node)

        config.option.loadscopereorder = False
        return ByUnit(config, log)


#: ``TOOLKIT_TEST_CPU_LOG=FILE``: each test's wall time and CPU seconds (this process and every
#: process it waited for, their descendants included) as JSON lines, for finding what to cut: on a
#: busy machine a test's wall time says more about its neighbours than about itself.
_CPU_LOG = os.environ.get("TOOLKIT_TEST_CPU_LOG")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Around the whole protocol, so that module fixtures set up for this test count too.
    timer = threading.Timer(_LIMIT_S, _hung, args=(item,))
    timer.daemon = True
    timer.start()
    wall, cpu = time.monotonic(), _cpu_seconds()
    try:
        yield
    finally:
        timer.cancel()
        if _CPU_LOG:
            line = json.dumps({"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
                               "cpu_s": round(_cpu_seconds() - cpu, 2)})
            with open(_CPU_LOG, "a") as log:
                log.write(line + "\n")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Put back os.environ and the stop signals' handlers after each test. An in-process
    ``init_distributed()`` exports the launch (``LOCAL_RANK=0``, ...) as it does for a user's
    script; left in a worker, it made a later test's
    child look like a rank process (CI, 2026-11-27)."""
    saved = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
    for sig, handler in handlers.items():  # a watcher that stopped leaves SIGTERM/SIGUSR1 ignored
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    # A stop agreed in this process makes its later commits write a stop record (issue 41): the
    # next test's in-process commits are another run's.
    import toolkit.preemption

    toolkit.preemption._last_stop = toolkit.preemption._first_stop = None


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
