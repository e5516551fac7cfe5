"""Pure search logic: the ZeRO space, the memory model, the line bookkeeping, and the binary,
random and ASHA methods. Nothing here starts a process or touches a file: a searcher takes
results and returns the next trials.

Modules: :mod:`~toolkit.dsat.search.types` (trials, results, settings, the :class:`Searcher`
protocol), :mod:`~toolkit.dsat.search.space` (ZeRO configurations), :mod:`~toolkit.dsat.search.memory`
(the memory model), :mod:`~toolkit.dsat.search.lines` (what every method shares),
:mod:`~toolkit.dsat.search.binary`, :mod:`~toolkit.dsat.search.random_search`,
:mod:`~toolkit.dsat.search.asha` (one method each), :mod:`~toolkit.dsat.search.peak` (where
``binary`` looks next for a configuration's throughput peak), :mod:`~toolkit.dsat.search.replay`,
:mod:`~toolkit.dsat.search.batch` (the global batch policy: which micro-batches a trial may use) and
:mod:`~toolkit.dsat.search.offload` (the offload levels walked when nothing fits).

Trial ids start at 1 (0 is the orchestrator's profiling trial) and follow proposal order; at most
``max_trials - 1`` trials are proposed. ``observe_profiling`` (before the first ``propose``) hands
the profiling trials to the searcher: ``binary`` takes those at configurations of its search as
results. Each searcher owns a ``random.Random(random_seed)``, and
nothing else is random, so the same seed and the same calls give the same trials.
``propose(a)`` followed by ``propose(b)`` gives the same trials as ``propose(a + b)``, and a
``propose`` that returns nothing changes nothing: :func:`replay` rebuilds a searcher from the
recorded results and, for each trial, the number of results observed when it was proposed.

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
