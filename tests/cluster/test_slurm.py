"""The real Slurm (slurm-wlm 22.05, one node on loopback, see conftest.py) with toolkit (issue 16).

* ``srun --ntasks 2``: init_distributed reads the step's real SLURM_* variables;
* ``scancel --signal=USR1``: every task stops through preemption with a committed checkpoint, and
  the job submitted again resumes from it;
* ``sbatch --signal=USR1@N``: the same at the time-limit warning;
* ``python -m toolkit.dsat`` inside ``salloc``: trials placed with ``srun``, a trial's timeout
  ending its step with no process left;
* ``python -m toolkit.run`` inside ``salloc``.
"""

import json
import os
import sys
import time
from pathlib import Path

import yaml
from hostprocs import owner_mark, owner_of, pid_alive

from helpers import procutil
from toolkit.launch.procs import find_trial_processes, kill_until_gone

CTX = procutil.WORKERS / "cluster_ctx.py"
TRAIN = procutil.WORKERS / "cluster_train.py"
START_S = 300  # a toolkit rank's start (torch, DeepSpeed) on 2 busy cores; normally about 10 s


def wait_for(predicate, timeout: float, what: str, *, alive=None) -> None:
    """Poll until ``predicate()``; fail after ``timeout`` s, or at once when ``alive()`` says the job
    ended."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if alive is not None and not alive():
            raise AssertionError(f"the job ended before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def job_script(tmp_path: Path, name: str, *args: str) -> Path:
    """A batch script whose only step is ``srun python cluster_train.py ARGS``."""
    script = tmp_path / name
    command = " ".join([sys.executable, str(TRAIN), *args])
    script.write_text(f"#!/bin/sh\nsrun --kill-on-bad-exit=1 {command}\n")
    return script


def submit(slurm, tmp_path: Path, script: Path, *flags: str) -> str:
    return slurm.sbatch("--ntasks=2", f"--output={tmp_path / (script.stem + '.out')}", f"--chdir={tmp_path}",
                        *flags, str(script), env=slurm.env(procutil.child_env()))


def job_log(tmp_path: Path, script: Path) -> str:
    path = tmp_path / f"{script.stem}.out"
    return path.read_text()[-4000:] if path.exists() else "(no output)"


def both(out: Path, prefix: str) -> bool:
    return all((out / f"{prefix}{rank}.json").exists() for rank in range(2))


def test_slurm_daemons_carry_the_owner_mark_not_the_test_session_mark(slurm, sshd):
    """tests/conftest.py kills processes with the session mark after each module: not these."""
    daemons = [proc.pid for proc in slurm.procs.values()] + [slurm.munge.proc.pid, sshd.proc.pid]
    for pid in daemons:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [e for e in environ if e.startswith(f"{procutil.SESSION_ENV}=".encode())], pid
        # what hostprocs.reap_orphans reads (from the argv for sshd, which overwrites its environment)
        assert owner_of(pid) == owner_mark(), pid


def test_srun_two_tasks_read_the_real_slurm_variables(slurm, tmp_path):
    result = slurm.run("srun", "--ntasks=2", "--immediate=60", sys.executable, str(CTX), str(tmp_path),
                       env=slurm.env(procutil.child_env()), check=False, timeout=START_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [read(tmp_path / f"rank{rank}.json") for rank in range(2)]
    job = int(records[0]["env"]["SLURM_JOB_ID"])
    for rank, record in enumerate(records):
        env = record["env"]
        assert record["launcher"] == "slurm"
        assert (env["SLURM_PROCID"], env["SLURM_LOCALID"]) == (str(rank), str(rank))
        assert env["SLURM_STEP_NUM_TASKS"] == "2"
        assert (record["rank"], record["local_rank"], record["world_size"]) == (rank, rank, 2)
        assert (record["local_world_size"], record["node_rank"], record["num_nodes"]) == (2, 0, 1)
        assert env["SLURM_STEP_NODELIST"] == slurm.nodename and env["SLURM_STEP_TASKS_PER_NODE"] == "2"
        # rank 0's host from the step's node list; a port derived from the job (10000-29999)
        assert env["MASTER_ADDR"] == slurm.nodename and 10000 <= int(env["MASTER_PORT"]) < 30000
        assert record["all_gathered"] == [0, 1] and record["sum"] == [2.0]
        assert int(env["SLURM_JOB_ID"]) == job
    assert records[0]["pid"] != records[1]["pid"] and records[0]["env"]["MASTER_PORT"] == env["MASTER_PORT"]


def test_scancel_usr1_stops_every_task_with_a_checkpoint_and_the_next_job_resumes(slurm, tmp_path):
    out = tmp_path / "out"
    script = job_script(tmp_path, "first.sh", str(out))
    job = submit(slurm, tmp_path, script)
    try:
        # only once the watcher is installed: before it, SIGUSR1's default action ends the process
        wait_for(lambda: both(out, "start"), START_S, "both tasks to start",
                 alive=lambda: slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"))
        slurm.run("scancel", "--signal=USR1", job)
        state = slurm.wait_job(job, timeout=120)
    finally:
        slurm.run("scancel", job, check=False)
    assert state == "COMPLETED", f"{state}\n{job_log(tmp_path, script)}"
    stops = [read(out / f"stop{rank}.json") for rank in range(2)]
    step = stops[0]["step"]
    assert [s["received"] for s in stops] == ["SIGUSR1", "SIGUSR1"]  # scancel signals every task of the step
    assert [s["steps"] for s in stops] == [[step, step]] * 2  # both stopped at the same step
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert [read(out / f"start{rank}.json")["env"]["SLURM_JOB_ID"] for rank in range(2)] == [job, job]

    again = job_script(tmp_path, "again.sh", str(out), "--max-steps", str(step + 3))
    job2 = submit(slurm, tmp_path, again)
    try:
        state = slurm.wait_job(job2, timeout=START_S)
    finally:
        slurm.run("scancel", job2, check=False)
    assert state == "COMPLETED", f"{state}\n{job_log(tmp_path, again)}"
    done = [read(out / f"done{rank}.json") for rank in range(2)]
    assert [(d["resumed_at"], d["step"], d["received"]) for d in done] == [(step, step + 3, None)] * 2
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step + 3}"


def test_signal_before_the_time_limit_stops_every_task_with_a_checkpoint(slurm, tmp_path):
    """``--signal=USR1@120`` with ``--time=2``: slurmctld sends it at its first time-limit check
    after the start (every 30 s), long before the limit; --block-usr1 holds it until the watcher
    is installed if it comes while the ranks start."""
    out = tmp_path / "out"
    script = job_script(tmp_path, "limit.sh", str(out), "--block-usr1")
    submitted = time.time()
    job = submit(slurm, tmp_path, script, "--time=2", "--signal=USR1@120")
    try:
        bound = slurm.next_timelimit_check(submitted + 2) - time.time() + START_S
        state = slurm.wait_job(job, timeout=bound)
    finally:
        slurm.run("scancel", job, check=False)
    assert state == "COMPLETED", f"{state}\n{job_log(tmp_path, script)}"
    stops = [read(out / f"stop{rank}.json") for rank in range(2)]
    step = stops[0]["step"]
    assert [s["received"] for s in stops] == ["SIGUSR1", "SIGUSR1"]
    assert [s["steps"] for s in stops] == [[step, step]] * 2
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"


# ---------------------------------------------------------------- dsat and toolkit.run inside salloc
def dsat_model_dir(tmp_path: Path, *, profile: str) -> Path:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    procutil.install_sim_model(procutil.WORKERS / "cluster_dsat_trial.py", model_dir)
    (model_dir / "ds_config.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}))
    (model_dir / "deepspeed.yaml").write_text(yaml.safe_dump({
        "name": "cluster", "entrypoint": "python3 model.py", "resources": {"slots_per_trial": 2},
        "searcher": {"max_length": 10},
        "hyperparameters": {"deepspeed_config": "ds_config.json", "profile": profile}}))
    return model_dir


def salloc_dsat(slurm, model_dir: Path, out: Path, *flags: str, timeout: float):
    """``salloc --ntasks 2 python -m toolkit.dsat binary ...`` (every host taken as remote: see the
    wrapper)."""
    argv = ["salloc", "--ntasks=2", "--immediate=60", sys.executable,
            str(procutil.WORKERS / "cluster_dsat_remote.py"),
            "binary", str(model_dir / "deepspeed.yaml"), str(model_dir), "--output-dir", str(out),
            "--zero-stages", "1", "--memory-per-slot", "1GiB", "--confirm", "0", "--no-own-config", *flags]
    return slurm.run(*argv, env=slurm.env(procutil.child_env()), check=False, timeout=timeout,
                     cwd=model_dir.parent)


def test_dsat_inside_salloc_places_its_trials_with_srun(slurm, tmp_path):
    out = tmp_path / "out"
    result = salloc_dsat(slurm, dsat_model_dir(tmp_path, profile="init"), out, "--max-trials", "2",
                         "--trial-timeout", str(START_S), timeout=2 * START_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trials = sorted((out / "trials").iterdir())
    assert [t.name for t in trials] == ["trial_0", "trial_1"]
    for trial in trials:
        placement = read(trial / "placement.json")
        assert placement["launch"] == "srun" and placement["hosts"] == {slurm.nodename: [0, 1]}
        assert placement["argv"][:5] == ["srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                                         f"--nodelist={slurm.nodename}"]
        ranks = [read(trial / f"rank{rank}.json") for rank in range(2)]
        assert [r["env"]["SLURM_PROCID"] for r in ranks] == ["0", "1"]
        assert all(r["env"]["SLURM_STEP_NUM_TASKS"] == "2" and "SLURM_STEP_ID" in r["env"] for r in ranks)
        assert {r["env"]["MASTER_PORT"] for r in ranks} == {str(placement["master_port"])}
    # the profiling trial's ranks met on the address and port that dsat exported through srun
    ctx = [read(trials[0] / f"rank{rank}.json")["ctx"] for rank in range(2)]
    assert [(c["launcher"], c["rank"], c["world_size"], c["all_gathered"]) for c in ctx] == [
        ("slurm", 0, 2, [0, 1]), ("slurm", 1, 2, [0, 1])]
    assert read(out / "trials" / "trial_0" / "result.json")["status"] == "ok"


def test_dsat_trial_timeout_ends_its_srun_step_and_every_process(slurm, tmp_path):
    out = tmp_path / "out"
    result = salloc_dsat(slurm, dsat_model_dir(tmp_path, profile="hang"), out, "--max-trials", "2",
                         "--trial-timeout", "6", timeout=START_S)
    log = result.stdout[-3000:] + result.stderr[-3000:]
    trial = out / "trials" / "trial_0"
    assert read(trial / "placement.json")["launch"] == "srun", log
    ranks = [read(trial / f"rank{rank}.json") for rank in range(2)]  # both tasks ran before the timeout
    assert "ran past the timeout" in log, log
    # dsat signalled srun, and srun had Slurm cancel the step on its node. Which of Slurm's lines
    # about the cancel reach the log varies (slurmstepd's "CANCELLED AT" can be lost as the tasks
    # die); the processes and the step being gone, checked below, is what counts.
    stderr = (trial / "launcher.log").read_text()  # srun's own lines
    assert "srun: forcing job termination" in stderr, stderr
    assert any(line in stderr for line in (" CANCELLED AT ", "Job step aborted", "Terminating StepId")), stderr
    assert not [r["pid"] for r in ranks if pid_alive(r["pid"])]
    assert not find_trial_processes(f"{out / 'trials'}{os.sep}", prefix=True)
    assert not slurm.steps(), slurm.steps()


def test_toolkit_run_inside_salloc(slurm, tmp_path):
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump({
        "name": "cluster-run", "entrypoint": "python3 cluster_train.py --max-steps 5",
        "resources": {"slots_per_trial": 2},
        "searcher": {"name": "single", "metric": "loss", "max_length": 5},
        "max_restarts": 0, "hyperparameters": {}}))
    out = tmp_path / "out"
    result = slurm.run("salloc", "--ntasks=2", "--immediate=60", sys.executable, "-m", "toolkit.run",
                       str(config), str(procutil.WORKERS), "--output-dir", str(out),
                       env=slurm.env(procutil.child_env()), check=False, timeout=START_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    done = [read(out / f"done{rank}.json") for rank in range(2)]
    assert [(d["step"], d["steps"]) for d in done] == [(5, [5, 5])] * 2
    starts = [read(out / f"start{rank}.json") for rank in range(2)]
    # torchrun's variables win over the allocation's (which have no step: SLURM_STEP_ID is unset)
    assert [(s["launcher"], s["rank"], s["world_size"]) for s in starts] == [
        ("torchrun", 0, 2), ("torchrun", 1, 2)]
    assert all(s["env"]["SLURM_NTASKS"] == "2" and "SLURM_STEP_ID" not in s["env"] for s in starts)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_5"


def test_toolkit_run_as_the_batch_script_stops_on_the_batch_signal(slurm, tmp_path):
    """``exec python -m toolkit.run`` in a batch script, and the signal Slurm sends the batch shell
    (``scancel --signal=USR1 --batch``, as ``--signal=B:USR1@N`` does at the time-limit warning)."""
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump({
        "name": "cluster-batch", "entrypoint": "python3 cluster_train.py",
        "resources": {"slots_per_trial": 2}, "max_restarts": 0, "hyperparameters": {},
        "searcher": {"name": "single", "metric": "loss", "max_length": 5}}))
    out = tmp_path / "out"
    script = tmp_path / "batch.sh"
    command = f"{sys.executable} -m toolkit.run {config} {procutil.WORKERS} --output-dir {out}"
    script.write_text(f"#!/bin/sh\nexec {command}\n")
    job = submit(slurm, tmp_path, script)
    pids = []
    try:
        wait_for(lambda: both(out, "start"), START_S, "both ranks to start",
                 alive=lambda: slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"))
        pids = [read(out / f"start{rank}.json")["pid"] for rank in range(2)]
        slurm.run("scancel", "--signal=USR1", "--batch", job)
        state = slurm.wait_job(job, timeout=120)
    finally:
        slurm.run("scancel", job, check=False)
        kill_until_gone(lambda table: {pid for pid in pids if pid in table}, grace_s=5.0,
                        what="orphaned ranks")
    assert state == "COMPLETED", f"{state}\n{job_log(tmp_path, script)}"
    assert both(out, "stop") and (out / "checkpoints" / "latest").exists()


def test_two_concurrent_steps_of_one_job_each_rendezvous(slurm, tmp_path):
    """``srun ... & srun ... & wait`` in one allocation (a sweep inside one job), no MASTER_PORT set."""
    script = tmp_path / "steps.sh"
    command = f"srun --overlap --ntasks=2 {sys.executable} {CTX}"
    steps = "".join(f"{command} {tmp_path / name} &\n" for name in "AB")
    script.write_text(f"#!/bin/sh\n{steps}wait\n")
    for name in "AB":
        (tmp_path / name).mkdir()
    env = procutil.child_env(CLUSTER_CTX_TIMEOUT_S="20", TOOLKIT_COLLECTIVE_TIMEOUT_S="20")
    job = slurm.sbatch("--ntasks=2", f"--output={tmp_path / 'steps.out'}", f"--chdir={tmp_path}", str(script),
                       env=slurm.env(env))
    try:  # a failed step ends the test at once (the other may wait minutes on a peer that is gone)
        wait_for(lambda: slurm.job_state(job) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
                 or "srun: error" in job_log(tmp_path, script), START_S, "the job or a failed step")
        state = slurm.job_state(job)
    finally:
        slurm.run("scancel", job, check=False)
    log = job_log(tmp_path, script)
    assert state == "COMPLETED" and "srun: error" not in log, log
    for name in "AB":
        records = [read(tmp_path / name / f"rank{rank}.json") for rank in range(2)]
        assert [r["all_gathered"] for r in records] == [[0, 1], [0, 1]], log
