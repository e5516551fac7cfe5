"""What ``python -m toolkit.run`` and the Determined layer of its trials share: the trial record
(``determined_trial.json``) and the files and variables of a search's handshake
(docs/design-dsat-runner.md#determineds-environment-variables-and-trial-files). Any process. Example::

    record_hparams(out, config)                  # runner: sample once for this output directory
    load_trial_state(out, write=False)["trial_id"]
"""

from __future__ import annotations

import json
import logging
import random
import re
import zlib
from pathlib import Path
from typing import Any, Mapping

from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.config.experiment import get_output_dir
from toolkit.config.hyperparameters import has_search_space, sample_hparams
from toolkit.errors import ConfigError

__all__ = ["ACK_FILE", "EARLY_EXIT_FILE", "EXIT_REASONS", "OPS_ACK_FILE", "OPS_FILE", "PROGRESS_FILE",
           "SEARCH_ACK_ENV", "SEARCH_FILE", "TRIAL_FILE", "load_trial_state", "output_dir_for",
           "record_hparams"]

logger = logging.getLogger(__name__)

#: The trial's ids, run count and sampled values, in its output directory.
TRIAL_FILE = "determined_trial.json"
_SAMPLE_KEYS = ("hparams", "hparams_seed", "hparams_space")
#: The search's record, in the directory above its trials' (kept by ``toolkit.run``'s search).
SEARCH_FILE = "determined_search.json"
#: Set by ``toolkit.run``'s search to the trial's output directory: its chief waits after each
#: validation report until the runner has read it (the offset of ``metrics.jsonl`` in ``ACK_FILE``).
SEARCH_ACK_ENV = "TOOLKIT_SEARCH_ACK"
ACK_FILE = ".searcher_ack"
#: The trial's ``report_progress``: ``{"progress": 0.42, "time": ...}``.
PROGRESS_FILE = "determined_progress.json"
#: The trial's ``report_early_exit`` / ``det.InvalidHP``: ``{"reason": "INVALID_HP"}`` (the first kept).
EARLY_EXIT_FILE = "determined_early_exit.json"
#: Determined's ``ExitedReason`` names a trial's early exit takes.
EXIT_REASONS = ("INVALID_HP", "USER_REQUESTED_STOP", "ERRORED")
#: ``core_context.searcher``'s operations: ``{"ops": [{"length": L, "searcher_metric": M}, ...], ...}``.
OPS_FILE = "determined_searcher.json"
#: The runner writes how many completed operations of the trial it read (after any stop they earned).
OPS_ACK_FILE = ".searcher_ops_ack"


def output_dir_for(config: Mapping[str, Any]) -> Path:
    """``$TOOLKIT_OUTPUT_DIR``, else ``runs/<experiment name>`` in the working directory. Any rank."""
    name = (
        re.sub(r"[^A-Za-z0-9._-]+", "-", str(config.get("name") or "determined")).strip("-.") or "determined"
    )
    return get_output_dir(Path("runs") / name)


def load_trial_state(output_dir: Path, *, write: bool) -> dict[str, Any]:
    """The trial's ids and run count (and sampled values), from ``determined_trial.json``, else derived
    from the directory the same on every rank; ``write=True`` (chief, or the runner) persists them."""
    path = output_dir / TRIAL_FILE
    try:
        state = load_json(path, what="trial record")
    except FileNotFoundError:
        key = str(output_dir.resolve()).encode()
        state = {
            "experiment_id": zlib.crc32(b"experiment:" + key) % 100_000 + 1,
            "trial_id": zlib.crc32(b"trial:" + key) % 1_000_000 + 1,
            "trial_seed": zlib.crc32(b"seed:" + key),
            "trial_run_id": 1,
        }
        if write:
            output_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, state)
    bad = [f"{k}={v!r:.60}" for k, v in state.items() if k not in _SAMPLE_KEYS and type(v) is not int]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: expected integers; the file records this trial's ids (and any "
                          "sampled hyperparameters): delete it to derive them again", source=str(path))
    return dict(state)


def record_hparams(output_dir: Path, config: Mapping[str, Any], *, seed: int | None = None,
                   values: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Sample the YAML's search spaces once for this output directory into ``determined_trial.json``, as
    Determined's master did for every trial, so that all ranks, restarts and reruns see the same values.
    Runner only. ``values`` (a search's trial) are recorded instead, with the searcher's ``seed``;
    without, ``seed`` defaults to ``reproducibility.experiment_seed``, else a random one. None: no search
    space and no ``values``. ConfigError: the directory holds values of another search space."""
    space = config.get("hyperparameters") or {}
    if values is None and not has_search_space(space):
        return None
    state = load_trial_state(output_dir, write=True)
    if "hparams" in state:
        if state.get("hparams_space") != json.loads(json.dumps(space)):
            raise ConfigError(
                f"{output_dir / TRIAL_FILE} holds hyperparameters sampled from another search space "
                "than the YAML's hyperparameters; use a new --output-dir for a changed search space"
            )
        return dict(state["hparams"])
    given = values is not None
    if values is None:
        if seed is None:
            seed = (config.get("reproducibility") or {}).get("experiment_seed")
        seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
        values = sample_hparams(space, random.Random(seed))
    state.update(hparams=dict(values), hparams_seed=seed, hparams_space=space)
    atomic_write_json(output_dir / TRIAL_FILE, state)
    logger.info("hyperparameters for this trial (%sseed %s): %s", "given by the searcher, " if given else "",
                seed, json.dumps(values))
    return dict(values)
