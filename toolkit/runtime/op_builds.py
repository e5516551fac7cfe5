"""DeepSpeed's JIT-built ops, loaded without a silent wait on torch's build lock. Any rank; per process.

torch's extension loader waits on ``<extension dir>/<op>/lock`` with no message and no limit, so a
process stopped while holding it hung every later load. :func:`install_build_guards` installs the
lock guard (:func:`judge_lock`: a live holder is waited for with a warning, a dead one's lock is
removed, an unseen one ends in BuildLockError) and the guards of :mod:`toolkit.runtime.build_env`
and :mod:`toolkit.runtime.cuda_arch`; nothing on import. docs/start.md (DeepSpeed's JIT-built ops)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import inspect
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from torch.utils.file_baton import FileBaton

from toolkit.errors import BuildLockError
from toolkit.runtime import build_env
from toolkit.runtime.build_env import extensions_root, torch_default_root
from toolkit.runtime.cuda_arch import install_arch_list_guard

__all__ = ["GuardedBaton", "LockState", "UNSEEN_HOLDER_LIMIT_S", "builders_for", "clear_dead_locks",
           "extensions_root", "install_build_guards", "install_lock_guard", "judge_lock", "load_ops",
           "remove_dead_lock", "stop_leftover_build"]

logger = logging.getLogger(__name__)

#: How long a lock whose holder cannot be seen from here (another user's, another machine's) is
#: waited for before BuildLockError.
UNSEEN_HOLDER_LIMIT_S = 110.0
_POLL_S = 0.1             # how often the lock file's existence is checked (torch's own interval)
_JUDGE_EVERY_S = 1.0      # how often its holder is looked for; a dead one is confirmed on a second look
_FIRST_REPORT_S = 5.0     # a wait longer than this is reported, then every _REPORT_EVERY_S
_REPORT_EVERY_S = 30.0
_RETRIES = 3              # loads restarted after removing a dead holder's lock
_MAX_ROUNDS = 100         # loads restarted in all (each after another process released the lock)
_CLEANER = ".toolkit-lock-clear"   # serialises the removal of a dead lock among waiters
# Filesystems where the holder may be a process of another machine, invisible in /proc.
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
               "fuse", "9p", "afs", "panfs", "wekafs", "orangefs")


@dataclasses.dataclass(frozen=True)
class LockState:
    """What :func:`judge_lock` found. ``kind``: ``"free"``, ``"held"`` (a live process here holds it or
    builds in its directory), ``"dead"`` (nobody does) or ``"unseen"`` (the holder may be where this
    process cannot look); ``detail`` describes it; ``ident`` (inode, mtime) lets a second look tell
    that it sees the same file."""

    kind: str
    detail: str = ""
    ident: tuple[int, int] | None = None


def _command(pid: str) -> str:
    """The process's program and first argument, short (``python3 train.py``, ``ninja -v``)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in raw if w][:2]
    return " ".join([os.path.basename(words[0]), *(w[:60] for w in words[1:])]) if words else "?"


def _describe(holders: list[tuple[str, str, str]]) -> str:
    """One short line for the holders: who holds the file, and how many processes build."""
    parts = [f"pid {pid} holds it ({cmd})" for pid, how, cmd in holders if how == "holds"]
    builders = [(pid, cmd) for pid, how, cmd in holders if how == "builds"]
    if builders:
        pid, cmd = builders[0]
        more = f" and {len(builders) - 1} more" if len(builders) > 1 else ""
        parts.append(f"a build runs in its directory (pid {pid}: {cmd}{more})")
    return "; ".join(parts)


def _local_holders(lock: Path) -> tuple[list[tuple[str, str, str]], bool]:
    """Processes here that hold ``lock`` open or work in its directory (ninja and its compilers), as
    (pid, "holds" or "builds", command), and whether every process could be looked at."""
    lock_path, build_dir = os.path.realpath(lock), os.path.realpath(lock.parent)
    holders, complete = [], True
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if cwd == build_dir or cwd.startswith(build_dir + os.sep):
                holders.append((pid, "builds", _command(pid)))
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            complete = False
            continue
        except OSError:  # the process ended
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == lock_path:
                    holders.append((pid, "holds", _command(pid)))
                    break
    return holders, complete


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/self/mounts), or "" if unknown."""
    target, best, kind = os.path.realpath(path), "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text(errors="replace").splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


def _recorded_host(lock: Path) -> str:
    """The host a toolkit process wrote into the lock when it took it ("" if none)."""
    try:
        text = lock.read_text(encoding="utf-8", errors="replace")[:300]
    except OSError:
        return ""
    return text.split()[0] if text.split() else ""


def judge_lock(lock: Path) -> LockState:
    """Who holds ``lock``, as far as this machine can tell: a process with the file open, or a build
    working in the op's directory. Any process; reads /proc only."""
    try:
        stat = lock.stat()
    except FileNotFoundError:
        return LockState("free")
    ident = (stat.st_ino, stat.st_mtime_ns)
    if not os.path.isdir("/proc/self/fd"):
        return LockState("unseen", "this system has no /proc to find its holder in", ident)
    holders, complete = _local_holders(lock)
    if holders:
        return LockState("held", _describe(holders), ident)
    host = _recorded_host(lock)
    if host and host != socket.gethostname():
        return LockState("unseen", f"it was taken on host {host}", ident)
    fs = _filesystem_type(lock)
    if not host and (fs in _NETWORK_FS or fs.startswith("fuse.")):
        return LockState("unseen", f"it is on a {fs} filesystem, whose holder may be another machine", ident)
    if not complete and stat.st_uid != os.geteuid():
        return LockState("unseen", f"it belongs to user id {stat.st_uid}, whose processes are hidden", ident)
    return LockState("dead", "no process of this machine holds it", ident)


def remove_dead_lock(lock: Path, ident: tuple[int, int] | None) -> bool:
    """Remove ``lock`` if :func:`judge_lock` still finds the same dead holder, one waiter at a time (a
    second must not remove the lock the first has just taken). True if removed; any process."""
    with open(lock.parent / _CLEANER, "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        state = judge_lock(lock)
        if state.kind != "dead" or state.ident != ident:
            return False
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            return True
    return False


def clear_dead_locks(root: Path | None = None) -> list[Path]:
    """Remove the op locks under ``root`` that no process holds (two looks a second apart); returns them.
    Default: :func:`extensions_root`, and torch's own default directory when ``TORCH_EXTENSIONS_DIR`` is
    unset. Any process; dsat calls it after each trial."""
    bases = [Path(root)] if root is not None else [extensions_root()] + (
        [torch_default_root()] if os.environ.get("TORCH_EXTENSIONS_DIR") is None else [])
    candidates = {lock: judge_lock(lock) for base in dict.fromkeys(bases) for lock in base.glob("*/lock")}
    candidates = {lock: state for lock, state in candidates.items() if state.kind == "dead"}
    if not candidates:
        return []
    time.sleep(_JUDGE_EVERY_S)
    removed = [lock for lock, state in candidates.items() if remove_dead_lock(lock, state.ident)]
    for lock in removed:
        logger.warning("removed %s: a lock of DeepSpeed's op %s that a process left when it died",
                       lock, lock.parent.name)
    return removed


class _LockReleased(Exception):
    """The awaited lock is gone: the load starts again, so this process takes the lock and runs the
    (usually empty) build itself, since whoever removed the lock may have died before the op was built."""


class _LockCleared(_LockReleased):
    """A dead holder's lock was removed while waiting; the load starts again."""


class GuardedBaton(FileBaton):
    """torch's FileBaton with a wait that knows the holder and a release that tolerates a lock
    removed under it; the holder's host and pid go into the lock for waiters elsewhere."""

    def try_acquire(self) -> bool:
        acquired = bool(super().try_acquire())
        if acquired:
            build_env.note_acquired(self.lock_file_path)
            with contextlib.suppress(OSError), open(self.lock_file_path, "w", encoding="utf-8") as file:
                file.write(f"{socket.gethostname()} {os.getpid()}\n")
        return acquired

    def wait(self) -> None:
        _wait_for(Path(self.lock_file_path))
        raise _LockReleased(self.lock_file_path)

    def release(self) -> None:
        fd: int | None = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)
            self.fd = None
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.lock_file_path)


def _wait_for(lock: Path) -> None:
    """Wait until ``lock`` is gone; raise _LockCleared after removing a dead one, BuildLockError
    when its holder stays unseen for UNSEEN_HOLDER_LIMIT_S."""
    op, start = lock.parent.name, time.monotonic()
    next_judge, next_report = start + _JUDGE_EVERY_S, start + _FIRST_REPORT_S
    dead_ident: tuple[int, int] | None = None
    unseen_since: float | None = None
    state = LockState("held")
    while lock.exists():
        now = time.monotonic()
        if now >= next_judge:
            next_judge = now + _JUDGE_EVERY_S
            state = judge_lock(lock)
            if state.kind == "dead" and dead_ident is not None and state.ident == dead_ident:
                if remove_dead_lock(lock, state.ident):
                    logger.warning("removed %s, left by a process that died while loading DeepSpeed's op %s; "
                                   "loading it again", lock, op)
                    raise _LockCleared(str(lock))
            dead_ident = state.ident if state.kind == "dead" else None
            unseen_since = (unseen_since or now) if state.kind == "unseen" else None
            if unseen_since is not None and now - unseen_since >= UNSEEN_HOLDER_LIMIT_S:
                raise BuildLockError(
                    f"waited {now - start:.0f} s for the build lock {lock} of DeepSpeed's op {op}: "
                    f"its holder cannot be seen from here ({state.detail}). If no build of {op} is "
                    f"running anywhere, remove it (rm {lock}) and start again; to keep this job apart "
                    "from others, give it an extension directory of its own (TORCH_EXTENSIONS_DIR)")
        if now >= next_report:
            next_report = now + _REPORT_EVERY_S
            logger.warning("waiting %.0f s so far for DeepSpeed's op %s, locked by %s: %s", now - start, op,
                           lock, state.detail or "its holder is being looked for")
        time.sleep(_POLL_S)


def _guarded_jit_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def jit_compile(name: str, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER

        build_dir = str(signature.bind_partial(name, *args, **kwargs).arguments.get("build_directory") or "")
        other = build_env.other_ninja(build_dir) if build_dir else None
        cleared = 0
        with build_env.ninja_first():
            for _ in range(_MAX_ROUNDS):
                try:
                    loaded = original(name, *args, **kwargs)
                except _LockReleased as released:
                    cleared += isinstance(released, _LockCleared)
                    if cleared > _RETRIES:
                        break
                    # Forget this process's record of the op, so that the next try runs its build.
                    JIT_EXTENSION_VERSIONER.entries.pop(name, None)
                    continue
                if build_dir:
                    build_env.report_build(name, build_dir, other)
                return loaded
        raise BuildLockError(f"DeepSpeed's op {name}: its build lock at {Path(build_dir) / 'lock'} "
                             f"was left by a dead process {cleared} times, or taken by others "
                             f"{_MAX_ROUNDS} times in a row; if no build of {name} is running, remove it")

    jit_compile.toolkit_guarded = True  # type: ignore[attr-defined]
    return jit_compile


def _stopping_leftovers(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ninja run, under the op's build lock; when it is interrupted (Ctrl-C, or a signal
    turned into an exception), the compilers ninja started are stopped too: ``subprocess.run``
    SIGKILLs ninja a quarter second after the interrupt, often before ninja passed it on to its
    commands (each in a process group of its own), which then ran on for minutes, orphaned."""
    def run_ninja_build(build_directory: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(build_directory, *args, **kwargs)
        except BaseException as err:
            if not isinstance(err, Exception):
                stop_leftover_build(Path(build_directory))
            raise

    run_ninja_build.toolkit_guarded = True  # type: ignore[attr-defined]
    return run_ninja_build


def stop_leftover_build(build_dir: Path, *, within_s: float = 5.0) -> list[int]:
    """SIGKILL the processes (but this one) working in ``build_dir``, an op's directory whose lock this
    process holds, until none is left or ``within_s`` passed; returns the pids signalled. Any process."""
    signalled: list[int] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        holders, _ = _local_holders(build_dir / "lock")
        left = [int(pid) for pid, how, _ in holders if how == "builds" and int(pid) != os.getpid()]
        if not left:
            break
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        signalled.extend(pid for pid in left if pid not in signalled)
        time.sleep(0.05)
    if signalled:
        logger.warning("stopped %d process(es) the interrupted build of %s left running", len(signalled),
                       build_dir.name)
    return signalled


def install_lock_guard() -> None:
    """Make torch's extension loader in this process wait on a build lock only while a live
    process holds it, and stop an interrupted build's compilers. Idempotent; any process."""
    from torch.utils import cpp_extension

    if not getattr(cpp_extension._run_ninja_build, "toolkit_guarded", False):
        setattr(cpp_extension, "_run_ninja_build", _stopping_leftovers(cpp_extension._run_ninja_build))  # noqa: B010
    if getattr(cpp_extension._jit_compile, "toolkit_guarded", False):
        return
    setattr(cpp_extension, "FileBaton", GuardedBaton)  # noqa: B010 (a module's global, replaced)
    setattr(cpp_extension, "_jit_compile", _guarded_jit_compile(cpp_extension._jit_compile))  # noqa: B010


def install_build_guards() -> None:
    """Install toolkit's guards on torch's extension loader and DeepSpeed's op builder in this process
    (build lock, this environment's ninja and directory, ``TORCH_CUDA_ARCH_LIST``). Idempotent; any rank.

    ``init_distributed``, the reporting context, Determined's ``core.init`` and dsat's op builds call
    it; a script that uses DeepSpeed alone calls it before its first op loads::

        toolkit.install_build_guards()     # before deepspeed.init_distributed / initialize
    """
    install_lock_guard()
    build_env.install_build_env()
    install_arch_list_guard()


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = config.get(key)
    return value if isinstance(value, Mapping) else {}


def builders_for(ds_configs: Iterable[Mapping[str, Any]], *, on_cpu: bool) -> list[str]:
    """DeepSpeed's op builders that engines of ``ds_configs`` load, as DeepSpeed 0.19 picks them
    (``DeepSpeedEngine._configure_basic_optimizer``; the shared-memory all-reduce on CPU). Pure."""
    names = ["ShareMemCommBuilder"] if on_cpu else []
    for config in ds_configs:
        optimizer, zero = _section(config, "optimizer"), _section(config, "zero_optimization")
        kind = str(optimizer.get("type", "")).lower()
        devices = {str(_section(zero, key).get("device", "none")).lower()
                   for key in ("offload_optimizer", "offload_param")}
        offload = str(_section(zero, "offload_optimizer").get("device", "none")).lower()
        cpu_optimizer = offload in ("cpu", "nvme")
        if kind in ("adam", "adamw") and not _section(optimizer, "params").get("torch_adam"):
            names.append("CPUAdamBuilder" if cpu_optimizer else "FusedAdamBuilder")
        elif kind == "adagrad" and cpu_optimizer:
            names.append("CPUAdagradBuilder")
        elif kind == "lion":
            names.append("CPULionBuilder" if cpu_optimizer else "FusedLionBuilder")
        elif kind == "lamb" and not on_cpu:
            names.append("FusedLambBuilder")
        if "nvme" in devices:
            names.append("AsyncIOBuilder")
    return list(dict.fromkeys(names))


def load_ops(builder_names: Iterable[str]) -> list[str]:
    """Build (or load) DeepSpeed's ops in this process, so that the processes started after it only load
    them (dsat, before its trials); returns those loaded. One that cannot be built here is logged and
    skipped: the process that needs it meets the error in its own log. Any process."""
    install_build_guards()
    from deepspeed.accelerator import get_accelerator

    loaded = []
    for class_name in builder_names:
        builder = get_accelerator().create_op_builder(class_name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue
        start = time.monotonic()
        try:
            builder.load(verbose=False)
        except BuildLockError:
            raise
        except Exception as err:  # noqa: BLE001 (DeepSpeed raises RuntimeError, OSError, ImportError...)
            logger.warning("could not build DeepSpeed's op %s here (%s: %s); the processes that load it will "
                           "build it themselves", builder.name, type(err).__name__, str(err)[:500])
            continue
        logger.info("DeepSpeed op %s ready (%.1f s)", builder.name, time.monotonic() - start)
        loaded.append(builder.name)
    return loaded
