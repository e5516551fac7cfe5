"""toolkit.runtime.cuda_arch: DeepSpeed's CUDA op builder under a TORCH_CUDA_ARCH_LIST with 9.0a.

DeepSpeed is the judge: the builder's own ``compute_capability_args`` runs here in its JIT mode,
which reads the arch list and needs no GPU (nothing is compiled). It fails on ``9.0a`` without the
guard (the ValueError seen on an H200 machine on 2026-11-28); with it, it leaves in
TORCH_CUDA_ARCH_LIST the list that PyTorch's JIT build then compiles for, as for ``9.0``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from toolkit.runtime import cuda_arch
from toolkit.runtime.cuda_arch import install_arch_list_guard, plain_arch_list

fused_adam = pytest.importorskip("deepspeed.ops.op_builder.fused_adam")
builder_module = pytest.importorskip("deepspeed.ops.op_builder.builder")


@pytest.mark.parametrize(("given", "expected"), [
    ("9.0a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("8.0 9.0a+PTX", "8.0;9.0+PTX"), ("10.0f;10.0a", "10.0"),
    ("12.0A", "12.0"), ("8.0;9.0", None), ("9.0+PTX", None), ("", None), (None, None), ("sm_90a", None),
])
def test_plain_arch_list(given, expected):
    assert plain_arch_list(given) == expected


def _jit_arch_list(monkeypatch, arch_list: str) -> str:
    """The arch list DeepSpeed's JIT mode leaves for PyTorch's build, given ``arch_list``."""
    builder = fused_adam.FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    assert builder.compute_capability_args() == []     # JIT mode: PyTorch reads the variable
    return os.environ["TORCH_CUDA_ARCH_LIST"]


@pytest.fixture
def unguarded(monkeypatch):
    """DeepSpeed's builder class as shipped, for this test; the guard is put back afterwards."""
    method = builder_module.CUDAOpBuilder.compute_capability_args
    monkeypatch.setattr(builder_module.CUDAOpBuilder, "compute_capability_args",
                        getattr(method, "__wrapped__", method))


def test_deepspeed_alone_fails_on_an_arch_specific_entry(unguarded, monkeypatch):
    with pytest.raises(ValueError, match="0a"):
        _jit_arch_list(monkeypatch, "8.0;9.0a")


def test_the_guard_gives_deepspeed_the_plain_entries(unguarded, monkeypatch, caplog):
    install_arch_list_guard()
    install_arch_list_guard()      # idempotent: wrapped once
    method = builder_module.CUDAOpBuilder.compute_capability_args
    assert not getattr(method.__wrapped__, "toolkit_guarded", False)
    cuda_arch._warn_once.cache_clear()    # said once per op and process: say it again here
    with caplog.at_level("WARNING", logger=cuda_arch.__name__):
        built_for = _jit_arch_list(monkeypatch, "8.0;9.0a")
    assert built_for == _jit_arch_list(monkeypatch, "8.0;9.0") == "8.0;9.0+PTX"
    assert "'8.0;9.0a'" in caplog.text and "fused_adam" in caplog.text


def test_the_guard_keeps_the_users_list_for_a_jit_load(unguarded, monkeypatch):
    """jit_load reads the list into _jit_arch_list and restores the variable afterwards; the guard
    reads that copy too, and leaves a list without suffixes as DeepSpeed reads it."""
    install_arch_list_guard()
    builder = fused_adam.FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    builder._jit_arch_list = "9.0a"
    builder.compute_capability_args()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0+PTX"
    builder._jit_arch_list = "8.0 8.6"
    builder.compute_capability_args()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;8.6+PTX"


def test_a_failed_build_gets_the_users_list_back(unguarded, monkeypatch):
    install_arch_list_guard()
    builder = fused_adam.FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a;bogus")
    with pytest.raises(ValueError):
        builder.compute_capability_args()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a;bogus"


@pytest.mark.parametrize("first", ["toolkit", "deepspeed"])
def test_the_guard_holds_whether_deepspeed_is_imported_before_or_after(first, tmp_path):
    """A fresh interpreter, as a user's script: the guard installed by the public call before
    DeepSpeed's builder module is imported (the import hook guards it when DeepSpeed loads it), or
    by init_distributed after it was (guarded at once: ba50b28's Determined-style case)."""
    steps = {"toolkit": ["import toolkit", "toolkit.install_build_guards()",
                         "from deepspeed.ops.op_builder import builder"],
             "deepspeed": ["from deepspeed.ops.op_builder import builder", "import toolkit",
                           "toolkit.init_distributed()"]}
    code = "\n".join([
        *steps[first],
        "import os",
        "from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder",
        "b = FusedAdamBuilder(); b.jit_mode = True",
        "b.compute_capability_args()",
        "print(os.environ['TORCH_CUDA_ARCH_LIST'])",
    ])
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "8.0;9.0a"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "8.0;9.0+PTX"
    assert "arch-specific entries" in done.stderr


def test_the_import_hook_keeps_the_loaders_other_answers_and_finds_only_what_exists(tmp_path):
    """What asks a module's loader for more than exec_module (tracebacks' linecache, inspect, pkgutil)
    gets the real loader's answers; a builder module nobody provides is not found."""
    import deepspeed.ops.op_builder as op_builder

    finder = cuda_arch._BuilderFinder()
    spec = finder.find_spec(builder_module.__name__, op_builder.__path__)
    assert isinstance(spec.loader, cuda_arch._GuardingLoader)
    assert "class CUDAOpBuilder" in spec.loader.get_source(builder_module.__name__)
    assert spec.loader.is_package(builder_module.__name__) is False
    # a source tree's op_builder package whose directory holds no builder module: not found
    assert finder.find_spec("op_builder.builder", [str(tmp_path)]) is None
    assert finder.find_spec("json", None) is None                   # not DeepSpeed's builder: not ours
