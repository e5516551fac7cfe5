"""Forget what toolkit caches once per process (the Determined layer's cluster info, a dsat trial's
session), for tests that build it again under another environment. The package ships no hook for
tests: these reset its private caches from here."""

from toolkit.compat.determined import info
from toolkit.dsat.trial import reporting


def forget_cluster_info() -> None:
    """``det.get_cluster_info()`` is built again at its next call."""
    info._cached = None


def forget_trial_session() -> None:
    """``dsat_reporting_context`` reads ``TOOLKIT_DSAT_TRIAL`` again and makes a new session."""
    reporting._trial_file, reporting._session = reporting._UNSET, None


def forget_distributed() -> None:
    """Destroy the process group a test made in this process (toolkit's otherwise lives until exit) and
    forget toolkit's context and DeepSpeed's backend, so that a later test of the same xdist worker
    starts without any (tests/runtime/test_collectives.py needs none)."""
    import torch.distributed as dist

    from toolkit.runtime import context

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    context._context = None
    try:
        from deepspeed.comm import comm as ds_comm_state
    except ImportError:
        return
    ds_comm_state.cdb = None
