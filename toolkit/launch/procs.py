"""Processes of trials and runs: find them by their marker and parentage in ``/proc``, kill them all,
run one job to its end. Launcher process only (dsat's autotuner, toolkit.run). Why a marker and not the
process group: docs/design-dsat-runner.md#processes-marked-found-and-killed.
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
    """Pids of the live processes of one trial: its mark ``variable=trial_file`` in their environment
    (``prefix``: any mark starting so, all trials under a directory), or below ``root``, the launcher's
    pid while not reaped. ``table``: a snapshot from :func:`scan_processes` (internal)."""
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
    """Whether a process (by its ``/proc/PID/environ``) is a rank or was started by one: it has
    ``LOCAL_RANK``, which the launcher and a child forked but not yet exec'd lack, so neither counts
    against the per-slot budget (docs/design-dsat-runner.md#processes-marked-found-and-killed)."""
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
    """Run one job that is not a trial (``--run-full-experiment``) to its end, marked with :data:`RUN_ENV`
    like a trial, logs in ``log_dir``, every process killed at ``timeout_s``, on an interrupt (re-raised
    after) or when its launcher leaves orphans. Autotuner process only. ``argv``: from
    :func:`toolkit.launch.argv.build_trial_argv`; ``env``: added to this process's. Returns the exit
    status (negative: a signal; 124: past ``timeout_s``)."""
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
