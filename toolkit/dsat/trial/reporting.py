"""The reporting context: the one dsat line of a training loop. Inside a trial it hands each step
to the trial's session, which times it and ends the trial (:mod:`toolkit.dsat.trial.session`).

The only dsat-specific line in a user's loop is :func:`dsat_reporting_context` around each
training step::

    # torchrun --nproc_per_node 2 train.py     (or started by dsat as a trial: no change)
    for batch in batches:
        with toolkit.dsat_reporting_context(engine):
            loss = engine(batch)                 # pipeline engines: engine.train_batch(it)
            engine.backward(loss)
            engine.step()

Outside a trial (:data:`~toolkit.runtime.trial_env.TRIAL_ENV` unset) it returns one shared
``contextlib.nullcontext`` and never touches the engine. Inside a trial, on every rank:

* The step's position decides its role: without ``steps_completed``, the calls of the context
  in this process (the first call is step 0); with it (the steps finished before this one),
  counted from the first value seen in the process. Either way a loop resumed from a checkpoint
  still gets its warm-up steps: the FLOPs are counted on step ``start_profile_step - 1`` and steps
  ``start_profile_step`` to ``end_profile_step`` (both included) are timed, the device
  synchronised around each one. When they span less than the contract's ``timed_window_s``
  (dsat's ``--timed-window``), more steps are timed, as many as the mean step predicts the window
  needs, up to ``last_profile_step`` (all ranks agree on the number at ``end_profile_step``).
  After the last timed step the chief writes the result file and every rank exits with status
  0. Forward and backward are timed by wrapping this engine's ``forward``/``backward``
  (pipeline engines: their ForwardPass/BackwardPass instructions) with instance attributes, set
  only inside a trial; DeepSpeed's own timers stay as configured.
* Metrics (:data:`~toolkit.dsat.contract.METRICS`), slowest rank for the times:
  ``latency`` = milliseconds per wrapped step (the whole body: forward, backward, optimizer
  and whatever else it does); ``forward`` and ``backward`` = milliseconds per step inside the
  engine's forward and backward (pipeline engines: the sums of their forward and backward
  micro-steps); ``throughput`` = samples per second over all ranks = micro-batches per step
  x ``train_micro_batch_size_per_gpu`` x data-parallel size / latency; ``FLOPS_per_gpu`` =
  model FLOPs per step on this rank / latency, averaged over ranks, with model FLOPs = 3 x the
  forward FLOPs (backward ~ 2 x forward; activation recomputation not counted, the convention
  of DeepSpeed's own autotuner). The forward FLOPs are those of the engine's forward calls
  (pipeline engines: their ForwardPass instructions) in step ``start_profile_step - 1``,
  counted by ``torch.utils.flop_counter.FlopCounterMode`` at the aten level (matrix products,
  convolutions, attention; elementwise operations count nothing), so the model's FLOPs per
  sample are the same at every ZeRO stage: what ZeRO runs around the model (gathers, hooks,
  its own ``F.linear``) is not the model's arithmetic.
* A loop without the line is timed by its engine's own steps (:mod:`toolkit.dsat.trial.engine_steps`);
  once that began, the line is a no-op for that engine.
* The profiling trial (``TrialContract.profile``, micro-batch 1) also records a
  :class:`~toolkit.dsat.contract.ProfileInfo` during its first wrapped step (see
  :mod:`toolkit.dsat.trial.profiling`) and reports metrics as well.
* An out-of-memory error raised inside the step (``torch.OutOfMemoryError``, of which
  ``torch.cuda.OutOfMemoryError`` is an alias) writes status ``"oom"`` and ends the process with
  :data:`~toolkit.dsat.contract.OOM_EXIT_STATUS` at once (``os._exit``: after an OOM the other
  ranks may never reach a collective, so no teardown is attempted). One that escapes uncaught
  elsewhere (typically ``deepspeed.initialize`` placing model states that do not fit) is written
  as ``"oom"`` too, by the excepthook of :func:`toolkit.runtime.trial_oom.install_oom_excepthook`,
  which :func:`toolkit.init_distributed` and the first reporting context of a trial install
  (importing toolkit changes nothing).

The result file (JSON, written atomically by the chief, or by the rank that ran out of memory)::

    {"trial_id": 3, "status": "ok" | "oom" | "failed", "metrics": {...5 metrics...},
     "profile": {...ProfileInfo...} | null, "timed_steps": 10 (ok only),
     "error": "..." (oom / failed only)}

``"failed"`` is written only at a clean exit of a loop that stopped before
``end_profile_step`` (too few steps); the runner reports it as the trial's error. A loop that
stops cleanly after ``end_profile_step`` but before the window's last step reports the steps it
timed (the chief's own measurements: the other ranks have left).
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
    """DeepSpeed config keys to merge into every trial's config (never into the best config).

    The timing here wraps the engine's own methods and counts FLOPs with torch's own counter,
    so no timer needs enabling; but DeepSpeed's config-driven
    flops profiler and autotuner must stay off in trials: both monkey-patch
    ``torch.nn.functional`` (counting twice) and the autotuner exits the process on its own.
    Pure; any process.

    Example::

        trial_config = merge(user_config, spec.ds_overrides(), instrumentation_overrides(contract))
    """
    del contract  # the same overrides for every trial
    return copy.deepcopy(dict(INSTRUMENTATION))


def dsat_reporting_context(engine: Any, *, steps_completed: int | None = None
                           ) -> contextlib.AbstractContextManager:
    """Wrap ONE training step; inside a dsat trial, measure it and end the trial. Call on all ranks.

    Args:
        engine: the engine from ``deepspeed.initialize`` (data-parallel or pipeline).
        steps_completed: optional, training steps finished before this one (0 for the first).
            None (the default): the context counts its own calls in this process, which is
            all it needs (steps are counted from the first call either way, so a resumed loop
            still gets its warm-up).

    Returns:
        A context manager. Outside a trial: the same shared no-op object on every call.

    Raises:
        SystemExit: inside a trial, after ``end_profile_step`` (status 0, every rank), once the
            result is written.
        LaunchEnvError: inside a trial, the trial contract named by ``TOOLKIT_DSAT_TRIAL`` cannot
            be read (set by the dsat runner; unset it to run outside a trial).

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


def _reset_for_tests() -> None:
    """Forget the memoised environment and session (tests only)."""
    global _trial_file, _session
    _trial_file, _session = _UNSET, None
