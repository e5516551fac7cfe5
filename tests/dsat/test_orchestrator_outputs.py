"""What a search leaves when it ends (issue 26 items 3, 4): ``best_ds_metrics.json`` in Determined's
flat shape, and the closing lines saying when the global batch is not the user's, also after the
full run. The search's results are given to the autotuner (no trial runs); the full run is one
real launch of a plain-Python simulated model on one slot."""

from __future__ import annotations

import json

import yaml

from helpers import procutil
from toolkit.dsat.cli import build_parser, make_plan
from toolkit.dsat.contract import METRICS, TrialStatus
from toolkit.dsat.full_run import run_full_experiment
from toolkit.dsat.orchestrator import BEST_METRICS_EXTRA_KEYS, Autotuner, best_metrics_record
from toolkit.dsat.search.types import TrialResult, TrialSpec

OK = TrialStatus.OK


def _metrics(scale: float) -> dict[str, float]:
    return {"FLOPS_per_gpu": 1e9 * scale, "throughput": 100.0 * scale, "forward": 2.0 / scale,
            "backward": 4.0 / scale, "latency": 8.0 / scale}


def _tuner(tmp_path, ds, *flags):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    procutil.install_sim_model(procutil.WORKERS / "dsat_model_trial.py", model_dir)
    (model_dir / "ds_config.json").write_text(json.dumps(ds))
    (model_dir / "deepspeed.yaml").write_text(yaml.safe_dump({
        "name": "sim", "entrypoint": "python3 model.py", "resources": {"slots_per_trial": 1},
        "searcher": {"max_length": 10}, "hyperparameters": {"deepspeed_config": "ds_config.json"}}))
    argv = ["binary", str(model_dir / "deepspeed.yaml"), str(model_dir),
            "--output-dir", str(tmp_path / "out"), "--memory-per-slot", "100MiB", *flags]
    said: list[str] = []
    tuner = Autotuner(make_plan(build_parser().parse_args(argv)), say=said.append, argv=argv)
    tuner.out.mkdir(parents=True)
    tuner.results = {0: TrialResult(TrialSpec(0, 1, {"stage": 1}, line=-1, profile=True), OK, _metrics(0.1)),
                     1: TrialResult(TrialSpec(1, 64, {"stage": 1}), OK, _metrics(2.0)),   # the best
                     2: TrialResult(TrialSpec(2, 8, {"stage": 2}), OK, _metrics(1.0))}
    return tuner, said


def test_free_policy_ends_with_the_old_and_new_global_batch_also_after_the_full_run(tmp_path):
    # HelloDeepSpeed's kind of config: a micro-batch and accumulation, no train_batch_size (free)
    tuner, said = _tuner(tmp_path, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    outcome = tuner._conclude()
    out = tmp_path / "out"
    assert outcome.exit_code == 0 and outcome.best is not None and outcome.best.spec.trial_id == 1
    first, last = outcome.message.split("\n")  # what the CLI prints last: "dsat: " + the message
    assert first.startswith("best FLOPS_per_gpu = 2e+09 (trial 1: stage 1, micro-batch 64)")
    assert last == outcome.batch_notice
    assert last.startswith("global batch changed from 8 to 128 samples per step (16x; 128 = micro-batch 64 x "
                           "gradient_accumulation_steps 2 x data-parallel size 1, --global-batch free; ")
    assert last.endswith(f"--global-batch 8 --output-dir {out}-batch8")
    assert json.loads((out / "best_ds_config.json").read_text())["train_batch_size"] == 128

    # Determined's shape: the best trial's metrics at the top level, the extras beside them
    record = json.loads((out / "best_ds_metrics.json").read_text())
    assert {k: record[k] for k in METRICS} == _metrics(2.0)
    assert (record["trial_id"], record["metric"]) == (1, "FLOPS_per_gpu")
    assert "metrics" not in record and set(record) == {*METRICS, *BEST_METRICS_EXTRA_KEYS}
    assert record["global_batch"] == {
        "policy": "free", "train_batch_size": 128, "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 64, "user_train_batch_size": 8, "factor": 16.0, "changed": True,
        "notice": last, "command": last.split("To tune within 8: ")[1]}

    # --run-full-experiment: its last line says it again
    lines: list[str] = []
    assert run_full_experiment(tuner.plan, outcome, say=lines.append) == 0
    assert lines[-2:] == ["full experiment exited with status 0", last]


def test_a_kept_batch_closes_without_a_notice(tmp_path):
    tuner, _ = _tuner(tmp_path, {"train_batch_size": 128, "train_micro_batch_size_per_gpu": 4,
                                 "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    outcome = tuner._conclude()
    assert outcome.batch_notice is None and "\n" not in outcome.message
    record = json.loads((tmp_path / "out" / "best_ds_metrics.json").read_text())
    assert record["global_batch"]["policy"] == "keep" and record["global_batch"]["train_batch_size"] == 128
    assert record["global_batch"]["changed"] is False and record["global_batch"]["notice"] is None


def test_the_extra_keys_never_hide_a_metric():
    assert not set(BEST_METRICS_EXTRA_KEYS) & set(METRICS)
    record = best_metrics_record({"throughput": 5.0, "trial_id": "a metric"}, trial_id=3, metric="throughput",
                                 global_batch={"policy": "free"})
    assert record == {"throughput": 5.0, "trial_id": "a metric", "metric": "throughput",
                      "global_batch": {"policy": "free"}}


def test_tuning_trials_that_only_ran_out_of_memory_leave_the_profiling_results(tmp_path):
    """The main job's autotune: its one tuning trial, at the predicted boundary, ran out of memory;
    the profiling trials the searcher took as results still give the best. Crashed tuning trials
    do not (tests/dsat/test_cli.py::test_all_tuning_trials_failing_is_a_failed_search)."""
    tuner, _ = _tuner(tmp_path, {"train_micro_batch_size_per_gpu": 4})
    tuner.results = {0: TrialResult(TrialSpec(0, 1, {"stage": 1}, line=-1, profile=True), OK, _metrics(1.0)),
                     1: TrialResult(TrialSpec(1, 804, {"stage": 1}), TrialStatus.OOM, {})}
    tuner.taken = {0}
    outcome = tuner._conclude()
    assert outcome.exit_code == 0 and outcome.best is not None and outcome.best.spec.trial_id == 0
    tuner.results[1] = TrialResult(TrialSpec(1, 804, {"stage": 1}), TrialStatus.FAILED, {}, error="crash")
    assert tuner._conclude().exit_code == 1
