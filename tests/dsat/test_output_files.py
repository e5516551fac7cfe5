"""toolkit.dsat.output_files: what event_problem says of each kind of bad line of ``events.jsonl`` (pure),
an oversized log, blank lines, and the summary table's missing metrics."""

import json

import pytest

from toolkit.dsat import output_files
from toolkit.dsat.contract import METRICS, TrialStatus
from toolkit.dsat.output_files import EventLog, event_problem, summary_table
from toolkit.dsat.search.types import TrialResult, TrialSpec
from toolkit.errors import ConfigError

PROFILE = {"num_params": 10, "trainable_params": 10, "activation_bytes_per_example": 4,
           "memory_per_slot": 2**30, "micro_batch": 1, "peak_bytes": 2**20, "device": "cpu"}


def result_event(trial_id=1, *, status=TrialStatus.OK, metrics=None, error=None, profile=None, spec_id=None):
    spec = TrialSpec(trial_id if spec_id is None else spec_id, 2, {"stage": 1})
    metrics = dict.fromkeys(METRICS, 1.0) if metrics is None else metrics
    return {"event": "result", "trial_id": trial_id,
            "result": TrialResult(spec, status, metrics, 1.0, error, profile).to_json()}


def start_event(trial_id=1, observed=0):
    return {"event": "start", "trial_id": trial_id, "observed_before": observed,
            "spec": TrialSpec(trial_id, 2, {"stage": 1}).to_json()}


def test_good_events_have_no_problem():
    assert event_problem(start_event()) is None
    assert event_problem(result_event()) is None
    assert event_problem(result_event(status=TrialStatus.FAILED, metrics={}, error="boom")) is None
    assert event_problem(result_event(profile=PROFILE)) is None


@pytest.mark.parametrize("event, problem", [
    (["start"], "expected a JSON object, got list"),
    ({"event": "stop", "trial_id": 1}, "event='stop': expected 'start' or 'result'"),
    ({"event": "start", "trial_id": True}, "trial_id=True: expected an integer"),
    (start_event(observed=-1), "observed_before=-1: expected an integer >= 0"),
    ({**start_event(), "observed_before": "2"}, "observed_before='2': expected an integer >= 0"),
    (result_event(metrics={**dict.fromkeys(METRICS, 1.0), "latency": float("inf")}),
     "metric latency=inf: expected a finite number >= 0"),
    (result_event(metrics={**dict.fromkeys(METRICS, 1.0), "throughput": -1.0}),
     "metric throughput=-1.0: expected a finite number >= 0"),
    (result_event(metrics={**dict.fromkeys(METRICS, 1.0), "forward": "fast"}),
     "metric forward='fast': expected a finite number >= 0"),
    (result_event(profile={**PROFILE, "num_params": -1}), "profile: "),
    (result_event(status=TrialStatus.FAILED, metrics={}, error=["boom"]),
     "error=['boom']: expected a string or null"),
    (result_event(3, spec_id=4), "trial_id=3 but its spec says trial 4"),
    ({"event": "result", "trial_id": 1, "result": {"spec": {}}},
     "the result record of trial 1 is incomplete or of the wrong kind (KeyError: "),
])
def test_each_bad_event_is_named(event, problem):
    assert str(event_problem(event)).startswith(problem)


def test_metrics_that_are_no_object_are_named():
    event = result_event()
    event["result"]["metrics"] = None  # from_json reads a missing object as {}: every metric is missing
    assert event_problem(event) == "metric FLOPS_per_gpu=None: expected a finite number >= 0"
    assert output_files._finite_metrics([1.0]) == "metrics=[1.0]: expected an object"


def test_a_log_over_the_limit_is_refused_and_blank_lines_are_skipped(tmp_path, monkeypatch):
    log = tmp_path / "events.jsonl"
    EventLog(log).append(start_event())
    with open(log, "a", encoding="utf-8") as fh:
        fh.write("\n   \n")
    EventLog(log).append(result_event())
    assert [e["event"] for e in EventLog(log).read()] == ["start", "result"]
    monkeypatch.setattr(output_files, "MAX_LOG_BYTES", 100)
    with pytest.raises(ConfigError, match=r"over 0 MiB: not a search log this toolkit wrote; start a new "
                                          r"search in another --output-dir"):
        EventLog(log).read()


def test_a_complete_last_line_without_its_newline_is_kept_by_the_next_append(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_text(json.dumps(start_event()))  # the crash came between the line and its newline
    EventLog(log).append(result_event())
    assert log.read_text().count("\n") == 2
    assert [e["event"] for e in EventLog(log).read()] == ["start", "result"]


def test_the_summary_shows_a_missing_metric_as_a_dash_and_an_integer_as_is():
    failed = TrialResult(TrialSpec(2, 4, {"stage": 2}), TrialStatus.OOM, {"FLOPS_per_gpu": 7}, 3.0,
                         "out of memory", None)
    table = summary_table([failed], metric="throughput", best_id=None)
    row = next(line for line in table.splitlines() if " oom " in line)
    assert row.split()[3:9] == ["oom", "7", "-", "-", "-", "-"]
