"""Averaging a batch of metric reports across ranks in one all-reduce, the ranks' agreement on names
and steps checked exactly, for :class:`toolkit.MetricsWriter`. All ranks, the same reports in the
same order. The vector's layout: docs/training.md (What a report costs)."""

from __future__ import annotations

import itertools
from typing import Any

from toolkit.metrics.pending import Report, describe_signature, signature_size
from toolkit.runtime.context import DistributedContext

__all__ = ["MAX_BATCH", "next_batch_size", "reduce_reports"]

HEADER = 3
_STEP_MOD = 1 << 16
MAX_BATCH = 1000   # adaptive batches: at most this many reports wait for their collective


def _vector(reports: list[Report], agreed: dict[str, tuple], elapsed: float, *, real: bool) -> list[float]:
    """This rank's contribution; with ``real=False`` a report not matching ``agreed`` is flagged."""
    out: list[float] = [elapsed]   # for the adaptive batch size
    for r in reports:
        step = r.steps % _STEP_MOD
        if real or r.signature == agreed.get(r.group):
            out += [0.0, step, step * step, *r.values]
        else:
            known = agreed.get(r.group)
            out += [1.0] + [0.0] * (HEADER - 1 + (signature_size(known) if known is not None else 0))
    return out


def _agree_on_names(ctx: DistributedContext, reports: list[Report], agreed: dict[str, tuple],
                    where: str) -> None:
    """All ranks: gather every report's names; raise on every rank if they differ, else record them."""
    signatures = ctx.all_gather_object([(r.group, r.signature) for r in reports])
    if any(s != signatures[0] for s in signatures):
        # The first report of the batch that differs (lists of equal length: the ranks made the
        # same number of reports, each being a call on all ranks).
        i = next(i for i, mine in enumerate(signatures[0]) if any(s[i] != mine for s in signatures))
        lines = "; ".join(f"rank {rank}: {s[i][0]} {describe_signature(s[i][1])}"
                          for rank, s in enumerate(signatures))
        raise ValueError(f"{where}: the ranks reported different metrics at steps_completed="
                         f"{reports[i].steps} ({lines}); every rank must report the same names (and "
                         "batch_metrics / samples) in the same call: compute each metric on every rank")
    for r in reports:
        agreed[r.group] = r.signature


def _check_steps_agree(ctx: DistributedContext, reports: list[Report], sums: list[float], where: str) -> None:
    """All ranks: raise on every rank when some report's step differed between ranks."""
    offset, ws = 1, ctx.world_size
    for r in reports:
        total, squares = round(sums[offset + 1]), round(sums[offset + 2])
        if ws * squares != total * total:
            steps_by_rank = ctx.all_gather_object([r.steps for r in reports])
            raise ValueError(f"{where}: the ranks passed different steps_completed {steps_by_rank} "
                             "(indexed by rank; one list per rank, the reports not averaged yet); "
                             "pass the same optimizer step count on every rank")
        offset += HEADER + signature_size(r.signature)


def reduce_reports(ctx: DistributedContext, reports: list[Report], agreed: dict[str, tuple], *,
                   elapsed: float, where: str) -> tuple[list[list[float]], float]:
    """Average ``reports`` over the ranks. All ranks, with the same reports in the same order.

    ``agreed``: group -> the signature every rank used last (updated here). Returns each report's means
    and the mean seconds per report over all ranks; ValueError on every rank if names or steps differ."""
    sizes = [HEADER + signature_size(agreed[r.group]) if r.group in agreed else HEADER for r in reports]
    offsets = list(itertools.accumulate(sizes[:-1], initial=1))
    sums: Any = ctx.all_reduce(_vector(reports, agreed, elapsed, real=False), op="sum")
    if any(sums[o] > 0 for o in offsets):
        _agree_on_names(ctx, reports, agreed, where)
        sums = ctx.all_reduce(_vector(reports, agreed, elapsed, real=True), op="sum")
    _check_steps_agree(ctx, reports, sums, where)
    means, offset, ws = [], 1, ctx.world_size
    for r in reports:
        size = HEADER + signature_size(r.signature)
        means.append([v / ws for v in sums[offset + HEADER:offset + size]])
        offset += size
    return means, sums[0] / ws / len(reports)


def next_batch_size(seconds_per_report: float, reduce_secs: float) -> int:
    """How many reports the next adaptive batch holds: about ``reduce_secs`` worth, 1 to MAX_BATCH.
    Pure; every rank computes it from reduced values, so every rank picks the same size."""
    wanted = reduce_secs / seconds_per_report if seconds_per_report > 0 else MAX_BATCH
    return max(1, min(MAX_BATCH, round(wanted)))
