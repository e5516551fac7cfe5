"""toolkit.dsat.hf_trainer: HF Trainer's --deepspeed convention, pure (the real Trainer under dsat:
tests/dsat/test_conventions_e2e.py)."""

import pytest

from toolkit.dsat.hf_trainer import hf_base_config, hf_trial_config, is_hf_trainer, with_batch_flags
from toolkit.errors import ConfigError

MBS, GAS, TBS = "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"


def test_which_entrypoints_follow_the_trainers_convention():
    hf = ("--deepspeed", "ds.json")
    assert is_hf_trainer(hf, ["python3", "t.py", "--per_device_train_batch_size", "2"], {MBS: 2})
    assert is_hf_trainer(hf, ["python3", "t.py", "--gradient_accumulation_steps=2"], {MBS: 2})
    # a --deepspeed PATH script of its own, with nothing of the Trainer's: its flags are not touched
    assert not is_hf_trainer(hf, ["python3", "t.py"], {MBS: 2})
    assert not is_hf_trainer(None, ["python3", "t.py", "--per_device_train_batch_size", "2"], {MBS: "auto"})


def test_the_files_auto_batch_keys_take_the_flags_or_the_trainers_defaults():
    user = {MBS: "auto", GAS: "auto", TBS: "auto", "gradient_clipping": "auto"}
    flags = ["t.py", "--per_device_train_batch_size", "3", "--gradient_accumulation_steps=2"]
    assert hf_base_config(user, flags) == {MBS: 3, GAS: 2, "gradient_clipping": "auto"}
    assert hf_base_config(user, ["t.py"]) == {MBS: 8, GAS: 1, "gradient_clipping": "auto"}
    assert hf_base_config({MBS: 5, TBS: 10}, flags) == {MBS: 5, TBS: 10}  # values of the file's own stay
    assert user[TBS] == "auto"  # not mutated
    with pytest.raises(ConfigError) as err:
        hf_base_config(user, ["--per_device_train_batch_size", "0", "--gradient_accumulation_steps", "x"])
    assert len(err.value.problems) == 2 and "--per_device_train_batch_size '0'" in err.value.problems[0]


def test_a_trials_config_in_the_trainers_shape_and_its_flags():
    kept = hf_trial_config({TBS: 32, MBS: 4, "zero_optimization": {"stage": 2}}, data_parallel_size=2)
    assert kept == {MBS: 4, GAS: 4, "zero_optimization": {"stage": 2}}
    assert hf_trial_config({MBS: 4}, data_parallel_size=2) == {MBS: 4, GAS: 1}
    assert hf_trial_config({MBS: 4, GAS: 3, TBS: 24}, data_parallel_size=2) == {MBS: 4, GAS: 3}
    argv = ["python3", "t.py", "--per_device_train_batch_size=2", "--max_steps", "9"]
    assert with_batch_flags(argv, kept) == ["python3", "t.py", "--per_device_train_batch_size=4",
                                            "--max_steps", "9", "--gradient_accumulation_steps", "4"]
    assert with_batch_flags(["t.py"], kept) == ["t.py", "--per_device_train_batch_size", "4",
                                                "--gradient_accumulation_steps", "4"]
    assert argv[2] == "--per_device_train_batch_size=2"  # a new list
