"""Rank-aware logging for toolkit's loggers: after :func:`toolkit.init_distributed` their records
carry ``[rank N]``, and those below WARNING show on the chief only (``TOOLKIT_LOG_ALL_RANKS=1``:
every rank's). Handlers and levels stay the application's (``logging.basicConfig(level=...)``)."""

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
    """Attach the rank filter to every existing ``toolkit.*`` logger (filters are not inherited, and
    ``import toolkit`` imported them all). Call on all ranks (``init_distributed`` does)."""
    _filter.rank = rank
    _filter.all_ranks = os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")
    names = ["toolkit"] + [n for n in logging.root.manager.loggerDict if n.startswith("toolkit.")]
    for name in names:
        lg = logging.getLogger(name)
        if _filter not in lg.filters:
            lg.addFilter(_filter)
