"""Searcher sections of Determined 0.37 and earlier, end to end (the translation itself:
tests/config/test_searcher_section.py): the runner plans them with one notice, a trial's searcher
operations come at its rungs (recorded, resumed, none after a stop), and the runner judges them
(acknowledged after the stop). Pure, but for one real `python -m toolkit.run` of a 0.37-style script
(the last test)."""

import json
import logging
import subprocess
import sys

import pytest

from helpers import procutil
from toolkit.compat.determined.core.distributed import DummyDistributedContext
from toolkit.compat.determined.core.searcher import SearcherContext
from toolkit.config.searcher_section import translate_searcher
from toolkit.errors import ConfigError
from toolkit.launch.trial_files import OPS_ACK_FILE, SEARCH_ACK_ENV, SEARCH_FILE
from toolkit.run import searchers

OLD_ASHA = {"name": "adaptive_asha", "metric": "x", "max_length": 100, "max_trials": 10}


def test_the_runner_plans_a_037_search_with_one_notice_and_refuses_what_it_cannot_translate(tmp_path, caplog):
    from toolkit.run import plan_run

    caplog.set_level(logging.WARNING, logger="toolkit.run")
    halving = dict(OLD_ASHA, name="async_halving", num_rungs=2)
    plan = plan_run({"entrypoint": "python3 x.py", "searcher": halving},
                    config_path=tmp_path / "x.yaml", model_dir=tmp_path, output_dir=tmp_path)
    assert plan.config["searcher"]["bracket_rungs"] == [2] and plan.config["searcher"]["max_time"] == 100
    assert [r.message.count("translated from Determined's") for r in caplog.records] == [1]
    with pytest.raises(ConfigError, match="searcher.num_rungs=0"):
        plan_run({"entrypoint": "python3 x.py", "searcher": dict(halving, num_rungs=0)},
                 config_path=tmp_path / "x.yaml", model_dir=tmp_path, output_dir=tmp_path)


def test_a_037_trial_gets_its_rungs_as_operations_recorded_resumed_and_none_after_a_stop(tmp_path,
                                                                                          monkeypatch):
    config = {"searcher": dict(OLD_ASHA)}
    progress, stop = [], []
    ctx = SearcherContext(DummyDistributedContext(), config, tmp_path, report_progress=progress.append,
                          stopped=lambda: bool(stop))
    ops = ctx.operations()
    op = next(ops)
    assert op.length == 25
    op.report_progress(20)
    op.report_completed(7.0)
    op = next(ops)
    assert op.length == 100 and progress == [0.2]
    # a rerun in that directory (a restart, or a paused trial continued) starts at the next rung
    again = SearcherContext(DummyDistributedContext(), config, tmp_path)
    assert next(again.operations()).length == 100
    op.report_completed(5.0)
    assert next(ops, None) is None
    record = json.loads((tmp_path / "determined_searcher.json").read_text())
    assert record["ops"] == [{"length": 25, "searcher_metric": 7.0}, {"length": 100, "searcher_metric": 5.0}]
    assert record["completed"] is True and list(SearcherContext(DummyDistributedContext(), config,
                                                                 tmp_path).operations()) == []
    # under toolkit.run: after an operation the chief waits for the runner's answer, then a stop
    # (the searcher's, or a pause) ends the operations
    other = tmp_path / "trial"
    monkeypatch.setenv(SEARCH_ACK_ENV, str(other))
    (other / OPS_ACK_FILE).parent.mkdir()
    (other / OPS_ACK_FILE).write_text("1")
    ctx = SearcherContext(DummyDistributedContext(), config, other, stopped=lambda: bool(stop))
    ops = ctx.operations()
    next(ops).report_completed(9.0)
    stop.append(True)
    assert next(ops, None) is None


def test_the_runner_judges_037_operations_and_answers_after_the_stop(tmp_path, caplog):
    from toolkit.run.trial_reports import ReportWatcher

    config, _, _ = translate_searcher({"searcher": dict(OLD_ASHA, max_trials=2, divisor=2,
                                                                mode="aggressive")})
    state = searchers.new_state(config, seed=1)
    assert state.asha.brackets[0].rungs == [50, 100]
    trials = []
    for _ in range(2):
        trials.append(searchers.next_trial(state, config))
        trials[-1].state = "RUNNING"
    assert searchers.asha_report(state, 0, time_step=50, metric=1.0, config=config) is False
    watcher = ReportWatcher(state, trials[1], config, tmp_path, lambda: None)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"group": "validation", "metrics": {"x": 4.0}}) + "\n")
    ops = {"ops": [{"length": 50, "searcher_metric": 3.0}], "completed": False}
    (tmp_path / "determined_searcher.json").write_text(json.dumps(ops))
    assert watcher() is True  # second of two at the rung: stopped; not answered until the stop is sent
    assert not (tmp_path / OPS_ACK_FILE).exists()
    assert watcher() is True and (tmp_path / OPS_ACK_FILE).read_text() == "1"
    assert (trials[1].metric, trials[1].best_metric, trials[1].time) == (3.0, 3.0, 50)
    # a script that validates but never loops over operations() is not judged: said, not silent
    (tmp_path / "determined_searcher.json").unlink()
    with caplog.at_level(logging.WARNING):
        ReportWatcher(state, trials[0], config, tmp_path, lambda: None).finish(stop_sent=False)
    assert "completed no searcher operation" in caplog.text


def _seed(check):
    config = {"searcher": {"name": "random", "max_trials": 4},
              "hyperparameters": {"increment_by": {"type": "int", "minval": 1, "maxval": 8}}}
    for seed in range(5000):
        state = searchers.new_state(config, seed=seed)
        incs = []
        for _ in range(4):
            trial = searchers.next_trial(state, config)
            trial.state = "COMPLETED"
            incs.append(trial.hparams["increment_by"])
        if check(incs):
            return seed, incs
    raise AssertionError("no seed found")


YAML = """name: det-037
entrypoint: python3 det_hpsearch_037.py
hyperparameters:
  increment_by: {{type: int, minval: 1, maxval: 8}}
searcher: {{name: adaptive_asha, metric: x, max_length: 8, max_trials: 3, divisor: 2, mode: aggressive,
           max_concurrent_trials: 1, stop_once: false}}
reproducibility: {{experiment_seed: {seed}}}
max_restarts: 0
"""


def test_a_037_search_runs_its_trials_by_operations_replaces_an_invalid_one_and_reports_progress(tmp_path):
    # 3 trials one after another, rungs at 4 and 8 batches: the second is worse than the first (stopped
    # after its first operation), the third raises InvalidHP (increment_by 8) and is replaced by a fourth,
    # the best
    seed, incs = _seed(lambda i: i[3] < i[0] < i[1] < 8 and i[2] == 8)
    model = tmp_path / "model"
    model.mkdir()
    (model / "det_hpsearch_037.py").write_text((procutil.WORKERS / "det_hpsearch_037.py").read_text())
    (model / "exp.yaml").write_text(YAML.format(seed=seed))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "toolkit.run", str(model / "exp.yaml"), str(model),
                             "--output-dir", str(out), "--max-slots", "1"], env=procutil.child_env(),
                            capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert log.count("searcher section translated from Determined's") == 1, log[-4000:]
    summary = json.loads((out / SEARCH_FILE).read_text())
    trials = summary["trials"]
    assert [t["hparams"]["increment_by"] for t in trials] == incs
    assert [t["state"] for t in trials] == ["COMPLETED"] * 4
    assert [t.get("early_exit") for t in trials] == [None, None, "INVALID_HP", None]
    assert [t["stopped_early"] for t in trials] == [False, True, False, False]

    def ops(t):
        record = json.loads((out / t["dir"] / "determined_searcher.json").read_text())
        return [op["length"] for op in record["ops"]]

    assert [ops(trials[i]) for i in (0, 1, 3)] == [[4, 8], [4], [4, 8]]
    assert [t["metric"] for t in trials] == [8 * incs[0], 4 * incs[1], None, 8 * incs[3]]
    assert [t.get("progress") for t in trials] == [1.0, 0.5, None, 1.0] and summary["progress"] == 1.0
    # the last trial asked for the experiment's best validation: the best report of any trial so far,
    # not the latest (trial 0 reported 4 * inc0, then 8 * inc0)
    assert json.loads((out / trials[3]["dir"] / "best.json").read_text()) == 4 * incs[0]
    assert summary["best"]["dir"] == "trial-0003" and trials[0]["best_metric"] == 4 * incs[0]
