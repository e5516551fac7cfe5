"""The experiment YAML's ``searcher`` section for ``python -m toolkit.run``: checked, ASHA's rungs and
brackets laid out as Determined's, and a section of Determined 0.37 translated to today's.

Pure; any process. The runner checks and translates before it plans (:mod:`toolkit.run.plan`);
a trial of a 0.37 ASHA search reads its operations' lengths (:func:`operation_lengths`). Why the
translation: docs/determined.md, "Searcher sections of Determined 0.37". Example::

    config, notice, problems = translate_searcher(config)     # runner, before plan
    asha_brackets(max_time=100, max_trials=10)                # [{'rungs': [25, 100], 'max_trials': 7}, ...]
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping

from toolkit._checks import is_int, is_mapping, is_number
from toolkit.config.hyperparameters import check_space
from toolkit.config.max_length import max_length_unit
from toolkit.errors import ConfigError

__all__ = ["ASHA_DEFAULTS", "ASHA_MODES", "SEARCHERS", "asha_brackets", "asha_rungs", "check_searcher",
           "is_legacy_asha", "operation_lengths", "searcher_defaults", "searcher_section",
           "translate_searcher"]

SEARCHERS = ("single", "random", "grid", "adaptive_asha")
ASHA_DEFAULTS = {"divisor": 4, "max_rungs": 5, "mode": "standard"}
ASHA_MODES = ("aggressive", "standard", "conservative")


def searcher_section(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's ``searcher`` section (``{"name": "single"}`` when absent), a new dict. Pure."""
    return dict(config.get("searcher") or {"name": "single"})


def check_searcher(config: Mapping[str, Any]) -> list[str]:
    """Every problem of the ``searcher`` section for a local search, each naming its key. Pure; any rank."""
    s = searcher_section(config)
    name = s.get("name", "single")
    if name not in SEARCHERS:
        return [f"searcher.name={name!r}: expected one of {', '.join(SEARCHERS)} (custom searchers and "
                "dsat's need a Determined master; tune DeepSpeed settings with python -m toolkit.dsat)"]
    problems = []
    if name in ("random", "adaptive_asha") and not (is_int(s.get("max_trials")) and s["max_trials"] >= 1):
        problems.append(f"searcher.max_trials={s.get('max_trials')!r}: {name} needs an integer >= 1")
    if name == "grid":
        problems.extend(check_space(config.get("hyperparameters") or {}, grid=True))
    if name == "adaptive_asha":
        if not (isinstance(s.get("metric"), str) and s["metric"]):
            problems.append(f"searcher.metric={s.get('metric')!r}: adaptive_asha needs the validation metric")
        if not (isinstance(s.get("time_metric"), str) and s["time_metric"]) and "max_length" not in s:
            problems.append(f"searcher.time_metric={s.get('time_metric')!r}: adaptive_asha needs the name of "
                            "a validation metric counting training progress, e.g. batches (or, as in "
                            "Determined 0.37, max_length)")
        if not (is_int(s.get("max_time")) and s["max_time"] >= 1):
            problems.append(f"searcher.max_time={s.get('max_time')!r}: adaptive_asha needs an integer >= 1 "
                            "(in time_metric's units)")
        if "divisor" in s and not (is_number(s["divisor"]) and s["divisor"] > 1):
            problems.append(f"searcher.divisor={s['divisor']!r}: expected a number > 1 (default 4)")
        if "max_rungs" in s and not (is_int(s["max_rungs"]) and s["max_rungs"] >= 1):
            problems.append(f"searcher.max_rungs={s['max_rungs']!r}: expected an integer >= 1 (default 5)")
        if "mode" in s and s["mode"] not in ASHA_MODES:
            problems.append(f"searcher.mode={s['mode']!r}: expected one of {', '.join(ASHA_MODES)} "
                            "(default standard)")
        rungs = s.get("bracket_rungs")
        if rungs not in (None, []) and not (isinstance(rungs, list)
                                            and all(is_int(r) and r >= 1 for r in rungs)):
            problems.append(f"searcher.bracket_rungs={rungs!r}: expected a list of rung counts >= 1")
    concurrent = s.get("max_concurrent_trials")
    if concurrent is not None and not (is_int(concurrent) and concurrent >= 0):
        problems.append(f"searcher.max_concurrent_trials={concurrent!r}: expected an integer >= 0 "
                        "(0: as many as the slots hold)")
    return problems


def searcher_defaults(s: Mapping[str, Any]) -> dict[str, Any]:
    """ASHA's ``divisor``, ``max_rungs``, ``mode`` and ``bracket_rungs`` of a searcher section, defaults
    filled (:func:`asha_brackets`'s keywords). Pure; any rank."""
    return {"divisor": s.get("divisor", ASHA_DEFAULTS["divisor"]),
            "max_rungs": s.get("max_rungs", ASHA_DEFAULTS["max_rungs"]),
            "mode": s.get("mode", ASHA_DEFAULTS["mode"]), "bracket_rungs": s.get("bracket_rungs")}


def asha_rungs(*, max_time: int, max_trials: int, divisor: float = 4, max_rungs: int = 5) -> list[int]:
    """The time_metric values of ASHA's rungs, as Determined's makeRungs. Pure; any rank.

    Example:
        >>> asha_rungs(max_time=100, max_trials=10)
        [25, 100]
    """
    return _rung_times(max_time, _max_rungs(max_time=max_time, max_trials=max_trials, divisor=divisor,
                                            max_rungs=max_rungs), divisor)


def _max_rungs(*, max_time: int, max_trials: int, divisor: float, max_rungs: int) -> int:
    return min(max_rungs, int(math.log(max_time) / math.log(divisor)) + 1,
               int(math.log(max_trials) / math.log(divisor)) + 1)


def _rung_times(max_time: int, n: int, divisor: float) -> list[int]:
    return [max(int(max_time / divisor ** (n - i - 1)), 1) for i in range(n)]


def asha_brackets(*, max_time: int, max_trials: int, divisor: float = 4, max_rungs: int = 5,
                  mode: str = "standard", bracket_rungs: list[int] | None = None) -> list[dict[str, Any]]:
    """Adaptive ASHA's brackets as Determined makes them: ``[{"rungs": [...], "max_trials": n}, ...]``.

    Pure; any rank. ``aggressive``: one bracket of the most rungs; ``standard``: the upper half of
    the rung counts; ``conservative``: every count from the most down to 1 (``bracket_rungs``, when
    given, instead). The brackets with more rungs (more early stopping) come first; ``max_trials`` is
    shared so that each bracket gets about the same budget (``divisor**(n-1)/n`` weights, at least
    one trial each, the remainder to the first).

    Example:
        >>> [(b["rungs"], b["max_trials"]) for b in asha_brackets(max_time=100, max_trials=10)]
        [([25, 100], 7), ([100], 3)]
    """
    most = _max_rungs(max_time=max_time, max_trials=max_trials, divisor=divisor, max_rungs=max_rungs)
    if bracket_rungs:
        counts = list(bracket_rungs)
    elif mode == "aggressive":
        counts = [most]
    elif mode == "conservative":
        counts = list(range(1, most + 1))
    else:
        counts = list(range((most - 1) // 2 + 1, most + 1))
    counts.sort(reverse=True)
    weights = [divisor ** (n - 1) / n for n in counts]
    trials = [max(int(w / sum(weights) * max_trials), 1) for w in weights]
    trials[0] += max(max_trials - sum(trials), 0)
    return [{"rungs": _rung_times(max_time, n, divisor), "max_trials": t}
            for n, t in zip(counts, trials, strict=True)]


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
    if problems or check_searcher(translated):  # e.g. max_trials: 0, which the runner refuses before
        return None
    s = translated["searcher"]
    brackets = asha_brackets(max_time=s["max_time"], max_trials=s["max_trials"], **searcher_defaults(s))
    return list(brackets[0]["rungs"])
