"""Crash-safe DeepSpeed checkpoints with an exact resume.

``api`` saves and loads (call on all ranks); ``consolidate`` writes one fp32 ``state_dict``
(rank 0 only); ``layout`` is the pure commit protocol (which directory is the latest, what a save
may delete); ``ranks`` makes every rank fail together; ``engine`` checks the engine and records
its layout; ``universal`` finds a ``ds_to_universal`` checkpoint; ``rng`` captures and restores
every rank's random streams; ``cpu_adam`` rebuilds the state DeepSpeed's CPU Adam keeps outside
the checkpoint.

Example::

    # torchrun --nproc_per_node 2 train.py
    save_checkpoint(engine, "ckpt", steps_completed=step)     # call on all ranks
    meta = load_checkpoint(engine, "ckpt")                     # call on all ranks
"""

from toolkit.checkpoint.api import load_checkpoint, save_checkpoint
from toolkit.checkpoint.consolidate import consolidate_checkpoint
from toolkit.checkpoint.cpu_adam import replay_cpu_adam_state

__all__ = ["consolidate_checkpoint", "load_checkpoint", "replay_cpu_adam_state", "save_checkpoint"]
