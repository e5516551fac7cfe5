"""Determined's searchers as pure decisions (toolkit.run.searchers) on typed state: trials, the grid,
adaptive ASHA's asynchronous stops within each bracket, early exits taken as Determined's searchers
took them, the best trial and the search's progress. No process, no file."""

import sys

from toolkit.run import searchers
from toolkit.run.search_state import SearchState, TrialRecord

SPACE = {"inc": {"type": "int", "minval": 1, "maxval": 8}}
ASHA = {
    "searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "time_metric": "batches",
                 "max_time": 100, "divisor": 2, "mode": "aggressive"},
    "hyperparameters": SPACE,
}


def _reporter(state, config):
    return lambda i, t, m: searchers.asha_report(state, i, time_step=t, metric=m, config=config)


def _start(state, config):
    trial = searchers.next_trial(state, config)
    if trial is not None:
        trial.state = "RUNNING"
    return trial


def _end(trial, **fields):
    for key, value in dict(fields, state=fields.get("state", "COMPLETED")).items():
        setattr(trial, key, value)


def test_asha_is_asynchronous_within_each_bracket():
    config = {"searcher": dict(ASHA["searcher"], max_trials=3, mode="standard", max_time=16)}
    state = searchers.new_state(config, seed=1)
    assert [(b.rungs, b.max_trials) for b in state.asha.brackets] == [([8, 16], 2), ([16], 1)]
    assert [searchers.bracket_of(state, i) for i in range(3)] == [0, 0, 1]  # filled in order
    report = _reporter(state, config)
    assert report(1, 8, 9.0) is False  # the first at its rung continues: nobody else has reported yet
    assert report(0, 8, 11.0) is True  # 2 at the rung, top 2 // 2 = 1: second, stopped at once
    assert report(2, 8, 99.0) is False and report(2, 16, 99.0) is False  # its bracket: no rung at 8
    assert state.asha.brackets[1].metrics == [[(2, 99.0)]]  # judged only within its bracket


def test_asha_stops_trials_outside_the_top_of_a_rung():
    state = searchers.new_state(ASHA, seed=1)
    assert [b.rungs for b in state.asha.brackets] == [[50, 100]]
    metrics = state.asha.brackets[0].metrics
    report = _reporter(state, ASHA)
    assert report(0, 40, 5.0) is False  # below the first rung
    assert report(0, 50, 5.0) is False  # alone at the rung: continues
    assert report(0, 50, 5.0) is False  # the same report again changes nothing
    assert metrics[0] == [(0, 5.0)]
    assert report(1, 50, 9.0) is True  # 2 at the rung, top 2 // 2 = 1: trial 1 is second
    assert report(2, 60, 1.0) is False  # best of three: continues
    assert report(0, 100, 6.0) is False and report(0, 110, 6.0) is False  # max_time: done, not signalled
    assert report(2, float("nan"), 1.0) is False  # a time that is not finite: ignored
    bigger = dict(ASHA, searcher=dict(ASHA["searcher"], smaller_is_better=False))
    state = searchers.new_state(bigger, seed=1)
    assert _reporter(state, bigger)(0, 50, 5.0) is False
    assert _reporter(state, bigger)(1, 50, 9.0) is False  # larger wins
    assert _reporter(state, bigger)(2, 50, float("nan")) is True  # a NaN ranks last
    assert state.asha.brackets[0].metrics[0][-1] == (2, sys.float_info.max)


def test_trials_random_grid_resume_and_best():
    state = searchers.new_state(ASHA, seed=4)
    first = searchers.next_trial(state, ASHA)
    assert first.dir == "trial-0000" and searchers.next_trial(state, ASHA) is first  # not run yet
    assert first.seed == searchers.trial_seed(state, 0) == 4 * 1_000_003
    again = searchers.new_state(ASHA, seed=4)
    assert searchers.next_trial(again, ASHA).hparams == first.hparams  # the seed decides
    first.state = "RUNNING"
    second = searchers.next_trial(state, ASHA)  # a running trial is not handed out twice
    assert second.index == 1 and second.bracket == 0
    _end(first, metric=3.0)
    second.state = "PAUSED"
    assert searchers.next_trial(state, ASHA) is second  # a paused trial is resumed first
    _end(second, metric=1.0, stopped_early=True)
    third = searchers.next_trial(state, ASHA)
    third.state = "ERROR"
    assert searchers.next_trial(state, ASHA) is None  # max_trials reached
    assert searchers.best_trial(state, ASHA).index == 0  # early-stopped trials rank only if none finished
    grid = {"searcher": {"name": "grid", "metric": "x"},
            "hyperparameters": {"a": {"type": "categorical", "vals": [1, 2]}, "b": 3}}
    state = searchers.new_state(grid, seed=0)
    points = []
    while (trial := searchers.next_trial(state, grid)) is not None:
        points.append(trial.hparams)
        trial.state = "COMPLETED"
    assert points == [{"a": 1, "b": 3}, {"a": 2, "b": 3}]
    single = searchers.new_state({"hyperparameters": SPACE}, seed=2)
    assert single.searcher == "single" and searchers.planned_count(single, {"hyperparameters": SPACE}) == 1


def test_a_rerun_sees_what_changed_in_the_yaml():
    state = searchers.new_state(ASHA, seed=5)
    assert searchers.config_changes(state, ASHA) == []
    more_at_once = dict(ASHA, searcher=dict(ASHA["searcher"], max_concurrent_trials=4))
    assert searchers.config_changes(state, more_at_once) == []  # how many at once, not which: may change
    changed = dict(ASHA, searcher=dict(ASHA["searcher"], name="random", max_trials=4),
                   hyperparameters={"inc": {"type": "int", "minval": 1, "maxval": 9}},
                   reproducibility={"experiment_seed": 7})
    assert searchers.config_changes(state, changed) == [
        "searcher.max_trials: 3 when the search started, now 4",
        "searcher.name: 'adaptive_asha' when the search started, now 'random'",
        'hyperparameters: {"inc": {"type": "int", "minval": 1, "maxval": 8}} when the search started, now '
        '{"inc": {"type": "int", "minval": 1, "maxval": 9}}',
        "reproducibility.experiment_seed: null when the search started, now 7"]
    early = SearchState(searcher="adaptive_asha", seed=5, trials=[])  # an early toolkit: the name alone
    assert searchers.config_changes(early, changed) == [
        "searcher.name: 'adaptive_asha' when the search started, now 'random'"]


def test_an_invalid_trial_is_replaced_by_random_and_asha_not_by_grid_and_never_ranks():
    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 2}, "hyperparameters": SPACE}
    state = searchers.new_state(config, seed=3)
    first, second = _start(state, config), _start(state, config)
    _end(first, metric=0.1)
    searchers.exited_early(state, first, "INVALID_HP")
    _end(second, metric=0.5)
    third = _start(state, config)
    assert third.index == 2 and _start(state, config) is None  # one replacement: two valid trials
    _end(third, metric=0.7)
    assert searchers.best_trial(state, config).index == 1  # the invalid trial's metric never counts
    for t in (second, third):
        searchers.exited_early(state, t, "INVALID_HP")
    assert searchers.planned_trials(state, config) == 4  # at most the plan again: no endless replacements
    grid = {"searcher": {"name": "grid", "metric": "x"}, "hyperparameters": {"a": {"type": "categorical",
                                                                                   "vals": [1, 2]}}}
    state = searchers.new_state(grid, seed=0)
    trial = _start(state, grid)
    searchers.exited_early(state, trial, "INVALID_HP")
    assert _start(state, grid).hparams == {"a": 2} and _start(state, grid) is None  # a grid point: done


def test_asha_early_exits_as_determineds_searcher():
    state = searchers.new_state(ASHA, seed=1)
    trials = [_start(state, ASHA) for _ in range(3)]
    report = _reporter(state, ASHA)
    assert report(0, 50, 5.0) is False
    # trial 0 asked to stop itself (USER_REQUESTED_STOP) before its next rung: it ranks last there
    searchers.exited_early(state, trials[0], "USER_REQUESTED_STOP")
    assert state.asha.brackets[0].metrics[1] == [(0, sys.float_info.max)]
    assert report(1, 50, 9.0) is True  # outside the top at the first rung
    # trial 2 reported a bad value and then raised InvalidHP: its reports leave every rung, and the
    # trial that replaces it takes its place in the bracket
    assert report(2, 50, 1.0) is False
    searchers.exited_early(state, trials[2], "INVALID_HP")
    assert [i for i, _ in state.asha.brackets[0].metrics[0]] == [0, 1]
    replacement = _start(state, ASHA)
    assert (replacement.index, replacement.bracket) == (3, 0)
    assert report(3, 50, 7.0) is True  # judged against trials 0 and 1 only: 2nd of 3, top 1
    # a trial that failed for good (ERRORED) also ranks last at the rung it was working towards, once
    searchers.exited_early(state, replacement, "ERRORED")
    searchers.exited_early(state, replacement, "ERRORED")
    assert [i for i, _ in state.asha.brackets[0].metrics[1]] == [0, 3]
    for t, m in zip(trials + [replacement], (5.0, 9.0, 1.0, 7.0), strict=True):
        _end(t, metric=m, stopped_early=t.index in (1, 3))
    assert searchers.best_trial(state, ASHA).index == 0  # early exits rank only when none ran to its end


def test_progress_counts_ended_trials_whole_and_the_others_by_their_report():
    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 4}, "hyperparameters": SPACE}
    state = searchers.new_state(config, seed=1)
    trials = [_start(state, config) for _ in range(3)]
    trials[0].progress, trials[1].state = 0.5, "COMPLETED"
    trials[2].state, trials[2].early_exit = "COMPLETED", "INVALID_HP"  # replaced: not counted
    assert searchers.search_progress(state, config) == (0.5 + 1.0) / 4
    assert searchers.better(0.3, None, smaller_is_better=True) == 0.3
    assert searchers.better(0.3, 0.5, smaller_is_better=False) == 0.5
    assert TrialRecord(index=7, hparams={}).dir == "trial-0007"
