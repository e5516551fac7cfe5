"""The one rule for names that become paths: checkpoint tags, run ids, storage ids. Any rank.

A name joined to a directory, whether from an argument, a file or another rank, is checked first
(:func:`check_name`): one component of 1-200 letters, digits, ``.``, ``_``, ``-`` starting with a
letter or digit. :func:`resolve_inside` keeps the resolved path inside its root; :func:`real_child`
is what a save may write into and a deletion remove. The rule's reasons: docs/security.md."""

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
    """``value`` if it is a safe name, else ``error`` is raised: ConfigError for a name the user passed,
    CheckpointError (default) for one read from disk or received from another rank. Any rank."""
    problem = name_problem(value, what=what, example=example)
    if problem:
        raise error(problem)
    return str(value)


def resolve_inside(root: str | os.PathLike[str], name: Any, *, what: str = "name",
                   error: type[Exception] = CheckpointError) -> Path:
    """``root/name`` with symlinks resolved, once ``name`` is safe (else ``error``) and the result stays
    inside ``root`` (else CheckpointError: a symlink points out). Any rank; touches nothing."""
    check_name(name, what=what, error=error)
    base = os.path.realpath(root)
    target = os.path.realpath(os.path.join(base, name))
    if target == base or os.path.commonpath([base, target]) != base:
        raise CheckpointError(f"{what}={shown(name)}: {os.path.join(root, name)} is a symlink that leads "
                              f"outside {root}; toolkit never follows it. Remove the link")
    return Path(target)


def real_child(root: str | os.PathLike[str], name: Any, *, what: str = "name") -> Path | None:
    """The real directory ``root/name`` that toolkit may write into or delete; None if absent. Any rank.

    CheckpointError for an unsafe name, a symlink (its target is not toolkit's) or a non-directory."""
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
