"""What a search's trial reports besides validations (toolkit.compat.determined.trial_reports): early
exits taken as Determined's searchers took them, progress from the trial's file to search.json, and
the best validation by the metric's direction. Pure: no trial process."""

import json
import logging
import math
import sys

from toolkit.compat.determined import search, trial_reports
from toolkit.compat.determined.core.train import EarlyExitReason, TensorboardMode, TrainContext

SPACE = {"inc": {"type": "int", "minval": 1, "maxval": 8}}
ASHA = {"searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "time_metric": "batches",
                     "max_time": 100, "divisor": 2, "mode": "aggressive"}, "hyperparameters": SPACE}


def _start(state, config):
    trial = search.next_trial(state, config)
    if trial is not None:
        trial["state"] = "RUNNING"
    return trial


def test_an_invalid_trial_is_replaced_by_random_and_asha_not_by_grid_and_never_ranks():
    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 2}, "hyperparameters": SPACE}
    state = search.new_state(config, seed=3)
    first, second = _start(state, config), _start(state, config)
    first.update(state="COMPLETED", metric=0.1)
    trial_reports.exited_early(state, first, "INVALID_HP")
    second.update(state="COMPLETED", metric=0.5)
    third = _start(state, config)
    assert third["index"] == 2 and _start(state, config) is None  # one replacement: two valid trials
    third.update(state="COMPLETED", metric=0.7)
    assert search.best_trial(state, config)["index"] == 1  # the invalid trial's metric never counts
    for t in (second, third):
        trial_reports.exited_early(state, t, "INVALID_HP")
    assert search.planned_trials(state, config) == 4  # at most the plan again: no endless replacements
    grid = {"searcher": {"name": "grid", "metric": "x"}, "hyperparameters": {"a": {"type": "categorical",
                                                                                   "vals": [1, 2]}}}
    state = search.new_state(grid, seed=0)
    trial = _start(state, grid)
    trial_reports.exited_early(state, trial, "INVALID_HP")
    assert _start(state, grid)["hparams"] == {"a": 2} and _start(state, grid) is None  # a grid point: done


def test_asha_early_exits_as_determineds_searcher():
    state = search.new_state(ASHA, seed=1)
    assert [b["rungs"] for b in state["asha"]["brackets"]] == [[50, 100]]
    trials = [_start(state, ASHA) for _ in range(3)]
    report = lambda i, t, m: search.asha_report(state, i, time_step=t, metric=m, config=ASHA)  # noqa: E731
    assert report(0, 50, 5.0) is False
    # trial 0 asked to stop itself (USER_REQUESTED_STOP) before its next rung: it ranks last there
    trial_reports.exited_early(state, trials[0], "USER_REQUESTED_STOP")
    assert state["asha"]["brackets"][0]["metrics"][1] == [[0, sys.float_info.max]]
    assert report(1, 50, 9.0) is True  # outside the top at the first rung
    # trial 2 reported a bad value and then raised InvalidHP: its reports leave every rung, and the
    # trial that replaces it takes its place in the bracket
    assert report(2, 50, 1.0) is False
    trial_reports.exited_early(state, trials[2], "INVALID_HP")
    assert [i for i, _ in state["asha"]["brackets"][0]["metrics"][0]] == [0, 1]
    replacement = _start(state, ASHA)
    assert (replacement["index"], replacement["bracket"]) == (3, 0)
    assert report(3, 50, 7.0) is True  # judged against trials 0 and 1 only: 2nd of 3, top 1
    # a trial that failed for good (ERRORED) also ranks last at the rung it was working towards, once
    # (the rule alone: the runner takes no exit of a trial the searcher stopped)
    trial_reports.exited_early(state, replacement, "ERRORED")
    trial_reports.exited_early(state, replacement, "ERRORED")
    assert [i for i, _ in state["asha"]["brackets"][0]["metrics"][1]] == [0, 3]
    for t, m in zip(trials + [replacement], (5.0, 9.0, 1.0, 7.0), strict=True):
        t.update(state="COMPLETED", metric=m, stopped_early=t["index"] in (1, 3))
    assert search.best_trial(state, ASHA)["index"] == 0  # early exits rank only when none ran to its end


def test_the_runner_records_an_exit_the_trial_reported_or_its_failure(tmp_path):
    from toolkit.run.process import Forwarder
    from toolkit.run.search import _Watcher, finish_trial

    state = search.new_state(ASHA, seed=1)
    trials = [_start(state, ASHA) for _ in range(2)]
    forwarder = Forwarder(install=False)
    for trial, status in zip(trials, (0, 1), strict=True):
        directory = tmp_path / trial["dir"]
        directory.mkdir()
        if status == 0:
            ctx = TrainContext(directory, tensorboard_mode=TensorboardMode.MANUAL, resume_step=None)
            ctx.report_early_exit(EarlyExitReason.INVALID_HP)
            ctx.report_early_exit(EarlyExitReason.USER_REQUESTED_STOP)  # the first report is kept
        watcher = _Watcher(state, trial, ASHA, directory, lambda: None)
        finish_trial(state, trial, watcher, forwarder, status, directory)
    assert [(t["state"], t["early_exit"]) for t in trials] == [("COMPLETED", "INVALID_HP"),
                                                              ("ERROR", "ERRORED")]
    assert search.planned_trials(state, ASHA) == 4
    assert json.loads((tmp_path / "trial-0000" / "determined_early_exit.json").read_text()) == {
        "reason": "INVALID_HP"}


def test_progress_goes_from_the_trials_file_to_search_json(tmp_path, monkeypatch):
    from toolkit.compat.determined.core import train
    from toolkit.run.search import _Watcher, save_state

    ctx = TrainContext(tmp_path / "trial-0000", tensorboard_mode=TensorboardMode.MANUAL, resume_step=None)
    ctx.report_progress(0.25)
    clock = [0.0]
    monkeypatch.setattr(train.time, "monotonic", lambda: clock[0])
    ctx.report_progress(0.5)  # within PROGRESS_EVERY_S of the last write: kept, written later
    path = tmp_path / "trial-0000" / trial_reports.PROGRESS_FILE
    assert json.loads(path.read_text())["progress"] == 0.25
    ctx.close()
    assert json.loads(path.read_text())["progress"] == 0.5
    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 4}, "hyperparameters": SPACE}
    state = search.new_state(config, seed=1)
    trials = [_start(state, config) for _ in range(2)]
    trials[1]["state"] = "COMPLETED"
    saves = []
    watcher = _Watcher(state, trials[0], config, tmp_path / "trial-0000", lambda: saves.append(1))
    assert watcher() is False and trials[0]["progress"] == 0.5 and saves == [1]
    assert watcher() is False and saves == [1]  # unchanged file: not read again, nothing saved
    assert trial_reports.search_progress(state, config) == (0.5 + 1.0) / 4
    save_state(tmp_path, state, config)
    assert json.loads((tmp_path / "search.json").read_text())["progress"] == 0.375


def test_best_validation_is_the_best_report_by_the_metrics_direction(tmp_path, caplog):
    from toolkit.run.search import _Watcher, save_state

    config = {"searcher": {"name": "random", "metric": "acc", "max_trials": 2, "smaller_is_better": False},
              "hyperparameters": SPACE}
    state = search.new_state(config, seed=1)
    trials = [_start(state, config) for _ in range(2)]
    for trial, values in zip(trials, ([0.5, 0.9, 0.7], [0.8, math.nan]), strict=True):
        directory = tmp_path / trial["dir"]
        directory.mkdir()
        (directory / "metrics.jsonl").write_text("".join(
            json.dumps({"group": "validation", "steps_completed": i, "metrics": {"acc": v}}) + "\n"
            for i, v in enumerate(values)))
        with caplog.at_level(logging.WARNING):
            _Watcher(state, trial, config, directory, lambda: None)()
    assert [(t["metric"], t["best_metric"]) for t in trials] == [(0.7, 0.9), (None, 0.8)]
    save_state(tmp_path, state, config)
    ctx = TrainContext(tmp_path / "trial-0001", tensorboard_mode=TensorboardMode.MANUAL, resume_step=None)
    assert ctx.get_experiment_best_validation() == 0.9  # not the latest reports' 0.7
    record = json.loads((tmp_path / "search.json").read_text())
    for trial in record["trials"]:
        del trial["best_metric"]  # a record of an earlier toolkit: the latest reports
    (tmp_path / "search.json").write_text(json.dumps(record))
    assert ctx.get_experiment_best_validation() == 0.7
