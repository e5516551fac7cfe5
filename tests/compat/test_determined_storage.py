"""Determined's checkpoint_storage of type s3 and gcs, against real servers on loopback started here
(moto's S3 server with access keys checked, gcp-storage-emulator): the Core API's checkpoint calls
in process, and a DeepSpeed Core API script with two ranks under python -m toolkit.run."""

from __future__ import annotations

import json
import signal
import sys
import uuid
from pathlib import Path

import pytest

from helpers import procutil
from helpers.storage_servers import GcsEmulator, S3Server, bucket_fixture
from toolkit.compat import determined as det
from toolkit.compat.determined import cloud, storage
from toolkit.compat.determined.core.checkpoint import CheckpointContext
from toolkit.errors import CheckpointError, ConfigError

from test_determined_e2e import DS_CONFIG, _committed, _finish, _start, _wait_committed


s3 = bucket_fixture(S3Server, "det", auth=True)
gcs = bucket_fixture(GcsEmulator, "det")


def test_cloud_storage_sections(tmp_path):
    root = storage.storage_root({"type": "s3", "bucket": "b-1", "prefix": "/exp/1/", "access_key": "AKIA1",
                                 "secret_key": "s3cr3t-value", "endpoint_url": "http://127.0.0.1:9"},
                                output_dir=tmp_path, base_dir=tmp_path)
    assert str(root) == "s3://b-1/exp/1" and "s3cr3t-value" not in repr(root) + str(root)
    assert dict(root.options) == {"key": "AKIA1", "secret": "s3cr3t-value", "endpoint_url": "http://127.0.0.1:9"}
    assert str(storage.storage_root({"type": "gcs", "bucket": "b_2"}, output_dir=tmp_path, base_dir=tmp_path)) \
        == "gs://b_2"
    assert str(storage.storage_root("gs://b_2/x", output_dir=tmp_path, base_dir=tmp_path)) == "gs://b_2/x"
    with pytest.raises(ConfigError) as err:
        storage.storage_root({"type": "s3", "prefix": 3, "secret_key": ["s3cr3t-value"]},
                             output_dir=tmp_path, base_dir=tmp_path)
    assert [p.split(":")[0] for p in err.value.problems] == [
        "checkpoint_storage.bucket=None", "checkpoint_storage.prefix=3", "checkpoint_storage.secret_key=a list",
        "checkpoint_storage"]
    assert "s3cr3t-value" not in str(err.value)
    with pytest.raises(ConfigError, match="prefix"):
        storage.storage_root({"type": "s3", "bucket": "b-1", "prefix": "a/../b"}, output_dir=tmp_path,
                             base_dir=tmp_path)
    assert storage.root_from_registry("s3://b-1/exp/1", root) is root
    assert str(storage.root_from_registry("gs://other/p", root)) == "gs://other/p"


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_core_api_checkpoint_calls_on_a_bucket(kind, s3, gcs, tmp_path, monkeypatch):
    """store_path, restore_path, download, upload, get_metadata, delete and save_trial_latest on a
    real bucket; the commit is metadata.json, written last; an interrupted store_path is cleaned."""
    server = s3 if kind == "s3" else gcs
    for key, value in {**(s3.env() if kind == "s3" else gcs.env()), "TOOLKIT_CACHE_DIR": str(tmp_path / "cache")
                       }.items():
        monkeypatch.setenv(key, value)
    section = {"type": kind, "bucket": "det", "prefix": f"core-{kind}"}
    if kind == "s3":  # keys and endpoint from the YAML, not the environment
        section.update(access_key=s3.key_id, secret_key=s3.secret, endpoint_url=s3.endpoint)
        for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(key)
    root = storage.storage_root(section, output_dir=tmp_path, base_dir=tmp_path)
    ckpt = CheckpointContext(det.core.DummyDistributedContext(), root=root, output_dir=tmp_path,
                             save_trial_latest=2)
    ids = []
    for step in (1, 2, 3):
        with ckpt.store_path({"steps_completed": step}) as (path, sid):
            (path / "sub").mkdir()
            (path / "sub" / "w").write_text(str(step))
            assert not storage.is_committed(root, sid)
        ids.append(sid)
    assert [e["storage_id"] for e in storage.read_registry(tmp_path)["committed"]] == ids[1:]
    listed = sorted(root.store.list_files())
    assert listed == sorted(f"{sid}/{name}" for sid in ids[1:] for name in ("metadata.json", "sub/w"))
    assert storage.latest_storage_id(storage.read_registry(tmp_path), root) == ids[2]
    with ckpt.restore_path(ids[2]) as path:
        assert (path / "sub" / "w").read_text() == "3"
    assert not path.exists()  # the download is removed after the block
    assert ckpt.get_metadata(ids[2]) == {"steps_completed": 3}
    ckpt.download(ids[2], tmp_path / "copy", selector=lambda rel: rel.endswith("w"))
    assert sorted(p.name for p in (tmp_path / "copy").rglob("*")) == ["sub", "w"]
    up = ckpt.upload(tmp_path / "copy", {"steps_completed": 4})
    ckpt.delete(up)
    assert not [rel for rel in root.store.list_files() if rel.startswith(up)]
    with pytest.raises(det.errors.CheckpointNotFound):
        with ckpt.restore_path(up):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with ckpt.store_path({"steps_completed": 9}) as (path, sid):
            (path / "half").write_text("x")
            raise RuntimeError("boom")
    assert not storage.is_committed(root, sid)
    CheckpointContext(det.core.DummyDistributedContext(), root=root, output_dir=tmp_path)
    assert not path.exists() and storage.read_registry(tmp_path)["pending"] == []
    assert storage.read_registry(tmp_path)["root"] == f"{'s3' if kind == 's3' else 'gs'}://det/core-{kind}"
    if kind == "s3":
        assert s3.secret not in (tmp_path / storage.REGISTRY_NAME).read_text()
        bad = storage.storage_root({**section, "secret_key": "not-the-secret-1234"}, output_dir=tmp_path,
                                   base_dir=tmp_path)
        with pytest.raises(CheckpointError, match="check the credentials") as err:
            CheckpointContext(det.core.DummyDistributedContext(), root=bad, output_dir=tmp_path)  # core.init
        assert "not-the-secret-1234" not in str(err.value) and "writing s3://det/core-s3/.toolkit-probe-" in str(
            err.value)
    del server


def test_local_metadata_damaged_or_not_an_object_and_removing_nothing(tmp_path):
    sid = str(uuid.uuid4())
    (tmp_path / sid).mkdir()
    (tmp_path / sid / "metadata.json").write_text("{half")
    with pytest.raises(CheckpointError, match=rf"cannot read .*{sid}/metadata.json: .*metadata is damaged"):
        storage.read_metadata(tmp_path, sid)
    (tmp_path / sid / "metadata.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"metadata.json holds list, expected a JSON object"):
        storage.read_metadata(tmp_path, sid)
    assert storage.remove_checkpoint(tmp_path, str(uuid.uuid4())) is False  # no such directory
    assert (tmp_path / sid / "metadata.json").exists()


def test_cloud_roots_refuse_bad_sections_and_urls():
    with pytest.raises(ConfigError, match="checkpoint_storage.bucket=None"):
        cloud.cloud_root({"type": "gcs"})
    with pytest.raises(ConfigError, match=r"checkpoint_storage='/mnt/ckpt': expected an s3:// or gs:// URL"):
        cloud.url_root("/mnt/ckpt")


def test_cloud_checkpoint_failures_name_the_checkpoint_and_commit_nothing(s3, tmp_path, monkeypatch):
    """On the real S3 server: an uncommitted or damaged metadata.json, an unsafe object name in a
    restore, and a bucket deleted under a running trial (the upload fails, nothing is committed)."""
    for key, value in {**s3.env(), "TOOLKIT_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    s3.make_bucket("det-gone")
    root = storage.storage_root({"type": "s3", "bucket": "det-gone", "prefix": "p"}, output_dir=tmp_path,
                                base_dir=tmp_path)
    ckpt = CheckpointContext(det.core.DummyDistributedContext(), root=root, output_dir=tmp_path)
    sid = str(uuid.uuid4())
    with pytest.raises(FileNotFoundError, match=rf"s3://det-gone/p/{sid}/metadata.json"):
        storage.read_metadata(root, sid)
    root.store.write(f"{sid}/metadata.json", b"{half")
    with pytest.raises(CheckpointError, match=rf"cannot read s3://det-gone/p/{sid}/metadata.json: .*damaged"):
        storage.read_metadata(root, sid)
    root.store.write(f"{sid}/metadata.json", b'{"steps_completed": 1}')
    root.store.write(f"{sid}/sub/a b.pt", b"x")  # not a name a checkpoint's writer gives
    with pytest.raises(CheckpointError, match=rf"downloading checkpoint {sid} from s3://det-gone/p: "
                                              rf"s3://det-gone/p/{sid}/sub/a b.pt: not a safe file name"):
        with ckpt.restore_path(sid):
            pass
    assert not list((tmp_path / "cache").rglob("*.pt"))
    root.store.delete(list(root.store.list_files()))
    s3.client().delete_bucket(Bucket="det-gone")
    with pytest.raises(CheckpointError, match=r"checkpoint (\S+) was not committed: uploading 1 file\(s\) to "
                                              r"s3://det-gone/p failed: .*'det-gone' does not exist") as err:
        with ckpt.store_path({"steps_completed": 2}) as (path, new_sid):
            (path / "w").write_text("2")
    assert new_sid in str(err.value) and not path.exists()   # the staging directory is removed
    assert storage.read_registry(tmp_path)["committed"] == []


DS_S3_YAML = """name: det-s3
entrypoint: python3 -m determined.launch.deepspeed python3 det_deepspeed.py
resources: {{slots_per_trial: 2}}
searcher: {{name: single, metric: loss, max_length: 6}}
max_restarts: 0
checkpoint_storage:
  type: s3
  bucket: det
  prefix: experiments/ds
  endpoint_url: {endpoint}
  access_key: {key}
  secret_key: {secret}
  save_trial_latest: 2
hyperparameters:
  deepspeed_config: ds_config.json
  checkpoint_rate: 2
"""


def test_deepspeed_core_api_experiment_checkpoints_in_s3_and_resumes(s3, tmp_path):
    """The Core API DeepSpeed script under toolkit.run with checkpoint_storage type s3 (keys and
    endpoint in the YAML only): its sharded checkpoints are listed in the bucket, a stop after the
    first one resumes from the bucket, and the secret is in no log and no file of the run."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "det_deepspeed.py").write_text((procutil.WORKERS / "det_deepspeed.py").read_text())
    (model_dir / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    (model_dir / "deepspeed.yaml").write_text(DS_S3_YAML.format(endpoint=s3.endpoint, key=s3.key_id,
                                                                secret=s3.secret))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "toolkit.run", str(model_dir / "deepspeed.yaml"), str(model_dir),
            "--output-dir", str(out)]
    env = {"TOOLKIT_CACHE_DIR": str(tmp_path / "cache"), "AWS_EC2_METADATA_DISABLED": "true"}
    proc = _start(argv, DET_TEST_STEP_SLEEP="0.5", **env)
    _wait_committed(proc, out, 1)
    proc.send_signal(signal.SIGUSR1)
    rc, first_log = _finish(proc)
    assert rc == 0, first_log[-4000:]
    first = _committed(out)[-1]
    keys = s3.keys("det", "experiments/ds/")
    shard = {k.split("/", 3)[3] for k in keys if k.startswith(f"experiments/ds/{first['storage_id']}/")}
    assert {"metadata.json", "latest"} <= shard and any(n.endswith("/mp_rank_00_model_states.pt") for n in shard)
    assert sum("zero_pp_rank" in name for name in shard) == 2  # each rank's optimizer shard
    rc, log = _finish(_start(argv, **env))
    assert rc == 0, log[-4000:]
    steps = [json.loads(line)["steps_completed"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6 and steps.count(first["steps_completed"] + 1) == 1  # resumed after it
    committed = [e["storage_id"] for e in _committed(out)]
    assert len(committed) == 2  # save_trial_latest: 2, the older ones deleted from the bucket
    assert {k.split("/")[2] for k in s3.keys("det", "experiments/ds/")} == set(committed)
    assert s3.secret not in first_log + log
    for path in out.rglob("*"):
        assert not path.is_file() or s3.secret.encode() not in path.read_bytes(), path
    assert not list((tmp_path / "cache").rglob("*.pt"))  # staging and downloads removed
