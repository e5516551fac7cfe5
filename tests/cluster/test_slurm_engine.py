"""``python -m toolkit.run ... --slurm OPTIONS`` on the real one-node Slurm cluster (issue 27, item 2).

One search of two trials, each its own Slurm job (2 CPUs: both run at once); one trial's job gets
``scancel --signal=USR1``, saves and stops, and the search submits it again: it resumes from its
checkpoint and the search finishes.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from helpers import procutil

START_S = 300  # a toolkit rank's start (torch, DeepSpeed) on 2 busy cores; normally about 10 s
STEPS = 120


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"exit {proc.returncode} before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s ({what}):\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


def test_search_as_slurm_jobs_resubmits_a_trial_stopped_by_usr1_from_its_checkpoint(slurm, tmp_path):
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump({
        "name": "slurm-engine", "entrypoint": f"python3 cluster_train.py --max-steps {STEPS} --sleep 0.1",
        "resources": {"slots_per_trial": 1}, "max_restarts": 0,
        "searcher": {"name": "grid", "metric": "loss", "max_length": 5, "max_concurrent_trials": 2},
        "hyperparameters": {"x": {"type": "categorical", "vals": [1, 2]}}}))
    out, log = tmp_path / "out", tmp_path / "run.log"
    argv = [sys.executable, "-m", "toolkit.run", str(config), str(procutil.WORKERS), "--output-dir", str(out),
            "--grace", "30", "--slurm", "--time=10"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, env=slurm.env(procutil.child_env()), cwd=tmp_path, stdout=fh,
                                stderr=subprocess.STDOUT)
    try:
        first = out / "trial-0000"
        wait_for(lambda: (first / "start0.json").exists(), START_S, "trial 0 to start", proc, log)
        job = read(out / "search.json")["trials"][0]["slurm_jobs"][0]
        slurm.run("scancel", "--signal=USR1", job)
        wait_for(lambda: (first / "done0.json").exists(), START_S, "trial 0 to finish", proc, log)
        assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
        slurm.cancel_all()
    text = log.read_text()
    trials = read(out / "search.json")["trials"]
    assert [t["state"] for t in trials] == ["COMPLETED", "COMPLETED"], text[-4000:]
    assert len(trials[0]["slurm_jobs"]) == 2 and trials[0]["slurm_jobs"][0] == job, trials
    assert len(trials[1]["slurm_jobs"]) == 1, trials
    stop, done = read(first / "stop0.json"), read(first / "done0.json")
    assert stop["received"] == "SIGUSR1" and 0 < stop["step"] < STEPS, stop
    assert (done["resumed_at"], done["step"]) == (stop["step"], STEPS), done  # resumed from its checkpoint
    assert (first / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"
    assert read(first / "slurm_result.json") == {"status": 0, "received": None,
                                                 "job": trials[0]["slurm_jobs"][1]}
    second = read(out / "trial-0001" / "done0.json")
    assert (second["resumed_at"], second["step"]) == (0, STEPS), second
    assert f"Slurm job {job} stopped by SIGUSR1 (preempted)" in text, text[-4000:]
