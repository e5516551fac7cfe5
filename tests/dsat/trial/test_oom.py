"""toolkit.dsat.trial.oom: the out-of-memory excepthook is installed explicitly, never on import."""

import json
import subprocess
import sys
import textwrap

from helpers import procutil

SCRIPT = textwrap.dedent("""
    import sys
    import toolkit
    from toolkit.runtime.trial_oom import install_oom_excepthook
    assert sys.excepthook is sys.__excepthook__, "importing toolkit installed a hook"
    assert install_oom_excepthook() is {in_trial}
    hook = sys.excepthook
    assert (hook is not sys.__excepthook__) is {in_trial}
    install_oom_excepthook()
    assert sys.excepthook is hook, "a second call installed another hook"
    import torch
    raise torch.cuda.OutOfMemoryError("CUDA out of memory (mocked)")
""")


def run(tmp_path, *, in_trial):
    env = procutil.child_env()
    env.pop("TOOLKIT_DSAT_TRIAL", None)
    result = tmp_path / "result.json"
    if in_trial:
        contract = tmp_path / "trial.json"
        contract.write_text(json.dumps({"trial_id": 7, "result_path": str(result), "start_profile_step": 1,
                                        "end_profile_step": 2}))
        env["TOOLKIT_DSAT_TRIAL"] = str(contract)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(in_trial=in_trial)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, result


def test_in_a_trial_the_hook_reports_an_uncaught_oom(tmp_path):
    proc, result = run(tmp_path, in_trial=True)
    assert proc.returncode == 1 and "OutOfMemoryError" in proc.stderr  # the traceback still printed
    written = json.loads(result.read_text())
    assert written == {"trial_id": 7, "status": "oom", "metrics": {}, "profile": None,
                       "error": "CUDA out of memory (mocked)"}


def test_outside_a_trial_nothing_is_installed(tmp_path):
    proc, result = run(tmp_path, in_trial=False)
    assert proc.returncode == 1 and "OutOfMemoryError" in proc.stderr and "AssertionError" not in proc.stderr
    assert not result.exists()
