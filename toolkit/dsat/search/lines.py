"""Lines, the bookkeeping every search method shares (ids, trial cap, bounds, offload levels, best),
and :func:`best_result`.

Pure; rank 0 only by use (the orchestrator). Design: docs/design-dsat-search.md#lines.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import json
import logging
import math
import random
from typing import Any, Generic, Iterable, Sequence, TypeVar

from toolkit._checks import is_int, is_number
from toolkit.dsat.contract import ProfileInfo, TrialStatus
from toolkit.dsat.search import memory, offload
from toolkit.dsat.search.memory import approx_max_micro_batch, offload_flags
from toolkit.dsat.search.space import ZeroSpace, canonical_zero, zero_config_for_stage
from toolkit.dsat.search.types import SMALLER_IS_BETTER, SearchSettings, TrialResult, TrialSpec, is_better

__all__ = ["best_result", "metric_value", "Line", "LineSearcher"]

logger = logging.getLogger(__name__)


def metric_value(result: TrialResult, metric: str) -> float | None:
    """The result's finite ``metric`` when it succeeded, else None. Pure; any rank."""
    if result.status is not TrialStatus.OK:
        return None
    value = result.metrics.get(metric)
    if value is None or not is_number(value) or not math.isfinite(value):
        return None
    return float(value)


_VERDICT = {TrialStatus.OK: "fitting (it ran)", TrialStatus.OOM: "out of memory"}


def _config(spec: TrialSpec) -> tuple[int, str]:
    """A configuration: micro-batch and canonical ZeRO section (the confirmation's key too)."""
    return spec.micro_batch, canonical_zero(spec.zero)


def _fingerprint(spec: TrialSpec) -> tuple[int, int, str]:
    """What identifies a proposal, insensitive to a JSON round trip of the record."""
    return spec.micro_batch, spec.line, json.dumps(dict(spec.zero), sort_keys=True, default=str)


def best_result(results: Iterable[TrialResult], metric: str) -> TrialResult | None:
    """The successful result with the best finite ``metric`` (the first on ties), or None. Pure; any rank."""
    best, best_value = None, None
    for result in results:
        value = metric_value(result, metric)
        if value is not None and is_better(metric, value, best_value):
            best, best_value = result, value
    return best


@dataclasses.dataclass
class Line:
    """One ZeRO configuration: its open micro-batch range ``[lo, hi]``, trials, best, offload level,
    why it ``stopped``, and ``repeat_mb``, a micro-batch to run again (conflicting verdicts)."""

    line_id: int                            # its index in the search (TrialSpec.line)
    zero: dict[str, Any]
    lo: int                                 # the smallest micro-batch not known to fit
    hi: int                                 # the largest not known to fail
    trials: int = 0
    in_flight: bool = False
    best: TrialResult | None = None
    stopped: str | None = None              # why it takes no more trials; None while it may
    offload: str = "none"
    repeat_mb: int | None = None            # judged both fitting and OOM: run once more first

    @property
    def stage(self) -> int:
        return int(self.zero.get("stage", 0))

    @property
    def closed(self) -> bool:
        return self.lo > self.hi

    @property
    def has_trial_due(self) -> bool:
        """It has a next trial: its range is open (a subclass may add trials below it)."""
        return not self.closed

    @property
    def moves_bounds(self) -> bool:
        """Its trial in flight narrows ``[lo, hi]`` (a probe below it would not)."""
        return True

    @property
    def idle_open(self) -> bool:
        """Ready for its next trial: nothing in flight, not stopped, and a trial due."""
        return not self.in_flight and self.stopped is None and self.has_trial_due


LineT = TypeVar("LineT", bound=Line)


class LineSearcher(Generic[LineT]):
    """Bookkeeping shared by the methods (a :class:`Searcher`); a method subclasses it with its line
    type and the "per method" hooks. Rank 0 only by use."""

    def __init__(self, settings: SearchSettings, profile: ProfileInfo) -> None:
        self.settings = settings
        self.profile = profile
        self._rng = random.Random(settings.random_seed)
        self._levels = offload.offload_levels(settings.offload, settings.zero_stages)
        self._level = self._start_level()
        self._space = self._space_at(self._level)
        self._lines: list[LineT] = []
        self._in_flight: dict[int, tuple[LineT, TrialSpec]] = {}
        self._results: list[TrialResult] = []
        self._proposed = 0
        self._best: TrialResult | None = None
        self._verdicts: dict[tuple[int, str], list[TrialResult]] = {}  # config -> its OK/OOM results
        self._repeats: set[int] = set()  # trial ids proposed to settle conflicting verdicts
        self.notes: list[str] = []       # what the user should read: conflicting verdicts and their repeat
        self._data_limit: int | None = None  # the most examples per forward the script's data gives

    # -- public (the Searcher protocol) -------------------------------------------------------
    def propose(self, capacity: int) -> list[TrialSpec]:
        """Up to ``capacity`` new trials (fewer or none while waiting or when done). Rank 0 only."""
        if not is_int(capacity) or capacity < 0:
            raise ValueError(f"capacity={capacity!r}: expected an integer >= 0 (free trial slots)")
        specs: list[TrialSpec] = []
        while len(specs) < capacity and self.budget_left > 0:
            repeat = next((line for line in self._lines if line.repeat_mb is not None and not line.in_flight),
                          None)
            if repeat is not None:
                specs.append(self._propose_on(repeat, micro_batch=repeat.repeat_mb))
                repeat.repeat_mb = None
                self._repeats.add(specs[-1].trial_id)
                continue
            line = self._next_line()
            if line is None:
                break
            specs.append(self._propose_on(line))
        return specs

    def observe(self, result: TrialResult) -> None:
        """Take a finished trial into account (profiling trials ignored); ValueError, nothing changed, for
        a trial not proposed, already observed or unlike its proposal. Rank 0 only."""
        if result.spec.profile:
            return
        line, spec = self._take_in_flight(result.spec)
        line.in_flight = False
        self._results.append(result)
        self._note_data_limit([result])
        if self._conflicts(line, result):
            return  # decided by the repeat, not by this verdict
        metric = self.settings.metric
        value = metric_value(result, metric)
        improved = value is not None and is_better(metric, value, self._best_value())
        if improved:
            self._best = result
        line_best = None if line.best is None else metric_value(line.best, metric)
        if value is not None and (line.best is None or is_better(metric, value, line_best)):
            line.best = result
        m = spec.micro_batch
        if line.moves_bounds:
            if result.status is TrialStatus.OK:
                line.lo = max(line.lo, m + 1)
            else:
                line.hi = self._top(min(line.hi, m - 1))  # failed, timed out: as an OOM
        self._after_observe(line, result, improved)
        if line.stopped is None and not line.has_trial_due:
            line.stopped = "range closed"
        self._maybe_offload_more()
        logger.debug("trial %d (line %d, stage %d, micro-batch %d): %s; line range [%d, %d]%s",
                     spec.trial_id, line.line_id, line.stage, m, result.status.value, line.lo, line.hi,
                     f", stopped: {line.stopped}" if line.stopped else "")

    def observe_profiling(self, results: Sequence[TrialResult]) -> list[TrialResult]:
        """Take the profiling trials at the search's configurations as its results; returns those taken.
        Once, before the first :meth:`propose`. Rank 0 only."""
        if self._proposed or self._lines:
            raise ValueError("observe_profiling: call it once, before the first propose")
        self._note_data_limit(results)
        base = offload.offload_zero(self.settings.base_zero, self.level)
        allowed, metric = self.settings.micro_batches, self.settings.metric
        taken: list[TrialResult] = []
        for stage in self._space.stages:
            zero = canonical_zero(zero_config_for_stage(base, stage))  # offload {"device": "none"} is none
            mine = [r for r in results if canonical_zero(r.spec.zero) == zero]
            for result in mine:
                if result.status in (TrialStatus.OK, TrialStatus.OOM):
                    self._verdicts.setdefault(_config(result.spec), []).append(result)
            mine = [r for r in mine if (allowed is None or r.spec.micro_batch in allowed)
                    and metric not in SMALLER_IS_BETTER]
            for result in mine:
                value = metric_value(result, metric)
                if value is not None and is_better(metric, value, self._best_value()):
                    self._best = result
            if mine:
                self._take_profiling(stage, mine)
                taken += mine
        return taken

    def _note_data_limit(self, results: Sequence[TrialResult]) -> None:
        """A trial whose script's data gave fewer examples than its micro-batch caps every line there
        (the data per rank is the same at any ZeRO config)."""
        limits = [r.data_limit for r in results if r.data_limit is not None]
        if not limits or (self._data_limit is not None and self._data_limit <= min(limits)):
            return
        self._data_limit = min(limits)
        self.notes.append(f"the script's data gives at most {self._data_limit} examples per forward: "
                          "no larger micro-batch is tried")
        for line in self._lines:
            line.hi = self._top(line.hi)

    def _take_profiling(self, stage: int, results: list[TrialResult]) -> None:
        """What a method does with the profiling trials taken at ``stage``: nothing by default."""

    def _conflicts(self, line: LineT, result: TrialResult) -> bool:
        """``result`` contradicts an earlier verdict of its configuration and is not the repeat: the line
        runs it once more, and that decides (said in :attr:`notes`). The verdict is kept either way."""
        if result.status not in (TrialStatus.OK, TrialStatus.OOM):
            return False
        earlier = self._verdicts.setdefault(_config(result.spec), [])
        other = next((r for r in earlier if r.status is not result.status), None)
        earlier.append(result)
        if other is None or result.spec.trial_id in self._repeats:
            return False
        spec = result.spec
        note = (f"trial {spec.name} (stage {spec.stage}, micro-batch {spec.micro_batch}) was judged "
                f"{_VERDICT[result.status]}, trial {other.spec.name} of the same config "
                f"{_VERDICT[other.status]}: running it once more to decide, rather than trusting the "
                "last verdict")
        self.notes.append(note)
        logger.warning("%s", note)
        line.repeat_mb = spec.micro_batch
        return True

    @property
    def done(self) -> bool:
        """No trial in flight, and the cap reached or nothing left to propose."""
        repeats = any(line.repeat_mb is not None for line in self._lines)
        return not self._in_flight and (self.budget_left <= 0 or not (repeats or self._has_work()))

    @property
    def budget_left(self) -> int:
        """Trials this searcher may still propose (``max_trials - 1`` in all)."""
        return self.settings.max_trials - 1 - self._proposed

    @property
    def observed_count(self) -> int:
        """Results observed so far; recorded with each proposed trial for ``replay``."""
        return len(self._results)

    @property
    def in_flight(self) -> list[TrialSpec]:
        """Trials proposed and not yet observed, by id."""
        return [spec for _, (_, spec) in sorted(self._in_flight.items())]

    @property
    def best(self) -> TrialResult | None:
        """The best successful result so far."""
        return self._best

    # -- shared helpers -----------------------------------------------------------------------
    def _take_in_flight(self, spec: TrialSpec) -> tuple[LineT, TrialSpec]:
        """The observed spec's line and proposal; ValueError, nothing changed, when not ours."""
        entry = self._in_flight.pop(spec.trial_id, None)
        if entry is None:
            raise ValueError(f"trial {spec.trial_id} was not proposed by this searcher or was "
                             f"already observed (in flight: {sorted(self._in_flight)}); replay results "
                             "through a fresh searcher with the same settings, in observation order")
        proposed = entry[1]
        if _fingerprint(spec) != _fingerprint(proposed):
            self._in_flight[spec.trial_id] = entry
            raise ValueError(f"trial {spec.trial_id}: the result is for micro_batch={spec.micro_batch}, "
                             f"line {spec.line}, zero {dict(spec.zero)}; this searcher proposed "
                             f"micro_batch={proposed.micro_batch}, line {proposed.line}, zero "
                             f"{dict(proposed.zero)}: the recorded search does not match these settings "
                             "(seed, method, stages?), or a toolkit version that searches differently "
                             "recorded it")
        return entry

    def _best_value(self) -> float | None:
        return None if self._best is None else metric_value(self._best, self.settings.metric)

    def _propose_on(self, line: LineT, *, micro_batch: int | None = None) -> TrialSpec:
        """The next trial of ``line`` (at ``micro_batch``, else the method's), now in flight."""
        self._proposed += 1
        m = self._micro_batch(line) if micro_batch is None else micro_batch
        spec = TrialSpec(trial_id=self._proposed, micro_batch=m, zero=copy.deepcopy(line.zero),
                         line=line.line_id)
        line.trials += 1
        line.in_flight = True
        self._in_flight[spec.trial_id] = (line, spec)
        return spec

    def _new_line(self, stages: Iterable[int] | None = None, *,
                  user_stage: int | None = None) -> LineT | None:
        """A new line: the user's own ZeRO section at ``user_stage``, or a random draw from ``stages``."""
        zero: dict[str, Any] | None
        if user_stage is not None:
            zero = self._space.user_config(user_stage)
        else:
            zero = self._space.draw(self._rng, stages=stages)
        if zero is None:
            return None
        off_opt, off_par = offload_flags(zero)
        approx = approx_max_micro_batch(self.profile, int(zero["stage"]),
                                        data_parallel_size=self.settings.data_parallel_size,
                                        offload_optimizer=off_opt, offload_param=off_par)
        hi = self._top(max(1, math.ceil(self.settings.search_range_factor * approx)))
        line = self._make_line(len(self._lines), zero, hi)
        line.offload = self.level
        self._lines.append(line)
        logger.debug("line %d: stage %d, micro-batch range [1, %d]", line.line_id, line.stage, hi)
        return line

    def _idle_lines(self) -> list[LineT]:
        return [line for line in self._lines if line.idle_open]

    def _top(self, m: int) -> int:
        """The largest micro-batch a trial may use that is ``<= m`` (``m`` itself when below 1)."""
        if m < 1:
            return m
        if self.settings.max_micro_batch is not None:
            m = min(m, self.settings.max_micro_batch)
        if self._data_limit is not None:
            m = min(m, self._data_limit)
        allowed = self.settings.micro_batches
        return m if allowed is None else allowed[bisect.bisect_right(allowed, m) - 1]

    def _inside(self, line: Line) -> tuple[int, ...] | None:
        """The allowed micro-batches in ``[line.lo, line.hi]``, ascending; None when any is allowed."""
        allowed = self.settings.micro_batches
        if allowed is None:
            return None
        return allowed[bisect.bisect_left(allowed, line.lo):bisect.bisect_right(allowed, line.hi)]

    # -- offload levels -----------------------------------------------------------------------
    @property
    def level(self) -> str:
        """The offload level new lines are drawn at."""
        return self._levels[self._level]

    def _space_at(self, index: int) -> ZeroSpace:
        level = self._levels[index]
        return ZeroSpace(offload.level_stages(self.settings.zero_stages, level),
                         base_zero=offload.offload_zero(self.settings.base_zero, level))

    def _fits_at_one(self, level: str) -> bool:
        """The memory model says some stage of ``level`` fits one example per slot."""
        base = offload.offload_zero(self.settings.base_zero, level)
        for stage in offload.level_stages(self.settings.zero_stages, level):
            off_opt, off_par = offload_flags(zero_config_for_stage(base, stage))
            row = memory.predict(self.profile, data_parallel_size=self.settings.data_parallel_size,
                                 zero_stages=(stage,), offload_optimizer=off_opt, offload_param=off_par)
            if row[stage]["fits"]:
                return True
        return False

    def _start_level(self) -> int:
        """``auto``: the first level predicted to fit micro-batch 1; else the first."""
        if self.settings.offload != "auto" or len(self._levels) == 1:
            return 0
        index = offload.first_level(self._levels, self._fits_at_one)
        if index:
            logger.info("memory model: no searched stage fits micro-batch 1 without offload; searching with "
                        "offload level %r", self._levels[index])
        return index

    def _maybe_offload_more(self) -> None:
        """One level down when every stage of this one ran out of memory at micro-batch 1."""
        if self._level + 1 >= len(self._levels):
            return
        here = [r for r in self._results if self._lines[r.spec.line].offload == self.level]
        if offload.nothing_fits_at_one(here, offload.level_stages(self.settings.zero_stages, self.level)):
            self._level += 1
            self._space = self._space_at(self._level)
            logger.info("every stage ran out of memory at micro-batch 1: searching with offload level %r",
                        self.level)

    # -- per method ---------------------------------------------------------------------------
    def _make_line(self, line_id: int, zero: dict[str, Any], hi: int) -> LineT:
        """A fresh line of this method's line type on the range ``[1, hi]``."""
        raise NotImplementedError

    def _micro_batch(self, line: LineT) -> int:
        """The micro-batch of ``line``'s next trial: the middle of its (allowed) range by default."""
        inside = self._inside(line)
        return (line.lo + line.hi) // 2 if inside is None else inside[(len(inside) - 1) // 2]

    def _next_line(self) -> LineT | None:
        """The line for the next trial (may start one); None when nothing to do."""
        raise NotImplementedError

    def _has_work(self) -> bool:
        """Whether :meth:`_next_line` would return a line (without drawing anything)."""
        raise NotImplementedError

    def _after_observe(self, line: LineT, result: TrialResult, improved: bool) -> None:
        """A method's reaction to a result (bounds already updated)."""
