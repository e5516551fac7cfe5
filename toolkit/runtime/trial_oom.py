"""Inside a dsat trial: an out-of-memory error that escapes uncaught is written as the trial's
``"oom"`` result (typically ``deepspeed.initialize`` placing model states that do not fit).

Nothing runs on import: :func:`toolkit.init_distributed` and the first reporting context of a
trial install the hook (:func:`install_oom_excepthook`). An OOM that a step raises is handled by
the reporting context itself (:func:`toolkit.dsat.trial.oom.exit_on_oom`). Every rank (each
reports its own OOM).

Example::

    # inside a trial process, before the model is built (toolkit.init_distributed does this)
    install_oom_excepthook()
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.runtime.trial_env import TRIAL_ENV

__all__ = ["install_oom_excepthook", "is_crashing", "is_oom", "one_line", "write_oom_result"]

_installed_for: str | None = None   # the trial file the hook was installed for
_crashing = False                   # an uncaught exception is ending this process


def is_oom(err: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is an alias). Any rank."""
    import torch
    oom = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                            getattr(torch.cuda, "OutOfMemoryError", None)) if isinstance(t, type))
    return bool(oom) and isinstance(err, oom)


def is_crashing() -> bool:
    """True once an uncaught exception is ending this process (seen by the installed hook)."""
    return _crashing


def one_line(err: BaseException) -> str:
    """The error's message on one line, at most 500 characters (its type's name when empty)."""
    return " ".join(str(err).split())[:500] or type(err).__name__


def write_oom_result(result_path: str | os.PathLike[str], trial_id: int, err: BaseException) -> None:
    """Write a trial's result file with status ``"oom"`` and the error's message. Any rank."""
    atomic_write_json(result_path, {"trial_id": trial_id, "status": "oom", "metrics": {},
                                    "profile": None, "error": one_line(err)})


def install_oom_excepthook() -> bool:
    """In a trial process, make an uncaught OOM write the trial's ``"oom"`` result. Any rank.

    Outside a trial (:data:`~toolkit.runtime.trial_env.TRIAL_ENV` unset) it does nothing. The
    previous ``sys.excepthook`` still runs first (the traceback is printed) and the process
    exits as Python does (status 1). Idempotent: a second call installs nothing. The trial file
    is read only when an OOM ends the process, for its ``trial_id`` and ``result_path``.

    Returns:
        True when the hook is installed (now or by an earlier call).
    """
    global _installed_for
    path = os.environ.get(TRIAL_ENV)
    if not path:
        return False
    if _installed_for == path:
        return True
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        global _crashing
        _crashing = True
        previous(exc_type, exc, tb)
        if isinstance(exc, BaseException) and "torch" in sys.modules and is_oom(exc):
            with contextlib.suppress(Exception):
                trial = load_json(path, what="trial file")
                write_oom_result(trial["result_path"], trial["trial_id"], exc)

    sys.excepthook = hook
    _installed_for = path
    return True
