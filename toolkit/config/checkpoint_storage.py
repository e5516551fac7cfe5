"""Determined's ``checkpoint_storage`` section: every problem of it, named, before anything starts.

The one check of the section: ``python -m toolkit.run`` calls it while planning, and a trial's
storage root (``toolkit.compat.determined.storage.storage_root``) raises what it finds. Pure;
any process. Example::

    checkpoint_storage_problems({"type": "azure"})   # ["checkpoint_storage.type='azure': ..."]
"""

from __future__ import annotations

from typing import Any, Mapping

from toolkit import _names
from toolkit._checks import is_int
from toolkit.checkpoint.store import bucket_section_problems, parse_url
from toolkit.errors import ConfigError

__all__ = ["checkpoint_storage_problems", "keep_count_problem"]

_KEEP_KEYS = ("save_trial_latest", "save_trial_best")


def keep_count_problem(key: str, value: Any) -> str | None:
    """The problem of ``save_trial_latest`` / ``save_trial_best`` (an integer >= 0), or None. Pure."""
    if is_int(value) and value >= 0:
        return None
    return f"checkpoint_storage.{key}={value!r}: expected an integer >= 0"


def _url_problems(storage: str) -> list[str]:
    if storage.startswith(("s3://", "gs://", "gcs://")):  # a URL of a scheme toolkit stores in
        try:
            parse_url(storage, what="checkpoint_storage")
        except ConfigError as err:
            return list(err.problems)
        return []
    if "://" in storage and not storage.startswith("file://"):
        return [f"checkpoint_storage={_names.shown(storage)}: expected a local or shared directory (a path), "
                "or an s3:// or gs:// URL"]
    return []


def checkpoint_storage_problems(storage: Any) -> list[str]:
    """Every problem of a ``checkpoint_storage`` value (None, a path or URL, or a mapping), each naming
    its key; empty when a storage root can be made of it. Pure; any process."""
    if storage is None:
        return []
    if isinstance(storage, str):
        return _url_problems(storage)
    if not isinstance(storage, Mapping):
        return [f"checkpoint_storage={storage!r}: expected a path or a mapping such as "
                "{type: shared_fs, host_path: /mnt/ckpt}"]
    problems = [p for key in _KEEP_KEYS if storage.get(key) is not None
                for p in [keep_count_problem(key, storage[key])] if p]
    kind = storage.get("type")
    if kind is None and not any(storage.get(k) for k in ("host_path", "storage_path", "container_path")):
        return problems  # only policy keys such as save_trial_latest: the output directory's
    if kind in ("s3", "gcs"):
        bucket = bucket_section_problems(storage)
        if not bucket:  # the URL a trial's storage root is made of: the bucket's name and the prefix
            prefix = str(storage.get("prefix") or "").strip("/")
            bucket = _url_problems(f"{'s3' if kind == 's3' else 'gs'}://{storage['bucket']}"
                                   + (f"/{prefix}" if prefix else ""))
        return bucket + problems
    if kind == "azure":
        return ["checkpoint_storage.type='azure': Azure Blob Storage is not available here; use type: s3 or "
                "gcs (bucket, prefix), or type: shared_fs (host_path, storage_path) on a disk every rank "
                "sees", *problems]
    if kind not in (None, "shared_fs", "directory"):
        return [f"checkpoint_storage.type={kind!r}: expected shared_fs, directory, s3 or gcs", *problems]
    if kind == "directory":
        path = storage.get("container_path")
        if not isinstance(path, str) or not path:
            problems.insert(0, f"checkpoint_storage.container_path={path!r}: expected a directory path")
        return problems
    given = {k: storage.get(k) for k in ("host_path", "storage_path") if storage.get(k) not in (None, "")}
    bad = [k for k, v in given.items() if not isinstance(v, str)]
    if bad or not given:
        key = bad[0] if bad else "host_path"
        problems.insert(0, f"checkpoint_storage.{key}={storage.get(key)!r}: expected a directory path")
    return problems
