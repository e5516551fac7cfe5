"""Training and validation metrics, averaged across ranks, for TensorBoard and a JSON-lines file.

Every rank reports; training reports are averaged in batches (one small collective about every
``reduce_secs``); the chief alone writes. Files, costs and failures: docs/training.md (Metrics)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

from toolkit._checks import int_problem, is_number
from toolkit.errors import ConfigError
from toolkit.metrics.pending import PendingReports, Report
from toolkit.metrics.reduce import next_batch_size, reduce_reports
from toolkit.metrics.values import (
    SAMPLES_PER_SECOND,
    check_batch_metrics,
    check_samples,
    check_steps,
    metric_values,
)
from toolkit.runtime.context import DistributedContext

__all__ = ["MetricsSettings", "MetricsWriter", "SAMPLES_PER_SECOND"]

logger = logging.getLogger(__name__)

# Monotonic clock for throughput intervals; a module global so tests can substitute a fake one.
_monotonic = time.perf_counter


@dataclasses.dataclass(frozen=True)
class MetricsSettings:
    """Options of a :class:`MetricsWriter`, validated on creation (docs/training.md). Any rank.

    ``reduce_every``: reports averaged together, one collective (``None``: adaptive, about
    ``reduce_secs`` apart, 1 to 1000); a report returns its averages only when it completes a batch.
    ``resume_step``: the ``steps_completed`` of the checkpoint resumed from: TensorBoard hides the
    points the interrupted run wrote after it. Files flush every ``flush_every`` reports or ``flush_secs``."""

    jsonl_name: str = "metrics.jsonl"
    flush_every: int = 100
    flush_secs: float = 30.0
    reduce_every: int | None = None
    reduce_secs: float = 5.0
    resume_step: int | None = None

    def __post_init__(self) -> None:
        problems = [self._jsonl_name_problem(),
                    int_problem("flush_every", self.flush_every, minimum=1),
                    None if self.reduce_every is None else int_problem(
                        "reduce_every", self.reduce_every, minimum=1,
                        hint=" or None (adaptive, see reduce_secs)"),
                    None if self.resume_step is None else int_problem(
                        "resume_step", self.resume_step, minimum=0,
                        hint=" or None: the steps_completed of the checkpoint this run resumed from")]
        for field in ("flush_secs", "reduce_secs"):
            value = getattr(self, field)
            if not is_number(value) or not value > 0 or not math.isfinite(value):
                problems.append(f"{field}={value!r}: expected a finite number of seconds > 0")
        found = [p for p in problems if p]
        if found:
            raise ConfigError(found, source="MetricsSettings")

    def _jsonl_name_problem(self) -> str | None:
        name = self.jsonl_name
        if (not isinstance(name, str) or not name or name in (".", "..")
                or "/" in name or (os.sep in name) or bool(os.altsep and os.altsep in name)):
            return (f"jsonl_name={name!r}: expected a plain file name such as 'metrics.jsonl' "
                    "(no directory part); the file goes into log_dir")
        return None


class MetricsWriter:
    """Averages metrics across ranks; the chief writes them to TensorBoard and JSON lines.

    Construct it on all ranks (no collective) with the same ``log_dir``; ``**settings`` are
    :class:`MetricsSettings` fields. Every ``report_*`` call, and ``close()``, is a collective: all
    ranks, same order, same names and ``steps_completed``; a bad value raises before any collective::

        # torchrun --nproc_per_node 2 train.py
        with toolkit.MetricsWriter(ctx, "runs/exp1", resume_step=start) as metrics:  # all ranks
            metrics.report_training_metrics(step, {"loss": loss}, samples=len(batch))
    """

    def __init__(self, ctx: DistributedContext, log_dir: str | os.PathLike, **settings: Any) -> None:
        if not isinstance(ctx, DistributedContext):
            raise TypeError(f"ctx is {type(ctx).__name__}: expected the DistributedContext returned "
                            "by toolkit.init_distributed()")
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise TypeError(f"log_dir={log_dir!r}: expected a non-empty path (str or pathlib.Path)")
        self.ctx = ctx
        self.settings = MetricsSettings(**settings)
        self.log_dir = Path(log_dir)
        self._agreed: dict[str, tuple] = {}          # group -> names every rank reported
        self._pending = PendingReports()           # reported here, not averaged yet
        self._warned: set[str] = set()
        self._unflushed = 0
        self._closed = False
        self._tb: Any = None
        self._jsonl: Any = None
        if ctx.is_chief:
            # Imported here: tensorboard takes seconds to import and only the chief needs it.
            from toolkit.metrics.tb_events import EventFile

            s = self.settings
            purge = None if s.resume_step is None else int(s.resume_step) + 1
            self._tb = EventFile(self.log_dir, purge_step=purge)
            self._jsonl = open(self.log_dir / s.jsonl_name, "a", encoding="utf-8")
            # Flush what is buffered even if the user forgets close(); holds no reference to self.
            self._finalizer = weakref.finalize(self, _close_files, self._tb, self._jsonl)
            logger.info("writing metrics to %s", self.log_dir)
        # Started after the (slow, chief-only) file set-up, so the first interval is the loop's.
        self._clock_start = _monotonic()
        self._last_flush = self._clock_start
        self._last_reduce = self._clock_start
        # Adaptive batches start at 1: the first report also agrees on the names right away.
        self._batch = self.settings.reduce_every or 1

    # -- public API -----------------------------------------------------------------------------

    def report_training_metrics(self, steps_completed: int, metrics: Mapping[str, Any], *,
                                batch_metrics: Sequence[Mapping[str, Any]] | None = None,
                                samples: int | None = None) -> dict[str, float] | None:
        """Average training metrics; the chief writes ``training/<name>``. Call on all ranks.

        ``metrics``: name -> scalar (number, numpy scalar, one-element tensor). ``batch_metrics``: one dict
        per step since the previous report, the last for ``steps_completed`` (``training_batch/<name>``).
        ``samples``: this rank's samples since the previous report; adds ``samples_per_second`` over the
        time since the previous training or validation report. Returns the averages, the same on every
        rank, when this report completes a batch, else None. TypeError / ValueError name a bad value."""
        where = "report_training_metrics"
        self._check_open(where)
        now = _monotonic()
        steps = check_steps(steps_completed)
        keys, values = metric_values(where, metrics)
        batches = check_batch_metrics(where, batch_metrics, steps)
        check_samples(where, samples, keys)
        if not keys and not batches and samples is None:
            raise ValueError(f"{where}: nothing to report: metrics is empty and neither "
                             "batch_metrics nor samples is given")
        header = [] if samples is None else [float(samples), now - self._clock_start]
        signature = (keys, samples is not None, tuple(k for k, _ in batches))
        self._clock_start = now
        flat = header + values + [v for _, vs in batches for v in vs]
        self._pending.append("training", signature, steps, flat, now)
        if len(self._pending) < self._batch:
            return None
        return self._reduce_pending(where)[-1]

    def report_validation_metrics(self, steps_completed: int,
                                  metrics: Mapping[str, Any]) -> dict[str, float]:
        """Average validation metrics; the chief writes ``validation/<name>``. Call on all ranks.
        Pending training reports are averaged first, in the same collective. Returns the averages."""
        where = "report_validation_metrics"
        self._check_open(where)
        now = _monotonic()
        steps = check_steps(steps_completed)
        keys, values = metric_values(where, metrics)
        if not keys:
            raise ValueError(f"{where}: metrics is empty: expected at least one name -> number")
        # The throughput interval restarts here, so evaluation time is not counted as training.
        self._clock_start = now
        self._pending.append("validation", (keys, False, ()), steps, values, now)
        return self._reduce_pending(where)[-1]

    def flush(self) -> None:
        """Write buffered metrics to disk now. Any rank (no collective; a no-op off the chief). Training
        reports still waiting for their batch are written by the report completing it, or by close()."""
        if self._tb is not None and not self._closed:
            self._jsonl.flush()
            self._tb.flush()
        self._unflushed = 0
        self._last_flush = _monotonic()

    def close(self) -> None:
        """Average and write pending reports, flush and close the files. Call on all ranks (a collective
        only when reports are pending). Later reports raise; a second call does nothing."""
        if self._closed:
            return
        try:
            if self._pending:
                self._reduce_pending("close")
        finally:
            self._close_files()

    def _close_files(self) -> None:
        self._closed = True
        if self._tb is not None:
            self._finalizer()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # Other ranks may never reach a collective after an exception on this one: no collective.
        if self._pending and not self._closed:
            first, last = self._pending.step_range()
            logger.warning("dropping %d metric reports not averaged yet (steps %d-%d): the writer is "
                           "left by an exception", len(self._pending), first, last)
        self._pending.drain()
        if not self._closed:
            self._close_files()

    # -- internals ------------------------------------------------------------------------------

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise RuntimeError(f"{where}: this MetricsWriter is closed; create a new one to report more")

    def _reduce_pending(self, where: str) -> list[dict[str, float]]:
        """Average every pending report with one all-reduce; the chief writes them. All ranks."""
        reports = self._pending.drain()
        now = _monotonic()
        means, per_report = reduce_reports(self.ctx, reports, self._agreed, elapsed=now - self._last_reduce,
                                           where=where)
        results = [self._average(r, m) for r, m in zip(reports, means, strict=True)]
        self._last_reduce = now
        if self.settings.reduce_every is None:
            self._batch = next_batch_size(per_report, self.settings.reduce_secs)
        return results

    def _average(self, report: Report, means: list[float]) -> dict[str, float]:
        """One report's averages (``means``: its values summed over ranks / world size); writes it."""
        keys, has_samples, batch_keys = report.signature
        result: dict[str, float] = {}
        if has_samples:
            samples, elapsed = means[0] * self.ctx.world_size, means[1]
            result[SAMPLES_PER_SECOND] = samples / elapsed if elapsed > 0 else math.nan
            means = means[2:]
        result.update(zip(keys, means, strict=False))  # batch values follow
        result = dict(sorted(result.items()))
        offset, batch_out = len(keys), []
        for i, bkeys in enumerate(batch_keys):
            step = report.steps - len(batch_keys) + 1 + i
            batch_out.append((step, dict(zip(bkeys, means[offset:offset + len(bkeys)], strict=True))))
            offset += len(bkeys)
        self._write(report.group, report.steps, result, batch_out, report.now)
        return result

    def _write(self, group: str, steps: int, metrics: dict[str, float],
               batches: list[tuple[int, dict[str, float]]], now: float) -> None:
        """Chief only: one TensorBoard event per step and one JSON line for the report, buffered by this
        thread until :meth:`flush`."""
        if self._tb is None:
            return
        wall = time.time()
        events = [(steps, group, metrics)] + [(s, "training_batch", m) for s, m in batches]
        for step, prefix, values in events:
            self._tb.add_scalars(step, {f"{prefix}/{k}": v for k, v in values.items()}, wall_time=wall)
            for k, v in values.items():
                if not math.isfinite(v) and f"{prefix}/{k}" not in self._warned:
                    self._warned.add(f"{prefix}/{k}")
                    logger.warning("metric %s/%s is %s at step %d (averaged over ranks); written as "
                                   "is; later non-finite values of it are written without a warning",
                                   prefix, k, v, step)
        line: dict[str, Any] = {"group": group, "steps_completed": steps, "metrics": metrics, "time": wall}
        if batches:
            line["batch_metrics"] = [{"steps_completed": s, "metrics": m} for s, m in batches]
        self._jsonl.write(json.dumps(line) + "\n")
        self._unflushed += 1
        if (self._unflushed >= self.settings.flush_every
                or now - self._last_flush >= self.settings.flush_secs):
            self.flush()


def _close_files(tb: Any, jsonl: Any) -> None:
    jsonl.close()
    tb.close()
