"""The boundary the tuning trials found per ZeRO stage, beside the memory model's prediction
(``profile.json`` and the summary). Pure; rank 0 by convention.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

__all__ = ["found_boundaries", "format_boundaries"]


def found_boundaries(results: Iterable[Any]) -> dict[int, dict[str, int | None]]:
    """Per stage, the largest micro-batch that ran (``largest_ok``) and the smallest out of memory
    (``smallest_oom``) among the tuning trials' results; None where no trial says. Pure."""
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
    """One line per stage the trials ran: the predicted largest micro-batch and what was found. Pure."""
    lines = []
    for stage, row in sorted(found.items()):
        predicted = prediction.get(stage) or prediction.get(str(stage)) or {}
        shown = predicted.get("approx_max_micro_batch", "?")
        lines.append(f"stage {stage}: predicted largest micro-batch {shown}; found: largest ok "
                     f"{row['largest_ok'] if row['largest_ok'] is not None else 'none'}, smallest oom "
                     f"{row['smallest_oom'] if row['smallest_oom'] is not None else 'none'}")
    return "\n".join(lines)
