"""``binary``: bisect each ZeRO configuration's micro-batch range, then refine it downwards.

Pure logic, rank 0 only by use (the orchestrator drives it through
:func:`~toolkit.dsat.search.make_searcher`). The bounds it keeps, for a line whose largest fitting
micro-batch is ``T`` on the range ``[1, hi]``, and ``f`` the largest fitting one it finds:

- the open range holds at most ``floor(hi / 2**k)`` micro-batches after ``k`` upward trials;
- ``bisect_tolerance = 0``: ``f = T`` within ``floor(log2 hi) + 1`` upward trials;
- ``bisect_tolerance = tol > 0``: ``T - f <= tol * f`` within
  ``min(floor(log2 hi) + 1, ceil(log2((1 + tol) * hi / (tol * T))))`` upward trials;
- downwards: at most ``floor(log4(f - 1)) + 3`` trials (none for ``f = 1``).

The proofs, and those of what the ladder finds on a rising or a peaked curve, sit next to the
property tests that check them, in ``tests/dsat/search/test_methods.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.search.lines import Line, LineSearcher, metric_value
from toolkit.dsat.search.types import SMALLER_IS_BETTER, TrialResult, TrialSpec, is_better

__all__ = ["BinaryLine", "BinarySearcher", "final_probes"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BinaryLine(Line):
    """A line of ``binary``: the range of :class:`~toolkit.dsat.search.lines.Line`, then its
    downward refinement (ladder and final probes), which moves no bound.

    Attributes:
        tried: micro-batches proposed on the line.
        values: micro-batch -> finite metric of its OK trials (at most one trial per micro-batch).
        statuses: micro-batch -> status of its observed trials (a skipped ladder probe is judged
            on it).
        probe: the next micro-batch of the downward ladder, to run.
        ladder: the ladder's micro-batches so far, in order, those skipped as already tried
            included.
        finals: the final probes still to run, next first (set once, when the ladder ends).
    """

    tried: set[int] = dataclasses.field(default_factory=set)
    values: dict[int, float] = dataclasses.field(default_factory=dict)
    statuses: dict[int, TrialStatus] = dataclasses.field(default_factory=dict)
    probe: int | None = None
    ladder: list[int] = dataclasses.field(default_factory=list)
    finals: list[int] = dataclasses.field(default_factory=list)

    @property
    def descending(self) -> bool:
        """The upward search is over and the line has a ladder or final probe to run."""
        return self.probe is not None or bool(self.finals)

    @property
    def has_trial_due(self) -> bool:
        """Its range is open, or a probe below it is due (even with the range closed)."""
        return self.descending or not self.closed

    @property
    def moves_bounds(self) -> bool:
        """A probe lies below a micro-batch known to fit: its outcome is no memory bound."""
        return not self.descending


def final_probes(line: BinaryLine, metric: str, *,
                 snap: Callable[[int], int] | None = None) -> tuple[list[int], str]:
    """``binary``'s final probes of ``line``: (micro-batches in order, why). Pure; rank 0 only by use.

    Around the ladder's best probe ``b`` (the best finite value among :attr:`BinaryLine.ladder`,
    skipped probes included; the first one on ties), the powers of two ``2 * b`` and ``b // 2``:
    the midpoints, on the log scale, between ``b`` and its ladder neighbours ``4 * b`` and
    ``b // 4``. Toward the better side first: the value of the nearest successful micro-batch of
    the line above ``b`` against the nearest one below ``b`` (any trial of the line, upward ones
    included); a missing side counts as worse, ties go above first. A probe is dropped when it
    is below 1, was tried, or is not below ``line.lo`` (not known to fit). No probe when no
    ladder probe has a finite value. ``snap`` maps each probe to the micro-batch a trial may use
    (the largest allowed one not above it, when the global batch is kept).

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
        m = snap(m) if snap is not None and m >= 1 else m
        where = f"{m} ({'twice' if m > b else 'half'} the ladder's best {b})"
        if m < 1:
            notes.append(f"{where}: below 1")
        elif m in line.tried or m in probes:
            notes.append(f"{where}: already tried")
        elif m >= line.lo:
            notes.append(f"{where}: not known to fit")
        else:
            probes.append(m)
            notes.append(where)
    return probes, f"{side}; " + "; ".join(notes)


class BinarySearcher(LineSearcher[BinaryLine]):
    """``binary``: bisect each ZeRO configuration's micro-batch range, then refine downwards.

    Upward search: bisection (``m = (lo + hi) // 2``) until the range closes or, after a success,
    ``hi - f <= bisect_tolerance * f`` with ``f = lo - 1``. Why stop early: bisecting the memory
    boundary to the last unit costs about ``log2(1 / tolerance)`` more trials per line (the
    largest micro-batches: the slowest trials, often out of memory); the ladder spends them on
    the range under the boundary instead.

    Downward refinement, the *ladder*, for ``throughput`` and ``FLOPS_per_gpu`` only (for the
    smaller-is-better metrics a smaller micro-batch wins trivially), and only for a line with a
    success ``f``:

    1. the first probe is the largest power of two strictly below ``f`` (none if ``f == 1``),
       each next one the previous probe ``// 4`` (powers of two of one parity: GPU kernels and
       CPU vector code are tuned for them);
    2. after an ``OK`` probe with a finite value ``v`` it goes on iff ``v >= 0.5 * best`` (the
       line's best, this probe included): throughput on CPU is not monotone, but under half the
       best, smaller micro-batches are dominated by per-step overhead. An ``OK`` probe without a
       finite value, or a next probe below 1, ends the ladder too;
    3. a probe the line already tried is not run again but judged on its recorded result;
    4. a probe that is not ``OK`` (run or recorded) ends the line at once, without final probes:
       a failure below a micro-batch known to fit says the line misbehaves.

    Then up to two final probes (:func:`final_probes`), in order; one that is not ``OK`` ends the
    line. Bounds: see the module docstring.

    Idle lines (open range or a probe due) get the next trials first (oldest first); spare
    capacity starts new lines, one in-flight trial per line: first one line per searched stage,
    lowest stage first (a lower stage that fits is faster), each with the user's own ZeRO
    section at that stage, then random ZeRO configs of any stage. Pure; rank 0 only by use.

    Example (rank 0 only)::

        searcher = make_searcher(SearchSettings(method="binary", metric="throughput",
                                                bisect_tolerance=0.25), profile)
    """

    def _make_line(self, line_id: int, zero: dict[str, Any], hi: int) -> BinaryLine:
        return BinaryLine(line_id=line_id, zero=zero, lo=1, hi=hi)

    def _propose_on(self, line: BinaryLine) -> TrialSpec:
        spec = super()._propose_on(line)
        line.tried.add(spec.micro_batch)
        return spec

    def _micro_batch(self, line: BinaryLine) -> int:
        if line.probe is not None:
            return line.probe
        if line.finals:
            return line.finals[0]
        return super()._micro_batch(line)

    def _next_line(self) -> BinaryLine | None:
        idle = self._idle_lines()
        if idle:
            return idle[0]
        # Each searched stage gets its first line in ascending order (DeepSpeed knowledge: a
        # lower stage that fits is faster), with the user's own ZeRO knobs: the tuned result is
        # then at least the user's configuration at its best micro-batch, whatever the random
        # draws give. Then lines are drawn at random from all stages.
        started = {line.stage for line in self._lines if line.offload == self.level}
        fresh = [st for st in self._space.stages if st not in started]
        if fresh:
            return self._new_line(user_stage=min(fresh))
        return self._new_line()

    def _has_work(self) -> bool:
        return bool(self._idle_lines()) or self._space.remaining() > 0

    def _after_observe(self, line: BinaryLine, result: TrialResult, improved: bool) -> None:
        m = result.spec.micro_batch
        line.statuses[m] = result.status
        value = metric_value(result, self.settings.metric)
        if value is not None:
            line.values[m] = value
        if line.finals:  # ``result`` is the final probe ``finals[0]``
            self._after_final_probe(line, result)
        elif line.probe is not None:
            line.probe = None
            line.ladder.append(m)
            if self._ladder_goes_on(line, m):
                self._set_ladder_probe(line, self._top(m // 4))
        else:
            self._after_upward_trial(line)

    def _after_upward_trial(self, line: BinaryLine) -> None:
        """End the upward search when the range closed or is within tolerance; start the ladder."""
        if line.lo <= 1:
            return  # no success yet: nothing to be within tolerance of, nothing to refine
        fits = line.lo - 1
        tolerance = self.settings.bisect_tolerance
        if line.closed:
            reason = "range closed"
        elif line.hi - fits <= tolerance * fits:
            reason = (f"within {tolerance * 100:g}% of the largest fitting micro-batch {fits} "
                      f"(open range [{line.lo}, {line.hi}])")
        else:
            return
        if self.settings.metric in SMALLER_IS_BETTER:
            line.stopped = f"{reason}; no downward refinement for {self.settings.metric}"
        elif fits == 1:
            line.stopped = f"{reason}; no ladder: no power of two below micro-batch 1 (no final probes)"
        else:
            first = 1 << ((fits - 1).bit_length() - 1)  # the largest power of two below ``fits``
            logger.debug("line %d: upward search over (%s); ladder down from %d", line.line_id, reason, first)
            self._set_ladder_probe(line, self._top(first))

    def _set_ladder_probe(self, line: BinaryLine, m: int) -> None:
        """Make ``m >= 1`` the next ladder probe; one the line already tried is judged on its
        recorded result instead of being run again (then the ladder goes on below it)."""
        while m in line.tried:  # all of a line's tried micro-batches are observed by now
            line.ladder.append(m)
            logger.debug("line %d: ladder: micro-batch %d already tried (%s): not run again",
                         line.line_id, m, line.statuses[m].value)
            if not self._ladder_goes_on(line, m, skipped=True):
                return
            m = self._top(m // 4)
        line.probe = m

    def _ladder_goes_on(self, line: BinaryLine, m: int, *, skipped: bool = False) -> bool:
        """The ladder's rule after its probe ``m``: True to go on to ``m // 4``; else it ends the
        ladder (final probes) or, after a failed probe, the line."""
        status, value = line.statuses[m], line.values.get(m)
        best = None if line.best is None else metric_value(line.best, self.settings.metric)
        what = f"micro-batch {m}" + (" (already tried: not run again)" if skipped else "")
        if status is not TrialStatus.OK:
            line.stopped = f"ladder: {status.value} at {what} (no final probes after a failed probe)"
        elif value is None or best is None or line.best is None:
            self._end_ladder(line, f"ladder: {what} has no finite {self.settings.metric}")
        elif value < 0.5 * best:
            self._end_ladder(line, f"ladder: {what} ({value:.6g}) is under half the line's best "
                                   f"({best:.6g} at micro-batch {line.best.spec.micro_batch})")
        elif m // 4 < 1:
            self._end_ladder(line, f"ladder reached {what}: {m} // 4 is below 1")
        else:
            return True
        return False

    def _end_ladder(self, line: BinaryLine, reason: str) -> None:
        """The ladder of ``line`` is over: give it its final probes, or stop it."""
        finals, why = final_probes(line, self.settings.metric, snap=self._top)
        if not finals:
            line.stopped = f"{reason}; no final probe: {why}"
            return
        line.finals = finals
        logger.debug("line %d: %s; final probes at micro-batches %s (%s)", line.line_id, reason,
                     ", ".join(map(str, finals)), why)

    def _after_final_probe(self, line: BinaryLine, result: TrialResult) -> None:
        m = line.finals.pop(0)
        outcome = ("improved the line's best" if line.best is result else
                   "did not improve the line's best" if result.status is TrialStatus.OK
                   else result.status.value)
        if result.status is not TrialStatus.OK and line.finals:
            line.stopped = (f"final probe at micro-batch {m}: {outcome} (final probe at micro-batch "
                            f"{line.finals[0]} not run after a failed probe)")
            line.finals = []
        elif line.finals:
            logger.debug("line %d: final probe at micro-batch %d: %s; next final probe at micro-batch %d",
                         line.line_id, m, outcome, line.finals[0])
        else:
            line.stopped = f"final probe at micro-batch {m}: {outcome}"
