"""``binary``: each ZeRO configuration's best micro-batch, its throughput peak bracketed on a log
scale (:mod:`~toolkit.dsat.search.peak`), or Determined's upward bisection for the times.

Pure; rank 0 only by use. Design: docs/design-dsat-search.md#binary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.search.lines import Line, LineSearcher, metric_value
from toolkit.dsat.search.peak import NOISE, log_grid, next_probe
from toolkit.dsat.search.types import SMALLER_IS_BETTER, TrialResult, is_better

__all__ = ["BinaryLine", "BinarySearcher"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BinaryLine(Line):
    """A line of ``binary``: the micro-batches ``tried``, the ``values`` of its successes, whether a trial
    above its best failed (``failed_above``), and its next micro-batch once proposed."""

    tried: set[int] = dataclasses.field(default_factory=set)
    values: dict[int, float] = dataclasses.field(default_factory=dict)
    failed_above: bool = False
    next_mb: int | None = None

    @property
    def has_trial_due(self) -> bool:
        """Decided by the searcher (a closed range may still have probes below it)."""
        return True


class BinarySearcher(LineSearcher[BinaryLine]):
    """``binary``: the user's section per stage, lowest first, then random sections of the stages not
    dominated (more than ``NOISE`` below the best). Pure; rank 0 only by use."""

    def _make_line(self, line_id: int, zero: dict[str, Any], hi: int) -> BinaryLine:
        return BinaryLine(line_id=line_id, zero=zero, lo=1, hi=hi)

    # -- the profiling trials as results -------------------------------------------------------
    def observe_profiling(self, results: Sequence[TrialResult]) -> list[TrialResult]:
        """As every method; here the trials taken also start their stage's line. Rank 0 only."""
        taken = super().observe_profiling(results)
        self._settle()
        return taken

    def _take_profiling(self, stage: int, results: list[TrialResult]) -> None:
        """Start (or extend) ``stage``'s line, the user's section, with the trials taken there."""
        line = next((x for x in self._lines if x.stage == stage and x.offload == self.level), None) \
            or self._new_line(user_stage=stage)
        assert line is not None  # a user section is always available
        for result in results:
            self._take(line, result)

    def _take(self, line: BinaryLine, result: TrialResult) -> None:
        """Record ``result`` on ``line``: bounds, values, line best (the search best is already set by
        :meth:`observe_profiling`, over these same results)."""
        m, metric = result.spec.micro_batch, self.settings.metric
        line.tried.add(m)
        value = metric_value(result, metric)
        if value is not None:
            line.values[m] = value
            if line.best is None or is_better(metric, value, metric_value(line.best, metric)):
                line.best = result
        if result.status is TrialStatus.OK:
            line.lo = max(line.lo, m + 1)
            line.hi = max(line.hi, m)  # the memory model predicted less than what ran
        else:
            line.hi = self._top(min(line.hi, m - 1))
            line.failed_above = True

    # -- per method hooks ------------------------------------------------------------------------
    def _micro_batch(self, line: BinaryLine) -> int:
        m = line.next_mb if line.next_mb is not None else super()._micro_batch(line)
        line.next_mb = None
        line.tried.add(m)
        return m

    def _after_observe(self, line: BinaryLine, result: TrialResult, improved: bool) -> None:
        m = result.spec.micro_batch
        value = metric_value(result, self.settings.metric)
        if value is not None:
            line.values[m] = value
        if result.status is not TrialStatus.OK:
            line.failed_above = True
        if line.values and line.hi < max(line.values):
            line.stopped = (f"{result.status.value} at micro-batch {m}, below micro-batch "
                            f"{max(line.values)} that succeeded on the line")
        self._settle()

    def _settle(self) -> None:
        """Stop every idle line with no trial due, after each result: stops depend on the results
        alone, not on when ``propose`` is called (a replay proposes less often)."""
        for line in self._idle_lines():
            m, why = self._due(line)
            if m is None:
                line.stopped = why
                logger.debug("line %d (stage %d) stops: %s", line.line_id, line.stage, why)

    def _next_line(self) -> BinaryLine | None:
        for line in self._by_priority(self._idle_lines()):  # settled: each has a trial due
            m, why = self._due(line)
            assert m is not None, why
            line.next_mb = m
            logger.debug("line %d (stage %d): micro-batch %d (%s)", line.line_id, line.stage, m, why)
            return line
        started = {line.stage for line in self._lines if line.offload == self.level}
        fresh = [st for st in self._space.stages if st not in started]
        new = self._new_line(user_stage=min(fresh)) if fresh else self._new_line(stages=self._open_stages())
        if new is not None:
            new.next_mb = self._first(new)
        return new

    def _has_work(self) -> bool:
        if self._idle_lines():  # settled: each has a trial due
            return True
        started = {line.stage for line in self._lines if line.offload == self.level}
        return bool(set(self._space.stages) - started) or self._space.remaining(self._open_stages()) > 0

    # -- the rules -------------------------------------------------------------------------------
    def _by_priority(self, lines: list[BinaryLine]) -> list[BinaryLine]:
        """Lines near the best first, lowest stage first (a tie goes to less communication), then
        the best's line, then by their own best, then the oldest."""
        metric = self.settings.metric
        sign = 1.0 if metric in SMALLER_IS_BETTER else -1.0

        def key(line: BinaryLine) -> tuple[int, int, int, float, int]:
            own = None if line.best is None else metric_value(line.best, metric)
            holds = self._best is not None and line.best is self._best
            near = own is not None and self._near_best(own)
            return (0 if near else 1, line.stage if near else 0, 0 if holds else 1,
                    sign * own if own is not None else float("inf"), line.line_id)
        return sorted(lines, key=key)

    def _near_best(self, value: float) -> bool:
        """``value`` is within ``NOISE`` of the search's best: too close for one measurement to rank."""
        best = self._best_value()
        if best is None:
            return False
        if self.settings.metric in SMALLER_IS_BETTER:
            return value <= best * (1 + NOISE)
        return value * (1 + NOISE) >= best

    def _open_stages(self) -> list[int]:
        """Stages not dominated (never the best's): random sections are drawn from these."""
        dominated = {line.stage for line in self._lines
                     if line.offload == self.level and (line.stopped or "").startswith("dominated")}
        if self._best is not None:
            dominated.discard(self._best.spec.stage)
        return [st for st in self._space.stages if st not in dominated]

    def _first(self, line: BinaryLine) -> int:
        """A new line's first micro-batch: the best's (snapped into its range), else the middle."""
        if self._best is not None and self.settings.metric not in SMALLER_IS_BETTER:
            return self._top(min(self._best.spec.micro_batch, line.hi))
        m = self._due(line)[0]
        assert m is not None  # a fresh line's range is [1, hi >= 1]
        return m

    def _due(self, line: BinaryLine) -> tuple[int | None, str]:
        """The line's next micro-batch and why, or (None, why it stops). Pure."""
        metric = self.settings.metric
        if line.closed and not line.values:
            return None, "range closed with no success"
        if metric in SMALLER_IS_BETTER:
            return self._upward(line)
        if not line.values:  # the middle of the range, on the line's grid
            m, why = self._upward(line)
            inside = [g for g in log_grid(line.hi, self._allowed_up_to(line.hi)) if g >= line.lo]
            return (m, why) if m is None or not inside else (
                min(inside, key=lambda g: (abs(math.log(g / m)), g)), why + ", on the grid")
        best = self._best_value()
        own = max(line.values.values())
        if best is not None and self._best is not None and line.best is not self._best:
            at = self._top(min(self._best.spec.micro_batch, line.hi))
            if at >= 1 and at not in line.tried:
                return at, f"compared at the best's micro-batch {self._best.spec.micro_batch}"
            if not self._near_best(own):
                return None, (f"dominated: its best {own:.6g} is more than {NOISE:.0%} below the search's "
                              f"best {best:.6g} (trial {self._best.spec.trial_id})")
        grid = log_grid(line.hi, self._allowed_up_to(line.hi))
        bisect_at = None if line.closed else super()._micro_batch(line)
        return next_probe(line.values, tried=line.tried, grid=grid, hi=line.hi,
                          failed_above=line.failed_above,
                          bisect_at=bisect_at, tolerance=self.settings.bisect_tolerance)

    def _allowed_up_to(self, hi: int) -> tuple[int, ...] | None:
        allowed = self.settings.micro_batches
        if allowed is None:
            return None
        cap = self.settings.max_micro_batch
        return tuple(m for m in allowed if m <= hi and (cap is None or m <= cap))

    def _upward(self, line: BinaryLine) -> tuple[int | None, str]:
        """Determined's upward bisection: the middle of ``[lo, hi]`` until closed or within tolerance."""
        if line.closed:
            return None, "range closed"
        fits, tolerance = line.lo - 1, self.settings.bisect_tolerance
        if fits >= 1 and line.hi - fits <= tolerance * fits:
            return None, (f"within {tolerance * 100:g}% of the largest fitting micro-batch {fits} "
                          f"(open range [{line.lo}, {line.hi}])")
        return super()._micro_batch(line), f"bisecting [{line.lo}, {line.hi}]"
