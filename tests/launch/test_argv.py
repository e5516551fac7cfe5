"""toolkit.launch.argv: the argv of a trial on this machine under torchrun or DeepSpeed's launcher, the
entrypoint's rules (an interpreter dropped, a launcher stripped, Determined's wrappers unwrapped) and
what is refused. Pure; exact lists."""

import base64
import json
import sys

import pytest

from toolkit.errors import ConfigError
from toolkit.launch.argv import build_trial_argv, world_info

PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", "29511"]


def ds_head(slots, port=29511):
    info = base64.urlsafe_b64encode(json.dumps({"localhost": slots}).encode()).decode()
    return [PY, "-m", "deepspeed.launcher.launch", f"--world_info={info}", "--master_addr=127.0.0.1",
            f"--master_port={port}", "--no_local_rank"]


def tr(entrypoint, **kw):
    return build_trial_argv(entrypoint, launcher="torchrun", nproc=2, master_port=29511, **kw)


def ds(entrypoint, **kw):
    return build_trial_argv(entrypoint, launcher="deepspeed", nproc=2, master_port=29511, **kw)


@pytest.mark.parametrize("entrypoint, tail", [
    (["python3", "train.py", "--flag"], ["train.py", "--flag"]),
    (["python", "-u", "train.py"], ["train.py"]),
    (["/usr/bin/python3.11", "train.py", "a b"], ["train.py", "a b"]),
    ([PY, "train.py"], ["train.py"]),
    (["train.py", "--x", "1"], ["train.py", "--x", "1"]),
    (["python3", "-m", "pkg.train", "--lr", "0.1"], ["--module", "pkg.train", "--lr", "0.1"]),
    (["bash", "run.sh", "-v"], ["--no-python", "bash", "run.sh", "-v"]),
])
def test_torchrun_argv(entrypoint, tail):
    assert tr(entrypoint) == TORCHRUN + tail


@pytest.mark.parametrize("entrypoint, tail", [
    (["python3", "train.py", "--flag"], ["train.py", "--flag"]),
    (["python3", "-m", "pkg.train"], ["--module", "pkg.train"]),
    (["./run.sh"], ["--no_python", "./run.sh"]),
])
def test_deepspeed_argv(entrypoint, tail):
    assert ds(entrypoint) == ds_head([0, 1]) + tail


def test_deepspeed_include_names_the_gpus():
    assert ds(["python3", "train.py"], include="localhost:4,6") == ds_head([4, 6]) + ["train.py"]
    assert json.loads(base64.urlsafe_b64decode(world_info("localhost:4,6", 2))) == {"localhost": [4, 6]}


@pytest.mark.parametrize("entrypoint", [
    ["torchrun", "--nproc_per_node", "8", "--max-restarts", "3", "train.py", "--flag"],
    ["python3", "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone", "train.py", "--flag"],
    ["deepspeed", "--num_gpus", "8", "--master_port", "1234", "train.py", "--flag"],
    ["python3", "-m", "deepspeed.launcher.runner", "--include", "localhost:0", "train.py", "--flag"],
])
def test_launcher_in_the_entrypoint_is_replaced(entrypoint):
    assert tr(entrypoint) == TORCHRUN + ["train.py", "--flag"]
    assert ds(entrypoint) == ds_head([0, 1]) + ["train.py", "--flag"]


def test_launcher_modes_in_the_entrypoint_are_kept():
    module = ["torchrun", "--nproc_per_node", "8", "-m", "pkg.train", "--x"]
    assert tr(module) == TORCHRUN + ["--module", "pkg.train", "--x"]
    assert ds(["deepspeed", "--no_python", "./run.sh"]) == ds_head([0, 1]) + ["--no_python", "./run.sh"]


@pytest.mark.parametrize("entrypoint, words", [
    ([], "non-empty list"),
    ("python3 train.py", "non-empty list"),
    (["python3", ""], "non-empty list"),
    (["python3"], "no script"),
    (["python3", "-O", "train.py"], "'-O'"),
    (["python3", "-m"], "module name"),
    (["python3", "-m", "determined.launch.deepspeed"], "no command to run"),
    (["python3", "-m", "determined.launch.deepspeed", "--trial", "model_def:Trial"], "Trial API"),
])
def test_bad_entrypoints_say_what_to_do(entrypoint, words):
    with pytest.raises(ConfigError, match=words):
        tr(entrypoint)


@pytest.mark.parametrize("entrypoint", [
    ["python3", "-m", "determined.launch.deepspeed", "python3", "train.py", "--lr", "1"],
    ["python3", "-m", "determined.launch.torch_distributed", "--", "python3", "train.py", "--lr", "1"],
    ["python3", "-m", "determined.launch.torch_distributed", "--nproc_per_node", "1", "--",
     "python3", "train.py", "--lr", "1"],
    ["python3", "-m", "determined.launch.wrap_rank", "0", "--", "python3", "train.py", "--lr", "1"],
])
def test_determined_wrappers_run_the_command_they_wrap(entrypoint):
    assert tr(entrypoint) == tr(["python3", "train.py", "--lr", "1"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="launcher='mpirun'"):
        build_trial_argv(["train.py"], launcher="mpirun", nproc=2, master_port=1)
    with pytest.raises(ValueError, match="nproc=0"):
        build_trial_argv(["train.py"], launcher="torchrun", nproc=0, master_port=1)
    with pytest.raises(ValueError, match="master_port=70000"):
        build_trial_argv(["train.py"], launcher="torchrun", nproc=1, master_port=70000)
    with pytest.raises(ValueError, match="only understood by the deepspeed launcher"):
        tr(["train.py"], include="localhost:0,1")
    with pytest.raises(ValueError, match="exactly one id per process"):
        ds(["train.py"], include="localhost:0")
    with pytest.raises(ValueError, match="one machine"):
        ds(["train.py"], include="worker-1:0,1")
    with pytest.raises(ValueError, match="integers"):
        ds(["train.py"], include="localhost:a,b")
