"""One trial of python -m toolkit.run (toolkit.run.trial): a damaged stop record, recorded values of
another search space, a run failing past max_restarts and one stopped by a signal, with real runs of a
small script (one process each)."""

import json
import logging
import signal
import sys
import threading
import time

from toolkit.checkpoint.stop_record import STOP_FILE
from toolkit.launch.trial_files import record_hparams
from toolkit.run import plan_run
from toolkit.run.process import Forwarder
from toolkit.run.trial import LOGS_DIR, execute, stop_record_of


def _plan(tmp_path, script, **config):
    (tmp_path / "script.py").write_text(script)
    config = {"entrypoint": f"{sys.executable} script.py", "resources": {"slots_per_trial": 1}, **config}
    return plan_run(config, config_path=tmp_path / "x.yaml", model_dir=tmp_path, output_dir=tmp_path / "out")


def test_a_damaged_stop_record_is_logged_and_counts_as_none(tmp_path, caplog):
    assert stop_record_of(tmp_path) is None  # none left
    (tmp_path / STOP_FILE).write_text(json.dumps({"format": 1, "state": "preempted"}))
    with caplog.at_level(logging.ERROR, logger="toolkit.run"):
        assert stop_record_of(tmp_path) is None
    assert f"{tmp_path / STOP_FILE}: " in caplog.text
    assert "the stop record is damaged, delete it" in caplog.text


def test_values_of_another_search_space_exit_2_before_any_run(tmp_path, caplog):
    plan = _plan(tmp_path, "raise SystemExit('must not run')",
                 hyperparameters={"n": {"type": "int", "minval": 1, "maxval": 4}})
    plan.output_dir.mkdir()
    other = {"hyperparameters": {"n": {"type": "int", "minval": 1, "maxval": 9}}}
    record_hparams(plan.output_dir, other, seed=1)
    with caplog.at_level(logging.ERROR, logger="toolkit.run"):
        assert execute(plan, forwarder=Forwarder(install=False)) == 2
    assert "holds hyperparameters sampled from another search space" in caplog.text
    assert not (plan.output_dir / LOGS_DIR).exists()  # no run started


def test_a_failed_run_is_not_restarted_past_max_restarts(tmp_path, caplog):
    plan = _plan(tmp_path, "import sys\nopen('runs', 'a').write('run\\n')\nsys.exit(3)\n", max_restarts=0)
    with caplog.at_level(logging.ERROR, logger="toolkit.run"):
        assert execute(plan, grace_s=5.0, forwarder=Forwarder(install=False), echo=False) == 1  # torchrun's
    assert (tmp_path / "runs").read_text() == "run\n"  # once
    assert "the run failed with exit status 1; its last lines" in caplog.text
    assert "exitcode  : 3" in caplog.text and caplog.text.rstrip().endswith("; max_restarts=0 reached")


def test_a_run_stopped_by_a_signal_says_how_to_continue(tmp_path, caplog):
    started = tmp_path / "started"
    plan = _plan(tmp_path, f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)\n",
                 max_restarts=3)
    forwarder = Forwarder(install=False)

    def stop_once_started():
        end = time.monotonic() + 60
        while not started.exists() and time.monotonic() < end:
            time.sleep(0.02)
        forwarder.handle(signal.SIGTERM)  # as the runner's handler does

    stopper = threading.Thread(target=stop_once_started)
    stopper.start()
    try:
        with caplog.at_level(logging.INFO, logger="toolkit.run"):
            status = execute(plan, grace_s=5.0, forwarder=forwarder, echo=False)
    finally:
        stopper.join(timeout=70)
    assert status != 0 and forwarder.received == signal.SIGTERM
    assert (f"stopped by SIGTERM (exit status {status}); run the same command again to continue from the "
            "latest checkpoint") in caplog.text
    assert "restart 1 of 3" not in caplog.text  # a stop is not a failure to restart
