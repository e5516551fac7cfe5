"""The autotuner's profiling phase: runs the profiling trials (through the autotuner's ``run_trial``)
whose measurements calibrate the memory model, and writes ``profile.json``. The decisions are
:mod:`toolkit.dsat.search.calibration`'s and :mod:`toolkit.dsat.search.memory`'s; the trials, their ids
and labels: docs/design-dsat-runner.md#the-autotuners-process. The trials after the first count in
``--max-trials`` and stop where one tuning trial is left. Rank 0 only (the autotuner's own process).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.dsat.contract import ProfileInfo, TrialStatus
from toolkit.dsat.search import boundaries, calibration, memory
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.dsat.tuning_plan import Plan, profile_spec
from toolkit.errors import ConfigError

__all__ = ["ProfilingPhase", "budget_share", "budget_share_line", "extra_profiling_trials",
           "record_boundaries"]

_MIB = 2**20


def extra_profiling_trials(trial_ids: Iterable[int]) -> int:
    """The profiling trials after the first among ``trial_ids`` (ids below 0), which count in
    ``--max-trials`` beside the first profiling trial and the tuning trials. Pure; any rank."""
    return sum(1 for trial_id in trial_ids if trial_id < 0)


def budget_share(profile: Mapping[str, Any]) -> dict[str, Any] | None:
    """What micro-batch 1 takes of the budget per slot, from the first profiling trial's profile
    (as JSON): the start-up peak (after the engine was built, before the first step), the
    training steps' peak, and the larger one's share of ``memory_per_slot`` (on CPU
    ``--memory-per-slot``, on GPUs the device's memory). None without a budget or a peak. Pure.

    >>> budget_share({"memory_per_slot": 1000, "startup_peak_bytes": 500, "peak_bytes": 620})
    {'budget_bytes': 1000, 'startup_peak_bytes': 500, 'step_peak_bytes': 620, 'share': 0.62}
    """
    budget, startup = int(profile.get("memory_per_slot") or 0), int(profile.get("startup_peak_bytes") or 0)
    step = int(profile.get("peak_bytes") or 0)
    if budget <= 0 or max(startup, step) <= 0:
        return None
    return {"budget_bytes": budget, "startup_peak_bytes": startup, "step_peak_bytes": step,
            "share": round(max(startup, step) / budget, 4)}


def budget_share_line(share: Mapping[str, Any]) -> str:
    """The closing line of :func:`budget_share`. Pure.

    >>> budget_share_line(budget_share({"memory_per_slot": 2**30, "startup_peak_bytes": 500 * 2**20,
    ...                                 "peak_bytes": 620 * 2**20}))[:60]
    'micro-batch 1 takes 61% of the 1024 MiB budget per slot (sta'
    """
    startup, step = share["startup_peak_bytes"], share["step_peak_bytes"]
    parts = ([f"start-up peak {startup / _MIB:.0f} MiB"] if startup else []) + \
        ([f"training steps' peak {step / _MIB:.0f} MiB"] if step else [])
    return (f"micro-batch 1 takes {100 * share['share']:.0f}% of the {share['budget_bytes'] / _MIB:.0f} MiB "
            f"budget per slot ({', '.join(parts)})")


def record_boundaries(out: Path, results: list[TrialResult], say: Callable[[str], None]) -> None:
    """Add the boundary the trials found per stage beside the prediction in ``out/profile.json``;
    say it. A damaged record is rewritten with the boundaries alone (said)."""
    path = out / "profile.json"
    if not path.exists():
        return
    try:
        recorded = load_json(path, what="profile record")
    except ConfigError as err:  # damaged by hand or by another program: the boundaries go in a new one
        say(f"{path} is damaged ({'; '.join(err.problems)}); it is rewritten with the boundaries "
            "found only (the prediction is in the log above)")
        recorded = {}
    found = boundaries.found_boundaries(results)
    recorded["found"] = {str(stage): row for stage, row in found.items()}
    atomic_write_json(path, recorded)
    if found:
        prediction = recorded.get("prediction")
        prediction = {k: v for k, v in prediction.items() if isinstance(v, dict)} \
            if isinstance(prediction, dict) else {}
        say("memory model, predicted vs found:\n" + boundaries.format_boundaries(prediction, found))


class ProfilingPhase:
    """The profiling trials of one search, for ``plan``, writing ``out/profile.json``, progress lines to
    ``say``. ``run_trial`` runs one trial to its end and records it; ``keep`` records a result reused
    from ``events`` (the event log so far: ``--resume`` reuses the profiling trials that succeeded).
    Rank 0 only."""

    def __init__(self, plan: Plan, *, out: Path, say: Callable[[str], None],
                 run_trial: Callable[[TrialSpec], TrialResult], keep: Callable[[TrialResult], None],
                 events: list[dict[str, Any]]) -> None:
        self.plan, self.out, self.say = plan, out, say
        self._run, self._keep, self._events = run_trial, keep, events
        self.results: dict[int, TrialResult] = {}  # the profiling trials, in the order they ran

    def _room(self) -> bool:
        """Whether another profiling trial after the first fits in ``--max-trials``: the first
        profiling trial, these, and at least one tuning trial."""
        return extra_profiling_trials(self.results) < self.plan.search.max_trials - 2

    def _run_profiling_trial(self, spec: TrialSpec) -> TrialResult:
        """A profiling trial's result: the recorded one (--resume) when it succeeded, or for the
        calibration trial (id < 0) when it ran out of memory at the same micro-batch; else a new
        run. Labelled ``p<n>``, ``n`` its place in the order the profiling trials ran."""
        spec = dataclasses.replace(spec, label=f"p{len(self.results) + 1}")
        recorded = [TrialResult.from_json(e["result"]) for e in self._events
                    if e["event"] == "result" and e["trial_id"] == spec.trial_id]
        reusable = (TrialStatus.OK,) if spec.trial_id == 0 else (TrialStatus.OK, TrialStatus.OOM)
        if recorded and recorded[-1].status in reusable and recorded[-1].spec.micro_batch == spec.micro_batch:
            result = dataclasses.replace(recorded[-1], spec=dataclasses.replace(recorded[-1].spec,
                                                                                label=spec.label))
            self.results[spec.trial_id] = result
            self._keep(result)
            self.say(f"profiling trial {spec.name}: reusing the recorded result")
            return result
        stage = "the script's own ZeRO section" if self.plan.awaiting_config else f"stage {spec.stage}"
        self.say(f"profiling trial {spec.name} ({stage}, micro-batch {spec.micro_batch}) ...")
        result = self._run(spec)
        self.results[spec.trial_id] = result
        return result

    def _measured(self, result: TrialResult) -> ProfileInfo:
        """A profiling trial's profile with the CPU budget of the plan and the trial's micro-batch."""
        fields = dict(result.profile or {})
        if self.plan.memory_per_slot is not None and fields.get("device", "cpu") == "cpu":
            fields["memory_per_slot"] = self.plan.memory_per_slot
        fields["micro_batch"] = result.spec.micro_batch
        return ProfileInfo.from_json(fields)

    def _calibrate(self, first: TrialResult) -> tuple[ProfileInfo, list[dict[str, Any]]]:
        """The memory model's profile: calibrated by a second profiling trial of the same ZeRO
        section at a larger micro-batch (trial -1; after an out-of-memory, once more at a quarter
        of it, trial -2), or the first profile alone when that is impossible. Also the measured
        profiles, for ``profile.json``."""
        profile, dp = self._measured(first), self.plan.data_parallel_size
        off_opt, off_par = memory.offload_flags(first.spec.zero)
        latency = first.metrics.get("latency") if self.plan.step_grows_with_micro_batch(first) else None
        k = calibration.calibration_micro_batch(profile, first.spec.stage, data_parallel_size=dp,
                                           latency_ms=latency,
                                           offload_optimizer=off_opt, offload_param=off_par)
        measured, why = [profile.to_json()], "the first profile has no peak-memory measurement"
        for trial_id in (-1, -2):
            k = self.plan.allowed_at_most(k)  # the global batch policy: a micro-batch that keeps it
            if k is None or k <= profile.micro_batch:
                break
            if not self._room():
                why = ("--max-trials leaves no room for a calibration trial" if trial_id == -1
                       else f"{why}, and --max-trials leaves no room for another")
                break
            result = self._run_profiling_trial(
                dataclasses.replace(first.spec, trial_id=trial_id, micro_batch=k))
            if result.status is TrialStatus.OK and result.profile:
                second = self._measured(result)
                measured.append(second.to_json())
                model = memory.model_memory_bytes(profile, first.spec.stage, data_parallel_size=dp,
                                                  offload_optimizer=off_opt, offload_param=off_par)
                calibrated = calibration.calibrate(profile, second, model_memory=model)
                return self._stage_extras(result.spec, calibrated, measured), measured
            why = f"the calibration trial at micro-batch {k} ended {result.status.value}"
            k = k // 4 if result.status is TrialStatus.OOM and k // 4 >= 2 else None
        self.say(f"memory model not calibrated ({why}): the estimate from the leaf outputs alone may be "
                 "several times too large")
        return profile, measured

    def _stage_extras(self, spec: TrialSpec, profile: ProfileInfo,
                      measured: list[dict[str, Any]]) -> ProfileInfo:
        """``profile`` with each searched stage's measured extra, one profiling trial per stage at half its
        predicted boundary (``calibration.stage_point_micro_batch``), its ZeRO section built on the
        calibration trial's; ids, order and retries: docs/design-dsat-runner.md#the-autotuners-process."""
        dp, at_most = self.plan.data_parallel_size, self._point_cap(spec)
        for stage in sorted(set(self.plan.search.zero_stages), key=lambda s: s != spec.stage):  # profiled 1st
            k = int(profile.micro_batch)  # the calibration point (the profiled stage's point once refitted)
            zero = {key: value for key, value in spec.zero.items()
                    if not (key == "offload_optimizer" and stage < 2 or key == "offload_param" and stage < 3)}
            zero["stage"] = stage
            off_opt, off_par = memory.offload_flags(zero)
            model = memory.model_memory_bytes(profile, stage, data_parallel_size=dp,
                                              offload_optimizer=off_opt, offload_param=off_par)
            point = self.plan.allowed_at_most(calibration.stage_point_micro_batch(
                profile, stage, data_parallel_size=dp, offload_optimizer=off_opt, offload_param=off_par,
                at_most=at_most)) or k
            readings: list[ProfileInfo] = []
            points: tuple[tuple[int, int], ...] = ((-10 - stage, max(point, k)), (-20 - stage, k))
            if stage == spec.stage:  # measured at k already: a ladder of points above it
                profile = self._climb(spec, zero, profile, measured, model=model)
                continue
            for trial_id, m in points:
                if not self._room():
                    break
                result = self._run_profiling_trial(
                    dataclasses.replace(spec, trial_id=trial_id, zero=zero, micro_batch=m))
                if result.status is TrialStatus.OK and result.profile:
                    at_stage = self._measured(result)
                    measured.append({**at_stage.to_json(), "zero_stage": stage})
                    if stage == spec.stage:  # the line through k and this point
                        readings.append(calibration.refit(profile, at_stage, model_memory=model,
                                                          first=ProfileInfo.from_json(measured[0])))
                        break
                    peak = at_stage.peak_bytes
                elif result.status is TrialStatus.OOM:  # a peak that makes the prediction m - 1 at most
                    peak = int(profile.memory_per_slot) + int(profile.activation_bytes_per_example)
                else:
                    break
                readings.append(memory.with_stage_extra(profile, stage, micro_batch=m, peak_bytes=peak,
                                                        model_memory=model))
                if result.status is not TrialStatus.OOM or m == k:
                    break
            if readings:  # after an out-of-memory at the point and a success at k: the smaller prediction
                profile = min(readings, key=lambda p: memory.approx_max_micro_batch(
                    p, stage, data_parallel_size=dp, offload_optimizer=off_opt, offload_param=off_par))
        return profile

    def _climb(self, spec: TrialSpec, zero: dict[str, Any], profile: ProfileInfo,
               measured: list[dict[str, Any]], *, model: int) -> ProfileInfo:
        """The profiled stage's ladder (``calibration.climb``): up to 3 profiling trials (ids
        -10, -30, -40 less the stage) nearer its boundary, each refitting the line."""
        dp, stage = self.plan.data_parallel_size, spec.stage
        off_opt, off_par = memory.offload_flags(zero)
        ids = iter((-10 - stage, -30 - stage, -40 - stage))
        times = []
        for trial_id in (0, spec.trial_id):
            result = self.results.get(trial_id)
            throughput = float(result.metrics.get("throughput") or 0.0) if result else 0.0
            if result is not None and throughput > 0:
                times.append((result.spec.micro_batch, 1000.0 * result.spec.micro_batch * dp / throughput))

        def measure(m: int) -> tuple[str, ProfileInfo | None, float | None]:
            result = self._run_profiling_trial(dataclasses.replace(spec, trial_id=next(ids), zero=zero,
                                                                   micro_batch=m))
            at = self._measured(result) if result.status is TrialStatus.OK and result.profile else None
            if at is not None:
                measured.append({**at.to_json(), "zero_stage": stage})
            throughput = float(result.metrics.get("throughput") or 0.0)
            return result.status.value, at, (1000.0 * m * dp / throughput if throughput > 0 else None)

        first = ProfileInfo.from_json(measured[0])
        return calibration.climb(profile, stage, data_parallel_size=dp, first=first,
                                 times=times, model_memory=model, measure=measure,
                                 allowed=lambda m: self.plan.allowed_at_most(m) if self._room() else None,
                                 offload_optimizer=off_opt,
                                 offload_param=off_par)

    def _point_cap(self, spec: TrialSpec) -> int | None:
        """The stages' points at most (``calibration.time_capped_point``), from the time per
        micro-batch of the first profiling trial and the calibration trial; None (4 k) when
        either lacks its throughput."""
        points = []
        for trial_id in (0, spec.trial_id):
            result = self.results.get(trial_id)
            throughput = float(result.metrics.get("throughput") or 0.0) if result else 0.0
            if result is None or throughput <= 0:
                return None
            ms = 1000.0 * result.spec.micro_batch * self.plan.data_parallel_size / throughput
            points.append((result.spec.micro_batch, ms))
        return calibration.time_capped_point(points[0], points[1])

    def run(self) -> ProfileInfo | None:
        """Run (or reuse) the profiling trials; the memory model's profile, with its prediction,
        the measured profiles and what micro-batch 1 takes of the budget written to
        ``profile.json``. None when the first profiling trial failed."""
        result = self._run_profiling_trial(profile_spec(self.plan.base_ds_config))
        if result.status is not TrialStatus.OK or not result.profile:
            return None
        profile, measured = self._calibrate(result)
        # The user's offload intent, as if at stage 3; predict applies what each stage allows.
        offload_optimizer, offload_param = memory.offload_flags({**self.plan.search.base_zero, "stage": 3})
        prediction = memory.predict(profile, data_parallel_size=self.plan.data_parallel_size,
                                    zero_stages=self.plan.search.zero_stages,
                                    offload_optimizer=offload_optimizer, offload_param=offload_param)
        share = budget_share(measured[0])
        atomic_write_json(self.out / "profile.json",
                          {"profile": profile.to_json(), "measured": measured,
                           "prediction": {str(k): v for k, v in prediction.items()},
                           "micro_batch_1": share})
        kind = "peak memory" if profile.calibrated else "activations"
        self.say(f"model: {profile.num_params:,} parameters ({profile.trainable_params:,} trainable), "
                 f"{kind} {profile.activation_bytes_per_example:,} bytes/example, "
                 f"{profile.memory_per_slot:,} bytes per slot ({profile.device})")
        if share is not None:
            self.say(budget_share_line(share))
        self.say(memory.format_prediction(prediction, profile=profile))
        return profile

    def _record_boundaries(self, results: list[TrialResult]) -> None:
        """:func:`record_boundaries` into this phase's output directory."""
        record_boundaries(self.out, results, self.say)
