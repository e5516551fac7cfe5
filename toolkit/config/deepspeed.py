"""DeepSpeed configs: load and merge, and :func:`build_ds_config` from hyperparameters to a checked config.

Re-exports :func:`resolve_ds_config`, :func:`validate_ds_config` and the key names, so
``toolkit.config.deepspeed`` keeps its public names. Pure (reading a JSON file aside); any rank.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_mapping, type_name
from toolkit.bounded_load import load_json
from toolkit.config.ds_schema import (
    BATCH_KEYS,
    DS_CONFIG_EXPECTED,
    DS_TOP_LEVEL_KEYS,
    mapping_problem,
    plain_copy,
    require_mapping,
    zero_stage,
)
from toolkit.config.resolve import resolve_ds_config
from toolkit.config.validate import validate_ds_config
from toolkit.errors import ConfigError

__all__ = [
    "BATCH_KEYS",
    "DS_TOP_LEVEL_KEYS",
    "load_json_strict",
    "overwrite_deepspeed_config",
    "get_ds_config_from_hparams",
    "resolve_ds_config",
    "validate_ds_config",
    "build_ds_config",
    "zero_stage",
]


def load_json_strict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed JSON config, read by :mod:`toolkit.bounded_load`. Any rank.

    Duplicate keys, non-finite numbers, deep nesting, an oversize or non-UTF-8 file and a non-object
    are a ConfigError; a missing file is FileNotFoundError naming the absolute path looked at.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"DeepSpeed config {str(path)!r} not found (looked at {file.resolve()})")
    data: dict[str, Any] = load_json(file, what="DeepSpeed config")
    return data


def _merge_into(base: dict[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    """``source`` merged into ``base`` (a fresh plain dict, changed in place and returned)."""
    for key, value in source.items():
        if is_mapping(value) and isinstance(base.get(key), dict):
            base[key] = _merge_into(base[key], value)
        else:
            base[key] = plain_copy(value) if is_mapping(value) else copy.deepcopy(value)
    return base


def overwrite_deepspeed_config(base_ds_config: str | os.PathLike[str] | Mapping[str, Any],
                               source_ds_dict: Mapping[str, Any] | None) -> dict[str, Any]:
    """``source_ds_dict`` merged into a DeepSpeed config, recursively; the source wins. Any rank.

    ``base_ds_config`` is a JSON file's path or a mapping; ``source_ds_dict`` (e.g.
    ``hparams["overwrite_deepspeed_args"]``) may be None. Nested mappings merge key by key, anything
    else is replaced. Returns a new dict; bad types of both arguments are one ConfigError.

    >>> overwrite_deepspeed_config({"optimizer": {"lr": 1e-3, "eps": 1e-8}}, {"optimizer": {"lr": 5e-3}})
    {'optimizer': {'lr': 0.005, 'eps': 1e-08}}
    """
    problems = []
    is_path = isinstance(base_ds_config, (str, os.PathLike))
    if not is_path and not is_mapping(base_ds_config):
        problems.append(f"base_ds_config={base_ds_config!r:.80}: expected a path to a JSON file or "
                        f"{DS_CONFIG_EXPECTED}, got {type_name(base_ds_config)}")
    source_problem = None if source_ds_dict is None else \
        mapping_problem(source_ds_dict, "source_ds_dict", DS_CONFIG_EXPECTED)
    if problems or source_problem:
        raise ConfigError([*problems, *([source_problem] if source_problem else [])])
    if isinstance(base_ds_config, (str, os.PathLike)):
        base = load_json_strict(base_ds_config)
    else:
        base = plain_copy(base_ds_config)
    return base if source_ds_dict is None else _merge_into(base, source_ds_dict)


def get_ds_config_from_hparams(hparams: Mapping[str, Any], base_dir: str | os.PathLike[str] = ".",
                               ) -> dict[str, Any]:
    """The DeepSpeed config the hyperparameters name or hold, as in Determined. Any rank.

    Either ``deepspeed_config: ds_config.json`` (relative to ``base_dir``; scripts pass
    ``Path(__file__).parent``) or DeepSpeed keys written inline; ``overwrite_deepspeed_args`` is
    merged on top of either. Returns a new, unresolved dict (see :func:`resolve_ds_config`).
    ConfigError for wrong types or neither form (naming the keys found); FileNotFoundError for a
    missing JSON file.
    """
    require_mapping(hparams, "hparams", "a dict of hyperparameters")
    overwrite = hparams.get("overwrite_deepspeed_args")
    if overwrite is not None and not is_mapping(overwrite):
        raise ConfigError(f"hyperparameters.overwrite_deepspeed_args={overwrite!r:.80}: expected a mapping "
                          "of DeepSpeed keys to values")
    if "deepspeed_config" in hparams:
        name = hparams["deepspeed_config"]
        if is_mapping(name):
            base: Any = name
        elif isinstance(name, (str, os.PathLike)) and str(name):
            path = Path(name)
            base = path if path.is_absolute() else Path(base_dir) / path
        else:
            raise ConfigError(f"hyperparameters.deepspeed_config={name!r}: expected a path to a JSON file "
                              "such as 'ds_config.json'")
        return overwrite_deepspeed_config(base, overwrite)
    inline = {k: v for k, v in hparams.items() if k in DS_TOP_LEVEL_KEYS}
    if not inline and not overwrite:
        found = ", ".join(sorted(map(str, hparams))) or "none"
        raise ConfigError("hyperparameters have no 'deepspeed_config' key and no DeepSpeed keys written "
                          f"inline (found: {found}); add 'deepspeed_config: ds_config.json' or the "
                          "DeepSpeed keys themselves")
    return overwrite_deepspeed_config(inline, overwrite)


def build_ds_config(hparams: Mapping[str, Any], *, data_parallel_size: int,
                    base_dir: str | os.PathLike[str] = ".", pipeline: bool = False,
                    device: Any = None, hidden_size: int | None = None) -> dict[str, Any]:
    """Hyperparameters to a complete, checked DeepSpeed config in one call. Any rank (same result on each).

    :func:`get_ds_config_from_hparams`, :func:`resolve_ds_config` (checking the hparams'
    ``global_batch_size`` / ``data_parallel_world_size``), then :func:`validate_ds_config`::

        # torchrun --nproc_per_node 2 train.py
        ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size,
                                            base_dir=Path(__file__).parent, device=ctx.device)
    """
    raw = get_ds_config_from_hparams(hparams, base_dir)
    resolved = resolve_ds_config(raw, data_parallel_size=data_parallel_size, hidden_size=hidden_size,
                                 hparams=hparams)
    validate_ds_config(resolved, pipeline=pipeline, device=device, data_parallel_size=data_parallel_size)
    return resolved
