"""The experiment YAML's searcher section (toolkit.config.searcher_section): ASHA's rungs and brackets as
Determined lays them out, the section's problems each naming its key, and a section of Determined 0.37
translated with one notice. Pure."""

import pytest

from toolkit.config import searcher_section as search
from toolkit.config.searcher_section import operation_lengths, translate_searcher

OLD_ASHA = {"name": "adaptive_asha", "metric": "x", "max_length": 100, "max_trials": 10}


def test_rungs_as_determined():
    assert search.asha_rungs(max_time=100, max_trials=10) == [25, 100]  # 3_hpsearch.yaml's
    assert search.asha_rungs(max_time=100, max_trials=10, divisor=2) == [12, 25, 50, 100]
    assert search.asha_rungs(max_time=1000, max_trials=1000) == [3, 15, 62, 250, 1000]
    assert search.asha_rungs(max_time=5, max_trials=1) == [5]


def _brackets(**kw):
    return [(b["rungs"], b["max_trials"]) for b in search.asha_brackets(**kw)]


def test_brackets_by_mode_as_determined():
    # 3_hpsearch.yaml: 2 rungs at most; standard (Determined's default) adds a bracket of one rung
    assert _brackets(max_time=100, max_trials=10, mode="aggressive") == [([25, 100], 10)]
    assert _brackets(max_time=100, max_trials=10) == [([25, 100], 7), ([100], 3)]
    # 4 rungs at most: standard keeps the upper half of the counts, conservative every count;
    # trials shared by the weights divisor**(n-1)/n, the remainder to the first bracket
    assert _brackets(max_time=1000, max_trials=100) == [
        ([15, 62, 250, 1000], 70), ([62, 250, 1000], 22), ([250, 1000], 8)]
    assert _brackets(max_time=1000, max_trials=100, mode="conservative") == [
        ([15, 62, 250, 1000], 67), ([62, 250, 1000], 21), ([250, 1000], 8), ([1000], 4)]
    assert _brackets(max_time=1000, max_trials=100, bracket_rungs=[1, 3]) == [([62, 250, 1000], 85),
                                                                               ([1000], 15)]
    assert _brackets(max_time=100, max_trials=2, mode="conservative") == [([100], 2)]


@pytest.mark.parametrize(
    "searcher,match",
    [
        ({"name": "random", "metric": "x"}, "searcher.max_trials"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2}, "searcher.time_metric"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b"}, "searcher.max_time"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b", "max_time": 9,
          "divisor": 1}, "searcher.divisor"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b", "max_time": 9,
          "mode": "fast"}, "searcher.mode='fast': expected one of aggressive, standard, conservative"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b", "max_time": 9,
          "bracket_rungs": [0]}, "searcher.bracket_rungs"),
        ({"name": "random", "metric": "x", "max_trials": 2, "max_concurrent_trials": -1},
         "searcher.max_concurrent_trials=-1"),
        ({"name": "custom", "metric": "x"}, "searcher.name='custom'"),
        ({"name": "grid", "metric": "x"}, "hyperparameters.n.count"),
        ({"name": "adaptive_asha", "max_trials": 2, "time_metric": "b", "max_time": 9},
         "searcher.metric=None: adaptive_asha needs the validation metric"),
        ({"name": "adaptive_asha", "metric": "x", "max_trials": 2, "time_metric": "b", "max_time": 9,
          "max_rungs": 0}, "searcher.max_rungs=0: expected an integer >= 1 (default 5)"),
    ],
)
def test_searcher_problems_name_the_key(searcher, match):
    problems = search.check_searcher(
        {"searcher": searcher, "hyperparameters": {"n": {"type": "int", "minval": 1, "maxval": 3}}}
    )
    assert any(match in p for p in problems), problems


def test_037_asha_and_async_halving_are_translated_with_one_notice():
    config = {"searcher": dict(OLD_ASHA), "entrypoint": "python3 x.py"}
    translated, notice, problems = translate_searcher(config)
    assert problems == [] and config == {"searcher": OLD_ASHA, "entrypoint": "python3 x.py"}  # not mutated
    assert translated["searcher"] == dict(OLD_ASHA, max_time=100)
    assert "max_time = 100 batches" in notice and "op.report_completed" in notice
    assert search.check_searcher(translated) == [] and search.check_searcher(config) != []
    assert translate_searcher(translated)[1] is None  # translated once: nothing more to say
    assert operation_lengths(config) == operation_lengths(translated) == [25, 100]
    halving = {"searcher": {"name": "async_halving", "num_rungs": 3, "metric": "x", "divisor": 3,
                            "max_trials": 9, "max_length": {"epochs": 9}, "stop_once": False,
                            "max_concurrent_trials": 2}, "records_per_epoch": 100}
    translated, notice, _ = translate_searcher(halving)
    assert translated["searcher"] == {"name": "adaptive_asha", "bracket_rungs": [3], "metric": "x",
                                      "divisor": 3, "max_trials": 9, "max_length": {"epochs": 9},
                                      "max_time": 9, "max_concurrent_trials": 2}
    assert notice.count("searcher section translated") == 1 and "bracket_rungs: [3]" in notice
    assert "stop_once=False is dropped" in notice and "9 epochs" in notice
    s = translated["searcher"]
    assert [b["rungs"] for b in search.asha_brackets(max_time=s["max_time"], max_trials=s["max_trials"],
                                                     **search.searcher_defaults(s))] == [[1, 3, 9]]  # no cap
    assert operation_lengths(halving) == [1, 3, 9]
    current = {"searcher": {"name": "async_halving", "num_rungs": 2, "metric": "x", "max_trials": 4,
                            "time_metric": "batches", "max_time": 16}}
    assert translate_searcher(current)[0]["searcher"]["bracket_rungs"] == [2]
    assert operation_lengths(current) is None  # 0.38's form: the script reports its time itself
    new = {"searcher": dict(current["searcher"], name="adaptive_asha", mode="standard")}
    assert translate_searcher(new) == (new, None, [])
    assert translate_searcher({"searcher": {"name": "async_halving", "metric": "x"}})[2] == [
        "searcher.num_rungs=None: async_halving needs an integer >= 1 (its rounds of halving)"]
    assert "searcher.max_length" in translate_searcher(
        {"searcher": dict(OLD_ASHA, max_length={"steps": 3})})[2][0]


def test_a_037_asha_section_with_a_problem_has_no_operation_lengths():
    """The problem is the searcher check's to report; no rungs are made up from a broken section."""
    assert operation_lengths({"searcher": dict(OLD_ASHA, max_length={"steps": 3})}) is None
    assert operation_lengths({"searcher": dict(OLD_ASHA, max_trials="10")}) is None
    # max_trials 0 (the runner refuses it, but a trial's script can read such a YAML): no rungs, no crash
    assert operation_lengths({"searcher": dict(OLD_ASHA, max_trials=0)}) is None
    assert operation_lengths({"searcher": dict(OLD_ASHA, max_length=0)}) is None
