"""The dsat command line and search loop, with real trial processes of a simulated model (fast)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from helpers import procutil
from helpers.dsatcli import KEEP_64, dsat, dsat_in_process, make_model_dir, plan_for, trial_rows
from toolkit.dsat.search.types import TrialSpec
from toolkit.dsat.tuning_plan import memory_only, profile_spec, trial_ds_config


# ---------------------------------------------------------------- bad input: exit 2, nothing written
@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--max-trials", "1"], "--max-trials=1: expected an integer >= 2 (it counts the profiling trial)"),
        (["--max-trials", "x"], "argument --max-trials: 'x' is not an integer"),
        (["--max-concurrent-trials", "0"], "--max-concurrent-trials=0: expected an integer >= 1"),
        (["--zero-stages", "4"], "argument --zero-stages: '4' is not a ZeRO stage"),
        (["--metric", "speed"], "argument --metric: invalid choice: 'speed'"),
        (["--confirm", "-1"], "--confirm=-1: expected an integer >= 0"),
        (["--trial-timeout", "0"], "--trial-timeout=0.0: expected a number of seconds > 0"),
        (["--memory-per-slot", "3XB"], "argument --memory-per-slot: '3XB' is not a size"),
        (["--start-profile-step", "0"], "--start-profile-step=0: expected an integer >= 1"),
        (["--memory-per-slot", "0"], "--memory-per-slot=0: expected an integer >= 1"),
        (
            ["--start-profile-step", "5", "--end-profile-step", "4"],
            "--end-profile-step=4 < --start-profile-step=5",
        ),
        (["--timed-window", "-1"], "--timed-window=-1.0: expected a number of seconds >= 0"),
        (["--timed-window", "inf"], "argument --timed-window: 'inf' is not a finite number"),
        (["--search-range-factor", "-1"], "--search-range-factor=-1.0: expected a number > 0"),
        (["--bisect-tolerance", "1"], "--bisect-tolerance=1.0: expected a number >= 0 and < 1"),
        (["--bisect-tolerance", "-0.1"], "--bisect-tolerance=-0.1: expected a number >= 0 and < 1"),
        (["--bisect-tolerance", "nan"], "argument --bisect-tolerance: 'nan' is not a finite number"),
        (["--search-range-factor", "inf"], "argument --search-range-factor: 'inf' is not a finite number"),
        (["--bisect-tolerance", "10%"], "argument --bisect-tolerance: '10%' is not a number"),
        (["--max-slots", "1"], None),  # valid with slots_per_trial 1: checked separately below
    ],
)
def test_bad_flags_exit_2_and_write_nothing(tmp_path, flags, fragment, capsys):
    model_dir = make_model_dir(tmp_path, slots=2 if fragment is None else 1)
    code, output = dsat_in_process(model_dir, *flags, capsys=capsys)
    assert code == 2, output[-3000:]
    assert (fragment or "resources.slots_per_trial=2 > --max-slots=1") in output
    assert not (tmp_path / "out").exists()


def test_every_bad_value_is_reported_once_in_the_users_words(tmp_path, capsys):
    # Values of both settings objects and of the experiment, all wrong at once: one line each.
    model_dir = make_model_dir(tmp_path, slots=2, hparams={"data_parallel_world_size": 3})
    code, output = dsat_in_process(
        model_dir,
        "--max-trials",
        "1",
        "--max-slots",
        "1",
        "--start-profile-step",
        "4",
        "--end-profile-step",
        "3",
        "--trial-timeout",
        "-2",
        capsys=capsys,
    )
    assert code == 2, output[-3000:]
    for fragment in ("--max-trials=1: expected an integer >= 2",
                     "resources.slots_per_trial=2 > --max-slots=1: no trial could ever start",
                     "--end-profile-step=3 < --start-profile-step=4",
                     "--trial-timeout=-2.0: expected a number of seconds > 0",
                     "hyperparameters.data_parallel_world_size=3: expected a divisor"):
        assert output.count(fragment) == 1, (fragment, output[-3000:])
    assert "max_trials=" not in output and "max_slots=" not in output  # no settings field names
    assert not (tmp_path / "out").exists()


def test_the_installed_cli_exits_2_on_bad_input(tmp_path):
    model_dir = make_model_dir(tmp_path)
    result = dsat(model_dir, "--max-trials", "1")
    assert result.returncode == 2 and "--max-trials=1: expected an integer >= 2" in result.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method, flags, fragment", [
    ("asha", ["--divisor", "1"], "--divisor=1: expected an integer >= 2"),
    ("random", ["--trials-per-random-config", "0"], "--trials-per-random-config=0: expected an integer >= 1"),
    ("binary", ["--divisor", "2"], "unrecognized arguments: --divisor"),
    ("asha", ["--bisect-tolerance", "0.1"], "unrecognized arguments: --bisect-tolerance"),
    ("random", ["--bisect-tolerance", "0.1"], "unrecognized arguments: --bisect-tolerance"),
    ("grid", [], "invalid choice: 'grid'"),
])
def test_method_flags_are_checked(tmp_path, method, flags, fragment, capsys):
    model_dir = make_model_dir(tmp_path)
    code, output = dsat_in_process(model_dir, *flags, method=method, capsys=capsys)
    assert code == 2 and fragment in output, output[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, expected", [([], 0.25), (["--bisect-tolerance", "0"], 0.0),
                                             (["--bisect-tolerance", "0.1"], 0.1)])
def test_bisect_tolerance_reaches_the_search_settings(tmp_path, flags, expected):
    from toolkit.dsat.tuner_cli import build_parser, make_plan

    model_dir = make_model_dir(tmp_path)
    args = build_parser().parse_args(
        [
            "binary",
            str(model_dir / "deepspeed.yaml"),
            str(model_dir),
            "--output-dir",
            str(tmp_path / "out"),
            "--memory-per-slot",
            "100MiB",
            *flags,
        ]
    )
    plan = make_plan(args)  # checks and plans only: launches and writes nothing
    assert plan.search.bisect_tolerance == expected
    assert plan.fingerprint()["search"]["bisect_tolerance"] == expected  # --resume needs the same value
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"experiment": {"entrypoint": None}}, "entrypoint is required by dsat"),
        ({"experiment": {"resources": {}}}, "resources.slots_per_trial is required by dsat"),
        (
            {"experiment": {"resources": {"slots_per_trial": 0}}},
            "resources.slots_per_trial=0: expected an integer >= 1",
        ),
        ({"experiment": {"entrypoint": "python3 missing.py"}}, "missing.py not found in MODEL_DIR"),
        (
            {"ds": {"train_micro_batch_size_per_gpu": 4, "amp": {"enabled": True}}},
            "amp: NVIDIA Apex AMP",
        ),
        (
            {
                "ds": {
                    "train_micro_batch_size_per_gpu": 4,
                    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
                }
            },
            "zero_optimization.offload_param.nvme_path is missing",
        ),
        ({"hparams": {"deepspeed_config": "nope.json"}}, "nope.json' not found"),
        ({"hparams": {"data_parallel_world_size": 3}}, "data_parallel_world_size=3: expected a divisor"),
    ],
)
def test_bad_config_exits_2_before_launch(tmp_path, change, fragment, capsys):
    experiment = change.get("experiment")
    model_dir = make_model_dir(
        tmp_path, ds=change.get("ds"), hparams=change.get("hparams"), experiment=experiment
    )
    if experiment and experiment.get("entrypoint") is None and "entrypoint" in experiment:
        config = yaml.safe_load((model_dir / "deepspeed.yaml").read_text())
        del config["entrypoint"]
        (model_dir / "deepspeed.yaml").write_text(yaml.safe_dump(config))
    code, output = dsat_in_process(model_dir, capsys=capsys)
    assert code == 2 and fragment in output, output[-2000:]
    assert not (tmp_path / "out").exists()


def test_missing_paths(tmp_path, capsys):
    # in this process: nothing is launched (test_the_installed_cli_exits_2_on_bad_input runs the CLI itself)
    from toolkit.dsat.tuner_cli import main

    model_dir = make_model_dir(tmp_path)
    for argv, fragments in (([str(tmp_path / "x.yaml"), str(model_dir)], ("x.yaml", "not found")),
                            ([str(model_dir / "deepspeed.yaml"), str(tmp_path / "nodir")],
                             ("is not a directory",))):
        code = main(["binary", *argv, "--output-dir", str(tmp_path / "out")])
        captured = capsys.readouterr()
        assert code == 2 and all(f in captured.out + captured.err for f in fragments), captured
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- pure pieces
def test_trial_config_keeps_the_batch_relation_and_replaces_zero():
    base = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    spec = TrialSpec(5, micro_batch=12, zero={"stage": 1, "reduce_bucket_size": 1000}, line=0)
    config = trial_ds_config(base, spec, data_parallel_size=4)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (96, 12, 2)
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert base["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"}}
    assert profile_spec(base).micro_batch == 1 and profile_spec(base).zero["stage"] == 3


def test_the_first_profiling_trial_measures_memory_without_the_kept_batch():
    base = {"train_batch_size": 768, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 1}}
    first = profile_spec(base)
    config = trial_ds_config(base, first, data_parallel_size=2, train_batch_size=768)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (2, 1, 1)      # not 384 accumulation steps
    assert memory_only(first, train_batch_size=768, data_parallel_size=2)
    # the other profiling trials keep it where they can (they may be the search's best)
    for spec, triple in ((TrialSpec(-1, 192, {"stage": 1}, profile=True), (768, 192, 2)),
                         (TrialSpec(-11, 100, {"stage": 1}, profile=True), (200, 100, 1)),
                         (TrialSpec(3, 1, {"stage": 1}), (768, 1, 384))):
        config = trial_ds_config(base, spec, data_parallel_size=2, train_batch_size=768)
        assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
                config["gradient_accumulation_steps"]) == triple, spec
    # free: nothing to keep, the user's accumulation
    config = trial_ds_config(base, first, data_parallel_size=2)
    assert not memory_only(first, train_batch_size=None, data_parallel_size=2)
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (16, 8)


# ---------------------------------------------------------------- searches with real trial processes
def test_binary_search_finds_the_limit_and_writes_everything(tmp_path):
    # each trial's ranks live 0.5 s: long enough for the runner to see their peak memory
    model_dir = make_model_dir(tmp_path, slots=2, hparams={"sleep_s": 0.5})
    out = tmp_path / "out"
    # also --run-full-experiment: the best config trains once more after the search, outside a trial
    result = dsat(model_dir, "--max-trials", "6", "--zero-stages", "1", "2", "--memory-per-slot", "100MiB",
                  "--confirm", "1", "--run-full-experiment")
    assert result.returncode == 0, result.stdout[-4000:]
    rows = trial_rows(out)
    # 6 trials of the search (--max-trials), then the best configuration re-run twice (--confirm 1)
    assert len(rows) == 8 and rows[0]["status"] == "ok" and rows[0]["profile"] == "True"
    assert (rows[0]["trial"], rows[0]["role"]) == ("p1", "profiling")
    assert [r["role"] for r in rows[6:]] == ["re-run", "re-run"]
    statuses = {row["status"] for row in rows[1:6]}
    assert "oom" in statuses and "ok" in statuses
    best = json.loads((out / "best_ds_config.json").read_text())
    metrics = json.loads((out / "best_ds_metrics.json").read_text())
    ok_rows = [r for r in rows[1:6] if r["status"] == "ok"]
    top = max(ok_rows, key=lambda r: float(r["FLOPS_per_gpu"]))
    # the best was measured three times (its trial and two re-runs); the median's trial is reported
    measured = metrics["measurements"]
    assert len(measured["values"]) == 3 and measured["trials"][0] == top["trial"]
    assert metrics["FLOPS_per_gpu"] == measured["median"] == sorted(measured["values"])[1]
    assert best["train_micro_batch_size_per_gpu"] == int(top["micro_batch"])
    assert "the median of 3 measurements" in result.stdout
    assert "-- re-runs (confirming the best): 2" in result.stdout
    assert best["train_micro_batch_size_per_gpu"] <= 37
    assert (
        best["train_batch_size"]
        == best["train_micro_batch_size_per_gpu"] * best["gradient_accumulation_steps"] * 2
    )
    assert best["optimizer"] == {"type": "Adam", "params": {"lr": 1e-3}}
    assert "autotuning" not in best and best["flops_profiler"] == {
        "enabled": False
    }  # the user's own, untouched
    # every trial's config and logs, and TensorBoard runs with HParams data
    trial_config = json.loads((out / "trials" / "trial_1" / "ds_config.json").read_text())
    assert trial_config["zero_optimization"]["stage"] in (1, 2)
    assert len([p for p in (out / "tensorboard").iterdir() if p.name.startswith("trial_")]) == 8
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard" / "trial_0001"))
    acc.Reload()
    assert "hparams" in acc.PluginTagToContent("hparams") or acc.PluginTagToContent("hparams")
    # the curves per stage against the micro-batch, read with TensorBoard's own reader: a peak for every
    # trial (the runner's polls of the ranks), the metric for every trial that measured one
    points = {}
    stages = [p for p in (out / "tensorboard" / "curves").iterdir()
              if p.name.startswith(("stage_1", "stage_2")) and not p.name.endswith("_predicted")]
    assert stages
    for stage in stages:
        curve = EventAccumulator(str(stage), size_guidance={"scalars": 0})
        curve.Reload()
        for tag in curve.Tags()["scalars"]:
            points.setdefault(tag, []).extend((e.step, e.value) for e in curve.Scalars(tag))
    measured = [r for r in rows if r["status"] == "ok"]
    assert sorted(points["metrics/FLOPS_per_gpu"]) == sorted(
        (int(r["micro_batch"]), pytest.approx(float(r["FLOPS_per_gpu"]), rel=1e-6)) for r in measured)
    assert len(points["memory/peak_MiB"]) + len(points.get("memory/peak_MiB_oom", [])) == len(rows)
    assert "stage" in result.stdout and "best" in result.stdout  # progress lines and the summary table
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert [record["trial_id"] for record in records] == list(range(8))
    # the full experiment: every rank ran the best config as a normal run
    for rank in (0, 1):
        assert (
            json.loads((out / "full_experiment" / "output" / f"full_run_rank{rank}.json").read_text()) == best
        )
    assert "full experiment exited with status 0" in result.stdout


def test_profiling_failure_is_one_trial_and_a_failed_search(tmp_path):
    model_dir = make_model_dir(tmp_path, hparams={"profile": "crash"})
    result = dsat(model_dir, "--max-trials", "10")
    assert result.returncode == 1
    assert "the profiling trial failed" in result.stdout and "simulated crash" in result.stdout
    assert len(trial_rows(tmp_path / "out")) == 1
    assert not (tmp_path / "out" / "best_ds_config.json").exists()


def test_all_tuning_trials_failing_is_a_failed_search(tmp_path):
    model_dir = make_model_dir(tmp_path, hparams={"tuning": "crash"})
    result = dsat(model_dir, "--max-trials", "3", "--zero-stages", "1", "--memory-per-slot", "100MiB",
                  "--quiet")
    assert result.returncode == 1 and "no tuning trial succeeded" in result.stdout
    assert [r["status"] for r in trial_rows(tmp_path / "out")] == ["ok", "failed", "failed"]
    # --quiet: no rank's line on the console; a failed trial's last lines, with its log, still are
    assert not re.search(r"^\[trial \S+ rank \d+\]", result.stdout, re.M), result.stdout[-3000:]
    log = tmp_path / "out" / "trials" / "trial_1" / "trial.log"
    assert f"trial 1 failed: exit status 1; its last lines (whole log: {log}):\n" \
           "  [rank 0] simulated crash: the model failed to build" in result.stdout, result.stdout[-3000:]


def test_the_usage_line_names_the_command_it_was_run_as(monkeypatch):
    from toolkit.dsat.cli_args import build_parser

    monkeypatch.setattr(sys, "argv", ["/venv/bin/dsat", "--help"])   # the installed console script
    assert build_parser().format_usage().startswith("usage: dsat ")
    monkeypatch.setattr(sys, "argv", ["/repo/toolkit/dsat/__main__.py"])
    assert build_parser().format_usage().startswith("usage: python -m toolkit.dsat ")


def test_sigkilled_search_resumes_without_rerunning_finished_trials(tmp_path):
    model_dir = make_model_dir(tmp_path, hparams={"sleep_s": 1.0})
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "toolkit.dsat", "random", str(model_dir / "deepspeed.yaml"), str(model_dir),
            "--output-dir", str(out), "--max-trials", "5", "--zero-stages", "1", "2", "--trial-timeout", "60",
            "--memory-per-slot", "100MiB", "--confirm", "0"]
    proc = subprocess.Popen(argv, env=procutil.child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out / "events.jsonl").exists() or \
            sum('"event": "result"' in line for line in (out / "events.jsonl").read_text().splitlines()) < 3:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the autotuner and everything in its session
    proc.wait(timeout=30)
    finished = {json.loads(line)["trial_id"] for line in (out / "events.jsonl").read_text().splitlines()
                if '"event": "result"' in line}
    result = procutil.run(argv + ["--resume"])
    assert result.returncode == 0, result.stdout[-3000:]
    rows = trial_rows(out)
    # the search's 5 trials, and the user's own config measured after them (role "own") if none did
    assert [int(r["trial_id"]) for r in rows if r["role"] != "own"] == list(range(5))
    for trial_id in finished:  # a finished trial was never started again
        starts = (out / "trials" / f"trial_{trial_id}" / "starts.log").read_text().splitlines()
        assert len(starts) == 1, (trial_id, starts)
    # the same flags are required to resume
    changed = procutil.run(argv + ["--resume", "--random-seed", "7"])
    assert changed.returncode == 2 and "settings differ" in changed.stdout


# ---------------------------------------------------------------- the global batch policy (issue 12)
@pytest.mark.parametrize("flags, policy, tbs, allowed", [
    ([], "keep", 64, (1, 2, 4, 8, 16, 32)),
    (["--global-batch", "keep"], "keep", 64, (1, 2, 4, 8, 16, 32)),
    (["--global-batch", "48"], "fixed", 48, (1, 2, 3, 4, 6, 8, 12, 24)),
    (["--global-batch", "free"], "free", None, None),
])
def test_the_global_batch_policy_reaches_the_plan(tmp_path, flags, policy, tbs, allowed):
    model_dir = make_model_dir(tmp_path, slots=2, ds=KEEP_64)
    plan = plan_for(tmp_path, model_dir, *flags)
    assert (plan.global_batch.policy, plan.global_batch.train_batch_size) == (policy, tbs)
    assert plan.search.micro_batches == allowed
    assert plan.fingerprint()["global_batch"] == {"policy": policy, "train_batch_size": tbs}
    spec = TrialSpec(1, micro_batch=8, zero={"stage": 2}, line=0)
    config = trial_ds_config(plan.base_ds_config, spec, data_parallel_size=2,
                             train_batch_size=plan.global_batch.train_batch_size)
    expected = (tbs, 8, tbs // 16) if tbs else (128, 8, 8)  # free: the user's accumulation 8 kept
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == expected


def test_without_train_batch_size_the_policy_is_free(tmp_path):
    plan = plan_for(tmp_path, make_model_dir(tmp_path))
    assert plan.global_batch.policy == "free" and plan.search.micro_batches is None


def test_auto_zero_sizes_are_accepted_and_resolved(tmp_path):
    ds = {**KEEP_64, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                           "stage3_prefetch_bucket_size": "auto",
                                           "stage3_param_persistence_threshold": "auto"},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    plan = plan_for(tmp_path, make_model_dir(tmp_path, slots=2, ds=ds, hparams={"hidden_size": 64}))
    assert plan.hidden_size == 64 and plan.global_batch.train_batch_size == 64
    config = trial_ds_config(plan.base_ds_config, profile_spec(plan.base_ds_config), data_parallel_size=2,
                             train_batch_size=64, hidden_size=plan.hidden_size)
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (64 * 64, int(0.9 * 64 * 64), 640)
    # without hidden_size: DeepSpeed's defaults; a searched knob is the search's choice
    spec = TrialSpec(1, micro_batch=2, zero={**ds["zero_optimization"], "reduce_bucket_size": 50_000_000})
    config = trial_ds_config(plan.base_ds_config, spec, data_parallel_size=2, train_batch_size=64)
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (50_000_000, 50_000_000, 100_000)


def test_every_flag_has_help_with_its_default():
    from toolkit.dsat.tuner_cli import build_parser

    parser = build_parser()
    methods = next(a for a in parser._actions if a.dest == "method")
    for name, sub in methods.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and "default" in action.help, (name, action.option_strings)
    text = " ".join(methods.choices["binary"].format_help().split())
    assert "80% of the memory available" in text and "(default: 600.0 seconds)" in text


def test_the_cpu_default_budget_leaves_headroom():
    from toolkit.dsat.execution.settings import default_memory_per_slot

    gib = 2**30
    assert default_memory_per_slot(23 * gib, slots=2) == int((0.8 * 23 * gib - 2 * gib) // 2)
    assert default_memory_per_slot(gib, slots=2) == 1  # nothing left: the memory model says so


# One metric of each direction end to end: the smallest latency here, the largest FLOPS_per_gpu in
# test_binary_search_finds_the_limit_and_writes_everything; every metric's direction is tested on
# the pure best_result (tests/dsat/search/test_methods.py::test_best_result_follows_the_metric_direction).
def test_the_global_batch_is_kept_in_every_trial_and_latency_is_minimised(tmp_path):
    model_dir = make_model_dir(tmp_path, slots=2, ds=KEEP_64)
    out = tmp_path / "out"
    result = dsat(model_dir, "--max-trials", "6", "--zero-stages", "1", "2", "--memory-per-slot", "100MiB",
                  "--metric", "latency")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "global batch: keep train_batch_size=64" in result.stdout
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert len(records) == 6
    # the first profiling trial measures memory only: micro-batch 1 with accumulation 1, not 32
    first = records[0]["ds_overrides"]
    assert records[0]["trial_id"] == 0
    assert (first["train_batch_size"], first["gradient_accumulation_steps"]) == (2, 1)
    for record in records[1:]:
        over = record["ds_overrides"]
        assert over["train_batch_size"] == 64, record
        assert over["train_micro_batch_size_per_gpu"] in (1, 2, 4, 8, 16, 32), record
        assert over["train_micro_batch_size_per_gpu"] * over["gradient_accumulation_steps"] * 2 == 64
        trial = json.loads((out / "trials" / f"trial_{record['trial_id']}" / "ds_config.json").read_text())
        assert trial["train_batch_size"] == 64
    best = json.loads((out / "best_ds_config.json").read_text())
    assert best["train_batch_size"] == 64
    assert best["train_micro_batch_size_per_gpu"] * best["gradient_accumulation_steps"] * 2 == 64
    metrics = json.loads((out / "best_ds_metrics.json").read_text())
    assert metrics["global_batch"]["policy"] == "keep" and metrics["global_batch"]["train_batch_size"] == 64
    assert json.loads((out / "dsat_search.json").read_text())["global_batch"] == {
        "policy": "keep", "train_batch_size": 64}
    ok_rows = [r for r in trial_rows(out)[1:] if r["status"] == "ok"]
    assert metrics["metric"] == "latency" and metrics["latency"] == min(float(r["latency"]) for r in ok_rows)


@pytest.mark.parametrize("record", ["dsat_search.json", "search.json"])  # an earlier toolkit's name too
def test_resume_needs_the_same_global_batch(tmp_path, record):
    from toolkit.dsat.tuner_cli import UsageError

    model_dir = make_model_dir(tmp_path, slots=2, ds=KEEP_64)
    plan = plan_for(tmp_path, model_dir)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / record).write_text(json.dumps(plan.fingerprint()))
    (tmp_path / "out" / "events.jsonl").write_text("")
    assert plan_for(tmp_path, model_dir, "--resume").global_batch == plan.global_batch
    with pytest.raises(UsageError, match="settings differ.*global_batch"):
        plan_for(tmp_path, model_dir, "--resume", "--global-batch", "free")


def test_resume_plans_with_the_cpu_budget_the_search_ran_with(tmp_path):
    # The default budget follows the memory free at the start: on --resume another one would change the
    # calibration trials, and the replayed search would propose other trials than those recorded.
    from toolkit.dsat.tuner_cli import UsageError, build_parser, make_plan

    model_dir, out = make_model_dir(tmp_path, slots=2, ds=KEEP_64), tmp_path / "o"

    def plan(*flags):
        argv = ["binary", str(model_dir / "deepspeed.yaml"), str(model_dir), "--output-dir", str(out)]
        return make_plan(build_parser().parse_args([*argv, *flags]))

    first = plan()
    recorded = {**first.fingerprint(), "memory_per_slot": 123 * 2**20}  # what the search ran with
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "dsat_search.json").write_text(json.dumps(recorded))
    (tmp_path / "o" / "events.jsonl").write_text("")
    resumed = plan("--resume")
    assert resumed.runner.memory_per_slot == resumed.memory_per_slot == 123 * 2**20
    with pytest.raises(UsageError, match="settings differ.*memory_per_slot"):  # a budget given: held to it
        plan("--resume", "--memory-per-slot", "100MiB")
    # a record of an earlier toolkit, without the budget: resumed with today's, unchecked
    del recorded["memory_per_slot"]
    (tmp_path / "o" / "dsat_search.json").write_text(json.dumps(recorded))
    assert plan("--resume").runner.memory_per_slot > 0  # the default from the memory free now


def test_a_recorded_search_the_searcher_would_not_propose_stops_resume_with_exit_2(tmp_path):
    model_dir, out = make_model_dir(tmp_path), tmp_path / "out"
    flags = ("--max-trials", "3", "--zero-stages", "1", "--memory-per-slot", "100MiB", "--quiet")
    assert dsat(model_dir, *flags).returncode == 0
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    for event in events:  # the first tuning trial recorded at a micro-batch this searcher never proposes
        if event["trial_id"] == 1:
            spec = event["spec"] if event["event"] == "start" else event["result"]["spec"]
            spec["micro_batch"] = 999
    (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    result = dsat(model_dir, *flags, "--resume")
    assert result.returncode == 2, result.stdout[-3000:]
    assert "--resume: trial 1: the result is for micro_batch=999" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
