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


def check_bounds(specs_by_line, results, *, descent=False, metric="FLOPS_per_gpu"):
    """Every trial's micro-batch lies in its line's [lo, hi] from the line's earlier results.

    With ``descent`` (binary), a line may instead end with a downward refinement below its
    largest fitting ``f``: the ladder and final probes of :func:`check_descent` (the trial cap
    may cut it short).
    """
    by_id = {r.spec.trial_id: r for r in results}
    for line, specs in specs_by_line.items():
        lo, hi = 1, None
        for i, spec in enumerate(specs):
            m = spec.micro_batch
            if m >= lo and (hi is None or m <= hi):
                lo, hi = (m + 1, hi) if by_id[spec.trial_id].status is OK else (lo, m - 1)
                continue
            assert descent and lo > 1, (line, spec)  # only below a micro-batch known to fit
            line_results = [by_id[s.trial_id] for s in specs]
            check_descent(line_results[:i], line_results[i:], lo - 1, metric, complete=False)
            break


def power_of_two_below(f: int) -> int:
    """The largest power of two strictly below ``f``, 0 if there is none (``f <= 1``)."""
    p = 1
    while 2 * p < f:
        p *= 2
    return p if p < f else 0


def ladder_rungs(f: int) -> list[int]:
    """The ladder's micro-batches for a line with largest fitting ``f``: the largest power of
    two below ``f``, then each one // 4, down to 1."""
    rungs, p = [], power_of_two_below(f)
    while p >= 1:
        rungs.append(p)
        p //= 4
    return rungs


def reference_finals(ladder: list[TrialResult], seen: list[TrialResult], metric: str, lo: int) -> list[int]:
    """The final probes after a line's ladder, written out independently (larger-is-better
    metrics): ``b`` the first best OK result of ``ladder`` (its probes, skipped ones included);
    the candidates ``2 * b`` and ``b // 2``, ``b // 2`` first iff the nearest OK micro-batch of
    ``seen`` (every trial of the line) below ``b`` is strictly faster than the nearest one above
    it, or there is none above; a candidate is kept iff ``1 <= m < lo`` and ``m`` was not tried."""
    values = {r.spec.micro_batch: r.metrics[metric] for r in seen if r.status is OK}
    b = None
    for r in ladder:
        if r.status is OK and (b is None or values[r.spec.micro_batch] > values[b]):
            b = r.spec.micro_batch
    if b is None:
        return []
    above = [mb for mb in values if mb > b]
    below = [mb for mb in values if mb < b]
    below_first = bool(below) and (not above or values[max(below)] > values[min(above)])
    tried = {r.spec.micro_batch for r in seen}
    order = [b // 2, 2 * b] if below_first else [2 * b, b // 2]
    return [m for m in order if 1 <= m < lo and m not in tried]


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


def check_descent(upward: list[TrialResult], probes: list[TrialResult], f: int, metric: str, *,
                  complete: bool = True) -> None:
    """The downward trials of one line follow the rule, written out independently.

    Ladder: the rungs of :func:`ladder_rungs`; a rung the line already tried is not run (its
    recorded result stands in); after each rung, not OK: the line ends there (no final probes);
    under half the line's best (all its OK results so far, this rung included): the ladder
    ends; else on to the next rung. Then the final probes of :func:`reference_finals` in order,
    a failed one being the last trial. ``complete=False``: the trial cap may have cut it short.
    """
    seen, tried = list(upward), {r.spec.micro_batch: r for r in upward}
    ladder, i = [], 0
    for rung in ladder_rungs(f):
        if rung in tried:
            r = tried[rung]  # already tried: judged on its record, not run again
        elif i == len(probes):
            assert not complete, f"the ladder stopped early at {rung} (f = {f})"
            return
        else:
            r = probes[i]
            i += 1
            assert r.spec.micro_batch == rung, (i, r.spec, f)
            seen.append(r)
            tried[rung] = r
        ladder.append(r)
        if r.status is not OK:
            assert i == len(probes), "the line went on after a ladder probe that failed"
            return
        if r.metrics[metric] < max(x.metrics[metric] for x in seen if x.status is OK) / 2:
            break
    finals = reference_finals(ladder, seen, metric, f + 1)
    rest = probes[i:]
    assert [r.spec.micro_batch for r in rest] == finals[:len(rest)], (f, [r.spec.micro_batch for r in probes])
    assert all(r.status is OK for r in rest[:-1]), "a final probe ran after one that failed"
    if complete and all(r.status is OK for r in rest):
        assert len(rest) == len(finals), (f, finals, [r.spec.micro_batch for r in probes])


def floor_log4(n: int) -> int:
    """floor(log4 n) for n >= 1, exactly."""
    return max(k for k in range(40) if 4**k <= n)


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
# (D) Downwards, for f >= 2: the ladder's rungs are 2**k, 2**(k - 2), ... >= 1 with
#     k = floor(log2(f - 1)) (the largest power of two below f), so at most
#     floor(k / 2) + 1 = floor(log4(f - 1)) + 1 ladder probes (all of them when every probe is
#     within half of the best, e.g. a curve fastest at micro-batch 1), then at most 2 final
#     probes: at most floor(log4(f - 1)) + 3 downward trials; none for f = 1 (no power of two
#     below 1). Only the first rung can be an upward trial: with s the first success, the trials
#     before it failed above it and those after it lie above it, so all are >= s; s was
#     proposed with lo = 1, s = (1 + hi) // 2 for the hi of then, so f <= hi <= 2 * s and every
#     upward trial is >= f / 2, while the later rungs are <= 2**(k - 2) < f / 4. The final
#     probes 2 * b and b // 2 are powers of two of the other parity than the rungs, never a rung.
#                             test_a_peaked_curve_gets_the_power_of_two_nearest_its_peak
# (G) A metric increasing with the micro-batch (GPU-like: fastest at the largest that fits):
#     the line's best stays f; the ladder's best is its first probe p0 (f / 2 <= p0 < f), so
#     2 * p0 >= f is dropped (tried or not known to fit) and p0 // 2 is the only final probe.
#     For v(m) = a * m the ladder is exactly p0, then p0 // 4 if >= 1 (v(p0 // 4) < v(f) / 4:
#     under half): at most 3 downward trials, none improving.
#                  test_zero_tolerance_is_the_exact_bisection_within_the_log2_bound,
#                  test_tolerance_stops_within_tolerance_of_the_largest_fitting_micro_batch
# (P) A unimodal metric peaking at p <= f whose first probe p0 is within half of the line's best
#     (e.g. v(m) = m / (1 + (m / p)**2), symmetric on a log scale: its values within a factor 2
#     of each other never differ by 2x), and P the power of two nearest p on a log scale: the
#     search (without failures, within its trial cap) tries P when P <= f, else p0 = P / 2.
#     Every later rung above the peak beats all earlier trials (those are >= 2 * rung), so the
#     ladder reaches the smallest rung a >= p, then a // 4; the ladder's best is one of the
#     two, so a // 2 is a final probe, and P is one of a // 4, a // 2, a. When p > p0, P is p0
#     or 2 * p0 (f, or above it).       test_a_peaked_curve_gets_the_power_of_two_nearest_its_peak


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
@given(hi=st.integers(1, 10**6), data=st.data(), metric=st.sampled_from(METRICS))
def test_zero_tolerance_is_the_exact_bisection_within_the_log2_bound(hi, data, metric):
    target = data.draw(st.integers(1, hi))
    s = settings_for("binary", zero_stages=(0,), max_trials=200, bisect_tolerance=0, metric=metric)
    searcher = make_searcher(s, profile_with_range(hi))  # stage 0: a single line
    calls, results = drive(searcher, oracle(target))
    mbs = [spec.micro_batch for spec in all_specs(calls)]
    assert {spec.line for spec in all_specs(calls)} == {0}
    upward, f = bisection(hi, target)
    assert f == target and len(upward) <= math.floor(math.log2(hi)) + 1
    assert mbs[:len(upward)] == upward  # the old behaviour, trial for trial
    # The oracle is linear through 0 in the micro-batch (GPU-like): the ladder's first rung p0
    # (the largest power of two below target) is within half of the best (target), p0 // 4 is
    # under half; the ladder's best p0 gets one final probe, p0 // 2 (2 * p0 >= target was tried
    # or does not fit). A rung the upward search tried is not run again; nothing improves.
    probes = results[len(upward):]
    if metric in LARGER:
        check_descent(results[:len(upward)], probes, target, metric)
        p0 = power_of_two_below(target)
        assert [r.spec.micro_batch for r in probes] == [m for m in (p0, p0 // 4, p0 // 2)
                                                       if m >= 1 and m not in upward]
    else:
        assert probes == []
    assert searcher.best.spec.micro_batch == target


@PROP
@given(hi=st.integers(1, 10**6), data=st.data(), tolerance=st.floats(0, 0.99),
       metric=st.sampled_from(["latency", "throughput"]))
def test_tolerance_stops_within_tolerance_of_the_largest_fitting_micro_batch(hi, data, tolerance, metric):
    target = data.draw(st.integers(1, hi))
    s = settings_for("binary", zero_stages=(0,), max_trials=200, bisect_tolerance=tolerance, metric=metric)
    _, results = drive(make_searcher(s, profile_with_range(hi)), oracle(target))
    upward, probes, f = split_line(results, hi, tolerance)
    assert [r.spec.micro_batch for r in upward] == bisection(hi, target, tolerance)[0]
    assert f == max(r.spec.micro_batch for r in results if r.status is OK)
    assert 1 <= f <= target and target - f <= tolerance * f  # f >= target / (1 + tolerance)
    assert len(upward) <= tolerance_bound(hi, target, tolerance)
    if metric == "latency":
        assert not probes
    else:  # linear oracle: the first rung, the next one under half the best, one final probe
        check_descent(upward, probes, f, metric)
        assert len(probes) <= 3 and best_result(results, metric).spec.micro_batch == f


def test_tolerance_spares_the_trials_at_the_memory_boundary(caplog):
    # The CPU benchmark's stage-1 line: exact bisection spent 5 of 7 trials next to the limit.
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="latency")
    exact, f = bisection(7106, 2700)
    assert exact[:7] == [3553, 1776, 2664, 3108, 2886, 2775, 2719] and len(exact) == 13 and f == 2700
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat.search.lines"):
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


# -- binary: the downward ladder -----------------------------------------------------------------
def nearest_power_of_two(p: int) -> int:
    """The power of two nearest ``p >= 1`` on a log scale (never a tie: ``p * p`` is no odd
    power of two)."""
    lower = 1
    while 2 * lower <= p:
        lower *= 2
    return lower if p * p < 2 * lower * lower else 2 * lower


@PROP
@given(hi=st.integers(2, 10**5), data=st.data(), tolerance=st.floats(0, 0.5),
       metric=st.sampled_from(LARGER))
def test_a_peaked_curve_gets_the_power_of_two_nearest_its_peak(hi, data, tolerance, metric):
    limit = data.draw(st.integers(1, hi), label="limit")
    peak = data.draw(st.integers(1, limit), label="peak")
    s = settings_for("binary", zero_stages=(0,), max_trials=200, bisect_tolerance=tolerance, metric=metric)
    searcher = make_searcher(s, profile_with_range(hi))
    run = peaked(limit, peak)
    _, results = drive(searcher, run)
    upward, probes, f = split_line(results, hi, tolerance)
    check_descent(upward, probes, f, metric)
    # The documented bounds: floor(log4(f - 1)) + 1 rungs (none for f = 1), of which only the
    # first may have been tried upwards (the upward trials are >= f / 2); then at most 2 final
    # probes (powers of two of the other parity: never a rung).
    rungs = ladder_rungs(f)
    assert len(rungs) == (floor_log4(f - 1) + 1 if f >= 2 else 0)
    assert not {r.spec.micro_batch for r in upward} & set(rungs[1:])
    ladder = [r for r in probes if r.spec.micro_batch in rungs]
    assert probes[:len(ladder)] == ladder and len(probes) - len(ladder) <= 2
    assert len(results) <= tolerance_bound(hi, limit, tolerance) + (floor_log4(f - 1) + 3 if f >= 2 else 0)
    tried = {r.spec.micro_batch for r in results}
    value = searcher.best.metrics[metric]
    if peak <= f:
        # P, the power of two nearest the peak, is tried when it fits (P <= f), else P / 2 (the
        # largest power of two below f: the peak lies between it and f).
        p2 = nearest_power_of_two(peak)
        wanted = p2 if p2 <= f else p2 // 2
        assert wanted in tried, (f, peak, p2, sorted(tried))
        assert value >= run(TrialSpec(0, wanted, {"stage": 0})).metrics[metric]
        if rungs and peak <= rungs[0]:  # the rung a >= peak > a // 4: a // 4, a // 2, a all tried
            a = min(r for r in rungs if r >= peak)
            assert {m for m in (a // 4, a // 2, a) if m >= 1} <= tried, (f, peak, a, sorted(tried))
    else:  # rising up to f: f stays the best, the ladder's best is its first rung p0 and the
        # only final probe is p0 // 2 (2 * p0 >= f was tried or is not known to fit)
        assert searcher.best.spec.micro_batch == f
        finals = [r.spec.micro_batch for r in probes[len(ladder):]]
        assert finals == ([rungs[0] // 2] if rungs and rungs[0] >= 2 else [])


@PROP
@given(hi=st.integers(2, 10**5), data=st.data(), tolerance=st.floats(0, 0.5),
       status=st.sampled_from([OOM, FAILED, TIMEOUT]))
def test_a_probe_that_fails_is_the_line_last_trial(hi, data, tolerance, status):
    limit = data.draw(st.integers(1, hi), label="limit")
    peak = data.draw(st.integers(1, limit), label="peak")
    s = settings_for("binary", zero_stages=(0,), max_trials=200, bisect_tolerance=tolerance,
                     metric="throughput")
    _, clean = drive(make_searcher(s, profile_with_range(hi)), peaked(limit, peak))
    upward, probes, f = split_line(clean, hi, tolerance)
    if not probes:
        return
    failing = probes[data.draw(st.integers(0, len(probes) - 1), label="failing probe")].spec.micro_batch
    base = peaked(limit, peak)

    def run(spec):  # the same curve, with one of the line's probes failing (never an upward trial)
        return TrialResult(spec, status, error="simulated") if spec.micro_batch == failing else base(spec)
    searcher = make_searcher(s, profile_with_range(hi))
    _, results = drive(searcher, run)
    mbs = [r.spec.micro_batch for r in results]
    # The same trials up to the failing probe, and none after it (ladder or final probe alike).
    assert mbs == [r.spec.micro_batch for r in clean][:mbs.index(failing) + 1] and mbs[-1] == failing
    check_descent(results[:len(upward)], results[len(upward):], f, "throughput")
    assert searcher.done and searcher.best is best_result(results, "throughput")




def test_ladder_skips_a_tried_rung_stops_under_half_then_runs_both_final_probes(caplog):
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput")
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        searcher = make_searcher(s, profile_with_range(1024))
        _, results = drive(searcher, peaked(1000, 40))
    mbs = [r.spec.micro_batch for r in results]
    # Upward: f = 896 with [897, 1024] open, within 25%. Ladder: 512 (the first upward trial:
    # not run again; within half of the best, which it is), 128, 32 (the best), 8 (7.7: under
    # half of 32's 19.5, the end). Final probes around the ladder's best 32: its nearest
    # successes are 128 (11.4) above and 8 (7.7) below: 2 * 32 = 64 first, then 16.
    assert mbs == [512, 768, 896, 128, 32, 8, 64, 16]
    values = {r.spec.micro_batch: r.metrics["throughput"] for r in results}
    assert values[512] == max(values[m] for m in (512, 768, 896)) and values[128] > values[512]
    assert values[32] / 2 > values[8] and values[128] > values[8]
    assert "ladder down from 512" in caplog.text
    assert "ladder: micro-batch 512 already tried (ok): not run again" in caplog.text
    assert ("ladder: micro-batch 8 (7.69231) is under half the line's best (19.5122 at micro-batch 32); "
            "final probes at micro-batches 64, 16 (nearest successes: 128 above, 8 below, above first"
            ) in caplog.text
    assert ("final probe at micro-batch 64: did not improve the line's best; next final probe at "
            "micro-batch 16") in caplog.text
    assert "final probe at micro-batch 16: did not improve the line's best" in caplog.text
    assert searcher.best.spec.micro_batch == 32 and searcher.done
    check_descent(results[:3], results[3:], 896, "throughput")


def test_ladder_ends_the_line_at_a_probe_that_fails(caplog):
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput")
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        searcher = make_searcher(s, profile_with_range(1024))
        _, results = drive(searcher, peaked(1000, 40, fail_at={32}))
    # No final probes after a failed probe, and the failure below 896 moves no bound.
    assert [r.spec.micro_batch for r in results] == [512, 768, 896, 128, 32]
    assert searcher.best.spec.micro_batch == 128 and searcher.done and searcher.propose(2) == []
    assert "ladder: failed at micro-batch 32 (no final probes after a failed probe)" in caplog.text
    check_descent(results[:3], results[3:], 896, "throughput")


def test_ladder_ends_below_micro_batch_1(caplog):
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput")
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        searcher = make_searcher(s, profile_with_range(1024))
        _, results = drive(searcher, peaked(1000, 1))  # fastest at micro-batch 1: every rung improves
    # 2 // 4 = 0 ends the ladder (all floor(log4 895) + 1 = 5 rungs); around its best 2: 4 first
    # (above: 8 is the only neighbour), then 1, the peak.
    assert [r.spec.micro_batch for r in results] == [512, 768, 896, 128, 32, 8, 2, 4, 1]
    assert "ladder reached micro-batch 2: 2 // 4 is below 1; final probes at micro-batches 4, 1" \
        in caplog.text
    assert searcher.best.spec.micro_batch == 1
    check_descent(results[:3], results[3:], 896, "throughput")
    # f = 3: the only rung, 2, was tried upwards; 4 (tried, out of memory) is dropped, 1 is run.
    caplog.clear()
    s = dataclasses.replace(s, bisect_tolerance=0)
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        _, results = drive(make_searcher(s, profile_with_range(8)), peaked(3, 100))
    assert [r.spec.micro_batch for r in results] == [4, 2, 3, 1]
    assert ("ladder reached micro-batch 2 (already tried: not run again): 2 // 4 is below 1; final probes at "
            "micro-batches 1 (nearest successes: 3 above, none below, above first; 4 (twice the ladder's "
            "best 2): already tried; 1 (half the ladder's best 2))") in caplog.text
    # f = 1: no power of two below it, no ladder, no final probe.
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        _, results = drive(make_searcher(s, profile_with_range(8)), peaked(1, 100))
    assert [r.spec.micro_batch for r in results] == [4, 2, 1]
    assert "range closed; no ladder: no power of two below micro-batch 1 (no final probes)" in caplog.text


@pytest.mark.parametrize("recorded, expected, message", [
    # 32 recorded OK and faster than 128: not run; on to 8 (under half of 32), then the final
    # probes around the ladder's best, the skipped 32.
    (OK, [512, 768, 896, 128, 8, 64, 16],
     "ladder: micro-batch 8 (7.69231) is under half the line's best (19.5122 at micro-batch 32); "
     "final probes at micro-batches 64, 16"),
    # 32 recorded as failed: the line ends as after a failed probe.
    (FAILED, [512, 768, 896, 128], "ladder: failed at micro-batch 32 (already tried: not run again) "
                                   "(no final probes after a failed probe)"),
])
def test_a_rung_below_the_first_already_tried_is_judged_on_its_record(recorded, expected, message, caplog):
    # Unreachable through bisection (only the first rung can be an upward trial, see
    # test_a_peaked_curve_gets_the_power_of_two_nearest_its_peak), so the line is given a trial
    # at 32 by hand, as its observation would record it: white-box, to check the rule itself.
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput")
    searcher = make_searcher(s, profile_with_range(1024))
    run = peaked(1000, 40)
    results = []
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        while not searcher.done:
            (spec,) = searcher.propose(1)
            if spec.micro_batch == 128:
                line = searcher._lines[0]
                earlier = run(TrialSpec(99, 32, spec.zero, line=0))
                line.tried.add(32)
                line.statuses[32] = recorded
                if recorded is OK:
                    line.values[32] = earlier.metrics["throughput"]
                    line.best = earlier
            results.append(run(spec))
            searcher.observe(results[-1])
    assert [r.spec.micro_batch for r in results] == expected
    assert message in caplog.text


@pytest.mark.parametrize("failing, status", [(128, OOM), (128, FAILED), (32, FAILED)])
def test_final_probes_run_in_order_and_a_failing_one_ends_the_line(failing, status, caplog):
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput")
    base = peaked(1300, 64)

    def run(spec):
        return TrialResult(spec, status, error="simulated") if spec.micro_batch == failing else base(spec)
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        searcher = make_searcher(s, profile_with_range(2048))
        _, results = drive(searcher, run)
    # f = 1280; ladder 1024 (tried upwards), 256, 64 (the peak), 16 (under half). 64's nearest
    # successes 256 and 16 are exactly as fast (the curve is symmetric on a log scale): a tie,
    # so above first: 128, then 32. A failing first final probe suppresses
    # the second; a failing second one just ends the line.
    values = {r.spec.micro_batch: r.metrics["throughput"] for r in results if r.status is OK}
    assert values[256] == values[16]
    full = [1024, 1536, 1280, 256, 64, 16, 128, 32]
    expected = full[:full.index(failing) + 1]
    assert [r.spec.micro_batch for r in results] == expected
    assert "final probes at micro-batches 128, 32 (nearest successes: 256 above, 16 below, above first" \
        in caplog.text
    if failing == 128:
        assert (f"final probe at micro-batch 128: {status.value} (final probe at micro-batch 32 not run "
                "after a failed probe)") in caplog.text
    else:
        assert f"final probe at micro-batch 32: {status.value}" in caplog.text
    assert searcher.best.spec.micro_batch == 64 and searcher.done and searcher.propose(2) == []
    check_descent(results[:3], results[3:], 1280, "throughput")


# -- binary: a non-monotone curve (the CPU benchmark) ---------------------------------------------
# Samples/s of the CPU example, stage 1, by micro-batch (measured by scripts/bench_dsat.py):
# not monotone (a cache cliff after 128), out of memory from 3379 on; the memory model's range
# is [1, 7724]. The grid's best is 128.
BENCH_TABLE = {1: 99, 2: 235, 4: 334, 8: 1127, 16: 1170, 32: 1675, 64: 5038, 128: 6696, 256: 4070,
               512: 4293, 1024: 4151, 1931: 5903, 2048: 5689, 4096: 4514}
BENCH_LIMIT, BENCH_HI = 3300, 7724


def _bench_search(stages, *, limit=BENCH_LIMIT, max_trials=10):
    # The bench's budget: --max-trials 10, i.e. 9 tuning trials, run one at a time. Every stage
    # gets the stage-1 curve and range (only the stage-1 line runs: it takes the whole budget).
    s = settings_for("binary", zero_stages=stages, max_trials=max_trials, metric="throughput")
    searcher = make_searcher(s, profile_with_range(BENCH_HI))
    _, results = drive(searcher, measured(BENCH_TABLE, limit))
    return searcher, results


@pytest.mark.parametrize("stages", [(1,), (1, 2, 3)])
def test_binary_finds_the_grid_best_of_the_cpu_benchmark_curve(stages, caplog):
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        searcher, results = _bench_search(stages)
    mbs = [r.spec.micro_batch for r in results]
    # Upward (tolerance 0.25): f = 2896 with [2897, 3378] open. Ladder from 2048: 512 lies in the
    # dip (slower than 1931, but within half of it), 128 (past the cliff: the grid's best), 32
    # (under half: the end). The budget's last trial is the first final probe around 128, toward
    # its faster nearest success (512 above, 32 below): 256.
    assert mbs == [3862, 1931, 2896, 3379, 2048, 512, 128, 32, 256]
    assert {r.spec.line for r in results} == {0} and len(results) == 9
    values = {r.spec.micro_batch: r.metrics["throughput"] for r in results if r.status is OK}
    assert values[1931] / 2 <= values[512] < values[1931] / 1.3 and values[128] > values[1931]
    assert "ladder down from 2048" in caplog.text
    assert ("ladder: micro-batch 32 (1675) is under half the line's best (6696 at micro-batch 128); "
            "final probes at micro-batches 256, 64") in caplog.text
    check_descent(results[:4], results[4:], 2896, "throughput", complete=False)
    assert searcher.best.spec.micro_batch == 128
    assert searcher.best.metrics["throughput"] >= 0.95 * max(BENCH_TABLE.values())


@pytest.mark.parametrize("limit, max_trials, expected, best", [
    # f = 1931 (4 upward trials): the ladder 1024, 256, 64, 16 has the other parity; 128 is its
    # first final probe (around 64, toward 256), the budget's 9th trial.
    (2000, 10, [3862, 1931, 2896, 2413, 1024, 256, 64, 16, 128], 128),
    # f = 1689 takes 5 upward trials: 9 tuning trials end with the ladder, a 10th finds 128.
    (1900, 10, [3862, 1931, 965, 1448, 1689, 1024, 256, 64, 16], 1689),
    (1900, 11, [3862, 1931, 965, 1448, 1689, 1024, 256, 64, 16, 128], 128),
])
def test_the_cpu_benchmark_curve_with_f_between_1024_and_2048(limit, max_trials, expected, best):
    searcher, results = _bench_search((1,), limit=limit, max_trials=max_trials)
    assert [r.spec.micro_batch for r in results] == expected
    upward, probes, f = split_line(results, BENCH_HI, 0.25)
    assert 1024 < f <= 2048 and [r.spec.micro_batch for r in probes][:4] == [1024, 256, 64, 16]
    check_descent(upward, probes, f, "throughput", complete=False)
    assert searcher.best.spec.micro_batch == best
    if best == 128:
        assert searcher.best.metrics["throughput"] == max(BENCH_TABLE.values())


# -- binary: the final probes ---------------------------------------------------------------------
# Samples/s of the CPU benchmark's stage-1 line (measured), and the micro-batch it ran out of memory above.
CPU_CURVE = {256: 2997, 512: 3146, 1024: 3490, 2048: 2813, 4096: 2050}
CPU_LIMIT = 2700


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




@pytest.mark.parametrize("metric", LARGER)
def test_final_probes_find_the_peak_of_the_measured_cpu_curve(metric, caplog):
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric=metric)
    run = measured(CPU_CURVE, CPU_LIMIT)
    peak = max(CPU_CURVE.values())
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        searcher = make_searcher(s, profile_with_range(7106))
        _, results = drive(searcher, run)
    mbs = [r.spec.micro_batch for r in results]
    # Upward (within 25% of 2664); the ladder from 2048 goes down to 2 (the curve is flat below
    # 256, so every rung is within half); its best 512 gets its two final probes: toward 128 (as
    # fast as 256, faster than 1776 above) 256 first, then 1024, the peak.
    assert mbs == [3553, 1776, 2664, 3108, 2048, 512, 128, 32, 8, 2, 256, 1024]
    ladder_best = best_result(results[:-2], metric)
    assert ladder_best.spec.micro_batch == 512 and ladder_best.metrics["throughput"] < 0.95 * peak
    assert searcher.best is results[-1] and searcher.best.metrics["throughput"] == peak
    assert ("final probes at micro-batches 256, 1024 (nearest successes: 1776 above, 128 below, below first; "
            "256 (half the ladder's best 512); 1024 (twice the ladder's best 512))") in caplog.text
    assert "final probe at micro-batch 1024: improved the line's best" in caplog.text
    assert searcher.done and searcher.propose(4) == []


@pytest.mark.parametrize("peak, order", [
    (40, [64, 16]),  # the ladder's best 32: 128 (above) beats 8 (below): 2 * 32 first
    (20, [16, 64]),  # the ladder's best 32: 8 (below) beats 128 (above): 32 // 2 first
])
def test_final_probes_go_toward_the_better_side_first(peak, order, caplog):
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput")
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        _, results = drive(make_searcher(s, profile_with_range(1024)), peaked(1000, peak))
    mbs = [r.spec.micro_batch for r in results]
    assert mbs[:6] == [512, 768, 896, 128, 32, 8] and mbs[-2:] == order
    values = {r.spec.micro_batch: r.metrics["throughput"] for r in results}
    assert values[32] == max(values[m] for m in mbs[3:-2])  # the ladder's best
    assert (values[128] > values[8]) == (order[0] == 64)
    side = "above" if order[0] == 64 else "below"
    assert f"final probes at micro-batches {order[0]}, {order[1]} (nearest successes: 128 above, 8 below, " \
           f"{side} first" in caplog.text
    check_descent(results[:3], results[3:], 896, "throughput")


@pytest.mark.parametrize("metric", sorted(SMALLER_IS_BETTER))
def test_no_final_probe_for_smaller_is_better_metrics(metric):
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric=metric)
    _, results = drive(make_searcher(s, profile_with_range(7106)), measured(CPU_CURVE, CPU_LIMIT))
    assert [r.spec.micro_batch for r in results] == [3553, 1776, 2664, 3108]  # upward only




@pytest.mark.parametrize("limit, run, expected, note", [
    # Linear, exact bisection: f = 20; ladder 16, 4 (under half); 2 * 16 = 32 does not fit.
    (41, oracle(20), [21, 10, 15, 18, 19, 20, 16, 4, 8], "32 (twice the ladder's best 16): not known to fit"),
    # f = 16: ladder 8, 2 (under half); 2 * 8 = 16 was tried (the largest that fits).
    (31, oracle(16), [16, 24, 20, 18, 17, 8, 2, 4], "16 (twice the ladder's best 8): already tried"),
    # Fastest at 1: f = 5, ladder 4 (tried), 1 (the best): 1 // 2 is below 1.
    (8, peaked(5, 1), [4, 6, 5, 1, 2], "0 (half the ladder's best 1): below 1"),
])
def test_a_final_probe_is_dropped_when_tried_below_1_or_not_known_to_fit(limit, run, expected, note, caplog):
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput", bisect_tolerance=0)
    with caplog.at_level(logging.DEBUG, logger="toolkit.dsat"):
        searcher = make_searcher(s, profile_with_range(limit))
        _, results = drive(searcher, run)
    assert [r.spec.micro_batch for r in results] == expected
    assert note in caplog.text
    assert searcher.done
    upward, probes, f = split_line(results, limit, 0)
    check_descent(upward, probes, f, "throughput")


def _interrupt_and_replay(s, run, hi: int, cut: int):
    """A search stopped after ``cut`` results with one proposal in flight, rebuilt by :func:`replay`
    in a fresh searcher: (original, in_flight, resumed, rerun, observed_before)."""
    original = make_searcher(s, profile_with_range(hi))
    observed_before: dict[int, int] = {}
    results = []
    for _ in range(cut):
        (spec,) = original.propose(1)
        observed_before[spec.trial_id] = original.observed_count
        results.append(run(spec))
        original.observe(results[-1])
    in_flight = original.propose(1)
    for spec in in_flight:
        observed_before[spec.trial_id] = original.observed_count
    resumed = make_searcher(s, profile_with_range(hi))
    records = [TrialResult.from_json(r.to_json()) for r in results]
    rerun = replay(resumed, results=records, observed_before=observed_before)
    return original, in_flight, resumed, rerun, observed_before


def test_replay_rebuilds_a_search_interrupted_during_the_final_probes():
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput")
    run = measured(CPU_CURVE, CPU_LIMIT)
    full = _run_to_end(make_searcher(s, profile_with_range(7106)), run, [], {}, 1)
    assert [mb for _, mb, _ in full][-3:] == [2, 256, 1024]
    for cut in (len(full) - 2, len(full) - 1, len(full)):  # a final probe in flight; the search over
        original, in_flight, resumed, rerun, observed_before = _interrupt_and_replay(s, run, 7106, cut)
        assert [spec.micro_batch for spec in rerun] == [mb for _, mb, _ in full[cut:cut + 1]]
        assert rerun == in_flight and resumed.best == original.best and resumed.done == (not rerun)
        while not resumed.done:
            for spec in rerun or resumed.propose(1):
                resumed.observe(run(spec))
            rerun = []
        assert resumed.propose(1) == [] and resumed.best.spec.micro_batch == 1024
        assert resumed.observed_count == len(full)


def test_replay_rebuilds_a_search_interrupted_around_a_skipped_rung():
    # The first rung, 512, was the first upward trial: replayed, the line skips it again.
    s = settings_for("binary", zero_stages=(0,), max_trials=200, metric="throughput")
    run = peaked(1000, 40)
    full = _run_to_end(make_searcher(s, profile_with_range(1024)), run, [], {}, 1)
    assert [mb for _, mb, _ in full] == [512, 768, 896, 128, 32, 8, 64, 16]
    for cut in range(len(full) + 1):
        original, in_flight, resumed, rerun, observed_before = _interrupt_and_replay(s, run, 1024, cut)
        assert rerun == in_flight and resumed.best == original.best
        rest = _run_to_end(resumed, run, list(rerun), dict(observed_before), 1)
        replayed = [mb for _, mb, _ in full[:cut]] + [spec.micro_batch for spec in rerun]
        assert replayed + [mb for _, mb, _ in rest] == [mb for _, mb, _ in full]


@PROP
@given(seed=st.integers(0, 2**16), concurrency=st.integers(1, 6), order_seed=st.integers(0, 99),
       tolerance=st.floats(0, 0.5), metric=st.sampled_from(LARGER), max_trials=st.integers(2, 60),
       peaks=st.tuples(st.integers(1, 400), st.integers(1, 400)))
def test_every_line_refines_by_its_own_best(seed, concurrency, order_seed, tolerance, metric, max_trials,
                                            peaks):
    """Many lines side by side: each line's probes follow the rule against that line's best."""
    hi, limits = 1000, {1: 500, 2: 700}
    s = settings_for("binary", zero_stages=(1, 2), max_trials=max_trials, random_seed=seed, metric=metric,
                     bisect_tolerance=tolerance)
    searcher = make_searcher(s, profile_with_range(hi))
    calls, results = drive(searcher, peaked(limits, {1: peaks[0], 2: peaks[1]}), concurrency=concurrency,
                           order_seed=order_seed)
    by_line = defaultdict(list)
    for r in sorted(results, key=lambda r: r.spec.trial_id):
        by_line[r.spec.line].append(r)
    # The trial cap cuts short only the lines with a trial in flight when it is reached (an idle
    # line gets the next free slot before any new line starts).
    assert len(results) == max_trials - 1  # 2 x 72 configurations: the cap always ends it
    flying, proposed, cut = set(), 0, set()
    for call, result in zip(calls, results, strict=True):
        flying |= {spec.line for spec in call}
        proposed += len(call)
        if proposed == max_trials - 1:
            cut = set(flying)
            break
        flying.discard(result.spec.line)
    for line, rs in by_line.items():
        upward, probes, f = split_line(rs, hi, tolerance)
        check_descent(upward, probes, f, metric, complete=line not in cut)
        if line not in cut:  # finished: upward search over, then the ladder and final probes
            assert f >= 1 and len(upward) == len(bisection(hi, limits[rs[0].spec.stage], tolerance)[0])
    assert searcher.best is best_result(results, metric)


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
    check_bounds({line: [r.spec for r in rs] for line, rs in by_line.items()}, results, descent=False)
    complete = 0
    for rs in by_line.values():  # the lines running when the trial cap hit are cut short
        expected = bisection(hi, limits[rs[0].spec.stage], tolerance)[0]
        assert [r.spec.micro_batch for r in rs] == expected[:len(rs)]
        complete += len(rs) == len(expected)
    assert complete >= len(by_line) - 3 and len(results) == 59
    # Smaller is better: the smallest success of the search wins (an upward trial).
    assert searcher.best is best_result(results, metric)


def _single_line_run(max_trials: int) -> list[int]:
    s = settings_for("binary", zero_stages=(0,), max_trials=max_trials, metric="throughput")
    searcher = make_searcher(s, profile_with_range(1024))
    _, results = drive(searcher, peaked(1000, 40))
    assert searcher.done and searcher.propose(3) == []
    return [r.spec.micro_batch for r in results]


def test_refinement_respects_the_trial_cap():
    full = _single_line_run(200)
    assert len(full) == 8  # the last two are the final probes
    for max_trials in range(2, len(full) + 3):
        assert _single_line_run(max_trials) == full[:max_trials - 1]


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


def test_replay_rebuilds_a_search_interrupted_during_a_refinement():
    s = settings_for("binary", zero_stages=(1, 2), max_trials=40, metric="throughput", random_seed=3)
    run = peaked({1: 900, 2: 1000}, {1: 40, 2: 60})
    full = _run_to_end(make_searcher(s, profile_with_range(1024)), run, [], {}, 2)
    assert len(full) == 39
    cut_during_refinement = 0
    for cut in range(len(full)):
        original = make_searcher(s, profile_with_range(1024))
        observed_before: dict[int, int] = {}
        in_flight, results = [], []
        while len(results) < cut:
            for spec in original.propose(2 - len(in_flight)):
                observed_before[spec.trial_id] = original.observed_count
                in_flight.append(spec)
            in_flight.sort(key=lambda spec: spec.trial_id)
            results.append(run(in_flight.pop(0)))
            original.observe(results[-1])
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
    check_bounds(by_line, results, descent=method == "binary", metric=s.metric)
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
    plain = make_searcher(settings_for("binary", zero_stages=(2,)), p)
    offl = make_searcher(settings_for("binary", zero_stages=(2,),
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
    assert fitted


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
