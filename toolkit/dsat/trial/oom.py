"""Inside a dsat trial: an out-of-memory error that a step raises ends the trial as ``"oom"``.

Every rank (each reports its own); an OOM raised elsewhere is the excepthook's
(:func:`toolkit.runtime.trial_oom.install_oom_excepthook`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

from toolkit.dsat.contract import OOM_EXIT_STATUS, TrialContract
from toolkit.runtime.trial_oom import one_line, write_oom_result

__all__ = ["exit_on_oom"]

logger = logging.getLogger(__name__)


def exit_on_oom(contract: TrialContract, err: BaseException, *, rank: int) -> NoReturn:
    """Report ``err`` as the trial's OOM and end the process with :data:`OOM_EXIT_STATUS`. Any rank;
    ``os._exit``, no teardown: after an OOM the other ranks may never reach a collective."""
    logger.error("dsat trial %d ran out of memory on rank %d: %s", contract.trial_id, rank, one_line(err))
    try:
        write_oom_result(contract.result_path, contract.trial_id, err)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(OOM_EXIT_STATUS)
