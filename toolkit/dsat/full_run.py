"""``--run-full-experiment``: train with the best config found, as a normal (non-trial) run.

Rank 0 only: runs in the autotuner's process and launches the entrypoint once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.config.experiment import max_length_steps
from toolkit.dsat.contract import trial_hparams
from toolkit.dsat.execution.multihost_argv import with_config_flag
from toolkit.dsat.execution.settings import CONFIG_READS_ENV, CPU_ALLOCATOR_ENV
from toolkit.dsat.trial.engine_hook import APPLY_ENV
from toolkit.dsat.trial.site import site_pythonpath
from toolkit.dsat.tuning_plan import Plan
from toolkit.launch.argv import LOOPBACK, build_trial_argv
from toolkit.launch.procs import free_port, run_to_completion
from toolkit.runtime.ds_shm import remove_buffers
from toolkit.runtime.trial_env import EXPERIMENT_CONFIG_ENV, TRIAL_HPARAMS_ENV

if TYPE_CHECKING:  # the orchestrator imports this module's callers; no cycle at run time
    from toolkit.dsat.orchestrator import SearchOutcome

__all__ = ["run_full_experiment", "FULL_RUN_TIMEOUT_S"]

#: The full run is a real training job; it is still never waited on without a limit.
FULL_RUN_TIMEOUT_S = 7 * 24 * 3600.0


def run_full_experiment(plan: Plan, outcome: SearchOutcome, *, say: Callable[[str], None] = print,
                        timeout_s: float = FULL_RUN_TIMEOUT_S) -> int:
    """Launch the entrypoint once with ``best_ds_config.json`` where the trials had theirs, for
    ``searcher.max_length`` steps; return its exit status. The last line repeats a global batch change
    (``outcome.batch_notice``). Rank 0 only (docs/design-dsat-runner.md#the-autotuners-process)."""
    directory = plan.output_dir / "full_experiment"
    directory.mkdir(parents=True, exist_ok=True)
    best_path = plan.output_dir / "best_ds_config.json"
    best_config = load_json(best_path, what="best DeepSpeed config")
    atomic_write_json(directory / "hparams.json",
                      trial_hparams(plan.hparams, ds_config=best_config, ds_config_path=best_path))
    steps = max_length_steps(plan.experiment)
    port = free_port()
    argv = build_trial_argv(with_config_flag(plan.runner.entrypoint, best_path),
                            launcher=plan.runner.launcher, nproc=plan.runner.slots_per_trial,
                            master_port=port)
    env = {TRIAL_HPARAMS_ENV: str(directory / "hparams.json"), EXPERIMENT_CONFIG_ENV: str(plan.config_path),
           APPLY_ENV: str(best_path), "PYTHONPATH": site_pythonpath(os.environ.get("PYTHONPATH"))}
    if not plan.runner.merge_config:
        del env[APPLY_ENV]
    elif plan.runner.config_files:  # a script that reads its own config file reads the best config
        env[CONFIG_READS_ENV] = os.pathsep.join(str(p) for p in plan.runner.config_files)
    if plan.runner.memory_per_slot is not None:  # on CPU, the allocator the trials measured with
        env.update({key: os.environ.get(key, value) for key, value in CPU_ALLOCATOR_ENV})
    say(f"full experiment: {' '.join(argv)} ({steps or 'script-defined'} steps, train_batch_size "
        f"{best_config.get('train_batch_size')} ({plan.global_batch.policy}); logs in {directory})")
    code = run_to_completion(argv, cwd=Path(plan.runner.model_dir), env=env, log_dir=directory,
                             timeout_s=timeout_s, nproc=plan.runner.slots_per_trial)
    remove_buffers(addr=LOOPBACK, port=port)  # what DeepSpeed leaves in /dev/shm (toolkit.runtime.ds_shm)
    say(f"full experiment exited with status {code}")
    if outcome.batch_notice:
        say(outcome.batch_notice)
    return code
