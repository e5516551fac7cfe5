"""toolkit._checks: the one integer check's sentence for each kind of bound (pure)."""

import numpy as np
import pytest

from toolkit._checks import int_problem, is_int


@pytest.mark.parametrize("kwargs, value, expected", [
    ({"minimum": 1, "maximum": 8}, 9, "slots=9: expected an integer from 1 to 8"),
    ({"minimum": 1}, 0, "slots=0: expected an integer >= 1"),
    ({"maximum": 8}, 9, "slots=9: expected an integer <= 8"),
    ({}, "4", "slots='4': expected an integer"),
    ({}, True, "slots=True: expected an integer"),  # a bool is no count
    ({"maximum": 8, "hint": " (one per GPU)"}, 2.0, "slots=2.0: expected an integer <= 8 (one per GPU)"),
])
def test_int_problem_names_the_key_the_value_and_the_bounds(kwargs, value, expected):
    assert int_problem("slots", value, **kwargs) == expected


@pytest.mark.parametrize("value", [1, 8, np.int64(5)])
def test_int_problem_is_none_within_the_inclusive_bounds(value):
    assert int_problem("slots", value, minimum=1, maximum=8) is None
    assert is_int(value)
