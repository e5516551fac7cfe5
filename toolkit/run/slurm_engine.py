"""A search's trials as Slurm jobs (``python -m toolkit.run ... --slurm OPTIONS``). Runner only.

Called by :mod:`toolkit.run.cli`. What a user sees:
docs/multi-node.md#a-search-as-slurm-jobs-toolkitrun-slurm; how: docs/design-determined.md#slurm-jobs.
:func:`_command` is the only place that starts a Slurm client.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from toolkit._checks import is_int
from toolkit._files import atomic_write, atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.errors import ConfigError
from toolkit.launch.trial_files import ACK_FILE, SEARCH_ACK_ENV, load_trial_state
from toolkit.run.plan import RunPlan
from toolkit.run.process import STOP_SIGNALS, Forwarder
from toolkit.run.search_record import load_state, save_state
from toolkit.run.search_state import SearchState, TrialRecord
from toolkit.run.searchers import best_trial, next_trial
from toolkit.run.slurm_argv import (
    ACTIVE_STATES,
    RESULT_FILE,
    SPEC_FILE,
    job_script,
    parse_squeue,
    sbatch_argv,
    scancel_argv,
    squeue_argv,
)
from toolkit.run.trial_reports import ReportWatcher, finish_trial

__all__ = ["CANCEL_MARGIN_S", "COMMAND_TIMEOUT_S", "POLL_S", "SQUEUE_GIVE_UP_S", "SlurmError",
           "check_submission", "run_slurm_search"]

logger = logging.getLogger("toolkit.run")

#: How often the jobs' states and the trials' reports are read, in seconds.
POLL_S = 1.0
#: The most one sbatch/squeue/scancel may take.
COMMAND_TIMEOUT_S = 60.0
#: ``squeue`` failing for this long in a row ends the search (its jobs are cancelled).
SQUEUE_GIVE_UP_S = 600.0
#: After a pause, jobs still there ``grace`` + this many seconds later are cancelled.
CANCEL_MARGIN_S = 30.0


class SlurmError(RuntimeError):
    """A Slurm command failed (sbatch refused a job, squeue kept failing)."""


def _command(argv: list[str]) -> str:
    """Run one Slurm client command; its stdout. Raises SlurmError when it fails or times out."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SlurmError(f"{shlex.join(argv)}: {err}") from None
    if done.returncode != 0:
        raise SlurmError(f"{shlex.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def check_submission(options: list[str], *, nproc: int) -> None:
    """Ask Slurm whether a trial's job with ``options`` would be accepted (``sbatch --test-only``);
    nothing is submitted. Runner only.

    Raises:
        ConfigError: naming ``--slurm``: sbatch is not installed, or refused the options (its message).
    """
    argv = sbatch_argv(options, script=Path("-"), job_name="toolkit-check", output=Path(os.devnull),
                       chdir=Path.cwd(), nproc=nproc)
    argv = [argv[0], "--test-only", *argv[1:-1], "--wrap=true"]
    try:
        _command(argv)
    except SlurmError as err:
        raise ConfigError(f"--slurm={shlex.join(options)!r}: Slurm would not accept a trial's job: {err}; "
                          "expected sbatch options this cluster accepts (and sbatch on PATH)") from None


class _JobForwarder(Forwarder):
    """The searcher's stop and the pause as signals to the trial's job (no handlers of its own)."""

    def __init__(self) -> None:
        super().__init__(install=False)
        self.job: str | None = None

    def handle(self, signum: int, frame: Any = None) -> None:
        self.received = self.received or signum
        self._send(signum)

    def searcher_stop(self) -> None:
        self.searcher_stopped = True
        self.searcher_sent = self._send(signal.SIGUSR1)

    def _send(self, signum: int) -> bool:
        if self.job is None:
            return False
        try:
            _command(scancel_argv(self.job, signal_name="USR1"))
        except SlurmError as err:  # a pending job has no step to signal: cancelled instead
            logger.info("%s; cancelling the job", err)
            try:
                _command(scancel_argv(self.job))
            except SlurmError as again:
                logger.warning("%s", again)
            return False
        return True


@dataclasses.dataclass
class _Job:
    trial: TrialRecord
    plan: RunPlan
    forwarder: _JobForwarder
    watcher: ReportWatcher
    state: str = "PENDING"
    acked: int = -1
    failures: int = 0


class _Signals:
    """The runner's handlers: a stop signal is remembered; the main loop pauses the jobs."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _submit(job: _Job, options: list[str], *, grace_s: float, experiment_id: int) -> None:
    """Write the trial's spec and script, submit its job, record the job id."""
    out = job.plan.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).unlink(missing_ok=True)
    (out / ACK_FILE).unlink(missing_ok=True)
    job.acked = -1
    spec = {"config": str(job.plan.config_path), "model_dir": str(job.plan.model_dir), "output_dir": str(out),
            "grace_s": grace_s, "hparams": job.trial.hparams, "seed": job.trial.seed,
            "experiment_id": experiment_id, "env": {SEARCH_ACK_ENV: str(out)}}
    atomic_write_json(out / SPEC_FILE, spec)
    script = out / "slurm_job.sh"
    atomic_write(script, job_script(sys.executable, out / SPEC_FILE, trial=job.trial.dir))
    argv = sbatch_argv(options, script=script, job_name=f"{job.plan.config.get('name') or 'toolkit'}."
                       f"{job.trial.dir}", output=out / "slurm-%j.out", chdir=job.plan.model_dir,
                       nproc=job.plan.nproc)
    job.forwarder.job = _command(argv).strip().split(";")[0]
    job.state = "PENDING"
    job.trial.slurm_jobs.append(job.forwarder.job)
    logger.info("searcher: %s (trial %d) with %s as Slurm job %s", job.trial.dir, job.trial.index,
                job.trial.hparams, job.forwarder.job)


def _result(job: _Job) -> dict[str, Any] | None:
    try:
        result = load_json(job.plan.output_dir / RESULT_FILE, what="slurm trial result")
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and is_int(result.get("status")) else None


def _ended(job: _Job, result: dict[str, Any] | None, *, pausing: bool) -> int | None:
    """How a job that ended leaves its trial: None (submit it again) or the trial's exit status."""
    fwd = job.forwarder
    if result is None:
        if pausing or fwd.searcher_sent:
            return 0
        job.failures += 1
        if job.failures > job.plan.max_restarts:
            logger.error("%s: Slurm job %s ended without the trial's result (see %s); max_restarts=%d "
                         "reached",
                         job.trial.dir, fwd.job, job.plan.output_dir / f"slurm-{fwd.job}.out",
                         job.plan.max_restarts)
            return 1
        logger.warning("%s: Slurm job %s ended without the trial's result (see its slurm-%s.out); submitting "
                       "it again (%d of max_restarts=%d)", job.trial.dir, fwd.job, fwd.job, job.failures,
                       job.plan.max_restarts)
        return None
    if result.get("received") and pausing:
        # Stopped by the pause, whatever its exit status: a rank may end by the stop signal itself
        # (one that has not installed watch_preemption yet, or a script with handlers of its own).
        # The same command continues it from its latest checkpoint, as after a preemption; a real
        # crash shows again then.
        return 0
    if result.get("received") and not fwd.searcher_stopped:
        logger.info("%s: Slurm job %s stopped by %s (preempted) after saving; submitting it again, to "
                    "continue from its checkpoint", job.trial.dir, fwd.job, result["received"])
        return None
    return int(result["status"])


def _pause(jobs: dict[int, _Job], signum: int) -> None:
    logger.warning("received %s: stopping the %d trial job(s), which save and stop; the same command "
                   "continues the search", signal.Signals(signum).name, len(jobs))
    for job in jobs.values():
        if job.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD") and job.forwarder.job is not None:
            job.forwarder.received = signum
            _command_quiet(scancel_argv(job.forwarder.job))
        else:
            job.forwarder.handle(signum)


def _states(last_ok: list[float]) -> dict[str, str] | None:
    try:
        states = parse_squeue(_command(squeue_argv()))
    except SlurmError as err:
        if time.monotonic() - last_ok[0] > SQUEUE_GIVE_UP_S:
            raise SlurmError(f"squeue failed for {SQUEUE_GIVE_UP_S:.0f} s; last: {err}") from None
        logger.warning("%s; trying again", err)
        return None
    last_ok[0] = time.monotonic()
    return states


def _adopt(state: SearchState, plan: RunPlan, save: Callable[[], None]) -> dict[int, _Job]:
    """The jobs a killed ``toolkit.run`` left running or queued: followed again, not submitted twice."""
    waiting = [t for t in state.trials if t.state == "PAUSED" and t.slurm_jobs]
    if not waiting:
        return {}
    queued = parse_squeue(_command(squeue_argv()))
    jobs = {}
    for trial in waiting:
        job_id = trial.slurm_jobs[-1]
        if queued.get(job_id) in ACTIVE_STATES:
            sub = plan.with_output_dir(plan.output_dir / trial.dir)
            job = jobs[trial.index] = _Job(trial, sub, _JobForwarder(),
                                           ReportWatcher(state, trial, plan.config, sub.output_dir, save),
                                           state=queued[job_id])
            job.forwarder.job = job_id
            trial.state = "RUNNING"
            logger.info("%s: following Slurm job %s (%s), left by an earlier toolkit.run", trial.dir,
                        job_id, queued[job_id])
    if jobs:
        save()
    return jobs


def run_slurm_search(plan: RunPlan, options: list[str], *, grace_s: float = 60.0) -> int:
    """Run (or continue) the search of ``plan.config`` as Slurm jobs; the exit status. Runner only.

    Raises:
        ConfigError, CheckpointError: as :func:`toolkit.run.scheduler.run_search` (nothing submitted).
        SlurmError: sbatch refused the first job (nothing else submitted).
    """
    out = plan.output_dir
    out.mkdir(parents=True, exist_ok=True)
    state = load_state(out, plan.config)
    experiment_id = load_trial_state(out, write=False)["experiment_id"]
    most = (plan.config.get("searcher") or {}).get("max_concurrent_trials")
    cap = most if is_int(most) and most > 0 else 2**31

    def save() -> None:
        save_state(out, state, plan.config)

    jobs = _adopt(state, plan, save)
    signals = _Signals()
    status, paused_at, last_ok = 0, None, [time.monotonic()]
    try:
        while True:
            while signals.received is None and len(jobs) < cap and \
                    (trial := next_trial(state, plan.config)) is not None:
                trial.state = "RUNNING"
                sub = plan.with_output_dir(out / trial.dir)
                watcher = ReportWatcher(state, trial, plan.config, sub.output_dir, save)
                job = _Job(trial, sub, _JobForwarder(), watcher)
                jobs[trial.index] = job
                _submit(job, options, grace_s=grace_s, experiment_id=experiment_id)
                save()
            if not jobs:
                break
            time.sleep(POLL_S)
            if signals.received is not None and paused_at is None:
                paused_at = time.monotonic()
                _pause(jobs, signals.received)
            if paused_at is not None and time.monotonic() - paused_at > grace_s + CANCEL_MARGIN_S:
                for job in jobs.values():
                    if job.forwarder.job is not None:
                        _command_quiet(scancel_argv(job.forwarder.job))
                paused_at = float("inf")
            states = _states(last_ok)
            if states is not None:
                status = _poll(jobs, states, state, plan, options, grace_s=grace_s,
                               experiment_id=experiment_id, pausing=signals.received is not None) or status
    finally:
        signals.restore()
        if jobs:  # an exception here (squeue gone): nothing of the search keeps running
            for job in jobs.values():
                if job.forwarder.job is not None:
                    _command_quiet(scancel_argv(job.forwarder.job))
                job.trial.state = "PAUSED"
            save()
    if signals.received is not None:
        logger.info("search paused; run the same command again to continue")
        return status
    best = best_trial(state, plan.config)
    logger.info("search done: %d trials; best %s", len(state.trials), best.summary() if best else None)
    return status


def _command_quiet(argv: list[str]) -> None:
    try:
        _command(argv)
    except SlurmError as err:
        logger.warning("%s", err)


def _poll(jobs: dict[int, _Job], states: dict[str, str], state: SearchState, plan: RunPlan,
          options: list[str], *, grace_s: float, experiment_id: int, pausing: bool) -> int:
    """One look at the jobs: the trials' reports (ASHA's stops, the chiefs' answers), and the jobs that
    ended, recorded or submitted again; the exit status of the last that failed (0: none)."""
    status = 0
    for index, job in list(jobs.items()):
        if job.watcher() and not job.forwarder.searcher_stopped:
            job.forwarder.searcher_stop()
        if job.watcher.offset != job.acked:
            atomic_write(job.plan.output_dir / ACK_FILE, str(job.watcher.offset))
            job.acked = job.watcher.offset
        now = states.get(job.forwarder.job or "", "GONE")
        if now != job.state:
            logger.info("%s: Slurm job %s %s", job.trial.dir, job.forwarder.job, now)
            job.state = now
        if now in ACTIVE_STATES:
            continue
        result = _result(job)
        if result is not None and not result.get("received"):
            job.forwarder.received = None  # it ended by itself before a pause's signal reached it
        code = _ended(job, result, pausing=pausing)
        if code is None:
            if pausing:
                code = 0
            else:
                _submit(job, options, grace_s=grace_s, experiment_id=experiment_id)
                save_state(plan.output_dir, state, plan.config)
                continue
        del jobs[index]
        finish_trial(state, job.trial, job.watcher, job.forwarder, code, job.plan.output_dir)
        save_state(plan.output_dir, state, plan.config)
        if job.trial.state in ("ERROR", "PAUSED") and code:
            status = code
    return status
