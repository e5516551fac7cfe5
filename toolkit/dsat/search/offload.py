"""Offload when nothing fits: the levels ``none``, ``optimizer``, ``param`` that ``--offload`` walks.

Pure; rank 0 only by use (the searchers). Design: docs/design-dsat-search.md#offload-levels.
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
    """The searched ``stages`` that can run at ``level``, ascending. Pure."""
    return tuple(sorted(s for s in set(stages) if s in _LEVEL_STAGES[level]))


def offload_levels(mode: str, stages: Iterable[int]) -> tuple[str, ...]:
    """The levels the search may walk, in order, for ``--offload mode``. Pure."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"offload mode {mode!r}: expected one of {', '.join(OFFLOAD_MODES)}")
    stages = tuple(stages)
    if mode == "never":
        return ("none",)
    walk = OFFLOAD_LEVELS if mode == "auto" else OFFLOAD_LEVELS[1:]
    return tuple(level for level in walk if level_stages(stages, level))


def offload_zero(base_zero: Mapping[str, Any], level: str) -> dict[str, Any]:
    """The user's ZeRO section with ``level``'s offload sections to the CPU (a user's own kept). Pure."""
    zero = copy.deepcopy(dict(base_zero))
    if level in ("optimizer", "param"):
        zero.setdefault("offload_optimizer", dict(_CPU))
    if level == "param":
        zero.setdefault("offload_param", dict(_CPU))
    return zero


def first_level(levels: Sequence[str], fits: Callable[[str], bool]) -> int:
    """The index of the first level ``fits`` at micro-batch 1; the last when none does. Pure."""
    return next((i for i, level in enumerate(levels) if fits(level)), len(levels) - 1)


def nothing_fits_at_one(results: Iterable[TrialResult], stages: Iterable[int]) -> bool:
    """Every stage of ``stages`` ran out of memory at micro-batch 1 and no trial succeeded. Pure."""
    results = list(results)
    if any(r.status is TrialStatus.OK for r in results):
        return False
    failed = {r.spec.stage for r in results if r.status is TrialStatus.OOM and r.spec.micro_batch == 1}
    return set(stages) <= failed and bool(failed)
