"""The runner's heartbeat of a running dsat trial (from its chief's ``progress.json``) and the peak
memory it records of each. Pure but for :func:`read_progress`; autotuner process only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from toolkit._checks import is_int
from toolkit.bounded_load import load_json
from toolkit.dsat.contract import PROGRESS_FILE
from toolkit.dsat.search.types import TrialSpec
from toolkit.errors import ConfigError

__all__ = ["heartbeat_text", "peak_bytes", "phase", "read_progress"]


def read_progress(directory: Path) -> dict[str, Any] | None:
    """The trial's last progress note, or None (none yet, or not readable as one)."""
    try:
        data = load_json(Path(directory) / PROGRESS_FILE, max_bytes=64 * 1024, what="progress note")
    except (OSError, ConfigError):
        return None
    return data if isinstance(data, dict) else None


def phase(progress: Mapping[str, Any] | None) -> str:
    """Where a trial is, from its progress note: starting, warming up, timing step k of n."""
    if not progress or not is_int(progress.get("step")):
        return "starting (no training step yet)"
    timed, to_time = progress.get("timed"), progress.get("to_time")
    if not (is_int(timed) and is_int(to_time)) or timed == 0:
        step = progress["step"]
        return f"warming up ({step} step{'' if step == 1 else 's'} done)"
    if timed >= to_time:
        return f"timed {timed} steps, reporting"
    return f"timing step {timed + 1} of {to_time}"


def heartbeat_text(spec: TrialSpec, *, elapsed_s: float, timeout_s: float,
                   progress: Mapping[str, Any] | None) -> str:
    """The heartbeat line of a running trial: its phase, its time against its timeout."""
    return (f"trial {spec.name} (stage {spec.stage}, mb {spec.micro_batch}): {phase(progress)} | "
            f"{elapsed_s:.0f} s of {timeout_s:g} s")


def peak_bytes(polled: int, progress: Mapping[str, Any] | None,
               profile: Mapping[str, Any] | None) -> int | None:
    """A trial's peak memory: the largest of the runner's polls of its ranks (CPU), its chief's
    last note and its profile's peaks; None when none was seen."""
    seen = [polled] + [source.get(key) for source, key in ((progress or {}, "peak_bytes"),
                                                            (profile or {}, "peak_bytes"),
                                                            (profile or {}, "startup_peak_bytes"))]
    values = [int(v) for v in seen if is_int(v) and v > 0]
    return max(values) if values else None
