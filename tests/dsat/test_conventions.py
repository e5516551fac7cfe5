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
    # --no-merge-config: the config the script gives is only checked
    plan = plan_for(tmp_path, model_dir, "--no-merge-config")
    assert (
        "--no-merge-config: the config the script gives deepspeed.initialize is only checked"
        in plan.config_line()
    )
    assert plan.fingerprint()["merge_config"] is False and not plan.runner.merge_config
    # none named: the script builds it; the first profiling trial records it
    _yaml(model_dir, hparams={"oom_above": 37})
    plan = plan_for(tmp_path, model_dir)
    assert (plan.config_source, plan.base_ds_config, plan.awaiting_config) == ("script", {}, True)
    assert plan.config_line().endswith(
        "the first profiling trial records the config it gives deepspeed.initialize; every trial's tuned "
        "keys (micro-batch, accumulation, global batch, zero_optimization) are merged over the config the "
        "script gives deepspeed.initialize"
    )


def test_a_flag_naming_a_missing_file_is_bad_input(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path)
    _yaml(model_dir, hparams={})  # no config named, and no merge: nothing could reach the engine
    code, output = dsat_in_process(model_dir, "--no-merge-config", capsys=capsys)
    assert code == 2 and "--no-merge-config with no config named" in output and "three ways" in output
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


def test_a_search_stopped_at_a_mismatch_cannot_be_resumed(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path)
    (tmp_path / "out").mkdir()
    result = {
        "spec": {"trial_id": 0, "micro_batch": 1, "zero": {"stage": 1}, "profile": True},
        "status": "mismatch",
        "metrics": {},
        "error": "its engine runs another config",
    }
    (tmp_path / "out" / "events.jsonl").write_text(
        json.dumps({"event": "result", "trial_id": 0, "result": result}) + "\n"
    )
    code, output = dsat_in_process(model_dir, "--resume", capsys=capsys)
    assert code == 2 and "stopped at trial 0, whose engine ran another config than the trial's" in output


def test_a_script_building_its_config_that_recorded_none_stops_with_the_three_ways(tmp_path):
    """The first profiling trial ran, but nothing was recorded at deepspeed.initialize (a script whose
    python runs without the site module, say): the search stops naming the three ways to give the config."""
    from toolkit.dsat.contract import TrialStatus
    from toolkit.dsat.script_config import discovered_plan
    from toolkit.dsat.search.types import TrialResult
    from toolkit.dsat.tuning_plan import profile_spec
    from toolkit.errors import ConfigError

    model_dir = make_model_dir(tmp_path)
    _yaml(model_dir, hparams={"oom_above": 37})
    plan = plan_for(tmp_path, model_dir, "--no-own-config")
    assert plan.awaiting_config and not plan.own_config
    first = TrialResult(profile_spec({}), TrialStatus.OK)
    with pytest.raises(ConfigError) as err:
        discovered_plan(plan, tmp_path / "out", first)
    assert (
        NO_CONFIG in err.value.problems[0]
        and "no config given to deepspeed.initialize" in err.value.problems[0]
    )
    # a recorded config of the script's own: the plan starts from it
    trial_dir = tmp_path / "out" / "trials" / "trial_0"
    trial_dir.mkdir(parents=True)
    own = {"train_batch_size": 16, "optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2}}
    (trial_dir / "script_config.json").write_text(json.dumps({"source": "script", "config": own}))
    planned, labelled = discovered_plan(plan, tmp_path / "out", first)
    assert planned.base_ds_config == own and not planned.awaiting_config
    assert planned.global_batch.train_batch_size == 16 and planned.search.micro_batches == (1, 2, 4, 8, 16)
    assert planned.search.base_zero == {"stage": 2} and labelled.spec.zero == {"stage": 2}
    # a recorded config that breaks a rule: named as the script's, in the file it was recorded in
    bad = {**own, "zero_optimization": {"stage": 7}}
    (trial_dir / "script_config.json").write_text(json.dumps({"source": "script", "config": bad}))
    with pytest.raises(ConfigError) as err:
        discovered_plan(plan, tmp_path / "out", first)
    assert err.value.source == str(trial_dir / "script_config.json")
    assert err.value.problems[0].startswith("the config your script gives deepspeed.initialize: "
                                            "zero_optimization.stage=7")


HF_FILE = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
           "zero_optimization": {"stage": 1}}


def test_an_hf_trainer_entrypoint_is_planned_with_its_flags_and_its_autos(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path)
    (model_dir / "hf.json").write_text(json.dumps(HF_FILE))
    _yaml(model_dir, entrypoint="python3 model.py --deepspeed hf.json --per_device_train_batch_size=6",
          hparams={})
    plan = plan_for(tmp_path, model_dir)
    assert plan.runner.hf_batch_flags and plan.config_flag == ("--deepspeed", "hf.json")
    # the batch keys as the Trainer fills them (accumulation: its default 1), its other "auto" values kept
    assert plan.base_ds_config == {**{k: v for k, v in HF_FILE.items() if k != "train_batch_size"},
                                   "train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1}
    assert "HF Trainer's --per_device_train_batch_size and --gradient_accumulation_steps are set to each " \
           "trial's" in plan.config_line()
    # the same file for DeepSpeed itself: the strings "auto" would reach it
    _yaml(model_dir, entrypoint="python3 model.py --deepspeed_config hf.json", hparams={})
    code, output = dsat_in_process(model_dir, capsys=capsys)
    assert code == 2 and "optimizer.params.lr='auto' is unresolved" in output
    # a flag the Trainer would refuse, named
    _yaml(model_dir, entrypoint="python3 model.py --deepspeed hf.json --gradient_accumulation_steps two",
          hparams={})
    code, output = dsat_in_process(model_dir, capsys=capsys)
    assert code == 2 and "the entrypoint's --gradient_accumulation_steps 'two': expected a positive integer" \
        in output
