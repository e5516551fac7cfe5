"""``core_context.checkpoint``: Determined's checkpoint calls, with toolkit's crash-safe commit.

Made by ``core.init``; layout and pure decisions in :mod:`toolkit.compat.determined.storage`,
buckets in :mod:`toolkit.compat.determined.cloud`. The commit, keeping and buckets:
docs/design-determined.md#checkpoints. Example (the Core API tutorials' pattern)::

    if core_context.distributed.rank == 0:                                   # shard=False: chief only
        with core_context.checkpoint.store_path({"steps_completed": steps}) as (path, storage_id):
            save_state(path)
    with core_context.checkpoint.store_path(meta, shard=True) as (path, _):  # all ranks
        engine.save_checkpoint(path)
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from toolkit import _names
from toolkit._checks import is_number
from toolkit._files import atomic_write_json, fsync_tree
from toolkit.checkpoint.stop_record import note_commit
from toolkit.compat.determined import cloud, storage
from toolkit.compat.determined.cloud import CloudRoot
from toolkit.compat.determined.core.distributed import DistributedContext
from toolkit.compat.determined.errors import CheckpointNotFound
from toolkit.errors import CheckpointError

__all__ = ["CheckpointContext", "DownloadMode", "merge_metadata"]

logger = logging.getLogger(__name__)


class DownloadMode(enum.Enum):
    LocalWorkersShareDownload = "LOCAL_WORKERS_SHARE_DOWNLOAD"
    NoSharedDownload = "NO_SHARED_DOWNLOAD"


def merge_metadata(parts: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Every rank's metadata merged as Determined does: dicts recursively, equal values once. Pure.
    Raises RuntimeError (Determined's message) when two ranks disagree on a key.

    Example:
        >>> merge_metadata([{"a": 1}, {"b": 2}, None])
        {'a': 1, 'b': 2}
    """
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in (part or {}).items():
            if key not in out:
                out[key] = value
            elif isinstance(out[key], dict) and isinstance(value, dict):
                out[key] = merge_metadata([out[key], value])
            elif out[key] != value:
                raise RuntimeError(
                    f"refusing to upload with metadata conflicts: {key!r}: {out[key]!r} != {value!r}"
                )
    return out


class CheckpointContext:
    """Store and restore checkpoints under the trial's checkpoint root. How:
    docs/design-determined.md#checkpoints."""

    def __init__(
        self, dist: DistributedContext, *, root: storage.Root, output_dir: Path,
        save_trial_latest: Any = None,
        before_store: Callable[[], None] | None = None, save_trial_best: Any = None,
        metric: str | None = None, smaller_is_better: bool = True,
    ) -> None:
        # save_trial_best: that many best checkpoints by ``metric`` (searcher.metric) validated at
        # their step (the trial's metrics.jsonl) are kept besides the newest save_trial_latest.
        # before_store: the metrics files' flush, so that every report made before a checkpoint
        # is on disk once the checkpoint is (a crash loses neither one without the other).
        self._before_store = before_store
        self._dist = dist
        self._root: storage.Root = root if isinstance(root, CloudRoot) else Path(root)
        self._output_dir = Path(output_dir)
        self._save_trial_latest = save_trial_latest
        self._save_trial_best, self._metric, self._smaller = save_trial_best, metric, smaller_is_better
        if dist.rank == 0:
            if isinstance(self._root, CloudRoot):  # wrong keys or endpoint fail here, before training
                self._root.store.check_access(f".toolkit-probe-{uuid.uuid4().hex}")
            self._clean_pending()

    def _clean_pending(self) -> None:
        """Remove what interrupted ``store_path`` calls left: recorded, toolkit-made, uncommitted."""
        registry = storage.read_registry(self._output_dir)
        for sid in registry["pending"]:
            if isinstance(self._root, CloudRoot):
                shutil.rmtree(cloud.staging_dir(self._root, str(sid)), ignore_errors=True)
            if storage.is_committed(self._root, sid):
                continue
            try:
                if storage.remove_checkpoint(self._root, sid):
                    logger.info("removed %s, a checkpoint an interrupted store_path left incomplete", sid)
            except CheckpointError as err:
                logger.warning("%s: left alone, not a pending checkpoint of toolkit's: %s",
                               self._output_dir / storage.REGISTRY_NAME, err)
        if registry["pending"]:
            registry["pending"] = []
            storage.write_registry(self._output_dir, registry)

    def _begin(self) -> str:
        storage_id = str(uuid.uuid4())
        registry = storage.read_registry(self._output_dir)
        registry["root"] = str(self._root) if isinstance(self._root, CloudRoot) else str(self._root.resolve())
        registry["pending"].append(storage_id)
        storage.write_registry(self._output_dir, registry)
        if not isinstance(self._root, CloudRoot):
            (self._root / storage_id).mkdir(parents=True, exist_ok=False)
        return storage_id

    def _path(self, storage_id: str) -> Path:
        """Where the block writes: the checkpoint's directory, or the cloud upload's staging one."""
        if isinstance(self._root, CloudRoot):
            path = cloud.staging_dir(self._root, storage_id)
            path.mkdir(parents=True, exist_ok=True)
            return path
        return self._root / storage_id

    def _upload(self, path: Path, storage_id: str, shard: bool) -> None:
        """Cloud only: the chief (or each machine's local rank 0 with ``shard``) uploads the staging
        directory; every rank raises if any upload failed. All ranks with ``shard``, else the chief."""
        assert isinstance(self._root, CloudRoot)
        error = None
        if not shard or self._dist.local_rank == 0:
            try:
                cloud.upload_dir(self._root, path, storage_id)
            except CheckpointError as err:
                error = str(err)
            finally:
                shutil.rmtree(path, ignore_errors=True)
        failed = [e for e in (self._dist.allgather(error) if shard else [error]) if e]
        if failed:
            raise CheckpointError(f"checkpoint {storage_id} was not committed: {failed[0]}")

    def _commit(self, storage_id: str, metadata: dict[str, Any]) -> None:
        if isinstance(self._root, CloudRoot):
            self._root.store.write(f"{storage_id}/{storage.METADATA_NAME}",
                                   (json.dumps(metadata, indent=2, sort_keys=True) + "\n").encode())
        else:
            fsync_tree(self._root / storage_id)
            atomic_write_json(self._root / storage_id / storage.METADATA_NAME, metadata)
        registry = storage.read_registry(self._output_dir)
        registry["pending"] = [s for s in registry["pending"] if s != storage_id]
        registry["committed"].append(
            {
                "storage_id": storage_id,
                "steps_completed": metadata.get("steps_completed"),
                "time": time.time(),
            }
        )
        doomed = storage.plan_gc(registry["committed"], self._save_trial_latest,
                                 save_trial_best=self._save_trial_best,
                                 metrics=self._scores(registry["committed"]), smaller_is_better=self._smaller)
        registry["committed"] = [e for e in registry["committed"] if e["storage_id"] not in doomed]
        storage.write_registry(self._output_dir, registry)
        for sid in doomed:
            try:
                storage.remove_checkpoint(self._root, sid)
            except CheckpointError as err:  # the new checkpoint is committed; do not fail the save
                logger.warning("save_trial_latest/save_trial_best: left %s alone: %s", _names.shown(sid), err)
        logger.info("saved checkpoint %s", storage_id)
        steps = metadata.get("steps_completed")  # after an agreed stop: the stop record, last
        note_commit(str(self._root), storage_id, steps if isinstance(steps, int) else None, None)

    def _scores(self, committed: list[dict[str, Any]]) -> dict[str, float]:
        """Storage id -> the searcher metric last validated at its steps_completed (for save_trial_best)."""
        if not self._save_trial_best or not self._metric:
            return {}
        by_step: dict[Any, float] = {}
        try:
            with open(self._output_dir / "metrics.jsonl", encoding="utf-8") as lines:
                for line in lines:
                    try:
                        row = json.loads(line)
                        value = row["metrics"][self._metric] if row.get("group") == "validation" else None
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn or foreign line: no score from it
                    if is_number(value) and math.isfinite(value):
                        by_step[row.get("steps_completed")] = float(value)
        except OSError:
            return {}
        return {str(e["storage_id"]): by_step[e.get("steps_completed")] for e in committed
                if e.get("steps_completed") in by_step}

    @contextlib.contextmanager
    def store_path(
        self, metadata: dict[str, Any] | None = None, *, shard: bool = False
    ) -> Iterator[tuple[Path, str]]:
        """A new checkpoint directory ``<root>/<uuid>/`` to write into, committed when the block ends (not
        if it raises). ``shard=False``: chief only. ``shard=True``: all ranks, one directory, the commit
        after every rank's block. Unlike Determined's, a crash at any moment leaves the previous checkpoint
        the latest. Raises RuntimeError for ``shard=False`` off rank 0, or metadata that conflicts across
        ranks."""
        if not shard and self._dist.rank != 0:
            raise RuntimeError(
                "cannot call CheckpointContext.store_path(shard=False) from non-chief worker "
                f"(rank={self._dist.rank})"
            )
        if self._dist.rank == 0 and self._before_store is not None:
            self._before_store()
        storage_id = self._begin() if self._dist.rank == 0 else ""
        if shard:
            storage_id = storage.check_storage_id(self._dist.broadcast(storage_id), error=CheckpointError)
        path = self._path(storage_id)
        yield path, storage_id
        parts = self._dist.allgather(metadata) if shard else [metadata]
        if isinstance(self._root, CloudRoot):
            self._upload(path, storage_id, shard)
        if self._dist.rank == 0:
            self._commit(storage_id, merge_metadata(parts))
        if shard:
            self._dist.broadcast(None)  # every rank returns once the checkpoint is committed

    def upload(
        self,
        ckpt_dir: str | os.PathLike[str] | None,
        metadata: dict[str, Any] | None = None,
        *,
        shard: bool = False,
        selector: Callable[[str], bool] | None = None,
    ) -> str:
        """Copy a directory into storage as a new checkpoint; its storage id. ``shard=False``: chief only;
        ``shard=True``: all ranks, those with nothing to add pass None."""
        if not shard and ckpt_dir is None:
            raise ValueError("upload(ckpt_dir=None) is only allowed with shard=True")
        with self.store_path(metadata, shard=shard) as (path, storage_id):
            if ckpt_dir is not None:
                _copy(Path(ckpt_dir), path, selector)
        return storage_id

    def _committed_dir(self, storage_id: str) -> Path:
        """The committed checkpoint's directory, inside the root (for a cloud root: its name).
        Raises ConfigError for an unsafe id, CheckpointNotFound for no committed checkpoint."""
        storage.check_storage_id(storage_id)
        if not storage.is_committed(self._root, storage_id):
            raise CheckpointNotFound(
                f"Did not find checkpoint {storage_id} in {self._root} (or it was never "
                "committed: its store_path did not finish)"
            )
        return Path(storage_id) if isinstance(self._root, CloudRoot) else self._root / storage_id

    def _fetch(self, storage_id: str, target: Path | None, shared: bool,
               selector: Callable[[str], bool] | None) -> Path:
        """Cloud only: download into ``target`` (None: a fresh cache directory), once per machine
        when ``shared`` (all local ranks call), else on this rank alone; raises where any failed."""
        assert isinstance(self._root, CloudRoot)
        root = self._root
        error, path = None, target
        if not shared or self._dist.local_rank == 0:
            try:
                path = target or cloud.fresh_local_dir(root, f"det-restore-{storage_id}")
                cloud.download_dir(root, storage_id, path, selector)
            except (CheckpointError, OSError) as err:
                error = f"downloading checkpoint {storage_id} from {root}: {err}"
        if shared:
            found = self._dist.allgather_local((error, str(path) if path else None))
            error = next((e for e, _ in found if e), None)
            path = Path(found[0][1]) if found[0][1] else None
        if error or path is None:
            raise CheckpointError(error or f"downloading checkpoint {storage_id} from {root} failed")
        return path

    @contextlib.contextmanager
    def restore_path(
        self,
        storage_id: str,
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> Iterator[Path]:
        """The committed checkpoint's directory itself, no copy (Determined's shared_fs behaviour; from a
        bucket: downloaded into the cache, removed after the block). Any rank. Raises CheckpointNotFound."""
        shared = DownloadMode(download_mode) is DownloadMode.LocalWorkersShareDownload
        directory = self._committed_dir(storage_id)
        if not isinstance(self._root, CloudRoot):
            if selector is not None:
                logger.warning("restore_path: selector ignored, the checkpoint is read in place")
            yield directory
            return
        path = self._fetch(storage_id, None, shared, selector)
        try:
            yield path
        finally:
            if shared:
                self._dist.allgather_local(None)  # every local rank is done with the files
            if not shared or self._dist.local_rank == 0:
                shutil.rmtree(path, ignore_errors=True)

    def download(
        self,
        storage_id: str,
        ckpt_dir: str | os.PathLike[str],
        download_mode: DownloadMode = DownloadMode.LocalWorkersShareDownload,
        *,
        selector: Callable[[str], bool] | None = None,
    ) -> None:
        """Copy a committed checkpoint into ``ckpt_dir``. All ranks (default mode; local rank 0
        copies) or any rank alone (``NoSharedDownload``)."""
        shared = DownloadMode(download_mode) is DownloadMode.LocalWorkersShareDownload
        source = self._committed_dir(storage_id)
        if isinstance(self._root, CloudRoot):
            self._fetch(storage_id, Path(ckpt_dir), shared, selector)
            return
        if not shared or self._dist.local_rank == 0:
            _copy(source, Path(ckpt_dir), selector, links=False)
        if shared:
            self._dist.allgather_local(None)

    def get_metadata(self, storage_id: str) -> dict[str, Any]:
        """The checkpoint's metadata. Any rank."""
        return storage.read_metadata(self._root, self._committed_dir(storage_id).name)

    def delete(self, storage_id: str) -> None:
        """Remove a checkpoint this trial committed: from its registry, then from disk. Any rank. Raises
        ConfigError for an unsafe id, CheckpointNotFound for one not in the registry (nothing deleted)."""
        storage.check_storage_id(storage_id)
        registry = storage.read_registry(self._output_dir)
        kept = [e for e in registry["committed"] if e["storage_id"] != storage_id]
        if len(kept) == len(registry["committed"]):
            raise CheckpointNotFound(
                f"checkpoint {storage_id} is not one this trial committed "
                f"({self._output_dir / storage.REGISTRY_NAME}); toolkit deletes only those"
            )
        registry["committed"] = kept
        storage.write_registry(self._output_dir, registry)
        storage.remove_checkpoint(self._root, storage_id)


def _copy(source: Path, target: Path, selector: Callable[[str], bool] | None, *, links: bool = True) -> None:
    """Copy the files under ``source``; ``links=False`` (out of the storage) skips symlinks, whose
    targets are not part of the checkpoint."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source).as_posix()
        if not links and path.is_symlink():
            logger.warning("download: skipped %s, a symlink in the checkpoint", path)
            continue
        if path.is_dir() or (selector is not None and not selector(rel)):
            continue
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target / rel)
