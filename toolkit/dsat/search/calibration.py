"""Where the autotuner measures peak memory, and how two measurements become the memory model's
line: the calibration trial's micro-batch, each stage's point near its boundary, and the fit.

The model itself (model-state bytes, the largest micro-batch, a stage's extra) is
:mod:`toolkit.dsat.search.memory`, whose docstring describes the whole scheme. Pure; the
autotuner calls these on rank 0 only (:mod:`toolkit.dsat.profiling_phase`).
"""

from __future__ import annotations

from toolkit.dsat.contract import ProfileInfo
from toolkit.dsat.search.memory import approx_max_micro_batch, ceil_div

__all__ = ["CALIBRATION_FRACTION", "CALIBRATION_MAX", "CALIBRATION_STEP_MS", "POINT_STEP_MS",
           "calibration_micro_batch", "stage_point_micro_batch", "time_capped_point", "calibrate", "refit"]


#: The calibration trial's micro-batch: this fraction of the uncalibrated estimate (which can be
#: several times too large), at most CALIBRATION_MAX examples and CALIBRATION_STEP_MS of step time.
CALIBRATION_FRACTION = 0.1
CALIBRATION_MAX = 256
CALIBRATION_STEP_MS = 3000.0
#: A stage's point may have a step this long (or 4x the calibration trial's, when longer). Each
#: searched stage pays one trial there; near the memory boundary a step is the longest of the
#: search, and a trial of 12 steps at 3 s costs as much as three at the small micro-batches.
#: ``scripts/bench_memory.py`` measures how far the slope from such a point carries.
POINT_STEP_MS = 1000.0


def calibration_micro_batch(profile: ProfileInfo, stage: int, *, data_parallel_size: int,
                            latency_ms: float | None = None, offload_optimizer: bool = False,
                            offload_param: bool = False) -> int | None:
    """The micro-batch of the second profiling trial, or None when there is nothing to calibrate.

    :data:`CALIBRATION_FRACTION` of the uncalibrated largest micro-batch at the profiled
    ``stage``, at most :data:`CALIBRATION_MAX`, and at most what keeps the step under
    :data:`CALIBRATION_STEP_MS` when steps grow linearly from ``latency_ms`` (the first
    profile's step time at its micro-batch); at least 2. None when the profile has no peak
    measurement (``peak_bytes`` 0) or is calibrated already. Pure; call anywhere.

    Example:
        >>> p = ProfileInfo(num_params=1000, trainable_params=1000, activation_bytes_per_example=100,
        ...                 memory_per_slot=10**6, micro_batch=1, peak_bytes=50_000)
        >>> calibration_micro_batch(p, 1, data_parallel_size=2)    # 10% of 9880, at most 256
        256
    """
    if int(profile.peak_bytes) <= 0 or profile.calibrated:
        return None
    estimate = approx_max_micro_batch(profile, stage, data_parallel_size=data_parallel_size,
                                      offload_optimizer=offload_optimizer, offload_param=offload_param)
    k = min(int(estimate * CALIBRATION_FRACTION), CALIBRATION_MAX)
    if latency_ms is not None and latency_ms > 0:
        k = min(k, int(CALIBRATION_STEP_MS / latency_ms * max(int(profile.micro_batch), 1)))
    return max(k, 2)


def stage_point_micro_batch(profile: ProfileInfo, stage: int, *, data_parallel_size: int,
                            offload_optimizer: bool = False, offload_param: bool = False,
                            at_most: int | None = None) -> int:
    """Where to measure ``stage``'s extra: half its predicted boundary on the calibrated line
    (before its own extra), at least the calibration point ``k`` and at most ``at_most``
    (:func:`time_capped_point`), or ``4 k`` when None (the step time within 4x the calibration
    trial's when it grows in proportion). Pure.

    Example:
        >>> p = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=100,
        ...                 memory_per_slot=100_000, micro_batch=20, calibrated=True)
        >>> stage_point_micro_batch(p, 3, data_parallel_size=2)    # half of 1000, at most 4 x 20
        80
    """
    k = int(profile.micro_batch)
    approx = approx_max_micro_batch(profile, stage, data_parallel_size=data_parallel_size,
                                    offload_optimizer=offload_optimizer, offload_param=offload_param)
    return max(k, min(approx // 2, 4 * k if at_most is None else at_most))


def time_capped_point(first: tuple[int, float], second: tuple[int, float]) -> int | None:
    """The largest micro-batch a stage's point may have: where the time per micro-batch, on the
    line through two profiling trials' ``(micro_batch, ms per micro-batch)``, reaches the larger
    of 4x the second's and :data:`POINT_STEP_MS`; at least ``4 m2``. A step's fixed cost
    (launch, communication, the optimizer) makes small steps cost far more than their share, so
    the line lets a cheap model's point come near its boundary, where the memory curve is
    measured, not extrapolated over a hundredfold. None when the time does not grow. Pure.

    Example:
        >>> time_capped_point((1, 20.0), (100, 25.0))    # 1000 ms at 100 + 975 / (5 / 99)
        19405
    """
    (m1, t1), (m2, t2) = first, second
    if not 1 <= m1 < m2 or t2 <= t1:
        return None
    per_example = (t2 - t1) / (m2 - m1)
    limit = max(4 * t2, POINT_STEP_MS)
    return max(int(m2 + (limit - t2) / per_example), 4 * m2)


def calibrate(first: ProfileInfo, second: ProfileInfo, *, model_memory: int) -> ProfileInfo:
    """The profile the memory model uses after two profiling trials of the same configuration.

    ``first`` and ``second`` ran the same ZeRO section at micro-batches ``m1 < m2``;
    ``model_memory`` is :func:`model_memory_bytes` of that section. The slope of the peak memory
    per example, ``(peak(m2) - peak(m1)) / (m2 - m1)``, becomes ``activation_bytes_per_example``
    (never less than the leaf outputs that the first trial saw), and the intercept at micro-batch
    0 less the model state, ``baseline_bytes``; ``micro_batch`` and ``peak_bytes`` become the
    second trial's (the calibration point, where :func:`with_stage_extra` measures). Pure.

    Raises:
        ValueError: the micro-batches are not increasing, or a profile lacks its peak.

    Example:
        >>> a = ProfileInfo(num_params=1000, trainable_params=1000, activation_bytes_per_example=10,
        ...                 memory_per_slot=10**6, micro_batch=1, peak_bytes=30_000)
        >>> b = ProfileInfo(num_params=1000, trainable_params=1000, activation_bytes_per_example=10,
        ...                 memory_per_slot=10**6, micro_batch=11, peak_bytes=31_000)
        >>> c = calibrate(a, b, model_memory=16_000)
        >>> (c.activation_bytes_per_example, c.baseline_bytes)   # 1000 / 10; 30000 - 100 - 16000
        (100, 13900)
    """
    m1, m2 = int(first.micro_batch), int(second.micro_batch)
    if not 1 <= m1 < m2:
        raise ValueError(f"micro_batch {m1} then {m2}: expected two profiling trials at increasing "
                         "micro-batches >= 1")
    if int(first.peak_bytes) <= 0 or int(second.peak_bytes) <= 0:
        raise ValueError(f"peak_bytes {first.peak_bytes}, {second.peak_bytes}: expected both measured (> 0)")
    slope = ceil_div(max(int(second.peak_bytes) - int(first.peak_bytes), 0), m2 - m1)
    slope = max(slope, int(first.activation_bytes_per_example), 1)
    baseline = max(int(first.peak_bytes) - slope * m1 - int(model_memory), 0)
    fields = {**first.to_json(), "activation_bytes_per_example": slope, "baseline_bytes": baseline,
              "micro_batch": m2, "peak_bytes": int(second.peak_bytes), "calibrated": True}
    return ProfileInfo.from_json(fields)


def refit(profile: ProfileInfo, at_point: ProfileInfo, *, first: ProfileInfo,
          model_memory: int) -> ProfileInfo:
    """The calibrated ``profile`` (line through ``peak(1)`` and ``peak(k)``) refitted through
    ``peak(k)`` and ``at_point``'s peak, the profiled stage measured at its point ``p > k``.

    The slope between ``k`` and ``p`` is the one nearest the boundary, and it leaves out what a
    small step measures besides its examples (one-off buffers, the allocator's first blocks),
    which a small ``k`` can make several times the real slope. It is floored at the smaller of
    the first trial's leaf outputs and the chord from ``peak(1)``, so that noise between ``k``
    and ``p`` cannot make it vanish. Pure; rank 0 by convention.

    Example:
        >>> first = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=100,
        ...                     memory_per_slot=10**6, micro_batch=1, peak_bytes=20_000)
        >>> at_k = calibrate(first, ProfileInfo.from_json({**first.to_json(), "micro_batch": 11,
        ...                  "peak_bytes": 40_000}), model_memory=0)        # 2000 per example
        >>> at_p = ProfileInfo.from_json({**first.to_json(), "micro_batch": 111, "peak_bytes": 90_000})
        >>> refit(at_k, at_p, first=first, model_memory=0).activation_bytes_per_example   # 50000 / 100
        500
    """
    chord = ceil_div(max(int(at_point.peak_bytes) - int(first.peak_bytes), 0),
                     max(int(at_point.micro_batch) - int(first.micro_batch), 1))
    floor = max(min(int(first.activation_bytes_per_example), chord), 1)
    return calibrate(ProfileInfo.from_json({**profile.to_json(), "activation_bytes_per_example": floor}),
                     at_point, model_memory=model_memory)
