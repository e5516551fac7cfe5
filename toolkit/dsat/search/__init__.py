"""Pure search logic: the ZeRO space, the memory model, and the binary, random and ASHA methods.

A searcher takes results and returns the next trials; it starts no process and touches no file.
Rank 0 only (the orchestrator drives it). Design: docs/design-dsat-search.md.
"""

from __future__ import annotations

from typing import Callable

from toolkit.dsat.contract import ProfileInfo
from toolkit.dsat.search.asha import AshaSearcher
from toolkit.dsat.search.binary import BinarySearcher
from toolkit.dsat.search.lines import best_result
from toolkit.dsat.search.random_search import RandomSearcher
from toolkit.dsat.search.replay import replay
from toolkit.dsat.search.types import Searcher, SearchSettings

__all__ = ["AshaSearcher", "BinarySearcher", "RandomSearcher", "Searcher", "best_result",
           "make_searcher", "replay"]

_METHODS: dict[str, Callable[[SearchSettings, ProfileInfo], Searcher]] = {
    "binary": BinarySearcher, "random": RandomSearcher, "asha": AshaSearcher}


def make_searcher(settings: SearchSettings, profile: ProfileInfo) -> Searcher:
    """A fresh searcher of ``settings.method`` for ``profile``. Rank 0 only (the orchestrator)."""
    if not isinstance(settings, SearchSettings) or not isinstance(profile, ProfileInfo):
        raise TypeError(f"make_searcher(settings, profile): got {type(settings).__name__} and "
                        f"{type(profile).__name__}, expected SearchSettings and ProfileInfo")
    return _METHODS[settings.method](settings, profile)
