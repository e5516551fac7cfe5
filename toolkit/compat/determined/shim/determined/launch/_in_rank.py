"""``python3 -m determined.launch.torch_distributed|deepspeed CMD...`` run by a rank of ``toolkit.run``.

Called from a script the entrypoint runs (``entrypoint: bash launch.sh``): the wrapper becomes this
rank's worker, ``exec`` of the command, marked wrapped (docs/design-determined.md#wrap_rank-and-the-shim).
As the entrypoint's first command toolkit.run unwraps it instead (:mod:`toolkit.launch.wrappers`).
Any process (one rank); started outside a rank (no ``LOCAL_RANK``) it exits 2, naming toolkit.run.
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
