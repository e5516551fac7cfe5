"""Search methods driven by a simulated oracle (pure logic: no processes, no DeepSpeed).

The oracle stands in for real trials, which would need a GPU to run out of memory: a trial
runs out of memory iff its micro-batch exceeds a per-stage limit, and its metrics are a fixed
function of micro-batch, stage and line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections import Counter, defaultdict
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.dsat.contract import METRICS, ProfileInfo, TrialStatus
from toolkit.dsat.search import (
    AshaSearcher,
    BinarySearcher,
    RandomSearcher,
    best_result,
    make_searcher,
    replay,
)
from toolkit.dsat.search.peak import log_grid, next_probe, plausible
from toolkit.dsat.search.types import SMALLER_IS_BETTER, SearchSettings, TrialResult, TrialSpec
from toolkit.errors import ConfigError

OK, OOM, FAILED, TIMEOUT = TrialStatus.OK, TrialStatus.OOM, TrialStatus.FAILED, TrialStatus.TIMEOUT
PROP = settings(max_examples=60, deadline=None)


def profile_with_range(hi: int) -> ProfileInfo:
    """A profile whose memory model gives approx_max_micro_batch == hi at every stage."""
    return ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=1,
                       memory_per_slot=hi)


def metrics_for(mb: int, stage: int, line: int = 0) -> dict[str, float]:
    # Bigger micro-batches and lower stages are faster; the line adds a small config effect.
    speed = mb * (4 - stage) + (line * 7919 % 13) / 13
    return {"FLOPS_per_gpu": 1e9 * speed, "throughput": speed, "forward": 100 / speed,
            "backward": 200 / speed, "latency": 300 / speed}


def oracle(limits: dict[int, int] | int, *, fail_ids=(), status=OOM):
    """Trial -> result: ``status`` iff micro_batch > the stage's limit (or the id is in fail_ids)."""
    def run(spec: TrialSpec) -> TrialResult:
        limit = limits if isinstance(limits, int) else limits[spec.stage]
        if spec.trial_id in fail_ids:
            return TrialResult(spec, FAILED, error="simulated crash")
        if spec.micro_batch > limit:
            return TrialResult(spec, status, error="simulated out of memory")
        return TrialResult(spec, OK, metrics_for(spec.micro_batch, spec.stage, spec.line))
    return run


def drive(searcher, run, *, concurrency=1, order_seed=0, max_steps=20_000):
    """Run a search to the end like the orchestrator: fill capacity, finish one trial, repeat.

    Returns (proposals per call, results in observation order). Checks on every step that the
    capacity is respected and that a searcher that is not done always has something going.
    """
    order = random.Random(order_seed)
    in_flight: list[TrialSpec] = []
    calls, results = [], []
    for _ in range(max_steps):
        if searcher.done:
            assert not in_flight
            return calls, results
        capacity = concurrency - len(in_flight)
        specs = searcher.propose(capacity)
        assert len(specs) <= capacity
        calls.append(specs)
        in_flight += specs
        assert in_flight, "searcher is not done but has nothing in flight and proposes nothing"
        spec = in_flight.pop(order.randrange(len(in_flight)))
        result = run(spec)
        searcher.observe(result)
        results.append(result)
    raise AssertionError("search did not finish")


def all_specs(calls):
    return [spec for call in calls for spec in call]


def settings_for(method, **kw):
    kw.setdefault("max_trials", 30)
    return SearchSettings(method=method, **kw)


def check_bounds(specs_by_line, results, *, below_fits=False, metric="FLOPS_per_gpu"):
    """Every trial's micro-batch lies in its line's [lo, hi] from the line's earlier results.

    With ``below_fits`` (binary's peak search), a trial may instead lie below a micro-batch
    known to fit, never above one known to fail, and never repeats a micro-batch of its line.
    """
    by_id = {r.spec.trial_id: r for r in results}
    for line, specs in specs_by_line.items():
        lo, hi, tried = 1, None, set()
        for spec in specs:
            m = spec.micro_batch
            ok = by_id[spec.trial_id].status is OK
            if m >= lo and (hi is None or m <= hi):
                lo, hi = (m + 1, hi) if ok else (lo, m - 1)
            else:
                assert below_fits and m < lo and (hi is None or m <= hi) and m not in tried, (line, spec)
                hi = hi if ok else m - 1
            tried.add(m)


def peaked(limits: dict[int, int] | int, peaks: dict[int, int] | int, *, fail_at=()):
    """Trial -> result with a unimodal throughput, like CPU runs where it peaks below the memory limit.

    OOM iff the micro-batch exceeds the stage's limit; FAILED at the micro-batches in
    ``fail_at``; else ``throughput(m) = m / (1 + (m / peak)**2)``, highest at ``m = peak``
    (and ``throughput(peak * x) == throughput(peak / x)``). Step times grow with ``m``.
    """
    def run(spec: TrialSpec) -> TrialResult:
        limit = limits if isinstance(limits, int) else limits[spec.stage]
        peak = peaks if isinstance(peaks, int) else peaks[spec.stage]
        m = spec.micro_batch
        if m > limit:
            return TrialResult(spec, OOM, error="simulated out of memory")
        if m in fail_at:
            return TrialResult(spec, FAILED, error="simulated crash")
        speed = m / (1 + (m / peak) ** 2)
        step_ms = 1000 * m / speed
        return TrialResult(spec, OK, {"FLOPS_per_gpu": 1e9 * speed, "throughput": speed,
                                     "forward": step_ms / 3, "backward": step_ms / 2, "latency": step_ms})
    return run


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
LARGER = ("throughput", "FLOPS_per_gpu")


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


@pytest.mark.parametrize("value", [1, 1.0, -0.1, float("nan"), float("inf"), "0.1", True, None])
def test_bisect_tolerance_is_validated(value):
    with pytest.raises(ConfigError, match=r"bisect_tolerance=.*expected a number >= 0 and < 1"):
        SearchSettings(method="binary", bisect_tolerance=value)


def test_bisect_tolerance_accepts_0_to_below_1_and_defaults_to_a_quarter():
    assert SearchSettings(method="binary").bisect_tolerance == 0.25
    for value in (0, 0.0, 0.5, 0.999):
        assert SearchSettings(method="binary", bisect_tolerance=value).bisect_tolerance == value


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


def measured(curve: dict[int, float], limit: int):
    """Trial -> result from a measured curve: linear in log2(micro-batch) between the measured
    points (flat beyond them), OOM above ``limit``. Its peak is the highest measured point."""
    xs = sorted(curve)

    def speed(m: int) -> float:
        if m <= xs[0] or m >= xs[-1]:
            return float(curve[xs[0] if m <= xs[0] else xs[-1]])
        a = max(x for x in xs if x <= m)
        b = min(x for x in xs if x > m)
        t = (math.log2(m) - math.log2(a)) / (math.log2(b) - math.log2(a))
        return curve[a] + t * (curve[b] - curve[a])

    def run(spec: TrialSpec) -> TrialResult:
        m = spec.micro_batch
        if m > limit:
            return TrialResult(spec, OOM, error="simulated out of memory")
        v = speed(m)
        return TrialResult(spec, OK, {"throughput": v, "FLOPS_per_gpu": 1e6 * v, "latency": 1000 * m / v,
                                      "forward": 300 * m / v, "backward": 600 * m / v})
    return run


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


def _run_to_end(searcher, run, in_flight, observed_before, concurrency):
    """Finish the lowest trial id first; returns every (trial id, micro-batch, line) proposed."""
    proposed = []
    while not searcher.done:
        for spec in searcher.propose(concurrency - len(in_flight)):
            observed_before[spec.trial_id] = searcher.observed_count
            in_flight.append(spec)
            proposed.append((spec.trial_id, spec.micro_batch, spec.line))
        in_flight.sort(key=lambda spec: spec.trial_id)
        searcher.observe(run(in_flight.pop(0)))
    return proposed


def _run_until(searcher, run, cut):
    """Run ``cut`` results (lowest trial id first, 2 at a time), as a search cut off there would
    have; returns (results, trials in flight sorted by id, observed_before)."""
    observed_before: dict[int, int] = {}
    results: list[TrialResult] = []
    in_flight: list[TrialSpec] = []
    while len(results) < cut:
        for spec in searcher.propose(2 - len(in_flight)):
            observed_before[spec.trial_id] = searcher.observed_count
            in_flight.append(spec)
        in_flight.sort(key=lambda spec: spec.trial_id)
        results.append(run(in_flight.pop(0)))
        searcher.observe(results[-1])
    return results, sorted(in_flight, key=lambda spec: spec.trial_id), observed_before


def test_replay_rebuilds_a_search_interrupted_during_a_refinement():
    s = settings_for("binary", zero_stages=(1, 2), max_trials=40, metric="throughput", random_seed=3)
    run = peaked({1: 900, 2: 1000}, {1: 40, 2: 60})
    full = _run_to_end(make_searcher(s, profile_with_range(1024)), run, [], {}, 2)
    assert len(full) == 39
    cut_during_refinement = 0
    for cut in range(len(full)):
        original = make_searcher(s, profile_with_range(1024))
        results, in_flight, observed_before = _run_until(original, run, cut)
        known_fit = defaultdict(int)
        for r in results:
            if r.status is OK:
                known_fit[r.spec.line] = max(known_fit[r.spec.line], r.spec.micro_batch)
        cut_during_refinement += any(spec.micro_batch < known_fit[spec.line] for spec in in_flight)
        resumed = make_searcher(s, profile_with_range(1024))
        records = [TrialResult.from_json(r.to_json()) for r in results]
        rerun = replay(resumed, results=records, observed_before=observed_before)
        assert rerun == sorted(in_flight, key=lambda spec: spec.trial_id)
        assert resumed.best == original.best
        before = [(sp.trial_id, sp.micro_batch, sp.line) for sp in [r.spec for r in results] + in_flight]
        rest = _run_to_end(resumed, run, list(rerun), dict(observed_before), 2)
        assert sorted(before) + rest == full  # the resumed search goes on exactly as the whole one
    assert cut_during_refinement >= 3


# -- binary: the peak search (throughput, FLOPS_per_gpu) ------------------------------------------
# toolkit/dsat/search/peak.py states the rule; these check what it finds. ``peaked`` curves are
# unimodal on a log scale with step times growing with the micro-batch (the bound of peak.py
# holds for them), so no candidate that could win is ever pruned.
def grid_best(hi: int, fits: int, peak: int) -> float:
    """The best value of ``m / (1 + (m / peak)**2)`` over the line's grid up to ``fits``."""
    return max(m / (1 + (m / peak) ** 2) for m in log_grid(hi, None) if m <= fits)


@PROP
@given(hi=st.integers(1, 10**5), data=st.data(), metric=st.sampled_from(LARGER),
       tolerance=st.sampled_from([0, 0.25]))
def test_a_unimodal_curve_gets_its_best_grid_point(hi, data, metric, tolerance):
    """Nothing runs out of memory in the range: the best is at least the grid's best (powers of
    two and the top). Out of memory below the top at T: the best is within the tolerance of the best
    grid point up to T (``v(f) / v(T) >= f / T >= 1 / (1 + tol)`` below the peak)."""
    peak = data.draw(st.integers(1, 2 * hi), label="peak")
    limit = data.draw(st.one_of(st.just(10**9), st.integers(1, hi)), label="limit")
    s = settings_for("binary", zero_stages=(0,), max_trials=500, metric=metric, bisect_tolerance=tolerance)
    searcher = make_searcher(s, profile_with_range(hi))
    _, results = drive(searcher, peaked(limit, peak))
    found = searcher.best.metrics["throughput"]
    fits = min(hi, limit)
    target = grid_best(hi, fits, peak)
    if limit >= hi:  # (a first trial in the middle of the range may even beat the grid)
        assert found >= target * (1 - 1e-12), [r.spec.micro_batch for r in results]
    else:
        assert found >= min(target, fits / (1 + (fits / peak) ** 2)) / (1 + tolerance) * (1 - 1e-12)
    tried = [r.spec.micro_batch for r in results]
    assert len(tried) == len(set(tried)) and all(1 <= m <= hi for m in tried)
    assert all(r.status is OK for r in results if r.spec.micro_batch <= limit)


@PROP
@given(hi=st.integers(1, 10**6), data=st.data(), tolerance=st.floats(0, 0.99))
def test_a_rising_curve_bisects_the_memory_boundary_within_tolerance(hi, data, tolerance):
    """GPU-like (faster with every example): the search climbs to the memory boundary T and
    bisects it as Determined's binary: ``T - f <= tolerance * f`` for the best ``f`` it finds."""
    target = data.draw(st.integers(1, hi))
    s = settings_for("binary", zero_stages=(0,), max_trials=500, bisect_tolerance=tolerance,
                     metric="throughput")
    searcher = make_searcher(s, profile_with_range(hi))
    _, results = drive(searcher, oracle(target))
    f = searcher.best.spec.micro_batch
    assert f == max(r.spec.micro_batch for r in results if r.status is OK)
    assert 1 <= f <= target and target - f <= tolerance * f
    assert len(results) <= 2 * hi.bit_length() + 2  # expansion by 4x, then bisection


def test_the_next_probe_of_the_cpu_benchmark_line():
    # bench_dsat's stage-1 line after the profiling trials (micro-batch 1 and the calibration at
    # 256), 2026-11-23: right of 256 first (log-width 3.1 up to the top 2197), though the gap
    # down to 1 is wider (8): below 47 nothing can reach 12165 from 234 at micro-batch 1.
    grid = log_grid(2197, None)
    assert grid == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 2197)
    values = {1: 234.0, 256: 12165.0}
    m, why = next_probe(values, tried=set(values), grid=grid, hi=2197, failed_above=False, bisect_at=None,
                        tolerance=0.25)
    assert m == 1024 and "4x the best 256" in why
    assert not plausible(32, values, 12165.0) and plausible(64, values, 12165.0)
    values[1024] = 12379.0  # then between 256 and the new best 1024 (2 log units) vs above it
    m, _ = next_probe(values, tried=set(values), grid=grid, hi=2197, failed_above=False, bisect_at=None,
                      tolerance=0.25)
    assert m == 512
    values[512] = 12614.0  # the grid's best: both neighbours tried, 2x away
    m, why = next_probe(values, tried=set(values), grid=grid, hi=2197, failed_above=False, bisect_at=None,
                        tolerance=0.25)
    assert m is None and why.startswith("peak at micro-batch 512")


def test_the_boundary_is_bisected_only_above_the_best():
    values = {512: 10.0, 1024: 12.0}  # 2048 ran out of memory: hi 2047, bisect [1025, 2047]
    probe = {"tried": {256, 512, 1024, 2048}, "grid": log_grid(2047, None), "failed_above": True,
             "tolerance": 0.25}
    assert next_probe(values, hi=2047, bisect_at=1536, **probe)[0] == 1536
    assert next_probe(values, hi=1280, bisect_at=1152, **probe)[0] is None  # within 25% of 1024
    values = {256: 11.0, 512: 12.0, 1024: 10.0}  # the best is not the largest success: no bisection
    assert next_probe(values, hi=2047, bisect_at=1536, **probe)[0] is None


def test_kept_batch_candidates_are_the_allowed_micro_batches():
    allowed = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 384)
    assert log_grid(200, allowed) == allowed[:-1]
    values = {1: 30.0, 96: 2000.0}
    m, _ = next_probe(values, tried=set(values), grid=log_grid(384, allowed), hi=384, failed_above=False,
                      bisect_at=None, tolerance=0.25)
    assert m == 384  # nearest 4 x 96 among 128, 192, 384
    values[384] = 2100.0
    m, _ = next_probe(values, tried=set(values), grid=log_grid(384, allowed), hi=384, failed_above=False,
                      bisect_at=None, tolerance=0.25)
    assert m == 192  # sqrt(96 x 384)


# -- binary: the profiling trials as results, lines compared, early end ----------------------------
def profiling(stage: int, mb: int, trial_id: int, run, *, zero=None) -> TrialResult:
    spec = TrialSpec(trial_id, mb, zero or {"stage": stage}, profile=True)
    return run(spec)


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


def test_replay_rebuilds_a_search_that_took_profiling_trials():
    run = peaked({1: 900, 2: 1000}, {1: 40, 2: 60})
    s = settings_for("binary", zero_stages=(1, 2), max_trials=12, metric="throughput", random_seed=3)
    priors = [profiling(1, 1, 0, run), profiling(1, 16, -1, run), profiling(2, 64, -12, run)]
    whole = make_searcher(s, profile_with_range(1024))
    whole.observe_profiling(priors)
    full = _run_to_end(whole, run, [], {}, 2)
    for cut in range(1, len(full)):
        original = make_searcher(s, profile_with_range(1024))
        original.observe_profiling(priors)
        results, in_flight, observed_before = _run_until(original, run, cut)
        resumed = make_searcher(s, profile_with_range(1024))
        resumed.observe_profiling([TrialResult.from_json(r.to_json()) for r in priors])
        rerun = replay(resumed, results=[TrialResult.from_json(r.to_json()) for r in results],
                       observed_before=observed_before)
        assert rerun == sorted(in_flight, key=lambda spec: spec.trial_id)
        before = [(sp.trial_id, sp.micro_batch, sp.line) for sp in [r.spec for r in results] + in_flight]
        assert sorted(before) + _run_to_end(resumed, run, list(rerun), dict(observed_before), 2) == full


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


# -- caps, ids, termination: all methods ---------------------------------------------------------
METHOD = st.sampled_from(["binary", "random", "asha"])
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


# -- determinism and resume ----------------------------------------------------------------------
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


@PROP
@given(method=METHOD, seed=st.integers(0, 2**16), concurrency=st.integers(1, 6),
       order_seed=st.integers(0, 99), cut=st.floats(0, 1), shape=st.sampled_from(["rising", "peaked"]))
def test_replay_rebuilds_an_interrupted_search(method, seed, concurrency, order_seed, cut, shape):
    s = settings_for(method, max_trials=25, random_seed=seed, early_stopping=8)
    limits = {1: 100, 2: 150, 3: 280}
    # peaked: binary lines refine downwards over several probes (rising: one probe each).
    run = oracle(limits) if shape == "rising" else peaked(limits, {1: 9, 2: 20, 3: 30})
    original = make_searcher(s, profile_with_range(300))
    order = random.Random(order_seed)
    observed_before: dict[int, int] = {}
    in_flight, results = [], []
    stop_after = int(cut * 24)
    while not original.done and len(results) < stop_after:
        for spec in original.propose(concurrency - len(in_flight)):
            observed_before[spec.trial_id] = original.observed_count
            in_flight.append(spec)
        result = run(in_flight.pop(order.randrange(len(in_flight))))
        original.observe(result)
        results.append(result)
    # "Interrupted" here; resume through a fresh searcher from the records alone, whose
    # results went through JSON like the orchestrator's records do.
    records = [TrialResult.from_json(r.to_json()) for r in results]
    resumed = make_searcher(s, profile_with_range(300))
    rerun = replay(resumed, results=records, observed_before=observed_before)
    assert rerun == sorted(in_flight, key=lambda spec: spec.trial_id)
    assert resumed.done == original.done and resumed.best == original.best
    # Both continue identically.
    for spec in rerun:
        original.observe(run(spec))
        resumed.observe(run(spec))
    assert original.propose(concurrency) == resumed.propose(concurrency)


def test_replay_rejects_a_record_from_other_settings():
    # Trials 1-3 are the user's ZeRO section at stages 1-3 whatever the seed; 4-5 are random draws.
    s = settings_for("binary", random_seed=1)
    first = make_searcher(s, profile_with_range(300)).propose(5)
    other = make_searcher(settings_for("binary", random_seed=2), profile_with_range(300))
    results = [oracle(100)(spec) for spec in first]
    with pytest.raises(ValueError, match="micro_batch|proposes|zero"):
        replay(other, results=results, observed_before={i: 0 for i in range(1, 6)})


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


# -- random: early-stopping rules ----------------------------------------------------------------
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


# -- asha ----------------------------------------------------------------------------------------
def test_asha_rung_sizes_follow_min_trials_times_divisor_power():
    # asha_early_stopping = 1, min 3, divisor 2: rung 0 gives a line 6 trials; capacity 1 means
    # the first line runs all of them before any other line starts.
    s = settings_for("asha", zero_stages=(1, 2), max_trials=200, min_binary_search_trials=3,
                     divisor=2, asha_early_stopping=1, max_rungs=3)
    calls, _ = drive(make_searcher(s, profile_with_range(2**30)), oracle(2**31))
    lines = [spec.line for spec in all_specs(calls)]
    assert lines[:6] == [0] * 6 and lines[6] == 1
    per_line = Counter(lines)
    del per_line[lines[-1]]  # the line the trial cap cut short
    # 3 * 2**(1 + r), r = 0, 1, 2; a range of 2**30 never closes within 24 trials.
    assert set(per_line.values()) <= {6, 12, 24}
    assert 24 in per_line.values()


def test_asha_promotes_the_top_fraction_by_metric_direction():
    # Rung 0: 1 trial per line, rung 1: 2. Line scores come from a table, not the micro-batch.
    scores = [5.0, 9.0, 1.0, 7.0, 3.0, 8.0]
    for metric in ("throughput", "latency"):
        def run(spec, metric=metric):
            return TrialResult(spec, OK, {metric: scores[spec.line] if spec.line < len(scores) else 0.0})
        s = settings_for("asha", metric=metric, zero_stages=(1, 2), max_trials=9,
                         min_binary_search_trials=1, divisor=2, max_rungs=2)
        calls, _ = drive(make_searcher(s, profile_with_range(2**20)), run)
        lines = [spec.line for spec in all_specs(calls)]
        if metric == "throughput":
            # 0; 1 -> top 1 of {0, 1} is 1 (9.0): promote; 2; 3 -> top 2 of 4 are {1, 3}: promote 3;
            # 4; 5 -> top 3 of 6 are {1, 5, 3}: promote 5.
            assert lines == [0, 1, 1, 2, 3, 3, 4, 5]
        else:
            # Smaller is better: 0 (5.0) beats 1 (9.0): promote 0; 2 (1.0) is the top 1 of 3 at
            # once: promote 2; 3 -> top 2 of 4 are {2, 0}, both promoted; 4 -> top 2 of 5 are
            # {2, 4}: promote 4.
            assert lines == [0, 1, 0, 2, 2, 3, 4, 4]


@PROP
@given(seed=st.integers(0, 2**16), rungs=st.integers(1, 4), min_bs=st.integers(1, 3),
       divisor=st.integers(2, 3), asha_es=st.integers(0, 1), concurrency=st.integers(1, 5),
       hi=st.integers(1, 3000), limit=st.integers(0, 3000))
def test_asha_promotes_only_from_the_top_fraction_of_a_rung(seed, rungs, min_bs, divisor, asha_es,
                                                            concurrency, hi, limit):
    """At the moment of every promotion, the line is in the top floor(n / divisor) of the n lines
    that finished its rung (asynchronous ASHA: checked when it happens, since later lines may
    push it out of the top again), and has a success there."""
    s = settings_for("asha", zero_stages=(1, 2, 3), max_trials=60, random_seed=seed, max_rungs=rungs,
                     min_binary_search_trials=min_bs, divisor=divisor, asha_early_stopping=asha_es)
    calls, results = drive(make_searcher(s, profile_with_range(hi)), oracle(limit), concurrency=concurrency)
    budget = [min_bs * divisor ** (asha_es + r) for r in range(rungs)]
    proposed: dict[int, int] = Counter()        # line -> trials proposed
    seen: dict[int, list[TrialResult]] = defaultdict(list)  # line -> results observed
    promotions = 0

    def finished_rung(line: int, r: int) -> tuple[bool, float | None]:
        """Whether the line finished rung r by now, and its best metric at that point."""
        rs, lo, top, closed_at = seen[line], 1, hi, None
        for i, x in enumerate(rs, 1):
            lo, top = (x.spec.micro_batch + 1, top) if x.status is OK else (lo, x.spec.micro_batch - 1)
            if lo > top:
                closed_at = i
                break
        prev = budget[r - 1] if r else 0
        done = len(rs) >= budget[r] or (closed_at is not None and prev < closed_at <= budget[r])
        cut = min(len(rs), budget[r])
        best = best_result(rs[:cut], s.metric)
        return done, (best.metrics[s.metric] if best else None)

    for call, result in zip(calls, results, strict=True):
        for spec in call:
            proposed[spec.line] += 1
            assert proposed[spec.line] <= budget[-1]
            for r in range(rungs - 1):
                if proposed[spec.line] == budget[r] + 1:  # the line's first trial of rung r + 1
                    promotions += 1
                    scores = {line: finished_rung(line, r) for line in seen}
                    ranked = sorted((line for line, (done, _) in scores.items() if done),
                                    key=lambda ln: (scores[ln][1] is None, -(scores[ln][1] or 0), ln))
                    assert scores[spec.line][1] is not None
                    assert spec.line in ranked[:len(ranked) // divisor]
        seen[result.spec.line].append(result)
    if rungs == 1:
        assert promotions == 0


def test_make_searcher_picks_the_method_class():
    p = profile_with_range(10)
    assert isinstance(make_searcher(settings_for("binary"), p), BinarySearcher)
    assert isinstance(make_searcher(settings_for("random"), p), RandomSearcher)
    assert isinstance(make_searcher(settings_for("asha"), p), AshaSearcher)
    with pytest.raises(TypeError, match="expected SearchSettings and ProfileInfo"):
        make_searcher({"method": "binary"}, p)


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
