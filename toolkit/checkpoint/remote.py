"""toolkit checkpoints in a bucket: staged on local disk, uploaded, committed by their record last.

:func:`save` and :func:`load` are what ``save_checkpoint`` and ``load_checkpoint`` do for an
``s3://`` or ``gs://`` URL (call on all ranks), with the layout and the pure decisions of
:mod:`toolkit.checkpoint.layout`: each rank uploads its own files, then the chief writes the commit
record and ``latest``; a load downloads once per machine into :func:`cache_dir`. The protocol and
its failure cases: docs/object-storage.md."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from toolkit import _names, preemption
from toolkit.checkpoint import api, layout, records
from toolkit.checkpoint.engine import engine_facts
from toolkit.checkpoint.ranks import agree, on_chief
from toolkit.checkpoint.stop_record import note_remote_commit
from toolkit.checkpoint.store import ObjectStore, StoreURL, open_store
from toolkit.errors import CheckpointError, ConfigError
from toolkit.runtime.context import DistributedContext

__all__ = ["save", "load", "load_url", "scan_store", "cache_dir", "GRACE_ENV"]

logger = logging.getLogger(__name__)

#: Seconds a scheduler grants between its stop signal and its kill; the upload after a preemption is
#: logged against it (30 s by default: Kubernetes' and GCP spot VMs' grace).
GRACE_ENV = "TOOLKIT_PREEMPTION_GRACE"
CACHE_ENV = "TOOLKIT_CACHE_DIR"


def cache_dir(url: StoreURL) -> Path:
    """This machine's directory for ``url``'s staging and downloads (docs/object-storage.md, The local
    cache). Any rank."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "toolkit")
    digest = hashlib.sha256(url.url.encode()).hexdigest()[:12]
    return Path(base) / "checkpoints" / f"{url.bucket}-{digest}"


def scan_store(store: ObjectStore) -> tuple[layout.DirState, dict[str, int]]:
    """The bucket prefix as a DirState, and every file's size: one listing, then the reads of ``latest``,
    the run record and each commit record. Any rank."""
    files = store.list_files()
    tag_entries: dict[str, set[str]] = {}
    for rel in files:
        tag, _, rest = rel.partition("/")
        if rest and not _names.name_problem(tag):
            tag_entries.setdefault(tag, set()).add(rest.partition("/")[0])
    tags = {}
    for tag, entries in sorted(tag_entries.items()):
        metadata = None
        if layout.COMMIT_FILE in entries:
            metadata = _record(store, f"{tag}/{layout.COMMIT_FILE}")
            problem = None if metadata is None else records.commit_problem(metadata, tag)
            if problem:
                raise CheckpointError(f"{store.where(tag)}/{layout.COMMIT_FILE}: {problem}; the record is "
                                      "damaged or not toolkit's: delete that prefix or load another tag")
        tags[tag] = layout.TagInfo(tag=tag, entries=tuple(sorted(entries)), metadata=metadata)
    latest, latest_problem = None, None
    if layout.LATEST_FILE in files:
        raw = store.read(layout.LATEST_FILE, _names.MAX_NAME + 2)
        if raw is not None:
            latest, latest_problem = records.parse_pointer(raw, store.where(layout.LATEST_FILE))
    run = _record(store, layout.RUN_FILE) if layout.RUN_FILE in files else None
    return layout.DirState(root=store.where(), run=run, latest=latest, tags=tags,
                           latest_problem=latest_problem), files


def _record(store: ObjectStore, rel: str) -> dict[str, Any] | None:
    raw = store.read(rel, records.MAX_RECORD + 1)
    return None if raw is None else records.parse_record(raw, store.where(rel))


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, default=repr) + "\n").encode()


def _discard(store: ObjectStore, files: dict[str, int], tag: str) -> None:
    """Delete a tag: its commit record first (no longer a checkpoint), the started marker last (a
    crash in between leaves an interrupted save, which the next save cleans up)."""
    mine = [rel for rel in files if rel.startswith(tag + "/")]
    first, last = f"{tag}/{layout.COMMIT_FILE}", f"{tag}/{layout.STARTED_FILE}"
    store.delete([first] if first in files else [])
    store.delete([rel for rel in mine if rel not in (first, last)])
    store.delete([last] if last in files else [])


def _long_barrier(ctx: DistributedContext) -> None:
    """One barrier with the process group's long timeout (uploads and downloads take long)."""
    with ctx.chief_first():
        pass


# ---------------------------------------------------------------------------------------------- save

def save(engine: Any, ctx: DistributedContext, request: Any, store: ObjectStore, *, mine: str | None,
         overwrite: bool) -> tuple[str, list[str]]:
    """Stage, upload and commit one checkpoint (``request``: api's checked ``_Save``); returns the run id
    and the tags ``keep_last`` deleted. CheckpointError on every rank if any write or upload failed.
    Call on all ranks."""
    tag = request.tag

    def prepare() -> tuple[str, int, str, int]:
        state, files = scan_store(store)
        plan = layout.plan_save(state, tag=tag, mine=mine, overwrite=overwrite)
        for warning in plan.warnings:
            logger.warning("%s", warning)
        for note in plan.notes:
            logger.info("%s", note)
        if plan.write_run_file:
            store.write(layout.RUN_FILE, _json({"run_id": plan.run_id, "created_at": time.time(),
                                                "world_size": ctx.world_size}))
        if plan.remove_latest:
            store.delete([layout.LATEST_FILE])
        elif plan.new_latest is not None:
            store.write(layout.LATEST_FILE, plan.new_latest.encode())
        for old in plan.discard:
            _discard(store, files, old)
        store.write(f"{tag}/{layout.STARTED_FILE}", _json({
            "run_id": plan.run_id, "tag": tag, "steps_completed": request.steps_completed,
            "started_at": time.time()}))
        return plan.run_id, plan.seq, tag, request.steps_completed

    # slow: the chief's calls to the bucket may outlast the short collective timeout
    this_run, seq = api._agree_on_tag(ctx, request, on_chief(ctx, prepare, slow=True))
    stage = cache_dir(store.url) / f"stage-{this_run}-{tag}" / f"rank_{ctx.rank:05d}"
    try:
        shutil.rmtree(stage, ignore_errors=True)
        try:
            (stage / tag / layout.RNG_DIR).mkdir(parents=True)
        except OSError:  # the writes below fail too, and every rank learns it there, together
            pass
        api._write_on_every_rank(engine, ctx, dataclasses.replace(request, root=str(stage)), this_run,
                                 flush=False)
        seconds = _upload_own_files(ctx, store, stage, tag)
        deleted = on_chief(ctx, lambda: _commit(engine, store, request, this_run, seq), slow=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        try:
            stage.parent.rmdir()  # the last rank of this machine to get here removes it
        except OSError:
            pass
    _log_upload(ctx, tag, store, seconds)
    return this_run, deleted


def _upload_own_files(ctx: DistributedContext, store: ObjectStore, stage: Path, tag: str) -> float:
    """Every rank uploads what it wrote; raises on every rank if one failed. The seconds taken
    by the slowest rank (as the chief saw them). Call on all ranks."""
    started = time.monotonic()
    pairs = [(str(path), path.relative_to(stage).as_posix())
             for path in sorted((stage / tag).rglob("*")) if path.is_file()]
    error = None
    try:
        store.upload(pairs)
    except CheckpointError as err:
        error = str(err)
    _long_barrier(ctx)
    agree(ctx, error, f"uploading checkpoint {tag!r} to {store.where()}")
    return time.monotonic() - started


def _commit(engine: Any, store: ObjectStore, request: Any, this_run: str, seq: int) -> list[str]:
    """Chief only: the commit record, then ``latest``, then ``keep_last`` (failures there logged)."""
    tag = request.tag
    store.write(f"{tag}/{layout.COMMIT_FILE}", _json(api._commit_metadata(engine, request, this_run, seq)))
    store.write(layout.LATEST_FILE, tag.encode())
    deleted: list[str] = []
    if request.keep_last is not None:
        try:
            state, files = scan_store(store)
            for old in layout.plan_keep_last(state, keep_last=request.keep_last, just_written=tag):
                _discard(store, files, old)
                deleted.append(old)
        except CheckpointError as err:  # the new checkpoint is committed; do not fail the save
            logger.warning("keep_last: could not delete older checkpoints in %s: %s", store.where(), err)
    note_remote_commit(store, tag, request.steps_completed, this_run)  # after a stop: the record, last
    return deleted


def _log_upload(ctx: DistributedContext, tag: str, store: ObjectStore, seconds: float) -> None:
    """The chief logs the upload time; after a preemption, against the grace ($TOOLKIT_PREEMPTION_GRACE)."""
    if not ctx.is_chief:
        return
    since = preemption.seconds_since_stop()
    if since is None:
        logger.info("checkpoint %r uploaded to %s in %.2f s", tag, store.where(), seconds)
        return
    try:
        grace = float(os.environ.get(GRACE_ENV) or 30.0)
    except ValueError:
        grace = 30.0
    level = logging.WARNING if since > 0.8 * grace else logging.INFO
    logger.log(level, "checkpoint %r uploaded to %s in %.2f s, committed %.1f s after the preemption was "
               "agreed, of a %g s grace (%s)%s", tag, store.where(), seconds, since, grace, GRACE_ENV,
               "; the next preemption may kill the upload: save more often or keep the model smaller"
               if level == logging.WARNING else "")


# ---------------------------------------------------------------------------------------------- load

def load_url(engine: Any, ctx: DistributedContext, url: StoreURL, tag: str | None,
             run_ids: dict[str, str]) -> tuple[int, dict[str, Any]] | None:
    """:func:`toolkit.load_checkpoint` from a bucket; adopts its run in ``run_ids``. All ranks."""
    if engine.load_universal_checkpoint():
        raise ConfigError(f"checkpoint.load_universal=true with {url.url}: universal checkpoints load from a "
                          "local directory only; download the ds_to_universal output and pass its directory")
    loaded, dir_run = load(engine, ctx, open_store(url), tag, engine_facts(engine, ctx))
    run_ids.update({url.url: dir_run} if dir_run else {})
    return loaded


def load(engine: Any, ctx: DistributedContext, store: ObjectStore, tag: str | None,
         facts: dict[str, Any]) -> tuple[tuple[int, dict[str, Any]] | None, str | None]:
    """Choose, download and load the latest (or given) committed checkpoint: ``(loaded or None, run id)``.
    The chief first writes a probe object, so wrong credentials fail before training. All ranks."""
    def choose() -> tuple[str | None, str | None, list[str], str]:
        store.check_access(f".toolkit-probe-{uuid.uuid4().hex}")
        state, files = scan_store(store)
        info, warning = layout.resolve_tag(state, tag)
        if warning:
            logger.warning("%s", warning)
        if info is None:
            return None, state.run_id, [], ""
        problems = layout.compatibility_problems(info.meta, facts)
        if problems:
            raise CheckpointError(f"checkpoint {info.tag!r} in {store.where()} does not fit this "
                                  "engine:\n  - " + "\n  - ".join(problems) + "\nRestart with the saved "
                                  "layout, or download it and convert it into a universal checkpoint "
                                  "(docs/training.md)")
        names = sorted(rel for rel in files if rel.startswith(info.tag + "/"))
        unsafe = [rel for rel in names if not _safe_rel(rel)]
        if unsafe:
            raise CheckpointError(f"{store.where(unsafe[0])}: not a name toolkit or DeepSpeed writes (each "
                                  "part: letters, digits, '.', '_', '-'); it is not downloaded, nor is the "
                                  f"checkpoint {info.tag!r}: delete the object or load another tag")
        return info.tag, state.run_id or info.meta.get("run_id"), names, uuid.uuid4().hex[:12]

    chosen, dir_run, names, nonce = on_chief(ctx, choose, slow=True)
    if chosen is None:
        logger.info("no committed checkpoint in %s: starting from scratch", store.where())
        return None, dir_run
    _names.check_name(chosen, what="tag")
    local = cache_dir(store.url) / f"restore-{nonce}-node{ctx.node_rank}"
    started = time.monotonic()
    error = None
    mine = names[ctx.local_rank::max(1, ctx.local_world_size)]  # the node's ranks share the download
    try:
        store.download([(rel, str(local / rel)) for rel in mine if _safe_rel(rel)])  # checked: all
    except CheckpointError as err:
        error = str(err)
    _long_barrier(ctx)
    agree(ctx, error, f"downloading checkpoint {chosen!r} from {store.where()}")
    if ctx.is_chief:
        logger.info("downloaded checkpoint %r from %s in %.2f s", chosen, store.where(),
                    time.monotonic() - started)
    loaded = api._load_committed(engine, ctx, str(local), chosen)
    _long_barrier(ctx)
    if ctx.is_local_chief:
        shutil.rmtree(local, ignore_errors=True)
    return loaded, dir_run


def _safe_rel(rel: str) -> bool:
    """A relative object path made of safe components only (never leaves the download directory)."""
    return all(not _names.name_problem(part) for part in rel.split("/"))
