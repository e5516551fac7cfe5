"""A run that meets another still running: how long it waits, and its exit status 2 after that.

A second run of the same command, started while the first's ranks still save, waits for them
(its rendezvous port, its checkpoint directory) up to :func:`wait_bound` seconds and then raises
:class:`~toolkit.errors.RunConflictError` on every rank; uncaught, it ends the process with exit
status 2, read by a scheduler as "not started, nothing written" (as the CLIs' bad input), after
the usual traceback and the ``atexit`` handlers. Any rank; the hook is installed when the error
is raised, so importing toolkit changes nothing. Exit statuses: docs/training.md.

Example::

    # deepspeed train.py, twice at once on one checkpoint directory: the second exits 2
    install_conflict_exit_hook()
"""

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
    """Seconds a run waits for another that holds what it needs: ``TOOLKIT_WAIT_FOR_OTHER_RUN_S``,
    else 300 (0: no wait). Pure but for reading the environment; any rank.

    Raises:
        ConfigError: the variable is not a number of seconds >= 0.
    """
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
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(CONFLICT_EXIT_STATUS)

    hook.toolkit_conflict_exit = True  # type: ignore[attr-defined]
    return hook


def install_conflict_exit_hook() -> None:
    """Make an uncaught RunConflictError end this process with status 2. Idempotent; any rank."""
    if not getattr(sys.excepthook, "toolkit_conflict_exit", False):
        sys.excepthook = _hook(sys.excepthook)
