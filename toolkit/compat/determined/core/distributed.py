"""``det.core.DistributedContext``: Determined's rank bookkeeping and object collectives, on toolkit's.

The collectives run on ``toolkit.init_distributed()``'s process group, not Determined's ZMQ sockets
(docs/design-determined.md#distributed). Example::

    distributed = det.core.DistributedContext.from_torch_distributed()      # call on all ranks
    with det.core.init(distributed=distributed) as core_context:
        total = sum(core_context.distributed.allgather(local_value))       # call on all ranks
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

import toolkit
from toolkit.errors import LaunchEnvError

__all__ = ["DistributedContext", "DummyDistributedContext"]

_RANK_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")


def _env_ints(names: dict[str, str], launcher: str) -> dict[str, int]:
    missing = [var for var in names.values() if var not in os.environ]
    if missing:
        raise LaunchEnvError(
            f"{', '.join(missing)} not set: DistributedContext.from_{launcher}() reads the "
            f"{launcher} launcher's variables; start the script with python -m toolkit.run "
            "CONFIG MODEL_DIR (or that launcher)"
        )
    out = {}
    for field, var in names.items():
        try:
            out[field] = int(os.environ[var])
        except ValueError:
            raise LaunchEnvError(f"{var}={os.environ[var]!r} is not an integer") from None
    return out


class DistributedContext:
    """Where this process sits (rank, size, local and cross ranks) and Determined's collectives. All ranks.
    Keyword-only, as Determined's: all six ranks or none (rank 0 of 1); ``chief_ip``, ``pub_port`` and
    ``pull_port`` give the rendezvous without ``MASTER_ADDR``; ``port_offset``, ``force_tcp`` are ignored."""

    def __init__(
        self,
        *,
        rank: int | None = None,
        size: int | None = None,
        local_rank: int | None = None,
        local_size: int | None = None,
        cross_rank: int | None = None,
        cross_size: int | None = None,
        chief_ip: str | None = None,
        pub_port: int = 12360,
        pull_port: int = 12376,
        port_offset: int = 0,
        force_tcp: bool = False,
    ) -> None:
        given = (rank, size, local_rank, local_size, cross_rank, cross_size)
        values = dict(zip(_RANK_FIELDS, given, strict=True))
        if all(v is None for v in values.values()):
            values = dict(zip(_RANK_FIELDS, (0, 1, 0, 1, 0, 1), strict=True))
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise ValueError(
                f"DistributedContext: {', '.join(missing)} not given; give all of rank, size, "
                "local_rank, local_size, cross_rank, cross_size (or none, for rank 0 of 1)"
            )
        ints = {k: int(v) for k, v in values.items() if v is not None}
        self.rank, self.size = ints["rank"], ints["size"]
        self.local_rank, self.local_size = ints["local_rank"], ints["local_size"]
        self.cross_rank, self.cross_size = ints["cross_rank"], ints["cross_size"]
        if not 0 <= self.rank < self.size or not 0 <= self.local_rank < self.local_size:
            raise ValueError(
                f"DistributedContext: rank {self.rank} of {self.size}, local rank {self.local_rank} "
                f"of {self.local_size}: expected 0 <= rank < size"
            )
        if self.local_size != self.size and chief_ip is None:
            raise ValueError("DistributedContext: chief_ip is required across machines (local_size != size)")
        self._chief_ip = chief_ip if self.local_size != self.size else "127.0.0.1"
        self._is_chief = self.rank == 0
        self._is_local_chief = self.local_rank == 0
        self._port = pub_port
        del pull_port, port_offset, force_tcp
        self._ctx: Any = None
        self._local_group: Any = None
        if self.size > 1:
            self._connect()

    def _connect(self) -> None:
        """Join (or adopt) toolkit's process group; check it agrees with these ranks."""
        for var, value in (
            ("RANK", self.rank),
            ("WORLD_SIZE", self.size),
            ("LOCAL_RANK", self.local_rank),
            ("LOCAL_WORLD_SIZE", self.local_size),
            ("MASTER_ADDR", self._chief_ip),
            ("MASTER_PORT", self._port),
        ):
            os.environ.setdefault(var, str(value))
        self._ctx = toolkit.init_distributed()
        if (self._ctx.rank, self._ctx.world_size) != (self.rank, self.size):
            raise ValueError(
                f"DistributedContext(rank={self.rank}, size={self.size}) but the launcher says rank "
                f"{self._ctx.rank} of {self._ctx.world_size}; build it from_torch_distributed() or "
                "from_deepspeed()"
            )
        if self.cross_size > 1:
            self._local_group, _ = dist.new_subgroups(group_size=self.local_size, backend="gloo")

    @property
    def toolkit_context(self) -> Any:
        """The ``toolkit.DistributedContext`` behind this one (None at size 1 until toolkit initialises)."""
        return self._ctx

    @classmethod
    def from_torch_distributed(cls, chief_ip: str | None = None) -> "DistributedContext":
        """From torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_*). All ranks."""
        return cls._from_env(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                              "GROUP_WORLD_SIZE"), "torch_distributed", chief_ip)

    @classmethod
    def from_deepspeed(cls, chief_ip: str | None = None) -> "DistributedContext":
        """From DeepSpeed's launcher variables (RANK, LOCAL_SIZE, CROSS_*, ...). All ranks."""
        return cls._from_env(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"),
                             "deepspeed", chief_ip)

    @classmethod
    def _from_env(cls, variables: tuple[str, ...], launcher: str,
                  chief_ip: str | None) -> "DistributedContext":
        """From a launcher's six variables: rank, size, local rank and size, cross rank and size."""
        fields = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")
        v = _env_ints(dict(zip(fields, variables, strict=True)), launcher)
        return cls(rank=v["rank"], size=v["size"], local_rank=v["local_rank"], local_size=v["local_size"],
                   cross_rank=v["cross_rank"], cross_size=v["cross_size"],
                   chief_ip=chief_ip or os.environ.get("DET_CHIEF_IP") or os.environ.get("MASTER_ADDR"))

    @classmethod
    def from_horovod(cls, hvd: Any, chief_ip: str | None = None) -> "DistributedContext":
        """Horovod is not available here (deprecated in Determined 0.38)."""
        raise NotImplementedError(
            "DistributedContext.from_horovod: Horovod is not supported; launch with "
            "torchrun or deepspeed and use from_torch_distributed() / from_deepspeed()"
        )

    def get_rank(self) -> int:
        return self.rank

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_size(self) -> int:
        return self.size

    def get_num_agents(self) -> int:
        return self.cross_size

    def gather(self, stuff: Any) -> list[Any] | None:
        """Every rank's object, in rank order, on the chief; None elsewhere. Call on all ranks."""
        return [stuff] if self.size < 2 else self._ctx.gather_object(stuff)

    def allgather(self, stuff: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank. Call on all ranks."""
        return [stuff] if self.size < 2 else self._ctx.all_gather_object(stuff)

    def broadcast(self, stuff: Any) -> Any:
        """The chief's object on every rank (the others' argument is ignored). Call on all ranks."""
        return stuff if self.size < 2 else self._ctx.broadcast_object(stuff)

    def gather_local(self, stuff: Any) -> list[Any] | None:
        """Every local rank's object on local rank 0; None elsewhere. Call on all ranks of the machine."""
        if self._local_group is None:
            return self.gather(stuff)
        out: list[Any] | None = [None] * self.local_size if self._is_local_chief else None
        dist.gather_object(stuff, out, dst=self.rank - self.local_rank, group=self._local_group)
        return out

    def allgather_local(self, stuff: Any) -> list[Any]:
        """Every local rank's object on every local rank. Call on all ranks of the machine."""
        if self._local_group is None:
            return self.allgather(stuff)
        out: list[Any] = [None] * self.local_size
        dist.all_gather_object(out, stuff, group=self._local_group)
        return out

    def broadcast_local(self, stuff: Any = None) -> Any:
        """Local rank 0's object on every local rank. Call on all ranks of the machine."""
        if self._local_group is None:
            return self.broadcast(stuff)
        box = [stuff]
        dist.broadcast_object_list(box, src=self.rank - self.local_rank, group=self._local_group)
        return box[0]

    def close(self) -> None:
        """Nothing to close: the process group belongs to toolkit (destroyed at exit). Any rank."""


class DummyDistributedContext(DistributedContext):
    """Rank 0 of 1 (what ``core.init()`` uses without a ``distributed`` argument)."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
