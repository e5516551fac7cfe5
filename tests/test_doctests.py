"""The examples in toolkit's docstrings run as written (doctest), module by module."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import toolkit

# The shim stands in for Determined's package: its module __getattr__ answers every name, which
# doctest's lookups would take for objects; the trial's sitecustomize is a trial process's start-up
# file. Neither has examples.
_SKIP = ("toolkit.compat.determined.shim", "toolkit.dsat.trial.site")


def _modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(toolkit.__path__, "toolkit.")]
    return sorted(n for n in names if not n.startswith(_SKIP) and not n.endswith("__main__"))


def test_every_module_is_found():
    names = _modules()
    assert "toolkit.dsat.execution.multihost_argv" in names and len(names) > 100


@pytest.mark.parametrize("name", [n for n in _modules()])
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False, report=False)
    assert result.failed == 0, (f"{result.failed} of {result.attempted} doctest examples of {name} failed "
                                f"(see them: python -m pytest --doctest-modules {module.__file__})")
