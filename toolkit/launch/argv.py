"""The argv that starts a job (a dsat trial, a run of ``python -m toolkit.run``) on this machine with
torchrun or DeepSpeed's launcher: pure, no processes. Called by both runners; across hosts dsat builds
its own (:mod:`toolkit.dsat.execution.multihost_argv`). Tests compare the lists exactly; the rules:
docs/design-dsat-runner.md#the-argv. Example::

    >>> build_trial_argv(["python3", "train.py", "--flag"], launcher="torchrun", nproc=2,
    ...                  master_port=29511)[3:]
    ['--nproc_per_node', '2', '--master_addr', '127.0.0.1', '--master_port', '29511', 'train.py', '--flag']
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from pathlib import Path
from typing import Mapping, Sequence

from toolkit._checks import is_int
from toolkit.errors import ConfigError
from toolkit.launch.output import rank_log_options
from toolkit.launch.wrappers import unwrap_launcher

__all__ = ["DEEPSPEED_MODE_FLAGS", "LAUNCHERS", "LOOPBACK", "build_trial_argv", "parse_entrypoint",
           "world_info"]

#: Launchers a job can be started with on this machine.
LAUNCHERS = ("torchrun", "deepspeed")
#: The rendezvous address of a job on this machine.
LOOPBACK = "127.0.0.1"
#: The options of DeepSpeed's launchers (per-node and multinode) for each mode of
#: :func:`parse_entrypoint`: a module, a program that is not Python, or a script.
DEEPSPEED_MODE_FLAGS: Mapping[str, tuple[str, ...]] = {"module": ("--module",), "exec": ("--no_python",),
                                                       "script": ()}

_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_DEEPSPEED_MODULES = ("deepspeed.launcher.runner",)


def world_info(include: str | None, nproc: int) -> str:
    """DeepSpeed's ``--world_info``: base64 of ``{"localhost": [slot ids]}``, the ids of ``include``
    (``"localhost:2,3"``, one host, one id per process) or ``0..nproc-1`` when None. Any process."""
    if include is None:
        slots = list(range(nproc))
    else:
        host, _, ids = include.partition(":")
        if host != "localhost" or not ids or "@" in include:
            raise ValueError(f"include={include!r}: expected 'localhost:ID[,ID...]' (one machine), "
                             "e.g. 'localhost:0,1'")
        try:
            slots = [int(part) for part in ids.split(",")]
        except ValueError:
            raise ValueError(f"include={include!r}: slot ids must be integers, e.g. "
                             "'localhost:0,1'") from None
        if len(slots) != nproc or len(set(slots)) != nproc or min(slots) < 0:
            raise ValueError(f"include={include!r} names {len(set(slots))} distinct slot(s) >= 0, "
                             f"but nproc={nproc}: give exactly one id per process")
    payload = json.dumps({"localhost": slots}).encode("utf-8")
    return base64.urlsafe_b64encode(payload).decode("utf-8")


def _split_entrypoint(entrypoint: Sequence[str]) -> tuple[str, str, list[str]]:
    """(mode, target, args) with mode "script", "module" or "exec" (not Python)."""
    argv = list(entrypoint)
    if _PYTHON.fullmatch(os.path.basename(argv[0])) or argv[0] == sys.executable:
        rest = argv[1:]
        while rest and rest[0] == "-u":
            rest = rest[1:]
        if not rest:
            raise ConfigError(f"entrypoint={list(entrypoint)!r}: the interpreter has no script; "
                              "expected e.g. 'python3 train.py'")
        if rest[0] == "-m":
            if len(rest) < 2:
                raise ConfigError(f"entrypoint={list(entrypoint)!r}: '-m' needs a module name")
            return "module", rest[1], rest[2:]
        if rest[0].startswith("-"):
            raise ConfigError(f"entrypoint={list(entrypoint)!r}: interpreter option {rest[0]!r} cannot be "
                              "passed through the trial launcher; remove it (only -u and -m are understood)")
        return "script", rest[0], rest[1:]
    if argv[0].endswith(".py"):
        return "script", argv[0], argv[1:]
    return "exec", argv[0], argv[1:]


def _unwrap_launcher(mode: str, target: str, args: list[str], entrypoint: Sequence[str]
                     ) -> tuple[str, str, list[str]]:
    """Strip a launcher named in the entrypoint, keeping its script, args and mode."""
    name = os.path.basename(target)
    if (mode == "exec" and name == "torchrun") or (mode == "module" and target in _TORCHRUN_MODULES):
        from torch.distributed.run import get_args_parser  # heavy import, only for this case

        parsed = get_args_parser().parse_args(args)
        inner = "module" if parsed.module else "exec" if parsed.no_python else "script"
        return inner, parsed.training_script, list(parsed.training_script_args)
    if (mode == "exec" and name == "deepspeed") or (mode == "module" and target in _DEEPSPEED_MODULES):
        from deepspeed.launcher.runner import parse_args  # heavy import, only for this case

        parsed = parse_args(args)
        inner = "module" if parsed.module else "exec" if parsed.no_python else "script"
        return inner, parsed.user_script, list(parsed.user_args)
    if mode == "module" and target.startswith("determined.launch"):
        # Determined's wrappers (deepspeed, torch_distributed, wrap_rank): the command they wrap is
        # what the job runs; the launcher chosen by the caller starts it.
        _launcher, _overrides, command = unwrap_launcher(list(entrypoint))
        return _split_entrypoint(command)
    return mode, target, args


def _check_entrypoint(entrypoint: Sequence[str]) -> None:
    if isinstance(entrypoint, str) or not entrypoint or not all(isinstance(p, str) and p for p in entrypoint):
        raise ConfigError(f"entrypoint={entrypoint!r}: expected a non-empty list of non-empty strings, "
                          "e.g. ['python3', 'train.py']")


def parse_entrypoint(entrypoint: Sequence[str]) -> tuple[str, str, list[str]]:
    """``(mode, target, args)`` of an entrypoint, a launcher it names stripped: ``mode`` is ``"script"``,
    ``"module"`` (``python -m target``) or ``"exec"`` (not Python). ConfigError: it cannot be launched
    (interpreter options, Determined's Trial API, ...). Pure; any process.

    >>> parse_entrypoint(["python3", "-u", "train.py", "--lr", "0.1"])
    ('script', 'train.py', ['--lr', '0.1'])
    """
    _check_entrypoint(entrypoint)
    return _unwrap_launcher(*_split_entrypoint(entrypoint), entrypoint)


def build_trial_argv(entrypoint: Sequence[str], *, launcher: str, nproc: int, master_port: int,
                     include: str | None = None, rank_logs: os.PathLike[str] | None = None) -> list[str]:
    """The argv (from ``sys.executable``, never run through a shell) that starts ``entrypoint`` (a list:
    :func:`toolkit.config.experiment.entrypoint_argv`) on ``nproc`` local processes meeting on
    ``master_port``. Pure; any process.

    ``include``: deepspeed only, the GPU ids (``"localhost:2,3"``); ``rank_logs``: where the launcher
    writes each rank's output (None: the ranks inherit its own). ConfigError: an entrypoint that cannot
    be launched; ValueError: a bad argument."""
    _check_entrypoint(entrypoint)
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    if not is_int(nproc) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: expected an integer >= 1")
    if not is_int(master_port) or not 1 <= master_port <= 65535:
        raise ValueError(f"master_port={master_port!r}: expected an integer port in 1..65535")
    if include is not None and launcher != "deepspeed":
        raise ValueError(f"include={include!r} is only understood by the deepspeed launcher; under "
                         "torchrun the runner selects GPUs with CUDA_VISIBLE_DEVICES")

    mode, target, args = parse_entrypoint(entrypoint)
    if launcher == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", LOOPBACK, "--master_port", str(master_port)]
    else:
        argv = [sys.executable, "-m", "deepspeed.launcher.launch",
                f"--world_info={world_info(include, nproc)}",
                f"--master_addr={LOOPBACK}", f"--master_port={master_port}", "--no_local_rank"]
    if rank_logs is not None:
        argv += rank_log_options(launcher, Path(rank_logs))
    if launcher == "torchrun":
        argv += {"module": ["--module"], "exec": ["--no-python"], "script": []}[mode]
    else:
        argv += DEEPSPEED_MODE_FLAGS[mode]
    return argv + [target] + args
