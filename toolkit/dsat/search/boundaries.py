"""The boundary the tuning trials found, per ZeRO stage, beside the memory model's prediction
(``profile.json`` and the summary). Pure; rank 0 by convention.

Example::

    found = found_boundaries(results)
    print(format_boundaries(prediction, found))
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

__all__ = ["found_boundaries", "format_boundaries"]


def found_boundaries(results: Iterable[Any]) -> dict[int, dict[str, int | None]]:
    """Per ZeRO stage, the boundary the tuning trials found: the largest micro-batch that ran
    (``largest_ok``) and the smallest that ran out of memory (``smallest_oom``), None where no
    trial says. ``results``: :class:`~toolkit.dsat.search.types.TrialResult` objects (profiling
    trials are left out). Pure; rank 0 by convention.
    """
    out: dict[int, dict[str, int | None]] = {}
    for r in results:
        if r.spec.profile or r.status.value not in ("ok", "oom"):
            continue
        row = out.setdefault(r.spec.stage, {"largest_ok": None, "smallest_oom": None})
        key, pick = ("largest_ok", max) if r.status.value == "ok" else ("smallest_oom", min)
        row[key] = r.spec.micro_batch if row[key] is None else pick(row[key], r.spec.micro_batch)
    return dict(sorted(out.items()))


def format_boundaries(prediction: Mapping[Any, Mapping[str, Any]],
                      found: Mapping[int, Mapping[str, int | None]]) -> str:
    """Lines ``stage S: predicted largest micro-batch P; found: largest ok A, smallest oom B``,
    for the stages the trials ran. ``prediction``: :func:`predict`'s (keys int or str). Pure.

    Example:
        >>> print(format_boundaries({"1": {"approx_max_micro_batch": 40}},
        ...                         {1: {"largest_ok": 38, "smallest_oom": 41}}))
        stage 1: predicted largest micro-batch 40; found: largest ok 38, smallest oom 41
    """
    lines = []
    for stage, row in sorted(found.items()):
        predicted = prediction.get(stage) or prediction.get(str(stage)) or {}
        shown = predicted.get("approx_max_micro_batch", "?")
        lines.append(f"stage {stage}: predicted largest micro-batch {shown}; found: largest ok "
                     f"{row['largest_ok'] if row['largest_ok'] is not None else 'none'}, smallest oom "
                     f"{row['smallest_oom'] if row['smallest_oom'] is not None else 'none'}")
    return "\n".join(lines)
