"""A search's trials in flight on the free slots of this machine. Runner process only.

:func:`run_search` (called by :mod:`toolkit.run.cli`) runs up to :func:`concurrency` trials at once,
each in a thread of its own (:func:`toolkit.run.trial.execute`); the main thread alone changes the
search state. How: docs/design-determined.md#a-search-on-this-machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_int
from toolkit._files import atomic_write
from toolkit.errors import ConfigError
from toolkit.launch.procs import cpu_slots
from toolkit.launch.slots import SlotPool, Slots, device_ids
from toolkit.launch.trial_files import ACK_FILE, SEARCH_ACK_ENV, load_trial_state
from toolkit.run.plan import RunPlan
from toolkit.run.process import STOP_SIGNALS, Forwarder, check_slots
from toolkit.run.progress_line import HEARTBEAT_S, latest_report, progress_line, report_text
from toolkit.run.search_record import load_state, save_state
from toolkit.run.search_state import SearchState, TrialRecord
from toolkit.run.searcher_view import write_searcher_view, write_trial_hparams
from toolkit.run.searchers import best_trial, next_trial, planned_count
from toolkit.run.trial import execute
from toolkit.run.trial_reports import ReportWatcher, finish_trial

__all__ = ["POLL_S", "concurrency", "run_search"]

logger = logging.getLogger("toolkit.run")

#: How often the trials in flight are checked (their reports, their end).
POLL_S = 0.05


def concurrency(config: Mapping[str, Any], *, slots: int, nproc: int) -> int:
    """How many trials may run at once: the slots' share at ``nproc`` each, at most
    ``searcher.max_concurrent_trials`` (0 or absent: no limit of its own), at least 1. Pure.

    Example:
        >>> concurrency({"searcher": {"max_concurrent_trials": 2}}, slots=8, nproc=1)
        2
    """
    cap = max(slots // max(nproc, 1), 1)
    most = (config.get("searcher") or {}).get("max_concurrent_trials")
    return min(cap, most) if is_int(most) and most > 0 else cap


@dataclasses.dataclass
class _InFlight:
    trial: TrialRecord
    plan: RunPlan
    slots: Slots
    forwarder: Forwarder
    watcher: ReportWatcher
    thread: threading.Thread
    started: float = dataclasses.field(default_factory=time.monotonic)
    acked: int = -1
    status: int | None = None


class _Signals:
    """The runner's handlers: a stop signal is remembered and passed to every trial in flight."""

    def __init__(self, running: dict[int, _InFlight]) -> None:
        self.received: int | None = None
        self._running = running
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            logger.warning("received %s: passing it to the %d trial(s) in flight, which save and stop; "
                           "the same command continues the search", signal.Signals(signum).name,
                           len(self._running))
        self.received = self.received or signum
        for flight in list(self._running.values()):
            flight.forwarder.handle(signum)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _gpus() -> int:
    import torch  # already loaded by the CLI

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _trial_env(trial_dir: Path, held: Slots, *, threads: int) -> dict[str, str]:
    env = {SEARCH_ACK_ENV: str(trial_dir)}
    if held.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(device_ids(held.gpus).values())
    elif "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _ack(flight: _InFlight) -> None:
    """Tell the trial's chief how far its reports were read (after any stop was sent)."""
    if flight.watcher.offset != flight.acked:
        flight.plan.output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(flight.plan.output_dir / ACK_FILE, str(flight.watcher.offset))
        flight.acked = flight.watcher.offset


def run_search(plan: RunPlan, *, grace_s: float = 60.0, max_slots: int | None = None,
               echo: bool = True) -> int:
    """Run (or continue) the search of ``plan.config``; the exit status (0, or the last failed or paused
    trial's). Runner only. ``max_slots`` None: this machine's GPUs, or its cores; ``echo`` False
    (``--quiet``): the trials' lines go to their logs only.

    Raises:
        ConfigError: the record holds a search of another searcher section, space or seed, or a trial
            needs more slots than there are (nothing is started).
        CheckpointError: the search's record is not a search state (nothing is started)."""
    slots, gpus = _slots(plan, max_slots)  # before anything is written
    cap = concurrency(plan.config, slots=slots, nproc=plan.nproc)
    out = plan.output_dir
    out.mkdir(parents=True, exist_ok=True)
    state = load_state(out, plan.config)
    experiment_id = load_trial_state(out, write=False)["experiment_id"]
    pool = SlotPool(slots_per_trial=plan.nproc, gpus=tuple(range(slots)) if gpus else None)
    threads = max(1, cpu_slots() // slots)
    running: dict[int, _InFlight] = {}
    signals = _Signals(running)
    status = 0
    progress = _Progress(plan, cap)
    logger.info("searcher: up to %d trial(s) at once on %d slot(s), %d per trial", cap, slots, plan.nproc)
    try:
        while True:
            while signals.received is None and len(running) < cap and \
                    (trial := next_trial(state, plan.config)) is not None:
                flight = running[trial.index] = _start(plan, state, trial, pool, grace_s=grace_s,
                                                          experiment_id=experiment_id, threads=threads,
                                                          echo=echo)
                if signals.received is not None:  # it came while the trial was being started
                    flight.forwarder.handle(signals.received)
            if not running:
                break
            time.sleep(POLL_S)
            status = _poll(running, pool, state, plan, progress.durations) or status
            progress(running, state)
    finally:
        signals.restore()
        for flight in running.values():  # an exception in this thread: stop what runs, then leave
            flight.forwarder.handle(signal.SIGTERM)
        for flight in running.values():
            flight.thread.join()
    if signals.received is not None:
        logger.info("search paused; run the same command again to continue")
        return status
    best = best_trial(state, plan.config)
    logger.info("search done: %d trials; best %s", len(state.trials),
                json.dumps(best.summary()) if best else None)
    return status


def _slots(plan: RunPlan, max_slots: int | None) -> tuple[int, int]:
    """The slots the trials share, and this machine's GPUs; a ConfigError for a process count they
    cannot run."""
    check_slots(plan)
    gpus = _gpus()
    slots = max_slots or gpus or cpu_slots()
    if plan.nproc > slots:
        raise ConfigError(f"--max-slots={slots}: a trial needs {plan.nproc} slot(s) "
                          "(resources.slots_per_trial or the wrapper's --nproc_per_node); expected at least "
                          "that many")
    if gpus and slots > gpus:
        raise ConfigError(f"--max-slots={slots}: this machine has {gpus} GPU(s); expected at most {gpus}")
    return slots, gpus


class _Progress:
    """Logs :func:`_progress` every :data:`~toolkit.run.progress_line.HEARTBEAT_S` while trials run; keeps
    the durations of the trials that ended (``_poll`` adds them)."""

    def __init__(self, plan: RunPlan, cap: int) -> None:
        self.plan, self.cap, self.last = plan, cap, time.monotonic()
        self.durations: list[float] = []

    def __call__(self, running: Mapping[int, _InFlight], state: SearchState) -> None:
        if running and time.monotonic() - self.last >= HEARTBEAT_S:
            self.last = time.monotonic()
            logger.info("%s", _progress(running, state, self.plan, self.durations, self.cap))


def _progress(running: Mapping[int, _InFlight], state: SearchState, plan: RunPlan, durations: list[float],
              cap: int) -> str:
    """The progress line: each running trial's latest report, the trials left, a rough time left."""
    metric = (plan.config.get("searcher") or {}).get("metric")
    reports = [(f.trial.dir, report_text(latest_report(f.plan.output_dir / "metrics.jsonl"),
                                            metric=metric)) for f in running.values()]
    done = sum(t.ended for t in state.trials)
    planned = planned_count(state, plan.config)  # the one count of the search's trials
    now = time.monotonic()
    return progress_line(reports, done=done, to_start=max(planned - done - len(running), 0),
                         durations=durations, elapsed=[now - f.started for f in running.values()],
                         concurrency=cap)


def _poll(running: dict[int, _InFlight], pool: SlotPool, state: SearchState, plan: RunPlan,
          durations: list[float]) -> int:
    """One look at the trials in flight: their reports (the searcher's stops, the chiefs' answers),
    and those that ended, recorded and their slots freed (their durations added to ``durations``,
    their HParams and the searcher's view written); the exit status of the last that failed or
    paused with one (0: none)."""
    status = 0
    for index, flight in list(running.items()):
        if flight.watcher() and not flight.forwarder.searcher_stopped:  # the watcher logs it
            flight.forwarder.searcher_stop()
        _ack(flight)
        if flight.thread.is_alive():
            continue
        flight.thread.join()
        del running[index]
        pool.give_back(flight.slots)
        code = 1 if flight.status is None else flight.status  # None: the thread raised
        finish_trial(state, flight.trial, flight.watcher, flight.forwarder, code, flight.plan.output_dir)
        save_state(plan.output_dir, state, plan.config)
        durations.append(time.monotonic() - flight.started)
        metric = (plan.config.get("searcher") or {}).get("metric")
        write_trial_hparams(flight.plan.output_dir, flight.trial.hparams, metric=metric)
        write_searcher_view(plan.output_dir, state, plan.config)
        if flight.trial.state in ("ERROR", "PAUSED") and code:
            status = code
    return status


def _start(plan: RunPlan, state: SearchState, trial: TrialRecord, pool: SlotPool, *, grace_s: float,
           experiment_id: int, threads: int, echo: bool) -> _InFlight:
    """Start one trial's thread on free slots (marked RUNNING in the search's record first)."""
    out = plan.output_dir
    sub = plan.with_output_dir(out / trial.dir)
    trial.state = "RUNNING"
    save_state(out, state, plan.config)
    (sub.output_dir / ACK_FILE).unlink(missing_ok=True)  # an earlier run's: read afresh
    held = pool.take(trial_id=trial.index)
    forwarder = Forwarder(install=False)
    def save() -> None:  # a report changed the search: its record and the searcher's view
        save_state(out, state, plan.config)
        write_searcher_view(out, state, plan.config)

    watcher = ReportWatcher(state, trial, plan.config, sub.output_dir, save)
    logger.info("searcher: %s (trial %d) with %s%s", trial.dir, trial.index,
                json.dumps(trial.hparams), f" on GPUs {held.gpus}" if held.gpus else "")
    flight = _InFlight(trial, sub, held, forwarder, watcher, threading.Thread(target=lambda: None))

    def run() -> None:
        flight.status = execute(sub, grace_s=grace_s, forwarder=forwarder, hparams=trial.hparams,
                                hparams_seed=trial.seed, experiment_id=experiment_id,
                                extra_env=_trial_env(sub.output_dir, held, threads=threads),
                                label=trial.dir, echo=echo)

    flight.thread = threading.Thread(target=run, name=f"toolkit.run {trial.dir}", daemon=True)
    flight.thread.start()
    return flight
