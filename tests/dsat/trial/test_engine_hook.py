"""toolkit.dsat.trial.engine_hook and the trial bootstrap (toolkit/dsat/trial/site/sitecustomize.py).

What DeepSpeed itself decides (which configs run, what an engine reports) is checked in real trials
(tests/dsat/test_conventions_e2e.py, tests/dsat/trial/test_reporting.py). Here the hook's own logic:
in this process with a stand-in for ``deepspeed.initialize`` (its real signature), and in child
processes started with the bootstrap on ``PYTHONPATH`` and a stand-in ``deepspeed`` package, which
costs a second where DeepSpeed's import costs several.
"""

import argparse
import base64
import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import procutil
from toolkit.dsat.contract import MISMATCH_EXIT_STATUS, TrialContract
from toolkit.dsat.trial import engine_hook
from toolkit.dsat.trial.engine_hook import SCRIPT_CONFIG_FILE, given_config, initialize_in_trial
from toolkit.dsat.trial.site import SITE_DIR
from toolkit.dsat.tuned_keys import INSTRUMENTATION
from toolkit.runtime.trial_env import TRIAL_ENV

TRIAL_CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 1},
    **INSTRUMENTATION,
}
SCRIPT_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 2},
}

# A stand-in for the deepspeed package: initialize with DeepSpeed 0.19's signature, an engine that
# reports what its config says (FAKE_IGNORE: a config of its own), and the accelerator a session asks for.
FAKE_DEEPSPEED = textwrap.dedent("""
    import os

    class Engine:
        device = "cpu"
        dp_world_size = 1
        def __init__(self, config):
            self.config = config
        def train_micro_batch_size_per_gpu(self):
            return self.config["train_micro_batch_size_per_gpu"]
        def gradient_accumulation_steps(self):
            return self.config.get("gradient_accumulation_steps", 1)
        def zero_optimization_stage(self):
            return self.config.get("zero_optimization", {}).get("stage", 0)
        def zero_offload_optimizer(self):
            return None
        def zero_offload_param(self):
            return None
        def is_gradient_accumulation_boundary(self):
            return True
        def __call__(self, *args):  # as torch.nn.Module's: the instance's forward
            return self.forward(*args)
        def forward(self, x):
            return x
        def backward(self, loss):
            return None
        def step(self):
            return None

    def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                   lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None,
                   collate_fn=None, config=None, mesh_param=None, config_params=None):
        if os.environ.get("FAKE_IGNORE"):
            config = {"train_micro_batch_size_per_gpu": 2}
        return Engine(config), None, None, None
""")
FAKE_ACCELERATOR = "def get_accelerator():\n    return type('A', (), {'synchronize': lambda self: None})()\n"
USER_SITE = "import os\nopen(os.environ['MARKER'], 'w').write('the user sitecustomize ran')\n"
SCRIPT = textwrap.dedent("""
    import json, os, sys
    print(json.dumps({"at_start": sorted({"toolkit", "torch", "deepspeed"} & set(sys.modules))}))
    if os.environ.get("FIND_FIRST"):  # as transformers asks whether DeepSpeed is installed
        import importlib.util
        assert importlib.util.find_spec("deepspeed") is not None and "deepspeed" not in sys.modules
    import deepspeed
    engine, *_ = deepspeed.initialize(model=None, config=dict(json.loads(os.environ["SCRIPT_CONFIG"])))
    print(json.dumps({"wrapped": getattr(deepspeed.initialize, "toolkit_dsat_hook", False),
                      "micro_batch": engine.train_micro_batch_size_per_gpu()}))
    if os.environ.get("FEED"):  # forwards of these sizes (an evaluation's first), then one backward
        import torch
        for n in os.environ["FEED"].split(","):
            engine(torch.zeros(int(n), 16))
        engine.backward(0)
        print(json.dumps({"trained": True}))
""")


def _trial(tmp_path, *, merge=True):
    (tmp_path / "ds_config.json").write_text(json.dumps(TRIAL_CONFIG))
    TrialContract(
        3, str(tmp_path / "result.json"), 3, 5, ds_config=str(tmp_path / "ds_config.json"), merge_config=merge
    ).write(tmp_path / "trial.json")
    return tmp_path / "trial.json"


def _run(tmp_path, *, trial, **env):
    """The script in a child process, the bootstrap first on PYTHONPATH, then a user's sitecustomize."""
    fake, user = tmp_path / "fake", tmp_path / "user_site"
    (fake / "deepspeed").mkdir(parents=True, exist_ok=True)
    (fake / "deepspeed" / "__init__.py").write_text(FAKE_DEEPSPEED)
    (fake / "deepspeed" / "accelerator.py").write_text(FAKE_ACCELERATOR)
    user.mkdir(exist_ok=True)
    (user / "sitecustomize.py").write_text(USER_SITE)
    (tmp_path / "script.py").write_text(SCRIPT)
    child = procutil.child_env(
        PYTHONPATH=os.pathsep.join([str(SITE_DIR), str(user), str(fake), str(procutil.REPO)]),
        MARKER=str(tmp_path / "marker"),
        SCRIPT_CONFIG=json.dumps(SCRIPT_CONFIG),
        **env,
    )
    for key in ("TOOLKIT_DSAT_TRIAL", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        child.pop(key, None)
    if trial is not None:
        child["TOOLKIT_DSAT_TRIAL"] = str(trial)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "script.py")],
        env=child,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done, {k: v for line in lines for k, v in line.items()}


def test_the_bootstrap_merges_in_a_trial_only_and_runs_the_users_sitecustomize(tmp_path):
    trial = _trial(tmp_path)
    done, seen = _run(tmp_path, trial=trial, FEED="5,4")  # an evaluation's batch of 5, then the engine's 4
    assert done.returncode == 0 and seen["trained"], done.stderr[-3000:]
    # Python started the bootstrap, which imported none of toolkit, torch or DeepSpeed by itself
    assert seen["at_start"] == [] and seen["wrapped"] is True
    assert (tmp_path / "marker").read_text() == "the user sitecustomize ran"  # chained as Python would
    assert seen["micro_batch"] == 4  # the trial's, not the script's 8
    recorded = json.loads((tmp_path / SCRIPT_CONFIG_FILE).read_text())
    assert recorded == {
        "how": "a dict given as deepspeed.initialize(config=...)",
        "path": None,
        "source": "script",
        "config": SCRIPT_CONFIG,
    }
    assert (
        "dsat trial 3: merged its tuned keys (micro-batch 4, gradient accumulation 1, ZeRO stage 1"
        in done.stderr
    )
    # outside a trial: nothing wrapped, the script's own config, the user's sitecustomize all the same
    (tmp_path / "marker").unlink()
    done, seen = _run(tmp_path, trial=None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (seen["wrapped"], seen["micro_batch"]) == (False, 8) and (tmp_path / "marker").exists()


def test_a_script_that_looks_deepspeed_up_before_importing_it_is_still_reached(tmp_path):
    # transformers (and so HF Trainer) calls importlib.util.find_spec("deepspeed") long before it
    # imports DeepSpeed: the hook must survive a lookup that imports nothing.
    done, seen = _run(tmp_path, trial=_trial(tmp_path), FIND_FIRST="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert seen["wrapped"] is True and seen["micro_batch"] == 4


def test_an_engine_that_runs_another_config_ends_the_trial_as_a_mismatch(tmp_path):
    """A script whose engine ignores the config it is given (here: the stand-in's FAKE_IGNORE)."""
    trial = _trial(tmp_path)
    done, _ = _run(tmp_path, trial=trial, FAKE_IGNORE="1")
    assert done.returncode == MISMATCH_EXIT_STATUS, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "mismatch" and result["trial_id"] == 3 and result["metrics"] == {}
    assert result["engine"]["micro_batch"] == 2 and result["expected"]["micro_batch"] == 4
    error = result["error"]
    for part in (
        "micro-batch: the engine runs 2, the trial is labelled 4",
        "ZeRO stage: the engine runs 0",
        f"the trial's config ({tmp_path / 'ds_config.json'})",
        "a dict given as deepspeed.initialize",
        "dsat merged the trial's keys over it",
        "Fix: ",
        "--deepspeed_config",
    ):
        assert part in error, (part, error)


def test_a_loop_that_feeds_its_own_batch_size_ends_the_trial_as_a_mismatch(tmp_path):
    """The engine runs the trial's micro-batch 4, the script's data loader keeps 3: its throughput
    would be counted for examples it never trained. Held at the first backward, to the forward before
    it (an evaluation's batch of 5 before is not); the engine's own steps are timed: no dsat line."""
    trial = _trial(tmp_path)
    done, seen = _run(tmp_path, trial=trial, FEED="5,3")
    assert seen["micro_batch"] == 4 and "trained" not in seen
    assert done.returncode == MISMATCH_EXIT_STATUS, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "mismatch" and result["data_batch"] == [3, 16]  # [B, F]: either may be B
    assert (
        "feeds 3/16 examples per forward" in result["error"]
        and "engine.train_micro_batch_size_per_gpu()" in result["error"]
    )


def _initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=29500,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """deepspeed.initialize's signature (DeepSpeed 0.19); records what it was given."""
    _initialize.calls.append({"args": args, "config": config, "config_params": config_params})
    ran = config if config is not None else json.loads(open(args.deepspeed_config).read())
    engine = type(
        "Engine",
        (),
        {
            "train_micro_batch_size_per_gpu": lambda self: ran["train_micro_batch_size_per_gpu"],
            "gradient_accumulation_steps": lambda self: 1,
            "zero_optimization_stage": lambda self: ran["zero_optimization"]["stage"],
            "zero_offload_optimizer": lambda self: None,
            "zero_offload_param": lambda self: None,
            "forward": lambda self, x: x,
            "backward": lambda self, loss: None,
            "step": lambda self: None,
        },
    )()
    return engine, None, None, None


def test_the_config_of_args_deepspeed_config_is_merged_without_touching_the_scripts_args(
    tmp_path, monkeypatch
):
    """--deepspeed_config PATH with deepspeed.initialize(args=args): DeepSpeed refuses a config given both in
    args and in the call, so the merged dict goes as config= with a copy of args whose path is None."""
    (tmp_path / "trial").mkdir()
    trial = _trial(tmp_path / "trial")
    user_file = tmp_path / "ds_user.json"
    user_file.write_text(json.dumps(SCRIPT_CONFIG))
    monkeypatch.setenv("TOOLKIT_DSAT_TRIAL", str(trial))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the trial's OOM hook, installed on the way
    args = argparse.Namespace(deepspeed=True, deepspeed_config=str(user_file), local_rank=-1)
    _initialize.calls = []
    engine, *_ = initialize_in_trial(_initialize, (args,), {"model": "m"})
    call = _initialize.calls[0]
    assert args.deepspeed_config == str(user_file)  # the script's object, unchanged
    assert (
        call["args"] is not args and call["args"].deepspeed_config is None and call["args"].local_rank == -1
    )
    assert (
        call["config"]["train_micro_batch_size_per_gpu"] == 4
        and call["config"]["optimizer"] == SCRIPT_CONFIG["optimizer"]
        and call["config_params"] is None
    )
    assert engine.train_micro_batch_size_per_gpu() == 4
    recorded = json.loads((trial.parent / SCRIPT_CONFIG_FILE).read_text())
    assert recorded["source"] == "script" and recorded["path"] == str(user_file)
    assert recorded["how"].startswith(
        f"args.deepspeed_config={str(user_file)!r} (the --deepspeed_config flag)"
    )
    # the trial's own file, as the rewritten flag hands it back: passed as it is, recorded as the trial's
    _initialize.calls = []
    args = argparse.Namespace(deepspeed_config=str(trial.parent / "ds_config.json"))
    initialize_in_trial(_initialize, (), {"args": args, "model": "m"})
    assert _initialize.calls[0]["args"] is args and _initialize.calls[0]["config"] is None
    assert json.loads((trial.parent / SCRIPT_CONFIG_FILE).read_text())["source"] == "trial"
    # outside a trial and a full run: the call as made
    monkeypatch.delenv("TOOLKIT_DSAT_TRIAL")
    _initialize.calls = []
    initialize_in_trial(_initialize, (), {"model": "m", "config": SCRIPT_CONFIG})
    assert _initialize.calls == [{"args": None, "config": SCRIPT_CONFIG, "config_params": None}]


@pytest.mark.parametrize("how", ["config", "config_params", "path", "base64", "args", "none"])
def test_how_a_script_gives_its_config(tmp_path, how):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(SCRIPT_CONFIG))
    encoded = base64.urlsafe_b64encode(json.dumps(SCRIPT_CONFIG).encode()).decode()
    bound = {
        "config": {"config": SCRIPT_CONFIG},
        "config_params": {"config_params": SCRIPT_CONFIG},
        "path": {"config": str(path)},
        "base64": {"config": encoded},
        "args": {"args": argparse.Namespace(deepspeed_config=str(path))},
        "none": {},
    }[how]
    given = given_config(bound)
    assert given.config == (None if how == "none" else SCRIPT_CONFIG)
    assert given.path == (str(path) if how in ("path", "args") else None)
    assert {
        "config": "deepspeed.initialize(config=...)",
        "config_params": "(config_params=...)",
        "path": f"the file {path}",
        "base64": "a dict",
        "args": "--deepspeed_config flag",
        "none": "no config given",
    }[how] in given.how or how == "base64"


def test_a_config_that_is_no_dict_file_or_base64_is_given_as_none(tmp_path):
    missing = str(tmp_path / "missing.json")
    given = given_config({"config": missing})  # neither a file nor base64 of JSON: its path kept
    assert (given.config, given.path) == (None, missing)
    given = given_config({"args": argparse.Namespace(deepscale_config=missing)})  # the flag's old name
    assert (given.config, given.path) == (None, missing) and "the --deepscale_config flag" in given.how
    given = given_config({"config_params": 42})  # not a config DeepSpeed reads: none, no path
    assert (given.config, given.path) == (None, None) and "(config_params=...)" in given.how


def test_a_rank_whose_launch_variables_are_malformed_records_as_the_chief(monkeypatch):
    """The script meets the launch error itself (at init_distributed); the hook does not raise it."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert engine_hook._is_chief() is False
    monkeypatch.delenv("MASTER_ADDR")  # world size 2 without rank 0's address: LaunchEnvError
    assert engine_hook._is_chief() is True


def test_a_config_file_that_cannot_be_read_is_passed_on_as_given():
    assert engine_hook._merged(engine_hook.Given("x", None, "missing.json"), TRIAL_CONFIG, trial=True) is None
    assert engine_hook._merged(engine_hook.Given("x", None), TRIAL_CONFIG, trial=True) == TRIAL_CONFIG


def test_the_full_run_merges_the_best_configs_tuned_keys_and_checks_nothing(tmp_path, monkeypatch):
    """--run-full-experiment (TOOLKIT_DSAT_APPLY_CONFIG, no trial): a script building its config in code
    trains the best config's micro-batch, accumulation and ZeRO section with its own other keys."""
    best = {**TRIAL_CONFIG, "optimizer": {"type": "SGD"}}
    for key in INSTRUMENTATION:
        best.pop(key)
    (tmp_path / "best_ds_config.json").write_text(json.dumps(best))
    monkeypatch.delenv("TOOLKIT_DSAT_TRIAL", raising=False)
    monkeypatch.setenv(engine_hook.APPLY_ENV, str(tmp_path / "best_ds_config.json"))
    _initialize.calls = []
    engine, *_ = initialize_in_trial(_initialize, (), {"model": "m", "config": SCRIPT_CONFIG})
    given = _initialize.calls[0]["config"]
    assert given == {
        **SCRIPT_CONFIG,
        **{
            k: best[k]
            for k in (
                "train_batch_size",
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "zero_optimization",
            )
        },
    }
    assert "flops_profiler" not in given and not (tmp_path / SCRIPT_CONFIG_FILE).exists()
    assert not hasattr(engine, "_toolkit_dsat_steps")  # nothing timed outside a trial


READS = """
import io, json, os, pathlib
path = os.environ["USER_CONFIG"]
seen = {"open": json.load(open(path)), "pathlib": json.loads(pathlib.Path(path).read_text()),
        "io": json.load(io.open(path, "rb")), "relative": json.load(open(os.path.basename(path)))}
open(path + ".other", "w").write("x")                       # writes and other files are untouched
seen["other"] = open(path + ".other").read()
with open(path, "a") as f:                                  # an append opens the user's own file
    seen["append"] = f.name
print(json.dumps(seen))
"""


def test_in_a_trial_a_script_that_reads_its_own_config_file_reads_the_trials(tmp_path):
    """Only reads of the named files, by any path to them, through open, io.open and pathlib;
    outside a trial nothing changes (the bootstrap alone, no DeepSpeed, in a child process)."""
    user, trial = tmp_path / "ds_config.json", tmp_path / "trial_3" / "ds_config.json"
    trial.parent.mkdir()
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    trial.write_text(json.dumps({"train_micro_batch_size_per_gpu": 64}))
    env = procutil.child_env(PYTHONPATH=str(SITE_DIR), USER_CONFIG=str(user),
                             TOOLKIT_DSAT_CONFIG_READS=str(user))
    run = [sys.executable, "-c", READS]
    inside = procutil.run(run, env={**env, TRIAL_ENV: str(trial.parent / "trial.json")}, cwd=tmp_path,
                          timeout=60)
    seen = json.loads(inside.stdout.splitlines()[-1])
    read = [seen[k]["train_micro_batch_size_per_gpu"] for k in ("open", "pathlib", "io", "relative")]
    assert read == [64] * 4
    assert (seen["other"], seen["append"]) == ("x", str(user))
    assert f"reads its DeepSpeed config {user}" in inside.stdout
    outside = json.loads(procutil.run(run, env=env, cwd=tmp_path, timeout=60).stdout.splitlines()[-1])
    assert outside["open"] == outside["relative"] == {"train_micro_batch_size_per_gpu": 2}


def test_a_short_data_set_fails_the_micro_batch_and_a_loader_of_its_own_is_a_mismatch():
    verdict = engine_hook.data_batch_verdict
    assert verdict({64, 128}, micro_batch=64, own=2) is None and verdict(set(), micro_batch=64, own=2) is None
    assert verdict({2, 128}, micro_batch=64, own=2) == "mismatch"      # the script's own batch: ignores it
    assert verdict({3000, 128}, micro_batch=4096, own=4096) == "failed"  # follows it, the data runs short
    assert verdict({3000}, micro_batch=4096, own=None) == "mismatch"     # how it was given is unknown
    assert verdict({5000}, micro_batch=4096, own=4096) == "mismatch"     # more than the micro-batch
