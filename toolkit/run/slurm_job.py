"""One trial of a ``toolkit.run --slurm`` search inside its Slurm job (``toolkit.run.slurm_job SPEC``).

The job's ``srun`` step runs it (:func:`toolkit.run.slurm_argv.job_script`): the trial as
``toolkit.run`` runs one locally (:func:`toolkit.run.trial.execute`), then ``slurm_result.json``.
Runner process only. The signals inside a step: docs/design-determined.md#slurm-jobs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.config.hyperparameters import load_config
from toolkit.run.plan import plan_run
from toolkit.run.process import SHIELD_USR1_ENV, STOP_SIGNALS, Forwarder
from toolkit.run.slurm_argv import RESULT_FILE
from toolkit.run.trial import execute

__all__ = ["main"]

logger = logging.getLogger("toolkit.run")


class _StepForwarder(Forwarder):
    """Passes SIGUSR1 on to the ranks as SIGTERM: a rank that has not installed ``watch_preemption`` yet
    ignores SIGUSR1 (inherited from the shielded launcher) but ends on SIGTERM, so the stop is never lost."""

    def _send(self, signum: int) -> bool:
        return super()._send(signal.SIGTERM if signum == signal.SIGUSR1 else signum)


def main(argv: list[str] | None = None) -> int:
    """Run the trial of the spec file ``argv[0]``; its exit status. Runner only (inside the job)."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: [toolkit.run slurm job] %(message)s")
    spec = load_json(Path(args[0]), what="slurm trial spec")
    config_path = Path(spec["config"])
    plan = plan_run(load_config(config_path), config_path=config_path,
                    model_dir=Path(spec["model_dir"]), output_dir=Path(spec["output_dir"]))
    forwarder = _StepForwarder()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))  # blocked by the job script until now
    try:
        status = execute(plan, grace_s=float(spec["grace_s"]), forwarder=forwarder, hparams=spec["hparams"],
                         hparams_seed=spec["seed"], experiment_id=spec["experiment_id"],
                         extra_env={**spec["env"], SHIELD_USR1_ENV: "1"})
    finally:
        forwarder.restore()
    received = signal.Signals(forwarder.received).name if forwarder.received is not None else None
    atomic_write_json(plan.output_dir / RESULT_FILE,
                      {"status": status, "received": received, "job": os.environ.get("SLURM_JOB_ID")})
    return status


if __name__ == "__main__":
    sys.exit(main())
