"""``determined.pytorch.deepspeed``: only ``overwrite_deepspeed_config`` (no Trial API: port such
trials to a Core API script, docs/determined.md#trial-api-and-horovod-experiments). Example::

    from toolkit.compat.determined.pytorch.deepspeed import overwrite_deepspeed_config
    ds_config = overwrite_deepspeed_config("ds_config.json", hparams.get("overwrite_deepspeed_args", {}))
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from toolkit._checks import is_mapping, type_name
from toolkit.compat.determined.errors import DeepSpeedConfigTypeError
from toolkit.config.deepspeed import overwrite_deepspeed_config as _overwrite

__all__ = ["overwrite_deepspeed_config"]


def overwrite_deepspeed_config(base_ds_config: str | os.PathLike[str] | Mapping[str, Any],
                               source_ds_dict: Mapping[str, Any] | None) -> dict[str, Any]:
    """``source_ds_dict`` merged recursively into a DeepSpeed config (a JSON path or a dict), the source
    winning. Any rank. As Determined's, a JSON with a duplicate key is refused; unlike it, a new dict
    (neither input changed), and ``source_ds_dict=None`` overwrites nothing.

    Raises:
        DeepSpeedConfigTypeError: the base is neither a path nor a mapping (also a ``TypeError``).
        ConfigError: the source is not a mapping, or the JSON is malformed. FileNotFoundError.
    """
    if not isinstance(base_ds_config, (str, os.PathLike)) and not is_mapping(base_ds_config):
        raise DeepSpeedConfigTypeError(
            f"base_ds_config={base_ds_config!r:.80}: expected a path to a DeepSpeed JSON file or a dict, "
            f"got {type_name(base_ds_config)}")
    return _overwrite(base_ds_config, source_ds_dict)
