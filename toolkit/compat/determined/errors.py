"""``det.errors``: the exceptions Determined's Core API raises that scripts catch."""

from __future__ import annotations

from toolkit.errors import ConfigError

__all__ = ["CheckpointNotFound", "DeepSpeedConfigTypeError"]


class CheckpointNotFound(Exception):
    """``restore_path`` / ``download`` / ``get_metadata`` of a storage id that is not a committed
    checkpoint of the storage (Determined's ``det.errors.CheckpointNotFound``)."""


class DeepSpeedConfigTypeError(ConfigError, TypeError):
    """A DeepSpeed config of the wrong type given to ``overwrite_deepspeed_config``: a
    :class:`toolkit.errors.ConfigError` that is also the ``TypeError`` Determined raised, so that
    a script's ``except TypeError`` still catches it."""
