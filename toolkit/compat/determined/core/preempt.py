"""``core_context.preempt``: a signal (SIGTERM, SIGINT, SIGUSR1) becomes ``should_preempt() == True``.

Made by ``core.init`` on ``toolkit.watch_preemption``. What each ``PreemptMode`` means here:
docs/design-determined.md#preemption. Example::

    with det.core.init(distributed=distributed) as core_context:     # installs the handlers
        if core_context.preempt.should_preempt():                    # call on all ranks
            return                                                   # after saving a checkpoint
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from types import TracebackType
from typing import Any

import toolkit
from toolkit.compat.determined.core.distributed import DistributedContext

__all__ = ["PreemptContext", "PreemptMode"]

logger = logging.getLogger(__name__)


class PreemptMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHIEF_ONLY"
    WorkersAskMaster = "WORKERS_ASK_MASTER"


class PreemptContext:
    """Determined's PreemptContext on toolkit's signal watcher. Started by ``core.init``'s ``with``."""

    def __init__(
        self, dist: DistributedContext, preempt_mode: PreemptMode = PreemptMode.WorkersAskChief
    ) -> None:
        self._dist = dist
        self._mode = PreemptMode(preempt_mode)
        self._watcher: Any = None
        self._started = False
        self._acknowledged = False

    def _toolkit_context(self) -> Any:
        ctx = self._dist.toolkit_context or toolkit.init_distributed()
        if self._mode is not PreemptMode.WorkersAskChief and ctx.world_size > 1:
            # Each rank answers alone: a one-rank view of the same process, so no collective.
            ctx = dataclasses.replace(
                ctx, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1
            )
        return ctx

    def start(self) -> "PreemptContext":
        """Install the signal handlers. Call on all ranks (``with core.init()`` does it)."""
        if self._started:
            raise RuntimeError("PreemptContext.start() was called twice")
        self._started = True
        self._watcher = toolkit.watch_preemption(self._toolkit_context())
        return self

    def should_preempt(self, auto_ack: bool = True) -> bool:
        """True once a stop was asked for: all ranks in step (WorkersAskChief), the chief (ChiefOnly) or any
        rank (WorkersAskMaster). RuntimeError before ``start()``, or on a worker under ChiefOnly."""
        if not self._started or self._watcher is None:
            raise RuntimeError(
                "you cannot call PreemptContext.should_preempt() before PreemptContext.start()"
            )
        if self._mode is PreemptMode.ChiefOnly and self._dist.rank != 0:
            raise RuntimeError(
                "PreemptContext was configured with preempt_mode=ChiefOnly but .should_preempt() "
                f"was called from non-chief worker of rank={self._dist.rank}"
            )
        answer = bool(self._watcher.should_preempt())
        if answer and auto_ack:
            self.acknowledge_preemption_signal()
        return answer

    def stop_received(self) -> bool:
        """Whether a stop signal reached this process (no agreement, no collective). Any rank."""
        return self._watcher is not None and self._watcher.received_signal is not None

    def acknowledge_preemption_signal(self) -> None:
        """Note that the trial stops to be resumed (rerun the same command to continue). Any rank."""
        if not self._acknowledged:
            self._acknowledged = True
            logger.info(
                "preemption acknowledged: the run stops here; run it again to continue from its "
                "latest checkpoint"
            )

    def close(self, *, after_error: bool = False) -> None:
        """Restore the signal handlers. All ranks (``with core.init()`` does it). ``after_error=True`` (the
        block raised) skips waiting for a check point in flight, which the other ranks may never reach."""
        if self._watcher is not None:
            watcher, self._watcher = self._watcher, None
            watcher.__exit__(BaseException if after_error else None, None, None)

    def __enter__(self) -> "PreemptContext":
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(after_error=exc_type is not None)
