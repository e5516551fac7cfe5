"""Determined's searchers as pure decisions: which trials to run, and when ASHA stops one.

``python -m toolkit.run`` runs a search's trials, several at once on free slots
(:mod:`toolkit.run.scheduler`, the shell); this module decides, on a JSON-able state dict that
the shell keeps in ``<output_dir>/search.json``, so a rerun continues where the search stopped:

* ``single``: one trial (its search spaces sampled, as Determined's master does);
* ``random``: ``max_trials`` trials, each sampled from the search space;
* ``grid``: one trial per point of :func:`toolkit.compat.determined.hparams.grid_points`;
* ``adaptive_asha`` (Determined 0.38: ``time_metric`` and ``max_time`` required): Determined's
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
``ERROR``.

A search under ``toolkit.run`` also makes the trial's chief wait, after each validation report,
until the runner has read it (:func:`wait_for_searcher`): a stop the report earns is sent before
the report returns, so the script's next ``should_preempt()`` sees it.

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
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_int, is_number
from toolkit.compat.determined.hparams import check_space, grid_points, sample_hparams

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
    "config_changes",
    "new_state",
    "next_trial",
    "trial_seed",
    "wait_for_searcher",
]

logger = logging.getLogger(__name__)

SEARCHERS = ("single", "random", "grid", "adaptive_asha")
#: The search's record, in the directory above its trials' (kept by ``toolkit.run``'s search).
SEARCH_FILE = "search.json"
_ASHA_DEFAULTS = {"divisor": 4, "max_rungs": 5, "mode": "standard"}
ASHA_MODES = ("aggressive", "standard", "conservative")
#: Set by ``toolkit.run``'s search to the trial's output directory: its chief waits after each
#: validation report until the runner has read it (the offset of ``metrics.jsonl`` in ``ACK_FILE``).
SEARCH_ACK_ENV = "TOOLKIT_SEARCH_ACK"
ACK_FILE = ".searcher_ack"
#: How long a chief waits for the runner to read a validation report (then it goes on, warned).
ACK_TIMEOUT_S = 30.0


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
        brackets = asha_brackets(max_time=s["max_time"], max_trials=s["max_trials"],
                                 divisor=s.get("divisor", _ASHA_DEFAULTS["divisor"]),
                                 max_rungs=s.get("max_rungs", _ASHA_DEFAULTS["max_rungs"]),
                                 mode=s.get("mode", _ASHA_DEFAULTS["mode"]),
                                 bracket_rungs=s.get("bracket_rungs"))
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


def next_trial(state: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The trial to run next: a PENDING or PAUSED one (the lowest index), else a new one, else None.

    None: every planned trial exists and none waits (the search is done once none runs either).

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
    if "asha" in state:
        trial["bracket"] = bracket_of(state, index)
    state["trials"].append(trial)
    return trial


def asha_report(state: dict[str, Any], index: int, *, time_step: float, metric: float,
                config: Mapping[str, Any]) -> bool:
    """Record one validation report of trial ``index``; True: stop the trial now.

    Pure (updates ``state``); any rank. Determined's asynchronous stopping ASHA: from the trial's
    current rung of its bracket (:func:`bracket_of`) upwards, each rung whose time the report
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
    bracket = asha["brackets"][bracket_of(state, index)]
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


def wait_for_searcher(output_dir: Path, offset: int, *, timeout_s: float = ACK_TIMEOUT_S) -> None:
    """After a validation report: wait until ``toolkit.run``'s search has read ``metrics.jsonl`` up to
    ``offset``. Chief only; returns at once outside such a search (``TOOLKIT_SEARCH_ACK`` unset or
    naming another directory).

    The runner sends the searcher's stop (SIGTERM to the ranks) before it writes the offset, so
    the next ``should_preempt()`` sees a stop this report earned. After ``timeout_s`` (a runner
    that does not answer) it goes on, with a warning.
    """
    named = os.environ.get(SEARCH_ACK_ENV)
    if not named or os.path.realpath(named) != os.path.realpath(output_dir):
        return
    ack, end = Path(output_dir) / ACK_FILE, time.monotonic() + timeout_s
    delay = 0.002
    while time.monotonic() < end:
        try:
            if int(ack.read_text(encoding="ascii") or 0) >= offset:
                return
        except (OSError, ValueError):  # not written yet, or being replaced
            pass
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    logger.warning("the search did not read the validation report within %.0f s; going on", timeout_s)
