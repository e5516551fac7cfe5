"""Durable, atomic file writes for the whole package: checkpoints, dsat's records, trial results.

A reader sees the old file or the whole new one, even after a crash or a power loss: a temporary
file in the same directory, fsynced, ``os.replace``-d over the target, then the directory fsynced.
Any rank; each call touches only the paths it is given."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Callable

logger = logging.getLogger(__name__)

__all__ = ["atomic_write", "atomic_write_json", "flushing_while_written", "fsync_dir", "fsync_tree"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX; a no-op where dirs cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """Flush every file under ``path`` (written by any process of this node) and the directories."""
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    os.fsync(fh.fileno())
            except FileNotFoundError:  # a temporary file renamed meanwhile; its writer fsyncs it
                continue
        fsync_dir(dirpath)


@contextlib.contextmanager
def flushing_while_written(path: str | os.PathLike[str], *, interval_s: float = 0.02) -> Iterator[None]:
    """While the block writes files under ``path``, flush each one that grew, in a thread, so the disk
    writes while the writer serialises the next bytes and the closing :func:`fsync_tree` finds
    little left (a checkpoint's flush costs about what DeepSpeed's save does otherwise). It guarantees
    nothing itself: call :func:`fsync_tree` after. Any process.

    >>> with flushing_while_written("/tmp/run/step_5"):
    ...     pass  # engine.save_checkpoint(...)
    """
    stop = threading.Event()
    thread = threading.Thread(target=_flush_growing, args=(os.fspath(path), stop, interval_s),
                              name="toolkit-flush", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60.0)
        if thread.is_alive():  # a flush blocked by the filesystem; fsync_tree will block there too
            logger.warning("flushing %s: a flush is still blocked after 60 s", path)


def _flush_growing(root: str, stop: threading.Event, interval_s: float) -> None:
    sizes: dict[str, int] = {}
    while not stop.wait(interval_s):
        for dirpath, _dirnames, filenames in os.walk(root):
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    size = os.stat(path).st_size
                    if sizes.get(path) != size:
                        sizes[path] = size
                        fd = os.open(path, os.O_RDONLY)
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                except OSError:  # gone, or not flushable here: fsync_tree, after, is the check
                    continue


def atomic_write(path: str | os.PathLike[str], data: bytes | str | Callable[[BinaryIO], None], *,
                 sync: bool = True) -> None:
    """Write ``path`` (its directory must exist) so that readers see the old or the whole new file.

    ``data``: bytes, a text (UTF-8) or a function writing into the open binary file
    (``lambda fh: torch.save(obj, fh)``). ``sync=False`` skips the fsyncs, for a file that need not
    outlive a crash (a trial's progress note)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    if sync:
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *,
                      default: Callable[[Any], Any] | None = None, sync: bool = True) -> None:
    """:func:`atomic_write` of ``obj`` as indented JSON with sorted keys; ``default`` as in ``json.dumps``
    (``repr`` keeps a trace of what JSON cannot encode, None raises ``TypeError``)."""
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True, default=default) + "\n", sync=sync)
