"""The binary method (toolkit/dsat/search/binary.py): Determined's upward bisection with a tolerance, the
profiling trials taken as results, dominated stages, and the measured CPU benchmark curves."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from searchsim import (
    FAILED,
    LARGER,
    OK,
    OOM,
    PROP,
    TIMEOUT,
    all_specs,
    check_bounds,
    drive,
    measured,
    oracle,
    peaked,
    profile_with_range,
    profiling,
    settings_for,
)

from toolkit.dsat.search import best_result, make_searcher
from toolkit.dsat.search.types import SMALLER_IS_BETTER, TrialResult


def bisection(hi: int, target: int, tolerance: float = 0.0) -> tuple[list[int], int]:
    """The upward search of one line, written out independently: bisect ``[1, hi]`` (fits iff
    ``m <= target``) until the range closes or, after a success, ``hi - f <= tolerance * f``
    with ``f = lo - 1``. With tolerance 0 this is the exact bisection binary always did.
    Returns (micro-batches tried, f)."""
    lo, tried = 1, []
    while lo <= hi and not (lo > 1 and hi - (lo - 1) <= tolerance * (lo - 1)):
        m = (lo + hi) // 2
        tried.append(m)
        lo, hi = (m + 1, hi) if m <= target else (lo, m - 1)
    return tried, lo - 1


def tolerance_bound(hi: int, target: int, tolerance: float) -> int:
    """The documented bound on upward trials: floor(log2 hi) + 1, and for tolerance > 0 also the
    smallest k with hi / 2**k <= tol * T / (1 + tol), T = target (exact rational arithmetic)."""
    exact = math.floor(math.log2(hi)) + 1
    if tolerance == 0:
        return exact
    tol, k = Fraction(tolerance), 0
    while Fraction(hi, 2**k) > tol * target / (1 + tol):
        k += 1
    return min(exact, k)


def split_line(results: list[TrialResult], hi: int, tolerance: float) -> tuple[list, list, int]:
    """One line's results (in order) -> (upward trials, downward probes, largest fitting f)."""
    lo = 1
    for i, r in enumerate(results):
        if lo > hi or (lo > 1 and hi - (lo - 1) <= tolerance * (lo - 1)):
            return results[:i], results[i:], lo - 1
        m = r.spec.micro_batch
        assert lo <= m <= hi, (i, r.spec, lo, hi)
        lo, hi = (m + 1, hi) if r.status is OK else (lo, m - 1)
    return results, [], lo - 1


# -- binary: the bounds and their proofs ---------------------------------------------------------
# toolkit/dsat/search/binary.py states these bounds; each is proved here, next to the property
# tests that check it. A line bisects [1, hi]; T is its largest fitting micro-batch (1 <= T <= hi,
# the oracle fits iff m <= T; FAILED and TIMEOUT count like OOM), f = lo - 1 the largest fitting
# one the search found, n = hi - lo + 1 the micro-batches of the open range.
#
# (R) After k upward trials the range holds at most floor(hi / 2**k) micro-batches, and
#     lo - 1 <= T <= hi. The trial is at m = (lo + hi) // 2: a success leaves [m + 1, hi],
#     hi - m = floor(n / 2) micro-batches, and m <= T; a failure leaves [lo, m - 1],
#     floor((n - 1) / 2) <= floor(n / 2) of them, and m > T so m - 1 >= T; and
#     floor(floor(x) / 2) = floor(x / 2).              test_the_range_halves_and_keeps_the_target
# (B0) bisect_tolerance = 0: by (R) the range is empty (closed) once 2**k > hi, i.e. after at
#     most floor(log2 hi) + 1 trials; then lo - 1 <= T <= hi = lo - 1: f = T.
#                             test_zero_tolerance_is_the_exact_bisection_within_the_log2_bound
# (Bt) bisect_tolerance = tol > 0: whenever it stops, T - f <= tol * f (closed: f = T; else
#     T <= hi gives T - f <= hi - f <= tol * f), i.e. f >= T / (1 + tol). It stops within
#     min(floor(log2 hi) + 1, ceil(log2((1 + tol) * hi / (tol * T)))) trials: after that many,
#     by (R), n = hi - f <= tol * T / (1 + tol) < T, so f >= 1 (lo = 1 would give n >= T), and
#     f >= T - n >= T / (1 + tol), so hi - f = n <= tol * T / (1 + tol) <= tol * f.
#                  test_tolerance_stops_within_tolerance_of_the_largest_fitting_micro_batch
# These hold for Determined's upward bisection, which binary runs for the smaller-is-better
# metrics (forward, backward, latency). For throughput and FLOPS_per_gpu the peak search
# (toolkit/dsat/search/peak.py) bisects only the gap between its best and an out-of-memory above
# it, with the same tolerance rule: test_a_rising_curve_bisects_the_memory_boundary_within_tolerance.


# -- binary: upward search -----------------------------------------------------------------------


@PROP
@given(hi=st.integers(1, 10**6), data=st.data(), tolerance=st.sampled_from([0, 0.1, 0.25, 0.9]),
       status=st.sampled_from([OOM, FAILED, TIMEOUT]))
def test_the_range_halves_and_keeps_the_target(hi, data, tolerance, status):
    """(R): after k upward trials the open range holds at most floor(hi / 2**k) micro-batches,
    and lo - 1 <= T <= hi (recomputed here from the results, trial by trial)."""
    target = data.draw(st.integers(1, hi), label="target")
    s = settings_for("binary", zero_stages=(0,), max_trials=200, bisect_tolerance=tolerance, metric="latency")
    _, results = drive(make_searcher(s, profile_with_range(hi)), oracle(target, status=status))
    lo, top = 1, hi  # latency: no downward refinement, every trial is an upward one
    for k, r in enumerate(results, start=1):
        m = r.spec.micro_batch
        assert lo <= m <= top, (k, m, lo, top)
        lo, top = (m + 1, top) if r.status is OK else (lo, m - 1)
        assert top - lo + 1 <= hi // 2**k, (k, lo, top, hi)
        assert lo - 1 <= target <= top, (k, lo, top, target)


@PROP
@given(hi=st.integers(1, 10**6), data=st.data(), metric=st.sampled_from(sorted(SMALLER_IS_BETTER)))
def test_zero_tolerance_is_the_exact_bisection_within_the_log2_bound(hi, data, metric):
    target = data.draw(st.integers(1, hi))
    s = settings_for("binary", zero_stages=(0,), max_trials=200, bisect_tolerance=0, metric=metric)
    searcher = make_searcher(s, profile_with_range(hi))  # stage 0: a single line
    calls, results = drive(searcher, oracle(target))
    mbs = [spec.micro_batch for spec in all_specs(calls)]
    assert {spec.line for spec in all_specs(calls)} == {0}
    upward, f = bisection(hi, target)
    assert f == target and len(upward) <= math.floor(math.log2(hi)) + 1
    assert mbs == upward  # Determined's bisection, trial for trial, and nothing else
    assert searcher.best is best_result(results, metric)


@PROP
@given(hi=st.integers(1, 10**6), data=st.data(), tolerance=st.floats(0, 0.99),
       metric=st.sampled_from(sorted(SMALLER_IS_BETTER)))
def test_tolerance_stops_within_tolerance_of_the_largest_fitting_micro_batch(hi, data, tolerance, metric):
    target = data.draw(st.integers(1, hi))
    s = settings_for("binary", zero_stages=(0,), max_trials=200, bisect_tolerance=tolerance, metric=metric)
    _, results = drive(make_searcher(s, profile_with_range(hi)), oracle(target))
    upward, probes, f = split_line(results, hi, tolerance)
    assert [r.spec.micro_batch for r in upward] == bisection(hi, target, tolerance)[0]
    assert f == max(r.spec.micro_batch for r in results if r.status is OK)
    assert 1 <= f <= target and target - f <= tolerance * f  # f >= target / (1 + tolerance)
    assert len(upward) <= tolerance_bound(hi, target, tolerance)
    assert not probes


def test_tolerance_spares_the_trials_at_the_memory_boundary(caplog):
    # The CPU benchmark's stage-1 line: exact bisection spent 5 of 7 trials next to the limit.
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="latency")
    exact, f = bisection(7106, 2700)
    assert exact[:7] == [3553, 1776, 2664, 3108, 2886, 2775, 2719] and len(exact) == 13 and f == 2700
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        _, results = drive(make_searcher(s, profile_with_range(7106)), oracle(2700))
    assert [r.spec.micro_batch for r in results] == [3553, 1776, 2664, 3108]  # default tolerance 0.25
    assert "within 25% of the largest fitting micro-batch 2664" in caplog.text
    tenth = drive(make_searcher(dataclasses.replace(s, bisect_tolerance=0.1), profile_with_range(7106)),
                  oracle(2700))[1]
    assert [r.spec.micro_batch for r in tenth] == [3553, 1776, 2664, 3108, 2886]
    exact_run = drive(make_searcher(dataclasses.replace(s, bisect_tolerance=0), profile_with_range(7106)),
                      oracle(2700))[1]
    assert [r.spec.micro_batch for r in exact_run] == exact


@PROP
@given(hi=st.integers(1, 10**4), factor=st.floats(0.1, 4.0))
def test_binary_range_is_factor_times_the_memory_model(hi, factor):
    s = settings_for("binary", zero_stages=(0,), max_trials=100, search_range_factor=factor,
                     bisect_tolerance=0)
    searcher = make_searcher(s, profile_with_range(hi))
    _, results = drive(searcher, oracle(10**9))  # everything fits: bisection climbs to the top
    assert max(r.spec.micro_batch for r in results) == max(1, math.ceil(factor * hi))


@pytest.mark.parametrize("status", [FAILED, TIMEOUT])
def test_binary_treats_failed_and_timeout_like_oom(status):
    searcher = make_searcher(settings_for("binary", zero_stages=(0,), bisect_tolerance=0),
                             profile_with_range(100))
    _, results = drive(searcher, oracle(37, status=status))
    assert searcher.best.spec.micro_batch == 37
    assert all(r.spec.micro_batch <= 37 or r.status is status for r in results)


@pytest.mark.parametrize("metric", sorted(SMALLER_IS_BETTER))
@pytest.mark.parametrize("tolerance", [0, 0.1, 0.5])
def test_no_refinement_for_smaller_is_better_metrics(metric, tolerance):
    limits, hi = {1: 300, 2: 400, 3: 900}, 1000
    s = settings_for("binary", zero_stages=(1, 2, 3), max_trials=60, metric=metric,
                     bisect_tolerance=tolerance)
    searcher = make_searcher(s, profile_with_range(hi))
    calls, results = drive(searcher, peaked(limits, 20), concurrency=3)
    by_line = defaultdict(list)
    for r in sorted(results, key=lambda r: r.spec.trial_id):
        by_line[r.spec.line].append(r)
    check_bounds({line: [r.spec for r in rs] for line, rs in by_line.items()}, results)
    complete = 0
    for rs in by_line.values():  # the lines running when the trial cap hit are cut short
        expected = bisection(hi, limits[rs[0].spec.stage], tolerance)[0]
        assert [r.spec.micro_batch for r in rs] == expected[:len(rs)]
        complete += len(rs) == len(expected)
    assert complete >= len(by_line) - 3 and len(results) == 59
    # Smaller is better: the smallest success of the search wins (an upward trial).
    assert searcher.best is best_result(results, metric)


# -- binary: the profiling trials as results, lines compared, early end ----------------------------


def test_profiling_trials_at_configurations_of_the_search_are_taken_as_results():
    run = peaked({0: 4096, 1: 4096, 2: 2048, 3: 2048}, {0: 400, 1: 400, 2: 300, 3: 200})
    s = settings_for("binary", zero_stages=(1, 2, 3), max_trials=6, metric="throughput",
                     base_zero={"stage": 1})
    searcher = make_searcher(s, profile_with_range(2197))
    priors = [profiling(1, 1, 0, run), profiling(1, 256, -1, run), profiling(2, 1024, -12, run),
              profiling(3, 1024, -13, run),
              profiling(2, 64, -22, run, zero={"stage": 2, "overlap_comm": True}),  # not the user's section
              profiling(0, 8, -30, run)]                                              # stage not searched
    taken = searcher.observe_profiling(priors)
    assert [r.spec.trial_id for r in taken] == [0, -1, -12, -13]
    assert searcher.best is priors[1] and searcher.observed_count == 0
    _, results = drive(searcher, run)
    # Stage 1 (the best, 256): 1024 (4x), then 512 (between; nothing below 256 can reach 256's
    # value from micro-batch 1's); stages 2 and 3 at the best's 512: more than 10% slower,
    # dominated; the last trial: a random ZeRO configuration of stage 1 at 512.
    assert [(r.spec.stage, r.spec.micro_batch) for r in results] == [(1, 1024), (1, 512), (2, 512), (3, 512),
                                                                     (1, 512)]
    assert searcher.best.spec.micro_batch == 512
    with pytest.raises(ValueError, match="before the first propose"):
        searcher.observe_profiling(priors)


def test_a_section_that_differs_only_by_deepspeeds_defaults_is_the_same_configuration():
    """DeepSpeed-Chat's get_train_ds_config at stage 2: offload sections with device "none" (offload_param
    too, which stage 2 never reads) and 3e7-style floats. Its profiling trials p1 and p2 ran the user's
    section as written; they are the search's results like the stage points p3 and p4, whose section the
    search built (issue 37: p2 was left out)."""
    from toolkit.dsat.search.space import canonical_zero, zero_config_for_stage
    from toolkit.dsat.tuning_plan import profile_spec

    chat = {"stage": 2, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"},
            "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False}
    run = peaked(10**6, 512)
    s = settings_for("binary", zero_stages=(2, 3), metric="throughput", base_zero=chat)
    searcher = make_searcher(s, profile_with_range(4096))
    first = profile_spec({"zero_optimization": chat}).zero  # what p1 runs: nothing moved, no "none" section
    priors = [profiling(2, 1, 0, run, zero=chat), profiling(2, 64, -1, run, zero=first),
              profiling(2, 256, -12, run, zero=zero_config_for_stage(chat, 2)),
              profiling(3, 256, -13, run, zero=zero_config_for_stage(chat, 3))]
    assert [r.spec.trial_id for r in searcher.observe_profiling(priors)] == [0, -1, -12, -13]
    assert canonical_zero(chat) == canonical_zero(first) == canonical_zero(zero_config_for_stage(chat, 2))
    cpu = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert canonical_zero(cpu) != canonical_zero({"stage": 2})
    assert canonical_zero({"stage": 3, "overlap_comm": True}) == canonical_zero({"stage": 3})  # its default
    assert canonical_zero({"stage": 2, "overlap_comm": True}) != canonical_zero({"stage": 2})


def test_profiling_trials_must_keep_the_global_batch():
    run = peaked(10**6, 64)
    s = settings_for("binary", zero_stages=(1,), metric="throughput", micro_batches=(1, 2, 4, 8, 16, 32, 64))
    searcher = make_searcher(s, profile_with_range(64))
    taken = searcher.observe_profiling([profiling(1, 1, 0, run), profiling(1, 24, -1, run)])
    assert [r.spec.trial_id for r in taken] == [0]  # 24 does not divide the kept batch


def test_a_dominated_stage_stops_and_gets_no_random_configs(caplog):
    run = peaked(10**6, {1: 128, 2: 128, 3: 128})

    def slower(spec):  # stage 2 and 3 at half the speed of stage 1
        r = run(spec)
        return r if spec.stage == 1 else dataclasses.replace(
            r, metrics={k: v / 2 if k in LARGER else v * 2 for k, v in r.metrics.items()})
    s = settings_for("binary", zero_stages=(1, 2, 3), max_trials=40, metric="throughput")
    searcher = make_searcher(s, profile_with_range(1024))
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat.search.binary"):
        _, results = drive(searcher, slower)
    later = [r for r in results if r.spec.stage != 1]
    assert [(r.spec.line, r.spec.micro_batch) for r in later] == [(1, 128), (2, 128)]  # one trial each
    assert caplog.text.count("dominated: its best") == 2
    assert all(r.spec.stage == 1 for r in results if r.spec.line > 2) and len(results) == 39
    assert searcher.best.spec.stage == 1 and searcher.best.spec.micro_batch == 128


def test_the_search_ends_early_when_every_line_found_its_peak():
    s = settings_for("binary", zero_stages=(0,), max_trials=50, metric="throughput")
    searcher = make_searcher(s, profile_with_range(4096))
    _, results = drive(searcher, peaked(10**6, 100))
    assert searcher.done and len(results) < 10  # stage 0: one configuration, no knobs to draw
    assert searcher.best.spec.micro_batch == 128


# -- binary: the measured CPU benchmark curve -----------------------------------------------------
# Samples/s of bench_dsat's example (2 CPU ranks, 1 GiB each), measured by its grid on 2026-11-23
# (a quiet machine): it peaks at 256-1024 and falls above. The memory model's range is [1, 2197].
CPU_GRID = {1: {1: 234, 16: 3521, 32: 4970, 64: 8441, 128: 9968, 256: 12165, 512: 12614, 1024: 12379,
                2048: 9619, 4096: 8893},
            2: {1: 315, 16: 3520, 32: 5287, 64: 7810, 128: 11506, 256: 11318, 512: 11600, 1024: 11924,
                2048: 6996},
            3: {1: 59, 16: 749, 32: 1408, 64: 2682, 128: 4037, 256: 4571, 512: 5868, 1024: 7612,
                2048: 10479}}
CPU_LIMITS = {1: 4096, 2: 2048, 3: 2048}


def test_eight_trials_find_the_grid_best_of_the_cpu_benchmark():
    """bench_dsat's budget: --max-trials 8, of which 4 profiling (micro-batch 1, the calibration
    at 256, stages 2 and 3 at 1024), given to the search: 4 tuning trials find the grid's best."""
    runs = {stage: measured(curve, CPU_LIMITS[stage]) for stage, curve in CPU_GRID.items()}

    def run(spec):
        return runs[spec.stage](spec)
    s = settings_for("binary", zero_stages=(1, 2, 3), max_trials=8 - 3, metric="throughput")
    searcher = make_searcher(s, profile_with_range(2197))
    searcher.observe_profiling([profiling(1, 1, 0, run), profiling(1, 256, -1, run),
                                profiling(2, 1024, -12, run), profiling(3, 1024, -13, run)])
    _, results = drive(searcher, run)
    # Stage 1 finds 512 in 2 trials; stage 2 at 512 is within 10% of it (its 1024 too), so it goes
    # on above its best: the top of the range, out of memory (every stage gets the same range here).
    assert [(r.spec.stage, r.spec.micro_batch) for r in results] == [(1, 1024), (1, 512), (2, 512), (2, 2197)]
    assert searcher.best.spec.stage == 1 and searcher.best.spec.micro_batch == 512



# Samples/s measured by bench_dsat's grid on 2026-11-26 (free run 2): stage 1 peaks at 512-4096,
# stage 3 is below it from 512 up. The profiling points at 851 measured all three within 1.2%,
# stage 3 highest: a tie the measurements cannot break.
TIED_GRID = {1: {1: 84, 64: 1660, 128: 1454, 256: 1715, 512: 2203, 1024: 2105, 2048: 1914, 4096: 2196},
             2: {1: 100, 64: 1492, 128: 1515, 256: 1643, 512: 1891, 1024: 1783, 2048: 1993, 4096: 1844},
             3: {1: 20, 64: 660, 128: 852, 256: 1257, 512: 1500, 1024: 1739, 2048: 1697, 4096: 1767}}


def test_a_tie_between_stages_goes_to_the_lowest_stage_first():
    runs = {stage: measured(curve, 4096) for stage, curve in TIED_GRID.items()}

    def run(spec):
        return runs[spec.stage](spec)

    def at(result, value):
        return dataclasses.replace(result, metrics={**result.metrics, "throughput": value})
    # bench_dsat's --max-trials 8: micro-batch 1 counts, the 4 other profiling trials do not
    s = settings_for("binary", zero_stages=(1, 2, 3), max_trials=8 - 4, metric="throughput")
    searcher = make_searcher(s, profile_with_range(6478))
    searcher.observe_profiling([profiling(1, 1, 0, run), at(profiling(1, 138, -1, run), 1540),
                                at(profiling(1, 851, -11, run), 1828), at(profiling(2, 851, -12, run), 1824),
                                at(profiling(3, 851, -13, run), 1846)])
    assert searcher.best.spec.stage == 3  # 1846: within NOISE of stage 1's 1828 and stage 2's 1824
    _, results = drive(searcher, run)
    # stage 1's line goes first (stage 3 holds the best, stage 2 ties too): 4x its best, between, the top
    assert [(r.spec.stage, r.spec.micro_batch) for r in results] == [(1, 4096), (1, 2048), (1, 6478)]
    assert searcher.best.spec.stage == 1 and searcher.best.spec.micro_batch == 4096


# Samples/s measured by bench_dsat's grid with the global batch kept at 768 on 2026-11-26 (the
# micro-batches dividing 384): flat within noise from 24 up at every stage.
KEPT_GRID = {1: {1: 300, 12: 1823, 24: 2317, 48: 2372, 96: 1680, 128: 2235, 192: 1643, 384: 1769},
             2: {1: 150, 96: 2459, 128: 2427, 192: 2445, 384: 2529},
             3: {1: 40, 64: 1238, 128: 1307, 192: 1837, 384: 1888}}
KEPT_MBS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 384)


def test_a_random_section_below_the_best_does_not_close_the_best_stage():
    """bench_dsat's kept run of 2026-11-26: stage 1's point at 384, the top of the range, measured
    2760 (then 1769-2372 in 6 other trials), so stages 2 and 3 (1822, 2293) were dominated and
    stage 1's user line had no micro-batch left; the first random stage-1 section measured 2370 at
    384 and, being dominated too, closed stage 1 itself: the search ended with trials unused."""
    runs = {stage: measured(curve, 384) for stage, curve in KEPT_GRID.items()}

    def run(spec):
        return runs[spec.stage](spec)

    def at(result, value):
        return dataclasses.replace(result, metrics={**result.metrics, "throughput": value})
    s = settings_for("binary", zero_stages=(1, 2, 3), max_trials=4, metric="throughput",
                     micro_batches=KEPT_MBS)
    searcher = make_searcher(s, profile_with_range(6480))
    searcher.observe_profiling([at(profiling(1, 1, 0, run), 485), at(profiling(1, 192, -1, run), 2259),
                                at(profiling(1, 384, -11, run), 2760), at(profiling(2, 384, -12, run), 1822),
                                at(profiling(3, 384, -13, run), 2293)])
    _, results = drive(searcher, run)
    # every tuning trial a random stage-1 section at the best's micro-batch, each one dominated
    assert [(r.spec.stage, r.spec.micro_batch) for r in results] == [(1, 384)] * 3
    assert len({r.spec.line for r in results}) == 3
    assert searcher.best.spec.trial_id == -11


# -- binary: the first lines ----------------------------------------------------------------------


@pytest.mark.parametrize("stages", [(1, 2, 3), (3, 1), (0, 2, 3)])
def test_binary_starts_one_line_per_stage_lowest_first_then_draws_at_random(stages):
    searcher = make_searcher(settings_for("binary", zero_stages=stages, max_trials=50),
                             profile_with_range(64))
    first = searcher.propose(len(stages) + 4)
    assert [spec.stage for spec in first[:len(stages)]] == sorted(stages)
    assert len({spec.line for spec in first}) == len(first)  # one in-flight trial per line
    assert {spec.stage for spec in first[len(stages):]} <= set(stages)


def test_binary_starts_each_stage_with_the_users_own_zero_section():
    base = {"stage": 2, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}
    s = settings_for("binary", zero_stages=(3, 1, 2), base_zero=base, random_seed=11)
    searcher = make_searcher(s, profile_with_range(300))
    first = searcher.propose(3)
    assert [spec.zero for spec in first] == [{**base, "stage": stage} for stage in (1, 2, 3)]
    assert [spec.line for spec in first] == [0, 1, 2]
    # Later lines are random draws of the space (searched bucket sizes, not the user's 5e6).
    pending, later = list(first), []
    while pending and len(later) < 2:  # every trial fails: the first lines close after ~9 each
        searcher.observe(oracle(0)(pending.pop(0)))
        pending += searcher.propose(1)
        later += [spec for spec in pending[-1:] if spec.line >= 3]
    assert [spec.line for spec in later] == [3, 4]
    assert all(spec.zero["reduce_bucket_size"] in (50_000_000, 200_000_000, 500_000_000) for spec in later)


@pytest.mark.parametrize("metric", sorted(SMALLER_IS_BETTER))
def test_smaller_is_better_metrics_take_no_profiling_trial(metric):
    run = peaked(10**6, 64)
    searcher = make_searcher(settings_for("binary", zero_stages=(1,), metric=metric), profile_with_range(64))
    assert searcher.observe_profiling([profiling(1, 1, 0, run), profiling(1, 8, -1, run)]) == []
    assert searcher.best is None and searcher.propose(1)[0].micro_batch == (1 + 64) // 2


def test_an_out_of_memory_profiling_trial_caps_its_line_below_it():
    run = peaked({1: 100}, 64)
    s = settings_for("binary", zero_stages=(1,), max_trials=8, metric="throughput")
    searcher = make_searcher(s, profile_with_range(1024))
    oom = profiling(1, 256, -1, run)
    assert oom.status is OOM
    assert [r.spec.trial_id for r in searcher.observe_profiling([profiling(1, 1, 0, run), oom])] == [0, -1]
    _, results = drive(searcher, run)
    on_line = [r.spec.micro_batch for r in results if r.spec.line == 0]
    assert on_line and max(on_line) <= 255  # without the profiling OOM its first trial is 512
    assert searcher.best.spec.micro_batch == 64


def test_a_failure_below_a_success_stops_the_line(caplog):
    caplog.set_level(logging.DEBUG, logger="toolkit.dsat.search")
    s = settings_for("binary", zero_stages=(1,), max_trials=12, metric="throughput")
    searcher = make_searcher(s, profile_with_range(1024))
    _, results = drive(searcher, peaked(10**6, 64, fail_at=(32,)))
    first = [(r.spec.micro_batch, r.status) for r in results if r.spec.line == 0]
    assert first == [(512, OK), (128, OK), (32, FAILED)]  # nothing more on the line after the failure
    assert ("(line 0, stage 1, micro-batch 32): failed; line range [513, 31], stopped: failed at "
            "micro-batch 32, below micro-batch 512 that succeeded on the line") in caplog.text
