"""The stop record (toolkit/checkpoint/stop_record.py, issue 41): what a run that stopped for a
preemption leaves for a scheduler, and who reads it (``python -m toolkit.run``, dsat).

Written by real ranks after a real stop in tests/test_preemption.py (the checkpoint directory's
record under the deepspeed launcher, TOOLKIT_STOP_RECORD under torchrun); here its content, the
moments it is written and removed, and its readers, with plain processes.
"""

import json
import sys
import time

import pytest

import toolkit.preemption
from toolkit.checkpoint import lock, stop_record
from toolkit.checkpoint.stop_record import STOP_FILE, STOP_RECORD_ENV, StopRecord, read_stop_record
from toolkit.dsat.execution.classify import TrialPreempted, preemption_of
from toolkit.errors import CheckpointError
from toolkit.preemption import AgreedStop
from toolkit.run import plan_run
from toolkit.run.process import Forwarder
from toolkit.run.search_state import SearchState, TrialRecord
from toolkit.run.trial import execute
from toolkit.run.trial_reports import finish_trial


@pytest.fixture
def process_state(monkeypatch):
    """This process's commits and locks start empty; a stop is agreed only where a test says so."""
    monkeypatch.setattr(stop_record, "_commits", {})
    monkeypatch.setattr(stop_record, "_last_commit", None)
    monkeypatch.setattr(lock, "_held", {})
    monkeypatch.setattr(toolkit.preemption, "_last_stop", None)
    monkeypatch.delenv(STOP_RECORD_ENV, raising=False)


def test_the_record_round_trips_and_a_damaged_one_is_named(tmp_path):
    record = StopRecord(cause="SIGTERM", steps_completed=12, tag="step_12", checkpoint_dir="/c", run_id="r1",
                        stopped_at=1.5, host="h", pid=7)
    data = record.to_json()
    assert data["state"] == "preempted" and data["resumable"] is True and data["format"] == 1
    assert StopRecord.from_json(json.loads(json.dumps(data))) == record
    assert not StopRecord.from_json({**data, "tag": None, "steps_completed": None}).resumable
    for bad, match in (({"state": "finished"}, "not a stop record"), ({"steps_completed": "12"}, "whole"),
                       ({"pid": True}, "whole number"), ({"tag": 3}, "string"),
                       ({"stopped_at": None}, "time")):
        with pytest.raises(ValueError, match=match):
            StopRecord.from_json({**data, **bad})
    assert read_stop_record(tmp_path) is None
    (tmp_path / STOP_FILE).write_text(json.dumps({**data, "pid": "x"}))
    with pytest.raises(CheckpointError, match=f"{STOP_FILE}: pid='x'.*delete it"):
        read_stop_record(tmp_path)


def test_written_after_a_stop_last_and_removed_by_later_progress(tmp_path, monkeypatch, process_state):
    root, extra = tmp_path / "ckpt", tmp_path / "runner" / "stop.json"
    root.mkdir()
    extra.parent.mkdir()
    monkeypatch.setenv(STOP_RECORD_ENV, str(extra))
    stop_record.note_commit(str(root), "step_3", 3, "run-a")  # no stop agreed: a periodic save
    assert read_stop_record(root) is None and not extra.exists()
    monkeypatch.setattr(toolkit.preemption, "_last_stop", AgreedStop(cause="SIGUSR1", at=time.time()))
    stop_record.note_commit(str(root), "step_5", 5, "run-a")  # the stop's save: the record, after the commit
    for record in (read_stop_record(root), read_stop_record(extra)):
        assert (record.steps_completed, record.tag, record.run_id) == (5, "step_5", "run-a")
        assert record.cause == "SIGUSR1" and record.resumable
    stop_record.record_agreed_stop()  # the watcher's close after the save: the same record again
    assert read_stop_record(root).tag == "step_5"
    monkeypatch.setattr(toolkit.preemption, "_last_stop", None)  # the next run's process
    stop_record.note_commit(str(root), "step_6", 6, "run-a")
    assert read_stop_record(root) is None


def test_after_a_stop_without_a_save_the_record_names_no_checkpoint(tmp_path, monkeypatch, process_state):
    extra = tmp_path / "stop.json"
    monkeypatch.setenv(STOP_RECORD_ENV, str(extra))
    stop = AgreedStop(cause="a launcher exited", at=time.time())
    monkeypatch.setattr(toolkit.preemption, "_last_stop", stop)
    stop_record.record_agreed_stop()
    record = read_stop_record(extra)
    assert record.cause == "a launcher exited" and not record.resumable and record.checkpoint_dir is None


def test_dsat_does_not_count_a_preempted_trial_as_a_failed_config(tmp_path, monkeypatch):
    """A trial whose ranks wrote the stop record and no result: not a result at all. The runner
    raises TrialPreempted, which dsat's CLI handles as an interruption (exit 130, --resume)."""
    from helpers import procutil
    from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
    from toolkit.dsat.search.types import TrialSpec

    trial = tmp_path / "t"
    trial.mkdir()
    assert preemption_of(trial) is None
    (trial / STOP_FILE).write_text("[]")
    assert "damaged" in preemption_of(trial)
    (trial / "result.json").write_text("{}")
    assert preemption_of(trial) is None  # a result was written first: it stands

    procutil.clean_launch_env(monkeypatch)
    settings = RunnerSettings(entrypoint=("python3", "dsat_fake_trial.py"), model_dir=procutil.WORKERS,
                              slots_per_trial=1, max_slots=1, max_concurrent=1, timeout_s=120.0, grace_s=2.0,
                              poll_s=0.1)
    with TrialRunner(settings, output_dir=tmp_path / "out") as runner:
        runner.start(TrialSpec(0, 1, {"stage": 1}, line=0), ds_config={"train_micro_batch_size_per_gpu": 1},
                     hparams={"behaviour": "preempted"})
        with pytest.raises(TrialPreempted, match=r"trial .* stopped for a preemption \(SIGTERM\)"):
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline:
                assert runner.wait(timeout=5) == []
        assert runner.running() == 0


# An entrypoint whose one rank stops for a preemption: it writes the stop record where toolkit.run
# says (TOOLKIT_STOP_RECORD) and exits 1, as torchrun does after its own SIGTERM.
RANK = """
import json, os, sys, time
runs = os.path.join(os.environ["TOOLKIT_OUTPUT_DIR"], "runs")
open(runs, "a").write("run\\n")
json.dump({"format": 1, "state": "preempted", "resumable": True, "cause": "SIGTERM", "steps_completed": 4,
           "tag": "step_4", "checkpoint_dir": "/c", "run_id": "r", "stopped_at": time.time(), "host": "h",
           "pid": os.getpid()}, open(os.environ["TOOLKIT_STOP_RECORD"], "w"))
sys.exit(1)
"""


def test_toolkit_run_does_not_restart_a_preempted_run_and_its_search_pauses_the_trial(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    config = {"entrypoint": f"{sys.executable} rank.py", "max_restarts": 3,
              "resources": {"slots_per_trial": 1}}
    plan = plan_run(config, config_path=tmp_path / "x.yaml", model_dir=tmp_path, output_dir=tmp_path / "out")
    assert execute(plan, grace_s=5.0, forwarder=Forwarder(install=False)) == 0  # a clean stop, not a failure
    assert (tmp_path / "out" / "runs").read_text() == "run\n"  # not restarted
    assert read_stop_record(tmp_path / "out" / STOP_FILE).steps_completed == 4

    class Watcher:
        def finish(self, *, stop_sent):
            pass

    trial = TrialRecord(index=0, hparams={}, state="RUNNING")
    state = SearchState(searcher="random", seed=1, trials=[trial])
    finish_trial(state, trial, Watcher(), Forwarder(install=False), 0, tmp_path / "out")
    assert trial.state == "PAUSED" and not trial.stopped_early
