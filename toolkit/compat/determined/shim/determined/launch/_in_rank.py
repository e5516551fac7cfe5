"""``python3 -m determined.launch.torch_distributed|deepspeed CMD...`` run by a rank of ``toolkit.run``.

When the wrapper is the entrypoint's first command, ``python -m toolkit.run`` unwraps it and starts
one process per slot itself (:mod:`toolkit.launch.wrappers`). When a script started by the
entrypoint calls it (``entrypoint: bash launch.sh``), toolkit.run has already started that script
once per slot, under torchrun: each such process is a Determined container of one slot, whose
wrapper would start one worker. So the wrapper here becomes that worker: it replaces itself
(``exec``) with the command, in the rank's environment, marked as a wrapped worker (the script
that called it is then spared the preemption signal, as Determined never signals its launcher)
and no longer as a container of its own (:func:`toolkit.compat.determined.get_cluster_info` then
sees the ranks of one container, as behind the first-command wrapper).

Any process (one rank). Started any other way (no ``LOCAL_RANK``), it says to run the experiment
through ``python -m toolkit.run`` and exits 2.
"""

from __future__ import annotations

import os
import sys

from toolkit.errors import ConfigError
from toolkit.launch.wrappers import (
    CONTAINER_PER_RANK_ENV,
    WRAPPED_ENV,
    torchrun_nproc_override,
    unwrap_launcher,
)


def worker_env(environ: dict[str, str], launcher: str | None) -> dict[str, str]:
    """The command's environment: the rank's, marked wrapped, not a container of its own. Pure."""
    env = dict(environ)
    env.pop(CONTAINER_PER_RANK_ENV, None)
    env[WRAPPED_ENV] = env.get("RANK", "0")
    if launcher == "deepspeed" and "LOCAL_WORLD_SIZE" in env:
        env.setdefault("LOCAL_SIZE", env["LOCAL_WORLD_SIZE"])  # DeepSpeed's launcher sets it (CPU devices)
    return env


def main(module: str, argv: list[str]) -> int:
    """Exec the wrapper's command as this rank's worker; 2 on bad arguments or outside a rank."""
    prog = f"python3 -m {module}"
    try:
        launcher, overrides, command = unwrap_launcher(["python3", "-m", module, *argv])
        nproc, _ = torchrun_nproc_override(overrides)
    except ConfigError as err:
        sys.stderr.write(f"{prog}: error: {err}\n")
        return 2
    if "LOCAL_RANK" not in os.environ:
        sys.stderr.write(
            f"{prog}: error: this is toolkit's stand-in for Determined's launcher, which runs only inside "
            "a rank that python -m toolkit.run started; run the experiment with "
            "'python -m toolkit.run CONFIG MODEL_DIR' (its resources.slots_per_trial sets the processes)\n")
        return 2
    size = os.environ.get("LOCAL_WORLD_SIZE")
    if nproc is not None and size is not None and nproc != int(size):
        sys.stderr.write(f"{prog}: warning: --nproc_per_node {nproc} is ignored inside a script: toolkit.run "
                         f"started {size} process(es) per machine (resources.slots_per_trial)\n")
    try:
        os.execvpe(command[0], command, worker_env(dict(os.environ), launcher))
    except OSError as err:
        sys.stderr.write(f"{prog}: error: cannot run {command[0]!r}: {err}\n")
        return 127
    return 0  # not reached
