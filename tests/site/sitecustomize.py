"""Test suite only: py-cpuinfo's answer cached in a file for the run, in every process the tests start.

DeepSpeed calls ``cpuinfo.get_cpu_info()`` twice each time a process loads one of its CPU ops
(``cpu_adam`` for FusedAdam on CPU, the shm all-reduce), for the compile flags it hashes. Each call
starts a Python interpreter that sleeps one second to measure the clock (py-cpuinfo's
``get_raw_hz``), so every DeepSpeed process of every test waited about 2 s for an answer that
cannot change during the run. ``tests/conftest.py`` puts this directory on ``PYTHONPATH`` and names
the cache file in ``PYTEST_CPUINFO_CACHE``; the first process to ask measures and writes it, the
others read it. Only the time changes: DeepSpeed gets the same dictionary (the ops' build hashes,
and so the built ops, are the same as without the cache).

Python imports ``sitecustomize`` at start-up. cpuinfo is patched when something imports it, not
here, so processes that never load it pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys

CACHE_ENV = "PYTEST_CPUINFO_CACHE"


def cached(measure, path: str):
    """``measure`` (cpuinfo's get_cpu_info) answered from ``path``; the first caller writes it."""
    def get_cpu_info():
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            info = measure()
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(info, f)
            os.replace(tmp, path)  # atomic: another process reads all of it or none
            return info

    get_cpu_info.__wrapped__ = measure
    return get_cpu_info


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the ``cpuinfo`` package right after it is executed, the first time it is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "cpuinfo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            module.get_cpu_info = cached(module.get_cpu_info, os.environ[CACHE_ENV])

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Patch cpuinfo when it is imported (now, if it already is), in this process."""
    if not os.environ.get(CACHE_ENV):
        return
    module = sys.modules.get("cpuinfo")
    if module is not None:
        if not hasattr(module.get_cpu_info, "__wrapped__"):
            module.get_cpu_info = cached(module.get_cpu_info, os.environ[CACHE_ENV])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


install()
