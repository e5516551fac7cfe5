"""toolkit.compat.determined without processes: launcher wrappers, hyperparameters, ids, storage,
checkpoints, metrics, the searcher, and every cluster-only call's error."""

import json
import os
import sys
import types
from pathlib import Path

import pytest

from helpers import resets
from toolkit.compat import determined as det
from toolkit.compat.determined import info as info_mod
from toolkit.compat.determined import storage
from toolkit.compat.determined.core.checkpoint import CheckpointContext, merge_metadata
from toolkit.compat.determined.core.searcher import SearcherContext
from toolkit.compat.determined.core.train import TensorboardMode, TrainContext
from toolkit.compat.determined.pytorch import dsat
from toolkit.errors import ConfigError, LaunchEnvError
from toolkit.launch.trial_files import TRIAL_FILE
from toolkit.launch.wrappers import unwrap_launcher


def test_hparams_const_resolved_and_search_spaces_named():
    hp = {"a": {"type": "const", "val": 2}, "g": {"b": {"type": "const", "val": [1]}, "c": 3}, "d": [1, 2]}
    assert info_mod.resolve_hparams(hp) == {"a": 2, "g": {"b": [1], "c": 3}, "d": [1, 2]}
    with pytest.raises(ConfigError) as err:
        info_mod.resolve_hparams(
            {
                "x": {"type": "int", "minval": 1, "maxval": 8},
                "g": {"y": {"type": "categorical", "vals": [1, 2]}},
            }
        )
    assert any("hyperparameters.x" in p for p in err.value.problems)
    assert any("hyperparameters.g.y" in p for p in err.value.problems)


def _yaml(tmp_path, text):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def env(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("TOOLKIT_") or key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TOOLKIT_OUTPUT_DIR", str(tmp_path / "out"))
    resets.forget_cluster_info()
    yield tmp_path
    resets.forget_cluster_info()


def test_cluster_info_from_yaml_with_stable_ids(env, monkeypatch):
    cfg = _yaml(
        env,
        "name: t\nentrypoint: python3 x.py\nresources: {slots_per_trial: 2}\n"
        "hyperparameters: {lr: {type: const, val: 0.5}, n: 3}\ndata: {k: v}\n"
        "searcher: {name: single, metric: x, max_length: {batches: 7}}\n",
    )
    monkeypatch.setenv("TOOLKIT_EXPERIMENT_CONFIG", str(cfg))
    info = det.get_cluster_info()
    assert info is det.get_cluster_info()  # cached
    assert info.trial.hparams == {"lr": 0.5, "n": 3}
    assert info.latest_checkpoint is None and info.task_type == "TRIAL"
    assert (
        info.user_data == {"k": "v"}
        and info.trial.config["name"] == "t"
        and info.trial._config["name"] == "t"
    )
    assert info.slot_ids == [0, 1] and info.container_addrs == ["127.0.0.1"] and info.container_rank == 0
    ids = (info.trial.trial_id, info.trial.experiment_id)
    resets.forget_cluster_info()
    again = det.get_cluster_info()
    assert (again.trial.trial_id, again.trial.experiment_id) == ids
    assert json.loads((env / "out" / TRIAL_FILE).read_text())["trial_id"] == ids[0]


@pytest.mark.parametrize(
    "text,match",
    [
        ("searcher: {name: adaptive_asha, metric: x}\n", "searcher.name='adaptive_asha'"),
        ("hyperparameters: {g: {x: {type: log, base: 10, minval: -3, maxval: -1}}}\n", "hyperparameters.g.x"),
        ("checkpoint_storage: {type: azure, container: c}\n", "checkpoint_storage.type='azure'"),
    ],
)
def test_cluster_info_refuses_cluster_only_config(env, monkeypatch, text, match):
    monkeypatch.setenv("TOOLKIT_EXPERIMENT_CONFIG", str(_yaml(env, "entrypoint: python3 x.py\n" + text)))
    with pytest.raises(ConfigError, match=match):
        det.get_cluster_info()


def test_dsat_trial_hparams_come_from_the_trial(env, monkeypatch):
    monkeypatch.setenv("TOOLKIT_EXPERIMENT_CONFIG", str(_yaml(env, "hyperparameters: {a: 1}\n")))
    (env / "hp.json").write_text(json.dumps({"a": 2, "deepspeed_config": "/abs/ds.json"}))
    monkeypatch.setenv("TOOLKIT_TRIAL_HPARAMS", str(env / "hp.json"))
    assert det.get_cluster_info().trial.hparams == {"a": 2, "deepspeed_config": "/abs/ds.json"}


def test_storage_roots(tmp_path):
    out, base = tmp_path / "out", tmp_path
    assert storage.storage_root(None, output_dir=out, base_dir=base) == out / "checkpoints"
    assert (
        storage.storage_root({"save_trial_latest": 2}, output_dir=out, base_dir=base) == out / "checkpoints"
    )
    assert storage.storage_root({"storage_path": "ck"}, output_dir=out, base_dir=base) == base / "ck"
    assert storage.storage_root(
        {"type": "shared_fs", "host_path": "/mnt", "storage_path": "c"}, output_dir=out, base_dir=base
    ) == Path("/mnt/c")
    assert storage.storage_root(
        {"type": "directory", "container_path": "/d"}, output_dir=out, base_dir=base
    ) == Path("/d")
    for bad, match in [
        ("hdfs://b/p", "s3:// or gs://"),
        ({"type": "gcs"}, "bucket"),
        ({"type": "azure"}, "azure"),
        ({"type": "shared_fs"}, "host_path"),
    ]:
        with pytest.raises(ConfigError, match=match):
            storage.storage_root(bad, output_dir=out, base_dir=base)
    assert storage.plan_gc([{"storage_id": s} for s in "abc"], 1) == ["a", "b"]
    assert storage.plan_gc([{"storage_id": s} for s in "abc"], None) == []


def test_checkpoint_commit_restore_metadata_delete_and_gc(tmp_path):
    ckpt = CheckpointContext(
        det.core.DummyDistributedContext(), root=tmp_path / "c", output_dir=tmp_path, save_trial_latest=2
    )
    ids = []
    for step in (1, 2, 3):
        with ckpt.store_path({"steps_completed": step}) as (path, sid):
            (path / "w").write_text(str(step))
            assert not storage.is_committed(tmp_path / "c", sid)  # not before the block ends
        ids.append(sid)
    registry = storage.read_registry(tmp_path)
    assert [e["storage_id"] for e in registry["committed"]] == ids[1:]  # save_trial_latest: 2
    assert not (tmp_path / "c" / ids[0]).exists()
    assert storage.latest_storage_id(registry, tmp_path / "c") == ids[2]
    with ckpt.restore_path(ids[2]) as path:
        assert (path / "w").read_text() == "3"
    assert ckpt.get_metadata(ids[2]) == {"steps_completed": 3}
    ckpt.download(ids[2], tmp_path / "copy")
    assert (tmp_path / "copy" / "w").read_text() == "3"
    up = ckpt.upload(tmp_path / "copy", {"steps_completed": 4})
    assert storage.latest_storage_id(storage.read_registry(tmp_path), tmp_path / "c") == up
    ckpt.delete(up)
    with pytest.raises(det.errors.CheckpointNotFound):
        with ckpt.restore_path(up):
            pass
    with pytest.raises(RuntimeError, match="boom"):  # a failing block commits nothing
        with ckpt.store_path({"steps_completed": 9}) as (path, sid):
            raise RuntimeError("boom")
    assert storage.latest_storage_id(storage.read_registry(tmp_path), tmp_path / "c") == ids[2]
    CheckpointContext(det.core.DummyDistributedContext(), root=tmp_path / "c", output_dir=tmp_path)
    assert not (tmp_path / "c" / sid).exists()  # the next run removes the partial one


def _validated(path, rows):
    path.write_text("".join(json.dumps({"group": group, "steps_completed": step, "metrics": {"loss": loss}})
                            + "\n" for group, step, loss in rows) + '{"group": "validation", "ste')


def test_save_trial_best_keeps_the_best_validated_and_skips_lines_it_cannot_read(tmp_path):
    ckpt = CheckpointContext(det.core.DummyDistributedContext(), root=tmp_path / "c", output_dir=tmp_path,
                             save_trial_latest=1, save_trial_best=1, metric="loss")
    _validated(tmp_path / "metrics.jsonl", [("validation", 1, 0.1), ("validation", 2, 0.5),
                                            ("training", 3, 0.01), ("validation", 3, float("nan"))])
    ids = []
    for step in (1, 2, 3):
        with ckpt.store_path({"steps_completed": step}) as (path, sid):
            (path / "w").write_text(str(step))
        ids.append(sid)
    kept = [e["storage_id"] for e in storage.read_registry(tmp_path)["committed"]]
    assert kept == [ids[0], ids[2]]  # the best validated (loss 0.1) and the newest


def test_save_trial_best_without_metrics_keeps_the_newest_only(tmp_path):
    ckpt = CheckpointContext(det.core.DummyDistributedContext(), root=tmp_path / "c", output_dir=tmp_path,
                             save_trial_latest=1, save_trial_best=1, metric="loss")
    for step in (1, 2):
        with ckpt.store_path({"steps_completed": step}) as (path, sid):
            (path / "w").write_text(str(step))
    assert [e["storage_id"] for e in storage.read_registry(tmp_path)["committed"]] == [sid]


def test_a_checkpoint_gc_cannot_remove_is_left_alone_with_a_warning(tmp_path, caplog):
    root = tmp_path / "c"
    ckpt = CheckpointContext(det.core.DummyDistributedContext(), root=root, output_dir=tmp_path,
                             save_trial_latest=1)
    with ckpt.store_path({"steps_completed": 1}) as (path, first):
        (path / "w").write_text("1")
    (root / first).rename(root / "moved")
    (root / first).symlink_to(root / "moved")  # someone put a link where the checkpoint was
    with ckpt.store_path({"steps_completed": 2}) as (path, second):
        (path / "w").write_text("2")
    assert f"save_trial_latest/save_trial_best: left {first!r} alone: " in caplog.text
    assert (root / "moved" / "w").read_text() == "1" and (root / first).is_symlink()
    assert [e["storage_id"] for e in storage.read_registry(tmp_path)["committed"]] == [second]


def test_checkpoint_copies_follow_the_selector_and_leave_links_out(tmp_path, caplog):
    ckpt = CheckpointContext(det.core.DummyDistributedContext(), root=tmp_path / "c", output_dir=tmp_path)
    with pytest.raises(ValueError, match=r"upload\(ckpt_dir=None\) is only allowed with shard=True"):
        ckpt.upload(None, {"steps_completed": 1})
    with ckpt.store_path({"steps_completed": 1}) as (path, sid):
        (path / "model").mkdir()
        (path / "model" / "w.pt").write_text("w")
        (path / "optim.pt").write_text("o")
        (path / "link").symlink_to(tmp_path / "outside")
    ckpt.download(sid, tmp_path / "copy", selector=lambda rel: rel.startswith("model/"))
    assert sorted(p.relative_to(tmp_path / "copy").as_posix() for p in (tmp_path / "copy").rglob("*")) == [
        "model", "model/w.pt"]
    assert "download: skipped " in caplog.text and "link, a symlink in the checkpoint" in caplog.text
    with ckpt.restore_path(sid, selector=lambda rel: False) as path:
        assert (path / "optim.pt").read_text() == "o"  # read in place: everything is there
    assert "restore_path: selector ignored, the checkpoint is read in place" in caplog.text


def test_merge_metadata_conflicts():
    assert merge_metadata([{"a": {"c": 1}}, {"a": {"d": 1}}]) == {"a": {"c": 1, "d": 1}}
    with pytest.raises(RuntimeError, match="conflicts"):
        merge_metadata([{"a": [1]}, {"a": [2]}])


def test_train_metrics_reach_tensorboard_and_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = TrainContext(tmp_path, tensorboard_mode=TensorboardMode.AUTO, resume_step=None)
    train.report_training_metrics(steps_completed=5, metrics={"loss": 0.5, "name": "x"})
    train.report_validation_metrics(steps_completed=5, metrics={"acc": 1})
    train.report_metrics("inference", steps_completed=5, metrics={"qps": 3.0})
    with pytest.raises(ConfigError, match="None"):
        train.report_validation_metrics(steps_completed=6, metrics={"acc": None})
    with pytest.raises(ConfigError, match="progress"):
        train.report_progress(1.5)
    with pytest.raises(RuntimeError, match="MANUAL"):
        train.upload_tensorboard_files()
    assert train.get_tensorboard_path() == tmp_path / "tensorboard"
    train.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"training/loss", "validation/acc", "inference/qps"} <= set(acc.Tags()["scalars"])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["group"] for line in lines] == ["training", "validation", "inference"]


def test_searcher_one_op_then_nothing_once_completed(tmp_path):
    config = {"searcher": {"name": "single", "max_length": {"batches": 4}}}
    searcher = SearcherContext(det.core.DummyDistributedContext(), config, tmp_path)
    it = searcher.operations()
    op = next(it)
    assert op.length == 4 and searcher.get_configured_units() is det.core.Unit.BATCHES
    with pytest.raises(RuntimeError, match="report_completed"):
        next(it)
    op.report_completed({"loss": 1.0})
    with pytest.raises(RuntimeError, match="once"):
        op.report_completed(1.0)
    assert next(searcher.operations(), None) is None
    assert list(SearcherContext(det.core.DummyDistributedContext(), config, tmp_path).operations()) == []
    assert json.loads((tmp_path / "determined_searcher.json").read_text())["searcher_metric"] == {"loss": 1.0}


@pytest.mark.parametrize(
    "searcher,match",
    [
        ({"max_length": {"epochs": 0}}, "epochs"),
        ({}, "max_length is not set"),
    ],
)
def test_searcher_length_errors(tmp_path, searcher, match):
    ctx = SearcherContext(det.core.DummyDistributedContext(), {"searcher": searcher}, tmp_path)
    with pytest.raises(ConfigError, match=match):
        ctx.operations()


def test_cluster_only_calls_say_what_to_use(tmp_path):
    ctx = det.core.Context.__new__(det.core.Context)
    with pytest.raises(NotImplementedError, match="webhooks"):
        det.core.Context.alert(ctx, title="x")
    with pytest.raises(NotImplementedError, match="torch.profiler"):
        det.core.ProfilerContext().on()
    det.core.ProfilerContext().off()
    train = TrainContext(tmp_path, tensorboard_mode=TensorboardMode.MANUAL, resume_step=None)
    train.upload_tensorboard_files()
    with pytest.raises(NotImplementedError, match="checkpoint"):
        train.set_metadata({})
    with pytest.raises(NotImplementedError):
        train.get_metadata()
    with pytest.raises(NotImplementedError, match="torchrun"):
        det.core.DistributedContext.from_horovod(object())


def test_distributed_context_arguments():
    d = det.core.DistributedContext(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
    assert (d.get_rank(), d.get_size(), d.get_local_rank(), d.get_num_agents()) == (0, 1, 0, 1)
    assert d.gather(1) == [1] and d.allgather(2) == [2] and d.broadcast(3) == 3
    assert d.gather_local(1) == [1] and d.allgather_local(2) == [2] and d.broadcast_local(3) == 3
    with pytest.raises(ValueError, match="cross_size"):
        det.core.DistributedContext(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0)
    with pytest.raises(TypeError):
        det.core.DistributedContext(0, 1, 0, 1, 0, 1)  # keyword-only, as in Determined
    with pytest.raises(ValueError, match="chief_ip"):
        det.core.DistributedContext(rank=0, size=4, local_rank=0, local_size=2, cross_rank=0, cross_size=2)
    assert det.core.PreemptMode("CHIEF_ONLY") is det.core.PreemptMode.ChiefOnly
    assert det.core.SearcherMode("CHEIF_ONLY") is det.core.SearcherMode.ChiefOnly
    assert det.LOG_FORMAT == "%(levelname)s: [%(process)s] %(name)s: %(message)s"
    with pytest.raises(TypeError):
        det.InvalidHP(3)


def test_distributed_context_defaults_and_bad_ranks():
    d = det.core.DistributedContext()  # nothing given: rank 0 of 1, as Determined
    assert (d.rank, d.size, d.local_rank, d.local_size, d.cross_rank, d.cross_size) == (0, 1, 0, 1, 0, 1)
    with pytest.raises(ValueError, match=r"rank 2 of 2, local rank 0 of 1: expected 0 <= rank < size"):
        det.core.DistributedContext(rank=2, size=2, local_rank=0, local_size=1, cross_rank=0, cross_size=2,
                                    chief_ip="10.0.0.1")


def test_distributed_context_from_a_launchers_variables_names_the_bad_one(monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "one"), ("LOCAL_RANK", "0"), ("LOCAL_SIZE", "1"),
                       ("CROSS_RANK", "0"), ("CROSS_SIZE", "1")):
        monkeypatch.setenv(var, value)
    with pytest.raises(LaunchEnvError, match=r"^WORLD_SIZE='one' is not an integer$"):
        det.core.DistributedContext.from_deepspeed()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert det.core.DistributedContext.from_deepspeed().get_size() == 1


def test_dsat_get_ds_config_from_hparams(tmp_path):
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1, "reduce_bucket_size": 5}}
        )
    )
    got = dsat.get_ds_config_from_hparams(
        {"deepspeed_config": "ds.json", "overwrite_deepspeed_args": {"zero_optimization": {"stage": 2}}},
        base_dir=tmp_path,
    )
    assert got["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 5}
    with pytest.raises(ConfigError, match="deepspeed_config"):
        dsat.get_ds_config_from_hparams({})


def test_dsat_reporting_context_outside_a_trial_is_transparent(tmp_path, monkeypatch):
    monkeypatch.delenv("TOOLKIT_DSAT_TRIAL", raising=False)
    monkeypatch.chdir(tmp_path)
    with dsat.dsat_reporting_context(None, None):
        pass
    with pytest.raises(SystemExit):  # no autotuning file: the exit goes on untouched
        with dsat.dsat_reporting_context(None, None):
            sys.exit(0)


@pytest.mark.parametrize("files, reported", [
    (["autotuning_metric.json"], True),          # DeepSpeed's autotuner ended the run: its metrics
    (["model_info.json"], True),                  # its model-info run (no GPU here: no gpu_mem added)
    (["autotuning_metric.json", "model_info.json"], False),  # which one is ambiguous: nothing reported
    ([], False),
])
def test_an_exit_of_deepspeeds_autotuner_reports_its_metrics_file(tmp_path, monkeypatch, files, reported):
    """Determined's helper: when DeepSpeed's own autotuner ends the run (SystemExit) after writing
    its metrics file, the chief reports it as the validation metrics and completes the operation."""
    monkeypatch.delenv("TOOLKIT_DSAT_TRIAL", raising=False)
    monkeypatch.chdir(tmp_path)
    for name in files:
        (tmp_path / name).write_text(json.dumps({"throughput": 12.5, "latency": 80.0}))
    config = {"searcher": {"name": "single", "max_length": {"batches": 4}}}
    core = types.SimpleNamespace(
        distributed=det.core.DummyDistributedContext(),
        train=TrainContext(tmp_path / "out", tensorboard_mode=TensorboardMode.MANUAL, resume_step=None),
        searcher=SearcherContext(det.core.DummyDistributedContext(), config, tmp_path / "out"))
    op = next(core.searcher.operations())
    with pytest.raises(SystemExit):
        with dsat.dsat_reporting_context(core, op, steps_completed=3):
            sys.exit(0)
    core.train.close()
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() \
        if (tmp_path / "out" / "metrics.jsonl").exists() else []
    if not reported:
        assert lines == [] and next(core.searcher.operations(), None) is not None  # not completed
        return
    (line,) = [json.loads(text) for text in lines]
    assert (line["group"], line["steps_completed"]) == ("validation", 3)
    assert line["metrics"] == {"throughput": 12.5, "latency": 80.0}
    assert json.loads((tmp_path / "out" / "determined_searcher.json").read_text())["searcher_metric"] == {
        "throughput": 12.5, "latency": 80.0}


class _Rank1:
    """A worker's view for calls that must refuse non-chief ranks (no process group needed)."""

    rank, size, local_rank = 1, 2, 1

    def broadcast(self, stuff):
        return False


def test_chief_only_calls_refuse_workers(tmp_path):
    ckpt = CheckpointContext(_Rank1(), root=tmp_path / "c", output_dir=tmp_path)
    with pytest.raises(RuntimeError, match="non-chief"):
        with ckpt.store_path({"steps_completed": 1}):
            pass
    searcher = SearcherContext(_Rank1(), {"searcher": {"max_length": 3}}, tmp_path)
    with pytest.raises(RuntimeError, match="non-chief"):
        searcher.operations(det.core.SearcherMode.ChiefOnly)
    op = next(searcher.operations())
    with pytest.raises(RuntimeError, match="chief"):
        op.report_completed(1.0)
    with pytest.raises(RuntimeError, match="chief"):
        op.report_progress(1)
    preempt = det.core.PreemptContext(det.core.DummyDistributedContext())
    with pytest.raises(RuntimeError, match="before PreemptContext.start"):
        preempt.should_preempt()


def test_init_without_distributed_under_a_multi_process_launch_is_refused(env, monkeypatch):
    monkeypatch.setenv("TOOLKIT_EXPERIMENT_CONFIG", str(_yaml(env, "entrypoint: python3 x.py\n")))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="DistributedContext"):
        det.core.init()
    with pytest.raises(TypeError):
        det.core.init(None)  # keyword-only, as in Determined


def test_searcher_length_inside_a_dsat_trial_is_the_last_profiled_step(tmp_path, monkeypatch):
    contract = tmp_path / "trial.json"
    contract.write_text(
        json.dumps(
            {
                "trial_id": 0,
                "result_path": str(tmp_path / "r.json"),
                "start_profile_step": 3,
                "end_profile_step": 5,
            }
        )
    )
    monkeypatch.setenv("TOOLKIT_DSAT_TRIAL", str(contract))
    searcher = SearcherContext(det.core.DummyDistributedContext(), {}, tmp_path)
    assert next(searcher.operations()).length == 6
    # with a timed window (--timed-window): up to the last step the trial may time, and one more
    contract.write_text(json.dumps({**json.loads(contract.read_text()), "timed_window_s": 3.0,
                                    "last_profile_step": 17}))
    searcher = SearcherContext(det.core.DummyDistributedContext(), {}, tmp_path / "other")
    assert next(searcher.operations()).length == 18


def test_refused_entrypoints_point_to_the_porting_section_of_the_docs():
    from test_docs import REPO, _anchors
    from toolkit.run.plan import PORTING, refused_entrypoint

    page, anchor = PORTING.split("#")
    assert anchor in _anchors(REPO / page)
    assert refused_entrypoint(["python3", "-m", "determined.launch.deepspeed", "python3", "t.py"]) is None
    assert refused_entrypoint(["python3", "train.py:main"]) is None  # a command, not a Trial class
    with pytest.raises(ConfigError, match=PORTING):
        unwrap_launcher(["python3", "-m", "determined.launch.deepspeed", "--trial", "m:T"])
