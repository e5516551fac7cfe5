"""A hyperparameter search under ``python -m toolkit.run``: its trials one after another. Runner only.

The decisions are :mod:`toolkit.compat.determined.search`'s; this shell runs each trial with
:func:`toolkit.run.trial.execute` in ``<output_dir>/trial-NNNN`` (its own trial id, the
experiment's id, its values recorded for every rank), and keeps ``<output_dir>/search.json``::

    {"searcher": "adaptive_asha", "seed": 123, "metric": "x", "smaller_is_better": true,
     "trials": [{"index": 0, "dir": "trial-0000", "trial_id": 5123, "hparams": {...},
                 "state": "COMPLETED", "metric": 700, "time": 100, "stopped_early": false}, ...],
     "asha": {"rungs": [25, 100], ...}, "best": {...}}

``metric`` is the trial's last reported validation value of ``searcher.metric``. Under ASHA the
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

import copy
import json
import logging
import random
from pathlib import Path
from typing import Any, Mapping

from toolkit._files import atomic_write_json
from toolkit.compat.determined import search
from toolkit.compat.determined.info import load_trial_state
from toolkit.run.plan import RunPlan
from toolkit.run.process import Forwarder
from toolkit.run.trial import execute

__all__ = ["SUMMARY", "run_search"]

logger = logging.getLogger("toolkit.run")

SUMMARY = "search.json"


def _validations(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete validation lines of ``metrics.jsonl`` after ``offset``, and the new offset."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    lines = []
    for raw in data[:end].splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("group") == "validation":
            lines.append(line.get("metrics") or {})
    return lines, offset + end


class _Watcher:
    """Feeds the running trial's validation reports to the searcher; True: stop the trial (ASHA)."""

    def __init__(self, state: dict[str, Any], trial: dict[str, Any], config: Mapping[str, Any],
                 trial_dir: Path, save: Any) -> None:
        self.state, self.trial, self.config, self.save = state, trial, config, save
        self.path, self.offset = trial_dir / "metrics.jsonl", 0
        s = config.get("searcher") or {}
        self.metric, self.time_metric = s.get("metric"), s.get("time_metric")
        self.asha = state["searcher"] == "adaptive_asha"
        self.stopped = False

    def __call__(self) -> bool:
        lines, self.offset = _validations(self.path, self.offset)
        for metrics in lines:
            if self.stopped or self.metric not in metrics:
                continue
            self.trial["metric"] = metrics[self.metric]
            if not self.asha:
                continue
            if self.time_metric not in metrics:
                logger.warning("validation metrics %s have no time_metric %r: ASHA cannot rank this report",
                               sorted(metrics), self.time_metric)
                continue
            self.trial["time"] = metrics[self.time_metric]
            if search.asha_report(self.state, self.trial["index"], time_step=float(metrics[self.time_metric]),
                                  metric=float(metrics[self.metric]), config=self.config):
                self.stopped = self.trial["stopped_early"] = True
                logger.info("searcher: stopping %s at %s=%s: below the top of its rung", self.trial["dir"],
                            self.time_metric, metrics[self.time_metric])
        self.save()
        return self.stopped


def _load(out: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    try:
        state = json.loads((out / SUMMARY).read_text(encoding="utf-8"))
    except FileNotFoundError:
        seed = (config.get("reproducibility") or {}).get("experiment_seed")
        seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
        return search.new_state(config, seed=seed)
    for trial in state["trials"]:
        if trial["state"] == "RUNNING":  # the runner itself was killed: resume the trial
            trial["state"] = "PAUSED"
    return state


def _save(out: Path, state: dict[str, Any], config: Mapping[str, Any]) -> None:
    s = config.get("searcher") or {}
    summary = dict(state, metric=s.get("metric"), smaller_is_better=s.get("smaller_is_better", True),
                   best=search.best_trial(state, config))
    atomic_write_json(out / SUMMARY, summary)


def _run_trial(plan: RunPlan, state: dict[str, Any], trial: dict[str, Any], forwarder: Forwarder,
               *, grace_s: float, experiment_id: int) -> int:
    out = plan.output_dir
    sub = copy.copy(plan)
    sub.output_dir = out / trial["dir"]
    trial["state"] = "RUNNING"
    _save(out, state, plan.config)
    watcher = _Watcher(state, trial, plan.config, sub.output_dir, lambda: _save(out, state, plan.config))
    logger.info("searcher: %s (trial %d) with %s", trial["dir"], trial["index"], json.dumps(trial["hparams"]))
    forwarder.searcher_stopped = False
    status = execute(sub, grace_s=grace_s, forwarder=forwarder, watch=watcher, hparams=trial["hparams"],
                     experiment_id=experiment_id)
    watcher()  # the reports written since the last poll
    trial["trial_id"] = load_trial_state(sub.output_dir, write=False)["trial_id"]
    trial["exit_status"] = status
    if forwarder.received is not None:
        trial["state"] = "PAUSED"
    elif status != 0 and forwarder.searcher_stopped:
        logger.warning("%s exited with status %d after the searcher's stop; counted as stopped early",
                       trial["dir"], status)
        trial["state"] = "COMPLETED"
    else:
        trial["state"] = "COMPLETED" if status == 0 else "ERROR"
    _save(out, state, plan.config)
    return status


def run_search(plan: RunPlan, *, grace_s: float = 60.0) -> int:
    """Run (or continue) the search of ``plan.config``; the exit status. This process only."""
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
