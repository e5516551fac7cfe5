"""A running dsat trial as the runner shows it (toolkit.dsat.execution.watch): its phase from the
chief's progress note, a heartbeat against its timeout, its peak memory, its labelled lines; one
real 2-rank DeepSpeed trial (tests/workers/dsat_train.py) under the runner carries the real checks."""

import json
import logging

import pytest

from helpers import procutil
from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.execution.watch import heartbeat_text, peak_bytes, phase
from toolkit.dsat.search.types import TrialResult, TrialSpec

GIB = 2**30


def test_the_phase_follows_the_chiefs_note_and_the_heartbeat_names_trial_config_and_time():
    assert phase(None) == phase({"step": "x"}) == "starting (no training step yet)"
    assert phase({"step": 1, "timed": 0, "to_time": 3}) == "warming up (1 step done)"
    assert phase({"step": 4, "timed": 2, "to_time": 3}) == "timing step 3 of 3"
    assert phase({"step": 6, "timed": 3, "to_time": 3}) == "timed 3 steps, reporting"
    spec = TrialSpec(-1, 16, {"stage": 3}, profile=True, label="p2")
    note = {"step": 4, "timed": 1, "to_time": 3}
    assert heartbeat_text(spec, elapsed_s=40.4, timeout_s=600, progress=note) \
        == "trial p2 (stage 3, mb 16): timing step 2 of 3 | 40 s of 600 s"


def test_a_trials_peak_is_the_largest_seen_and_survives_the_event_log():
    assert peak_bytes(5, {"peak_bytes": 9}, None) == 9
    assert peak_bytes(0, {"peak_bytes": "x"}, {"peak_bytes": 0}) is None
    result = TrialResult(TrialSpec(3, 4, {"stage": 1}), TrialStatus.OOM, peak_bytes=7 * GIB)
    assert TrialResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    assert "peak_bytes" not in TrialResult(TrialSpec(3, 4, {"stage": 1}), TrialStatus.OOM).to_json()
    from toolkit.dsat.output_files import event_problem

    event = {"event": "result", "trial_id": 3, "result": {**result.to_json(), "peak_bytes": -1}}
    assert event_problem(event) == "peak_bytes=-1: expected an integer >= 0 or null"


def test_the_default_heartbeat_gives_a_60_s_trial_two_lines_at_least():
    settings = RunnerSettings(entrypoint=("python3", "t.py"), model_dir=procutil.WORKERS, slots_per_trial=1,
                              max_slots=1, max_concurrent=1, timeout_s=600)
    assert 60 // settings.heartbeat_s >= 2 and settings.echo


@pytest.mark.slow
def test_a_real_trial_beats_with_its_phases_and_leaves_its_labelled_logs_and_peak(
        tmp_path, monkeypatch, caplog, capsys):
    procutil.clean_launch_env(monkeypatch)
    settings = RunnerSettings(entrypoint=("python3", "dsat_train.py"), model_dir=procutil.WORKERS,
                              slots_per_trial=2, max_slots=2, max_concurrent=1, timeout_s=240,
                              memory_per_slot=8 * GIB, start_profile_step=3, end_profile_step=5,
                              timed_window_s=0.0, heartbeat_s=1.0)
    spec = TrialSpec(5, 2, {"stage": 2}, line=0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    caplog.set_level(logging.INFO, logger="toolkit.dsat.execution.runner")
    with TrialRunner(settings, output_dir=tmp_path) as runner:  # steps of 0.4 s: several beats while timing
        runner.start(spec, ds_config=config, hparams={"deepspeed_config": "x.json", "sleep_step_ms": 400,
                                                       "steps": 8})
        results = []
        while not results:
            results = runner.wait(timeout=300)
    result, = results
    assert result.status is TrialStatus.OK, result.error
    beats = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trial 5 (stage 2, mb 2): ")]
    assert len(beats) >= 2 and all(b.endswith(" of 240 s") for b in beats), beats
    assert any("warming up" in b or "timing step" in b for b in beats), beats   # the chief's real notes
    trial = tmp_path / "trials" / "trial_5"
    note = json.loads((trial / "progress.json").read_text())   # written after the last step
    assert (note["step"], note["timed"], note["to_time"]) == (6, 3, 3) and note["peak_bytes"] > 0
    assert result.peak_bytes >= note["peak_bytes"]
    log = (trial / "trial.log").read_text()
    assert "[rank 0] " in log and "[rank 1] " in log
    assert len(list((trial / "ranks").rglob("stdout.log"))) == 2
    shown = [line for line in capsys.readouterr().out.splitlines() if "rank" in line]
    assert shown and all(line.startswith(("[trial 5 rank 0] ", "[trial 5 rank 1] ")) for line in shown), shown
