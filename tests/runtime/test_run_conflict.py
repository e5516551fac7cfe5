"""toolkit.runtime.run_conflict: an uncaught RunConflictError ends a real process with status 2 after
its traceback, its atexit handlers and its buffered output (wait_bound: test_launcher_watch.py)."""

from __future__ import annotations

import subprocess
import sys

from helpers import procutil
from toolkit.runtime.run_conflict import CONFLICT_EXIT_STATUS

_CONFLICT = """
import atexit, sys
from toolkit.errors import RunConflictError
from toolkit.runtime.run_conflict import install_conflict_exit_hook
atexit.register(lambda: print("atexit ran", end=""))
install_conflict_exit_hook()
install_conflict_exit_hook()                     # idempotent: one hook
print("buffered, not yet flushed", end="")       # stdout is a pipe: block-buffered
raise RunConflictError("the rendezvous port is still served by another run's process")
"""


def test_an_uncaught_run_conflict_exits_2_after_atexit_and_the_buffered_output():
    done = subprocess.run([sys.executable, "-c", _CONFLICT], capture_output=True, text=True, timeout=60,
                          env=procutil.child_env())
    assert done.returncode == CONFLICT_EXIT_STATUS == 2, done.stderr
    assert done.stdout == "buffered, not yet flushedatexit ran"
    assert done.stderr.count("Traceback") == 1
    assert done.stderr.rstrip().endswith(
        "RunConflictError: the rendezvous port is still served by another run's process")
