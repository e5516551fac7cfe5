"""The stop record ``<checkpoint dir>/toolkit_stopped.json``: "stopped at step N, resumable".

After every rank agreed on a preemption, the chief writes it once the stop's checkpoint is
committed (:func:`note_commit`) or when the watcher closes (:func:`record_agreed_stop`), last and
atomically; the next run's first load or save removes it. ``TOOLKIT_STOP_RECORD=<file>`` (set by
``python -m toolkit.run`` and dsat) gets it too. Any process reads it (:func:`read_stop_record`).
What schedulers read: docs/training.md (Exit statuses a scheduler can read)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Mapping

from toolkit._files import atomic_write_json
from toolkit.checkpoint import layout, records
from toolkit.errors import CheckpointError

__all__ = ["STOP_FILE", "STOP_RECORD_ENV", "StopRecord", "clear_stop_record", "note_commit",
           "note_remote_commit", "read_stop_record", "record_agreed_stop"]

logger = logging.getLogger(__name__)

STOP_FILE = "toolkit_stopped.json"
#: A file that also receives the record (runners set it for their ranks).
STOP_RECORD_ENV = "TOOLKIT_STOP_RECORD"
_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class StopRecord:
    """What a run that stopped for a preemption left (the JSON file's content): the ``cause``, the
    committed checkpoint (``steps_completed``, ``tag``, ``checkpoint_dir``, ``run_id``; None without
    one), when (``stopped_at``) and the chief that wrote it (``host``, ``pid``)."""

    cause: str
    steps_completed: int | None
    tag: str | None
    checkpoint_dir: str | None
    run_id: str | None
    stopped_at: float
    host: str
    pid: int

    @property
    def resumable(self) -> bool:
        """True when a committed checkpoint is there to continue from."""
        return self.tag is not None

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, "state": "preempted", "resumable": self.resumable,
                **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StopRecord":
        """The record from its JSON object. Raises ValueError naming the first bad field."""
        fields: dict[str, Any] = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        if data.get("state") != "preempted" or not isinstance(fields["cause"], str):
            raise ValueError(f"state={data.get('state')!r}, cause={fields['cause']!r}: not a stop record")
        for name in ("steps_completed", "pid"):
            value = fields[name]
            whole = isinstance(value, int) and not isinstance(value, bool)
            if (value is not None or name == "pid") and not whole:
                raise ValueError(f"{name}={value!r}: expected a whole number")
        for name in ("tag", "checkpoint_dir", "run_id", "host"):
            if (fields[name] is not None or name == "host") and not isinstance(fields[name], str):
                raise ValueError(f"{name}={fields[name]!r}: expected a string")
        if not isinstance(fields["stopped_at"], (int, float)) or isinstance(fields["stopped_at"], bool):
            raise ValueError(f"stopped_at={fields['stopped_at']!r}: expected a time in seconds")
        return cls(**fields)


def read_stop_record(path: str | os.PathLike[str]) -> StopRecord | None:
    """The stop record in checkpoint directory ``path`` (or the file ``path``); None if absent,
    CheckpointError naming a damaged one. Any process."""
    file = Path(path) / STOP_FILE if Path(path).is_dir() else Path(path)
    data = records.read_record(file)
    if data is None:
        return None
    try:
        return StopRecord.from_json(data)
    except ValueError as err:
        raise CheckpointError(f"{file}: {err}; the stop record is damaged, delete it") from None


def clear_stop_record(root: str | os.PathLike[str]) -> None:
    """Chief only: a new run holds the directory, so the previous run's stop record goes."""
    path = Path(root) / STOP_FILE
    if path.is_file() and not path.is_symlink():
        path.unlink()
        logger.info("a new run holds %s: removed the previous run's stop record", root)


# The chief's commits in this process, by the directory's real path: (root, tag, steps, run id).
_commits: dict[str, tuple[str, str, int | None, str | None]] = {}
_last_commit: str | None = None


def note_commit(root: str, tag: str, steps_completed: int | None, run_id: str | None) -> None:
    """Chief only, right after a commit: remember it; after an agreed stop write the record, else
    remove an older one (this is progress past it)."""
    global _last_commit
    from toolkit.preemption import last_agreed_stop

    key = os.path.realpath(root)
    _commits[key] = (root, tag, steps_completed, run_id)
    _last_commit = key
    stop = last_agreed_stop()
    if stop is not None:
        _write(_record(stop.cause, key), [Path(root) / STOP_FILE, *_extra_path()])
    else:
        clear_stop_record(root)


def note_remote_commit(store: Any, tag: str, steps_completed: int | None, run_id: str | None) -> None:
    """Chief only, right after a commit in object storage (``store``: an ObjectStore): as
    :func:`note_commit`, the record being an object beside ``latest`` (and ``TOOLKIT_STOP_RECORD``)."""
    global _last_commit
    from toolkit.preemption import last_agreed_stop

    key = store.where()
    _commits[key] = (key, tag, steps_completed, run_id)
    _last_commit = key
    stop = last_agreed_stop()
    try:
        if stop is None:
            store.delete([STOP_FILE])
            return
        record = _record(stop.cause, key)
        store.write(STOP_FILE, json.dumps(record.to_json()).encode())
    except CheckpointError as err:  # the checkpoint is committed; a missing record must not fail the stop
        logger.warning("could not write the stop record in %s: %s", key, err)
        return
    _write(record, _extra_path())


def record_agreed_stop() -> None:
    """Chief only (the watcher's close after an agreed stop): write the record for every directory
    this process holds, naming its latest committed checkpoint, and to ``TOOLKIT_STOP_RECORD``."""
    from toolkit.checkpoint import lock
    from toolkit.preemption import last_agreed_stop

    stop = last_agreed_stop()
    if stop is None or not _is_chief():
        return
    for key in sorted(set(lock.held_directories()) | set(_commits)):
        if "://" not in key:  # a bucket's record is written at its commit (note_remote_commit)
            _write(_record(stop.cause, key), [Path(key) / STOP_FILE])
    if _extra_path():
        _write(_record(stop.cause, _last_commit or next(iter(lock.held_directories()), None)), _extra_path())


def _is_chief() -> bool:
    from toolkit.runtime import context

    return context._context is None or context._context.is_chief  # no context: a world of one


def _extra_path() -> list[Path]:
    extra = os.environ.get(STOP_RECORD_ENV, "").strip()
    return [Path(extra)] if extra else []


def _record(cause: str, key: str | None) -> StopRecord:
    tag: str | None = None
    steps: int | None = None
    run_id: str | None = None
    if key is not None and key in _commits:
        _, tag, steps, run_id = _commits[key]
    elif key is not None:
        try:
            state = layout.scan_dir(key)
            info, _ = layout.resolve_tag(state, None)
        except (CheckpointError, ValueError, OSError) as err:
            logger.warning("stop record: cannot read %s (%s); recording no checkpoint", key, err)
            info, state = None, None
        if info is not None and state is not None:
            tag, steps, run_id = info.tag, int(info.meta.get("steps_completed", 0)), state.run_id
    return StopRecord(cause=cause, steps_completed=steps, tag=tag, checkpoint_dir=key, run_id=run_id,
                      stopped_at=time.time(), host=socket.gethostname(), pid=os.getpid())


def _write(record: StopRecord, paths: list[Path]) -> None:
    for path in paths:
        try:
            atomic_write_json(path, record.to_json())
        except OSError as err:  # the checkpoint is committed; a missing record must not fail the stop
            logger.warning("could not write the stop record %s: %s", path, err)
            continue
        logger.info("stop record %s: stopped at step %s (%s)%s", path, record.steps_completed, record.cause,
                    ", resumable" if record.resumable else ", no committed checkpoint")
