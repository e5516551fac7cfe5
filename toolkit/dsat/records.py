"""What the autotuner leaves in its output directory, and the event log that ``--resume`` reads.

Layout of ``OUTPUT_DIR``::

    search.json            the settings of the search (checked on --resume)
    events.jsonl           append-only log: one "start" and one "result" line per trial
    profile.json           the profiling numbers and the memory model's prediction
    trials.jsonl           one record per finished trial: config, status, metrics, duration
    trials.csv             the same as a table
    best_ds_config.json    the best DeepSpeed config: complete, no autotuning leftovers
    best_ds_metrics.json   its metrics and trial id
    tensorboard/           each trial's metrics, with its config in TensorBoard's HParams view
    trials/trial_<id>/     each trial's ds_config.json, hparams.json, logs and result
    full_experiment/       with --run-full-experiment: the run with the best config

Rank 0 only: everything here runs in the autotuner's own process.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from toolkit._files import atomic_write
from toolkit.dsat.contract import METRICS
from toolkit.dsat.search.types import TrialResult, TrialSpec

__all__ = ["EventLog", "write_trial_tables", "TensorBoardTrials", "summary_table",
           "flatten_zero"]


class EventLog:
    """Append-only JSON-lines log of trial starts and results, fsynced per line.

    A crash can cut the last line short; :meth:`read` ignores a torn final line (it was never
    acknowledged), and any other unreadable line is an error, since the search cannot be rebuilt.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, event: Mapping[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(event, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        events = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):
                    break  # torn last line of an interrupted write
                raise ValueError(f"{self.path}: line {number} is not valid JSON; the search log is damaged. "
                                 "Start a new search in another --output-dir") from None
        return events

    def started(self, spec: TrialSpec, *, observed_before: int) -> None:
        self.append({"event": "start", "trial_id": spec.trial_id, "observed_before": observed_before,
                     "spec": spec.to_json()})

    def finished(self, result: TrialResult) -> None:
        self.append({"event": "result", "trial_id": result.spec.trial_id, "result": result.to_json()})


def flatten_zero(spec: TrialSpec) -> dict[str, Any]:
    """The trial's knobs as flat scalar columns: micro_batch, stage, and zero.<key> values."""
    row: dict[str, Any] = {"micro_batch": spec.micro_batch, "stage": spec.stage}
    for key, value in sorted(spec.zero.items()):
        if key == "stage":
            continue
        row[f"zero.{key}"] = json.dumps(value) if isinstance(value, (dict, list)) else value
    return row


def _record(result: TrialResult) -> dict[str, Any]:
    return {"trial_id": result.spec.trial_id, "line": result.spec.line, "profile": result.spec.profile,
            "status": result.status.value, **flatten_zero(result.spec),
            **{m: result.metrics.get(m) for m in METRICS}, "duration_s": round(result.duration_s, 3),
            "error": result.error}


def write_trial_tables(output_dir: Path, results: Iterable[TrialResult], *,
                       overrides: Callable[[TrialSpec], Mapping[str, Any]] | None = None) -> None:
    """Rewrite trials.jsonl and trials.csv from all finished trials (sorted by trial id).

    ``overrides``: a trial's ``ds_overrides`` in trials.jsonl (default: ``spec.ds_overrides()``;
    the orchestrator adds the batch triple the global batch policy gave the trial)."""
    ordered = sorted(results, key=lambda r: r.spec.trial_id)
    records = [_record(r) for r in ordered]
    over = overrides or (lambda spec: spec.ds_overrides())
    jsonl = "".join(json.dumps({**rec, "ds_overrides": dict(over(r.spec))}, sort_keys=True) + "\n"
                    for rec, r in zip(records, ordered, strict=True))
    atomic_write(output_dir / "trials.jsonl", jsonl)
    columns: list[str] = []
    for rec in records:
        columns += [c for c in rec if c not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    atomic_write(output_dir / "trials.csv", buf.getvalue())


class TensorBoardTrials:
    """One TensorBoard run per trial: its metrics as scalars and its config in the HParams view."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir

    def add(self, result: TrialResult) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy import, only when there is a result

        hparams = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                   for k, v in flatten_zero(result.spec).items()}
        hparams["status"] = result.status.value
        metrics = {f"dsat/{m}": float(result.metrics[m]) for m in METRICS if m in result.metrics}
        if not metrics:
            metrics = {f"dsat/{METRICS[0]}": float("nan")}  # failed trials still appear in the table
        writer = SummaryWriter(log_dir=str(self.log_dir / f"trial_{result.spec.trial_id:04d}"))
        try:
            writer.add_hparams(hparams, metrics, run_name=".")
            for name, value in metrics.items():
                writer.add_scalar(name, value, global_step=result.spec.trial_id)
        finally:
            writer.close()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_table(results: Iterable[TrialResult], *, metric: str, best_id: int | None) -> str:
    """A plain-text table of all trials, the best marked with ``*``."""
    header = ["id", "stage", "mb", "status", *METRICS, "secs"]
    rows = []
    for r in sorted(results, key=lambda r: r.spec.trial_id):
        mark = "*" if r.spec.trial_id == best_id else ""
        rows.append([f"{r.spec.trial_id}{mark}", str(r.spec.stage), str(r.spec.micro_batch),
                     r.status.value + (" (profile)" if r.spec.profile else ""),
                     *[_fmt(r.metrics.get(m)) for m in METRICS], f"{r.duration_s:.1f}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(f"metric: {metric}; * = best")
    return "\n".join(lines)
