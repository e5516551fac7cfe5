"""dsat end to end on the real example model: 2 CPU ranks, a memory budget, the best config trained again."""

import csv
import json
import sys

import pytest
import yaml

from helpers import procutil

EXAMPLES = procutil.REPO / "examples" / "core_api"


def small_setup(tmp_path, *, slots=2):
    """The example with small DeepSpeed buckets (so the fixed memory per process is small) and oneDNN on."""
    ds = json.loads((EXAMPLES / "ds_config.json").read_text())
    ds["zero_optimization"] = {
        "stage": 1,
        "reduce_bucket_size": 5_000_000,
        "allgather_bucket_size": 5_000_000,
    }
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    config = yaml.safe_load((EXAMPLES / "deepspeed.yaml").read_text())
    config["resources"]["slots_per_trial"] = slots
    config["hyperparameters"].update(
        {
            "deepspeed_config": str(tmp_path / "ds_config.json"),
            "deterministic": False,
            "dataset_size": 4096,
            "validate_every": 1000,
            "checkpoint_every": 1000,
        }
    )
    (tmp_path / "deepspeed.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "deepspeed.yaml"


@pytest.mark.slow
def test_binary_search_on_the_example_then_train_with_the_best_config(tmp_path):
    config = small_setup(tmp_path)
    out = tmp_path / "dsat"
    result = procutil.run([sys.executable, "-m", "toolkit.dsat", "binary", str(config), str(EXAMPLES),
                    # 600 MiB per rank: a boundary near 260 (0.73 MiB per example above ~400 MiB),
                    # well below the data's and the trial timeout's caps on a loaded machine
                    "--max-trials", "7", "--memory-per-slot", "600MiB", "--search-range-factor", "3",
                    # latency: Determined's upward bisection, whose first trial (1.5x the memory
                    # model's boundary) runs out of memory; throughput brackets its peak below
                    "--metric", "latency",
                    # stage 1 alone: its profiling trials leave 3 tuning trials, so that a search whose
                    # first two trials run out of memory (a loaded machine's peaks) still finds a fit
                    # (another stage's point: tests/dsat/test_profiling_phase.py)
                    "--zero-stages", "1", "--start-profile-step", "2", "--end-profile-step", "3",
                    # no re-runs of the best here (tests/dsat/test_tuner_cli.py confirms one on the simulated
                    # model), nor of the example's own config (tests/dsat/test_conventions.py measures one)
                    "--confirm", "0", "--no-own-config", "--trial-timeout", "240", "--output-dir", str(out)],
                           timeout=1200)
    assert result.returncode == 0, result.stdout[-5000:]
    with open(out / "trials.csv") as fh:
        rows = list(csv.DictReader(fh))
    # the profiling trials (1, k, stage 1's ladder nearer its boundary), then tuning
    profiling = [r for r in rows if r["role"] == "profiling"]
    assert 4 <= len(profiling) <= 7 and rows[:len(profiling)] == profiling, [
        (r["trial"], r["role"]) for r in rows]
    assert [r["trial"] for r in profiling] == [f"p{i}" for i in range(1, len(profiling) + 1)]  # as they ran
    tuning = rows[len(profiling):]
    # --max-trials 7 counts the profiling trials too, but the search always gets one tuning trial
    assert len(rows) == max(7, len(profiling) + 1) and tuning and {r["role"] for r in tuning} == {"tuning"}
    # what micro-batch 1 takes of the budget: the start-up's peak and the steps' apart, in the closing lines
    share = json.loads((out / "profile.json").read_text())["micro_batch_1"]
    assert share["budget_bytes"] == 600 * 2**20 and 0 < share["startup_peak_bytes"] <= share["budget_bytes"]
    assert 0 < share["step_peak_bytes"] and share["share"] < 1
    assert f"micro-batch 1 takes {100 * share['share']:.0f}% of the 600 MiB budget per slot" in result.stdout
    assert "-- profiling trials" in result.stdout
    assert f"-- tuning trials (the search's): {len(tuning)}" in result.stdout
    statuses = [r["status"] for r in rows[1:]]
    assert "oom" in statuses, statuses          # some trials exceeded the budget ...
    assert "ok" in statuses, statuses           # ... and some fit
    oom_errors = [r["error"] for r in rows if r["status"] == "oom"]
    assert all("exceeded the memory budget" in e for e in oom_errors), oom_errors
    best = json.loads((out / "best_ds_config.json").read_text())
    assert (
        best["train_batch_size"]
        == best["train_micro_batch_size_per_gpu"] * best["gradient_accumulation_steps"] * 2
    )
    # best_ds_metrics.json as Determined wrote it: the metrics at the top level. The example's
    # config sets only the micro-batch (8, on 2 ranks: 16 samples per step), so the policy is free
    # and the last line says when the best config's global batch is another.
    metrics = json.loads((out / "best_ds_metrics.json").read_text())
    best_row = next(r for r in rows if int(r["trial_id"]) == metrics["trial_id"])
    assert metrics["latency"] == pytest.approx(float(best_row["latency"]))
    assert "metrics" not in metrics and metrics["metric"] == "latency"
    batch = metrics["global_batch"]
    assert (batch["policy"], batch["user_train_batch_size"]) == ("free", 16)
    assert batch["train_batch_size"] == best["train_batch_size"]
    last = result.stdout.rstrip().splitlines()[-1]
    if best["train_batch_size"] != 16:
        assert last == batch["notice"]
        assert last.startswith(f"global batch changed from 16 to {best['train_batch_size']} samples per step")
        assert "--global-batch 16 --output-dir" in last
    else:
        assert last.startswith("micro-batch 1 takes") and batch["notice"] is None

    # The best config, passed back to the example through its own YAML, trains it.
    experiment = yaml.safe_load(config.read_text())
    experiment["hyperparameters"]["deepspeed_config"] = str(out / "best_ds_config.json")
    experiment["hyperparameters"].pop("overwrite_deepspeed_args")
    (tmp_path / "best.yaml").write_text(yaml.safe_dump(experiment))
    argv = procutil.torchrun_argv(EXAMPLES / "train.py", "--config", str(tmp_path / "best.yaml"),
                                  "--output-dir", str(tmp_path / "run"), "--max-steps", "3")
    train = procutil.run(argv, timeout=600)
    assert train.returncode == 0, train.stdout[-4000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_3"


@pytest.mark.slow
def test_an_offload_trial_runs_on_cpu(tmp_path):
    """One real ZeRO-Offload trial (issue 12): optimizer state offloaded to the CPU at stage 2, where
    DeepSpeed steps it with DeepSpeedCPUAdam; the global batch 8 kept. On 1 rank: offloading is no
    collective, and each rank fewer saves a process start in both trials (the 2-rank search above)."""
    config = small_setup(tmp_path, slots=1)
    out = tmp_path / "dsat"
    result = procutil.run([sys.executable, "-m", "toolkit.dsat", "binary", str(config), str(EXAMPLES),
                    "--max-trials", "2", "--memory-per-slot", "1400MiB", "--zero-stages", "2",
                    "--offload", "always", "--global-batch", "8", "--start-profile-step", "2",
                    "--end-profile-step", "3", "--confirm", "0", "--no-own-config", "--trial-timeout", "240",
                    "--output-dir", str(out)], timeout=900)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "global batch: fixed train_batch_size=8" in result.stdout
    records = {r["trial_id"]: r for r in map(json.loads, (out / "trials.jsonl").read_text().splitlines())}
    assert records[1]["status"] == "ok" and not records[1]["profile"], records  # the one tuning trial
    # every trial keeps it, the profiling trials included, but the first: micro-batch 1 measures
    # memory with accumulation 1, not 8 (plan.memory_only)
    first = records[0]["ds_overrides"]
    assert (first["train_batch_size"], first["gradient_accumulation_steps"]) == (1, 1), records
    assert all(r["ds_overrides"]["train_batch_size"] == 8 for i, r in records.items() if i != 0), records
    offloaded = records[1]["ds_overrides"]
    assert offloaded["zero_optimization"]["stage"] == 2
    assert offloaded["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert offloaded["train_batch_size"] == 8
    trial = json.loads((out / "trials" / "trial_1" / "ds_config.json").read_text())  # what DeepSpeed ran
    assert trial["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert trial["optimizer"]["type"] == "Adam"  # with the optimizer offloaded: DeepSpeedCPUAdam
    best = json.loads((out / "best_ds_config.json").read_text())
    assert best["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert best["train_batch_size"] == 8
    # 8 is also what the example's config implies (8 x 1 x 1): no notice, the summary's lines are the last
    batch = json.loads((out / "best_ds_metrics.json").read_text())["global_batch"]
    assert (batch["user_train_batch_size"], batch["changed"], batch["notice"]) == (8, False, None)
    summary, share = result.stdout.rstrip().splitlines()[-2:]
    assert summary.startswith("dsat: best FLOPS_per_gpu") and share.startswith("micro-batch 1 takes")
