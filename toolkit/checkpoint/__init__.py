"""Crash-safe DeepSpeed checkpoints with an exact resume: save and load on all ranks, consolidate on
rank 0 only. How a save commits and what a load checks: docs/training.md (Checkpoints)."""

from toolkit.checkpoint import remote  # noqa: F401 - imported with toolkit: its logger gets the rank filter
from toolkit.checkpoint.api import load_checkpoint, save_checkpoint
from toolkit.checkpoint.consolidate import consolidate_checkpoint
from toolkit.checkpoint.cpu_adam import replay_cpu_adam_state

__all__ = ["consolidate_checkpoint", "load_checkpoint", "replay_cpu_adam_state", "save_checkpoint"]
