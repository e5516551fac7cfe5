"""The memory model against hand-computed numbers (pure arithmetic, no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.dsat.contract import ProfileInfo
from toolkit.dsat.search import calibration
from toolkit.dsat.search.memory import (
    approx_max_micro_batch,
    format_prediction,
    model_memory_bytes,
    offload_flags,
    predict,
    predicted_peak_bytes,
)


def _profile(n=1000, n_t=1000, *, act=100, mem=17_000, base=0, half=False):
    return ProfileInfo(num_params=n, trainable_params=n_t, activation_bytes_per_example=act,
                       memory_per_slot=mem, baseline_bytes=base, half_precision=half)


# fp32, N = N_t = 1000: P = 4000, G = 4000, O = 8000.
# half, N = N_t = 1000: P = 2000, G = 4000, O = 12000.
@pytest.mark.parametrize("half,stage,s,expected", [
    (False, 0, 1, 16_000), (False, 1, 1, 16_000), (False, 2, 1, 16_000), (False, 3, 1, 16_000),
    (False, 0, 4, 16_000),
    (False, 1, 4, 4000 + 4000 + 8000 // 4),        # 10000
    (False, 2, 4, 4000 + (4000 + 8000) // 4),      # 7000
    (False, 3, 4, 16_000 // 4),                    # 4000
    (True, 0, 4, 18_000),
    (True, 1, 4, 2000 + 4000 + 12_000 // 4),       # 9000
    (True, 2, 4, 2000 + (4000 + 12_000) // 4),     # 6000
    (True, 3, 4, 18_000 // 4),                     # 4500
    (True, 3, 1, 18_000),
])
def test_model_memory_hand_computed(half, stage, s, expected):
    assert model_memory_bytes(_profile(half=half), stage, data_parallel_size=s) == expected


def test_frozen_parameters_carry_no_gradient_or_optimizer_state():
    # N = 1000, N_t = 500, fp32: P = 4000, G = 2000, O = 4000; S = 2.
    p = _profile(1000, 500)
    got = [model_memory_bytes(p, st_, data_parallel_size=2) for st_ in range(4)]
    assert got == [10_000, 4000 + 2000 + 2000, 4000 + 3000, 5000]


def test_offloaded_parts_leave_the_device():
    p = _profile()  # fp32, P = 4000, G = 4000, O = 8000, S = 4
    assert model_memory_bytes(p, 0, data_parallel_size=4, offload_optimizer=True) == 8000
    assert model_memory_bytes(p, 1, data_parallel_size=4, offload_optimizer=True) == 8000
    assert model_memory_bytes(p, 2, data_parallel_size=4, offload_optimizer=True) == 4000 + 1000
    assert model_memory_bytes(p, 3, data_parallel_size=4, offload_optimizer=True) == 2000
    assert model_memory_bytes(p, 3, data_parallel_size=4, offload_param=True) == 3000
    assert model_memory_bytes(p, 3, data_parallel_size=4, offload_param=True, offload_optimizer=True) == 1000


def test_partitions_round_up():
    # N = 1 fp32: 16 bytes over 3 slots -> 6, never 5.
    assert model_memory_bytes(_profile(1, 1), 3, data_parallel_size=3) == 6


def test_approx_max_micro_batch_hand_computed():
    assert approx_max_micro_batch(_profile(), 0, data_parallel_size=1) == (17_000 - 16_000) // 100
    assert approx_max_micro_batch(_profile(base=500), 0, data_parallel_size=1) == 5
    assert approx_max_micro_batch(_profile(), 3, data_parallel_size=4) == (17_000 - 4000) // 100
    # The model does not fit at all: still 1 (the search finds out with a real trial).
    assert approx_max_micro_batch(_profile(mem=1000), 0, data_parallel_size=1) == 1
    # No activation measured: taken as 1 byte, the bound stays finite.
    assert approx_max_micro_batch(_profile(act=0), 0, data_parallel_size=1) == 1000


@pytest.mark.parametrize("bad", [dict(stage=4), dict(stage=-1), dict(stage=True), dict(s=0), dict(s=1.5)])
def test_invalid_arguments_are_rejected(bad):
    with pytest.raises(ValueError, match="stage=|data_parallel_size="):
        model_memory_bytes(_profile(), bad.get("stage", 1), data_parallel_size=bad.get("s", 2))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 10**12), frac=st.floats(0, 1), half=st.booleans(), s=st.integers(2, 1024),
       off_opt=st.booleans(), off_par=st.booleans(), act=st.integers(0, 10**9),
       mem=st.integers(0, 10**14))
def test_higher_stages_never_need_more(n, frac, half, s, off_opt, off_par, act, mem):
    p = _profile(n, int(n * frac), act=act, mem=mem, half=half)
    kw = dict(data_parallel_size=s, offload_optimizer=off_opt, offload_param=off_par)
    mm = [model_memory_bytes(p, stage, **kw) for stage in range(4)]
    assert mm[3] <= mm[2] <= mm[1] <= mm[0]
    mb = [approx_max_micro_batch(p, stage, **kw) for stage in range(4)]
    assert 1 <= mb[0] <= mb[1] <= mb[2] <= mb[3]
    # One slot partitions nothing: every stage holds everything it keeps on the device.
    one = {model_memory_bytes(p, stage, data_parallel_size=1) for stage in range(4)}
    assert len(one) == 1


def test_offload_flags_follow_what_the_stage_allows():
    both = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}
    assert offload_flags({"stage": 0, **both}) == (False, False)
    assert offload_flags({"stage": 1, **both}) == (False, False)
    assert offload_flags({"stage": 2, **both}) == (True, False)
    assert offload_flags({"stage": 3, **both}) == (True, True)
    assert offload_flags({"stage": 3, "offload_optimizer": {"device": "none"}}) == (False, False)
    assert offload_flags({}) == (False, False)


def test_predict_and_table():
    p = _profile(mem=12_000)  # fp32: model 16000 at stage 0, 4000 at stage 3 with S = 4
    pred = predict(p, data_parallel_size=4, zero_stages=(3, 1, 0))
    assert list(pred) == [0, 1, 3]
    assert pred[0] == {"model_memory_bytes": 16_000, "free_bytes": -4000, "approx_max_micro_batch": 1,
                       "fits": False}
    assert pred[1]["model_memory_bytes"] == 10_000 and pred[1]["approx_max_micro_batch"] == 20
    assert pred[3] == {"model_memory_bytes": 4000, "free_bytes": 8000, "approx_max_micro_batch": 80,
                       "fits": True}
    off = predict(p, data_parallel_size=4, zero_stages=(0, 1, 3), offload_optimizer=True, offload_param=True)
    assert off[0]["model_memory_bytes"] == 16_000   # stage 0 cannot offload
    assert off[1]["model_memory_bytes"] == 8000
    assert off[3]["model_memory_bytes"] == 1000
    table = format_prediction(pred, profile=p)
    lines = table.splitlines()
    assert "1,000 (1,000 trainable)" in lines[0] and "fp32" in lines[0]
    assert len(lines) == 2 + 1 + 3
    assert lines[3].split()[0] == "0" and lines[3].endswith("(does not fit)")
    assert lines[5].split()[0] == "3" and lines[5].split()[-1] == "80"


# -- the ladder of points near the boundary (calibration.climb) and refits from trials ------------
# A simulated CPU process measured on the MLP client (width 1024, depth 4, 900 MB budget, ZeRO 1):
# the step's fixed buffers set the peak up to a knee near 1300 examples, then 32 KiB per example.
MIB, BUDGET = 2**20, 900 * 10**6


def _mlp_peak(m):
    return max(480 * MIB, 439 * MIB + 32 * 1024 * m)


def _concave_peak(m):  # bench_dsat's kind: one-off buffers fill the first 14 examples
    return 400 * MIB + 2 * MIB * min(m, 14) + 90 * 1024 * m


def _simulate(peak, *, leaf, step_ms):
    """(first profile, calibrated profile at k, the times, a measure(m) that runs the simulation)."""
    trials = []

    def profile_at(m):
        return ProfileInfo(num_params=5_258_250, trainable_params=5_258_250,
                           activation_bytes_per_example=leaf, memory_per_slot=BUDGET, baseline_bytes=0,
                           micro_batch=m, peak_bytes=peak(m))

    def measure(m):
        trials.append(m)
        if peak(m) > BUDGET:
            return "oom", None, None
        return "ok", profile_at(m), step_ms(m)

    first = profile_at(1)
    model = model_memory_bytes(first, 1, data_parallel_size=2)
    k = calibration.calibration_micro_batch(first, 1, data_parallel_size=2, latency_ms=step_ms(1))
    calibrated = calibration.calibrate(first, profile_at(k), model_memory=model)
    return first, calibrated, [(1, step_ms(1)), (k, step_ms(k))], measure, model, trials


def _boundary(peak):
    m = 1
    while peak(m + 1) <= BUDGET:
        m += 1
    return m


@pytest.mark.parametrize("peak,leaf,step_ms", [
    (_mlp_peak, 41_000, lambda m: 300.0 + 0.9 * m),       # the MLP: a step of fixed cost, a knee
    (_mlp_peak, 20_000, lambda m: 300.0 + 0.9 * m),       # leaf outputs that count half (the hidden client's)
    (_concave_peak, 30_000, lambda m: 20.0 + 3.0 * m),    # one-off buffers at small steps
    (_mlp_peak, 41_000, lambda m: 5.0 + 10.0 * m),        # slow examples: the time holds the ladder
])
def test_the_ladder_brings_the_prediction_within_20_percent(peak, leaf, step_ms):
    first, calibrated, times, measure, model, trials = _simulate(peak, leaf=leaf, step_ms=step_ms)
    before = approx_max_micro_batch(calibrated, 1, data_parallel_size=2)
    climbed = calibration.climb(calibrated, 1, data_parallel_size=2, first=first, times=times,
                                model_memory=model, measure=measure)
    after, found = approx_max_micro_batch(climbed, 1, data_parallel_size=2), _boundary(peak)
    assert len(trials) <= calibration.MAX_LADDER_POINTS
    ladder = [m for m, _ in times] + trials
    for a, b in zip(ladder[1:], ladder[2:], strict=False):   # each rung within 4x the last or 1 s
        assert step_ms(b) <= max(4 * step_ms(a), calibration.POINT_STEP_MS) * 1.01
    if step_ms(1) > 100:   # cheap examples: the ladder reaches near the boundary
        assert 0.8 <= after / found <= 1.2, (before, after, found, trials)
    else:                  # 10 ms an example: held by time, the ladder stops short, never worse than before
        assert abs(after / found - 1) <= abs(before / found - 1) + 0.01, (before, after, found, trials)


def test_a_ladder_point_out_of_memory_is_an_upper_bound_and_the_ladder_goes_on_below_it():
    # 30 KiB per example, then 400 KiB beyond 4000 (a buffer that appears only at large steps)
    steep = lambda m: 400 * MIB + 30 * 1024 * m + 400 * 1024 * max(m - 4000, 0)   # noqa: E731
    first, calibrated, times, measure, model, trials = _simulate(steep, leaf=40_000,
                                                                 step_ms=lambda m: 300.0 + 0.01 * m)
    climbed = calibration.climb(calibrated, 1, data_parallel_size=2, first=first, times=times,
                                model_memory=model, measure=measure)
    after, found = approx_max_micro_batch(climbed, 1, data_parallel_size=2), _boundary(steep)
    oom = [m for m in trials if steep(m) > BUDGET]
    ok = [m for m in trials if steep(m) <= BUDGET]
    assert oom and ok and max(ok) <= found < after < min(oom) <= 2 * max(ok), (after, found, trials)
    # a jump beyond every point can only be bracketed: the prediction is the bracket's top


def test_the_time_cap_counts_growth_below_the_noise_as_the_noise():
    assert calibration.time_capped_point((1, 309.0), (9, 301.0)) is None       # the single point's rule
    assert calibration.time_capped_point((1, 309.0), (9, 301.0), noise=0.1) == 9 + int(903 / (30.1 / 8))
    # real growth above the noise is taken as measured
    assert calibration.time_capped_point((1, 20.0), (100, 25.0), noise=0.1) == \
        calibration.time_capped_point((1, 20.0), (100, 25.0))


def test_next_point_stops_near_the_boundary_and_when_time_holds_it():
    p = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=40_000,
                    memory_per_slot=900 * 10**6, baseline_bytes=500 * 10**6, micro_batch=4500,
                    calibrated=True)
    assert calibration.next_point(p, 1, data_parallel_size=2, times=[(1, 300.0), (4500, 4000.0)]) is None
    near = ProfileInfo.from_json({**p.to_json(), "micro_batch": 100})
    # half of 10000, held by the time: 4 x 400 ms at 100 + 1200 / (100 / 99)
    assert calibration.next_point(near, 1, data_parallel_size=2, times=[(1, 300.0), (100, 400.0)]) == 1288
    # an out-of-memory above the point: halve the bracket until within 25%
    fast = [(1, 300.0), (100, 300.5)]
    assert calibration.next_point(near, 1, data_parallel_size=2, times=fast, oom_at=300) == 200
    assert calibration.next_point(near, 1, data_parallel_size=2, times=fast, oom_at=126) is None
    # one timing says nothing of a larger step's cost: the rung is held to 4x the point
    assert calibration.next_point(near, 1, data_parallel_size=2, times=[(100, 400.0)]) == 400


def test_a_fitting_trial_refits_the_profiled_stage_and_remeasures_another_stages_extra():
    k_peak = 500 * MIB
    p = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=41_000,
                    memory_per_slot=BUDGET, baseline_bytes=k_peak - 41_000 * 1000, micro_batch=1000,
                    peak_bytes=k_peak, calibrated=True, stage_extra_bytes={"3": 10 * MIB})
    # the profiled stage (no extra of its own): the chord from k's peak
    q = calibration.with_trial(p, 1, micro_batch=6000, peak_bytes=k_peak + 5000 * 32_000, model_memory=0)
    assert (q.activation_bytes_per_example, q.micro_batch) == (32_000, 6000)
    # within the noise of k's peak, or below k: nothing is learnt
    assert calibration.with_trial(p, 1, micro_batch=6000, peak_bytes=k_peak + MIB, model_memory=0) == p
    assert calibration.with_trial(p, 1, micro_batch=10, peak_bytes=k_peak + 100 * MIB, model_memory=0) == p
    # another stage: its extra measured again at this micro-batch, referred to k
    r = calibration.with_trial(p, 3, micro_batch=2000, peak_bytes=p.baseline_bytes + 41_000 * 2000 + 8 * MIB,
                               model_memory=0)
    assert r.stage_extra_bytes["3"] == 4 * MIB


@pytest.mark.parametrize("stage,m", [(1, 20_000), (1, 500), (3, 20_000), (3, 500), (2, 7000)])
def test_an_out_of_memory_trial_caps_the_prediction_below_it(stage, m):
    p = ProfileInfo(num_params=10**6, trainable_params=10**6, activation_bytes_per_example=20_000,
                    memory_per_slot=BUDGET, baseline_bytes=400 * MIB, micro_batch=1000,
                    peak_bytes=400 * MIB + 16 * 10**6 + 20_000 * 1000, calibrated=True,
                    stage_extra_bytes={"3": 10 * MIB, "2": -MIB})
    model = model_memory_bytes(p, stage, data_parallel_size=2)
    before = approx_max_micro_batch(p, stage, data_parallel_size=2)
    q = calibration.with_oom(p, stage, micro_batch=m, model_memory=model, data_parallel_size=2)
    after = approx_max_micro_batch(q, stage, data_parallel_size=2)
    assert after < m
    assert after >= 0.95 * (m - 1) or before < m
    # a prediction already below it is left as it is
    low = calibration.with_oom(p, stage, micro_batch=10**7, model_memory=model, data_parallel_size=2)
    assert low == p


@settings(max_examples=300, deadline=None)
@given(params=st.integers(1, 10**7), activation=st.integers(0, 10**6), budget=st.integers(1, 10**10),
       baseline=st.integers(0, 10**8), k=st.integers(0, 5000), extra=st.integers(-10**8, 10**8),
       stage=st.sampled_from([0, 1, 2, 3]), dp=st.integers(1, 8), offload=st.booleans())
def test_the_predicted_peak_curve_crosses_the_budget_at_the_predicted_largest_micro_batch(
        params, activation, budget, baseline, k, extra, stage, dp, offload):
    # dsat's TensorBoard draws predicted_peak_bytes against the budget: the line must cross it where
    # approx_max_micro_batch says the largest micro-batch is (unless not even micro-batch 1 fits)
    p = ProfileInfo(num_params=params, trainable_params=params, activation_bytes_per_example=activation,
                    memory_per_slot=budget, baseline_bytes=baseline, micro_batch=k,
                    stage_extra_bytes={str(stage): extra})
    kw = dict(data_parallel_size=dp, offload_optimizer=offload and stage >= 2)
    m = approx_max_micro_batch(p, stage, **kw)
    if predicted_peak_bytes(p, stage, m, **kw) <= budget:
        assert predicted_peak_bytes(p, stage, m + 1, **kw) > budget
    else:
        assert m == 1


def test_negative_parameter_counts_are_rejected():
    with pytest.raises(ValueError, match=r"num_params=-1, trainable_params=0: expected counts >= 0"):
        model_memory_bytes(_profile(-1, 0), 0, data_parallel_size=1)


def test_the_table_writes_terabytes_past_the_largest_unit():
    p = _profile(2**40, 2**40, act=3 * 2**20, mem=2**50)  # fp32: 16 bytes a parameter, 16 TiB at stage 0
    lines = format_prediction(predict(p, data_parallel_size=1, zero_stages=(0,)), profile=p).splitlines()
    assert "memory per slot: 1024.00 TiB" in lines[1] and "per example: 3.00 MiB" in lines[1]
    assert lines[3].split()[:3] == ["0", "16.00", "TiB"]


def test_a_ladder_point_that_fails_otherwise_ends_the_ladder_with_the_profile_unchanged():
    first, calibrated, times, measure, model, trials = _simulate(_mlp_peak, leaf=41_000,
                                                                 step_ms=lambda m: 300.0 + 0.9 * m)
    asked = []

    def crashes(m):
        asked.append(m)
        return "failed", None, None

    climbed = calibration.climb(calibrated, 1, data_parallel_size=2, first=first, times=times,
                                model_memory=model, measure=crashes)
    assert len(asked) == 1 and asked[0] > calibrated.micro_batch
    assert climbed == calibrated
