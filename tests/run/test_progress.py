"""What a search under toolkit.run shows while it runs (toolkit.run.watch, toolkit.run.tensorboard,
toolkit.launch.progress): pure functions and files; the real concurrent search that writes them is
tests/run/test_scheduler.py's."""

import json
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.plugins.hparams import metadata

from toolkit.compat.determined import search
from toolkit.launch.progress import format_duration, remaining_text, time_left
from toolkit.run.tensorboard import flat_hparams, searcher_series, write_searcher_view, write_trial_hparams
from toolkit.run.watch import latest_report, progress_line, report_text


def test_time_left_is_the_mean_trial_over_the_slots_and_says_so_for_people():
    assert time_left([], remaining=3, concurrency=1) is None
    assert time_left([10.0, 30.0], remaining=3, concurrency=2, running=[5.0, 40.0]) == (60 + 15) / 2
    assert [format_duration(s) for s in (3, 89.6, 90, 5399, 5400)] == [
        "3 s", "90 s", "1.5 min", "90.0 min", "1.5 h"]
    assert remaining_text([60.0], remaining=1, concurrency=1) == "up to 1 more trial, about 60 s left"


def test_a_trials_latest_report_is_the_last_whole_line_of_its_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert latest_report(path) is None
    lines = [{"group": "training", "steps_completed": 10, "metrics": {"loss": 0.5}},
             {"group": "validation", "steps_completed": 20, "metrics": {"x": 12, "batches": 20, "note": "a"}}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"group": "training", "steps')
    assert latest_report(path) == lines[1]   # the torn line being written is not read
    assert report_text(lines[1], metric="x") == "step 20 validation x=12"
    assert report_text(lines[0], metric="x") == "step 10 training loss=0.5"   # not the metric: its numbers
    assert report_text(None, metric="x") == "no report yet"


def test_the_progress_line_names_each_running_trial_and_what_is_left(tmp_path):
    from toolkit.run.scheduler import _progress

    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 5}}
    state = search.new_state(config, seed=1)
    for _ in range(3):
        search.next_trial(state, config)["state"] = "RUNNING"
    state["trials"][0]["state"] = "COMPLETED"
    (tmp_path / "trial-0001").mkdir()
    (tmp_path / "trial-0001" / "metrics.jsonl").write_text(
        json.dumps({"group": "validation", "steps_completed": 8, "metrics": {"x": 2.5}}) + "\n")
    running = {i: SimpleNamespace(trial=t, plan=SimpleNamespace(output_dir=tmp_path / t["dir"]), started=0.0)
               for i, t in enumerate(state["trials"]) if i}
    line = _progress(running, state, SimpleNamespace(config=config), [100.0], 2)
    assert line.startswith("searcher: 2 running (trial-0001 step 8 validation x=2.5; trial-0002 no report "
                           "yet), 1 done; up to 2 more trials, about ")
    assert progress_line([], done=0, to_start=1, durations=[], elapsed=[], concurrency=1).endswith(
        "time left unknown until a trial ends")


def test_the_searchers_view_holds_metrics_stops_and_asha_rungs_in_trial_order():
    config = {"searcher": {"name": "adaptive_asha", "metric": "acc", "smaller_is_better": False,
                           "max_trials": 4, "time_metric": "batches", "max_time": 16, "divisor": 2,
                           "mode": "aggressive"}}
    state = search.new_state(config, seed=0)
    trials = []
    for _ in range(3):
        trials.append(search.next_trial(state, config))
        trials[-1]["state"] = "RUNNING"
    for trial, acc in zip(trials, (0.9, 0.5, float("nan"))):
        search.asha_report(state, trial["index"], time_step=8, metric=acc, config=config)
        trial.update(state="COMPLETED", metric=acc if acc == acc else None, stopped_early=trial["index"] > 0)
    search.asha_report(state, 0, time_step=16, metric=0.95, config=config)
    series = searcher_series(state, config)
    assert series["searcher/metric"] == [(0, 0.9), (1, 0.5)]
    assert series["searcher/stopped_early"] == [(0, 0.0), (1, 1.0), (2, 1.0)]
    # rungs at 4, 8, 16 batches: a report at 8 fills the rung at 4 and, for a trial kept, the one at 8
    assert series["asha/batches_4"] == [(0, 0.9), (1, 0.5)]   # larger is better: as reported; NaN not drawn
    assert series["asha/batches_8"] == [(0, 0.9)] and series["asha/batches_16"] == [(0, 0.95)]
    assert series["asha/rungs_reached"] == [(0, 3.0), (1, 1.0), (2, 1.0)]
    assert flat_hparams({"opt": {"lr": 0.1, "betas": [0.9, 0.99]}, "n": float("inf")}) == {
        "opt.lr": 0.1, "opt.betas": "[0.9, 0.99]", "n": "inf"}


def test_tensorboard_reads_the_searchers_run_and_each_trials_hparams(tmp_path):
    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 2}}
    state = search.new_state(config, seed=0)
    for index in range(2):
        trial = search.next_trial(state, config)
        trial.update(state="COMPLETED", metric=float(index))
        write_searcher_view(tmp_path, state, config)     # rewritten whole at each change
        write_trial_hparams(tmp_path / trial["dir"], {"lr": 0.1 * (index + 1), "opt": {"name": "adam"}},
                            metric="x")
    write_trial_hparams(tmp_path / "trial-0001", {"lr": 0.2, "opt": {"name": "adam"}}, metric="x")  # again
    assert len(list((tmp_path / "tensorboard" / "searcher").iterdir())) == 2   # a rewrite per change
    assert len(list((tmp_path / "trial-0001" / "tensorboard").iterdir())) == 1   # a trial's session once
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "searcher"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("searcher/metric")] == [(0, 0.0), (1, 1.0)]
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    sessions = multiplexer.PluginRunToTagToContent(metadata.PLUGIN_NAME)
    assert set(sessions) == {"trial-0000/tensorboard", "trial-0001/tensorboard"}
    start = metadata.parse_session_start_info_plugin_data(
        sessions["trial-0001/tensorboard"][metadata.SESSION_START_INFO_TAG])
    assert start.hparams["lr"].number_value == pytest.approx(0.2)
    assert start.hparams["opt.name"].string_value == "adam"
