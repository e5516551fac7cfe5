"""Determined's ``environment.environment_variables``: the variables every rank of a trial gets, put
into the launcher's environment by ``python -m toolkit.run`` and dsat's runner. Both forms (a list, or
a mapping by device): docs/design-dsat-runner.md#determineds-environment-variables-and-trial-files.
Pure; any process.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from toolkit._checks import is_mapping
from toolkit.errors import ConfigError

__all__ = ["CONFIG_WARNED_ENV", "environment_variables", "environment_variables_problems"]

#: Set by the runner (``toolkit.run``, dsat) after it warned about the experiment YAML's ignored
#: keys: the ranks, which read the same YAML, then stay quiet (one warning per run, not per rank).
CONFIG_WARNED_ENV = "TOOLKIT_DET_CONFIG_WARNED"
_DEVICES = ("cpu", "cuda", "rocm")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEY = "environment.environment_variables"


def _entries(raw: Any, key: str, problems: list[str]) -> dict[str, str]:
    if not isinstance(raw, list):
        problems.append(f"{key}={raw!r:.200}: expected a list of NAME=VALUE strings, e.g. [MY_FLAG=1]")
        return {}
    out: dict[str, str] = {}
    for i, entry in enumerate(raw):
        name, eq, value = entry.partition("=") if isinstance(entry, str) else ("", "", "")
        if not eq or not _NAME.match(name):
            problems.append(f"{key}[{i}]={entry!r:.200}: expected NAME=VALUE with NAME a variable name, "
                            "e.g. MY_FLAG=1")
            continue
        out[name] = value
    return out


def _parse(config: Mapping[str, Any], device: str) -> tuple[dict[str, str], list[str]]:
    problems: list[str] = []
    environment = config.get("environment")
    if environment is None:
        return {}, problems
    if not is_mapping(environment):
        return {}, [f"environment={environment!r:.200}: expected a mapping such as "
                    "{environment_variables: [MY_FLAG=1]}"]
    raw = environment.get("environment_variables")
    if raw is None:
        return {}, problems
    if not is_mapping(raw):
        return _entries(raw, _KEY, problems), problems
    unknown = [k for k in raw if k not in _DEVICES]
    if unknown:
        problems.append(f"{_KEY}: unknown device key(s) {unknown!r}; expected cpu, cuda or rocm")
    chosen: dict[str, str] = {}
    for kind in _DEVICES:
        if kind in raw and raw[kind] is not None:
            found = _entries(raw[kind], f"{_KEY}.{kind}", problems)
            if kind == device:
                chosen = found
    return chosen, problems


def environment_variables_problems(config: Mapping[str, Any]) -> list[str]:
    """Every problem of ``environment.environment_variables``, each naming its key. Pure; any process."""
    return _parse(config, "cpu")[1]


def environment_variables(config: Mapping[str, Any], *, device: str) -> dict[str, str]:
    """The variables of ``environment.environment_variables`` for ``device`` (``cpu`` or ``cuda``);
    ConfigError naming every malformed entry or form. Pure.

    >>> environment_variables({"environment": {"environment_variables": {"cpu": ["A=1"],
    ...                        "cuda": ["A=2"]}}}, device="cuda")
    {'A': '2'}
    """
    found, problems = _parse(config, device)
    if problems:
        raise ConfigError(problems)
    return found
