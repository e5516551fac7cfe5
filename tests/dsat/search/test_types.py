"""SearchSettings' checks (toolkit/dsat/search/types.py)."""

from __future__ import annotations

import pytest

from toolkit.dsat.search.types import SearchSettings
from toolkit.errors import ConfigError


@pytest.mark.parametrize("value", [1, 1.0, -0.1, float("nan"), float("inf"), "0.1", True, None])
def test_bisect_tolerance_is_validated(value):
    with pytest.raises(ConfigError, match=r"--bisect-tolerance=.*expected a number >= 0 and < 1"):
        SearchSettings(method="binary", bisect_tolerance=value)


def test_bisect_tolerance_accepts_0_to_below_1_and_defaults_to_a_quarter():
    assert SearchSettings(method="binary").bisect_tolerance == 0.25
    for value in (0, 0.0, 0.5, 0.999):
        assert SearchSettings(method="binary", bisect_tolerance=value).bisect_tolerance == value
