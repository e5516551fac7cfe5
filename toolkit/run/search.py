"""A hyperparameter search under ``python -m toolkit.run``: its trials one after another. Runner only.

The decisions are :mod:`toolkit.compat.determined.search`'s; this shell runs each trial with
:func:`toolkit.run.trial.execute` in ``<output_dir>/trial-NNNN`` (its own trial id, the
experiment's id, its values recorded for every rank), and keeps ``<output_dir>/search.json``::

    {"searcher": "adaptive_asha", "seed": 123, "metric": "x", "smaller_is_better": true,
     "searcher_config": {...}, "hyperparameters": {...}, "experiment_seed": 123,
     "trials": [{"index": 0, "dir": "trial-0000", "trial_id": 5123, "hparams": {...},
                 "seed": 123000369, "state": "COMPLETED", "metric": 700, "time": 100,
                 "stopped_early": false}, ...],
     "asha": {"rungs": [25, 100], ...}, "best": {...}}

``metric`` is the trial's last reported validation value of ``searcher.metric`` (a report whose
metric or ``time_metric`` is not a number is skipped, with a warning; a NaN or infinite metric
makes it null: the trial diverged, ranks last under ASHA and is never the best); ``seed`` the one its
values were drawn with (also ``hparams_seed`` in the trial's ``determined_trial.json``);
``stopped_early`` that the searcher's stop reached the trial before it ended by itself. A rerun
refuses (exit 2) a YAML whose searcher section, hyperparameters or experiment seed differ from
those recorded. The file is rewritten when something in it changed. Under ASHA the
shell reads each validation line of the running trial's ``metrics.jsonl`` (written at once by
``report_validation_metrics``) and, when the searcher says so, stops the trial through the
preemption signal: the script saves and exits 0 as on a preemption. A SIGTERM/SIGINT/SIGUSR1 to
the runner pauses the current trial and ends the command; the same command again resumes that
trial from its checkpoint and continues the search. Exit status: 0, or the last failed trial's.

Example::

    python -m toolkit.run 3_hpsearch.yaml . --output-dir runs/hp    # searcher: adaptive_asha
    cat runs/hp/search.json
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Any, Callable, Mapping

from toolkit._checks import is_number
from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.compat.determined import search
from toolkit.compat.determined.info import load_trial_state
from toolkit.errors import CheckpointError, ConfigError
from toolkit.run.plan import RunPlan
from toolkit.run.process import Forwarder, check_slots
from toolkit.run.trial import execute

__all__ = ["SUMMARY", "run_search"]

logger = logging.getLogger("toolkit.run")

SUMMARY = search.SEARCH_FILE  # where the trials find it (get_experiment_best_validation)


def _validations(path: Path, offset: int) -> list[tuple[dict[str, Any], int]]:
    """Complete validation lines of ``metrics.jsonl`` after ``offset``: (metrics, offset after the line)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return []
    lines, end = [], offset
    for raw in data[: data.rfind(b"\n") + 1].splitlines(keepends=True):
        end += len(raw)
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("group") == "validation":
            lines.append((line.get("metrics") or {}, end))
    return lines


class _Watcher:
    """Feeds the running trial's validation reports to the searcher; True: stop the trial (ASHA).

    Every report sets the trial's ``metric`` and ``time`` (the last reported values). While the
    trial runs, a report that ASHA stops the trial at ends the poll (True); the reports after it
    are read later. :meth:`finish` reads the rest after the trial ended: they reach ASHA only
    when no stop was sent (the trial ran on), and a rung decision there is no stop.
    """

    def __init__(self, state: dict[str, Any], trial: dict[str, Any], config: Mapping[str, Any],
                 trial_dir: Path, save: Callable[[], None]) -> None:
        self.state, self.trial, self.config, self.save = state, trial, config, save
        self.path, self.offset = trial_dir / "metrics.jsonl", 0
        s = config.get("searcher") or {}
        self.metric, self.time_metric = str(s.get("metric")), str(s.get("time_metric"))
        self.asha = state["searcher"] == "adaptive_asha"
        self.stop = False

    def __call__(self) -> bool:
        if not self.stop:
            self._read(feed=True, final=False)
        return self.stop

    def finish(self, *, stop_sent: bool) -> None:
        """Read the reports written since the last poll (``stop_sent``: the searcher's stop reached it)."""
        self._read(feed=not stop_sent, final=True)

    def _read(self, *, feed: bool, final: bool) -> None:
        changed = False
        for metrics, end in _validations(self.path, self.offset):
            self.offset, changed = end, True
            if self.metric not in metrics:
                continue
            value, step = metrics[self.metric], metrics.get(self.time_metric)
            if not is_number(value) or (self.asha and not (is_number(step) and math.isfinite(step))):
                logger.warning("%s: validation report skipped: searcher.metric %r=%r, time_metric %r=%r "
                               "(expected numbers, a finite time)", self.trial["dir"], self.metric, value,
                               self.time_metric, step)
                continue
            if not math.isfinite(value):
                logger.warning("%s: searcher.metric %r=%r is not finite: the trial ranks last and is never "
                               "the best", self.trial["dir"], self.metric, value)
            self.trial["metric"] = value if math.isfinite(value) else None
            if not self.asha:
                continue
            self.trial["time"] = step
            if feed and search.asha_report(self.state, self.trial["index"], time_step=float(step or 0),
                                           metric=float(value), config=self.config) and not final:
                self.stop = True
                logger.info("searcher: stopping %s at %s=%s: below the top of its rung", self.trial["dir"],
                            self.time_metric, step)
                break
        if changed:
            self.save()


def _load(out: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """The search state of ``out/search.json`` (a fresh one when absent).

    Raises:
        ConfigError: the YAML's searcher section, hyperparameters or experiment seed changed.
        CheckpointError: the file is not a search state.
    """
    path = out / SUMMARY
    try:
        state = load_json(path, what="search record")
    except FileNotFoundError:
        seed = (config.get("reproducibility") or {}).get("experiment_seed")
        seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
        return search.new_state(config, seed=seed)
    except ValueError as err:  # the loader's ConfigError: malformed, not UTF-8, over a bound
        raise CheckpointError(f"{path} is not valid JSON ({err}); delete it to start the search over, or "
                              "use a new --output-dir") from None
    if not (isinstance(state, dict) and isinstance(state.get("trials"), list) and "seed" in state):
        raise CheckpointError(f"{path} is not a search state (expected an object with 'seed' and 'trials'); "
                              "delete it to start the search over, or use a new --output-dir")
    changes = search.config_changes(state, config)
    if changes:
        raise ConfigError([f"{c} (recorded in {path}); continuing would mix two searches: use a new "
                           "--output-dir for a changed search" for c in changes])
    for trial in state["trials"]:
        if trial["state"] == "RUNNING":  # the runner itself was killed: resume the trial
            trial["state"] = "PAUSED"
    return state


def _save(out: Path, state: dict[str, Any], config: Mapping[str, Any]) -> None:
    s = config.get("searcher") or {}
    summary = dict(state, metric=s.get("metric"), smaller_is_better=s.get("smaller_is_better", True),
                   best=search.best_trial(state, config))
    atomic_write_json(out / SUMMARY, summary)


def _stopped_early(state: Mapping[str, Any], trial: Mapping[str, Any], forwarder: Forwarder) -> bool:
    """The searcher's stop reached the run before it ended by itself (not at max_time)."""
    if not forwarder.searcher_sent:
        return False
    rungs = (state.get("asha") or {}).get("rungs") or []
    return not (rungs and trial["time"] is not None and trial["time"] >= rungs[-1])


def _run_trial(plan: RunPlan, state: dict[str, Any], trial: dict[str, Any], forwarder: Forwarder,
               *, grace_s: float, experiment_id: int) -> int:
    out = plan.output_dir
    sub = plan.with_output_dir(out / trial["dir"])
    trial["state"] = "RUNNING"
    trial.setdefault("seed", search.trial_seed(state, trial["index"]))
    _save(out, state, plan.config)
    watcher = _Watcher(state, trial, plan.config, sub.output_dir, lambda: _save(out, state, plan.config))
    logger.info("searcher: %s (trial %d) with %s", trial["dir"], trial["index"], json.dumps(trial["hparams"]))
    forwarder.new_trial()
    status = execute(sub, grace_s=grace_s, forwarder=forwarder, watch=watcher, hparams=trial["hparams"],
                     hparams_seed=trial["seed"], experiment_id=experiment_id)
    watcher.finish(stop_sent=forwarder.searcher_sent)  # the reports written since the last poll
    trial["stopped_early"] = _stopped_early(state, trial, forwarder)
    trial["trial_id"] = load_trial_state(sub.output_dir, write=False)["trial_id"]
    trial["exit_status"] = status
    if forwarder.received is not None:
        trial["state"] = "PAUSED"
    elif status != 0 and trial["stopped_early"]:
        logger.warning("%s exited with status %d after the searcher's stop; counted as stopped early",
                       trial["dir"], status)
        trial["state"] = "COMPLETED"
    else:
        trial["state"] = "COMPLETED" if status == 0 else "ERROR"
    _save(out, state, plan.config)
    return status


def run_search(plan: RunPlan, *, grace_s: float = 60.0) -> int:
    """Run (or continue) the search of ``plan.config``; the exit status. Runner only.

    Raises:
        ConfigError: ``search.json`` holds a search started from another searcher section,
            search space or experiment seed, or the trials' process count is more than this
            machine runs (nothing is started).
        CheckpointError: ``search.json`` is not a search state (nothing is started).
    """
    check_slots(plan)  # before anything is written
    out = plan.output_dir
    out.mkdir(parents=True, exist_ok=True)
    state = _load(out, plan.config)
    experiment_id = load_trial_state(out, write=False)["experiment_id"]
    forwarder = Forwarder()
    failed = 0
    try:
        while forwarder.received is None and (trial := search.next_trial(state, plan.config)) is not None:
            status = _run_trial(plan, state, trial, forwarder, grace_s=grace_s, experiment_id=experiment_id)
            if trial["state"] == "ERROR":
                failed = status
            if forwarder.received is not None:
                logger.info("search paused at %s; run the same command again to continue", trial["dir"])
                return status
    finally:
        forwarder.restore()
    best = search.best_trial(state, plan.config)
    logger.info("search done: %d trials; best %s", len(state["trials"]),
                json.dumps({k: best[k] for k in ("dir", "hparams", "metric")}) if best else None)
    return failed
