"""The one rule for names that become paths: checkpoint tags, run ids, storage ids. Any rank.

A name that toolkit joins to a directory, wherever it comes from (an argument, a file on disk
such as ``latest`` or a commit record, another rank's broadcast), is first checked with
:func:`name_problem` / :func:`check_name`: one path component of letters, digits, ``.``, ``_``
and ``-`` starting with a letter or digit, at most 200 characters (so no ``/``, ``..``, absolute,
hidden, empty or NUL-holding names). :func:`resolve_inside` then resolves symlinks and verifies
that the path stays inside its root; :func:`real_child` is what a save may write into and a
deletion may remove: a real directory (not a symlink) that is a direct child of the root.

Example::

    check_name("global_step10", what="tag")                  # returns the name
    resolve_inside("checkpoints", "step_3", what="tag")      # Path('/abs/checkpoints/step_3')
    resolve_inside("checkpoints", "../A", what="tag")        # raises CheckpointError
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from toolkit.errors import CheckpointError

__all__ = ["MAX_NAME", "name_problem", "check_name", "resolve_inside", "real_child", "shown"]

MAX_NAME = 200
_SAFE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}")


def shown(value: Any, limit: int = 400) -> str:
    """``repr(value)``, cut to ``limit`` characters: a message never carries a huge name whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def name_problem(value: Any, *, what: str = "name", example: str = "step_100") -> str | None:
    """What is wrong with ``value`` as one safe path component, or None. Pure; any rank."""
    if isinstance(value, str) and _SAFE.fullmatch(value):
        return None
    return (f"{what}={shown(value)}: expected 1-{MAX_NAME} characters from A-Z a-z 0-9 . _ - starting "
            f"with a letter or digit (a single directory name: no '/', no '..', not hidden, not empty), "
            f"for example {example!r}")


def check_name(value: Any, *, what: str = "name", error: type[Exception] = CheckpointError,
               example: str = "step_100") -> str:
    """``value`` if it is a safe name (see :func:`name_problem`). Any rank.

    ``error``: :class:`~toolkit.errors.ConfigError` for a name the user passed, the default
    :class:`~toolkit.errors.CheckpointError` for one read from disk or received from another rank.
    """
    problem = name_problem(value, what=what, example=example)
    if problem:
        raise error(problem)
    return str(value)


def resolve_inside(root: str | os.PathLike[str], name: Any, *, what: str = "name",
                   error: type[Exception] = CheckpointError) -> Path:
    """``root/name`` with symlinks resolved, once ``name`` is safe and the result is inside ``root``.

    Any rank; touches nothing (the path need not exist). A symlink at ``root/name`` that points
    elsewhere inside ``root`` is followed; one that points outside raises.

    Raises:
        ``error``: ``name`` is not a safe name.
        CheckpointError: the resolved path leaves ``root`` (a symlink points out).
    """
    check_name(name, what=what, error=error)
    base = os.path.realpath(root)
    target = os.path.realpath(os.path.join(base, name))
    if target == base or os.path.commonpath([base, target]) != base:
        raise CheckpointError(f"{what}={shown(name)}: {os.path.join(root, name)} is a symlink that leads "
                              f"outside {root}; toolkit never follows it. Remove the link")
    return Path(target)


def real_child(root: str | os.PathLike[str], name: Any, *, what: str = "name") -> Path | None:
    """The directory ``root/name`` that toolkit may write into or delete, or None when it does not exist.

    Any rank. Only a real directory that is a direct child of ``root`` qualifies: never a symlink
    (the link's target is not toolkit's), never a path outside ``root``.

    Raises:
        CheckpointError: ``name`` is not a safe name, or ``root/name`` is a symlink or not a directory.
    """
    target = resolve_inside(root, name, what=what)
    entry = Path(os.path.realpath(root)) / str(name)
    if entry.is_symlink() or target != entry:
        raise CheckpointError(f"{what}={shown(name)}: {Path(root) / str(name)} is a symlink; toolkit "
                              "writes and deletes only directories it created, never through a link; "
                              "remove the link")
    if not os.path.lexists(entry):
        return None
    if not entry.is_dir():
        raise CheckpointError(f"{what}={shown(name)}: {Path(root) / str(name)} is not a directory; "
                              "toolkit writes and deletes only checkpoint directories it created")
    return entry
