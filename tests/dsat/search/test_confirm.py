"""The best is confirmed (toolkit/dsat/search/confirm.py, issue 29 item 3): configurations grouped
with all their trials, the top ones re-run, the pick by the median among those measured more than
once, a config judged both fitting and out of memory decided by the majority of its verdicts."""

from __future__ import annotations

from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.search.confirm import (
    CONFIRM_MEASUREMENTS,
    config_key,
    group,
    next_to_confirm,
    pick,
    to_confirm,
)
from toolkit.dsat.search.types import TrialResult, TrialSpec

OK, OOM = TrialStatus.OK, TrialStatus.OOM


def result(trial_id, mb, value=None, *, stage=1, status=OK, metric="throughput", **spec):
    metrics = {metric: value} if status is OK else {}
    return TrialResult(TrialSpec(trial_id, mb, {"stage": stage}, **spec), status, metrics)


def test_trials_of_one_configuration_are_one_candidate_in_the_order_they_first_ran():
    results = [result(0, 1, 5.0, profile=True, label="p1"), result(1, 8, 90.0), result(2, 8, 80.0, stage=2),
               result(3, 8, 70.0, rerun=True)]
    candidates = group(results)
    assert [[r.spec.trial_id for r in c.results] for c in candidates] == [[0], [1, 3], [2]]
    assert candidates[1].values("throughput") == [90.0, 70.0] and candidates[1].median("throughput") == 80.0


def test_the_top_configurations_by_median_are_re_run_to_three_trials():
    candidates = group([result(1, 8, 90.0), result(2, 16, 100.0), result(3, 4, 60.0), result(4, 16, 95.0),
                        result(5, 32, status=OOM)])
    top = to_confirm(candidates, "throughput", top=2)
    assert [c.spec.micro_batch for c in top] == [16, 8]             # 97.5, then 90; the OOM one never
    assert [c.reruns_needed() for c in top] == [1, 2] and CONFIRM_MEASUREMENTS == 3
    assert to_confirm(candidates, "throughput", top=0) == []


def test_one_lucky_run_does_not_win_the_median_does():
    # The HelloDeepSpeed port measured one config at 1.053e10 and 8.598e9: a single high run loses
    # to a steadier config once both are re-run.
    lucky = [result(1, 16, 100.0), result(3, 16, 60.0, rerun=True), result(4, 16, 70.0, rerun=True)]
    steady = [result(2, 8, 90.0), result(5, 8, 85.0, rerun=True), result(6, 8, 80.0, rerun=True)]
    chosen = pick(group(lucky + steady), "throughput")
    assert chosen is not None and chosen.spec.micro_batch == 8
    assert chosen.representative("throughput").spec.trial_id == 5       # the trial at the median
    assert chosen.spread("throughput") == "median 85 (min 80, max 90; 90, 85, 80; trials 2, 5, 6)"


def test_only_configurations_measured_more_than_once_are_picked_unless_told():
    once = group([result(1, 16, 100.0), result(2, 8, 90.0), result(3, 8, 88.0, rerun=True)])
    assert pick(once, "throughput").spec.micro_batch == 8
    assert pick(once, "throughput", confirmed=False).spec.micro_batch == 16
    assert pick(group([result(1, 16, 100.0)]), "throughput") is None


def test_smaller_is_better_and_an_even_count_reports_the_worse_middle_trial():
    ms = dict(metric="latency")
    candidates = group([result(1, 4, 10.0, **ms), result(2, 4, 14.0, rerun=True, **ms),
                        result(3, 2, 12.0, **ms), result(4, 2, 13.0, rerun=True, **ms)])
    chosen = pick(candidates, "latency")
    assert chosen.spec.micro_batch == 4 and chosen.median("latency") == 12.0   # 12 beats 12.5
    assert chosen.representative("latency").spec.trial_id == 2                # 14 ms: the worse middle


def test_a_config_judged_both_fitting_and_out_of_memory_is_decided_by_the_majority():
    flipped = group([result(1, 8, 90.0), result(2, 8, status=OOM, rerun=True),
                     result(3, 8, 85.0, rerun=True)])
    (candidate,) = flipped
    assert candidate.conflicting and candidate.fits and pick(flipped, "throughput") is candidate
    assert candidate.spread("throughput").endswith("verdicts ok, oom, ok: fits by majority)")
    failed = group([result(1, 8, 90.0), result(2, 8, status=OOM, rerun=True), result(3, 8, status=OOM)])
    assert not failed[0].fits and pick(failed, "throughput") is None
    assert to_confirm(failed, "throughput", top=1) == []


def _chosen(results, top, metric="throughput"):
    return [config_key(c.spec) for c in to_confirm(group(results), metric, top=top)]


def test_the_chosen_are_confirmed_in_order_and_a_later_one_only_while_it_could_win():
    search = [result(1, 16, 100.0), result(2, 8, 90.0), result(3, 4, 60.0)]
    chosen = _chosen(search, 3)
    # nothing is confirmed yet: the first one
    assert next_to_confirm(group(search), chosen, "throughput").spec.micro_batch == 16
    # 16 measured 100, 80, 85: median 85. 8's 90 beats it: 8 is re-run next. 4's 60 cannot.
    confirmed = search + [result(4, 16, 80.0, rerun=True), result(5, 16, 85.0, rerun=True)]
    assert next_to_confirm(group(confirmed), chosen, "throughput").spec.micro_batch == 8
    both = confirmed + [result(6, 8, 88.0, rerun=True), result(7, 8, 91.0, rerun=True)]  # median 90
    assert next_to_confirm(group(both), chosen, "throughput") is None
    assert pick(group(both), "throughput").spec.micro_batch == 8
    # 16 measured 100, 95, 97 (median 97): neither 8's 90 nor 4's 60 can win, nothing more runs
    clear = search + [result(4, 16, 95.0, rerun=True), result(5, 16, 97.0, rerun=True)]
    assert next_to_confirm(group(clear), chosen, "throughput") is None


def test_a_chosen_configuration_that_stops_fitting_is_not_confirmed_and_the_next_one_runs():
    search = [result(1, 16, 100.0), result(2, 8, 50.0)]
    chosen = _chosen(search, 2)
    flipped = search + [result(3, 16, status=OOM, rerun=True), result(4, 16, status=OOM, rerun=True)]
    assert not group(flipped)[0].fits
    assert next_to_confirm(group(flipped), chosen, "throughput").spec.micro_batch == 8  # 8 may still win
    half = search + [result(3, 16, status=OOM, rerun=True)]   # one verdict each way: the third decides
    assert next_to_confirm(group(half), chosen, "throughput").spec.micro_batch == 16


def test_smaller_is_better_when_a_later_one_could_win():
    ms = dict(metric="latency")
    search = [result(1, 16, 10.0, **ms), result(2, 8, 11.0, **ms)]
    chosen = _chosen(search, 2, "latency")
    slow = search + [result(3, 16, 13.0, rerun=True, **ms), result(4, 16, 12.0, rerun=True, **ms)]  # 12 ms
    assert next_to_confirm(group(slow), chosen, "latency").spec.micro_batch == 8    # 11 ms beats 12 ms
    fast = search + [result(3, 16, 10.5, rerun=True, **ms), result(4, 16, 10.2, rerun=True, **ms)]
    assert next_to_confirm(group(fast), chosen, "latency") is None


def test_a_configuration_without_a_success_has_no_representative_and_says_so():
    candidate = group([result(3, 8, status=OOM), result(7, 8, status=OOM)])[0]
    assert candidate.representative("throughput") is None and candidate.median("throughput") is None
    assert candidate.spread("throughput") == "no result (trials 3, 7)"
    assert not candidate.fits
