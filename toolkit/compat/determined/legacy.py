"""Searcher sections written for Determined 0.37 and earlier, run as the searches toolkit has (pure).

``python -m toolkit.run`` translates them before planning (:func:`translate_searcher`, one notice
saying how); a trial reads the same translation (:func:`operation_lengths`). ``async_halving`` is
``adaptive_asha`` with ``bracket_rungs: [num_rungs]``; an ASHA section with ``max_length`` and no
``time_metric`` / ``max_time`` (0.37) gets ``max_time`` = max_length's value, and its trials get
their rungs as searcher operations, judged on ``op.report_completed``; ``stop_once`` is dropped
(0.38 always stopped for good). Why: docs/determined.md, "Searcher sections of Determined 0.37".
Any process; no file read. Example::

    config, notice, problems = translate_searcher(config)     # runner, before plan
    operation_lengths(config)                                 # a trial: [25, 100] or None
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from toolkit._checks import is_int, is_mapping
from toolkit.compat.determined.search import asha_brackets, searcher_defaults
from toolkit.config.max_length import max_length_unit
from toolkit.errors import ConfigError

__all__ = ["is_legacy_asha", "operation_lengths", "translate_searcher"]


def is_legacy_asha(searcher: Mapping[str, Any]) -> bool:
    """An ASHA section of Determined 0.37: ``max_length`` and no ``time_metric``. Pure; any rank."""
    return (searcher.get("name") in ("adaptive_asha", "async_halving") and "max_length" in searcher
            and not searcher.get("time_metric"))


def translate_searcher(config: Mapping[str, Any]) -> tuple[dict[str, Any], str | None, list[str]]:
    """``config`` with its searcher in today's form, the notice saying how (None: unchanged), the problems.

    Pure (a new dict; ``config`` is not changed); any process. Problems name the key (an
    ``async_halving`` without an integer ``num_rungs``, a malformed ``max_length``); the
    section is then left as written.

    Example:
        >>> cfg, notice, _ = translate_searcher({"searcher": {"name": "async_halving", "num_rungs": 2,
        ...     "metric": "x", "max_trials": 4, "time_metric": "batches", "max_time": 100}})
        >>> cfg["searcher"]["name"], cfg["searcher"]["bracket_rungs"]
        ('adaptive_asha', [2])
    """
    raw = config.get("searcher")
    if not is_mapping(raw) or raw.get("name") not in ("adaptive_asha", "async_halving"):
        return copy.deepcopy(dict(config)), None, []
    searcher, how = dict(copy.deepcopy(raw)), []
    if searcher["name"] == "async_halving":
        rungs = searcher.pop("num_rungs", None)
        if not (is_int(rungs) and rungs >= 1):
            return copy.deepcopy(dict(config)), None, [
                f"searcher.num_rungs={rungs!r}: async_halving needs an integer >= 1 (its rounds of halving)"]
        searcher.update(name="adaptive_asha", bracket_rungs=[rungs])
        for key in ("mode", "max_rungs"):
            searcher.pop(key, None)
        how.append(f"async_halving runs as adaptive_asha with bracket_rungs: [{rungs}] (the one bracket of "
                   f"{rungs} rung(s) that async_halving is)")
    if is_legacy_asha(searcher) and "max_time" not in searcher:
        try:
            found = max_length_unit({"searcher": searcher,
                                     "records_per_epoch": config.get("records_per_epoch")})
        except ConfigError as err:
            return copy.deepcopy(dict(config)), None, list(err.problems)
        if found is not None:
            unit, value = found
            searcher["max_time"] = value
            how.append(f"max_length without time_metric/max_time (Determined 0.37's form) runs with "
                       f"max_time = {value} {unit}: each trial gets its rungs as searcher operations "
                       f"(op.length in {unit}) and is judged on op.report_completed(metric), as 0.37 did")
    if "stop_once" in searcher:
        stop_once = searcher.pop("stop_once")
        if stop_once is not True:
            how.append(f"stop_once={stop_once!r} is dropped: a trial below the top of its rung is stopped "
                       "for good, as Determined 0.38 always did (0.37 could resume it later)")
    if not how:
        return copy.deepcopy(dict(config)), None, []
    out = copy.deepcopy(dict(config))
    out["searcher"] = searcher
    return out, "searcher section translated from Determined's: " + "; ".join(how), []


def operation_lengths(config: Mapping[str, Any]) -> list[int] | None:
    """The ``op.length`` of each searcher operation of a trial of a 0.37 ASHA search, else None. Pure.

    The rungs of the bracket with the most rungs, in max_length's unit (every bracket's rungs are
    a tail of them, so each trial's rungs are among its operations). None: not such a search
    (one operation of ``searcher.max_length``, as before).

    Example:
        >>> operation_lengths({"searcher": {"name": "adaptive_asha", "metric": "x", "max_length": 100,
        ...                                 "max_trials": 10}})
        [25, 100]
    """
    searcher = config.get("searcher")
    if not is_mapping(searcher) or not is_legacy_asha(searcher):
        return None
    translated, _, problems = translate_searcher(config)
    s = translated["searcher"]
    if problems or not is_int(s.get("max_time")) or not is_int(s.get("max_trials")):
        return None
    brackets = asha_brackets(max_time=s["max_time"], max_trials=s["max_trials"], **searcher_defaults(s))
    return list(brackets[0]["rungs"])
