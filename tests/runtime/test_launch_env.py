"""detect_launch: pure logic over launcher variables (no processes)."""

import pytest

from toolkit.errors import LaunchEnvError
from toolkit.runtime.launch_env import detect_launch, first_slurm_host

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"}


def test_nothing_set_is_world_of_one():
    info = detect_launch({})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.num_nodes) == (
        "none", 0, 1, 0, 1)
    assert info.master_addr is None


def test_torchrun():
    info = detect_launch(TORCHRUN)
    assert info.launcher == "torchrun" and info.uses_env_rendezvous
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert (info.node_rank, info.num_nodes, info.master_addr, info.master_port) == (1, 2, "10.0.0.1", 29501)


def test_deepspeed_launcher():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
           "CROSS_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    info = detect_launch(env)
    assert info.launcher == "deepspeed"
    assert (info.node_rank, info.num_nodes, info.local_world_size) == (1, 2, 2)


def test_plain_env_launcher_derives_local_values():
    info = detect_launch({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert info.launcher == "env" and info.local_rank == 1 and info.local_world_size == 2


def test_open_mpi_single_host_defaults_to_loopback():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    info = detect_launch(env)
    assert info.launcher == "mpi" and not info.uses_env_rendezvous
    assert (info.rank, info.world_size, info.master_addr, info.master_port) == (1, 2, "127.0.0.1", 29500)


def test_mpi_across_hosts_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):
        detect_launch(env)
    info = detect_launch({**env, "MASTER_ADDR": "node1"})
    assert (info.num_nodes, info.node_rank) == (2, 0)


def test_mpich_pmi():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "MASTER_ADDR": "n0"}
    info = detect_launch(env)
    assert (info.rank, info.local_rank, info.node_rank, info.num_nodes) == (3, 1, 1, 2)


# Slurm allocations cannot run here: these variables are what srun sets, per the Slurm docs.
SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "12345"}


def test_slurm_srun_step():
    info = detect_launch(SRUN)
    assert info.launcher == "slurm"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.node_rank, info.num_nodes, info.master_addr) == (1, 2, "gpu07")
    assert info.master_port == 10000 + (12345 * 100 + 0) % 20000


def test_two_steps_of_one_slurm_job_take_different_default_ports():
    ports = {detect_launch({**SRUN, "SLURM_STEP_ID": step}).master_port for step in ("0", "1", "2")}
    assert len(ports) == 3, ports


def test_two_mpirun_jobs_take_different_default_ports():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    ports = {detect_launch({**env, "OMPI_MCA_ess_base_jobid": str(family << 16 | 1)}).master_port
             for family in (1000, 1001)}
    assert len(ports) == 2 and all(10000 <= port < 30000 for port in ports), ports
    assert detect_launch(env).master_port == 29500  # not Open MPI's: the default


def test_sbatch_script_without_srun_is_one_process():
    env = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert detect_launch(env).world_size == 1


def test_launcher_variables_win_over_slurm():
    assert detect_launch({**SRUN, **TORCHRUN}).launcher == "torchrun"


@pytest.mark.parametrize("nodelist, first", [("node[03-05,09]", "node03"), ("gpu-a[1-2],gpu-b7", "gpu-a1"),
                                             ("host1,host2", "host1"), ("single", "single")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("key, value, fragment", [
    ("LOCAL_RANK", "x", "LOCAL_RANK='x' is not an integer"),
    ("RANK", "-1", "RANK='-1' must be >= 0"),
    ("WORLD_SIZE", "0", "WORLD_SIZE='0' must be >= 1"),
    ("MASTER_PORT", "http", "MASTER_PORT='http' is not an integer"),
    ("MASTER_PORT", "70000", "master port 70000 is outside 1..65535"),
    ("MASTER_ADDR", " ", "MASTER_ADDR=' ' is empty"),
    ("RANK", "4", "rank 4 is outside [0, world size 4)"),
    ("LOCAL_RANK", "2", "local rank 2 is outside [0, local world size 2)"),
    ("LOCAL_WORLD_SIZE", "3", "not a multiple of the local world size 3"),
])
def test_bad_variable_is_named(key, value, fragment):
    with pytest.raises(LaunchEnvError) as info:
        detect_launch({**TORCHRUN, key: value})
    assert fragment in str(info.value)


def test_all_bad_variables_reported_at_once():
    with pytest.raises(LaunchEnvError) as info:
        detect_launch({**TORCHRUN, "LOCAL_RANK": "x", "GROUP_RANK": "y"})
    assert "LOCAL_RANK='x'" in str(info.value) and "GROUP_RANK='y'" in str(info.value)


def test_half_set_launch_is_an_error():
    with pytest.raises(LaunchEnvError, match="WORLD_SIZE is not"):
        detect_launch({"RANK": "0"})


def test_a_local_world_larger_than_the_world_is_named():
    env = {**TORCHRUN, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}
    with pytest.raises(LaunchEnvError, match="torchrun: local world size 4 exceeds world size 2"):
        detect_launch(env)


def test_a_job_step_without_its_step_counts_reads_the_jobs():
    """Older Slurm sets no SLURM_STEP_NUM_TASKS / SLURM_STEP_NUM_NODES: the job's counts stand in."""
    env = {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES")}
    info = detect_launch({**env, "SLURM_NNODES": "2"})
    assert (info.world_size, info.num_nodes, info.local_world_size, info.node_rank) == (8, 2, 4, 1)


@pytest.mark.parametrize("nodelist", ["gpu[08-07]", "gpu[07-08", "", "gpu[a-b]"])
def test_a_node_list_that_cannot_be_parsed_is_named(nodelist):
    expected = f"SLURM node list {nodelist!r} cannot be parsed; expected e.g. 'node[01-04]'"
    with pytest.raises(LaunchEnvError) as info:
        first_slurm_host(nodelist)
    assert str(info.value) == expected
    if nodelist:   # in a job step without MASTER_ADDR: the same message, with the others at once
        with pytest.raises(LaunchEnvError) as info:
            detect_launch({**SRUN, "SLURM_STEP_NODELIST": nodelist, "SLURM_LOCALID": "x"})
        assert expected in str(info.value) and "SLURM_LOCALID='x'" in str(info.value)


def test_slurm_bad_tasks_per_node():
    with pytest.raises(LaunchEnvError, match="SLURM_STEP_TASKS_PER_NODE"):
        detect_launch({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "many"})
