"""A ``python -m toolkit.run`` search's progress line: each running trial's latest report (the
last line of its ``metrics.jsonl``: ``group``, ``steps_completed``, ``metrics``), the trials left
and a rough time left. Runner process only. Example::

    searcher: 2 running (trial-0000 step 200 validation x=12; trial-0001 step 40 training loss=0.31),
    1 done; up to 5 more trials, about 4.2 min left
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from toolkit._checks import is_number
from toolkit.launch.progress import remaining_text

__all__ = ["HEARTBEAT_S", "latest_report", "progress_line", "report_text"]

#: How often a search's progress line is logged, in seconds.
HEARTBEAT_S = 30.0
_TAIL_BYTES = 64 * 1024


def latest_report(path: Path) -> dict[str, Any] | None:
    """The last complete report line of a trial's ``metrics.jsonl``, or None (none yet)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(fh.seek(0, os.SEEK_END) - _TAIL_BYTES, 0))
            data = fh.read()
    except OSError:
        return None
    for raw in reversed(data[: data.rfind(b"\n") + 1].splitlines()):
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and isinstance(line.get("metrics"), dict):
            return line
    return None


def report_text(report: Mapping[str, Any] | None, *, metric: str | None) -> str:
    """``"step 40 training loss=0.31"``: a report's step, group and the searcher's metric (else
    its first two numbers); ``"no report yet"``."""
    if not report:
        return "no report yet"
    values = report.get("metrics") or {}
    numbers = {k: v for k, v in values.items() if is_number(v)}
    shown = {metric: numbers[metric]} if metric in numbers else dict(list(numbers.items())[:2])
    text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) and math.isfinite(v) else f"{k}={v}"
                    for k, v in shown.items())
    return f"step {report.get('steps_completed', '?')} {report.get('group', '')} {text}".rstrip()


def progress_line(running: Sequence[tuple[str, str]], *, done: int, to_start: int, durations: Sequence[float],
                  elapsed: Sequence[float], concurrency: int) -> str:
    """The progress line from ``(trial dir, report text)`` of the running trials, the trials done
    and to start, the durations of those that ended and the running ones' elapsed seconds."""
    trials = "; ".join(f"{name} {text}" for name, text in running)
    left = remaining_text(durations, remaining=to_start, concurrency=concurrency, running=elapsed)
    return f"searcher: {len(running)} running ({trials}), {done} done; {left}"
