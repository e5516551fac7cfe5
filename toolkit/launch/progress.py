"""How far a search is: a rough time left from the trials that ended, and durations for people.

Pure; used by dsat's progress lines and ``python -m toolkit.run``'s search heartbeat (launcher
process only by use).

Example::

    left = time_left([40.0, 44.0], remaining=6, concurrency=2, running=[10.0])
    print(f"about {format_duration(left)} left")            # about 2.4 min left
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["format_duration", "remaining_text", "time_left"]


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"3.5 min"``, ``"1.2 h"``. Pure.

    >>> format_duration(44.6), format_duration(210), format_duration(9000)
    ('45 s', '3.5 min', '2.5 h')
    """
    if not math.isfinite(seconds) or seconds < 90:
        return f"{max(seconds, 0):.0f} s" if math.isfinite(seconds) else "?"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def time_left(durations: Sequence[float], *, remaining: int, concurrency: int,
              running: Sequence[float] = ()) -> float | None:
    """Seconds the search may still take: ``remaining`` trials not yet started and the ``running``
    ones (their elapsed seconds), each expected to take the mean of ``durations`` (the trials that
    ended), ``concurrency`` at a time. None before any trial ended. Pure.

    >>> time_left([40.0, 44.0], remaining=6, concurrency=2, running=[10.0])
    142.0
    """
    if not durations:
        return None
    mean = sum(durations) / len(durations)
    work = remaining * mean + sum(max(mean - elapsed, 0.0) for elapsed in running)
    return work / max(concurrency, 1)


def remaining_text(durations: Sequence[float], *, remaining: int, concurrency: int,
                   running: Sequence[float] = ()) -> str:
    """``"up to 6 more trials, about 2.4 min left"``: :func:`time_left` for people. Pure.

    >>> remaining_text([], remaining=6, concurrency=2)
    'up to 6 more trials, time left unknown until a trial ends'
    """
    left = time_left(durations, remaining=remaining, concurrency=concurrency, running=running)
    eta = "time left unknown until a trial ends" if left is None else f"about {format_duration(left)} left"
    return f"up to {remaining} more trial{'' if remaining == 1 else 's'}, {eta}"
