"""``python -m toolkit.run``'s command line. Runner process only."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from toolkit.bounded_load import load_json
from toolkit.config.hyperparameters import load_config
from toolkit.errors import CheckpointError, ConfigError
from toolkit.launch.trial_files import OPS_FILE, TRIAL_FILE, load_trial_state
from toolkit.run.plan import RunPlan, plan_run
from toolkit.run.scheduler import run_search
from toolkit.run.slurm_argv import parse_options
from toolkit.run.trial import execute

__all__ = ["main"]

logger = logging.getLogger("toolkit.run")


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (2: bad input, nothing started). Runner only.

    Example: ``python -m toolkit.run exp.yaml . --output-dir runs/exp``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m toolkit.run", description="Run a Determined experiment YAML on this machine."
    )
    parser.add_argument("config", help="the experiment YAML (Determined's format)")
    parser.add_argument("model_dir", help="the entrypoint's working directory (Determined's context dir)")
    parser.add_argument("--output-dir", help="checkpoints, TensorBoard and metrics (default: runs/<name>)")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds the ranks get to stop after a signal")
    parser.add_argument(
        "--max-slots", type=int, default=None,
        help="slots a search's trials share, resources.slots_per_trial each (default: this machine's GPUs, "
             "or on CPU its cores); searcher.max_concurrent_trials limits the trials at once further",
    )
    parser.add_argument("--quiet", action="store_true", help="show the runner's and the searcher's lines "
                        "only; the ranks' lines still go to each trial's logs/trial.log")
    parser.add_argument(
        "--slurm", metavar="OPTIONS", default=None,
        help="run each trial of the search as its own Slurm job, submitted with these sbatch options "
             "(one string, e.g. --slurm='--partition=gpu --time=60'; '' for none); see docs/multi-node.md",
    )
    args = parser.parse_args(_joined_slurm(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: [toolkit.run] %(message)s")
    config_path, model_dir = Path(args.config), Path(args.model_dir)
    if not model_dir.is_dir():
        parser.error(f"MODEL_DIR={args.model_dir!r}: not a directory")
    if args.grace <= 0:
        parser.error(f"--grace={args.grace!r}: expected a number of seconds > 0")
    if args.max_slots is not None and args.max_slots < 1:
        parser.error(f"--max-slots={args.max_slots!r}: expected an integer >= 1")
    try:
        config = load_config(config_path)
        plan = plan_run(
            config,
            config_path=config_path,
            model_dir=model_dir,
            output_dir=Path(args.output_dir) if args.output_dir else None,
        )
    except (ConfigError, OSError) as err:  # OSError: the YAML is missing, a directory or unreadable
        print(f"python -m toolkit.run: error: {err}", file=sys.stderr)
        return 2
    searching = (plan.config.get("searcher") or {}).get("name", "single") != "single"
    if args.slurm is not None:
        return _slurm(args, plan, searching=searching)
    if searching:
        try:
            return run_search(plan, grace_s=args.grace, max_slots=args.max_slots, echo=not args.quiet)
        except (ConfigError, CheckpointError) as err:  # the search's record: another search, or not one
            print(f"python -m toolkit.run: error: {err}", file=sys.stderr)
            return 2
    problem = _record_problem(plan.output_dir)
    if problem:
        print(f"python -m toolkit.run: error: {problem}", file=sys.stderr)
        return 2
    return execute(plan, grace_s=args.grace, echo=not args.quiet)


def _joined_slurm(argv: list[str]) -> list[str]:
    """``--slurm VALUE`` as ``--slurm=VALUE``: argparse takes a value that starts with ``-`` for a flag."""
    joined, i = [], 0
    while i < len(argv):
        if argv[i] == "--slurm" and i + 1 < len(argv):
            joined.append(f"--slurm={argv[i + 1]}")
            i += 2
            continue
        joined.append(argv[i])
        i += 1
    return joined


def _slurm(args: argparse.Namespace, plan: RunPlan, *, searching: bool) -> int:
    """The search as Slurm jobs (:mod:`toolkit.run.slurm_engine`); exit 2 for bad input, nothing submitted."""
    from toolkit.run import slurm_engine  # the Slurm client commands, only with --slurm

    try:
        if not searching:
            raise ConfigError("--slurm: runs a search's trials as Slurm jobs, and searcher.name is 'single'; "
                              "expected a search (random, grid, adaptive_asha), or submit "
                              "'python -m toolkit.run ...' itself in a batch script")
        if args.max_slots is not None:
            raise ConfigError(f"--max-slots={args.max_slots}: the slots of this machine, which --slurm does "
                              "not use; leave one of them out")
        options = parse_options(args.slurm)
        slurm_engine.check_submission(options, nproc=plan.nproc)
        return slurm_engine.run_slurm_search(plan, options, grace_s=args.grace)
    except (ConfigError, CheckpointError) as err:
        print(f"python -m toolkit.run: error: {err}", file=sys.stderr)
        return 2
    except slurm_engine.SlurmError as err:
        print(f"python -m toolkit.run: error: {err}", file=sys.stderr)
        return 1


def _record_problem(output_dir: Path) -> str | None:
    """Why the records a previous run left in ``output_dir`` cannot be continued from, or None. Reads only."""
    try:
        if (output_dir / TRIAL_FILE).exists():
            load_trial_state(output_dir, write=False)
        if (output_dir / OPS_FILE).exists():
            load_json(output_dir / OPS_FILE, what="searcher record")
    except ConfigError as err:
        return str(err)
    except OSError as err:
        return f"{output_dir}: a record cannot be read ({err})"
    return None
