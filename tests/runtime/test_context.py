"""init_distributed and the context's collectives, in real processes under each launcher."""

import json
import subprocess
import sys
import time

import pytest

from helpers import procutil

WORKER = procutil.WORKERS / "ctx_worker.py"


def _records(out_dir, n):
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]
    assert sorted((out_dir / "chief_first.txt").read_text().split()) == [str(r) for r in range(n)]
    # chief_first: the chief's line is written before any other rank's.
    assert (out_dir / "chief_first.txt").read_text().split()[0] == "0"
    return records


def _check_two_ranks(records, *, launcher, num_nodes=1):
    for rank, rec in enumerate(records):
        assert rec["rank"] == rank and rec["world_size"] == 2 and rec["is_chief"] == (rank == 0)
        assert rec["launcher"] == launcher and rec["backend"] == "gloo" and rec["device"] == "cpu"
        assert rec["num_nodes"] == num_nodes and rec["idempotent"] is True
        assert rec["broadcast"] == {"from": 0, "payload": [1, 2]}
        assert rec["all_gathered"] == [0, 1]
        assert rec["mean"] == [0.5, 1.0] and rec["max"] == [1.0]
    assert records[0]["gathered"] == [0, 10] and records[1]["gathered"] is None


def test_plain_python_is_world_of_one(tmp_path):
    procutil.check(procutil.run([sys.executable, str(WORKER), str(tmp_path)]))
    (rec,) = _records(tmp_path, 1)
    assert rec["launcher"] == "none" and rec["world_size"] == 1 and rec["is_chief"]
    assert rec["gathered"] == [0] and rec["mean"] == [0.0, 1.0] and rec["idempotent"]


def test_torchrun_two_ranks(tmp_path):
    procutil.check(procutil.run(procutil.torchrun_argv(WORKER, str(tmp_path))))
    records = _records(tmp_path, 2)
    _check_two_ranks(records, launcher="torchrun")
    assert [r["local_rank"] for r in records] == [0, 1] and records[0]["local_world_size"] == 2


def test_deepspeed_launcher_two_ranks(tmp_path):
    procutil.check(procutil.run(procutil.deepspeed_argv(WORKER, str(tmp_path)),
                                env=procutil.child_env(LOCAL_SIZE="2")))
    _check_two_ranks(_records(tmp_path, 2), launcher="deepspeed")


def test_two_simulated_nodes_on_loopback(tmp_path):
    port = procutil.free_port()
    procs = [subprocess.Popen(
        procutil.torchrun_argv(WORKER, str(tmp_path), nproc=1, port=port,
                        extra=["--nnodes", "2", "--node_rank", str(node)]),
        env=procutil.child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]
    records = _records(tmp_path, 2)
    _check_two_ranks(records, launcher="torchrun", num_nodes=2)
    assert [(r["node_rank"], r["local_rank"], r["local_world_size"]) for r in records] == [
        (0, 0, 1), (1, 0, 1)]


def _spawn_with_env(tmp_path, envs):
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], env=procutil.child_env(**env),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for env in envs]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]


def test_mpirun_variables(tmp_path):
    # mpirun is not installed here: two real processes get exactly the variables Open MPI sets.
    port = str(procutil.free_port())
    _spawn_with_env(tmp_path, [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                                "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                "MASTER_PORT": port} for r in (0, 1)])
    _check_two_ranks(_records(tmp_path, 2), launcher="mpi")


def test_srun_variables(tmp_path):
    # No Slurm allocation here: two real processes get the variables an srun step sets.
    port = str(procutil.free_port())
    _spawn_with_env(tmp_path, [{"SLURM_PROCID": str(r), "SLURM_STEP_ID": "0",
                                "SLURM_STEP_NUM_TASKS": "2",
                                "SLURM_LOCALID": str(r), "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1",
                                "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "127.0.0.1",
                                "SLURM_JOB_ID": "7", "MASTER_PORT": port} for r in (0, 1)])
    _check_two_ranks(_records(tmp_path, 2), launcher="slurm")


def test_bad_variable_stops_before_anything_starts(tmp_path):
    result = procutil.run([sys.executable, str(WORKER), str(tmp_path)],
                   env=procutil.child_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="x", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT="1"))
    assert result.returncode != 0
    assert "LOCAL_RANK='x' is not an integer" in result.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("code, message", [
    ("toolkit.init_distributed(backend='nccl')", "backend='nccl' needs CUDA"),
    ("toolkit.init_distributed(backend='tcp')", "backend='tcp': expected one of"),
    ("toolkit.init_distributed(); toolkit.init_distributed(backend='mpi')",
     "already initialised with backend 'gloo'"),
    ("toolkit.init_distributed(timeout=5)", "expected a positive datetime.timedelta"),
    # Every problem of the arguments at once, as a ConfigError.
    ("toolkit.init_distributed(backend='tcp', timeout=5, collective_timeout=0)",
     "ConfigError: 3 problems in configuration"),
    ("toolkit.init_distributed(collective_timeout=-1)", "collective_timeout=-1"),
    ("toolkit.get_context()", "init_distributed() has not been called"),
])
def test_bad_arguments(code, message):
    result = procutil.run([sys.executable, "-c", f"import toolkit; {code}"])
    assert result.returncode != 0 and message in result.stdout


def test_adopts_process_group_made_by_deepspeed(tmp_path):
    code = ("import deepspeed, toolkit, torch.distributed as dist; deepspeed.init_distributed('gloo'); "
            # One write per rank: print() of several values writes them one by one, and the two
            # ranks share torchrun's stdout, so their pieces could interleave.
            "ctx = toolkit.init_distributed(); import sys; "
            "sys.stdout.write(f'ADOPTED {ctx.rank} {ctx.world_size} {ctx.backend}\\n'); sys.stdout.flush()")
    script = tmp_path / "adopt.py"
    script.write_text(code)
    out = procutil.check(procutil.run(procutil.torchrun_argv(script)))
    assert "ADOPTED 0 2 gloo" in out and "ADOPTED 1 2 gloo" in out


LONE = """
import sys, time, toolkit
ctx = toolkit.init_distributed()
if ctx.rank == 0:
    getattr(ctx, sys.argv[1])(*([{"x": 1}] if sys.argv[1] != "barrier" else []))
else:
    time.sleep(30)   # the other rank does not call it: it trains on, or sleeps
"""


@pytest.mark.parametrize("call", ["all_gather_object", "barrier"])
def test_collective_called_on_one_rank_raises_naming_the_call(tmp_path, call):
    script = tmp_path / "lone.py"
    script.write_text(LONE)
    start = time.monotonic()
    result = procutil.run(procutil.torchrun_argv(script, call),
                          env=procutil.child_env(TOOLKIT_COLLECTIVE_TIMEOUT_S="4"), timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - start < 60, "the lone rank must fail within about the bound"
    assert f"CollectiveTimeoutError: ctx.{call} (toolkit collective #1) did not complete within 4 s " \
           "on rank 0: rank(s) [1] never reached it" in result.stdout, result.stdout[-4000:]
    assert "called on all ranks" in result.stdout


def test_collective_timeout_resolution():
    from datetime import timedelta

    from toolkit.errors import ConfigError
    from toolkit.runtime.collectives import resolve_collective_timeout
    assert resolve_collective_timeout(None, {}) == 60.0
    assert resolve_collective_timeout(None, {"TOOLKIT_COLLECTIVE_TIMEOUT_S": "2.5"}) == 2.5
    assert resolve_collective_timeout(timedelta(minutes=2), {"TOOLKIT_COLLECTIVE_TIMEOUT_S": "1"}) == 120.0
    for bad, env in [(0, {}), (True, {}), (float("inf"), {}), (None, {"TOOLKIT_COLLECTIVE_TIMEOUT_S": "x"})]:
        with pytest.raises(ConfigError):
            resolve_collective_timeout(bad, env)
