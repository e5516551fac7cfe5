"""A search's typed state at the JSON edge (toolkit.run.search_state): records of earlier toolkits read in
today's form, and a damaged record named with what to do. Pure."""

import pytest

from toolkit.errors import CheckpointError
from toolkit.run import searchers
from toolkit.run.search_state import SearchState

ASHA = {"searcher": {"name": "adaptive_asha", "metric": "x", "max_trials": 3, "time_metric": "batches",
                     "max_time": 100, "divisor": 2, "mode": "aggressive"},
        "hyperparameters": {"inc": {"type": "int", "minval": 1, "maxval": 8}}}


def test_an_earlier_record_of_one_bracket_at_the_top_continues():
    old = {"searcher": "adaptive_asha", "seed": 1, "searcher_config": dict(ASHA["searcher"], mode=None),
           "trials": [], "asha": {"rungs": [50, 100], "metrics": [[[0, 5.0]], []], "trial_rung": {"0": 1}}}
    state = SearchState.from_json(old, source="search.json")
    brackets = [(b.rungs, b.max_trials, b.metrics) for b in state.asha.brackets]
    assert brackets == [([50, 100], 3, [[(0, 5.0)], []])]
    assert searchers.asha_report(state, 1, time_step=50, metric=9.0, config=ASHA) is True
    early = SearchState.from_json({"searcher": "random", "seed": 2, "trials": [
        {"index": 0, "dir": "trial-0000", "hparams": {}, "state": "COMPLETED", "metric": 1}]}, source="s")
    assert early.searcher_config is None and early.trials[0].seed is None and early.trials[0].metric == 1.0


@pytest.mark.parametrize("record, fragment", [
    ([], "is not a search state (expected an object with 'seed' and 'trials')"),
    ({"seed": 1, "trials": [5]}, "trials[0]: expected a trial (an object), found int"),
    ({"seed": 1, "trials": [{"index": 0, "dir": "../../etc", "hparams": {}, "state": "PENDING"}]},
     "trials[0]: dir='../../etc': expected 'trial-0000'"),
    ({"seed": 1, "trials": [{"index": 0, "hparams": {}, "state": "LOST"}]}, "state='LOST'"),
    ({"seed": 1, "trials": [{"index": 1, "hparams": {}, "state": "PENDING"}]}, "the trials' indices are [1]"),
    ({"seed": 1, "searcher": "adaptive_asha", "trials": []}, "ASHA's state for adaptive_asha"),
    ({"seed": 1, "searcher": "adaptive_asha", "trials": [], "asha": {"brackets": [{"rungs": [1]}]}},
     "asha is not ASHA's state"),
])
def test_a_damaged_record_is_named_with_what_to_do(record, fragment):
    with pytest.raises(CheckpointError) as err:
        SearchState.from_json(record, source="runs/hp/determined_search.json")
    assert fragment in str(err.value) and "use a new --output-dir" in str(err.value), str(err.value)
