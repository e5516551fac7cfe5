"""Where the throughput of one ZeRO configuration peaks: ``binary``'s next micro-batch. Pure.

Throughput (and ``FLOPS_per_gpu``, proportional to it for one model) is not monotone in the
micro-batch: on CPU it peaks well below the memory limit and falls above (caches), and on GPUs it
flattens out. So a line of ``binary`` brackets the maximum on a log scale instead of climbing to
the memory boundary first. Two facts drive the decision:

* **Unimodal on a log scale** (assumed): the line's best micro-batch ``b`` is the peak once its
  nearest tried neighbours are at most :data:`RESOLUTION` (2x) away on both sides (or are the
  ends of the range). Nearer than that, a CPU or GPU measurement's noise (~10%) is as large as
  the differences left to find.
* **A step never gets faster with more examples** (physics, not an assumption): for ``a < m``,
  ``throughput(m) <= throughput(a) * m / a``. With ``S`` the optimizer step, ``B`` the examples
  of a step per rank and ``t(m) >= t(a)`` the time of a micro-step,
  ``T(m) = (B / m) t(m) + S >= (a / m) T(a)``, whether the global batch is kept (``B`` fixed) or
  free (``B = m``). So a micro-batch ``m`` below the best can only beat it when
  ``min over tried a < m of value(a) * m / a`` reaches the best within :data:`NOISE`; the others
  are never tried (this is what prunes the small micro-batches).

The rule (:func:`next_probe`), with ``b`` the best tried micro-batch of the line:

1. *right of b*: a success ``c`` above it (worse): the nearest candidate to ``sqrt(b c)``
   strictly between them, unless ``c / b <= RESOLUTION``; a failure above it (out of memory:
   the memory boundary): bisect ``[b + 1, hi]`` as Determined's ``binary`` does, until
   ``hi - b <= tolerance * b`` (``--bisect-tolerance``); nothing tried above: the candidate
   nearest ``EXPAND * b`` up to the range's top ``hi`` (the memory model's prediction);
2. *left of b*: the plausible candidates (the bound above) between the nearest success ``a``
   below ``b`` and ``b``: the nearest to ``sqrt(a b)``, unless ``b / a <= RESOLUTION``; nothing
   tried below: the plausible candidate nearest ``b / EXPAND``;
3. the side whose gap is wider on the log scale goes first (ties: right, toward the larger
   micro-batches); None when neither side has a candidate: the line has found its peak.

Candidates are the line's *grid*: with the global batch free, the powers of two up to the
range's top and the top itself (bisection near a memory boundary uses any integer); with it
kept, the micro-batches that keep it. Rank 0 only by use.

Example::

    m, why = next_probe({1: 240.0, 256: 12000.0}, tried={1, 256}, grid=(1, 2, 4, ..., 2048, 2197),
                        hi=2197, failed_above=False, bisect_at=None, tolerance=0.25)   # 1024
"""

from __future__ import annotations

import math
from typing import Collection, Mapping, Sequence

__all__ = ["EXPAND", "NOISE", "RESOLUTION", "log_grid", "next_probe", "plausible"]

#: Relative noise of one measurement: a candidate whose bound is within it of the best is tried,
#: and a line whose best is more than this below the search's best is dominated.
NOISE = 0.1
#: The peak is found when the best's tried neighbours are at most this factor away.
RESOLUTION = 2.0
#: The outward step from the best when nothing is tried on that side (a power of two).
EXPAND = 4


def log_grid(hi: int, allowed: Sequence[int] | None) -> tuple[int, ...]:
    """The candidates of a line whose range is ``[1, hi]``: ``allowed`` up to ``hi`` (the global
    batch kept), else the powers of two up to ``hi`` and ``hi`` itself. Empty for ``hi < 1``."""
    if hi < 1:
        return ()
    if allowed is not None:
        return tuple(m for m in allowed if m <= hi)
    return tuple(sorted({1 << k for k in range(hi.bit_length()) if 1 << k <= hi} | {hi}))


def plausible(m: int, values: Mapping[int, float], best: float) -> bool:
    """Whether micro-batch ``m`` may reach ``best`` (within :data:`NOISE`), by the bound
    ``value(m) <= value(a) * m / a`` for every successful ``a < m`` (module docstring)."""
    bound = min((values[a] * m / a for a in values if a < m), default=math.inf)
    return bound * (1 + NOISE) >= best


def _nearest(candidates: Sequence[int], target: float) -> int:
    """The candidate nearest ``target`` on a log scale (the smaller one on ties)."""
    return min(candidates, key=lambda m: (abs(math.log(m / target)), m))


def next_probe(values: Mapping[int, float], *, tried: Collection[int], grid: Sequence[int], hi: int,
               failed_above: bool, bisect_at: int | None, tolerance: float) -> tuple[int | None, str]:
    """The next micro-batch of a line looking for its throughput peak, and why; None: found.

    Args:
        values: micro-batch -> finite value (larger is better) of the line's successful trials;
            not empty.
        tried: every micro-batch the line tried (successes, failures, results without a value).
        grid: the line's candidates, ascending, up to ``hi`` (:func:`log_grid`).
        hi: the largest micro-batch not known to fail.
        failed_above: a trial above the line's largest success failed (``hi`` comes from it).
        bisect_at: the bisection midpoint of the open range above the largest success (None
            when closed): the next trial toward the memory boundary.
        tolerance: ``--bisect-tolerance``: the boundary is close enough once
            ``hi - b <= tolerance * b``.

    Pure; rank 0 only by use. See the module docstring for the rule.
    """
    b = max(values, key=lambda m: (values[m], -m))
    best = values[b]
    sides: list[tuple[float, int, str]] = []  # (log-width of the gap, probe, why)
    above = [m for m in values if m > b]
    if above:
        c = min(above)
        inner = [m for m in grid if b < m < c and m not in tried]
        if c / b > RESOLUTION and inner:
            sides.append((math.log2(c / b), _nearest(inner, math.sqrt(b * c)),
                          f"between the best {b} and {c} above it"))
    elif failed_above:
        if bisect_at is not None and hi - b > tolerance * b:
            sides.append((math.log2((hi + 1) / b), bisect_at,
                          f"bisecting the memory boundary in [{b + 1}, {hi}] above the best {b}"))
    else:
        inner = [m for m in grid if m > b and m not in tried]
        if inner:
            sides.append((math.log2(max(inner) / b), _nearest(inner, EXPAND * b),
                          f"{EXPAND}x the best {b}, nothing tried above it (top {max(inner)})"))
    below = [m for m in values if m < b]
    low = [m for m in grid if m < b and m not in tried and plausible(m, values, best)]
    if below:
        a = max(below)
        inner = [m for m in low if m > a]
        # below ``floor`` no micro-batch is plausible: the gap is (floor, b), not (a, b)
        floor = max([a] + [best * x / (values[x] * (1 + NOISE)) for x in below if values[x] > 0])
        if b / a > RESOLUTION and inner:
            sides.append((math.log2(b / floor), _nearest(inner, math.sqrt(floor * b)),
                          f"between {a} and the best {b} above it (plausible from {min(inner)})"))
    elif low:
        sides.append((math.log2(b / min(low)), _nearest(low, b / EXPAND),
                      f"1/{EXPAND} of the best {b}, nothing tried below it (plausible from {min(low)})"))
    if not sides:
        return None, f"peak at micro-batch {b}: no untried candidate within {RESOLUTION:g}x of it can " \
                     "plausibly beat it"
    width, m, why = max(sides, key=lambda side: side[0])  # the first (right) on ties
    return m, why
