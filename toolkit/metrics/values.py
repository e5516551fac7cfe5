"""Metric values as the ranks pass them, checked and turned into floats before any collective, for
:mod:`toolkit.metrics.writer`. Any rank; a bad value raises on the rank that has it."""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from toolkit._checks import is_int

__all__ = ["SAMPLES_PER_SECOND", "check_batch_metrics", "check_samples", "check_steps", "metric_values"]

#: Name of the throughput metric written when ``samples=`` is passed to a training report.
SAMPLES_PER_SECOND = "samples_per_second"


def check_steps(steps_completed: Any) -> int:
    """``steps_completed`` as an int, or TypeError / ValueError naming what was given."""
    if not is_int(steps_completed):
        raise TypeError(f"steps_completed={steps_completed!r} ({type(steps_completed).__name__}): "
                        "expected an int, the number of optimizer steps done so far "
                        "(convert a tensor with int(t.item()))")
    if steps_completed < 0:
        raise ValueError(f"steps_completed={steps_completed}: expected an integer >= 0, the number "
                         "of optimizer steps done so far")
    return int(steps_completed)


def _scalar(where: str, key: Any, value: Any) -> float | torch.Tensor:
    """One metric value as a float, or a one-element tensor (converted later, in one go)."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"{where}: metric name {key!r} ({type(key).__name__}): expected a non-empty str")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"{where}: metric {key!r} is a tensor of shape {tuple(value.shape)} and "
                             f"dtype {value.dtype}: expected a real scalar (a 0-d or one-element "
                             "tensor); reduce it first, e.g. with .mean()")
        return value
    if isinstance(value, np.ndarray):
        if value.size != 1 or not np.isrealobj(value) or value.dtype.kind not in "biuf":
            raise ValueError(f"{where}: metric {key!r} is a numpy array of shape {value.shape} and "
                             f"dtype {value.dtype}: expected a real scalar; reduce it first")
        return float(value.reshape(()))
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    raise TypeError(f"{where}: metric {key!r} is {type(value).__name__} ({value!r:.60}): expected a "
                    "real number (int, float, numpy scalar, or a 0-d / one-element tensor); "
                    "report a number on every rank, not None, a string or a list")


def metric_values(where: str, metrics: Any) -> tuple[tuple[str, ...], list[float]]:
    """Sorted names and their values as floats. Pure; raises before any collective."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where}: metrics is {type(metrics).__name__}: expected a dict of "
                        "name -> number, e.g. {'loss': loss}")
    keys = tuple(sorted(metrics, key=str))
    raw = [_scalar(where, k, metrics[k]) for k in keys]
    tensors = [(i, v) for i, v in enumerate(raw) if isinstance(v, torch.Tensor)]
    if len(tensors) == 1:  # the usual case, a loss: one copy, without building a new tensor
        i, t = tensors[0]
        raw[i] = float(t.detach().reshape(()).item())
    elif tensors:
        # One device-to-host copy per device rather than a synchronising .item() per tensor.
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, t in tensors:
            by_device.setdefault(t.device, []).append((i, t))
        for group in by_device.values():
            flat = torch.cat([t.detach().reshape(1) for _, t in group]).tolist()
            for (i, _), v in zip(group, flat, strict=True):
                raw[i] = float(v)
    return keys, raw  # type: ignore[return-value]


def check_batch_metrics(where: str, batch_metrics: Any,
                        steps: int) -> list[tuple[tuple[str, ...], list[float]]]:
    """Each per-batch dict's names and values (see :func:`metric_values`); at most ``steps`` of them."""
    if batch_metrics is None:
        return []
    if not isinstance(batch_metrics, Sequence) or isinstance(batch_metrics, (str, bytes)):
        raise TypeError(f"{where}: batch_metrics is {type(batch_metrics).__name__}: expected "
                        "a list of dicts, one per batch since the previous report")
    if len(batch_metrics) > steps:
        raise ValueError(f"{where}: {len(batch_metrics)} batch_metrics entries at "
                         f"steps_completed={steps}: expected at most {steps}, one per step, "
                         "the last one for step steps_completed")
    return [metric_values(f"{where}: batch_metrics[{i}]", m) for i, m in enumerate(batch_metrics)]


def check_samples(where: str, samples: Any, keys: tuple[str, ...]) -> None:
    """Refuse a ``samples`` count that is not an integer >= 0, or one that would overwrite a metric."""
    if samples is None:
        return
    if not is_int(samples) or samples < 0:
        raise ValueError(f"{where}: samples={samples!r}: expected the integer number (>= 0) "
                         "of samples this rank processed since the previous report")
    if SAMPLES_PER_SECOND in keys:
        raise ValueError(f"{where}: metric {SAMPLES_PER_SECOND!r} is also computed from "
                         "samples=; rename your metric or leave samples out")
