"""Where the profiling phase measures peak memory, and how the measurements fit the memory model's
line (:mod:`toolkit.dsat.search.memory`).

Pure but for ``climb``'s callback; rank 0 only by use (:mod:`toolkit.dsat.profiling_phase`, the
search). Design: docs/design-dsat-search.md#the-memory-model.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from toolkit.dsat.contract import ProfileInfo
from toolkit.dsat.search.memory import approx_max_micro_batch, ceil_div, with_stage_extra

__all__ = ["CALIBRATION_FRACTION", "CALIBRATION_MAX", "CALIBRATION_STEP_MS", "POINT_STEP_MS", "TIME_NOISE",
           "POINT_FRACTION", "MAX_LADDER_POINTS", "calibration_micro_batch", "stage_point_micro_batch",
           "time_capped_point", "next_point", "calibrate", "refit", "climb", "noise_bytes", "with_trial",
           "with_oom"]


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
#: Relative noise of a trial's mean step time: a step time that grew by less than this between two
#: trials is taken to have grown by this much (the most the noise can hide), not by nothing.
TIME_NOISE = 0.1
#: The profiled stage's points climb until the largest is at least this fraction of the predicted
#: boundary: the slope is then measured near the boundary, not extrapolated from small steps,
#: whose peak is set by the step's fixed buffers (optimizer, communication), not by the examples.
POINT_FRACTION = 0.4
#: At most this many points of the profiled stage (each one trial) in a ladder (:func:`next_point`).
MAX_LADDER_POINTS = 3


def calibration_micro_batch(profile: ProfileInfo, stage: int, *, data_parallel_size: int,
                            latency_ms: float | None = None, offload_optimizer: bool = False,
                            offload_param: bool = False) -> int | None:
    """The second profiling trial's micro-batch: ``CALIBRATION_FRACTION`` of the uncalibrated
    estimate, within ``CALIBRATION_MAX`` and a ``CALIBRATION_STEP_MS`` step, at least 2; None when
    there is nothing to calibrate. Pure."""
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
    """Where to measure ``stage``'s extra: half its predicted boundary, at least ``k``, at most
    ``at_most`` (None: ``4 k``). Pure."""
    k = int(profile.micro_batch)
    approx = approx_max_micro_batch(profile, stage, data_parallel_size=data_parallel_size,
                                    offload_optimizer=offload_optimizer, offload_param=offload_param)
    return max(k, min(approx // 2, 4 * k if at_most is None else at_most))


def time_capped_point(first: tuple[int, float], second: tuple[int, float], *,
                      noise: float | None = None) -> int | None:
    """The largest micro-batch a point may have: where the step time, on the line through two
    ``(micro_batch, ms)``, reaches max(4x the second's, ``POINT_STEP_MS``); at least ``4 m2``. With
    ``noise``, a smaller growth counts as that fraction; without, None when the time does not grow. Pure."""
    (m1, t1), (m2, t2) = first, second
    if not 1 <= m1 < m2 or t2 <= 0 or (noise is None and t2 <= t1):
        return None
    per_example = max(t2 - t1, (noise or 0.0) * t2) / (m2 - m1)
    limit = max(4 * t2, POINT_STEP_MS)
    return max(int(m2 + (limit - t2) / per_example), 4 * m2)


def next_point(profile: ProfileInfo, stage: int, *, data_parallel_size: int,
               times: Sequence[tuple[int, float]], oom_at: int | None = None,
               offload_optimizer: bool = False, offload_param: bool = False) -> int | None:
    """The next point of the profiled stage's ladder (half the predicted boundary, held by
    :func:`time_capped_point`; after an OOM at ``oom_at``, halving the bracket); None: enough. Pure."""
    k = int(profile.micro_batch)
    approx = approx_max_micro_batch(profile, stage, data_parallel_size=data_parallel_size,
                                    offload_optimizer=offload_optimizer, offload_param=offload_param)
    if oom_at is not None and oom_at > k:
        if oom_at - 1 <= 1.25 * k:
            return None
        target = (k + oom_at) // 2
    elif k >= POINT_FRACTION * approx:
        return None
    else:
        target = approx // 2
    # Without two timings nothing says what a larger step costs: each rung at most 4x the last.
    cap = time_capped_point(times[-2], times[-1], noise=TIME_NOISE) if len(times) >= 2 else 4 * k
    m = target if cap is None else min(target, cap)
    return m if m > k else None


def calibrate(first: ProfileInfo, second: ProfileInfo, *, model_memory: int) -> ProfileInfo:
    """The profile after two trials of one configuration at ``m1 < m2``: their peaks' slope becomes
    ``activation_bytes_per_example`` (at least the leaf outputs), the intercept less ``model_memory``
    ``baseline_bytes``, ``m2`` the point ``k``. ValueError: not increasing, or a peak missing. Pure."""
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
          model_memory: int, noise_bytes: int | None = None) -> ProfileInfo:
    """The calibrated line refitted through ``peak(k)`` and ``at_point``'s peak, its slope floored at the
    smaller of the leaf outputs and the chord from ``peak(1)``; a rise below ``noise_bytes`` measures no
    slope (the floor is the leaf outputs). Pure."""
    rise = int(at_point.peak_bytes) - int(profile.peak_bytes)
    if noise_bytes is not None and rise < noise_bytes:
        floor = max(int(first.activation_bytes_per_example), 1)
    else:
        chord = ceil_div(max(int(at_point.peak_bytes) - int(first.peak_bytes), 0),
                         max(int(at_point.micro_batch) - int(first.micro_batch), 1))
        floor = max(min(int(first.activation_bytes_per_example), chord), 1)
    return calibrate(ProfileInfo.from_json({**profile.to_json(), "activation_bytes_per_example": floor}),
                     at_point, model_memory=model_memory)


#: What :func:`climb` needs of one profiling trial at a micro-batch: its status ("ok", "oom" or
#: anything else), its measured profile (None without one) and its ms per micro-batch (None
#: unknown).
Measure = Callable[[int], "tuple[str, ProfileInfo | None, float | None]"]


def climb(profile: ProfileInfo, stage: int, *, data_parallel_size: int, first: ProfileInfo,
          times: Sequence[tuple[int, float]], model_memory: int, measure: Measure,
          allowed: Callable[[int], int | None] = lambda m: m, offload_optimizer: bool = False,
          offload_param: bool = False) -> ProfileInfo:
    """The profiled stage's ladder: up to ``MAX_LADDER_POINTS`` trials, ``measure(m)`` at :func:`next_point`,
    each refitting the line. ``allowed(m)``: the largest micro-batch the global batch allows up to
    ``m`` (None: none). Rank 0 (the autotuner's process)."""
    flags: dict[str, Any] = {"data_parallel_size": data_parallel_size, "offload_optimizer": offload_optimizer,
                             "offload_param": offload_param}
    times, oom_at = list(times), None
    for _ in range(MAX_LADDER_POINTS):
        m = next_point(profile, stage, times=times, oom_at=oom_at, **flags)
        m = allowed(m) if m is not None else None
        if m is None or m <= int(profile.micro_batch):
            break
        status, measured, ms = measure(m)
        if status == "ok" and measured is not None and int(measured.peak_bytes) > 0:
            profile = refit(profile, measured, first=first, model_memory=model_memory,
                            noise_bytes=noise_bytes(profile))
            if ms:
                times.append((m, float(ms)))
        elif status == "oom":
            oom_at = m if oom_at is None else min(oom_at, m)
        else:
            break
        if oom_at is not None:   # a refit through a point below it must not forget it
            profile = with_oom(profile, stage, micro_batch=oom_at, model_memory=model_memory, **flags)
    return profile


def noise_bytes(profile: ProfileInfo) -> int:
    """Two peaks closer than this measure no slope: 1% of the slot's memory, at least 4 MiB. Pure."""
    return max(int(profile.memory_per_slot) // 100, 4 * 2**20)


def with_trial(profile: ProfileInfo, stage: int, *, micro_batch: int, peak_bytes: int,
               model_memory: int) -> ProfileInfo:
    """The calibrated profile after a trial that fitted: a stage's extra measured again; at the profiled
    stage above ``k`` beyond the noise, the line refitted through it (it becomes ``k``); else unchanged.
    Pure."""
    if not profile.calibrated or int(micro_batch) < int(profile.micro_batch):
        return profile
    if str(stage) in profile.stage_extra_bytes:
        return with_stage_extra(profile, stage, micro_batch=micro_batch, peak_bytes=peak_bytes,
                                model_memory=model_memory)
    k, peak_k = int(profile.micro_batch), int(profile.peak_bytes)
    if micro_batch == k or int(peak_bytes) - peak_k < noise_bytes(profile):
        return profile
    slope = ceil_div(int(peak_bytes) - peak_k, int(micro_batch) - k)
    baseline = max(int(peak_bytes) - slope * int(micro_batch) - int(model_memory), 0)
    return ProfileInfo.from_json({**profile.to_json(), "activation_bytes_per_example": slope,
                                  "baseline_bytes": baseline, "micro_batch": int(micro_batch),
                                  "peak_bytes": int(peak_bytes)})


def with_oom(profile: ProfileInfo, stage: int, *, micro_batch: int, model_memory: int,
             data_parallel_size: int, offload_optimizer: bool = False,
             offload_param: bool = False) -> ProfileInfo:
    """The calibrated profile after an OOM at ``micro_batch``, predicting at most ``micro_batch - 1``: a
    steeper line through ``k``'s peak (the profiled stage, above ``k``), else the stage's extra. Pure."""
    flags: dict[str, Any] = {"data_parallel_size": data_parallel_size, "offload_optimizer": offload_optimizer,
                             "offload_param": offload_param}
    m, k = int(micro_batch), int(profile.micro_batch)
    if not profile.calibrated or approx_max_micro_batch(profile, stage, **flags) < m:
        return profile
    budget, slope = int(profile.memory_per_slot), int(profile.activation_bytes_per_example)
    if m > k and str(stage) not in profile.stage_extra_bytes and int(profile.peak_bytes) > 0:
        peak_k = int(profile.peak_bytes)
        steeper = max(budget - peak_k, 0) // (m - k) + 1   # the least with k's peak + (m - k) x it > budget
        baseline = max(peak_k - steeper * k - int(model_memory), 0)
        fitted = ProfileInfo.from_json({**profile.to_json(), "baseline_bytes": baseline,
                                        "activation_bytes_per_example": max(steeper, slope)})
        if approx_max_micro_batch(fitted, stage, **flags) < m:
            return fitted
    # else the stage's extra that puts m over the budget: fixed at most k (memory.approx_max_micro_batch's
    # first branch), referred to k beyond it (its second: free x k // (slope x k + extra))
    free = budget - int(profile.baseline_bytes) - int(model_memory)
    extra = free - slope * m + 1 if m <= k else free * k // m - slope * k + 1
    extra = max(extra, int(profile.stage_extra_bytes.get(str(stage), 0)))
    return ProfileInfo.from_json({**profile.to_json(),
                                  "stage_extra_bytes": {**profile.stage_extra_bytes, str(stage): extra}})
