"""Inside a dsat trial: an out-of-memory error that escapes uncaught is written as the trial's
``"oom"`` result (typically ``deepspeed.initialize`` placing model states that do not fit).

``init_distributed`` and a trial's first reporting context install the hook, never the import; an
OOM that a step raises is the reporting context's own (``exit_on_oom``). Each rank reports its own."""

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
    """In a trial process (``TOOLKIT_DSAT_TRIAL`` set), make an uncaught OOM write the trial's ``"oom"``
    result after the previous hook ran; True once installed. Idempotent; any rank."""
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
