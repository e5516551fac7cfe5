"""Which ninja and which directory a process's JIT op builds use (DeepSpeed's ops are JIT extensions).

Installed by :func:`toolkit.install_build_guards`: builds run this Python environment's ninja
whatever PATH says (two ninja versions relink each other's builds) and, with
``TORCH_EXTENSIONS_DIR`` unset, go to a directory of torch's default cache keyed by the environment.
Any rank; per process. Why, and the layout: docs/start.md (DeepSpeed's JIT-built ops)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from toolkit._files import atomic_write_json

__all__ = ["BUILD_TOOLS", "build_environment", "build_processes", "extensions_root", "install_build_env",
           "pinned_ninja", "torch_default_root"]

logger = logging.getLogger(__name__)

_ENV = "TORCH_EXTENSIONS_DIR"
_MARKER = ".toolkit-ninja"          # in an op's directory: "<version> <path>" of the ninja that built it last
_DESCRIPTION = "toolkit-environment.json"
#: Process names of a build: ninja, the compilers and linkers it runs.
BUILD_TOOLS = frozenset({"ninja", "cc1plus", "cc1", "c++", "g++", "gcc", "cc", "clang", "clang++", "ld",
                         "ld.gold", "ld.lld", "collect2", "as", "nvcc", "cicc", "ptxas", "fatbinary",
                         "nvlink", "hipcc", "clang-offload-bu"})

_path_lock = threading.Lock()
_path_users = 0
_path_set: tuple[str | None, str] | None = None   # (PATH before, PATH set) while a build runs
_acquired: dict[str, tuple[dict[str, int], float]] = {}   # lock path -> (.so mtimes, time) when taken
_warned_dirs: set[str] = set()


@functools.lru_cache(maxsize=1)
def pinned_ninja() -> str | None:
    """The ninja this Python environment builds with: the one in its scripts directory (where
    ``pip install ninja`` puts it) or beside ``sys.executable``, else PATH's. Any process."""
    for directory in dict.fromkeys((sysconfig.get_path("scripts"), os.path.dirname(sys.executable))):
        candidate = os.path.join(directory, "ninja")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("ninja")


@functools.lru_cache(maxsize=8)
def _ninja_version(path: str) -> str:
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


@functools.lru_cache(maxsize=1)
def build_environment() -> dict[str, str]:
    """What makes a build of one environment unusable by another: the ninja version (its command
    hash), torch and DeepSpeed (their paths are in the commands) and Python. Any process."""
    import torch

    ninja = pinned_ninja()
    deepspeed = importlib.util.find_spec("deepspeed")
    origin = deepspeed.origin if deepspeed is not None else None
    return {"ninja": _ninja_version(ninja) if ninja else "none", "ninja_path": ninja or "",
            "torch": f"{torch.__version__} {os.path.realpath(os.path.dirname(torch.__file__))}",
            "deepspeed": os.path.realpath(os.path.dirname(origin)) if origin else "none",
            "python": f"{sys.version.split()[0]} {sysconfig.get_paths()['include']}"}


def _key() -> str:
    keyed = {k: v for k, v in build_environment().items() if k != "ninja_path"}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]


def torch_default_root() -> Path:
    """torch's own extension directory when ``TORCH_EXTENSIONS_DIR`` is unset
    (``cpp_extension._get_build_directory``: ``~/.cache/torch_extensions/py311_cpu``). Any process."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        variant = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        variant = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        variant = "cpu"
    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{version}_{variant}"


def extensions_root() -> Path:
    """Where this process's guarded builds go: ``TORCH_EXTENSIONS_DIR`` when set, else
    ``<torch's default>/toolkit-<key of this environment>``. Any process."""
    explicit = os.environ.get(_ENV)
    return Path(explicit) if explicit is not None else torch_default_root() / f"toolkit-{_key()}"


def _describe(root: Path) -> None:
    """Say in the keyed directory which environment it serves (once per directory)."""
    if not (root / _DESCRIPTION).exists():
        root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            atomic_write_json(root / _DESCRIPTION, {**build_environment(), "sys.prefix": sys.prefix})


def _keyed_build_directory(original: Callable[..., str]) -> Callable[..., str]:
    def get_build_directory(name: str, *args: Any, **kwargs: Any) -> str:
        if os.environ.get(_ENV) is not None:
            return original(name, *args, **kwargs)
        root = extensions_root()
        _describe(root)
        (root / name).mkdir(parents=True, exist_ok=True)
        return str(root / name)

    get_build_directory.toolkit_guarded = True  # type: ignore[attr-defined]
    return get_build_directory


@contextlib.contextmanager
def ninja_first() -> Iterator[None]:
    """This environment's ninja first on PATH while torch builds (its env is copied from
    ``os.environ``); nothing changes when PATH's first ninja is already that one."""
    global _path_users, _path_set
    ninja = pinned_ninja()
    found = shutil.which("ninja")
    if ninja is None or (found is not None and os.path.realpath(found) == os.path.realpath(ninja)):
        yield
        return
    with _path_lock:
        _path_users += 1
        if _path_users == 1:
            before = os.environ.get("PATH")
            _path_set = (before, os.pathsep.join([os.path.dirname(ninja), before or os.defpath]))
            os.environ["PATH"] = _path_set[1]
    try:
        yield
    finally:
        with _path_lock:
            _path_users -= 1
            if _path_users == 0 and _path_set is not None:
                before, set_to = _path_set
                _path_set = None
                if os.environ.get("PATH") == set_to:   # unless someone changed it meanwhile
                    if before is None:
                        os.environ.pop("PATH", None)
                    else:
                        os.environ["PATH"] = before


def _ninja_scoped(original: Callable[..., Any]) -> Callable[..., Any]:
    def is_ninja_available(*args: Any, **kwargs: Any) -> Any:
        with ninja_first():
            return original(*args, **kwargs)

    is_ninja_available.toolkit_guarded = True  # type: ignore[attr-defined]
    return is_ninja_available


def _libraries(build_dir: str) -> dict[str, int]:
    state = {}
    for path in Path(build_dir).glob("*.so"):
        with contextlib.suppress(OSError):
            state[path.name] = path.stat().st_mtime_ns
    return state


def note_acquired(lock_path: str) -> None:
    """Called when this process takes an op's build lock: what was linked before its build."""
    _acquired[lock_path] = (_libraries(os.path.dirname(lock_path)), time.monotonic())


def _ours() -> str:
    ninja = pinned_ninja()
    return f"{_ninja_version(ninja)} {ninja}" if ninja else "none"


def other_ninja(build_dir: str) -> str | None:
    """The ninja ("<version> <path>") that built the op in ``build_dir`` last, if another version
    than this environment's; warned once per directory when ``TORCH_EXTENSIONS_DIR`` is the user's."""
    with contextlib.suppress(OSError):
        recorded = Path(build_dir, _MARKER).read_text(encoding="utf-8").strip()
        if recorded and recorded.split()[0] != _ours().split()[0]:
            root = os.path.dirname(os.path.abspath(build_dir))
            if os.environ.get(_ENV) is not None and root not in _warned_dirs:
                _warned_dirs.add(root)
                logger.warning("TORCH_EXTENSIONS_DIR=%s holds builds of another ninja (%s; this "
                               "environment's is %s): each rebuilds what the other built. Give each "
                               "environment its own TORCH_EXTENSIONS_DIR, or unset it (toolkit keeps "
                               "environments apart in torch's default cache)", os.environ[_ENV], recorded,
                               _ours())
            return recorded
    return None


def report_build(name: str, build_dir: str, other: str | None) -> None:
    """After a load: if this process linked the op, record its ninja in the op's directory and
    say which op was built and why."""
    taken = _acquired.pop(os.path.join(build_dir, "lock"), None)
    if taken is None:
        return
    before, since = taken
    if _libraries(build_dir) == before:
        return
    with contextlib.suppress(OSError):
        Path(build_dir, _MARKER).write_text(_ours() + "\n", encoding="utf-8")
    if not before:
        why = "it was not built yet"
    elif other:
        why = f"its build was made by ninja {other}, whose records this ninja reads as out of date"
    else:
        why = "ninja found its build out of date (its sources, flags or compiler changed)"
    logger.warning("built op %s in %.0f s with ninja %s in %s: %s", name, time.monotonic() - since, _ours(),
                   build_dir, why)


def install_build_env() -> None:
    """Pin this process's op builds to its environment's ninja and directory (see the module).
    Idempotent; any process; :func:`toolkit.install_build_guards` calls it."""
    from torch.utils import cpp_extension

    if not getattr(cpp_extension._get_build_directory, "toolkit_guarded", False):
        setattr(cpp_extension, "_get_build_directory",  # noqa: B010 (a module's global, replaced)
                _keyed_build_directory(cpp_extension._get_build_directory))
    if not getattr(cpp_extension.is_ninja_available, "toolkit_guarded", False):
        setattr(cpp_extension, "is_ninja_available", _ninja_scoped(cpp_extension.is_ninja_available))  # noqa: B010


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def build_processes(pids: set[int], parents: Mapping[int, int]) -> dict[int, str]:
    """Those of ``pids`` that build: ninja and what runs below it, each with the op's directory
    (ninja's working directory), and a compiler or linker run otherwise (a feature probe, with "").
    Reads /proc; any process. dsat's runner calls it so that no build counts as a trial's memory."""
    names = {pid: _command_name(pid) for pid in pids}
    found: dict[int, str] = {}
    for pid in pids:
        chain, current = [], pid
        while current in pids and current not in chain:
            chain.append(current)
            current = parents.get(current, 0)
        ninja = next((p for p in chain if names[p] == "ninja"), None)
        if ninja is not None:
            try:
                found[pid] = os.readlink(f"/proc/{ninja}/cwd")
            except OSError:
                found[pid] = "?"
        elif names[pid] in BUILD_TOOLS:
            found[pid] = ""
    return found
