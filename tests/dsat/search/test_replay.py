"""Replay (toolkit/dsat/search/replay.py): a search rebuilt from its records goes on exactly as
the whole one would have."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st
from searchsim import METHOD, OK, PROP, oracle, peaked, profile_with_range, profiling, settings_for

from toolkit.dsat.search import make_searcher, replay
from toolkit.dsat.search.types import TrialResult, TrialSpec


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


def test_replay_rejects_a_record_it_cannot_place():
    s = settings_for("binary", random_seed=1)
    with pytest.raises(ValueError, match=r"observed_before\[3\]=2: expected 0\.\.1"):
        replay(make_searcher(s, profile_with_range(300)),
               results=[oracle(100)(TrialSpec(1, 1, {"stage": 1}))], observed_before={1: 0, 3: 2})
    # Trial 2 recorded as proposed first: a fresh searcher proposes trial 1 first.
    with pytest.raises(ValueError, match=r"after 0 results the recorded search proposed trials \[2\], "
                                         r"this searcher proposes \[1\]; resume with the original settings"):
        replay(make_searcher(s, profile_with_range(300)), results=[], observed_before={2: 0})
