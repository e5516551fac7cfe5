"""Where a rank sits and how ranks talk: the launcher's environment, the process group, and
toolkit's bounded collectives, plus what keeps a job healthy around them (DataLoader workers that
survive a preemption signal, rank-aware logging, DeepSpeed's shared-memory segments and build
locks). :func:`init_distributed` is called on all ranks; see docs/start.md (Launch it).

Example::

    # torchrun --nproc_per_node 2 train.py
    from toolkit.runtime import init_distributed
    ctx = init_distributed()            # call on all ranks
    if ctx.is_chief:                    # rank 0 only below
        logger.info("world size %d", ctx.world_size)
"""

from toolkit.runtime.collectives import COLLECTIVE_TIMEOUT_ENV, CollectiveTimeoutError
from toolkit.runtime.context import DistributedContext, get_context, init_distributed
from toolkit.runtime.launch_env import LaunchInfo, detect_launch
from toolkit.runtime.op_builds import install_build_guards

__all__ = ["COLLECTIVE_TIMEOUT_ENV", "CollectiveTimeoutError", "DistributedContext", "LaunchInfo",
           "detect_launch", "get_context", "init_distributed", "install_build_guards"]
