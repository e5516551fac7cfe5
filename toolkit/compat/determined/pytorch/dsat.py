"""``determined.pytorch.dsat``: what a Core API script calls to be tuned by dsat.

::

    from toolkit.compat.determined.pytorch import dsat     # was: from determined.pytorch import dsat
    ds_config = dsat.get_ds_config_from_hparams(hparams)
    for op in core_context.searcher.operations():
        ...
        with dsat.dsat_reporting_context(core_context, op):   # call on all ranks, around each batch
            loss = engine(x); engine.backward(loss); engine.step()

Inside a toolkit dsat trial (``python -m toolkit.dsat ...``), the context is
``toolkit.dsat_reporting_context`` on the script's DeepSpeed engine (found once, the only
``DeepSpeedEngine`` of the process), with ``steps_completed`` counted by this context when not
given: it measures the profiled steps, writes the trial's result and ends the trial with
``SystemExit(0)`` on every rank. Outside a trial it changes nothing, except Determined's own
handling of DeepSpeed's autotuner exit: when a ``SystemExit`` leaves the block and exactly one of
``model_info.json`` / ``autotuning_metric.json`` is in the working directory, the chief reports
its contents as validation metrics and as the operation's metric before the exit goes on.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
from typing import Any, Mapping

import toolkit
from toolkit.bounded_load import load_json
from toolkit.errors import ConfigError
from toolkit.runtime.trial_env import TRIAL_ENV

__all__ = ["get_ds_config_from_hparams", "dsat_reporting_context", "find_engine"]

_MODEL_INFO = pathlib.Path("model_info.json")
_AUTOTUNING_METRIC = pathlib.Path("autotuning_metric.json")
_state: dict[str, Any] = {"engine": None, "calls": 0}


def get_ds_config_from_hparams(
    hparams: Mapping[str, Any], base_dir: pathlib.Path | str = pathlib.Path(".")
) -> dict[str, Any]:
    """The JSON named by ``hparams["deepspeed_config"]`` (relative to ``base_dir``), with
    ``overwrite_deepspeed_args`` merged in. A new dict. Any rank.

    Raises:
        ConfigError: ``deepspeed_config`` missing (Determined asserts it), or malformed.
        FileNotFoundError: the JSON file does not exist.
    """
    if "deepspeed_config" not in hparams:
        raise ConfigError(
            "hyperparameters.deepspeed_config is missing: expected the path of the DeepSpeed "
            f"JSON, e.g. 'deepspeed_config: ds_config.json'; found keys {sorted(hparams)}"
        )
    return toolkit.get_ds_config_from_hparams(hparams, base_dir)


def find_engine() -> Any:
    """The process's one DeepSpeed engine (searched once, then cached). Any rank.

    Raises:
        ValueError: none or several engines exist (the context must then be given steps by
            toolkit's own ``toolkit.dsat_reporting_context(engine, steps_completed=...)``).
    """
    engine = _state["engine"]
    if engine is not None:
        return engine
    from deepspeed.runtime.engine import DeepSpeedEngine  # heavy; only inside a trial

    engines = [obj for obj in gc.get_objects() if isinstance(obj, DeepSpeedEngine)]
    if len(engines) != 1:
        raise ValueError(
            f"dsat_reporting_context found {len(engines)} DeepSpeed engines in this process, expected "
            "one (from deepspeed.initialize, created before the first step); with several, use "
            "toolkit.dsat_reporting_context(engine, steps_completed=step)"
        )
    _state["engine"] = engines[0]
    return engines[0]


def _report_autotuning_file(core_context: Any, op: Any, steps_completed: int | None) -> None:
    existing = [p for p in (_MODEL_INFO, _AUTOTUNING_METRIC) if p.exists()]
    if len(existing) != 1:
        return
    steps_completed = op.length if steps_completed is None else steps_completed
    if core_context.distributed.rank == 0:
        results = load_json(existing[0], what="DeepSpeed autotuner metrics file")
        if existing[0] == _MODEL_INFO:
            import torch

            if torch.cuda.is_available():
                results["gpu_mem"] = torch.cuda.get_device_properties(0).total_memory
        core_context.train.report_validation_metrics(steps_completed=steps_completed, metrics=results)
        op.report_completed(results)
    if next(core_context.searcher.operations(), None) is not None:
        raise RuntimeError("Unexpected additional operations found!")


class _ReportingContext:
    """What :func:`dsat_reporting_context` returns: a class, not a generator, since it wraps every
    batch (entering and leaving cost a few microseconds less)."""

    __slots__ = ("_core_context", "_op", "_steps_completed", "_inner")

    def __init__(self, core_context: Any, op: Any, steps_completed: int | None) -> None:
        self._core_context, self._op, self._steps_completed = core_context, op, steps_completed
        self._inner: Any = None

    def __enter__(self) -> None:
        counted = _state["calls"]
        _state["calls"] += 1
        if os.environ.get(TRIAL_ENV):
            steps = counted if self._steps_completed is None else int(self._steps_completed)
            self._inner = toolkit.dsat_reporting_context(find_engine(), steps_completed=steps)
            self._inner.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        inner, self._inner = self._inner, None
        try:
            if inner is not None and inner.__exit__(exc_type, exc, tb):
                return True
        except SystemExit:
            _report_autotuning_file(self._core_context, self._op, self._steps_completed)
            raise
        if exc_type is not None and issubclass(exc_type, SystemExit):
            _report_autotuning_file(self._core_context, self._op, self._steps_completed)
        return False


def dsat_reporting_context(
    core_context: Any, op: Any, steps_completed: int | None = None
) -> contextlib.AbstractContextManager[None]:
    """Wrap one training batch; inside a dsat trial, measure it and end the trial. Call on all ranks.

    Args:
        core_context: from ``det.core.init()``.
        op: the searcher operation the batch belongs to.
        steps_completed: batches finished before this one; None counts the calls of this context.

    Raises:
        SystemExit: inside a dsat trial after its last profiled step (status 0, every rank).
    """
    return _ReportingContext(core_context, op, steps_completed)
