"""Reading toolkit's records in a checkpoint directory, by the one rule for names. Any rank.

A tag or run id is a safe name (:mod:`toolkit._names`) not reserved for DeepSpeed's or toolkit's
files. Records (``toolkit_run.json``, ``toolkit_checkpoint.json``) and pointers (``latest``,
``latest_universal``) are read bounded, never through a symlink; a damaged one is a CheckpointError
naming the file, and a pointer's content is never quoted unless it is a valid tag."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Mapping

from toolkit import _names
from toolkit.bounded_load import parse_json
from toolkit.errors import CheckpointError

__all__ = ["name_problem", "validate_name", "read_record", "parse_record", "commit_problem", "read_pointer",
           "parse_pointer", "MAX_RECORD"]

MAX_RECORD = 16 * 2**20   # a commit or run record larger than this is damaged, not read
_RESERVED = {"latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py"}


def name_problem(value: Any, *, what: str = "tag") -> str | None:
    """What is wrong with a tag or run id, or None: the rule of :mod:`toolkit._names`, and not a name
    DeepSpeed or toolkit uses for its own files. Pure; any rank."""
    problem = _names.name_problem(value, what=what)
    if problem:
        return problem
    if value in _RESERVED or value.startswith("toolkit_"):
        return (f"{what}={value!r} is a name DeepSpeed or toolkit uses for its own files "
                "in a checkpoint directory; choose another, for example 'step_100'")
    return None


def validate_name(value: Any, *, what: str = "tag") -> str:
    """A tag or run id found on disk (``latest``...), or CheckpointError; a user's arguments go through
    :func:`name_problem` and ConfigError instead. Any rank."""
    problem = name_problem(value, what=what)
    if problem:
        raise CheckpointError(problem)
    return value


def _read_plain_file(path: Path, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of a regular file, None when missing; never through a symlink, never
    blocking on a FIFO. Raises OSError (a symlink: ELOOP) for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return fh.read(limit)


def _unreadable(path: Path, err: OSError) -> str:
    return ("it is a symlink, which toolkit never writes or follows" if path.is_symlink()
            else err.strerror or str(err))


def read_record(path: Path) -> dict[str, Any] | None:
    """A toolkit record (run or commit file) as a dict; None when missing. Never through a symlink."""
    try:
        raw = _read_plain_file(path, MAX_RECORD + 1)
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {_unreadable(path, err)}; delete the directory that "
                              "holds it or load another tag") from err
    return None if raw is None else parse_record(raw, str(path))


def parse_record(raw: bytes, source: str) -> dict[str, Any]:
    """A record's bytes (read from ``source``, a path or a URL) as a dict. Any rank."""
    try:
        if len(raw) > MAX_RECORD:
            raise ValueError(f"larger than {MAX_RECORD // 2**20} MiB")
        data = parse_json(raw.decode("utf-8"), source=source, expect_object=False)
    except ValueError as err:  # UnicodeDecodeError and ConfigError are ValueErrors too
        raise CheckpointError(f"cannot read {source}: {err}; the file is damaged, delete the directory that "
                              "holds it or load another tag") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{source} holds {type(data).__name__}, expected a JSON object; the file is "
                              "damaged, delete the directory that holds it or load another tag")
    return data


def commit_problem(metadata: Mapping[str, Any], tag: str) -> str | None:
    """What makes a commit record unusable for the tag directory that holds it, or None. Pure."""
    if metadata.get("tag") != tag:
        return (f"its tag={_names.shown(metadata.get('tag'))} is not the name of its directory {tag!r} "
                "(a commit record names the checkpoint it sits in, nothing else)")
    seq = metadata.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        return f"seq={_names.shown(seq)}: expected the commit's sequence number, an integer >= 0"
    return None


def read_pointer(root: str | os.PathLike[str], name: str) -> tuple[str | None, str | None]:
    """The tag a pointer file (``latest``, ``latest_universal``) names: ``(tag, problem)``, ``(None, None)``
    when missing. A symlink, an unreadable file or content that is not a safe tag give ``(None, problem)``,
    never quoting the content (it may come from another file through a link). Any rank."""
    path = Path(root) / name
    if path.is_symlink():
        return None, f"{path} is a symlink (DeepSpeed and toolkit write a plain file); ignored"
    try:
        raw = _read_plain_file(path, _names.MAX_NAME + 2)
    except OSError as err:
        return None, f"{path} cannot be read ({_unreadable(path, err)}); ignored"
    if raw is None:
        return None, None
    return parse_pointer(raw, str(path))


def parse_pointer(raw: bytes, source: str) -> tuple[str | None, str | None]:
    """A pointer file's bytes (read from ``source``) as ``(tag, problem)``, as :func:`read_pointer`."""
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not tag and not raw.strip():
        return None, f"{source} is empty; ignored"
    if name_problem(tag) or len(raw) > _names.MAX_NAME + 1:
        return None, f"{source} does not hold a valid tag name; ignored"
    return tag, None
