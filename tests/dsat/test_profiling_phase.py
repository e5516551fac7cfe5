"""dsat's profiling phase (toolkit/dsat/profiling_phase.py): the trial timeout's cap on the
micro-batch, the other stages' points near their boundaries, the profiled stage measured again
where its peak bends, and the profiling trials every search method takes as results."""



import pytest

from helpers.dsatcli import KEEP_64, make_model_dir, plan_for
from toolkit.dsat.profiling_phase import ProfilingPhase
from toolkit.dsat.search.types import TrialSpec
from toolkit.dsat.tuning_plan import profile_spec


@pytest.mark.parametrize("ds, throughput, cap", [
    (None, 20.0, 1180),     # free: 10 s start-up + 5 steps x 100 ms x m <= 600 s: m <= 1180
    (KEEP_64, 20.0, 1180),  # kept, one micro-batch per timed step: the same cap
    (KEEP_64, 640.0, None),  # kept, 32 micro-batches per timed step: a step's examples stay 64
])
def test_the_trial_timeout_caps_the_micro_batch(tmp_path, ds, throughput, cap):
    from toolkit.dsat.contract import TrialStatus
    from toolkit.dsat.orchestrator import Autotuner
    from toolkit.dsat.search.types import TrialResult

    plan = plan_for(tmp_path, make_model_dir(tmp_path, slots=2, ds=ds))
    tuner = object.__new__(Autotuner)  # only the plan and the profiling result are read
    tuner.plan, tuner.say = plan, lambda line: None
    profiled = TrialResult(profile_spec(plan.base_ds_config), TrialStatus.OK,
                           {"latency": 100.0, "throughput": throughput}, duration_s=10.5)
    tuner.results = {0: profiled, -1: profiled}  # with a calibration trial
    settings = tuner._search_settings()
    assert settings.max_micro_batch == cap
    assert settings.micro_batches == plan.search.micro_batches
    assert settings.max_trials == plan.search.max_trials - 1  # --max-trials counts every trial


def test_the_trial_timeout_follows_the_profiling_trials_step_line(tmp_path):
    # Micro-batch 1 takes 100 ms a step, micro-batch 101 200 ms, a stage-3 point at 201 350 ms: the
    # fixed cost is most of the first step, so scaling it alone would cap at 1180. The steepest line
    # from micro-batch 1, 1.25 ms per example: 10 s start-up + 5 x (100 + 1.25 (m - 1)) ms <= 600 s.
    import dataclasses

    from toolkit.dsat.contract import TrialStatus
    from toolkit.dsat.orchestrator import Autotuner
    from toolkit.dsat.search.types import TrialResult

    plan = plan_for(tmp_path, make_model_dir(tmp_path, slots=2))
    tuner = object.__new__(Autotuner)
    tuner.plan, tuner.say = plan, lambda line: None
    first = profile_spec(plan.base_ds_config)

    def measured(trial_id, micro_batch, stage, latency, status=TrialStatus.OK):
        spec = dataclasses.replace(first, trial_id=trial_id, micro_batch=micro_batch, zero={"stage": stage})
        return TrialResult(spec, status, {"latency": latency, "throughput": 20.0}, duration_s=10.5)

    tuner.results = {0: measured(0, 1, 1, 100.0), -1: measured(-1, 101, 1, 200.0),
                     -13: measured(-13, 201, 3, 350.0),
                     -12: measured(-12, 5000, 2, 0.0, TrialStatus.OOM)}   # no time: left out
    assert tuner._search_settings().max_micro_batch == 1 + int((118_000 - 100) // 1.25) == 94321


@pytest.mark.parametrize("oom_at_point", [False, True])
def test_each_other_stage_is_measured_near_its_boundary(tmp_path, oom_at_point):
    # The orchestrator's per-stage profiling trials, with simulated results (no processes): calibrated
    # at stage 1 and micro-batch 10 (20 MiB + 1 MiB per example, 100 MiB budget), stage 3 is measured
    # at half its predicted boundary (40); after an out-of-memory there, once more at 10 (id -23).
    from toolkit.dsat.contract import ProfileInfo, TrialStatus
    from toolkit.dsat.search import memory
    from toolkit.dsat.search.types import TrialResult

    mib = 2 ** 20
    plan = plan_for(tmp_path, make_model_dir(tmp_path, slots=2), "--zero-stages", "3")
    profile = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=mib,
                          memory_per_slot=100 * mib, baseline_bytes=20 * mib, micro_batch=10,
                          peak_bytes=30 * mib, calibrated=True)
    ran = []

    def trial(spec):  # stage 3 holds 0.1 MiB more per example than the line
        ran.append((spec.trial_id, spec.stage, spec.micro_batch))
        if oom_at_point and spec.micro_batch == 40 and spec.stage == 3:
            return TrialResult(spec, TrialStatus.OOM)
        peak = 20 * mib + spec.micro_batch * mib + (spec.micro_batch * mib // 10 if spec.stage == 3 else 0)
        return TrialResult(spec, TrialStatus.OK, profile={**profile.to_json(), "peak_bytes": peak})

    # no timings: points at most 4 k
    phase = ProfilingPhase(plan, out=tmp_path, say=lambda line: None, run_trial=trial, keep=ran.append,
                           events=[])
    calibration = TrialSpec(-1, 10, {"stage": 1}, line=-1, profile=True)
    measured: list = []
    out = phase._stage_extras(calibration, profile, measured)
    predicted = memory.approx_max_micro_batch(out, 3, data_parallel_size=2)
    # stage 1, calibrated but not searched, is not measured again
    if oom_at_point:
        assert ran == [(-13, 3, 40), (-23, 3, 10)]
        assert predicted == 39           # the per-example reading at 10 says 72; 40 ran out of memory
    else:
        assert ran == [(-13, 3, 40)] and len(measured) == 1
        assert out.stage_extra_bytes == {"3": mib}      # 4 MiB at 40, referred to k = 10
        assert predicted == 80 * mib * 10 // (11 * mib) == 72   # 1.1 MiB per example: the true boundary


def _tuner_on_a_bending_peak(tmp_path, results):
    """A profiling phase searching stage 1 (no processes: simulated profiling trials, whose peak grows
    as 20 + m + m^2/400 MiB, as a CPU rank's does when the C allocator keeps freed activations in its
    heap), with ``results`` as the profiling trials run so far, and the (id, stage, micro-batch) list
    of the trials it ran."""
    from toolkit.dsat.contract import ProfileInfo, TrialStatus
    from toolkit.dsat.search.types import TrialResult

    mib = 2 ** 20
    plan = plan_for(tmp_path, make_model_dir(tmp_path, slots=2), "--zero-stages", "1")
    ran: list = []
    measured = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=mib,
                           memory_per_slot=mib, micro_batch=1)

    def trial(spec):
        ran.append((spec.trial_id, spec.stage, spec.micro_batch))
        peak = 20 * mib + spec.micro_batch * mib + spec.micro_batch ** 2 * mib // 400
        return TrialResult(spec, TrialStatus.OK, profile={**measured.to_json(), "peak_bytes": peak})

    phase = ProfilingPhase(plan, out=tmp_path, say=lambda line: None, run_trial=trial, keep=ran.append,
                           events=[])
    phase.results = dict(results)
    return phase, ran


def _first_profile():
    """The micro-batch-1 profiling trial's record, as the phase keeps it (the ladder refits from it)."""
    from toolkit.dsat.contract import ProfileInfo
    mib = 2 ** 20
    first = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=mib,
                        memory_per_slot=100 * mib, micro_batch=1, peak_bytes=21 * mib)
    return [{**first.to_json(), "zero_stage": 1}]


def _calibrated_at_10(budget_mib):
    from toolkit.dsat.contract import ProfileInfo
    mib = 2 ** 20
    return ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=mib,
                       memory_per_slot=budget_mib * mib, baseline_bytes=20 * mib, micro_batch=10,
                       peak_bytes=30 * mib, calibrated=True)


def test_the_profiled_stage_is_measured_again_where_its_peak_bends(tmp_path):
    # Calibrated at 1 and 10, the line says 80 (100 MiB budget); the point at 40 sees 4 MiB more
    # than the line, and refitted through 10 and 40 the prediction is 71, against a true boundary
    # of 68. No timings: the point is at most 4 k. A point not above k measures nothing.
    from toolkit.dsat.search import memory

    calibration = TrialSpec(-1, 10, {"stage": 1}, line=-1, profile=True)
    for budget, expected_runs, expected in ((100, [(-11, 1, 40)], 71), (30, [], 10)):
        (tmp_path / str(budget)).mkdir()
        tuner, ran = _tuner_on_a_bending_peak(tmp_path / str(budget), {})
        out = tuner._stage_extras(calibration, _calibrated_at_10(budget), _first_profile())
        assert ran == expected_runs
        assert memory.approx_max_micro_batch(out, 1, data_parallel_size=2) == expected


def test_a_cheap_step_lets_the_point_come_near_the_boundary(tmp_path):
    # The same bending peak with a 1000 MiB budget: the line says 980, whose half is 490. The
    # profiling trials' steps cost 20 ms at micro-batch 1 and 21 ms at 10 (a step's fixed cost
    # dominates), so the point is not held to 4 k = 40: refitted through 10 and 490, the
    # prediction is 441 against a true boundary of 457 (through 10 and 40 it would be over 860).
    # (The simulation does not enforce the budget: the point's peak is above it.)
    from toolkit.dsat.contract import TrialStatus
    from toolkit.dsat.search import memory
    from toolkit.dsat.search.types import TrialResult

    calibration = TrialSpec(-1, 10, {"stage": 1}, line=-1, profile=True)
    timed = {0: (TrialSpec(0, 1, {"stage": 1}, line=-1, profile=True), 20.0), -1: (calibration, 21.0)}
    results = {i: TrialResult(spec, TrialStatus.OK, {"throughput": spec.micro_batch * 2 * 1000 / ms})
               for i, (spec, ms) in timed.items()}
    tuner, ran = _tuner_on_a_bending_peak(tmp_path, results)
    out = tuner._stage_extras(calibration, _calibrated_at_10(1000), _first_profile())
    assert ran == [(-11, 1, 490)]
    assert memory.approx_max_micro_batch(out, 1, data_parallel_size=2) == 441


@pytest.mark.parametrize("method", ["binary", "random", "asha"])
def test_profiling_trials_at_configurations_of_the_search_count_as_results(tmp_path, method):
    # The orchestrator hands the profiling trials to the searcher (no processes): those at the
    # user's ZeRO section of a searched stage are results of the search and may be its best, for
    # every method alike (random did not count them: its best was below its own profiling trials').
    from toolkit.dsat.contract import ProfileInfo, TrialStatus
    from toolkit.dsat.orchestrator import Autotuner
    from toolkit.dsat.search import make_searcher
    from toolkit.dsat.search.types import TrialResult

    plan = plan_for(tmp_path, make_model_dir(tmp_path, slots=2), "--zero-stages", "1", "2",
                 "--metric", "throughput", method=method)
    said: list[str] = []
    tuner = object.__new__(Autotuner)
    tuner.plan, tuner.say = plan, said.append

    def result(trial_id, stage, mb, value, label, zero=None):
        return TrialResult(TrialSpec(trial_id, mb, zero or {"stage": stage}, profile=True, label=label),
                           TrialStatus.OK, {"throughput": value, "FLOPS_per_gpu": value, "latency": 1.0,
                                            "forward": 1.0, "backward": 1.0})

    tuner.results = {0: result(0, 1, 1, 10.0, "p1"), -1: result(-1, 1, 8, 80.0, "p2"),
                     -12: result(-12, 2, 8, 90.0, "p3"),
                     -13: result(-13, 3, 8, 99.0, "p4", {"stage": 3})}  # stage 3 is not searched
    profile = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=1,
                          memory_per_slot=64)
    searcher = make_searcher(plan.search, profile)
    tuner._take_profiling(searcher)
    assert tuner.taken == {0, -1, -12} and searcher.best is tuner.results[-12]
    assert said == ["profiling trials taken as results of the search: p1 (stage 1, mb 1), p2 (stage 1, "
                    "mb 8), p3 (stage 2, mb 8)"]
    assert [r.spec.trial_id for r in tuner._candidates()] == [0, -1, -12]
    if method == "binary":
        (spec,) = searcher.propose(1)  # the best's line goes on: 4x its micro-batch, up to the top
        assert spec.stage == 2 and spec.micro_batch > 8


@pytest.mark.parametrize("max_trials, expected", [(2, 1), (3, 2), (5, 4), (50, 5)])
def test_the_profiling_trials_leave_one_tuning_trial_in_max_trials(tmp_path, max_trials, expected):
    # The whole phase on the bending peak, searching stages 1-3 (no processes): unbounded it runs 5
    # profiling trials (the first, calibration, one ladder point and a point per other stage); under
    # --max-trials it stops where one tuning trial is left (with 2, uncalibrated), and the searcher
    # gets that one. Before, --max-trials 2 ran all 5 and still left 1 tuning trial: 6 in all.
    from toolkit.dsat.contract import ProfileInfo, TrialStatus
    from toolkit.dsat.orchestrator import Autotuner
    from toolkit.dsat.search.types import TrialResult

    mib = 2 ** 20
    plan = plan_for(tmp_path, make_model_dir(tmp_path, slots=2), "--zero-stages", "1", "2", "3",
                    "--memory-per-slot", "1000MiB", "--max-trials", str(max_trials))
    shape = ProfileInfo(num_params=0, trainable_params=0, activation_bytes_per_example=mib,
                        memory_per_slot=mib, micro_batch=1)
    ran: list = []

    def trial(spec):
        ran.append(spec.trial_id)
        peak = 20 * mib + spec.micro_batch * mib + spec.micro_batch ** 2 * mib // 400
        return TrialResult(spec, TrialStatus.OK, profile={**shape.to_json(), "peak_bytes": peak})

    said: list[str] = []
    (tmp_path / "out").mkdir()
    phase = ProfilingPhase(plan, out=tmp_path / "out", say=said.append, run_trial=trial, keep=ran.append,
                           events=[])
    assert phase.run() is not None
    assert len(ran) == expected and ran[0] == 0
    assert (max_trials == 2) == any("--max-trials leaves no room for a calibration trial" in s for s in said)
    tuner = object.__new__(Autotuner)
    tuner.plan, tuner.say, tuner.results = plan, said.append, phase.results
    tuning = tuner._search_settings().max_trials - 1   # what the searcher may still propose
    assert tuning >= 1 and (max_trials == 50 or len(ran) + tuning == max_trials)


def test_under_a_kept_batch_the_first_profiling_trial_is_not_a_result(tmp_path):
    # It ran micro-batch 1 with accumulation 1 (memory only), not the kept 64: its throughput is not
    # one of a config of the search. The calibration trial, which kept the batch, is.
    from toolkit.dsat.contract import ProfileInfo, TrialStatus
    from toolkit.dsat.orchestrator import Autotuner
    from toolkit.dsat.search import make_searcher
    from toolkit.dsat.search.types import TrialResult

    plan = plan_for(tmp_path, make_model_dir(tmp_path, slots=2, ds=KEEP_64), "--zero-stages", "1",
                    "--metric", "throughput")
    said: list[str] = []
    tuner = object.__new__(Autotuner)
    tuner.plan, tuner.say = plan, said.append
    metrics = {"throughput": 50.0, "FLOPS_per_gpu": 50.0, "latency": 1.0, "forward": 1.0, "backward": 1.0}
    tuner.results = {0: TrialResult(TrialSpec(0, 1, {"stage": 1}, profile=True, label="p1"), TrialStatus.OK,
                                    {**metrics, "throughput": 99.0}),
                     -1: TrialResult(TrialSpec(-1, 8, {"stage": 1}, profile=True, label="p2"), TrialStatus.OK,
                                     metrics)}
    assert plan.memory_only(tuner.results[0].spec) and not plan.memory_only(tuner.results[-1].spec)
    searcher = make_searcher(plan.search, ProfileInfo(num_params=0, trainable_params=0,
                                                      activation_bytes_per_example=1, memory_per_slot=64))
    tuner._take_profiling(searcher)
    assert tuner.taken == {-1} and searcher.best is tuner.results[-1]
    assert said == ["profiling trials taken as results of the search: p2 (stage 1, mb 8)"]
