"""The value checks every module shares: integers, numbers, mappings. Pure; any rank.

An integer is a :class:`numbers.Integral` that is not a ``bool`` (NumPy's and PyTorch's integers
count, ``True`` does not); code that stores a checked value converts it with ``int()`` first."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, TypeGuard

__all__ = ["int_problem", "is_int", "is_mapping", "is_number", "type_name"]


def is_int(value: Any) -> TypeGuard[int]:
    """True for an integer that is not a bool (``numbers.Integral``: int, NumPy, PyTorch ints)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[float]:
    """True for a real number that is not a bool (int, float, NumPy scalars; NaN included)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_mapping(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """True for a mapping (a dict, or anything registered as :class:`collections.abc.Mapping`)."""
    return isinstance(value, Mapping)


def type_name(value: Any) -> str:
    """The type's name, for messages: ``'str'``, ``'NoneType'``."""
    return type(value).__name__


def int_problem(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
                hint: str = "") -> str | None:
    """The sentence naming what is wrong with integer setting ``name`` (inclusive bounds), or None.

    ``name`` as the user wrote it (``"keep_last"``, ``"--max-trials"``); ``hint`` is appended:
    ``int_problem("keep_last", 0, minimum=1)`` is ``'keep_last=0: expected an integer >= 1'``."""
    if is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return None
    if minimum is not None and maximum is not None:
        expected = f"an integer from {minimum} to {maximum}"
    elif minimum is not None:
        expected = f"an integer >= {minimum}"
    elif maximum is not None:
        expected = f"an integer <= {maximum}"
    else:
        expected = "an integer"
    return f"{name}={value!r}: expected {expected}{hint}"
