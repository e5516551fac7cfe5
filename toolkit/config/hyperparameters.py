"""Determined's ``hyperparameters`` section: search spaces checked, sampled and laid on a grid.

The rules are Determined 0.38's master's: ``const``, ``int`` (both ends included), ``double``,
``log`` (``base ** uniform``), ``categorical``, nested groups; a grid takes ``count`` evenly spaced
values of each numeric range. ``python -m toolkit.run`` samples them (every searcher, ``single``
too); a trial reads the values recorded for it (:mod:`toolkit.launch.trial_files`).
:func:`load_config` reads an experiment YAML with its search spaces. Pure apart from that read;
any rank. Example::

    sample_hparams({"lr": {"type": "log", "base": 10, "minval": -4, "maxval": -2}}, random.Random(7))
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_int, is_mapping, is_number
from toolkit.bounded_load import load_yaml
from toolkit.config.experiment import check_experiment_config, load_experiment_config, warn_unknown_keys
from toolkit.config.not_honoured import NOT_HONOURED
from toolkit.errors import ConfigError

__all__ = [
    "SEARCH_TYPES",
    "check_space",
    "grid_points",
    "has_search_space",
    "load_config",
    "sample_hparams",
]

SEARCH_TYPES = ("int", "double", "log", "categorical")
#: Keys toolkit's own experiment check does not know but this layer uses (no "unknown key" warning).
_COMPAT_KEYS = ("data", "reproducibility", "debug")
_HONOURED = {
    "environment": ("environment_variables",),
    "checkpoint_storage": ("type", "host_path", "storage_path", "container_path", "save_trial_latest",
                           "save_trial_best", "bucket", "prefix", "endpoint_url", "access_key", "secret_key"),
}
_COMPAT_SEARCHER_KEYS = (
    "max_trials", "max_concurrent_trials", "time_metric", "max_time", "divisor", "max_rungs", "mode",
    "bracket_rungs", "num_rungs", "stop_once",
)


def _kind(value: Any) -> str:
    """'const', one of SEARCH_TYPES, 'group', or 'value' (a plain constant).

    A mapping whose ``type`` is none of those is a group, as toolkit always read it (Determined
    would refuse it; wrap such a value as ``{type: const, val: {...}}``)."""
    if is_mapping(value) and value.get("type") in ("const", *SEARCH_TYPES):
        return str(value["type"])
    return "group" if is_mapping(value) else "value"


def _walk(hparams: Mapping[str, Any], prefix: str):
    """(dotted key, value) of every typed leaf, groups entered."""
    for name, value in hparams.items():
        key = f"{prefix}.{name}"
        if _kind(value) == "group":
            yield from _walk(value, key)
        else:
            yield key, value


def has_search_space(hparams: Mapping[str, Any]) -> bool:
    """Whether any entry (at any depth) is an int/double/log/categorical range. Pure; any rank."""
    return any(_kind(v) in SEARCH_TYPES for _, v in _walk(hparams, "hyperparameters"))


def _range_problems(key: str, spec: Mapping[str, Any], *, grid: bool) -> list[str]:
    kind = spec["type"]
    if kind == "categorical":
        vals = spec.get("vals")
        return [] if isinstance(vals, list) and vals else [
            f"{key}.vals={vals!r}: expected a non-empty list of values"]
    check = is_int if kind == "int" else is_number
    want = "an integer" if kind == "int" else "a number"
    problems = [f"{key}.{name}={spec.get(name)!r}: expected {want}"
                for name in ("minval", "maxval") if not check(spec.get(name))]
    if not problems and spec["minval"] > spec["maxval"]:
        problems.append(f"{key}: minval={spec['minval']!r} > maxval={spec['maxval']!r}; "
                        "expected minval <= maxval")
    if kind == "log" and not (is_number(spec.get("base")) and spec["base"] > 0):
        problems.append(f"{key}.base={spec.get('base')!r}: expected a number > 0, e.g. 10")
    if "count" in spec or grid:
        if not (is_int(spec.get("count")) and spec["count"] >= 1):
            problems.append(f"{key}.count={spec.get('count')!r}: expected an integer >= 1 "
                            "(grid search needs one for every numeric range)")
    return problems


def check_space(hparams: Any, *, grid: bool = False) -> list[str]:
    """Every problem of a hyperparameter section, each naming its key (empty: fine). Pure; any rank.

    ``grid=True`` also requires ``count`` on every int/double/log range, as Determined's grid does.
    """
    if not is_mapping(hparams):
        return [f"hyperparameters={hparams!r}: expected a mapping of names to values"]
    problems: list[str] = []
    for key, value in _walk(hparams, "hyperparameters"):
        kind = _kind(value)
        if kind == "const":
            if "val" not in value:
                problems.append(f"{key}: type const needs 'val', e.g. {{type: const, val: 0.1}}")
        elif kind in SEARCH_TYPES:
            problems.extend(_range_problems(key, value, grid=grid))
    return problems


def _sample_one(value: Any, rng: random.Random) -> Any:
    kind = _kind(value)
    if kind == "const":
        return copy.deepcopy(value["val"])
    if kind == "int":
        return rng.randint(int(value["minval"]), int(value["maxval"]))
    if kind == "double":
        return rng.uniform(float(value["minval"]), float(value["maxval"]))
    if kind == "log":
        return float(value["base"]) ** rng.uniform(float(value["minval"]), float(value["maxval"]))
    if kind == "categorical":
        return copy.deepcopy(value["vals"][rng.randrange(len(value["vals"]))])
    if kind == "group":
        return {name: _sample_one(sub, rng) for name, sub in sorted(value.items())}
    return copy.deepcopy(value)


def sample_hparams(hparams: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """One trial's values: every range sampled, constants kept, groups nested. Pure given ``rng``; any rank.

    Keys are visited in sorted order (as Determined's ``Each``), so one seed gives one sample.

    Raises:
        ConfigError: the section is malformed (see :func:`check_space`).

    Example:
        >>> sample_hparams({"n": {"type": "int", "minval": 3, "maxval": 3}, "g": {"a": 1}}, random.Random(0))
        {'g': {'a': 1}, 'n': 3}
    """
    problems = check_space(hparams)
    if problems:
        raise ConfigError(problems)
    return {name: _sample_one(value, rng) for name, value in sorted(hparams.items())}


def _axis(value: Any) -> list[Any]:
    """The values one grid axis takes (Determined's getGridAxes for one typed leaf)."""
    kind = _kind(value)
    if kind == "categorical":
        return list(value["vals"])
    if kind not in ("int", "double", "log"):
        return [value["val"] if kind == "const" else value]
    lo, hi = float(value["minval"]), float(value["maxval"])
    count = int(value["count"])
    if kind == "int":
        count = min(count, int(hi - lo) + 1)
    points = [(lo + hi) / 2.0] if count == 1 else [lo + i * (hi - lo) / (count - 1) for i in range(count)]
    if kind == "int":
        return [int(math.copysign(math.floor(abs(p) + 0.5), p)) for p in points]  # Go's math.Round
    return [float(value["base"]) ** p for p in points] if kind == "log" else points


def _leaves(hparams: Mapping[str, Any], route: tuple[str, ...]) -> list[tuple[tuple[str, ...], list[Any]]]:
    out: list[tuple[tuple[str, ...], list[Any]]] = []
    for name, value in sorted(hparams.items()):
        here = (*route, name)
        if _kind(value) == "group":
            out.extend(_leaves(value, here) if value else [(here, [{}])])
        else:
            out.append((here, _axis(value)))
    return out


def grid_points(hparams: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every point of Determined's grid over the section, in its order. Pure; any rank.

    Raises:
        ConfigError: the section is malformed, or a numeric range has no ``count``.

    Example:
        >>> grid_points({"a": {"type": "int", "minval": 1, "maxval": 3, "count": 2},
        ...              "b": {"type": "categorical", "vals": ["x", "y"]}})
        [{'a': 1, 'b': 'x'}, {'a': 1, 'b': 'y'}, {'a': 3, 'b': 'x'}, {'a': 3, 'b': 'y'}]
    """
    problems = check_space(hparams, grid=True)
    if problems:
        raise ConfigError(problems)
    leaves = _leaves(hparams, ())
    points = []
    for combo in itertools.product(*(axis for _, axis in leaves)):
        point: dict[str, Any] = {}
        for (route, _), value in zip(leaves, combo, strict=True):
            node = point
            for part in route[:-1]:
                node = node.setdefault(part, {})
            node[route[-1]] = copy.deepcopy(value)
        points.append(point)
    return points


def _warn_ignored(raw: Mapping[str, Any]) -> list[str]:
    """Warn (ConfigWarning) for each key of ``environment`` and ``checkpoint_storage`` not honoured here
    (the runner's, once per run; the ranks are quiet, see info.py)."""
    messages = []
    for section, honoured in _HONOURED.items():
        values = raw.get(section)
        if section == "checkpoint_storage" and is_mapping(values) and values.get("type") not in (
                None, "shared_fs", "directory", "s3", "gcs"):
            continue  # azure is refused, by its own error
        if is_mapping(values):
            messages += warn_unknown_keys(values, honoured, where=f"{section}.",
                                          not_honoured=NOT_HONOURED[f"{section}."])
    return messages


def load_config(path: str | Path) -> dict[str, Any]:
    """An experiment YAML as Determined reads it: search spaces kept, everything else checked. Any rank.

    Toolkit's own :func:`toolkit.load_experiment_config` refuses search spaces (a plain toolkit
    script runs one value); here they are checked by :func:`check_space` and kept as written, and
    ``{type: const, val: X}`` stays too (resolved by the trial's ``get_cluster_info`` and by
    :func:`sample_hparams`).

    Raises:
        FileNotFoundError: no such file.
        ConfigError: malformed YAML or any problem, each naming its key.
    """
    if not Path(path).is_file():
        return load_experiment_config(path)  # its message (the absolute path looked at)
    raw = load_yaml(path, what="experiment config")
    if not is_mapping(raw) or not is_mapping(raw.get("hyperparameters") or {}):
        return load_experiment_config(path)
    masked = {k: v for k, v in raw.items() if k not in _COMPAT_KEYS}
    hparams = raw.get("hyperparameters") or {}
    masked["hyperparameters"] = {k: (0 if _kind(v) in SEARCH_TYPES else v) for k, v in hparams.items()}
    if is_mapping(raw.get("searcher")):
        masked["searcher"] = {k: v for k, v in raw["searcher"].items() if k not in _COMPAT_SEARCHER_KEYS}
    _warn_ignored(raw)
    problems: list[str] = []
    try:
        check_experiment_config(masked, source=str(path))
    except ConfigError as err:
        problems.extend(err.problems)
    problems.extend(check_space(hparams))
    if problems:
        raise ConfigError(problems, source=str(path))
    return copy.deepcopy(dict(raw))
