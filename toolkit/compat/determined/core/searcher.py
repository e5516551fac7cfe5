"""``core_context.searcher``: the trial's searcher operations (Determined 0.37's Core API loop).

Made by ``core.init``. One operation of ``searcher.max_length``, or one per rung under a 0.37 ASHA section;
completed ones recorded in ``determined_searcher.json``: docs/design-determined.md#searcher-operations.
Example (0.37-era tutorials)::

    for op in core_context.searcher.operations():          # call on all ranks
        while steps_completed < op.length:
            ...
        if core_context.distributed.rank == 0:
            op.report_completed(loss)
"""

from __future__ import annotations

import enum
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import toolkit
from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.compat.determined.core.distributed import DistributedContext
from toolkit.compat.determined.search_client import wait_for_searcher
from toolkit.config.experiment import max_length_unit
from toolkit.config.searcher_section import operation_lengths
from toolkit.dsat.contract import TrialContract
from toolkit.errors import ConfigError
from toolkit.launch.trial_files import OPS_ACK_FILE, OPS_FILE
from toolkit.runtime.trial_env import TRIAL_ENV

__all__ = ["SearcherContext", "SearcherOperation", "SearcherMode", "Unit"]

logger = logging.getLogger(__name__)



class SearcherMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHEIF_ONLY"  # sic: Determined's value


class Unit(enum.Enum):
    EPOCHS = "EPOCHS"
    RECORDS = "RECORDS"
    BATCHES = "BATCHES"


class SearcherOperation:
    """One unit of work: train until ``length`` batches, then ``report_completed``."""

    def __init__(self, context: "SearcherContext", length: int, *, is_chief: bool, total: int | None = None,
                 last: bool = True) -> None:
        self._context = context
        self._length = length
        self._total = total or length
        self._is_chief = is_chief
        self._last = last
        self._completed = False

    @property
    def length(self) -> int:
        return self._length

    def report_progress(self, length: float) -> None:
        """Report progress in max_length's unit: the trial's progress is ``length`` over the last
        operation's length. Chief only (RuntimeError elsewhere, as in Determined)."""
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_progress() from the chief worker")
        if self._completed and length != self._length:
            raise RuntimeError(
                "you must not call op.report_progress() with a length other than op.length "
                "after op.report_completed()"
            )
        logger.debug("progress report: %s/%s", length, self._length)
        self._context.progress(length / self._total)

    def report_completed(self, searcher_metric: Any) -> None:
        """Record the operation's metric; ``operations()`` then yields nothing more. Chief only, once."""
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_completed() from the chief worker")
        if self._completed:
            raise RuntimeError("you may only call op.report_completed() once")
        self._completed = True
        self._context.record_completed(self._length, searcher_metric, last=self._last)
        logger.info("SearcherOperation Complete: searcher_metric=%s", searcher_metric)


class SearcherContext:
    """Determined's SearcherContext for a trial. ``report_progress`` (the TrainContext's) and ``stopped``
    (the PreemptContext's) are optional; ``core.init`` passes them."""

    def __init__(self, dist: DistributedContext, config: Mapping[str, Any], output_dir: Path, *,
                 report_progress: Callable[[float], None] | None = None,
                 stopped: Callable[[], bool] | None = None) -> None:
        self._dist = dist
        self._config = config
        self._dir = Path(output_dir)
        self._file = self._dir / OPS_FILE
        self._report_progress, self._stopped = report_progress, stopped
        try:
            record = load_json(self._file, what="searcher record")
        except FileNotFoundError:
            record = {}
        record = record if isinstance(record, dict) else {}
        self._completed = bool(record.get("completed"))
        ops = record.get("ops")
        self._ops: list[dict[str, Any]] = list(ops) if isinstance(ops, list) else []

    def _length(self) -> int:
        found = max_length_unit(self._config)
        if found is not None and found[0] != "batches":
            return found[1]  # as Determined's Core API: op.length in the unit max_length names
        length = toolkit.max_length_steps(self._config)
        if length is None:
            raise ConfigError(
                "searcher.max_length is not set: core_context.searcher.operations() needs the "
                "trial's length; add e.g. 'max_length: {batches: 100}' under searcher"
            )
        return length

    def _lengths(self) -> list[int]:
        trial_file = os.environ.get(TRIAL_ENV)
        if trial_file:
            # Inside a dsat trial the operation lasts until the last step the trial may time (as
            # Determined's dsat set it, plus the timed window's room); the trial ends there or
            # earlier (SystemExit from the reporting context).
            return [TrialContract.read(trial_file).final_step_bound + 1]
        return operation_lengths(self._config) or [self._length()]

    def progress(self, fraction: float) -> None:
        """Pass the trial's progress (0 to 1, clamped) on. Chief only (through ``op.report_progress``)."""
        if self._report_progress is not None:
            self._report_progress(min(max(float(fraction), 0.0), 1.0))

    def record_completed(self, length: int, metric: Any, *, last: bool = True) -> None:
        """Write the completed operation's metric (chief, through ``op.report_completed``)."""
        self._ops.append({"length": length, "searcher_metric": metric})
        self._completed = last
        record = {"completed": last, "length": length, "searcher_metric": metric, "ops": self._ops}
        try:
            atomic_write_json(self._file, record)
        except TypeError:  # a metric JSON cannot hold: its repr
            self._ops[-1]["searcher_metric"] = record["searcher_metric"] = repr(metric)
            atomic_write_json(self._file, record)

    def operations(
        self, searcher_mode: SearcherMode = SearcherMode.WorkersAskChief, auto_ack: bool = True
    ) -> Iterator[SearcherOperation]:
        """The trial's operations not completed yet. All ranks in step (WorkersAskChief) or the chief alone
        (ChiefOnly). Raises ConfigError for a missing or malformed ``searcher.max_length`` (at the call),
        RuntimeError for ChiefOnly on a worker or a chief loop without ``report_completed`` (Determined's)."""
        mode = SearcherMode(searcher_mode)
        if mode is SearcherMode.ChiefOnly and self._dist.rank != 0:
            raise RuntimeError(
                "you cannot call searcher.operations(searcher_mode=ChiefOnly) from a non-chief worker."
            )
        return self._operations(mode, self._lengths())

    def _stop_between_ops(self) -> bool:
        """Chief: after an operation, wait until the search read it, then whether a stop came (its own)."""
        wait_for_searcher(self._dir, len(self._ops), ack_file=OPS_ACK_FILE)
        return self._stopped is not None and self._stopped()

    def _operations(self, mode: SearcherMode, lengths: list[int]) -> Iterator[SearcherOperation]:
        chief = self._dist.rank == 0
        for number in range(len(self._ops), len(lengths)):
            done = self._completed or (number > 0 and chief and self._stop_between_ops())
            if mode is SearcherMode.WorkersAskChief:
                done = self._dist.broadcast(done)
            if done:
                return
            op = SearcherOperation(self, lengths[number], is_chief=chief, total=lengths[-1],
                                   last=number == len(lengths) - 1)
            yield op
            if chief and not op._completed:
                raise RuntimeError("you must call op.report_completed() on each operation")

    def acknowledge_out_of_ops(self) -> None:
        """Nothing to acknowledge (deprecated in Determined). Any rank."""

    def get_configured_units(self) -> Unit | None:
        """The unit of ``max_length`` (``Unit.BATCHES``, ``RECORDS``, ``EPOCHS``); None for a bare number.
        Any rank."""
        raw = (self._config.get("searcher") or {}).get("max_length")
        if not isinstance(raw, Mapping):
            return None
        found = max_length_unit(self._config)
        return Unit(found[0].upper()) if found is not None else None
