"""Rebuild a searcher from a recorded search: how ``--resume`` works. Pure; rank 0 only by use."""

from __future__ import annotations

from typing import Mapping, Sequence

from toolkit.dsat.search.types import Searcher, TrialResult, TrialSpec

__all__ = ["replay"]


def replay(searcher: Searcher, *, results: Sequence[TrialResult],
           observed_before: Mapping[int, int]) -> list[TrialSpec]:
    """Rebuild a fresh searcher (the record's settings and seed) from the finished trials, in observation
    order, and per trial id ``observed_count`` when it was proposed. Returns the trials left in flight
    (run them again); ValueError when the record does not match. Rank 0 only."""
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
