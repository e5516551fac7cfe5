"""Inside a dsat trial: report an out-of-memory error as the trial's result, then end the process.

An OOM that a step raises is caught by the reporting context (:func:`exit_on_oom`); one that
escapes uncaught elsewhere (typically ``deepspeed.initialize`` placing model states that do not
fit) is reported by the excepthook of :func:`install_oom_excepthook`. Nothing here runs on
import: the hook is installed explicitly, by :func:`toolkit.init_distributed` and by the first
reporting context of a trial process. Every rank (each reports its own OOM).

Example::

    # inside a trial process, before the model is built (toolkit.init_distributed does this)
    install_oom_excepthook()
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, NoReturn

from toolkit._files import atomic_write_json
from toolkit.dsat.contract import OOM_EXIT_STATUS, TRIAL_ENV, TrialContract

__all__ = ["exit_on_oom", "install_oom_excepthook", "is_crashing", "is_oom", "one_line", "write_oom_result"]

logger = logging.getLogger(__name__)

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


def write_oom_result(contract: TrialContract, err: BaseException) -> None:
    """Write the trial's result file with status ``"oom"`` and the error's message. Any rank."""
    atomic_write_json(contract.result_path, {"trial_id": contract.trial_id, "status": "oom", "metrics": {},
                                             "profile": None, "error": one_line(err)})


def exit_on_oom(contract: TrialContract, err: BaseException, *, rank: int) -> NoReturn:
    """Report ``err`` as the trial's OOM and end this process with :data:`OOM_EXIT_STATUS`. Any rank.

    ``os._exit``, no teardown: after an OOM the other ranks may never reach a collective.
    """
    logger.error("dsat trial %d ran out of memory on rank %d: %s", contract.trial_id, rank, one_line(err))
    try:
        write_oom_result(contract, err)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(OOM_EXIT_STATUS)


def install_oom_excepthook() -> bool:
    """In a trial process, make an uncaught OOM write the trial's ``"oom"`` result. Any rank.

    Outside a trial (:data:`~toolkit.dsat.contract.TRIAL_ENV` unset) it does nothing. The
    previous ``sys.excepthook`` still runs first (the traceback is printed) and the process
    exits as Python does (status 1). Idempotent: a second call installs nothing.

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
                write_oom_result(TrialContract.read(path), exc)

    sys.excepthook = hook
    _installed_for = path
    return True
