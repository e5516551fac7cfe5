"""The search loop: profiling trial, memory model, search method, trials, outputs, resume.

Rank 0 only: this runs in the autotuner's own process (``python -m toolkit.dsat ...``); the
trials are separate launches of the user's entrypoint (see :mod:`toolkit.dsat.execution.runner`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from toolkit._files import atomic_write_json
from toolkit.config.deepspeed import BATCH_KEYS, overwrite_deepspeed_config, resolve_ds_config
from toolkit.dsat import search
from toolkit.dsat.contract import ProfileInfo, TrialContract, TrialStatus
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.records import (
    EventLog,
    TensorBoardTrials,
    summary_table,
    write_trial_tables,
)
from toolkit.dsat.search import memory
from toolkit.dsat.search.batch import GlobalBatch, time_capped_micro_batch
from toolkit.dsat.search.space import default_zero_autos
from toolkit.dsat.search.types import SearchSettings, TrialResult, TrialSpec
from toolkit.dsat.trial.reporting import instrumentation_overrides

__all__ = ["Plan", "trial_ds_config", "profile_spec", "Autotuner", "SearchOutcome"]

logger = logging.getLogger(__name__)
TBS, MBS, GAS = BATCH_KEYS


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the autotuner was asked to do, checked before anything is launched.

    Attributes:
        config_path: the experiment YAML.
        experiment: the loaded experiment config.
        base_ds_config: the user's DeepSpeed config (file + overwrite_deepspeed_args), unresolved.
        hparams: the experiment's hyperparameters.
        data_parallel_size: replicas per trial (``hyperparameters.data_parallel_world_size`` or
            ``resources.slots_per_trial``).
        search: the search method's settings.
        runner: how trials are launched and limited.
        output_dir: where everything is written.
        resume: continue the search recorded in ``output_dir``.
        run_full_experiment: after the search, train with the best config.
        memory_per_slot: bytes per slot given to the memory model (CPU budget; on GPU the
            profiling trial's measurement wins).
        global_batch: the global batch policy (keep the user's ``train_batch_size``, fix it, or
            free it); every trial and the best config follow it.
        hidden_size: ``hyperparameters.hidden_size``, which resolves ZeRO's "auto" sizes.
    """

    config_path: Path
    experiment: Mapping[str, Any]
    base_ds_config: Mapping[str, Any]
    hparams: Mapping[str, Any]
    data_parallel_size: int
    search: SearchSettings
    runner: RunnerSettings
    output_dir: Path
    resume: bool = False
    run_full_experiment: bool = False
    memory_per_slot: int | None = None
    global_batch: GlobalBatch = GlobalBatch("free")
    hidden_size: int | None = None

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a search and its ``--resume``."""
        search_settings = {k: (list(v) if isinstance(v, tuple) else v)
                           for k, v in dataclasses.asdict(self.search).items()}
        return {"search": json.loads(json.dumps(search_settings, default=str)),
                "base_ds_config": json.loads(json.dumps(self.base_ds_config)),
                "data_parallel_size": self.data_parallel_size,
                "slots_per_trial": self.runner.slots_per_trial,
                "entrypoint": list(self.runner.entrypoint),
                "start_profile_step": self.runner.start_profile_step,
                "end_profile_step": self.runner.end_profile_step,
                "global_batch": self.global_batch.to_json(), "hidden_size": self.hidden_size}

    def resume_problem(self) -> str | None:
        """Why ``--resume`` cannot continue the search recorded in ``output_dir``, or None.

        A search continues only with the settings it was recorded with (:meth:`fingerprint`).
        """
        path = self.output_dir / "search.json"
        if not path.exists():
            return None
        recorded, now = json.loads(path.read_text(encoding="utf-8")), self.fingerprint()
        if recorded == now:
            return None
        changed = sorted(k for k in now if recorded.get(k) != now[k])
        return (f"--resume: the settings differ from the recorded search in {self.output_dir} "
                f"({', '.join(changed)}); resume with the same flags and config")


def profile_spec(base_ds_config: Mapping[str, Any]) -> TrialSpec:
    """The profiling trial: micro-batch 1, the user's own ZeRO section."""
    zero = base_ds_config.get("zero_optimization")
    zero = copy.deepcopy(dict(zero)) if isinstance(zero, Mapping) else {"stage": int(bool(zero))}
    zero.setdefault("stage", 0)
    return TrialSpec(trial_id=0, micro_batch=1, zero=zero, line=-1, profile=True)


def trial_ds_config(base_ds_config: Mapping[str, Any], spec: TrialSpec, *, data_parallel_size: int,
                    train_batch_size: int | None = None, hidden_size: int | None = None) -> dict[str, Any]:
    """The complete DeepSpeed config of a trial (or of the best trial): pure.

    The trial's ZeRO section replaces the user's whole (the searcher built it on the user's,
    dropping what its stage cannot run); the micro-batch is the trial's. With a global batch
    (``train_batch_size``: the policy keep or N) the accumulation is derived so that
    ``train_batch_size = micro_batch * accumulation * data_parallel_size``; without (free), the
    accumulation stays the user's (1 when unset or "auto") and ``train_batch_size`` is derived.
    ZeRO's "auto" sizes are resolved from ``hidden_size`` (HF's rule), else DeepSpeed's defaults.
    A profiling trial whose micro-batch does not divide ``train_batch_size / data_parallel_size``
    (it measures memory, not speed) runs with the accumulation of the free policy.
    """
    config = overwrite_deepspeed_config(base_ds_config, {MBS: spec.micro_batch})
    config["zero_optimization"] = copy.deepcopy(dict(spec.zero))
    if spec.profile and train_batch_size is not None \
            and train_batch_size % (spec.micro_batch * data_parallel_size):
        train_batch_size = None  # a profiling trial at a micro-batch that cannot keep it: memory only
    if train_batch_size is not None:
        config[TBS] = train_batch_size
        config.pop(GAS, None)
    else:
        config.pop(TBS, None)
        if not isinstance(config.get(GAS), int) or isinstance(config.get(GAS), bool):
            config[GAS] = 1
    config = resolve_ds_config(config, data_parallel_size=data_parallel_size, hidden_size=hidden_size)
    config["zero_optimization"] = default_zero_autos(config["zero_optimization"])
    return config


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

    def _progress(self, result: TrialResult, running: int) -> None:
        metric = self.plan.search.metric
        best = search.best_result([r for r in self.results.values() if not r.spec.profile], metric)
        value = result.metrics.get(metric)
        shown = f"{metric}={value:.4g}" if value is not None else (result.error or "")[:120]
        best_text = f"best {best.metrics[metric]:.4g} (trial {best.spec.trial_id})" if best else "no best yet"
        self.say(f"[{len(self.results)}/{self.plan.search.max_trials}] trial {result.spec.trial_id} "
                 f"stage {result.spec.stage} mb {result.spec.micro_batch}: {result.status.value} {shown} | "
                 f"{best_text} | running {running} | {time.monotonic() - self.started_at:.0f}s")

    # ---------------------------------------------------------------- phases
    def _run_profiling_trial(self, runner: TrialRunner, events: list[dict[str, Any]]) -> TrialResult:
        """The profiling trial's result: the recorded one when it succeeded (--resume), else a new run."""
        recorded = [e for e in events if e["event"] == "result" and e["trial_id"] == 0]
        if recorded and recorded[-1]["result"]["status"] == TrialStatus.OK.value:
            result = TrialResult.from_json(recorded[-1]["result"])
            self._record(result, replayed=True)
            self.say("profiling trial: reusing the recorded result")
            return result
        self.say("profiling trial (micro-batch 1) ...")
        self._start(runner, profile_spec(self.plan.base_ds_config), observed_before=0)
        done: list[TrialResult] = []
        while not done:
            done = runner.wait(timeout=1.0)
        self._record(done[0])
        self._progress(done[0], 0)
        return done[0]

    def _profile(self, runner: TrialRunner, events: list[dict[str, Any]]) -> ProfileInfo | None:
        """Run (or reuse) the profiling trial; its model and memory numbers, with the memory model's
        prediction written to ``profile.json``. None when the profiling trial failed."""
        result = self._run_profiling_trial(runner, events)
        if result.status is not TrialStatus.OK or not result.profile:
            return None
        fields = dict(result.profile)
        if self.plan.memory_per_slot is not None and fields.get("device", "cpu") == "cpu":
            fields["memory_per_slot"] = self.plan.memory_per_slot
        profile = ProfileInfo.from_json(fields)
        # The user's offload intent, as if at stage 3; predict applies what each stage allows.
        offload_optimizer, offload_param = memory.offload_flags({**self.plan.search.base_zero, "stage": 3})
        prediction = memory.predict(profile, data_parallel_size=self.plan.data_parallel_size,
                                    zero_stages=self.plan.search.zero_stages,
                                    offload_optimizer=offload_optimizer, offload_param=offload_param)
        atomic_write_json(self.out / "profile.json",
                          {"profile": profile.to_json(),
                           "prediction": {str(k): v for k, v in prediction.items()}})
        self.say(f"model: {profile.num_params:,} parameters ({profile.trainable_params:,} trainable), "
                 f"activations {profile.activation_bytes_per_example:,} bytes/example, "
                 f"{profile.memory_per_slot:,} bytes per slot ({profile.device})")
        self.say(memory.format_prediction(prediction, profile=profile))
        return profile

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

    def _search_settings(self) -> SearchSettings:
        """The plan's search settings with the micro-batch capped so that no trial is predicted to run
        past the trial timeout (the profiling trial's step time, linear in the micro-batch).

        With the global batch kept and a timed step that spans the accumulation steps (more than
        one micro-batch per step), a step's examples do not grow with the micro-batch: no cap."""
        runner, profiled, dp = self.plan.runner, self.results[0], self.plan.data_parallel_size
        latency = float(profiled.metrics.get("latency") or 0.0)
        micro_per_step = float(profiled.metrics.get("throughput") or 0.0) * latency / 1000.0 / dp
        if self.plan.global_batch.train_batch_size is not None and micro_per_step > 1.5:
            return self.plan.search
        steps = runner.end_profile_step
        overhead = profiled.duration_s - steps * latency / 1000.0
        cap = time_capped_micro_batch(latency, steps=steps, timeout_s=runner.timeout_s, overhead_s=overhead)
        if cap is None:
            return self.plan.search
        logger.info("trial timeout %gs: no micro-batch above %d (predicted %.0fs start-up + %d steps x %.4g "
                    "ms x micro-batch)", runner.timeout_s, cap, overhead, steps, latency)
        top = self.plan.search.micro_batches[-1] if self.plan.search.micro_batches else None
        if top is None or cap < top:
            self.say(f"trial timeout {runner.timeout_s:g}s: micro-batches above {cap} are not tried "
                     f"(predicted {overhead:.0f}s start-up + {steps} steps x {latency:.4g} ms x micro-batch)")
        return dataclasses.replace(self.plan.search, max_micro_batch=cap)

    def _replay(self, searcher: search.Searcher, runner: TrialRunner, events: list[dict[str, Any]]) -> int:
        """Feed a resumed search's recorded results through the fresh searcher; rerun the unfinished."""
        results, observed_before, seen = [], {}, set()
        for event in events:
            if event["trial_id"] == 0:
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
        best = search.best_result(tuning, self.plan.search.metric)
        table = summary_table(results, metric=self.plan.search.metric,
                              best_id=best.spec.trial_id if best else None)
        self.say(table)
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
