"""Wait for an earlier run's rank 0 that still serves this run's rendezvous port on this machine.

The same command run again (``deepspeed train.py`` uses port 29500 every time) while the first run's
ranks still save would fail (EADDRINUSE) or join the old store. A rank 0 whose rendezvous completed
leaves a marker (:func:`mark_rendezvous`); :func:`wait_for_rendezvous_port`, run first by
``init_distributed``, waits while the marked process listens, up to ``TOOLKIT_WAIT_FOR_OTHER_RUN_S``,
then raises RunConflictError (exit status 2). Any rank. docs/start.md (The same command again)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

from toolkit._files import atomic_write_json
from toolkit.errors import RunConflictError
from toolkit.runtime.launcher_watch import ProcessInfo, read_process
from toolkit.runtime.run_conflict import WAIT_ENV, install_conflict_exit_hook, wait_bound

__all__ = ["is_local_address", "listening_inodes", "mark_rendezvous", "marker_path", "port_holders",
           "wait_for_rendezvous_port"]

logger = logging.getLogger(__name__)

_LOOK_S = 1.0
_REPORT_EVERY_S = 30.0
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def is_local_address(addr: str) -> bool:
    """True when ``addr`` is an address of this machine (it can be bound). Any process."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.bind((address[0], 0))
            return True
    return False


def listening_inodes(port: int, *, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> set[int]:
    """The socket inodes listening on TCP ``port`` (any address), from /proc/net. Any process."""
    found: set[int] = set()
    for table in tables:
        try:
            with open(table, encoding="ascii", errors="replace") as file:
                lines = file.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and fields[1].rsplit(":", 1)[-1] == f"{port:04X}":
                with contextlib.suppress(ValueError):
                    found.add(int(fields[9]))
    return found


def port_holders(inodes: set[int]) -> list[int]:
    """The pids of this machine that hold one of the sockets ``inodes`` open (those it may look at)."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    holders = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/fd/{fd}") in wanted:
                    holders.append(int(entry))
                    break
    return holders


def marker_path(port: int) -> Path:
    """This user's marker of the toolkit rank 0 serving ``port`` here after its rendezvous. Pure."""
    return Path(tempfile.gettempdir()) / f"toolkit-{os.getuid()}" / f"rendezvous-{port}.json"


def mark_rendezvous(port: int | None) -> None:
    """Rank 0 only, once its rendezvous is complete: mark this process as serving ``port`` for a started
    run (no rank of this run waits for it: the rendezvous needed them all). Left at exit, since the
    port is served to the end; the markers of ended processes are removed."""
    me = read_process(os.getpid())
    if not port or me is None:
        return
    path = marker_path(port)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        atomic_write_json(path, {"pid": me.pid, "start": me.start})
    except OSError as err:  # only a later run's wait needs it
        logger.debug("cannot write %s: %s", path, err)
        return
    for old in path.parent.glob("rendezvous-*.json"):
        if old != path and _marked_process(old) is None:
            with contextlib.suppress(OSError):
                old.unlink()


def _marked_process(path: Path) -> ProcessInfo | None:
    """The live process a marker names (the same pid and start time), or None."""
    try:
        marked = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    holder = read_process(marked.get("pid", 0)) if isinstance(marked, dict) and isinstance(
        marked.get("pid"), int) else None
    if holder is None or holder.start != marked.get("start") or holder.state in ("Z", "X"):
        return None
    return holder


def _earlier_runs(port: int) -> list[int]:
    """The listeners on ``port`` that are the marked rank 0 of an earlier run, still alive."""
    inodes = listening_inodes(port)
    holder = _marked_process(marker_path(port)) if inodes else None
    return [] if holder is None else [pid for pid in port_holders(inodes) if pid == holder.pid]


def _describe(pids: list[int]) -> str:
    shown = []
    for pid in pids[:3]:
        info = read_process(pid)
        shown.append(info.describe() if info is not None else f"pid {pid}")
    return f"host {socket.gethostname()}, " + "; ".join(shown)


def wait_for_rendezvous_port(addr: str | None, port: int | None, *, bound_s: float | None = None) -> None:
    """Return once no earlier run's rank 0 listens on ``port`` here (nothing to do for another machine's
    ``addr`` or without /proc); RunConflictError after ``bound_s``. Any rank, before the rendezvous."""
    if not addr or not port or not os.path.isdir("/proc/self/fd") or not is_local_address(addr):
        return
    bound = wait_bound() if bound_s is None else bound_s
    start = next_report = time.monotonic()
    while True:
        holders = _earlier_runs(port)
        if not holders:
            return
        now = time.monotonic()
        who = _describe(holders)
        if now - start >= bound:
            install_conflict_exit_hook()
            raise RunConflictError(
                f"the rendezvous port {addr}:{port} (MASTER_PORT) is still served by another run's process "
                f"after {now - start:.0f} s ({WAIT_ENV}): {who}. Its ranks are probably still saving or "
                "running: wait for them to end (or stop them) and run this again, or give this run another "
                "port (--master_port)")
        if now >= next_report:
            next_report = now + _REPORT_EVERY_S
            logger.warning("the rendezvous port %s:%s is served by another run (%s): waiting up to %.0f s "
                           "more for it to end (%s)", addr, port, who, bound - (now - start), WAIT_ENV)
        time.sleep(_LOOK_S)
