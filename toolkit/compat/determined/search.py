"""Determined's searchers as pure decisions: which trials to run, and when ASHA stops one.

``python -m toolkit.run`` runs a search's trials, several at once on free slots
(:mod:`toolkit.run.scheduler`, the shell); this module decides, on a JSON-able state dict that
the shell keeps in ``<output_dir>/search.json``, so a rerun continues where the search stopped:

* ``single``: one trial (its search spaces sampled, as Determined's master does);
* ``random``: ``max_trials`` trials, each sampled from the search space;
* ``grid``: one trial per point of :func:`toolkit.compat.determined.hparams.grid_points`;
* ``adaptive_asha`` (Determined 0.38: ``time_metric`` and ``max_time``; ``async_halving`` and
  0.37's ``max_length`` are translated first, :mod:`toolkit.compat.determined.legacy`): Determined's
  asynchronous, stopping-based ASHA. ``mode`` (``aggressive``, ``standard`` (default),
  ``conservative``) or ``bracket_rungs`` gives brackets of fewer and fewer rungs, and
  ``max_trials`` is shared among them as Determined shares it (:func:`asha_brackets`); a trial
  index belongs to one bracket (:func:`bracket_of`: the brackets are filled in order, the most
  aggressive first). Each validation report carries the trial's ``time_metric``; when it reaches
  a rung of the trial's bracket, the trial's ``metric`` is ranked among the reports that bracket
  has *so far* at that rung (no waiting for the others: asynchronous), and the trial is stopped
  unless it is in the top ``1/divisor`` (at least one continues); at the last rung
  (``max_time``) it is finished. Rungs as Determined's: a bracket of ``n`` rungs has them at
  ``max_time / divisor**k``.

Trial states: ``PENDING`` (created, not run), ``RUNNING``, ``PAUSED`` (stopped by a signal: a
rerun resumes it), ``COMPLETED`` (``stopped_early`` when ASHA stopped it below the last rung),
``ERROR``. A trial's ``early_exit`` (:mod:`toolkit.compat.determined.trial_reports`) is
``INVALID_HP`` for one that another trial replaces (:func:`planned_trials`).

A search under ``toolkit.run`` also makes the trial's chief wait, after each validation report,
until the runner has read it (:func:`~toolkit.compat.determined.search_client.wait_for_searcher`).

Any process; no process started. Example::

    state = new_state(config, seed=3)
    trial = next_trial(state, config)        # {'index': 0, 'dir': 'trial-0000', 'hparams': {...}, ...}
    stop = asha_report(state, trial["index"], time_step=30, metric=0.5, config=config)
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import random
import sys
from typing import Any, Mapping

from toolkit._checks import is_int, is_number
from toolkit.compat.determined.hparams import check_space, grid_points, sample_hparams
from toolkit.compat.determined.search_client import (  # the trial's side, here too for its callers
    ACK_FILE,
    SEARCH_ACK_ENV,
    SEARCH_FILE,
    best_validation,
    wait_for_searcher,
)

__all__ = [
    "ACK_FILE",
    "ASHA_MODES",
    "SEARCHERS",
    "SEARCH_ACK_ENV",
    "asha_brackets",
    "asha_report",
    "asha_rungs",
    "bracket_of",
    "SEARCH_FILE",
    "best_trial",
    "best_validation",
    "check_searcher",
    "planned_trials",
    "searcher_defaults",
    "trial_bracket",
    "config_changes",
    "new_state",
    "next_trial",
    "trial_seed",
    "wait_for_searcher",
]

logger = logging.getLogger(__name__)

SEARCHERS = ("single", "random", "grid", "adaptive_asha")
_ASHA_DEFAULTS = {"divisor": 4, "max_rungs": 5, "mode": "standard"}
ASHA_MODES = ("aggressive", "standard", "conservative")


def _searcher(config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(config.get("searcher") or {"name": "single"})


def check_searcher(config: Mapping[str, Any]) -> list[str]:
    """Every problem of the ``searcher`` section for a local search, each naming its key. Pure; any rank."""
    s = _searcher(config)
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
    return {"divisor": s.get("divisor", _ASHA_DEFAULTS["divisor"]),
            "max_rungs": s.get("max_rungs", _ASHA_DEFAULTS["max_rungs"]),
            "mode": s.get("mode", _ASHA_DEFAULTS["mode"]), "bracket_rungs": s.get("bracket_rungs")}


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


def bracket_of(state: Mapping[str, Any], index: int) -> int:
    """The ASHA bracket of trial ``index``: the brackets are filled in order. Pure; any rank."""
    brackets = state["asha"]["brackets"]
    end = 0
    for number, bracket in enumerate(brackets):
        end += int(bracket["max_trials"])
        if index < end:
            return number
    return len(brackets) - 1


def _recorded(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a search's state records of its config, to refuse a changed YAML on a rerun (JSON values)."""
    return json.loads(json.dumps({
        "searcher_config": _searcher(config),
        "hyperparameters": config.get("hyperparameters") or {},
        "experiment_seed": (config.get("reproducibility") or {}).get("experiment_seed"),
    }))


def new_state(config: Mapping[str, Any], *, seed: int) -> dict[str, Any]:
    """A fresh search state (JSON-able), recording the searcher section, the space and the seed.

    Pure; any rank. A rerun compares them with the YAML (:func:`config_changes`).
    """
    s = _searcher(config)
    state: dict[str, Any] = {"searcher": s.get("name", "single"), "seed": int(seed), **_recorded(config),
                             "trials": []}
    if state["searcher"] == "adaptive_asha":
        brackets = asha_brackets(max_time=s["max_time"], max_trials=s["max_trials"], **searcher_defaults(s))
        for bracket in brackets:
            bracket["metrics"] = [[] for _ in bracket["rungs"]]
        state["asha"] = {"brackets": brackets, "trial_rung": {}}
    return state


def upgrade_state(state: dict[str, Any]) -> dict[str, Any]:
    """A search state of an earlier toolkit (one ASHA bracket at the top of ``asha``) in today's form.

    Pure; any rank. Such a search ran Determined's ``aggressive`` mode: one bracket of every trial.
    """
    asha = state.get("asha")
    if isinstance(asha, dict) and "brackets" not in asha and "rungs" in asha:
        max_trials = (state.get("searcher_config") or {}).get("max_trials", len(state.get("trials") or []))
        asha["brackets"] = [{"rungs": asha.pop("rungs"), "metrics": asha.pop("metrics"),
                             "max_trials": max_trials}]
    return state


def config_changes(state: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """What differs between the config a search state was started with and ``config``. Pure; any rank.

    Each entry names the key and both values; empty when the search can continue.
    ``max_concurrent_trials`` may change (it decides how many trials run at once, not which).
    Example::

        config_changes(state, config)   # ["searcher.max_trials: 2 when the search started, now 3"]
    """
    now = _recorded(config)
    before = state.get("searcher_config", {"name": state.get("searcher")})  # older files: the name only
    keys = set(before) | set(now["searcher_config"]) if "searcher_config" in state else {"name"}
    keys.discard("max_concurrent_trials")
    after = now["searcher_config"]
    changes = [f"searcher.{key}: {before.get(key)!r} when the search started, now {after.get(key)!r}"
               for key in sorted(keys) if before.get(key) != after.get(key)]
    for key, label in (("hyperparameters", "hyperparameters"),
                       ("experiment_seed", "reproducibility.experiment_seed")):
        if key in state and state[key] != now[key]:
            changes.append(f"{label}: {json.dumps(state[key])} when the search started, "
                           f"now {json.dumps(now[key])}")
    return changes


def trial_seed(state: Mapping[str, Any], index: int) -> int:
    """The seed of the search's trial ``index``: its values are sampled with it. Pure; any rank."""
    return int(state["seed"]) * 1_000_003 + index


def _planned(state: Mapping[str, Any], config: Mapping[str, Any]) -> int:
    name, s = state["searcher"], _searcher(config)
    if name == "single":
        return 1
    if name == "grid":
        return len(grid_points(config.get("hyperparameters") or {}))
    return int(s["max_trials"])


def planned_trials(state: Mapping[str, Any], config: Mapping[str, Any], *, replacements: bool = True) -> int:
    """How many trials the search runs: its plan, plus (``replacements``) one for each trial that exited
    with an invalid hyperparameter (random and ASHA replace those, as Determined's; at most the plan
    again). Pure."""
    planned = _planned(state, config)
    if not replacements or state["searcher"] not in ("random", "adaptive_asha"):
        return planned
    return planned + min(sum(t.get("early_exit") == "INVALID_HP" for t in state["trials"]), planned)


def _open_bracket(state: Mapping[str, Any]) -> int:
    """The first ASHA bracket with room for a trial (trials that exited invalid leave theirs)."""
    brackets = state["asha"]["brackets"]
    for number, bracket in enumerate(brackets):
        held = sum(t.get("bracket") == number and t.get("early_exit") != "INVALID_HP"
                   for t in state["trials"])
        if held < int(bracket["max_trials"]):
            return number
    return len(brackets) - 1


def trial_bracket(state: Mapping[str, Any], index: int) -> int:
    """The ASHA bracket trial ``index`` was put in (recorded), else :func:`bracket_of`. Pure."""
    trials = state["trials"]
    if index < len(trials) and trials[index].get("index") == index and "bracket" in trials[index]:
        return int(trials[index]["bracket"])
    return bracket_of(state, index)


def next_trial(state: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The trial to run next: a PENDING or PAUSED one (the lowest index), else a new one, else None.

    None: every planned trial exists and none waits (the search is done once none runs either).

    Pure; any rank. A new trial is appended to ``state["trials"]``; its values come from the grid or
    from a sample seeded by :func:`trial_seed` (the search seed and the trial's index, so a rerun
    draws the same), which the trial records as ``seed`` (also for a grid point, where nothing is
    sampled). :func:`planned_trials` counts the replacements of invalid trials.
    """
    for trial in state["trials"]:
        if trial["state"] in ("PENDING", "PAUSED"):
            return trial
    index = len(state["trials"])
    if index >= planned_trials(state, config):
        return None
    space = config.get("hyperparameters") or {}
    seed = trial_seed(state, index)
    if state["searcher"] == "grid":
        values = grid_points(space)[index]
    else:
        values = sample_hparams(space, random.Random(seed))
    trial = {"index": index, "dir": f"trial-{index:04d}", "hparams": values, "seed": seed, "state": "PENDING",
             "metric": None, "time": None, "stopped_early": False}
    if "asha" in state:
        trial["bracket"] = _open_bracket(state)
    state["trials"].append(trial)
    return trial


def asha_report(state: dict[str, Any], index: int, *, time_step: float, metric: float,
                config: Mapping[str, Any]) -> bool:
    """Record one validation report of trial ``index``; True: stop the trial now.

    Pure (updates ``state``); any rank. Determined's asynchronous stopping ASHA: from the trial's
    current rung of its bracket (:func:`trial_bracket`) upwards, each rung whose time the report
    reached takes the metric (negated when ``smaller_is_better`` is false); the trial stops where
    it ranks outside the top ``max(1, len(rung) // divisor)`` of the reports that rung has so
    far. At the last rung (``max_time``) Determined stops the trial as finished; here it is left
    to end by itself (0.38 scripts set their own length), so no stop races the script's own exit.
    Reprocessing a report already seen changes nothing. A NaN or infinite ``metric`` ranks last
    (stored as the largest finite float); a report at a ``time_step`` that is not finite is ignored.
    """
    if not math.isfinite(time_step):
        return False
    s = _searcher(config)
    asha = state["asha"]
    value = float(metric) if s.get("smaller_is_better", True) else -float(metric)
    if not math.isfinite(value):  # NaN or infinity: the worst of its rungs, stored as a finite number
        value = sys.float_info.max
    divisor = float(s.get("divisor", _ASHA_DEFAULTS["divisor"]))
    bracket = asha["brackets"][trial_bracket(state, index)]
    rungs = bracket["rungs"]
    rung = asha["trial_rung"].get(str(index), 0)
    while rung < len(rungs):
        asha["trial_rung"][str(index)] = rung
        if time_step < rungs[rung]:
            return False
        entries = bracket["metrics"][rung]
        at = bisect.bisect_left([v for _, v in entries], value)
        entries.insert(at, [index, value])
        if rung == len(rungs) - 1:  # max_time: Determined stops it there; here it ends itself
            asha["trial_rung"][str(index)] = rung + 1
            return False
        if at >= max(int(len(entries) / divisor), 1):
            asha["trial_rung"][str(index)] = rung + 1
            return True
        rung += 1
    return False


def best_trial(state: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The completed trial with the best ``metric`` (``smaller_is_better``, default true), or None.

    Pure; any rank. Trials that ASHA stopped early, or that exited early by their own report,
    count only when no trial ran to its end: their last metric was taken earlier in training than
    the others'. A trial that exited with an invalid hyperparameter never counts, nor a metric that
    is not a finite number (NaN, infinity): such a trial diverged.
    """
    sign = 1.0 if _searcher(config).get("smaller_is_better", True) else -1.0
    done = [t for t in state["trials"] if t["state"] == "COMPLETED" and is_number(t["metric"])
            and math.isfinite(t["metric"]) and t.get("early_exit") != "INVALID_HP"]
    done = [t for t in done if not t["stopped_early"] and not t.get("early_exit")] or done
    return min(done, key=lambda t: sign * float(t["metric"])) if done else None
