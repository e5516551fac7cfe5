"""The asha method (toolkit/dsat/search/asha.py): rung sizes and promotions by the metric's direction."""

from __future__ import annotations

from collections import Counter, defaultdict

from hypothesis import given
from hypothesis import strategies as st
from searchsim import OK, PROP, all_specs, drive, oracle, profile_with_range, settings_for

from toolkit.dsat.search import best_result, make_searcher
from toolkit.dsat.search.types import TrialResult


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
