"""The memory model: model-state bytes per ZeRO stage, and the largest micro-batch that fits.

Pure arithmetic on the profiling trials' :class:`~toolkit.dsat.contract.ProfileInfo`, Adam assumed;
the line's calibration is :mod:`toolkit.dsat.search.calibration`. Rank 0 only by use.
Design: docs/design-dsat-search.md#the-memory-model.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from toolkit._checks import is_int, is_mapping
from toolkit.dsat.contract import ProfileInfo

__all__ = [
    "model_memory_bytes", "approx_max_micro_batch", "offload_flags", "predict", "format_prediction",
    "free_bytes", "with_stage_extra", "ceil_div", "predicted_peak_bytes",
]

logger = logging.getLogger(__name__)

_STAGES = (0, 1, 2, 3)


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up (``b > 0``). Pure; any rank."""
    return -(-a // b)


def _check_stage_and_size(stage: int, data_parallel_size: int) -> None:
    if not is_int(stage) or stage not in _STAGES:
        raise ValueError(f"stage={stage!r}: expected a ZeRO stage 0, 1, 2 or 3")
    if not is_int(data_parallel_size) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size!r}: expected an integer >= 1 "
                         "(the slots of one trial)")


def _state_bytes(profile: ProfileInfo) -> tuple[int, int, int]:
    """(P, G, O) in bytes for the whole model, before any partitioning."""
    n, n_t = int(profile.num_params), int(profile.trainable_params)
    if n < 0 or n_t < 0:
        raise ValueError(f"num_params={n}, trainable_params={n_t}: expected counts >= 0")
    half = bool(profile.half_precision)
    return n * (2 if half else 4), n_t * 4, n_t * ((4 if half else 0) + 8)


def model_memory_bytes(profile: ProfileInfo, stage: int, *, data_parallel_size: int,
                       offload_optimizer: bool = False, offload_param: bool = False) -> int:
    """Bytes of model state (parameters, gradients, Adam state) one slot holds at ``stage``, rounded up;
    ValueError for a stage outside 0..3 or ``data_parallel_size < 1``. Pure; any rank.

    >>> p = ProfileInfo(num_params=1000, trainable_params=1000,
    ...                 activation_bytes_per_example=1, memory_per_slot=10**6)
    >>> model_memory_bytes(p, 2, data_parallel_size=4)   # 4000 + (4000 + 8000) / 4
    7000
    """
    _check_stage_and_size(stage, data_parallel_size)
    params, grads, optim = _state_bytes(profile)
    params, optim = (0 if offload_param else params), (0 if offload_optimizer else optim)
    # (held whole, partitioned over the slots) per stage: nothing, O, G + O, P + G + O partitioned
    kept, split = ((params + grads + optim, 0), (params + grads, optim), (params, grads + optim),
                   (0, params + grads + optim))[stage]
    return kept + ceil_div(split, data_parallel_size)


def approx_max_micro_batch(profile: ProfileInfo, stage: int, *, data_parallel_size: int,
                           offload_optimizer: bool = False, offload_param: bool = False) -> int:
    """The approximate largest micro-batch per slot at ``stage``, at least 1: ``free_bytes //
    activation_bytes_per_example`` (0 taken as 1), a positive stage extra growing as ``E x m / k``
    beyond the calibration point ``k``. Pure; any rank."""
    model = model_memory_bytes(profile, stage, data_parallel_size=data_parallel_size,
                               offload_optimizer=offload_optimizer, offload_param=offload_param)
    activation = max(int(profile.activation_bytes_per_example), 1)
    fixed = free_bytes(profile, stage, model) // activation   # the stage's extra taken as fixed
    extra, k = int(profile.stage_extra_bytes.get(str(stage), 0)), int(profile.micro_batch)
    if extra <= 0 or k < 1 or fixed <= k:
        return max(fixed, 1)
    # beyond k the extra grows as extra * m / k: slope + extra / k per example, from micro-batch 0
    before_extra = int(profile.memory_per_slot) - int(profile.baseline_bytes) - model
    return max(before_extra * k // (activation * k + extra), 1)


def predicted_peak_bytes(profile: ProfileInfo, stage: int, micro_batch: int, *, data_parallel_size: int,
                         offload_optimizer: bool = False, offload_param: bool = False) -> int:
    """The peak per slot predicted at ``micro_batch`` (baseline, model state, examples, the stage's
    extra), for dsat's curves. Pure; any rank."""
    model = model_memory_bytes(profile, stage, data_parallel_size=data_parallel_size,
                               offload_optimizer=offload_optimizer, offload_param=offload_param)
    activation = max(int(profile.activation_bytes_per_example), 1)
    extra, k, m = int(profile.stage_extra_bytes.get(str(stage), 0)), int(profile.micro_batch), micro_batch
    if extra > 0 and k >= 1 and m > k:
        extra = ceil_div(extra * m, k)
    return int(profile.baseline_bytes) + model + activation * m + extra


def free_bytes(profile: ProfileInfo, stage: int, model_memory: int) -> int:
    """What remains per slot for the examples at ``stage``: memory less baseline, model state and the
    stage's extra at ``k``. Pure."""
    extra = int(profile.stage_extra_bytes.get(str(stage), 0))
    return int(profile.memory_per_slot) - int(profile.baseline_bytes) - model_memory - extra


def with_stage_extra(profile: ProfileInfo, stage: int, *, micro_batch: int, peak_bytes: int,
                     model_memory: int) -> ProfileInfo:
    """``profile`` with ``stage``'s extra: the peak measured at ``micro_batch`` (at least ``k``, else
    ValueError) less the line's prediction there, a positive one referred to ``k``. Pure."""
    k = int(profile.micro_batch)
    if profile.calibrated and int(micro_batch) < k:
        raise ValueError(f"micro_batch={micro_batch}: expected at least the calibration point {k}")
    slope = int(profile.activation_bytes_per_example)
    extra = int(peak_bytes) - (int(profile.baseline_bytes) + int(model_memory) + slope * micro_batch)
    if extra > 0 and profile.calibrated:
        extra = ceil_div(extra * k, int(micro_batch))
    extras = {**profile.stage_extra_bytes, str(stage): extra}
    return ProfileInfo.from_json({**profile.to_json(), "stage_extra_bytes": extras})


def offload_flags(zero: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(offload_optimizer, offload_param)`` of a ZeRO section as the search counts them (a device
    not "none"; the optimizer at stages 2 and 3, the parameters at 3). Pure."""
    stage = int(zero.get("stage", 0))

    def _on(section: Any) -> bool:
        return is_mapping(section) and str(section.get("device", "none")).lower() not in ("none", "")

    return (stage >= 2 and _on(zero.get("offload_optimizer")),
            stage == 3 and _on(zero.get("offload_param")))


def predict(profile: ProfileInfo, *, data_parallel_size: int, zero_stages: Iterable[int] = _STAGES,
            offload_optimizer: bool = False, offload_param: bool = False) -> dict[int, dict[str, Any]]:
    """Per stage: ``model_memory_bytes``, ``free_bytes``, ``approx_max_micro_batch`` and ``fits`` (one
    example fits: the maximum of 1 is an estimate, not a floor). Pure; rank 0 by use."""
    out: dict[int, dict[str, Any]] = {}
    for stage in sorted(set(zero_stages)):
        off_opt, off_par = offload_optimizer and stage >= 1, offload_param and stage == 3
        model = model_memory_bytes(profile, stage, data_parallel_size=data_parallel_size,
                                   offload_optimizer=off_opt, offload_param=off_par)
        free = free_bytes(profile, stage, model)
        approx = approx_max_micro_batch(profile, stage, data_parallel_size=data_parallel_size,
                                        offload_optimizer=off_opt, offload_param=off_par)
        out[stage] = {"model_memory_bytes": model, "free_bytes": free, "approx_max_micro_batch": approx,
                      "fits": free >= int(profile.activation_bytes_per_example)}
    return out


def _human(n: int) -> str:
    sign, value, units = "-" if n < 0 else "", float(abs(n)), ("B", "KiB", "MiB", "GiB", "TiB")
    for unit in units[:-1]:
        if value < 1024:
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    return f"{sign}{value:.2f} TiB"


def format_prediction(prediction: Mapping[int, Mapping[str, Any]], *,
                      profile: ProfileInfo | None = None) -> str:
    """:func:`predict`'s result as a plain-text table for the console. Pure; rank 0 by convention."""
    lines: list[str] = []
    if profile is not None:
        lines += [
            f"parameters: {profile.num_params:,} ({profile.trainable_params:,} trainable), "
            f"{'fp16/bf16' if profile.half_precision else 'fp32'}, device {profile.device}",
            f"memory per slot: {_human(int(profile.memory_per_slot))}, "
            f"baseline: {_human(int(profile.baseline_bytes))}, "
            f"{'peak memory' if profile.calibrated else 'activations'} per example: "
            f"{_human(int(profile.activation_bytes_per_example))}",
        ]
    lines.append(f"{'stage':>5}  {'model memory':>12}  {'free for activations':>20}  "
                 f"{'approx max micro-batch':>22}")
    for stage in sorted(prediction):
        row = prediction[stage]
        mark = "" if row.get("fits", True) else "  (does not fit)"
        lines.append(f"{stage:>5}  {_human(int(row['model_memory_bytes'])):>12}  "
                     f"{_human(int(row['free_bytes'])):>20}  {int(row['approx_max_micro_batch']):>22}{mark}")
    return "\n".join(lines)
