"""The distributed context: where this process sits, and the few collectives toolkit needs.

:func:`init_distributed` reads whichever launcher started the process (plain ``python``, torchrun,
the deepspeed launcher, mpirun, an ``srun`` step): docs/start.md (Launch it).

Example (``torchrun --nproc_per_node 2 train.py``)::

    ctx = toolkit.init_distributed()            # all ranks
    if ctx.is_chief:                            # rank 0 only
        logger.info("world size %d", ctx.world_size)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from toolkit.errors import ConfigError, LaunchEnvError
from toolkit.runtime.collectives import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    BoundedGroup,
    new_bounded_group,
    resolve_collective_timeout,
)
from toolkit.runtime.ds_shm import share_with_deepspeed
from toolkit.runtime.launch_env import LaunchInfo, detect_launch
from toolkit.runtime.launcher_watch import remember_launchers
from toolkit.runtime.op_builds import install_build_guards
from toolkit.runtime.rendezvous_wait import mark_rendezvous, wait_for_rendezvous_port
from toolkit.runtime.trial_oom import install_oom_excepthook
from toolkit.runtime.worker_signals import protect_dataloader_workers

__all__ = ["DistributedContext", "init_distributed", "get_context", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)
_BACKENDS = ("nccl", "gloo", "mpi", "ucc")
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# The one context of this process; init_distributed is idempotent through it.
_context: "DistributedContext | None" = None
_init_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job, and toolkit's collectives; made by :func:`init_distributed`.

    ``device``: ``cuda:<local_rank>`` under nccl, else ``cpu``; ``launcher``: whose variables were read.
    ``group``: a CPU group with the long ``init_distributed(timeout=...)`` (under nccl a gloo group of
    its own, so control messages need no GPU tensors and never queue behind training traffic).
    ``collectives``: the :class:`~toolkit.runtime.collectives.BoundedGroup` the methods below run on,
    with the short ``collective_timeout``: a collective some rank never calls raises
    ``CollectiveTimeoutError``, naming the call and the missing ranks. At world size 1 they are no-ops."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    device: torch.device
    backend: str
    launcher: str
    group: Any = dataclasses.field(default=None, repr=False, compare=False)
    collectives: BoundedGroup = dataclasses.field(
        default_factory=lambda: BoundedGroup(rank=0, world_size=1, timeout_s=DEFAULT_COLLECTIVE_TIMEOUT_S),
        repr=False, compare=False)

    @property
    def collective_timeout(self) -> float:
        """Seconds a toolkit collective waits for every rank before raising. Any rank."""
        return self.collectives.timeout_s

    @property
    def is_chief(self) -> bool:
        """True on global rank 0, the rank that writes shared files and logs."""
        return self.rank == 0

    @property
    def is_local_chief(self) -> bool:
        """True on local rank 0, the rank that does per-node work (caches, node-local files)."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait until every rank has arrived. Call on all ranks."""
        if self.distributed:
            self.collectives.run("ctx.barrier", lambda group: dist.barrier(group=group))

    def broadcast_object(self, obj: Any = None, *, src: int = 0) -> Any:
        """Send picklable ``obj`` from rank ``src`` to every rank and return it. Call on all ranks."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == src else None]
        self.collectives.run("ctx.broadcast_object",
                             lambda group: dist.broadcast_object_list(box, src=src, group=group))
        return box[0]

    def gather_object(self, obj: Any, *, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` as a list by rank on rank ``dst``, None elsewhere. Call on all ranks."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        self.collectives.run("ctx.gather_object",
                             lambda group: dist.gather_object(obj, out, dst=dst, group=group))
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Collect one picklable object from every rank on every rank. Call on all ranks."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self.collectives.run("ctx.all_gather_object",
                             lambda group: dist.all_gather_object(out, obj, group=group))
        return out

    def all_reduce(self, values: Sequence[float], *, op: str = "sum") -> list[float]:
        """Reduce a short vector of numbers in float64 (``op``: sum, mean, max or min); the same result on
        every rank. Call on all ranks."""
        if op not in ("sum", "mean", "max", "min"):
            raise ConfigError(f"op={op!r}: expected one of 'sum', 'mean', 'max', 'min'")
        values = [float(v) for v in values]
        if not self.distributed or not values:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        reduce_op = _REDUCE_OPS["sum" if op == "mean" else op]
        self.collectives.run("ctx.all_reduce",
                             lambda group: dist.all_reduce(tensor, op=reduce_op, group=group))
        if op == "mean":
            tensor /= self.world_size
        return tensor.tolist()

    @contextlib.contextmanager
    def chief_first(self) -> Iterator[None]:
        """Run the body on the chief first, then on the other ranks. Call on all ranks.

        For work whose result the others reuse (a download, a cache). Its two barriers wait up to
        ``init_distributed(timeout=...)``, not the short collective timeout: the chief's work may be long."""
        if not self.is_chief:
            self._long_barrier()
        try:
            yield
        finally:
            if self.is_chief:
                self._long_barrier()

    def _long_barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


_EXIT_GRACE_S = 0.1


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    # A gloo worker thread drops its reference to the last collective's work object after the
    # caller has returned; when that is the last reference, it frees the work's tensors, which
    # needs the GIL. If the interpreter is finalising by then, Python ends that thread, and a
    # thread ended inside C++ code aborts the process ("terminate called without an active
    # exception", exit status -6, about 1 run in 20 of a script whose last act is a
    # collective). Releasing the GIL for a moment lets those threads finish first.
    time.sleep(_EXIT_GRACE_S)


def get_context() -> DistributedContext:
    """The context made by :func:`init_distributed`; RuntimeError before it. Any rank."""
    if _context is None:
        raise RuntimeError("toolkit.init_distributed() has not been called in this process; call it "
                           "first, on every rank")
    return _context


def _check_arguments(backend: Any, timeout: Any, collective_timeout: Any) -> float:
    """Every problem of init_distributed's arguments, raised once; returns the collective timeout."""
    problems: list[str] = []
    if backend is not None and (not isinstance(backend, str) or backend not in _BACKENDS):
        problems.append(f"backend={backend!r}: expected one of {', '.join(_BACKENDS)} or None "
                        "(None picks nccl with CUDA, gloo otherwise)")
    elif backend == "nccl" and not torch.cuda.is_available():
        problems.append("backend='nccl' needs CUDA, and torch.cuda.is_available() is False here; "
                        "use backend='gloo' or leave it None")
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        problems.append(f"timeout={timeout!r}: expected a positive datetime.timedelta, for example "
                        "timedelta(minutes=30)")
    seconds = DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        seconds = resolve_collective_timeout(collective_timeout)
    except ConfigError as err:
        problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)
    return seconds


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def _export_env(info: LaunchInfo) -> None:
    """Set the torchrun variables (where unset) to the detected launch: DeepSpeed reads them from
    ``os.environ`` in several places, and mpirun or srun do not set them."""
    values = {
        "RANK": info.rank, "WORLD_SIZE": info.world_size, "LOCAL_RANK": info.local_rank,
        "LOCAL_WORLD_SIZE": info.local_world_size,
        "MASTER_ADDR": info.master_addr or "127.0.0.1",
        "MASTER_PORT": info.master_port or 29500,
    }
    for key, value in values.items():
        os.environ.setdefault(key, str(value))


def init_distributed(*, backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT,
                     collective_timeout: float | timedelta | None = None) -> DistributedContext:
    """Initialise torch.distributed from the launcher's variables, once. Call on all ranks.

    Without launcher variables: a one-rank group on an in-memory store (no port). Installs the build
    guards, hands the group to ``deepspeed.comm`` and makes DataLoader workers started afterwards
    ignore the stop signals. A second call returns the same context; a group made before is adopted
    once checked. Details: docs/start.md (Launch it).

    Args:
        backend: ``"nccl"``, ``"gloo"``, ``"mpi"`` or ``"ucc"``; None: nccl with CUDA, else gloo.
        timeout: the rendezvous's and DeepSpeed's collectives'.
        collective_timeout: toolkit's own collectives', in seconds or a timedelta; None reads
            ``TOOLKIT_COLLECTIVE_TIMEOUT_S``, else 60 s.

    Raises ConfigError (bad arguments), LaunchEnvError (a malformed or inconsistent launcher variable),
    RunConflictError (another run's process here still serves MASTER_PORT after
    ``TOOLKIT_WAIT_FOR_OTHER_RUN_S``; exit status 2), ValueError (another backend than before)."""
    global _context
    collective_s = _check_arguments(backend, timeout, collective_timeout)
    install_build_guards()   # before share_with_deepspeed loads DeepSpeed's first op
    with _init_lock:
        if _context is not None:
            if backend is not None and backend != _context.backend:
                raise ValueError(f"init_distributed(backend={backend!r}) but this process was already "
                                 f"initialised with backend {_context.backend!r}")
            return _context
        info = detect_launch()
        _export_env(info)
        if info.world_size > 1 and not dist.is_initialized():  # the same command again, too soon
            wait_for_rendezvous_port(info.master_addr, info.master_port)
        chosen = _init_process_group(info, _pick_backend(backend), timeout)
        if info.rank == 0 and info.world_size > 1:  # the rendezvous is complete: a later run may wait
            mark_rendezvous(info.master_port)
        share_with_deepspeed(chosen, timeout, info)
        _context = _make_context(info, chosen, timeout, collective_s)
        _install_process_hooks()
        from toolkit.runtime.rank_logging import (
            configure_rank_logging,  # local: log imports nothing heavy, no cycle
        )
        configure_rank_logging(_context.rank)
        logger.info("initialised %s: world size %d, %d node(s), backend %s, launcher %s",
                    _context.device, info.world_size, info.num_nodes, chosen, info.launcher)
        return _context


def _install_process_hooks() -> None:
    """What every rank of a toolkit job needs once (each idempotent): DataLoader workers that a stop
    signal does not kill, its launchers remembered (a launcher that exits is a stop), and inside a dsat
    trial the hook that reports an OOM raised before the first step as the trial's "oom"."""
    protect_dataloader_workers()
    remember_launchers()
    install_oom_excepthook()


def _init_process_group(info: LaunchInfo, chosen: str, timeout: timedelta) -> str:
    """Make the default process group (or adopt the existing one); returns the backend in use."""
    if dist.is_initialized():
        if dist.get_rank() != info.rank or dist.get_world_size() != info.world_size:
            raise LaunchEnvError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the {info.launcher} variables say rank {info.rank} of "
                f"{info.world_size}; initialise once, through toolkit.init_distributed()")
        return str(dist.get_backend())
    if chosen == "nccl":
        count = torch.cuda.device_count()
        if info.local_rank >= count:
            raise LaunchEnvError(
                f"LOCAL_RANK={info.local_rank} but only {count} CUDA device(s) are visible; "
                "start at most one process per GPU")
        torch.cuda.set_device(info.local_rank)
    if info.world_size == 1:
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif info.uses_env_rendezvous:
        dist.init_process_group(chosen, init_method="env://", rank=info.rank,
                                world_size=info.world_size, timeout=timeout)
    else:
        dist.init_process_group(chosen, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                rank=info.rank, world_size=info.world_size, timeout=timeout)
    # Join the backend's threads before the interpreter tears them down: without this a
    # gloo rank can abort at exit ("terminate called without an active exception").
    atexit.register(_destroy_at_exit)
    return chosen


def _make_context(info: LaunchInfo, chosen: str, timeout: timedelta,
                  collective_s: float) -> DistributedContext:
    """The context, with its CPU groups. Call on all ranks: new_group is a collective."""
    # Control-plane collectives on CPU: under nccl a separate gloo group, created on all ranks.
    group = dist.new_group(backend="gloo", timeout=timeout) if chosen == "nccl" else None
    bounded = new_bounded_group(rank=info.rank, world_size=info.world_size, timeout_s=collective_s,
                                prefix="toolkit/ctx")
    device = torch.device("cuda", info.local_rank) if chosen == "nccl" else torch.device("cpu")
    return DistributedContext(
        rank=info.rank, local_rank=info.local_rank, world_size=info.world_size,
        local_world_size=info.local_world_size, node_rank=info.node_rank,
        num_nodes=info.num_nodes, device=device, backend=chosen, launcher=info.launcher,
        group=group, collectives=bounded)
