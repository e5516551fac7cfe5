"""``det.core.init()`` and the ``Context`` it returns: the Core API's entry point, on toolkit.

Example (Determined's tutorials, imports swapped)::

    # python -m toolkit.run deepspeed.yaml .
    from toolkit.compat import determined as det
    info = det.get_cluster_info()
    distributed = det.core.DistributedContext.from_torch_distributed()    # call on all ranks
    with det.core.init(distributed=distributed) as core_context:          # call on all ranks
        main(core_context, info.latest_checkpoint, info.trial.hparams)
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping

from toolkit.compat.determined import storage
from toolkit.compat.determined.core.checkpoint import CheckpointContext
from toolkit.compat.determined.core.distributed import DistributedContext, DummyDistributedContext
from toolkit.compat.determined.core.preempt import PreemptContext, PreemptMode
from toolkit.compat.determined.core.searcher import SearcherContext
from toolkit.compat.determined.core.train import EarlyExitReason, TensorboardMode, TrainContext
from toolkit.compat.determined.info import ClusterInfo, get_cluster_info
from toolkit.runtime.op_builds import install_build_guards

__all__ = ["Context", "init", "ProfilerContext", "ExperimentalCoreContext", "InvalidHP"]

logger = logging.getLogger(__name__)


class InvalidHP(Exception):
    """Raise inside ``with det.core.init()`` to end a trial whose hyperparameters cannot work:
    the context logs it and the process exits with status 0, as in Determined."""

    def __init__(self, msg: str = "InvalidHP raised") -> None:
        if not isinstance(msg, str):
            raise TypeError(f"InvalidHP msg must be a str, not {type(msg).__name__}")
        self.msg = msg
        super().__init__(msg)


class ProfilerContext:
    """Determined's system-metrics profiler reports to its master's web UI: not available."""

    def on(self, sampling_interval: int = 1, samples_per_report: int = 10) -> None:
        raise NotImplementedError(
            "profiler.on: Determined's profiler sends system metrics to its master's web "
            "UI, which does not exist here; use torch.profiler, or DeepSpeed's "
            "flops_profiler / wall_clock_breakdown config sections"
        )

    def off(self) -> None:
        """Nothing to stop. Any rank."""


class ExperimentalCoreContext:
    """Model-registry links of Determined's master: no-ops, as in Determined off-cluster."""

    def report_task_using_checkpoint(self, checkpoint: Any) -> None:
        logger.debug("report_task_using_checkpoint: no model registry here")

    def report_task_using_model_version(self, model_version: Any) -> None:
        logger.debug("report_task_using_model_version: no model registry here")


class Context:
    """What ``core.init()`` returns: ``checkpoint``, ``distributed``, ``preempt``, ``train``,
    ``searcher``, ``profiler``, ``experimental``, ``info``. Use it as a context manager."""

    def __init__(
        self,
        *,
        checkpoint: CheckpointContext,
        distributed: DistributedContext,
        preempt: PreemptContext,
        train: TrainContext,
        searcher: SearcherContext,
        info: ClusterInfo,
    ) -> None:
        self.checkpoint, self.distributed, self.preempt = checkpoint, distributed, preempt
        self.train, self.searcher, self.info = train, searcher, info
        self.profiler, self.experimental = ProfilerContext(), ExperimentalCoreContext()

    def start(self) -> None:
        """Install the preemption signal handlers. Call on all ranks (``with`` does it)."""
        self.preempt.start()

    def __enter__(self) -> "Context":
        self.start()
        return self

    def close(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> None:
        """Restore the signal handlers, close the metrics files. All ranks (``with`` does it)."""
        try:
            self.preempt.close(after_error=exc_type is not None)
        finally:
            self.train.close()
            self.distributed.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        self.close(exc_type, exc_val, exc_tb)
        if isinstance(exc_val, InvalidHP):
            self.train.report_early_exit(EarlyExitReason.INVALID_HP)
            logger.info("InvalidHP detected during Trial init, converting InvalidHP to exit(0)")
            sys.exit(0)

    def alert(
        self, title: str | None = None, description: str | None = None, level: str | None = "info"
    ) -> None:
        """Determined posts alerts to its master's webhooks: not available."""
        raise NotImplementedError(
            "core_context.alert: alerts go to a Determined master's webhooks, which do not "
            "exist here; log with logging.getLogger(__name__).warning(...) instead"
        )


def _launched_world_size() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    return int(value) if value.isdigit() else 1


def init(
    *,
    distributed: DistributedContext | None = None,
    checkpoint_storage: str | Mapping[str, Any] | None = None,
    preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
    tensorboard_mode: TensorboardMode = TensorboardMode.AUTO,
) -> Context:
    """The Core API context of this trial. Call on all ranks, as ``with det.core.init(...) as ctx``.

    Args:
        distributed: from ``DistributedContext.from_torch_distributed()`` / ``from_deepspeed()``; None:
            rank 0 of 1 (a ValueError under a launcher of several processes, as Determined's).
        checkpoint_storage: as the YAML's; None: the YAML's, else ``<output_dir>/checkpoints``
            (ConfigError when bad).
        preempt_mode, tensorboard_mode: as Determined's (MANUAL writes no TensorBoard metrics).
    """
    install_build_guards()   # a Determined script may never call toolkit.init_distributed
    info = get_cluster_info()
    if distributed is None:
        if _launched_world_size() > 1:
            raise ValueError(
                "you must provide a valid DistributedContext for a multi-slot task: "
                "det.core.init(distributed=det.core.DistributedContext.from_torch_distributed())"
            )
        distributed = DummyDistributedContext()
    if not isinstance(distributed, DistributedContext):
        raise TypeError(f"distributed={distributed!r}: expected a det.core.DistributedContext")
    config = info.trial._config
    root = (
        info.checkpoint_root
        if checkpoint_storage is None
        else storage.storage_root(checkpoint_storage, output_dir=info.output_dir, base_dir=Path.cwd())
    )
    yaml_storage = config.get("checkpoint_storage")
    save_latest = yaml_storage.get("save_trial_latest") if isinstance(yaml_storage, Mapping) else None
    save_best = yaml_storage.get("save_trial_best") if isinstance(yaml_storage, Mapping) else None
    raw_searcher = config.get("searcher")
    searcher: Mapping[str, Any] = raw_searcher if isinstance(raw_searcher, Mapping) else {}
    resume_step = info.trial._steps_completed if info.latest_checkpoint else None
    train = TrainContext(info.output_dir, tensorboard_mode=tensorboard_mode, resume_step=resume_step)
    preempt = PreemptContext(distributed, preempt_mode)
    return Context(
        checkpoint=CheckpointContext(
            distributed, root=root, output_dir=info.output_dir, save_trial_latest=save_latest,
            before_store=train.flush, save_trial_best=save_best, metric=searcher.get("metric"),
            smaller_is_better=searcher.get("smaller_is_better", True) is not False,
        ),
        distributed=distributed,
        preempt=preempt,
        train=train,
        searcher=SearcherContext(distributed, config, info.output_dir, report_progress=train.record_progress,
                                 stopped=preempt.stop_received),
        info=info,
    )
