"""One writer per checkpoint directory: the chief holds ``<dir>/.toolkit_lock/writer`` for its lifetime.

Taken by a process's first load or save on the directory, released at exit. A second run waits
while the holder lives (a warning names its host, pid and command), up to
``TOOLKIT_WAIT_FOR_OTHER_RUN_S``, then every rank raises CheckpointLockError (exit status 2 when
uncaught); a lock whose holder is proven dead (``op_builds.judge_lock``) is taken over. Call on all
ranks: the chief decides, a collective tells the others. docs/training.md (One writer per directory)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from toolkit.errors import CheckpointLockError
from toolkit.runtime.context import DistributedContext
from toolkit.runtime.op_builds import judge_lock, remove_dead_lock
from toolkit.runtime.run_conflict import WAIT_ENV, install_conflict_exit_hook, wait_bound

__all__ = ["LOCK_DIR", "LOCK_FILE", "held_directories", "hold_directory", "holder_text", "lock_path",
           "verify_held"]

logger = logging.getLogger(__name__)

LOCK_DIR = ".toolkit_lock"   # hidden: never a tag; judge_lock counts processes working in it, and none do
LOCK_FILE = "writer"
_LOOK_S = 1.0            # between two looks at the holder; a dead one is confirmed on the second
_REPORT_EVERY_S = 30.0


@dataclasses.dataclass(frozen=True)
class _Held:
    path: Path
    fd: int
    inode: int
    owner: int  # the pid that took it: a forked child inherits the table, not the lock


_held: dict[str, _Held] = {}     # the chief's locks, by the directory's real path
_agreed: set[str] = set()        # every rank: directories whose lock this run holds


def lock_path(root: str | os.PathLike[str]) -> Path:
    """The writer lock's file for checkpoint directory ``root``. Pure."""
    return Path(root) / LOCK_DIR / LOCK_FILE


def holder_text(path: Path) -> str:
    """Who wrote the lock file: ``host H, pid P (command), holding it since ...``; "" if unreadable."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace")[:4000].splitlines()
        info = json.loads(lines[1]) if len(lines) > 1 else {}
    except (OSError, ValueError):
        return ""
    if not isinstance(info, dict):
        return ""
    since = info.get("since")
    when = (time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since))
            if isinstance(since, (int, float)) else "")
    command = str(info.get("command", "?"))[:200]
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')} ({command}){when}"


def _command() -> str:
    return " ".join([os.path.basename(sys.executable), *sys.argv])[:300]


def _try_create(path: Path) -> _Held | None:
    """Create the lock file (None if it exists) and write its holder: this host, pid and command."""
    for _ in range(3):  # a releasing holder may remove the (empty) directory meanwhile
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent.is_symlink():  # never written through a link (the file itself: O_EXCL)
            raise OSError(f"{path.parent} is a symlink; remove it")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
            break
        except FileExistsError:
            return None
        except FileNotFoundError:
            continue
    else:
        raise FileNotFoundError(f"{path.parent} keeps disappearing")
    info = {"host": socket.gethostname(), "pid": os.getpid(), "command": _command(), "since": time.time()}
    # First word: the host, which judge_lock reads to tell a holder on another machine.
    os.write(fd, f"{info['host']} {info['pid']}\n{json.dumps(info)}\n".encode())
    return _Held(path=path, fd=fd, inode=os.fstat(fd).st_ino, owner=os.getpid())


def _acquire(root: str, bound_s: float) -> _Held:
    """Chief only: take the lock, waiting while its holder lives, at most ``bound_s``; raises
    CheckpointLockError after that."""
    path = lock_path(root)
    start = time.monotonic()
    next_report = start
    dead: tuple[int, int] | None = None
    while True:
        held = _try_create(path)
        if held is not None:
            return held
        state = judge_lock(path)
        if state.kind == "free":
            continue
        if state.kind == "dead" and dead is not None and state.ident == dead:
            left_by = holder_text(path) or "a process"
            if remove_dead_lock(path, state.ident):
                logger.warning("took over the writer lock %s, left by %s, which has ended", path, left_by)
            dead = None
            continue
        dead = state.ident if state.kind == "dead" else None
        now = time.monotonic()
        who = holder_text(path) or state.detail or "an unknown process"
        if now - start >= bound_s and state.kind != "dead":
            raise CheckpointLockError(_refusal(root, path, who, state.kind, state.detail, now - start))
        if now >= next_report and state.kind != "dead":
            next_report = now + _REPORT_EVERY_S
            logger.warning("checkpoint directory %s is held by another run (%s; %s); waiting up to %.0f s "
                           "more for it to finish (%s)", root, who, state.detail,
                           max(0.0, bound_s - (now - start)), WAIT_ENV)
        time.sleep(_LOOK_S)


def _refusal(root: str, path: Path, who: str, kind: str, detail: str, waited: float) -> str:
    if kind == "unseen":
        return (f"checkpoint directory {root} is held by another run ({who}), whose holder cannot be seen "
                f"from here ({detail}); waited {waited:.0f} s ({WAIT_ENV}). Two runs must not write one "
                f"directory: if no run writes there any more, remove {path} and start again")
    return (f"checkpoint directory {root} is still held by another run after {waited:.0f} s ({WAIT_ENV}): "
            f"{who}; {detail}. Two runs must not write one directory: wait for that run to end (or stop it), "
            "then run this again, or use another checkpoint directory")


def _release_all() -> None:
    """At exit: remove the locks this process took (if they are still ours) and close them."""
    for key, held in list(_held.items()):
        if held.owner != os.getpid():
            continue
        with contextlib.suppress(OSError):
            if os.stat(held.path).st_ino == held.inode:
                os.unlink(held.path)
        with contextlib.suppress(OSError):
            os.close(held.fd)
        with contextlib.suppress(OSError):
            held.path.parent.rmdir()  # only if empty: a waiter's clean-up guard may be there
        _held.pop(key, None)


def hold_directory(ctx: DistributedContext, root: str) -> bool:
    """Make sure this run holds ``root``'s writer lock; True when taken now. Call on all ranks.

    The first call per directory takes it (and removes the previous run's stop record). On every rank:
    CheckpointLockError when the holder outlived the wait, ConfigError for a bad wait variable."""
    key = os.path.realpath(root)
    if key in _agreed:
        return False
    bound = wait_bound()
    outcome: str | None = None
    with ctx.chief_first():  # the other ranks wait with the process group's long timeout
        if ctx.is_chief:
            outcome = _take(root, key, bound)
    outcome = ctx.broadcast_object(outcome)
    if outcome is not None:
        install_conflict_exit_hook()
        raise CheckpointLockError(outcome)
    _agreed.add(key)
    return True


def _take(root: str, key: str, bound: float) -> str | None:
    """Chief only: the lock taken (and the old stop record removed), or the refusal's message."""
    from toolkit.checkpoint.stop_record import clear_stop_record

    try:
        held = _acquire(root, bound)
    except CheckpointLockError as err:
        return str(err)
    except OSError as err:
        return f"cannot create the writer lock {lock_path(root)}: {err}"
    if not _held:
        atexit.register(_release_all)
    _held[key] = held
    clear_stop_record(root)
    logger.debug("holding the writer lock %s", held.path)
    return None


def held_directories() -> list[str]:
    """The directories (real paths) whose writer lock this process holds: the chief's. Any rank."""
    return [key for key, held in _held.items() if held.owner == os.getpid()]


def verify_held(root: str) -> None:
    """Chief only, before a save: the lock taken earlier is still this process's file (one removed by
    hand is taken again); CheckpointLockError when another run now holds it."""
    key = os.path.realpath(root)
    held = _held.get(key)
    if held is None or held.owner != os.getpid():
        return
    with contextlib.suppress(OSError):
        if os.stat(held.path).st_ino == held.inode:
            return
    again = _try_create(held.path)
    if again is None:
        with contextlib.suppress(OSError):
            os.close(held.fd)
        _held.pop(key, None)
        raise CheckpointLockError(f"the writer lock {held.path} of this run was replaced by another run's "
                                  f"({holder_text(held.path) or 'unknown'}); not writing beside it")
    with contextlib.suppress(OSError):
        os.close(held.fd)
    _held[key] = again
    logger.warning("the writer lock %s had been removed; taken again", held.path)
