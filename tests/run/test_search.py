"""A search's records under python -m toolkit.run (toolkit.run.search): a rerun refuses a changed
search or a corrupt search.json, the watcher of a trial's reports, and a signal before a trial's
run starts nothing. In this process, no trial started (the searcher's decisions are tested in
tests/compat/test_determined_search.py, trials in flight in test_scheduler.py)."""

import json
import signal

import pytest

from toolkit.compat.determined import search

ASHA = {
    "searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "time_metric": "batches",
                 "max_time": 100, "divisor": 2, "mode": "aggressive"},
    "hyperparameters": {"inc": {"type": "int", "minval": 1, "maxval": 8}},
}


def test_a_rerun_refuses_a_changed_search_or_a_corrupt_search_json(tmp_path, capsys):
    from toolkit.run import main

    state = search.new_state(ASHA, seed=5)
    assert search.config_changes(state, ASHA) == []
    more_at_once = dict(ASHA, searcher=dict(ASHA["searcher"], max_concurrent_trials=4))
    assert search.config_changes(state, more_at_once) == []  # how many at once, not which: may change
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
    assert [i for i, _ in state["asha"]["brackets"][0]["metrics"][1]] == [1]  # its last rung recorded too
    state = search.new_state(ASHA, seed=1)
    search.asha_report(state, 0, time_step=50, metric=1.0, config=ASHA)
    watcher = _Watcher(state, dict(trial, metric=None), ASHA, tmp_path, lambda: None)
    assert watcher() is True and watcher.trial["time"] == 50  # while it runs: the stop, at the rung
    watcher.finish(stop_sent=True)  # the stop reached it: later reports set metric and time only
    assert watcher.trial["time"] == 100 and len(state["asha"]["brackets"][0]["metrics"][1]) == 0


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
