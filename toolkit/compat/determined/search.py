"""Determined's searchers as pure decisions: which trials to run, and when ASHA stops one.

``python -m toolkit.run`` runs a search's trials one after another (:mod:`toolkit.run.search`,
the shell); this module decides, on a JSON-able state dict that the shell keeps in
``<output_dir>/search.json``, so a rerun continues where the search stopped:

* ``single``: one trial (its search spaces sampled, as Determined's master does);
* ``random``: ``max_trials`` trials, each sampled from the search space;
* ``grid``: one trial per point of :func:`toolkit.compat.determined.hparams.grid_points`;
* ``adaptive_asha`` (Determined 0.38: ``time_metric`` and ``max_time`` required): ``max_trials``
  sampled trials; each validation report carries the trial's ``time_metric``; when it reaches a
  rung, the trial's ``metric`` is ranked among the trials that reached that rung, and the trial is
  stopped unless it is in the top ``1/divisor`` (at least one continues); at the last rung
  (``max_time``) it is stopped as finished. Rungs as Determined's: ``n = min(max_rungs,
  log_divisor(max_time) + 1, log_divisor(max_trials) + 1)`` rungs at ``max_time / divisor**k``.
  One bracket (Determined's ``mode: aggressive``); Determined's default ``standard`` mode also
  runs brackets with fewer rungs side by side, which one-after-another trials cannot.

Trial states: ``PENDING`` (created, not run), ``PAUSED`` (stopped by a signal: a rerun resumes
it), ``COMPLETED`` (``stopped_early`` when ASHA stopped it below the last rung), ``ERROR``.

Any process; no file, no process. Example::

    state = new_state(config, seed=3)
    trial = next_trial(state, config)        # {'index': 0, 'dir': 'trial-0000', 'hparams': {...}, ...}
    stop = asha_report(state, trial["index"], time_step=30, metric=0.5, config=config)
"""

from __future__ import annotations

import bisect
import json
import math
import random
import sys
from typing import Any, Mapping

from toolkit._checks import is_int, is_number
from toolkit.compat.determined.hparams import check_space, grid_points, sample_hparams

__all__ = [
    "SEARCHERS",
    "asha_report",
    "asha_rungs",
    "SEARCH_FILE",
    "best_trial",
    "best_validation",
    "check_searcher",
    "config_changes",
    "new_state",
    "next_trial",
    "trial_seed",
]

SEARCHERS = ("single", "random", "grid", "adaptive_asha")
#: The search's record, in the directory above its trials' (kept by ``toolkit.run``'s search).
SEARCH_FILE = "search.json"
_ASHA_DEFAULTS = {"divisor": 4, "max_rungs": 5}


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
        if not (isinstance(s.get("time_metric"), str) and s["time_metric"]):
            problems.append(f"searcher.time_metric={s.get('time_metric')!r}: adaptive_asha needs the name of "
                            "a validation metric counting training progress, e.g. batches")
        if not (is_int(s.get("max_time")) and s["max_time"] >= 1):
            problems.append(f"searcher.max_time={s.get('max_time')!r}: adaptive_asha needs an integer >= 1 "
                            "(in time_metric's units)")
        if "divisor" in s and not (is_number(s["divisor"]) and s["divisor"] > 1):
            problems.append(f"searcher.divisor={s['divisor']!r}: expected a number > 1 (default 4)")
        if "max_rungs" in s and not (is_int(s["max_rungs"]) and s["max_rungs"] >= 1):
            problems.append(f"searcher.max_rungs={s['max_rungs']!r}: expected an integer >= 1 (default 5)")
    return problems


def asha_rungs(*, max_time: int, max_trials: int, divisor: float = 4, max_rungs: int = 5) -> list[int]:
    """The time_metric values of ASHA's rungs, as Determined's makeRungs. Pure; any rank.

    Example:
        >>> asha_rungs(max_time=100, max_trials=10)
        [25, 100]
    """
    n = min(max_rungs, int(math.log(max_time) / math.log(divisor)) + 1,
            int(math.log(max_trials) / math.log(divisor)) + 1)
    return [max(int(max_time / divisor ** (n - i - 1)), 1) for i in range(n)]


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
        divisor = s.get("divisor", _ASHA_DEFAULTS["divisor"])
        rungs = asha_rungs(max_time=s["max_time"], max_trials=s["max_trials"], divisor=divisor,
                           max_rungs=s.get("max_rungs", _ASHA_DEFAULTS["max_rungs"]))
        state["asha"] = {"rungs": rungs, "metrics": [[] for _ in rungs], "trial_rung": {}}
    return state


def config_changes(state: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """What differs between the config a search state was started with and ``config``. Pure; any rank.

    Each entry names the key and both values; empty when the search can continue. Example::

        config_changes(state, config)   # ["searcher.max_trials: 2 when the search started, now 3"]
    """
    now = _recorded(config)
    before = state.get("searcher_config", {"name": state.get("searcher")})  # older files: the name only
    keys = set(before) | set(now["searcher_config"]) if "searcher_config" in state else {"name"}
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


def next_trial(state: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The trial to run next: a PENDING or PAUSED one, else a new one, else None (search done).

    Pure; any rank. A new trial is appended to ``state["trials"]``; its values come from the grid or
    from a sample seeded by :func:`trial_seed` (the search seed and the trial's index, so a rerun
    draws the same), which the trial records as ``seed`` (also for a grid point, where nothing is
    sampled).
    """
    for trial in state["trials"]:
        if trial["state"] in ("PENDING", "PAUSED"):
            return trial
    index = len(state["trials"])
    if index >= _planned(state, config):
        return None
    space = config.get("hyperparameters") or {}
    seed = trial_seed(state, index)
    if state["searcher"] == "grid":
        values = grid_points(space)[index]
    else:
        values = sample_hparams(space, random.Random(seed))
    trial = {"index": index, "dir": f"trial-{index:04d}", "hparams": values, "seed": seed, "state": "PENDING",
             "metric": None, "time": None, "stopped_early": False}
    state["trials"].append(trial)
    return trial


def asha_report(state: dict[str, Any], index: int, *, time_step: float, metric: float,
                config: Mapping[str, Any]) -> bool:
    """Record one validation report of trial ``index``; True: stop the trial now.

    Pure (updates ``state``); any rank. Determined's doEarlyStopping: from the trial's current rung
    upwards, each rung whose time the report reached takes the metric (negated when
    ``smaller_is_better`` is false); the trial stops where it ranks outside the top ``max(1,
    len(rung) // divisor)``. At the last rung (``max_time``) Determined stops the trial as finished;
    here it is left to end by itself (0.38 scripts set their own length), so no stop races the
    script's own exit. Reprocessing a report already seen changes nothing. A NaN or infinite
    ``metric`` ranks last (stored as the largest finite float); a report at a ``time_step`` that
    is not finite is ignored.
    """
    if not math.isfinite(time_step):
        return False
    s = _searcher(config)
    asha = state["asha"]
    value = float(metric) if s.get("smaller_is_better", True) else -float(metric)
    if not math.isfinite(value):  # NaN or infinity: the worst of its rungs, stored as a finite number
        value = sys.float_info.max
    divisor = float(s.get("divisor", _ASHA_DEFAULTS["divisor"]))
    rung = asha["trial_rung"].get(str(index), 0)
    while rung < len(asha["rungs"]):
        asha["trial_rung"][str(index)] = rung
        if time_step < asha["rungs"][rung]:
            return False
        entries = asha["metrics"][rung]
        at = bisect.bisect_left([v for _, v in entries], value)
        entries.insert(at, [index, value])
        if rung == len(asha["rungs"]) - 1:  # max_time: Determined stops it there; here it ends itself
            asha["trial_rung"][str(index)] = rung + 1
            return False
        if at >= max(int(len(entries) / divisor), 1):
            asha["trial_rung"][str(index)] = rung + 1
            return True
        rung += 1
    return False


def best_trial(state: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The completed trial with the best ``metric`` (``smaller_is_better``, default true), or None.

    Pure; any rank. Trials that ASHA stopped early count only when no trial ran to its end:
    their last metric was taken earlier in training than the others'. A metric that is not a
    finite number (NaN, infinity) never ranks: such a trial diverged.
    """
    sign = 1.0 if _searcher(config).get("smaller_is_better", True) else -1.0
    done = [t for t in state["trials"] if t["state"] == "COMPLETED" and is_number(t["metric"])
            and math.isfinite(t["metric"])]
    done = [t for t in done if not t["stopped_early"]] or done
    return min(done, key=lambda t: sign * float(t["metric"])) if done else None


def best_validation(state: Any, trial_dir: str) -> float | None:
    """The best ``metric`` of a search state (``search.json``) that lists ``trial_dir``; else None. Pure.

    Each trial's latest reported value (the runner records them while the trials run), the best by
    the recorded ``smaller_is_better``; values that are not finite numbers are skipped. A state
    that does not list ``trial_dir`` is another search's: None, as before any report.

    Example:
        >>> best_validation({"trials": [{"dir": "trial-0000", "metric": 0.5}]}, "trial-0000")
        0.5
    """
    trials = state.get("trials") if isinstance(state, dict) else None
    if not isinstance(trials, list) or not any(
            isinstance(t, dict) and t.get("dir") == trial_dir for t in trials):
        return None
    values = [float(t["metric"]) for t in trials
              if isinstance(t, dict) and is_number(t.get("metric")) and math.isfinite(t["metric"])]
    if not values:
        return None
    return min(values) if state.get("smaller_is_better", True) is not False else max(values)
