"""What every method shares (toolkit/dsat/search/lines.py, and make_searcher in the package):
trial caps, ids, termination, determinism, the metric's direction."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st
from searchsim import (
    FAILED,
    METHOD,
    OK,
    OOM,
    PROP,
    TIMEOUT,
    all_specs,
    check_bounds,
    drive,
    oracle,
    profile_with_range,
    settings_for,
)

from toolkit.dsat.contract import METRICS, ProfileInfo
from toolkit.dsat.search import AshaSearcher, BinarySearcher, RandomSearcher, best_result, make_searcher
from toolkit.dsat.search.types import SMALLER_IS_BETTER, SearchSettings, TrialResult, TrialSpec

# -- caps, ids, termination: all methods ---------------------------------------------------------
STAGES = st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True).map(tuple)


@PROP
@given(method=METHOD, stages=STAGES, max_trials=st.integers(2, 60), concurrency=st.integers(1, 8),
       hi=st.integers(1, 5000), limit=st.integers(0, 6000), seed=st.integers(0, 2**32),
       order_seed=st.integers(0, 1000), es=st.one_of(st.none(), st.integers(1, 6)),
       per_config=st.integers(1, 6), rungs=st.integers(1, 4), min_bs=st.integers(1, 4),
       divisor=st.integers(2, 4), asha_es=st.integers(0, 2))
def test_caps_ids_and_termination(method, stages, max_trials, concurrency, hi, limit, seed,
                                  order_seed, es, per_config, rungs, min_bs, divisor, asha_es):
    s = SearchSettings(method=method, zero_stages=stages, max_trials=max_trials, random_seed=seed,
                       early_stopping=es, trials_per_random_config=per_config, max_rungs=rungs,
                       min_binary_search_trials=min_bs, divisor=divisor, asha_early_stopping=asha_es)
    searcher = make_searcher(s, profile_with_range(hi))
    calls, results = drive(searcher, oracle(limit), concurrency=concurrency, order_seed=order_seed)
    specs = all_specs(calls)
    assert len(specs) <= max_trials - 1
    assert [spec.trial_id for spec in specs] == list(range(1, len(specs) + 1))
    assert sorted(r.spec.trial_id for r in results) == [spec.trial_id for spec in specs]
    assert all(spec.micro_batch >= 1 and spec.stage in stages and not spec.profile for spec in specs)
    assert searcher.done and searcher.propose(8) == []  # done stays done
    by_line = defaultdict(list)
    for spec in specs:
        by_line[spec.line].append(spec)
    for line_specs in by_line.values():  # a line is one ZeRO config
        assert all(spec.zero == line_specs[0].zero for spec in line_specs)
    assert len({repr(sorted(v[0].zero.items())) for v in by_line.values()}) == len(by_line)
    check_bounds(by_line, results, below_fits=method == "binary", metric=s.metric)
    # At most one trial of a line in flight at a time: replay the proposal/observation order.
    flying: set[int] = set()
    observed = iter(results)
    for call in calls:
        for spec in call:
            assert spec.line not in flying
            flying.add(spec.line)
        flying.discard(next(observed).spec.line)
    expected_best = best_result(results, s.metric)
    assert searcher.best is expected_best


@PROP
@given(method=METHOD, stages=STAGES, status=st.sampled_from([OOM, FAILED, TIMEOUT]),
       concurrency=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_all_failures_terminate_with_no_best(method, stages, status, concurrency, seed):
    s = settings_for(method, zero_stages=stages, max_trials=50, random_seed=seed)
    searcher = make_searcher(s, profile_with_range(1000))
    calls, results = drive(searcher, oracle(0, status=status), concurrency=concurrency)
    assert searcher.done and searcher.best is None and best_result(results, s.metric) is None
    assert all(r.status is status for r in results)


@pytest.mark.parametrize("method", ["binary", "random", "asha"])
def test_all_failures_end_when_the_space_is_exhausted(method):
    # Stage 0 has one config; a huge trial cap must not make the search go on forever.
    s = settings_for(method, zero_stages=(0,), max_trials=10_000)
    searcher = make_searcher(s, profile_with_range(1000))
    calls, results = drive(searcher, oracle(0), concurrency=4)
    assert searcher.done and 1 <= len(results) <= 11  # one line, bisected down to micro-batch 1


@pytest.mark.parametrize("method", ["binary", "random", "asha"])
def test_one_failure_among_successes_still_completes(method):
    s = settings_for(method, zero_stages=(1, 2), max_trials=20)
    searcher = make_searcher(s, profile_with_range(64))
    calls, results = drive(searcher, oracle({1: 40, 2: 50}, fail_ids={1}), concurrency=3)
    assert results[[r.spec.trial_id for r in results].index(1)].status is FAILED
    assert searcher.done and searcher.best is not None and searcher.best.status is OK
    assert len(results) == 19


# -- determinism ---------------------------------------------------------------------------------


def _events(method, seed, concurrency, order_seed, n_trials=25):
    s = settings_for(method, max_trials=n_trials, random_seed=seed, zero_stages=(1, 2, 3))
    searcher = make_searcher(s, profile_with_range(300))
    return drive(searcher, oracle({1: 100, 2: 150, 3: 280}), concurrency=concurrency, order_seed=order_seed)


@PROP
@given(method=METHOD, seed=st.integers(0, 2**16), concurrency=st.integers(1, 6),
       order_seed=st.integers(0, 99))
def test_same_seed_same_calls_same_trials(method, seed, concurrency, order_seed):
    a = _events(method, seed, concurrency, order_seed)
    b = _events(method, seed, concurrency, order_seed)
    assert a == b


def test_different_seeds_explore_differently():
    a, b = _events("random", 1, 2, 0), _events("random", 2, 2, 0)
    assert all_specs(a[0]) != all_specs(b[0])


@PROP
@given(method=METHOD, seed=st.integers(0, 2**16), splits=st.lists(st.integers(0, 4), min_size=1, max_size=6))
def test_split_proposals_equal_one_proposal(method, seed, splits):
    s = settings_for(method, random_seed=seed)
    one = make_searcher(s, profile_with_range(500)).propose(sum(splits))
    split = make_searcher(s, profile_with_range(500))
    assert [spec for n in splits for spec in split.propose(n)] == one


def test_observe_rejects_unknown_or_repeated_trials_and_ignores_profiling():
    searcher = make_searcher(settings_for("binary"), profile_with_range(300))
    (spec,) = searcher.propose(1)
    searcher.observe(TrialResult(TrialSpec(0, 1, {}, profile=True), OK))  # the profiling trial
    with pytest.raises(ValueError, match="trial 7 was not proposed"):
        searcher.observe(TrialResult(TrialSpec(7, 1, {}), OK))
    searcher.observe(oracle(100)(spec))
    with pytest.raises(ValueError, match="already observed"):
        searcher.observe(oracle(100)(spec))
    with pytest.raises(ValueError, match="capacity=-1"):
        searcher.propose(-1)


def test_specs_do_not_share_state_with_the_searcher_or_the_user_config():
    base = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 12}
    s = settings_for("binary", zero_stages=(2,), base_zero=base)
    searcher = make_searcher(s, profile_with_range(300))
    (spec,) = searcher.propose(1)
    searcher.observe(oracle(10)(spec))
    spec.zero["offload_optimizer"]["device"] = "nvme"
    (nxt,) = searcher.propose(1)
    assert nxt.line == spec.line and nxt.zero["offload_optimizer"] == {"device": "cpu"}
    assert base == {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 12}


def test_offload_in_the_user_config_widens_the_range():
    # fp32, N = 10**6: stage 2 with S = 1 holds 16 MB, 4 MB when the optimizer is offloaded.
    p = ProfileInfo(num_params=10**6, trainable_params=10**6, activation_bytes_per_example=10**5,
                    memory_per_slot=20 * 10**6)
    # latency: the first trial is the middle of the range (throughput: the grid point nearest it)
    plain = make_searcher(settings_for("binary", zero_stages=(2,), metric="latency"), p)
    offl = make_searcher(settings_for("binary", zero_stages=(2,), metric="latency",
                                      base_zero={"offload_optimizer": {"device": "cpu"}}), p)
    assert plain.propose(1)[0].micro_batch == (1 + 40) // 2
    assert offl.propose(1)[0].micro_batch == (1 + 120) // 2


# -- metric direction ----------------------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
def test_best_result_follows_the_metric_direction(metric):
    def res(i, value, status=OK):
        return TrialResult(TrialSpec(i, 1, {"stage": 1}), status, {metric: value} if status is OK else {})
    results = [res(1, 5.0), res(2, 1.0), res(3, 9.0), res(4, 0.5, OOM), res(5, float("nan")), res(6, 9.0)]
    best = best_result(results, metric)
    assert best.spec.trial_id == (2 if metric in SMALLER_IS_BETTER else 3)
    assert best_result([], metric) is None


@pytest.mark.parametrize("method", ["binary", "random", "asha"])
@pytest.mark.parametrize("metric", METRICS)
def test_searchers_rank_by_the_metric_direction(method, metric):
    s = settings_for(method, metric=metric, zero_stages=(0,), max_trials=40)
    searcher = make_searcher(s, profile_with_range(200))
    _, results = drive(searcher, oracle(123))
    # The oracle is fastest at the largest micro-batch: FLOPS/throughput highest, times lowest.
    largest_ok = max(r.spec.micro_batch for r in results if r.status is OK)
    assert searcher.best.spec.micro_batch == largest_ok
    assert searcher.best is best_result(results, metric)


def test_make_searcher_picks_the_method_class():
    p = profile_with_range(10)
    assert isinstance(make_searcher(settings_for("binary"), p), BinarySearcher)
    assert isinstance(make_searcher(settings_for("random"), p), RandomSearcher)
    assert isinstance(make_searcher(settings_for("asha"), p), AshaSearcher)
    with pytest.raises(TypeError, match="expected SearchSettings and ProfileInfo"):
        make_searcher({"method": "binary"}, p)


# -- a config judged both fitting and out of memory: decided by a repeat (issue 29 item 2) ---------
@pytest.mark.parametrize("repeat", [OK, OOM])
def test_a_conflicting_verdict_is_decided_by_a_repeat_not_by_the_last_one(repeat):
    # The profiling trial ran the user's config at micro-batch 2; the search's trial at the same
    # config is judged out of memory there (a start-up peak near the budget). The searcher moves no
    # bound on it, says so, and runs micro-batch 2 again first: that repeat decides (2 of 3).
    settings = dict(zero_stages=(1,), metric="throughput", max_trials=10)
    zero = make_searcher(settings_for("asha", **settings), profile_with_range(4)).propose(1)[0].zero
    searcher = make_searcher(settings_for("asha", base_zero=zero, **settings), profile_with_range(4))
    ran = TrialResult(TrialSpec(0, 2, zero, profile=True, label="p1"), OK, {"throughput": 1.0})
    assert searcher.observe_profiling([ran]) == [ran]
    (first,) = searcher.propose(1)
    assert (first.zero, first.micro_batch) == (zero, 2)
    searcher.observe(TrialResult(first, OOM))
    (note,) = searcher.notes
    assert note.startswith("trial 1 (stage 1, micro-batch 2) was judged out of memory, trial p1 of the same "
                           "config fitting (it ran): running it once more")
    again, other = searcher.propose(2)  # the repeat first, then the method's own next trial
    assert (again.trial_id, again.line, again.micro_batch) == (2, first.line, 2) and other.line != first.line
    searcher.observe(TrialResult(again, repeat, {"throughput": 1.0} if repeat is OK else {}))
    line = searcher._lines[first.line]
    assert (line.lo, line.hi) == ((3, 4) if repeat is OK else (1, 1))
    assert len(searcher.notes) == 1  # the repeat's own verdict is not a new conflict


@PROP
@given(method=METHOD, stages=STAGES, data=st.integers(1, 900), seed=st.integers(0, 2**16))
def test_a_micro_batch_the_scripts_data_cannot_give_caps_every_line(method, stages, data, seed):
    """A trial whose loader gave fewer examples than its micro-batch (``data_limit``) is a failure
    of that micro-batch alone: after it no line proposes a larger one, at any ZeRO config."""
    s = settings_for(method, zero_stages=stages, max_trials=40, random_seed=seed)
    searcher = make_searcher(s, profile_with_range(5000))

    def run(spec):
        if spec.micro_batch > data:
            return TrialResult(spec, FAILED, error="data set smaller than the micro-batch", data_limit=data)
        return TrialResult(spec, OK, {"FLOPS_per_gpu": float(spec.micro_batch), "throughput": 1.0,
                                      "forward": 1.0, "backward": 1.0, "latency": 1.0})

    calls, results = drive(searcher, run)
    first = next((i for i, r in enumerate(results) if r.data_limit is not None), None)
    if first is not None:
        later = {r.spec.trial_id for r in results[first + 1:]}
        proposed_after = [spec for call in calls for spec in call if spec.trial_id in later]
        assert all(spec.micro_batch <= data for spec in proposed_after), (data, proposed_after)
        assert any(f"at most {data} examples" in note for note in searcher.notes)
    assert TrialResult.from_json(results[-1].to_json()) == results[-1]
