"""DeepSpeed's op builds under a ``TORCH_CUDA_ARCH_LIST`` with arch-specific entries (``9.0a``).

PyTorch accepts arch-specific and family entries such as ``9.0a`` (Hopper), ``10.0a`` or ``10.0f``,
and CUDA images set them (one of the GPU machines this project is checked on has
``TORCH_CUDA_ARCH_LIST`` with ``9.0a``). DeepSpeed 0.19's JIT builder sorts the entries with
``int()`` on each part and stops with ``ValueError: invalid literal for int() with base 10: '0a'``
before it compiles anything, so ``deepspeed.initialize`` fails with FusedAdam on such a machine.
Its builder keeps only the plain ``X.Y`` form of every entry in the end, so
:func:`install_arch_list_guard` hands it that form (``9.0a`` becomes ``9.0``, the same GPUs), for
DeepSpeed's own op builds only: DeepSpeed's JIT load restores the variable after each build, so
the user's own extensions still see what was set. Any rank; per process.

Example::

    # TORCH_CUDA_ARCH_LIST="8.0;9.0a" torchrun --nproc_per_node 8 train.py
    ctx = toolkit.init_distributed()      # installs the guard: FusedAdam builds for 8.0 and 9.0
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any

__all__ = ["install_arch_list_guard", "plain_arch_list"]

logger = logging.getLogger(__name__)

_ENV = "TORCH_CUDA_ARCH_LIST"
# An entry with an arch-specific ("a") or family ("f") suffix, with or without "+PTX".
_SUFFIXED = re.compile(r"^(\d+\.\d+)[af](\+PTX)?$", re.IGNORECASE)


def plain_arch_list(value: str | None) -> str | None:
    """``value`` with every ``X.Ya``/``X.Yf`` entry as ``X.Y`` (``+PTX`` kept), ``;``-separated, or
    None when it has no such entry (then DeepSpeed reads it as it is). Pure.

    >>> plain_arch_list("8.0 9.0a+PTX")
    '8.0;9.0+PTX'
    >>> plain_arch_list("8.0;9.0") is None
    True
    """
    if not value:
        return None
    entries = [entry for entry in re.split(r"[;\s]+", value.strip()) if entry]
    plain = [_SUFFIXED.sub(r"\1\2", entry) for entry in entries]
    return None if plain == entries else ";".join(dict.fromkeys(plain))


def _guarded(original: Any) -> Any:
    @functools.wraps(original)
    def compute_capability_args(self: Any, *args: Any, **kwargs: Any) -> Any:
        given_env, given_jit = os.environ.get(_ENV), getattr(self, "_jit_arch_list", None)
        env, jit = plain_arch_list(given_env), plain_arch_list(given_jit)
        if env is None and jit is None:
            return original(self, *args, **kwargs)
        logger.warning("%s=%r has arch-specific entries that DeepSpeed's op builder cannot read; building "
                       "DeepSpeed's op %s for %r (the same GPUs; your own extensions still see %r)",
                       _ENV, given_jit or given_env, getattr(self, "name", "?"), jit or env,
                       given_jit or given_env)
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


def install_arch_list_guard() -> bool:
    """Let DeepSpeed's CUDA op builder in this process read arch-specific ``TORCH_CUDA_ARCH_LIST``
    entries (see the module). Idempotent; any process; imports DeepSpeed's builder module.

    Returns:
        False when DeepSpeed is not installed (nothing to guard), True otherwise.
    """
    try:
        from deepspeed.ops.op_builder.builder import CUDAOpBuilder
    except ImportError:
        return False
    if not getattr(CUDAOpBuilder.compute_capability_args, "toolkit_guarded", False):
        setattr(CUDAOpBuilder, "compute_capability_args",  # noqa: B010 (a class's method, wrapped)
                _guarded(CUDAOpBuilder.compute_capability_args))
    return True
