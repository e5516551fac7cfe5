"""A search's record (toolkit.run.search_record): a record the previous toolkit wrote (as search.json)
continues under its new name with nothing lost; a rerun refuses a changed search or a damaged record
(exit 2, nothing started). No trial process."""

import copy
import json

from toolkit.launch.trial_files import SEARCH_FILE
from toolkit.run import searchers
from toolkit.run.search_record import OLD_SEARCH_FILE, load_state, save_state

ASHA = {"searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "time_metric": "batches",
                     "max_time": 100, "divisor": 2, "mode": "aggressive"},
        "hyperparameters": {"inc": {"type": "int", "minval": 1, "maxval": 8}}}
# What toolkit.run wrote before issue 40 (save_state of toolkit/run/search.py at c539ff7), as search.json:
# trial 0 was running when the runner was killed, trial 1 was stopped by ASHA at the first rung.
PREVIOUS = {
    "asha": {"brackets": [{"max_trials": 3, "metrics": [[[0, 2.0], [1, 3.0]], []], "rungs": [50, 100]}],
             "trial_rung": {"0": 1, "1": 1}},
    "best": {"best_metric": 3.0, "bracket": 0, "dir": "trial-0001", "exit_status": 0, "hparams": {"inc": 2},
             "index": 1, "metric": 3.0, "seed": 5000016, "state": "COMPLETED", "stopped_early": True,
             "time": 50, "trial_id": 77},
    "experiment_seed": None, "hyperparameters": ASHA["hyperparameters"], "metric": "x", "progress": 0.5,
    "searcher": "adaptive_asha", "searcher_config": ASHA["searcher"], "seed": 5, "smaller_is_better": True,
    "trials": [
        {"best_metric": 2.0, "bracket": 0, "dir": "trial-0000", "hparams": {"inc": 5}, "index": 0,
         "metric": 2.0, "progress": 0.5, "seed": 5000015, "state": "RUNNING", "stopped_early": False,
         "time": 50},
        {"best_metric": 3.0, "bracket": 0, "dir": "trial-0001", "exit_status": 0, "hparams": {"inc": 2},
         "index": 1, "metric": 3.0, "seed": 5000016, "state": "COMPLETED", "stopped_early": True, "time": 50,
         "trial_id": 77}]}


def test_the_previous_toolkits_record_continues_under_its_new_name(tmp_path):
    (tmp_path / OLD_SEARCH_FILE).write_text(json.dumps(PREVIOUS))
    state = load_state(tmp_path, ASHA)
    assert [t.state for t in state.trials] == ["PAUSED", "COMPLETED"]  # the killed runner's: resumed
    assert state.asha.trial_rung == {0: 1, 1: 1} and state.trials[1].trial_id == 77
    assert searchers.next_trial(state, ASHA) is state.trials[0]
    written = {k: v for k, v in copy.deepcopy(PREVIOUS).items()
               if k not in ("best", "metric", "smaller_is_better", "progress")}
    written["trials"][0]["state"] = "PAUSED"
    assert json.loads(json.dumps(state.to_json())) == written  # nothing lost, nothing added
    save_state(tmp_path, state, ASHA)
    record = json.loads((tmp_path / SEARCH_FILE).read_text())
    assert record["best"] == PREVIOUS["best"] and record["progress"] == 0.5
    assert json.loads((tmp_path / OLD_SEARCH_FILE).read_text()) == PREVIOUS  # left as it was
    assert load_state(tmp_path, ASHA).trials[0].state == "PAUSED"  # the new name is read from now on


def test_an_early_records_trials_get_the_seed_their_values_were_drawn_with(tmp_path):
    config = {"searcher": {"name": "random", "metric": "x", "max_trials": 2}}
    (tmp_path / OLD_SEARCH_FILE).write_text(json.dumps({"searcher": "random", "seed": 3, "trials": [
        {"index": 0, "dir": "trial-0000", "hparams": {}, "state": "RUNNING", "metric": None}]}))
    state = load_state(tmp_path, config)  # an early toolkit: no seed per trial, the searcher's name only
    assert state.trials[0].seed == searchers.trial_seed(state, 0) and state.trials[0].state == "PAUSED"


def test_a_rerun_refuses_a_changed_search_or_a_corrupt_record(tmp_path, capsys):
    from toolkit.run import main

    state = searchers.new_state(ASHA, seed=5)
    changed = dict(ASHA, searcher=dict(ASHA["searcher"], name="random", max_trials=4))
    yaml = tmp_path / "exp.yaml"
    yaml.write_text(json.dumps(dict(changed, entrypoint="python3 nothing.py")))
    (tmp_path / SEARCH_FILE).write_text(json.dumps(state.to_json()))
    argv = [str(yaml), str(tmp_path), "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "searcher.name: 'adaptive_asha' when the search started, now 'random'" in err, err
    assert "use a new --output-dir" in err
    (tmp_path / SEARCH_FILE).write_text('{"seed": 1, "tri')
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / SEARCH_FILE} is not valid JSON" in err and not (tmp_path / "trial-0000").exists()
