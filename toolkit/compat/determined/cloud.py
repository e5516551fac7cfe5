"""Determined's ``checkpoint_storage`` of ``type: s3`` and ``type: gcs``: a bucket prefix as a storage root.

Any rank; which rank uploads, the commit and the keys: docs/design-determined.md#checkpoints
(core/checkpoint.py calls it). Example::

    root = cloud_root({"type": "s3", "bucket": "ckpts", "prefix": "exp1"})
    committed(root, storage_id)        # True once metadata.json is in the bucket
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from toolkit import _names
from toolkit.bounded_load import parse_json
from toolkit.checkpoint import store
from toolkit.checkpoint.remote import cache_dir
from toolkit.errors import CheckpointError, ConfigError

__all__ = ["CloudRoot", "cloud_root", "committed", "read_metadata", "remove", "upload_dir",
           "download_dir", "staging_dir"]

METADATA_NAME = "metadata.json"


@dataclasses.dataclass(frozen=True)
class CloudRoot:
    """A bucket prefix holding a trial's checkpoints; its credentials never appear in ``repr``."""

    url: store.StoreURL
    options: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False, compare=False)

    def __str__(self) -> str:
        return self.url.url

    @property
    def store(self) -> store.ObjectStore:
        return store.open_store(self.url, dict(self.options))


def cloud_root(section: Mapping[str, Any]) -> CloudRoot:
    """The :class:`CloudRoot` of an s3/gcs ``checkpoint_storage`` mapping. Pure (no connection).

    Raises:
        ConfigError: every problem of the section (a missing bucket, a bad prefix, a key alone).
    """
    problems = store.bucket_section_problems(section)
    if problems:
        raise ConfigError(problems)
    scheme = "s3" if section["type"] == "s3" else "gs"
    prefix = str(section.get("prefix") or "").strip("/")
    url = url_root(f"{scheme}://{section['bucket']}" + (f"/{prefix}" if prefix else "")).url
    options: dict[str, str] = {}
    if section.get("access_key"):
        options.update(key=section["access_key"], secret=section["secret_key"])
    if section.get("endpoint_url"):
        options["endpoint_url"] = section["endpoint_url"]
    return CloudRoot(url, tuple(sorted(options.items())))


def url_root(url: str) -> CloudRoot:
    """A ``s3://``/``gs://`` string (``core.init(checkpoint_storage=...)``, a registry's root)."""
    parsed = store.parse_url(url, what="checkpoint_storage")
    if parsed is None:
        raise ConfigError(f"checkpoint_storage={_names.shown(url)}: expected an s3:// or gs:// URL")
    return CloudRoot(parsed)


def committed(root: CloudRoot, storage_id: str) -> bool:
    """True when the checkpoint's metadata.json is in the bucket."""
    return root.store.read(f"{storage_id}/{METADATA_NAME}", 1) is not None


def read_metadata(root: CloudRoot, storage_id: str) -> dict[str, Any]:
    """The committed checkpoint's metadata. Raises FileNotFoundError for an uncommitted one."""
    raw = root.store.read(f"{storage_id}/{METADATA_NAME}", 16 * 2**20)
    if raw is None:
        raise FileNotFoundError(f"{root}/{storage_id}/{METADATA_NAME}")
    try:
        data = parse_json(raw.decode("utf-8"), source=f"{root}/{storage_id}/{METADATA_NAME}")
    except ValueError as err:
        raise CheckpointError(f"cannot read {root}/{storage_id}/{METADATA_NAME}: {err}; the checkpoint's "
                              "metadata is damaged") from err
    return dict(data)


def remove(root: CloudRoot, storage_id: str) -> bool:
    """Delete a checkpoint's objects, metadata.json first (it is no longer committed). False: none."""
    st = root.store
    files = [rel for rel in st.list_files() if rel.startswith(storage_id + "/")]
    first = f"{storage_id}/{METADATA_NAME}"
    st.delete([first] if first in files else [])
    st.delete([rel for rel in files if rel != first])
    return bool(files)


def staging_dir(root: CloudRoot, storage_id: str) -> Path:
    """This machine's local directory where a checkpoint is written before its upload."""
    return cache_dir(root.url) / f"det-{storage_id}"


def upload_dir(root: CloudRoot, local: Path, storage_id: str) -> None:
    """Upload every file under ``local`` to ``<root>/<storage_id>/`` (not metadata.json: the commit)."""
    pairs = [(str(path), f"{storage_id}/{path.relative_to(local).as_posix()}")
             for path in sorted(local.rglob("*")) if path.is_file() and not path.is_symlink()]
    root.store.upload([(src, rel) for src, rel in pairs if rel != f"{storage_id}/{METADATA_NAME}"])


def download_dir(root: CloudRoot, storage_id: str, target: Path,
                 selector: Callable[[str], bool] | None = None) -> None:
    """Download the committed checkpoint's files (those ``selector`` keeps) into ``target``."""
    st = root.store
    prefix = storage_id + "/"
    pairs = []
    for rel in sorted(st.list_files()):
        inner = rel[len(prefix):]
        if not rel.startswith(prefix) or (selector is not None and not selector(inner)):
            continue
        if any(_names.name_problem(part) for part in inner.split("/")):
            raise CheckpointError(f"{root}/{rel}: not a safe file name inside a checkpoint; not downloaded")
        pairs.append((rel, str(target / inner)))
    target.mkdir(parents=True, exist_ok=True)
    st.download(pairs)


def fresh_local_dir(root: CloudRoot, what: str) -> Path:
    """A new, empty directory in this machine's cache (for a restore)."""
    path = cache_dir(root.url) / f"{what}-{uuid.uuid4().hex[:12]}"
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path
