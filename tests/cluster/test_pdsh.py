"""The real pdsh and ssh (pdsh 2.34, OpenSSH 9.2 on Debian 12) against an sshd on a loopback port
(conftest.py): DeepSpeed's pdsh runner starts a dsat trial "on another host", and a trial's
timeout stops it there through ``pdsh ... pkill`` (issue 16).

The host is ``localhost``, which dsat would start locally; ``is_local_host`` is patched to say
no, so the trial takes the path of a remote host: DeepSpeed's runner -> pdsh -> ssh -> sshd ->
``deepspeed.launcher.launch`` -> the ranks.
"""

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path
from unittest import mock

from hostprocs import pid_alive

from helpers import procutil
from toolkit.dsat.contract import TrialStatus
from toolkit.launch import slots as slots_module
from toolkit.launch.hosts import Host
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.search.types import TrialSpec
from toolkit.launch.procs import find_trial_processes, kill_until_gone


def test_pdsh_runs_a_command_on_both_loopback_names(sshd):
    result = subprocess.run(["pdsh", "-R", "ssh", "-w", "127.0.0.1,localhost", "echo %n"],
                            env=sshd.env(procutil.child_env()), capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["127.0.0.1: 0", "localhost: 1"]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


def test_dsat_trial_through_pdsh_and_ssh_and_its_timeout(sshd, tmp_path):
    out = tmp_path / "out"
    settings = RunnerSettings(entrypoint=("python3", "dsat_fake_trial.py"), model_dir=procutil.WORKERS,
                              slots_per_trial=2, max_slots=2, max_concurrent=1, timeout_s=120, grace_s=3,
                              poll_s=0.1, hosts=(Host("localhost", 2),), multihost_launcher="pdsh")
    try:
        with mock.patch.dict(os.environ, sshd.env(procutil.child_env()), clear=True), \
                mock.patch.object(slots_module, "is_local_host", lambda name: False):
            with TrialRunner(settings, output_dir=out) as runner:
                runner.start(TrialSpec(1, 1, {"stage": 1}, line=0), ds_config={}, hparams={"behaviour": "ok"})
                (ok,) = runner.wait(timeout=200)
            hang = dataclasses.replace(settings, timeout_s=3)
            with TrialRunner(hang, output_dir=out) as runner:
                runner.start(TrialSpec(2, 1, {"stage": 1}, line=0), ds_config={},
                             hparams={"behaviour": "hang"})
                # the timeout counts only in wait(): let both ranks start first (the runner takes 5-15 s)
                wait_for(lambda: len(list((out / "trials" / "trial_2").glob("rank*.json"))) == 2, 200,
                         "both ranks of the hanging trial")
                (hung,) = runner.wait(timeout=200)
    finally:  # ranks started through ssh do not carry the test session's mark: never leave one
        def leftovers(table):
            return find_trial_processes(f"{out / 'trials'}{os.sep}", prefix=True, table=table)

        kill_until_gone(leftovers, grace_s=2.0, what="pdsh test leftovers")
    trial = out / "trials" / "trial_1"
    record = _read(trial / "placement.json")
    assert ok.status is TrialStatus.OK, f"{ok.error}\n{(trial / 'trial.log').read_text()[-3000:]}"
    assert record["launch"] == "pdsh" and record["argv"][2] == "toolkit.dsat.execution.pdsh_launch"
    ranks = [_read(f) for f in sorted(trial.glob("rank*.json"))]
    assert len(ranks) == 2 and all(r["env"]["TOOLKIT_DSAT_TRIAL"] == str(trial / "trial.json") for r in ranks)
    assert hung.status is TrialStatus.TIMEOUT, hung.error
    pids = [_read(f)["pid"] for f in (out / "trials" / "trial_2").glob("rank*.json")]
    assert len(pids) == 2 and not [pid for pid in pids if pid_alive(pid)]
    assert not find_trial_processes(f"{out / 'trials'}{os.sep}", prefix=True)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())
