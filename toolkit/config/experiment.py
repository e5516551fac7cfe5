"""Experiment configs (the Determined-compatible ``deepspeed.yaml``) and hyperparameters: load, check,
warn about unknown keys. Pure apart from reading the named files and environment variables; any
rank (every rank reads the same files). The YAML's keys: docs/configs.md.
"""

from __future__ import annotations

import copy
import difflib
import os
import shlex
import warnings
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import int_problem, is_mapping, type_name
from toolkit.bounded_load import load_json, load_yaml
from toolkit.config.max_length import max_length_steps, max_length_unit
from toolkit.config.not_honoured import NOT_HONOURED
from toolkit.errors import ConfigError
from toolkit.runtime.trial_env import EXPERIMENT_CONFIG_ENV, OUTPUT_DIR_ENV, TRIAL_HPARAMS_ENV

__all__ = [
    "ConfigWarning",
    "TRIAL_HPARAMS_ENV",
    "EXPERIMENT_CONFIG_ENV",
    "OUTPUT_DIR_ENV",
    "get_output_dir",
    "load_experiment_config",
    "get_hparams",
    "max_length_steps",
    "max_length_unit",
    "entrypoint_argv",
    "check_experiment_config",
    "warn_unknown_keys",
]

_TOP_LEVEL = ("name", "description", "entrypoint", "resources", "hyperparameters", "searcher",
              "checkpoint_storage", "max_restarts", "labels", "environment", "records_per_epoch")
_RESOURCES = ("slots_per_trial",)
_SEARCHER = ("name", "metric", "smaller_is_better", "max_length")


class ConfigWarning(UserWarning):
    """An unknown or not-honoured config key, with the closest known key; on the rank that read it.
    ``warnings.simplefilter("error", toolkit.ConfigWarning)`` makes them fatal (e.g. in CI)."""


def warn_unknown_keys(mapping: Mapping[str, Any], known: tuple[str, ...] | frozenset[str], *,
                      where: str, not_honoured: Mapping[str, str] | None = None) -> list[str]:
    """Warn once per unknown key, suggesting the closest known one; returns the messages. Any rank.

    ``where`` prefixes the key in the message (``"resources."``); ``not_honoured`` maps Determined's
    cluster-only keys to why they are not honoured here, which their warning says instead."""
    messages = []
    for key in mapping:
        if key in known:
            continue
        if not_honoured and key in not_honoured:
            message = f"{where}{key} is not honoured here: {not_honoured[key]}"
            warnings.warn(message, ConfigWarning, stacklevel=3)
            messages.append(message)
            continue
        close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        message = f"unknown key {where}{key!r} is ignored{hint}"
        warnings.warn(message, ConfigWarning, stacklevel=3)
        messages.append(message)
    return messages



def check_experiment_config(config: Any, *, source: str = "") -> None:
    """Check a parsed experiment config (a YAML's, or one built in code): one ConfigError lists every
    problem, each naming its key; unknown keys only warn. ``source``: the path, for the message.
    Pure; any rank."""
    if not is_mapping(config):
        raise ConfigError(f"the file must hold a mapping of keys (name, entrypoint, ...), "
                          f"got {type_name(config)}: {config!r:.80}", source=source or None)
    warn_unknown_keys(config, _TOP_LEVEL, where="", not_honoured=NOT_HONOURED[""])
    problems = [*_text_problems(config), *_entrypoint_problems(config), *_resources_problems(config),
                *_hparams_problems(config), *_searcher_problems(config), *_storage_problems(config)]
    if problems:
        raise ConfigError(problems, source=source or None)


def _text_problems(config: Mapping[str, Any]) -> list[str]:
    """``name`` and ``description`` are strings."""
    return [f"{key}={config[key]!r}: expected a string, got {type_name(config[key])}"
            for key in ("name", "description") if key in config and not isinstance(config[key], str)]


def _entrypoint_problems(config: Mapping[str, Any]) -> list[str]:
    """``entrypoint`` is a non-empty command string or a non-empty list of non-empty strings."""
    if "entrypoint" not in config:
        return []
    ep = config["entrypoint"]
    if isinstance(ep, str):
        if not ep.strip():
            return ["entrypoint='': expected a command such as 'python3 train.py'"]
        try:
            shlex.split(ep)
        except ValueError as err:  # an unbalanced quote, or a backslash at the end
            return [f"entrypoint={ep!r:.200}: cannot be split into arguments ({err}); balance the quotes, "
                    "or write the entrypoint as a list of arguments"]
        return []
    if isinstance(ep, list):
        if ep and all(isinstance(part, str) and part for part in ep):
            return []
        return [f"entrypoint={ep!r}: expected a non-empty list of non-empty strings"]
    return [f"entrypoint={ep!r}: expected a string or a list of strings, got {type_name(ep)}"]


def _section(config: Mapping[str, Any], key: str, expected: str, known: tuple[str, ...] | None = None, *,
             width: int | None = None) -> tuple[Mapping[str, Any] | None, list[str]]:
    """The mapping at ``config[key]`` (None when absent or not a mapping) and the problem if it is not
    one; its unknown keys are warned about when ``known`` is given. Pure but for the warning."""
    section = config.get(key)
    if section is None:
        return None, []
    if not is_mapping(section):
        shown = repr(section) if width is None else f"{section!r:.{width}}"
        return None, [f"{key}={shown}: expected {expected}"]
    if known is not None:
        warn_unknown_keys(section, known, where=f"{key}.", not_honoured=NOT_HONOURED.get(f"{key}."))
    return section, []


def _resources_problems(config: Mapping[str, Any]) -> list[str]:
    """``resources`` is a mapping; ``slots_per_trial`` an integer >= 1."""
    resources, problems = _section(config, "resources", "a mapping such as {slots_per_trial: 2}", _RESOURCES)
    if resources is None or "slots_per_trial" not in resources:
        return problems
    problem = int_problem("resources.slots_per_trial", resources["slots_per_trial"], minimum=1)
    return [problem] if problem else []


def _hparams_problems(config: Mapping[str, Any]) -> list[str]:
    """``hyperparameters`` is a mapping of plain values (Determined's search types are refused)."""
    hparams, problems = _section(config, "hyperparameters", "a mapping of names to values", width=80)
    if hparams is None:
        return problems
    return [f"hyperparameters.{name} has type {value['type']!r}: toolkit runs single trials and does not "
            "search hyperparameters; give a plain value (or {type: const, val: ...})"
            for name, value in hparams.items()
            if is_mapping(value) and "type" in value and set(value) - {"type", "val"}
            and value.get("type") in ("int", "double", "log", "categorical")]


def _searcher_problems(config: Mapping[str, Any]) -> list[str]:
    """``searcher`` is a mapping; ``metric`` a name, ``smaller_is_better`` a bool, ``max_length`` steps."""
    searcher, problems = _section(config, "searcher", "a mapping with metric, smaller_is_better, max_length",
                                  _SEARCHER)
    if searcher is None:
        return problems
    if "metric" in searcher and (not isinstance(searcher["metric"], str) or not searcher["metric"]):
        problems.append(f"searcher.metric={searcher['metric']!r}: expected a metric name")
    if "smaller_is_better" in searcher and not isinstance(searcher["smaller_is_better"], bool):
        problems.append(f"searcher.smaller_is_better={searcher['smaller_is_better']!r}: "
                        "expected true or false")
    if "max_length" in searcher or "records_per_epoch" in config:
        try:
            max_length_unit(config)  # the form only: the batch size may be a search space
        except ConfigError as err:
            problems.extend(err.problems)
    return problems


def _storage_problems(config: Mapping[str, Any]) -> list[str]:
    """``checkpoint_storage`` is a mapping of directory paths and ``save_trial_latest`` >= 0."""
    storage, problems = _section(config, "checkpoint_storage",
                                 "a mapping such as {storage_path: checkpoints}")
    if storage is None:
        return problems
    problems = [f"checkpoint_storage.{key}={storage[key]!r}: expected a directory path"
                for key in ("storage_path", "host_path")
                if key in storage and (not isinstance(storage[key], str) or not storage[key])]
    if storage.get("type") in ("s3", "gcs"):  # bucket, prefix, keys: never quoting a key's value
        from toolkit.checkpoint.store import bucket_section_problems

        problems.extend(bucket_section_problems(storage))
    if "save_trial_latest" in storage:
        problem = int_problem("checkpoint_storage.save_trial_latest", storage["save_trial_latest"], minimum=0)
        if problem:
            problems.append(problem)
    return problems


def _unwrap_const(hparams: dict[str, Any]) -> dict[str, Any]:
    """Determined's ``{type: const, val: X}`` hyperparameters become plain ``X``."""
    out = {}
    for name, value in hparams.items():
        if is_mapping(value) and value.get("type") == "const" and set(value) == {"type", "val"}:
            value = value["val"]
        out[name] = copy.deepcopy(value)
    return out


def load_experiment_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check an experiment YAML (:func:`toolkit.bounded_load.load_yaml`, SafeLoader). Any rank.

    Returns a new dict, ``{type: const, val: X}`` hyperparameters unwrapped to ``X``. A missing file
    is FileNotFoundError (absolute path); malformed YAML, a broken bound or wrong values one ConfigError."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"experiment config {str(path)!r} not found (looked at {file.resolve()})")
    config = load_yaml(file, what="experiment config")
    if config is None:
        config = {}
    check_experiment_config(config, source=str(path))
    config = copy.deepcopy(config)
    if is_mapping(config.get("hyperparameters")):
        config["hyperparameters"] = _unwrap_const(config["hyperparameters"])
    return config


def entrypoint_argv(config: Mapping[str, Any]) -> list[str]:
    """The experiment's ``entrypoint`` as an argv list, split like a POSIX shell (never run by one).
    Pure; any rank. ConfigError when it is missing, empty, or neither a string nor a list of strings."""
    ep = config.get("entrypoint")
    if ep is None:
        raise ConfigError("entrypoint is missing: expected e.g. 'entrypoint: python3 train.py'")
    problems = _entrypoint_problems(config)
    if problems:
        raise ConfigError(problems)
    return list(ep) if isinstance(ep, list) else shlex.split(ep)


def get_hparams(config_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """This run's hyperparameters. Any rank (every rank reads the same file).

    Order of precedence:

    1. inside a dsat trial, the trial's hyperparameters: the JSON file named by
       ``TOOLKIT_TRIAL_HPARAMS`` (:data:`TRIAL_HPARAMS_ENV`);
    2. the ``hyperparameters`` of ``config_path``;
    3. the ``hyperparameters`` of the YAML named by ``TOOLKIT_EXPERIMENT_CONFIG``;
    4. none of these (a plain ``torchrun train.py``): ``{}``, so ``hparams.get("lr", 1e-3)``
       keeps the script's own defaults with no guard.

    Returns:
        A new dict (empty when the config has no hyperparameters, or there is no config).

    Raises:
        ConfigError: the file is malformed (or the trial's file is missing).
        FileNotFoundError: ``config_path`` (or the variable's YAML) does not exist.

    Example::

        # torchrun --nproc_per_node 2 train.py   (or as a dsat trial: no change needed)
        hparams = toolkit.get_hparams(Path(__file__).with_name("deepspeed.yaml"))
    """
    trial_file = os.environ.get(TRIAL_HPARAMS_ENV)
    if trial_file:
        try:
            hparams = load_json(trial_file, what="trial's hyperparameters file")
        except FileNotFoundError:
            raise ConfigError(f"{TRIAL_HPARAMS_ENV}={trial_file!r}: file not found; it is set by the dsat "
                              "trial runner, unset it to run outside a trial") from None
        except ConfigError as err:
            raise ConfigError(err.problems, source=f"{TRIAL_HPARAMS_ENV}={trial_file!r}") from None
        return hparams
    if config_path is None:
        config_path = os.environ.get(EXPERIMENT_CONFIG_ENV) or None
    if config_path is None:
        return {}  # a plain run of the script: its own defaults apply
    config = load_experiment_config(config_path)
    return config.get("hyperparameters") or {}


def get_output_dir(default: str | os.PathLike[str]) -> Path:
    """Where this run writes: ``$TOOLKIT_OUTPUT_DIR`` when set (dsat trials), else ``default``. Any rank."""
    env = os.environ.get(OUTPUT_DIR_ENV)
    return Path(env) if env else Path(default)
