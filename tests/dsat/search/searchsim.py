"""Simulated trials and a driver for the search tests (pure logic: no processes, no DeepSpeed).

The oracles stand in for real trials, which would need a GPU to run out of memory: a trial
runs out of memory iff its micro-batch exceeds a per-stage limit, and its metrics are a fixed
function of micro-batch, stage and line (``oracle``), a unimodal curve (``peaked``) or a
measured one (``measured``). ``drive`` runs a search to the end like the orchestrator.
"""

from __future__ import annotations

import math
import random

from hypothesis import settings
from hypothesis import strategies as st

from toolkit.dsat.contract import ProfileInfo, TrialStatus
from toolkit.dsat.search.types import SearchSettings, TrialResult, TrialSpec

OK, OOM, FAILED, TIMEOUT = TrialStatus.OK, TrialStatus.OOM, TrialStatus.FAILED, TrialStatus.TIMEOUT
PROP = settings(max_examples=60, deadline=None)
LARGER = ("throughput", "FLOPS_per_gpu")  # the metrics where larger is better
METHOD = st.sampled_from(["binary", "random", "asha"])


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


def profiling(stage: int, mb: int, trial_id: int, run, *, zero=None) -> TrialResult:
    spec = TrialSpec(trial_id, mb, zero or {"stage": stage}, profile=True)
    return run(spec)
