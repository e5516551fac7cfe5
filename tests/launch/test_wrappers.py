"""Determined's launcher wrappers in an entrypoint (toolkit.launch.wrappers): what each of Determined's own
example entrypoints stands for, the errors that name the fix, the launcher dsat's --launcher defaults to,
and the shim directory toolkit.run puts on an entrypoint's PYTHONPATH. Pure."""

import os

import pytest

from toolkit.errors import ConfigError
from toolkit.launch.wrappers import (
    SHIM_DIR,
    entrypoint_launcher,
    python_module,
    shim_pythonpath,
    torchrun_nproc_override,
    unwrap_launcher,
)

# The entrypoints of Determined's own examples, exactly as their YAMLs write them.
EXAMPLES = [
    ("python3 -m determined.launch.deepspeed python3 script.py", ("deepspeed", [], ["python3", "script.py"])),
    (
        "python3 -m determined.launch.torch_distributed python3 model_def_distributed.py",
        ("torchrun", [], ["python3", "model_def_distributed.py"]),
    ),
    (
        "python3 -m determined.launch.torch_distributed --nproc_per_node 1 -- python3 train.py",
        ("torchrun", ["--nproc_per_node", "1"], ["python3", "train.py"]),
    ),
    (
        "python3 -m determined.launch.wrap_rank 0 -- python3 4_distributed.py worker 0 0",
        (None, [], ["python3", "4_distributed.py", "worker", "0", "0"]),
    ),
    ("python3 4_distributed.py launcher", (None, [], ["python3", "4_distributed.py", "launcher"])),
    ("python3 2_checkpoints.py", (None, [], ["python3", "2_checkpoints.py"])),
    (
        "python3 -m determined.launch.deepspeed -- python3 script.py",
        ("deepspeed", [], ["python3", "script.py"]),
    ),
]


@pytest.mark.parametrize("entry,expected", EXAMPLES)
def test_unwrap_launcher_on_determined_example_entrypoints(entry, expected):
    assert unwrap_launcher(entry.split()) == expected


@pytest.mark.parametrize(
    "entry,match",
    [
        ("python3 -m determined.launch.torch_distributed", "no command"),
        ("python3 -m determined.launch.deepspeed --trial model_def:Trial", "Trial API"),
        ("python3 -m determined.launch.torch_distributed -- --trial model_def:Trial", "Trial API"),
    ],
)
def test_unwrap_launcher_errors_name_the_fix(entry, match):
    with pytest.raises(ConfigError, match=match):
        unwrap_launcher(entry.split())
    with pytest.raises(TypeError):
        unwrap_launcher("python3 train.py")


def test_torchrun_override_nproc():
    assert torchrun_nproc_override(["--nproc_per_node=3", "--foo"]) == (3, ["--foo"])
    with pytest.raises(ConfigError, match="nproc_per_node"):
        torchrun_nproc_override(["--nproc_per_node", "x"])


def test_the_launcher_an_entrypoint_stands_for_without_unwrapping():
    assert python_module(["python3", "-m", "pkg.train", "--x"]) == "pkg.train"
    assert python_module(["python3", "train.py"]) is None
    assert entrypoint_launcher("python3 -m determined.launch.deepspeed python3 s.py")[0] == "deepspeed"
    assert entrypoint_launcher(["python3", "-m", "determined.launch.torch_distributed", "t.py"])[0] == \
        "torchrun"
    found, why = entrypoint_launcher("bash launch.sh")
    assert found is None and why


def test_the_shim_goes_first_on_pythonpath_once(monkeypatch):
    assert (SHIM_DIR / "determined" / "launch" / "wrap_rank.py").is_file()  # the Determined layer's shim
    assert shim_pythonpath({}) == str(SHIM_DIR)  # no real determined package in the test environment
    again = shim_pythonpath({"PYTHONPATH": os.pathsep.join([str(SHIM_DIR), "/a", "", "/b"])})
    assert again == os.pathsep.join([str(SHIM_DIR), "/a", "/b"])
