"""``toolkit.run --slurm``'s engine against fake Slurm clients: the failures of sbatch, squeue and
scancel, the pause, the jobs a killed runner left, and a whole search loop.

The real one-node cluster test (tests/cluster/test_slurm_engine.py) runs real jobs; it is slow and
needs root. Here ``sbatch``, ``squeue`` and ``scancel`` are small shell scripts on PATH (a fake
Slurm: no cluster can run in a unit test) that log their argv and answer from files, so that the
engine's real subprocess calls, timeouts and decisions are exercised in milliseconds.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from toolkit.errors import ConfigError
from toolkit.launch.trial_files import SEARCH_FILE
from toolkit.run import slurm_engine
from toolkit.run.plan import RunPlan
from toolkit.run.search_record import load_state
from toolkit.run.search_state import TrialRecord
from toolkit.run.slurm_argv import RESULT_FILE, SPEC_FILE
from toolkit.run.slurm_engine import (
    SlurmError,
    _adopt,
    _command,
    _ended,
    _Job,
    _JobForwarder,
    _pause,
    _result,
    _states,
    check_submission,
    run_slurm_search,
)

# $FAKE_SLURM holds: calls (one line per command), next (the next job id), and the answers:
# sbatch.fail / squeue.fail / scancel.fail / scancel_signal.fail (their text is the error),
# squeue.out (squeue's output), result (copied into each submitted trial's output directory).
SBATCH = f"""#!/bin/sh
echo "sbatch $*" >> "$FAKE_SLURM/calls"
if [ -e "$FAKE_SLURM/sbatch.fail" ]; then cat "$FAKE_SLURM/sbatch.fail" >&2; exit 1; fi
n=$(cat "$FAKE_SLURM/next" 2>/dev/null || echo 100)
echo $((n + 1)) > "$FAKE_SLURM/next"
for script; do :; done
if [ -e "$FAKE_SLURM/result" ]; then cp "$FAKE_SLURM/result" "$(dirname "$script")/{RESULT_FILE}"; fi
echo "$n;cluster"
"""
SQUEUE = """#!/bin/sh
echo "squeue $*" >> "$FAKE_SLURM/calls"
if [ -e "$FAKE_SLURM/squeue.fail" ]; then cat "$FAKE_SLURM/squeue.fail" >&2; exit 1; fi
cat "$FAKE_SLURM/squeue.out" 2>/dev/null
exit 0
"""
SCANCEL = """#!/bin/sh
echo "scancel $*" >> "$FAKE_SLURM/calls"
case "$1" in --signal=*) if [ -e "$FAKE_SLURM/scancel_signal.fail" ]; then
    cat "$FAKE_SLURM/scancel_signal.fail" >&2; exit 1; fi;; esac
if [ -e "$FAKE_SLURM/scancel.fail" ]; then cat "$FAKE_SLURM/scancel.fail" >&2; exit 1; fi
exit 0
"""


@pytest.fixture
def fake(tmp_path, monkeypatch) -> Path:
    """The fake Slurm's folder, first on PATH."""
    folder = tmp_path / "fake-slurm"
    folder.mkdir()
    for name, text in (("sbatch", SBATCH), ("squeue", SQUEUE), ("scancel", SCANCEL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    monkeypatch.setenv("FAKE_SLURM", str(folder))
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder


def calls(fake: Path) -> list[str]:
    path = fake / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_a_command_that_fails_is_one_slurm_error_naming_it_and_its_message(tmp_path, monkeypatch):
    with pytest.raises(SlurmError, match=r"^sh -c 'echo refused >&2; exit 3' exited 3: refused$"):
        _command(["sh", "-c", "echo refused >&2; exit 3"])
    with pytest.raises(SlurmError, match=r"^" + str(tmp_path) + r"/no-sbatch --x: .*No such file"):
        _command([str(tmp_path / "no-sbatch"), "--x"])
    monkeypatch.setattr(slurm_engine, "COMMAND_TIMEOUT_S", 0.2)
    start = time.monotonic()
    with pytest.raises(SlurmError, match=r"^sleep 30: .*timed out after 0.2 seconds"):
        _command(["sleep", "30"])
    assert time.monotonic() - start < 10
    assert _command(["sh", "-c", "echo 12"]) == "12\n"


def test_check_submission_asks_sbatch_test_only_and_names_slurm_when_refused(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_submission(["--partition=cpu", "--time=5"], nproc=2)
    (line,) = calls(fake)
    assert line.startswith("sbatch --test-only --parsable ")
    assert line.endswith("--partition=cpu --time=5 --wrap=true")
    assert "--cpus-per-task=2" in line

    (fake / "sbatch.fail").write_text("sbatch: error: invalid partition specified: cpu")
    with pytest.raises(ConfigError, match=r"--slurm='--partition=cpu': Slurm would not accept a trial's job: "
                                          r"sbatch .* exited 1: sbatch: error: invalid partition"):
        check_submission(["--partition=cpu"], nproc=1)


def test_check_submission_without_sbatch_installed_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    with pytest.raises(ConfigError, match=r"--slurm='--time=5'.*No such file.*\(and sbatch on PATH\)"):
        check_submission(["--time=5"], nproc=1)


def test_the_forwarder_signals_a_running_job_and_cancels_one_without_a_step(fake, caplog):
    idle = _JobForwarder()
    idle.searcher_stop()  # no job submitted yet: nothing to signal
    assert idle.searcher_stopped and not idle.searcher_sent and calls(fake) == []

    running = _JobForwarder()
    running.job = "7"
    running.searcher_stop()
    assert running.searcher_sent and calls(fake) == ["scancel --signal=USR1 7"]

    (fake / "scancel_signal.fail").write_text("scancel: error: no active step for job 8")
    (fake / "calls").unlink()
    pending = _JobForwarder()
    pending.job = "8"
    with caplog.at_level(logging.INFO, logger="toolkit.run"):
        pending.handle(signal.SIGTERM)
    assert pending.received == signal.SIGTERM
    assert calls(fake) == ["scancel --signal=USR1 8", "scancel 8"]  # cancelled instead
    assert "no active step for job 8; cancelling the job" in caplog.text

    (fake / "scancel.fail").write_text("scancel: error: slurmctld not responding")
    with caplog.at_level(logging.WARNING, logger="toolkit.run"):
        pending.searcher_stop()  # both fail: logged, never raised (the loop must go on)
    assert not pending.searcher_sent
    assert "scancel 8 exited 1: scancel: error: slurmctld not responding" in caplog.text


def _plan(tmp_path: Path, *, max_restarts: int = 0, searcher: dict[str, Any] | None = None) -> RunPlan:
    config: dict[str, Any] = {"name": "s", "entrypoint": "python3 t.py",
              "hyperparameters": {"x": {"type": "int", "minval": 1, "maxval": 3}},
              "searcher": searcher or {"name": "random", "metric": "x", "max_trials": 2, "max_length": 1}}
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(config))
    return RunPlan(launcher="torchrun", command=["python3", "t.py"], nproc=1, max_restarts=max_restarts,
                   output_dir=tmp_path / "out", config_path=path, model_dir=tmp_path, config=config)


def _job(plan: RunPlan, index: int, job_id: str | None, state: str) -> _Job:
    trial = TrialRecord(index=index, hparams={"x": 1}, seed=1)
    forwarder = _JobForwarder()
    forwarder.job = job_id
    return _Job(trial, plan.with_output_dir(plan.output_dir / trial.dir), forwarder,
                watcher=None, state=state)  # type: ignore[arg-type]


def test_a_pause_cancels_queued_jobs_and_signals_running_ones(fake, tmp_path):
    plan = _plan(tmp_path)
    jobs = {0: _job(plan, 0, "10", "PENDING"), 1: _job(plan, 1, "11", "RUNNING"),
            2: _job(plan, 2, "12", "REQUEUE_HOLD"), 3: _job(plan, 3, None, "PENDING")}
    _pause(jobs, signal.SIGTERM)
    assert calls(fake) == ["scancel 10", "scancel --signal=USR1 11", "scancel 12"]
    assert [job.forwarder.received for job in jobs.values()] == [signal.SIGTERM] * 4


def test_squeue_failing_is_retried_until_the_give_up_time(fake, caplog):
    (fake / "squeue.out").write_text("5|RUNNING\n6|COMPLETED\n")
    last_ok = [0.0]
    assert _states(last_ok) == {"5": "RUNNING", "6": "COMPLETED"} and last_ok[0] > 0

    (fake / "squeue.fail").write_text("squeue: error: slurm_load_jobs: timeout")
    with caplog.at_level(logging.WARNING, logger="toolkit.run"):
        assert _states(last_ok) is None  # a short outage: tried again at the next poll
    assert "slurm_load_jobs: timeout; trying again" in caplog.text
    last_ok[0] = time.monotonic() - slurm_engine.SQUEUE_GIVE_UP_S - 1
    with pytest.raises(SlurmError, match=r"squeue failed for 600 s; last: squeue .* slurm_load_jobs"):
        _states(last_ok)


def test_a_result_file_that_is_not_a_trial_result_counts_as_none(tmp_path):
    job = _job(_plan(tmp_path), 0, "1", "RUNNING")
    job.plan.output_dir.mkdir(parents=True)
    assert _result(job) is None  # absent
    (job.plan.output_dir / RESULT_FILE).write_text("{half")
    assert _result(job) is None
    (job.plan.output_dir / RESULT_FILE).write_text('{"status": "0"}')
    assert _result(job) is None
    (job.plan.output_dir / RESULT_FILE).write_text('{"status": 4}')
    assert _result(job) == {"status": 4}


def test_a_job_stopped_by_the_pause_is_paused_whatever_its_exit_status(tmp_path):
    """Under load a rank that had saved and left watch_preemption died of the SIGTERM torchrun
    passed on, and the paused trial was marked failed (its job exited 1)."""
    job = _job(_plan(tmp_path), 0, "11", "RUNNING")
    stopped = {"job": "11", "received": "SIGUSR1", "status": 1}
    assert _ended(job, stopped, pausing=True) == 0                 # PAUSED: the same command continues it
    assert _ended(job, stopped, pausing=False) is None             # preempted by Slurm: submitted again
    assert _ended(job, {"job": "11", "received": None, "status": 1}, pausing=True) == 1  # a crash stays one


def test_jobs_left_by_a_killed_runner_are_followed_not_submitted_again(fake, tmp_path):
    plan = _plan(tmp_path)
    state = load_state(plan.output_dir, plan.config)
    state.trials = [
        TrialRecord(index=0, state="PAUSED", slurm_jobs=["20", "21"], hparams={}),
        TrialRecord(index=1, state="PAUSED", slurm_jobs=["22"], hparams={}),
        TrialRecord(index=2, state="PAUSED", hparams={}),
        TrialRecord(index=3, state="COMPLETED", slurm_jobs=["23"], hparams={}),
    ]
    (fake / "squeue.out").write_text("20|COMPLETED\n21|PENDING\n22|FAILED\n23|RUNNING\n")
    saved = []
    jobs = _adopt(state, plan, lambda: saved.append(1))
    assert list(jobs) == [0] and saved == [1]
    job = jobs[0]
    assert job.forwarder.job == "21" and job.state == "PENDING"
    assert job.plan.output_dir == plan.output_dir / "trial-0000"
    assert [t.state for t in state.trials] == ["RUNNING", "PAUSED", "PAUSED", "COMPLETED"]

    (fake / "squeue.out").write_text("")
    state.trials[0].state = "PAUSED"
    assert _adopt(state, plan, lambda: saved.append(1)) == {} and saved == [1]  # nothing left: no save


def _summary(plan: RunPlan) -> dict:
    return json.loads((plan.output_dir / SEARCH_FILE).read_text())


def test_a_search_submits_each_trial_once_and_records_the_failed_trials_status(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(slurm_engine, "POLL_S", 0.01)
    plan = _plan(tmp_path, searcher={"name": "random", "metric": "x", "max_trials": 2, "max_length": 1,
                                     "max_concurrent_trials": 1})
    (fake / "result").write_text('{"status": 3, "received": null}')  # each job ends at once, failed
    assert run_slurm_search(plan, ["--time=5"], grace_s=7.0) == 3
    sbatches = [c for c in calls(fake) if c.startswith("sbatch")]
    assert [c.split()[2] for c in sbatches] == ["--job-name=s.trial-0000", "--job-name=s.trial-0001"]
    for line, trial in zip(sbatches, ("trial-0000", "trial-0001"), strict=True):
        assert line.endswith(f"--time=5 {plan.output_dir / trial / 'slurm_job.sh'}")
    summary = _summary(plan)
    assert [(t["state"], t["slurm_jobs"], t["exit_status"]) for t in summary["trials"]] == [
        ("ERROR", ["100"], 3), ("ERROR", ["101"], 3)]
    spec = json.loads((plan.output_dir / "trial-0001" / SPEC_FILE).read_text())
    assert spec["grace_s"] == 7.0 and spec["hparams"] == summary["trials"][1]["hparams"]


@pytest.mark.parametrize("scancel_fails", [False, True])
def test_squeue_gone_ends_the_search_and_cancels_its_jobs(fake, tmp_path, monkeypatch, caplog, scancel_fails):
    monkeypatch.setattr(slurm_engine, "POLL_S", 0.01)
    monkeypatch.setattr(slurm_engine, "SQUEUE_GIVE_UP_S", 0.0)
    plan = _plan(tmp_path)
    (fake / "squeue.fail").write_text("squeue: error: Unable to contact slurm controller")
    if scancel_fails:  # the controller is gone for scancel too: each job is still tried, and logged
        (fake / "scancel.fail").write_text("scancel: error: Unable to contact slurm controller")
    with caplog.at_level(logging.WARNING, logger="toolkit.run"), \
            pytest.raises(SlurmError, match="squeue failed for 0 s; last: .*Unable to contact slurm"):
        run_slurm_search(plan, [])
    assert [c for c in calls(fake) if c.startswith("scancel")] == ["scancel 100", "scancel 101"]
    assert ("scancel 101 exited 1: scancel: error: Unable to contact" in caplog.text) is scancel_fails
    assert [(t["state"], t["slurm_jobs"]) for t in _summary(plan)["trials"]] == [
        ("PAUSED", ["100"]), ("PAUSED", ["101"])]


def test_a_paused_search_cancels_jobs_still_there_after_the_grace(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(slurm_engine, "POLL_S", 0.01)
    monkeypatch.setattr(slurm_engine, "CANCEL_MARGIN_S", 0.0)
    plan = _plan(tmp_path)
    # the two jobs run (ignoring USR1) until the runner cancels them; then squeue no longer lists them
    (fake / "squeue").write_text(SQUEUE.replace(
        'cat "$FAKE_SLURM/squeue.out" 2>/dev/null',
        'for j in 100 101; do grep -q "^scancel $j$" "$FAKE_SLURM/calls" || echo "$j|RUNNING"; done'))
    killer = subprocess.Popen(["sh", "-c", f"while [ ! -s '{fake}/next' ]; do sleep 0.01; done; "
                               f"sleep 0.05; kill -TERM {os.getpid()}"])
    try:
        status = run_slurm_search(plan, [], grace_s=0.0)
    finally:
        killer.wait(timeout=30)
    assert status == 0
    scancels = [c for c in calls(fake) if c.startswith("scancel")]
    assert "scancel 100" in scancels and "scancel 101" in scancels  # cancelled after the grace
    assert [t["state"] for t in _summary(plan)["trials"]] == ["PAUSED", "PAUSED"]
    assert len([c for c in calls(fake) if c.startswith("sbatch")]) == 2  # nothing submitted after the pause
