"""``random``: random ZeRO configurations, each tried at random micro-batches in its range (named so
as not to shadow :mod:`random`). Pure; rank 0 only by use. Design: docs/design-dsat-search.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from toolkit.dsat.contract import ProfileInfo, TrialStatus
from toolkit.dsat.search.lines import Line, LineSearcher
from toolkit.dsat.search.types import SearchSettings, TrialResult

__all__ = ["EarlyStopping", "RandomSearcher"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EarlyStopping:
    """``random``'s search-wide stopping state: a stage 1 or 2 trial fitted, trials without improvement,
    why the search stopped."""

    low_stage_fits: bool = False
    without_improvement: int = 0
    stopped: str | None = None


class RandomSearcher(LineSearcher[Line]):
    """``random`` with early stopping: trials per line capped, no stage 3 once stage 1 or 2 fits, a line
    failing at ``lo`` stops, ``early_stopping`` trials without improvement end it. Rank 0 only by use."""

    def __init__(self, settings: SearchSettings, profile: ProfileInfo) -> None:
        super().__init__(settings, profile)
        self._stopping = EarlyStopping()

    def _make_line(self, line_id: int, zero: dict[str, Any], hi: int) -> Line:
        return Line(line_id=line_id, zero=zero, lo=1, hi=hi)

    def _micro_batch(self, line: Line) -> int:
        inside = self._inside(line)
        return self._rng.randint(line.lo, line.hi) if inside is None else self._rng.choice(inside)

    def _allowed_stages(self) -> list[int]:
        return [s for s in self._space.stages if not (s == 3 and self._stopping.low_stage_fits)]

    def _next_line(self) -> Line | None:
        if self._stopping.stopped:
            return None
        idle = self._idle_lines()
        return idle[0] if idle else self._new_line(self._allowed_stages())

    def _has_work(self) -> bool:
        return not self._stopping.stopped and (bool(self._idle_lines())
                                               or self._space.remaining(self._allowed_stages()) > 0)

    def _after_observe(self, line: Line, result: TrialResult, improved: bool) -> None:
        ok = result.status is TrialStatus.OK
        if not ok and result.spec.micro_batch <= line.lo:
            line.stopped = f"{result.status.value} at its lower bound {result.spec.micro_batch}"
        elif line.trials >= self.settings.trials_per_random_config:
            line.stopped = f"{line.trials} trials (trials_per_random_config)"
        stopping = self._stopping
        if ok and line.stage in (1, 2) and not stopping.low_stage_fits:
            stopping.low_stage_fits = True
            for other in self._lines:
                if other.stage == 3 and other.stopped is None:
                    other.stopped = "a stage 1/2 trial fits"
            logger.debug("stage %d fits: no more stage-3 trials", line.stage)
        stopping.without_improvement = 0 if improved else stopping.without_improvement + 1
        limit = self.settings.early_stopping
        if limit is not None and stopping.without_improvement >= limit and not stopping.stopped:
            stopping.stopped = f"{limit} trials without improvement (early_stopping)"
            logger.info("random search stops: %s", stopping.stopped)
