"""Experiment YAML and hyperparameters (pure logic, real files)."""

import json
import warnings

import pytest

import toolkit
from toolkit.config.experiment import check_experiment_config, entrypoint_argv, max_length_steps
from toolkit.errors import ConfigError

GOOD = """
name: demo
entrypoint: python3 train.py --epochs 1
resources: {slots_per_trial: 2}
searcher: {metric: loss, smaller_is_better: true, max_length: {batches: 50}}
checkpoint_storage: {storage_path: ckpts, save_trial_latest: 2}
hyperparameters:
  deepspeed_config: ds_config.json
  lr: {type: const, val: 0.01}
  overwrite_deepspeed_args: {train_micro_batch_size_per_gpu: 4}
"""


def write(tmp_path, text, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_good_config(tmp_path):
    config = toolkit.load_experiment_config(write(tmp_path, GOOD))
    assert config["resources"]["slots_per_trial"] == 2
    assert config["hyperparameters"]["lr"] == 0.01  # const unwrapped
    assert max_length_steps(config) == 50
    assert entrypoint_argv(config) == ["python3", "train.py", "--epochs", "1"]


def test_entrypoint_list_and_plain_max_length(tmp_path):
    config = toolkit.load_experiment_config(
        write(tmp_path, "entrypoint: [python3, t.py]\nsearcher: {max_length: 7}\n"))
    assert entrypoint_argv(config) == ["python3", "t.py"] and max_length_steps(config) == 7


def test_empty_file_is_empty_config(tmp_path):
    assert toolkit.load_experiment_config(write(tmp_path, "")) == {}


@pytest.mark.parametrize("text, fragment", [
    ("resources: {slots_per_trial: 0}", "resources.slots_per_trial=0: expected an integer >= 1"),
    ("resources: {slots_per_trial: two}", "resources.slots_per_trial='two'"),
    ("resources: {slots_per_trial: true}", "resources.slots_per_trial=True"),
    ("resources: 2", "resources=2: expected a mapping"),
    ("entrypoint: 3", "entrypoint=3: expected a string or a list"),
    ("entrypoint: []", "entrypoint=[]: expected a non-empty list"),
    ("name: [a]", "name=['a']: expected a string"),
    ("hyperparameters: [1, 2]", "hyperparameters=[1, 2]"),
    ("searcher: {max_length: -5}", "searcher.max_length=-5"),
    ("searcher: {max_length: {epochs: 0}}", "searcher.max_length={'epochs': 0}"),
    ("searcher: {smaller_is_better: 'yes'}", "searcher.smaller_is_better='yes'"),
    ("checkpoint_storage: {storage_path: 5}", "checkpoint_storage.storage_path=5"),
    ("hyperparameters: {lr: {type: double, minval: 0.1, maxval: 1}}", "does not search hyperparameters"),
    ("- just\n- a list", "must hold a mapping"),
])
def test_bad_values_name_the_key(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as info:
        toolkit.load_experiment_config(write(tmp_path, text))
    assert fragment in str(info.value)
    assert "exp.yaml" in str(info.value)


def test_all_problems_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        toolkit.load_experiment_config(write(tmp_path, "entrypoint: 3\nresources: {slots_per_trial: 0}\n"))
    assert len(info.value.problems) == 2


def test_malformed_yaml_gives_line(tmp_path):
    with pytest.raises(ConfigError, match="malformed YAML at line 2"):
        toolkit.load_experiment_config(write(tmp_path, "name: a\nresources: x: y\n"))


def test_python_tags_are_not_executed(tmp_path):
    with pytest.raises(ConfigError, match="malformed YAML"):
        toolkit.load_experiment_config(write(tmp_path, "name: !!python/object/apply:os.system ['true']\n"))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        toolkit.load_experiment_config(tmp_path / "nope.yaml")


def test_unknown_keys_warn_with_suggestion(tmp_path):
    with pytest.warns(toolkit.ConfigWarning, match="'hyperparameter'.*did you mean 'hyperparameters'"):
        toolkit.load_experiment_config(write(tmp_path, "hyperparameter: {}\n"))
    with pytest.warns(toolkit.ConfigWarning, match="resources.'slot_per_trial'"):
        toolkit.load_experiment_config(write(tmp_path, "resources: {slot_per_trial: 2}\n"))


def test_known_keys_do_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        toolkit.load_experiment_config(write(tmp_path, GOOD))


def test_get_hparams_from_path_and_env(tmp_path, monkeypatch):
    path = write(tmp_path, GOOD)
    monkeypatch.delenv(toolkit.TRIAL_HPARAMS_ENV, raising=False)
    monkeypatch.delenv(toolkit.EXPERIMENT_CONFIG_ENV, raising=False)
    assert toolkit.get_hparams(path)["deepspeed_config"] == "ds_config.json"
    assert toolkit.get_hparams() == {}  # outside any trial or YAML: no guard needed in the user's code
    monkeypatch.setenv(toolkit.EXPERIMENT_CONFIG_ENV, str(path))
    assert toolkit.get_hparams()["lr"] == 0.01


def test_get_hparams_inside_a_trial_wins(tmp_path, monkeypatch):
    trial = tmp_path / "hparams.json"
    trial.write_text(json.dumps({"deepspeed_config": "/abs/ds.json", "lr": 0.5}))
    monkeypatch.setenv(toolkit.TRIAL_HPARAMS_ENV, str(trial))
    assert toolkit.get_hparams(write(tmp_path, GOOD)) == {"deepspeed_config": "/abs/ds.json", "lr": 0.5}
    trial.write_text("{broken")
    with pytest.raises(ConfigError, match="TOOLKIT_TRIAL_HPARAMS.*malformed JSON at line 1"):
        toolkit.get_hparams()
    monkeypatch.setenv(toolkit.TRIAL_HPARAMS_ENV, str(tmp_path / "gone.json"))
    with pytest.raises(ConfigError, match="file not found"):
        toolkit.get_hparams()


def test_load_does_not_share_state_between_calls(tmp_path):
    path = write(tmp_path, GOOD)
    first = toolkit.load_experiment_config(path)
    first["hyperparameters"]["overwrite_deepspeed_args"]["x"] = 1
    assert "x" not in toolkit.load_experiment_config(path)["hyperparameters"]["overwrite_deepspeed_args"]


def test_check_experiment_config_lists_every_section():
    bad = {"name": 3, "entrypoint": [], "resources": {"slots_per_trial": True}, "hyperparameters": [1],
           "searcher": {"metric": "", "smaller_is_better": "yes", "max_length": 0},
           "checkpoint_storage": {"storage_path": "", "save_trial_latest": -1}}
    with pytest.raises(ConfigError) as info:
        check_experiment_config(bad, source="exp.yaml")
    keys = [p.split("=")[0] for p in info.value.problems]
    assert keys == ["name", "entrypoint", "resources.slots_per_trial", "hyperparameters", "searcher.metric",
                    "searcher.smaller_is_better", "searcher.max_length", "checkpoint_storage.storage_path",
                    "checkpoint_storage.save_trial_latest"]
    assert "in exp.yaml" in str(info.value)
    with pytest.raises(ConfigError, match="got list"):
        check_experiment_config([1], source="exp.yaml")
    check_experiment_config({"resources": {"slots_per_trial": 1}})  # fine


@pytest.mark.parametrize("config", [{"searcher": "fast"}, {"searcher": {"max_length": {"epochs": 1}}}])
def test_max_length_steps_malformed_is_a_config_error(config):
    with pytest.raises(ConfigError):
        max_length_steps(config)


@pytest.mark.parametrize("entrypoint", ["", " ", 42, [], ["python3", ""], "python3 'train.py", "train.py \\"])
def test_entrypoint_argv_malformed_is_a_config_error(entrypoint):
    with pytest.raises(ConfigError, match="entrypoint="):
        entrypoint_argv({"entrypoint": entrypoint})


@pytest.mark.parametrize("text, fragment", [
    ("name: a\nname: b\n", "duplicate key 'name' (lines 1 and 2)"),
    ("hyperparameters: {lr: .nan}\n", "'.nan' is not a finite number"),
    ("hyperparameters: {lr: 1.0e+999}\n", "'1.0e+999' is not a finite number"),
])
def test_yaml_the_loader_refuses(tmp_path, text, fragment):
    """Read through toolkit.bounded_load (its bounds: tests/reliability/test_security_input.py)."""
    with pytest.raises(ConfigError, match="exp.yaml") as caught:
        toolkit.load_experiment_config(write(tmp_path, text))
    assert fragment in str(caught.value)
