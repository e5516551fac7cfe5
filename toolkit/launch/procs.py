"""Processes of trials and runs: find them by their marker, kill them all, run one job to its end.

torchrun starts each worker in a session of its own (``start_new_session=True`` in torch's
subprocess handler), so killing a launcher's process group does not reach its workers, and a
SIGKILLed launcher leaves them orphaned. Every process dsat and ``python -m toolkit.run`` start
therefore carries a marker in its environment (``TOOLKIT_DSAT_TRIAL`` for trials,
``TOOLKIT_DSAT_RUN`` or toolkit.run's own mark for other runs); this module finds processes by
that marker and by parentage in ``/proc``.

Launcher process only (dsat's autotuner, toolkit.run: not part of any training job).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping

from toolkit.runtime.trial_env import OUTPUT_DIR_ENV, RUN_ENV, TRIAL_ENV

__all__ = ["block_interrupts", "cpu_slots", "find_trial_processes", "free_port", "is_rank_process",
           "kill_until_gone", "rss_bytes", "run_to_completion", "scan_processes", "unblock_interrupts"]

logger = logging.getLogger(__name__)

_GIVE_UP_S = 15.0   # after SIGKILL: a process in uninterruptible sleep may take a while


def cpu_slots() -> int:
    """The CPU slots of this machine: its CPU cores (``os.cpu_count()``, dsat's default
    ``--max-slots`` on CPU). A job on CPU runs at most this many processes here. Any process."""
    return os.cpu_count() or 1


def scan_processes() -> dict[int, tuple[int, bytes]]:
    """Live (non-zombie) processes we may read: pid -> (ppid, environ bytes)."""
    table: dict[int, tuple[int, bytes]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X"):
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                environ = fh.read()
        except (OSError, IndexError):  # gone, or another user's process
            continue
        table[int(entry.name)] = (int(fields[1]), environ)
    return table


def find_trial_processes(trial_file: str | os.PathLike[str], *, root: int | None = None, prefix: bool = False,
                         variable: str = TRIAL_ENV, table: Mapping[int, tuple[int, bytes]] | None = None
                         ) -> set[int]:
    """Pids of the live processes of one trial: its mark in their environment, or below ``root``.

    Args:
        trial_file: the trial's ``trial.json`` (the value of ``TOOLKIT_DSAT_TRIAL``).
        root: the launcher's pid (not yet reaped); its descendants count even without the mark.
        prefix: match every mark that starts with ``trial_file`` (all trials under a directory).
        variable: the marking variable (:data:`RUN_ENV` for :func:`run_to_completion`).
        table: a process snapshot from a previous scan (internal).
    """
    mark = b"\0" + f"{variable}={os.fspath(trial_file)}".encode() + (b"" if prefix else b"\0")
    table = scan_processes() if table is None else table
    found = {pid for pid, (_, env) in table.items() if mark in b"\0" + env + b"\0"}
    if root is not None and root in table:
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        stack, seen = [root], set()
        while stack:
            pid = stack.pop()
            if pid not in seen:
                seen.add(pid)
                stack.extend(children.get(pid, ()))
        found |= seen
    found.discard(os.getpid())
    return found


def is_rank_process(environ: bytes) -> bool:
    """Whether a process (by its ``/proc/PID/environ``) is a rank or was started by one.

    Every launcher we start trials with (torchrun, ``deepspeed.launcher.launch``) sets
    ``LOCAL_RANK`` for its workers, and their children inherit it. The launcher itself has none,
    and neither has a child it has forked but not yet exec'd: until ``execve`` such a child still
    shows the launcher's environment, and its VmRSS is the launcher's (shared pages after
    ``fork``, the very same memory after ``vfork``). Counting that instant against the per-slot
    budget once failed a trial whose workers were tiny (the RSS was that of torchrun's own imports).
    """
    return b"\0LOCAL_RANK=" in b"\0" + environ


def rss_bytes(pid: int, *, field: str = "VmRSS") -> int:
    """A process's resident size (``VmRSS``) or its peak so far (``VmHWM``) in bytes; 0 when
    unreadable (the process ended, or it is not ours)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0




def kill_until_gone(find: Callable[[Mapping[int, tuple[int, bytes]]], set[int]], *, grace_s: float,
                     reap: Iterable[subprocess.Popen] = (), what: str = "job") -> bool:
    """SIGTERM, then SIGKILL after ``grace_s``, until ``find`` sees no live process. False: gave up."""
    reap = list(reap)
    start = time.monotonic()
    termed: set[int] = set()
    while True:
        for process in reap:
            process.poll()  # reap our own child so that it does not linger as a zombie
        alive = find(scan_processes())
        if not alive:
            return True
        elapsed = time.monotonic() - start
        if elapsed > grace_s + _GIVE_UP_S:
            logger.error("processes %s of %s survived SIGKILL for %.0f s", sorted(alive), what, _GIVE_UP_S)
            return False
        kill = elapsed >= grace_s
        for pid in alive:
            if kill or pid not in termed:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
                termed.add(pid)
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a launcher's ``--master_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_to_completion(argv: list[str], *, cwd: Path, env: Mapping[str, str] | None = None, log_dir: Path,
                      timeout_s: float, nproc: int = 1, grace_s: float = 10.0) -> int:
    """Run one job that is not a trial (``--run-full-experiment``) to its end. Autotuner process only.

    Like a trial it runs in a session of its own with ``stdout.log``/``stderr.log`` in
    ``log_dir``, marked (:data:`RUN_ENV`) so that every process it starts is found and killed
    when it times out, when the autotuner is interrupted (Ctrl-C: killed, then the interrupt is
    re-raised), and when its launcher exits leaving orphans.

    Args:
        argv: from :func:`toolkit.launch.argv.build_trial_argv`; never run through a shell.
        cwd: working directory (the model directory).
        env: variables added to this process's environment; ``TOOLKIT_OUTPUT_DIR`` defaults to
            ``log_dir/output`` so that the job never touches the user's own runs.
        log_dir: created if missing.
        timeout_s: wall-clock limit.
        nproc: processes the launcher starts (sets the default ``OMP_NUM_THREADS``).

    Returns:
        The launcher's exit status: negative for a signal; 124 when it ran past ``timeout_s``.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    mark = str(log_dir.resolve())
    full_env = {k: v for k, v in os.environ.items() if k != TRIAL_ENV}
    full_env.update(env or {})
    full_env.update({RUN_ENV: mark, "PYTHONUNBUFFERED": "1"})
    full_env.setdefault(OUTPUT_DIR_ENV, str(log_dir.resolve() / "output"))
    full_env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // max(nproc, 1))))
    with open(log_dir / "stdout.log", "wb") as out, open(log_dir / "stderr.log", "wb") as err:
        process = subprocess.Popen(argv, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=err, start_new_session=True)

    def find(table: Mapping[int, tuple[int, bytes]]) -> set[int]:
        root = process.pid if process.returncode is None else None
        return find_trial_processes(mark, root=root, variable=RUN_ENV, table=table)

    deadline = time.monotonic() + timeout_s
    code: int | None = None
    try:
        while code is None and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
    finally:
        masked = block_interrupts()
        try:
            if code is None:
                logger.error("%s: stopping it (%s)", " ".join(argv),
                             "timeout" if time.monotonic() >= deadline else "interrupted")
            kill_until_gone(find, grace_s=grace_s, reap=[process], what=" ".join(argv))
        finally:
            unblock_interrupts(masked)
    return 124 if code is None else code


def block_interrupts() -> set[int | signal.Signals] | None:
    """Hold SIGINT/SIGTERM while killing trials, so a second Ctrl-C cannot leave orphans."""
    try:
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, OSError, ValueError):
        return None


def unblock_interrupts(previous: set[int | signal.Signals] | None) -> None:
    if previous is not None:  # pending signals are delivered now, after the clean-up
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
