"""What a search's trial reads of ``toolkit.run``'s search, and how it waits for it (trial side).

After each validation report (and each searcher operation of a 0.37 ASHA search) the trial's
chief waits until the runner has read it (:func:`wait_for_searcher`): a stop the report earns is
sent before the report returns, so the script's next ``should_preempt()`` sees it.
``get_experiment_best_validation`` reads the search's record (:func:`best_validation`). Chief only,
or any rank for the reads. The file and variable names: :mod:`toolkit.launch.trial_files`.
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
    """The best validation ``metric`` of a search's record that lists ``trial_dir``; else None.

    Pure. Each trial's best reported value (``best_metric``, which the runner keeps while the trials
    run; ``metric``, the latest, in a record of an earlier toolkit), the best of them by the recorded
    ``smaller_is_better``, as Determined's ``get_experiment_best_validation``; values that are not
    finite numbers are skipped. A state that does not list ``trial_dir`` is another search's: None,
    as before any report.

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
    """After a report: wait until ``toolkit.run``'s search has read the trial's reports up to ``offset``.
    Chief only; returns at once outside such a search (``TOOLKIT_SEARCH_ACK`` unset or naming
    another directory).

    ``ack_file`` :data:`ACK_FILE`: ``offset`` is one of ``metrics.jsonl`` (a validation report);
    another name is another count (the searcher operations completed). The runner sends the
    searcher's stop (SIGTERM to the ranks) before it writes the value, so the next
    ``should_preempt()`` sees a stop this report earned. After ``timeout_s`` (a runner that does
    not answer) it goes on, with a warning.
    """
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
