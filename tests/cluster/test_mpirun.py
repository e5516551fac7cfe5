"""Open MPI's real ``mpirun -np 2`` (Open MPI 4.1, as root, loopback only) runs a toolkit script;
``init_distributed`` reads the real OMPI_COMM_WORLD_* variables (issue 16)."""

import json
import sys

from realsshd import mpirun_argv

from helpers import procutil


def test_mpirun_two_ranks_read_the_real_ompi_variables(cluster_packages, tmp_path):
    # MASTER_PORT: the default (29500) is one fixed port for every mpirun job on the machine
    argv = mpirun_argv(2, sys.executable, str(procutil.WORKERS / "cluster_ctx.py"), str(tmp_path))
    result = procutil.run(argv, env=procutil.child_env(MASTER_PORT=str(procutil.free_port())), timeout=300)
    procutil.check(result)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(ranks):
        env = record["env"]
        assert record["launcher"] == "mpi", record
        assert (record["rank"], record["world_size"]) == (rank, 2)
        assert (env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]) == (str(rank), "2")
        local = int(env["OMPI_COMM_WORLD_LOCAL_RANK"])
        assert (record["local_rank"], record["local_world_size"]) == (local, 2)
        assert (record["node_rank"], record["num_nodes"]) == (0, 1)
        assert record["all_gathered"] == [0, 1] and record["sum"] == [2.0]
        # init_distributed exported the torchrun-style names DeepSpeed reads, from the MPI ones
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert env["MASTER_ADDR"] == "127.0.0.1"
    assert ranks[0]["is_chief"] and not ranks[1]["is_chief"]
