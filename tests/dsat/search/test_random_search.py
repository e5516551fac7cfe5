"""The random method (toolkit/dsat/search/random_search.py): bounds, trials per configuration,
early stopping."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st
from searchsim import OK, PROP, all_specs, check_bounds, drive, oracle, profile_with_range, settings_for

from toolkit.dsat.search import make_searcher
from toolkit.dsat.search.types import TrialResult


@PROP
@given(per_config=st.integers(1, 6), seed=st.integers(0, 2**16), concurrency=st.integers(1, 4))
def test_random_caps_trials_per_config_and_randomizes_within_bounds(per_config, seed, concurrency):
    s = settings_for("random", zero_stages=(1, 2), max_trials=40, random_seed=seed,
                     trials_per_random_config=per_config)
    calls, results = drive(make_searcher(s, profile_with_range(10**6)), oracle(5 * 10**5),
                           concurrency=concurrency)
    per_line = Counter(spec.line for spec in all_specs(calls))
    assert max(per_line.values()) <= per_config
    by_line = defaultdict(list)
    for spec in all_specs(calls):
        by_line[spec.line].append(spec)
    check_bounds(by_line, results)


def test_random_micro_batch_is_random_not_bisection():
    s = settings_for("random", zero_stages=(1,), max_trials=40)
    specs = make_searcher(s, profile_with_range(10**6)).propose(30)
    assert len({spec.micro_batch for spec in specs}) > 20


@PROP
@given(seed=st.integers(0, 2**16), concurrency=st.integers(1, 6),
       stages=st.sampled_from([(1, 3), (2, 3), (1, 2, 3)]))
def test_random_stops_stage3_once_stage_1_or_2_fits(seed, concurrency, stages):
    s = settings_for("random", zero_stages=stages, max_trials=50, random_seed=seed)
    searcher = make_searcher(s, profile_with_range(1000))
    calls, results = drive(searcher, oracle(600), concurrency=concurrency)
    observed = iter(results)
    fitted = False
    for call in calls:  # calls and observations alternate, one observation after each call
        assert not (fitted and any(spec.stage == 3 for spec in call))
        r = next(observed)
        fitted = fitted or (r.status is OK and r.spec.stage in (1, 2))
    # Not vacuous: a lower stage fitted, unless every line drawn was stage 3 (with stages (1, 3)
    # about 2**-10 for ten lines; hypothesis found seed 11587 on 2026-11-24, failing before as well).
    assert fitted or all(spec.stage == 3 for spec in all_specs(calls))


def test_random_stops_a_line_that_fails_at_its_lower_bound():
    s = settings_for("random", zero_stages=(0,), max_trials=200, trials_per_random_config=100)
    for seed in range(20):
        searcher = make_searcher(dataclasses.replace(s, random_seed=seed), profile_with_range(1000))
        calls, results = drive(searcher, oracle(0))  # everything OOMs: lower bound stays 1
        assert results[-1].spec.micro_batch == 1 and searcher.done
        assert sum(r.spec.micro_batch == 1 for r in results) == 1


@pytest.mark.parametrize("n", [1, 3, 5])
def test_random_early_stopping_without_improvement(n):
    # Only the first trial improves (all metrics equal afterwards would not beat it: ties lose).
    def flat(spec):
        return TrialResult(spec, OK, {"FLOPS_per_gpu": 1.0})
    s = settings_for("random", zero_stages=(1, 2, 3), max_trials=50, early_stopping=n)
    _, results = drive(make_searcher(s, profile_with_range(1000)), flat)
    assert len(results) == 1 + n
    # All failures: no trial ever improves.
    _, results = drive(make_searcher(s, profile_with_range(1000)), oracle(0), concurrency=1)
    assert len(results) == n
    # With concurrency, trials already running when it stops still finish and are observed.
    _, results = drive(make_searcher(s, profile_with_range(1000)), oracle(0), concurrency=4)
    assert n <= len(results) <= n + 3


def test_random_without_early_stopping_uses_the_budget():
    s = settings_for("random", zero_stages=(1, 2, 3), max_trials=30)
    _, results = drive(make_searcher(s, profile_with_range(1000)),
                       lambda spec: TrialResult(spec, OK, {"FLOPS_per_gpu": 1.0}))
    assert len(results) == 29
