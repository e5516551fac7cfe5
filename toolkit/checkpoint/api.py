"""Crash-safe DeepSpeed checkpoints for your own training loop: save, load, consolidate. Call on all ranks.

A save becomes the latest only once every rank has written, so a crash at any moment leaves the
previous one loadable; a load checks that the checkpoint fits the engine before DeepSpeed reads
anything. A directory belongs to one run, on storage every rank sees (or a bucket URL:
:mod:`toolkit.checkpoint.remote`). Loading unpickles DeepSpeed's files: trusted checkpoints only.
The layout, the commit and run ownership: docs/training.md (Checkpoints).

Example (``torchrun --nproc_per_node 2 train.py``; run it again after a crash: it resumes)::

    resumed = toolkit.load_checkpoint(engine, "checkpoints")
    steps_completed, state = resumed if resumed else (0, {})
    toolkit.save_checkpoint(engine, "checkpoints", steps_completed=step + 1, keep_last=3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from toolkit._checks import int_problem, is_int, type_name
from toolkit._files import atomic_write_json, flushing_while_written, fsync_tree
from toolkit.checkpoint import layout, lock, remote  # remote imports this module: only used in calls
from toolkit.checkpoint.consolidate import consolidate_checkpoint
from toolkit.checkpoint.cpu_adam import replay_cpu_adam_state
from toolkit.checkpoint.engine import check_engine, engine_facts
from toolkit.checkpoint.ranks import agree, on_chief, write_failure
from toolkit.checkpoint.rng import read_rank_file, restore_rng_state, write_rank_file
from toolkit.checkpoint.stop_record import note_commit
from toolkit.checkpoint.store import open_store, parse_url
from toolkit.checkpoint.universal import universal_tag
from toolkit.errors import CheckpointError, ConfigError
from toolkit.runtime.context import DistributedContext, get_context

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate_checkpoint"]

logger = logging.getLogger(__name__)

# toolkit's part of DeepSpeed's client_state: one key, so a user's keys never collide with
# DeepSpeed's own ('module', 'optimizer', ...), which client_state would otherwise overwrite.
_CLIENT_KEY = "toolkit_checkpoint"
# This process's run id per checkpoint directory (real path): set by save, adopted by load.
_run_ids: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class _Save:
    """One checked save request, the same on every rank (the chief's run id and sequence added)."""

    root: str
    tag: str
    steps_completed: int
    client_state: dict[str, Any]
    keep_last: int | None
    facts: dict[str, Any]

    @property
    def tag_dir(self) -> Path:
        return Path(self.root) / self.tag


def _rng_path(root: str, tag: str, rank: int) -> Path:
    return Path(root) / tag / layout.RNG_DIR / f"rank_{rank:05d}.pt"


def save_checkpoint(engine: Any, checkpoint_dir: str | os.PathLike[str], *, steps_completed: int,
                    client_state: Mapping[str, Any] | None = None, keep_last: int | None = None,
                    tag: str | None = None, run_id: str | None = None, overwrite: bool = False) -> str:
    """Save a DeepSpeed engine checkpoint and commit it once every rank has written. Call on all ranks.

    Returns the tag, on every rank only after the commit; a process killed at any moment leaves the
    previous checkpoint the latest and loadable (docs/training.md, Checkpoints).

    Args:
        engine: from ``deepspeed.initialize`` (ZeRO 0-3, or pipeline).
        checkpoint_dir: the run's directory, shared by all ranks, or an ``s3://`` / ``gs://`` URL.
        steps_completed: training steps done so far; :func:`load_checkpoint` returns it.
        client_state: your picklable state, saved from the first data-parallel rank (keep it the same
            on every rank); :func:`load_checkpoint` returns it on every rank.
        keep_last: after the commit, keep this many committed checkpoints (leftovers of interrupted
            saves go too).
        tag: by default ``step_<steps_completed>``.
        run_id: by default the one a load adopted, or the one this process's first save made.
        overwrite: take over another run's directory, or a tag directory of DeepSpeed's own files.

    Raises ConfigError (every bad argument, before anything is written); CheckpointError on every rank
    (another run's directory, a tag that is not toolkit's, a failed write or upload on any rank);
    CheckpointLockError when another run still holds the directory after the wait (exit status 2)."""
    url = parse_url(checkpoint_dir)
    root = url.url if url else layout.checkpoint_root(checkpoint_dir)
    tag = _checked_save_arguments(steps_completed, client_state, keep_last, tag, run_id, overwrite)
    check_engine(engine)
    ctx = get_context()
    if not url:  # a bucket has no POSIX lock: one writer per prefix is the user's to keep
        lock.hold_directory(ctx, root)  # one writer per directory, from the first load or save on
    started = time.monotonic()
    save = _Save(root=root, tag=tag, steps_completed=int(steps_completed),
                 client_state=dict(client_state or {}), facts=engine_facts(engine, ctx),
                 keep_last=None if keep_last is None else int(keep_last))
    key = root if url else os.path.realpath(root)
    if url:  # object storage: staged locally, uploaded, committed in the bucket (remote.py)
        _run_ids[key], deleted = remote.save(engine, ctx, save, open_store(url),
                                             mine=run_id or _run_ids.get(key), overwrite=overwrite)
    else:
        _run_ids[key], deleted = _save_local(engine, ctx, save, mine=run_id or _run_ids.get(key),
                                             overwrite=overwrite)
    logger.info("checkpoint %r (steps_completed=%d) committed to %s in %.2f s%s", tag, save.steps_completed,
                root, time.monotonic() - started, f"; deleted {deleted}" if deleted else "")
    return tag


def _save_local(engine: Any, ctx: DistributedContext, save: _Save, *, mine: str | None,
                overwrite: bool) -> tuple[str, list[str]]:
    """Plan, write and commit into a directory; the run id and the tags deleted. All ranks."""
    this_run, seq = _prepare_tag(ctx, save, mine=mine, overwrite=overwrite)
    _write_on_every_rank(engine, ctx, save, this_run)
    return this_run, on_chief(ctx, lambda: _commit(engine, save, this_run, seq), slow=True)


def _checked_save_arguments(steps_completed: Any, client_state: Any, keep_last: Any, tag: Any, run_id: Any,
                            overwrite: Any) -> str:
    """The tag to save, once every argument is checked; raises ConfigError listing every problem."""
    problems = [int_problem("steps_completed", steps_completed, minimum=0)]
    if client_state is not None and not isinstance(client_state, Mapping):
        problems.append(f"client_state={client_state!r:.60} ({type_name(client_state)}): expected a dict "
                        "(or None) of your own picklable state")
    if keep_last is not None:
        problems.append(int_problem("keep_last", keep_last, minimum=1, hint=" (or None to keep all)"))
    if tag is None and is_int(steps_completed):
        tag = f"step_{int(steps_completed)}"
    if tag is not None:
        problems.append(layout.name_problem(tag))
    if run_id is not None:
        problems.append(layout.name_problem(run_id, what="run_id"))
    if not isinstance(overwrite, bool):
        problems.append(f"overwrite={overwrite!r}: expected True or False")
    found = [p for p in problems if p]
    if found:
        raise ConfigError(found, source="save_checkpoint()")
    return str(tag)


def _prepare_tag(ctx: DistributedContext, save: _Save, *, mine: str | None,
                 overwrite: bool) -> tuple[str, int]:
    """The chief plans the save (run, latest, leftovers) and marks the tag as started. Call on all ranks;
    returns the run id and the save's sequence number, raising on all if they disagree on tag or step."""
    def prepare() -> tuple[str, int, str, int]:
        os.makedirs(save.root, exist_ok=True)
        lock.verify_held(save.root)
        layout.tag_path(save.root, save.tag, to_write=True)  # never write through a symlink
        layout.empty_trash(save.root)
        plan = layout.plan_save(layout.scan_dir(save.root), tag=save.tag, mine=mine, overwrite=overwrite)
        for warning in plan.warnings:
            logger.warning("%s", warning)
        for note in plan.notes:
            logger.info("%s", note)
        if plan.write_run_file:
            atomic_write_json(Path(save.root) / layout.RUN_FILE, {
                "run_id": plan.run_id, "created_at": time.time(), "world_size": ctx.world_size})
        if plan.new_latest is not None or plan.remove_latest:
            layout.set_latest(save.root, plan.new_latest)
        for old in plan.discard:
            layout.discard_tag(save.root, old)
        (save.tag_dir / layout.RNG_DIR).mkdir(parents=True, exist_ok=True)
        atomic_write_json(save.tag_dir / layout.STARTED_FILE, {
            "run_id": plan.run_id, "tag": save.tag, "steps_completed": save.steps_completed,
            "started_at": time.time()})
        return plan.run_id, plan.seq, save.tag, save.steps_completed

    return _agree_on_tag(ctx, save, on_chief(ctx, prepare))


def _agree_on_tag(ctx: DistributedContext, save: _Save,
                  planned: tuple[str, int, str, int]) -> tuple[str, int]:
    """The chief's (run id, seq) once every rank saves its tag and step; raises on all ranks if not."""
    this_run, seq, chief_tag, chief_steps = planned
    # Every rank must write the same tag, or ranks would scatter their files over two checkpoints.
    mismatch = (f"tag {save.tag!r} at steps_completed={save.steps_completed}, but the chief saves "
                f"{chief_tag!r} at steps_completed={chief_steps}; pass the same values on every rank")
    agree(ctx, None if (chief_tag, chief_steps) == (save.tag, save.steps_completed) else mismatch,
          f"saving checkpoint {save.tag!r}")
    return this_run, seq


def _write_on_every_rank(engine: Any, ctx: DistributedContext, save: _Save, this_run: str, *,
                         flush: bool = True) -> None:
    """Every rank writes its RNG states (first: DeepSpeed's save ends with a barrier) and DeepSpeed's
    files, flushed unless ``flush=False`` (a staging directory for an upload); raises on all ranks if
    one failed. All ranks."""
    rank_error = None
    try:
        write_rank_file(_rng_path(save.root, save.tag, ctx.rank), rank=ctx.rank, world_size=ctx.world_size)
    except (OSError, RuntimeError) as err:  # torch.save reports a failed write as RuntimeError too
        # Still enter DeepSpeed's collective save, then fail together below.
        rank_error = write_failure("writing the RNG states", err, save.tag_dir)
    ours = {"steps_completed": save.steps_completed, "client_state": save.client_state,
            "run_id": this_run, "tag": save.tag}
    # The local chief flushes the node's files as DeepSpeed writes them: the flush below finds little left.
    early = flushing_while_written(save.tag_dir) if ctx.is_local_chief and flush else contextlib.nullcontext()
    try:
        with early:
            engine.save_checkpoint(save.root, tag=save.tag, client_state={_CLIENT_KEY: ours},
                                   save_latest=False)
    except (OSError, RuntimeError) as err:
        # A failed write (disk full, quota, file size limit) raises on the ranks that hit it after
        # the save's collectives but before DeepSpeed's closing barrier: stand in for that barrier,
        # so that every rank meets in the agreement below and raises there; none is left waiting.
        import deepspeed.comm

        rank_error = rank_error or write_failure(f"DeepSpeed could not write its files into {save.tag_dir}",
                                                 err, save.tag_dir)
        deepspeed.comm.barrier()
    if rank_error is None and ctx.is_local_chief and flush:
        try:  # flush every file of this node before the commit can be written
            fsync_tree(save.tag_dir)
        except OSError as err:
            rank_error = f"flushing {save.tag_dir}: {err}"
    agree(ctx, rank_error, f"saving checkpoint {save.tag!r}")


def _commit(engine: Any, save: _Save, this_run: str, seq: int) -> list[str]:
    """Chief only: the commit marker, ``latest``, then ``keep_last``; returns the tags deleted (a failed
    deletion is logged, not raised: the new checkpoint is committed by then)."""
    metadata = _commit_metadata(engine, save, this_run, seq)
    atomic_write_json(save.tag_dir / layout.COMMIT_FILE, metadata, default=repr)
    layout.set_latest(save.root, save.tag)
    deleted: list[str] = []
    if save.keep_last is not None:
        for old in layout.plan_keep_last(layout.scan_dir(save.root), keep_last=save.keep_last,
                                         just_written=save.tag):
            try:
                layout.discard_tag(save.root, old)
                deleted.append(old)
            except OSError as err:  # the new checkpoint is committed; do not fail the save
                logger.warning("keep_last: could not delete %s: %s", Path(save.root) / old, err)
    note_commit(save.root, save.tag, save.steps_completed, this_run)  # after a stop: the stop record, last
    return deleted


def _commit_metadata(engine: Any, save: _Save, this_run: str, seq: int) -> dict[str, Any]:
    """The commit record of a save (any rank; the chief writes it)."""
    import deepspeed

    return {**save.facts, "format": layout.FORMAT_VERSION, "tag": save.tag, "run_id": this_run,
            "seq": seq, "steps_completed": save.steps_completed, "committed_at": time.time(),
            "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
            "ds_config": engine.config, "client_state_keys": sorted(map(str, save.client_state))}


def load_checkpoint(engine: Any, checkpoint_dir: str | os.PathLike[str], *, tag: str | None = None,
                    read_only: bool = False) -> tuple[int, dict[str, Any]] | None:
    """Load the latest (or the given) committed checkpoint into ``engine``. Call on all ranks.

    Returns ``(steps_completed, client_state)``, or None when nothing is committed (a fresh start). A
    checkpoint that does not fit the engine (data-parallel size, ZeRO stage, tensor-parallel size,
    pipeline layout) is refused before DeepSpeed reads anything, naming the fix; then the weights,
    optimizer, scheduler and RNG states are restored and the directory's run is adopted.
    ``"checkpoint": {"load_universal": true}`` loads a universal checkpoint at any world size, without
    RNG states. Unpickles DeepSpeed's files: trusted checkpoints only. Details: docs/training.md.

    Args:
        engine: freshly initialised (under ZeRO-3 DeepSpeed cannot load into one that has saved).
        checkpoint_dir: as given to :func:`save_checkpoint` (a URL is downloaded once per machine).
        tag: a committed tag; None follows ``latest`` (else takes the newest committed).
        read_only: True takes no writer lock (an evaluation beside the training run); False makes
            this run the directory's one writer (docs/training.md, One writer per directory).

    Raises ConfigError (a bad ``tag`` or ``read_only``); CheckpointError on every rank (a missing or
    uncommitted tag, a misfit, a missing RNG file, a bucket that cannot be written or read);
    CheckpointLockError when another run still holds the directory after the wait (exit status 2)."""
    url = parse_url(checkpoint_dir)
    root = url.url if url else layout.checkpoint_root(checkpoint_dir)
    problem = None if tag is None else layout.name_problem(tag)
    if not isinstance(read_only, bool):
        problem = f"read_only={read_only!r}: expected True or False"
    if problem:
        raise ConfigError(problem, source="load_checkpoint()")
    check_engine(engine)
    ctx = get_context()
    if url:
        return remote.load_url(engine, ctx, url, tag, _run_ids)
    if not read_only:
        lock.hold_directory(ctx, root)
    key = os.path.realpath(root)
    if engine.load_universal_checkpoint():
        return _load_universal(engine, ctx, root, tag, key)
    chosen, dir_run = on_chief(ctx, lambda: _choose(root, tag, engine_facts(engine, ctx)))
    _run_ids.update({key: dir_run} if dir_run else {})
    if chosen is None:
        logger.info("no committed checkpoint in %s: starting from scratch", root)
        return None
    return _load_committed(engine, ctx, root, chosen)


def _load_committed(engine: Any, ctx: DistributedContext, root: str, tag: str) -> tuple[int, dict[str, Any]]:
    """Load the chosen committed checkpoint, then the state DeepSpeed misses. Call on all ranks."""
    layout.tag_path(root, tag)  # from the chief: every rank checks it before joining it to a path
    rng, rank_error = read_rank_file(_rng_path(root, tag, ctx.rank), rank=ctx.rank, world_size=ctx.world_size)
    agree(ctx, rank_error, f"loading checkpoint {tag!r}")  # before DeepSpeed's collectives
    load_path, ds_state = engine.load_checkpoint(root, tag=tag)
    ours = _our_state(load_path, ds_state, root, tag)
    _restore_hidden_optimizer_state(engine)
    restore_rng_state(rng)
    logger.info("loaded checkpoint %r (steps_completed=%d) from %s", tag, ours["steps_completed"], root)
    return int(ours["steps_completed"]), ours["client_state"]


def _restore_hidden_optimizer_state(engine: Any) -> None:
    """What an uninterrupted run's optimizer holds that DeepSpeed's checkpoint does not. All ranks."""
    replay_cpu_adam_state(engine)  # the CPU Adam kernels' step state


def _choose(root: str, tag: str | None, facts: dict[str, Any]) -> tuple[str | None, str | None]:
    """Chief only: the tag to load (its directory's name, never what a file says; None: none committed)
    and the directory's run id; raises when it does not fit the engine (``facts``) or leaves ``root``."""
    state = layout.scan_dir(root)
    info, warning = layout.resolve_tag(state, tag)
    if warning:
        logger.warning("%s", warning)
    if info is None:
        return None, state.run_id
    layout.tag_path(root, info.tag)
    problems = layout.compatibility_problems(info.meta, facts)
    if problems:
        raise CheckpointError(
            f"checkpoint {info.tag!r} in {root} does not fit this engine:\n  - " + "\n  - ".join(problems)
            + "\n" + layout.universal_fix(root, info.tag))
    return info.tag, state.run_id or info.meta.get("run_id")


def _our_state(load_path: Any, ds_state: Any, root: str, tag: str) -> dict[str, Any]:
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no model states in {Path(root) / tag}")
    ours = (ds_state or {}).get(_CLIENT_KEY)
    if not isinstance(ours, dict) or "steps_completed" not in ours:
        raise CheckpointError(f"{Path(root) / tag} lacks toolkit's client state ({_CLIENT_KEY!r}): it was "
                              "not written by toolkit.save_checkpoint; load it with engine.load_checkpoint()")
    return ours


def _load_universal(engine: Any, ctx: DistributedContext, root: str, tag: str | None,
                    key: str) -> tuple[int, dict[str, Any]]:
    """:func:`load_checkpoint` of a ``ds_to_universal`` output (no RNG states). Call on all ranks."""
    chosen, dir_run = on_chief(ctx, lambda: (_universal_choice(root, tag), layout.scan_dir(root).run_id))
    layout.tag_path(root, chosen)  # from the chief: checked again on every rank
    load_path, ds_state = engine.load_checkpoint(root, tag=chosen)
    ours = _our_state(load_path, ds_state, root, chosen)
    _restore_hidden_optimizer_state(engine)
    _run_ids[key] = dir_run or ours["run_id"]
    logger.warning("loaded universal checkpoint %r (steps_completed=%d); RNG states are not restored "
                   "across a layout change, so random streams differ from the original run",
                   chosen, ours["steps_completed"])
    return int(ours["steps_completed"]), ours["client_state"]


def _universal_choice(root: str, tag: str | None) -> str:
    """Chief only: the universal checkpoint to load (``tag``, else the one ``latest_universal`` names)."""
    chosen = universal_tag(root, tag)
    layout.tag_path(root, chosen)
    return chosen
