"""``core_context.searcher``: the single trial's one operation, of ``searcher.max_length`` batches.

As Determined's ``single`` searcher (0.37 semantics, which the dsat example relies on):
``operations()`` yields one :class:`SearcherOperation` whose ``length`` is ``searcher.max_length``
in the unit it names, as Determined's Core API gave it (``100``, ``{batches: 100}``, ``{records: N}``
or ``{epochs: N}``: :meth:`SearcherContext.get_configured_units` says which; inside a dsat trial:
``end_profile_step + 1`` as Determined's dsat set it, plus the room of dsat's ``--timed-window``:
one more than the contract's last step). Once the chief called ``op.report_completed(metric)``,
the metric is recorded in
``<output_dir>/determined_searcher.json`` and ``operations()`` yields nothing more, in this run
and the next ones in that output directory.

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
from typing import Any, Iterator, Mapping

import toolkit
from toolkit._files import atomic_write_json
from toolkit.bounded_load import load_json
from toolkit.compat.determined.core.distributed import DistributedContext
from toolkit.config.experiment import max_length_unit
from toolkit.dsat.contract import TrialContract
from toolkit.errors import ConfigError
from toolkit.runtime.trial_env import TRIAL_ENV

__all__ = ["SearcherContext", "SearcherOperation", "SearcherMode", "Unit", "SEARCHER_FILE"]

logger = logging.getLogger(__name__)

SEARCHER_FILE = "determined_searcher.json"


class SearcherMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHEIF_ONLY"  # sic: Determined's value


class Unit(enum.Enum):
    EPOCHS = "EPOCHS"
    RECORDS = "RECORDS"
    BATCHES = "BATCHES"


class SearcherOperation:
    """One unit of work: train until ``length`` batches, then ``report_completed``."""

    def __init__(self, context: "SearcherContext", length: int, *, is_chief: bool) -> None:
        self._context = context
        self._length = length
        self._is_chief = is_chief
        self._completed = False

    @property
    def length(self) -> int:
        return self._length

    def report_progress(self, length: float) -> None:
        """Log progress in batches. Chief only (RuntimeError elsewhere, as in Determined)."""
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_progress() from the chief worker")
        if self._completed and length != self._length:
            raise RuntimeError(
                "you must not call op.report_progress() with a length other than op.length "
                "after op.report_completed()"
            )
        logger.info("progress report: %s/%s", length, self._length)

    def report_completed(self, searcher_metric: Any) -> None:
        """Record the operation's metric; ``operations()`` then yields nothing more. Chief only, once."""
        if not self._is_chief:
            raise RuntimeError("you must only call op.report_completed() from the chief worker")
        if self._completed:
            raise RuntimeError("you may only call op.report_completed() once")
        self._completed = True
        self._context.record_completed(self._length, searcher_metric)
        logger.info("SearcherOperation Complete: searcher_metric=%s", searcher_metric)


class SearcherContext:
    """Determined's SearcherContext for a single trial. See the module docstring."""

    def __init__(self, dist: DistributedContext, config: Mapping[str, Any], output_dir: Path) -> None:
        self._dist = dist
        self._config = config
        self._file = Path(output_dir) / SEARCHER_FILE
        try:
            self._completed = bool(load_json(self._file, what="searcher record").get("completed"))
        except FileNotFoundError:
            self._completed = False

    def _length(self) -> int:
        trial_file = os.environ.get(TRIAL_ENV)
        if trial_file:
            # Inside a dsat trial the operation lasts until the last step the trial may time (as
            # Determined's dsat set it, plus the timed window's room); the trial ends there or
            # earlier (SystemExit from the reporting context).
            return TrialContract.read(trial_file).final_step_bound + 1
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

    def record_completed(self, length: int, metric: Any) -> None:
        """Write the completed operation's metric (chief, through ``op.report_completed``)."""
        self._completed = True
        try:
            atomic_write_json(self._file, {"completed": True, "length": length, "searcher_metric": metric})
        except TypeError:
            atomic_write_json(
                self._file, {"completed": True, "length": length, "searcher_metric": repr(metric)}
            )

    def operations(
        self, searcher_mode: SearcherMode = SearcherMode.WorkersAskChief, auto_ack: bool = True
    ) -> Iterator[SearcherOperation]:
        """The trial's operations: one, or none once completed. All ranks in step (WorkersAskChief)
        or the chief alone (ChiefOnly).

        Raises:
            ConfigError: ``searcher.max_length`` missing or malformed (at the call).
            RuntimeError: ChiefOnly on a worker; the chief's loop went on without
                ``report_completed`` (Determined's check).
        """
        mode = SearcherMode(searcher_mode)
        if mode is SearcherMode.ChiefOnly and self._dist.rank != 0:
            raise RuntimeError(
                "you cannot call searcher.operations(searcher_mode=ChiefOnly) from a non-chief worker."
            )
        return self._operations(mode, self._length())

    def _operations(self, mode: SearcherMode, length: int) -> Iterator[SearcherOperation]:
        done = self._completed
        if mode is SearcherMode.WorkersAskChief:
            done = self._dist.broadcast(done)
        if done:
            return
        op = SearcherOperation(self, length, is_chief=self._dist.rank == 0)
        yield op
        if self._dist.rank == 0 and not op._completed:
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
