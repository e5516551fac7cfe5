"""What toolkit.run launches, decided from the experiment config alone (toolkit.run.plan): the launcher
and process count each entrypoint form stands for, the output directory, every problem of the config
named at once, and the entrypoints toolkit cannot run refused before anything starts. Pure."""

import logging
from pathlib import Path

import pytest

from toolkit.errors import ConfigError
from toolkit.run.plan import RunPlan, plan_run, refused_entrypoint


def _plan(tmp_path, **config):
    return plan_run(config, config_path=tmp_path / "exp.yaml", model_dir=tmp_path,
                    output_dir=tmp_path / "out")


@pytest.mark.parametrize("entrypoint, launcher, command, nproc, wrapped", [
    ("python3 train.py --lr 0.1", "torchrun", ["python3", "train.py", "--lr", "0.1"], 2, False),
    (["python3", "train.py"], "torchrun", ["python3", "train.py"], 2, False),
    ("python3 -m determined.launch.torch_distributed python3 train.py", "torchrun", ["python3", "train.py"],
     2, True),
    ("python3 -m determined.launch.torch_distributed --nproc_per_node 1 -- python3 train.py", "torchrun",
     ["python3", "train.py"], 1, True),
    ("python3 -m determined.launch.deepspeed python3 train.py", "deepspeed", ["python3", "train.py"], 2,
     True),
    ("deepspeed train.py", "deepspeed", ["deepspeed", "train.py"], 2, False),
])
def test_each_entrypoint_form_gets_its_launcher_and_process_count(tmp_path, entrypoint, launcher, command,
                                                                  nproc, wrapped):
    plan = _plan(tmp_path, entrypoint=entrypoint, resources={"slots_per_trial": 2})
    assert (plan.launcher, plan.command, plan.nproc, plan.wrapped) == (launcher, command, nproc, wrapped)
    assert plan.max_restarts == 5 and plan.output_dir == (tmp_path / "out").resolve()
    assert plan.config_path == (tmp_path / "exp.yaml").resolve() and plan.model_dir == tmp_path.resolve()


def test_the_output_directory_and_a_trials_copy_of_the_plan(tmp_path, monkeypatch):
    monkeypatch.delenv("TOOLKIT_OUTPUT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    plan = plan_run({"entrypoint": "python3 x.py", "name": "my exp/1"}, config_path=Path("exp.yaml"),
                    model_dir=tmp_path, output_dir=None)
    assert plan.output_dir == tmp_path / "runs" / "my-exp-1"
    monkeypatch.setenv("TOOLKIT_OUTPUT_DIR", str(tmp_path / "elsewhere"))
    plan = plan_run({"entrypoint": "python3 x.py"}, config_path=Path("exp.yaml"), model_dir=tmp_path,
                    output_dir=None)
    assert plan.output_dir == tmp_path / "elsewhere"
    trial = plan.with_output_dir(tmp_path / "trial-0001")
    assert isinstance(trial, RunPlan) and trial.output_dir == tmp_path / "trial-0001" and trial.command == \
        plan.command and plan.output_dir == tmp_path / "elsewhere"  # frozen: the search's own plan is kept


def test_every_problem_of_the_config_is_named_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        _plan(tmp_path, max_restarts=-1, hyperparameters={"lr": {"type": "double", "minval": 2, "maxval": 1}},
              searcher={"name": "random", "metric": "x"}, checkpoint_storage={"type": "azure"},
              environment={"environment_variables": ["NO_EQUALS_SIGN"]})
    text = "\n".join(err.value.problems)
    for key in ("entrypoint is missing", "max_restarts=-1", "hyperparameters.lr", "searcher.max_trials",
                "checkpoint_storage.type='azure'", "environment.environment_variables"):
        assert key in text, (key, text)
    assert err.value.source == str(tmp_path / "exp.yaml")
    with pytest.raises(ConfigError, match="entrypoint='python3 \"x.py': cannot be split"):
        _plan(tmp_path, entrypoint='python3 "x.py')


def test_a_037_searcher_section_is_planned_translated_with_one_notice(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="toolkit.run")
    searcher = {"name": "async_halving", "num_rungs": 2, "metric": "x", "max_trials": 4, "max_length": 100}
    plan = _plan(tmp_path, entrypoint="python3 x.py", searcher=searcher)
    assert plan.config["searcher"]["name"] == "adaptive_asha" and plan.config["searcher"]["max_time"] == 100
    assert [r.message.count("translated from Determined's") for r in caplog.records] == [1]


@pytest.mark.parametrize("argv, fragment", [
    (["model_def:MNistTrial"], "names a class of Determined's Trial API"),
    (["python3", "-m", "determined.launch.horovod", "python3", "train.py"], "starts Horovod (horovodrun)"),
    (["python3", "-m", "determined.launch.tensorflow", "python3", "train.py"], "TensorFlow's distributed"),
])
def test_entrypoints_toolkit_cannot_run_are_refused_with_the_porting_guide(tmp_path, argv, fragment):
    why = refused_entrypoint(argv)
    assert fragment in why and "docs/determined.md#trial-api-and-horovod-experiments" in why
    with pytest.raises(ConfigError, match="Trial API|Horovod|TensorFlow"):
        _plan(tmp_path, entrypoint=argv)
    assert refused_entrypoint(["python3", "train.py"]) is None
