"""Local hyperparameter searches: the pure decisions (trials, grid, ASHA's rungs and stops, the best),
and one adaptive_asha search of two 1-rank trials under python -m toolkit.run, paused by SIGTERM and
continued by the same command."""

import json
import signal
import subprocess
import sys
import time

import pytest

from helpers import procutil
from toolkit.compat.determined import search

ASHA = {
    "searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "time_metric": "batches",
                 "max_time": 100, "divisor": 2},
    "hyperparameters": {"inc": {"type": "int", "minval": 1, "maxval": 8}},
}


def test_rungs_as_determined():
    assert search.asha_rungs(max_time=100, max_trials=10) == [25, 100]  # 3_hpsearch.yaml's
    assert search.asha_rungs(max_time=100, max_trials=10, divisor=2) == [12, 25, 50, 100]
    assert search.asha_rungs(max_time=1000, max_trials=1000) == [3, 15, 62, 250, 1000]
    assert search.asha_rungs(max_time=5, max_trials=1) == [5]


def test_asha_stops_trials_outside_the_top_of_a_rung():
    state = search.new_state(ASHA, seed=1)
    assert state["asha"]["rungs"] == [50, 100]
    report = lambda i, t, m: search.asha_report(state, i, time_step=t, metric=m, config=ASHA)  # noqa: E731
    assert report(0, 40, 5.0) is False  # below the first rung
    assert report(0, 50, 5.0) is False  # alone at the rung: continues
    assert report(0, 50, 5.0) is False  # the same report again changes nothing
    assert state["asha"]["metrics"][0] == [[0, 5.0]]
    assert report(1, 50, 9.0) is True  # 2 at the rung, top 2 // 2 = 1: trial 1 is second
    assert report(2, 60, 1.0) is False  # best of three: continues
    assert report(0, 100, 6.0) is False and report(0, 110, 6.0) is False  # max_time: done, not signalled
    bigger = dict(ASHA, searcher=dict(ASHA["searcher"], smaller_is_better=False))
    state = search.new_state(bigger, seed=1)
    assert search.asha_report(state, 0, time_step=50, metric=5.0, config=bigger) is False
    assert search.asha_report(state, 1, time_step=50, metric=9.0, config=bigger) is False  # larger wins


def test_trials_random_grid_resume_and_best():
    state = search.new_state(ASHA, seed=4)
    first = search.next_trial(state, ASHA)
    assert first["dir"] == "trial-0000" and search.next_trial(state, ASHA) is first  # not run yet
    again = search.new_state(ASHA, seed=4)
    assert search.next_trial(again, ASHA)["hparams"] == first["hparams"]  # the seed decides
    for trial, (metric, early) in zip([first], [(3, False)], strict=True):
        trial.update(state="COMPLETED", metric=metric, stopped_early=early)
    second = search.next_trial(state, ASHA)
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
        ({"name": "custom", "metric": "x"}, "searcher.name='custom'"),
        ({"name": "grid", "metric": "x"}, "hyperparameters.n.count"),
    ],
)
def test_searcher_problems_name_the_key(searcher, match):
    problems = search.check_searcher(
        {"searcher": searcher, "hyperparameters": {"n": {"type": "int", "minval": 1, "maxval": 3}}}
    )
    assert any(match in p for p in problems), problems


YAML = """name: det-hpsearch
entrypoint: python3 det_hpsearch.py
hyperparameters:
  increment_by: {{type: int, minval: 1, maxval: 8}}
  max_length: 16
  report_every: 4
searcher: {{name: adaptive_asha, metric: x, max_trials: 2, time_metric: batches, max_time: 16, divisor: 2}}
reproducibility: {{experiment_seed: {seed}}}
max_restarts: 0
"""


def _seed_with_a_worse_second_trial():
    """A seed whose second trial increments more than its first (so ASHA stops the second at batch 8)."""
    config = {"searcher": {"name": "random", "max_trials": 2},
              "hyperparameters": {"increment_by": {"type": "int", "minval": 1, "maxval": 8}}}
    for seed in range(100):
        state = search.new_state(config, seed=seed)
        a = search.next_trial(state, config)
        a["state"] = "COMPLETED"
        b = search.next_trial(state, config)
        if b["hparams"]["increment_by"] > a["hparams"]["increment_by"]:
            return seed, a["hparams"]["increment_by"], b["hparams"]["increment_by"]
    raise AssertionError("no seed found")


def test_an_asha_search_pauses_continues_and_stops_the_worse_trial_early(tmp_path):
    seed, inc0, inc1 = _seed_with_a_worse_second_trial()
    model = tmp_path / "model"
    model.mkdir()
    (model / "det_hpsearch.py").write_text((procutil.WORKERS / "det_hpsearch.py").read_text())
    (model / "exp.yaml").write_text(YAML.format(seed=seed))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "toolkit.run", str(model / "exp.yaml"), str(model), "--output-dir",
            str(out)]
    proc = subprocess.Popen(argv, env=procutil.child_env(DET_TEST_STEP_SLEEP="0.3"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = out / "trial-0000" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or not metrics.read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # pause the search inside its first trial
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((out / "search.json").read_text())
    assert [t["state"] for t in summary["trials"]] == ["PAUSED"]
    # trial 1's steps after its rung (8) are slow: the searcher's stop must end it before step 16
    slow = procutil.child_env(DET_TEST_STEP_SLEEP="0.05", DET_TEST_SLOW="trial-0001:8:0.5")
    result = procutil.run(argv, env=slow, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "searcher: stopping trial-0001 at batches=8" in result.stdout, result.stdout[-4000:]
    summary = json.loads((out / "search.json").read_text())
    first, second = summary["trials"]
    assert (first["hparams"]["increment_by"], second["hparams"]["increment_by"]) == (inc0, inc1)
    assert first["state"] == "COMPLETED" and not first["stopped_early"] and first["metric"] == 16 * inc0
    assert second["state"] == "COMPLETED" and second["stopped_early"] and second["time"] in (8, 12)
    stopped = [json.loads(line)["steps_completed"] for line in
               (out / "trial-0001" / "metrics.jsonl").read_text().splitlines()]
    assert stopped[-1] < 16 and second["time"] == stopped[-1]  # stopped by the searcher, not at its end
    assert [t["seed"] for t in (first, second)] == [seed * 1_000_003, seed * 1_000_003 + 1]
    assert summary["best"]["dir"] == "trial-0000" and summary["asha"]["rungs"] == [8, 16]
    ids = [json.loads((out / t["dir"] / "determined_trial.json").read_text()) for t in (first, second)]
    assert ids[0]["trial_id"] != ids[1]["trial_id"] and ids[0]["experiment_id"] == ids[1]["experiment_id"]
    assert ids[0]["trial_run_id"] == 2 and ids[0]["hparams"] == first["hparams"]  # resumed, same values
    assert [i["hparams_seed"] for i in ids] == [first["seed"], second["seed"]]
    steps = [json.loads(line)["steps_completed"] for line in
             (out / "trial-0000" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 16  # continued from its checkpoint, nothing redone
    again = procutil.run(argv, env=procutil.child_env(), timeout=120)  # the search is done: nothing runs
    assert again.returncode == 0 and "search done: 2 trials" in again.stdout


def test_a_rerun_refuses_a_changed_search_or_a_corrupt_search_json(tmp_path, capsys):
    from toolkit.run import main

    state = search.new_state(ASHA, seed=5)
    assert search.config_changes(state, ASHA) == []
    changed = dict(ASHA, searcher=dict(ASHA["searcher"], name="random", max_trials=4),
                   hyperparameters={"inc": {"type": "int", "minval": 1, "maxval": 9}},
                   reproducibility={"experiment_seed": 7})
    changes = search.config_changes(state, changed)
    assert [c.split(":")[0] for c in changes] == ["searcher.max_trials", "searcher.name", "hyperparameters",
                                                  "reproducibility.experiment_seed"], changes
    yaml = tmp_path / "exp.yaml"
    yaml.write_text(json.dumps(dict(changed, entrypoint="python3 nothing.py")))
    (tmp_path / "search.json").write_text(json.dumps(state))
    argv = [str(yaml), str(tmp_path), "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "searcher.name: 'adaptive_asha' when the search started, now 'random'" in err, err
    assert "use a new --output-dir" in err
    (tmp_path / "search.json").write_text('{"seed": 1, "tri')
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'search.json'} is not valid JSON" in err and not (tmp_path / "trial-0000").exists()


def test_the_watcher_skips_non_numbers_and_a_rung_passed_after_the_last_poll_is_no_stop(tmp_path, caplog):
    from toolkit.run.search import _Watcher

    state = search.new_state(ASHA, seed=1)  # rungs [50, 100]
    assert search.asha_report(state, 0, time_step=50, metric=1.0, config=ASHA) is False
    trial = {"index": 1, "dir": "trial-0001", "metric": None, "time": None}
    saves = []
    watcher = _Watcher(state, trial, ASHA, tmp_path, lambda: saves.append(1))
    lines = [{"group": "validation", "metrics": {"x": "nan?", "batches": 40}},
             {"group": "validation", "metrics": {"x": 9.0, "batches": 50}},  # outside the top: a stop
             {"group": "validation", "metrics": {"x": 8.0, "batches": 100}}]
    assert watcher() is False and saves == []  # nothing written yet: nothing saved
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    watcher.finish(stop_sent=False)  # the trial ended before the poll: it ran to its end
    assert "'nan?'" in caplog.text and "trial-0001" in caplog.text
    assert (trial["metric"], trial["time"]) == (8.0, 100) and saves == [1]
    assert [i for i, _ in state["asha"]["metrics"][1]] == [1]  # its last rung recorded too
    state = search.new_state(ASHA, seed=1)
    search.asha_report(state, 0, time_step=50, metric=1.0, config=ASHA)
    watcher = _Watcher(state, dict(trial, metric=None), ASHA, tmp_path, lambda: None)
    assert watcher() is True and watcher.trial["time"] == 50  # while it runs: the stop, at the rung
    watcher.finish(stop_sent=True)  # the stop reached it: later reports set metric and time only
    assert watcher.trial["time"] == 100 and len(state["asha"]["metrics"][1]) == 0


def test_a_signal_before_the_run_starts_starts_nothing(monkeypatch, tmp_path):
    from toolkit.run import execute, plan_run, process

    plan = plan_run({"entrypoint": "python3 x.py"}, config_path=tmp_path / "x.yaml", model_dir=tmp_path,
                    output_dir=tmp_path)
    monkeypatch.setattr(process.subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    forwarder = process.Forwarder()
    try:
        forwarder.received = signal.SIGTERM
        assert process.run_once(plan, {}, forwarder=forwarder, grace_s=1.0) == 0
        sub = plan.with_output_dir(tmp_path / "trial-0003")  # a search's next trial: not even counted
        assert execute(sub, forwarder=forwarder, hparams={}, hparams_seed=1) == 0
        assert not sub.output_dir.exists() and plan.output_dir == tmp_path
    finally:
        forwarder.restore()
