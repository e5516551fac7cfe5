"""Where the autotuner measures peak memory, and how two measurements become the memory model's
line: the calibration trial's micro-batch, each stage's point near its boundary, and the fit.

The model itself (model-state bytes, the largest micro-batch, a stage's extra) is
:mod:`toolkit.dsat.search.memory`, whose docstring describes the whole scheme. Pure; the
autotuner calls these on rank 0 only (:mod:`toolkit.dsat.profiling_phase`).
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


def time_capped_point(first: tuple[int, float], second: tuple[int, float], *,
                      noise: float | None = None) -> int | None:
    """The largest micro-batch a stage's point may have: where the time per micro-batch, on the
    line through two profiling trials' ``(micro_batch, ms per micro-batch)``, reaches the larger
    of 4x the second's and :data:`POINT_STEP_MS`; at least ``4 m2``. A step's fixed cost
    (launch, communication, the optimizer) makes small steps cost far more than their share, so
    the line lets a cheap model's point come near its boundary, where the memory curve is
    measured, not extrapolated over a hundredfold. None when the time does not grow, unless
    ``noise`` (a fraction, :data:`TIME_NOISE` for :func:`next_point`) is given: a time that grew
    by less than that fraction of the second's (or fell) is then taken to have grown by that
    much, the most the noise can hide, so the step stays within the limit whatever the truth (an
    MLP whose step was 300 ms of optimizer and all-reduce at micro-batch 1 and at 9 had its point
    held to 4 x 9 = 36 where its boundary was 12860). None for points not increasing. Pure.

    Example:
        >>> time_capped_point((1, 20.0), (100, 25.0))    # 1000 ms at 100 + 975 / (5 / 99)
        19405
        >>> time_capped_point((1, 309.0), (9, 301.0), noise=0.1)    # 1204 ms at 9 + 903 / (30.1 / 8)
        249
    """
    (m1, t1), (m2, t2) = first, second
    if not 1 <= m1 < m2 or t2 <= 0 or (noise is None and t2 <= t1):
        return None
    per_example = max(t2 - t1, (noise or 0.0) * t2) / (m2 - m1)
    limit = max(4 * t2, POINT_STEP_MS)
    return max(int(m2 + (limit - t2) / per_example), 4 * m2)


def next_point(profile: ProfileInfo, stage: int, *, data_parallel_size: int,
               times: Sequence[tuple[int, float]], oom_at: int | None = None,
               offload_optimizer: bool = False, offload_param: bool = False) -> int | None:
    """The next point of the profiled ``stage``'s ladder, or None when it has measured enough.

    ``profile`` is calibrated and refitted through every point so far (its ``micro_batch`` is the
    largest one measured); ``times`` the ``(micro_batch, ms per micro-batch)`` of the profiling
    trials of this configuration so far, ascending (fewer than two: each rung is held to 4x the
    last point). The next point is half the
    predicted boundary, held by :func:`time_capped_point` on the last two times (each rung's step
    within 4x the last one's or :data:`POINT_STEP_MS`); None once the largest point is at least
    :data:`POINT_FRACTION` of the prediction, or when the cap leaves no room above it. After an
    out-of-memory at ``oom_at`` (the smallest) the boundary lies between the largest point and
    it: the next point halves that bracket until it is within 25% of the point. Pure.

    Example:
        >>> p = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=40_000,
        ...                 memory_per_slot=900 * 10**6, baseline_bytes=500 * 10**6, micro_batch=9,
        ...                 calibrated=True)
        >>> next_point(p, 1, data_parallel_size=2, times=[(1, 309.0), (9, 301.0)])   # half of 10000: 249
        249
    """
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
          model_memory: int, noise_bytes: int | None = None) -> ProfileInfo:
    """The calibrated ``profile`` (line through ``peak(1)`` and ``peak(k)``) refitted through
    ``peak(k)`` and ``at_point``'s peak, the profiled stage measured at its point ``p > k``.

    The slope between ``k`` and ``p`` is the one nearest the boundary, and it leaves out what a
    small step measures besides its examples (one-off buffers, the allocator's first blocks),
    which a small ``k`` can make several times the real slope. It is floored at the smaller of
    the first trial's leaf outputs and the chord from ``peak(1)``, so that noise between ``k``
    and ``p`` cannot make it vanish. With ``noise_bytes`` (:func:`climb` passes
    :func:`noise_bytes`), two peaks that differ by less do not measure the slope at all: the
    step's fixed buffers (the optimizer's, the communication's) set both, and the floor is the
    leaf outputs alone (an MLP's peak rose 3 MiB from micro-batch 1 to 249 and 6 MiB more to
    1000, then 32 KiB per example: the chord from 1 made it 2.2x optimistic). Pure; rank 0 by
    convention.

    Example:
        >>> first = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=100,
        ...                     memory_per_slot=10**9, micro_batch=1, peak_bytes=20_000)
        >>> at_k = calibrate(first, ProfileInfo.from_json({**first.to_json(), "micro_batch": 11,
        ...                  "peak_bytes": 20_000_000}), model_memory=0)
        >>> at_p = ProfileInfo.from_json({**first.to_json(), "micro_batch": 1011, "peak_bytes": 70_000_000})
        >>> refit(at_k, at_p, first=first, model_memory=0).activation_bytes_per_example   # 5e7 / 1000
        50000
    """
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
    """The profiled ``stage``'s ladder: up to :data:`MAX_LADDER_POINTS` profiling trials at
    :func:`next_point`, each refitting ``profile`` (:func:`refit`; an out-of-memory:
    :func:`with_oom`, and the ladder bisects below it), until the largest point is near the
    predicted boundary. ``measure(m)`` runs one trial (the caller's ids, files and records);
    ``allowed(m)`` is the largest micro-batch the global batch policy allows up to ``m`` (None:
    none). ``times`` the ``(micro_batch, ms per micro-batch)`` of the profiling trials so far.
    Not pure only through ``measure``; rank 0 (the autotuner's process).

    Example::

        profile = calibration.climb(calibrated, 1, data_parallel_size=2, first=first_profile,
                                    times=[(1, 309.0), (9, 301.0)], model_memory=model,
                                    measure=run_profiling_trial_at)
    """
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
    """Two peaks closer than this do not measure a slope: 1% of the slot's memory, at least 4 MiB
    (a CPU process's resident size moves by a few MiB between identical runs)."""
    return max(int(profile.memory_per_slot) // 100, 4 * 2**20)


def with_trial(profile: ProfileInfo, stage: int, *, micro_batch: int, peak_bytes: int,
               model_memory: int) -> ProfileInfo:
    """The calibrated ``profile`` after a trial at ``stage`` and ``micro_batch`` that fitted with
    a measured ``peak_bytes``: the measurement nearest the boundary wins.

    * A stage with a measured extra (not the profiled one): the extra is measured again here
      (:func:`~toolkit.dsat.search.memory.with_stage_extra`), when ``micro_batch`` is at least k.
    * The profiled stage, above the calibration point k by more than the noise in peak: the line
      is refitted through k's peak and this one (the chord nearest the boundary), and this point
      becomes k. Below k, or a peak within the noise of k's: nothing changes (a search's small
      trials, whose peak the start-up can set on CPU, say nothing about the slope).

    ``model_memory`` is :func:`~toolkit.dsat.search.memory.model_memory_bytes` of the trial's
    ZeRO section. Pure; rank 0 by use (the search, as trials report).

    Example:
        >>> p = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=1000,
        ...                 memory_per_slot=10**9, baseline_bytes=4 * 10**8, micro_batch=100,
        ...                 peak_bytes=4 * 10**8 + 100_000, calibrated=True)
        >>> with_trial(p, 1, micro_batch=10_000, peak_bytes=6 * 10**8 + 100_000, model_memory=0
        ...            ).activation_bytes_per_example                       # 2e8 / 9900
        20203
    """
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
    """The calibrated ``profile`` after a trial at ``stage`` ran out of memory at ``micro_batch``:
    predicted to fit ``micro_batch - 1`` at most. Unchanged when it already predicts less.

    At the profiled stage above k the line through k's peak is made steep enough to reach the
    budget at ``micro_batch`` (the slope nearest the boundary, as a measured point would give);
    otherwise (another stage, or at most k) the stage's extra is what makes it so. Pure; rank 0
    by use.

    Example:
        >>> p = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=1000,
        ...                 memory_per_slot=10**9, baseline_bytes=4 * 10**8, micro_batch=100,
        ...                 peak_bytes=4 * 10**8 + 100_000, calibrated=True)
        >>> q = with_oom(p, 1, micro_batch=300_000, model_memory=0, data_parallel_size=2)
        >>> approx_max_micro_batch(q, 1, data_parallel_size=2)
        299900
    """
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
