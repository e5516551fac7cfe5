"""Metric reports waiting for their batch's collective, for :class:`toolkit.MetricsWriter`. One
rank's bookkeeping, no collective."""

from __future__ import annotations

import dataclasses
import functools

__all__ = ["PendingReports", "Report", "describe_signature", "signature_size"]  # for the writer


@dataclasses.dataclass(frozen=True)
class Report:
    """One report as this rank made it, being averaged (built from :class:`PendingReports`)."""

    group: str            # "training" or "validation"
    signature: tuple      # (names, has samples, batch names): must match across ranks
    steps: int
    values: list[float]   # [samples, elapsed]? + values + batch values, in signature order
    now: float            # the writer's clock at the report


class PendingReports:
    """The reports waiting for their batch's collective, kept in a few growing lists of numbers.

    Not one object each: hundreds of GC-tracked objects living for seconds make the cyclic collector
    run full passes over the whole training process (docs/training.md, What a report costs)."""

    def __init__(self) -> None:
        self._kinds: list[tuple[str, tuple]] = []            # distinct (group, signature)
        self._kind_ids: dict[tuple[str, tuple], int] = {}
        self._drain()

    def _drain(self) -> None:
        self._kind: list[int] = []
        self._steps: list[int] = []
        self._nows: list[float] = []
        self._ends: list[int] = []      # end of each report's values in _values
        self._values: list[float] = []

    def __len__(self) -> int:
        return len(self._steps)

    def append(self, group: str, signature: tuple, steps: int, values: list[float], now: float) -> None:
        key = (group, signature)
        kind = self._kind_ids.get(key)
        if kind is None:
            kind = self._kind_ids[key] = len(self._kinds)
            self._kinds.append(key)
        self._kind.append(kind)
        self._steps.append(steps)
        self._nows.append(now)
        self._values += values
        self._ends.append(len(self._values))

    def step_range(self) -> tuple[int, int]:
        """``steps_completed`` of the first and the last waiting report (some must wait)."""
        return self._steps[0], self._steps[-1]

    def drain(self) -> list[Report]:
        """The waiting reports, oldest first; none wait afterwards."""
        reports, start = [], 0
        for kind, steps, now, end in zip(self._kind, self._steps, self._nows, self._ends, strict=True):
            group, signature = self._kinds[kind]
            reports.append(Report(group, signature, steps, self._values[start:end], now))
            start = end
        self._drain()
        return reports


@functools.lru_cache(maxsize=256)
def signature_size(signature: tuple) -> int:
    """How many floats a report with this signature sends: values, samples and batch values. Cached:
    a writer sees a handful of signatures, each report of a batch asks three times."""
    keys, has_samples, batch_keys = signature
    return len(keys) + (2 if has_samples else 0) + sum(len(k) for k in batch_keys)


def describe_signature(signature: tuple) -> str:
    """The signature in words, for the message naming ranks that reported different metrics."""
    keys, has_samples, batch_keys = signature
    text = f"metrics {list(keys)}"
    if has_samples:
        text += " and samples"
    if batch_keys:
        text += f" and batch_metrics {[list(k) for k in batch_keys]}"
    return text
