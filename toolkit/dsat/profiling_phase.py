"""The autotuner's profiling phase: the profiling trials and the memory model they calibrate.

A mixin of :class:`toolkit.dsat.orchestrator.Autotuner`, apart because it is one concern: the
micro-batch-1 profiling trial, the calibration trial at ``k``, one trial per searched stage at
half its predicted boundary, ``profile.json`` with the prediction, and at the end the boundary
the trials found beside it. The decisions (where to measure, how a measurement changes the
model) are the pure functions of :mod:`toolkit.dsat.search.calibration` and
:mod:`toolkit.dsat.search.memory`; this runs the trials.
Rank 0 only (the autotuner's own process).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.dsat.contract import ProfileInfo, TrialStatus
from toolkit.dsat.execution.runner import TrialRunner
from toolkit.dsat.plan import Plan, profile_spec
from toolkit.dsat.search import boundaries, calibration, memory
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.errors import ConfigError

__all__ = ["ProfilingPhase"]


class ProfilingPhase:
    """The profiling trials of an :class:`~toolkit.dsat.orchestrator.Autotuner`. Rank 0 only.

    The autotuner provides the plan, the results so far, and how a trial is started and
    recorded (the methods below that raise)."""

    plan: Plan
    out: Path
    results: dict[int, TrialResult]
    say: Callable[[str], None]

    def _start(self, runner: TrialRunner, spec: TrialSpec, *, observed_before: int, log: bool = True) -> None:
        raise NotImplementedError

    def _record(self, result: TrialResult, *, replayed: bool = False) -> None:
        raise NotImplementedError

    def _progress(self, result: TrialResult, running: int) -> None:
        raise NotImplementedError

    def _allowed_at_most(self, m: int | None) -> int | None:
        raise NotImplementedError

    def _step_grows_with_micro_batch(self, profiled: TrialResult) -> bool:
        raise NotImplementedError

    def _run_profiling_trial(self, runner: TrialRunner, events: list[dict[str, Any]],
                             spec: TrialSpec) -> TrialResult:
        """A profiling trial's result: the recorded one (--resume) when it succeeded, or for the
        calibration trial (id < 0) when it ran out of memory at the same micro-batch; else a new run."""
        recorded = [TrialResult.from_json(e["result"]) for e in events
                    if e["event"] == "result" and e["trial_id"] == spec.trial_id]
        reusable = (TrialStatus.OK,) if spec.trial_id == 0 else (TrialStatus.OK, TrialStatus.OOM)
        if recorded and recorded[-1].status in reusable and recorded[-1].spec.micro_batch == spec.micro_batch:
            self._record(recorded[-1], replayed=True)
            self.say(f"profiling trial {spec.trial_id}: reusing the recorded result")
            return recorded[-1]
        self.say(f"profiling trial {spec.trial_id} (micro-batch {spec.micro_batch}) ...")
        self._start(runner, spec, observed_before=0)
        done: list[TrialResult] = []
        while not done:
            done = runner.wait(timeout=1.0)
        self._record(done[0])
        self._progress(done[0], 0)
        return done[0]

    def _measured(self, result: TrialResult) -> ProfileInfo:
        """A profiling trial's profile with the CPU budget of the plan and the trial's micro-batch."""
        fields = dict(result.profile or {})
        if self.plan.memory_per_slot is not None and fields.get("device", "cpu") == "cpu":
            fields["memory_per_slot"] = self.plan.memory_per_slot
        fields["micro_batch"] = result.spec.micro_batch
        return ProfileInfo.from_json(fields)

    def _calibrate(self, runner: TrialRunner, events: list[dict[str, Any]],
                   first: TrialResult) -> tuple[ProfileInfo, list[dict[str, Any]]]:
        """The memory model's profile: calibrated by a second profiling trial of the same ZeRO
        section at a larger micro-batch (trial -1; after an out-of-memory, once more at a quarter
        of it, trial -2), or the first profile alone when that is impossible. Also the measured
        profiles, for ``profile.json``."""
        profile, dp = self._measured(first), self.plan.data_parallel_size
        off_opt, off_par = memory.offload_flags(first.spec.zero)
        latency = first.metrics.get("latency") if self._step_grows_with_micro_batch(first) else None
        k = calibration.calibration_micro_batch(profile, first.spec.stage, data_parallel_size=dp,
                                           latency_ms=latency,
                                           offload_optimizer=off_opt, offload_param=off_par)
        measured, why = [profile.to_json()], "the first profile has no peak-memory measurement"
        for trial_id in (-1, -2):
            k = self._allowed_at_most(k)  # the global batch policy: a micro-batch that keeps it
            if k is None or k <= profile.micro_batch:
                break
            result = self._run_profiling_trial(
                runner, events, dataclasses.replace(first.spec, trial_id=trial_id, micro_batch=k))
            if result.status is TrialStatus.OK and result.profile:
                second = self._measured(result)
                measured.append(second.to_json())
                model = memory.model_memory_bytes(profile, first.spec.stage, data_parallel_size=dp,
                                                  offload_optimizer=off_opt, offload_param=off_par)
                calibrated = calibration.calibrate(profile, second, model_memory=model)
                return self._stage_extras(runner, events, result.spec, calibrated, measured), measured
            why = f"the calibration trial at micro-batch {k} ended {result.status.value}"
            k = k // 4 if result.status is TrialStatus.OOM and k // 4 >= 2 else None
        self.say(f"memory model not calibrated ({why}): the estimate from the leaf outputs alone may be "
                 "several times too large")
        return profile, measured

    def _stage_extras(self, runner: TrialRunner, events: list[dict[str, Any]], spec: TrialSpec,
                      profile: ProfileInfo, measured: list[dict[str, Any]]) -> ProfileInfo:
        """``profile`` with each searched stage's measured extra: one profiling trial per stage
        (id -10 - stage) at half its predicted boundary (``calibration.stage_point_micro_batch``;
        after an out-of-memory there, once more at the calibration point, id -20 - stage), the
        stage's own ZeRO section built on the calibration trial's. The calibrated stage comes
        first, when its point lies above the calibration point: the line is refitted through k
        and that point (``calibration.refit``), which becomes k for the others. A stage that
        runs out of memory at a
        micro-batch is predicted to fit one example less at most; one that fails is left to the
        formula."""
        dp, at_most = self.plan.data_parallel_size, self._point_cap(spec)
        for stage in sorted(set(self.plan.search.zero_stages), key=lambda s: s != spec.stage):  # profiled 1st
            k = int(profile.micro_batch)  # the calibration point (the profiled stage's point once refitted)
            zero = {key: value for key, value in spec.zero.items()
                    if not (key == "offload_optimizer" and stage < 2 or key == "offload_param" and stage < 3)}
            zero["stage"] = stage
            off_opt, off_par = memory.offload_flags(zero)
            model = memory.model_memory_bytes(profile, stage, data_parallel_size=dp,
                                              offload_optimizer=off_opt, offload_param=off_par)
            point = self._allowed_at_most(calibration.stage_point_micro_batch(
                profile, stage, data_parallel_size=dp, offload_optimizer=off_opt, offload_param=off_par,
                at_most=at_most)) or k
            readings: list[ProfileInfo] = []
            points: tuple[tuple[int, int], ...] = ((-10 - stage, max(point, k)), (-20 - stage, k))
            if stage == spec.stage:  # measured at k already: only a point above it says more
                if point <= k:
                    continue
                points = points[:1]
            for trial_id, m in points:
                result = self._run_profiling_trial(
                    runner, events, dataclasses.replace(spec, trial_id=trial_id, zero=zero, micro_batch=m))
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

    def _profile(self, runner: TrialRunner, events: list[dict[str, Any]]) -> ProfileInfo | None:
        """Run (or reuse) the profiling trials; the memory model's profile, with its prediction and
        the measured profiles written to ``profile.json``. None when the profiling trial failed."""
        result = self._run_profiling_trial(runner, events, profile_spec(self.plan.base_ds_config))
        if result.status is not TrialStatus.OK or not result.profile:
            return None
        profile, measured = self._calibrate(runner, events, result)
        # The user's offload intent, as if at stage 3; predict applies what each stage allows.
        offload_optimizer, offload_param = memory.offload_flags({**self.plan.search.base_zero, "stage": 3})
        prediction = memory.predict(profile, data_parallel_size=self.plan.data_parallel_size,
                                    zero_stages=self.plan.search.zero_stages,
                                    offload_optimizer=offload_optimizer, offload_param=offload_param)
        atomic_write_json(self.out / "profile.json",
                          {"profile": profile.to_json(), "measured": measured,
                           "prediction": {str(k): v for k, v in prediction.items()}})
        kind = "peak memory" if profile.calibrated else "activations"
        self.say(f"model: {profile.num_params:,} parameters ({profile.trainable_params:,} trainable), "
                 f"{kind} {profile.activation_bytes_per_example:,} bytes/example, "
                 f"{profile.memory_per_slot:,} bytes per slot ({profile.device})")
        self.say(memory.format_prediction(prediction, profile=profile))
        return profile

    def _record_boundaries(self, results: list[TrialResult]) -> None:
        """Add the boundary the trials found per stage beside the prediction in ``profile.json``; say it."""
        path = self.out / "profile.json"
        if not path.exists():
            return
        try:
            recorded = load_json(path, what="profile record")
        except ConfigError as err:  # damaged by hand or by another program: the boundaries go in a new one
            self.say(f"{path} is damaged ({'; '.join(err.problems)}); it is rewritten with the boundaries "
                     "found only (the prediction is in the log above)")
            recorded = {}
        found = boundaries.found_boundaries(results)
        recorded["found"] = {str(stage): row for stage, row in found.items()}
        atomic_write_json(path, recorded)
        if found:
            prediction = recorded.get("prediction")
            prediction = {k: v for k, v in prediction.items() if isinstance(v, dict)} \
                if isinstance(prediction, dict) else {}
            self.say("memory model, predicted vs found:\n" + boundaries.format_boundaries(prediction, found))

