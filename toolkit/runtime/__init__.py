"""Where a rank sits and how ranks talk: the launcher's environment, the process group, toolkit's
bounded collectives, and what keeps a job healthy around them (DataLoader workers, rank-aware
logging, DeepSpeed's shared-memory segments and op builds). Start with :func:`init_distributed`."""

from toolkit.runtime.collectives import COLLECTIVE_TIMEOUT_ENV, CollectiveTimeoutError
from toolkit.runtime.context import DistributedContext, get_context, init_distributed
from toolkit.runtime.launch_env import LaunchInfo, detect_launch
from toolkit.runtime.op_builds import install_build_guards

__all__ = ["COLLECTIVE_TIMEOUT_ENV", "CollectiveTimeoutError", "DistributedContext", "LaunchInfo",
           "detect_launch", "get_context", "init_distributed", "install_build_guards"]
