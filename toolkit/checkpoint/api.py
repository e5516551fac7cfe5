"""Crash-safe DeepSpeed checkpoints for your own training loop: save, load, consolidate. Call on all ranks.

:func:`save_checkpoint` writes DeepSpeed's checkpoint plus every rank's RNG states and makes it
the latest only once every rank has written, so a crash at any moment leaves the previous one
loadable; :func:`load_checkpoint` checks that it fits the engine before DeepSpeed reads anything,
so a restarted script continues exactly where it stopped. A directory belongs to one run, on
storage every rank sees; loading unpickles DeepSpeed's files, so load only checkpoints you or
your team wrote. The layout, the commit protocol and run ownership: docs/training.md.

Example::

    # torchrun --nproc_per_node 2 train.py      (run it again after a crash: it resumes)
    resumed = toolkit.load_checkpoint(engine, "checkpoints")          # call on all ranks
    steps_completed, state = resumed if resumed else (0, {})
    ...
    toolkit.save_checkpoint(engine, "checkpoints", steps_completed=step + 1, keep_last=3)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from toolkit._checks import int_problem, is_int, type_name
from toolkit._files import atomic_write_json, fsync_tree
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

    A process killed at any moment leaves the previous checkpoint as the latest and loadable;
    returns on every rank only after the commit (the protocol: docs/training.md, Checkpoints).

    Args:
        engine: the engine from ``deepspeed.initialize`` (data parallel with ZeRO 0-3, or pipeline).
        checkpoint_dir: the run's checkpoint directory, shared by all ranks; created if missing.
            Or an ``s3://`` / ``gs://`` URL: staged locally, uploaded, committed in the bucket
            (docs/object-storage.md).
        steps_completed: training steps done so far; returned by :func:`load_checkpoint`.
        client_state: your own picklable state (epoch, sampler position, ...), saved through
            DeepSpeed's ``client_state`` from the first data-parallel rank, so keep it the same on
            every rank; returned on every rank by :func:`load_checkpoint`.
        keep_last: after the commit, delete older committed checkpoints of the directory so that
            this many remain (the new one always stays), and leftovers of interrupted saves.
        tag: the checkpoint's directory name, ``step_<steps_completed>`` by default; letters,
            digits, ``.``, ``_`` and ``-`` only.
        run_id: this run's id (letters, digits, ``.``, ``_``, ``-``); by default the id adopted by
            :func:`load_checkpoint` or made by the first save of this process.
        overwrite: save even if the directory holds another run's checkpoints (this run takes it
            over) or the tag directory holds DeepSpeed files not written by toolkit.

    Returns:
        The tag saved.

    Raises:
        ConfigError: invalid arguments (every problem listed), before anything is written.
        CheckpointError: a directory owned by another run, a tag directory that is not
            toolkit's, or a failure on some rank, an upload's included (every rank raises).
        CheckpointLockError: another run still holds the directory's writer lock after the
            wait (exit status 2 when uncaught); every rank raises.

    Example::

        # torchrun --nproc_per_node 2 train.py
        toolkit.save_checkpoint(engine, "checkpoints", steps_completed=step + 1, keep_last=2)
    """
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
    """The chief plans the save (run, latest, discarded leftovers) and marks the tag as started.

    Call on all ranks; returns the run id and the sequence number of the save on every rank,
    and raises on every rank when the ranks disagree about the tag or the step.
    """
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
    """Every rank writes its RNG states and DeepSpeed's files, flushed; raises on all if one failed.

    RNG states first: DeepSpeed's save ends with a barrier, after which every file is complete.
    ``flush=False``: a staging directory for an upload (the bucket makes it durable). All ranks.
    """
    rank_error = None
    try:
        write_rank_file(_rng_path(save.root, save.tag, ctx.rank), rank=ctx.rank, world_size=ctx.world_size)
    except (OSError, RuntimeError) as err:  # torch.save reports a failed write as RuntimeError too
        # Still enter DeepSpeed's collective save, then fail together below.
        rank_error = write_failure("writing the RNG states", err, save.tag_dir)
    ours = {"steps_completed": save.steps_completed, "client_state": save.client_state,
            "run_id": this_run, "tag": save.tag}
    try:
        engine.save_checkpoint(save.root, tag=save.tag, client_state={_CLIENT_KEY: ours}, save_latest=False)
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
    """Chief only: write the commit marker, point ``latest`` at the tag, apply ``keep_last``.

    Returns the tags deleted by ``keep_last`` (a failed deletion is logged, not raised: the new
    checkpoint is committed by then).
    """
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

    A checkpoint that does not fit the engine (data-parallel size, ZeRO stage, tensor-parallel
    size, pipeline layout) is refused before DeepSpeed reads anything, naming the fix (a universal
    checkpoint); then the weights, optimizer, scheduler and RNG states are restored, and the
    directory's run is adopted. ``"checkpoint": {"load_universal": true}`` loads a universal
    checkpoint at any world size, without RNG states. DeepSpeed's files are unpickled: load only
    checkpoints from a trusted source. Details: docs/training.md, Checkpoints.

    Args:
        engine: a freshly initialised engine (under ZeRO-3 DeepSpeed cannot load into an engine
            that has saved since its creation).
        checkpoint_dir: the directory or bucket URL given to :func:`save_checkpoint`; from a
            URL the checkpoint is downloaded once per machine into the local cache.
        tag: a committed checkpoint's tag; ``None`` follows ``latest`` (or takes the newest
            committed one when ``latest`` names none).
        read_only: True for a run that only reads (an evaluation beside the training run): no
            writer lock is taken. False (default): this run becomes the directory's one writer,
            waiting for a run that still holds it (docs/training.md, One writer per directory).

    Returns:
        ``(steps_completed, client_state)``, or ``None`` when the directory holds no committed
        checkpoint (a fresh start).

    Raises:
        ConfigError: ``tag`` is not a valid name, or ``read_only`` not a bool.
        CheckpointError: the tag is missing or not committed; the checkpoint does not
            fit the engine; a rank's RNG file is missing; or the bucket cannot be written
            (credentials, endpoint) or read. Raised on every rank.
        CheckpointLockError: another run still holds the directory after the wait (exit status 2
            when uncaught). Raised on every rank.

    Example::

        # torchrun --nproc_per_node 2 train.py
        resumed = toolkit.load_checkpoint(engine, "checkpoints")
        steps_completed, state = resumed if resumed is not None else (0, {})
    """
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
    """Chief only: the universal checkpoint to load (``latest_universal`` read as ``latest`` is)."""
    tag, problem = (tag, None) if tag is not None else layout.read_pointer(root, "latest_universal")
    if problem:
        raise CheckpointError(f"checkpoint.load_universal is set but {problem}; pass the tag of the "
                              "ds_to_universal output folder")
    chosen = universal_tag(root, tag)
    layout.tag_path(root, chosen)
    return chosen
