"""Offload when nothing fits: the ladder of ZeRO-Offload levels the search walks down.

``--offload`` (:data:`OFFLOAD_MODES`):

* ``auto`` (default): search without offload first. When the memory model predicts that no
  searched stage fits at micro-batch 1, start one level lower; when every stage of the current
  level ran out of memory at micro-batch 1 (and none succeeded), continue one level lower.
* ``never``: the user's ZeRO section only (its own offload sections pass through).
* ``always``: every trial offloads, from the first level below ``none``.

The levels (:data:`OFFLOAD_LEVELS`): ``none`` (the user's section as written, any searched
stage); ``optimizer`` (``offload_optimizer`` to the CPU, stages 2 and 3); ``param``
(``offload_optimizer`` and ``offload_param`` to the CPU, stage 3). A user's own offload section
is kept as written (an NVMe one included). The memory model
(:func:`~toolkit.dsat.search.memory.model_memory_bytes`) subtracts what leaves the device.

Pure; rank 0 only by use (the searchers). Example::

    levels = offload_levels("auto", (1, 2, 3))            # ("none", "optimizer", "param")
    zero = offload_zero({"stage": 2}, "optimizer")        # {"stage": 2, "offload_optimizer": {...}}
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Mapping, Sequence

from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.search.types import OFFLOAD_MODES, TrialResult

__all__ = ["OFFLOAD_LEVELS", "OFFLOAD_MODES", "first_level", "level_stages", "nothing_fits_at_one",
           "offload_levels", "offload_zero"]

OFFLOAD_LEVELS = ("none", "optimizer", "param")
_LEVEL_STAGES = {"none": (0, 1, 2, 3), "optimizer": (2, 3), "param": (3,)}
_CPU = {"device": "cpu"}


def level_stages(stages: Iterable[int], level: str) -> tuple[int, ...]:
    """The searched ``stages`` that can run at ``level``, ascending.

    >>> level_stages((1, 2, 3), "optimizer")
    (2, 3)
    """
    return tuple(sorted(s for s in set(stages) if s in _LEVEL_STAGES[level]))


def offload_levels(mode: str, stages: Iterable[int]) -> tuple[str, ...]:
    """The levels the search may walk, in order, for ``--offload mode`` and the searched stages.

    >>> offload_levels("always", (1, 2))
    ('optimizer',)
    >>> offload_levels("never", (1, 2, 3))
    ('none',)
    """
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"offload mode {mode!r}: expected one of {', '.join(OFFLOAD_MODES)}")
    stages = tuple(stages)
    if mode == "never":
        return ("none",)
    walk = OFFLOAD_LEVELS if mode == "auto" else OFFLOAD_LEVELS[1:]
    return tuple(level for level in walk if level_stages(stages, level))


def offload_zero(base_zero: Mapping[str, Any], level: str) -> dict[str, Any]:
    """The user's ZeRO section with the offload sections of ``level`` (a user's own kept).

    >>> offload_zero({"stage": 3}, "param")["offload_param"]
    {'device': 'cpu'}
    """
    zero = copy.deepcopy(dict(base_zero))
    if level in ("optimizer", "param"):
        zero.setdefault("offload_optimizer", dict(_CPU))
    if level == "param":
        zero.setdefault("offload_param", dict(_CPU))
    return zero


def first_level(levels: Sequence[str], fits: Callable[[str], bool]) -> int:
    """The index of the first level of ``levels`` predicted to fit at micro-batch 1 (``fits``);
    the last one when none is. Example: ``first_level(levels, lambda level: ...)``."""
    return next((i for i, level in enumerate(levels) if fits(level)), len(levels) - 1)


def nothing_fits_at_one(results: Iterable[TrialResult], stages: Iterable[int]) -> bool:
    """Every stage of ``stages`` ran out of memory at micro-batch 1 and no trial succeeded.

    >>> from toolkit.dsat.search.types import TrialSpec
    >>> oom = TrialResult(TrialSpec(1, 1, {"stage": 2}), TrialStatus.OOM)
    >>> nothing_fits_at_one([oom], (2,)), nothing_fits_at_one([oom], (2, 3))
    (True, False)
    """
    results = list(results)
    if any(r.status is TrialStatus.OK for r in results):
        return False
    failed = {r.spec.stage for r in results if r.status is TrialStatus.OOM and r.spec.micro_batch == 1}
    return set(stages) <= failed and bool(failed)
