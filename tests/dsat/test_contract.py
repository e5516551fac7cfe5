"""The autotuner-trial contract (toolkit/dsat/contract.py): a profile's checks, the trial file read
back, the hyperparameters a trial gets (pure, real files in tmp_path)."""

from __future__ import annotations

import json

import pytest

from toolkit.dsat.contract import ProfileInfo, TrialContract, trial_hparams
from toolkit.errors import ConfigError

PROFILE = {"num_params": 10, "trainable_params": 10, "activation_bytes_per_example": 4,
           "memory_per_slot": 100}


@pytest.mark.parametrize("extra, problem", [
    ({"half_precision": "yes"}, "half_precision='yes': expected true or false"),
    ({"calibrated": 1}, "calibrated=1: expected true or false"),
    ({"device": "tpu"}, "device='tpu': expected 'cpu' or 'cuda'"),
    ({"stage_extra_bytes": {"1": 2.5}}, "stage_extra_bytes={'1': 2.5}: expected an object of integers by "
                                        "stage"),
    ({"stage_extra_bytes": [1]}, "stage_extra_bytes=[1]: expected an object of integers by stage"),
    ({"num_params": True}, "num_params=True: expected an integer count >= 0"),
])
def test_a_profile_problem_names_the_field(extra, problem):
    assert ProfileInfo.problem({**PROFILE, **extra}) == problem
    assert ProfileInfo.problem({**PROFILE, "device": "cuda", "stage_extra_bytes": {"1": -3}}) is None


def test_the_trial_file_round_trips_and_a_foreign_one_is_named(tmp_path):
    contract = TrialContract(trial_id=3, result_path=str(tmp_path / "result.json"), start_profile_step=2,
                             end_profile_step=5, profile=True, memory_per_slot=2**30)
    contract.write(tmp_path / "trial.json")
    assert TrialContract.read(tmp_path / "trial.json") == contract
    data = json.loads((tmp_path / "trial.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps({**data, "warmup_steps": 2}))  # another version's field
    with pytest.raises(ConfigError, match=r"in .*other\.json: not a trial file of this toolkit version "
                                          r"\(.*'warmup_steps'\)") as caught:
        TrialContract.read(tmp_path / "other.json")
    assert caught.value.source == str(tmp_path / "other.json")


def test_a_trials_hyperparameters_name_its_config_and_its_global_batch():
    hparams = {"lr": 0.1, "global_batch_size": 32, "overwrite_deepspeed_args": {"train_batch_size": 32},
               "model": {"width": 8}}
    out = trial_hparams(hparams, ds_config={"train_batch_size": 64}, ds_config_path="/t/ds_config.json")
    assert out == {"lr": 0.1, "global_batch_size": 64, "model": {"width": 8},
                   "deepspeed_config": "/t/ds_config.json"}
    out["model"]["width"] = 16
    assert hparams["model"]["width"] == 8 and "overwrite_deepspeed_args" in hparams  # deep-copied
    assert "global_batch_size" not in trial_hparams({"lr": 0.1}, ds_config={"train_batch_size": 64},
                                                    ds_config_path="c.json")
