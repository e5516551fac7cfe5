"""What toolkit.run and its trials share (toolkit.launch.trial_files): the trial's ids derived the same on
every rank and kept once written, a damaged record named, the values of a search's trial recorded with
the seed the searcher drew them with, and the default output directory. Files only; no process."""

import json
import logging
from pathlib import Path

import pytest

from toolkit.errors import ConfigError
from toolkit.launch.trial_files import TRIAL_FILE, load_trial_state, output_dir_for, record_hparams


def test_ids_are_derived_alike_on_every_rank_and_kept_once_written(tmp_path):
    out = tmp_path / "run"
    derived = load_trial_state(out, write=False)
    assert not out.exists() and derived == load_trial_state(out, write=False)  # no agreement needed
    assert set(derived) == {"experiment_id", "trial_id", "trial_seed", "trial_run_id"}
    assert load_trial_state(tmp_path / "other", write=False)["trial_id"] != derived["trial_id"]
    assert load_trial_state(out, write=True) == derived
    assert json.loads((out / TRIAL_FILE).read_text()) == derived
    (out / TRIAL_FILE).write_text(json.dumps(dict(derived, trial_id=7, hparams={"a": 1})))
    assert load_trial_state(out, write=False)["trial_id"] == 7  # what is recorded wins
    (out / TRIAL_FILE).write_text(json.dumps(dict(derived, trial_id="seven")))
    with pytest.raises(ConfigError, match="trial_id='seven': expected integers; .*delete it"):
        load_trial_state(out, write=False)


def test_a_search_trials_values_are_recorded_with_the_searchers_seed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="toolkit.launch.trial_files")
    space = {"n": {"type": "int", "minval": 1, "maxval": 9}}
    out = tmp_path / "trial-0003"
    given = record_hparams(out, {"hyperparameters": space}, values={"n": 4}, seed=77)
    record = json.loads((out / TRIAL_FILE).read_text())
    assert given == {"n": 4} and (record["hparams"], record["hparams_seed"], record["hparams_space"]) == (
        {"n": 4}, 77, space)
    assert "given by the searcher, seed 77" in caplog.text
    assert record_hparams(out, {"hyperparameters": space}, values={"n": 5}, seed=78) == {"n": 4}  # kept


def test_the_output_directory_is_toolkit_output_dir_else_runs_and_the_name(tmp_path, monkeypatch):
    monkeypatch.delenv("TOOLKIT_OUTPUT_DIR", raising=False)
    assert output_dir_for({"name": "my exp/1"}) == Path("runs") / "my-exp-1"
    assert output_dir_for({"name": "../.."}) == Path("runs") / "determined"  # nothing of the name left
    monkeypatch.setenv("TOOLKIT_OUTPUT_DIR", str(tmp_path))
    assert output_dir_for({"name": "x"}) == tmp_path
