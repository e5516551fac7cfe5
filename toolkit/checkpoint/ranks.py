"""How the ranks of a save or load agree on its outcome: one rank's failure fails every rank.

A checkpoint save or load is a sequence of collectives; a rank that raises between two of them
leaves the others waiting in the next one until the launcher's timeout. The helpers here turn a
failure on any rank into the same :class:`~toolkit.errors.CheckpointError` on every rank.
Call on all ranks.

Example::

    # torchrun --nproc_per_node 2 train.py   (inside toolkit.save_checkpoint)
    run_id = on_chief(ctx, prepare)                          # all ranks; the chief runs prepare
    agree(ctx, error_or_none, "saving checkpoint 'step_10'")  # all ranks; raises on all if any failed
"""

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

    A failing chief must make every rank raise, not leave them waiting in the next collective:
    the chief re-raises its own exception, the other ranks raise a :class:`CheckpointError`
    naming it.

    ``slow=True`` is for work whose length grows with the checkpoint (fsyncing every file,
    deleting old checkpoints): the other ranks wait for it with the process group's long
    timeout (``ctx.chief_first()``), not the short collective timeout, which is there to catch a
    call made on one rank only; the first collectives of a save or load catch that already.
    """
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
    """A barrier that also makes every rank raise when any rank failed. Call on all ranks.

    Args:
        error: this rank's failure, one sentence, or ``None``.
        what: the operation, for the message (``"saving checkpoint 'step_10'"``).

    Raises:
        CheckpointError: on every rank, listing each failed rank's sentence.
    """
    errors = ctx.all_gather_object(error)
    failed = [f"rank {rank}: {err}" for rank, err in enumerate(errors) if err is not None]
    if failed:
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s):\n  " + "\n  ".join(failed))


def write_failure(what: str, err: BaseException, directory: Path) -> str:
    """Why a checkpoint write failed, with the free space. Any rank.

    torch reports a full disk as a bare ``RuntimeError`` ("unexpected pos ...") that does not
    say so; the sentence adds the free space under ``directory`` and the fix.
    """
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
        space = (f"the disk is full: {free // 1024} KiB free" if free < 64 * 2**20 else
                 f"{free // 2**20} MiB free, so perhaps a quota or file size limit") + f" under {directory}"
    except OSError:
        space = "is the disk full or over quota?"
    return (f"{what}: {type(err).__name__}: {err} ({space}). Nothing was committed: the previous checkpoint "
            "is still the latest; free space and save again")
