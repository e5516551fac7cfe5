"""toolkit.dsat.search.boundaries: the boundary the trials found, beside the prediction (pure)."""

from toolkit.dsat.contract import TrialStatus
from toolkit.dsat.search.boundaries import format_boundaries, found_boundaries
from toolkit.dsat.search.types import TrialResult, TrialSpec


def _result(tid, stage, mb, status, profile=False):
    return TrialResult(TrialSpec(tid, mb, {"stage": stage}, profile=profile), TrialStatus(status))


def test_found_boundaries_and_their_lines():
    results = [_result(0, 1, 1, "ok", profile=True), _result(-1, 1, 90, "oom", profile=True),
               _result(1, 1, 40, "ok"), _result(2, 1, 60, "oom"), _result(3, 1, 50, "ok"),
               _result(4, 1, 55, "oom"), _result(5, 3, 70, "ok"), _result(6, 2, 10, "failed")]
    found = found_boundaries(results)
    assert found == {1: {"largest_ok": 50, "smallest_oom": 55}, 3: {"largest_ok": 70, "smallest_oom": None}}
    prediction = {"1": {"approx_max_micro_batch": 52}, "3": {"approx_max_micro_batch": 80}}
    text = format_boundaries(prediction, found)
    assert text.splitlines() == [
        "stage 1: predicted largest micro-batch 52; found: largest ok 50, smallest oom 55",
        "stage 3: predicted largest micro-batch 80; found: largest ok 70, smallest oom none"]
