"""Command line of the autotuner: ``python -m toolkit.dsat {binary,random,asha} CONFIG MODEL_DIR``.

Exit status: 0 a best config was found; 1 the search failed (the profiling trial failed, or no
tuning trial succeeded); 2 bad input (nothing was launched and nothing written); 130 interrupted
(every trial killed; ``--resume`` continues).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from toolkit._checks import is_int
from toolkit.config.deepspeed import get_ds_config_from_hparams, validate_ds_config
from toolkit.config.experiment import entrypoint_argv, load_experiment_config
from toolkit.dsat.contract import METRICS
from toolkit.dsat.execution.argv import MULTIHOST_LAUNCHERS
from toolkit.dsat.execution.hosts import Host, read_hostfile, slurm_hosts
from toolkit.dsat.execution.settings import RunnerSettings
from toolkit.dsat.search.types import SearchSettings
from toolkit.errors import ConfigError

if TYPE_CHECKING:  # the orchestrator imports the runner and the search; the CLI loads them on use
    from toolkit.dsat.orchestrator import Plan

__all__ = ["build_parser", "make_plan", "main", "parse_bytes", "user_terms", "UsageError", "USER_NAMES"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(ConfigError):
    """Bad input found before anything was launched: every problem, in the user's words (flags,
    config keys). The CLI prints them and exits 2; nothing was launched or written."""


# The argparse types parse a flag's syntax only: its range is checked once, by the settings it goes
# into (RunnerSettings, SearchSettings), and reported with the flag's name (see user_terms).

def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _stage(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeRO stage: expected 0, 1, 2 or 3")
    return int(text)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"2G"`` or a plain number of bytes (the settings check its range)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: expected e.g. 8GiB, 512MiB or 1000000")
    return int(float(match.group(1)) * _UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command per search method)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("config", type=Path, help="experiment YAML (entrypoint, resources.slots_per_trial, "
                        "hyperparameters.deepspeed_config)")
    common.add_argument("model_dir", type=Path,
                        help="directory holding the entrypoint and the DeepSpeed JSON")
    g = common.add_argument_group("search")
    g.add_argument("--max-trials", type=_integer, default=50)
    g.add_argument("--max-concurrent-trials", type=_integer, default=16)
    g.add_argument("--max-slots", type=_integer, default=None,
                   help="slots in use at once (default: GPUs of this machine, or its CPU cores)")
    g.add_argument("--metric", choices=METRICS, default="FLOPS_per_gpu",
                   help="FLOPS_per_gpu and throughput: larger is better; forward, backward, latency: smaller")
    g.add_argument("--run-full-experiment", action="store_true",
                   help="after the search, run the entrypoint with the best config for "
                        "searcher.max_length steps")
    g.add_argument("--zero-stages", type=_stage, nargs="+", default=[1, 2, 3])
    g.add_argument("--start-profile-step", type=_integer, default=3)
    g.add_argument("--end-profile-step", type=_integer, default=5)
    g.add_argument("--random-seed", type=_integer, default=42)
    g.add_argument("--trial-timeout", type=_number, default=600.0, metavar="SECONDS",
                   help="a trial running longer is killed with all its processes (default 600)")
    g.add_argument("--memory-per-slot", type=parse_bytes, default=None, metavar="SIZE",
                   help="CPU only: memory budget per slot, e.g. 4GiB (default: host memory / max slots); "
                        "a trial process above it is killed and recorded as out-of-memory")
    g.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun",
                   help="starts a trial whose slots are all on this machine")
    h = common.add_argument_group("hosts (default: this machine alone, or the Slurm allocation's nodes)")
    h.add_argument("--hostfile", type=Path, default=None,
                   help="DeepSpeed hostfile ('HOST slots=N' per line): the hosts and slots trials run on; "
                        "a trial larger than one host's slots spans hosts")
    h.add_argument("--multihost-launcher", choices=MULTIHOST_LAUNCHERS, default=None,
                   help="starts a trial on other hosts: DeepSpeed's runner (pdsh, openmpi, mvapich, mpich, "
                        "impi) or srun (default: srun inside a Slurm allocation, else pdsh)")
    h.add_argument("--ssh-port", type=_integer, default=None, help="ssh port of the hosts (pdsh)")
    g.add_argument("--output-dir", type=Path, default=None, help="default: MODEL_DIR/dsat_output")
    g.add_argument("--resume", action="store_true", help="continue the search recorded in --output-dir")

    description = "DeepSpeed autotuner: find the fastest DeepSpeed config that fits."
    parser = argparse.ArgumentParser(prog="python -m toolkit.dsat", description=description)
    _add_methods(parser, common)
    return parser


def _add_methods(parser: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    """One sub-command per search method, with the common flags and its own."""
    methods = parser.add_subparsers(dest="method", required=True, metavar="{binary,random,asha}")
    binary = methods.add_parser("binary", parents=[common],
                                help="bisect the micro-batch of random ZeRO configs")
    binary.add_argument("--search-range-factor", type=_number, default=1.0)
    binary.add_argument("--bisect-tolerance", type=_number, default=0.25, metavar="FRACTION",
                        help="stop bisecting a config's micro-batch once the open range is within this "
                             "fraction of its largest fitting micro-batch f; for throughput/FLOPS_per_gpu "
                             "then probe down a ladder of powers of two (the largest below f, then /4 each "
                             "time) while each probe is within half of the config's best, and end with up "
                             "to two probes at the powers of two next to the ladder's best (twice and half "
                             "it) (0: bisect to the last unit; default 0.25)")
    rand = methods.add_parser("random", parents=[common], help="random ZeRO configs with early stopping")
    rand.add_argument("--trials-per-random-config", type=_integer, default=5)
    rand.add_argument("--early-stopping", type=_integer, default=None,
                      help="stop after this many trials without improvement")
    asha = methods.add_parser("asha", parents=[common], help="ASHA over lines of binary search")
    asha.add_argument("--max-rungs", type=_integer, default=5)
    asha.add_argument("--min-binary-search-trials", type=_integer, default=3)
    asha.add_argument("--asha-early-stopping", type=_integer, default=0)
    asha.add_argument("--divisor", type=_integer, default=2)
    asha.add_argument("--search-range-factor", type=_number, default=1.0)


#: Where each settings field comes from: a flag, or a key of the experiment config.
_FLAGS = ("max_trials", "max_slots", "zero_stages", "start_profile_step", "end_profile_step", "random_seed",
          "memory_per_slot", "ssh_port", "multihost_launcher", "search_range_factor", "bisect_tolerance",
          "trials_per_random_config", "early_stopping", "max_rungs", "min_binary_search_trials",
          "asha_early_stopping", "divisor")
USER_NAMES = {**{field: "--" + field.replace("_", "-") for field in _FLAGS},
              "max_concurrent": "--max-concurrent-trials", "timeout_s": "--trial-timeout",
              "slots_per_trial": "resources.slots_per_trial",
              "data_parallel_size": "hyperparameters.data_parallel_world_size"}
_FIELD = re.compile(r"(?<![\w.-])(" + "|".join(sorted(USER_NAMES, key=len, reverse=True)) + r")(=?)")


def user_terms(problem: str) -> str:
    """A settings problem with each field named as the user wrote it. Pure.

    >>> user_terms("max_trials=1: expected an integer >= 2")
    '--max-trials 1: expected an integer >= 2'
    >>> user_terms("slots_per_trial=2 > max_slots=1: no trial could ever start")
    'resources.slots_per_trial=2 > --max-slots 1: no trial could ever start'
    """
    def name(match: re.Match[str]) -> str:
        user = USER_NAMES[match.group(1)]
        if not match.group(2):
            return user
        return user + (" " if user.startswith("--") else "=")
    return _FIELD.sub(name, problem)


def _problems_of(err: Exception) -> list[str]:
    """An error's problems, each naming the file it was found in."""
    if not isinstance(err, ConfigError):
        return [str(err)]
    return [f"{err.source}: {p}" for p in err.problems] if err.source else list(err.problems)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The experiment as loaded: what every later check needs."""

    model_dir: Path
    experiment: dict[str, Any]
    hparams: dict[str, Any]
    slots: Any              # checked by the experiment loader and RunnerSettings
    entrypoint: list[str]
    base: dict[str, Any]


def _load_inputs(args: argparse.Namespace, problems: list[str]) -> _Inputs:
    """Load the experiment and the user's DeepSpeed config; UsageError when nothing else can be checked."""
    model_dir = args.model_dir.resolve()
    if not model_dir.is_dir():
        raise UsageError(f"MODEL_DIR {str(args.model_dir)!r} is not a directory")
    try:
        experiment = load_experiment_config(args.config)
    except (ConfigError, FileNotFoundError) as err:
        raise UsageError(_problems_of(err)) from None
    hparams = experiment.get("hyperparameters") or {}
    slots = (experiment.get("resources") or {}).get("slots_per_trial")
    missing = [f"{args.config}: {key} is required by dsat and missing"
               for key, present in [("entrypoint", "entrypoint" in experiment),
                                    ("resources.slots_per_trial", slots is not None),
                                    ("hyperparameters.deepspeed_config", "deepspeed_config" in hparams)]
               if not present]
    if missing:
        raise UsageError(missing)
    entrypoint = entrypoint_argv(experiment)
    script = next((part for part in entrypoint if part.endswith(".py")), None)  # the script a trial runs
    if script is not None and not (model_dir / script).is_file():
        problems.append(f"entrypoint {shlex.join(entrypoint)!r}: {script} not found in MODEL_DIR {model_dir}")
    try:
        base = get_ds_config_from_hparams(hparams, base_dir=model_dir)
    except (ConfigError, FileNotFoundError, TypeError) as err:
        raise UsageError([*problems, *_problems_of(err)]) from None
    return _Inputs(model_dir, experiment, hparams, slots, entrypoint, base)


@dataclasses.dataclass(frozen=True)
class _Machines:
    """Where trials run: the hosts (None: this machine), the GPUs, the slots and the CPU budget."""

    hosts: tuple[Host, ...] | None
    via: str
    max_slots: int
    gpus: tuple[int, ...] | None
    memory_per_slot: int | None


def _find_machines(args: argparse.Namespace, problems: list[str]) -> _Machines:
    """Hosts (``--hostfile``, else the Slurm allocation, else this machine), GPUs and budget."""
    import torch

    hosts = None
    try:
        hosts = read_hostfile(args.hostfile) if args.hostfile is not None else slurm_hosts()
    except ConfigError as err:
        problems.extend(err.problems)
    via = args.multihost_launcher or ("srun" if args.hostfile is None and hosts is not None else "pdsh")
    cuda = torch.cuda.is_available()
    if args.max_slots is not None:
        max_slots = args.max_slots
    elif hosts:
        max_slots = sum(h.slots for h in hosts)
    else:
        max_slots = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
    if cuda and args.memory_per_slot is not None:
        problems.append("--memory-per-slot is for CPU runs; on GPUs the profiling trial measures the GPU "
                        "memory")
    memory_per_slot = args.memory_per_slot
    if not cuda and memory_per_slot is None:  # the host's memory shared by the slots (bad ones: reported)
        memory_per_slot = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(int(max_slots), 1)
    elif cuda:
        memory_per_slot = None
    gpus = tuple(range(torch.cuda.device_count())) if cuda else None
    return _Machines(hosts, via, max_slots, gpus, memory_per_slot)


def _data_parallel_size(inputs: _Inputs, problems: list[str]) -> Any:
    """``hyperparameters.data_parallel_world_size`` (default: the slots), checked to divide the slots
    (its type and range are SearchSettings' to check)."""
    dp = inputs.hparams.get("data_parallel_world_size", inputs.slots)
    if is_int(dp) and dp >= 1 and is_int(inputs.slots) and inputs.slots % dp:
        problems.append(f"hyperparameters.data_parallel_world_size={dp!r}: expected a divisor of "
                        f"resources.slots_per_trial={inputs.slots}")
    return dp


def _check_ds_config(inputs: _Inputs, dp: Any, *, device: str, problems: list[str]) -> None:
    """The user's config at micro-batch 1 must be runnable before any trial is started."""
    from toolkit.dsat.orchestrator import profile_spec, trial_ds_config
    if not (is_int(dp) and dp >= 1):
        return  # reported as a value; the config cannot be resolved without it
    try:
        validate_ds_config(trial_ds_config(inputs.base, profile_spec(inputs.base), data_parallel_size=dp),
                           device=device, data_parallel_size=dp)
    except ConfigError as err:
        problems.extend(f"DeepSpeed config: {p}" for p in err.problems)


def _build_settings(args: argparse.Namespace, inputs: _Inputs, machines: _Machines, dp: Any,
                    problems: list[str]) -> tuple[SearchSettings | None, RunnerSettings | None]:
    """The search's and the runner's settings; each checks its own values (problems in the user's terms)."""
    method_args = {k: getattr(args, k) for k in (
        "trials_per_random_config", "early_stopping", "search_range_factor", "bisect_tolerance", "max_rungs",
        "min_binary_search_trials", "asha_early_stopping", "divisor") if hasattr(args, k)}
    zero = inputs.base.get("zero_optimization")
    search = runner = None
    try:
        search = SearchSettings(method=args.method, metric=args.metric, max_trials=args.max_trials,
                                zero_stages=tuple(dict.fromkeys(args.zero_stages)), data_parallel_size=dp,
                                random_seed=args.random_seed,
                                base_zero=dict(zero) if isinstance(zero, dict) else {}, **method_args)
    except ConfigError as err:
        problems.extend(user_terms(p) for p in err.problems)
    try:
        runner = RunnerSettings(entrypoint=tuple(inputs.entrypoint), model_dir=inputs.model_dir,
                                slots_per_trial=inputs.slots, max_slots=machines.max_slots,
                                max_concurrent=args.max_concurrent_trials, timeout_s=args.trial_timeout,
                                launcher=args.launcher, memory_per_slot=machines.memory_per_slot,
                                start_profile_step=args.start_profile_step,
                                end_profile_step=args.end_profile_step,
                                gpus=machines.gpus, hosts=machines.hosts, multihost_launcher=machines.via,
                                ssh_port=args.ssh_port)
    except ConfigError as err:
        problems.extend(user_terms(p) for p in err.problems)
    return search, runner


def _output_dir_problem(output_dir: Path, *, resume: bool) -> str | None:
    """A new search needs an output directory without one; ``--resume`` needs one."""
    recorded = (output_dir / "events.jsonl").exists()
    if recorded and not resume:
        return (f"--output-dir {output_dir} holds a previous search (events.jsonl); pass --resume to "
                "continue it, or choose another --output-dir")
    if resume and not recorded:
        return f"--resume: {output_dir} holds no search to resume (no events.jsonl)"
    return None


def make_plan(args: argparse.Namespace) -> Plan:
    """Check every input and build the :class:`~toolkit.dsat.orchestrator.Plan`. Launches nothing.

    Each value is checked once, where its rule lives (the experiment loader, the settings, or
    here for what involves several inputs); every problem is collected and raised together.
    Autotuner process only.

    Raises:
        UsageError: listing every problem found, in the user's words (flags, config keys).
    """
    from toolkit.dsat.orchestrator import Plan

    problems: list[str] = []
    inputs = _load_inputs(args, problems)
    machines = _find_machines(args, problems)
    dp = _data_parallel_size(inputs, problems)
    _check_ds_config(inputs, dp, device="cpu" if machines.gpus is None else "cuda", problems=problems)
    search, runner = _build_settings(args, inputs, machines, dp, problems)
    output_dir = (args.output_dir or inputs.model_dir / "dsat_output").resolve()
    problem = _output_dir_problem(output_dir, resume=args.resume)
    if problem:
        problems.append(problem)
    if problems or search is None or runner is None:
        raise UsageError(problems)
    plan = Plan(config_path=args.config.resolve(), experiment=inputs.experiment, base_ds_config=inputs.base,
                hparams=inputs.hparams, data_parallel_size=dp, search=search, runner=runner,
                output_dir=output_dir, resume=args.resume, run_full_experiment=args.run_full_experiment,
                memory_per_slot=machines.memory_per_slot)
    problem = plan.resume_problem() if args.resume else None
    if problem:
        raise UsageError(problem)
    return plan


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m toolkit.dsat`` and the ``dsat`` console script."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with the flag named on bad flags
    try:
        plan = make_plan(args)
    except UsageError as err:
        print("\n  ".join(["dsat: bad input, nothing was launched:", *err.problems]), file=sys.stderr)
        return EXIT_USAGE
    from toolkit.dsat.full_run import run_full_experiment
    from toolkit.dsat.orchestrator import Autotuner

    tuner = Autotuner(plan, say=lambda line: print(line, flush=True))
    # A scheduler stops the autotuner with SIGTERM: treat it like Ctrl-C, so that the runner's
    # shutdown kills every trial before the process goes.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        outcome = tuner.run()
    except KeyboardInterrupt:
        print("dsat: interrupted; every trial was stopped. Continue with --resume --output-dir "
              f"{plan.output_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(("dsat: " if outcome.exit_code == 0 else "dsat: search failed: ") + outcome.message, flush=True)
    if outcome.exit_code == 0 and plan.run_full_experiment:
        return run_full_experiment(plan, outcome, say=lambda line: print(line, flush=True))
    return outcome.exit_code
