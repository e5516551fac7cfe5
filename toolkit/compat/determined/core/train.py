"""``core_context.train``: metrics to TensorBoard and ``metrics.jsonl``, written by the calling rank alone.

Made by ``core.init``; Determined's tutorials call it on the chief (``if rank == 0``), so there is no
collective. What is written, when, and why training reports are batched: docs/design-determined.md#metrics.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import numbers
import time
from pathlib import Path
from typing import Any, Callable

from toolkit._checks import is_int
from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.compat.determined.search_client import best_validation, wait_for_searcher
from toolkit.errors import ConfigError
from toolkit.launch.trial_files import EARLY_EXIT_FILE, PROGRESS_FILE, SEARCH_FILE

__all__ = ["TrainContext", "EarlyExitReason", "TensorboardMode"]

logger = logging.getLogger(__name__)


def _captured(metrics: dict[str, Any]) -> dict[str, Any]:
    """The values as they are now (tensors as numbers); a list or dict that JSON cannot hold fails here."""
    values = {k: _jsonable(v) for k, v in metrics.items()}
    for v in values.values():
        if isinstance(v, (list, dict)):
            json.dumps(v)
    return values


class TensorboardMode(enum.Enum):
    AUTO = "AUTO"
    MANUAL = "MANUAL"


class EarlyExitReason(enum.Enum):
    INVALID_HP = "EXITED_REASON_INVALID_HP"
    USER_REQUESTED_STOP = "EXITED_REASON_USER_REQUESTED_STOP"


def _scalar(value: Any) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "ndim") and getattr(value, "ndim", 1) == 0 and hasattr(value, "item"):
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def _jsonable(value: Any) -> Any:
    number = _scalar(value)
    if number is not None and not isinstance(value, (bool, int)):
        return number
    return value if isinstance(value, (str, bool, int, type(None), list, dict)) else repr(value)


#: Seconds between flushes of the training reports (validation and other groups flush at once).
FLUSH_SECS = 2.0
#: Seconds between writes of the progress file (the last value is written at close()).
PROGRESS_EVERY_S = 1.0


class TrainContext:
    """Metrics and progress of the trial. Chief only by Determined's rule (no collective)."""

    def __init__(
        self, output_dir: Path, *, tensorboard_mode: TensorboardMode, resume_step: int | None
    ) -> None:
        self._dir = Path(output_dir)
        self._tb_dir = self._dir / "tensorboard"
        self._mode = TensorboardMode(tensorboard_mode)
        self._resume_step = resume_step
        self._events: Any = None
        self._jsonl: Any = None
        self._best: float | None = None
        self._flushed = 0.0
        self._progress: float | None = None
        self._progress_written: tuple[float, float | None] = (-PROGRESS_EVERY_S, None)  # (when, value)
        # Reports not yet serialized: (group, steps_completed, values, wall time).
        self._pending: list[tuple[str, int, dict[str, Any], float]] = []

    def _write(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        if not is_int(steps_completed) or steps_completed < 0:
            raise ConfigError(f"steps_completed={steps_completed!r}: expected an integer >= 0")
        if not isinstance(metrics, dict):
            raise TypeError(f"metrics={metrics!r}: expected a dict of metric names to values")
        if not group or "." in group:
            raise ConfigError(f"group={group!r}: expected a non-empty name without '.'")
        now = time.time()
        self._pending.append((group, int(steps_completed), _captured(metrics), now))
        # Serializing a report costs a JSON dump, a protobuf event and two pure-Python CRCs, slow
        # right after a training step (cold caches): training reports are kept as values and
        # written together at least every FLUSH_SECS, which is also how late a reader (TensorBoard,
        # a tail of metrics.jsonl) may see them; close() writes the rest. Other groups (validation,
        # which toolkit.run's ASHA reads) are written at once, after the training reports before them.
        if group not in ("training", "training_batch") or now - self._flushed >= FLUSH_SECS:
            self._flush(now)

    def flush(self) -> None:
        """Write what is buffered to ``metrics.jsonl`` and the event file. Chief only."""
        self._flush(time.time())

    def _flush(self, now: float) -> None:
        self._flushed = now
        pending, self._pending = self._pending, []
        if pending:
            self._serialize(pending)
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._events is not None:
            self._events.flush()

    def _serialize(self, pending: list[tuple[str, int, dict[str, Any], float]]) -> None:
        if self._jsonl is None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self._dir / "metrics.jsonl", "a", encoding="utf-8")
        self._jsonl.write("".join(
            json.dumps({"group": group, "steps_completed": steps, "metrics": values, "time": now}) + "\n"
            for group, steps, values, now in pending
        ))
        if self._mode is TensorboardMode.AUTO:
            for group, steps, values, now in pending:
                scalars = {f"{group}/{k}": s for k, v in values.items() if (s := _scalar(v)) is not None}
                if scalars:
                    self._event_file().add_scalars(steps, scalars, wall_time=now)

    def _event_file(self) -> Any:
        if self._events is None:
            from toolkit.metrics.tb_events import EventFile  # tensorboard is slow to import

            purge = self._resume_step + 1 if self._resume_step is not None else None
            self._events = EventFile(self._tb_dir, purge_step=purge)
        return self._events

    def report_training_metrics(
        self, steps_completed: int, metrics: dict[str, Any], batch_metrics: list[dict[str, Any]] | None = None
    ) -> None:
        """Write training metrics at ``steps_completed`` (``batch_metrics``: ``training_batch/<name>`` points,
        the last at ``steps_completed``). Chief only; buffered, written at least every :data:`FLUSH_SECS`."""
        logger.info("report_training_metrics(steps_completed=%s, metrics=%s)", steps_completed, metrics)
        for i, batch in enumerate(batch_metrics or []):
            self._write("training_batch", steps_completed - len(batch_metrics or []) + 1 + i, batch)
        self._write("training", steps_completed, metrics)

    def report_validation_metrics(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Write validation metrics at ``steps_completed``, at once. Chief only. Under a ``toolkit.run``
        search it returns once the search read the report
        (:func:`~toolkit.compat.determined.search_client.wait_for_searcher`), so the stop it earns reaches the
        next ``should_preempt()``. Raises ConfigError for a None value."""
        logger.info("report_validation_metrics(steps_completed=%s, metrics=%s)", steps_completed, metrics)
        bad = [k for k, v in metrics.items() if v is None]
        if bad:
            raise ConfigError(
                [f"validation metric {k!r} returned an invalid scalar value: None" for k in bad]
            )
        self._write("validation", steps_completed, metrics)
        if self._jsonl is not None:  # under toolkit.run's search: until it read the report (its stop sent)
            wait_for_searcher(self._dir, self._jsonl.tell())

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Write metrics of any group (``<group>/<name>`` in TensorBoard). Chief only."""
        logger.info(
            "report_metrics(group=%s, steps_completed=%s, metrics=%s)", group, steps_completed, metrics
        )
        self._write(group, steps_completed, metrics)

    def report_progress(self, progress: float) -> None:
        """The fraction of the trial done, 0 to 1: under ``toolkit.run`` the trial's ``progress`` in
        ``determined_search.json`` (Determined: its web UI bar). Chief only; cheap every step.
        Raises ConfigError for anything but a number from 0 to 1."""
        if (
            isinstance(progress, bool)
            or not isinstance(progress, numbers.Real)
            or not 0 <= progress <= 1
            or math.isnan(progress)
        ):
            raise ConfigError(f"progress={progress!r}: expected a number between 0 and 1")
        logger.debug("report_progress with progress=%s", progress)
        self.record_progress(float(progress))

    def record_progress(self, fraction: float) -> None:
        """Keep ``fraction`` as the trial's progress; write it when the last write is old enough. Chief only
        (``report_progress``, and ``op.report_progress`` through core.init)."""
        self._progress = fraction
        if time.monotonic() - self._progress_written[0] >= PROGRESS_EVERY_S:
            self._write_progress()

    def _write_progress(self) -> None:
        if self._progress is None or self._progress == self._progress_written[1]:
            return
        self._dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self._dir / PROGRESS_FILE, {"progress": self._progress, "time": time.time()})
        self._progress_written = (time.monotonic(), self._progress)

    def set_status(self, status: str) -> None:
        """Log a short status line (Determined shows it in the web UI). Chief only."""
        logger.info("status: %s", status)

    def report_early_exit(self, reason: EarlyExitReason) -> None:
        """Tell the search that this trial exits early, and why; ``toolkit.run``'s searcher takes it as
        Determined's did. Any rank; the first report is kept (``det.InvalidHP`` in ``with core.init()``
        reports ``INVALID_HP`` itself)."""
        reason = EarlyExitReason(reason)
        logger.info("report_early_exit(reason=%s)", reason.value)
        path = self._dir / EARLY_EXIT_FILE
        if path.exists():
            logger.warning("early exit has already been reported for this trial, ignoring new value")
            return
        self._dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"reason": reason.name})

    def get_experiment_best_validation(self) -> float | None:
        """The best ``searcher.metric`` any trial of this ``toolkit.run`` search reported so far, by
        ``smaller_is_better`` (``determined_search.json`` above the trial's directory); None outside a search
        or before a report (Determined off-cluster: None). Any rank."""
        directory = self._dir.resolve()
        try:
            state = load_json(directory.parent / SEARCH_FILE, what="search record")
        except (OSError, ConfigError):  # no search, or a record being replaced: nothing known
            return None
        return best_validation(state, directory.name)

    def get_tensorboard_path(self) -> Path:
        """``<output_dir>/tensorboard`` (created): where TensorBoard files go. Any rank."""
        self._tb_dir.mkdir(parents=True, exist_ok=True)
        return self._tb_dir

    def upload_tensorboard_files(
        self,
        selector: Callable[[Path], bool] = lambda _: True,
        mangler: Callable[[Path, int], Path] = lambda p, __: p,
    ) -> None:
        """MANUAL mode: nothing to upload, the files already are in the output directory. Any rank.
        RuntimeError in AUTO mode, as in Determined."""
        if self._mode is TensorboardMode.AUTO:
            raise RuntimeError("upload_tensorboard_files can only be used in MANUAL mode")

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Run metadata lives in Determined's master database: not available."""
        raise NotImplementedError(
            "train.set_metadata: run metadata is stored by a Determined master; write it "
            "into a checkpoint's metadata (store_path(metadata=...)) or a file instead"
        )

    def get_metadata(self) -> None:
        """Run metadata lives in Determined's master database: not available."""
        raise NotImplementedError(
            "train.get_metadata: run metadata is stored by a Determined master; read "
            "checkpoint_context.get_metadata(storage_id) or your own file instead"
        )

    def close(self) -> None:
        """Flush and close the files (Context.close). Any rank."""
        self._write_progress()
        self._flush(time.time())
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._events is not None:
            self._events.close()
            self._events = None
