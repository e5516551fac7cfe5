"""A search's trials in flight (toolkit.run.scheduler): how many at once, and one adaptive_asha search
of two 1-rank trials at once under python -m toolkit.run (Determined's 3_hpsearch.py style), paused
by SIGTERM in both, continued by the same command with nothing lost or repeated, the worse trial
stopped by the searcher at the report that ranked it out."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import procutil
from toolkit.launch.trial_files import SEARCH_FILE
from toolkit.run import searchers
from toolkit.run.scheduler import concurrency


def test_how_many_trials_run_at_once():
    assert concurrency({}, slots=2, nproc=1) == 2  # default: as many as the slots hold
    assert concurrency({}, slots=8, nproc=3) == 2
    assert concurrency({"searcher": {"max_concurrent_trials": 1}}, slots=8, nproc=1) == 1
    assert concurrency({"searcher": {"max_concurrent_trials": 0}}, slots=4, nproc=2) == 2  # 0: no cap
    assert concurrency({"searcher": {"max_concurrent_trials": 9}}, slots=4, nproc=1) == 4


def test_each_trial_gets_its_own_gpus_or_a_share_of_the_cores(tmp_path, monkeypatch):
    # No GPU here: the pool is told of 2 GPUs; what a trial would see is its environment.
    from toolkit.launch.slots import SlotPool
    from toolkit.run.scheduler import _trial_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    pool = SlotPool(slots_per_trial=1, gpus=(0, 1))
    held = [pool.take(trial_id=i) for i in range(2)]
    envs = [_trial_env(tmp_path / f"t{i}", h, threads=8) for i, h in enumerate(held)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4", "5"] and "OMP_NUM_THREADS" not in envs[0]
    assert envs[1]["TOOLKIT_SEARCH_ACK"] == str(tmp_path / "t1")
    pool.give_back(held[0])
    assert pool.take(trial_id=2).gpus == (0,)  # the freed GPU goes to the next trial
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = SlotPool(slots_per_trial=1).take(trial_id=0)
    assert _trial_env(tmp_path, cpu, threads=1)["OMP_NUM_THREADS"] == "1"


def test_max_slots_below_a_trial_exits_2_with_nothing_written(tmp_path, capsys):
    from toolkit.run import main

    yaml = tmp_path / "exp.yaml"
    yaml.write_text(json.dumps({"entrypoint": "python3 x.py", "resources": {"slots_per_trial": 2},
                                "searcher": {"name": "random", "metric": "x", "max_trials": 2}}))
    assert main([str(yaml), str(tmp_path), "--output-dir", str(tmp_path / "out"), "--max-slots", "1"]) == 2
    assert "--max-slots=1: a trial needs 2 slot(s)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        main([str(yaml), str(tmp_path), "--max-slots", "0"])


YAML = """name: det-hpsearch
entrypoint: python3 det_hpsearch.py
hyperparameters:
  increment_by: {{type: int, minval: 1, maxval: 8}}
  max_length: 16
  report_every: 4
searcher: {{name: adaptive_asha, metric: x, max_trials: 2, time_metric: batches, max_time: 16, divisor: 2,
           mode: aggressive, max_concurrent_trials: 2}}
reproducibility: {{experiment_seed: {seed}}}
max_restarts: 0
"""


def _seed_with_a_worse_second_trial():
    """A seed whose second trial increments more than its first (so ASHA stops the second at batch 8)."""
    config = {"searcher": {"name": "random", "max_trials": 2},
              "hyperparameters": {"increment_by": {"type": "int", "minval": 1, "maxval": 8}}}
    for seed in range(100):
        state = searchers.new_state(config, seed=seed)
        a = searchers.next_trial(state, config)
        a.state = "COMPLETED"
        b = searchers.next_trial(state, config)
        if b.hparams["increment_by"] > a.hparams["increment_by"]:
            return seed, a.hparams["increment_by"], b.hparams["increment_by"]
    raise AssertionError("no seed found")


def _steps(path):
    """The steps of the complete validation lines in ``path`` (none while it does not exist)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line)["steps_completed"] for line in text[: text.rfind("\n") + 1].splitlines()]


def test_two_trials_at_once_pause_together_and_continue_with_nothing_lost_or_repeated(tmp_path):
    seed, inc0, inc1 = _seed_with_a_worse_second_trial()
    model = tmp_path / "model"
    model.mkdir()
    (model / "det_hpsearch.py").write_text((procutil.WORKERS / "det_hpsearch.py").read_text())
    (model / "exp.yaml").write_text(YAML.format(seed=seed))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "toolkit.run", str(model / "exp.yaml"), str(model), "--output-dir",
            str(out), "--max-slots", "2"]
    # trial 1's steps after 4 are slow: trial 0 reaches the rung (8) first, trial 1 is judged there
    slow = procutil.child_env(DET_TEST_STEP_SLEEP="1.0", DET_TEST_SLOW="trial-0001:4:3.0")
    proc = subprocess.Popen(argv, env=slow, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    metrics = [out / d / "metrics.jsonl" for d in ("trial-0000", "trial-0001")]
    deadline = time.monotonic() + 120
    # both in flight: trial 0 past its rung (8), trial 1 past step 4 and slow (3 s a step) on the way there
    while not (8 in _steps(metrics[0]) and _steps(metrics[1])):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # pause the search inside both trials: each stops at its next report
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log[-4000:]
    _each_trials_lines_are_its_own(log, out, {"trial-0000": inc0, "trial-0001": inc1})
    stop = re.search(r"searcher: stopping trial-0001 at batches=(\d+)", log)
    assert stop, log[-4000:]
    summary = json.loads((out / SEARCH_FILE).read_text())
    first, second = summary["trials"]
    assert first["state"] == "PAUSED" and _steps(metrics[0])[-1] in (8, 12), log[-4000:]  # 12: a late start
    # the searcher's stop reached trial 1 at its next should_preempt(): its last report is the one ranked
    # out, and it is done (not paused: the search will not resume it)
    assert second["state"] == "COMPLETED" and second["stopped_early"]
    assert _steps(metrics[1])[-1] == second["time"] == int(stop.group(1)) == 8
    result = procutil.run(argv + ["--quiet"], env=procutil.child_env(DET_TEST_STEP_SLEEP="0.05"), timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "trial-0001" not in result.stdout.replace("best", "")  # nothing of the stopped trial again
    summary = json.loads((out / SEARCH_FILE).read_text())
    first, second = summary["trials"]
    assert (first["hparams"]["increment_by"], second["hparams"]["increment_by"]) == (inc0, inc1)
    assert first["state"] == "COMPLETED" and not first["stopped_early"] and first["metric"] == 16 * inc0
    assert _steps(metrics[0]) == [4, 8, 12, 16] and _steps(metrics[1]) == [4, 8]  # nothing lost or repeated
    ids = [json.loads((out / t["dir"] / "determined_trial.json").read_text()) for t in (first, second)]
    assert [i["trial_run_id"] for i in ids] == [2, 1] and ids[0]["trial_id"] != ids[1]["trial_id"]
    assert summary["best"]["dir"] == "trial-0000"
    _each_trials_lines_are_its_own(result.stdout, out, {"trial-0000": inc0}, quiet=True)
    # the searcher's view in TensorBoard: the second trial stopped at the rung of 8, the first went on
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    view = EventAccumulator(str(out / "tensorboard" / "searcher"))
    view.Reload()
    assert [(e.step, e.value) for e in view.Scalars("searcher/stopped_early")] == [(0, 0.0), (1, 1.0)]
    assert [(e.step, e.value) for e in view.Scalars("asha/rungs_reached")] == [(0, 2.0), (1, 1.0)]


def _each_trials_lines_are_its_own(console, out, increments, quiet=False):
    """Every validation line on the console names its trial and rank and carries that trial's x (its
    increment times the step); each trial's logs/trial.log holds its own such lines and no other's.
    ``quiet`` (--quiet): no rank's line on the console, the logs as always."""
    pattern = re.compile(r"report_validation_metrics\(steps_completed=(\d+), metrics=\{'x': (\d+)")
    shown = [line for line in console.splitlines() if pattern.search(line)]
    if quiet:
        assert not shown and not re.search(r"^\[trial-\d{4} rank", console, re.M), console[-4000:]
    else:
        assert shown, console[-4000:]
    for line in shown:
        label = re.match(r"\[(trial-\d{4}) rank 0\] ", line)
        assert label and label.group(1) in increments, line
        steps, x = map(int, pattern.search(line).groups())
        assert x == steps * increments[label.group(1)], line
    for trial, increment in increments.items():
        lines = (out / trial / "logs" / "trial.log").read_text().splitlines()
        logged = [pattern.search(line) for line in lines]
        values = [(int(m.group(1)), int(m.group(2))) for m in logged if m]
        assert values and all(x == steps * increment for steps, x in values), (trial, values)
