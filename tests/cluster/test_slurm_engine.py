"""``python -m toolkit.run ... --slurm OPTIONS`` on the real one-node Slurm cluster (issue 27, item 2).

One search of two trials, each its own Slurm job (2 CPUs: both run at once): paused by SIGTERM to
``toolkit.run`` (both jobs save and stop, none is left), continued by the same command, and one
trial's job then gets ``scancel --signal=USR1``: it saves and stops, the search submits it again,
it resumes from that checkpoint and the search finishes.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from helpers import procutil
from toolkit.launch.trial_files import SEARCH_FILE

START_S = 300  # a rank's start (torch, gloo) on 2 busy cores; normally a few seconds
STEPS = 120

# The trial: 0.1 s steps; on a preemption signal (toolkit.watch_preemption) it saves its step (the
# checkpoint) and stops; it resumes from it. No DeepSpeed: test_slurm.py covers its checkpoints
# under Slurm, and the start of a DeepSpeed rank would triple this test's time.
TRAIN = """\
import json, os, sys, time
import toolkit

out = toolkit.get_output_dir("runs/x")
out.mkdir(parents=True, exist_ok=True)

def write(name, record):
    (out / (name + ".tmp")).write_text(json.dumps(record))
    os.replace(out / (name + ".tmp"), out / name)

ckpt = out / "checkpoint.json"
step = resumed_at = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
ctx = toolkit.init_distributed()
with toolkit.watch_preemption(ctx, check_interval=0.1) as preemption:
    write("start0.json", {"resumed_at": resumed_at, "pid": os.getpid()})
    stopped = False
    while step < int(sys.argv[1]):
        time.sleep(0.1)
        step += 1
        if preemption.should_preempt():
            stopped = True
            break
    received = preemption.received_signal
write("checkpoint.json", {"step": step})
write("stop0.json" if stopped else "done0.json",
      {"step": step, "resumed_at": resumed_at, "received": received.name if received else None})
"""


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


def started(trial: Path, *, resumed: bool) -> bool:
    """The trial's rank started (and, with ``resumed``, from a checkpoint)."""
    try:
        return not resumed or read(trial / "start0.json")["resumed_at"] > 0
    except (OSError, ValueError):
        return False


def test_search_as_slurm_jobs_pauses_continues_and_resubmits_a_trial_stopped_by_usr1(slurm, tmp_path):
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump({
        "name": "slurm-engine", "entrypoint": f"python3 train.py {STEPS}",
        "resources": {"slots_per_trial": 1}, "max_restarts": 0,
        "searcher": {"name": "grid", "metric": "loss", "max_length": 5, "max_concurrent_trials": 2},
        "hyperparameters": {"x": {"type": "categorical", "vals": [1, 2]}}}))
    out = tmp_path / "out"
    trials = [out / "trial-0000", out / "trial-0001"]
    model = tmp_path / "model"
    model.mkdir()
    (model / "train.py").write_text(TRAIN)
    argv = [sys.executable, "-m", "toolkit.run", str(config), str(model), "--output-dir", str(out),
            "--grace", "30", "--slurm", "--time=10"]

    def launch(log: Path) -> subprocess.Popen:
        with open(log, "wb") as fh:
            return subprocess.Popen(argv, env=slurm.env(procutil.child_env()), cwd=tmp_path, stdout=fh,
                                    stderr=subprocess.STDOUT)

    first_log, again_log = tmp_path / "first.log", tmp_path / "again.log"
    proc = launch(first_log)
    try:
        # a pause (SIGTERM to toolkit.run) once both trials run: their jobs save and stop
        wait_for(lambda: all((t / "start0.json").exists() for t in trials), START_S, "both trials to start",
                 proc, first_log)
        proc.terminate()
        assert proc.wait(timeout=120) == 0, first_log.read_text()[-4000:]
        paused = read(out / SEARCH_FILE)["trials"]
        assert [t["state"] for t in paused] == ["PAUSED", "PAUSED"], first_log.read_text()[-4000:]
        stops = [read(t / "stop0.json") for t in trials]
        assert all(s["received"] == "SIGUSR1" and s["step"] < STEPS for s in stops), stops
        assert not slurm.run("squeue", "-h", "-o", "%i").stdout.strip()  # no job of the search left
        # the same command continues; then trial 0's job gets scancel --signal=USR1 and is submitted again
        proc = launch(again_log)
        wait_for(lambda: started(trials[0], resumed=True), START_S, "trial 0 to resume", proc, again_log)
        job = read(out / SEARCH_FILE)["trials"][0]["slurm_jobs"][1]
        slurm.run("scancel", "--signal=USR1", job)
        assert proc.wait(timeout=START_S) == 0, again_log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
        slurm.cancel_all()
    text = again_log.read_text()
    records = read(out / SEARCH_FILE)["trials"]
    assert [t["state"] for t in records] == ["COMPLETED", "COMPLETED"], text[-4000:]
    assert [len(t["slurm_jobs"]) for t in records] == [3, 2], records  # first, after the pause, after USR1
    assert f"Slurm job {job} stopped by SIGUSR1 (preempted)" in text, text[-4000:]
    usr1 = read(trials[0] / "stop0.json")  # the stop of the resumed trial 0, after its pause's stop
    assert usr1["received"] == "SIGUSR1" and stops[0]["step"] < usr1["step"] < STEPS, (stops, usr1)
    done = [read(t / "done0.json") for t in trials]
    # each resumed from its last checkpoint: trial 0 from the USR1 stop, trial 1 from the pause
    assert [(d["resumed_at"], d["step"]) for d in done] == [(usr1["step"], STEPS), (stops[1]["step"], STEPS)]
    for trial, record in zip(trials, records, strict=True):
        assert read(trial / "checkpoint.json") == {"step": STEPS}
        result = read(trial / "slurm_result.json")
        assert result == {"status": 0, "received": None, "job": record["slurm_jobs"][-1]}
