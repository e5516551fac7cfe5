"""A Core API script that launches its own workers (Determined's 4_distributed.py style, imports
swapped only) under python -m toolkit.run with 2 real ranks: `determined.launch.wrap_rank` from the
shim, one container per rank, the workers' process group, a SIGTERM that stops the workers and not
their launcher, and the rerun's resume with the same sampled hyperparameter and trial id. Also the
pure parts: wrap_rank's argument and line rules, and which processes a forwarded signal reaches."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import procutil
from toolkit.compat.determined import storage, wrap_rank
from toolkit.errors import ConfigError, LaunchEnvError
from toolkit.launch.procs import find_trial_processes
from toolkit.launch.wrappers import SHIM_DIR, WRAPPED_ENV, shim_pythonpath
from toolkit.run.process import signal_targets

YAML = """name: det-launcher
entrypoint: python3 det_launcher.py launcher
resources: {slots_per_trial: 2}
searcher: {name: single, metric: x}
max_restarts: 0
hyperparameters:
  increment_by: {type: int, minval: 1, maxval: 8}
  max_length: 40
  checkpoint_every: 5
"""


def test_wrap_rank_rules():
    assert wrap_rank.parse_rank("3", {}) == 3 and wrap_rank.parse_rank("A,RANK", {"RANK": "2"}) == 2
    assert wrap_rank.parse_rank("A", {}) is None
    with pytest.raises(ConfigError, match="RANK='-1'"):
        wrap_rank.parse_rank("-1", {})  # a negative number, not a variable name
    with pytest.raises(LaunchEnvError, match="RANK='x'.*'A,RANK'"):
        wrap_rank.parse_rank("A,RANK", {"RANK": "x"})
    assert list(wrap_rank.split_lines(iter([b"a\rb", b"c\n\nd"]))) == [b"a\n", b"bc\n", b"\n", b"d\n"]
    assert [len(x) for x in wrap_rank.split_lines(iter([b"x" * 9000]))] == [8192, 810]
    path = shim_pythonpath({"PYTHONPATH": "/a"})
    assert path == f"{SHIM_DIR}{os.pathsep}/a"  # no real determined package in the test environment


def test_wrap_rank_refuses_an_empty_script_a_negative_rank_and_an_unset_rank_variable(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        wrap_rank.main(["0", "--"])
    assert exited.value.code == 2 and "error: empty script is not allowed" in capsys.readouterr().err
    monkeypatch.delenv("TOOLKIT_TEST_NO_RANK", raising=False)
    assert wrap_rank.main(["TOOLKIT_TEST_NO_RANK", "--", "true"]) == 1
    assert capsys.readouterr().err == ("rank environment variable is set to TOOLKIT_TEST_NO_RANK, but it is "
                                       "not in os.environ\n")
    with pytest.raises(SystemExit) as exited:  # the shim's command line is this main (checked below)
        wrap_rank.main(["-1", "--", "true"])
    assert exited.value.code == 2 and "RANK='-1'" in capsys.readouterr().err


def test_wrap_rank_passes_signals_on_also_those_received_before_the_command_started():
    previous = {name: signal.getsignal(getattr(signal, name)) for name in wrap_rank._FORWARDED}
    proc = None
    try:
        passthru = wrap_rank._Passthru()
        os.kill(os.getpid(), signal.SIGUSR1)  # before the command exists: kept
        assert passthru.pending == [signal.SIGUSR1]
        proc = subprocess.Popen(["sleep", "30"])
        passthru.attach(proc)
        assert proc.wait(timeout=10) == -signal.SIGUSR1
        passthru = wrap_rank._Passthru()
        proc = subprocess.Popen(["sleep", "30"])
        passthru.attach(proc)
        passthru(signal.SIGTERM, None)  # the handler, as a signal calls it: straight to the command
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_real_determined_package_is_used_instead_of_the_shim(tmp_path, monkeypatch):
    (tmp_path / "determined").mkdir()
    (tmp_path / "determined" / "__init__.py").write_text("")  # stands for an installed determined
    monkeypatch.delitem(sys.modules, "determined", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert shim_pythonpath({"PYTHONPATH": "/a"}) is None
    monkeypatch.syspath_prepend(str(SHIM_DIR))  # the shim itself found first: still the shim
    assert shim_pythonpath({"PYTHONPATH": f"/a{os.pathsep}{SHIM_DIR}"}) == f"{SHIM_DIR}{os.pathsep}/a"


def test_wrap_rank_through_the_shim_prefixes_lines_passes_the_status_and_marks_the_worker():
    env = procutil.child_env(PYTHONPATH=shim_pythonpath(os.environ) + os.pathsep + str(procutil.REPO), R="4")
    code = f"import os,sys; print('out'); print(os.environ['{WRAPPED_ENV}'], file=sys.stderr); sys.exit(3)"
    argv = [sys.executable, "-m", "determined.launch.wrap_rank", "R", "--", sys.executable, "-c", code]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (3, "[rank=4] out\n", "[rank=4] 4\n")
    for forgot in ("import determined as det; det.get_cluster_info()", "from determined import core"):
        result = subprocess.run([sys.executable, "-c", forgot], env=env, capture_output=True, text=True,
                                timeout=60)
        assert "ImportError" in result.stderr, result.stderr
        assert "from toolkit.compat import determined as det" in result.stderr


def test_signals_reach_the_wrapped_workers_not_their_launcher():
    rank = b"LOCAL_RANK=0\0RANK=0"
    table = {
        10: (1, b"X=1"),  # torchrun
        11: (10, rank),  # an ordinary rank
        12: (11, rank),  # its DataLoader worker
        20: (10, rank),  # a self-launching script
        21: (20, rank),  # its wrap_rank
        22: (21, rank + f"\0{WRAPPED_ENV}=1".encode()),  # the wrapped worker
        23: (22, rank + f"\0{WRAPPED_ENV}=1".encode()),  # what the worker started
    }
    assert signal_targets(table, set(table)) == [11, 12, 22, 23]


def _start(argv, **env):
    return subprocess.Popen(argv, env=procutil.child_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc, timeout=240):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"timed out:\n{proc.communicate(timeout=30)[0][-4000:]}") from None
    return proc.returncode, out


def test_a_self_launching_script_runs_preempts_and_resumes_on_two_ranks(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "det_launcher.py").write_text((procutil.WORKERS / "det_launcher.py").read_text())
    (model / "exp.yaml").write_text(YAML)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "toolkit.run", str(model / "exp.yaml"), str(model), "--output-dir",
            str(out)]
    proc = _start(argv, DET_TEST_STEP_SLEEP="0.2")
    deadline = time.monotonic() + 180
    while not (out / storage.REGISTRY_NAME).exists() or not storage.read_registry(out)["committed"]:
        assert proc.poll() is None and time.monotonic() < deadline, _finish(proc)[1][-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    rc, log = _finish(proc)
    assert rc == 0, log[-4000:]  # the launcher waited for its workers, which saved and exited 0
    assert "[rank=1]" in log and "world size 2" in log  # both workers, one process group
    stopped = {(out / f"preempted-{r}").read_text() for r in (0, 1)}
    assert len(stopped) == 1 and int(stopped.pop()) < 40 and not (out / "final.json").exists()
    state = json.loads((out / "determined_trial.json").read_text())
    rc, log = _finish(_start(argv))
    assert rc == 0, log[-4000:]
    final = json.loads((out / "final.json").read_text())
    inc = state["hparams"]["increment_by"]
    assert 1 <= inc <= 8 and final["hparams"]["increment_by"] == inc  # sampled once, kept by the rerun
    assert final["x"] == 2 * inc * 40 and final["trial_id"] == state["trial_id"]  # resumed exactly
    assert not find_trial_processes(str(out), variable="TOOLKIT_OUTPUT_DIR")
