"""Determined's searchers (``single``, ``random``, ``grid``, ``adaptive_asha``) as pure decisions on a
:class:`~toolkit.run.search_state.SearchState`. Runner process only, called by
:mod:`toolkit.run.scheduler` and :mod:`toolkit.run.slurm_engine`. Rules: docs/determined.md#searches;
details: docs/design-determined.md#the-searchers. Example::

    state = new_state(config, seed=3)
    trial = next_trial(state, config)        # TrialRecord(index=0, hparams={...}, state='PENDING', ...)
    stop = asha_report(state, trial.index, time_step=30, metric=0.5, config=config)
"""

from __future__ import annotations

import bisect
import json
import math
import random
import sys
from typing import Any, Mapping

from toolkit._checks import is_number
from toolkit.config.hyperparameters import grid_points, sample_hparams
from toolkit.config.searcher_section import ASHA_DEFAULTS, asha_brackets, searcher_defaults, searcher_section
from toolkit.run.search_state import AshaState, Bracket, SearchState, TrialRecord

__all__ = ["asha_report", "best_trial", "better", "bracket_of", "config_changes", "exited_early", "new_state",
           "next_trial", "planned_count", "planned_trials", "search_progress", "trial_bracket", "trial_seed"]


def _recorded(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a search's state records of its config, to refuse a changed YAML on a rerun (JSON values)."""
    return json.loads(json.dumps({
        "searcher_config": searcher_section(config),
        "hyperparameters": config.get("hyperparameters") or {},
        "experiment_seed": (config.get("reproducibility") or {}).get("experiment_seed"),
    }))


def new_state(config: Mapping[str, Any], *, seed: int) -> SearchState:
    """A fresh search state, recording the searcher section, the space and the seed (a rerun compares
    them with the YAML: :func:`config_changes`). Pure."""
    s = searcher_section(config)
    state = SearchState(searcher=s.get("name", "single"), seed=int(seed), trials=[], **_recorded(config))
    if state.searcher == "adaptive_asha":
        brackets = asha_brackets(max_time=s["max_time"], max_trials=s["max_trials"], **searcher_defaults(s))
        state.asha = AshaState([Bracket(b["rungs"], b["max_trials"], [[] for _ in b["rungs"]])
                                for b in brackets])
    return state


def config_changes(state: SearchState, config: Mapping[str, Any]) -> list[str]:
    """What differs between the config a search was started with and ``config``, each entry naming the
    key and both values; empty when the search can continue. ``max_concurrent_trials`` may change
    (how many trials run at once, not which). Pure."""
    now = _recorded(config)
    after = now["searcher_config"]
    before = state.searcher_config if state.searcher_config is not None else {"name": state.searcher}
    keys = (set(before) | set(after)) if state.searcher_config is not None else {"name"}
    keys.discard("max_concurrent_trials")
    changes = [f"searcher.{key}: {before.get(key)!r} when the search started, now {after.get(key)!r}"
               for key in sorted(keys) if before.get(key) != after.get(key)]
    if state.searcher_config is not None:  # an early toolkit recorded the searcher's name alone
        for label, was, key in (
                ("hyperparameters", state.hyperparameters, "hyperparameters"),
                ("reproducibility.experiment_seed", state.experiment_seed, "experiment_seed")):
            if was != now[key]:
                changes.append(f"{label}: {json.dumps(was)} when the search started, "
                               f"now {json.dumps(now[key])}")
    return changes


def trial_seed(state: SearchState, index: int) -> int:
    """The seed of the search's trial ``index``: its values are sampled with it. Pure."""
    return state.seed * 1_000_003 + index


def planned_count(state: SearchState, config: Mapping[str, Any]) -> int:
    """How many trials the search plans, replacements not counted. Pure."""
    if state.searcher == "single":
        return 1
    if state.searcher == "grid":
        return len(grid_points(config.get("hyperparameters") or {}))
    return int(searcher_section(config)["max_trials"])


def planned_trials(state: SearchState, config: Mapping[str, Any], *, replacements: bool = True) -> int:
    """How many trials the search runs: its plan, plus (``replacements``) one for each trial that exited
    with an invalid hyperparameter (random and ASHA replace those, as Determined's; at most the plan
    again). Pure."""
    planned = planned_count(state, config)
    if not replacements or state.searcher not in ("random", "adaptive_asha"):
        return planned
    return planned + min(sum(t.early_exit == "INVALID_HP" for t in state.trials), planned)


def bracket_of(state: SearchState, index: int) -> int:
    """The ASHA bracket of trial ``index`` when none was recorded: the brackets are filled in order."""
    assert state.asha is not None, "an ASHA search"
    end = 0
    for number, bracket in enumerate(state.asha.brackets):
        end += bracket.max_trials
        if index < end:
            return number
    return len(state.asha.brackets) - 1


def _open_bracket(state: SearchState) -> int:
    """The first ASHA bracket with room for a trial (trials that exited invalid leave theirs)."""
    assert state.asha is not None, "an ASHA search"
    for number, bracket in enumerate(state.asha.brackets):
        held = sum(t.bracket == number and t.early_exit != "INVALID_HP" for t in state.trials)
        if held < bracket.max_trials:
            return number
    return len(state.asha.brackets) - 1


def trial_bracket(state: SearchState, index: int) -> int:
    """The ASHA bracket trial ``index`` was put in (recorded), else :func:`bracket_of`. Pure."""
    recorded = state.trials[index].bracket if index < len(state.trials) else None
    return recorded if recorded is not None else bracket_of(state, index)


def next_trial(state: SearchState, config: Mapping[str, Any]) -> TrialRecord | None:
    """The trial to run next: a PENDING or PAUSED one (lowest index), else a new one (appended to
    ``state.trials``, values from the grid or seeded by :func:`trial_seed`), else None. Pure."""
    for trial in state.trials:
        if trial.state in ("PENDING", "PAUSED"):
            return trial
    index = len(state.trials)
    if index >= planned_trials(state, config):
        return None
    space = config.get("hyperparameters") or {}
    seed = trial_seed(state, index)
    if state.searcher == "grid":
        values = grid_points(space)[index]
    else:
        values = sample_hparams(space, random.Random(seed))
    trial = TrialRecord(index=index, hparams=values, seed=seed)
    if state.asha is not None:
        trial.bracket = _open_bracket(state)
    state.trials.append(trial)
    return trial


def asha_report(state: SearchState, index: int, *, time_step: float, metric: float,
                config: Mapping[str, Any]) -> bool:
    """Record one validation report of trial ``index``; True: stop the trial now. Pure (updates ``state``).
    It ranks at each rung reached, stops outside the top ``max(1, len(rung) // divisor)``, never at the
    last rung: docs/design-determined.md#the-searchers."""
    if not math.isfinite(time_step):
        return False
    assert state.asha is not None, "an ASHA search"
    s = searcher_section(config)
    value = float(metric) if s.get("smaller_is_better", True) else -float(metric)
    if not math.isfinite(value):  # NaN or infinity: the worst of its rungs, stored as a finite number
        value = sys.float_info.max
    divisor = float(s.get("divisor", ASHA_DEFAULTS["divisor"]))
    bracket = state.asha.brackets[trial_bracket(state, index)]
    rung = state.asha.trial_rung.get(index, 0)
    while rung < len(bracket.rungs):
        state.asha.trial_rung[index] = rung
        if time_step < bracket.rungs[rung]:
            return False
        entries = bracket.metrics[rung]
        at = bisect.bisect_left([v for _, v in entries], value)
        entries.insert(at, (index, value))
        if rung == len(bracket.rungs) - 1:  # max_time: Determined stops it there; here it ends itself
            state.asha.trial_rung[index] = rung + 1
            return False
        if at >= max(int(len(entries) / divisor), 1):
            state.asha.trial_rung[index] = rung + 1
            return True
        rung += 1
    return False


def exited_early(state: SearchState, trial: TrialRecord, reason: str) -> None:
    """Record that ``trial`` exited early for ``reason`` (Determined's ``ExitedReason``); update ASHA. Pure.
    ``INVALID_HP``: its reports leave the rungs and :func:`next_trial` replaces it (not a grid point); any
    other reason ranks last at the rung it worked towards (once). Not for a trial the searcher stopped."""
    trial.early_exit = reason
    if state.asha is None:
        return
    bracket = state.asha.brackets[trial_bracket(state, trial.index)]
    if reason == "INVALID_HP":
        for entries in bracket.metrics:
            entries[:] = [entry for entry in entries if entry[0] != trial.index]
        return
    rung = state.asha.trial_rung.get(trial.index, 0)
    if rung >= len(bracket.rungs):
        return
    entries = bracket.metrics[rung]
    if all(entry[0] != trial.index for entry in entries):
        worst = sys.float_info.max  # Determined's ashaExitedMetricValue
        entries.insert(bisect.bisect_right([v for _, v in entries], worst), (trial.index, worst))


def best_trial(state: SearchState, config: Mapping[str, Any]) -> TrialRecord | None:
    """The completed trial with the best finite ``metric`` (``smaller_is_better``, default true), or None;
    never an invalid one, and one stopped early only when none ran to its end. Pure."""
    sign = 1.0 if searcher_section(config).get("smaller_is_better", True) else -1.0
    done = [t for t in state.trials if t.state == "COMPLETED" and is_number(t.metric)
            and math.isfinite(t.metric) and t.early_exit != "INVALID_HP"]
    done = [t for t in done if not t.stopped_early and not t.early_exit] or done
    return min(done, key=lambda t: sign * float(t.metric or 0.0)) if done else None


def search_progress(state: SearchState, config: Mapping[str, Any]) -> float:
    """The search's fraction done, 0 to 1: ended trials count 1, the others their reported ``progress``,
    over the planned trials (invalid ones and their replacements not counted twice). Pure."""
    trials = [t for t in state.trials if t.early_exit != "INVALID_HP"]
    planned = planned_trials(state, config, replacements=False)
    done = sum(1.0 if t.ended else min(max(float(t.progress or 0.0), 0.0), 1.0) for t in trials)
    return min(done / planned, 1.0) if planned > 0 else 1.0


def better(value: float, best: Any, *, smaller_is_better: bool) -> float:
    """The better of ``value`` and ``best`` (None or not a number: ``value``). Pure.

    Example:
        >>> better(0.3, 0.5, smaller_is_better=True), better(0.3, 0.5, smaller_is_better=False)
        (0.3, 0.5)
    """
    if not is_number(best):
        return value
    return min(value, best) if smaller_is_better else max(value, best)
