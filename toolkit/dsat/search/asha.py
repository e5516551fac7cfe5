"""``asha``: asynchronous successive halving with binary-search lines as the resource.

Pure; rank 0 only by use (the orchestrator, through :func:`~toolkit.dsat.search.make_searcher`).
Design: docs/design-dsat-search.md#random-and-asha.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from toolkit.dsat.search.lines import Line, LineSearcher, metric_value
from toolkit.dsat.search.types import TrialResult, is_better

__all__ = ["AshaLine", "AshaSearcher"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AshaLine(Line):
    """A line of ``asha``: the rung it may run to, the highest it finished (-1: none), and its best
    result when it finished each rung (its score there)."""

    rung: int = 0
    finished_rung: int = -1
    rung_best: dict[int, TrialResult | None] = dataclasses.field(default_factory=dict)


class AshaSearcher(LineSearcher[AshaLine]):
    """``asha``: rung ``r`` allows a line ``min_binary_search_trials x divisor ** (asha_early_stopping + r)``
    trials; the top ``1 / divisor`` of a rung's finished lines with a success go on. Rank 0 only by use."""

    def _make_line(self, line_id: int, zero: dict[str, Any], hi: int) -> AshaLine:
        return AshaLine(line_id=line_id, zero=zero, lo=1, hi=hi)

    def _rung_trials(self, rung: int) -> int:
        """``T(rung)``: the trials a line may have in all once promoted to ``rung``."""
        s = self.settings
        return s.min_binary_search_trials * s.divisor ** (s.asha_early_stopping + rung)

    def _lines_within_rung(self) -> list[AshaLine]:
        """Idle lines that have not finished the rung they are allowed to run to."""
        return [line for line in self._lines
                if line.idle_open and line.finished_rung < line.rung]

    def _score(self, line: AshaLine, rung: int) -> float | None:
        result = line.rung_best.get(rung)
        return None if result is None else metric_value(result, self.settings.metric)

    def _rank_order(self, rung: int, a: AshaLine, b: AshaLine) -> int:
        """Comparison for sorting the lines of ``rung``: better score first, then line id."""
        metric = self.settings.metric
        va, vb = self._score(a, rung), self._score(b, rung)
        if va is not None and (vb is None or is_better(metric, va, vb)):
            return -1
        if vb is not None and (va is None or is_better(metric, vb, va)):
            return 1
        return a.line_id - b.line_id

    def _promotable(self) -> AshaLine | None:
        for rung in range(self.settings.max_rungs - 2, -1, -1):
            finished = [line for line in self._lines if line.finished_rung >= rung]
            top = sorted(finished, key=functools.cmp_to_key(functools.partial(self._rank_order, rung)))
            for line in top[:len(finished) // self.settings.divisor]:
                waiting = line.rung == rung and line.finished_rung == rung and line.idle_open
                if waiting and self._score(line, rung) is not None:
                    return line
        return None

    def _next_line(self) -> AshaLine | None:
        running = self._lines_within_rung()
        if running:
            return running[0]
        line = self._promotable()
        if line is not None:
            line.rung += 1
            logger.debug("line %d promoted to rung %d (%d trials)", line.line_id, line.rung,
                         self._rung_trials(line.rung))
            return line
        return self._new_line()

    def _has_work(self) -> bool:
        return (bool(self._lines_within_rung()) or self._promotable() is not None
                or self._space.remaining() > 0)

    def _after_observe(self, line: AshaLine, result: TrialResult, improved: bool) -> None:
        if line.trials >= self._rung_trials(line.rung) or line.closed:
            line.finished_rung = line.rung
            line.rung_best[line.rung] = line.best
            if line.rung == self.settings.max_rungs - 1 and not line.closed:
                line.stopped = "last rung finished"
