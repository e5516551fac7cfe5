"""A search's record, ``<output_dir>/determined_search.json``: read on a rerun, written at each change.

The record is the :class:`~toolkit.run.search_state.SearchState` with the metric, its direction,
the best trial and the search's progress beside it (what ``get_experiment_best_validation``
reads, what a person reads: docs/determined.md#searches). A rerun continues the record of an
earlier toolkit, named ``search.json`` then, and refuses (exit 2) a YAML whose searcher section,
hyperparameters or experiment seed changed. Runner process only. Example::

    state = load_state(out, config)           # a fresh one when the directory holds none
    save_state(out, state, config)
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Mapping

from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.errors import CheckpointError, ConfigError
from toolkit.launch.trial_files import SEARCH_FILE
from toolkit.run.search_state import SearchState
from toolkit.run.searchers import best_trial, config_changes, new_state, search_progress, trial_seed

__all__ = ["OLD_SEARCH_FILE", "SEARCH_FILE", "load_state", "save_state"]

logger = logging.getLogger("toolkit.run")

#: The record's name before toolkit.run and dsat named their files apart (read on a rerun).
OLD_SEARCH_FILE = "search.json"


def _record_path(out: Path) -> Path:
    """Today's record, else an earlier toolkit's (the same content under the old name)."""
    path = out / SEARCH_FILE
    old = out / OLD_SEARCH_FILE
    if not path.exists() and old.exists():
        logger.info("continuing the search recorded in %s; from now on it is recorded in %s", old, path)
        return old
    return path


def load_state(out: Path, config: Mapping[str, Any]) -> SearchState:
    """The search state recorded in ``out`` (a fresh one when there is none); RUNNING trials, left by
    a runner that was killed, are PAUSED (a rerun resumes them), and every trial has its seed.

    Raises:
        ConfigError: the YAML's searcher section, hyperparameters or experiment seed changed.
        CheckpointError: the file is not a search record.
    """
    path = _record_path(out)
    try:
        data = load_json(path, what="search record")
    except FileNotFoundError:
        seed = (config.get("reproducibility") or {}).get("experiment_seed")
        seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
        return new_state(config, seed=seed)
    except ValueError as err:  # the loader's ConfigError: malformed, not UTF-8, over a bound
        raise CheckpointError(f"{path} is not valid JSON ({err}); delete it to start the search over, or "
                              "use a new --output-dir") from None
    state = SearchState.from_json(data, source=str(path))
    changes = config_changes(state, config)
    if changes:
        raise ConfigError([f"{c} (recorded in {path}); continuing would mix two searches: use a new "
                           "--output-dir for a changed search" for c in changes])
    for trial in state.trials:
        if trial.state == "RUNNING":  # the runner itself was killed: resume the trial
            trial.state = "PAUSED"
        if trial.seed is None:  # a record of an early toolkit: the seed its values were drawn with
            trial.seed = trial_seed(state, trial.index)
    return state


def save_state(out: Path, state: SearchState, config: Mapping[str, Any]) -> None:
    """Write ``out/determined_search.json``: the state, the metric, its direction, the best trial and
    the search's progress."""
    s = config.get("searcher") or {}
    best = best_trial(state, config)
    atomic_write_json(out / SEARCH_FILE, {
        **state.to_json(), "metric": s.get("metric"), "smaller_is_better": s.get("smaller_is_better", True),
        "best": best.to_json() if best is not None else None,
        "progress": round(search_progress(state, config), 4)})
