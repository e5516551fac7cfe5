"""A search's trial's reports read by the runner (toolkit.run.trial_reports): validations (non-numbers
skipped, a rung passed after the last poll is no stop), early exits the trial reported or its failure,
its progress, and the best validation by the metric's direction as the trials read it back. What the
trial writes comes from the Determined layer's own TrainContext; no trial process."""

import json
import logging
import math
import os
import signal
import subprocess

from toolkit.compat.determined.core.train import EarlyExitReason, TensorboardMode, TrainContext
from toolkit.config.searcher_section import translate_searcher
from toolkit.launch.trial_files import PROGRESS_FILE, SEARCH_FILE
from toolkit.run import searchers
from toolkit.run.process import Forwarder
from toolkit.run.search_record import save_state
from toolkit.run.search_state import TrialRecord
from toolkit.run.trial_reports import ReportWatcher, finish_trial

SPACE = {"inc": {"type": "int", "minval": 1, "maxval": 8}}
ASHA = {"searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "time_metric": "batches",
                     "max_time": 100, "divisor": 2, "mode": "aggressive"}, "hyperparameters": SPACE}


def _start(state, config):
    trial = searchers.next_trial(state, config)
    if trial is not None:
        trial.state = "RUNNING"
    return trial


def test_the_watcher_skips_non_numbers_and_a_rung_passed_after_the_last_poll_is_no_stop(tmp_path, caplog):
    state = searchers.new_state(ASHA, seed=1)  # rungs [50, 100]
    assert searchers.asha_report(state, 0, time_step=50, metric=1.0, config=ASHA) is False
    trial = TrialRecord(index=1, hparams={})
    saves = []
    watcher = ReportWatcher(state, trial, ASHA, tmp_path, lambda: saves.append(1))
    lines = [{"group": "validation", "metrics": {"x": "nan?", "batches": 40}},
             {"group": "validation", "metrics": {"x": 9.0, "batches": 50}},  # outside the top: a stop
             {"group": "validation", "metrics": {"x": 8.0, "batches": 100}}]
    assert watcher() is False and saves == []  # nothing written yet: nothing saved
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    watcher.finish(stop_sent=False)  # the trial ended before the poll: it ran to its end
    assert "'nan?'" in caplog.text and "trial-0001" in caplog.text
    assert (trial.metric, trial.time) == (8.0, 100) and saves == [1]
    assert [i for i, _ in state.asha.brackets[0].metrics[1]] == [1]  # its last rung recorded too
    state = searchers.new_state(ASHA, seed=1)
    searchers.asha_report(state, 0, time_step=50, metric=1.0, config=ASHA)
    watcher = ReportWatcher(state, TrialRecord(index=1, hparams={}), ASHA, tmp_path, lambda: None)
    assert watcher() is True and watcher.trial.time == 50  # while it runs: the stop, at the rung
    watcher.finish(stop_sent=True)  # the stop reached it: later reports set metric and time only
    assert watcher.trial.time == 100 and len(state.asha.brackets[0].metrics[1]) == 0


def test_the_runner_records_an_exit_the_trial_reported_or_its_failure(tmp_path):
    state = searchers.new_state(ASHA, seed=1)
    trials = [_start(state, ASHA) for _ in range(2)]
    forwarder = Forwarder(install=False)
    for trial, status in zip(trials, (0, 1), strict=True):
        directory = tmp_path / trial.dir
        directory.mkdir()
        if status == 0:
            ctx = TrainContext(directory, tensorboard_mode=TensorboardMode.MANUAL, resume_step=None)
            ctx.report_early_exit(EarlyExitReason.INVALID_HP)
            ctx.report_early_exit(EarlyExitReason.USER_REQUESTED_STOP)  # the first report is kept
        watcher = ReportWatcher(state, trial, ASHA, directory, lambda: None)
        finish_trial(state, trial, watcher, forwarder, status, directory)
    assert [(t.state, t.early_exit) for t in trials] == [("COMPLETED", "INVALID_HP"), ("ERROR", "ERRORED")]
    assert searchers.planned_trials(state, ASHA) == 4
    assert json.loads((tmp_path / "trial-0000" / "determined_early_exit.json").read_text()) == {
        "reason": "INVALID_HP"}


def test_progress_goes_from_the_trials_file_to_the_search_record(tmp_path, monkeypatch):
    from toolkit.compat.determined.core import train
    ctx = TrainContext(tmp_path / "trial-0000", tensorboard_mode=TensorboardMode.MANUAL, resume_step=None)
    ctx.report_progress(0.25)
    clock = [0.0]
    monkeypatch.setattr(train.time, "monotonic", lambda: clock[0])
    ctx.report_progress(0.5)  # within PROGRESS_EVERY_S of the last write: kept, written later
    path = tmp_path / "trial-0000" / PROGRESS_FILE
    assert json.loads(path.read_text())["progress"] == 0.25
    ctx.close()
    assert json.loads(path.read_text())["progress"] == 0.5
    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 4}, "hyperparameters": SPACE}
    state = searchers.new_state(config, seed=1)
    trials = [_start(state, config) for _ in range(2)]
    trials[1].state = "COMPLETED"
    saves = []
    watcher = ReportWatcher(state, trials[0], config, tmp_path / "trial-0000", lambda: saves.append(1))
    assert watcher() is False and trials[0].progress == 0.5 and saves == [1]
    assert watcher() is False and saves == [1]  # unchanged file: not read again, nothing saved
    assert searchers.search_progress(state, config) == (0.5 + 1.0) / 4
    save_state(tmp_path, state, config)
    assert json.loads((tmp_path / SEARCH_FILE).read_text())["progress"] == 0.375


def test_best_validation_is_the_best_report_by_the_metrics_direction(tmp_path, caplog):
    config = {"searcher": {"name": "random", "metric": "acc", "max_trials": 2, "smaller_is_better": False},
              "hyperparameters": SPACE}
    state = searchers.new_state(config, seed=1)
    trials = [_start(state, config) for _ in range(2)]
    for trial, values in zip(trials, ([0.5, 0.9, 0.7], [0.8, math.nan]), strict=True):
        directory = tmp_path / trial.dir
        directory.mkdir()
        (directory / "metrics.jsonl").write_text("".join(
            json.dumps({"group": "validation", "steps_completed": i, "metrics": {"acc": v}}) + "\n"
            for i, v in enumerate(values)))
        with caplog.at_level(logging.WARNING):
            ReportWatcher(state, trial, config, directory, lambda: None)()
    assert [(t.metric, t.best_metric) for t in trials] == [(0.7, 0.9), (None, 0.8)]
    save_state(tmp_path, state, config)
    ctx = TrainContext(tmp_path / "trial-0001", tensorboard_mode=TensorboardMode.MANUAL, resume_step=None)
    assert ctx.get_experiment_best_validation() == 0.9  # not the latest reports' 0.7
    record = json.loads((tmp_path / SEARCH_FILE).read_text())
    for trial in record["trials"]:
        del trial["best_metric"]  # a record of an earlier toolkit: the latest reports
    (tmp_path / SEARCH_FILE).write_text(json.dumps(record))
    assert ctx.get_experiment_best_validation() == 0.7


def test_the_watcher_passes_over_torn_lines_and_validations_without_the_metric(tmp_path):
    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 2}, "hyperparameters": SPACE}
    state = searchers.new_state(config, seed=1)
    trial = _start(state, config)
    reports = ["{not json", json.dumps({"group": "validation", "metrics": {"loss": 0.1}}),
               json.dumps({"group": "validation", "metrics": {"x": 3.0}}),
               json.dumps({"group": "validation", "metrics": {"loss": 0.2}})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(reports) + "\n")
    watcher = ReportWatcher(state, trial, config, tmp_path, lambda: None)
    assert watcher() is False
    assert trial.metric == 3.0 and watcher.offset == (tmp_path / "metrics.jsonl").stat().st_size


LEGACY_ASHA = {"searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "max_length": 100,
                            "divisor": 2, "mode": "aggressive"}, "hyperparameters": SPACE}


def test_a_searcher_operation_without_a_number_is_skipped_and_named(tmp_path, caplog):
    from toolkit.compat.determined.core.distributed import DummyDistributedContext
    from toolkit.compat.determined.core.searcher import SearcherContext

    config, _, problems = translate_searcher(LEGACY_ASHA)  # as the runner plans a 0.37 section
    assert problems == []
    state = searchers.new_state(config, seed=1)
    trial = _start(state, config)
    ops = SearcherContext(DummyDistributedContext(), LEGACY_ASHA, tmp_path)  # the trial's side
    ops.record_completed(25, {"x": 0.5}, last=False)  # a dict where Determined expects a number
    ops.record_completed(50, 0.25, last=False)
    watcher = ReportWatcher(state, trial, config, tmp_path, lambda: None)
    with caplog.at_level(logging.WARNING, logger="toolkit.run"):
        watcher()
    assert ("searcher operation skipped: op.report_completed({'x': 0.5}) at op.length 25 (ASHA expects a "
            "number)") in caplog.text
    assert (trial.metric, watcher.ops_read) == (0.25, 2)


def test_a_run_that_fails_after_the_searchers_stop_counts_as_stopped_early(tmp_path, caplog):
    state = searchers.new_state(ASHA, seed=1)
    trial = _start(state, ASHA)
    (tmp_path / trial.dir).mkdir()
    forwarder = Forwarder(install=False)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}  # not a rank process
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True, env=env)  # the launcher, no rank yet
    try:
        forwarder.attach(proc, "toolkit-run-test")
        forwarder.searcher_stop()
        status = proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert forwarder.searcher_sent and status == -signal.SIGTERM
    watcher = ReportWatcher(state, trial, ASHA, tmp_path / trial.dir, lambda: None)
    with caplog.at_level(logging.WARNING, logger="toolkit.run"):
        finish_trial(state, trial, watcher, forwarder, 143, tmp_path / trial.dir)
    assert (trial.state, trial.stopped_early, trial.exit_status) == ("COMPLETED", True, 143)
    assert "exited with status 143 after the searcher's stop; counted as stopped early" in caplog.text
