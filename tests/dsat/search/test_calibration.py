"""Calibration (toolkit/dsat/search/calibration.py): where the profiling trials measure, and the
model fitted to their peaks (pure arithmetic, no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.dsat.contract import ProfileInfo
from toolkit.dsat.search.calibration import (
    CALIBRATION_MAX,
    calibrate,
    calibration_micro_batch,
    refit,
    stage_point_micro_batch,
    time_capped_point,
)
from toolkit.dsat.search.memory import approx_max_micro_batch, model_memory_bytes, predict, with_stage_extra

MIB = 2 ** 20


def _measured(mb, peak, *, act=1000, n=10 ** 6, mem=1024 * MIB):
    return ProfileInfo(num_params=n, trainable_params=n, activation_bytes_per_example=act,
                       memory_per_slot=mem, baseline_bytes=300 * MIB, micro_batch=mb, peak_bytes=peak)


def test_calibrated_prediction_is_the_peak_slope_per_stage():
    # A simulated process: peak(mb) = 300 MiB + model state at the profiled stage + 2 MiB per example.
    # The first trial's leaf outputs (1000 bytes/example) miss almost all of the 2 MiB.
    dp, stage0 = 2, 1
    state = {s: model_memory_bytes(_measured(1, 1), s, data_parallel_size=dp) for s in (1, 2, 3)}
    peak = lambda mb: 300 * MIB + state[stage0] + 2 * MIB * mb   # noqa: E731
    first, second = _measured(1, peak(1)), _measured(40, peak(40))
    profile = calibrate(first, second, model_memory=state[stage0])
    assert profile.calibrated and profile.activation_bytes_per_example == 2 * MIB
    assert profile.baseline_bytes == 300 * MIB
    for s in (1, 2, 3):
        # floor((budget - peak(1) - (state(s) - state(1))) / slope) + 1 = the true boundary
        true = (1024 * MIB - 300 * MIB - state[s]) // (2 * MIB)
        assert approx_max_micro_batch(profile, s, data_parallel_size=dp) == true
        assert peak(true) - state[stage0] + state[s] <= 1024 * MIB < peak(true + 1) - state[stage0] + state[s]
    uncalibrated = approx_max_micro_batch(first, 1, data_parallel_size=dp)
    assert uncalibrated > 100 * approx_max_micro_batch(profile, 1, data_parallel_size=dp)


def test_calibration_never_goes_below_the_leaf_outputs_and_checks_its_inputs():
    # a peak that did not grow (allocator noise) falls back on the first trial's leaf outputs
    profile = calibrate(_measured(1, 500 * MIB, act=4096), _measured(8, 499 * MIB, act=4096), model_memory=0)
    assert profile.activation_bytes_per_example == 4096
    with pytest.raises(ValueError, match="increasing"):
        calibrate(_measured(8, 1), _measured(8, 2), model_memory=0)
    with pytest.raises(ValueError, match="peak_bytes"):
        calibrate(_measured(1, 0), _measured(8, 2), model_memory=0)


def test_calibration_micro_batch_is_a_fraction_of_the_estimate_capped():
    # uncalibrated estimate at stage 1, dp 2: (1 GiB - 300 MiB - 10 MB state) // 1000 bytes ~ 749,000
    first = _measured(1, 400 * MIB)
    assert calibration_micro_batch(first, 1, data_parallel_size=2) == CALIBRATION_MAX
    # a 100 ms step at micro-batch 1: at most 3 s per step -> 30
    assert calibration_micro_batch(first, 1, data_parallel_size=2, latency_ms=100.0) == 30
    small = _measured(1, 400 * MIB, act=50 * MIB)        # estimate 14 -> 10% is 1 -> at least 2
    assert calibration_micro_batch(small, 1, data_parallel_size=2) == 2
    assert calibration_micro_batch(_measured(1, 0), 1, data_parallel_size=2) is None   # no peak measured
    calibrated = calibrate(first, _measured(9, 420 * MIB), model_memory=0)
    assert calibration_micro_batch(calibrated, 1, data_parallel_size=2) is None


def _calibrated_at_stage_1(dp):
    """Calibrated at stage 1 from micro-batches 1 and 40: 300 MiB + state + 2 MiB per example."""
    state = {s: model_memory_bytes(_measured(1, 1), s, data_parallel_size=dp) for s in (1, 2, 3)}
    first = _measured(1, 300 * MIB + state[1] + 2 * MIB)
    second = _measured(40, 300 * MIB + state[1] + 80 * MIB)
    return calibrate(first, second, model_memory=state[1]), state


def test_the_calibrated_profile_keeps_its_calibration_point():
    profile, state = _calibrated_at_stage_1(2)
    assert profile.micro_batch == 40 and profile.peak_bytes == 300 * MIB + state[1] + 80 * MIB
    with pytest.raises(ValueError, match="at least the calibration point 40"):
        with_stage_extra(profile, 3, micro_batch=39, peak_bytes=1, model_memory=state[3])


def test_a_stage_is_measured_at_half_its_predicted_boundary_between_k_and_4k():
    dp = 2
    profile, state = _calibrated_at_stage_1(dp)
    approx = approx_max_micro_batch(profile, 3, data_parallel_size=dp)      # ~362 on the line
    assert stage_point_micro_batch(profile, 3, data_parallel_size=dp) == min(approx // 2, 160)
    # a tight budget: half the boundary is below k -> k
    tight = ProfileInfo.from_json({**profile.to_json(), "memory_per_slot": 300 * MIB + state[3] + 100 * MIB})
    assert stage_point_micro_batch(tight, 3, data_parallel_size=dp) == 40
    # a roomy one: at most 4 k
    roomy = ProfileInfo.from_json({**profile.to_json(), "memory_per_slot": 64 * 1024 * MIB})
    assert stage_point_micro_batch(roomy, 3, data_parallel_size=dp) == 160


def test_an_extra_measured_beyond_k_is_the_same_extra_per_example():
    # stage 3 measured at 120 (> k = 40): 96 MiB over the line = 0.8 MiB per example
    dp = 2
    profile, state = _calibrated_at_stage_1(dp)
    peak3 = 300 * MIB + state[3] + 2 * MIB * 120 + 96 * MIB
    extra = with_stage_extra(profile, 3, micro_batch=120, peak_bytes=peak3, model_memory=state[3])
    assert extra.stage_extra_bytes == {"3": 32 * MIB}      # referred to k = 40: 0.8 MiB x 40
    free = 1024 * MIB - 300 * MIB - state[3]
    assert approx_max_micro_batch(extra, 3, data_parallel_size=dp) == free // (2 * MIB + 96 * MIB // 120)
    # a negative extra is not scaled: a fixed saving
    less = with_stage_extra(profile, 2, micro_batch=120, peak_bytes=300 * MIB + state[2] + 2 * MIB * 120
                            - 10 * MIB, model_memory=state[2])
    assert less.stage_extra_bytes == {"2": -10 * MIB}


def test_a_positive_stage_extra_grows_per_example_beyond_the_calibration_point():
    # a trial at stage 3 and micro-batch 40 peaked 64 MiB above the line: 1.6 MiB per example
    dp = 2
    profile, state = _calibrated_at_stage_1(dp)
    peak3 = 300 * MIB + state[3] + 2 * MIB * 40 + 64 * MIB
    extra = with_stage_extra(profile, 3, micro_batch=40, peak_bytes=peak3, model_memory=state[3])
    assert extra.stage_extra_bytes == {"3": 64 * MIB}
    assert approx_max_micro_batch(extra, 1, data_parallel_size=dp) == approx_max_micro_batch(
        profile, 1, data_parallel_size=dp)
    # the largest m with 300 MiB + state(3) + 2 MiB m + 64 MiB m / 40 <= 1 GiB: m (2 + 1.6) MiB <= free
    free = 1024 * MIB - 300 * MIB - state[3]
    m = approx_max_micro_batch(extra, 3, data_parallel_size=dp)
    assert m == free * 40 // (2 * MIB * 40 + 64 * MIB) == free // (2 * MIB + 64 * MIB // 40)
    assert 300 * MIB + state[3] + m * 2 * MIB + 64 * MIB * m / 40 <= 1024 * MIB
    assert 300 * MIB + state[3] + (m + 1) * 2 * MIB + 64 * MIB * (m + 1) / 40 > 1024 * MIB
    # taken as fixed it would have been larger: (free - 64 MiB) // 2 MiB
    assert m < (free - 64 * MIB) // (2 * MIB)
    # predict's free_bytes is what remains at the measured point (the extra as measured at k)
    assert predict(extra, data_parallel_size=dp, zero_stages=(3,))[3]["free_bytes"] == free - 64 * MIB
    assert ProfileInfo.from_json(extra.to_json()) == extra


def test_a_negative_stage_extra_stays_fixed_and_a_boundary_below_k_uses_the_measured_extra():
    dp = 2
    profile, state = _calibrated_at_stage_1(dp)
    # stage 2 held 30 MiB less than the line at 40: a fixed saving, not 0.75 MiB less per example
    peak2 = 300 * MIB + state[2] + 2 * MIB * 40 - 30 * MIB
    less = with_stage_extra(profile, 2, micro_batch=40, peak_bytes=peak2, model_memory=state[2])
    assert approx_max_micro_batch(less, 2, data_parallel_size=dp) == (
        1024 * MIB - 300 * MIB - state[2] + 30 * MIB) // (2 * MIB)
    # a stage extra so large that the fixed reading ends below k: up to k the extra is E as measured
    peak3 = 300 * MIB + state[3] + 2 * MIB * 40 + 660 * MIB
    big = with_stage_extra(profile, 3, micro_batch=40, peak_bytes=peak3, model_memory=state[3])
    fixed = (1024 * MIB - 300 * MIB - state[3] - 660 * MIB) // (2 * MIB)
    assert fixed <= 40 and approx_max_micro_batch(big, 3, data_parallel_size=dp) == fixed


def test_a_stage_out_of_memory_at_the_calibration_point_is_predicted_k_minus_1():
    # what the orchestrator records for a stage whose trial at k ran out of memory
    dp = 2
    profile, state = _calibrated_at_stage_1(dp)
    oom = with_stage_extra(profile, 3, micro_batch=40, peak_bytes=1024 * MIB + 2 * MIB, model_memory=state[3])
    assert approx_max_micro_batch(oom, 3, data_parallel_size=dp) == 39


@given(extra_mib=st.integers(-200, 400), k=st.integers(2, 200), slope_kib=st.integers(64, 8192))
@settings(max_examples=200, deadline=None)
def test_the_prediction_is_the_largest_micro_batch_under_the_larger_reading(extra_mib, k, slope_kib):
    # m fits iff baseline + state + slope m + extra(m) <= budget, extra(m) = E up to k and
    # max(E, E m / k) beyond; the model returns the largest such m (at least 1).
    slope, extra, budget, base = slope_kib * 1024, extra_mib * MIB, 1024 * MIB, 300 * MIB
    profile = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=slope,
                          memory_per_slot=budget, baseline_bytes=base, micro_batch=k, calibrated=True,
                          stage_extra_bytes={"3": extra})

    def fits(m):
        return base + slope * m + (extra if m <= k else max(extra, extra * m / k)) <= budget

    m = approx_max_micro_batch(profile, 3, data_parallel_size=2)
    if fits(1):
        assert fits(m) and not fits(m + 1)
    else:
        assert m == 1


def test_the_points_time_cap_follows_the_step_times_line():
    # 20 ms at 1, 25 ms at 100: 1000 ms (POINT_STEP_MS) at 100 + 975 / (5 / 99)
    assert time_capped_point((1, 20.0), (100, 25.0)) == 19405
    # a step already at 2 s: 4x its time, 8 s, at 100 + 6000 / (1990 / 99) = 398; at least 4 x 100
    assert time_capped_point((1, 10.0), (100, 2000.0)) == 400
    assert time_capped_point((1, 10.0), (100, 300.0)) == 100 + int(900 / (290 / 99)) == 407  # 4 x 300 ms
    # no growth, or points out of order: nothing to extrapolate (the caller keeps 4 k)
    assert time_capped_point((1, 30.0), (100, 25.0)) is None
    assert time_capped_point((100, 20.0), (1, 25.0)) is None


def test_refit_takes_the_slope_between_k_and_the_point():
    # peak(1) = 20 kB; peak(11) = 40 kB (the small step's one-off 18 kB makes 2000 B per example);
    # peak(111) = 90 kB: 500 B per example from k on, the line through (11, 40 kB)
    first = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=100,
                        memory_per_slot=100_000, micro_batch=1, peak_bytes=20_000)
    at_k = calibrate(first,
                     ProfileInfo.from_json({**first.to_json(), "micro_batch": 11, "peak_bytes": 40_000}),
                     model_memory=0)
    assert approx_max_micro_batch(at_k, 0, data_parallel_size=1) == (100_000 - 18_000) // 2000
    at_p = ProfileInfo.from_json({**first.to_json(), "micro_batch": 111, "peak_bytes": 90_000})
    refitted = refit(at_k, at_p, first=first, model_memory=0)
    assert (refitted.activation_bytes_per_example, refitted.baseline_bytes,
            refitted.micro_batch) == (500, 34_500, 111)
    assert approx_max_micro_batch(refitted, 0, data_parallel_size=1) == (100_000 - 34_500) // 500 == 131
    # a point that measured less than k (noise): the slope is floored at the leaf outputs (100 B),
    # or at the chord from peak(1) when that is smaller
    flat = ProfileInfo.from_json({**first.to_json(), "micro_batch": 111, "peak_bytes": 39_000})
    assert refit(at_k, flat, first=first, model_memory=0).activation_bytes_per_example == 100
    low = ProfileInfo.from_json({**first.to_json(), "micro_batch": 111, "peak_bytes": 25_500})
    assert refit(at_k, low, first=first, model_memory=0).activation_bytes_per_example == 50
