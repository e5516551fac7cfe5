"""What a search's trial reads of ``toolkit.run``'s search, and how it waits for it (trial side).

Called by ``core_context.train`` and ``searcher``: chief only, or any rank for the reads. The handshake:
docs/design-determined.md#the-report-handshake; file and variable names: :mod:`toolkit.launch.trial_files`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from toolkit._checks import is_number
from toolkit.launch.trial_files import ACK_FILE, SEARCH_ACK_ENV

__all__ = ["ACK_TIMEOUT_S", "best_validation", "wait_for_searcher"]

logger = logging.getLogger(__name__)

#: How long a chief waits for the runner to read a validation report (then it goes on, warned).
ACK_TIMEOUT_S = 30.0


def best_validation(state: Any, trial_dir: str) -> float | None:
    """The best validation ``metric`` of a search's record that lists ``trial_dir``, else None: each
    trial's ``best_metric`` (``metric`` in an earlier toolkit's record), the best by the recorded
    ``smaller_is_better``, non-finite values skipped, as Determined's. Pure.

    Example:
        >>> best_validation({"trials": [{"dir": "t0", "metric": 0.9, "best_metric": 0.5}]}, "t0")
        0.5
    """
    trials = state.get("trials") if isinstance(state, dict) else None
    if not isinstance(trials, list) or not any(
            isinstance(t, dict) and t.get("dir") == trial_dir for t in trials):
        return None
    values = [float(v) for t in trials if isinstance(t, dict)
              for v in [t.get("best_metric", t.get("metric"))] if is_number(v) and math.isfinite(v)]
    if not values:
        return None
    return min(values) if state.get("smaller_is_better", True) is not False else max(values)


def wait_for_searcher(output_dir: Path, offset: int, *, timeout_s: float = ACK_TIMEOUT_S,
                      ack_file: str = ACK_FILE) -> None:
    """After a report: wait until ``toolkit.run``'s search read the trial's reports up to ``offset`` in
    ``ack_file`` (:data:`ACK_FILE`: ``metrics.jsonl``'s; another: searcher operations completed). Chief
    only; at once outside such a search; after ``timeout_s`` it goes on, warned."""
    named = os.environ.get(SEARCH_ACK_ENV)
    if not named or os.path.realpath(named) != os.path.realpath(output_dir):
        return
    ack, end = Path(output_dir) / ack_file, time.monotonic() + timeout_s
    delay = 0.002
    while time.monotonic() < end:
        try:
            if int(ack.read_text(encoding="ascii") or 0) >= offset:
                return
        except (OSError, ValueError):  # not written yet, or being replaced
            pass
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    what = "validation report" if ack_file == ACK_FILE else "completed searcher operation"
    logger.warning("the search did not read the %s within %.0f s; going on", what, timeout_s)
