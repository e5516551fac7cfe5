"""dsat's launcher: read from the entrypoint's Determined wrapper unless --launcher says otherwise, said
in the first line; a trial failing for another launcher's variables names the flag that fixes it."""

import json
import sys

import pytest
import yaml

from helpers import procutil
from toolkit.config.experiment import entrypoint_argv
from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.execution.classify import classify, launcher_hint
from toolkit.dsat.search.types import TrialSpec
from toolkit.dsat.tuner_cli import choose_launcher
from toolkit.launch.wrappers import entrypoint_launcher

DS_WRAPPED = "python3 -m determined.launch.deepspeed python3 model.py"


@pytest.mark.parametrize("entrypoint, launcher", [
    ("python3 -m determined.launch.deepspeed python3 script.py", "deepspeed"),
    (["python3", "-m", "determined.launch.deepspeed", "python3", "script.py"], "deepspeed"),
    ("python -m determined.launch.deepspeed\npython run_clm.py --deepspeed ds.json", "deepspeed"),  # YAML >-
    ("python3.11 -m determined.launch.torch_distributed --nproc_per_node 1 -- python3 train.py", "torchrun"),
    (["python3", "-m", "determined.launch.torch_distributed", "python3", "train.py"], "torchrun"),
    ("python3 -m determined.launch.wrap_rank 0 -- python3 train.py", None),
    ("python3 train.py", None),
    ("bash launch.sh", None),  # a wrapper inside the script cannot be read without running it
    (["torchrun", "--nproc_per_node", "2", "train.py"], None),
])
def test_the_launcher_is_read_from_the_entrypoints_wrapper(entrypoint, launcher):
    argv = entrypoint_argv({"entrypoint": entrypoint})
    assert entrypoint_launcher(argv)[0] == launcher
    assert entrypoint_launcher(entrypoint)[0] == launcher  # a string is split as the YAML loader does


@pytest.mark.parametrize("flag, entrypoint, launcher, why", [
    (None, DS_WRAPPED, "deepspeed",
     "the entrypoint runs determined.launch.deepspeed; --launcher torchrun overrides it"),
    ("torchrun", DS_WRAPPED, "torchrun", "--launcher torchrun was given"),
    ("deepspeed", "python3 model.py", "deepspeed", "--launcher deepspeed was given"),
    (None, "python3 -m determined.launch.torch_distributed python3 model.py", "torchrun",
     "the entrypoint runs determined.launch.torch_distributed; --launcher deepspeed overrides it"),
    (None, "bash launch.sh", "torchrun",
     "the default: the entrypoint runs no determined.launch wrapper itself (one inside a shell script is "
     "not read); pass --launcher deepspeed for DeepSpeed's launcher"),
])
def test_an_explicit_flag_wins_over_the_entrypoint(flag, entrypoint, launcher, why):
    assert choose_launcher(flag, entrypoint_argv({"entrypoint": entrypoint})) == (launcher, why)


def _model_dir(tmp_path, entrypoint):
    """The simulated model (tests/workers/dsat_model_trial.py), run by ``model.py`` only when the
    deepspeed launcher's own variables are set (as Determined's DistributedContext.from_deepspeed)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    procutil.install_sim_model(procutil.WORKERS / "dsat_model_trial.py", model_dir)
    (model_dir / "sim.py").write_text((model_dir / "model.py").read_text())
    (model_dir / "model.py").write_text(
        "import os, runpy, sys\n"
        "missing = [v for v in ('LOCAL_SIZE', 'CROSS_RANK', 'CROSS_SIZE') if v not in os.environ]\n"
        "if missing:\n"
        "    sys.exit(', '.join(missing) + ' not set: from_deepspeed() reads the deepspeed launcher\\'s "
        "variables')\n"
        "sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n"
        "runpy.run_path('sim.py', run_name='__main__')\n")
    (model_dir / "ds_config.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}))
    (model_dir / "deepspeed.yaml").write_text(yaml.safe_dump({
        "name": "sim", "entrypoint": entrypoint, "resources": {"slots_per_trial": 1},
        "searcher": {"max_length": 10},
        "hyperparameters": {"deepspeed_config": "ds_config.json", "oom_above": 8}}))
    return model_dir


def _plan(tmp_path, model_dir, *flags):
    from toolkit.dsat.tuner_cli import build_parser, make_plan

    args = build_parser().parse_args(["binary", str(model_dir / "deepspeed.yaml"), str(model_dir),
                                      "--output-dir", str(tmp_path / "out"), "--memory-per-slot", "100MiB",
                                      *flags])
    return make_plan(args)  # checks and plans only: launches and writes nothing


def test_the_plan_runs_trials_with_the_chosen_launcher(tmp_path):
    model_dir = _model_dir(tmp_path, DS_WRAPPED)
    assert _plan(tmp_path, model_dir).runner.launcher == "deepspeed"
    assert _plan(tmp_path, model_dir, "--launcher", "torchrun").runner.launcher == "torchrun"


def _failed_with(tmp_path, stderr):
    trial_dir = tmp_path / "trial"
    trial_dir.mkdir(exist_ok=True)
    (trial_dir / "stderr.log").write_text(stderr)
    return classify(TrialSpec(0, 1, {"stage": 1}, profile=True), directory=trial_dir, code=1, duration_s=1.0)


@pytest.mark.parametrize("method, flag", [("from_deepspeed", "deepspeed"),
                                          ("from_torch_distributed", "torchrun")])
def test_a_trial_missing_the_other_launchers_variables_names_the_flag(tmp_path, monkeypatch, method, flag):
    from toolkit.compat.determined.core.distributed import DistributedContext
    from toolkit.errors import LaunchEnvError

    for name in ("LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(LaunchEnvError) as err:  # the real error a Core API script raises
        getattr(DistributedContext, method)()
    result = _failed_with(tmp_path, f"Traceback (most recent call last):\n  ...\n"
                                    f"toolkit.errors.LaunchEnvError: {err.value}\n")
    assert result.status is TrialStatus.FAILED
    assert result.error.startswith("exit status 1: the script reads ")
    assert f"pass --launcher {flag}" in result.error.splitlines()[0]


def test_other_failures_name_no_launcher(tmp_path):
    assert "--launcher" not in _failed_with(tmp_path, "ValueError: simulated crash\n").error
    both = "KeyError: 'CROSS_RANK'\nKeyError: 'GROUP_RANK'\n"  # no single flag fixes it
    assert launcher_hint(both) == ""
    assert launcher_hint("LOCAL_SIZE=4 was read\n") == ""  # a name alone is no missing variable
    assert launcher_hint("LaunchEnvError: LOCAL_SIZE='x' is not an integer\n") == ""  # malformed, not missing
    assert launcher_hint("KeyError: 'LOCAL_SIZE'\n").endswith("pass --launcher deepspeed")


def test_the_wrapped_example_is_tuned_without_a_flag(tmp_path):
    """A real search (simulated model, ~20 s): the entrypoint keeps Determined's deepspeed wrapper,
    no --launcher is given, and the script that needs DeepSpeed's variables gets them."""
    model_dir = _model_dir(tmp_path, DS_WRAPPED)
    argv = [sys.executable, "-m", "toolkit.dsat", "binary", str(model_dir / "deepspeed.yaml"),
            str(model_dir), "--output-dir", str(tmp_path / "out"), "--trial-timeout", "60",
            "--max-trials", "2", "--confirm", "0",
            "--zero-stages", "1", "--memory-per-slot", "100MiB", "--max-concurrent-trials", "2"]
    result = procutil.run(argv, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.splitlines()[0].startswith("dsat: the search starts from the DeepSpeed config of ")
    assert result.stdout.splitlines()[1] == (
        "dsat: trials on this machine start with deepspeed: the entrypoint runs determined.launch.deepspeed; "
        "--launcher torchrun overrides it")
    rows = [json.loads(line) for line in (tmp_path / "out" / "trials.jsonl").read_text().splitlines()]
    assert rows[0]["status"] == "ok"
