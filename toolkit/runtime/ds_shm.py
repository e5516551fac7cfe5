"""DeepSpeed's shared-memory all-reduce segments (CPU, one machine), which DeepSpeed never removes.

:func:`share_with_deepspeed` (all ranks, in ``init_distributed``) unlinks each rank's segment once
every peer mapped it, so its memory goes when the job ends, however it ends; :func:`remove_buffers`
and :func:`remove_stale_buffers` (any process) clear what other runs left. Only this user's
segments are touched; ``python -P toolkit/runtime/ds_shm.py`` clears stale ones (scripts/setup.sh).
Details: docs/start.md (DeepSpeed's shared-memory segments)."""

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
    """The name DeepSpeed gives rank ``rank``'s segment (``shm_initialize`` in ``shm.cpp``). Pure."""
    return f"{_PREFIX}_{os.getuid() if uid is None else uid}_{addr}_{port}_{rank}"


def unlink_buffer(rank: int, *, environ: dict[str, str] | None = None, shm_dir: Path = SHM_DIR) -> bool:
    """Remove the name of this rank's segment, if DeepSpeed made one; True if so. This rank only.

    Safe only once every peer mapped it: after a barrier that follows DeepSpeed's communication set-up
    on every rank. The name comes from ``MASTER_ADDR``/``MASTER_PORT``, as DeepSpeed read them."""
    env = os.environ if environ is None else environ
    path = shm_dir / buffer_name(addr=env.get("MASTER_ADDR", ""), port=env.get("MASTER_PORT", ""), rank=rank)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def remove_buffers(*, addr: str, port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove every rank's segment of rendezvous ``addr:port``, once its processes ended (dsat's runner,
    after a local trial)."""
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
    """Remove this user's DeepSpeed segments that no live process maps and older than ``min_age_s`` (a
    live rank maps its own from a moment after creating it until it exits); returns them. Any process."""
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
    """Hand the process group to ``deepspeed.comm`` (``PipelineModule`` and other calls made before
    ``deepspeed.initialize`` need it), then unlink this rank's shared-memory segment once every rank
    is past that init (every peer's is mapped by then). Call on all ranks."""
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

