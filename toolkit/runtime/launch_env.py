"""Read where this process sits in a distributed job from the launcher's environment variables.

Pure, any rank: :func:`detect_launch` maps the variables (``os.environ`` by default) of torchrun,
the deepspeed launcher, a plain ``RANK``/``WORLD_SIZE``, mpirun, an ``srun`` step or none (world
size 1) to a :class:`LaunchInfo`, naming a bad variable. Which variables, and which launcher wins:
docs/start.md (How the launcher is recognised)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from toolkit.errors import LaunchEnvError

__all__ = ["LaunchInfo", "detect_launch", "first_slurm_host", "parse_slurm_counts", "parse_slurm_nodelist"]

DEFAULT_MASTER_PORT = 29500


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits, as the launcher described it. ``launcher``: ``"torchrun"``,
    ``"deepspeed"``, ``"env"``, ``"mpi"``, ``"slurm"`` or ``"none"``; no ``master_addr`` at world size 1."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None

    @property
    def uses_env_rendezvous(self) -> bool:
        """True when the launcher set MASTER_ADDR/PORT and RANK for ``env://``. torchrun needs it: its agent
        already serves the TCP store on MASTER_PORT, so a second ``tcp://`` server there would fail."""
        return self.launcher in ("torchrun", "deepspeed", "env")


class _Reader:
    """Reads and validates variables, collecting every problem before raising once."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.problems: list[str] = []

    def has(self, *names: str) -> bool:
        return all(name in self.environ for name in names)

    def int(self, name: str, default: int | None = None, *, minimum: int = 0) -> int | None:
        raw = self.environ.get(name)
        if raw is None:
            return default
        try:
            value = int(raw.strip())
        except ValueError:
            self.problems.append(f"{name}={raw!r} is not an integer")
            return default
        if value < minimum:
            self.problems.append(f"{name}={raw!r} must be >= {minimum}")
            return default
        return value

    def str(self, name: str) -> str | None:
        raw = self.environ.get(name)
        if raw is not None and not raw.strip():
            self.problems.append(f"{name}={raw!r} is empty; expected a host name or address")
            return None
        return raw.strip() if raw is not None else None


def parse_slurm_counts(text: str) -> list[int] | None:
    """Slurm's per-node counts, ``'2(x3),1'`` -> ``[2, 2, 2, 1]``; None when malformed. Pure."""
    counts: list[int] = []
    for item in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: ``a[1-2],b`` -> ``['a[1-2]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_slurm_nodelist(nodelist: str) -> list[str] | None:
    """Every host of a Slurm node list, in order, without ``scontrol``; None when malformed. Pure.
    ``node[01-03,7]`` -> ``node01 node02 node03 node7`` (padding kept); one bracket group per name."""
    if not isinstance(nodelist, str) or not nodelist.strip():
        return None
    hosts: list[str] = []
    for part in _split_top(nodelist.strip()):
        match = re.fullmatch(r"([^\[\],]+)(?:\[([^\[\]]+)\]([^\[\],]*))?", part.strip())
        if not match:
            return None
        prefix, ranges, suffix = match.group(1), match.group(2), match.group(3) or ""
        if ranges is None:
            hosts.append(prefix)
            continue
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
                return None
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}{suffix}")
    return hosts


def _slurm_tasks_per_node(raw: str, node: int | None = None) -> int | None:
    """This node's entry of SLURM_STEP_TASKS_PER_NODE, e.g. ``'2(x3),1'`` -> 2 on nodes 0-2, 1 on node 3."""
    counts = parse_slurm_counts(raw)
    if counts is None:
        return None
    node = node or 0
    return counts[node] if node < len(counts) else counts[0]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``node[03-05,09]`` -> ``node03``), without ``scontrol``;
    LaunchEnvError when it is empty or malformed. Pure."""
    hosts = parse_slurm_nodelist(nodelist)
    if not hosts:
        raise LaunchEnvError(f"SLURM node list {nodelist!r} cannot be parsed; expected e.g. 'node[01-04]'")
    return hosts[0]


def _finish(launcher: str, r: _Reader, *, rank, world_size, local_rank, local_world_size,
            node_rank, num_nodes, master_addr, master_port) -> LaunchInfo:
    """Fill what can be derived, check the numbers against each other, raise all problems once."""
    if not r.problems:   # rank and world_size are read from variables each caller checked are set
        if local_world_size is None:
            local_world_size = world_size if num_nodes in (None, 1) else max(world_size // num_nodes, 1)
        if local_rank is None:
            local_rank = rank % local_world_size
        if num_nodes is None:
            if world_size % local_world_size:
                r.problems.append(
                    f"{launcher}: world size {world_size} is not a multiple of the local world size "
                    f"{local_world_size}; cannot tell the number of nodes")
                num_nodes = 1
            else:
                num_nodes = world_size // local_world_size
        if node_rank is None:
            node_rank = rank // local_world_size
        if not 0 <= rank < max(world_size, 1):
            r.problems.append(f"{launcher}: rank {rank} is outside [0, world size {world_size})")
        if not 0 <= local_rank < max(local_world_size, 1):
            r.problems.append(
                f"{launcher}: local rank {local_rank} is outside [0, local world size {local_world_size})")
        if local_world_size > world_size:
            r.problems.append(
                f"{launcher}: local world size {local_world_size} exceeds world size {world_size}")
        if not 0 <= node_rank < max(num_nodes, 1):
            r.problems.append(
                f"{launcher}: node rank {node_rank} is outside [0, number of nodes {num_nodes})")
        if master_port is not None and not 1 <= master_port <= 65535:
            r.problems.append(f"{launcher}: master port {master_port} is outside 1..65535")
        if world_size > 1 and master_addr is None:
            r.problems.append(
                f"{launcher}: MASTER_ADDR is not set; with world size {world_size} every rank must know "
                "rank 0's address: export MASTER_ADDR=<host of rank 0>")
    if r.problems:
        raise LaunchEnvError("; ".join(r.problems))
    return LaunchInfo(launcher, rank, world_size, local_rank, local_world_size, node_rank, num_nodes,
                      master_addr,
                      master_port if master_port is not None or world_size == 1 else DEFAULT_MASTER_PORT)


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Describe this process's place in the job from the launcher variables in ``environ`` (default
    ``os.environ``). Pure: any rank, nothing initialised. LaunchEnvError names every malformed or
    inconsistent variable (``LOCAL_RANK='x' is not an integer``); no variables: world size 1."""
    env = os.environ if environ is None else environ
    r = _Reader(env)
    if r.has("RANK", "WORLD_SIZE"):
        return _from_rank_vars(r)
    if r.has("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        return _from_mpi(r, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                         "OMPI_COMM_WORLD_LOCAL_SIZE")
    if r.has("PMI_RANK", "PMI_SIZE"):
        return _from_mpi(r, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if r.has("SLURM_PROCID", "SLURM_STEP_ID"):
        return _from_slurm(r, env)
    partial = [name for name in ("RANK", "WORLD_SIZE") if name in env]
    if partial:
        missing = sorted({"RANK", "WORLD_SIZE"} - set(partial))
        raise LaunchEnvError(
            f"{partial[0]}={env[partial[0]]!r} is set but {', '.join(missing)} is not; a launcher sets "
            "both. Unset it to run as a single process, or set both.")
    return _finish("none", r, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                   num_nodes=1, master_addr=None, master_port=None)


def _from_rank_vars(r: _Reader) -> LaunchInfo:
    """torchrun, the deepspeed launcher, or a plain RANK/WORLD_SIZE environment."""
    if r.has("CROSS_RANK") or r.has("LOCAL_SIZE"):
        launcher, local_size_var, node_var = "deepspeed", "LOCAL_SIZE", "CROSS_RANK"
        num_nodes = r.int("CROSS_SIZE", minimum=1)
    elif r.has("GROUP_RANK") or r.has("TORCHELASTIC_RUN_ID"):
        launcher, local_size_var, node_var = "torchrun", "LOCAL_WORLD_SIZE", "GROUP_RANK"
        num_nodes = r.int("GROUP_WORLD_SIZE", minimum=1)
    else:
        launcher, local_size_var, node_var = "env", "LOCAL_WORLD_SIZE", "NODE_RANK"
        num_nodes = None
    return _finish(
        launcher, r,
        rank=r.int("RANK"), world_size=r.int("WORLD_SIZE", minimum=1),
        local_rank=r.int("LOCAL_RANK"), local_world_size=r.int(local_size_var, minimum=1),
        node_rank=r.int(node_var), num_nodes=num_nodes,
        master_addr=r.str("MASTER_ADDR"), master_port=r.int("MASTER_PORT", minimum=1))


def _from_mpi(r: _Reader, rank_var: str, size_var: str, local_rank_var: str,
              local_size_var: str) -> LaunchInfo:
    """Open MPI (OMPI_COMM_WORLD_*) or MPICH / Intel MPI (PMI_*, MPI_LOCAL*)."""
    local_size = r.int(local_size_var, minimum=1)
    world = r.int(size_var, minimum=1)
    return _finish(
        "mpi", r,
        rank=r.int(rank_var), world_size=world,
        local_rank=r.int(local_rank_var), local_world_size=local_size,
        node_rank=None, num_nodes=None,  # OMPI_COMM_WORLD_NODE_RANK is not a node index
        master_addr=r.str("MASTER_ADDR") or _local_master(world, local_size),
        master_port=r.int("MASTER_PORT", _mpi_default_port(r.environ), minimum=1))


def _mpi_default_port(env: Mapping[str, str]) -> int:
    """Open MPI: a port from the job family in OMPI_MCA_ess_base_jobid (the same on every rank of one
    ``mpirun``, different between two), so that two mpirun jobs on one machine avoid each other;
    otherwise (MPICH, Intel MPI) DEFAULT_MASTER_PORT."""
    jobid = env.get("OMPI_MCA_ess_base_jobid", "").strip()
    return 10000 + (int(jobid) >> 16) % 20000 if jobid.isdigit() else DEFAULT_MASTER_PORT


def _from_slurm(r: _Reader, env: Mapping[str, str]) -> LaunchInfo:
    """An ``srun`` job step: SLURM_PROCID and friends; rank 0's host from the node list."""
    world = r.int("SLURM_STEP_NUM_TASKS", minimum=1)
    if world is None:
        world = r.int("SLURM_NTASKS", 1, minimum=1)
    num_nodes = r.int("SLURM_STEP_NUM_NODES", minimum=1)
    if num_nodes is None:
        num_nodes = r.int("SLURM_NNODES", minimum=1)
    per_node_raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_size = _slurm_tasks_per_node(per_node_raw, r.int("SLURM_NODEID")) if per_node_raw else None
    if per_node_raw and local_size is None:
        r.problems.append(f"SLURM_STEP_TASKS_PER_NODE={per_node_raw!r} cannot be parsed; "
                          "expected e.g. '2(x3)'")
    master = r.str("MASTER_ADDR")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if master is None and nodelist:
        try:
            master = first_slurm_host(nodelist)
        except LaunchEnvError as err:
            r.problems.append(str(err))
    job_id = r.int("SLURM_JOB_ID", 0)
    step = env.get("SLURM_STEP_ID", "").strip()
    # A port derived from the job and step ids lets concurrent jobs on shared nodes, and steps of
    # one job running at once (``srun ... & srun ... & wait``), avoid each other.
    step_id = int(step) if step.isdigit() else 0
    port = r.int("MASTER_PORT", 10000 + ((job_id or 0) * 100 + step_id) % 20000, minimum=1)
    return _finish(
        "slurm", r,
        rank=r.int("SLURM_PROCID"), world_size=world,
        local_rank=r.int("SLURM_LOCALID"), local_world_size=local_size,
        node_rank=r.int("SLURM_NODEID"), num_nodes=num_nodes,
        master_addr=master, master_port=port)


def _local_master(world: int | None, local_size: int | None) -> str | None:
    """All ranks on this host: rank 0 is here too, so loopback is right. Otherwise it must be given."""
    if world is not None and (world == 1 or world == local_size):
        return "127.0.0.1"
    return None
