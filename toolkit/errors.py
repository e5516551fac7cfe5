"""Exceptions raised by toolkit, and the one rule for which to raise (any rank).

Every error a user can cause says what was given, what was expected and how to fix it:

* a value the user chose is wrong (a YAML or DeepSpeed key, a hyperparameter, a flag, an argument
  such as ``keep_last=0``): :class:`ConfigError` (a ``ValueError``), every problem of that input
  listed, raised once, before anything is launched or written;
* the state on disk or across ranks does not allow it (no checkpoint, another run's directory,
  another world size, a failed write): :class:`CheckpointError` (a ``RuntimeError``);
* the launcher's environment is malformed (``LOCAL_RANK='x'``): :class:`LaunchEnvError`, a
  ``RuntimeError``, since the launcher wrote it, not the user;
* another live run still holds what this run needs after the wait (its rendezvous port on this
  machine, or the checkpoint directory's writer lock): :class:`RunConflictError` (a
  ``RuntimeError``; :class:`CheckpointLockError` for the lock), naming that run's process; it ends
  the process with exit status 2 when nothing catches it;
* a DeepSpeed op build lock no process of this machine can be shown to hold (another user's, or on
  a network filesystem): :class:`BuildLockError` (a ``RuntimeError``), naming the lock file and the
  fix;
* a programming error (a module passed as the engine, a report after ``close()``): ``TypeError``
  or ``ValueError``. Nothing in toolkit uses ``assert`` for any of these.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["ConfigError", "LaunchEnvError", "CheckpointError", "CheckpointLockError", "RunConflictError",
           "BuildLockError"]


class ConfigError(ValueError):
    """One or more problems in an experiment config, a DeepSpeed config or hyperparameters.

    Attributes:
        problems: every problem found, one human-readable sentence each; each sentence names
            the key, the value given and what is expected.

    Example:
        >>> try:
        ...     raise ConfigError(["zero_optimization.stage=5: expected 0, 1, 2 or 3"])
        ... except ConfigError as err:
        ...     err.problems
        ['zero_optimization.stage=5: expected 0, 1, 2 or 3']
    """

    def __init__(self, problems: Iterable[str] | str, *, source: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            message = f"invalid configuration{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{len(self.problems)} problems in configuration{where}:\n{lines}"
        super().__init__(message)


class LaunchEnvError(RuntimeError):
    """A launcher environment variable (torchrun, deepspeed, mpirun, Slurm) is malformed.

    The message names the variable and its value, for example
    ``LOCAL_RANK='x' is not an integer``.
    """


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message names the fix."""


class RunConflictError(RuntimeError):
    """Another run, alive or not provably dead, still holds what this run needs after the wait: its
    rendezvous port on this machine (toolkit.runtime.rendezvous_wait) or its checkpoint directory
    (:class:`CheckpointLockError`). The message names it (host, pid, command); uncaught, it ends
    the process with exit status 2 (toolkit.runtime.exit_status)."""


class CheckpointLockError(CheckpointError, RunConflictError):
    """Another run still holds the checkpoint directory's writer lock after the wait
    (toolkit.checkpoint.lock); exit status 2 when uncaught, as every :class:`RunConflictError`."""


class BuildLockError(RuntimeError):
    """torch's extension build lock of a DeepSpeed op was held for too long by a holder that cannot
    be seen from this process; the message names the lock file and how to remove it."""
