"""How the ranks of a save or load agree on its outcome: one rank's failure fails every rank.

A rank that raised between two collectives of a save would leave the others waiting in the next
until the launcher's timeout; these helpers turn a failure on any rank into the same
CheckpointError on every rank. Call on all ranks."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, TypeVar

from toolkit.errors import CheckpointError
from toolkit.runtime.context import DistributedContext

__all__ = ["agree", "on_chief", "write_failure"]

T = TypeVar("T")


def on_chief(ctx: DistributedContext, fn: Callable[[], T], *, slow: bool = False) -> T:
    """Run ``fn`` on the chief and hand its result, or its failure, to every rank. Call on all ranks.

    The chief re-raises its exception, the others raise a CheckpointError naming it. ``slow=True``, for
    work that grows with the checkpoint (fsync, deleting old ones): the others wait with the process
    group's long timeout (``ctx.chief_first()``), not the short one meant to catch a one-rank call."""
    outcome: Any = None
    failure: BaseException | None = None

    def run_on_chief() -> None:
        nonlocal outcome, failure
        if ctx.is_chief:
            try:
                outcome = ("ok", fn())
            except Exception as err:  # noqa: BLE001 - re-raised below, after telling the other ranks
                failure, outcome = err, ("error", f"{type(err).__name__}: {err}")

    if slow:
        with ctx.chief_first():
            run_on_chief()
    else:
        run_on_chief()
    outcome = ctx.broadcast_object(outcome)
    if failure is not None:
        raise failure
    if outcome[0] == "error":
        raise CheckpointError(f"failed on the chief (rank 0): {outcome[1]}")
    return outcome[1]


def agree(ctx: DistributedContext, error: str | None, what: str) -> None:
    """A barrier after which every rank raises a CheckpointError listing each failed rank's ``error`` (a
    sentence, or None) if any failed; ``what`` names the operation. Call on all ranks."""
    errors = ctx.all_gather_object(error)
    failed = [f"rank {rank}: {err}" for rank, err in enumerate(errors) if err is not None]
    if failed:
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s):\n  " + "\n  ".join(failed))


def write_failure(what: str, err: BaseException, directory: Path) -> str:
    """Why a checkpoint write failed, with the free space under ``directory`` and the fix (torch reports a
    full disk as a bare ``RuntimeError``). Any rank."""
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
        space = (f"the disk is full: {free // 1024} KiB free" if free < 64 * 2**20 else
                 f"{free // 2**20} MiB free, so perhaps a quota or file size limit") + f" under {directory}"
    except OSError:
        space = "is the disk full or over quota?"
    return (f"{what}: {type(err).__name__}: {err} ({space}). Nothing was committed: the previous checkpoint "
            "is still the latest; free space and save again")
