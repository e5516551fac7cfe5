"""Run Determined AI Core API scripts on toolkit, with only their import lines changed. Any rank.

::

    from toolkit.compat import determined as det          # was: import determined as det
    python -m toolkit.run deepspeed.yaml .                # was: det experiment create deepspeed.yaml .

What each call does here: docs/determined.md#what-each-call-does-here; inside:
docs/design-determined.md#the-core-api-on-toolkit. No dependency on the ``determined`` package.
"""

import os

from toolkit.compat.determined import core, errors
from toolkit.compat.determined.core.context import InvalidHP
from toolkit.compat.determined.info import (
    ClusterInfo,
    RendezvousInfo,
    ResourcesInfo,
    TrialInfo,
    get_cluster_info,
)
from toolkit.runtime.op_builds import install_build_guards
from toolkit.runtime.trial_env import BUILD_GUARDS_ENV

if os.environ.get(BUILD_GUARDS_ENV) == "1":   # started by toolkit.run: before deepspeed.init_distributed
    install_build_guards()

#: Determined's log format, for ``logging.basicConfig(format=det.LOG_FORMAT)``.
LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"
#: The Determined release whose Core API this layer follows.
__version__ = "0.38.1"

__all__ = [
    "LOG_FORMAT",
    "ClusterInfo",
    "InvalidHP",
    "RendezvousInfo",
    "ResourcesInfo",
    "TrialInfo",
    "core",
    "errors",
    "get_cluster_info",
]
