"""toolkit.dsat.execution.classify: how a trial ended, from its exit status and its result file
(pure, no processes).

Each row of the module's table is checked on real files in a temporary trial directory; the
runner's tests (tests/dsat/execution/test_runner.py) cover the same outcomes with real trial processes.
"""

import json
import signal

import pytest

from toolkit.dsat.contract import METRICS, TrialStatus
from toolkit.dsat.execution.classify import check_result, classify, exit_text, stderr_tail
from toolkit.dsat.search.types import TrialSpec

GOOD = {"trial_id": 1, "status": "ok", "metrics": dict.fromkeys(METRICS, 1.0)}


def spec(trial_id=1, profile=False):
    return TrialSpec(trial_id, 1, {"stage": 1}, line=-1 if profile else 0, profile=profile)


def write_result(directory, content):
    (directory / "result.json").write_text(content if isinstance(content, str) else json.dumps(content))


@pytest.mark.parametrize("content, words", [
    ({"trial_id": 9, "status": "ok"}, "trial_id=9, expected 1"),
    ({"trial_id": 1, "status": "done"}, "status='done'"),
    ({"trial_id": 1, "status": "ok", "metrics": {"latency": 1.0}}, "metric FLOPS_per_gpu=None"),
    ({"trial_id": 1, "status": "ok", "metrics": dict.fromkeys(METRICS, float("nan"))}, "finite number"),
    ({"trial_id": 1, "status": "ok", "metrics": dict.fromkeys(METRICS, -1.0)}, ">= 0"),
    ({"trial_id": 1, "status": "ok", "metrics": dict.fromkeys(METRICS, True)}, "finite number"),
    ({"trial_id": 1, "status": "ok", "metrics": dict.fromkeys(METRICS, 1.0), "profile": {"num_params": 1}},
     "profile="),
    ([1, 2], "expected a JSON object"),
])
def test_malformed_result_files_are_named(content, words):
    assert words in check_result(content, spec())
    assert check_result(GOOD, spec()) is None
    assert "profile=None" in check_result(GOOD, spec(profile=True))  # the profiling trial needs its profile


def test_exit_text_names_the_status_or_the_signal():
    assert exit_text(3) == "exit status 3"
    assert exit_text(-signal.SIGKILL) == "killed by signal SIGKILL"
    assert exit_text(-200) == "killed by signal 200"


@pytest.mark.parametrize(
    "result, code, status, words",
    [
        (None, 0, TrialStatus.FAILED, "exited 0 without a result file"),
        (None, 3, TrialStatus.FAILED, "exit status 3"),
        (None, -signal.SIGKILL, TrialStatus.FAILED, "killed by signal SIGKILL"),
        (None, None, TrialStatus.FAILED, "had not exited"),  # not reaped within the grace period
        (GOOD, None, TrialStatus.FAILED, "had not exited by the end of the kill grace period (after writing"),
        ('{"trial_id": 1, "status": "ok", ', 0, TrialStatus.FAILED, "corrupt result file: "),
        ({"trial_id": 2, "status": "ok"}, 0, TrialStatus.FAILED, "corrupt result file: trial_id=2"),
        ({"trial_id": 1, "status": "oom"}, 1, TrialStatus.OOM, "out of memory (reported by the trial)"),
        (
            {"trial_id": 1, "status": "oom", "error": "CUDA out of memory. Tried"},
            1,
            TrialStatus.OOM,
            "CUDA out of",
        ),
        ({"trial_id": 1, "status": "failed", "error": "no data"}, 0, TrialStatus.FAILED, "no data"),
        ({"trial_id": 1, "status": "failed", "error": "no data"}, 2, TrialStatus.FAILED, "exit status 2"),
        (GOOD, 1, TrialStatus.FAILED, "exit status 1 (after writing its result)"),
        (GOOD, 0, TrialStatus.OK, None),
    ],
)
def test_each_row_of_the_table(tmp_path, result, code, status, words):
    if result is not None:
        write_result(tmp_path, result)
    r = classify(spec(), directory=tmp_path, code=code, duration_s=2.5)
    assert (r.status, r.duration_s) == (status, 2.5)
    if words is None:
        assert r.error is None and r.metrics == dict.fromkeys(METRICS, 1.0)
    else:
        assert words in r.error and r.metrics == {}


def test_the_runners_verdict_wins_over_a_result_written_before_the_kill(tmp_path):
    write_result(tmp_path, GOOD)
    r = classify(spec(), directory=tmp_path, code=-signal.SIGKILL, duration_s=9.0,
                 verdict=(TrialStatus.TIMEOUT, "ran past the timeout of 9 s"))
    assert (r.status, r.error) == (TrialStatus.TIMEOUT, "ran past the timeout of 9 s")


def test_failed_trials_show_the_workers_error_not_torchruns_epilogue(tmp_path):
    worker = [f"line {i}" for i in range(8)] + ["RuntimeError: boom on rank 0"]
    epilogue = ["E1122 torch/distributed/elastic/multiprocessing/api.py] failed (exitcode: 1) local_rank: 0",
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "train.py FAILED"]
    (tmp_path / "stderr.log").write_text("\n".join(worker + epilogue) + "\n")
    tail = stderr_tail(tmp_path / "stderr.log")
    assert tail.splitlines()[:2] == ["", "last lines of its output:"]
    assert tail.splitlines()[2:] == [
        "  line 4",
        "  line 5",
        "  line 6",
        "  line 7",
        "  RuntimeError: boom on rank 0",
    ]
    r = classify(spec(), directory=tmp_path, code=1, duration_s=1.0)
    assert r.error == "exit status 1" + tail
    assert stderr_tail(tmp_path / "missing.log") == ""
    # a trial's directory: its trial.log, the ranks' lines only, wherever the launcher's fell
    (tmp_path / "trial.log").write_text("\n".join(
        ["[rank 1] line 8", *(f"[launcher] {line}" for line in epilogue), "[rank 0] ValueError: bad x",
         "[launcher] exits with return code = 1"]) + "\n")
    assert stderr_tail(tmp_path).splitlines()[-2:] == ["  [rank 1] line 8", "  [rank 0] ValueError: bad x"]
    assert classify(spec(), directory=tmp_path, code=1, duration_s=1.0).error.endswith("ValueError: bad x")


def test_a_micro_batch_the_data_cannot_give_is_a_failure_that_names_the_limit(tmp_path):
    spec = TrialSpec(3, 4096, {"stage": 1}, line=0)
    short = {"trial_id": 3, "status": "failed", "error": "its loop feeds 3000 examples per forward",
             "data_limit": 3000}
    (tmp_path / "result.json").write_text(json.dumps(short))
    result = classify(spec, directory=tmp_path, code=0, duration_s=1.0)
    assert (result.status, result.data_limit) == (TrialStatus.FAILED, 3000)
    assert check_result({**short, "data_limit": 0}, spec) == "data_limit=0: expected an integer >= 1 or none"
    crashed = classify(spec, directory=tmp_path, code=1, duration_s=1.0)  # a crash after it: no limit known
    assert (crashed.status, crashed.data_limit) == (TrialStatus.FAILED, None)


def test_an_engine_summary_with_unknown_names_and_metrics_that_are_no_object_are_named():
    problem = check_result({**GOOD, "engine": {"stage": 1, "zero_stage": 1}}, spec())
    assert problem.startswith("engine={'stage': 1, 'zero_stage': 1}: expected an object with micro_batch, ")
    assert check_result({**GOOD, "engine": [1]}, spec()).startswith("engine=[1]: expected an object")
    assert check_result({**GOOD, "metrics": [1.0]}, spec()).startswith(
        "metrics=[1.0], expected an object with FLOPS_per_gpu")


def test_a_result_file_that_cannot_be_read_is_a_failure(tmp_path):
    (tmp_path / "result.json").mkdir()  # a directory where the file should be: reading it is an OSError
    r = classify(spec(), directory=tmp_path, code=0, duration_s=1.0)
    assert r.status is TrialStatus.FAILED and r.error.startswith("corrupt result file: ")
    assert "result.json" in r.error


def test_an_unreadable_trial_config_cannot_contradict_the_engine_the_result_reports(tmp_path):
    engine = {"micro_batch": 4, "gradient_accumulation_steps": 1, "stage": 2}
    write_result(tmp_path, {**GOOD, "engine": engine})
    (tmp_path / "ds_config.json").write_text('{"train_micro_batch_size_per_gpu": ')  # cut off
    r = classify(spec(), directory=tmp_path, code=0, duration_s=1.0)
    assert (r.status, r.error) == (TrialStatus.OK, None)
    (tmp_path / "ds_config.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 8,
                                                          "zero_optimization": {"stage": 2}}))
    r = classify(spec(), directory=tmp_path, code=0, duration_s=1.0)  # readable: it is compared
    assert r.status is TrialStatus.MISMATCH and "micro-batch" in r.error
