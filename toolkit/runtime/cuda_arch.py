"""DeepSpeed's op builds under a ``TORCH_CUDA_ARCH_LIST`` with arch-specific entries (``9.0a``).

DeepSpeed 0.19's JIT builder reads each entry with ``int()`` and stops at ``'0a'``; the guard hands
its builder the plain ``X.Y`` form (the same GPUs), for its own builds only. Installed by
:func:`toolkit.install_build_guards`, before or after DeepSpeed's import (an import hook for its
builder module alone). Any rank; per process. docs/start.md (DeepSpeed's JIT-built ops)."""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import re
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["install_arch_list_guard", "plain_arch_list"]

logger = logging.getLogger(__name__)

_ENV = "TORCH_CUDA_ARCH_LIST"
# DeepSpeed's builder module: installed (pip) and in a source tree that puts op_builder on the path.
_BUILDER_MODULES = ("deepspeed.ops.op_builder.builder", "op_builder.builder")
# An entry with an arch-specific ("a") or family ("f") suffix, with or without "+PTX".
_SUFFIXED = re.compile(r"^(\d+\.\d+)[af](\+PTX)?$", re.IGNORECASE)


def plain_arch_list(value: str | None) -> str | None:
    """``value`` with every ``X.Ya``/``X.Yf`` entry as ``X.Y`` (``+PTX`` kept), ``;``-separated, or None when
    it has none (DeepSpeed reads it as it is): ``"8.0 9.0a+PTX"`` -> ``"8.0;9.0+PTX"``. Pure."""
    if not value:
        return None
    entries = [entry for entry in re.split(r"[;\s]+", value.strip()) if entry]
    plain = [_SUFFIXED.sub(r"\1\2", entry) for entry in entries]
    return None if plain == entries else ";".join(dict.fromkeys(plain))


@functools.lru_cache(maxsize=None)
def _warn_once(given: str, plain: str, op: str) -> None:
    """Say it once per op and process: every load of an op, built or not, goes through the builder."""
    logger.warning("%s=%r has arch-specific entries that DeepSpeed's op builder cannot read; building "
                   "DeepSpeed's op %s for %r (the same GPUs; your own extensions still see %r)",
                   _ENV, given, op, plain, given)


def _guarded(original: Any) -> Any:
    @functools.wraps(original)
    def compute_capability_args(self: Any, *args: Any, **kwargs: Any) -> Any:
        given_env, given_jit = os.environ.get(_ENV), getattr(self, "_jit_arch_list", None)
        env, jit = plain_arch_list(given_env), plain_arch_list(given_jit)
        if env is None and jit is None:
            return original(self, *args, **kwargs)
        _warn_once(given_jit or given_env or "", jit or env or "", str(getattr(self, "name", "?")))
        if jit is not None:
            self._jit_arch_list = jit
        if env is not None:
            os.environ[_ENV] = env
        try:
            return original(self, *args, **kwargs)   # sets the variable to its own plain list on success
        except BaseException:
            if given_env is not None:
                os.environ[_ENV] = given_env
            raise

    compute_capability_args.toolkit_guarded = True  # type: ignore[attr-defined]
    return compute_capability_args


def _guard_module(module: Any) -> None:
    """Wrap ``CUDAOpBuilder.compute_capability_args`` of DeepSpeed's builder ``module``, once."""
    builder = getattr(module, "CUDAOpBuilder", None)
    method = getattr(builder, "compute_capability_args", None)
    if method is not None and not getattr(method, "toolkit_guarded", False):
        setattr(builder, "compute_capability_args", _guarded(method))  # noqa: B010 (a class's method)


class _GuardingLoader(importlib.abc.Loader):
    """DeepSpeed's builder module's own loader, which guards the module once it has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _guard_module(module)

    def __getattr__(self, name: str) -> Any:   # get_code, get_source, is_package, ...: the loader's
        return getattr(self._loader, name)


class _BuilderFinder(importlib.abc.MetaPathFinder):
    """Finds DeepSpeed's builder module as the other finders do, with a :class:`_GuardingLoader`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname not in _BUILDER_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _GuardingLoader(spec.loader)
                return spec
        return None


def install_arch_list_guard() -> None:
    """Let DeepSpeed's CUDA op builder in this process read arch-specific entries: now if its builder
    module is imported, else at its import (DeepSpeed is not imported here). Idempotent; any process."""
    for name in _BUILDER_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            _guard_module(module)
    if not any(isinstance(finder, _BuilderFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BuilderFinder())
