"""The global batch policy, the trial-timeout cap and offload when nothing fits (pure logic)."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.dsat.contract import ProfileInfo, TrialStatus
from toolkit.dsat.search import make_searcher
from toolkit.dsat.search.batch import (
    GlobalBatch,
    allowed_micro_batches,
    global_batch_policy,
    step_time_line,
    time_capped_micro_batch,
)
from toolkit.dsat.search.offload import (
    first_level,
    level_stages,
    nothing_fits_at_one,
    offload_levels,
    offload_zero,
)
from toolkit.dsat.search.space import default_zero_autos
from toolkit.dsat.search.types import SearchSettings, TrialResult, TrialSpec
from toolkit.errors import ConfigError

OK, OOM = TrialStatus.OK, TrialStatus.OOM
METHODS = ("binary", "random", "asha")


def drive(searcher, run, *, max_steps=2000):
    """Propose one trial at a time until the searcher is done; the results in order."""
    results = []
    for _ in range(max_steps):
        if searcher.done:
            return results
        specs = searcher.propose(1)
        assert specs, "not done but proposes nothing"
        result = run(specs[0])
        searcher.observe(result)
        results.append(result)
    raise AssertionError("the search did not end")


def limit_oracle(limit):
    """OOM above ``limit(spec)``; metrics grow with the micro-batch."""
    def run(spec: TrialSpec) -> TrialResult:
        if spec.micro_batch > limit(spec):
            return TrialResult(spec, OOM, error="simulated out of memory")
        speed = float(spec.micro_batch * (4 - spec.stage))
        return TrialResult(spec, OK, {"FLOPS_per_gpu": speed, "throughput": speed, "forward": 1 / speed,
                                      "backward": 1 / speed, "latency": 1 / speed})
    return run


# ------------------------------------------------------------------ the policy
def test_the_policy_keeps_an_integer_fixes_n_or_frees():
    assert global_batch_policy(None, user_train_batch_size=64) == GlobalBatch("keep", 64)
    assert global_batch_policy(None, user_train_batch_size="auto") == GlobalBatch("free")
    assert global_batch_policy(None, user_train_batch_size=None) == GlobalBatch("free")
    assert global_batch_policy(None, user_train_batch_size=-2) == GlobalBatch("free")  # reported elsewhere
    assert global_batch_policy("free", user_train_batch_size=64) == GlobalBatch("free")
    assert global_batch_policy(48, user_train_batch_size=64) == GlobalBatch("fixed", 48)
    with pytest.raises(ConfigError, match="--global-batch keep.*train_batch_size"):
        global_batch_policy("keep", user_train_batch_size="auto")
    with pytest.raises(ConfigError, match="--global-batch 0"):
        global_batch_policy(0, user_train_batch_size=64)
    assert "keep train_batch_size=64" in GlobalBatch("keep", 64).describe()
    assert GlobalBatch("fixed", 8).to_json() == {"policy": "fixed", "train_batch_size": 8}


def test_allowed_micro_batches_are_the_divisors_per_rank():
    assert allowed_micro_batches(64, data_parallel_size=2) == (1, 2, 4, 8, 16, 32)
    assert allowed_micro_batches(24, data_parallel_size=2) == (1, 2, 3, 4, 6, 12)
    assert allowed_micro_batches(7, data_parallel_size=7) == (1,)
    with pytest.raises(ConfigError, match="train_batch_size=63 is not a multiple of the data-parallel size"):
        allowed_micro_batches(63, data_parallel_size=2)


def test_time_cap_is_linear_in_the_micro_batch():
    # 10 s start-up, 5 steps of 100 ms x micro-batch within 60 s: micro-batch 100.
    assert time_capped_micro_batch(100.0, steps=5, timeout_s=60.0, overhead_s=10.0) == 100
    assert time_capped_micro_batch(100.0, steps=5, timeout_s=5.0, overhead_s=10.0) == 1
    assert time_capped_micro_batch(0.0, steps=5, timeout_s=60.0) is None



def test_time_cap_follows_the_step_times_line():
    # 10 s start-up, 5 steps of 100 ms at micro-batch 1 + 1 ms per example above it, within 60 s:
    # 100 + (m - 1) <= 10000 ms a step, so m = 9901 (not 100, the fixed cost scaled with the batch).
    assert time_capped_micro_batch(100.0, steps=5, timeout_s=60.0, overhead_s=10.0,
                                   per_example_ms=1.0) == 9901
    # Anchored at a larger micro-batch that already runs past the room: that micro-batch, not less.
    assert time_capped_micro_batch(20_000.0, steps=5, timeout_s=60.0, overhead_s=10.0, micro_batch=64,
                                   per_example_ms=1.0) == 64
    assert time_capped_micro_batch(100.0, steps=5, timeout_s=60.0, per_example_ms=0.0) is None


def test_the_step_line_takes_the_steepest_slope_from_the_smallest_micro_batch():
    # Stage 1 at 101 (1 ms per example beyond 1), stage 3 at 201 (1.5 ms): the slower bounds both.
    assert step_time_line([(101, 200.0), (1, 100.0), (201, 400.0)]) == (1, 100.0, 1.5)
    # One micro-batch, or only noise below the first: through the origin from it.
    assert step_time_line([(4, 100.0)]) == (4, 100.0, 25.0)
    assert step_time_line([(1, 100.0), (50, 90.0)]) == (1, 100.0, 100.0)
    # Unmeasured trials (no latency) are left out; nothing measured is no line.
    assert step_time_line([(1, 100.0), (300, 0.0)]) == (1, 100.0, 100.0)
    assert step_time_line([(1, 0.0)]) is None

def test_default_zero_autos_fill_only_the_model_size_values():
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "overlap_comm": True}
    assert default_zero_autos(zero) == {"stage": 3, "reduce_bucket_size": 500_000_000,
                                        "stage3_prefetch_bucket_size": 50_000_000,
                                        "stage3_param_persistence_threshold": 100_000, "overlap_comm": True}
    assert zero["reduce_bucket_size"] == "auto"  # not mutated
    assert default_zero_autos(True) is True


# ------------------------------------------------------------------ the searchers keep it
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("allowed, limit", [((1, 2, 4, 8, 16, 32), 11), ((1, 2, 3, 4, 6, 12), 5),
                                            ((1, 2, 3, 4, 6, 12), 100)])
def test_every_method_proposes_only_allowed_micro_batches(method, allowed, limit):
    settings = SearchSettings(method=method, max_trials=30, micro_batches=allowed, zero_stages=(1, 2))
    profile = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=1,
                          memory_per_slot=1000)  # the memory model allows far more than the list
    results = drive(make_searcher(settings, profile), limit_oracle(lambda spec: limit))
    assert results and all(r.spec.micro_batch in allowed for r in results)
    best_ok = max(m for m in allowed if m <= limit)
    assert max(r.spec.micro_batch for r in results if r.status is OK) == best_ok


def test_binary_bisects_the_sorted_allowed_list():
    allowed = (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)
    settings = SearchSettings(method="binary", max_trials=4, micro_batches=allowed, zero_stages=(1,),
                              bisect_tolerance=0.0, metric="latency")
    profile = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=1,
                          memory_per_slot=30)
    results = drive(make_searcher(settings, profile), limit_oracle(lambda spec: 10))
    # the memory model's 30 clamps the range to 24 (the largest allowed <= 30): [1..24] has 9 entries;
    # midpoints over the list: 6 ok, then [8, 12, 16, 24] -> 12 oom, then [8] -> 8 ok: closed at 8
    assert [r.spec.micro_batch for r in results] == [6, 12, 8]


@pytest.mark.parametrize("method", METHODS)
def test_the_time_cap_bounds_every_trial(method):
    settings = SearchSettings(method=method, max_trials=25, max_micro_batch=7, zero_stages=(1, 2),
                              bisect_tolerance=0.0)
    profile = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=1,
                          memory_per_slot=500)
    results = drive(make_searcher(settings, profile), limit_oracle(lambda spec: 100))
    assert max(r.spec.micro_batch for r in results) == 7


# ------------------------------------------------------------------ offload when nothing fits
def test_offload_levels_and_sections():
    assert offload_levels("auto", (1, 2, 3)) == ("none", "optimizer", "param")
    assert offload_levels("auto", (0, 1)) == ("none",)
    assert offload_levels("auto", (1, 2)) == ("none", "optimizer")
    assert offload_levels("never", (1, 2, 3)) == ("none",)
    assert offload_levels("always", (1, 2, 3)) == ("optimizer", "param")
    assert level_stages((1, 2, 3), "param") == (3,)
    assert offload_zero({"stage": 2}, "optimizer") == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    user = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}
    assert offload_zero(user, "param") == {**user, "offload_param": {"device": "cpu"}}  # the user's kept
    assert first_level(("none", "optimizer", "param"), lambda level: level == "optimizer") == 1
    assert first_level(("none", "optimizer"), lambda level: False) == 1


def _result(stage, mb, status):
    return TrialResult(TrialSpec(1, mb, {"stage": stage}), status)


def test_nothing_fits_at_one_needs_every_stage_out_of_memory_at_1_and_no_success():
    assert nothing_fits_at_one([_result(1, 1, OOM), _result(2, 1, OOM)], (1, 2))
    assert not nothing_fits_at_one([_result(1, 1, OOM), _result(2, 4, OOM)], (1, 2))
    assert not nothing_fits_at_one([_result(1, 1, OOM), _result(2, 1, OOM), _result(2, 1, OK)], (1, 2))
    assert not nothing_fits_at_one([], (1,))


# Model state 16 bytes/param (fp32 Adam: 4 + 4 + 8), 1000 params, one slot: stage 1-3 hold 16000
# bytes unless offloaded; optimizer offload leaves 8000 (stage 2) / 8000 (stage 3), param offload 4000.
def _profile(budget):
    return ProfileInfo(num_params=1000, trainable_params=1000, activation_bytes_per_example=100,
                       memory_per_slot=budget)


@pytest.mark.parametrize("budget, level", [(20_000, "none"), (9_000, "optimizer"), (5_000, "param"),
                                           (1_000, "param")])
def test_the_memory_model_chooses_the_first_level_that_fits(budget, level):
    searcher = make_searcher(SearchSettings(method="binary", max_trials=5), _profile(budget))
    spec = searcher.propose(1)[0]
    assert searcher.level == level
    assert ("offload_optimizer" in spec.zero) == (level != "none")
    assert ("offload_param" in spec.zero) == (level == "param")
    if level != "none":
        assert spec.stage in level_stages((1, 2, 3), level)


def test_never_and_always():
    never = make_searcher(SearchSettings(method="binary", max_trials=5, offload="never"), _profile(1_000))
    assert never.level == "none" and "offload_optimizer" not in never.propose(1)[0].zero
    always = make_searcher(SearchSettings(method="binary", max_trials=5, offload="always"), _profile(10**9))
    assert always.level == "optimizer" and always.propose(1)[0].zero["offload_optimizer"] == {"device": "cpu"}
    with pytest.raises(ConfigError, match="--offload=always with --zero-stages=\\[0, 1\\]"):
        SearchSettings(method="binary", offload="always", zero_stages=(0, 1))
    with pytest.raises(ConfigError, match="--offload='sometimes'"):
        SearchSettings(method="binary", offload="sometimes")


@pytest.mark.parametrize("method, activation", [("binary", 100), ("random", 100), ("binary", 4000),
                                                ("random", 4000), ("asha", 4000)])
def test_every_stage_out_of_memory_at_1_moves_to_offload(method, activation):
    # Activations of 100 bytes: the memory model says micro-batch 2 fits without offload; of 4000:
    # only with optimizer offload (it starts there). The trials say nothing fits but with parameter
    # offload. (asha promotes no line without a success, so its lines reach micro-batch 1 only
    # when the model's range is small: the 4000 case.)
    settings = SearchSettings(method=method, max_trials=60, zero_stages=(1, 2, 3), random_seed=3)
    searcher = make_searcher(settings, dataclasses.replace(_profile(16_200),
                                                           activation_bytes_per_example=activation))

    def limit(spec):
        return 8 if "offload_param" in spec.zero else 0
    results = drive(searcher, limit_oracle(limit))
    assert searcher.level == "param"
    ok = [r for r in results if r.status is OK]
    assert ok and all(r.spec.stage == 3 and "offload_param" in r.spec.zero for r in ok)
    first_param = next(i for i, r in enumerate(results) if "offload_param" in r.spec.zero)
    assert all(r.status is OOM for r in results[:first_param])
    at_one = {r.spec.stage for r in results[:first_param] if r.spec.micro_batch == 1
              and "offload_optimizer" in r.spec.zero}
    assert at_one == {2, 3}  # both stages of the optimizer level ran out of memory at 1 first
    if activation == 100:
        first_optimizer = next(i for i, r in enumerate(results) if "offload_optimizer" in r.spec.zero)
        assert {r.spec.stage for r in results[:first_optimizer] if r.spec.micro_batch == 1} == {1, 2, 3}
    else:
        assert "offload_optimizer" in results[0].spec.zero  # the memory model started there


def test_no_offload_while_a_stage_fits():
    settings = SearchSettings(method="binary", max_trials=20, zero_stages=(1, 2, 3))
    results = drive(make_searcher(settings, _profile(10**6)),
                    limit_oracle(lambda spec: 4 if spec.stage == 3 else 0))
    assert all("offload_optimizer" not in r.spec.zero for r in results)


@pytest.mark.parametrize("policy,size,message", [
    ("both", 64, r"global batch policy='both': expected one of keep, fixed, free"),
    ("free", 64, r"global batch policy 'free' with train_batch_size=64: a free policy fixes no global batch"),
    ("keep", None, r"train_batch_size=None: expected an integer"),
    ("fixed", 0, r"train_batch_size=0: expected an integer >= 1"),
])
def test_a_global_batch_policy_is_validated_on_construction(policy, size, message):
    with pytest.raises(ConfigError, match=message):
        GlobalBatch(policy, size)


def test_an_unknown_offload_mode_is_rejected_naming_the_modes():
    with pytest.raises(ValueError, match=r"offload mode 'sometimes': expected one of auto, never, always"):
        offload_levels("sometimes", (1, 2, 3))
