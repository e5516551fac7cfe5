"""The autotuner's search methods: pure logic from trial results to the next trials.

Every method explores *lines* (:mod:`toolkit.dsat.search.lines`): a line is one ZeRO
configuration (drawn at random without repeats from :class:`~toolkit.dsat.search.space.ZeroSpace`, or
for ``binary``'s first line of each stage the user's own section) whose
micro-batch is narrowed on the range ``[1, ceil(search_range_factor * approx_max_micro_batch)]``
of the memory model. A line keeps
``lo`` (smallest micro-batch not yet known to fit) and ``hi`` (largest not yet known to fail):
a trial that succeeds (``OK``) at ``m`` sets ``lo = m + 1``, one that runs out of memory sets
``hi = m - 1``. A ``FAILED`` or ``TIMEOUT`` trial is treated like an out-of-memory one: its
micro-batch, and all above it, are not tried again on that line (a trial too slow at ``m`` is
slower still above it; a crash at ``m`` is as likely a memory crash as anything). The range is
closed when ``lo > hi``; the best fitting micro-batch of the line is then ``lo - 1``.

* :class:`BinarySearcher` (``binary``): bisects each line upwards (``m = (lo + hi) // 2``) until
  its range closes or, once a trial fits, the open range is within ``bisect_tolerance`` of the
  largest fitting micro-batch ``f = lo - 1``: ``hi - f <= bisect_tolerance * f``. Then, for the
  larger-is-better metrics, refines it downwards: a ladder over powers of two, then up to two
  final probes next to the ladder's best (rules and bounds: :class:`BinarySearcher`). Lines
  run side by side. Bounds, for a line whose largest fitting micro-batch is ``T`` (``1 <= T <=
  hi``; the range ``[lo, hi]`` holds at most ``floor(hi / 2**k)`` micro-batches after ``k``
  trials and always contains ``T``):

  - ``bisect_tolerance = 0``: the upward search finds ``f = T`` within ``floor(log2 hi) + 1``
    trials (exact bisection);
  - ``bisect_tolerance = tol > 0``: it ends within
    ``min(floor(log2 hi) + 1, ceil(log2((1 + tol) * hi / (tol * T))))`` trials with
    ``T - f <= tol * f``, i.e. ``f >= T / (1 + tol)`` (once the range holds at most
    ``tol * T / (1 + tol)`` micro-batches, ``f >= T - (hi - f)`` gives ``hi - f <= tol * f``);
  - downward: at most ``floor(log4(f - 1)) + 3`` trials (none for ``f = 1``).
* :class:`RandomSearcher` (``random``): a random micro-batch in ``[lo, hi]`` per trial, with the
  early-stopping rules of :class:`RandomSearcher`.
* :class:`AshaSearcher` (``asha``): binary-search lines as ASHA's resource; see its docstring
  for the rung sizes and the exact promotion rule.

Trial ids start at 1 (0 is the orchestrator's profiling trial) and follow proposal order; at most
``max_trials - 1`` trials are proposed. Each searcher owns a ``random.Random(random_seed)``, and
nothing else is random, so the same seed and the same calls give the same trials.
``propose(a)`` followed by ``propose(b)`` gives the same trials as ``propose(a + b)``, and a
``propose`` that returns nothing changes nothing: :func:`replay` rebuilds a searcher from the
recorded results and, for each trial, the number of results observed when it was proposed.

Example (rank 0 only: the orchestrator drives the search)::

    searcher = make_searcher(settings, profile)
    while not searcher.done:
        for spec in searcher.propose(free_slots // settings.data_parallel_size):
            start(spec)            # records spec with searcher.observed_count
        searcher.observe(wait_for_any_trial())
    best = searcher.best
"""

from __future__ import annotations

import functools
import logging
from typing import Mapping, Sequence

from toolkit.dsat.contract import ProfileInfo, TrialStatus
from toolkit.dsat.search.lines import Line, LineSearcher, best_result, final_probes, metric_value
from toolkit.dsat.search.types import (
    SMALLER_IS_BETTER,
    Searcher,
    SearchSettings,
    TrialResult,
    TrialSpec,
    is_better,
)

__all__ = ["make_searcher", "best_result", "replay", "BinarySearcher", "RandomSearcher", "AshaSearcher"]

logger = logging.getLogger(__name__)


class BinarySearcher(LineSearcher):
    """``binary``: bisect each ZeRO configuration's micro-batch range, then refine downwards.

    Upward search: bisection until the range closes or, after a success, ``hi - f <=
    bisect_tolerance * f`` with ``f = lo - 1``. Why stop early: bisecting the memory boundary
    to the last unit costs about ``log2(1 / tolerance)`` more trials per line (the largest
    micro-batches: the slowest trials, often out of memory), and where throughput peaks well
    below the memory limit (as on CPU) they find nothing faster; the ladder below spends them
    on the range under the boundary instead.

    Downward refinement, the *ladder*, for ``throughput`` and ``FLOPS_per_gpu`` only (for
    ``latency``, ``forward`` and ``backward`` a smaller micro-batch wins trivially, so it would
    only spend trials), and only for a line with a success ``f = lo - 1``:

    1. the first probe is the largest power of two strictly below ``f`` (none if ``f == 1``),
       each next one the previous probe ``// 4``: all probes are powers of two of one parity
       (2048, 512, 128, 32, ... or 1024, 256, 64, 16, ...). Why powers of two: GPU kernels and
       CPU vector code are tuned for them, and with the final probes every power of two next
       to the ladder's best gets tried;
    2. after an ``OK`` probe with a finite value ``v`` it goes on iff ``v >= 0.5 * best``, with
       ``best`` the line's best value, this probe included: a probe within half of the best may
       have a better one below it (throughput on CPU is not monotone: a cache cliff can put a
       dip between the memory boundary and the peak), while under half the best, smaller
       micro-batches are dominated by per-step overhead. An ``OK`` probe without a finite
       value also ends the ladder; so does a next probe below 1;
    3. a probe the line already tried is not run again but judged on its recorded result (its
       value for the rule above; the ladder then goes on to its ``// 4``). Only the first probe
       can be one on a bisected line: the upward trials are all ``>= s >= f / 2`` (``s`` the
       first success: ``f <= hi <= 2 * s`` then), the later probes ``< f / 4``;
    4. a probe that is not ``OK`` (out of memory, failed, timeout; run or recorded) ends the
       line at once, without final probes: a failure below a micro-batch known to fit says the
       line misbehaves.

    Probes move no bound.

    Final probes (up to two, computed once when the ladder ends, see
    :func:`~toolkit.dsat.search.lines.final_probes`): around the ladder's best probe ``b`` (skipped
    probes included; the first one on ties), ``2 * b`` and ``b // 2``, the midpoints on the log
    scale between ``b`` and its ladder neighbours; toward the better side first (the nearest
    successful micro-batch of the line above ``b`` against the nearest one below, any trial
    of the line; a missing side is worse; ties: above first). One is dropped when tried,
    below 1 or not below ``lo``; none when no ladder probe has a finite value. Why around the
    ladder's best and not the line's: the upward search already sampled the region near ``f``
    finely (to the bisect tolerance); the ladder's region is the coarse one, so it gets the
    refinement, and with it the best power of two near the ladder's best is tried whichever
    parity the ladder has. A final probe that is not ``OK`` ends the line (the other one is
    not run); after the last one the line is done.

    Bounds of the downward trials of a line with largest fitting micro-batch ``f >= 2``: the
    ladder's rungs are ``2**k, 2**(k - 2), ... >= 1`` with ``k = floor(log2(f - 1))``, so at
    most ``floor(k / 2) + 1 = floor(log4(f - 1)) + 1 <= floor(log4 f) + 1`` ladder probes
    (all of them when every probe is within half of the best, e.g. a curve fastest at
    micro-batch 1), then at most 2 final probes.

    With a metric that increases with the micro-batch (GPU-like: fastest at the largest
    micro-batch that fits) the line's best stays ``f``; the ladder's best is its first probe
    ``p0`` (``f / 2 <= p0 < f``), so ``2 * p0 >= f`` is dropped and ``p0 // 2`` is the only
    final probe. For ``v(m) = a * m`` the ladder is exactly ``p0`` then ``p0 // 4`` if ``>= 1``
    (``v(p0 // 4) < v(f) / 4``: under half): at most 3 downward trials, none improving. With a
    unimodal metric peaking at ``p <= f`` whose first probe ``p0`` is within half of the line's
    best (e.g. ``v(m) = m / (1 + (m / p)**2)``, symmetric on a log scale: its values within a
    factor 2 of each other never differ by 2x), and ``P`` the power of two nearest ``p`` on a
    log scale, the search (without failures, within its trial cap) tries ``P`` when ``P <= f``,
    else ``p0 = P / 2``. Why: every later rung above the peak beats all earlier trials (those
    are ``>= 2 * rung``), so the ladder reaches the smallest rung ``a >= p``, then ``a // 4``;
    the ladder's best is one of the two, so ``a // 2`` is a final probe, and ``P`` is one of
    ``a // 4, a // 2, a``. When ``p > p0``, ``P`` is ``p0`` or ``2 * p0`` (``f``, or above it).

    Idle lines (open range or a probe due) get the next trials first (oldest first); spare
    capacity starts new lines, one in-flight trial per line: first one line per searched stage,
    lowest stage first (a lower stage that fits is faster), each with the user's own ZeRO
    section at that stage (its knobs unchanged), then random ZeRO configs of any stage. Pure;
    rank 0 only by use.

    Example (rank 0 only)::

        searcher = make_searcher(SearchSettings(method="binary", metric="throughput",
                                                bisect_tolerance=0.25), profile)
    """

    def _micro_batch(self, line: Line) -> int:
        if line.probe is not None:
            return line.probe
        if line.finals:
            return line.finals[0]
        return super()._micro_batch(line)

    def _next_line(self) -> Line | None:
        idle = self._idle_lines()
        if idle:
            return idle[0]
        # Each searched stage gets its first line in ascending order (DeepSpeed knowledge: a
        # lower stage that fits is faster; measured on the CPU example, stage 1's best beat
        # stage 3's by 7%), with the user's own ZeRO knobs: the tuned result is then at least
        # the user's configuration at its best micro-batch, whatever the random draws give.
        # Then lines are drawn at random from all stages.
        started = {line.stage for line in self._lines}
        fresh = [st for st in self._space.stages if st not in started]
        if fresh:
            return self._new_line(user_stage=min(fresh))
        return self._new_line()

    def _has_work(self) -> bool:
        return bool(self._idle_lines()) or self._space.remaining() > 0

    def _after_observe(self, line: Line, result: TrialResult, improved: bool) -> None:
        if line.finals:  # ``result`` is the final probe ``finals[0]``
            self._after_final(line, result)
            return
        if line.probe is not None:
            m = line.probe
            line.probe = None
            line.ladder.append(m)
            if self._judge(line, m):
                self._descend(line, m // 4)
            return
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
            self._descend(line, first)

    def _descend(self, line: Line, m: int) -> None:
        """Make ``m >= 1`` the next ladder probe; one the line already tried is judged on its
        recorded result instead of being run again (then the ladder goes on below it)."""
        while m in line.tried:  # all of a line's tried micro-batches are observed by now
            line.ladder.append(m)
            logger.debug("line %d: ladder: micro-batch %d already tried (%s): not run again",
                         line.line_id, m, line.statuses[m].value)
            if not self._judge(line, m, skipped=True):
                return
            m //= 4
        line.probe = m

    def _judge(self, line: Line, m: int, *, skipped: bool = False) -> bool:
        """The ladder's rule after its probe ``m``: True to go on to ``m // 4``; else it ends the
        ladder (final probes) or, after a failed probe, the line."""
        status, value = line.statuses[m], line.values.get(m)
        best = metric_value(line.best, self.settings.metric) if line.best is not None else None
        what = f"micro-batch {m}" + (" (already tried: not run again)" if skipped else "")
        if status is not TrialStatus.OK:
            line.stopped = f"ladder: {status.value} at {what} (no final probes after a failed probe)"
        elif value is None or best is None:
            self._finish(line, f"ladder: {what} has no finite {self.settings.metric}")
        elif value < 0.5 * best:
            self._finish(line, f"ladder: {what} ({value:.6g}) is under half the line's best "
                               f"({best:.6g} at micro-batch {line.best.spec.micro_batch})")
        elif m // 4 < 1:
            self._finish(line, f"ladder reached {what}: {m} // 4 is below 1")
        else:
            return True
        return False

    def _finish(self, line: Line, reason: str) -> None:
        """The ladder of ``line`` is over: give it its final probes, or stop it."""
        finals, why = final_probes(line, self.settings.metric)
        if not finals:
            line.stopped = f"{reason}; no final probe: {why}"
            return
        line.finals = finals
        logger.debug("line %d: %s; final probes at micro-batches %s (%s)", line.line_id, reason,
                     ", ".join(map(str, finals)), why)

    def _after_final(self, line: Line, result: TrialResult) -> None:
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


class RandomSearcher(LineSearcher):
    """``random``: random ZeRO configurations, each tried at random micro-batches in ``[lo, hi]``.

    Early-stopping rules (DeepSpeed knowledge: a lower stage that fits is faster than stage 3):

    1. a line gets at most ``trials_per_random_config`` trials;
    2. once any stage-1 or stage-2 trial succeeds, no stage-3 line is started or continued
       (stage-3 trials already in flight finish and are observed);
    3. a line whose trial fails at its lower bound ``lo`` stops (nothing below is left to try:
       ``lo - 1`` fits or ``lo`` is 1);
    4. with ``early_stopping = n``, the whole search stops proposing after ``n`` consecutive
       observed trials that did not improve the best metric (failed trials count).

    Idle lines are continued (oldest first) before new ones start. Pure; rank 0 only by use.
    """

    def __init__(self, settings: SearchSettings, profile: ProfileInfo) -> None:
        super().__init__(settings, profile)
        self._low_stage_fits = False
        self._without_improvement = 0
        self._stopped_search: str | None = None

    def _micro_batch(self, line: Line) -> int:
        return self._rng.randint(line.lo, line.hi)

    def _allowed_stages(self) -> list[int]:
        return [s for s in self._space.stages if not (s == 3 and self._low_stage_fits)]

    def _next_line(self) -> Line | None:
        if self._stopped_search:
            return None
        idle = self._idle_lines()
        return idle[0] if idle else self._new_line(self._allowed_stages())

    def _has_work(self) -> bool:
        return not self._stopped_search and (bool(self._idle_lines())
                                             or self._space.remaining(self._allowed_stages()) > 0)

    def _after_observe(self, line: Line, result: TrialResult, improved: bool) -> None:
        ok = result.status is TrialStatus.OK
        if not ok and result.spec.micro_batch <= line.lo:
            line.stopped = f"{result.status.value} at its lower bound {result.spec.micro_batch}"
        elif line.trials >= self.settings.trials_per_random_config:
            line.stopped = f"{line.trials} trials (trials_per_random_config)"
        if ok and line.stage in (1, 2) and not self._low_stage_fits:
            self._low_stage_fits = True
            for other in self._lines:
                if other.stage == 3 and other.stopped is None:
                    other.stopped = "a stage 1/2 trial fits"
            logger.debug("stage %d fits: no more stage-3 trials", line.stage)
        self._without_improvement = 0 if improved else self._without_improvement + 1
        limit = self.settings.early_stopping
        if limit is not None and self._without_improvement >= limit and not self._stopped_search:
            self._stopped_search = f"{limit} trials without improvement (early_stopping)"
            logger.info("random search stops: %s", self._stopped_search)


class AshaSearcher(LineSearcher):
    """``asha``: asynchronous successive halving with binary-search lines as the resource.

    Rung ``r`` (``0 .. max_rungs - 1``) allows a line
    ``T(r) = min_binary_search_trials * divisor ** (asha_early_stopping + r)`` trials in total
    (counting its trials of earlier rungs). A line *finishes* rung ``r`` when it has ``T(r)``
    trials or its range closes; its best result at that moment is its score for rung ``r``.

    Promotion rule (asynchronous, checked whenever a trial slot is free): for ``r`` from the
    highest rung down, the lines that finished rung ``r`` are ranked by their rung-``r`` score
    (``is_better`` in the metric's direction; lines without a successful trial rank last; ties
    by line id). The first ``floor(n / divisor)`` of the ``n`` lines are the top; a line of the top
    that is waiting at rung ``r`` (not promoted yet, range still open, at least one success) is
    promoted to rung ``r + 1`` and continues its bisection. Closed lines and lines without a
    success are never promoted, but still count in ``n`` and may occupy top places.

    Priority of a free slot: a line still inside its rung's budget, then the best promotion,
    then a new line at rung 0. Pure; rank 0 only by use.
    """

    def _budget(self, rung: int) -> int:
        s = self.settings
        return s.min_binary_search_trials * s.divisor ** (s.asha_early_stopping + rung)

    def _running(self) -> list[Line]:
        return [line for line in self._lines
                if line.idle_open and line.finished_rung < line.rung]

    def _score(self, line: Line, rung: int) -> float | None:
        result = line.rung_best.get(rung)
        return None if result is None else metric_value(result, self.settings.metric)

    def _compare(self, rung: int, a: Line, b: Line) -> int:
        metric = self.settings.metric
        va, vb = self._score(a, rung), self._score(b, rung)
        if va is not None and (vb is None or is_better(metric, va, vb)):
            return -1
        if vb is not None and (va is None or is_better(metric, vb, va)):
            return 1
        return a.line_id - b.line_id

    def _promotable(self) -> Line | None:
        for rung in range(self.settings.max_rungs - 2, -1, -1):
            finished = [line for line in self._lines if line.finished_rung >= rung]
            top = sorted(finished, key=functools.cmp_to_key(functools.partial(self._compare, rung)))
            for line in top[:len(finished) // self.settings.divisor]:
                waiting = line.rung == rung and line.finished_rung == rung and line.idle_open
                if waiting and self._score(line, rung) is not None:
                    return line
        return None

    def _next_line(self) -> Line | None:
        running = self._running()
        if running:
            return running[0]
        line = self._promotable()
        if line is not None:
            line.rung += 1
            logger.debug("line %d promoted to rung %d (%d trials)", line.line_id, line.rung,
                         self._budget(line.rung))
            return line
        return self._new_line()

    def _has_work(self) -> bool:
        return bool(self._running()) or self._promotable() is not None or self._space.remaining() > 0

    def _after_observe(self, line: Line, result: TrialResult, improved: bool) -> None:
        if line.trials >= self._budget(line.rung) or line.closed:
            line.finished_rung = line.rung
            line.rung_best[line.rung] = line.best
            if line.rung == self.settings.max_rungs - 1 and not line.closed:
                line.stopped = "last rung finished"


_METHODS = {"binary": BinarySearcher, "random": RandomSearcher, "asha": AshaSearcher}


def make_searcher(settings: SearchSettings, profile: ProfileInfo) -> Searcher:
    """The searcher of ``settings.method``, fresh (no trial proposed yet).

    Rank 0 only (the orchestrator runs the search and launches the trials).

    Example:
        >>> settings = SearchSettings(method="binary", max_trials=10)
        >>> profile = ProfileInfo(num_params=10**6, trainable_params=10**6,
        ...                       activation_bytes_per_example=10**6, memory_per_slot=2**30)
        >>> [spec.trial_id for spec in make_searcher(settings, profile).propose(2)]
        [1, 2]
    """
    if not isinstance(settings, SearchSettings) or not isinstance(profile, ProfileInfo):
        raise TypeError(f"make_searcher(settings, profile): got {type(settings).__name__} and "
                        f"{type(profile).__name__}, expected SearchSettings and ProfileInfo")
    return _METHODS[settings.method](settings, profile)


def replay(searcher: Searcher, *, results: Sequence[TrialResult],
           observed_before: Mapping[int, int]) -> list[TrialSpec]:
    """Rebuild a fresh searcher's state from a recorded search (how ``--resume`` works).

    Rank 0 only.

    Args:
        searcher: a fresh searcher with the recorded search's settings and seed.
        results: the finished tuning trials, in the order they were observed.
        observed_before: for every proposed trial id, ``searcher.observed_count`` when it was
            proposed (the number of results observed before it).

    Returns:
        The trials that were proposed but have no result (they were running when the search
        was interrupted); they are in flight in ``searcher``: run them again and observe them.

    Raises:
        ValueError: the record does not match what this searcher proposes (another seed,
            method or settings), or ``observed_before`` is inconsistent.
    """
    by_count: dict[int, list[int]] = {}
    for trial_id, count in observed_before.items():
        if count < 0 or count > len(results):
            raise ValueError(f"observed_before[{trial_id}]={count}: expected 0..{len(results)}")
        by_count.setdefault(int(count), []).append(int(trial_id))
    for k in range(len(results) + 1):
        wanted = sorted(by_count.get(k, []))
        got = [spec.trial_id for spec in searcher.propose(len(wanted))]
        if got != wanted:
            raise ValueError(f"replay: after {k} results the recorded search proposed trials {wanted}, "
                             f"this searcher proposes {got}; resume with the original settings and seed")
        if k < len(results):
            searcher.observe(results[k])
    return list(getattr(searcher, "in_flight", []))
