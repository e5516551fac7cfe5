"""Exceptions raised by toolkit.

Every error a user can cause says what was given, what was expected and how to fix it.
Configuration problems are collected and raised once, as a single :class:`ConfigError`
that lists all of them, so a user fixes a config in one round instead of one key at a time.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["ConfigError", "LaunchEnvError", "CheckpointError"]


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
