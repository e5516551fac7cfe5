"""dsat's trial bootstrap: this directory goes first on each trial's ``PYTHONPATH`` for its
``sitecustomize`` (:mod:`toolkit.dsat.trial.site.sitecustomize`); nothing here is imported as a package."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SITE_DIR", "site_pythonpath"]

#: The directory the trial runner puts first on a trial's ``PYTHONPATH``.
SITE_DIR = Path(__file__).resolve().parent


def site_pythonpath(pythonpath: str | None) -> str:
    """``PYTHONPATH`` for a trial (or the full run): :data:`SITE_DIR` first, then ``pythonpath``. Pure.

    >>> site_pythonpath("/a").endswith(os.pathsep + "/a")
    True
    """
    rest = [p for p in (pythonpath or "").split(os.pathsep) if p and p != str(SITE_DIR)]
    return os.pathsep.join([str(SITE_DIR), *rest])
