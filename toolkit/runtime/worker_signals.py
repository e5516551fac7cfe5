"""DataLoader worker processes ignore the stop signals, so that a preemption stops the rank cleanly.

torchrun, Ctrl-C and Slurm signal a rank's whole process group; with the default action its
DataLoader workers die and the rank fails before it can save. :func:`protect_dataloader_workers`
(``init_distributed`` and ``watch_preemption`` call it) makes workers started afterwards ignore
SIGTERM, SIGINT and SIGUSR1, and a forked worker dies with its rank. Any rank. How, and what it
does not cover: docs/training.md (DataLoader workers)."""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any, Iterable

__all__ = ["PROTECTED_SIGNALS", "die_with_parent", "protect_dataloader_workers", "protected_signals",
           "stop_signals"]

logger = logging.getLogger(__name__)

PROTECTED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}
_EXIT_GRACE_S = 1.0

_original: Any = None         # torch's own _worker_loop, once wrapped
_signals: tuple[int, ...] = ()
_parent_main_ident = 0        # the rank's main thread; a forked worker compares its own thread with it
_PR_SET_PDEATHSIG = 1         # <linux/prctl.h>


def worker_loop_ignoring(signals: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Torch's worker loop, after setting ``signals`` to SIG_IGN. In a DataLoader worker only; a module
    function (bound with ``functools.partial``) so that a ``spawn`` or ``forkserver`` loader can pickle it."""
    from torch.utils.data._utils import signal_handling, worker

    torch_handlers = signal_handling._set_worker_signal_handlers

    # Torch's loop first installs C handlers for SIGSEGV, SIGBUS, SIGFPE and SIGTERM (its SIGTERM
    # handler re-raises the default action unless the DataLoader's own process sent it), so the
    # signals are ignored right after that, in this worker process only.
    def set_handlers(*a: Any, **kw: Any) -> None:
        torch_handlers(*a, **kw)
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        if _original is not None:  # forked: tie this worker's life to its rank's
            die_with_parent()

    signal_handling._set_worker_signal_handlers = set_handlers

    # Forked: the original saved by protect_dataloader_workers. Spawned: this module and torch
    # were imported afresh in the child, where torch's attribute is still its own loop.
    loop = _original if _original is not None else worker._worker_loop
    loop(*args, **kwargs)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this forked DataLoader worker when its rank exits. In the worker.

    A worker that ignores SIGTERM must never outlive its rank: an orphan holds the job's output open,
    torchrun, seeing the rank gone, never signals its group again, and torch's watchdog ends one only
    from its fetch loop. ``PR_SET_PDEATHSIG`` fires when the *thread* that forked ends, so it is set
    only for workers forked by the rank's main thread."""
    if not sys.platform.startswith("linux") or threading.get_ident() != _parent_main_ident:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # pragma: no cover - no prctl: torch's watchdog remains
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the rank ended before prctl
        os._exit(0)


def protect_dataloader_workers(signals: Iterable[int] = PROTECTED_SIGNALS) -> tuple[int, ...]:
    """Make DataLoader workers started from now on ignore ``signals`` (added to earlier ones); returns
    every signal now ignored. Idempotent, process-wide, never undone. Any rank."""
    global _original, _signals, _parent_main_ident
    try:
        from torch.utils.data._utils import worker
    except ImportError:  # pragma: no cover - torch moved its worker loop: say so, do not fail
        logger.warning("torch.utils.data._utils.worker is gone; DataLoader workers keep the default "
                       "action of SIGTERM and may die on a preemption")
        return ()
    wanted = tuple(sorted(set(_signals) | {int(s) for s in signals}))
    if _original is None:
        atexit.register(_kill_protected_workers)  # after this, runs before multiprocessing's own
        _original = worker._worker_loop
        _parent_main_ident = threading.main_thread().ident or 0
    if wanted != _signals or not _is_ours(worker._worker_loop):
        _signals = wanted
        worker._worker_loop = functools.partial(worker_loop_ignoring, _signals)
        logger.debug("DataLoader workers will ignore %s",
                     ", ".join(signal.Signals(s).name for s in wanted))
    return _signals


def protected_signals() -> tuple[int, ...]:
    """The signals new DataLoader workers ignore (empty before any protection). Any rank."""
    return _signals


def _kill_protected_workers() -> None:
    """At exit, end daemonic children (DataLoader workers; which are workers cannot be told) before
    multiprocessing joins them with no timeout, which a worker ignoring its SIGTERM would hang:
    SIGTERM, one second, then SIGKILL."""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if not children:
        return
    # torch's SIGCHLD handler would report the killed workers as a failure of the loader.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + _EXIT_GRACE_S
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()


def _is_ours(loop: Any) -> bool:
    return isinstance(loop, functools.partial) and loop.func is worker_loop_ignoring


def stop_signals(signals: Iterable[Any], problems: list[str]) -> tuple[signal.Signals, ...]:
    """The signals of ``signals``, deduplicated; what is wrong is appended to ``problems``. Any rank."""
    if isinstance(signals, (int, str)) or not isinstance(signals, Iterable):
        problems.append(f"signals={signals!r}: expected a sequence of signals, for example "
                        "(signal.SIGTERM, signal.SIGUSR1)")
        return ()
    out: list[signal.Signals] = []
    for sig in signals:
        try:
            sig = signal.Signals(sig)
        except (ValueError, TypeError):
            problems.append(f"signals contains {sig!r}, which is not a signal of this platform; "
                            "use the signal module's constants, for example signal.SIGTERM")
            continue
        if sig in _UNCATCHABLE:
            problems.append(f"signals contains {sig.name}, which a process cannot catch; "
                            "watch SIGTERM or SIGUSR1 instead")
        elif sig not in out:
            out.append(sig)
    if not out and not problems:
        problems.append("signals=(): expected at least one signal to watch, for example (signal.SIGTERM,)")
    return tuple(out)
