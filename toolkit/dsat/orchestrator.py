"""The search loop: profiling trial, memory model, search method, trials, outputs, resume.

Rank 0 only: this runs in the autotuner's own process (``python -m toolkit.dsat ...``); the
trials are separate launches of the user's entrypoint (see :mod:`toolkit.dsat.execution.runner`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Callable

from toolkit._files import atomic_write_json
from toolkit.config.deepspeed import BATCH_KEYS, overwrite_deepspeed_config
from toolkit.dsat import search
from toolkit.dsat.contract import ProfileInfo, TrialContract, TrialStatus
from toolkit.dsat.execution.runner import TrialRunner
from toolkit.dsat.plan import Plan, profile_spec, trial_ds_config
from toolkit.dsat.records import (
    EventLog,
    TensorBoardTrials,
    summary_table,
    write_trial_tables,
)
from toolkit.dsat.search import memory
from toolkit.dsat.search.batch import time_capped_micro_batch
from toolkit.dsat.search.types import SearchSettings, TrialResult, TrialSpec
from toolkit.dsat.trial.reporting import instrumentation_overrides

__all__ = ["Plan", "trial_ds_config", "profile_spec", "Autotuner", "SearchOutcome"]

logger = logging.getLogger(__name__)
TBS, MBS, GAS = BATCH_KEYS


@dataclasses.dataclass
class SearchOutcome:
    """How a search ended. ``exit_code``: 0 found a best config, 1 the search failed."""

    exit_code: int
    results: list[TrialResult]
    best: TrialResult | None
    message: str


class Autotuner:
    """Runs a :class:`Plan`. Rank 0 only.

    Args:
        plan: the checked plan.
        say: where progress lines and tables go (the CLI passes ``print``).
    """

    def __init__(self, plan: Plan, *, say: Callable[[str], None] = print) -> None:
        self.plan = plan
        self.say = say
        self.out = plan.output_dir
        self.log = EventLog(self.out / "events.jsonl")
        self.tensorboard = TensorBoardTrials(self.out / "tensorboard")
        self.results: dict[int, TrialResult] = {}
        self.taken: set[int] = set()  # profiling trials the searcher took as results
        self.started_at = time.monotonic()

    # ---------------------------------------------------------------- helpers
    def _config_for(self, spec: TrialSpec, *, instrumented: bool) -> dict[str, Any]:
        plan = self.plan
        config = trial_ds_config(plan.base_ds_config, spec, data_parallel_size=plan.data_parallel_size,
                                 train_batch_size=plan.global_batch.train_batch_size,
                                 hidden_size=plan.hidden_size)
        if instrumented:
            runner = self.plan.runner
            contract = TrialContract(spec.trial_id, "", runner.start_profile_step, runner.end_profile_step,
                                     spec.profile, runner.memory_per_slot)
            config = overwrite_deepspeed_config(config, instrumentation_overrides(contract))
        return config

    def _overrides(self, spec: TrialSpec) -> dict[str, Any]:
        """A trial's ``ds_overrides`` for trials.jsonl: its micro-batch, ZeRO section and batch triple."""
        config = self._config_for(spec, instrumented=False)
        return {**spec.ds_overrides(), TBS: config[TBS], GAS: config[GAS]}

    def _allowed_at_most(self, m: int | None) -> int | None:
        """The largest micro-batch the global batch policy allows that is ``<= m`` (None stays None)."""
        allowed = self.plan.search.micro_batches
        if m is None or allowed is None or m < 1:
            return m
        return max(a for a in allowed if a <= m)

    def _start(self, runner: TrialRunner, spec: TrialSpec, *, observed_before: int, log: bool = True) -> None:
        config = self._config_for(spec, instrumented=True)
        if log:
            self.log.started(spec, observed_before=observed_before)
        runner.start(spec, ds_config=config, hparams=self.plan.hparams)  # see contract.trial_hparams

    def _record(self, result: TrialResult, *, replayed: bool = False) -> None:
        """Keep a finished trial's result; log it unless it was replayed from the log; rewrite the tables."""
        self.results[result.spec.trial_id] = result
        if not replayed:
            self.log.finished(result)
            self.tensorboard.add(result)
        write_trial_tables(self.out, self.results.values(), overrides=self._overrides)

    def _candidates(self) -> list[TrialResult]:
        """The results the best is chosen from: the tuning trials and the profiling trials the
        searcher took as results (configurations of the search, timed like any trial)."""
        return [r for r in self.results.values() if not r.spec.profile or r.spec.trial_id in self.taken]

    def _progress(self, result: TrialResult, running: int) -> None:
        metric = self.plan.search.metric
        best = search.best_result(self._candidates(), metric)
        value = result.metrics.get(metric)
        shown = f"{metric}={value:.4g}" if value is not None else (result.error or "")[:120]
        best_text = f"best {best.metrics[metric]:.4g} (trial {best.spec.trial_id})" if best else "no best yet"
        self.say(f"[{len(self.results)}/{self.plan.search.max_trials}] trial {result.spec.trial_id} "
                 f"stage {result.spec.stage} mb {result.spec.micro_batch}: {result.status.value} {shown} | "
                 f"{best_text} | running {running} | {time.monotonic() - self.started_at:.0f}s")

    # ---------------------------------------------------------------- phases
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
        k = memory.calibration_micro_batch(profile, first.spec.stage, data_parallel_size=dp,
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
                calibrated = memory.calibrate(profile, second, model_memory=model)
                return self._stage_extras(runner, events, result.spec, calibrated, measured), measured
            why = f"the calibration trial at micro-batch {k} ended {result.status.value}"
            k = k // 4 if result.status is TrialStatus.OOM and k // 4 >= 2 else None
        self.say(f"memory model not calibrated ({why}): the estimate from the leaf outputs alone may be "
                 "several times too large")
        return profile, measured

    def _stage_extras(self, runner: TrialRunner, events: list[dict[str, Any]], spec: TrialSpec,
                      profile: ProfileInfo, measured: list[dict[str, Any]]) -> ProfileInfo:
        """``profile`` with each searched stage's measured extra: one profiling trial per stage
        (id -10 - stage) at half its predicted boundary (``memory.stage_point_micro_batch``;
        after an out-of-memory there, once more at the calibration point, id -20 - stage), the
        stage's own ZeRO section built on the calibration trial's. The calibrated stage is
        measured too, when its point lies above the calibration point: the peak does not grow
        linearly (the C allocator's heap, buffers that grow with the batch), and a point nearer
        the boundary keeps the extrapolation short. A stage that runs out of memory at a
        micro-batch is predicted to fit one example less at most; one that fails is left to the
        formula."""
        dp, k = self.plan.data_parallel_size, spec.micro_batch
        for stage in sorted(set(self.plan.search.zero_stages)):
            zero = {key: value for key, value in spec.zero.items()
                    if not (key == "offload_optimizer" and stage < 2 or key == "offload_param" and stage < 3)}
            zero["stage"] = stage
            off_opt, off_par = memory.offload_flags(zero)
            model = memory.model_memory_bytes(profile, stage, data_parallel_size=dp,
                                              offload_optimizer=off_opt, offload_param=off_par)
            point = self._allowed_at_most(memory.stage_point_micro_batch(
                profile, stage, data_parallel_size=dp, offload_optimizer=off_opt, offload_param=off_par))
            readings = []
            points: tuple[tuple[int, int], ...] = ((-10 - stage, max(point or k, k)), (-20 - stage, k))
            if stage == spec.stage:  # measured at k already: only a point above it says more
                if (point or k) <= k:
                    continue
                points = points[:1]
            for trial_id, m in points:
                result = self._run_profiling_trial(
                    runner, events, dataclasses.replace(spec, trial_id=trial_id, zero=zero, micro_batch=m))
                if result.status is TrialStatus.OK and result.profile:
                    at_stage = self._measured(result)
                    measured.append({**at_stage.to_json(), "zero_stage": stage})
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

    def run_profiling(self) -> ProfileInfo | None:
        """Only the profiling trials and the memory model (``profile.json``), no search: for
        benchmarks of the memory model (``scripts/bench_memory.py``). Rank 0 only.

        Example::

            profile = Autotuner(make_plan(args), say=print).run_profiling()
        """
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "trials").mkdir(exist_ok=True)
        with TrialRunner(self.plan.runner, output_dir=self.out) as runner:
            return self._profile(runner, self.log.read())

    def _record_boundaries(self, results: list[TrialResult]) -> None:
        """Add the boundary the trials found per stage beside the prediction in ``profile.json``; say it."""
        path = self.out / "profile.json"
        if not path.exists():
            return
        recorded = json.loads(path.read_text(encoding="utf-8"))
        found = memory.found_boundaries(results)
        recorded["found"] = {str(stage): row for stage, row in found.items()}
        atomic_write_json(path, recorded)
        if found:
            self.say("memory model, predicted vs found:\n"
                     + memory.format_boundaries(recorded.get("prediction", {}), found))

    def run(self) -> SearchOutcome:
        """Run (or resume) the search. Interrupting it (Ctrl-C) kills every trial; the record stays."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "trials").mkdir(exist_ok=True)
        events = self.log.read()
        atomic_write_json(self.out / "search.json", self.plan.fingerprint())
        self.say(self.plan.global_batch.describe())
        with TrialRunner(self.plan.runner, output_dir=self.out) as runner:
            profile = self._profile(runner, events)
            if profile is None:
                failed = self.results[0]
                return SearchOutcome(1, list(self.results.values()), None,
                                     f"the profiling trial failed ({failed.status.value}): {failed.error}; "
                                     f"its logs are in {self.out / 'trials' / 'trial_0'}")
            searcher: search.Searcher = search.make_searcher(self._search_settings(), profile)
            self._take_profiling(searcher)
            observed = self._replay(searcher, runner, events)
            while not searcher.done:
                for spec in searcher.propose(runner.capacity()):
                    self._start(runner, spec, observed_before=observed)
                if runner.running() == 0:
                    break  # nothing in flight and nothing proposed: the method has finished
                for result in runner.wait(timeout=1.0):
                    self._record(result)
                    searcher.observe(result)
                    observed += 1
                    self._progress(result, runner.running())
        return self._conclude()

    def _take_profiling(self, searcher: search.Searcher) -> None:
        """Give the profiling trials to the searcher (in the order they ran, also on --resume):
        those at configurations of the search count as its results, not as trials lost."""
        taken = searcher.observe_profiling([r for r in self.results.values() if r.spec.profile])
        self.taken = {r.spec.trial_id for r in taken}
        if taken:
            self.say("profiling trials taken as results of the search: " + ", ".join(
                f"{r.spec.trial_id} (stage {r.spec.stage}, mb {r.spec.micro_batch})" for r in taken))

    def _search_settings(self) -> SearchSettings:
        """The plan's search settings for the searcher: the micro-batch capped by the trial timeout
        (:meth:`_time_cap`), and ``max_trials`` less the extra profiling (calibration) trials, so that
        ``--max-trials`` counts every trial of the search."""
        extra = sum(1 for trial_id in self.results if trial_id < 0)
        return dataclasses.replace(self.plan.search, max_micro_batch=self._time_cap(),
                                   max_trials=max(self.plan.search.max_trials - extra, 2))

    def _step_grows_with_micro_batch(self, profiled: TrialResult) -> bool:
        """Whether a timed step's examples grow with the micro-batch: not when the global batch is
        kept and the profiling trial's timed step spanned its accumulation steps (more than one
        micro-batch per step): then every step is ``train_batch_size`` examples."""
        latency = float(profiled.metrics.get("latency") or 0.0)
        micro_per_step = (float(profiled.metrics.get("throughput") or 0.0) * latency / 1000.0
                          / self.plan.data_parallel_size / max(profiled.spec.micro_batch, 1))
        return self.plan.global_batch.train_batch_size is None or micro_per_step <= 1.5

    def _time_cap(self) -> int | None:
        """The largest micro-batch no trial is predicted to run past the trial timeout with (the
        profiling trial's step time, linear in the micro-batch); None: no cap.

        With the global batch kept and a timed step that spans the accumulation steps (more than
        one micro-batch per step), a step's examples do not grow with the micro-batch: no cap."""
        runner, profiled = self.plan.runner, self.results[0]
        latency = float(profiled.metrics.get("latency") or 0.0)
        if not self._step_grows_with_micro_batch(profiled):
            return None
        steps = runner.end_profile_step
        overhead = profiled.duration_s - steps * latency / 1000.0
        cap = time_capped_micro_batch(latency, steps=steps, timeout_s=runner.timeout_s, overhead_s=overhead)
        if cap is None:
            return None
        logger.info("trial timeout %gs: no micro-batch above %d (predicted %.0fs start-up + %d steps x %.4g "
                    "ms x micro-batch)", runner.timeout_s, cap, overhead, steps, latency)
        top = self.plan.search.micro_batches[-1] if self.plan.search.micro_batches else None
        if top is None or cap < top:
            self.say(f"trial timeout {runner.timeout_s:g}s: micro-batches above {cap} are not tried "
                     f"(predicted {overhead:.0f}s start-up + {steps} steps x {latency:.4g} ms x micro-batch)")
        return cap

    def _replay(self, searcher: search.Searcher, runner: TrialRunner, events: list[dict[str, Any]]) -> int:
        """Feed a resumed search's recorded results through the fresh searcher; rerun the unfinished."""
        results, observed_before, seen = [], {}, set()
        for event in events:
            if event["trial_id"] <= 0:  # the profiling trials
                continue
            if event["event"] == "start":
                observed_before[event["trial_id"]] = event["observed_before"]
            elif event["trial_id"] not in seen:
                seen.add(event["trial_id"])
                results.append(TrialResult.from_json(event["result"]))
        if not observed_before:
            return 0
        in_flight = search.replay(searcher, results=results, observed_before=observed_before)
        for result in results:
            self._record(result, replayed=True)
        self.say(f"resumed: {len(results)} finished trial(s) kept, {len(in_flight)} interrupted trial(s) "
                 "rerun")
        for spec in in_flight:
            self._start(runner, spec, observed_before=observed_before[spec.trial_id], log=False)
        return len(results)

    def _conclude(self) -> SearchOutcome:
        results = list(self.results.values())
        tuning = [r for r in results if not r.spec.profile]
        best = search.best_result(self._candidates(), self.plan.search.metric) \
            if any(r.status is TrialStatus.OK for r in tuning) else None  # else the tuning trials fail
        table = summary_table(results, metric=self.plan.search.metric,
                              best_id=best.spec.trial_id if best else None)
        self.say(table)
        self._record_boundaries(results)
        if best is None:
            return SearchOutcome(1, results, None,
                                 f"no tuning trial succeeded ({len(tuning)} run); see trials.csv and each "
                                 "trial's stderr.log")
        best_config = self._config_for(best.spec, instrumented=False)
        atomic_write_json(self.out / "best_ds_config.json", best_config)
        atomic_write_json(self.out / "best_ds_metrics.json",
                          {"trial_id": best.spec.trial_id, "metric": self.plan.search.metric,
                           "metrics": dict(best.metrics),
                           "global_batch": {**self.plan.global_batch.to_json(),
                                            "train_batch_size": best_config[TBS],
                                            "gradient_accumulation_steps": best_config[GAS],
                                            "train_micro_batch_size_per_gpu": best_config[MBS]}})
        counts = {s.value: sum(r.status is s for r in tuning) for s in TrialStatus}
        message = (f"best {self.plan.search.metric} = {best.metrics[self.plan.search.metric]:.4g} (trial "
                   f"{best.spec.trial_id}: stage {best.spec.stage}, micro-batch {best.spec.micro_batch}); "
                   f"{len(tuning)} tuning trials: {counts}; wrote {self.out / 'best_ds_config.json'}")
        return SearchOutcome(0, results, best, message)
