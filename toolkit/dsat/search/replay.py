"""Rebuild a searcher from a recorded search: how ``--resume`` works. Pure; rank 0 only by use."""

from __future__ import annotations

from typing import Mapping, Sequence

from toolkit.dsat.search.types import Searcher, TrialResult, TrialSpec

__all__ = ["replay"]


def replay(searcher: Searcher, *, results: Sequence[TrialResult],
           observed_before: Mapping[int, int]) -> list[TrialSpec]:
    """Rebuild a fresh searcher's state from a recorded search (how ``--resume`` works).

    Works because a searcher is deterministic for its seed and calls, ``propose(a)`` then
    ``propose(b)`` gives the trials of ``propose(a + b)``, and a ``propose`` that returns
    nothing changes nothing. Rank 0 only.

    Args:
        searcher: a fresh searcher with the recorded search's settings and seed.
        results: the finished tuning trials, in the order they were observed.
        observed_before: for every proposed trial id, ``searcher.observed_count`` when it was
            proposed (the number of results observed before it).

    Returns:
        The trials that were proposed but have no result (they were running when the search
        was interrupted); they are in flight in ``searcher``: run them again and observe them.

    Raises:
        ValueError: the record does not match what this searcher proposes (another seed,
            method or settings), or ``observed_before`` is inconsistent.

    Example (rank 0, resuming)::

        searcher = make_searcher(settings, profile)
        for spec in replay(searcher, results=finished, observed_before=counts):
            start(spec)
    """
    by_count: dict[int, list[int]] = {}
    for trial_id, count in observed_before.items():
        if count < 0 or count > len(results):
            raise ValueError(f"observed_before[{trial_id}]={count}: expected 0..{len(results)}")
        by_count.setdefault(int(count), []).append(int(trial_id))
    for k in range(len(results) + 1):
        wanted = sorted(by_count.get(k, []))
        got = [spec.trial_id for spec in searcher.propose(len(wanted))]
        if got != wanted:
            raise ValueError(f"replay: after {k} results the recorded search proposed trials {wanted}, "
                             f"this searcher proposes {got}; resume with the original settings and seed")
        if k < len(results):
            searcher.observe(results[k])
    return list(searcher.in_flight)
