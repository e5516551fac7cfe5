"""Where Core API checkpoints live, and which of them are committed. Pure decisions, thin file effects.

Called by :mod:`toolkit.compat.determined.core.checkpoint` and ``info``. The layout
(``<root>/<storage_id>/``, ``metadata.json`` as the commit, the trial's registry
``determined_checkpoints.json``) and the rules for ids: docs/design-determined.md#checkpoints.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

from toolkit import _names
from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.compat.determined import cloud
from toolkit.compat.determined.cloud import CloudRoot
from toolkit.config.checkpoint_storage import checkpoint_storage_problems, keep_count_problem
from toolkit.errors import CheckpointError, ConfigError

__all__ = [
    "REGISTRY_NAME",
    "METADATA_NAME",
    "storage_root",
    "read_registry",
    "write_registry",
    "check_storage_id",
    "is_toolkit_id",
    "checkpoint_path",
    "latest_storage_id",
    "is_committed",
    "read_metadata",
    "plan_gc",
    "remove_checkpoint",
    "root_from_registry",
    "Root",
]

logger = logging.getLogger(__name__)

REGISTRY_NAME = "determined_checkpoints.json"
METADATA_NAME = "metadata.json"
Root = Path | CloudRoot


def storage_root(storage: Any, *, output_dir: Path, base_dir: Path) -> Root:
    """Where checkpoints go, from ``checkpoint_storage`` (YAML or ``core.init``). Pure. None:
    ``<output_dir>/checkpoints``; a path or an ``s3://``/``gs://`` URL; a mapping of ``type: shared_fs``,
    ``directory``, ``s3`` or ``gcs`` as Determined's (not azure), or toolkit's own ``storage_path``.
    Relative paths from ``base_dir``. Raises ConfigError, each problem named."""
    problems = checkpoint_storage_problems(storage)
    if problems:
        raise ConfigError(problems)
    if storage is None:
        return output_dir / "checkpoints"
    if isinstance(storage, str):
        if storage.startswith(("s3://", "gs://", "gcs://")):
            return cloud.url_root(storage)
        return base_dir / storage.removeprefix("file://")
    kind = storage.get("type")
    if kind is None and not any(storage.get(k) for k in ("host_path", "storage_path", "container_path")):
        return output_dir / "checkpoints"  # only policy keys such as save_trial_latest
    if kind in ("s3", "gcs"):
        return cloud.cloud_root(storage)
    if kind == "directory":
        return base_dir / storage["container_path"]
    host, sub = storage.get("host_path"), storage.get("storage_path")
    return base_dir / (str(Path(host) / sub) if host and sub else (host or sub))


def root_from_registry(recorded: Any, configured: Root) -> Root:
    """Where a trial's registry says its checkpoints went (``core.init(checkpoint_storage=...)`` may
    differ from the YAML): the configured root when it is the same place (its credentials kept)."""
    if not isinstance(recorded, str) or not recorded:
        return configured
    same_dir = isinstance(configured, Path) and str(configured.resolve()) == recorded
    if str(configured) == recorded or same_dir:
        return configured
    return cloud.url_root(recorded) if "://" in recorded else Path(recorded)


def read_registry(output_dir: Path) -> dict[str, Any]:
    """This trial's registry (``committed``, ``pending``); empty lists when none yet. Any rank.
    Raises CheckpointError naming a damaged file."""
    path = output_dir / REGISTRY_NAME
    damaged = ("; the registry is damaged: move it aside to start the trial's checkpoint list afresh "
               "(the checkpoints stay in the storage)")
    try:
        data = load_json(path, what="checkpoint registry", expect_object=False)
    except FileNotFoundError:
        data = {}
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}{damaged}") from err
    data = data if isinstance(data, dict) else {"committed": None}
    committed, pending = data.get("committed", []), data.get("pending", [])
    if not (isinstance(committed, list) and isinstance(pending, list)
            and all(isinstance(e, dict) and "storage_id" in e for e in committed)):
        raise CheckpointError(f"{path} is not a checkpoint registry (expected an object with lists "
                              f"'committed' of {{'storage_id': ...}} and 'pending'){damaged}")
    return {"root": data.get("root"), "committed": list(committed), "pending": list(pending)}


def write_registry(output_dir: Path, registry: Mapping[str, Any]) -> None:
    """Atomically replace the registry (chief only)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output_dir / REGISTRY_NAME, dict(registry))


def check_storage_id(storage_id: Any, *, error: type[Exception] = ConfigError) -> str:
    """``storage_id`` if it is a safe name (:mod:`toolkit._names`), else ``error`` (ConfigError for an id
    the script passed, CheckpointError for one from disk or another rank). Any rank."""
    return _names.check_name(storage_id, what="storage_id", error=error,
                             example="5f0c3f4e-8d2a-4c53-9a8e-2b1d7c6e9f10")


def is_toolkit_id(storage_id: Any) -> bool:
    """True for an id of the form toolkit gives its checkpoints (a canonical UUID). Pure."""
    try:
        return isinstance(storage_id, str) and str(uuid.UUID(storage_id)) == storage_id
    except ValueError:
        return False


def checkpoint_path(root: Path, storage_id: Any) -> Path:
    """``<root>/<storage_id>`` (need not exist) once the id is safe and the path, symlinks resolved, stays
    inside ``root``; else CheckpointError. Any rank."""
    _names.resolve_inside(root, check_storage_id(storage_id, error=CheckpointError), what="storage_id")
    return root / storage_id


def is_committed(root: Root, storage_id: Any) -> bool:
    """True when ``<root>/<storage_id>`` holds a complete checkpoint (its metadata.json, a plain
    file) and the id is safe and stays inside ``root``. Any rank."""
    if isinstance(root, CloudRoot):
        return _names.name_problem(storage_id) is None and cloud.committed(root, storage_id)
    try:
        metadata = checkpoint_path(root, storage_id) / METADATA_NAME
    except CheckpointError:
        return False
    return metadata.is_file() and not metadata.is_symlink()


def latest_storage_id(registry: Mapping[str, Any], root: Root) -> str | None:
    """The newest committed checkpoint of the registry that is still on disk, or None. Any rank."""
    for entry in reversed(registry["committed"]):
        if is_committed(root, entry["storage_id"]):
            return str(entry["storage_id"])
    return None


def read_metadata(root: Root, storage_id: str) -> dict[str, Any]:
    """The checkpoint's metadata.json. Any rank. Raises FileNotFoundError for a partial one,
    CheckpointError for an unsafe id, a symlink out of ``root`` or a damaged file."""
    if isinstance(root, CloudRoot):
        return cloud.read_metadata(root, check_storage_id(storage_id, error=CheckpointError))
    path = checkpoint_path(root, storage_id) / METADATA_NAME
    try:
        data = load_json(path, what="checkpoint metadata", expect_object=False)
    except ValueError as err:  # ConfigError too: a bound, a bad encoding, malformed
        raise CheckpointError(f"cannot read {path}: {err}; the checkpoint's metadata is damaged") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds {type(data).__name__}, expected a JSON object")
    return data


def _keep_count(key: str, value: Any) -> int:
    problem = keep_count_problem(key, value)
    if problem:
        raise ConfigError(problem)
    return int(value)


def plan_gc(committed: list[dict[str, Any]], save_trial_latest: Any, *, save_trial_best: Any = None,
            metrics: Mapping[str, float] | None = None, smaller_is_better: bool = True) -> list[str]:
    """Storage ids to delete: all but the newest ``save_trial_latest`` (at least 1) and the
    ``save_trial_best`` best by ``metrics`` (id -> the metric validated at its step). Pure. Both None
    keeps all; ``save_trial_best`` alone keeps the newest too (Determined's default latest: 1).

    Example:
        >>> plan_gc([{"storage_id": "a"}, {"storage_id": "b"}, {"storage_id": "c"}], 2)
        ['a']
    """
    if save_trial_latest is None and save_trial_best is None:
        return []
    latest = 1 if save_trial_latest is None else _keep_count("save_trial_latest", save_trial_latest)
    best = 0 if save_trial_best is None else _keep_count("save_trial_best", save_trial_best)
    ids = [str(e["storage_id"]) for e in committed]
    keep = set(ids[-max(1, latest):])
    sign = 1.0 if smaller_is_better else -1.0
    scored = [sid for sid in ids if sid in (metrics or {})]
    keep.update(sorted(scored, key=lambda sid: sign * float((metrics or {})[sid]))[:best])
    return [sid for sid in ids if sid not in keep]


def remove_checkpoint(root: Root, storage_id: Any) -> bool:
    """Delete a checkpoint directory toolkit made, metadata.json first (uncommit). Any rank. Only a
    canonical UUID naming a real directory directly inside ``root``; False when there is none.
    Raises CheckpointError for another id, or a symlink or file where the directory should be."""
    check_storage_id(storage_id, error=CheckpointError)
    if not is_toolkit_id(storage_id):
        raise CheckpointError(f"storage_id={_names.shown(storage_id)} is not an id toolkit gives its "
                              "checkpoints (a UUID); toolkit deletes only checkpoints it created")
    if isinstance(root, CloudRoot):
        removed = cloud.remove(root, storage_id)
        logger.info("deleted checkpoint %s from %s", storage_id, root)
        return removed
    directory = _names.real_child(root, storage_id, what="storage_id")
    if directory is None:
        return False
    (directory / METADATA_NAME).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    logger.info("deleted checkpoint %s", storage_id)
    return True
