"""The binary method's peak search for throughput and FLOPS_per_gpu (toolkit/dsat/search/peak.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from searchsim import LARGER, OK, PROP, drive, oracle, peaked, profile_with_range, settings_for

from toolkit.dsat.search import make_searcher
from toolkit.dsat.search.peak import log_grid, next_probe, plausible


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


def test_a_line_with_no_room_has_no_candidates():
    assert log_grid(0, None) == () and log_grid(-3, (1, 2)) == ()
    assert log_grid(6, None) == (1, 2, 4, 6) and log_grid(6, (1, 3, 9)) == (1, 3)
