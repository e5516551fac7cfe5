"""init_distributed and the context's collectives, in real processes under each launcher.

Two nodes (torchrun agents with --nnodes 2 on loopback): tests/runtime/test_multinode.py checks
the node placement and the same collectives there."""

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


def _check_two_ranks(records, *, launcher, num_nodes=1, adopted=False):
    for rank, rec in enumerate(records):
        assert rec["adopted"] is adopted
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
    assert rec["gathered"] == [0] and rec["mean"] == [0.0, 1.0] and rec["idempotent"] and not rec["adopted"]


def test_torchrun_two_ranks(tmp_path):
    procutil.check(procutil.run(procutil.torchrun_argv(WORKER, str(tmp_path))))
    records = _records(tmp_path, 2)
    _check_two_ranks(records, launcher="torchrun")
    assert [r["local_rank"] for r in records] == [0, 1] and records[0]["local_world_size"] == 2


def test_deepspeed_launcher_two_ranks_adopting_the_group_deepspeed_made(tmp_path):
    """A DeepSpeed script: its ranks call deepspeed.init_distributed first; toolkit adopts that group
    (the group toolkit makes itself, from the same variables, is test_torchrun_two_ranks')."""
    procutil.check(procutil.run(procutil.deepspeed_argv(WORKER, str(tmp_path)),
                                env=procutil.child_env(LOCAL_SIZE="2", CTX_WORKER_DEEPSPEED_FIRST="1")))
    _check_two_ranks(_records(tmp_path, 2), launcher="deepspeed", adopted=True)


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


# Each call raises before any collective and leaves no state behind, so one process tries them all
# in turn: get_context() first (nothing initialised yet), the second init_distributed last.
BAD_CALLS = [
    ("toolkit.get_context()", "init_distributed() has not been called"),
    ("toolkit.init_distributed(backend='nccl')", "backend='nccl' needs CUDA"),
    ("toolkit.init_distributed(backend='tcp')", "backend='tcp': expected one of"),
    ("toolkit.init_distributed(timeout=5)", "expected a positive datetime.timedelta"),
    # Every problem of the arguments at once, as a ConfigError.
    ("toolkit.init_distributed(backend='tcp', timeout=5, collective_timeout=0)",
     "ConfigError: 3 problems in configuration"),
    ("toolkit.init_distributed(collective_timeout=-1)", "collective_timeout=-1"),
    # A group made before with another rank and size than the launcher variables say: not adopted.
    ("import os, torch.distributed as dist\n"
     "saved = dict(os.environ)\n"
     "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
     "os.environ.update(RANK='1', WORLD_SIZE='2', MASTER_ADDR='127.0.0.1')\n"
     "try:\n"
     "    toolkit.init_distributed()\n"
     "finally:\n"
     "    dist.destroy_process_group()\n"
     "    os.environ.clear()\n"
     "    os.environ.update(saved)\n",
     "LaunchEnvError: torch.distributed is already initialised as rank 0 of 1, but the env variables say "
     "rank 1 of 2; initialise once, through toolkit.init_distributed()"),
    ("toolkit.init_distributed(backend='gloo').all_reduce([1.0], op='prod')",
     "ConfigError: invalid configuration: op='prod': expected one of 'sum', 'mean', 'max', 'min'"),
    ("toolkit.init_distributed(); toolkit.init_distributed(backend='mpi')",
     "already initialised with backend 'gloo'"),
]
TRY_EACH = """
import sys, toolkit
for index, code in enumerate(sys.argv[1:]):
    try:
        exec(code)
    except Exception as err:
        text = f"{type(err).__name__}: {err}".replace(chr(10), " ")
    else:
        text = "no error"
    print(f"call {index}: {text}", flush=True)
"""


def test_bad_arguments():
    out = procutil.check(procutil.run([sys.executable, "-c", TRY_EACH, *(code for code, _ in BAD_CALLS)]))
    lines = [line for line in out.splitlines() if line.startswith("call ")]
    assert len(lines) == len(BAD_CALLS), out[-4000:]
    for line, (code, message) in zip(lines, BAD_CALLS, strict=True):
        assert message in line, (code, line)


LONE = """
import sys, time, toolkit
ctx = toolkit.init_distributed()
if ctx.rank == 0:
    errors = []
    for call in sys.argv[1:]:
        try:
            getattr(ctx, call)(*([{"x": 1}] if call != "barrier" else []))
        except Exception as err:
            errors.append(err)
            print(f"{type(err).__name__}: {err}".replace(chr(10), " "), flush=True)
    raise SystemExit(f"{len(errors)} calls raised")
else:
    time.sleep(60)   # the other rank does not call them: it trains on, or sleeps
"""


def test_collective_called_on_one_rank_raises_naming_the_call(tmp_path):
    """Rank 0 alone calls two collectives in turn, each failing on its own within the bound."""
    script = tmp_path / "lone.py"
    script.write_text(LONE)
    calls = ["all_gather_object", "barrier"]
    start = time.monotonic()
    result = procutil.run(procutil.torchrun_argv(script, *calls),
                          env=procutil.child_env(TOOLKIT_COLLECTIVE_TIMEOUT_S="4"), timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - start < 60, "the lone rank must fail within about the bound"
    assert "2 calls raised" in result.stdout, result.stdout[-4000:]
    for number, call in enumerate(calls, 1):
        assert f"CollectiveTimeoutError: ctx.{call} (toolkit collective #{number}) did not complete " \
               "within 4 s on rank 0: rank(s) [1] never reached it" in result.stdout, result.stdout[-4000:]
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
