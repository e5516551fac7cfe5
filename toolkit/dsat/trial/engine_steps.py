"""Inside a dsat trial: time the engine's own steps, one per optimizer boundary, when the loop never
enters the reporting context. Installed on each engine the trial's hook builds; every rank (the
session's collectives run at the same boundaries everywhere).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

__all__ = ["EngineSteps", "time_engine_steps"]

logger = logging.getLogger(__name__)


class EngineSteps:
    """The engine-driven steps of one engine, decided at its first call. Every rank."""

    def __init__(self, engine: Any, contract_file: str) -> None:
        self.engine = engine
        self.contract_file = contract_file
        self.mode: str | None = None            # None: undecided; "line" or "engine"
        self.open_step: contextlib.AbstractContextManager | None = None
        self.pipeline = hasattr(type(engine), "_INSTRUCTION_MAP")
        for name in ("train_batch",) if self.pipeline else ("forward", "backward", "step"):
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def _decide(self) -> None:
        """At the engine's first call: the line's session (this engine's, or another's that stepped first:
        a reference model is not timed), or one driven from here."""
        from toolkit.dsat.trial import reporting
        if reporting.active_session() is not None:
            self.mode = "line"
            return
        self.mode = "engine"
        reporting.engine_session(self.engine, self.contract_file)
        logger.warning("dsat: the loop does not use dsat_reporting_context: timing the engine's own steps "
                       "(one per optimizer boundary)")
        self._open()

    def _open(self) -> None:
        from toolkit.dsat.trial import reporting
        step = reporting.engine_session(self.engine, self.contract_file).step(None)
        step.__enter__()
        self.open_step = step

    def _close(self) -> None:
        """End the step in progress (the trial may end here, every rank) and begin the next."""
        step, self.open_step = self.open_step, None
        if step is not None:
            step.__exit__(None, None, None)
        self._open()

    def _fail(self, err: BaseException) -> None:
        """A call raised inside a step: the session's handling (an OOM ends the trial here)."""
        step, self.open_step = self.open_step, None
        if step is not None:
            step.__exit__(type(err), err, err.__traceback__)

    def _boundary(self) -> bool:
        """Whether the ``step()`` about to run ends an optimizer step (unmanaged accumulation: always)."""
        managed = getattr(self.engine, "managed_gradient_accumulation", None)
        if callable(managed) and not managed():
            return True
        return bool(self.engine.is_gradient_accumulation_boundary())

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.mode is None:
                self._decide()
                if self.mode == "engine" and name in ("forward", "backward"):
                    # through the session's timers, installed on the engine just now
                    return getattr(self.engine, name)(*args, **kwargs)
            if self.mode == "line":
                return fn(*args, **kwargs)
            if self.open_step is None:
                self._open()
            ends = name == "train_batch" or (name == "step" and self._boundary())
            try:
                out = fn(*args, **kwargs)
            except BaseException as err:
                self._fail(err)
                raise
            if ends:
                self._close()
            return out
        call.__wrapped__ = fn  # type: ignore[attr-defined]
        return call


def time_engine_steps(engine: Any, contract_file: str) -> EngineSteps:
    """Install :class:`EngineSteps` on ``engine`` (once per engine). Every rank, inside a trial."""
    existing = getattr(engine, "_toolkit_dsat_steps", None)
    if isinstance(existing, EngineSteps):
        return existing
    steps = EngineSteps(engine, contract_file)
    engine._toolkit_dsat_steps = steps
    return steps
