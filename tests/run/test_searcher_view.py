"""A search under toolkit.run in TensorBoard (toolkit.run.searcher_view): the searcher's run (metrics, stops,
ASHA's rungs in trial order) and each trial's HParams session, read back by TensorBoard's own readers."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
from tensorboard.plugins.hparams import metadata

from toolkit.run import searchers
from toolkit.run.searcher_view import flat_hparams, searcher_series, write_searcher_view, write_trial_hparams


def test_the_searchers_view_holds_metrics_stops_and_asha_rungs_in_trial_order():
    config = {"searcher": {"name": "adaptive_asha", "metric": "acc", "smaller_is_better": False,
                           "max_trials": 4, "time_metric": "batches", "max_time": 16, "divisor": 2,
                           "mode": "aggressive"}}
    state = searchers.new_state(config, seed=0)
    trials = []
    for _ in range(3):
        trials.append(searchers.next_trial(state, config))
        trials[-1].state = "RUNNING"
    for trial, acc in zip(trials, (0.9, 0.5, float("nan")), strict=True):
        searchers.asha_report(state, trial.index, time_step=8, metric=acc, config=config)
        trial.state, trial.stopped_early = "COMPLETED", trial.index > 0
        trial.metric = acc if acc == acc else None
    searchers.asha_report(state, 0, time_step=16, metric=0.95, config=config)
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
    state = searchers.new_state(config, seed=0)
    for index in range(2):
        trial = searchers.next_trial(state, config)
        trial.state, trial.metric = "COMPLETED", float(index)
        write_searcher_view(tmp_path, state, config)     # rewritten whole at each change
        write_trial_hparams(tmp_path / trial.dir, {"lr": 0.1 * (index + 1), "opt": {"name": "adam"}},
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
