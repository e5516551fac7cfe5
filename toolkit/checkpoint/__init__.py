"""Crash-safe DeepSpeed checkpoints with an exact resume.

``api`` saves, loads and consolidates (call on all ranks); ``layout`` is the pure commit protocol
(which directory is the latest, what a save may delete); ``rng`` captures and restores every
rank's random streams; ``cpu_adam`` rebuilds the state DeepSpeed's CPU Adam keeps outside the
checkpoint.

Example::

    # torchrun --nproc_per_node 2 train.py
    save_checkpoint(engine, "ckpt", steps_completed=step)     # call on all ranks
    meta = load_checkpoint(engine, "ckpt")                     # call on all ranks
"""

from toolkit.checkpoint.api import consolidate_checkpoint, load_checkpoint, save_checkpoint
from toolkit.checkpoint.cpu_adam import replay_cpu_adam_state

__all__ = ["consolidate_checkpoint", "load_checkpoint", "replay_cpu_adam_state", "save_checkpoint"]
