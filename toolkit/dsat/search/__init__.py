"""Pure search logic: the ZeRO space, the memory model, and the binary, random and ASHA methods.

Nothing here starts a process or touches a file: a searcher takes results and returns the next
trials. Trial ids start at 1 (0 is the profiling trial) and follow proposal order; at most
``max_trials - 1`` are proposed. ``observe_profiling`` (before the first ``propose``) hands the
profiling trials over, and every method takes those at configurations of its search as results.
Each searcher owns a ``random.Random(random_seed)`` and nothing else is random, so the same seed
and calls give the same trials; ``propose(a)`` then ``propose(b)`` equals ``propose(a + b)``, and
an empty ``propose`` changes nothing, so :func:`replay` rebuilds a searcher from the recorded
results and, for each trial, the number of results observed when it was proposed.

Example (rank 0 only: the orchestrator drives the search)::

    searcher = make_searcher(settings, profile)
    while not searcher.done:
        for spec in searcher.propose(free_slots // settings.data_parallel_size):
            start(spec)            # records spec with searcher.observed_count
        searcher.observe(wait_for_any_trial())
    best = searcher.best
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
    """The searcher of ``settings.method``, fresh (no trial proposed yet).

    Rank 0 only (the orchestrator runs the search and launches the trials).

    Example:
        >>> settings = SearchSettings(method="binary", max_trials=10)
        >>> profile = ProfileInfo(num_params=10**6, trainable_params=10**6,
        ...                       activation_bytes_per_example=10**6, memory_per_slot=2**30)
        >>> [spec.trial_id for spec in make_searcher(settings, profile).propose(2)]
        [1, 2]
    """
    if not isinstance(settings, SearchSettings) or not isinstance(profile, ProfileInfo):
        raise TypeError(f"make_searcher(settings, profile): got {type(settings).__name__} and "
                        f"{type(profile).__name__}, expected SearchSettings and ProfileInfo")
    return _METHODS[settings.method](settings, profile)
