"""Determined's environment.environment_variables (toolkit.launch.experiment_env): the list and the
per-device forms, and each bad entry named by its index. Pure."""

import pytest

from toolkit.errors import ConfigError
from toolkit.launch.experiment_env import environment_variables, environment_variables_problems


def test_environment_variables_forms_and_problems():
    both = {"environment": {"environment_variables": {"cpu": ["A=1"], "cuda": ["A=2", "B=x=y"]}}}
    assert environment_variables(both, device="cuda") == {"A": "2", "B": "x=y"}
    assert environment_variables(both, device="cpu") == {"A": "1"}
    listed = {"environment": {"environment_variables": ["A=1"]}}
    assert environment_variables(listed, device="cuda") == {"A": "1"}
    assert environment_variables({}, device="cpu") == {}
    bad = {"environment": {"environment_variables": ["NOVALUE", "1X=2", 5]}}
    assert [p.split("=")[0] for p in environment_variables_problems(bad)] == [
        "environment.environment_variables[0]", "environment.environment_variables[1]",
        "environment.environment_variables[2]"]
    assert "unknown device" in environment_variables_problems(
        {"environment": {"environment_variables": {"gpu": ["A=1"]}}})[0]
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        environment_variables(bad, device="cpu")
