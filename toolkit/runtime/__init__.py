"""Where a rank sits and how ranks talk: the launcher's environment (``launch_env``), the
process group and toolkit's collectives (``context``), their bounded wait (``collectives``),
DataLoader workers that survive a preemption signal (``worker_signals``), rank-aware logging
(``rank_logging``), DeepSpeed's CPU shared-memory segments (``ds_shm``) and its JIT-built ops
(``op_builds``: importing toolkit installs the guard that never waits silently on their build lock).

Example::

    # torchrun --nproc_per_node 2 train.py
    from toolkit.runtime import init_distributed
    ctx = init_distributed()            # call on all ranks
    if ctx.is_chief:                    # rank 0 only below
        print(ctx.world_size)
"""

from toolkit.runtime.collectives import COLLECTIVE_TIMEOUT_ENV, CollectiveTimeoutError
from toolkit.runtime.context import DistributedContext, get_context, init_distributed
from toolkit.runtime.launch_env import LaunchInfo, detect_launch
from toolkit.runtime.op_builds import install_lock_guard

# Every toolkit process (user scripts, dsat trials, toolkit.run) loads DeepSpeed ops through the guard.
install_lock_guard()

__all__ = ["COLLECTIVE_TIMEOUT_ENV", "CollectiveTimeoutError", "DistributedContext", "LaunchInfo",
           "detect_launch", "get_context", "init_distributed"]
