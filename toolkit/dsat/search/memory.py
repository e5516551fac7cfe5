"""Memory model of the autotuner: model-state bytes per ZeRO stage and the largest micro-batch.

Pure arithmetic on the profiling trial's numbers (:class:`~toolkit.dsat.contract.ProfileInfo`),
Adam assumed. With ``N`` parameters, ``N_t`` of them trainable, and ``S`` data-parallel slots:

* parameters ``P = N * (2 if fp16/bf16 else 4)``
* gradients ``G = N_t * 4``
* optimizer ``O = N_t * ((4 if fp16/bf16 else 0) + 8)`` (fp32 master copy in half precision,
  plus Adam's two moments)

Per slot, ZeRO stage 0 holds ``P + G + O``; stage 1 ``P + G + O/S``; stage 2 ``P + (G + O)/S``;
stage 3 ``(P + G + O)/S``. An offloaded part leaves the device: ``offload_optimizer`` removes
``O``, ``offload_param`` removes ``P``. Divisions round up, so the model never promises a byte
the device does not have.

Calibrated (:mod:`toolkit.dsat.search.calibration`, which picks the points and fits the line):
the profiling trial at micro-batch 1 sees only the outputs of the leaf modules, not the
backward's temporaries, the allocator's slack, the communication buckets or the optimizer's
first-step allocations, so the orchestrator runs a second profiling trial at a larger
micro-batch ``k`` and the model uses the slope of the measured peak memory (``peak_bytes``)
between the two: with ``peak(1)`` measured at the profiled stage ``s0``, a stage ``s`` is
predicted to fit up to
``floor((memory_per_slot - peak(1) - (model_memory(s) - model_memory(s0))) / slope) + 1``, the
stages' model-state differences coming from the formula above. The calibrated profile carries the
slope as ``activation_bytes_per_example``, the intercept as ``baseline_bytes`` and the calibration
point ``k`` as ``micro_batch``, so :func:`approx_max_micro_batch` computes exactly that. The
profiled stage is then measured at points nearer the boundary (``calibration.climb``: a ladder,
each point at half the predicted boundary, until the largest is 40% of it), and the line refitted
through the two largest, the larger becoming ``k``: the peak does not grow linearly (small steps
carry one-off buffers; the step's fixed buffers set the peak of small steps, so an MLP's peak was
flat to a knee near 1300 examples; on CPU the C allocator bends the curve). A tuning trial refits
it the same way (``calibration.with_trial``, ``with_oom``).

What the formula misses between stages (ZeRO-3's gather and prefetch buffers, a stage's own
buckets) is measured by one more profiling trial per other searched stage, at half the stage's
predicted boundary (at least ``k``; at most where the step time reaches 4x the calibration
trial's or 3 s), and :func:`with_stage_extra` keeps its extra ``E`` over the line. One point
cannot tell a fixed extra from one that grows with the micro-batch, so the model takes the larger
of the two readings beyond the point, ``extra(m) = max(E, E * m / point)``: a positive extra
grows in proportion (ZeRO-3's buffers can grow with the batch), a negative one (a stage that
holds less) is not extrapolated into a saving per example. Both err on the side of a smaller
prediction, and the point near the boundary keeps the extrapolation short. A positive extra is
stored referred to ``k`` (``E * k / point``), so one calibration point serves every stage.

Example (rank 0 only, e.g. in the autotuner's orchestrator after the profiling trial)::

    profile = ProfileInfo(num_params=10**8, trainable_params=10**8,
                          activation_bytes_per_example=2**26, memory_per_slot=16 * 2**30)
    prediction = predict(profile, data_parallel_size=2, zero_stages=(1, 2, 3))
    logger.info("memory model:\\n%s", format_prediction(prediction, profile=profile))
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
    """Bytes of model state (parameters, gradients, Adam state) one slot holds at ``stage``.

    Pure; call anywhere (the autotuner calls it on rank 0 only).

    Args:
        profile: the profiling trial's numbers (parameter counts, half precision).
        stage: ZeRO stage 0..3.
        data_parallel_size: ``S``, the slots of one trial; partitioned parts are divided by it.
        offload_optimizer: the optimizer state ``O`` lives on the host, not the device.
        offload_param: the parameters ``P`` live on the host, not the device.

    Returns:
        Bytes, rounded up.

    Raises:
        ValueError: a stage outside 0..3 or ``data_parallel_size < 1``.

    Example:
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
    """The approximate largest micro-batch per slot at ``stage``; at least 1.

    ``max(free_bytes // activation_bytes_per_example, 1)``; beyond the calibration point ``k`` a
    positive stage extra ``E`` grows as ``E * m / k`` (module docstring). An activation size of 0
    (activations the profiler could not see) is taken as 1 byte, so the bound stays finite; the
    search's bisection corrects it with real out-of-memory results. Pure; call anywhere.

    Example:
        >>> p = ProfileInfo(num_params=1000, trainable_params=1000,
        ...                 activation_bytes_per_example=100, memory_per_slot=17000)
        >>> approx_max_micro_batch(p, 0, data_parallel_size=1)   # (17000 - 16000) // 100
        10
    """
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
    """The peak memory per slot the model predicts at ``micro_batch``: baseline, model state,
    per-example memory and the stage's extra (growing beyond ``k`` as in
    :func:`approx_max_micro_batch`, whose result is the largest micro-batch this keeps within
    ``memory_per_slot``, where one fits). For dsat's curves. Pure; call anywhere.

    Example:
        >>> p = ProfileInfo(num_params=1000, trainable_params=1000,
        ...                 activation_bytes_per_example=100, memory_per_slot=17000)
        >>> predicted_peak_bytes(p, 0, 10, data_parallel_size=1)   # 16000 + 10 x 100
        17000
    """
    model = model_memory_bytes(profile, stage, data_parallel_size=data_parallel_size,
                               offload_optimizer=offload_optimizer, offload_param=offload_param)
    activation = max(int(profile.activation_bytes_per_example), 1)
    extra, k, m = int(profile.stage_extra_bytes.get(str(stage), 0)), int(profile.micro_batch), micro_batch
    if extra > 0 and k >= 1 and m > k:
        extra = ceil_div(extra * m, k)
    return int(profile.baseline_bytes) + model + activation * m + extra


def free_bytes(profile: ProfileInfo, stage: int, model_memory: int) -> int:
    """What remains per slot for per-example memory at ``stage``: the slot's memory less the
    baseline, the model state and the stage's extra as measured at ``k`` (``stage_extra_bytes``). Pure."""
    extra = int(profile.stage_extra_bytes.get(str(stage), 0))
    return int(profile.memory_per_slot) - int(profile.baseline_bytes) - model_memory - extra


def with_stage_extra(profile: ProfileInfo, stage: int, *, micro_batch: int, peak_bytes: int,
                     model_memory: int) -> ProfileInfo:
    """``profile`` (calibrated) with the extra that a profiling trial at ``stage`` and
    ``micro_batch`` measured: its peak less what the calibrated line predicts there
    (``baseline + model_memory + slope x micro_batch``; negative when the stage needs less).
    ``micro_batch``, the stage's point, is at least the calibration point ``k`` (the profile's
    ``micro_batch``); a positive extra is kept referred to ``k`` (``E * k / micro_batch``, the
    same extra per example). Pure; call anywhere.

    Raises:
        ValueError: ``micro_batch`` is below the calibrated profile's.

    Example:
        >>> p = ProfileInfo(num_params=1000, trainable_params=1000, activation_bytes_per_example=100,
        ...                 memory_per_slot=10**6, baseline_bytes=5000, micro_batch=10, calibrated=True)
        >>> with_stage_extra(p, 3, micro_batch=10, peak_bytes=9000, model_memory=1000).stage_extra_bytes
        {'3': 2000}
    """
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
    """``(offload_optimizer, offload_param)`` as DeepSpeed would apply them for a ZeRO section.

    An offload section whose ``device`` is ``"none"`` offloads nothing; ``offload_param`` only
    takes effect at stage 3 and ``offload_optimizer`` here only at stages 2 and 3, the stages dsat's
    search offloads at (DeepSpeed 0.19 also offloads at stage 1). Pure; call anywhere.

    Example:
        >>> offload_flags({"stage": 3, "offload_param": {"device": "cpu"}})
        (False, True)
    """
    stage = int(zero.get("stage", 0))

    def _on(section: Any) -> bool:
        return is_mapping(section) and str(section.get("device", "none")).lower() not in ("none", "")

    return (stage >= 2 and _on(zero.get("offload_optimizer")),
            stage == 3 and _on(zero.get("offload_param")))


def predict(profile: ProfileInfo, *, data_parallel_size: int, zero_stages: Iterable[int] = _STAGES,
            offload_optimizer: bool = False, offload_param: bool = False) -> dict[int, dict[str, Any]]:
    """The memory model for each stage of ``zero_stages``.

    Pure; the autotuner calls it on rank 0 only and writes the result to its output directory.

    Returns:
        ``{stage: {"model_memory_bytes", "free_bytes", "approx_max_micro_batch", "fits"}}``, with
        ``free_bytes`` what remains per slot for activations after baseline and model state, and
        ``fits`` whether one example's activations fit in it (the approximate maximum is 1
        either way; ``fits`` says whether that 1 is an estimate or a floor).

    Example:
        >>> p = ProfileInfo(num_params=1000, trainable_params=1000,
        ...                 activation_bytes_per_example=100, memory_per_slot=17000)
        >>> predict(p, data_parallel_size=1, zero_stages=(0,))[0]["approx_max_micro_batch"]
        10
    """
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
    """A plain-text table of :func:`predict`'s result, for logs and the console.

    Pure; rank 0 only by convention (it is what the autotuner prints).

    Example:
        >>> p = ProfileInfo(num_params=1000, trainable_params=1000,
        ...                 activation_bytes_per_example=100, memory_per_slot=17000)
        >>> print(format_prediction(predict(p, data_parallel_size=1, zero_stages=(0,))))
        stage  model memory  free for activations  approx max micro-batch
            0     15.62 KiB                1000 B                      10
    """
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
