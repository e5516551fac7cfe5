"""Limits and ranking (issue 30 items 4-5): slot counts checked against this machine, restarts
with a bounded backoff, and a NaN or infinite metric that never ranks best. Pure functions and
the CLIs in this process (bad input launches nothing); no subprocess."""

import json
import math
import os
import signal
import threading
import time

import pytest
import yaml

from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.execution.settings import RunnerSettings
from toolkit.dsat.search import best_result
from toolkit.dsat.search.types import TrialResult, TrialSpec, is_better
from toolkit.errors import ConfigError
from toolkit.launch.procs import cpu_slots
from toolkit.run import plan_run, process, searchers, trial
from toolkit.run.search_state import SearchState, TrialRecord

CATEGORY = "security"
NON_FINITE = [math.nan, math.inf, -math.inf]
CPU_PROBLEM = (f"resources.slots_per_trial=100000: a trial on CPU runs one process per slot and this machine "
               f"has {cpu_slots()} CPU core(s); expected at most {cpu_slots()}")
GRID = {"searcher": {"name": "grid", "metric": "loss", "max_trials": 4},
        "hyperparameters": {"lr": {"type": "categorical", "vals": [1, 2, 3, 4]}}}


# -- a NaN or infinite metric never ranks best --------------------------------------------------

@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("smaller", [True, False])
def test_a_grid_search_never_ranks_a_non_finite_metric_best(bad, smaller):
    config = dict(GRID, searcher=dict(GRID["searcher"], smaller_is_better=smaller))
    state = SearchState(searcher="grid", seed=1, trials=[
        TrialRecord(index=i, hparams={}, state="COMPLETED", metric=m)
        for i, m in enumerate([bad, 2.0, bad, 1.0, bad])])
    assert searchers.best_trial(state, config).index == (3 if smaller else 1)
    state.trials = [t for t in state.trials if t.metric is bad]
    assert searchers.best_trial(state, config) is None


@pytest.mark.parametrize("bad", NON_FINITE)
def test_asha_ranks_a_non_finite_metric_last_and_stores_a_finite_number(bad):
    config = {"searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 4, "time_metric": "b",
                           "max_time": 100, "divisor": 2}}
    state = searchers.new_state(config, seed=1)  # rungs [50, 100]
    assert searchers.asha_report(state, 0, time_step=50, metric=5.0, config=config) is False
    assert searchers.asha_report(state, 1, time_step=50, metric=bad, config=config) is True  # stopped: last
    assert searchers.asha_report(state, 2, time_step=50, metric=4.0, config=config) is False
    assert [i for i, _ in state.asha.brackets[0].metrics[0]] == [2, 0, 1]
    assert all(math.isfinite(v) for _, v in state.asha.brackets[0].metrics[0])
    json.dumps(state.to_json(), allow_nan=False)  # the search's record stays strict JSON
    assert searchers.asha_report(state, 3, time_step=math.nan, metric=1.0, config=config) is False
    assert 3 not in state.asha.trial_rung  # a report at no finite time counts nowhere


def test_the_watcher_makes_a_non_finite_metric_null(tmp_path, caplog):
    from toolkit.run.trial_reports import ReportWatcher

    run = TrialRecord(index=0, hparams={})
    lines = [{"group": "validation", "metrics": {"loss": 0.5}},
             {"group": "validation", "metrics": {"loss": "x"}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines)
                                            + '{"group": "validation", "metrics": {"loss": NaN}}\n')
    watcher = ReportWatcher(searchers.new_state(GRID, seed=1), run, GRID, tmp_path, lambda: None)
    watcher.finish(stop_sent=False)
    assert run.metric is None and "'loss'=nan is not finite" in caplog.text


@pytest.mark.parametrize("bad", NON_FINITE)
def test_dsat_never_ranks_a_non_finite_metric_best(bad):
    def result(i, value):
        return TrialResult(TrialSpec(i, 1, {"stage": 1}, line=0), TrialStatus.OK,
                           {"throughput": value, "latency": value})

    results = [result(1, bad), result(2, 3.0), result(3, bad), result(4, 2.0)]
    assert best_result(results, "throughput").spec.trial_id == 2
    assert best_result(results, "latency").spec.trial_id == 4
    assert best_result([result(1, bad)], "latency") is None
    for metric in ("throughput", "latency"):
        assert not is_better(metric, bad, 1.0) and not is_better(metric, bad, None)
        assert is_better(metric, 1.0, bad) and not is_better(metric, bad, bad)


# -- slots against this machine ------------------------------------------------------------------

def test_dsat_settings_refuse_more_cpu_slots_than_cores(tmp_path):
    cores = cpu_slots()
    with pytest.raises(ConfigError) as err:
        RunnerSettings(entrypoint=("python3", "t.py"), model_dir=tmp_path, slots_per_trial=100000,
                       max_slots=100000, max_concurrent=1, timeout_s=60)
    assert CPU_PROBLEM in str(err.value)
    RunnerSettings(entrypoint=("python3", "t.py"), model_dir=tmp_path, slots_per_trial=cores, max_slots=cores,
                   max_concurrent=1, timeout_s=60)  # all of them is fine


def test_dsat_cli_names_the_key_and_exits_2(tmp_path, capsys):
    from toolkit.dsat.tuner_cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "train.py").write_text("")
    (model / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    (model / "exp.yaml").write_text(yaml.safe_dump({
        "name": "x", "entrypoint": "python3 train.py", "resources": {"slots_per_trial": 100000},
        "searcher": {"max_length": 10}, "hyperparameters": {"deepspeed_config": "ds.json"}}))
    out = tmp_path / "out"
    try:
        code = main(["binary", str(model / "exp.yaml"), str(model), "--output-dir", str(out),
                     "--max-slots", "100000"])
    except SystemExit as exit_:
        code = exit_.code
    text = capsys.readouterr()
    assert code == 2, text
    assert CPU_PROBLEM in text.err + text.out
    assert not out.exists()


def _plan(tmp_path, slots, entrypoint="python3 train.py"):
    config = {"entrypoint": entrypoint, "resources": {"slots_per_trial": slots}, "max_restarts": 0}
    return plan_run(config, config_path=tmp_path / "exp.yaml", model_dir=tmp_path,
                    output_dir=tmp_path / "out")


def test_toolkit_run_checks_its_process_count_against_the_machine(tmp_path, caplog):
    process.check_slots(_plan(tmp_path, cpu_slots()), gpus=0)
    process.check_slots(_plan(tmp_path, 4), gpus=4)
    with pytest.raises(ConfigError, match=r"resources.slots_per_trial=5: one process per slot, and this "
                                          r"machine has 4 GPU\(s\); expected at most 4"):
        process.check_slots(_plan(tmp_path, 5), gpus=4)
    wrapped = _plan(tmp_path, 1, "python3 -m determined.launch.torch_distributed --nproc_per_node 9 -- "
                                 "python3 train.py")
    with pytest.raises(ConfigError, match=r"the entrypoint's --nproc_per_node=9: .* has 2 GPU\(s\)"):
        process.check_slots(wrapped, gpus=2)
    huge = _plan(tmp_path, 100000)
    assert trial.execute(huge) == 2  # nothing started, nothing written
    assert (f"resources.slots_per_trial=100000: one process per slot, and this machine has {cpu_slots()} "
            f"CPU core(s); expected at most {cpu_slots()}") in caplog.text
    assert not huge.output_dir.exists()


def test_a_toolkit_run_search_over_the_machine_exits_2_and_writes_nothing(tmp_path, capsys):
    from toolkit.run.cli import main

    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(dict(GRID, entrypoint="python3 train.py",
                                                           resources={"slots_per_trial": 100000})))
    assert main([str(tmp_path / "exp.yaml"), str(tmp_path), "--output-dir", str(tmp_path / "out")]) == 2
    assert "resources.slots_per_trial=100000" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- restarts: a bounded exponential backoff -----------------------------------------------------

def test_restart_delays_double_from_1_s_to_at_most_30_s():
    assert [trial.restart_delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert trial.restart_delay(10**9) == trial.RESTART_BACKOFF_MAX_S == 30


def test_a_signal_ends_the_backoff_at_once():
    forwarder = process.Forwarder()
    try:
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        begin = time.monotonic()
        trial._pause(30.0, forwarder)
        assert time.monotonic() - begin < 5 and forwarder.received == signal.SIGUSR1
    finally:
        timer.cancel()
        forwarder.restore()
