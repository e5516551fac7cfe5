"""Determined Core API scripts (tests/workers/det_*.py, imports swapped) under python -m toolkit.run,
with 2 real ranks: TensorBoard, SIGTERM stopping every rank, an exact resume with the same trial id,
a SIGKILL inside store_path, the DeepSpeed wrapper with store_path(shard=True), and bad input."""

import json
import signal
import subprocess
import sys
import time

import pytest

from helpers import procutil
from toolkit.compat.determined import storage
from toolkit.launch.procs import find_trial_processes

TRAIN_YAML = """name: det-train
entrypoint: python3 -m determined.launch.torch_distributed python3 det_train.py
resources: {slots_per_trial: 2}
searcher: {name: single, metric: loss}
max_restarts: 0
hyperparameters: {seed: 3, max_length: 12, checkpoint_every: 3}
"""
DS_YAML = """name: det-ds
entrypoint: python3 -m determined.launch.deepspeed python3 det_deepspeed.py
resources: {slots_per_trial: 2}
searcher: {name: single, metric: loss, max_length: 8}
max_restarts: 0
hyperparameters:
  deepspeed_config: ds_config.json
  checkpoint_rate: 2
"""
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10**9,
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000},
}


def _run_argv(config, model_dir, out):
    return [sys.executable, "-m", "toolkit.run", str(config), str(model_dir), "--output-dir", str(out)]


def _start(argv, **env):
    return subprocess.Popen(
        argv,
        env=procutil.child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc, timeout=240):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"timed out; output:\n{out[-4000:]}") from None
    return proc.returncode, out


def _committed(out):
    return storage.read_registry(out)["committed"] if (out / storage.REGISTRY_NAME).exists() else []


def _wait_committed(proc, out, n, timeout=180):
    deadline = time.monotonic() + timeout
    while len(_committed(out)) < n:
        assert proc.poll() is None, f"exited early:\n{_finish(proc)[1][-4000:]}"
        assert time.monotonic() < deadline, "no checkpoint committed in time"
        time.sleep(0.2)


def _weights(out):
    return json.loads((out / "final.json").read_text())["weights"]


def _trial_id(out):
    return json.loads((out / "determined_trial.json").read_text())["trial_id"]


@pytest.fixture(scope="module")
def train_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "train.yaml"
    path.write_text(TRAIN_YAML)
    return path


@pytest.fixture(scope="module")
def reference(train_yaml, tmp_path_factory):
    """An uninterrupted run: its final weights, and its TensorBoard files."""
    out = tmp_path_factory.mktemp("ref") / "out"
    rc, log = _finish(_start(_run_argv(train_yaml, procutil.WORKERS, out)))
    assert rc == 0, log[-4000:]
    return out


def test_metrics_reach_tensorboard_and_jsonl(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(reference / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("training/loss")] == [3, 6, 9, 12]
    assert [e.step for e in acc.Scalars("validation/loss")] == [12]
    groups = [json.loads(line)["group"] for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert groups == ["training"] * 4 + ["validation"]


@pytest.fixture(scope="module")
def killed_then_stopped(train_yaml, tmp_path_factory):
    """One trial through both failures: rank 0 SIGKILLed inside store_path at step 6 (run 1;
    toolkit.run restarts it, max_restarts 1), then toolkit.run SIGTERMed once run 2 has committed
    again, then a rerun (run 3) to the end. Returns the output directory, the logs of the
    interrupted launch and of the rerun, the trial id and the steps each rank stopped at."""
    base = tmp_path_factory.mktemp("killed")
    cfg = base / "restart.yaml"
    cfg.write_text(train_yaml.read_text().replace("max_restarts: 0", "max_restarts: 1"))
    out = base / "out"
    proc = _start(_run_argv(cfg, procutil.WORKERS, out), DET_TEST_KILL_AT="6", DET_TEST_STEP_SLEEP="0.6")
    _wait_committed(proc, out, 2)  # step 3 (run 1), then step 6 redone by run 2: the kill is behind
    trial_id = _trial_id(out)
    proc.send_signal(signal.SIGTERM)
    rc, first_log = _finish(proc)
    assert rc == 0, first_log[-4000:]  # both ranks saved and exited cleanly
    stopped = [(out / f"preempted-{r}").read_text() for r in (0, 1)]
    final_after_stop = (out / "final.json").exists()
    rc, rerun_log = _finish(_start(_run_argv(cfg, procutil.WORKERS, out)))
    assert rc == 0, rerun_log[-4000:]
    return out, first_log, rerun_log, trial_id, stopped, final_after_stop


def test_sigkill_inside_store_path_keeps_the_previous_checkpoint_and_the_restart_resumes(
    killed_then_stopped, reference
):
    out, log, _, _, _, _ = killed_then_stopped
    assert "restart 1 of 1" in log and "left incomplete" in log  # the partial step-6 checkpoint, removed
    # The restart resumed from step 3, the checkpoint before the one killed inside store_path; the
    # SIGTERM stopped run 2 at a checkpoint (6 or 9) and run 3 went on from there.
    steps = [json.loads(line)["steps_completed"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3, 6, 6, 9, 12, 12]  # step 6 reported, killed in store_path, redone after the restart
    assert [e["steps_completed"] for e in _committed(out)] == [3, 6, 9, 12]
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == sorted(
        e["storage_id"] for e in _committed(out)
    )
    assert _weights(out) == _weights(reference)  # bitwise equal to the uninterrupted run


def test_sigterm_stops_every_rank_and_the_rerun_resumes_exactly(killed_then_stopped, reference):
    out, _, _, trial_id, stopped, final_after_stop = killed_then_stopped
    # The same step on both ranks, a checkpoint step after the restart's resume, before the end.
    assert stopped[0] == stopped[1] and int(stopped[0]) in (6, 9), stopped
    assert not final_after_stop
    assert _weights(out) == _weights(reference)  # bitwise equal to the uninterrupted run
    assert json.loads((out / "final.json").read_text())["trial_id"] == trial_id == _trial_id(out)
    assert json.loads((out / "determined_trial.json").read_text())["trial_run_id"] == 3
    assert not find_trial_processes(str(out), variable="TOOLKIT_OUTPUT_DIR")  # nothing left behind


def test_deepspeed_wrapper_sharded_checkpoint_preempt_and_resume(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "det_deepspeed.py").write_text((procutil.WORKERS / "det_deepspeed.py").read_text())
    (model_dir / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    (model_dir / "deepspeed.yaml").write_text(DS_YAML)
    out = tmp_path / "out"
    argv = _run_argv(model_dir / "deepspeed.yaml", model_dir, out)
    proc = _start(argv, DET_TEST_STEP_SLEEP="0.5")
    _wait_committed(proc, out, 1)
    proc.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@N: forwarded like SIGTERM
    rc, log = _finish(proc)
    assert rc == 0, log[-4000:]
    first = _committed(out)[-1]
    shard_files = {p.name for p in (out / "checkpoints" / first["storage_id"]).rglob("*")}
    assert {"mp_rank_00_model_states.pt", "metadata.json"} <= shard_files
    assert sum("zero_pp_rank" in name for name in shard_files) == 2  # one optimizer shard per rank
    rc, log = _finish(_start(argv))
    assert rc == 0, log[-4000:]
    steps = [json.loads(line)["steps_completed"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 8 and steps.count(first["steps_completed"] + 1) == 1  # resumed after the checkpoint
    assert json.loads((out / "determined_searcher.json").read_text())["completed"] is True


def test_single_process_core_init_preempts_on_its_own_signal_and_invalid_hp_exits_0(train_yaml, tmp_path):
    cfg = tmp_path / "single.yaml"
    cfg.write_text("searcher: {name: single, metric: loss, max_length: 5}\n")
    env = {"TOOLKIT_EXPERIMENT_CONFIG": str(cfg), "TOOLKIT_OUTPUT_DIR": str(tmp_path / "out")}
    argv = [sys.executable, str(procutil.WORKERS / "det_single.py")]
    seen = json.loads(
        procutil.check(procutil.run(argv, env=procutil.child_env(**env))).strip().splitlines()[-1]
    )
    assert seen["size"] == 1 and seen["before"] is False and seen["after"] is True
    assert seen["ops"] == [5] and seen["ops_again"] == 0 and seen["latest"] is None
    # The second run resumes (the same trial, the stored checkpoint), then raises InvalidHP: exit 0.
    result = procutil.run(argv + ["invalid_hp"], env=procutil.child_env(**env))
    assert result.returncode == 0 and "InvalidHP" in result.stdout, result.stdout[-4000:]
    again = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert again["latest"] == seen["stored"] and again["trial_id"] == seen["trial_id"]


@pytest.mark.parametrize(
    "yaml_text,args,match",
    [
        ("entrypoint: python3 x.py\nsearcher: {name: custom, metric: x}\n", [], "searcher.name='custom'"),
        ("entrypoint: python3 x.py\nsearcher: {name: adaptive_asha, metric: x}\n", [], "searcher.max_trials"),
        (
            "entrypoint: python3 x.py\nhyperparameters: {lr: {type: double, minval: 1, maxval: 0}}\n",
            [],
            "hyperparameters.lr",
        ),
        (
            "entrypoint: python3 x.py\ncheckpoint_storage: {type: azure, container: b}\n",
            [],
            "checkpoint_storage.type",
        ),
        ("entrypoint: python3 -m determined.launch.deepspeed --trial m:T\n", [], "Trial API"),
        ("entrypoint: model_def:MNistTrial\n", [], "names a class of Determined's Trial API"),
        ("entrypoint: [model_def:MNistTrial]\n", [], "#trial-api-and-horovod-experiments"),
        ("entrypoint: python3 -m determined.launch.horovod --autohorovod python3 train.py\n", [],
         "determined.launch.horovod starts Horovod"),
        ("entrypoint: python3 -m determined.launch.tensorflow python3 train.py\n", [], "TensorFlow"),
        ("searcher: {name: single, metric: x}\n", [], "entrypoint is missing"),
        ("entrypoint: python3 x.py\nmax_restarts: -1\n", [], "max_restarts"),
        ("entrypoint: python3 x.py\n", ["--grace", "0"], "--grace"),
    ],
)
def test_bad_input_exits_2_naming_the_key_with_nothing_started(tmp_path, capsys, yaml_text, args, match):
    from toolkit.run import main

    cfg = tmp_path / "exp.yaml"
    cfg.write_text(yaml_text)
    out = tmp_path / "out"
    try:
        status = main([str(cfg), str(tmp_path), "--output-dir", str(out), *args])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    assert status == 2
    assert match in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit) as exc:
        main([str(cfg), str(tmp_path / "missing")])
    assert exc.value.code == 2


def _dsat_model_dir(tmp_path, entrypoint):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "det_deepspeed.py").write_text((procutil.WORKERS / "det_deepspeed.py").read_text())
    (model_dir / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    (model_dir / "deepspeed.yaml").write_text(
        DS_YAML.replace("python3 -m determined.launch.deepspeed python3 det_deepspeed.py", entrypoint)
    )
    return model_dir


def _dsat(model_dir, out, *flags):
    argv = [
        sys.executable,
        "-m",
        "toolkit.dsat",
        "binary",
        str(model_dir / "deepspeed.yaml"),
        str(model_dir),
        "--max-trials",  # the fewest: the profiling trial and one tuning trial
        "2",
        "--zero-stages",
        "1",
        "--global-batch",  # micro-batch 1 only (2 ranks): no calibration trials at larger ones
        "2",
        "--timed-window",  # the profile steps only: the trials' length is not what this checks
        "0",
        "--output-dir",
        str(out),
        "--confirm",  # no re-runs of the best: this test is about the wrapper, not the confirmation
        "0",
        *flags,
    ]
    return procutil.run(argv, timeout=500)


def test_dsat_tunes_a_core_api_script_with_the_wrapper_left_in_its_entrypoint(tmp_path):
    """The entrypoint keeps Determined's 'python3 -m determined.launch.deepspeed' wrapper;
    dsat.dsat_reporting_context(core_context, op) measures real trials (engine found, steps counted).
    No --launcher: dsat reads the deepspeed launcher from the wrapper."""
    model_dir = _dsat_model_dir(tmp_path, "python3 -m determined.launch.deepspeed python3 det_deepspeed.py")
    out = procutil.check(_dsat(model_dir, tmp_path / "out"))
    assert "trials on this machine start with deepspeed" in out
    rows = [json.loads(line) for line in (tmp_path / "out" / "trials.jsonl").read_text().splitlines()]
    assert [row["role"] for row in rows] == ["profiling", "tuning"], rows
    assert all(row["status"] == "ok" and row["FLOPS_per_gpu"] > 0 for row in rows), rows  # measured
    assert (
        json.loads((tmp_path / "out" / "best_ds_config.json").read_text())["zero_optimization"]["stage"] == 1
    )
