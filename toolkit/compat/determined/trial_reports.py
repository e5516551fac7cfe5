"""What a search's trial reports besides its validations, and what the searcher makes of it (pure).

The trial's chief writes into its output directory (``toolkit.compat.determined.core``):
:data:`PROGRESS_FILE` (``{"progress": 0.42, "time": ...}``, from ``train.report_progress`` or
``op.report_progress``), :data:`EARLY_EXIT_FILE` (``{"reason": "INVALID_HP"}``, from
``train.report_early_exit`` and ``det.InvalidHP``; the first kept) and :data:`OPS_FILE` (the
searcher operations completed). ``python -m toolkit.run`` copies them into ``search.json``: each
trial's ``progress`` and ``early_exit``, and the search's ``progress`` (:func:`search_progress`).
Early exits are taken as Determined's searchers took them (``trialExitedEarly``,
:func:`exited_early`). Any rank.
"""

from __future__ import annotations

import bisect
import sys
from typing import Any, Mapping

from toolkit._checks import is_number
from toolkit.compat.determined.search import planned_trials, trial_bracket

__all__ = ["EARLY_EXIT_FILE", "EXIT_REASONS", "OPS_FILE", "PROGRESS_FILE", "better", "exited_early",
           "search_progress"]

PROGRESS_FILE = "determined_progress.json"
EARLY_EXIT_FILE = "determined_early_exit.json"
#: Written by ``core_context.searcher``: ``{"ops": [{"length": L, "searcher_metric": M}, ...], ...}``.
OPS_FILE = "determined_searcher.json"
#: Determined's ``ExitedReason`` names a trial's ``early_exit`` takes.
EXIT_REASONS = ("INVALID_HP", "USER_REQUESTED_STOP", "ERRORED")


def better(value: float, best: Any, *, smaller_is_better: bool) -> float:
    """The better of ``value`` and ``best`` (None or not a number: ``value``). Pure.

    Example:
        >>> better(0.3, 0.5, smaller_is_better=True), better(0.3, 0.5, smaller_is_better=False)
        (0.3, 0.5)
    """
    if not is_number(best):
        return value
    return min(value, best) if smaller_is_better else max(value, best)


def exited_early(state: dict[str, Any], trial: dict[str, Any], reason: str) -> None:
    """Record that ``trial`` exited early for ``reason`` (one of :data:`EXIT_REASONS`); update ASHA.

    Pure (updates ``state`` and ``trial``); runner. ``INVALID_HP``: its ASHA reports are removed
    from every rung and :func:`~toolkit.compat.determined.search.next_trial` replaces it (random,
    ASHA; a grid point is not replaced). Any other reason: under ASHA the trial takes the worst
    value at the rung it was working towards (once), so the others there are judged as in
    Determined. A trial the searcher stopped is no early exit: call this only for the others.
    """
    trial["early_exit"] = reason
    if "asha" not in state:
        return
    asha, index = state["asha"], int(trial["index"])
    bracket = asha["brackets"][trial_bracket(state, index)]
    if reason == "INVALID_HP":
        for entries in bracket["metrics"]:
            entries[:] = [entry for entry in entries if entry[0] != index]
        return
    rung = asha["trial_rung"].get(str(index), 0)
    if rung >= len(bracket["rungs"]):
        return
    entries = bracket["metrics"][rung]
    if all(entry[0] != index for entry in entries):
        worst = sys.float_info.max  # Determined's ashaExitedMetricValue
        entries.insert(bisect.bisect_right([v for _, v in entries], worst), [index, worst])


def search_progress(state: Mapping[str, Any], config: Mapping[str, Any]) -> float:
    """The search's fraction done, 0 to 1: ended trials count 1, the others their reported ``progress``,
    over the planned trials (invalid ones and their replacements are not counted twice). Pure.

    Determined 0.37's random searcher's rule (ended trials whole, the others by their progress),
    here for every searcher, so what the trials report reaches the search's progress.
    """
    trials = [t for t in state["trials"] if t.get("early_exit") != "INVALID_HP"]
    planned = planned_trials(state, config, replacements=False)
    done = sum(1.0 if t["state"] in ("COMPLETED", "ERROR")
               else min(max(float(t.get("progress") or 0.0), 0.0), 1.0) for t in trials)
    return min(done / planned, 1.0) if planned > 0 else 1.0
