"""One trial of ``python -m toolkit.run``: its ids and values recorded, its runs and restarts. Runner only.

Called by :mod:`toolkit.run.cli` (a single run), :mod:`toolkit.run.scheduler` and
:mod:`toolkit.run.slurm_job`. Restarts, the stop record and the logs:
docs/design-determined.md#one-run-processes-and-signals.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any, Mapping

from toolkit._files import atomic_write_json
from toolkit.checkpoint.stop_record import STOP_FILE, STOP_RECORD_ENV, StopRecord, read_stop_record
from toolkit.errors import CheckpointError, ConfigError
from toolkit.launch.output import OutputPump
from toolkit.launch.trial_files import TRIAL_FILE, load_trial_state, record_hparams
from toolkit.run.plan import RunPlan
from toolkit.run.process import Forwarder, check_slots, environment, run_once

__all__ = ["LOGS_DIR", "RESTART_BACKOFF_MAX_S", "RESTART_BACKOFF_S", "execute", "restart_delay"]

logger = logging.getLogger("toolkit.run")

#: The pause before the first restart, in seconds; each further restart waits twice as long ...
RESTART_BACKOFF_S = 1.0
#: ... up to this.
RESTART_BACKOFF_MAX_S = 30.0
#: Under a trial's output directory: its logs (:mod:`toolkit.launch.output`).
LOGS_DIR = "logs"


def restart_delay(restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...): 1, 2, 4, ... at most 30. Pure."""
    return min(RESTART_BACKOFF_S * 2.0 ** min(max(restart - 1, 0), 32), RESTART_BACKOFF_MAX_S)


def _pause(seconds: float, forwarder: Forwarder) -> None:
    """Sleep ``seconds``, or until the forwarder receives a signal."""
    end = time.monotonic() + seconds
    while forwarder.received is None and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))


def stop_record_of(output_dir: Path) -> StopRecord | None:
    """The stop record the last run's ranks left in ``output_dir`` (None: they did not stop for a
    preemption; a damaged record is logged and counts as none). Runner only."""
    try:
        return read_stop_record(output_dir / STOP_FILE)
    except CheckpointError as err:
        logger.error("%s", err)
        return None


def _run_once(plan: RunPlan, env: dict[str, str], forwarder: Forwarder, grace_s: float,
              output: OutputPump, who: str) -> int | None:
    """One run; its exit status, or None (said) when its ranks left the stop record: a preemption."""
    env[STOP_RECORD_ENV] = str(plan.output_dir / STOP_FILE)
    (plan.output_dir / STOP_FILE).unlink(missing_ok=True)  # a record is this run's own
    output.start()
    try:
        status = run_once(plan, env, forwarder=forwarder, grace_s=grace_s, output=output)
    finally:
        output.stop()  # read to the end: its last lines are this run's
    stopped = stop_record_of(plan.output_dir)
    if stopped is None:
        return status
    where = f" from {stopped.checkpoint_dir} ({stopped.tag})" if stopped.resumable else ""
    logger.info("%sthe ranks stopped for a preemption (%s) at step %s (launcher exit status %d); run "
                "the same command again to continue%s", who, stopped.cause, stopped.steps_completed, status,
                where)
    return None


def _next_attempt(output_dir: Path, experiment_id: int | None = None) -> None:
    """Count this run in ``determined_trial.json`` (``trial_run_id``), creating the ids on the first."""
    existed = (output_dir / TRIAL_FILE).exists()
    state = load_trial_state(output_dir, write=True)
    if existed:
        state["trial_run_id"] = state.get("trial_run_id", 1) + 1
    elif experiment_id is not None:
        state["experiment_id"] = experiment_id  # a search's trials share their experiment's id
    if existed or experiment_id is not None:
        atomic_write_json(output_dir / TRIAL_FILE, state)


def execute(
    plan: RunPlan,
    *,
    grace_s: float = 60.0,
    forwarder: Forwarder | None = None,
    hparams: Mapping[str, Any] | None = None,
    hparams_seed: int | None = None,
    experiment_id: int | None = None,
    extra_env: Mapping[str, str] | None = None,
    label: str | None = None,
    echo: bool = True,
) -> int:
    """Run the plan, restarting failed runs; the exit status. Runner only. A search passes the trial's
    ``forwarder``, ``hparams`` and their ``hparams_seed``, ``experiment_id``, ``extra_env`` and ``label``
    (its console name; None: lines named by rank alone); ``echo`` False: lines to the log only. A signal
    before a run starts nothing (0); a process count this machine cannot run writes nothing (2)."""
    if forwarder is not None and forwarder.received is not None:
        return 0  # stopped before it started (a search's next trial): nothing counted, nothing run
    try:
        check_slots(plan)
    except ConfigError as err:
        logger.error("%s", err)
        return 2
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    _next_attempt(plan.output_dir, experiment_id)
    try:  # as Determined's master samples
        record_hparams(plan.output_dir, plan.config, values=hparams, seed=hparams_seed)
    except ConfigError as err:
        logger.error("%s", err)
        return 2
    env = environment(plan, extra=extra_env)
    own = forwarder is None
    forwarder = forwarder or Forwarder()
    try:
        return _runs(plan, env, forwarder=forwarder, grace_s=grace_s, label=label, echo=echo)
    finally:
        if own:
            forwarder.restore()


def _runs(plan: RunPlan, env: dict[str, str], *, forwarder: Forwarder, grace_s: float, label: str | None,
          echo: bool) -> int:
    """The runs of one trial, a failed one restarted up to ``max_restarts`` times; the last status."""
    who = f"{label}: " if label else ""
    attempt = 0
    while True:
        if attempt:
            _next_attempt(plan.output_dir)
        output = OutputPump(plan.output_dir / LOGS_DIR, label=label, echo=echo, fresh=False)
        status = _run_once(plan, env, forwarder, grace_s, output, who)  # None: a preemption's stop
        if status is None or status == 0 or forwarder.stopping:
            if forwarder.received is not None and status is not None:
                name = signal.Signals(forwarder.received).name
                logger.info("%sstopped by %s (exit status %d); run the same command again to continue "
                            "from the latest checkpoint", who, name, status)
            return status or 0
        failed = output.failure_text(f"{who}the run failed with exit status {status}")
        if attempt >= plan.max_restarts:
            logger.error("%s; max_restarts=%d reached", failed, plan.max_restarts)
            return status
        attempt += 1
        delay = restart_delay(attempt)
        logger.warning("%s\nrestart %d of %d in %.0f s, from the latest checkpoint", failed, attempt,
                       plan.max_restarts, delay)
        _pause(delay, forwarder)
