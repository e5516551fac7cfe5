"""dsat and the ways a script takes its DeepSpeed config (issue 37), on the simulated model: where the
search's base config comes from, a trial whose engine ran another config (the search stops, exit 2, no
best), the user's own config measured beside the best. Real DeepSpeed trials of each convention:
tests/dsat/test_conventions_e2e.py."""

import json

import pytest
import yaml

from helpers.dsatcli import dsat, dsat_in_process, make_model_dir, plan_for, trial_rows
from toolkit.dsat.script_config import NO_CONFIG


def _yaml(model_dir, *, entrypoint=None, hparams=None):
    """The model's YAML with its entrypoint and hyperparameters replaced."""
    config = yaml.safe_load((model_dir / "deepspeed.yaml").read_text())
    if entrypoint is not None:
        config["entrypoint"] = entrypoint
    if hparams is not None:
        config["hyperparameters"] = hparams
    (model_dir / "deepspeed.yaml").write_text(yaml.safe_dump(config))


def test_where_the_search_starts_from(tmp_path):
    model_dir = make_model_dir(tmp_path)
    user = json.loads((model_dir / "ds_config.json").read_text())
    # the entrypoint's flag, when the hyperparameters name no config (overwrite_deepspeed_args still applies)
    _yaml(
        model_dir,
        entrypoint="python3 model.py --deepspeed --deepspeed_config ds_config.json",
        hparams={"overwrite_deepspeed_args": {"gradient_clipping": 0.5}},
    )
    plan = plan_for(tmp_path, model_dir)
    assert plan.config_source == "entrypoint flag" and plan.config_flag == (
        "--deepspeed_config",
        "ds_config.json",
    )
    assert plan.base_ds_config == {**user, "gradient_clipping": 0.5} and not plan.awaiting_config
    assert (
        "the entrypoint's --deepspeed_config ds_config.json; each trial's own config file replaces"
        in plan.config_line()
    )
    # the hyperparameters' file wins over the flag's (and is said)
    _yaml(model_dir, hparams={"deepspeed_config": "ds_config.json"})
    assert plan_for(tmp_path, model_dir).config_source == "hyperparameters.deepspeed_config"
    # DeepSpeed keys written in the hyperparameters
    _yaml(model_dir, entrypoint="python3 model.py", hparams={"train_micro_batch_size_per_gpu": 3})
    plan = plan_for(tmp_path, model_dir)
    assert (plan.config_source, plan.base_ds_config) == (
        "hyperparameters",
        {"train_micro_batch_size_per_gpu": 3},
    )
    # none named: the script builds it; the first profiling trial records it
    _yaml(model_dir, hparams={"oom_above": 37})
    plan = plan_for(tmp_path, model_dir, "--no-merge-config")
    assert (plan.config_source, plan.base_ds_config, plan.awaiting_config) == ("script", {}, True)
    assert "the first profiling trial records the config it gives deepspeed.initialize" in plan.config_line()
    assert (
        "--no-merge-config: the config the script gives deepspeed.initialize is only checked"
        in plan.config_line()
    )
    assert plan.fingerprint()["merge_config"] is False and not plan.runner.merge_config


def test_a_flag_naming_a_missing_file_is_bad_input(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path)
    _yaml(model_dir, entrypoint="python3 model.py --deepspeed_config missing.json", hparams={})
    code, output = dsat_in_process(model_dir, capsys=capsys)
    assert (
        code == 2 and "the entrypoint's --deepspeed_config missing.json: no such file in MODEL_DIR" in output
    )
    assert not (tmp_path / "out").exists()


def test_a_trial_whose_engine_ran_another_config_stops_the_search(tmp_path):
    """The simulated script's engine trains micro-batch 2 whatever it is given, and its result says so,
    as a real trial's does: the first trial ends the search with exit 2, nothing ranked, no best."""
    model_dir = make_model_dir(tmp_path, hparams={"script_micro_batch": 2})
    result = dsat(model_dir, "--max-trials", "6", "--memory-per-slot", "100MiB")
    out = tmp_path / "out"
    assert result.returncode == 2, result.stdout[-3000:]
    rows = trial_rows(out)
    assert [(r["trial"], r["status"], r["throughput"]) for r in rows] == [("p1", "mismatch", "")]
    assert "micro-batch: the engine runs 2, the trial is labelled 1" in rows[0]["error"]
    last = result.stdout.rstrip().splitlines()[-1]
    assert (
        last.startswith("dsat: search stopped: stopped at trial p1 (labelled micro-batch 1, ")
        and "No best config was written" in last
    )
    assert not list(out.glob("best_ds_*.json")) and not (out / "tensorboard").exists()
    # nothing of it can be resumed
    again = dsat(model_dir, "--max-trials", "6", "--memory-per-slot", "100MiB", "--resume")
    assert again.returncode == 2 and "stopped at trial 0, whose engine ran another config" in again.stdout


def test_a_script_building_its_config_that_records_none_stops_with_the_three_ways(tmp_path):
    """No config named, and the first trial recorded none (the simulated script never calls
    deepspeed.initialize): exit 2 after that trial, naming the three ways to give dsat the config."""
    model_dir = make_model_dir(tmp_path)
    _yaml(model_dir, hparams={"oom_above": 37})  # the simulated model reads the trial's file all the same
    result = dsat(model_dir, "--max-trials", "4", "--memory-per-slot", "100MiB")
    assert result.returncode == 2, result.stdout[-3000:]
    assert result.stdout.splitlines()[0].startswith(
        "dsat: the search starts from the DeepSpeed config of the script itself"
    )
    assert (
        NO_CONFIG in result.stdout
        and "no config given to deepspeed.initialize by the script was recorded" in result.stdout
    )
    assert [r["trial"] for r in trial_rows(tmp_path / "out")] == ["p1"]
    assert not (tmp_path / "out" / "best_ds_config.json").exists()


@pytest.mark.parametrize("skip", [False, True])
def test_the_users_own_config_is_measured_beside_the_best(tmp_path, skip):
    """The user's config: micro-batch 3, accumulation 2, stage 1; a search of 2 trials runs micro-batch 1
    and one tuning trial (a power of 2), then (unless --no-own-config) the user's own config."""
    model_dir = make_model_dir(
        tmp_path,
        ds={
            "train_micro_batch_size_per_gpu": 3,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 1},
        },
    )
    flags = ("--no-own-config",) if skip else ()
    result = dsat(model_dir, "--max-trials", "2", "--zero-stages", "1", "--memory-per-slot", "100MiB", *flags)
    assert result.returncode == 0, result.stdout[-3000:]
    rows = trial_rows(tmp_path / "out")
    metrics = json.loads((tmp_path / "out" / "best_ds_metrics.json").read_text())
    if skip:
        assert [r["role"] for r in rows] == ["profiling", "tuning"] and metrics["own_config"] == {}
        assert "your own config" not in result.stdout
        return
    assert [(r["role"], r["trial"], r["micro_batch"]) for r in rows][-1] == ("own", "own", "3")
    own = metrics["own_config"]
    assert (own["micro_batch"], own["stage"], own["trials"], own["statuses"]) == (3, 1, "own", ["ok"])
    assert own["value"] == float(rows[-1]["FLOPS_per_gpu"]) and own["factor"] == pytest.approx(
        metrics["FLOPS_per_gpu"] / own["value"]
    )
    line = next(x for x in result.stdout.splitlines() if x.startswith("your own config"))
    assert line == (
        f"your own config (stage 1, micro-batch 3; trial own): FLOPS_per_gpu = {own['value']:.4g}, "
        f"the best's {metrics['FLOPS_per_gpu']:.4g}; the best is {own['factor']:.3g}x as good"
    )
    assert "measuring your own config as written (stage 1, micro-batch 3)" in result.stdout
