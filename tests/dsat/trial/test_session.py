"""toolkit.dsat.trial.session: a contract a trial cannot run by, and a step that fails (an error
propagates and the step is abandoned; an out-of-memory error ends the trial as ``"oom"``), and the
end of a trial (the heap frozen, the loop's cleanup run)."""

import json
import subprocess
import sys
import textwrap

import pytest

from helpers import procutil
from toolkit.dsat.contract import OOM_EXIT_STATUS
from toolkit.dsat.trial.session import read_contract
from toolkit.errors import LaunchEnvError


def contract(tmp_path, **fields):
    path = tmp_path / "trial.json"
    path.write_text(json.dumps({"trial_id": 7, "result_path": str(tmp_path / "result.json"),
                                "start_profile_step": 1, "end_profile_step": 2, **fields}))
    return path


@pytest.mark.parametrize("fields, message", [
    ({"start_profile_step": 0}, r"start_profile_step=0, end_profile_step=2; expected 1 <= start <= end"),
    ({"start_profile_step": 3}, r"start_profile_step=3, end_profile_step=2; expected 1 <= start <= end"),
    ({"timed_window_s": -1.0}, r"timed_window_s=-1.0, .*expected a window >= 0 s"),
    ({"last_profile_step": 1},
     r"timed_window_s=0.0, last_profile_step=1; expected a window >= 0 s and None or a last step >= 2"),
])
def test_a_contract_the_trial_cannot_run_by_names_its_fields(tmp_path, fields, message):
    path = contract(tmp_path, **fields)
    with pytest.raises(LaunchEnvError, match=rf"trial contract {path}: {message}"):
        read_contract(str(path))


def test_an_unreadable_contract_names_the_variable_and_the_fix(tmp_path):
    with pytest.raises(LaunchEnvError, match=r"TOOLKIT_DSAT_TRIAL='.*missing.json': cannot read the trial "
                                             r"contract .*unset it to run outside a trial"):
        read_contract(str(tmp_path / "missing.json"))


# Trial processes without DeepSpeed: the engine is a stand-in (a step's failure never reaches it,
# the exit path does not depend on it, and a real engine's start would cost seconds).
ENGINE = textwrap.dedent("""
    import sys
    from toolkit.dsat.trial.session import TrialSession

    class Engine:
        device = "cpu"
        dp_world_size = 1
        def forward(self, x):
            return x
        def backward(self, loss):
            return None
        def train_micro_batch_size_per_gpu(self):
            return 4
""")

# The OOM is raised by hand (no GPU here).
OOM_TRIAL = ENGINE + textwrap.dedent("""
    import torch

    session = TrialSession(Engine(), sys.argv[1])
    with session.step(0):
        session.engine.forward(1)
    try:
        with session.step(1):  # a timed step
            raise ValueError("a bug in the step")
    except ValueError:
        pass
    assert session.timing is False and session.step_s == [], "the failed step was timed"
    assert session.finished is False
    with session.step(2):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\\n(mocked)")
    print("after the OOM")
""")

# After the result is written the heap is frozen (gc.freeze), so the interpreter's last collections
# skip it; the loop's finally blocks, atexit handlers and the exit status are a plain SystemExit(0)'s.
EXIT_TRIAL = ENGINE + textwrap.dedent("""
    import atexit, gc

    atexit.register(lambda: print("atexit: frozen", gc.get_freeze_count() > 0, flush=True))
    session = TrialSession(Engine(), sys.argv[1])
    frozen_before = gc.get_freeze_count()
    try:
        for step in range(10):
            with session.step(step):
                session.engine.forward(1)
                session.engine.backward(1)
    finally:
        print("finally: ran after step", step, "frozen before", frozen_before, flush=True)
    print("after the loop")
""")


def run_trial(code, path):
    return subprocess.run([sys.executable, "-c", code, str(path)], env=procutil.child_env(),
                          capture_output=True, text=True, timeout=120)


def test_an_oom_in_a_step_ends_the_process_with_an_oom_result_and_other_errors_propagate(tmp_path):
    path = contract(tmp_path)
    proc = run_trial(OOM_TRIAL, path)
    assert proc.returncode == OOM_EXIT_STATUS, proc.stderr[-3000:]
    assert "after the OOM" not in proc.stdout
    assert "dsat trial 7 ran out of memory on rank 0: CUDA out of memory. Tried to allocate 2.00 GiB " \
           "(mocked)" in proc.stderr
    assert json.loads((tmp_path / "result.json").read_text()) == {
        "trial_id": 7, "status": "oom", "metrics": {}, "profile": None,
        "error": "CUDA out of memory. Tried to allocate 2.00 GiB (mocked)"}


def test_a_trial_ends_with_its_heap_frozen_and_its_cleanup_run(tmp_path):
    proc = run_trial(EXIT_TRIAL, contract(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok" and result["timed_steps"] == 2, result
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("finally:", "atexit:", "after"))]
    assert lines == ["finally: ran after step 2 frozen before 0", "atexit: frozen True"], proc.stdout
