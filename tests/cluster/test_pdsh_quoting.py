"""No shell on the remote side (issue 30): a dsat trial through the real pdsh, ssh and sshd on
loopback (conftest.py), with shell syntax in its entrypoint's arguments, its model directory and
its output directory. The script must receive its arguments exactly, and nothing else may run.

As in test_pdsh.py, ``is_local_host`` is patched to say no for ``localhost``, so the trial takes
the remote path: dsat's pdsh runner -> pdsh -> ssh -> sshd -> the login shell ->
``deepspeed.launcher.launch`` -> the ranks. Before the fix, DeepSpeed's runner joined these words
unquoted into the remote line: ``;`` ended the command there, ``$(...)`` and backquotes ran.
"""

import json
import os
import shutil
import uuid
from pathlib import Path
from unittest import mock

from helpers import procutil
from toolkit.dsat.contract import TrialStatus
from toolkit.launch import slots as slots_module
from toolkit.launch.hosts import Host
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.search.types import TrialSpec
from toolkit.launch.procs import find_trial_processes, kill_until_gone


def test_shell_syntax_in_a_remote_trial_arrives_as_literal_arguments(sshd, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    touched = {name: markers / name for name in ("semicolon", "dollar", "backquote", "newline")}
    args = (f"--note=a;touch${{IFS}}{touched['semicolon']}", f"$(touch {touched['dollar']})",
            f"`touch {touched['backquote']}`", "two words", "it's \"quoted\"", "100%h %n %%",
            f"x\ntouch {touched['newline']}", "*", "~", "a|b&c>d<e")
    # a file name holds no '/': these markers would land in the remote shell's directory (root's home)
    stray = f"toolkit-pdsh-quoting-{uuid.uuid4().hex[:12]}"
    model_dir = tmp_path / f"model dir;$(touch {stray}-cwd)"
    model_dir.mkdir()
    shutil.copy(procutil.WORKERS / "dsat_fake_trial.py", model_dir)
    out = tmp_path / f"out `touch {stray}-out`"
    settings = RunnerSettings(entrypoint=("python3", "dsat_fake_trial.py", *args), model_dir=model_dir,
                              slots_per_trial=1, max_slots=1, max_concurrent=1, timeout_s=120, grace_s=3,
                              poll_s=0.1, hosts=(Host("localhost", 1),), multihost_launcher="pdsh")
    try:
        with mock.patch.dict(os.environ, sshd.env(procutil.child_env()), clear=True), \
                mock.patch.object(slots_module, "is_local_host", lambda name: False):
            with TrialRunner(settings, output_dir=out) as runner:
                runner.start(TrialSpec(1, 1, {"stage": 1}, line=0), ds_config={}, hparams={"behaviour": "ok"})
                (result,) = runner.wait(timeout=200)
    finally:  # ranks started through ssh do not carry the test session's mark: never leave one
        def leftovers(table):
            return find_trial_processes(f"{out / 'trials'}{os.sep}", prefix=True, table=table)

        kill_until_gone(leftovers, grace_s=2.0, what="pdsh quoting test leftovers")
    trial = out / "trials" / "trial_1"
    assert result.status is TrialStatus.OK, f"{result.error}\n{(trial / 'trial.log').read_text()[-3000:]}"
    assert json.loads((trial / "placement.json").read_text())["launch"] == "pdsh"
    (rank,) = [json.loads(f.read_text()) for f in trial.glob("rank*.json")]
    assert rank["argv"][1:] == list(args)
    assert rank["cwd"] == str(model_dir)
    assert rank["env"]["TOOLKIT_DSAT_TRIAL"] == str(trial / "trial.json")
    assert sorted(os.listdir(markers)) == []
    homes = {Path.home(), Path("~root").expanduser(), model_dir, tmp_path}
    assert not [f for home in homes for f in home.glob(f"{stray}*")]
