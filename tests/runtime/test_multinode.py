"""Training across nodes, simulated on one machine: two ``torchrun --nnodes 2`` agents with the c10d
rendezvous on 127.0.0.1, one rank each, sharing a checkpoint directory (tests/workers/multinode_train.py).

Checked for real: the node rank and counts init_distributed reports, the context's collectives
and ``chief_first`` across the nodes, SIGTERM to one node's
worker stopping both nodes at the same step, a checkpoint written once per shard and committed
once on the shared directory, and the resume from it on both nodes; then, in the resume launch's
processes, examples/core_api/train.py unchanged (two launches in all, for both tests).

The pdsh path of DeepSpeed's multinode runner runs for real in tests/cluster/test_pdsh.py.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import procutil

WORKER = procutil.WORKERS / "multinode_train.py"
RESUME_THEN_EXAMPLE = procutil.WORKERS / "multinode_resume_then_example.py"


def agent_argv(node: int, port: int, run_id: str, *args: str, script: Path = WORKER) -> list[str]:
    # is_host: the first agent serves the rendezvous store; both would match 127.0.0.1 otherwise,
    # and which one serves it would be a race (the loser falls back to client, but say it plainly).
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
            "--max-restarts", "0", str(script), *args]


def start_nodes(out: Path, ckpt: Path, *args: str, script: Path = WORKER) -> list[subprocess.Popen]:
    port, run_id = procutil.free_port(), uuid.uuid4().hex[:8]
    env = procutil.child_env(PYTHONPATH=f"{procutil.REPO}{os.pathsep}{procutil.WORKERS}")
    logs = [open(out / f"agent{node}.log", "w") for node in (0, 1)]
    try:
        return [subprocess.Popen(agent_argv(node, port, run_id, str(out), str(ckpt), *args, script=script),
                                 env=env, stdout=logs[node], stderr=subprocess.STDOUT, start_new_session=True)
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
    ({"RANK": "2", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
      "CROSS_SIZE": "3", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}, ("deepspeed", 1, 3, 2)),
    # Open MPI: OMPI_COMM_WORLD_NODE_RANK is a rank across jobs on the node, not the node's index
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "MASTER_ADDR": "n0"},
     ("mpi", 2, 3, 2)),
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


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two two-node launches, checked by the tests below: multinode_train.py stopped by a SIGTERM to
    one node's worker, then (a fresh rendezvous) its resume followed, in the same processes, by
    examples/core_api/train.py (tests/workers/multinode_resume_then_example.py). What the tests
    check of the checkpoint directory after the first launch is kept before the second starts."""
    from helpers.examples import small_config

    base = tmp_path_factory.mktemp("two_nodes")
    out, ckpt = base / "out", base / "shared" / "checkpoints"
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
    chief_first = (out / "chief_first.txt").read_text().split()
    # SIGTERM reaches one node only (its worker, not the agent): both must stop at the same step.
    node1 = next((c for c in ctxs if c["node_rank"] == 1), ctxs[1])  # the test checks the node ranks
    os.kill(node1["pid"], signal.SIGTERM)
    assert wait_all(procs, out) == [0, 0], (out / "agent0.log").read_text()[-3000:]
    results = [read(out / f"result{r}.json") for r in (0, 1)]
    stopped = results[0]["stopped_at"]
    tag = f"step_{stopped}"
    first = {"ctxs": ctxs, "chief_first": chief_first, "results": results,
             "latest": (ckpt / "latest").read_text().strip(),
             "files": sorted(str(f.relative_to(ckpt / tag)) for f in (ckpt / tag).rglob("*") if f.is_file()),
             "commit": read(ckpt / tag / "toolkit_checkpoint.json"),
             "dirs": [d.name for d in ckpt.iterdir() if d.is_dir()]}

    # Resume on both nodes from the committed step (node ranks may swap), then the example.
    for f in out.glob("result*.json"):
        f.unlink()
    config, example = small_config(base, "train.py"), base / "example"
    procs = start_nodes(out, ckpt, "--max-steps", str(stopped + 2), "--", "--config", str(config),
                        "--output-dir", str(example), "--max-steps", "10", script=RESUME_THEN_EXAMPLE)
    codes = wait_all(procs, out)
    resumed = [read(out / f"result{r}.json") if (out / f"result{r}.json").exists() else None for r in (0, 1)]
    logs = "\n".join((out / f"agent{n}.log").read_text()[-3000:] for n in (0, 1))
    return first, {"codes": codes, "results": resumed, "latest": (ckpt / "latest").read_text().strip(),
                   "logs": logs}, example


def test_two_nodes_report_their_place_stop_together_commit_once_and_resume(two_nodes):
    first, second, _ = two_nodes
    ctxs = first["ctxs"]
    for rank, ctx in enumerate(ctxs):
        assert (ctx["rank"], ctx["world_size"], ctx["local_rank"], ctx["local_world_size"]) == (rank, 2, 0, 1)
        assert (ctx["num_nodes"], ctx["launcher"], ctx["is_local_chief"]) == (2, "torchrun", True)
        assert ctx["node_rank"] == int(ctx["env"]["GROUP_RANK"]) and ctx["env"]["GROUP_WORLD_SIZE"] == "2"
    assert sorted(c["node_rank"] for c in ctxs) == [0, 1]
    # The context's collectives across the nodes (on one node: tests/runtime/test_context.py).
    for rank, ctx in enumerate(ctxs):
        assert ctx["is_chief"] == (rank == 0) and ctx["broadcast"] == {"from": 0, "payload": [1, 2]}
        assert ctx["all_gathered"] == [0, 1] and ctx["mean"] == [0.5, 1.0] and ctx["max"] == [1.0]
    assert ctxs[0]["gathered"] == [0, 10] and ctxs[1]["gathered"] is None
    assert first["chief_first"] == ["0", "1"]
    # The SIGTERM to one node's worker (the fixture): both nodes stopped at the same step.
    results = first["results"]
    stopped = results[0]["stopped_at"]
    assert all(r["preempted"] and r["stopped_at"] == stopped and r["steps"] == [stopped, stopped]
               for r in results)
    assert all(r["start"] == 0 for r in results)

    # The shared directory: one commit, model states once, one ZeRO shard per data-parallel rank.
    tag = f"step_{stopped}"
    assert first["latest"] == tag
    files = first["files"]
    assert files == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt",
                     "toolkit_checkpoint.json", "toolkit_rng/rank_00000.pt", "toolkit_rng/rank_00001.pt",
                     "toolkit_save_started.json"] or files == [
        "mp_rank_00_model_states.pt", "toolkit_checkpoint.json", "toolkit_rng/rank_00000.pt",
        "toolkit_rng/rank_00001.pt", "toolkit_save_started.json", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"], files
    commit = first["commit"]
    assert (commit["world_size"], commit["data_parallel_size"], commit["steps_completed"]) == (2, 2, stopped)
    assert first["dirs"] == [tag]

    # The resume on both nodes from the committed step (a fresh rendezvous).
    assert second["codes"] == [0, 0], second["logs"]
    assert all(r["start"] == stopped and r["stopped_at"] == stopped + 2 and not r["preempted"]
               for r in second["results"]), second["results"]
    assert second["latest"] == f"step_{stopped + 2}"


def test_the_example_runs_unchanged_on_two_nodes(two_nodes):
    """examples/core_api/train.py, as it is, under two torchrun agents (one rank per "node"), run in
    the processes of the fixture's resume launch after the worker: it trains, writes TensorBoard logs
    and commits its checkpoints on the shared directory."""
    _, second, out = two_nodes
    assert second["codes"] == [0, 0], second["logs"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_10"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


# The real pdsh + ssh trial (through DeepSpeed's pdsh runner, on a loopback sshd) is in
# tests/cluster/test_pdsh.py.
