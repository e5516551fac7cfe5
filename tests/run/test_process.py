"""One run's launch (toolkit.run.process): the GPUs DeepSpeed's launcher is given, the environment, and
the Forwarder's signals to real processes."""

import base64
import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest

from toolkit.run import plan_run, process
from toolkit.run.process import Forwarder, _launch_argv, deepspeed_include, environment, run_once


def _plan(tmp_path, entrypoint, slots=2):
    return plan_run({"entrypoint": entrypoint, "resources": {"slots_per_trial": slots}},
                    config_path=tmp_path / "x.yaml", model_dir=tmp_path, output_dir=tmp_path)


def test_deepspeed_launches_on_the_gpus_the_run_was_given(tmp_path):
    ds = _plan(tmp_path, "python3 -m determined.launch.deepspeed python3 train.py")
    assert deepspeed_include(ds, {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == "localhost:4,5"  # the first nproc
    argv = _launch_argv(ds, 29511, {"CUDA_VISIBLE_DEVICES": "1,3"})
    info = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
    assert json.loads(base64.urlsafe_b64decode(info)) == {"localhost": [1, 3]}
    for env in ({}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"},
                {"CUDA_VISIBLE_DEVICES": "0,0"}):
        assert deepspeed_include(ds, env) is None, env  # the launcher's default slots 0..n-1
    assert deepspeed_include(_plan(tmp_path, "python3 train.py"), {"CUDA_VISIBLE_DEVICES": "1,3"}) is None


# ---------------------------------------------------------------- the Forwarder, with real processes
# A `sleep` stands for the run's launcher: no rank carries the run's mark, so the signal goes to
# the launcher's process group, as before torchrun has started the ranks.
def _launcher(*, own_group: bool = True) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}  # not a rank process, whatever ran before
    return subprocess.Popen(["sleep", "30"], start_new_session=own_group, env=env)


def test_a_signal_received_before_the_run_started_is_sent_when_it_exists():
    fwd = Forwarder(install=False)
    fwd.handle(signal.SIGUSR1)  # no run yet: remembered
    assert fwd.received == signal.SIGUSR1 and fwd.stopping
    proc = _launcher()
    try:
        fwd.attach(proc, "toolkit-run-test")
        assert proc.wait(timeout=10) == -signal.SIGUSR1
    finally:
        proc.kill()
        proc.wait()


def test_the_searchers_stop_between_two_runs_reaches_the_next_run():
    fwd = Forwarder(install=False)
    fwd.searcher_stop()  # the run had ended: nothing to send
    assert fwd.searcher_stopped and not fwd.searcher_sent
    proc = _launcher()
    try:
        fwd.attach(proc, "toolkit-run-test")
        assert fwd.searcher_sent and proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_a_launcher_without_its_own_process_group_is_reported_not_signalled():
    fwd = Forwarder(install=False)
    fwd.searcher_stopped = True
    proc = _launcher(own_group=False)  # its pid names no process group: killpg finds none
    try:
        fwd.attach(proc, "toolkit-run-test")
        assert not fwd.searcher_sent and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_run_that_cannot_start_releases_its_port(tmp_path):
    plan = _plan(tmp_path, "python3 train.py", slots=1).with_output_dir(tmp_path / "out")
    plan = dataclasses.replace(plan, model_dir=tmp_path / "missing")
    before = set(process._ports_in_use)
    with pytest.raises(FileNotFoundError, match="missing"):
        run_once(plan, environment(plan), forwarder=Forwarder(install=False), grace_s=1.0)
    assert process._ports_in_use == before


def test_the_entrypoints_python3_is_this_interpreter(tmp_path):
    plan = _plan(tmp_path, "python3 train.py", slots=1)
    here = os.path.dirname(sys.executable)
    env = environment(plan, base={"PATH": "/usr/bin:/bin"})  # an unactivated virtual environment
    assert env["PATH"] == f"{here}{os.pathsep}/usr/bin:/bin"
    env = environment(plan, base={"PATH": f"{here}{os.pathsep}/usr/bin"})  # already first: unchanged
    assert env["PATH"] == f"{here}{os.pathsep}/usr/bin"


def test_a_signal_before_the_run_starts_starts_nothing(monkeypatch, tmp_path):
    from toolkit.run import execute

    plan = plan_run({"entrypoint": "python3 x.py"}, config_path=tmp_path / "x.yaml", model_dir=tmp_path,
                    output_dir=tmp_path)
    monkeypatch.setattr(process.subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    forwarder = process.Forwarder()
    try:
        forwarder.received = signal.SIGTERM
        assert process.run_once(plan, {}, forwarder=forwarder, grace_s=1.0) == 0
        sub = plan.with_output_dir(tmp_path / "trial-0003")  # a search's next trial: not even counted
        assert execute(sub, forwarder=forwarder, hparams={}, hparams_seed=1) == 0
        assert not sub.output_dir.exists() and plan.output_dir == tmp_path
    finally:
        forwarder.restore()
