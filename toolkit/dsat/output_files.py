"""What the autotuner leaves in its output directory (the layout: docs/dsat.md#outputs-and-exit-status),
and the event log that ``--resume`` reads (docs/design-dsat-runner.md#output-files-and-the-event-log).
Rank 0 only: everything here runs in the autotuner's own process.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from toolkit._checks import is_number
from toolkit._files import atomic_write
from toolkit.bounded_load import parse_json
from toolkit.dsat.contract import METRICS, ProfileInfo, TrialStatus, clip_error
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.errors import ConfigError

__all__ = ["SEARCH_FILE", "EventLog", "event_problem", "write_trial_tables", "summary_table", "flatten_zero",
           "role", "search_file"]


#: The largest event log read (a line is a few hundred bytes; a trial's error text is cut).
MAX_LOG_BYTES = 256 * 2**20
#: The settings of the search, which ``--resume`` checks; an earlier toolkit named it search.json.
SEARCH_FILE = "dsat_search.json"
_OLD_SEARCH_FILE = "search.json"



def search_file(output_dir: Path) -> Path:
    """The record of the search's settings in ``output_dir``: today's name, else an earlier toolkit's
    ``search.json`` when only that one is there (``--resume`` reads it). Rank 0 only."""
    path = Path(output_dir) / SEARCH_FILE
    old = Path(output_dir) / _OLD_SEARCH_FILE
    return old if not path.exists() and old.exists() else path

def _read_log(path: Path) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(MAX_LOG_BYTES + 1)
    if len(data) > MAX_LOG_BYTES:
        raise ConfigError(f"over {MAX_LOG_BYTES // 2**20} MiB: not a search log this toolkit wrote; start a "
                          "new search in another --output-dir", source=str(path))
    return data


def _finite_metrics(metrics: Any) -> str | None:
    if not isinstance(metrics, dict):
        return f"metrics={metrics!r:.80}: expected an object"
    for name in METRICS:
        value = metrics.get(name)
        if not is_number(value) or not math.isfinite(value) or value < 0:
            return f"metric {name}={value!r:.40}: expected a finite number >= 0"
    return None


def event_problem(event: Any) -> str | None:
    """What is wrong with one parsed line of ``events.jsonl`` (a "start" line: ``trial_id``,
    ``observed_before`` >= 0, ``spec``; a "result" line: a checked :class:`TrialResult`), or None. Pure."""
    if not isinstance(event, dict):
        return f"expected a JSON object, got {type(event).__name__}"
    kind, trial_id = event.get("event"), event.get("trial_id")
    if kind not in ("start", "result"):
        return f"event={kind!r:.60}: expected 'start' or 'result'"
    if type(trial_id) is not int:
        return f"trial_id={trial_id!r:.60}: expected an integer"
    try:
        if kind == "start":
            observed = event.get("observed_before")
            if type(observed) is not int or observed < 0:
                return f"observed_before={observed!r:.60}: expected an integer >= 0"
            spec = TrialSpec.from_json(event["spec"])
        else:
            result = TrialResult.from_json(event["result"])
            spec = result.spec
            problem = _finite_metrics(result.metrics) if result.status is TrialStatus.OK else None
            ok = result.status is TrialStatus.OK
            if problem is None and (result.profile is not None or (spec.profile and ok)):
                problem = ProfileInfo.problem(result.profile)
                problem = problem and f"profile: {problem}"
            if problem is None and not isinstance(result.error, (str, type(None))):
                problem = f"error={result.error!r:.60}: expected a string or null"
            peak = event["result"].get("peak_bytes")
            if problem is None and peak is not None and (type(peak) is not int or peak < 0):
                problem = f"peak_bytes={peak!r:.60}: expected an integer >= 0 or null"
            limit = event["result"].get("data_limit")
            if problem is None and limit is not None and (type(limit) is not int or limit < 1):
                problem = f"data_limit={limit!r:.60}: expected an integer >= 1 or null"
            if problem:
                return problem
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        return (f"the {kind} record of trial {trial_id} is incomplete or of the wrong kind "
                f"({type(err).__name__}: {err!s:.200})")
    if spec.trial_id != trial_id:
        return f"trial_id={trial_id} but its spec says trial {spec.trial_id}"
    return None


class EventLog:
    """Append-only JSON-lines log of trial starts and results, fsynced per line. A torn final line is
    ignored and removed by the next :meth:`append`; any other damaged line is a ConfigError naming the
    line and its repair (docs/design-dsat-runner.md#output-files-and-the-event-log)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tail_checked = False

    def append(self, event: Mapping[str, Any]) -> None:
        if not self._tail_checked:
            self._repair_tail()
            self._tail_checked = True
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(event, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _repair_tail(self) -> None:
        """End the log with a newline: a complete last line gets one, a torn one (never acknowledged) goes."""
        try:
            with open(self.path, "rb+") as fh:
                end = fh.seek(0, os.SEEK_END)
                start = max(end - MAX_LOG_BYTES, 0)
                fh.seek(start)
                data = fh.read()
                if not data or data.endswith(b"\n"):
                    return
                cut = data.rfind(b"\n") + 1
                try:
                    json.loads(data[cut:].decode("utf-8"))
                    fh.write(b"\n")
                except ValueError:
                    fh.truncate(start + cut)
                fh.flush()
                os.fsync(fh.fileno())
        except FileNotFoundError:
            return

    def _damaged(self, number: int, problem: str) -> ConfigError:
        path, kept = self.path, f"{self.path}.kept"
        keep = (f"keep its first {number - 1} line(s) and delete the rest (`head -n {number - 1} {path} > "
                f"{kept} && mv {kept} {path}`: the trials recorded after them run again)"
                if number > 1 else f"delete {path}")
        return ConfigError(f"line {number}: {problem}; the search log is damaged there and cannot be "
                           f"replayed past it: {keep}, or start a new search in another --output-dir",
                           source=str(self.path))

    def read(self) -> list[dict[str, Any]]:
        """Every event, checked (:func:`event_problem`); a trial's error text cut to ``MAX_ERROR_CHARS``.

        Raises:
            ConfigError: naming the file, the damaged line and how to repair the log.
        """
        if not self.path.exists():
            return []
        data = _read_log(self.path)
        lines = data.split(b"\n")
        if lines and not lines[-1].strip():
            lines.pop()
        events = []
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                event = parse_json(raw.decode("utf-8"), source=f"{self.path}, line {number}")
            except (UnicodeDecodeError, ConfigError) as err:
                if number == len(lines) and not data.endswith(b"\n"):
                    break  # torn last line of an interrupted write
                why = err.problems[0] if isinstance(err, ConfigError) else f"not UTF-8 ({err.reason})"
                raise self._damaged(number, why) from None
            problem = event_problem(event)
            if problem is not None:
                raise self._damaged(number, problem)
            if event["event"] == "result":
                event["result"]["error"] = clip_error(event["result"].get("error"))
            events.append(event)
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


def role(spec: TrialSpec) -> str:
    """What a trial was for: ``profiling`` (the memory model's), ``re-run`` (confirming the best),
    ``own`` (the user's config as written) or ``tuning`` (the search method's). Pure."""
    return "profiling" if spec.profile else "re-run" if spec.rerun else "own" if spec.baseline else "tuning"


def _order(result: TrialResult) -> tuple[int, int]:
    """Profiling trials first in the order they ran (their label), then the others by id."""
    spec = result.spec
    if spec.profile:
        label = spec.label[1:]
        return 0, int(label) if label.isdigit() else -spec.trial_id
    return 1, spec.trial_id


def _record(result: TrialResult) -> dict[str, Any]:
    return {"trial": result.spec.name, "role": role(result.spec), "trial_id": result.spec.trial_id,
            "line": result.spec.line, "profile": result.spec.profile,
            "status": result.status.value, **flatten_zero(result.spec),
            **{m: result.metrics.get(m) for m in METRICS}, "duration_s": round(result.duration_s, 3),
            "error": result.error}


def write_trial_tables(output_dir: Path, results: Iterable[TrialResult], *,
                       overrides: Callable[[TrialSpec], Mapping[str, Any]] | None = None) -> None:
    """Rewrite trials.jsonl and trials.csv from all finished trials, the profiling trials first in the
    order they ran. ``overrides``: a trial's ``ds_overrides`` there (default ``spec.ds_overrides()``;
    the orchestrator adds the batch triple the global batch policy gave the trial)."""
    ordered = sorted(results, key=_order)
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


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_table(results: Iterable[TrialResult], *, metric: str, best_id: int | None,
                  spreads: Sequence[tuple[TrialSpec, str]] = ()) -> str:
    """A plain-text table of all trials in sections (profiling trials, tuning trials, re-runs),
    the best marked with ``*``; then ``spreads``: each configuration measured more than once, with
    its measurements (``confirm.Candidate.spread``)."""
    header = ["trial", "stage", "mb", "status", *METRICS, "secs"]
    sections: dict[str, list[list[str]]] = {"profiling": [], "tuning": [], "own": [], "re-run": []}
    for r in sorted(results, key=_order):
        mark = "*" if r.spec.trial_id == best_id else ""
        sections[role(r.spec)].append([f"{r.spec.name}{mark}", str(r.spec.stage), str(r.spec.micro_batch),
                                       r.status.value, *[_fmt(r.metrics.get(m)) for m in METRICS],
                                       f"{r.duration_s:.1f}"])
    rows = [row for section in sections.values() for row in section]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    titles = {"profiling": "profiling trials (the memory model's; p1 is micro-batch 1)",
              "tuning": "tuning trials (the search's)", "own": "your own config as written",
              "re-run": "re-runs (confirming the best)"}
    for kind, section in sections.items():
        if section:
            lines.append(f"-- {titles[kind]}: {len(section)}")
            lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in section]
    if spreads:
        lines.append(f"-- configurations measured more than once ({metric}):")
        lines += [f"stage {spec.stage} mb {spec.micro_batch}: {text}" for spec, text in spreads]
    lines.append(f"metric: {metric}; * = best (the trial at its configuration's median)")
    return "\n".join(lines)
