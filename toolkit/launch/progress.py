"""A search's rough time left, for dsat's and ``python -m toolkit.run``'s progress lines. Pure."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["format_duration", "remaining_text", "time_left"]


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"3.5 min"``, ``"1.2 h"``."""
    if not math.isfinite(seconds) or seconds < 90:
        return f"{max(seconds, 0):.0f} s" if math.isfinite(seconds) else "?"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def time_left(durations: Sequence[float], *, remaining: int, concurrency: int,
              running: Sequence[float] = ()) -> float | None:
    """Seconds for ``remaining`` trials and the rest of the ``running`` ones (their elapsed
    seconds), each the mean of ``durations``, ``concurrency`` at a time; None before any ended."""
    if not durations:
        return None
    mean = sum(durations) / len(durations)
    work = remaining * mean + sum(max(mean - elapsed, 0.0) for elapsed in running)
    return work / max(concurrency, 1)


def remaining_text(durations: Sequence[float], *, remaining: int, concurrency: int,
                   running: Sequence[float] = ()) -> str:
    """``"up to 6 more trials, about 2.4 min left"``: :func:`time_left` for people."""
    left = time_left(durations, remaining=remaining, concurrency=concurrency, running=running)
    eta = "time left unknown until a trial ends" if left is None else f"about {format_duration(left)} left"
    return f"up to {remaining} more trial{'' if remaining == 1 else 's'}, {eta}"
