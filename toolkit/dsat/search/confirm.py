"""The best is confirmed: each configuration's measurements, the re-runs of the top candidates,
and the pick by the median.

Pure; rank 0 only by use (the orchestrator). Design: docs/design-dsat-search.md#the-confirmation.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Iterable, Sequence

from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.search.lines import metric_value
from toolkit.dsat.search.space import canonical_zero
from toolkit.dsat.search.types import SMALLER_IS_BETTER, TrialResult, TrialSpec

__all__ = ["CONFIRM_MEASUREMENTS", "Candidate", "config_key", "group", "next_to_confirm", "pick",
           "to_confirm"]

#: Trials a confirmed configuration has in all (its search trials and its re-runs): an odd number,
#: so that its median is one of its measurements and its verdicts have a majority.
CONFIRM_MEASUREMENTS = 3


def config_key(spec: TrialSpec) -> tuple[int, str]:
    """The micro-batch and the ZeRO section as DeepSpeed sees it (``canonical_zero``). Pure."""
    return spec.micro_batch, canonical_zero(spec.zero)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration and its finished trials (search, profiling, re-runs), in run order."""

    results: tuple[TrialResult, ...]

    @property
    def spec(self) -> TrialSpec:
        """Its first trial's spec."""
        return self.results[0].spec

    def values(self, metric: str) -> list[float]:
        """The finite ``metric`` of its successful trials, in run order."""
        return [v for v in (metric_value(r, metric) for r in self.results) if v is not None]

    @property
    def fits(self) -> bool:
        """Most of its verdicts say it ran (OK)."""
        ok = sum(r.status is TrialStatus.OK for r in self.results)
        return ok > len(self.results) - ok

    @property
    def conflicting(self) -> bool:
        """Judged both fitting (OK) and out of memory at least once each."""
        statuses = {r.status for r in self.results}
        return TrialStatus.OK in statuses and TrialStatus.OOM in statuses

    def median(self, metric: str) -> float | None:
        """The median of :meth:`values` (None without one)."""
        values = self.values(metric)
        return statistics.median(values) if values else None

    def representative(self, metric: str) -> TrialResult | None:
        """The successful trial at the median, whose metrics are reported (even count: the worse)."""
        ok = [(v, r) for r in self.results if (v := metric_value(r, metric)) is not None]
        if not ok:
            return None
        worse_first = sorted(ok, key=lambda vr: -vr[0] if metric in SMALLER_IS_BETTER else vr[0])
        return worse_first[(len(worse_first) - 1) // 2][1]

    def reruns_needed(self) -> int:
        """Re-runs that bring it to :data:`CONFIRM_MEASUREMENTS` trials."""
        return max(0, CONFIRM_MEASUREMENTS - len(self.results))

    def spread(self, metric: str) -> str:
        """Its measurements for the summary: ``median (min-max; all values; trials)``."""
        values = self.values(metric)
        names = ", ".join(r.spec.name for r in self.results)
        if not values:
            return f"no result (trials {names})"
        verdicts = "" if not self.conflicting else (
            f"; verdicts {', '.join(r.status.value for r in self.results)}: "
            f"{'fits' if self.fits else 'does not fit'} by majority")
        return (f"median {statistics.median(values):.4g} (min {min(values):.4g}, max {max(values):.4g}; "
                f"{', '.join(f'{v:.4g}' for v in values)}; trials {names}{verdicts})")


def group(results: Iterable[TrialResult]) -> list[Candidate]:
    """Every configuration measured, with its trials, in first-run order. Pure."""
    by_key: dict[tuple[int, str], list[TrialResult]] = {}
    for result in results:
        by_key.setdefault(config_key(result.spec), []).append(result)
    return [Candidate(tuple(rs)) for rs in by_key.values()]


def _ranked(candidates: Sequence[Candidate], metric: str) -> list[Candidate]:
    """The fitting candidates with a result, best median first (ties: the one that ran first)."""
    scored = [(m, i, c) for i, c in enumerate(candidates) if c.fits and (m := c.median(metric)) is not None]
    sign = 1.0 if metric in SMALLER_IS_BETTER else -1.0
    return [c for _, _, c in sorted(scored, key=lambda mic: (sign * mic[0], mic[1]))]


def to_confirm(candidates: Sequence[Candidate], metric: str, *, top: int) -> list[Candidate]:
    """The ``top`` best fitting configurations by their median so far (``top`` 0: none). Pure."""
    return _ranked(candidates, metric)[:max(top, 0)]


def _better(a: float, b: float, metric: str) -> bool:
    return a < b if metric in SMALLER_IS_BETTER else a > b


def next_to_confirm(candidates: Sequence[Candidate], chosen: Sequence[tuple[int, str]],
                    metric: str) -> Candidate | None:
    """The next of ``chosen`` (:func:`to_confirm`'s keys, in order) to re-run, or None: the first not
    confirmed, while none is or one of its values beats the best confirmed median. Pure."""
    by_key = {config_key(c.spec): c for c in candidates}
    ordered = [by_key[key] for key in chosen if key in by_key]
    done = [c.median(metric) for c in ordered if c.reruns_needed() == 0 and c.fits]
    medians = [m for m in done if m is not None]
    best = (min if metric in SMALLER_IS_BETTER else max)(medians) if medians else None
    for candidate in ordered:
        if candidate.reruns_needed() == 0:
            continue
        values = candidate.values(metric)
        if best is None or any(_better(v, best, metric) for v in values):
            return candidate
    return None


def pick(candidates: Sequence[Candidate], metric: str, *, confirmed: bool = True) -> Candidate | None:
    """The best median among the fitting configurations measured more than once (``confirmed=False``:
    all fitting ones); None if none. Pure."""
    ranked = _ranked(candidates, metric)
    if confirmed:
        ranked = [c for c in ranked if len(c.values(metric)) > 1]
    return ranked[0] if ranked else None

