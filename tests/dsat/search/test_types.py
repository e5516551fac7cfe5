"""SearchSettings' checks (toolkit/dsat/search/types.py)."""

from __future__ import annotations

import pytest

from toolkit.dsat.search.types import SearchSettings, is_better
from toolkit.errors import ConfigError


@pytest.mark.parametrize("value", [1, 1.0, -0.1, float("nan"), float("inf"), "0.1", True, None])
def test_bisect_tolerance_is_validated(value):
    with pytest.raises(ConfigError, match=r"--bisect-tolerance=.*expected a number >= 0 and < 1"):
        SearchSettings(method="binary", bisect_tolerance=value)


def test_bisect_tolerance_accepts_0_to_below_1_and_defaults_to_a_quarter():
    assert SearchSettings(method="binary").bisect_tolerance == 0.25
    for value in (0, 0.0, 0.5, 0.999):
        assert SearchSettings(method="binary", bisect_tolerance=value).bisect_tolerance == value


def test_is_better_rejects_a_metric_it_does_not_know():
    with pytest.raises(ValueError, match=r"metric='speed': expected one of .*throughput"):
        is_better("speed", 2.0, 1.0)
    assert is_better("throughput", 2.0, 1.0) and is_better("latency", 1.0, 2.0)


def test_every_settings_problem_is_reported_at_once_naming_its_flag():
    with pytest.raises(ConfigError) as caught:
        SearchSettings(method="grid", metric="speed", zero_stages=(1, 4), micro_batches=(2, 4))
    problems = caught.value.problems
    assert len(problems) == 4
    assert problems[0].startswith("method='grid': expected one of binary, random, asha")
    assert problems[1].startswith("metric='speed': expected one of")
    assert problems[2] == "--zero-stages=(1, 4): expected one or more of 0, 1, 2, 3"
    assert problems[3].startswith("micro_batches=(2, 4): expected a tuple of ascending integers")


@pytest.mark.parametrize("mbs", [(), [1, 2], (1, 4, 2), (1, 2, 2), (1, 2.0)])
def test_allowed_micro_batches_must_be_an_ascending_tuple_from_1(mbs):
    with pytest.raises(ConfigError, match=r"micro_batches=.*expected a tuple of ascending integers"):
        SearchSettings(method="binary", micro_batches=mbs)
    assert SearchSettings(method="binary", micro_batches=(1, 2, 8)).micro_batches == (1, 2, 8)
