"""Determined's dsat helpers for Hugging Face scripts and its ``determined.pytorch.deepspeed`` import path
(toolkit.compat.determined.pytorch), checked against what Determined documents. Pure: files only."""

import json

import pytest

from toolkit.compat.determined.errors import DeepSpeedConfigTypeError
from toolkit.compat.determined.pytorch import deepspeed as det_ds
from toolkit.compat.determined.pytorch import dsat
from toolkit.errors import ConfigError


# ---------------------------------------------------------------- determined.pytorch.deepspeed
def test_overwrite_deepspeed_config_merges_leaves_and_changes_nothing(tmp_path):
    base = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": 1e-8}}, "train_batch_size": 8}
    source = {"optimizer": {"params": {"lr": 5e-3}}, "steps_per_print": 1}
    merged = det_ds.overwrite_deepspeed_config(base, source)
    assert merged == {"optimizer": {"type": "Adam", "params": {"lr": 5e-3, "eps": 1e-8}},
                      "train_batch_size": 8, "steps_per_print": 1}
    assert base["optimizer"]["params"]["lr"] == 1e-3
    (tmp_path / "ds.json").write_text(json.dumps(base))
    assert det_ds.overwrite_deepspeed_config(str(tmp_path / "ds.json"), {"train_batch_size": 4})[
        "train_batch_size"] == 4


def test_a_base_of_the_wrong_type_is_a_type_error_as_in_determined(tmp_path):
    with pytest.raises(TypeError) as err:  # Determined: TypeError("Expected string or dict ...")
        det_ds.overwrite_deepspeed_config(["ds.json"], {})
    assert isinstance(err.value, ConfigError) and isinstance(err.value, DeepSpeedConfigTypeError)
    assert "base_ds_config=['ds.json']" in str(err.value) and "got list" in str(err.value)
    (tmp_path / "dup.json").write_text('{"train_batch_size": 8, "train_batch_size": 4}')
    with pytest.raises(ConfigError, match="train_batch_size"):  # duplicate keys refused, as Determined
        det_ds.overwrite_deepspeed_config(str(tmp_path / "dup.json"), None)


# ---------------------------------------------------------------- get_batch_config_from_mbs_gas_and_slots
@pytest.mark.parametrize("ds_config, slots, expected", [
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),  # accumulation absent: 1
    ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto"}, 1, (8, 8, 1)),  # HF's auto
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 999}, 4,
     (32, 2, 4)),  # train_batch_size is replaced, never read
])
def test_the_batch_config_is_consistent(ds_config, slots, expected):
    out = dsat.get_batch_config_from_mbs_gas_and_slots(ds_config, slots)
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    assert out == dict(zip(keys, expected, strict=True))


def test_a_batch_config_that_is_no_dict_is_named():
    with pytest.raises(ConfigError, match=r"ds_config='ds.json': expected a DeepSpeed config dict, got str"):
        dsat.get_batch_config_from_mbs_gas_and_slots("ds.json", 2)  # type: ignore[arg-type]


def test_a_bad_batch_config_lists_every_problem():
    with pytest.raises(ConfigError) as err:
        dsat.get_batch_config_from_mbs_gas_and_slots({"gradient_accumulation_steps": 0}, 0)
    assert err.value.problems == ["train_micro_batch_size_per_gpu=None: expected an integer >= 1",
                                  "gradient_accumulation_steps=0: expected an integer >= 1 or 'auto'",
                                  "slots=0: expected an integer >= 1"]


# ---------------------------------------------------------------- get_hf_args_with_overwrites
HF_ARGS = ["--output_dir", "o", "--deepspeed", "ds.json", "--per_device_train_batch_size", "8", "--do_train"]
BASE = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "zero_optimization": {"stage": 1}}


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOOLKIT_OUTPUT_DIR", raising=False)
    (tmp_path / "ds.json").write_text(json.dumps(BASE))
    return tmp_path


def test_without_overwrites_the_arguments_are_unchanged(cwd):
    args = list(HF_ARGS)
    out = dsat.get_hf_args_with_overwrites(args, {"deepspeed_config": "ds.json"})
    assert out == HF_ARGS and out is not args
    assert dsat.get_hf_args_with_overwrites(["--output_dir", "o"], {}) == ["--output_dir", "o"]


def test_overwrites_reach_the_flags_and_a_new_config_file(cwd):
    hparams = {"deepspeed_config": "ds.json", "overwrite_deepspeed_args": {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
        "zero_optimization": {"stage": 2}}}
    out = dsat.get_hf_args_with_overwrites(HF_ARGS, hparams)
    path = out[out.index("--deepspeed") + 1]
    assert path != "ds.json" and json.loads((cwd / path).read_text()) == {
        **BASE, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
        "zero_optimization": {"stage": 2}}
    assert json.loads((cwd / "ds.json").read_text()) == BASE  # the user's file, shared by trials, untouched
    assert out == ["--output_dir", "o", "--deepspeed", path, "--per_device_train_batch_size", "2",
                   "--do_train", "--gradient_accumulation_steps", "3"]  # set where given, appended where not
    assert dsat.get_hf_args_with_overwrites(HF_ARGS, hparams) == out  # every rank: the same file


def test_what_hugging_faces_parser_reads(cwd):
    """HfArgumentParser's own argparse reads the flags (TrainingArguments itself is not built: it
    needs accelerate, which is not installed here, and a device)."""
    transformers = pytest.importorskip("transformers")
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    args = ["--output_dir", "o", "--deepspeed=ds.json", "--per-device-train-batch-size=16",
            "--gradient_accumulation_steps", "1"]
    hparams = {"overwrite_deepspeed_args": {"train_micro_batch_size_per_gpu": 4,
                                            "gradient_accumulation_steps": 2}}
    read = parser.parse_args(dsat.get_hf_args_with_overwrites(args, hparams))
    assert (read.per_device_train_batch_size, read.gradient_accumulation_steps) == (4, 2)
    assert json.loads((cwd / read.deepspeed).read_text())["train_micro_batch_size_per_gpu"] == 4


def test_auto_values_leave_the_flags_as_given(cwd):
    hparams = {"overwrite_deepspeed_args": {"zero_optimization": {"stage": 3}}}
    out = dsat.get_hf_args_with_overwrites(HF_ARGS, hparams)
    assert out[4:] == ["--per_device_train_batch_size", "8", "--do_train"]
    assert "--gradient_accumulation_steps" not in out


def test_a_dsat_trials_own_config_is_followed(cwd, monkeypatch):
    """Inside a toolkit dsat trial the hyperparameters name the trial's complete config (and carry no
    overwrite_deepspeed_args): --deepspeed is pointed at it, the batch flags follow it."""
    trial = cwd / "trial_3"
    trial.mkdir()
    (trial / "ds_config.json").write_text(json.dumps(
        {**BASE, "train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 2,
         "train_batch_size": 10}))
    monkeypatch.setenv("TOOLKIT_OUTPUT_DIR", str(trial))
    out = dsat.get_hf_args_with_overwrites(HF_ARGS, {"deepspeed_config": str(trial / "ds_config.json")})
    assert out == ["--output_dir", "o", "--deepspeed", str(trial / "ds_config.json"),
                   "--per_device_train_batch_size", "5", "--do_train", "--gradient_accumulation_steps", "2"]
    merged = dsat.get_hf_args_with_overwrites(HF_ARGS, {"overwrite_deepspeed_args": {"steps_per_print": 1}})
    assert merged[3].startswith(str(trial) + "/ds.")  # a merged config goes to the trial's directory


def test_bad_input_is_named(cwd):
    with pytest.raises(ConfigError, match="no '--deepspeed ds_config.json'"):
        dsat.get_hf_args_with_overwrites(["--output_dir", "o"], {"overwrite_deepspeed_args": {}})
    with pytest.raises(ConfigError, match="overwrite_deepspeed_args=3: expected a mapping"):
        dsat.get_hf_args_with_overwrites(HF_ARGS, {"overwrite_deepspeed_args": 3})
    with pytest.raises(TypeError, match="expected a list of arguments"):
        dsat.get_hf_args_with_overwrites("--deepspeed ds.json", {})


def test_a_batch_flag_left_without_its_value_gets_it_appended(cwd):
    hparams = {"overwrite_deepspeed_args": {"train_micro_batch_size_per_gpu": 2}}
    args = ["--deepspeed", "ds.json", "--per_device_train_batch_size"]
    out = dsat.get_hf_args_with_overwrites(args, hparams)
    assert out[2:] == ["--per_device_train_batch_size", "2"]


def test_a_deepspeed_config_given_as_a_dict_is_the_base_of_the_merge(cwd):
    named = {**BASE, "train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3}}
    hparams = {"deepspeed_config": named, "overwrite_deepspeed_args": {"gradient_accumulation_steps": 2}}
    out = dsat.get_hf_args_with_overwrites(HF_ARGS, hparams)
    assert json.loads((cwd / out[3]).read_text()) == {**named, "gradient_accumulation_steps": 2}
    assert out[4:] == ["--per_device_train_batch_size", "3", "--do_train",
                       "--gradient_accumulation_steps", "2"]
    assert json.loads((cwd / "ds.json").read_text()) == BASE  # --deepspeed's file is not the base


def test_hparams_that_are_no_dict_are_named(cwd):
    with pytest.raises(ConfigError, match=r"hparams=\['lr'\]: expected a dict of hyperparameters"):
        dsat.get_hf_args_with_overwrites(HF_ARGS, ["lr"])  # type: ignore[arg-type]
