"""Checkpoints in object storage against real servers on loopback, started here: moto's S3 server
(checking access keys) and a GCS emulator. Real torchrun ranks, real signals, no mock of a store.

The spot-VM round trip runs a ZeRO-1 engine into S3 and a ZeRO-3 engine into GCS in one launch
(tests/workers/ckpt_store.py trains them in lockstep), to spend two launches on both stages.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import procutil
from helpers.storage_servers import GcsEmulator, S3Server, TcpProxy, bucket_fixture, wait_for
from toolkit.checkpoint import layout, remote, store
from toolkit.errors import CheckpointError, ConfigError
from toolkit.runtime.context import DistributedContext

WORKER = procutil.WORKERS / "ckpt_store.py"


s3 = bucket_fixture(S3Server, "spot", auth=True)
gcs = bucket_fixture(GcsEmulator, "spot")


def _results(out: Path, ranks: int = 1) -> list[dict]:
    return [json.loads((out / f"run{rank}.json").read_text()) for rank in range(ranks)]


def _progress(out: Path) -> int:
    try:
        return int((out / "progress0").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


# ------------------------------------------------------------------------------------- pure parts

@pytest.mark.parametrize("given, expected", [
    ("s3://bucket/a/b/", ("s3", "bucket", "a/b")),
    ("gcs://my_bucket", ("gs", "my_bucket", "")),
    ("gs://b-1.x/run", ("gs", "b-1.x", "run")),
    ("checkpoints", None),
    ("./s3:/x", None),
])
def test_parse_url(given, expected):
    url = store.parse_url(given)
    assert (url and (url.scheme, url.bucket, url.prefix)) == expected


@pytest.mark.parametrize("given, words", [
    ("hdfs://x/y", "not in hdfs://"),
    ("file:///tmp/x", "not in file://"),
    ("s3://Upper/x", "bucket name"),
    ("s3://bucket/a/../b", "'..'"),
    ("s3://bucket/a//b", "no empty component"),
    ("s3:///x", "bucket name"),
])
def test_parse_url_refuses(given, words):
    with pytest.raises(ConfigError, match="checkpoint_dir=") as err:
        store.parse_url(given)
    assert words in str(err.value)


def test_local_paths_refuse_urls(tmp_path):
    """consolidate_checkpoint and every other local path take no URL, and never make 's3:' dirs."""
    with pytest.raises(ConfigError, match="only save_checkpoint and load_checkpoint"):
        layout.checkpoint_root("s3://bucket/x")
    assert layout.checkpoint_root(str(tmp_path / "a:b")) == str(tmp_path / "a:b")


def test_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # what an environment without the extra gives
    monkeypatch.setattr(store, "_stores", {})
    with pytest.raises(ConfigError, match=r"pip install 'toolkit\[s3\]'"):
        store.open_store(store.parse_url("s3://bucket/x"))
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    monkeypatch.setitem(sys.modules, "gcsfs.core", None)
    with pytest.raises(ConfigError, match=r"pip install 'toolkit\[gcs\]'"):
        store.open_store(store.parse_url("gs://bucket/x"))


# ---------------------------------------------------------------------- the layout in a real bucket

def test_scan_and_discard_in_a_real_bucket(s3, monkeypatch):
    """scan_store reads a bucket as layout reads a directory; discarding removes the record first."""
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(store, "_stores", {})
    st = store.open_store(store.parse_url("s3://spot/scan"))
    record = {"tag": "step_1", "seq": 0, "run_id": "r1", "steps_completed": 1}
    st.write("toolkit_run.json", json.dumps({"run_id": "r1"}).encode())
    st.write("step_1/toolkit_checkpoint.json", json.dumps(record).encode())
    st.write("step_1/toolkit_save_started.json", b"{}")
    st.write("step_1/mp_rank_00_model_states.pt", b"x" * 10)
    st.write("step_2/toolkit_save_started.json", b"{}")       # an interrupted save
    st.write("step_2/toolkit_rng/rank_00000.pt", b"y")
    st.write("latest", b"step_2")                               # names an uncommitted tag
    state, files = remote.scan_store(st)
    assert state.run_id == "r1" and files["step_1/mp_rank_00_model_states.pt"] == 10
    assert [t.tag for t in state.committed()] == ["step_1"] and state.tags["step_2"].started
    info, warning = layout.resolve_tag(state, None)
    assert info.tag == "step_1" and "not committed" in warning
    assert layout.plan_keep_last(state, keep_last=1, just_written="step_3") == ["step_1", "step_2"]
    remote._discard(st, files, "step_2")
    assert sorted(st.list_files()) == ["latest", "step_1/mp_rank_00_model_states.pt",
                                       "step_1/toolkit_checkpoint.json", "step_1/toolkit_save_started.json",
                                       "toolkit_run.json"]
    st.write("step_1/toolkit_checkpoint.json", b"{not json")
    with pytest.raises(CheckpointError, match=r"s3://spot/scan/step_1/toolkit_checkpoint.json.*damaged"):
        remote.scan_store(st)


def _open(s3, monkeypatch, url: str, **options) -> store.ObjectStore:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(store, "_stores", {})
    return store.open_store(store.parse_url(url), options)


def test_backend_failures_become_clear_errors(s3, monkeypatch, tmp_path):
    """Each call of an ObjectStore against a real server: a missing bucket lists as empty and names the
    fix on a write; a wrong secret fails every call with the credentials' hint and never the secret."""
    gone = _open(s3, monkeypatch, "s3://no-such-bucket/x")
    assert gone.list_files() == {} and gone.read("latest", 10) is None
    with pytest.raises(CheckpointError, match=r"writing s3://no-such-bucket/x/latest failed: .*the bucket "
                                              r"'no-such-bucket' does not exist: create it, or fix the URL"):
        gone.write("latest", b"step_1")
    gone.delete(["latest"])  # deleting what is not there is no error

    bad = _open(s3, monkeypatch, "s3://spot/creds-x", key=s3.key_id, secret="wrong-secret-value-77")
    fix = r"failed: .*check the credentials \(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    with pytest.raises(CheckpointError, match=r"listing s3://spot/creds-x " + fix) as listing:
        bad.list_files()
    with pytest.raises(CheckpointError, match=r"reading s3://spot/creds-x/latest " + fix):
        bad.read("latest", 10)
    with pytest.raises(CheckpointError, match=r"downloading 1 file\(s\) from s3://spot/creds-x " + fix):
        bad.download([("step_1/a.pt", str(tmp_path / "dl" / "a.pt"))])
    with pytest.raises(CheckpointError,
                       match=r"deleting 1 object\(s\) under s3://spot/creds-x " + fix) as deleting:
        bad.delete(["latest"])
    assert "wrong-secret-value-77" not in str(listing.value) + str(deleting.value)
    # a local directory that cannot be made (a file in its place) fails as a CheckpointError too, which
    # remote.load's ranks agree on, not a bare OSError on one rank while the others wait
    (tmp_path / "blocked").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"downloading from s3://spot/creds-x: cannot create .*blocked/step_1"):
        bad.download([("step_1/a.pt", str(tmp_path / "blocked" / "step_1" / "a.pt"))])


def test_the_hint_follows_what_the_backend_said():
    gs, s3url = store.parse_url("gs://b-1/x"), store.parse_url("s3://b-1/x")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in store._hint(gs, PermissionError("no"), "permissionerror: no")
    assert "AWS_ACCESS_KEY_ID" in store._hint(s3url, ValueError("odd"), "valueerror: odd")  # unknown: creds
    assert "does not exist" in store._hint(gs, FileNotFoundError("b-1"), "filenotfounderror: b-1")
    assert "cannot be reached" in store._hint(s3url, OSError("x"), "connection refused")


def _commit_record(tag: str, **meta) -> bytes:
    return json.dumps({"tag": tag, "seq": 0, "run_id": "r1", "steps_completed": 1, **meta}).encode()


def test_a_bucket_load_refuses_a_record_a_misfit_and_unsafe_names_before_downloading(s3, monkeypatch,
                                                                                     tmp_path):
    """remote.load's checks on the chief (one process, world of one), each before any download."""
    ctx = DistributedContext(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                             num_nodes=1, device=torch.device("cpu"), backend="gloo", launcher="none")
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    facts = {"world_size": 1, "data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline": False,
             "pipeline_stages": None, "zero_stage": 1}

    st = _open(s3, monkeypatch, "s3://spot/misnamed")
    st.write("step_1/toolkit_checkpoint.json", _commit_record("step_9"))  # a record copied from elsewhere
    with pytest.raises(CheckpointError, match=r"s3://spot/misnamed/step_1/toolkit_checkpoint.json: its "
                                              r"tag='step_9' is not the name of its directory 'step_1'"):
        remote.load(None, ctx, st, None, facts)

    st = _open(s3, monkeypatch, "s3://spot/misfit")
    st.write("step_1/toolkit_checkpoint.json", _commit_record("step_1", **{**facts, "zero_stage": 3}))
    with pytest.raises(CheckpointError, match=r"checkpoint 'step_1' in s3://spot/misfit does not fit this "
                                              r"engine:\n  - ZeRO stage: saved 3, this engine 1"):
        remote.load(None, ctx, st, None, facts)

    st = _open(s3, monkeypatch, "s3://spot/unsafe")
    st.write("step_1/toolkit_checkpoint.json", _commit_record("step_1", **facts))
    st.write("step_1/..x/a b.pt", b"x")
    st.write("step_2/toolkit_save_started.json", b"{}")
    st.write("latest", b"step_2")  # not committed: the load warns and takes step_1
    with pytest.raises(CheckpointError, match=r"s3://spot/unsafe/step_1/..x/a b.pt: not a name toolkit or "
                                              r"DeepSpeed writes.*nor is the checkpoint 'step_1'"):
        remote.load(None, ctx, st, None, facts)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.pt"))
    assert s3.keys("spot", "unsafe/.toolkit-probe") == []  # the probe object is deleted


# -------------------------------------------------------------------------- real runs with signals

def test_spot_vm_round_trip_resumes_bitwise_from_the_buckets(s3, gcs, tmp_path):
    """Train on 2 ranks, SIGTERM to torchrun, the working directory and its cache deleted; the same
    command from a new directory resumes from S3 (ZeRO-1) and GCS (ZeRO-3), and its losses equal
    an uninterrupted run's bitwise."""
    runs = ["--ckpt", "zero1=s3://spot/z1", "--ckpt", "zero3=gs://spot/z3"]
    first = tmp_path / "vm1"
    first.mkdir()
    env = procutil.child_env(**s3.env(), **gcs.env(), TOOLKIT_CACHE_DIR=str(first / "cache"))
    argv = procutil.torchrun_argv(WORKER, "out", *runs, "--steps", "9", "--sleep", "0.3")
    with open(first / "log", "w") as log:
        proc = subprocess.Popen(argv, env=env, cwd=first, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_for(lambda: _progress(first / "out") >= 2, 180, "two steps")
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    stopped = _results(first / "out", 2)
    assert all(r["ended"].startswith("preempted at") for r in stopped), (first / "log").read_text()[-3000:]
    at = int(stopped[0]["ended"].split()[-1])
    assert at < 9 and s3.read("spot", "z1/latest").decode() == f"step_{at}"
    assert not list((first / "cache").rglob("*.pt")), "the staging directories are removed after the upload"
    log = (first / "log").read_text()
    assert f"checkpoint 'step_{at}' uploaded to s3://spot/z1 in" in log  # the chief logs the upload
    assert "after the preemption was agreed, of a 30 s grace (TOOLKIT_PREEMPTION_GRACE)" in log
    shutil.rmtree(first)  # the spot VM's disk is gone

    second = tmp_path / "vm2"
    second.mkdir()
    env["TOOLKIT_CACHE_DIR"] = str(second / "cache")
    result = procutil.run(procutil.torchrun_argv(WORKER, "out", *runs, "--steps", "9", "--reference"),
                          env=env, cwd=second, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    for rank, resumed in enumerate(_results(second / "out", 2)):
        assert resumed["start"] == {"zero1": at, "zero3": at}
        for case in ("zero1", "zero3"):
            both = {**stopped[rank]["losses"][case], **resumed["losses"][case]}
            assert both == resumed["reference"][case], (rank, case)  # floats from JSON: bitwise
    assert not list((second / "cache").rglob("*.pt")), "the download is removed once loaded"


def test_sigkill_mid_upload_and_a_server_that_stops_leave_the_previous_checkpoint(s3, tmp_path):
    """One process saving every 2 steps through a proxy: (a) SIGKILL while step_4's upload is held:
    step_2 stays the latest, step_4 is never committed; (b) the rerun resumes from step_2, and the
    server going away in step_4's upload is a clear error on the save; (c) with the server back,
    the same command resumes from step_2 and matches an uninterrupted run bitwise; keep_last=1
    then leaves one checkpoint and no leftover."""
    proxy = TcpProxy(s3.port)
    env = procutil.child_env(**s3.env(proxy.endpoint), TOOLKIT_CACHE_DIR=str(tmp_path / "cache"))
    argv = [sys.executable, str(WORKER), "out", "--ckpt", "zero0=s3://spot/kill", "--steps", "6",
            "--save-every", "2", "--keep-last", "1"]
    step4_upload = lambda data: data.startswith(b"PUT ") and b"/kill/step_4/" in data and b".pt " in data  # noqa: E731
    try:
        proxy.hold_when(step4_upload)
        proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_for(proxy.held.is_set, 180, "the upload of step_4")
            time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        keys = s3.keys("spot", "kill/")
        assert s3.read("spot", "kill/latest") == b"step_2"
        assert "kill/step_2/toolkit_checkpoint.json" in keys
        assert "kill/step_4/toolkit_save_started.json" in keys
        assert "kill/step_4/toolkit_checkpoint.json" not in keys
        proxy.release()

        proxy.hold_when(step4_upload)
        proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        wait_for(proxy.held.is_set, 180, "the upload of step_4, again")
        proxy.stop()
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode != 0
        assert "CheckpointError: uploading checkpoint 'step_4' to s3://spot/kill failed" in out, out[-3000:]
        assert "previous checkpoint is still the latest" in out
        assert _results(tmp_path / "out")[0]["start"] == {"zero0": 2}
        assert s3.read("spot", "kill/latest") == b"step_2"
        assert s3.secret not in out

        proxy.start()
        result = procutil.run(argv + ["--reference"], env=env, cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:]
        (run,) = _results(tmp_path / "out")
        assert run["start"] == {"zero0": 2}
        assert run["losses"]["zero0"] == {k: v for k, v in run["reference"]["zero0"].items() if int(k) > 2}
        assert s3.read("spot", "kill/latest") == b"step_6"
        assert {k.split("/")[1] for k in s3.keys("spot", "kill/")} == {"latest", "toolkit_run.json", "step_6"}
    finally:
        proxy.stop()


def test_wrong_credentials_fail_before_training(s3, tmp_path):
    """A wrong secret: the load (the first call of the loop) fails on the probe, before any step,
    naming what to check and never the secret."""
    env = procutil.child_env(**{**s3.env(), "AWS_SECRET_ACCESS_KEY": "wrong-secret-value-42"},
                             TOOLKIT_CACHE_DIR=str(tmp_path / "cache"))
    result = procutil.run([sys.executable, str(WORKER), "out", "--ckpt", "zero0=s3://spot/creds"], env=env,
                          cwd=tmp_path, timeout=240)
    assert result.returncode != 0
    (run,) = _results(tmp_path / "out")
    assert run["ended"] == "loading" and not run["losses"]["zero0"]
    assert "CheckpointError: writing s3://spot/creds/.toolkit-probe-" in run["load_error"]
    assert "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in run["load_error"]
    assert "wrong-secret-value-42" not in result.stdout and s3.secret not in result.stdout
    assert s3.keys("spot", "creds/") == []
