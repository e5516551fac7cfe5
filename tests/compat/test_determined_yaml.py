"""The Determined experiment YAML as Determined read it (issue 27 item 4): environment_variables
for every rank (the forms: tests/launch/test_experiment_env.py), the determined.launch wrappers
called from a script the entrypoint runs, max_length in records and epochs,
get_experiment_best_validation() from the search's records, save_trial_best, and the ignored keys
warned once per run. One real
`python -m toolkit.run` of a `bash launch.sh` entrypoint with 2 ranks; the rest pure."""

import json
import subprocess
import sys
import warnings

import pytest

from helpers import procutil
from toolkit.compat.determined import storage
from toolkit.compat.determined.core.checkpoint import CheckpointContext
from toolkit.compat.determined.core.distributed import DummyDistributedContext
from toolkit.compat.determined.core.searcher import SearcherContext, Unit
from toolkit.compat.determined.core.train import TensorboardMode, TrainContext
from toolkit.compat.determined.shim.determined.launch import _in_rank as in_rank
from toolkit.config import hyperparameters
from toolkit.config.experiment import ConfigWarning, check_experiment_config, max_length_steps
from toolkit.errors import ConfigError
from toolkit.launch.trial_files import SEARCH_FILE
from toolkit.launch.wrappers import CONTAINER_PER_RANK_ENV, WRAPPED_ENV

SCRIPT = """import json, os, sys
from toolkit.compat import determined as det
info = det.get_cluster_info()
seen = {k: os.environ.get(k) for k in ("MY_FLAG", "EMPTY", "RANK", "WORLD_SIZE", "TOOLKIT_DET_WRAPPED_RANK",
                                       "TOOLKIT_DET_CONTAINER_PER_RANK")}
seen["slot_ids"], seen["parent"] = info.slot_ids, open(f"/proc/{os.getppid()}/comm").read().strip()
out = os.environ["TOOLKIT_OUTPUT_DIR"]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f)
"""

YAML = """name: det-yaml
entrypoint: bash launch.sh
resources: {slots_per_trial: 2}
searcher: {name: single, metric: x, max_length: {epochs: 1}}
records_per_epoch: 64
max_restarts: 0
environment:
  image: determinedai/pytorch-ngc:0.38.0
  environment_variables: ["MY_FLAG=on=1", "EMPTY="]
hyperparameters: {global_batch_size: 32}
"""


def test_a_bash_entrypoint_calling_the_wrapper_runs_every_rank_with_the_variables(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "show.py").write_text(SCRIPT)
    (model / "launch.sh").write_text("set -e\n"
                                     "python3 -m determined.launch.torch_distributed python3 show.py\n")
    (tmp_path / "exp.yaml").write_text(YAML)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "toolkit.run", str(tmp_path / "exp.yaml"), str(model),
                             "--output-dir", str(out)], env=procutil.child_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen == {"MY_FLAG": "on=1", "EMPTY": "", "RANK": str(rank), "WORLD_SIZE": "2",
                        WRAPPED_ENV: str(rank), CONTAINER_PER_RANK_ENV: None, "slot_ids": [0, 1],
                        "parent": "bash"}
    assert result.stderr.count("environment.image is not honoured here") == 1, result.stderr[-3000:]


def test_the_wrapper_outside_a_rank_says_to_use_toolkit_run(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert in_rank.main("determined.launch.torch_distributed", ["python3", "x.py"]) == 2
    assert "python -m toolkit.run CONFIG MODEL_DIR" in capsys.readouterr().err
    assert in_rank.main("determined.launch.deepspeed", ["--trial", "m:C"]) == 2
    assert "Trial API" in capsys.readouterr().err


def test_worker_env_marks_the_worker_and_ends_the_one_slot_container():
    env = in_rank.worker_env({"RANK": "3", "LOCAL_WORLD_SIZE": "2", CONTAINER_PER_RANK_ENV: "1"}, "deepspeed")
    assert env == {"RANK": "3", "LOCAL_WORLD_SIZE": "2", WRAPPED_ENV: "3", "LOCAL_SIZE": "2"}


def test_max_length_in_records_and_epochs():
    base = {"hyperparameters": {"global_batch_size": {"type": "const", "val": 32}}, "records_per_epoch": 100}
    assert max_length_steps({**base, "searcher": {"max_length": {"records": 64}}}) == 2
    # 200 records, rounded up
    assert max_length_steps({**base, "searcher": {"max_length": {"epochs": 2}}}) == 7
    assert max_length_steps({"searcher": {"max_length": {"records": 64}}}, global_batch_size=16) == 4
    with pytest.raises(ConfigError, match="records_per_epoch") as err:
        max_length_steps({"searcher": {"max_length": {"epochs": 2}}})
    assert "hyperparameters.global_batch_size" in str(err.value)
    # the form only at load time (the batch size may be a search space)
    check_experiment_config({"searcher": {"max_length": {"epochs": 2}}, "records_per_epoch": 10})
    with pytest.raises(ConfigError, match="records_per_epoch=0"):
        check_experiment_config({"searcher": {"max_length": {"epochs": 2}}, "records_per_epoch": 0})
    with pytest.raises(ConfigError, match="searcher.max_length"):
        max_length_steps({"searcher": {"max_length": {"epochs": 1, "records": 2}}})


def test_the_searcher_operation_counts_in_the_unit_max_length_names(tmp_path):
    ctx = SearcherContext(DummyDistributedContext(), {"searcher": {"max_length": {"epochs": 3}}}, tmp_path)
    op = next(ctx.operations())
    assert op.length == 3 and ctx.get_configured_units() is Unit.EPOCHS


def test_best_validation_from_the_search_record(tmp_path):
    trial = tmp_path / "trial-0001"

    def best(directory=trial):
        return TrainContext(directory, tensorboard_mode=TensorboardMode.MANUAL,
                            resume_step=None).get_experiment_best_validation()

    assert best() is None  # no search
    record = {"smaller_is_better": False, "trials": [
        {"dir": "trial-0000", "metric": 0.5}, {"dir": "trial-0001", "metric": None},
        {"dir": "trial-0002", "metric": 0.7}]}
    (tmp_path / SEARCH_FILE).write_text(json.dumps(record))
    assert best() == 0.7
    (tmp_path / SEARCH_FILE).write_text(json.dumps({**record, "smaller_is_better": True}))
    assert best() == 0.5
    assert best(tmp_path / "trial-0009") is None  # not this search's trial


def test_plan_gc_keeps_the_latest_and_the_best():
    committed = [{"storage_id": s} for s in "abcde"]
    scores = {"a": 0.3, "b": 0.1, "c": 0.9, "d": 0.2}
    assert storage.plan_gc(committed, 1, save_trial_best=2, metrics=scores) == ["a", "c"]
    larger = storage.plan_gc(committed, 1, save_trial_best=1, metrics=scores, smaller_is_better=False)
    assert larger == ["a", "b", "d"]
    assert storage.plan_gc(committed, None, save_trial_best=0) == ["a", "b", "c", "d"]
    assert storage.plan_gc(committed, None) == []
    with pytest.raises(ConfigError, match="save_trial_best=-1"):
        storage.plan_gc(committed, 1, save_trial_best=-1)


def test_save_trial_best_keeps_the_best_validated_checkpoint(tmp_path):
    ctx = CheckpointContext(DummyDistributedContext(), root=tmp_path / "ckpt", output_dir=tmp_path,
                            save_trial_latest=1, save_trial_best=1, metric="loss")
    ids = []
    for step, loss in ((1, 0.5), (2, 0.1), (3, 0.9), (4, 0.8)):
        with (tmp_path / "metrics.jsonl").open("a") as f:
            row = {"group": "validation", "steps_completed": step, "metrics": {"loss": loss}}
            f.write(json.dumps(row) + "\n")
        with ctx.store_path({"steps_completed": step}) as (path, sid):
            (path / "w").write_text(str(step))
        ids.append(sid)
    kept = [e["storage_id"] for e in storage.read_registry(tmp_path)["committed"]]
    assert kept == [ids[1], ids[3]]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(kept)


def test_cluster_only_determined_keys_are_not_honoured_here_and_typos_stay_unknown(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("entrypoint: python3 x.py\nenvironment: {pod_spec: {}, environment_variables: [A=1]}\n"
                    "checkpoint_storage: {save_experiment_best: 1, save_trial_best: 1}\n"
                    "bind_mounts: [{host_path: /data, container_path: /data}]\n"
                    "resources: {resource_pool: a100, slots_per_trial: 1, slot_per_trial: 2}\n"
                    "min_validation_period: {batches: 10}\ncheckpoint_policy: best\n"
                    "profiling: {enabled: true}\nworkspace: w\nproject: p\ndebug: false\n"
                    "searcher: {name: adaptive_asha, metric: x, max_trials: 4, time_metric: batches,"
                    " max_time: 8, bracket_rungs: [1], source_trial_id: 3}\nmax_restart: 1\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hyperparameters.load_config(path)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    honoured = sorted(m.split(" is not honoured here: ")[0] for m in messages if "not honoured here" in m)
    assert honoured == ["bind_mounts", "checkpoint_policy", "checkpoint_storage.save_experiment_best",
                        "environment.pod_spec", "min_validation_period", "profiling", "project",
                        "resources.resource_pool", "searcher.source_trial_id", "workspace"], messages
    assert sorted(m for m in messages if "not honoured" not in m) == [  # typos keep their message
        "unknown key 'max_restart' is ignored; did you mean 'max_restarts'?",
        "unknown key resources.'slot_per_trial' is ignored; did you mean 'slots_per_trial'?"]
    assert "only Determined's Trial API read it" in next(m for m in messages if "checkpoint_policy" in m)


def test_dsat_trials_get_the_variables_of_their_device(tmp_path):
    from toolkit.dsat.execution.runner import TrialRunner
    from toolkit.dsat.execution.settings import RunnerSettings

    config = tmp_path / "exp.yaml"
    config.write_text("environment:\n  environment_variables: {cpu: [MY_FLAG=cpu], cuda: [MY_FLAG=gpu]}\n")
    settings = RunnerSettings(entrypoint=("python3", "x.py"), model_dir=tmp_path, slots_per_trial=1,
                              max_slots=1, max_concurrent=1, timeout_s=60.0, grace_s=1.0, poll_s=0.1,
                              experiment_config=config)
    with TrialRunner(settings, output_dir=tmp_path / "out") as runner:
        env, _ = runner._trial_env(tmp_path, None)
    assert env["MY_FLAG"] == "cpu"
