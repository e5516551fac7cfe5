"""toolkit.dsat.trial.session: the end of a trial. After the result is written the heap is frozen
(gc.freeze), so the interpreter's last collections skip it; the loop's finally blocks, atexit
handlers and the exit status are those of a plain ``SystemExit(0)``.

One trial process without DeepSpeed (a stand-in engine, as in test_session.py): a real engine's
start would cost seconds and the exit path does not depend on it.
"""

import json
import subprocess
import sys
import textwrap

from helpers import procutil

TRIAL = textwrap.dedent("""
    import atexit, gc, sys
    from toolkit.dsat.trial.session import TrialSession

    class Engine:
        device = "cpu"
        def forward(self, x):
            return x
        def backward(self, loss):
            return None
        def train_micro_batch_size_per_gpu(self):
            return 4
        dp_world_size = 1

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


def test_a_trial_ends_with_its_heap_frozen_and_its_cleanup_run(tmp_path):
    path = tmp_path / "trial.json"
    path.write_text(json.dumps({"trial_id": 7, "result_path": str(tmp_path / "result.json"),
                                "start_profile_step": 1, "end_profile_step": 2}))
    proc = subprocess.run([sys.executable, "-c", TRIAL, str(path)], env=procutil.child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok" and result["timed_steps"] == 2, result
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("finally:", "atexit:", "after"))]
    assert lines == ["finally: ran after step 2 frozen before 0", "atexit: frozen True"], proc.stdout
