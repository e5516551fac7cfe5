"""A run that meets another still running: how long it waits, and its exit status 2 after that.

One bound (``TOOLKIT_WAIT_FOR_OTHER_RUN_S``, default 300 s) for the rendezvous port and the
checkpoint directory; then RunConflictError is raised on every rank and, uncaught, ends the process
with status 2 ("not started, nothing written") after the traceback and the ``atexit`` handlers.
The hook is installed when the error is raised, never on import. Any rank."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
from typing import Any, Mapping

from toolkit.errors import ConfigError, RunConflictError

__all__ = ["CONFLICT_EXIT_STATUS", "DEFAULT_WAIT_S", "WAIT_ENV", "install_conflict_exit_hook", "wait_bound"]

CONFLICT_EXIT_STATUS = 2
WAIT_ENV = "TOOLKIT_WAIT_FOR_OTHER_RUN_S"
DEFAULT_WAIT_S = 300.0


def wait_bound(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a run waits for another that holds what it needs: ``TOOLKIT_WAIT_FOR_OTHER_RUN_S``, else
    300 (0: no wait); ConfigError unless a number >= 0. Any rank."""
    raw = (os.environ if environ is None else environ).get(WAIT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{WAIT_ENV}={raw!r}: expected the seconds a run waits for another run that still "
                          f"holds its rendezvous port or checkpoint directory (0: no wait), for example "
                          f"{DEFAULT_WAIT_S:g}")
    return value


def _hook(previous: Any) -> Any:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        previous(exc_type, exc, tb)
        if isinstance(exc, RunConflictError):
            with contextlib.suppress(Exception):
                atexit._run_exitfuncs()  # what a normal exit runs (the process group, toolkit's locks)
            # untraced: coverage's exit handler, run above, has stopped (tests/runtime/test_run_conflict.py)
            for stream in (sys.stdout, sys.stderr):  # pragma: no cover
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(CONFLICT_EXIT_STATUS)

    hook.toolkit_conflict_exit = True  # type: ignore[attr-defined]
    return hook


def install_conflict_exit_hook() -> None:
    """Make an uncaught RunConflictError end this process with status 2. Idempotent; any rank."""
    if not getattr(sys.excepthook, "toolkit_conflict_exit", False):
        sys.excepthook = _hook(sys.excepthook)
