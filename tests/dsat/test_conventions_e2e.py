"""dsat tunes the examples/dsat scripts as they take their DeepSpeed config (issue 37): real searches,
real DeepSpeed trials (one rank each: what is checked is the config each engine ran, read from the
engine; 2-rank trials of the same hook: tests/dsat/trial/test_reporting.py)."""

import json
import shutil
import sys

import pytest
import yaml

from helpers import procutil
from toolkit.dsat.tuned_keys import TUNED_KEYS

EXAMPLES = procutil.REPO / "examples" / "dsat"
USER = json.loads((EXAMPLES / "ds_config.json").read_text())  # train_in_code.py's dict is the same config


def _search(tmp_path, yaml_name, *flags, hparams=None, model_dir=EXAMPLES, trials=2, entrypoint=None):
    config = yaml.safe_load((EXAMPLES / yaml_name).read_text())
    config["resources"]["slots_per_trial"] = 1
    if hparams:
        config["hyperparameters"] = hparams
    if entrypoint is not None or model_dir != EXAMPLES:
        config["entrypoint"] = entrypoint or "python3 dsat_own_json.py"
    (tmp_path / yaml_name).write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "toolkit.dsat",
        "binary",
        str(tmp_path / yaml_name),
        str(model_dir),
        "--output-dir",
        str(out),
        "--metric",
        "throughput",
        "--max-trials",
        str(trials),
        "--zero-stages",
        "1",
        "--memory-per-slot",
        "1GiB",
        "--trial-timeout",
        "240",
        "--confirm",
        "0",
        "--timed-window",
        "0",
        "--start-profile-step",
        "2",
        "--end-profile-step",
        "3",
        *flags,
    ]
    result = procutil.run(argv, timeout=900)
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    return result, out, rows


def _engines_ran_their_labels(out, rows):
    """Every ok trial's engine (its own report) trained the micro-batch and stage it is labelled with."""
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == len(rows) and len(rows) >= 3, rows  # p1, the search's trials, the user's own config
    for row in ok:
        engine = json.loads((out / "trials" / f"trial_{row['trial_id']}" / "result.json").read_text())[
            "engine"
        ]
        assert (engine["micro_batch"], engine["stage"]) == (row["micro_batch"], row["stage"]), (row, engine)


def _best_beats_the_users_own(result, out, rows):
    best, metrics = (
        json.loads((out / name).read_text()) for name in ("best_ds_config.json", "best_ds_metrics.json")
    )
    # the user's untuned keys, as written; the tuned keys the best trial's; no autotuning leftovers
    assert {k: v for k, v in best.items() if k not in TUNED_KEYS} == {
        k: v for k, v in USER.items() if k not in TUNED_KEYS
    }
    assert best["zero_optimization"] == USER["zero_optimization"]
    assert best["train_micro_batch_size_per_gpu"] == metrics["global_batch"]["train_micro_batch_size_per_gpu"]
    own = metrics["own_config"]
    assert (own["micro_batch"], own["stage"], own["statuses"]) == (2, 1, ["ok"])
    assert [r["role"] for r in rows][-1] == "own" and own["value"] == pytest.approx(rows[-1]["throughput"])
    seen = [(r["trial"], r["status"], r["micro_batch"], r.get("throughput")) for r in rows]
    assert own["factor"] > 1 and metrics["throughput"] > own["value"], (metrics, seen)  # side by side
    line = next(x for x in result.stdout.splitlines() if x.startswith("your own config"))
    assert line.startswith("your own config (stage 1, micro-batch 2; trial own): throughput = ")


@pytest.mark.slow
def test_a_deepspeed_config_script_is_tuned_through_its_own_flag(tmp_path):
    result, out, rows = _search(tmp_path, "ds_config_flag.yaml", trials=3)
    assert result.returncode == 0, result.stdout[-5000:]
    first = result.stdout.splitlines()[0]
    assert first == (
        "dsat: the search starts from the DeepSpeed config of the entrypoint's --deepspeed_config "
        "ds_config.json; each trial's own config file replaces --deepspeed_config ds_config.json in the "
        "entrypoint; every trial's tuned keys (micro-batch, accumulation, global batch, zero_optimization) "
        "are merged over the config the script gives deepspeed.initialize"
    )
    _engines_ran_their_labels(out, rows)
    for row in rows:  # each trial was started with its own file in the flag, and its script read that file
        trial = out / "trials" / f"trial_{row['trial_id']}"
        started = next(x for x in result.stdout.splitlines() if x.startswith(f"trial {row['trial']} started"))
        assert f"--deepspeed --deepspeed_config {trial / 'ds_config.json'}" in started, started
        assert json.loads((trial / "script_config.json").read_text())["source"] == "trial"
    _best_beats_the_users_own(result, out, rows)


@pytest.mark.slow
def test_a_script_that_builds_its_config_in_code_is_tuned_with_the_one_line(tmp_path):
    result, out, rows = _search(tmp_path, "in_code.yaml", trials=3)
    assert result.returncode == 0, result.stdout[-5000:]
    assert result.stdout.splitlines()[0].startswith(
        "dsat: the search starts from the DeepSpeed config of the script itself"
    )
    assert (
        "the script's own DeepSpeed config, recorded by trial p1, is the search's base: micro-batch 2, ZeRO "
        "stage 1"
    ) in result.stdout
    recorded = json.loads((out / "trials" / "trial_0" / "script_config.json").read_text())
    assert (
        recorded["how"] == "a dict given as deepspeed.initialize(config=...)"
        and recorded["source"] == "script"
    )
    assert recorded["config"] == {k: v for k, v in USER.items() if k != "gradient_accumulation_steps"}
    _engines_ran_their_labels(out, rows)
    tuning = out / "trials" / f"trial_{rows[1]['trial_id']}" / "trial.log"
    assert f"merged its tuned keys (micro-batch {rows[1]['micro_batch']}, " in tuning.read_text()
    _best_beats_the_users_own(result, out, rows)


@pytest.mark.slow
def test_a_script_that_ignores_the_trials_config_stops_the_search_in_its_first_trial(tmp_path):
    """The YAML names the script's config file, which the script ignores (it builds its own dict, as the
    first client of issue 37 read its own JSON), and --no-merge-config keeps dsat from merging: the engine
    trains micro-batch 2 whatever the trial says."""
    result, out, rows = _search(
        tmp_path, "in_code.yaml", "--no-merge-config", hparams={"deepspeed_config": "ds_config.json"}
    )
    assert result.returncode == 2, result.stdout[-5000:]
    assert [(r["trial"], r["status"]) for r in rows] == [("p1", "mismatch")]
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith(
        "dsat: search stopped: stopped at trial p1 (labelled micro-batch 1, gradient accumulation 1, ZeRO "
        "stage 1, offload_optimizer none, offload_param none)"
    )
    for part in (
        "micro-batch: the engine runs 2, the trial is labelled 1",
        "a dict given as deepspeed.initialize",
        "--no-merge-config kept it as written",
        "No best config was written",
    ):
        assert part in last, part
    assert not list(out.glob("best_ds_*.json"))


@pytest.mark.slow
def test_a_script_that_reads_its_own_json_and_sizes_its_loader_from_it_is_tuned(tmp_path):
    """The YAML names the file the script reads itself: in a trial that read opens the trial's config,
    so the loader follows the trial's micro-batch; a micro-batch larger than the data set (3000) is a
    failed trial of that config, not a mismatch, and the search goes on."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(procutil.REPO / "tests" / "workers" / "dsat_own_json.py", model_dir)
    shutil.copy(EXAMPLES / "ds_config.json", model_dir)
    result, out, rows = _search(tmp_path, "in_code.yaml", hparams={"deepspeed_config": "ds_config.json"},
                                model_dir=model_dir)
    assert result.returncode == 0, result.stdout[-5000:]
    statuses = {r["status"] for r in rows}
    assert statuses <= {"ok", "failed"} and "ok" in statuses, rows
    for row in rows:
        if row["status"] == "failed":
            assert row["micro_batch"] > 3000 and "the data set (per rank) is smaller" in row["error"], row
        else:
            engine = json.loads((out / "trials" / f"trial_{row['trial_id']}" / "result.json").read_text())
            assert engine["engine"]["micro_batch"] == row["micro_batch"], (row, engine)
    first_ok = next(r for r in rows if r["status"] == "ok")
    log = (out / "trials" / f"trial_{first_ok['trial_id']}" / "trial.log").read_text()
    assert f"reads its DeepSpeed config {model_dir / 'ds_config.json'}" in log
    assert json.loads((model_dir / "ds_config.json").read_text()) == USER  # the user's file as written
    metrics = json.loads((out / "best_ds_metrics.json").read_text())
    assert metrics["own_config"]["factor"] >= 1, metrics  # measured beside the best (2 trials: it may be it)


@pytest.mark.slow
def test_an_hf_trainer_script_is_tuned_through_its_own_flags(tmp_path):
    """examples/dsat/train_hf.py, transformers' real Trainer: its file's "auto" values are the Trainer's to
    fill, each trial gets its own file and its own --per_device_train_batch_size, and the best config
    keeps the user's "auto" values, with the flags to run it."""
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate for --deepspeed: "
                                             "pip install '.[hf]' (scripts/setup.sh installs it)")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("train_hf.py", "hf_ds_config.json"):
        shutil.copy(EXAMPLES / name, model_dir)
    entrypoint = (f"python3 train_hf.py --deepspeed hf_ds_config.json --output_dir {tmp_path / 'hf_out'} "
                  "--per_device_train_batch_size 4 --max_steps 30 --report_to none --save_strategy no "
                  "--disable_tqdm true")
    result, out, rows = _search(tmp_path, "hf_trainer.yaml", model_dir=model_dir, entrypoint=entrypoint,
                                trials=3)
    assert result.returncode == 0, result.stdout[-5000:]
    _engines_ran_their_labels(out, rows)
    lines = result.stdout.splitlines()
    for row in rows:  # its own file in the flag, its micro-batch in the Trainer's flag (its data follows it)
        trial = out / "trials" / f"trial_{row['trial_id']}"
        started = next(x for x in lines if x.startswith(f"trial {row['trial']} started"))
        assert f"--deepspeed {trial / 'ds_config.json'}" in started, started
        assert f"--per_device_train_batch_size {row['micro_batch']} " in started, started
        assert started.endswith(" --gradient_accumulation_steps 1"), started
    user = json.loads((model_dir / "hf_ds_config.json").read_text())
    best = json.loads((out / "best_ds_config.json").read_text())
    metrics = json.loads((out / "best_ds_metrics.json").read_text())
    micro_batch = metrics["global_batch"]["train_micro_batch_size_per_gpu"]
    # the user's "auto" values kept, the tuned micro-batch and accumulation, no train_batch_size
    assert best == {**user, "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1}
    assert metrics["own_config"]["micro_batch"] == 4 and metrics["own_config"]["statuses"] == ["ok"]
    flags = next(x for x in lines if x.startswith("HF Trainer: run it with"))
    assert flags.endswith(f"--per_device_train_batch_size {best['train_micro_batch_size_per_gpu']} "
                          "--gradient_accumulation_steps 1")
