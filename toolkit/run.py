"""``python -m toolkit.run CONFIG MODEL_DIR [--output-dir DIR]``: run an experiment on this machine.

The local counterpart of Determined's ``det experiment create CONFIG MODEL_DIR``: the
experiment's ``entrypoint`` runs in ``MODEL_DIR`` on ``resources.slots_per_trial`` processes,
started by torchrun (plain commands, ``determined.launch.torch_distributed``) or by DeepSpeed's
launcher (``determined.launch.deepspeed``; ``--no_local_rank``, as Determined passes it). Each
process gets ``TOOLKIT_EXPERIMENT_CONFIG`` (the YAML) and ``TOOLKIT_OUTPUT_DIR`` (checkpoints,
TensorBoard, metrics; default ``runs/<name>``), which ``det.get_cluster_info()``,
``toolkit.get_hparams()`` and ``toolkit.get_output_dir()`` read. Plain toolkit scripts run too.

* SIGTERM, SIGINT and SIGUSR1 (Slurm's ``--signal=B:USR1@N``) to this process are passed to the
  ranks, which stop through preemption (``should_preempt()``) and save; after ``--grace``
  seconds whatever is left is killed.
* A run that fails is started again, up to ``max_restarts`` times (Determined's default 5); it
  resumes from ``latest_checkpoint``. A run stopped by a forwarded signal is not restarted.
* Exit status: the last run's (0 when it succeeded). Bad input exits 2, naming the key or flag,
  with nothing started. No process of the run outlives this one.

Example::

    python -m toolkit.run examples/determined/deepspeed.yaml examples/determined --output-dir runs/det
    # the same command again resumes from the latest checkpoint
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from toolkit._files import atomic_write_json
from toolkit.compat.determined import hparams, storage
from toolkit.compat.determined.info import TRIAL_FILE, load_trial_state, output_dir_for, record_hparams
from toolkit.compat.determined.launch import torchrun_nproc_override, unwrap_launcher
from toolkit.dsat.contract import EXPERIMENT_CONFIG_ENV, OUTPUT_DIR_ENV
from toolkit.dsat.execution.argv import build_trial_argv
from toolkit.dsat.execution.procs import (
    find_trial_processes,
    free_port,
    is_rank_process,
    kill_until_gone,
    scan_processes,
)
from toolkit.errors import ConfigError

__all__ = ["main", "plan_run", "RunPlan"]

logger = logging.getLogger("toolkit.run")

#: Marks every process of one run (Determined's name for one run of a trial), to find them all.
MARK_ENV = "DET_ALLOCATION_ID"
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # what toolkit.watch_preemption watches


class RunPlan:
    """What to launch, decided from the config and flags alone (pure; see :func:`plan_run`)."""

    def __init__(
        self,
        *,
        launcher: str,
        command: list[str],
        nproc: int,
        max_restarts: int,
        output_dir: Path,
        config_path: Path,
        model_dir: Path,
    ) -> None:
        self.launcher, self.command, self.nproc = launcher, command, nproc
        self.max_restarts, self.output_dir = max_restarts, output_dir
        self.config_path, self.model_dir = config_path, model_dir
        self.config: Mapping[str, Any] = {}


def _launcher_of(argv: list[str], problems: list[str]) -> tuple[str, list[str], int | None]:
    """(launcher, user command, process count from the wrapper or None); problems appended."""
    if not argv:
        return "torchrun", argv, None
    try:
        found, wrapper_args, command = unwrap_launcher(argv)
        nproc, ignored = torchrun_nproc_override(wrapper_args)
    except ConfigError as err:
        problems.extend(err.problems)
        return "torchrun", argv, None
    if ignored:
        logger.warning(
            "entrypoint: torchrun arguments %s are ignored; toolkit.run sets processes, "
            "address and port itself",
            ignored,
        )
    launcher = found or ("deepspeed" if os.path.basename(command[0]) == "deepspeed" else "torchrun")
    return launcher, command, nproc


def plan_run(
    config: Mapping[str, Any], *, config_path: Path, model_dir: Path, output_dir: Path | None
) -> RunPlan:
    """Check the experiment and decide the launch. Pure, but reads ``$TOOLKIT_OUTPUT_DIR`` (the default).

    Raises:
        ConfigError: every problem, each naming its key (entrypoint, searcher.name, a search
            space, checkpoint_storage, max_restarts, the wrapper's arguments).
    """
    problems: list[str] = []
    entry = config.get("entrypoint")
    argv: list[str] = []
    if entry is None:
        problems.append("entrypoint is missing: expected e.g. 'entrypoint: python3 train.py'")
    else:
        argv = list(entry) if isinstance(entry, list) else shlex.split(entry)
    name = (config.get("searcher") or {}).get("name")
    if name not in (None, "single"):
        problems.append(
            f"searcher.name={name!r}: toolkit runs one trial; use 'single' (hyperparameter "
            "searches need a Determined master; tune DeepSpeed settings with python -m toolkit.dsat)"
        )
    restarts = config.get("max_restarts", 5)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        problems.append(f"max_restarts={restarts!r}: expected an integer >= 0")
    problems.extend(hparams.check_space(config.get("hyperparameters") or {}))
    for check in (
        lambda: storage.storage_root(
            config.get("checkpoint_storage"), output_dir=Path("."), base_dir=Path(".")
        ),
    ):
        try:
            check()
        except ConfigError as err:
            problems.extend(err.problems)
    launcher, command, nproc = _launcher_of(argv, problems)
    if problems:
        raise ConfigError(problems, source=str(config_path))
    slots = int((config.get("resources") or {}).get("slots_per_trial", 1))
    out = output_dir or output_dir_for(config)
    plan = RunPlan(
        launcher=launcher,
        command=command,
        nproc=nproc or slots,
        max_restarts=int(restarts),
        output_dir=out.resolve(),
        config_path=config_path.resolve(),
        model_dir=model_dir.resolve(),
    )
    plan.config = config
    return plan


class _Forwarder:
    """Signal handlers that pass SIGTERM/SIGINT/SIGUSR1 to the run's rank processes (or, before they exist,
    to the launcher's process group)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.mark = ""
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in _FORWARDED}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            logger.warning(
                "received %s: passing it to the ranks, which save and stop", signal.Signals(signum).name
            )
        self.received = self.received or signum
        if self.proc is None or self.proc.poll() is not None:
            return
        # To the ranks themselves: the launcher then sees them exit 0 after saving, and exits 0.
        table = scan_processes()
        ranks = [
            pid
            for pid in find_trial_processes(self.mark, root=self.proc.pid, variable=MARK_ENV, table=table)
            if is_rank_process(table[pid][1])
        ]
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if not ranks:  # not started yet: the launcher stops what it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _launch_argv(plan: RunPlan) -> list[str]:
    argv = build_trial_argv(plan.command, launcher=plan.launcher, nproc=plan.nproc, master_port=free_port())
    if plan.launcher == "torchrun" and "--max_restarts" not in argv:
        argv.insert(3, "--max_restarts=0")  # restarts are this runner's (with a resume)
    return argv


def _run_once(plan: RunPlan, env: dict[str, str], forwarder: _Forwarder, *, grace_s: float) -> int:
    mark = f"toolkit-run-{uuid.uuid4().hex[:12]}"
    argv = _launch_argv(plan)
    logger.info("starting %s", shlex.join(argv))
    proc = subprocess.Popen(argv, cwd=plan.model_dir, env={**env, MARK_ENV: mark}, start_new_session=True)
    forwarder.proc, forwarder.mark = proc, mark
    deadline: float | None = None
    try:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if forwarder.received is not None and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                logger.error("the ranks did not stop within %.0f s of the signal; killing them", grace_s)
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        forwarder.proc = None
        kill_until_gone(
            lambda table: find_trial_processes(mark, root=proc.pid, variable=MARK_ENV, table=table),
            grace_s=5.0,
            reap=[proc],
            what="run",
        )


def _environment(plan: RunPlan) -> dict[str, str]:
    env = dict(os.environ)
    env[EXPERIMENT_CONFIG_ENV] = str(plan.config_path)
    env[OUTPUT_DIR_ENV] = str(plan.output_dir)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if plan.launcher == "deepspeed":
        import torch

        if not torch.cuda.is_available():
            env["LOCAL_SIZE"] = str(plan.nproc)  # DeepSpeed counts CPU "devices" from it
    return env


def _next_attempt(output_dir: Path) -> None:
    """Count this run in ``determined_trial.json`` (``trial_run_id``), creating the ids on the first."""
    existed = (output_dir / TRIAL_FILE).exists()
    state = load_trial_state(output_dir, write=True)
    if existed:
        state["trial_run_id"] = state.get("trial_run_id", 1) + 1
        atomic_write_json(output_dir / TRIAL_FILE, state)


def execute(plan: RunPlan, *, grace_s: float = 60.0) -> int:
    """Run the plan, restarting failed runs; return the exit status. This process only."""
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    _next_attempt(plan.output_dir)
    try:
        record_hparams(plan.output_dir, plan.config)  # Determined's master samples every trial's values
    except ConfigError as err:
        logger.error("%s", err)
        return 2
    env = _environment(plan)
    forwarder = _Forwarder()
    try:
        attempt = 0
        while True:
            if attempt:
                _next_attempt(plan.output_dir)
            status = _run_once(plan, env, forwarder, grace_s=grace_s)
            if status == 0 or forwarder.received is not None:
                if forwarder.received is not None:
                    logger.info(
                        "stopped by %s (exit status %d); run the same command again to continue from "
                        "the latest checkpoint",
                        signal.Signals(forwarder.received).name,
                        status,
                    )
                return status
            if attempt >= plan.max_restarts:
                logger.error(
                    "the run failed with exit status %d; max_restarts=%d reached", status, plan.max_restarts
                )
                return status
            attempt += 1
            logger.warning(
                "the run failed with exit status %d; restart %d of %d, from the latest checkpoint",
                status,
                attempt,
                plan.max_restarts,
            )
    finally:
        forwarder.restore()


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (2: bad input, nothing started)."""
    parser = argparse.ArgumentParser(prog="python -m toolkit.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the experiment YAML (Determined's format)")
    parser.add_argument(
        "model_dir", help="the directory the entrypoint runs in (Determined's context directory)"
    )
    parser.add_argument("--output-dir", help="checkpoints, TensorBoard and metrics (default: runs/<name>)")
    parser.add_argument(
        "--grace", type=float, default=60.0, help="seconds the ranks get to stop after a signal"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: [toolkit.run] %(message)s")
    config_path, model_dir = Path(args.config), Path(args.model_dir)
    if not model_dir.is_dir():
        parser.error(f"MODEL_DIR={args.model_dir!r}: not a directory")
    if args.grace <= 0:
        parser.error(f"--grace={args.grace!r}: expected a number of seconds > 0")
    try:
        config = hparams.load_config(config_path)
        plan = plan_run(
            config,
            config_path=config_path,
            model_dir=model_dir,
            output_dir=Path(args.output_dir) if args.output_dir else None,
        )
    except (ConfigError, FileNotFoundError) as err:
        print(f"python -m toolkit.run: error: {err}", file=sys.stderr)
        return 2
    return execute(plan, grace_s=args.grace)


if __name__ == "__main__":
    sys.exit(main())
