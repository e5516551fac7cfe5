"""Notice that a rank's launcher is gone, so that the rank stops as if it had been signalled.

``kill <pid of deepspeed>`` (what ``docker stop`` sends) ends DeepSpeed's runner alone, and its
ranks would train on. :func:`remember_launchers` (at ``init_distributed``) records the rank's
ancestors that are launchers by their command line; :class:`LauncherMonitor` (started by
``watch_preemption``) looks at them twice a second. Any rank; the rule and its limits:
docs/start.md (A launcher that exits is a stop)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Callable, Sequence

__all__ = ["WATCH_ENV", "ProcessInfo", "LauncherMonitor", "ancestors", "exited", "launcher_chain",
           "launcher_name", "read_process", "remember_launchers", "remembered_launchers"]

logger = logging.getLogger(__name__)

#: ``TOOLKIT_WATCH_LAUNCHER=0`` turns the watch off (nothing is remembered or polled).
WATCH_ENV = "TOOLKIT_WATCH_LAUNCHER"
POLL_S = 0.5
_MAX_DEPTH = 64

# Python modules and programs that start ranks and wait for them until they end.
_MODULES = {
    "torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
    "deepspeed.launcher.runner": "deepspeed", "deepspeed.launcher.launch": "deepspeed.launcher.launch",
    "deepspeed.launcher.launcher_helper": "deepspeed.launcher.launcher_helper",
    "determined.launch.torch_distributed": "determined.launch",
    "determined.launch.deepspeed": "determined.launch",
    "determined.launch.wrap_rank": "determined.launch.wrap_rank",
    "toolkit.run": "toolkit.run", "toolkit.dsat": "dsat",
}
_PROGRAMS = {
    "torchrun": "torchrun", "deepspeed": "deepspeed", "ds": "deepspeed", "dsat": "dsat",
    "mpirun": "mpirun", "mpiexec": "mpirun", "orterun": "mpirun", "prterun": "mpirun", "orted": "orted",
    "prted": "prted", "prte": "prte", "hydra_pmi_proxy": "hydra_pmi_proxy", "mpiexec.hydra": "mpirun",
    "srun": "srun", "slurmstepd": "slurmstepd",
}
_PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X", "-Q")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """One process as /proc shows it; ``start`` (stat field 22, clock ticks since boot) tells a
    reused pid apart, ``state`` is stat's letter (``Z``: exited, not yet reaped)."""

    pid: int
    ppid: int
    start: int
    state: str
    argv: tuple[str, ...] = ()

    def describe(self) -> str:
        """``pid 123 (python -m deepspeed.launcher.runner)``, for messages."""
        return f"pid {self.pid} ({' '.join(w[:80] for w in self.argv[:3]) or '?'})"


def launcher_name(argv: Sequence[str]) -> str | None:
    """The launcher a command line runs (``"torchrun"``, ``"deepspeed"``, ``"mpirun"``...), or None. Pure."""
    if not argv:
        return None
    # slurmstepd retitles itself "slurmstepd: [12.0]"; a shell or "python -c" is no launcher.
    program = os.path.basename(argv[0].split(":")[0].split()[0]) if argv[0].strip() else ""
    if not program.startswith("python"):
        return _PROGRAMS.get(program)
    words = list(argv[1:])
    while words:
        word = words.pop(0)
        if word == "-m":
            return _MODULES.get(words[0]) if words else None
        if word == "-c" or word == "-":
            return None
        if word in _PYTHON_OPTIONS_WITH_VALUE:
            words = words[1:]
        elif not word.startswith("-"):  # the script: a console script such as bin/deepspeed
            return _PROGRAMS.get(os.path.basename(word))
    return None


def read_process(pid: int) -> ProcessInfo | None:
    """The process ``pid`` from /proc, or None when it does not exist or cannot be read. Any process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": the comm may hold spaces
    try:
        state, ppid, start = fields[0], int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = tuple(w.decode(errors="replace") for w in file.read().split(b"\0") if w)
    except OSError:
        argv = ()
    return ProcessInfo(pid=pid, ppid=ppid, start=start, state=state, argv=argv)


def ancestors(pid: int | None = None) -> list[ProcessInfo]:
    """The ancestors of ``pid`` (default: this process), parent first, up to init (excluded). Any process."""
    found: list[ProcessInfo] = []
    parent = os.getppid() if pid is None else getattr(read_process(pid), "ppid", 0)
    while parent > 1 and len(found) < _MAX_DEPTH:
        info = read_process(parent)
        if info is None:
            break
        found.append(info)
        parent = info.ppid
    return found


def launcher_chain(processes: Sequence[ProcessInfo]) -> tuple[ProcessInfo, ...]:
    """The launchers among ``processes`` (a rank's ancestors), by :func:`launcher_name`. Pure.
    Shells, ``setsid`` and other wrappers are never watched: their exit is not a stop."""
    return tuple(p for p in processes if launcher_name(p.argv) is not None)


def exited(process: ProcessInfo) -> bool:
    """True when ``process`` has ended: its pid gone, reused or a zombie. One this process cannot read
    counts as alive: never a false stop. Any process."""
    try:
        with open(f"/proc/{process.pid}/stat", "rb") as file:
            stat = file.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return fields[0] in ("Z", "X", "x") or int(fields[19]) != process.start
    except (IndexError, ValueError):
        return False


_remembered: tuple[ProcessInfo, ...] | None = None
_remember_lock = threading.Lock()


def remember_launchers() -> tuple[ProcessInfo, ...]:
    """Record this process's launcher ancestors, once (``init_distributed``, while they surely live);
    nothing without /proc or with ``TOOLKIT_WATCH_LAUNCHER=0``. Any rank."""
    global _remembered
    with _remember_lock:
        if _remembered is None:
            off = os.environ.get(WATCH_ENV, "1").strip().lower() in ("0", "false", "no", "off")
            _remembered = () if off or not os.path.isdir("/proc/self") else launcher_chain(ancestors())
            if _remembered:
                logger.debug("watching this rank's launcher(s): %s",
                             ", ".join(p.describe() for p in _remembered))
        return _remembered


def remembered_launchers() -> tuple[ProcessInfo, ...] | None:
    """What :func:`remember_launchers` recorded, or None before it ran. Any rank."""
    return _remembered


class LauncherMonitor:
    """A daemon thread that calls ``on_exit(process)`` once when one of ``watched`` has exited.
    Started by ``watch_preemption`` (any rank), stopped by its ``close()``: nothing per step."""

    def __init__(self, watched: Sequence[ProcessInfo], on_exit: Callable[[ProcessInfo], None], *,
                 interval_s: float = POLL_S) -> None:
        self.watched = tuple(watched)
        self._on_exit = on_exit
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="toolkit-launcher-watch", daemon=True)

    def start(self) -> "LauncherMonitor":
        if self.watched:
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            for process in self.watched:
                if exited(process):
                    self._on_exit(process)
                    return
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        """End the thread (waits for it at most one poll). Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
