"""Crash-safe DeepSpeed checkpoints for your own training loop: save, load, consolidate.

:func:`save_checkpoint` writes DeepSpeed's engine checkpoint (ZeRO 0-3 shards, pipeline layers)
plus toolkit's metadata and every rank's RNG states, and makes it the latest only once every rank
has finished writing. :func:`load_checkpoint` checks that the checkpoint fits the engine before
DeepSpeed reads anything, loads it and restores the RNG states, so a restarted script continues
exactly where it stopped. See :mod:`toolkit.checkpoint.layout` for the files and the protocol.

**Runs and directories.** A checkpoint directory belongs to one run, recorded by a run id in
``toolkit_run.json``. The natural resume flow needs nothing more::

    # torchrun --nproc_per_node 2 train.py      (run it again after a crash: it resumes)
    ctx = toolkit.init_distributed()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    resumed = toolkit.load_checkpoint(engine, "checkpoints")          # call on all ranks
    steps_completed, state = resumed if resumed else (0, {})
    for step in range(steps_completed, max_steps):
        ...
        if (step + 1) % 100 == 0:
            toolkit.save_checkpoint(engine, "checkpoints", steps_completed=step + 1,
                                    client_state={"epoch": epoch}, keep_last=3)

:func:`load_checkpoint` adopts the directory's run, so the saves that follow continue it. A new
run (one that did not load from the directory) saving into a directory that already holds
another run's committed checkpoints gets a :class:`~toolkit.errors.CheckpointError` instead of
silently mixing with them and, with ``keep_last``, deleting them; pass ``overwrite=True`` to take
the directory over, or the same ``run_id`` to continue a run without loading (for example when a
scheduler provides a stable job id). Saving a tag that this run already committed replaces it.

**Trust.** Loading unpickles DeepSpeed's files with ``torch.load(weights_only=False)`` (DeepSpeed's
own choice: they hold optimizer state and your ``client_state``), which can run arbitrary code:
load only checkpoints you or your team wrote. toolkit's own files are JSON, or tensors read with
``weights_only=True``.

``checkpoint_dir`` must be on a filesystem every rank sees (the usual DeepSpeed setup); DeepSpeed's
``use_node_local_storage`` and decoupled (asynchronous) checkpoint engines are refused.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch

from toolkit._checks import is_int
from toolkit._files import atomic_write, atomic_write_json, fsync_tree
from toolkit.checkpoint import layout
from toolkit.checkpoint.cpu_adam import replay_cpu_adam_state
from toolkit.checkpoint.rng import capture_rng_state, restore_rng_state
from toolkit.errors import CheckpointError
from toolkit.runtime.context import DistributedContext, get_context

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate_checkpoint"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# toolkit's part of DeepSpeed's client_state: one key, so a user's keys never collide with
# DeepSpeed's own ('module', 'optimizer', ...), which client_state would otherwise overwrite.
_CLIENT_KEY = "toolkit_checkpoint"
# This process's run id per checkpoint directory (real path): set by save, adopted by load.
_run_ids: dict[str, str] = {}


def _root(checkpoint_dir: Any) -> str:
    if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
        raise CheckpointError(f"checkpoint_dir={checkpoint_dir!r}: expected a non-empty path")
    root = os.fspath(checkpoint_dir)
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint_dir={root!r} exists and is not a directory")
    return root


def _check_engine(engine: Any) -> None:
    if not all(hasattr(engine, name) for name in ("save_checkpoint", "load_checkpoint", "zero_optimization_stage")):
        raise CheckpointError(f"engine={type(engine).__name__}: expected the DeepSpeed engine returned "
                              "by deepspeed.initialize()")
    if engine.use_node_local_storage():
        raise CheckpointError("the DeepSpeed config sets checkpoint.use_node_local_storage, which toolkit "
                              "checkpoints do not support: they commit through one shared directory")
    if getattr(engine.checkpoint_engine, "is_decoupled", lambda: False)():
        raise CheckpointError("the DeepSpeed checkpoint engine is decoupled (writes after save returns); "
                              "toolkit can only commit checkpoints written synchronously")


def _engine_facts(engine: Any, ctx: DistributedContext) -> dict[str, Any]:
    from deepspeed.runtime.pipe.engine import PipelineEngine  # deepspeed is loaded: engine is one

    pipeline = isinstance(engine, PipelineEngine)
    return {"world_size": ctx.world_size, "data_parallel_size": int(engine.dp_world_size),
            # Pipeline engines count their stages as model parallelism; keep tensor parallelism apart.
            "tensor_parallel_size": int(engine.grid.get_slice_parallel_world_size() if pipeline
                                        else engine.mp_world_size),
            "pipeline": pipeline,
            "pipeline_stages": int(engine.num_stages) if pipeline else None,
            "zero_stage": int(engine.zero_optimization_stage()),
            "bf16": bool(engine.bfloat16_enabled()), "fp16": bool(engine.fp16_enabled())}


def _on_chief(ctx: DistributedContext, fn: Callable[[], T]) -> T:
    """Run ``fn`` on the chief and hand its result, or its failure, to every rank: a failing chief
    must make every rank raise, not leave them waiting in the next collective."""
    outcome: Any = None
    failure: BaseException | None = None
    if ctx.is_chief:
        try:
            outcome = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - re-raised below, after telling the other ranks
            failure, outcome = err, ("error", f"{type(err).__name__}: {err}")
    outcome = ctx.broadcast_object(outcome)
    if failure is not None:
        raise failure
    if outcome[0] == "error":
        raise CheckpointError(f"failed on the chief (rank 0): {outcome[1]}")
    return outcome[1]


def _agree(ctx: DistributedContext, error: str | None, what: str) -> None:
    """A barrier that also makes every rank raise when any rank failed."""
    errors = ctx.all_gather_object(error)
    failed = [f"rank {rank}: {err}" for rank, err in enumerate(errors) if err is not None]
    if failed:
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s):\n  " + "\n  ".join(failed))


def _write_failed(what: str, err: BaseException, directory: Path) -> str:
    """Why a checkpoint write failed, with the free space: torch reports a full disk as a bare
    ``RuntimeError`` ("unexpected pos ...") that does not say so."""
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
        space = (f"the disk is full: {free // 1024} KiB free" if free < 64 * 2**20 else
                 f"{free // 2**20} MiB free, so perhaps a quota or file size limit") + f" under {directory}"
    except OSError:
        space = "is the disk full or over quota?"
    return (f"{what}: {type(err).__name__}: {err} ({space}). Nothing was committed: the previous checkpoint "
            "is still the latest; free space and save again")


def _rng_path(root: str, tag: str, rank: int) -> Path:
    return Path(root) / tag / layout.RNG_DIR / f"rank_{rank:05d}.pt"


def save_checkpoint(engine: Any, checkpoint_dir: str | os.PathLike[str], *, steps_completed: int,
                    client_state: Mapping[str, Any] | None = None, keep_last: int | None = None,
                    tag: str | None = None, run_id: str | None = None, overwrite: bool = False) -> str:
    """Save a DeepSpeed engine checkpoint and commit it once every rank has written. Call on all ranks.

    Protocol: the chief checks the directory and marks the tag as started; every rank writes its
    RNG states and DeepSpeed writes its files; after a barrier the chief writes the metadata (the
    commit marker) and then atomically replaces DeepSpeed's ``latest`` file, so DeepSpeed's own
    tools (``zero_to_fp32.py``, ``ds_to_universal``) find it too. A process killed at any moment
    leaves the previous checkpoint as the latest and loadable. Returns on every rank only after
    the commit.

    Args:
        engine: the engine from ``deepspeed.initialize`` (data parallel with ZeRO 0-3, or pipeline).
        checkpoint_dir: the run's checkpoint directory, shared by all ranks; created if missing.
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
        CheckpointError: an invalid argument or tag, a directory owned by another run, a tag
            directory that is not toolkit's, or a failure on some rank (every rank raises).

    Example::

        # torchrun --nproc_per_node 2 train.py
        toolkit.save_checkpoint(engine, "checkpoints", steps_completed=step + 1, keep_last=2)
    """
    root = _root(checkpoint_dir)
    if not is_int(steps_completed) or steps_completed < 0:
        raise CheckpointError(f"steps_completed={steps_completed!r}: expected an int >= 0")
    if client_state is not None and not isinstance(client_state, Mapping):
        raise CheckpointError(f"client_state is a {type(client_state).__name__}: expected a dict or None")
    if keep_last is not None and (not is_int(keep_last)
                                  or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r}: expected None (keep all) or an int >= 1")
    tag = layout.validate_name(f"step_{steps_completed}" if tag is None else tag)
    if run_id is not None:
        layout.validate_name(run_id, what="run_id")
    if not isinstance(overwrite, bool):
        raise CheckpointError(f"overwrite={overwrite!r}: expected True or False")
    _check_engine(engine)
    ctx = get_context()
    facts = _engine_facts(engine, ctx)
    key = os.path.realpath(root)
    mine = run_id or _run_ids.get(key)
    started = time.monotonic()
    tag_dir = Path(root) / tag

    def prepare() -> tuple[str, int, str, int]:
        os.makedirs(root, exist_ok=True)
        layout.empty_trash(root)
        plan = layout.plan_save(layout.scan_dir(root), tag=tag, mine=mine, overwrite=overwrite)
        for warning in plan.warnings:
            logger.warning("%s", warning)
        for note in plan.notes:
            logger.info("%s", note)
        if plan.write_run_file:
            atomic_write_json(Path(root) / layout.RUN_FILE, {
                "run_id": plan.run_id, "created_at": time.time(), "world_size": ctx.world_size})
        if plan.new_latest is not None or plan.remove_latest:
            layout.set_latest(root, plan.new_latest)
        for old in plan.discard:
            layout.discard_tag(root, old)
        (tag_dir / layout.RNG_DIR).mkdir(parents=True, exist_ok=True)
        atomic_write_json(tag_dir / layout.STARTED_FILE, {
            "run_id": plan.run_id, "tag": tag, "steps_completed": steps_completed, "started_at": time.time()})
        return plan.run_id, plan.seq, tag, steps_completed

    this_run, seq, chief_tag, chief_steps = _on_chief(ctx, prepare)
    # Every rank must write the same tag, or ranks would scatter their files over two checkpoints.
    _agree(ctx, None if (chief_tag, chief_steps) == (tag, steps_completed) else
           f"tag {tag!r} at steps_completed={steps_completed}, but the chief saves {chief_tag!r} at "
           f"steps_completed={chief_steps}; pass the same values on every rank", f"saving checkpoint {tag!r}")
    _run_ids[key] = this_run

    # RNG states first: DeepSpeed's save ends with a barrier, after which every file is complete.
    rank_error = None
    try:
        saved = {"rank": ctx.rank, "world_size": ctx.world_size, "rng": capture_rng_state()}
        atomic_write(_rng_path(root, tag, ctx.rank), lambda fh: torch.save(saved, fh))
    except (OSError, RuntimeError) as err:  # torch.save reports a failed write as RuntimeError too
        # Still enter DeepSpeed's collective save, then fail together below.
        rank_error = _write_failed("writing the RNG states", err, tag_dir)
    ours = {"steps_completed": steps_completed, "client_state": dict(client_state or {}),
            "run_id": this_run, "tag": tag}
    try:
        engine.save_checkpoint(root, tag=tag, client_state={_CLIENT_KEY: ours}, save_latest=False)
    except (OSError, RuntimeError) as err:
        # A failed write (disk full, quota, file size limit) raises on the ranks that hit it after
        # the save's collectives but before DeepSpeed's closing barrier: stand in for that barrier,
        # so that every rank meets in the agreement below and raises there; none is left waiting.
        import deepspeed.comm

        rank_error = rank_error or _write_failed(f"DeepSpeed could not write its files into {tag_dir}", err,
                                                 tag_dir)
        deepspeed.comm.barrier()
    if rank_error is None and ctx.is_local_chief:
        try:  # flush every file of this node before the commit can be written
            fsync_tree(tag_dir)
        except OSError as err:
            rank_error = f"flushing {tag_dir}: {err}"
    _agree(ctx, rank_error, f"saving checkpoint {tag!r}")

    def commit() -> list[str]:
        import deepspeed

        metadata = {**facts, "format": layout.FORMAT_VERSION, "tag": tag, "run_id": this_run, "seq": seq,
                    "steps_completed": steps_completed, "committed_at": time.time(),
                    "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
                    "ds_config": engine.config, "client_state_keys": sorted(map(str, ours["client_state"]))}
        atomic_write_json(tag_dir / layout.COMMIT_FILE, metadata, default=repr)
        layout.set_latest(root, tag)
        deleted: list[str] = []
        if keep_last is not None:
            for old in layout.plan_keep_last(layout.scan_dir(root), keep_last=keep_last, just_written=tag):
                try:
                    layout.discard_tag(root, old)
                    deleted.append(old)
                except OSError as err:  # the new checkpoint is committed; do not fail the save
                    logger.warning("keep_last: could not delete %s: %s", Path(root) / old, err)
        return deleted

    deleted = _on_chief(ctx, commit)
    logger.info("checkpoint %r (steps_completed=%d) committed to %s in %.2f s%s", tag, steps_completed,
                root, time.monotonic() - started, f"; deleted {deleted}" if deleted else "")
    return tag


def load_checkpoint(engine: Any, checkpoint_dir: str | os.PathLike[str], *,
                    tag: str | None = None) -> tuple[int, dict[str, Any]] | None:
    """Load the latest (or the given) committed checkpoint into ``engine``. Call on all ranks.

    Before DeepSpeed reads anything, the checkpoint's metadata is compared with the engine: a
    different data-parallel size, ZeRO stage, tensor-parallel size, or pipeline layout raises,
    naming the fix (a DeepSpeed universal checkpoint). Then DeepSpeed loads the weights, optimizer
    and scheduler states, this rank's RNG states are restored, and DeepSpeed's CPU Adam kernels
    are brought to the step state an uninterrupted run has (their running ``beta**step`` products
    are not in the checkpoint; see :mod:`toolkit.checkpoint.cpu_adam`). The directory's run is adopted,
    so later :func:`save_checkpoint` calls into it continue that run.

    With ``"checkpoint": {"load_universal": true}`` in the DeepSpeed config, ``tag`` (or DeepSpeed's
    ``latest_universal`` file) names a universal checkpoint made by ``ds_to_universal``; it loads
    at any world size, and the RNG states are not restored (the ranks differ).

    Only load checkpoints from a trusted source: DeepSpeed's files are unpickled.

    Args:
        engine: a freshly initialised engine (under ZeRO-3 DeepSpeed cannot load into an engine
            that has saved since its creation).
        checkpoint_dir: the directory given to :func:`save_checkpoint`.
        tag: a committed checkpoint's tag; ``None`` follows ``latest`` (or takes the newest
            committed one when ``latest`` names none).

    Returns:
        ``(steps_completed, client_state)``, or ``None`` when the directory holds no committed
        checkpoint (a fresh start).

    Raises:
        CheckpointError: the tag is invalid, missing or not committed; the checkpoint does not
            fit the engine; or a rank's RNG file is missing. Raised on every rank.

    Example::

        # torchrun --nproc_per_node 2 train.py
        resumed = toolkit.load_checkpoint(engine, "checkpoints")
        steps_completed, state = resumed if resumed is not None else (0, {})
    """
    root = _root(checkpoint_dir)
    if tag is not None:
        layout.validate_name(tag)
    _check_engine(engine)
    ctx = get_context()
    facts = _engine_facts(engine, ctx)
    key = os.path.realpath(root)
    if engine.load_universal_checkpoint():
        return _load_universal(engine, ctx, root, tag, key)

    def choose() -> tuple[dict[str, Any] | None, str | None]:
        state = layout.scan_dir(root)
        info, warning = layout.resolve_tag(state, tag)
        if warning:
            logger.warning("%s", warning)
        if info is None:
            return None, state.run_id
        problems = layout.compatibility_problems(info.metadata, facts)
        if problems:
            raise CheckpointError(
                f"checkpoint {info.tag!r} in {root} does not fit this engine:\n  - " + "\n  - ".join(problems)
                + "\n" + layout.universal_fix(root, info.tag))
        return dict(info.metadata), state.run_id or info.metadata.get("run_id")

    metadata, dir_run = _on_chief(ctx, choose)
    if dir_run:
        _run_ids[key] = dir_run
    if metadata is None:
        logger.info("no committed checkpoint in %s: starting from scratch", root)
        return None
    tag = metadata["tag"]

    rng, rank_error = None, None
    path = _rng_path(root, tag, ctx.rank)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("rank") != ctx.rank or saved.get("world_size") != ctx.world_size:
            rank_error = (f"{path} holds rank {saved.get('rank')} of {saved.get('world_size')}, "
                          f"expected rank {ctx.rank} of {ctx.world_size}")
        rng = saved["rng"]
    except (OSError, RuntimeError, KeyError, AttributeError) as err:
        rank_error = f"cannot read this rank's RNG states {path}: {err}"
    _agree(ctx, rank_error, f"loading checkpoint {tag!r}")

    load_path, ds_state = engine.load_checkpoint(root, tag=tag)
    ours = _our_state(load_path, ds_state, root, tag)
    replay_cpu_adam_state(engine)  # the CPU Adam kernels' step state is not in the checkpoint
    restore_rng_state(rng)
    logger.info("loaded checkpoint %r (steps_completed=%d) from %s", tag, ours["steps_completed"], root)
    return int(ours["steps_completed"]), ours["client_state"]


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
    def choose() -> tuple[str, str | None]:
        chosen = tag
        if chosen is None:
            latest = Path(root) / "latest_universal"
            if not latest.is_file():
                raise CheckpointError(f"checkpoint.load_universal is set but no tag was given and {latest} "
                                      "does not exist; pass the tag of the ds_to_universal output folder")
            chosen = layout.validate_name(latest.read_text(encoding="utf-8").strip())
        if not (Path(root) / chosen / "zero").is_dir():
            raise CheckpointError(
                f"checkpoint.load_universal is set but {Path(root) / chosen} is not a universal checkpoint "
                f"(no zero/ folder); make one with `python -m deepspeed.checkpoint.ds_to_universal "
                f"--input_folder {Path(root) / chosen} --output_folder {Path(root) / chosen}_universal "
                "--inject_missing_state`")
        return chosen, layout.scan_dir(root).run_id

    chosen, dir_run = _on_chief(ctx, choose)
    load_path, ds_state = engine.load_checkpoint(root, tag=chosen)
    ours = _our_state(load_path, ds_state, root, chosen)
    replay_cpu_adam_state(engine)
    _run_ids[key] = dir_run or ours["run_id"]
    logger.warning("loaded universal checkpoint %r (steps_completed=%d); RNG states are not restored "
                   "across a layout change, so random streams differ from the original run",
                   chosen, ours["steps_completed"])
    return int(ours["steps_completed"]), ours["client_state"]


def consolidate_checkpoint(checkpoint_dir: str | os.PathLike[str], output_path: str | os.PathLike[str], *,
                           tag: str | None = None) -> str:
    """Write a committed checkpoint's weights as one plain fp32 ``state_dict`` file. Rank 0 only.

    Or any single process offline: it uses no collectives and needs no process group. ZeRO 1-3
    checkpoints go through DeepSpeed's ``zero_to_fp32`` (the fp32 master weights); ZeRO-0 ones
    give the module's weights; pipeline ones merge the layer files into keys ``<layer index>.<name>``,
    which is what ``torch.nn.Sequential(*layers).load_state_dict`` expects. Tensor-parallel
    checkpoints are not supported. DeepSpeed's files are unpickled: trusted checkpoints only.

    Args:
        checkpoint_dir: the directory given to :func:`save_checkpoint`.
        output_path: the file to write (``torch.save`` format), replaced atomically.
        tag: a committed checkpoint's tag; ``None`` for the latest.

    Returns:
        The tag consolidated.

    Example::

        # offline: python consolidate.py      (inside a training job: under `if ctx.is_chief:`)
        toolkit.consolidate_checkpoint("checkpoints", "model_fp32.pt")
        model.load_state_dict(torch.load("model_fp32.pt", weights_only=True))
    """
    root = _root(checkpoint_dir)
    if not isinstance(output_path, (str, os.PathLike)) or not os.fspath(output_path):
        raise CheckpointError(f"output_path={output_path!r}: expected a file path")
    output = Path(output_path)
    if output.is_dir():
        raise CheckpointError(f"output_path={str(output)!r} is a directory; expected a file path")
    info, warning = layout.resolve_tag(layout.scan_dir(root), tag)
    if warning:
        logger.warning("%s", warning)
    if info is None:
        raise CheckpointError(f"{root} holds no committed checkpoint to consolidate")
    meta, tag_dir = info.metadata, Path(root) / info.tag
    if meta.get("tensor_parallel_size", 1) != 1:
        raise CheckpointError(f"checkpoint {info.tag!r} is tensor parallel (size {meta['tensor_parallel_size']}); "
                              "consolidate it with DeepSpeed's universal checkpoint tools instead")
    if meta.get("pipeline"):
        state_dict = {}
        for path in sorted(tag_dir.glob("layer_*-model_states.pt")):
            index = int(path.name.split("-")[0][len("layer_"):])
            layer = torch.load(path, map_location="cpu", weights_only=True)
            state_dict.update({f"{index}.{name}": value for name, value in layer.items()})
    elif any(tag_dir.glob("*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state_dict = get_fp32_state_dict_from_zero_checkpoint(root, tag=info.tag)
    else:
        state_dict = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu",
                                weights_only=False)["module"]
    state_dict = {name: value.detach().float().contiguous() if value.is_floating_point() else value
                  for name, value in state_dict.items()}
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(output, lambda fh: torch.save(state_dict, fh))
    logger.info("consolidated checkpoint %r of %s into %s (%d tensors)", info.tag, root, output, len(state_dict))
    return info.tag
