"""Determined's searchers as pure decisions (toolkit.compat.determined.search): trials, the grid,
adaptive ASHA's rungs, brackets by mode, asynchronous stops, the best, the searcher section's
problems, and the chief's wait for the runner to read a report. No process."""

import logging
import threading
import time

import pytest

from toolkit.compat.determined import search

ASHA = {
    "searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "time_metric": "batches",
                 "max_time": 100, "divisor": 2, "mode": "aggressive"},
    "hyperparameters": {"inc": {"type": "int", "minval": 1, "maxval": 8}},
}


def test_rungs_as_determined():
    assert search.asha_rungs(max_time=100, max_trials=10) == [25, 100]  # 3_hpsearch.yaml's
    assert search.asha_rungs(max_time=100, max_trials=10, divisor=2) == [12, 25, 50, 100]
    assert search.asha_rungs(max_time=1000, max_trials=1000) == [3, 15, 62, 250, 1000]
    assert search.asha_rungs(max_time=5, max_trials=1) == [5]


def _brackets(**kw):
    return [(b["rungs"], b["max_trials"]) for b in search.asha_brackets(**kw)]


def test_brackets_by_mode_as_determined():
    # 3_hpsearch.yaml: 2 rungs at most; standard (Determined's default) adds a bracket of one rung
    assert _brackets(max_time=100, max_trials=10, mode="aggressive") == [([25, 100], 10)]
    assert _brackets(max_time=100, max_trials=10) == [([25, 100], 7), ([100], 3)]
    # 4 rungs at most: standard keeps the upper half of the counts, conservative every count;
    # trials shared by the weights divisor**(n-1)/n, the remainder to the first bracket
    assert _brackets(max_time=1000, max_trials=100) == [
        ([15, 62, 250, 1000], 70), ([62, 250, 1000], 22), ([250, 1000], 8)]
    assert _brackets(max_time=1000, max_trials=100, mode="conservative") == [
        ([15, 62, 250, 1000], 67), ([62, 250, 1000], 21), ([250, 1000], 8), ([1000], 4)]
    assert _brackets(max_time=1000, max_trials=100, bracket_rungs=[1, 3]) == [([62, 250, 1000], 85),
                                                                               ([1000], 15)]
    assert _brackets(max_time=100, max_trials=2, mode="conservative") == [([100], 2)]


def test_asha_is_asynchronous_within_each_bracket():
    config = {"searcher": dict(ASHA["searcher"], max_trials=3, mode="standard", max_time=16)}
    state = search.new_state(config, seed=1)
    assert [(b["rungs"], b["max_trials"]) for b in state["asha"]["brackets"]] == [([8, 16], 2), ([16], 1)]
    assert [search.bracket_of(state, i) for i in range(3)] == [0, 0, 1]  # filled in order
    report = lambda i, t, m: search.asha_report(state, i, time_step=t, metric=m, config=config)  # noqa: E731
    assert report(1, 8, 9.0) is False  # the first at its rung continues: nobody else has reported yet
    assert report(0, 8, 11.0) is True  # 2 at the rung, top 2 // 2 = 1: second, stopped at once
    assert report(2, 8, 99.0) is False and report(2, 16, 99.0) is False  # its bracket: no rung at 8
    assert state["asha"]["brackets"][1]["metrics"] == [[[2, 99.0]]]  # judged only within its bracket


def test_asha_stops_trials_outside_the_top_of_a_rung():
    state = search.new_state(ASHA, seed=1)
    assert [b["rungs"] for b in state["asha"]["brackets"]] == [[50, 100]]
    metrics = state["asha"]["brackets"][0]["metrics"]
    report = lambda i, t, m: search.asha_report(state, i, time_step=t, metric=m, config=ASHA)  # noqa: E731
    assert report(0, 40, 5.0) is False  # below the first rung
    assert report(0, 50, 5.0) is False  # alone at the rung: continues
    assert report(0, 50, 5.0) is False  # the same report again changes nothing
    assert metrics[0] == [[0, 5.0]]
    assert report(1, 50, 9.0) is True  # 2 at the rung, top 2 // 2 = 1: trial 1 is second
    assert report(2, 60, 1.0) is False  # best of three: continues
    assert report(0, 100, 6.0) is False and report(0, 110, 6.0) is False  # max_time: done, not signalled
    bigger = dict(ASHA, searcher=dict(ASHA["searcher"], smaller_is_better=False))
    state = search.new_state(bigger, seed=1)
    assert search.asha_report(state, 0, time_step=50, metric=5.0, config=bigger) is False
    assert search.asha_report(state, 1, time_step=50, metric=9.0, config=bigger) is False  # larger wins


def test_a_search_state_of_one_bracket_at_the_top_continues():
    old = {"searcher": "adaptive_asha", "seed": 1, "searcher_config": dict(ASHA["searcher"], mode=None),
           "trials": [], "asha": {"rungs": [50, 100], "metrics": [[[0, 5.0]], []], "trial_rung": {"0": 1}}}
    state = search.upgrade_state(old)
    assert state["asha"]["brackets"] == [{"rungs": [50, 100], "metrics": [[[0, 5.0]], []], "max_trials": 3}]
    assert search.asha_report(state, 1, time_step=50, metric=9.0, config=ASHA) is True


def test_trials_random_grid_resume_and_best():
    state = search.new_state(ASHA, seed=4)
    first = search.next_trial(state, ASHA)
    assert first["dir"] == "trial-0000" and search.next_trial(state, ASHA) is first  # not run yet
    again = search.new_state(ASHA, seed=4)
    assert search.next_trial(again, ASHA)["hparams"] == first["hparams"]  # the seed decides
    first["state"] = "RUNNING"
    second = search.next_trial(state, ASHA)  # a running trial is not handed out twice
    assert second["index"] == 1 and second["bracket"] == 0
    first.update(state="COMPLETED", metric=3, stopped_early=False)
    second.update(state="PAUSED")
    assert search.next_trial(state, ASHA) is second  # a paused trial is resumed first
    second.update(state="COMPLETED", metric=1, stopped_early=True)
    third = search.next_trial(state, ASHA)
    third.update(state="ERROR")
    assert search.next_trial(state, ASHA) is None  # max_trials reached
    assert search.best_trial(state, ASHA)["index"] == 0  # early-stopped trials rank only if none finished
    grid = {"searcher": {"name": "grid", "metric": "x"},
            "hyperparameters": {"a": {"type": "categorical", "vals": [1, 2]}, "b": 3}}
    state = search.new_state(grid, seed=0)
    points = []
    while (trial := search.next_trial(state, grid)) is not None:
        points.append(trial["hparams"])
        trial["state"] = "COMPLETED"
    assert points == [{"a": 1, "b": 3}, {"a": 2, "b": 3}]


@pytest.mark.parametrize(
    "searcher,match",
    [
        ({"name": "random", "metric": "x"}, "searcher.max_trials"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2}, "searcher.time_metric"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b"}, "searcher.max_time"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b", "max_time": 9,
          "divisor": 1}, "searcher.divisor"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b", "max_time": 9,
          "mode": "fast"}, "searcher.mode='fast': expected one of aggressive, standard, conservative"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b", "max_time": 9,
          "bracket_rungs": [0]}, "searcher.bracket_rungs"),
        ({"name": "random", "metric": "x", "max_trials": 2, "max_concurrent_trials": -1},
         "searcher.max_concurrent_trials=-1"),
        ({"name": "custom", "metric": "x"}, "searcher.name='custom'"),
        ({"name": "grid", "metric": "x"}, "hyperparameters.n.count"),
    ],
)
def test_searcher_problems_name_the_key(searcher, match):
    problems = search.check_searcher(
        {"searcher": searcher, "hyperparameters": {"n": {"type": "int", "minval": 1, "maxval": 3}}}
    )
    assert any(match in p for p in problems), problems


def test_the_chief_waits_until_the_runner_read_its_report(tmp_path, monkeypatch, caplog):
    search.wait_for_searcher(tmp_path, 10**9, timeout_s=60)  # outside a search: at once
    monkeypatch.setenv(search.SEARCH_ACK_ENV, str(tmp_path / "another-trial"))
    search.wait_for_searcher(tmp_path, 10**9, timeout_s=60)  # another trial's handshake: at once
    monkeypatch.setenv(search.SEARCH_ACK_ENV, str(tmp_path))
    ack = tmp_path / search.ACK_FILE
    timer = threading.Timer(0.3, lambda: ack.write_text("120"))
    start = time.monotonic()
    timer.start()
    search.wait_for_searcher(tmp_path, 120, timeout_s=60)
    assert 0.25 < time.monotonic() - start < 5
    search.wait_for_searcher(tmp_path, 100, timeout_s=60)  # read already
    with caplog.at_level(logging.WARNING):
        search.wait_for_searcher(tmp_path, 121, timeout_s=0.2)  # a runner that does not answer
    assert "did not read the validation report within" in caplog.text
