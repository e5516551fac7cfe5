"""The reporting context, the one dsat line of a training loop: inside a trial it hands each step to
the trial's session (:mod:`toolkit.dsat.trial.session`), outside one it does nothing::

    # torchrun --nproc_per_node 2 train.py     (or started by dsat as a trial: no change)
    with toolkit.dsat_reporting_context(engine):            # all ranks
        loss = engine(batch); engine.backward(loss); engine.step()

Step roles, metrics, result file: docs/design-dsat-search.md#inside-a-trial.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

from toolkit.dsat.contract import OOM_EXIT_STATUS, TrialContract
from toolkit.dsat.trial.session import TrialSession
from toolkit.dsat.tuned_keys import INSTRUMENTATION
from toolkit.runtime.op_builds import install_build_guards
from toolkit.runtime.trial_env import TRIAL_ENV
from toolkit.runtime.trial_oom import install_oom_excepthook

__all__ = ["active_session", "dsat_reporting_context", "engine_session", "instrumentation_overrides",
           "OOM_EXIT_STATUS"]

_NOOP = contextlib.nullcontext()
_UNSET = object()
_trial_file: Any = _UNSET            # memo of os.environ[TRIAL_ENV]: read once per process
_session: TrialSession | None = None


def instrumentation_overrides(contract: TrialContract) -> dict[str, Any]:
    """DeepSpeed config keys merged into every trial's config (never the best's): its config-driven
    flops profiler and autotuner off (both patch ``torch.nn.functional``; the autotuner exits the
    process). Pure; any process."""
    del contract  # the same overrides for every trial
    return copy.deepcopy(dict(INSTRUMENTATION))


def dsat_reporting_context(engine: Any, *, steps_completed: int | None = None
                           ) -> contextlib.AbstractContextManager:
    """Wrap ONE training step; inside a dsat trial, time it and end the trial after the last. All ranks.

    ``steps_completed``: steps finished before this one (None: the context counts its calls; a resumed
    loop gets its warm-up either way). Outside a trial: one shared no-op. Inside one: ``SystemExit(0)``
    after the last timed step; :class:`LaunchEnvError` when ``TOOLKIT_DSAT_TRIAL`` names no contract.

    Example::

        # torchrun --nproc_per_node 2 train.py
        with toolkit.dsat_reporting_context(engine):
            engine.train_batch(data_iter)          # pipeline engine: one call is one step
    """
    global _trial_file, _session
    if _trial_file is _UNSET:
        _trial_file = os.environ.get(TRIAL_ENV) or None
    if _trial_file is None:
        return _NOOP
    if _session is not None and _session.engine is engine and _session.auto:
        return _NOOP  # the engine's own steps are timed (toolkit.dsat.trial.engine_steps)
    if _session is None or _session.engine is not engine:
        install_oom_excepthook()   # usually done already by toolkit.init_distributed
        install_build_guards()     # likewise; for the ops the engine loads from here on
        _session = TrialSession(engine, _trial_file)
    return _session.step(None if steps_completed is None else int(steps_completed))


def active_session() -> TrialSession | None:
    """The session timing this trial in this process (the line's, or an engine's own steps'), if any.
    Any rank."""
    return _session


def engine_session(engine: Any, contract_file: str) -> TrialSession:
    """The session that times ``engine``'s own steps (:mod:`toolkit.dsat.trial.engine_steps`), made
    on the first call; the line is a no-op for this engine from then on. Every rank."""
    global _session
    if _session is None or _session.engine is not engine:
        install_oom_excepthook()
        _session = TrialSession(engine, contract_file, auto=True)
    return _session
