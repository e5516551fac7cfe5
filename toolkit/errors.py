"""Exceptions raised by toolkit, and the one rule for which to raise.

Every error a user can cause says what was given, what was expected and how to fix it.

The rule:

* **A value the user chose is wrong** (a key of the experiment YAML or the DeepSpeed config, a
  hyperparameter, a command-line flag, an argument of a public function such as
  ``keep_last=0`` or a checkpoint tag): :class:`ConfigError`, with *every* problem of that
  input listed, raised once, before anything is launched or written. It is a ``ValueError``.
* **The state on disk or across ranks does not allow what was asked** (no checkpoint to load,
  another run's directory, another world size, a failed write on some rank):
  :class:`CheckpointError`. It is a ``RuntimeError``.
* **The launcher's environment is malformed** (``LOCAL_RANK='x'``): :class:`LaunchEnvError`, a
  ``RuntimeError``: the user did not write it in a config, the launcher did.
* **A DeepSpeed op build lock that no process of this machine can be shown to hold** (the
  extension directory is another user's, or on a network filesystem): :class:`BuildLockError`, a
  ``RuntimeError`` naming the lock file and the fix.
* **A programming error** (an object of the wrong kind where toolkit needs a specific one, such
  as a module passed as the engine; a call out of order, such as a report after ``close()``):
  the built-in ``TypeError`` or ``ValueError``.

Nothing in toolkit uses ``assert`` for any of these.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["ConfigError", "LaunchEnvError", "CheckpointError", "BuildLockError"]


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


class BuildLockError(RuntimeError):
    """torch's extension build lock of a DeepSpeed op was held for too long by a holder that cannot
    be seen from this process; the message names the lock file and how to remove it."""
