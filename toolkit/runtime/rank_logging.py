"""Rank-aware logging for toolkit's own loggers.

Every module logs through ``logging.getLogger(__name__)``. After :func:`toolkit.init_distributed`
their records carry a ``[rank N]`` prefix, and records below WARNING are kept on the chief only, so
a 16-rank job does not print every line 16 times. Set ``TOOLKIT_LOG_ALL_RANKS=1`` to see the
INFO lines of every rank. Handlers and levels stay the application's choice
(``logging.basicConfig(level=logging.INFO)`` in a script shows toolkit's INFO lines).
"""

from __future__ import annotations

import logging
import os

__all__ = ["configure_rank_logging", "ALL_RANKS_ENV"]

ALL_RANKS_ENV = "TOOLKIT_LOG_ALL_RANKS"


class _RankFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.rank = 0
        self.all_ranks = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.rank != 0 and not self.all_ranks and record.levelno < logging.WARNING:
            return False
        if not getattr(record, "_toolkit_prefixed", False):
            record.msg = f"[rank {self.rank}] {record.msg}"
            record._toolkit_prefixed = True
        return True


_filter = _RankFilter()


def configure_rank_logging(rank: int) -> None:
    """Attach the rank filter to every ``toolkit`` logger. Call on all ranks (init_distributed does).

    Logger filters are not inherited by child loggers, so the filter is put on each existing
    ``toolkit.*`` logger; modules are all imported by ``import toolkit`` before this runs.
    """
    _filter.rank = rank
    _filter.all_ranks = os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")
    names = ["toolkit"] + [n for n in logging.root.manager.loggerDict if n.startswith("toolkit.")]
    for name in names:
        lg = logging.getLogger(name)
        if _filter not in lg.filters:
            lg.addFilter(_filter)
