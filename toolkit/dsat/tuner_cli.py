"""Command line of the autotuner: ``python -m toolkit.dsat {binary,random,asha} CONFIG MODEL_DIR``.

Exit status: 0 a best config was found; 1 the search failed (the profiling trial failed, or no
tuning trial succeeded); 2 bad input (nothing was launched and nothing written), or the search
stopped at a trial whose engine ran another config than the trial's (no best written); 130
interrupted (every trial killed; ``--resume`` continues).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from toolkit._checks import is_int
from toolkit.config.deepspeed import (
    BATCH_KEYS,
    DS_TOP_LEVEL_KEYS,
    get_ds_config_from_hparams,
    validate_ds_config,
)
from toolkit.config.experiment import entrypoint_argv, load_experiment_config
from toolkit.dsat.cli_args import build_parser, parse_bytes
from toolkit.dsat.execution.multihost_argv import config_flag
from toolkit.dsat.execution.settings import RunnerSettings, available_memory_bytes, default_memory_per_slot
from toolkit.dsat.hf_trainer import hf_base_config, is_hf_trainer, without_autos
from toolkit.dsat.search.batch import GlobalBatch, allowed_micro_batches, global_batch_policy
from toolkit.dsat.search.types import SearchSettings
from toolkit.errors import ConfigError
from toolkit.launch.hosts import Host, read_hostfile, slurm_hosts
from toolkit.launch.wrappers import entrypoint_launcher

if TYPE_CHECKING:  # the plan imports the records and the search; the CLI loads them on use
    from toolkit.dsat.tuning_plan import Plan

__all__ = ["build_parser", "choose_launcher", "make_plan", "main", "parse_bytes", "UsageError"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_LAUNCHER = "torchrun"


class UsageError(ConfigError):
    """Bad input found before anything was launched: every problem, naming the flag or config key.
    The CLI prints them and exits 2; nothing was launched or written."""


def choose_launcher(flag: str | None, entrypoint: Sequence[str]) -> tuple[str, str]:
    """The launcher of trials on this machine and why: ``--launcher`` when given, else the one the
    entrypoint's Determined wrapper stands for, else torchrun. Pure; autotuner process only.

    >>> choose_launcher(None, ["python3", "-m", "determined.launch.deepspeed", "python3", "script.py"])
    ('deepspeed', 'the entrypoint runs determined.launch.deepspeed; --launcher torchrun overrides it')
    >>> choose_launcher("torchrun", ["python3", "-m", "determined.launch.deepspeed", "python3", "script.py"])
    ('torchrun', '--launcher torchrun was given')
    """
    if flag is not None:
        return flag, f"--launcher {flag} was given"
    found, why = entrypoint_launcher(entrypoint)
    if found is not None:
        other = "torchrun" if found == "deepspeed" else "deepspeed"
        return found, f"{why}; --launcher {other} overrides it"
    return DEFAULT_LAUNCHER, (f"the default: {why} (one inside a shell script is not read); pass "
                              "--launcher deepspeed for DeepSpeed's launcher")


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
    source: str = "hyperparameters.deepspeed_config"   # one of plan.CONFIG_SOURCES
    flag: tuple[str, str] | None = None                 # the entrypoint's config flag and its path
    hf_trainer: bool = False                            # HF Trainer's --deepspeed convention (hf_trainer.py)


def _base_config(hparams: dict[str, Any], flag: tuple[str, str] | None,
                 model_dir: Path) -> tuple[dict[str, Any], str]:
    """The search's base config and where it comes from (:data:`toolkit.dsat.tuning_plan.CONFIG_SOURCES`):
    ``hyperparameters.deepspeed_config``, else DeepSpeed keys in the hyperparameters, else the file of
    the entrypoint's flag (with ``overwrite_deepspeed_args``), else none yet (the script builds it)."""
    if "deepspeed_config" in hparams:
        return get_ds_config_from_hparams(hparams, base_dir=model_dir), "hyperparameters.deepspeed_config"
    inline = any(key in DS_TOP_LEVEL_KEYS for key in hparams)
    if inline or (hparams.get("overwrite_deepspeed_args") and not flag):
        return get_ds_config_from_hparams(hparams, base_dir=model_dir), "hyperparameters"
    if flag is not None:
        path = Path(flag[1]) if Path(flag[1]).is_absolute() else model_dir / flag[1]
        if not path.is_file():
            raise ConfigError(f"the entrypoint's {flag[0]} {flag[1]}: no such file in MODEL_DIR {model_dir}; "
                              "dsat starts the search from it")
        return get_ds_config_from_hparams({**hparams, "deepspeed_config": str(path)}), "entrypoint flag"
    return {}, "script"


def _config_files(inputs: _Inputs) -> tuple[Path, ...]:
    """The user's DeepSpeed config files a trial's script may open itself: the YAML's
    ``hyperparameters.deepspeed_config`` and the file of the entrypoint's flag."""
    named = [inputs.hparams.get("deepspeed_config"), inputs.flag[1] if inputs.flag else None]
    paths = [Path(p) if Path(p).is_absolute() else inputs.model_dir / p
             for p in named if isinstance(p, str) and p]
    return tuple(dict.fromkeys(p.resolve() for p in paths if p.is_file()))


def _load_inputs(args: argparse.Namespace, problems: list[str]) -> _Inputs:
    """Load the experiment and the user's DeepSpeed config; UsageError when nothing else can be checked."""
    model_dir = args.model_dir.resolve()
    if not model_dir.is_dir():
        raise UsageError(f"MODEL_DIR {str(args.model_dir)!r} is not a directory")
    try:
        experiment = load_experiment_config(args.config)
    except (ConfigError, OSError) as err:  # OSError: missing, a directory, unreadable
        raise UsageError(_problems_of(err)) from None
    hparams = experiment.get("hyperparameters") or {}
    slots = (experiment.get("resources") or {}).get("slots_per_trial")
    missing = [f"{args.config}: {key} is required by dsat and missing"
               for key, present in [("entrypoint", "entrypoint" in experiment),
                                    ("resources.slots_per_trial", slots is not None)]
               if not present]
    if missing:
        raise UsageError(missing)
    entrypoint = entrypoint_argv(experiment)
    script = next((part for part in entrypoint if part.endswith(".py")), None)  # the script a trial runs
    if script is not None and not (model_dir / script).is_file():
        problems.append(f"entrypoint {shlex.join(entrypoint)!r}: {script} not found in MODEL_DIR {model_dir}")
    flag = config_flag(entrypoint)
    try:
        base, source = _base_config(hparams, flag, model_dir)
        hf = source == "entrypoint flag" and is_hf_trainer(flag, entrypoint, base)
        if hf:  # the Trainer fills the file's "auto" batch keys from its flags: so does the search
            base = hf_base_config(base, entrypoint)
    except (ConfigError, OSError, TypeError) as err:
        raise UsageError([*problems, *_problems_of(err)]) from None
    return _Inputs(model_dir, experiment, hparams, slots, entrypoint, base, source, flag, hf)


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
    if not cuda and memory_per_slot is None:  # the host's free memory, less headroom, shared by the slots
        memory_per_slot = default_memory_per_slot(available_memory_bytes(),
                                                  slots=max_slots if is_int(max_slots) else 1)
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


def _hidden_size(inputs: _Inputs, problems: list[str]) -> int | None:
    """``hyperparameters.hidden_size``: resolves ZeRO's "auto" sizes the HF way (None: not given)."""
    value = inputs.hparams.get("hidden_size")
    if value is not None and not (is_int(value) and value >= 1):
        problems.append(f"hyperparameters.hidden_size={value!r}: expected a positive integer (the model's "
                        "width; it resolves the DeepSpeed config's \"auto\" ZeRO sizes)")
        return None
    return value


def _check_ds_config(args: argparse.Namespace, inputs: _Inputs, dp: Any, *, device: str,
                     problems: list[str]) -> tuple[GlobalBatch | None, int | None]:
    """The user's DeepSpeed config (JSON + overwrite_deepspeed_args) as written, against every rule
    of ``validate_ds_config``, before dsat substitutes its own values; then the global batch policy
    and the profiling trial's config. Returns (the policy, ``hidden_size``); None: a problem."""
    from toolkit.dsat.tuning_plan import as_written, profile_spec, trial_ds_config
    hidden = _hidden_size(inputs, problems)
    if not (is_int(dp) and dp >= 1):
        return None, hidden  # reported as a value; the config cannot be checked without it
    if inputs.source == "script":  # checked once the first profiling trial recorded it (with_base_config)
        return GlobalBatch("free"), hidden
    # HF Trainer's other "auto" values are the Trainer's to fill, DeepSpeed never sees them
    seen = without_autos if inputs.hf_trainer else dict
    try:
        validate_ds_config(seen(as_written(inputs.base)), device=device, data_parallel_size=dp)
        policy = global_batch_policy(args.global_batch, user_train_batch_size=inputs.base.get(BATCH_KEYS[0]))
        if policy.train_batch_size is not None:
            allowed_micro_batches(policy.train_batch_size, data_parallel_size=dp)
        first = trial_ds_config(inputs.base, profile_spec(inputs.base), data_parallel_size=dp,
                                train_batch_size=policy.train_batch_size, hidden_size=hidden)
        validate_ds_config(seen(first), device=device, data_parallel_size=dp)
    except ConfigError as err:
        problems.extend(f"DeepSpeed config: {p}" for p in err.problems)
        return None, hidden
    return policy, hidden


def _build_settings(args: argparse.Namespace, inputs: _Inputs, machines: _Machines, dp: Any,
                    policy: GlobalBatch | None,
                    problems: list[str]) -> tuple[SearchSettings | None, RunnerSettings | None]:
    """The search's and the runner's settings; each checks its own values (problems in the user's terms)."""
    method_args = {k: getattr(args, k) for k in (
        "trials_per_random_config", "early_stopping", "search_range_factor", "bisect_tolerance", "max_rungs",
        "min_binary_search_trials", "asha_early_stopping", "divisor") if hasattr(args, k)}
    zero = inputs.base.get("zero_optimization")
    search = runner = None
    kept = policy.train_batch_size if policy is not None else None
    micro_batches = allowed_micro_batches(kept, data_parallel_size=dp) if kept is not None else None
    try:
        search = SearchSettings(method=args.method, metric=args.metric, max_trials=args.max_trials,
                                zero_stages=tuple(dict.fromkeys(args.zero_stages)), data_parallel_size=dp,
                                random_seed=args.random_seed,
                                base_zero=dict(zero) if isinstance(zero, dict) else {},
                                micro_batches=micro_batches, offload=args.offload, **method_args)
    except ConfigError as err:
        problems.extend(err.problems)
    try:
        runner = RunnerSettings(entrypoint=tuple(inputs.entrypoint), model_dir=inputs.model_dir,
                                slots_per_trial=inputs.slots, max_slots=machines.max_slots,
                                max_concurrent=args.max_concurrent_trials, timeout_s=args.trial_timeout,
                                launcher=choose_launcher(args.launcher, inputs.entrypoint)[0],
                                memory_per_slot=machines.memory_per_slot,
                                start_profile_step=args.start_profile_step,
                                end_profile_step=args.end_profile_step,
                                timed_window_s=args.timed_window,
                                gpus=machines.gpus, hosts=machines.hosts, multihost_launcher=machines.via,
                                experiment_config=args.config.resolve(),
                                ssh_port=args.ssh_port, echo=not args.quiet,
                                merge_config=not args.no_merge_config, config_files=_config_files(inputs),
                                hf_batch_flags=inputs.hf_trainer)
    except ConfigError as err:
        problems.extend(err.problems)
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
    """Check every input, once, where its rule lives, and build the :class:`~toolkit.dsat.tuning_plan.Plan`;
    launches nothing. UsageError listing every problem in the user's words. Autotuner process only."""
    from toolkit.dsat.tuning_plan import Plan, recorded_budget

    problems: list[str] = []
    inputs = _load_inputs(args, problems)
    machines = _find_machines(args, problems)
    output_dir = (args.output_dir or inputs.model_dir / "dsat_output").resolve()
    budget = recorded_budget(output_dir) if args.resume and args.memory_per_slot is None else None
    if budget is not None and machines.gpus is None:  # the replayed search needs the budget it ran with
        machines = dataclasses.replace(machines, memory_per_slot=budget)
    dp = _data_parallel_size(inputs, problems)
    policy, hidden = _check_ds_config(args, inputs, dp, device="cpu" if machines.gpus is None else "cuda",
                                      problems=problems)
    search, runner = _build_settings(args, inputs, machines, dp, policy, problems)
    problem = _output_dir_problem(output_dir, resume=args.resume)
    if problem:
        problems.append(problem)
    if inputs.source == "script" and args.no_merge_config:
        problems.append("--no-merge-config with no config named (no hyperparameters.deepspeed_config, no "
                        "--deepspeed_config or --deepspeed in the entrypoint): no trial's config could reach "
                        "the engine your script builds. Name your config (docs/dsat.md: three ways), or let "
                        "dsat merge each trial's tuned keys over the one your script gives "
                        "deepspeed.initialize")
    if args.confirm < 0:
        problems.append(f"--confirm={args.confirm}: expected an integer >= 0 (how many of the best "
                        "configurations are re-run; 0: none)")
    if problems or search is None or runner is None or policy is None:
        raise UsageError(problems)
    plan = Plan(config_path=args.config.resolve(), experiment=inputs.experiment, base_ds_config=inputs.base,
                hparams=inputs.hparams, data_parallel_size=dp, search=search, runner=runner,
                output_dir=output_dir, resume=args.resume, run_full_experiment=args.run_full_experiment,
                memory_per_slot=machines.memory_per_slot, global_batch=policy, hidden_size=hidden,
                confirm=args.confirm, config_source=inputs.source, config_flag=inputs.flag,
                awaiting_config=inputs.source == "script", global_batch_flag=args.global_batch,
                own_config=not args.no_own_config)
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
    print(plan.config_line(), flush=True)
    launcher, why = choose_launcher(args.launcher, plan.runner.entrypoint)
    print(f"dsat: trials on this machine start with {launcher}: {why}", flush=True)
    from toolkit.dsat.full_run import run_full_experiment
    from toolkit.dsat.orchestrator import Autotuner

    tuner = Autotuner(plan, say=lambda line: print(line, flush=True),
                      argv=list(argv) if argv is not None else sys.argv[1:])
    # A scheduler stops the autotuner with SIGTERM: treat it like Ctrl-C, so that the runner's
    # shutdown kills every trial before the process goes.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        outcome = tuner.run()
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM, or a trial preempted (TrialPreempted)
        print(f"dsat: interrupted{f' ({err})' if str(err) else ''}; every trial was stopped. Continue with "
              f"--resume --output-dir {plan.output_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    prefix = {0: "dsat: ", 2: "dsat: search stopped: "}.get(outcome.exit_code, "dsat: search failed: ")
    print(prefix + outcome.message, flush=True)
    if outcome.exit_code == 0 and plan.run_full_experiment:
        return run_full_experiment(plan, outcome, say=lambda line: print(line, flush=True))
    return outcome.exit_code
