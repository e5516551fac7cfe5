"""Training and validation metrics, averaged across ranks, for TensorBoard and a JSON-lines file.

Every rank reports its own values; the writer averages them with one small collective per call
and the chief alone writes them: TensorBoard event files (tags ``training/<name>``,
``validation/<name>``, ``training_batch/<name>``, x axis = ``steps_completed``) and
``metrics.jsonl`` beside them, one line per report::

    {"group": "training", "steps_completed": 100, "metrics": {"loss": 0.25}, "time": 1700000000.0}

Non-finite values are written as JSON ``NaN`` / ``Infinity`` (Python's ``json`` reads them).

Example::

    # torchrun --nproc_per_node 2 train.py
    ctx = toolkit.init_distributed()
    with toolkit.MetricsWriter(ctx, "runs/exp1") as metrics:          # call on all ranks
        for step, batch in enumerate(loader, start=1):
            loss = engine(batch); engine.backward(loss); engine.step()
            metrics.report_training_metrics(step, {"loss": loss}, samples=len(batch))
    # tensorboard --logdir runs
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from toolkit.distributed import DistributedContext

__all__ = ["MetricsSettings", "MetricsWriter", "SAMPLES_PER_SECOND"]

logger = logging.getLogger(__name__)

#: Name of the throughput metric written when ``samples=`` is passed to a training report.
SAMPLES_PER_SECOND = "samples_per_second"

# Monotonic clock for throughput intervals; a module global so tests can substitute a fake one.
_monotonic = time.perf_counter

# Header of every reduced vector: [signature-changed flag, step mod 2**16, (step mod 2**16)**2].
# The sum and the sum of squares of a small integer tell, exactly in float64, whether every
# rank passed the same step (Cauchy-Schwarz: n * sum(x*x) == sum(x)**2 iff all x are equal);
# the sums stay below 2**53, so exact, for up to 2**21 ranks.
_HEADER = 3
_STEP_MOD = 1 << 16


@dataclasses.dataclass(frozen=True)
class MetricsSettings:
    """Options of a :class:`MetricsWriter`; validated on creation. Any rank (no collective).

    Attributes:
        jsonl_name: file name of the JSON-lines file in ``log_dir``.
        flush_every: flush both files to disk after this many reports.
        flush_secs: ...or when this many seconds passed since the last flush, whichever first.
        max_queue: events TensorBoard's background writer may hold before ``report_*`` blocks.
        resume_step: when resuming from a checkpoint taken at this ``steps_completed``, pass it:
            TensorBoard then hides the points *after* it that the interrupted run wrote (they are
            about to be written again); the points up to and including it belong to the
            checkpoint and stay. ``None`` for a fresh run.
    """

    jsonl_name: str = "metrics.jsonl"
    flush_every: int = 100
    flush_secs: float = 30.0
    max_queue: int = 1000
    resume_step: int | None = None

    def __post_init__(self) -> None:
        name = self.jsonl_name
        if (not isinstance(name, str) or not name or name in (".", "..")
                or "/" in name or (os.sep in name) or (os.altsep and os.altsep in name)):
            raise ValueError(f"jsonl_name={name!r}: expected a plain file name such as "
                             "'metrics.jsonl' (no directory part); the file goes into log_dir")
        for field in ("flush_every", "max_queue"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{field}={value!r}: expected an integer >= 1")
        if (not isinstance(self.flush_secs, numbers.Real) or isinstance(self.flush_secs, bool)
                or not self.flush_secs > 0 or not math.isfinite(self.flush_secs)):
            raise ValueError(f"flush_secs={self.flush_secs!r}: expected a finite number of seconds > 0")
        if self.resume_step is not None and (not _is_int(self.resume_step) or self.resume_step < 0):
            raise ValueError(f"resume_step={self.resume_step!r}: expected None or the integer "
                             "steps_completed (>= 0) of the checkpoint this run resumed from")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_steps(steps_completed: Any) -> int:
    if not _is_int(steps_completed):
        raise TypeError(f"steps_completed={steps_completed!r} ({type(steps_completed).__name__}): "
                        "expected an int, the number of optimizer steps done so far "
                        "(convert a tensor with int(t.item()))")
    if steps_completed < 0:
        raise ValueError(f"steps_completed={steps_completed}: expected an integer >= 0, the number "
                         "of optimizer steps done so far")
    return int(steps_completed)


def _scalar(where: str, key: Any, value: Any) -> float | torch.Tensor:
    """One metric value as a float, or a one-element tensor (converted later, in one go)."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"{where}: metric name {key!r} ({type(key).__name__}): expected a non-empty str")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"{where}: metric {key!r} is a tensor of shape {tuple(value.shape)} and "
                             f"dtype {value.dtype}: expected a real scalar (a 0-d or one-element "
                             "tensor); reduce it first, e.g. with .mean()")
        return value
    if isinstance(value, np.ndarray):
        if value.size != 1 or not np.isrealobj(value) or value.dtype.kind not in "biuf":
            raise ValueError(f"{where}: metric {key!r} is a numpy array of shape {value.shape} and "
                             f"dtype {value.dtype}: expected a real scalar; reduce it first")
        return float(value.reshape(()))
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    raise TypeError(f"{where}: metric {key!r} is {type(value).__name__} ({value!r:.60}): expected a "
                    "real number (int, float, numpy scalar, or a 0-d / one-element tensor); "
                    "report a number on every rank, not None, a string or a list")


def _values(where: str, metrics: Any) -> tuple[tuple[str, ...], list[float]]:
    """Sorted names and their values as floats. Pure; raises before any collective."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where}: metrics is {type(metrics).__name__}: expected a dict of "
                        "name -> number, e.g. {'loss': loss}")
    keys = tuple(sorted(metrics, key=str))
    raw = [_scalar(where, k, metrics[k]) for k in keys]
    tensors = [(i, v) for i, v in enumerate(raw) if isinstance(v, torch.Tensor)]
    if tensors:
        # One device-to-host copy per device rather than a synchronising .item() per tensor.
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for i, t in tensors:
            by_device.setdefault(t.device, []).append((i, t))
        for group in by_device.values():
            flat = torch.cat([t.detach().reshape(1) for _, t in group]).tolist()
            for (i, _), v in zip(group, flat):
                raw[i] = float(v)
    return keys, raw  # type: ignore[return-value]


class MetricsWriter:
    """Averages metrics across ranks and writes them, on the chief, to TensorBoard and JSON lines.

    Construct it on all ranks (no collective) with the same ``log_dir``; only the chief creates
    the directory and files. Every ``report_*`` call is a collective: call it on all ranks, in
    the same order, with the same metric names and the same ``steps_completed``.

    Cost per call: one all-reduce of ``len(metrics) + 3`` floats (+2 with ``samples``, + the
    batch metrics), plus one all-gather and one more all-reduce when the set of names changes;
    on the chief, some tens of microseconds to queue one TensorBoard event per step (its writer
    thread computes the checksums) and buffer one JSON line. Files are flushed every
    ``flush_every`` reports, every ``flush_secs`` seconds, and on close.

    A value of the wrong kind raises on the rank that has it, before any collective: when every
    rank passes the same bad input, every rank raises. Ranks that disagree about the metric
    names or ``steps_completed`` all raise a ValueError (no hang). A bad value on some ranks
    only leaves the others waiting in the collective until the launcher stops the job.

    Args:
        ctx: the context from :func:`toolkit.init_distributed`.
        log_dir: the TensorBoard directory of this run, the same on all ranks.
        **settings: fields of :class:`MetricsSettings` (``jsonl_name``, ``flush_every``,
            ``flush_secs``, ``max_queue``, ``resume_step``).

    Example::

        # torchrun --nproc_per_node 2 train.py
        with toolkit.MetricsWriter(ctx, "runs/exp1", resume_step=start) as metrics:  # all ranks
            metrics.report_validation_metrics(start, {"accuracy": acc})
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
        self._warned: set[str] = set()
        self._unflushed = 0
        self._closed = False
        self._tb: Any = None
        self._jsonl: Any = None
        if ctx.is_chief:
            # Imported here: tensorboard takes seconds to import and only the chief needs it.
            from torch.utils.tensorboard import SummaryWriter
            from tensorboard.compat.proto.summary_pb2 import Summary

            self._summary_cls = Summary
            s = self.settings
            self._tb = SummaryWriter(str(self.log_dir), max_queue=s.max_queue,
                                     flush_secs=s.flush_secs,
                                     purge_step=None if s.resume_step is None else s.resume_step + 1)
            self._jsonl = open(self.log_dir / s.jsonl_name, "a", encoding="utf-8")
            # Flush what is buffered even if the user forgets close(); holds no reference to self.
            self._finalizer = weakref.finalize(self, _close_files, self._tb, self._jsonl)
            logger.info("writing metrics to %s", self.log_dir)
        # Started after the (slow, chief-only) file set-up, so the first interval is the loop's.
        self._clock_start = _monotonic()
        self._last_flush = self._clock_start

    # -- public API -----------------------------------------------------------------------------

    def report_training_metrics(self, steps_completed: int, metrics: Mapping[str, Any], *,
                                batch_metrics: Sequence[Mapping[str, Any]] | None = None,
                                samples: int | None = None) -> dict[str, float]:
        """Average training metrics; the chief writes ``training/<name>``. Call on all ranks.

        Args:
            steps_completed: optimizer steps done so far (>= 0): the x axis.
            metrics: name -> scalar (int, float, numpy scalar, 0-d or one-element tensor).
            batch_metrics: optional, one dict per batch since the previous report, oldest
                first; the last belongs to step ``steps_completed``, the one before to
                ``steps_completed - 1``, and so on. Written as ``training_batch/<name>``.
            samples: optional, the samples this rank processed since the previous report.
                The writer then adds ``samples_per_second``: the samples of all ranks over the
                wall time since the previous training or validation report (or since the
                writer was created), averaged over ranks. Validation time is therefore left
                out when the validation report comes right after the evaluation loop.

        Returns:
            The averaged metrics (and ``samples_per_second``), the same on every rank.

        Raises:
            TypeError, ValueError: a value is None, a string, or not a scalar (the name, type
                and shape are given); ``steps_completed`` is not an integer >= 0; the ranks
                passed different names or steps; the writer is closed.
        """
        where = "report_training_metrics"
        self._check_open(where)
        now = _monotonic()
        steps = _check_steps(steps_completed)
        keys, values = _values(where, metrics)
        batches: list[tuple[tuple[str, ...], list[float]]] = []
        if batch_metrics is not None:
            if not isinstance(batch_metrics, Sequence) or isinstance(batch_metrics, (str, bytes)):
                raise TypeError(f"{where}: batch_metrics is {type(batch_metrics).__name__}: expected "
                                "a list of dicts, one per batch since the previous report")
            if len(batch_metrics) > steps:
                raise ValueError(f"{where}: {len(batch_metrics)} batch_metrics entries at "
                                 f"steps_completed={steps}: expected at most {steps}, one per step, "
                                 "the last one for step steps_completed")
            batches = [_values(f"{where}: batch_metrics[{i}]", m) for i, m in enumerate(batch_metrics)]
        header: list[float] = []
        if samples is not None:
            if not _is_int(samples) or samples < 0:
                raise ValueError(f"{where}: samples={samples!r}: expected the integer number (>= 0) "
                                 "of samples this rank processed since the previous report")
            if SAMPLES_PER_SECOND in keys:
                raise ValueError(f"{where}: metric {SAMPLES_PER_SECOND!r} is also computed from "
                                 "samples=; rename your metric or leave samples out")
            header = [float(samples), now - self._clock_start]
        if not keys and not batches and samples is None:
            raise ValueError(f"{where}: nothing to report: metrics is empty and neither "
                             "batch_metrics nor samples is given")
        signature = (keys, samples is not None, tuple(k for k, _ in batches))
        flat = header + values + [v for _, vs in batches for v in vs]
        sums = self._reduce(where, "training", signature, steps, flat)
        self._clock_start = now
        ws = self.ctx.world_size
        result: dict[str, float] = {}
        if samples is not None:
            elapsed = sums[1] / ws
            result[SAMPLES_PER_SECOND] = sums[0] / elapsed if elapsed > 0 else math.nan
            sums = sums[2:]
        result.update(zip(keys, (v / ws for v in sums)))
        result = dict(sorted(result.items()))
        offset = len(keys)
        batch_out = []
        for i, (bkeys, _) in enumerate(batches):
            step = steps - len(batches) + 1 + i
            batch_out.append((step, dict(zip(bkeys, (v / ws for v in sums[offset:offset + len(bkeys)])))))
            offset += len(bkeys)
        self._write("training", steps, result, batch_out, now)
        return result

    def report_validation_metrics(self, steps_completed: int,
                                  metrics: Mapping[str, Any]) -> dict[str, float]:
        """Average validation metrics; the chief writes ``validation/<name>``. Call on all ranks.

        Args:
            steps_completed: optimizer steps done when the validation ran (>= 0).
            metrics: name -> scalar, as for :meth:`report_training_metrics`.

        Returns:
            The averaged metrics, the same on every rank.

        Raises:
            TypeError, ValueError: as for :meth:`report_training_metrics`.
        """
        where = "report_validation_metrics"
        self._check_open(where)
        now = _monotonic()
        steps = _check_steps(steps_completed)
        keys, values = _values(where, metrics)
        if not keys:
            raise ValueError(f"{where}: metrics is empty: expected at least one name -> number")
        sums = self._reduce(where, "validation", (keys, False, ()), steps, values)
        # The throughput interval restarts here, so evaluation time is not counted as training.
        self._clock_start = now
        result = dict(zip(keys, (v / self.ctx.world_size for v in sums)))
        self._write("validation", steps, result, [], now)
        return result

    def flush(self) -> None:
        """Write buffered metrics to disk now. Any rank (no collective; a no-op off the chief)."""
        if self._tb is not None and not self._closed:
            self._jsonl.flush()
            self._tb.flush()
        self._unflushed = 0
        self._last_flush = _monotonic()

    def close(self) -> None:
        """Flush and close the files; later reports raise. Any rank (no collective); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._tb is not None:
            self._finalizer()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise RuntimeError(f"{where}: this MetricsWriter is closed; create a new one to report more")

    def _reduce(self, where: str, group: str, signature: tuple, steps: int,
                values: list[float]) -> list[float]:
        """Sum ``values`` over ranks with one all-reduce; returns the sums without the header."""
        step = steps % _STEP_MOD
        agreed = self._agreed.get(group)
        if signature == agreed:
            sums = self.ctx.all_reduce([0.0, step, step * step, *values], op="sum")
        else:
            # Same length as every rank whose names match the agreed ones, so the collective
            # stays well formed; the flag sends every rank to the slow path below together.
            size = _HEADER + (_signature_size(agreed) if agreed is not None else 0)
            sums = self.ctx.all_reduce([1.0] + [0.0] * (size - 1), op="sum")
        if sums[0] > 0:
            signatures = self.ctx.all_gather_object(signature)
            if any(s != signatures[0] for s in signatures):
                lines = "; ".join(f"rank {r}: {_describe(s)}" for r, s in enumerate(signatures))
                raise ValueError(f"{where}: the ranks reported different metrics ({lines}); every "
                                 "rank must report the same names (and batch_metrics / samples) in "
                                 "the same call: compute each metric on every rank")
            self._agreed[group] = signature
            sums = self.ctx.all_reduce([0.0, step, step * step, *values], op="sum")
        total, squares = round(sums[1]), round(sums[2])
        if self.ctx.world_size * squares != total * total:
            steps_by_rank = self.ctx.all_gather_object(steps)
            raise ValueError(f"{where}: the ranks passed different steps_completed {steps_by_rank} "
                             "(indexed by rank); pass the same optimizer step count on every rank")
        return sums[_HEADER:]

    def _write(self, group: str, steps: int, metrics: dict[str, float],
               batches: list[tuple[int, dict[str, float]]], now: float) -> None:
        """Chief only: one TensorBoard event per step and one JSON line for the report."""
        if self._tb is None:
            return
        wall = time.time()
        events = [(steps, group, metrics)] + [(s, "training_batch", m) for s, m in batches]
        for step, prefix, values in events:
            summary = self._summary_cls(value=[
                self._summary_cls.Value(tag=f"{prefix}/{k}", simple_value=v) for k, v in values.items()])
            # FileWriter.add_summary queues the event for TensorBoard's writer thread.
            self._tb.file_writer.add_summary(summary, step, wall)
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


def _signature_size(signature: tuple) -> int:
    keys, has_samples, batch_keys = signature
    return len(keys) + (2 if has_samples else 0) + sum(len(k) for k in batch_keys)


def _describe(signature: tuple) -> str:
    keys, has_samples, batch_keys = signature
    text = f"metrics {list(keys)}"
    if has_samples:
        text += " and samples"
    if batch_keys:
        text += f" and batch_metrics {[list(k) for k in batch_keys]}"
    return text


def _close_files(tb: Any, jsonl: Any) -> None:
    jsonl.close()
    tb.close()
