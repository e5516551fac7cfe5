"""Lines: the bookkeeping every search method shares, and :func:`best_result`.

A *line* is one ZeRO configuration (drawn at random without repeats from
:class:`~toolkit.dsat.search.space.ZeroSpace`, or the user's own section at a stage) whose micro-batch
is narrowed on ``[1, ceil(search_range_factor * approx_max_micro_batch)]`` of the memory model.
The methods of :mod:`toolkit.dsat.search.methods` differ only in which line gets the next trial and at
which micro-batch; trial ids, the trial cap, in-flight trials, bounds and the best result live
here.

A line's trials first narrow its range ``[lo, hi]`` (its *upward* search). ``binary`` may then
refine a line *downwards* with a ladder over powers of two (:attr:`Line.probe`, :attr:`Line.ladder`),
ending with up to two final probes around the ladder's best (:attr:`Line.finals`,
:func:`final_probes`): those probes lie below the largest micro-batch known to fit, so they move
no bound, and the line stays idle-and-open while it has a probe to run even when its range is
closed. Each line keeps the outcome of every trial (:attr:`Line.statuses`) and the metric of its
successful ones (:attr:`Line.values`), so that a ladder probe the line already tried is judged on
its recorded result instead of being run again, and so that the final probes can look at the
neighbours of the ladder's best. Pure logic, rank 0 only by use (the orchestrator).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import random
from typing import Any, Iterable

from toolkit._checks import is_int
from toolkit.dsat.contract import ProfileInfo, TrialStatus
from toolkit.dsat.search.memory import approx_max_micro_batch, offload_flags
from toolkit.dsat.search.space import ZeroSpace
from toolkit.dsat.search.types import SearchSettings, TrialResult, TrialSpec, is_better

__all__ = ["best_result", "final_probes", "metric_value", "Line", "LineSearcher"]

logger = logging.getLogger(__name__)


def metric_value(result: TrialResult, metric: str) -> float | None:
    """The result's finite ``metric`` when it succeeded, else None."""
    if result.status is not TrialStatus.OK:
        return None
    value = result.metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _fingerprint(spec: TrialSpec) -> tuple[int, int, str]:
    """What identifies a proposal, insensitive to a JSON round trip of the record."""
    return spec.micro_batch, spec.line, json.dumps(dict(spec.zero), sort_keys=True, default=str)


def best_result(results: Iterable[TrialResult], metric: str) -> TrialResult | None:
    """The successful result with the best ``metric`` (first one on ties), or None if none.

    Direction from :func:`~toolkit.dsat.search.types.is_better`: ``FLOPS_per_gpu`` and ``throughput``
    larger is better, ``forward``, ``backward`` and ``latency`` smaller is better. Results that
    are not ``OK`` or lack a finite value of ``metric`` are skipped. Pure; rank 0 only by use.

    Example (rank 0, after the search)::

        best = best_result(results, "latency")   # the OK trial with the lowest latency
    """
    best, best_value = None, None
    for result in results:
        value = metric_value(result, metric)
        if value is not None and is_better(metric, value, best_value):
            best, best_value = result, value
    return best


@dataclasses.dataclass
class Line:
    """One ZeRO configuration and what its trials taught about its micro-batch range."""

    line_id: int
    zero: dict[str, Any]
    lo: int
    hi: int
    trials: int = 0
    in_flight: bool = False
    best: TrialResult | None = None
    stopped: str | None = None  # why the line takes no more trials
    tried: set[int] = dataclasses.field(default_factory=set)  # micro-batches proposed on this line
    # micro-batch -> finite metric of the line's OK trials (at most one trial per micro-batch)
    values: dict[int, float] = dataclasses.field(default_factory=dict)
    # micro-batch -> status of the line's observed trials (a skipped ladder probe is judged on it)
    statuses: dict[int, TrialStatus] = dataclasses.field(default_factory=dict)
    probe: int | None = None    # binary: the next micro-batch of the downward ladder, to run
    # binary: the ladder's micro-batches so far, in order, those skipped as already tried included
    ladder: list[int] = dataclasses.field(default_factory=list)
    # binary: the final probes still to run, next first (set once, when the ladder ends)
    finals: list[int] = dataclasses.field(default_factory=list)
    rung: int = 0               # asha: the rung the line is allowed to run to
    finished_rung: int = -1     # asha: the highest rung it finished
    rung_best: dict[int, TrialResult | None] = dataclasses.field(default_factory=dict)

    @property
    def stage(self) -> int:
        return int(self.zero.get("stage", 0))

    @property
    def closed(self) -> bool:
        return self.lo > self.hi

    @property
    def descending(self) -> bool:
        """binary: the upward search is over and the line has a ladder or final probe to run."""
        return self.probe is not None or bool(self.finals)

    @property
    def idle_open(self) -> bool:
        """Ready for its next trial: nothing in flight, not stopped, range open or a probe due."""
        return not self.in_flight and self.stopped is None and (self.descending or not self.closed)


class LineSearcher:
    """Bookkeeping shared by the methods: ids, trial cap, lines, in-flight trials, best result."""

    def __init__(self, settings: SearchSettings, profile: ProfileInfo) -> None:
        self.settings = settings
        self.profile = profile
        self._rng = random.Random(settings.random_seed)
        self._space = ZeroSpace(settings.zero_stages, base_zero=settings.base_zero)
        self._lines: list[Line] = []
        self._in_flight: dict[int, tuple[Line, TrialSpec]] = {}
        self._results: list[TrialResult] = []
        self._proposed = 0
        self._best: TrialResult | None = None

    # -- public -------------------------------------------------------------------------------
    def propose(self, capacity: int) -> list[TrialSpec]:
        """Up to ``capacity`` new trials (fewer, or none, while waiting or when finished).

        Rank 0 only (the orchestrator). Raises ValueError for a negative ``capacity``.
        """
        if not is_int(capacity) or capacity < 0:
            raise ValueError(f"capacity={capacity!r}: expected an integer >= 0 (free trial slots)")
        specs: list[TrialSpec] = []
        while len(specs) < capacity and self.budget_left > 0:
            line = self._next_line()
            if line is None:
                break
            specs.append(self._start(line))
        return specs

    def observe(self, result: TrialResult) -> None:
        """Take a finished trial into account. Rank 0 only.

        The profiling trial (``spec.profile``) is ignored. Raises ValueError for a trial this
        searcher has not proposed or already observed, or whose micro-batch, line or ZeRO
        section differs from the proposal (a replay that does not match this searcher's seed or
        settings); the searcher is unchanged then.
        """
        if result.spec.profile:
            return
        entry = self._in_flight.pop(result.spec.trial_id, None)
        if entry is None:
            raise ValueError(f"trial {result.spec.trial_id} was not proposed by this searcher or was "
                             f"already observed (in flight: {sorted(self._in_flight)}); replay results "
                             "through a fresh searcher with the same settings, in observation order")
        line, spec = entry
        if _fingerprint(result.spec) != _fingerprint(spec):
            self._in_flight[spec.trial_id] = entry
            raise ValueError(f"trial {spec.trial_id}: the result is for micro_batch={result.spec.micro_batch}, "
                             f"line {result.spec.line}, zero {dict(result.spec.zero)}; this searcher proposed "
                             f"micro_batch={spec.micro_batch}, line {spec.line}, zero {dict(spec.zero)}: the "
                             "recorded search does not match these settings (seed, method, stages?), or a "
                             "toolkit version that searches differently recorded it")
        line.in_flight = False
        self._results.append(result)
        value = metric_value(result, self.settings.metric)
        line.statuses[spec.micro_batch] = result.status
        if value is not None:
            line.values[spec.micro_batch] = value
        improved = value is not None and is_better(self.settings.metric, value, self._best_value())
        if improved:
            self._best = result
        if value is not None and (line.best is None or is_better(self.settings.metric, value,
                                                                 metric_value(line.best, self.settings.metric))):
            line.best = result
        m = spec.micro_batch
        if line.descending:
            pass  # a probe below a micro-batch known to fit: its outcome is no memory bound
        elif result.status is TrialStatus.OK:
            line.lo = max(line.lo, m + 1)
        else:
            line.hi = min(line.hi, m - 1)
        self._after_observe(line, result, improved)
        if line.closed and line.stopped is None and not line.descending:
            line.stopped = "range closed"
        logger.debug("trial %d (line %d, stage %d, micro-batch %d): %s; line range [%d, %d]%s",
                     spec.trial_id, line.line_id, line.stage, m, result.status.value, line.lo, line.hi,
                     f", stopped: {line.stopped}" if line.stopped else "")

    @property
    def done(self) -> bool:
        """No trial is in flight, and the trial cap is reached or nothing is left to propose."""
        return not self._in_flight and (self.budget_left <= 0 or not self._has_work())

    @property
    def budget_left(self) -> int:
        """Trials this searcher may still propose (``max_trials - 1`` in all)."""
        return self.settings.max_trials - 1 - self._proposed

    @property
    def observed_count(self) -> int:
        """Results observed so far; record it with each proposed trial for :func:`replay`."""
        return len(self._results)

    @property
    def in_flight(self) -> list[TrialSpec]:
        """Trials proposed and not yet observed, by id."""
        return [spec for _, (_, spec) in sorted(self._in_flight.items())]

    @property
    def best(self) -> TrialResult | None:
        """The best successful result so far (see :func:`best_result`)."""
        return self._best

    # -- shared helpers -----------------------------------------------------------------------
    def _best_value(self) -> float | None:
        return None if self._best is None else metric_value(self._best, self.settings.metric)

    def _start(self, line: Line) -> TrialSpec:
        self._proposed += 1
        spec = TrialSpec(trial_id=self._proposed, micro_batch=self._micro_batch(line),
                         zero=copy.deepcopy(line.zero), line=line.line_id)
        line.trials += 1
        line.tried.add(spec.micro_batch)
        line.in_flight = True
        self._in_flight[spec.trial_id] = (line, spec)
        return spec

    def _new_line(self, stages: Iterable[int] | None = None, *, user_stage: int | None = None) -> Line | None:
        """A new line: the user's own ZeRO section at ``user_stage``, or a random draw from ``stages``."""
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
        hi = max(1, math.ceil(self.settings.search_range_factor * approx))
        line = Line(line_id=len(self._lines), zero=zero, lo=1, hi=hi)
        self._lines.append(line)
        logger.debug("line %d: stage %d, micro-batch range [1, %d]", line.line_id, line.stage, hi)
        return line

    def _idle_lines(self) -> list[Line]:
        return [line for line in self._lines if line.idle_open]

    # -- per method ---------------------------------------------------------------------------
    def _micro_batch(self, line: Line) -> int:
        return (line.lo + line.hi) // 2

    def _next_line(self) -> Line | None:
        """The line to give the next trial to (may start a new one); None when nothing to do."""
        raise NotImplementedError

    def _has_work(self) -> bool:
        """Whether :meth:`_next_line` would return a line (without drawing anything)."""
        raise NotImplementedError

    def _after_observe(self, line: Line, result: TrialResult, improved: bool) -> None:
        """Method-specific reaction to a result (bounds are already updated)."""


def final_probes(line: Line, metric: str) -> tuple[list[int], str]:
    """``binary``'s final probes of ``line``: (micro-batches in order, why). Pure; rank 0 only by use.

    Around the ladder's best probe ``b`` (the best finite value among :attr:`Line.ladder`, skipped
    probes included; the first one on ties), the powers of two ``2 * b`` and ``b // 2``: the
    midpoints, on the log scale, between ``b`` and its ladder neighbours ``4 * b`` and ``b // 4``.
    Toward the better side first: the value of the nearest successful micro-batch of the line
    above ``b`` against the nearest one below ``b`` (any trial of the line, upward ones included);
    a missing side counts as worse, ties go above first. A probe is dropped when it is below 1,
    was tried, or is not below ``line.lo`` (not known to fit). No probe when no ladder probe
    has a finite value.

    Example (rank 0, when the ladder of a line ends)::

        finals, why = final_probes(line, "throughput")   # e.g. [256, 64] around the ladder's 128
    """
    ladder_ok = [mb for mb in line.ladder if mb in line.values]
    if not ladder_ok:
        return [], "no ladder probe has a finite " + metric
    b = ladder_ok[0]
    for mb in ladder_ok[1:]:
        if is_better(metric, line.values[mb], line.values[b]):
            b = mb
    above = min((mb for mb in line.values if mb > b), default=None)
    below = max((mb for mb in line.values if mb < b), default=None)
    below_first = below is not None and (above is None
                                         or is_better(metric, line.values[below], line.values[above]))
    side = (f"nearest successes: {'none' if above is None else above} above, "
            f"{'none' if below is None else below} below, {'below' if below_first else 'above'} first")
    probes, notes = [], []
    for m in ([b // 2, 2 * b] if below_first else [2 * b, b // 2]):
        where = f"{m} ({'twice' if m > b else 'half'} the ladder's best {b})"
        if m < 1:
            notes.append(f"{where}: below 1")
        elif m in line.tried:
            notes.append(f"{where}: already tried")
        elif m >= line.lo:
            notes.append(f"{where}: not known to fit")
        else:
            probes.append(m)
            notes.append(where)
    return probes, f"{side}; " + "; ".join(notes)
