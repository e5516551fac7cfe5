"""``det.core``: Determined's Core API (``init``, the contexts, their enums) on toolkit's helpers.

See :mod:`toolkit.compat.determined` for what runs where.
"""

from toolkit.compat.determined.core.checkpoint import CheckpointContext, DownloadMode
from toolkit.compat.determined.core.context import (
    Context,
    ExperimentalCoreContext,
    InvalidHP,
    ProfilerContext,
    init,
)
from toolkit.compat.determined.core.distributed import DistributedContext, DummyDistributedContext
from toolkit.compat.determined.core.preempt import PreemptContext, PreemptMode
from toolkit.compat.determined.core.searcher import SearcherContext, SearcherMode, SearcherOperation, Unit
from toolkit.compat.determined.core.train import EarlyExitReason, TensorboardMode, TrainContext

__all__ = [
    "CheckpointContext",
    "Context",
    "DistributedContext",
    "DownloadMode",
    "DummyDistributedContext",
    "EarlyExitReason",
    "ExperimentalCoreContext",
    "InvalidHP",
    "PreemptContext",
    "PreemptMode",
    "ProfilerContext",
    "SearcherContext",
    "SearcherMode",
    "SearcherOperation",
    "TensorboardMode",
    "TrainContext",
    "Unit",
    "init",
]
