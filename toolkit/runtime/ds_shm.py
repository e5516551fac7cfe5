"""DeepSpeed's shared-memory all-reduce buffers, which DeepSpeed itself never removes.

On the CPU accelerator with every rank on one machine, DeepSpeed 0.19 creates a 69 MB segment
per rank in /dev/shm (memory) and never unlinks it, so every run used to leave its segments
behind. :func:`unlink_buffer` (all ranks, after a barrier: :func:`toolkit.init_distributed` does
it) frees them when the job ends, however it ends; :func:`remove_buffers` and
:func:`remove_stale_buffers` (any process) clear what other runs left. Only this user's segments
are touched. Details: docs/start.md (DeepSpeed's shared-memory segments).

Example::

    # bash: clear segments no live process maps (scripts/setup.sh does this)
    .venv/bin/python -P toolkit/runtime/ds_shm.py
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolkit.runtime.launch_env import LaunchInfo

__all__ = ["SHM_DIR", "buffer_name", "remove_buffers", "remove_stale_buffers", "share_with_deepspeed",
           "unlink_buffer"]

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_PREFIX = "deepspeed_allreduce_buffer"
#: A segment younger than this may be between its creation and its rank's ``mmap``.
_MIN_AGE_S = 60.0


def buffer_name(*, addr: str, port: str | int, rank: int, uid: int | None = None) -> str:
    """The name DeepSpeed gives rank ``rank``'s segment (``shm.cpp``'s ``shm_initialize``).

    >>> buffer_name(addr="127.0.0.1", port=29500, rank=1, uid=0)
    'deepspeed_allreduce_buffer_0_127.0.0.1_29500_1'
    """
    return f"{_PREFIX}_{os.getuid() if uid is None else uid}_{addr}_{port}_{rank}"


def unlink_buffer(rank: int, *, environ: dict[str, str] | None = None, shm_dir: Path = SHM_DIR) -> bool:
    """Remove the name of this rank's segment, if DeepSpeed made one. This rank only.

    Safe only once every peer has mapped it: DeepSpeed's set-up returns on a rank after it mapped
    all peers' segments, so call this after a barrier that follows DeepSpeed's communication
    set-up on every rank (as :func:`toolkit.init_distributed` does). The name is read from
    ``MASTER_ADDR`` and ``MASTER_PORT`` as DeepSpeed read them.

    Returns:
        True when a segment was unlinked.
    """
    env = os.environ if environ is None else environ
    path = shm_dir / buffer_name(addr=env.get("MASTER_ADDR", ""), port=env.get("MASTER_PORT", ""), rank=rank)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def remove_buffers(*, addr: str, port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove every rank's segment of the rendezvous ``addr:port``. Only after its processes ended.

    Example::

        # the dsat runner, once a local trial's processes are gone
        remove_buffers(addr="127.0.0.1", port=trial.port)
    """
    removed = []
    prefix = buffer_name(addr=addr, port=port, rank=0)[:-1]
    for path in shm_dir.glob(f"{prefix}*"):
        if path.name[len(prefix):].isdigit():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _mapped_paths(shm_dir: Path) -> set[str]:
    """Paths of files in ``shm_dir`` that some process of this user maps (/proc/<pid>/maps)."""
    mapped, folder = set(), f"{shm_dir}/"
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:  # the process ended, or belongs to another user
            continue
        for line in text.splitlines():
            at = line.find(folder)
            if at >= 0:
                mapped.add(line[at:].removesuffix(" (deleted)"))
    return mapped


def remove_stale_buffers(*, shm_dir: Path = SHM_DIR, min_age_s: float = _MIN_AGE_S) -> list[Path]:
    """Remove this user's DeepSpeed segments that no live process maps. Any process, any time.

    A live rank maps its own segment from a moment after creating it until it exits, so a segment
    older than ``min_age_s`` that nobody maps belongs to no running job.

    Returns:
        The removed paths.
    """
    mapped = _mapped_paths(shm_dir)
    now = time.time()
    removed = []
    for path in shm_dir.glob(f"{_PREFIX}_{os.getuid()}_*"):
        try:
            if now - path.stat().st_mtime < min_age_s or str(path) in mapped:
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    if removed:
        logger.info("removed %d stale DeepSpeed shared-memory segment(s) from %s", len(removed), shm_dir)
    return removed


def share_with_deepspeed(backend: str, timeout: timedelta, info: "LaunchInfo") -> None:
    """Hand the process group to ``deepspeed.comm`` too. Call on all ranks.

    DeepSpeed keeps its own communication backend object; ``PipelineModule(...)`` and other
    DeepSpeed calls made before ``deepspeed.initialize`` assert that it exists. With
    torch.distributed already initialised, DeepSpeed's init only wraps the existing group.

    On the CPU, that init also creates this rank's shared-memory all-reduce segment, which
    DeepSpeed never removes (this module). Once every rank is past the init, every rank has
    mapped every peer's segment, so each removes the name of its own: the memory goes back
    when the ranks exit, even if they are killed.
    """
    import torch.distributed as dist  # here: setup.sh runs this file without torch (see the end)

    try:
        import deepspeed.comm as ds_comm
        from deepspeed.comm import comm as ds_comm_state
    except ImportError:  # toolkit's config and launch helpers work without DeepSpeed
        return
    ds_comm.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
    # One machine only: there every rank has the same DeepSpeed build, so all ranks agree on
    # whether to take part in the barrier (DeepSpeed makes segments only when all ranks are local).
    if info.num_nodes == 1 and getattr(ds_comm_state.cdb, "shm_comm_op", None) is not None:
        if info.world_size > 1:
            dist.barrier()
        if unlink_buffer(info.rank):
            logger.debug("removed the name of DeepSpeed's shared-memory segment of rank %d", info.rank)


if __name__ == "__main__":
    # scripts/setup.sh runs this file by path, with -P (no toolkit import, so no torch: fast).
    gone = remove_stale_buffers()
    if gone:
        print(f"setup: removed {len(gone)} DeepSpeed shared-memory segment(s) from {SHM_DIR} that earlier "
              "runs left and no process maps")

