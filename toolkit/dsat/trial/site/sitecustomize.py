"""The ``sitecustomize`` of every process of a dsat trial (and of ``--run-full-experiment``).

In a trial or a full run only, an import hook on ``deepspeed`` routes ``deepspeed.initialize``
through :func:`toolkit.dsat.trial.engine_hook.initialize_in_trial`, so scripts that never import
toolkit are reached; it imports neither toolkit, torch nor DeepSpeed itself. Then it runs the next
``sitecustomize`` on ``sys.path``, as Python would have. Every process of the trial.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from typing import Any

_TRIAL_ENV = "TOOLKIT_DSAT_TRIAL"          # toolkit.runtime.trial_env.TRIAL_ENV
_APPLY_ENV = "TOOLKIT_DSAT_APPLY_CONFIG"   # toolkit.dsat.trial.engine_hook.APPLY_ENV
_READS_ENV = "TOOLKIT_DSAT_CONFIG_READS"   # toolkit.dsat.execution.settings.CONFIG_READS_ENV
_HERE = os.path.dirname(os.path.abspath(__file__))


def _bootstrap() -> None:
    """toolkit's side, once DeepSpeed is imported: the trial's OOM hook, op-build guards, cpuinfo."""
    partial = sys.modules.get("toolkit")
    if partial is not None and not hasattr(partial, "init_distributed"):
        return  # toolkit is being imported right now; the engine hook does this at initialize
    try:
        from toolkit.dsat.trial.engine_hook import bootstrap
        bootstrap()
    except Exception as err:  # noqa: BLE001 (the script must still run; the trial's check still holds)
        logging.getLogger(__name__).warning("dsat trial bootstrap: %s: %s", type(err).__name__, err)


def wrap_initialize(module: Any) -> None:
    """Route ``module.initialize`` (DeepSpeed's) through the trial's engine hook; once."""
    original = getattr(module, "initialize", None)
    if original is None or getattr(original, "toolkit_dsat_hook", False):
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        from toolkit.dsat.trial.engine_hook import initialize_in_trial
        return initialize_in_trial(original, args, kwargs)

    initialize.toolkit_dsat_hook = True  # type: ignore[attr-defined]
    module.initialize = initialize
    _bootstrap()


class _AfterDeepSpeedImport(importlib.abc.MetaPathFinder):
    """Wraps ``deepspeed.initialize`` right after the ``deepspeed`` package is executed. It stays on
    ``sys.meta_path`` until then: ``importlib.util.find_spec("deepspeed")`` (transformers asks so
    whether DeepSpeed is installed) imports nothing."""

    def __init__(self) -> None:
        self._searching = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "deepspeed" or self._searching:
            return None
        self._searching = True
        spec = None
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None) if finder is not self else None
                spec = find(name, path, target) if find is not None else None
                if spec is not None:
                    break
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            wrap_initialize(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec


def _redirect_config_reads() -> None:
    """A script that reads its own DeepSpeed config file (the files named by ``_READS_ENV``) for its
    data loader or its dict reads the trial's config instead (the run's, under ``_APPLY_ENV``): the
    read-only ``open`` of those exact files, by path, through ``builtins.open`` and ``io.open``."""
    import builtins
    import io

    trial = os.environ.get(_TRIAL_ENV)
    target = os.path.join(os.path.dirname(trial), "ds_config.json") if trial else os.environ.get(_APPLY_ENV)
    names = [p for p in os.environ.get(_READS_ENV, "").split(os.pathsep) if p]
    if not target or not names or getattr(builtins.open, "toolkit_dsat_reads", False):
        return
    real = {os.path.realpath(p) for p in names}
    bases = {os.path.basename(p) for p in real}
    original = builtins.open
    said: list[str] = []

    def open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:  # noqa: A001 (the builtin's name)
        if isinstance(file, (str, os.PathLike)) and not set(mode) & set("wax+"):
            path = os.fspath(file)
            if isinstance(path, str) and os.path.basename(path) in bases and os.path.realpath(path) in real:
                if not said and os.environ.get("RANK", "0") == "0":
                    said.append(path)
                    logging.getLogger("toolkit.dsat.trial").warning(
                        "dsat: the script reads its DeepSpeed config %s; it reads this trial's config %s "
                        "instead (--no-merge-config keeps the file as written)", path, target)
                file = target
        return original(file, mode, *args, **kwargs)

    open.toolkit_dsat_reads = True  # type: ignore[attr-defined]
    builtins.open = io.open = open


def _install() -> None:
    if not (os.environ.get(_TRIAL_ENV) or os.environ.get(_APPLY_ENV)):
        return
    _redirect_config_reads()
    if "deepspeed" in sys.modules:
        wrap_initialize(sys.modules["deepspeed"])
    elif not any(isinstance(f, _AfterDeepSpeedImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDeepSpeedImport())


def _chain() -> None:
    """Run the ``sitecustomize`` Python would have found without this directory, if any."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin is None \
            or os.path.dirname(os.path.abspath(spec.origin)) == _HERE:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_install()
if __name__ == "sitecustomize":  # started by Python's site module, not imported as toolkit's module
    _chain()
