"""A search's trial's reports read into its :class:`~toolkit.run.search_state.TrialRecord` while it runs,
and how it ended. Runner process only (the main thread of :mod:`toolkit.run.scheduler` and
:mod:`toolkit.run.slurm_engine`). The handshake with the trial's chief:
docs/design-determined.md#the-report-handshake. Example::

    watcher = ReportWatcher(state, trial, config, trial_dir, save)
    if watcher():                # a report ASHA stopped it at
        forwarder.searcher_stop()
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Mapping

from toolkit._checks import is_number
from toolkit._files import atomic_write
from toolkit.bounded_load import load_json
from toolkit.launch.trial_files import (
    EARLY_EXIT_FILE,
    EXIT_REASONS,
    OPS_ACK_FILE,
    OPS_FILE,
    PROGRESS_FILE,
    TRIAL_FILE,
    load_trial_state,
)
from toolkit.run.process import Forwarder
from toolkit.run.search_state import SearchState, TrialRecord
from toolkit.run.searchers import asha_report, better, exited_early
from toolkit.run.trial import stop_record_of

__all__ = ["ReportWatcher", "finish_trial", "stopped_early"]

logger = logging.getLogger("toolkit.run")


def _validations(path: Path, offset: int) -> list[tuple[dict[str, Any], int]]:
    """Complete validation lines of ``metrics.jsonl`` after ``offset``: (metrics, offset after the line)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return []
    lines, end = [], offset
    for raw in data[: data.rfind(b"\n") + 1].splitlines(keepends=True):
        end += len(raw)
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("group") == "validation":
            lines.append((line.get("metrics") or {}, end))
    return lines


class ReportWatcher:
    """Feeds the running trial's reports to the searcher; True: stop the trial (ASHA). :attr:`offset` is how
    far ``metrics.jsonl`` was read (the ack); :meth:`finish` reads the rest after the trial ended. Under
    a 0.37 ASHA section it judges the completed searcher operations:
    docs/design-determined.md#the-report-handshake."""

    def __init__(self, state: SearchState, trial: TrialRecord, config: Mapping[str, Any],
                 trial_dir: Path, save: Callable[[], None]) -> None:
        self.state, self.trial, self.config, self.save = state, trial, config, save
        self.path, self.offset = trial_dir / "metrics.jsonl", 0
        s = config.get("searcher") or {}
        self.metric, self.time_metric = str(s.get("metric")), str(s.get("time_metric"))
        self.smaller = s.get("smaller_is_better", True) is not False
        self.asha = state.searcher == "adaptive_asha"
        self.legacy = self.asha and not s.get("time_metric")
        self.stop = False
        self.ops_read = self.ops_acked = 0
        self._seen: dict[str, tuple[int, int]] = {}

    def __call__(self) -> bool:
        self._ack_ops()  # read at the last poll: any stop they earned was sent since
        self._read(feed=not self.stop, final=False)
        if not self.stop:
            self._ack_ops()
        return self.stop

    def finish(self, *, stop_sent: bool) -> None:
        """Read the reports written since the last poll (``stop_sent``: the searcher's stop reached it)."""
        self._read(feed=not stop_sent, final=True)
        if self.legacy and self.ops_read == 0 and self.offset > 0:
            logger.warning("%s reported validations but completed no searcher operation: a search of "
                           "max_length without time_metric (Determined 0.37's form) judges "
                           "op.report_completed(metric), so ASHA did not judge it; loop over "
                           "core_context.searcher.operations(), or set time_metric and max_time",
                           self.trial.dir)

    def _read(self, *, feed: bool, final: bool) -> None:
        changed = self._read_validations(feed=feed, final=final)
        if self.legacy and not self.stop:
            changed = self._read_ops(feed=feed, final=final) or changed
        changed = self._read_progress() or changed
        if changed:
            self.save()

    def _record(self, value: float) -> None:
        """A searcher metric the trial reported: its latest and its best (a non-finite one is null)."""
        if not math.isfinite(value):
            logger.warning("%s: searcher.metric %r=%r is not finite: the trial ranks last and is never "
                           "the best", self.trial.dir, self.metric, value)
        self.trial.metric = value if math.isfinite(value) else None
        if math.isfinite(value):
            self.trial.best_metric = better(value, self.trial.best_metric, smaller_is_better=self.smaller)

    def _judge(self, step: float, value: float, *, feed: bool, final: bool) -> bool:
        """Feed ASHA one report; True (and logged): the searcher stops the trial now."""
        self.trial.time = step
        if feed and asha_report(self.state, self.trial.index, time_step=float(step or 0),
                                metric=float(value), config=self.config) and not final:
            self.stop = True
            logger.info("searcher: stopping %s at %s=%s: below the top of its rung", self.trial.dir,
                        "op.length" if self.legacy else self.time_metric, step)
        return self.stop

    def _read_validations(self, *, feed: bool, final: bool) -> bool:
        changed, judged = False, self.asha and not self.legacy
        for metrics, end in _validations(self.path, self.offset):
            self.offset, changed = end, True
            if self.metric not in metrics:
                continue
            value, step = metrics[self.metric], metrics.get(self.time_metric)
            if not is_number(value) or (judged and not (is_number(step) and math.isfinite(step))):
                logger.warning("%s: validation report skipped: searcher.metric %r=%r, time_metric %r=%r "
                               "(expected numbers, a finite time)", self.trial.dir, self.metric, value,
                               self.time_metric, step)
                continue
            self._record(value)
            if judged and is_number(step) and self._judge(step, value, feed=feed, final=final):
                break
        return changed

    def _load(self, name: str) -> Any:
        """A small JSON record of the trial's directory when it changed since the last look, else None."""
        path = self.path.with_name(name)
        try:
            stat = path.stat()
            if self._seen.get(name) == (stat.st_mtime_ns, stat.st_size):
                return None
            record = load_json(path, what="trial record")
        except (OSError, ValueError):  # absent, or being replaced: the next look
            return None
        self._seen[name] = (stat.st_mtime_ns, stat.st_size)
        return record if isinstance(record, dict) else None

    def _read_ops(self, *, feed: bool, final: bool) -> bool:
        record = self._load(OPS_FILE)
        ops = record.get("ops") if record else None
        if not isinstance(ops, list) or len(ops) <= self.ops_read:
            return False
        for op in ops[self.ops_read:]:
            self.ops_read += 1
            op = op if isinstance(op, dict) else {}
            length, value = op.get("length"), op.get("searcher_metric")
            if not (is_number(value) and is_number(length)):
                logger.warning("%s: searcher operation skipped: op.report_completed(%r) at op.length %r "
                               "(ASHA expects a number)", self.trial.dir, value, length)
                continue
            self._record(value)
            if self._judge(length, value, feed=feed, final=final):
                break
        return True

    def _ack_ops(self) -> None:
        if self.ops_read != self.ops_acked:
            atomic_write(self.path.with_name(OPS_ACK_FILE), str(self.ops_read))
            self.ops_acked = self.ops_read

    def _read_progress(self) -> bool:
        record = self._load(PROGRESS_FILE)
        value = record.get("progress") if record else None
        if not (is_number(value) and math.isfinite(value)):
            return False
        value = min(max(float(value), 0.0), 1.0)
        changed = self.trial.progress != value
        self.trial.progress = value
        return changed


def stopped_early(state: SearchState, trial: TrialRecord, forwarder: Forwarder) -> bool:
    """The searcher's stop reached the run before it ended by itself (not at max_time). Pure."""
    if not forwarder.searcher_sent:
        return False
    max_time = (state.searcher_config or {}).get("max_time")
    return not (is_number(max_time) and trial.time is not None and trial.time >= max_time)


def _early_exit(trial_dir: Path) -> str | None:
    """The early exit the trial reported (``train.report_early_exit``), or None."""
    try:
        record = load_json(trial_dir / EARLY_EXIT_FILE, what="early exit record")
    except (OSError, ValueError):
        return None
    reason = record.get("reason") if isinstance(record, dict) else None
    return reason if reason in EXIT_REASONS else None


def finish_trial(state: SearchState, trial: TrialRecord, watcher: ReportWatcher, forwarder: Forwarder,
                 status: int, trial_dir: Path) -> None:
    """Record how a trial's runs ended: the reports since the last poll, its state, id and status, and
    an early exit (reported, or ``ERRORED``: failed for good) as Determined's searcher took it."""
    watcher.finish(stop_sent=forwarder.searcher_sent)
    trial.stopped_early = stopped_early(state, trial, forwarder)
    if (trial_dir / TRIAL_FILE).exists():
        trial.trial_id = load_trial_state(trial_dir, write=False)["trial_id"]
    trial.exit_status = status
    preempted = forwarder.received is not None or stop_record_of(trial_dir) is not None  # ranks' own stop
    if preempted and not trial.stopped_early:  # stopped by the searcher: done
        trial.state = "PAUSED"
    elif status != 0 and trial.stopped_early:
        logger.warning("%s exited with status %d after the searcher's stop; counted as stopped early",
                       trial.dir, status)
        trial.state = "COMPLETED"
    else:
        trial.state = "COMPLETED" if status == 0 else "ERROR"
    if trial.state == "PAUSED" or trial.stopped_early or trial.early_exit:
        return
    reason = _early_exit(trial_dir) or ("ERRORED" if trial.state == "ERROR" else None)
    if reason is not None:
        exited_early(state, trial, reason)
        logger.info("searcher: %s exited early (%s)%s", trial.dir, reason,
                    "; another trial takes its place" if reason == "INVALID_HP"
                    and state.searcher in ("random", "adaptive_asha") else "")
