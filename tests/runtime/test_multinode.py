"""Training across nodes, simulated on one machine: two ``torchrun --nnodes 2`` agents with the c10d
rendezvous on 127.0.0.1, one rank each, sharing a checkpoint directory (tests/workers/multinode_train.py).

Checked for real: the node rank and counts init_distributed reports, SIGTERM to one node's
worker stopping both nodes at the same step, a checkpoint written once per shard and committed
once on the shared directory, and the resume from it on both nodes.

The pdsh path of DeepSpeed's multinode runner runs at the end, against ``localhost`` with an sshd
that the test starts on a loopback port (skipped, with the reason, where sshd or pdsh is missing).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import procutil as p

WORKER = p.WORKERS / "multinode_train.py"


def agent_argv(node: int, port: int, run_id: str, *args: str, script: Path = WORKER) -> list[str]:
    # is_host: the first agent serves the rendezvous store; both would match 127.0.0.1 otherwise,
    # and which one serves it would be a race (the loser falls back to client, but say it plainly).
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
            "--max-restarts", "0", str(script), *args]


def start_nodes(out: Path, ckpt: Path, *args: str) -> list[subprocess.Popen]:
    port, run_id = p.free_port(), uuid.uuid4().hex[:8]
    env = p.child_env(PYTHONPATH=f"{p.REPO}{os.pathsep}{p.WORKERS}")
    logs = [open(out / f"agent{node}.log", "w") for node in (0, 1)]
    try:
        return [subprocess.Popen(agent_argv(node, port, run_id, str(out), str(ckpt), *args), env=env,
                                 stdout=logs[node], stderr=subprocess.STDOUT, start_new_session=True)
                for node in (0, 1)]
    finally:
        for log in logs:
            log.close()


def wait_all(procs: list[subprocess.Popen], out: Path, timeout: float = 300) -> list[int]:
    end = time.monotonic() + timeout
    try:
        return [proc.wait(timeout=max(end - time.monotonic(), 1)) for proc in procs]
    except subprocess.TimeoutExpired:
        logs = "\n".join((out / f"agent{n}.log").read_text()[-3000:] for n in (0, 1))
        raise AssertionError(f"the agents did not finish in {timeout} s:\n{logs}") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def wait_for(predicate, what: str, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def read(path: Path):
    return json.loads(path.read_text())


# ---------------------------------------------------------------- node rank and counts per launcher (pure)
@pytest.mark.parametrize("env, node", [
    # torchrun: GROUP_RANK / GROUP_WORLD_SIZE (what its agent sets)
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
      "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}, ("torchrun", 1, 2, 2)),
    # deepspeed.launcher.launch on each node: CROSS_RANK / CROSS_SIZE, LOCAL_SIZE
    ({"RANK": "2", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "3",
      "MASTER_ADDR": "n0", "MASTER_PORT": "1"}, ("deepspeed", 1, 3, 2)),
    # Open MPI: OMPI_COMM_WORLD_NODE_RANK is a rank across jobs on the node, not the node's index
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "MASTER_ADDR": "n0"}, ("mpi", 2, 3, 2)),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "n0"},
     ("mpi", 1, 2, 2)),
    # srun with an uneven step: this node's own task count
    ({"SLURM_PROCID": "6", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "7", "SLURM_LOCALID": "0",
      "SLURM_NODEID": "3", "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
      "SLURM_STEP_NODELIST": "node[01-04]"}, ("slurm", 3, 4, 1)),
])
def test_node_rank_and_counts_per_launcher(env, node):
    from toolkit.runtime.launch_env import detect_launch

    info = detect_launch(env)
    assert (info.launcher, info.node_rank, info.num_nodes, info.local_world_size) == node


def test_two_nodes_report_their_place_stop_together_commit_once_and_resume(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "shared" / "checkpoints"
    out.mkdir()
    procs = start_nodes(out, ckpt)
    try:
        wait_for(lambda: all((out / f"progress{r}").exists() for r in (0, 1))
                 and min(int((out / f"progress{r}").read_text() or 0) for r in (0, 1)) >= 3,
                 "both nodes to train 3 steps")
    except AssertionError:
        wait_all(procs, out, timeout=1)
        raise
    ctxs = [read(out / f"ctx{r}.json") for r in (0, 1)]
    for rank, ctx in enumerate(ctxs):
        assert (ctx["rank"], ctx["world_size"], ctx["local_rank"], ctx["local_world_size"]) == (rank, 2, 0, 1)
        assert (ctx["num_nodes"], ctx["launcher"], ctx["is_local_chief"]) == (2, "torchrun", True)
        assert ctx["node_rank"] == int(ctx["env"]["GROUP_RANK"]) and ctx["env"]["GROUP_WORLD_SIZE"] == "2"
    assert sorted(c["node_rank"] for c in ctxs) == [0, 1]
    # SIGTERM reaches one node only (its worker, not the agent): both must stop at the same step.
    node1 = next(c for c in ctxs if c["node_rank"] == 1)
    os.kill(node1["pid"], signal.SIGTERM)
    assert wait_all(procs, out) == [0, 0]
    results = [read(out / f"result{r}.json") for r in (0, 1)]
    stopped = results[0]["stopped_at"]
    assert all(r["preempted"] and r["stopped_at"] == stopped and r["steps"] == [stopped, stopped] for r in results)
    assert all(r["start"] == 0 for r in results)

    # The shared directory: one commit, model states once, one ZeRO shard per data-parallel rank.
    tag = f"step_{stopped}"
    assert (ckpt / "latest").read_text().strip() == tag
    files = sorted(str(f.relative_to(ckpt / tag)) for f in (ckpt / tag).rglob("*") if f.is_file())
    assert files == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                     "mp_rank_00_model_states.pt", "toolkit_checkpoint.json", "toolkit_rng/rank_00000.pt",
                     "toolkit_rng/rank_00001.pt", "toolkit_save_started.json"] or files == [
        "mp_rank_00_model_states.pt", "toolkit_checkpoint.json", "toolkit_rng/rank_00000.pt",
        "toolkit_rng/rank_00001.pt", "toolkit_save_started.json", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"], files
    commit = read(ckpt / tag / "toolkit_checkpoint.json")
    assert (commit["world_size"], commit["data_parallel_size"], commit["steps_completed"]) == (2, 2, stopped)
    assert [d.name for d in ckpt.iterdir() if d.is_dir()] == [tag]

    # Resume on both nodes from the committed step (a fresh rendezvous; node ranks may swap).
    for f in out.glob("result*.json"):
        f.unlink()
    procs = start_nodes(out, ckpt, "--max-steps", str(stopped + 2))
    assert wait_all(procs, out) == [0, 0]
    results = [read(out / f"result{r}.json") for r in (0, 1)]
    assert all(r["start"] == stopped and r["stopped_at"] == stopped + 2 and not r["preempted"] for r in results)
    assert (ckpt / "latest").read_text().strip() == f"step_{stopped + 2}"


def test_the_example_runs_unchanged_on_two_nodes(tmp_path):
    """examples/core_api/train.py, as it is, under two torchrun agents (one rank per "node"):
    it trains, writes TensorBoard logs and commits its checkpoints on the shared directory."""
    from test_examples import EXAMPLES, small_config

    config, out = small_config(tmp_path, "train.py"), tmp_path / "out"
    port, run_id = p.free_port(), uuid.uuid4().hex[:8]
    procs = []
    for node in (0, 1):
        with open(tmp_path / f"agent{node}.log", "w") as log:
            procs.append(subprocess.Popen(
                agent_argv(node, port, run_id, "--config", str(config), "--output-dir", str(out), "--max-steps", "10",
                           script=EXAMPLES / "train.py"),
                env=p.child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    assert wait_all(procs, tmp_path) == [0, 0], (tmp_path / "agent0.log").read_text()[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_10"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


# ---------------------------------------------------------------- pdsh + ssh on loopback (optional)
def _sshd_setup(tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    """An sshd on a loopback port with a throw-away host key, and a HOME whose ssh config reaches it."""
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    missing = [name for name, path in (("sshd", sshd), ("pdsh", shutil.which("pdsh")),
                                       ("ssh", shutil.which("ssh")), ("ssh-keygen", shutil.which("ssh-keygen")))
               if not path]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: the pdsh/ssh path of DeepSpeed's runner cannot run here "
                    "(apt-get install openssh-server pdsh to run it)")
    home = tmp_path / "home"
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(parents=True)
    for key in ("host_key", "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh_dir / key)], check=True,
                       timeout=60)
    shutil.copy(ssh_dir / "id_ed25519.pub", ssh_dir / "authorized_keys")
    os.chmod(home, 0o755)
    port = p.free_port()
    config = tmp_path / "sshd_config"
    config.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {ssh_dir / 'host_key'}\n"
                      f"AuthorizedKeysFile {ssh_dir / 'authorized_keys'}\nPasswordAuthentication no\n"
                      "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
                      f"PidFile {tmp_path / 'sshd.pid'}\nPermitUserEnvironment no\n")
    (ssh_dir / "config").write_text(f"Host localhost 127.0.0.1\n  Port {port}\n  IdentityFile {ssh_dir / 'id_ed25519'}\n"
                                    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    os.makedirs("/run/sshd", exist_ok=True)
    daemon = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "sshd.log", "w"), start_new_session=True)
    # ssh reads ~/.ssh/config from the passwd entry's home, not $HOME, and DeepSpeed's runner,
    # pdsh and the test all run plain `ssh`: an `ssh` first on PATH adds `-F` with this config.
    shim = home / "bin"
    shim.mkdir()
    (shim / "ssh").write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {ssh_dir / 'config'} \"$@\"\n")
    (shim / "ssh").chmod(0o755)
    env = p.child_env(HOME=str(home), PATH=f"{shim}{os.pathsep}{os.environ['PATH']}")
    for _ in range(50):
        if daemon.poll() is not None:
            pytest.skip(f"sshd could not be started: {(tmp_path / 'sshd.log').read_text()[-500:]}")
        probe = subprocess.run([str(shim / "ssh"), "-o", "BatchMode=yes", "localhost", "true"], env=env, timeout=30,
                               capture_output=True)
        if probe.returncode == 0:
            return daemon, port, home
        time.sleep(0.2)
    daemon.kill()
    pytest.skip(f"ssh to the test sshd failed: {probe.stderr.decode()[-300:]}")


@pytest.mark.slow
def test_dsat_trial_through_pdsh_and_ssh_on_loopback(tmp_path):
    """A dsat trial on a host that is not taken as local (its name is made remote for the test)
    runs through DeepSpeed's runner -> pdsh -> ssh -> deepspeed.launcher.launch, with the
    trial's variables exported, and is stopped on its host on timeout."""
    daemon, _, home = _sshd_setup(tmp_path)
    try:
        _run_pdsh_trials(tmp_path, home)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def _run_pdsh_trials(tmp_path: Path, home: Path) -> None:
    from unittest import mock

    from toolkit.dsat.contract import TrialStatus
    from toolkit.dsat.execution import runner as runner_module
    from toolkit.dsat.execution.hosts import Host
    from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner, find_trial_processes
    from toolkit.dsat.search.types import TrialSpec

    env = p.child_env(HOME=str(home),
                      PATH=os.pathsep.join([str(home / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]))
    out = tmp_path / "out"
    settings = RunnerSettings(entrypoint=("python3", "dsat_fake_trial.py"), model_dir=p.WORKERS, slots_per_trial=2,
                              max_slots=2, max_concurrent=1, timeout_s=120, grace_s=3, poll_s=0.1,
                              hosts=(Host("localhost", 2),), multihost_launcher="pdsh")
    with mock.patch.dict(os.environ, env, clear=True), \
            mock.patch.object(runner_module, "is_local_host", lambda name: False):  # take the ssh path
        with TrialRunner(settings, output_dir=out) as runner:
            runner.start(TrialSpec(1, 1, {"stage": 1}, line=0), ds_config={}, hparams={"behaviour": "ok"})
            (ok,) = runner.wait(timeout=200)
        with TrialRunner(dataclasses_replace(settings, timeout_s=8), output_dir=out) as runner:
            runner.start(TrialSpec(2, 1, {"stage": 1}, line=0), ds_config={}, hparams={"behaviour": "hang"})
            wait_for(lambda: len(list((out / "trials" / "trial_2").glob("rank*.json"))) == 2, "both ranks of trial 2")
            (hung,) = runner.wait(timeout=200)
    record = read(out / "trials" / "trial_1" / "placement.json")
    log = (out / "trials" / "trial_1" / "stderr.log").read_text()[-3000:]
    assert ok.status is TrialStatus.OK, f"{ok.error}\n{log}"
    assert record["launch"] == "pdsh" and record["argv"][2] == "deepspeed.launcher.runner"
    ranks = [read(f) for f in sorted((out / "trials" / "trial_1").glob("rank*.json"))]
    assert len(ranks) == 2
    assert hung.status is TrialStatus.TIMEOUT
    assert not find_trial_processes(f"{out / 'trials'}{os.sep}", prefix=True)


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)
