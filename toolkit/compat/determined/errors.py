"""``det.errors``: the exceptions Determined's Core API raises that scripts catch."""

from __future__ import annotations

__all__ = ["CheckpointNotFound"]


class CheckpointNotFound(Exception):
    """``restore_path`` / ``download`` / ``get_metadata`` of a storage id that is not a committed
    checkpoint of the storage (Determined's ``det.errors.CheckpointNotFound``)."""
