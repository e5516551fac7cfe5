"""Build DeepSpeed's CPU ops once, serially, before the tests and the main job run in parallel.

DeepSpeed compiles its CPU ops (FusedAdam, CPU Adam, the shared-memory all-reduce) the first time
a process needs them; building them here, in one process, right after set-up, means the test
processes only load finished ops. It goes through toolkit's build guards (``toolkit.install_build_guards``): a
lock left by a process that died while loading an op is removed, and the build uses this
environment's ninja and directory, so the processes started later find it built.

    python scripts/build_ops.py        # scripts/setup.sh runs it; a no-op when all are built

On an accelerator other than the CPU nothing is built here: DeepSpeed JIT-builds what it needs.
"""

from __future__ import annotations

import logging
import sys

BUILDERS = ("FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder")


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    from toolkit.runtime.op_builds import load_ops

    if get_accelerator().device_name() != "cpu":
        print(f"build_ops: accelerator {get_accelerator().device_name()!r}: DeepSpeed builds its ops when needed")
        return 0
    logging.basicConfig(level=logging.INFO, format="build_ops: %(message)s")
    ready = load_ops(BUILDERS)
    print(f"build_ops: {', '.join(ready) or 'nothing'} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
