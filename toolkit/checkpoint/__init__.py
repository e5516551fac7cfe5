"""Crash-safe DeepSpeed checkpoints with an exact resume.

Saving and loading are collectives: call on all ranks; consolidating into one fp32
``state_dict`` is rank 0 only. How a save commits and what a load checks: docs/training.md;
what an exact resume needs: docs/exact-resume.md.

Example::

    # torchrun --nproc_per_node 2 train.py
    save_checkpoint(engine, "ckpt", steps_completed=step)     # call on all ranks
    resumed = load_checkpoint(engine, "ckpt")                  # call on all ranks
"""

from toolkit.checkpoint import remote  # noqa: F401 - imported with toolkit: its logger gets the rank filter
from toolkit.checkpoint.api import load_checkpoint, save_checkpoint
from toolkit.checkpoint.consolidate import consolidate_checkpoint
from toolkit.checkpoint.cpu_adam import replay_cpu_adam_state

__all__ = ["consolidate_checkpoint", "load_checkpoint", "replay_cpu_adam_state", "save_checkpoint"]
