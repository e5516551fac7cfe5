"""Command line of the autotuner: ``python -m toolkit.dsat {binary,random,asha} CONFIG MODEL_DIR``.

Exit status: 0 a best config was found; 1 the search failed (the profiling trial failed, or no
tuning trial succeeded); 2 bad input (nothing was launched and nothing written); 130 interrupted
(every trial killed; ``--resume`` continues).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from toolkit._checks import is_int
from toolkit.config.deepspeed import get_ds_config_from_hparams, validate_ds_config
from toolkit.config.experiment import entrypoint_argv, load_experiment_config
from toolkit.dsat.contract import METRICS
from toolkit.dsat.execution.argv import MULTIHOST_LAUNCHERS
from toolkit.dsat.execution.hosts import read_hostfile, slurm_hosts
from toolkit.dsat.search.types import SearchSettings
from toolkit.errors import ConfigError

__all__ = ["build_parser", "make_plan", "main", "UsageError"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad input found before anything was launched; the CLI prints it and exits 2."""


def _int_at_least(low: int, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small: expected an integer >= {low}{why}")
        return value
    parse.__name__ = f"int>={low}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is out of range: expected a number > 0")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text} is out of range: expected a number >= 0 and < 1")
    return value


def _stage(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeRO stage: expected 0, 1, 2 or 3")
    return int(text)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"2G"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: expected e.g. 8GiB, 512MiB or 1000000")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected a size > 0")
    return value


def _machine_slots() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command per search method)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("config", type=Path, help="experiment YAML (entrypoint, resources.slots_per_trial, "
                        "hyperparameters.deepspeed_config)")
    common.add_argument("model_dir", type=Path, help="directory holding the entrypoint and the DeepSpeed JSON")
    g = common.add_argument_group("search")
    g.add_argument("--max-trials", type=_int_at_least(2, " (it counts the profiling trial)"), default=50)
    g.add_argument("--max-concurrent-trials", type=_int_at_least(1), default=16)
    g.add_argument("--max-slots", type=_int_at_least(1), default=None,
                   help="slots in use at once (default: GPUs of this machine, or its CPU cores)")
    g.add_argument("--metric", choices=METRICS, default="FLOPS_per_gpu",
                   help="FLOPS_per_gpu and throughput: larger is better; forward, backward, latency: smaller")
    g.add_argument("--run-full-experiment", action="store_true",
                   help="after the search, run the entrypoint with the best config for searcher.max_length steps")
    g.add_argument("--zero-stages", type=_stage, nargs="+", default=[1, 2, 3])
    g.add_argument("--start-profile-step", type=_int_at_least(1), default=3)
    g.add_argument("--end-profile-step", type=_int_at_least(1), default=5)
    g.add_argument("--random-seed", type=int, default=42)
    g.add_argument("--trial-timeout", type=_positive_float, default=600.0, metavar="SECONDS",
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
    h.add_argument("--ssh-port", type=_int_at_least(1), default=None, help="ssh port of the hosts (pdsh)")
    g.add_argument("--output-dir", type=Path, default=None, help="default: MODEL_DIR/dsat_output")
    g.add_argument("--resume", action="store_true", help="continue the search recorded in --output-dir")

    parser = argparse.ArgumentParser(prog="python -m toolkit.dsat",
                                     description="DeepSpeed autotuner: find the fastest DeepSpeed config that fits.")
    methods = parser.add_subparsers(dest="method", required=True, metavar="{binary,random,asha}")
    binary = methods.add_parser("binary", parents=[common], help="bisect the micro-batch of random ZeRO configs")
    binary.add_argument("--search-range-factor", type=_positive_float, default=1.0)
    binary.add_argument("--bisect-tolerance", type=_fraction, default=0.25, metavar="FRACTION",
                        help="stop bisecting a config's micro-batch once the open range is within this "
                             "fraction of its largest fitting micro-batch f; for throughput/FLOPS_per_gpu "
                             "then probe down a ladder of powers of two (the largest below f, then /4 each "
                             "time) while each probe is within half of the config's best, and end with up "
                             "to two probes at the powers of two next to the ladder's best (twice and half "
                             "it) (0: bisect to the last unit; default 0.25)")
    rand = methods.add_parser("random", parents=[common], help="random ZeRO configs with early stopping")
    rand.add_argument("--trials-per-random-config", type=_int_at_least(1), default=5)
    rand.add_argument("--early-stopping", type=_int_at_least(1), default=None,
                      help="stop after this many trials without improvement")
    asha = methods.add_parser("asha", parents=[common], help="ASHA over lines of binary search")
    asha.add_argument("--max-rungs", type=_int_at_least(1), default=5)
    asha.add_argument("--min-binary-search-trials", type=_int_at_least(1), default=3)
    asha.add_argument("--asha-early-stopping", type=_int_at_least(0), default=0)
    asha.add_argument("--divisor", type=_int_at_least(2), default=2)
    asha.add_argument("--search-range-factor", type=_positive_float, default=1.0)
    return parser


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _script_of(entrypoint: list[str]) -> str | None:
    """The first ``.py`` argument of the entrypoint (the script a trial runs), if any."""
    return next((part for part in entrypoint if part.endswith(".py")), None)


def _hosts(args: argparse.Namespace, problems: list[str]):
    """(hosts or None, multihost launcher): ``--hostfile``, else the Slurm allocation, else this machine."""
    hosts = None
    try:
        if args.hostfile is not None:
            hosts = read_hostfile(args.hostfile)
        else:
            hosts = slurm_hosts()
    except ConfigError as err:
        problems.extend(err.problems)
    in_slurm = args.hostfile is None and hosts is not None
    via = args.multihost_launcher or ("srun" if in_slurm else "pdsh")
    return hosts, via


def make_plan(args: argparse.Namespace):
    """Check every input and build the :class:`~toolkit.dsat.orchestrator.Plan`. Launches nothing.

    Raises:
        UsageError: listing every problem found.
    """
    import torch

    from toolkit.dsat.execution.runner import RunnerSettings
    from toolkit.dsat.orchestrator import Plan, profile_spec, trial_ds_config

    problems: list[str] = []
    model_dir = args.model_dir.resolve()
    if not model_dir.is_dir():
        raise UsageError(f"MODEL_DIR {str(args.model_dir)!r} is not a directory")
    try:
        experiment = load_experiment_config(args.config)
    except (ConfigError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    hparams = experiment.get("hyperparameters") or {}
    slots = (experiment.get("resources") or {}).get("slots_per_trial")
    for key, present in [("entrypoint", "entrypoint" in experiment), ("resources.slots_per_trial", slots is not None),
                         ("hyperparameters.deepspeed_config", "deepspeed_config" in hparams)]:
        if not present:
            problems.append(f"{args.config}: {key} is required by dsat and missing")
    if problems:
        raise UsageError("; ".join(problems))
    entrypoint = entrypoint_argv(experiment)
    script = _script_of(entrypoint)
    if script is not None and not (model_dir / script).is_file():
        problems.append(f"entrypoint {shlex.join(entrypoint)!r}: {script} not found in MODEL_DIR {model_dir}")
    try:
        base = get_ds_config_from_hparams(hparams, base_dir=model_dir)
    except (ConfigError, FileNotFoundError, TypeError) as err:
        raise UsageError(str(err)) from None

    cuda = torch.cuda.is_available()
    hosts, via = _hosts(args, problems)
    total = sum(h.slots for h in hosts) if hosts else None
    max_slots = args.max_slots or total or _machine_slots()
    # Reported here with the flag's name; RunnerSettings gets the most it could take, so that it
    # does not report the same problem again in its own words.
    runner_max_slots = max_slots
    if hosts and max_slots > total:
        problems.append(f"--max-slots {max_slots}: the hosts have {total} slot(s) in all")
        runner_max_slots = total
    if cuda and not hosts and max_slots > torch.cuda.device_count():
        problems.append(f"--max-slots {max_slots}: this machine has {torch.cuda.device_count()} GPU(s)")
        runner_max_slots = torch.cuda.device_count()
    if slots > max_slots:
        problems.append(f"resources.slots_per_trial={slots} > --max-slots {max_slots}: no trial could start; "
                        "lower slots_per_trial or raise --max-slots")
    dp = hparams.get("data_parallel_world_size", slots)
    if not is_int(dp) or dp < 1 or slots % dp:
        problems.append(f"hyperparameters.data_parallel_world_size={dp!r}: expected a divisor of "
                        f"resources.slots_per_trial={slots}")
        dp = slots
    if args.end_profile_step < args.start_profile_step:
        problems.append(f"--end-profile-step {args.end_profile_step} < --start-profile-step "
                        f"{args.start_profile_step}: expected end >= start")
    if cuda and args.memory_per_slot is not None:
        problems.append("--memory-per-slot is for CPU runs; on GPUs the profiling trial measures the GPU memory")
    memory_per_slot = None if cuda else (args.memory_per_slot or _host_memory() // max_slots)
    try:
        # The user's config at micro-batch 1 must be runnable before any trial is started.
        validate_ds_config(trial_ds_config(base, profile_spec(base), data_parallel_size=dp),
                           device="cuda" if cuda else "cpu", data_parallel_size=dp)
    except ConfigError as err:
        problems.extend(f"DeepSpeed config: {p}" for p in err.problems)
    method_args = {k: getattr(args, k) for k in ("trials_per_random_config", "early_stopping", "search_range_factor",
                                                 "bisect_tolerance", "max_rungs", "min_binary_search_trials",
                                                 "asha_early_stopping", "divisor") if hasattr(args, k)}
    zero = base.get("zero_optimization")
    output_dir = (args.output_dir or model_dir / "dsat_output").resolve()
    try:
        search = SearchSettings(method=args.method, metric=args.metric, max_trials=args.max_trials,
                                zero_stages=tuple(dict.fromkeys(args.zero_stages)), data_parallel_size=dp,
                                random_seed=args.random_seed, base_zero=dict(zero) if isinstance(zero, dict) else {},
                                **method_args)
        runner = RunnerSettings(entrypoint=tuple(entrypoint), model_dir=model_dir, slots_per_trial=slots,
                                max_slots=runner_max_slots, max_concurrent=args.max_concurrent_trials,
                                timeout_s=args.trial_timeout, launcher=args.launcher,
                                memory_per_slot=memory_per_slot, start_profile_step=args.start_profile_step,
                                end_profile_step=args.end_profile_step,
                                gpus=tuple(range(torch.cuda.device_count())) if cuda else None,
                                hosts=hosts, multihost_launcher=via, ssh_port=args.ssh_port)
    except ConfigError as err:
        problems.extend(err.problems)
    if (output_dir / "events.jsonl").exists() and not args.resume:
        problems.append(f"--output-dir {output_dir} holds a previous search (events.jsonl); pass --resume to "
                        "continue it, or choose another --output-dir")
    if args.resume and not (output_dir / "events.jsonl").exists():
        problems.append(f"--resume: {output_dir} holds no search to resume (no events.jsonl)")
    if problems:
        raise UsageError("\n  ".join(["bad input, nothing was launched:", *problems]))
    plan = Plan(config_path=args.config.resolve(), experiment=experiment, base_ds_config=base, hparams=hparams,
                data_parallel_size=dp, search=search, runner=runner, output_dir=output_dir, resume=args.resume,
                run_full_experiment=args.run_full_experiment, memory_per_slot=memory_per_slot)
    if args.resume:
        import json

        recorded = json.loads((output_dir / "search.json").read_text()) if (output_dir / "search.json").exists() else None
        if recorded is not None and recorded != plan.fingerprint():
            changed = sorted(k for k in plan.fingerprint() if recorded.get(k) != plan.fingerprint()[k])
            raise UsageError(f"--resume: the settings differ from the recorded search in {output_dir} "
                             f"({', '.join(changed)}); resume with the same flags and config")
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
        print(f"dsat: {err}", file=sys.stderr)
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
        print(f"dsat: interrupted; every trial was stopped. Continue with --resume --output-dir {plan.output_dir}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(("dsat: " if outcome.exit_code == 0 else "dsat: search failed: ") + outcome.message, flush=True)
    if outcome.exit_code == 0 and plan.run_full_experiment:
        return run_full_experiment(plan, outcome, say=lambda line: print(line, flush=True))
    return outcome.exit_code
