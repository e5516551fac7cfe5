"""The search loop: the profiling phase, the search method, the confirmation of the best, the
outputs, resume.

Rank 0 only: this runs in the autotuner's own process (``python -m toolkit.dsat ...``); the
trials are separate launches of the user's entrypoint (see :mod:`toolkit.dsat.execution.runner`);
the profiling trials are :class:`~toolkit.dsat.profiling_phase.ProfilingPhase`'s, the decisions of
the confirmation :mod:`toolkit.dsat.search.confirm`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from toolkit._files import atomic_write_json
from toolkit.config.deepspeed import BATCH_KEYS, overwrite_deepspeed_config
from toolkit.dsat import script_config, search
from toolkit.dsat.contract import ProfileInfo, TrialContract, TrialStatus
from toolkit.dsat.execution.runner import TrialRunner
from toolkit.dsat.execution.settings import CPU_ALLOCATOR_ENV
from toolkit.dsat.hf_trainer import batch_flags_line, hf_trial_config
from toolkit.dsat.output_files import SEARCH_FILE, EventLog, summary_table, write_trial_tables
from toolkit.dsat.profiling_phase import (
    ProfilingPhase,
    budget_share,
    budget_share_line,
    extra_profiling_trials,
    record_boundaries,
)
from toolkit.dsat.search import confirm
from toolkit.dsat.search.batch import (
    global_batch_change,
    implied_global_batch,
    step_time_line,
    time_capped_micro_batch,
)
from toolkit.dsat.search.types import SearchSettings, TrialResult, TrialSpec
from toolkit.dsat.tensorboard import TensorBoardTrials
from toolkit.dsat.trial.reporting import instrumentation_overrides
from toolkit.dsat.tuned_keys import config_summary, describe_summary, merge_tuned
from toolkit.dsat.tuning_plan import Plan, own_spec, trial_ds_config
from toolkit.errors import ConfigError
from toolkit.launch.progress import remaining_text

__all__ = ["Autotuner", "SearchOutcome", "SearchStop", "best_metrics_record", "BEST_METRICS_EXTRA_KEYS"]

logger = logging.getLogger(__name__)
TBS, MBS, GAS = BATCH_KEYS

#: What ``best_ds_metrics.json`` holds beside the best trial's metrics (never a metric's name).
BEST_METRICS_EXTRA_KEYS = ("trial_id", "trial", "metric", "global_batch", "measurements", "own_config")


class SearchStop(Exception):
    """The search stops here with no best (``exit_code`` 2): a trial's engine ran another config than
    the trial's, or the script's own config cannot be planned from. ``message`` says why and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclasses.dataclass
class SearchOutcome:
    """How a search ended. ``exit_code``: 0 found a best config, 1 the search failed, 2 it stopped
    (:class:`SearchStop`).
    ``batch_notice``: the line saying the best config's global batch is not the user's (None when it is)."""

    exit_code: int
    results: list[TrialResult]
    best: TrialResult | None
    message: str
    batch_notice: str | None = None


def best_metrics_record(metrics: Mapping[str, Any], *, trial_id: int, metric: str,
                        global_batch: Mapping[str, Any], trial: str | None = None,
                        measurements: Mapping[str, Any] | None = None,
                        own_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``best_ds_metrics.json`` as Determined's dsat wrote it: the best trial's metrics at the top level,
    with :data:`BEST_METRICS_EXTRA_KEYS` beside them (docs/dsat.md#outputs-and-exit-status); a metric
    of the trial never gives way to an extra key. Pure; any rank."""
    values = (trial_id, trial if trial is not None else str(trial_id), metric, dict(global_batch),
              dict(measurements or {}), dict(own_config or {}))
    extras = dict(zip(BEST_METRICS_EXTRA_KEYS, values, strict=True))
    return {**{k: v for k, v in extras.items() if k not in metrics}, **metrics}


def _dsat_argv() -> list[str] | None:
    """This process's dsat arguments (after ``python -m toolkit.dsat``); None when it is not dsat's CLI."""
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if main is not None and (main.name == "dsat"  # the console script
                             or (main.name == "__main__.py" and main.parent.name == "dsat")):
        return list(sys.argv[1:])
    return None


class Autotuner:
    """Runs a :class:`~toolkit.dsat.tuning_plan.Plan`. Rank 0 only.

    Args:
        plan: the checked plan.
        say: where progress lines and tables go (the CLI passes ``print``).
        argv: the dsat arguments of the search (default: this process's when it is
            ``python -m toolkit.dsat``, else the method, config and model directory).
    """

    def __init__(self, plan: Plan, *, say: Callable[[str], None] = print,
                 argv: Sequence[str] | None = None) -> None:
        self.plan = plan
        self.say = say
        # the search's dsat arguments, for the command that reruns it within the user's global batch
        self.argv = list(argv) if argv is not None else _dsat_argv() or [
            plan.search.method, str(plan.config_path), str(plan.runner.model_dir)]
        self.out = plan.output_dir
        self.log = EventLog(self.out / "events.jsonl")
        self.tensorboard = TensorBoardTrials(self.out / "tensorboard", memory_only=plan.memory_only,
                                             data_parallel_size=plan.data_parallel_size)
        self.results: dict[int, TrialResult] = {}
        self.taken: set[int] = set()  # profiling trials the searcher took as results
        self.started_at = time.monotonic()
        self._phase: ProfilingPhase | None = None

    # ---------------------------------------------------------------- helpers
    def _config_for(self, spec: TrialSpec, *, instrumented: bool) -> dict[str, Any]:
        plan = self.plan
        if plan.awaiting_config:  # the script's config is not known yet: micro-batch 1 merged over it
            config: dict[str, Any] = {MBS: spec.micro_batch, GAS: 1,
                                      TBS: spec.micro_batch * plan.data_parallel_size}
        else:
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
        if self.plan.runner.hf_batch_flags:
            config = hf_trial_config(config, data_parallel_size=self.plan.data_parallel_size)
        if log:
            self.log.started(spec, observed_before=observed_before)
        runner.start(spec, ds_config=config, hparams=self.plan.hparams)  # see contract.trial_hparams

    def _record(self, result: TrialResult, *, replayed: bool = False) -> None:
        """Keep a finished trial's result; log it unless it was replayed from the log; rewrite the
        tables. A trial whose engine ran another config stops the search (:class:`SearchStop`)."""
        self.results[result.spec.trial_id] = result
        if not replayed:
            self.log.finished(result)
            self.tensorboard.add(result, self.results.values())
        write_trial_tables(self.out, self.results.values(), overrides=self._overrides)
        if result.status is TrialStatus.MISMATCH:
            spec = result.spec
            label = describe_summary(config_summary(self._config_for(spec, instrumented=False)))
            logs = self.out / "trials" / f"trial_{spec.trial_id}"
            raise SearchStop(f"stopped at trial {spec.name} (labelled {label}): {result.error}. No best "
                             f"config was written; its logs are in {logs}")

    def _discover(self, result: TrialResult) -> TrialResult:
        """After the first profiling trial of a script that builds its config in code: plan from the
        config it recorded (:func:`~toolkit.dsat.script_config.discovered_plan`)."""
        if self.plan.config_source != "script" or result.spec.trial_id != 0 \
                or result.status is not TrialStatus.OK:
            return result
        try:
            self.plan, result = script_config.discovered_plan(self.plan, self.out, result)
        except ConfigError as err:
            where = f"{err.source}: " if err.source else ""
            raise SearchStop("; ".join(where + p for p in err.problems)) from None
        if self._phase is not None:
            self._phase.plan = self.plan
        self.say(f"the script's own DeepSpeed config, recorded by trial {result.spec.name}, is the search's "
                 f"base: {describe_summary(config_summary(self.plan.base_ds_config))}")
        self.say(self.plan.global_batch.describe(
            implied_global_batch(self.plan.base_ds_config, data_parallel_size=self.plan.data_parallel_size)))
        return result

    def _keep(self, result: TrialResult) -> None:
        """A profiling trial reused from the event log (``--resume``): discovered again, recorded."""
        self._record(self._discover(result), replayed=True)

    def _run_one(self, runner: TrialRunner, spec: TrialSpec) -> TrialResult:
        """Start one trial, wait for its end, record and show it (the profiling trials run so)."""
        self._start(runner, spec, observed_before=0)
        done: list[TrialResult] = []
        while not done:
            done = runner.wait(timeout=1.0)
        try:
            result = self._discover(done[0]) if done[0].status is not TrialStatus.MISMATCH else done[0]
        except SearchStop:
            self._record(done[0])  # the trial ran: in the tables, as it was labelled
            raise
        self._record(result)
        self._progress(result, 0)
        return result

    def _candidates(self) -> list[TrialResult]:
        """The results the best is chosen from: the tuning trials, their re-runs, and the profiling
        trials the searcher took as results (configurations of the search, timed like any trial)."""
        return [r for r in self.results.values() if not r.spec.profile or r.spec.trial_id in self.taken]

    def _progress(self, result: TrialResult, running: int) -> None:
        metric = self.plan.search.metric
        best = search.best_result(self._candidates(), metric)
        value = result.metrics.get(metric)
        shown = f"{metric}={value:.4g}" if value is not None else (result.error or "")[:120]
        best_text = f"best {best.metrics[metric]:.4g} (trial {best.spec.name})" if best else "no best yet"
        spec = result.spec
        kind = "profiling trial" if spec.profile else "re-run" if spec.rerun else \
            "your own config" if spec.baseline else "trial"
        limit = "" if spec.rerun or spec.baseline else f"/{self.plan.search.max_trials}"
        count = len([r for r in self.results.values() if (r.spec.rerun, r.spec.baseline) == (spec.rerun,
                                                                                               spec.baseline)])
        r, durations = self.plan.runner, [t.duration_s for t in self.results.values()]
        at_once = min(r.max_concurrent, max(r.max_slots // r.slots_per_trial, 1))
        left = "" if spec.rerun or spec.baseline else " | " + remaining_text(
            durations, remaining=max(self.plan.search.max_trials - count, 0), concurrency=at_once,
            running=[0.0] * running)
        self.say(f"[{count}{limit}] {kind} {result.spec.name} "
                 f"stage {result.spec.stage} mb {result.spec.micro_batch}: {result.status.value} {shown} | "
                 f"{best_text} | running {running} | {time.monotonic() - self.started_at:.0f}s{left}")

    # ---------------------------------------------------------------- phases
    def _profile(self, runner: TrialRunner, events: list[dict[str, Any]]) -> ProfileInfo | None:
        """The profiling phase (:class:`ProfilingPhase`) with this search's trials and records."""
        self._phase = ProfilingPhase(self.plan, out=self.out, say=self.say, events=events,
                                     run_trial=lambda spec: self._run_one(runner, spec), keep=self._keep)
        return self._phase.run()

    def run_profiling(self) -> ProfileInfo | None:
        """Only the profiling trials and the memory model (``profile.json``), no search: for
        benchmarks of the memory model (``scripts/bench_memory.py``). Rank 0 only.

        Example::

            profile = Autotuner(make_plan(args), say=print).run_profiling()
        """
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "trials").mkdir(exist_ok=True)
        try:
            with TrialRunner(self.plan.runner, output_dir=self.out) as runner:
                return self._profile(runner, self.log.read())
        except SearchStop as stop:
            self.say(stop.message)
            return None

    def run(self) -> SearchOutcome:
        """Run (or resume) the search. Interrupting it (Ctrl-C) kills every trial; the record stays.
        A :class:`SearchStop` kills every trial too and ends it with exit code 2, no best written."""
        try:
            return self._run()
        except SearchStop as stop:
            results = list(self.results.values())
            self.say(summary_table(results, metric=self.plan.search.metric, best_id=None))
            return SearchOutcome(2, results, None, stop.message)

    def _run(self) -> SearchOutcome:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "trials").mkdir(exist_ok=True)
        events = self.log.read()
        atomic_write_json(self.out / SEARCH_FILE, self.plan.fingerprint())
        if not self.plan.awaiting_config:  # else said once the first trial recorded the script's config
            self.say(self.plan.global_batch.describe(implied_global_batch(
                self.plan.base_ds_config, data_parallel_size=self.plan.data_parallel_size)))
        if self.plan.runner.memory_per_slot is not None:
            self.say("CPU budget: trials run with " + " ".join(f"{k}={v}" for k, v in CPU_ALLOCATOR_ENV)
                     + " unless set (glibc's heap otherwise makes the peak memory jump with the "
                     "micro-batch); set it in your own launches of the tuned config for the same memory")
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
            self.say(f"search ({self.plan.search.method}): up to {searcher.budget_left} tuning trials")
            while not searcher.done:
                for spec in searcher.propose(runner.capacity()):
                    self._start(runner, spec, observed_before=observed)
                if runner.running() == 0:
                    break  # nothing in flight and nothing proposed: the method has finished
                for result in runner.wait(timeout=1.0):
                    self._record(result)
                    notes = len(searcher.notes)
                    searcher.observe(result)
                    observed += 1
                    self._progress(result, runner.running())
                    for note in searcher.notes[notes:]:
                        self.say(note)
            self._measure_own(runner, events)
            self._confirm(runner, events)
        return self._conclude()

    def _take_profiling(self, searcher: search.Searcher) -> None:
        """Give the profiling trials to the searcher (in the order they ran, also on --resume):
        those at configurations of the search count as its results, not as trials lost (every
        method alike); those run without the kept global batch (``Plan.memory_only``) do not."""
        taken = searcher.observe_profiling([r for r in self.results.values()
                                            if r.spec.profile and not self.plan.memory_only(r.spec)])
        self.taken = {r.spec.trial_id for r in taken}
        if taken:
            self.say("profiling trials taken as results of the search: " + ", ".join(
                f"{r.spec.name} (stage {r.spec.stage}, mb {r.spec.micro_batch})" for r in taken))

    def _search_settings(self) -> SearchSettings:
        """The plan's search settings for the searcher: the micro-batch capped by the trial timeout
        (:meth:`_time_cap`), and ``max_trials`` less the extra profiling (calibration) trials, so that
        ``--max-trials`` counts every trial of the search (the re-runs of ``--confirm`` not)."""
        extra = extra_profiling_trials(self.results)
        return dataclasses.replace(self.plan.search, max_micro_batch=self._time_cap(),
                                   max_trials=max(self.plan.search.max_trials - extra, 2))

    def _time_cap(self) -> int | None:
        """The largest micro-batch no trial is predicted to run past the trial timeout with, from the
        profiling trials' step times (:func:`step_time_line`) and the first one's start-up; None: no cap
        (also when a step's examples do not grow: :meth:`Plan.step_grows_with_micro_batch`)."""
        runner, profiled = self.plan.runner, self.results[0]
        latency = float(profiled.metrics.get("latency") or 0.0)
        if not self.plan.step_grows_with_micro_batch(profiled):
            return None
        steps = runner.end_profile_step
        overhead = profiled.duration_s - steps * latency / 1000.0
        line = step_time_line([(r.spec.micro_batch, float(r.metrics.get("latency") or 0.0))
                               for r in self.results.values()
                               if r.spec.profile and r.status is TrialStatus.OK])
        if line is None:
            return None
        m0, t0, per_example = line
        cap = time_capped_micro_batch(t0, steps=steps, timeout_s=runner.timeout_s, overhead_s=overhead,
                                      micro_batch=m0, per_example_ms=per_example)
        if cap is None:
            return None
        how = (f"predicted {overhead:.0f}s start-up + {steps} steps x ({t0:.4g} ms at micro-batch {m0} "
               f"+ {per_example:.4g} ms per example above it)")
        logger.info("trial timeout %gs: no micro-batch above %d (%s)", runner.timeout_s, cap, how)
        top = self.plan.search.micro_batches[-1] if self.plan.search.micro_batches else None
        if top is None or cap < top:
            self.say(f"trial timeout {runner.timeout_s:g}s: micro-batches above {cap} are not tried ({how})")
        return cap

    def _replay(self, searcher: search.Searcher, runner: TrialRunner, events: list[dict[str, Any]]) -> int:
        """Feed a resumed search's recorded results through the fresh searcher; rerun the unfinished.
        The recorded re-runs of the confirmation are kept for it (:meth:`_confirm`)."""
        results, observed_before, seen = [], {}, set()
        for event in events:
            if event["trial_id"] <= 0:  # the profiling trials
                continue
            spec = event["spec"] if event["event"] == "start" else event["result"]["spec"]
            if spec.get("rerun") or spec.get("baseline"):
                if event["event"] == "result":
                    self._record(TrialResult.from_json(event["result"]), replayed=True)
            elif event["event"] == "start":
                observed_before[event["trial_id"]] = event["observed_before"]
            elif event["trial_id"] not in seen:
                seen.add(event["trial_id"])
                results.append(TrialResult.from_json(event["result"]))
        if not observed_before:
            return 0
        try:
            in_flight = search.replay(searcher, results=results, observed_before=observed_before)
        except ValueError as err:  # the searcher proposes other trials than the recorded ones
            raise SearchStop(f"--resume: {err}. Start a new search in another --output-dir") from None
        for result in results:
            self._record(result, replayed=True)
        self.say(f"resumed: {len(results)} finished trial(s) kept, {len(in_flight)} interrupted trial(s) "
                 "rerun")
        for spec in in_flight:
            self._start(runner, spec, observed_before=observed_before[spec.trial_id], log=False)
        return len(results)

    def _own_results(self, spec: TrialSpec) -> list[TrialResult]:
        """The trials that measured the configuration of ``spec`` (the user's own), in the order they ran."""
        key = confirm.config_key(spec)
        return [r for r in self.results.values() if confirm.config_key(r.spec) == key
                and not self.plan.memory_only(r.spec) and r.status in (TrialStatus.OK, TrialStatus.OOM)]

    def _measure_own(self, runner: TrialRunner, events: list[dict[str, Any]]) -> None:
        """The user's own config as written (:func:`~toolkit.dsat.tuning_plan.own_spec`), measured once
        after the search when no trial did, so that the closing lines compare the best with it;
        not counted in ``--max-trials``. A candidate like any trial."""
        next_id = max([*self.results, *(e["trial_id"] for e in events)], default=0) + 1
        spec = own_spec(self.plan, next_id)
        if not self.plan.own_config or self._broken() or spec is None or self._own_results(spec):
            return
        self.say(f"measuring your own config as written (stage {spec.stage}, micro-batch "
                 f"{spec.micro_batch}), which no trial of the search ran, to compare the best with")
        self._start(runner, spec, observed_before=0)
        while runner.running():
            for result in runner.wait(timeout=1.0):
                self._record(result)
                self._progress(result, runner.running())

    def _confirm(self, runner: TrialRunner, events: list[dict[str, Any]]) -> None:
        """Re-run the ``--confirm`` best configurations, one after the other, until each has
        :data:`~toolkit.dsat.search.confirm.CONFIRM_MEASUREMENTS` trials (beside ``--max-trials``), a
        later one only while it could still win; ids follow the search's, and a resumed search keeps its
        re-runs (docs/design-dsat-search.md#the-confirmation)."""
        metric, top = self.plan.search.metric, self.plan.confirm
        if self._broken():
            return
        chosen = [confirm.config_key(c.spec)
                  for c in confirm.to_confirm(confirm.group(self._candidates()), metric, top=top)]
        next_id = max([*self.results, *(e["trial_id"] for e in events)], default=0) + 1
        announced = False
        for _round in chosen:  # each round brings one configuration to its measurements
            candidate = confirm.next_to_confirm(confirm.group(self._candidates()), chosen, metric)
            if candidate is None:
                break
            if not announced:
                self.say(f"confirming the best {len(chosen)} configuration(s) (--confirm {top}): each "
                         f"re-run until measured {confirm.CONFIRM_MEASUREMENTS} times in all, one after the "
                         "other, a later one only while a measurement of it beats the best median; picked by "
                         "the median")
                announced = True
            pending = []
            for _ in range(candidate.reruns_needed()):
                pending.append(dataclasses.replace(candidate.spec, trial_id=next_id, label="", rerun=True,
                                                   profile=False))
                next_id += 1
            while pending or runner.running():
                while pending and runner.capacity() > 0:
                    self._start(runner, pending.pop(0), observed_before=0)
                for result in runner.wait(timeout=1.0):
                    self._record(result)
                    self._progress(result, runner.running())
        short = [c for c in confirm.group(self._candidates())
                 if confirm.config_key(c.spec) in chosen and c.reruns_needed() > 0]
        if announced and short:
            self.say(f"not re-run: {len(short)} configuration(s) none of whose measurements beats the best "
                     "confirmed median")

    def _share_line(self) -> str:
        """What micro-batch 1 takes of the budget (the closing lines), or nothing when unmeasured:
        on CPU the budget is the plan's, on GPUs the device's memory (as the memory model's)."""
        first = self.results.get(0)
        if first is None or not first.profile:
            return ""
        profile = dict(first.profile)
        if self.plan.memory_per_slot is not None and profile.get("device", "cpu") == "cpu":
            profile["memory_per_slot"] = self.plan.memory_per_slot
        share = budget_share(profile)
        return "" if share is None else "\n" + budget_share_line(share)

    def _broken(self) -> bool:
        """Tuning trials that all crashed say the trials are broken: no best, nothing confirmed.
        Tuning trials that only ran out of memory or time leave the profiling trials the searcher
        took as its results."""
        tuning = [r for r in self.results.values() if not (r.spec.profile or r.spec.rerun or r.spec.baseline)]
        return bool(tuning) and all(r.status is TrialStatus.FAILED and r.data_limit is None for r in tuning)

    def _best_configs(self, spec: TrialSpec) -> tuple[dict[str, Any], dict[str, Any]]:
        """The best trial's config (its batch triple complete) and the best config to write: the
        script's with the tuned keys, or for HF Trainer the user's file, its "auto" values kept."""
        trial_config = self._config_for(spec, instrumented=False)
        if self.plan.runner.hf_batch_flags:  # run with the Trainer's two flags (batch_flags_line)
            tuned = merge_tuned(self.plan.base_ds_config, trial_config, instrumented=False)
            return trial_config, hf_trial_config(tuned, data_parallel_size=self.plan.data_parallel_size)
        return trial_config, script_config.best_config(self.out, spec, trial_config, self.plan.base_ds_config)

    def _conclude(self) -> SearchOutcome:
        results = list(self.results.values())
        tuning = [r for r in results if not (r.spec.profile or r.spec.rerun or r.spec.baseline)]
        metric = self.plan.search.metric
        broken = self._broken()
        candidates = [] if broken else confirm.group(self._candidates())
        for c in candidates:
            if c.conflicting:
                verdicts = ", ".join(f"{r.spec.name}: {r.status.value}" for r in c.results)
                self.say(f"stage {c.spec.stage} micro-batch {c.spec.micro_batch} was judged both fitting and "
                         f"out of memory ({verdicts}): "
                         f"{'fits' if c.fits else 'does not fit'} by the majority of its verdicts")
        chosen = confirm.pick(candidates, metric, confirmed=self.plan.confirm > 0)
        unconfirmed = chosen is None and self.plan.confirm > 0
        if unconfirmed:  # no configuration ran twice: the best single measurement, said
            chosen = confirm.pick(candidates, metric, confirmed=False)
        best = chosen.representative(metric) if chosen is not None else None
        shown = [c for c in candidates if len(c.results) > 1 and c.values(metric)]
        self.say(summary_table(results, metric=metric, best_id=best.spec.trial_id if best else None,
                               spreads=[(c.spec, c.spread(metric)) for c in shown]))
        record_boundaries(self.out, results, self.say)
        if best is None or chosen is None:
            return SearchOutcome(1, results, None,
                                 f"no tuning trial succeeded ({len(tuning)} run, "
                                 f"{'all failed' if broken else 'no result to choose from'}); see trials.csv "
                                 "and each trial's trial.log" + self._share_line())
        trial_config, best_config = self._best_configs(best.spec)
        own = own_spec(self.plan, 0)
        own_line, own_record = script_config.own_comparison(self._own_results(own) if own else [], best,
                                                            metric)
        change = global_batch_change(self.plan.base_ds_config, trial_config, policy=self.plan.global_batch,
                                     data_parallel_size=self.plan.data_parallel_size, argv=self.argv,
                                     output_dir=str(self.out))
        values = chosen.values(metric)
        measurements = {"median": chosen.median(metric), "values": values,
                        "trials": [r.spec.name for r in chosen.results],
                        "statuses": [r.status.value for r in chosen.results]}
        atomic_write_json(self.out / "best_ds_config.json", best_config)
        atomic_write_json(self.out / "best_ds_metrics.json", best_metrics_record(
            best.metrics, trial_id=best.spec.trial_id, trial=best.spec.name, metric=metric,
            measurements=measurements, own_config=own_record,
            global_batch={**self.plan.global_batch.to_json(), **{k: trial_config[k] for k in (TBS, GAS, MBS)},
                          **change.to_json()}))
        counts = {s.value: sum(r.status is s for r in tuning) for s in TrialStatus}
        profiling = sum(r.spec.profile for r in results)
        reruns = sum(r.spec.rerun for r in results)
        how = (f"the median of {len(values)} measurements, {min(values):.4g} to {max(values):.4g}"
               if len(values) > 1 else "measured once: " + (
                   "no configuration could be re-run" if unconfirmed else "--confirm 0"))
        spec = best.spec
        message = (f"best {metric} = {best.metrics[metric]:.4g} (trial {spec.name}: stage {spec.stage}, "
                   f"micro-batch {spec.micro_batch}; {how}); {profiling} profiling trials, {len(tuning)} "
                   f"tuning trials: {counts}, {reruns} re-runs; wrote {self.out / 'best_ds_config.json'}")
        message += ("\n" + own_line if own_line else "") + self._share_line()
        if self.plan.runner.hf_batch_flags:
            message += "\n" + batch_flags_line(best_config)
        notice = change.notice()
        if notice:  # the last line the CLI prints (and the full run's, after it)
            message += "\n" + notice
        return SearchOutcome(0, results, best, message, batch_notice=notice)
