"""DeepSpeed configs: load and merge, and the one-call path from hyperparameters to a checked config.

DeepSpeed configs stay plain dicts and are never mutated: every function here returns a new dict.
:func:`build_ds_config` is :func:`get_ds_config_from_hparams`, then :func:`resolve_ds_config`,
then :func:`validate_ds_config`; this module re-exports those and the key names, so
``toolkit.config.deepspeed`` keeps its public names. Pure (reading a JSON file aside), any rank;
a wrong config of any kind is a :class:`~toolkit.errors.ConfigError`, a missing JSON file a
``FileNotFoundError`` naming the path looked at.

Example::

    # torchrun --nproc_per_node 2 train.py      (any rank: the same result on every rank)
    ctx = toolkit.init_distributed()
    hparams = toolkit.get_hparams("deepspeed.yaml")
    ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size,
                                        base_dir=Path(__file__).parent, device=ctx.device)
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
    """Load a DeepSpeed JSON config, bounded (:mod:`toolkit.bounded_load`). Any rank (reads the file).

    Duplicate keys, numbers that are not finite (``NaN``, ``Infinity``, ``1e999``), nesting
    deeper than ``MAX_DEPTH``, a file over ``MAX_CONFIG_BYTES`` and non-UTF-8 text are refused.

    Raises:
        FileNotFoundError: naming the absolute path looked at.
        ConfigError: malformed JSON (line and column), any of the above, or a non-object.

    Example::

        ds_config = load_json_strict(Path(__file__).with_name("ds_config.json"))
        # '{"zero_optimization": {"stage": 1, "stage": 3}}' -> ConfigError: duplicate key 'stage'
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
    """Merge ``source_ds_dict`` into a DeepSpeed config, recursively; the source wins. Any rank.

    Nested mappings are merged key by key, anything else (numbers, lists) is replaced, and keys
    only in the source are added. Neither input is modified.

    Args:
        base_ds_config: a path to a JSON file (duplicate keys rejected) or a mapping.
        source_ds_dict: the values that win, e.g. ``hparams["overwrite_deepspeed_args"]``;
            ``None`` means nothing to overwrite.

    Returns:
        A new dict.

    Raises:
        ConfigError: ``base_ds_config`` is neither a path nor a mapping, the source is not a
            mapping, or the JSON file is malformed (both kinds listed when both are wrong).
        FileNotFoundError: the JSON file is missing.

    Example:
        >>> overwrite_deepspeed_config({"optimizer": {"params": {"lr": 1e-3, "eps": 1e-8}}},
        ...                            {"optimizer": {"params": {"lr": 5e-3}}})
        {'optimizer': {'params': {'lr': 0.005, 'eps': 1e-08}}}
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
    """The DeepSpeed config named or written in the hyperparameters. Any rank.

    Two forms, as in Determined:

    * ``deepspeed_config: ds_config.json`` (relative to ``base_dir``, not to the working
      directory unless ``base_dir`` is ``"."``), plus optional ``overwrite_deepspeed_args``
      merged on top;
    * no ``deepspeed_config``: the DeepSpeed keys written inline in the hyperparameters
      (``train_batch_size``, ``zero_optimization``, ...), plus ``overwrite_deepspeed_args``.

    Args:
        hparams: from :func:`toolkit.get_hparams`.
        base_dir: the directory relative paths are resolved against; scripts pass their own
            directory, ``Path(__file__).parent``, so they work from any working directory.

    Returns:
        A new dict; not yet resolved (see :func:`resolve_ds_config`).

    Raises:
        ConfigError: ``hparams`` is not a mapping, ``deepspeed_config`` or
            ``overwrite_deepspeed_args`` has the wrong type, or neither form is present (the
            message lists the keys that were found).
        FileNotFoundError: the JSON file is missing (the message gives the path looked at).

    Example:
        >>> get_ds_config_from_hparams({"train_micro_batch_size_per_gpu": 4, "lr": 0.1,
        ...                             "overwrite_deepspeed_args": {"zero_optimization": {"stage": 1}}})
        {'train_micro_batch_size_per_gpu': 4, 'zero_optimization': {'stage': 1}}
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
    """Hyperparameters to a complete, checked DeepSpeed config, in one call. Any rank.

    :func:`get_ds_config_from_hparams`, then :func:`resolve_ds_config` (with the hparams'
    ``global_batch_size`` / ``data_parallel_world_size`` checked), then
    :func:`validate_ds_config`.

    Example::

        # torchrun --nproc_per_node 2 train.py
        ds_config = toolkit.build_ds_config(hparams, data_parallel_size=ctx.world_size,
                                            base_dir=Path(__file__).parent, device=ctx.device)
    """
    raw = get_ds_config_from_hparams(hparams, base_dir)
    resolved = resolve_ds_config(raw, data_parallel_size=data_parallel_size, hidden_size=hidden_size,
                                 hparams=hparams)
    validate_ds_config(resolved, pipeline=pipeline, device=device, data_parallel_size=data_parallel_size)
    return resolved
