"""Determined's launcher wrappers (``python3 -m determined.launch.torch_distributed ...``) in an
``entrypoint``, mapped onto torchrun or DeepSpeed's launcher for ``python -m toolkit.run`` and dsat.
Pure: no process, no file; any process. The rules, as Determined's wrappers parse their argv:
docs/design-dsat-runner.md#determineds-launcher-wrappers.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path
from typing import Mapping, Sequence

from toolkit.errors import ConfigError

__all__ = ["CONTAINER_PER_RANK_ENV", "SHIM_DIR", "WRAPPED_ENV", "WRAPPERS", "entrypoint_launcher",
           "python_module", "shim_pythonpath", "torchrun_nproc_override", "unwrap_launcher"]

#: Set by ``python -m toolkit.run`` for the command ``determined.launch.wrap_rank`` starts: its rank.
#: Marks wrapped workers for toolkit.run's signal forwarding.
WRAPPED_ENV = "TOOLKIT_DET_WRAPPED_RANK"
#: Set by ``python -m toolkit.run`` for an entrypoint without a launcher wrapper: each rank process
#: is one Determined container of one slot (Determined runs such an entrypoint once per container).
CONTAINER_PER_RANK_ENV = "TOOLKIT_DET_CONTAINER_PER_RANK"
#: The ``determined`` shim package's directory (``determined.launch.wrap_rank`` and the wrappers),
#: in the Determined layer; toolkit.run puts it on an entrypoint's ``PYTHONPATH``.
SHIM_DIR = Path(__file__).resolve().parent.parent / "compat" / "determined" / "shim"
#: Determined wrapper module -> the launcher that runs its command here (None: no launcher).
WRAPPERS = {
    "determined.launch.torch_distributed": "torchrun",
    "determined.launch.deepspeed": "deepspeed",
    "determined.launch.wrap_rank": None,
}
_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")


def python_module(argv: Sequence[str]) -> str | None:
    """The module a ``python[3[.X]] -m MODULE ...`` command runs, else None. Pure; any process."""
    if len(argv) >= 3 and _PYTHON.match(os.path.basename(argv[0])) and argv[1] == "-m":
        return argv[2]
    return None


def _wrapper_module(argv: Sequence[str]) -> str | None:
    module = python_module(argv)
    return module if module in WRAPPERS else None


def _check_command(entry: Sequence[str], module: str, command: list[str]) -> list[str]:
    if not command:
        raise ConfigError(
            f"entrypoint={list(entry)!r}: {module} is given no command to run; expected "
            f"e.g. 'python3 -m {module} python3 train.py'"
        )
    if command[0] == "--trial":
        raise ConfigError(
            f"entrypoint={list(entry)!r}: --trial runs Determined's Trial API "
            "(PyTorchTrial, DeepSpeedTrial), which toolkit does not provide; port the "
            "trial to a Core API script and name that script instead "
            "(docs/determined.md#trial-api-and-horovod-experiments)"
        )
    return command


def unwrap_launcher(argv: Sequence[str]) -> tuple[str | None, list[str], list[str]]:
    """``(launcher, its own args, the user's command)`` of an entrypoint argv: ``"torchrun"`` for
    ``determined.launch.torch_distributed``, ``"deepspeed"`` for ``determined.launch.deepspeed``, None for
    ``wrap_rank`` or no wrapper (the argv returned unchanged). ConfigError: a wrapper with no command,
    or ``--trial``; TypeError: a string (``shlex.split`` it first). Pure; any process.

    >>> unwrap_launcher(["python3", "-m", "determined.launch.torch_distributed",
    ...                  "--nproc_per_node", "1", "--", "python3", "train.py"])
    ('torchrun', ['--nproc_per_node', '1'], ['python3', 'train.py'])
    """
    if isinstance(argv, str):
        raise TypeError(f"argv={argv!r}: expected a list of arguments; shlex.split() a string entrypoint")
    argv = list(argv)
    module = _wrapper_module(argv)
    if module is None:
        return None, [], argv
    rest = argv[3:]
    if module == "determined.launch.torch_distributed":
        if "--" in rest:
            cut = rest.index("--")
            return "torchrun", rest[:cut], _check_command(argv, module, rest[cut + 1 :])
        return "torchrun", [], _check_command(argv, module, rest)
    if module == "determined.launch.deepspeed":
        if rest[:1] == ["--"]:
            rest = rest[1:]
        return "deepspeed", [], _check_command(argv, module, rest)
    # wrap_rank [--no-redirect-stdio] RANK [--] CMD...
    if rest[:1] == ["--no-redirect-stdio"]:
        rest = rest[1:]
    if not rest:
        raise ConfigError(
            f"entrypoint={argv!r}: {module} expects RANK and a command, e.g. "
            f"'python3 -m {module} RANK -- python3 train.py'"
        )
    rest = rest[1:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return None, [], _check_command(argv, module, rest)


def entrypoint_launcher(entrypoint: str | Sequence[str]) -> tuple[str | None, str]:
    """The launcher an entrypoint's (a string or a list) Determined wrapper stands for, or None (no wrapper
    in its first command, or ``wrap_rank``), and why, as a phrase for a log line. Pure; any process.

    >>> entrypoint_launcher("python3 -m determined.launch.deepspeed python3 script.py")[0]
    'deepspeed'
    """
    argv = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    module = _wrapper_module(argv)
    launcher = WRAPPERS.get(module) if module is not None else None
    if module is None:
        return None, "the entrypoint runs no determined.launch wrapper itself"
    if launcher is None:
        return None, f"the entrypoint's {module} stands for no launcher"
    return launcher, f"the entrypoint runs {module}"


def torchrun_nproc_override(overrides: Sequence[str]) -> tuple[int | None, list[str]]:
    """The ``--nproc_per_node`` among torch_distributed's override args (ConfigError: not an integer
    >= 1), and the args left, which the caller names as ignored. Pure.

    >>> torchrun_nproc_override(["--nproc_per_node", "1", "--max_restarts", "0"])
    (1, ['--max_restarts', '0'])
    """
    nproc: int | None = None
    left: list[str] = []
    items = list(overrides)
    i = 0
    while i < len(items):
        arg = items[i]
        name, eq, value = arg.partition("=")
        if name in ("--nproc_per_node", "--nproc-per-node"):
            if not eq:
                value = items[i + 1] if i + 1 < len(items) else ""
                i += 1
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"entrypoint: determined.launch.torch_distributed {name}={value!r}: "
                    "expected an integer >= 1"
                )
            nproc = int(value)
        else:
            left.append(arg)
        i += 1
    return nproc, left


def shim_pythonpath(environ: Mapping[str, str]) -> str | None:
    """``PYTHONPATH`` with the shim directory in front (it provides ``determined.launch.wrap_rank`` alone),
    or None when a real ``determined`` is importable. The runner's process (the entrypoint's environment)."""
    if importlib.util.find_spec("determined") is not None and not _is_shim(environ):
        return None
    rest = environ.get("PYTHONPATH", "")
    parts = [p for p in rest.split(os.pathsep) if p and p != str(SHIM_DIR)]
    return os.pathsep.join([str(SHIM_DIR), *parts])


def _is_shim(environ: Mapping[str, str]) -> bool:
    spec = importlib.util.find_spec("determined")
    return spec is not None and spec.origin is not None and Path(spec.origin).is_relative_to(SHIM_DIR)
