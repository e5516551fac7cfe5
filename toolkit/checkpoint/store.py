"""Object storage (``s3://``, ``gs://``) for checkpoints, through fsspec's s3fs and gcsfs. Any rank.

:func:`parse_url` tells a bucket URL from a local path and refuses other schemes; an
:class:`ObjectStore` (:func:`open_store`) turns every backend failure into a CheckpointError saying
what failed and how to fix it, never quoting a credential. Credentials come from the standard
chains or ``options``. The design: docs/object-storage.md."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any, Mapping

from toolkit import _names
from toolkit.errors import CheckpointError, ConfigError

__all__ = ["StoreURL", "ObjectStore", "parse_url", "open_store", "bucket_section_problems", "BUCKET_KEYS"]

logger = logging.getLogger(__name__)

_URL_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)
_SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs"}
_EXTRA = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs")}
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
#: Determined's ``checkpoint_storage`` keys of each bucket type that toolkit honours.
BUCKET_KEYS = {"s3": ("bucket", "prefix", "endpoint_url", "access_key", "secret_key"),
               "gcs": ("bucket", "prefix")}
_SECRET_KEYS = ("access_key", "secret_key")


@dataclasses.dataclass(frozen=True)
class StoreURL:
    """A checked bucket URL: ``scheme`` is ``s3`` or ``gs``; ``prefix`` has no leading or trailing ``/``."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    def key(self, rel: str = "") -> str:
        """The backend's path of ``rel`` under the prefix (``bucket/prefix/rel``)."""
        return "/".join(part for part in (self.bucket, self.prefix, rel) if part)


def parse_url(value: Any, *, what: str = "checkpoint_dir") -> StoreURL | None:
    """The bucket URL in ``value``, or None for a local path. Pure; ConfigError for another
    ``scheme://``, no bucket or an unsafe prefix."""
    if isinstance(value, os.PathLike) or not isinstance(value, str):
        return None
    match = _URL_RE.fullmatch(value)
    if match is None:
        return None
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme not in _SCHEMES:
        raise ConfigError(f"{what}={_names.shown(value)}: toolkit stores checkpoints in a local or shared "
                          "directory (a path without scheme) or in object storage (s3://bucket/prefix, "
                          f"gs://bucket/prefix), not in {scheme}://")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    bad = [p for p in parts if _names.name_problem(p)]
    if not bucket or not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]", bucket) or bad:
        raise ConfigError(f"{what}={_names.shown(value)}: expected {scheme}://BUCKET/PREFIX with a bucket "
                          "name of lower-case letters, digits, '.', '-' and '_', and prefix components of "
                          "letters, digits, '.', '_' and '-' (no '..', no empty component)"
                          + (f"; {_names.name_problem(bad[0], what='component')}" if bad else ""))
    return StoreURL(_SCHEMES[scheme], bucket, "/".join(parts))


def bucket_section_problems(section: Mapping[str, Any]) -> list[str]:
    """What is wrong with Determined's ``checkpoint_storage`` of type s3/gcs (toolkit.config and
    toolkit.compat check it); the values of ``access_key``/``secret_key`` are never quoted. Pure."""
    kind = section.get("type")
    problems = []
    bucket = section.get("bucket")
    if not isinstance(bucket, str) or not bucket:
        problems.append(f"checkpoint_storage.bucket={_names.shown(bucket)}: expected the bucket's name "
                        f"(type: {kind} needs one)")
    for key in BUCKET_KEYS.get(str(kind), ())[1:]:
        value = section.get(key)
        if value is not None and not isinstance(value, str):
            shown = f"a {type(value).__name__}" if key in _SECRET_KEYS else _names.shown(value)
            problems.append(f"checkpoint_storage.{key}={shown}: expected a string")
    if kind == "s3" and bool(section.get("access_key")) != bool(section.get("secret_key")):
        problems.append("checkpoint_storage: access_key and secret_key go together: give both, or neither "
                        "to use the standard AWS credential chain (AWS_* variables, ~/.aws, an instance "
                        "role)")
    return problems


_stores: dict[tuple[str, str, str], "ObjectStore"] = {}


def open_store(url: StoreURL, options: Mapping[str, Any] | None = None) -> "ObjectStore":
    """An :class:`ObjectStore` for ``url``, reused within the process. Any rank. ``options`` go to the
    fsspec filesystem (s3fs: ``key``, ``secret``, ``endpoint_url``; gcsfs: ``token``, ``project``), else
    the standard credential chain; ConfigError when the scheme's extra is not installed."""
    options = dict(options or {})
    cache_key = (url.scheme, url.bucket, repr(sorted(options.items())))
    if cache_key in _stores:
        return _stores[cache_key]
    package, extra = _EXTRA[url.scheme]
    try:
        if url.scheme == "s3":
            import s3fs

            endpoint = options.pop("endpoint_url", None)
            if endpoint:
                options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": endpoint}
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
        else:
            # The plain JSON-API class: gcsfs's default class probes each bucket over gRPC first
            # (60 s per call against an emulator, which has no such service).
            from gcsfs.core import GCSFileSystem

            if os.environ.get("STORAGE_EMULATOR_HOST") and "token" not in options:
                options["token"] = "anon"  # emulators take no credentials
            fs = GCSFileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
    except ImportError as err:
        raise ConfigError(f"{url.url}: object storage on {url.scheme}:// needs the {package} package, "
                          f"which cannot be imported ({err}); install it with: pip install 'toolkit[{extra}]'"
                          ) from err
    secrets = [str(v) for k, v in options.items() if k in ("key", "secret", "token") and isinstance(v, str)]
    store = ObjectStore(url, fs, secrets=secrets)
    _stores[cache_key] = store
    return store


class ObjectStore:
    """Files under one bucket URL, by paths relative to its prefix. Any rank. Every method raises a
    CheckpointError on a backend failure, naming the operation, the URL and the fix."""

    def __init__(self, url: StoreURL, fs: Any, *, secrets: list[str] | tuple[str, ...] = ()) -> None:
        self.url = url
        self.fs = fs
        self._secrets = [s for s in (*secrets, *(os.environ.get(k, "") for k in _SECRET_ENV)) if len(s) >= 4]

    def where(self, rel: str = "") -> str:
        return f"{self.url.url}/{rel}" if rel else self.url.url

    def _fail(self, doing: str, err: BaseException) -> CheckpointError:
        text = f"{type(err).__name__}: {err}"
        for secret in self._secrets:
            text = text.replace(secret, "***")
        hint = _hint(self.url, err, text)
        return CheckpointError(f"{doing} failed: {text[:600]}{hint}")

    def list_files(self) -> dict[str, int]:
        """Every object under the prefix: relative path -> size in bytes."""
        root = self.url.key()
        try:
            found = self.fs.find(root, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as err:  # noqa: BLE001 - any backend failure becomes one clear error
            raise self._fail(f"listing {self.where()}", err) from err
        return {key[len(root) + 1:]: int(info.get("size") or 0) for key, info in found.items()
                if key.startswith(root + "/") and info.get("type") != "directory" and not key.endswith("/")}

    def read(self, rel: str, limit: int) -> bytes | None:
        """Up to ``limit`` bytes of one object; None when it does not exist."""
        try:
            return bytes(self.fs.cat_file(self.url.key(rel), start=0, end=limit))
        except FileNotFoundError:
            return None
        except Exception as err:  # noqa: BLE001
            raise self._fail(f"reading {self.where(rel)}", err) from err

    def write(self, rel: str, data: bytes) -> None:
        """One object, replaced whole (a reader sees the old or the new content)."""
        try:
            self.fs.pipe_file(self.url.key(rel), data)
        except Exception as err:  # noqa: BLE001
            raise self._fail(f"writing {self.where(rel)}", err) from err

    def upload(self, pairs: list[tuple[str, str]]) -> None:
        """Upload local files: ``(local path, relative path)`` pairs, concurrently."""
        if pairs:
            try:
                self.fs.put([p[0] for p in pairs], [self.url.key(p[1]) for p in pairs])
            except Exception as err:  # noqa: BLE001
                raise self._fail(f"uploading {len(pairs)} file(s) to {self.where()}", err) from err

    def download(self, pairs: list[tuple[str, str]]) -> None:
        """Download objects: ``(relative path, local path)`` pairs, concurrently."""
        if pairs:
            for _, local in pairs:
                try:  # a CheckpointError, which the ranks agree on: a bare OSError would leave them waiting
                    os.makedirs(os.path.dirname(local), exist_ok=True)
                except OSError as err:
                    raise CheckpointError(f"downloading from {self.where()}: cannot create "
                                          f"{os.path.dirname(local)}: {err}") from err
            try:
                self.fs.get([self.url.key(p[0]) for p in pairs], [p[1] for p in pairs])
            except Exception as err:  # noqa: BLE001
                raise self._fail(f"downloading {len(pairs)} file(s) from {self.where()}", err) from err

    def delete(self, rels: list[str]) -> None:
        """Delete objects (missing ones are no error), in one batch."""
        if rels:
            try:
                self.fs.rm([self.url.key(r) for r in rels])
            except FileNotFoundError:
                pass
            except Exception as err:  # noqa: BLE001
                raise self._fail(f"deleting {len(rels)} object(s) under {self.where()}", err) from err

    def check_access(self, probe: str) -> None:
        """Write and delete a probe object: the credentials, the endpoint and the bucket work."""
        self.write(probe, b"")
        self.delete([probe])


def _hint(url: StoreURL, err: BaseException, text: str) -> str:
    """How to fix a failed call, from what it says."""
    lowered = text.lower()
    if url.scheme == "s3":
        creds = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the "
                 "instance role) and, for an S3-compatible server, AWS_ENDPOINT_URL")
    else:
        creds = ("check the credentials (GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default "
                 "login`) and, for an emulator, STORAGE_EMULATOR_HOST")
    if isinstance(err, PermissionError) or any(w in lowered for w in (
            "accessdenied", "access denied", "invalidaccesskeyid", "signaturedoesnotmatch", "forbidden",
            "unauthorized", "401", "403", "credentials")):
        return f"; {creds}"
    if "nosuchbucket" in lowered or "bucket does not exist" in lowered or (
            isinstance(err, FileNotFoundError) and url.bucket in lowered):
        return f"; the bucket {url.bucket!r} does not exist: create it, or fix the URL"
    if any(w in lowered for w in ("connect", "timeout", "timed out", "refused", "resolve", "unreachable")):
        return ("; the storage server cannot be reached: check the network and the endpoint; nothing was "
                "committed, so the previous checkpoint is still the latest and the run can resume from it")
    return f"; {creds}"
