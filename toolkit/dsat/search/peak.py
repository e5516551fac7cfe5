"""Where one ZeRO configuration's throughput peaks: ``binary``'s next micro-batch on a line.

The peak is bracketed on a log scale (assumed unimodal there), and micro-batches that cannot win
are skipped (a step never gets faster with more examples). Pure; rank 0 only by use.
Design: docs/design-dsat-search.md#where-a-lines-throughput-peaks.
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
    """A line's candidates on ``[1, hi]``: ``allowed`` up to ``hi`` (the global batch kept), else the
    powers of two up to ``hi`` and ``hi``; empty for ``hi < 1``. Pure."""
    if hi < 1:
        return ()
    if allowed is not None:
        return tuple(m for m in allowed if m <= hi)
    return tuple(sorted({1 << k for k in range(hi.bit_length()) if 1 << k <= hi} | {hi}))


def plausible(m: int, values: Mapping[int, float], best: float) -> bool:
    """``m`` may reach ``best`` (within ``NOISE``): ``value(m) <= value(a) x m / a`` for each
    success ``a < m``. Pure."""
    bound = min((values[a] * m / a for a in values if a < m), default=math.inf)
    return bound * (1 + NOISE) >= best


def _nearest(candidates: Sequence[int], target: float) -> int:
    """The candidate nearest ``target`` on a log scale (the smaller one on ties)."""
    return min(candidates, key=lambda m: (abs(math.log(m / target)), m))


def next_probe(values: Mapping[int, float], *, tried: Collection[int], grid: Sequence[int], hi: int,
               failed_above: bool, bisect_at: int | None, tolerance: float) -> tuple[int | None, str]:
    """The next micro-batch of a line seeking its throughput peak, and why; None once found.
    ``values``: micro-batch -> value of its successes (not empty); ``bisect_at``: the bisection midpoint
    above the largest success (None: closed). Pure; rank 0 only by use."""
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
