"""Build DeepSpeed's CPU ops once, serially, before anything runs in parallel.

DeepSpeed compiles its CPU ops (FusedAdam, CPU Adam, the shared-memory all-reduce) the first time
an engine needs them, inside every rank at once, behind a lock file in ``TORCH_EXTENSIONS_DIR``.
A process killed during that build (a test's timeout, a SIGKILL test, Ctrl-C) leaves the lock
behind, and every later process waits on it forever. Building here, in one process, right after
set-up, means tests and the main job only ever load finished ops; a lock left by a build that
died more than ``STALE_AFTER_S`` ago is removed (a build takes well under a minute).

    python scripts/build_ops.py        # scripts/setup.sh runs it; a no-op when all are built

On an accelerator other than the CPU nothing is built here: DeepSpeed JIT-builds what it needs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STALE_AFTER_S = 600
BUILDERS = ("FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder")


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        print(f"build_ops: accelerator {accelerator.device_name()!r}: DeepSpeed builds its ops when needed")
        return 0
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    for class_name in BUILDERS:
        builder = accelerator.create_op_builder(class_name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"build_ops: {class_name} is not available here; skipped")
            continue
        for lock in root.glob(f"*/{builder.name}/lock"):
            age = time.time() - lock.stat().st_mtime
            if age > STALE_AFTER_S:
                print(f"build_ops: removing {lock}, left {age / 60:.0f} min ago by a build that died")
                lock.unlink(missing_ok=True)
        start = time.monotonic()
        builder.load(verbose=False)
        print(f"build_ops: {builder.name} ready ({time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
