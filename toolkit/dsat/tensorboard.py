"""dsat's TensorBoard run (``OUTPUT_DIR/tensorboard``): one run per trial, and curves per ZeRO config
against the micro-batch, rewritten whole after each trial (:func:`toolkit.metrics.tb_events.write_run`).
The runs and tags: docs/design-dsat-runner.md#tensorboard. Autotuner process only. Example::

    tensorboard --logdir runs/dsat/tensorboard      # Scalars: metrics/throughput, memory/peak_MiB
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

from toolkit.bounded_load import load_json
from toolkit.dsat.contract import METRICS, ProfileInfo, TrialStatus
from toolkit.dsat.search import memory
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.errors import ConfigError

__all__ = ["TensorBoardTrials", "curve_key", "curve_names", "curve_series", "read_profile"]

_MIB = float(2**20)
Series = dict[str, list[tuple[int, float]]]


def curve_key(spec: TrialSpec) -> str:
    """The curves of a trial's stage and what it offloads: ``stage_3_offload_optimizer``."""
    off_opt, off_par = memory.offload_flags(spec.zero)
    return f"stage_{spec.stage}{'_offload_optimizer' if off_opt else ''}{'_offload_param' if off_par else ''}"


def curve_names(specs: Iterable[TrialSpec]) -> dict[int, str]:
    """Each trial's curve by trial id, one per ZeRO configuration: :func:`curve_key` for the one
    of the stage's lowest search line (the profiling trials'), ``<key>_line_<n>`` for another."""
    specs = list(specs)
    group = {s.trial_id: (curve_key(s), json.dumps(dict(s.zero), sort_keys=True, default=str)) for s in specs}
    lowest: dict[tuple[str, str], int] = {}
    for s in specs:
        lowest[group[s.trial_id]] = min(lowest.get(group[s.trial_id], s.line), s.line)
    first = {key: min(line for (k, _), line in lowest.items() if k == key) for key, _ in lowest}
    return {tid: key if lowest[(key, zero)] == first[key] else f"{key}_line_{lowest[(key, zero)]}"
            for tid, (key, zero) in group.items()}


def read_profile(output_dir: Path) -> ProfileInfo | None:
    """The memory model's profile in ``output_dir/profile.json``; None when absent or damaged."""
    try:
        data = load_json(Path(output_dir) / "profile.json", what="profile record")
        return ProfileInfo.from_json(data["profile"])
    except (OSError, ConfigError, KeyError, TypeError, ValueError):
        return None


def _grid(tried: Iterable[int], also: int | None) -> list[int]:
    """Where a line is drawn: the tried micro-batches, the powers of two up to the largest, and ``also``."""
    points = {m for m in tried if m >= 1}
    top = max(points | {also or 1})
    points |= {1 << k for k in range(top.bit_length()) if 1 << k <= top}
    return sorted(points | ({also} if also else set()))


def curve_series(results: Iterable[TrialResult], *, profile: ProfileInfo | None, data_parallel_size: int,
                 memory_only: Callable[[TrialSpec], bool] = lambda spec: False) -> dict[str, Series]:
    """Every curve run's scalars: run name -> tag -> ``(micro-batch, value)`` points. ``memory_only``: a
    profiling trial that is a point of the memory curve only; failed, timed-out, mismatched: none. Pure."""
    runs: dict[str, Series] = {}
    tried: dict[str, tuple[TrialSpec, set[int]]] = {}
    results = list(results)
    names = curve_names(r.spec for r in results)
    for r in results:
        key, m = curve_key(r.spec), r.spec.micro_batch
        if r.status not in (TrialStatus.OK, TrialStatus.OOM):
            continue
        tried.setdefault(key, (r.spec, set()))[1].add(m)
        series = runs.setdefault(f"curves/{names[r.spec.trial_id]}", {})
        if r.status is TrialStatus.OK and not memory_only(r.spec):
            for name in METRICS:
                if name in r.metrics:
                    series.setdefault(f"metrics/{name}", []).append((m, float(r.metrics[name])))
        if r.status is TrialStatus.OK and r.peak_bytes:
            series.setdefault("memory/peak_MiB", []).append((m, r.peak_bytes / _MIB))
        elif r.status is TrialStatus.OOM and (r.peak_bytes or profile is not None):
            # out of memory: the peak reached the budget, whatever was seen before the end
            peak = max(r.peak_bytes or 0, int(profile.memory_per_slot) if profile is not None else 0)
            series.setdefault("memory/peak_MiB_oom", []).append((m, peak / _MIB))
    if profile is None or not tried:
        return runs
    everywhere: set[int] = set()
    for key, (spec, micro_batches) in tried.items():
        off_opt, off_par = memory.offload_flags(spec.zero)
        kw: dict[str, Any] = dict(data_parallel_size=data_parallel_size, offload_optimizer=off_opt,
                                  offload_param=off_par)
        grid = _grid(micro_batches, memory.approx_max_micro_batch(profile, spec.stage, **kw))
        everywhere |= set(grid)
        runs[f"curves/{key}_predicted"] = {"memory/peak_MiB": [
            (m, memory.predicted_peak_bytes(profile, spec.stage, m, **kw) / _MIB) for m in grid]}
    runs["curves/budget"] = {"memory/peak_MiB": [(m, int(profile.memory_per_slot) / _MIB)
                                                 for m in sorted(everywhere)]}
    return runs


class TensorBoardTrials:
    """Writes ``log_dir``. ``data_parallel_size``, ``memory_only``: the search's (the predicted lines, and
    :meth:`toolkit.dsat.tuning_plan.Plan.memory_only`). Autotuner process only."""

    def __init__(self, log_dir: Path, *, data_parallel_size: int = 1,
                 memory_only: Callable[[TrialSpec], bool] = lambda spec: False) -> None:
        self.log_dir = Path(log_dir)
        self.data_parallel_size = data_parallel_size
        self.memory_only = memory_only

    def add(self, result: TrialResult, results: Iterable[TrialResult] = ()) -> None:
        """The trial's own run; then the curves of ``results`` (every trial so far) rewritten."""
        if result.status is TrialStatus.MISMATCH:
            return  # it measured another config than its label: nothing to show as this config's
        self._trial_run(result)
        profile = read_profile(self.log_dir.parent)
        self.write_curves(curve_series(results, profile=profile, data_parallel_size=self.data_parallel_size,
                                       memory_only=self.memory_only))

    def write_curves(self, runs: dict[str, Series]) -> None:
        from toolkit.metrics.tb_events import write_run  # tensorboard is slow to import

        for run, series in runs.items():
            write_run(self.log_dir / run, series, name="dsat-curve")

    def _trial_run(self, result: TrialResult) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summaries  # slow imports

        from toolkit.dsat.output_files import flatten_zero, role
        from toolkit.metrics.tb_events import write_run

        hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                   for k, v in flatten_zero(result.spec).items()}
        hparams["status"] = result.status.value
        hparams["role"] = role(result.spec)
        metrics = {f"dsat/{m}": float(result.metrics[m]) for m in METRICS if m in result.metrics}
        if not metrics:
            metrics = {f"dsat/{METRICS[0]}": float("nan")}  # failed trials still appear in the table
        if result.peak_bytes:
            metrics["dsat/peak_MiB"] = result.peak_bytes / _MIB
        spec = result.spec
        name = spec.name if spec.label else f"{spec.trial_id:04d}"
        points = {tag: [(spec.micro_batch, value)] for tag, value in metrics.items()}
        write_run(self.log_dir / f"trial_{name}", points, name="dsat-trial",
                  summaries=hparams_summaries(hparams, metrics))
