"""Exceptions raised by toolkit, and the one rule for which to raise (any rank).

Every error a user can cause says what was given, what was expected and how to fix it:

* a value the user chose (a YAML or DeepSpeed key, a hyperparameter, a flag, ``keep_last=0``):
  ConfigError, every problem of that input listed, raised once, before anything is launched;
* the state on disk or across ranks (no checkpoint, another run's directory, a failed write):
  CheckpointError; a malformed launcher variable (``LOCAL_RANK='x'``, the launcher's doing, not
  the user's): LaunchEnvError;
* another live run still holds this run's rendezvous port or checkpoint directory after the wait:
  RunConflictError (CheckpointLockError for the directory), exit status 2 when uncaught;
* a DeepSpeed op build lock whose holder cannot be seen from here: BuildLockError;
* a programming error (a module passed as the engine, a report after ``close()``): TypeError or
  ValueError. Nothing in toolkit uses ``assert`` for any of these."""

from __future__ import annotations

from typing import Iterable

__all__ = ["ConfigError", "LaunchEnvError", "CheckpointError", "CheckpointLockError", "RunConflictError",
           "BuildLockError"]


class ConfigError(ValueError):
    """One or more problems in an experiment config, a DeepSpeed config or hyperparameters.

    ``problems``: one sentence each, naming the key, the value given and what is expected."""

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
    """A launcher variable (torchrun, deepspeed, mpirun, Slurm) is malformed; the message names it."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message names the fix."""


class RunConflictError(RuntimeError):
    """Another run still holds this run's rendezvous port or checkpoint directory after the wait; the
    message names it (host, pid, command). Uncaught, it ends the process with exit status 2."""


class CheckpointLockError(CheckpointError, RunConflictError):
    """Another run still holds the checkpoint directory's writer lock after the wait (exit status 2)."""


class BuildLockError(RuntimeError):
    """A DeepSpeed op's build lock held too long by a holder this process cannot see; names the fix."""
