"""Determined's hyperparameter semantics (toolkit.config.hyperparameters) without processes: sampling
per type, the grid, and the YAML loader that keeps search spaces."""

import json
import random

import pytest

from toolkit.config import hyperparameters as hp
from toolkit.errors import ConfigError

SPACE = {
    "n": {"type": "int", "minval": 1, "maxval": 3},
    "lr": {"type": "log", "base": 10, "minval": -4, "maxval": -2},
    "p": {"type": "double", "minval": 0.25, "maxval": 0.5},
    "opt": {"type": "categorical", "vals": ["adam", "sgd", {"x": 1}]},
    "g": {"k": {"type": "const", "val": [1, 2]}, "m": {"type": "int", "minval": 5, "maxval": 5}, "e": {}},
    "plain": 7,
}


def test_sampling_follows_determined_per_type():
    seen_n, seen_opt = set(), []
    for seed in range(300):
        s = hp.sample_hparams(SPACE, random.Random(seed))
        seen_n.add(s["n"])
        seen_opt.append(json.dumps(s["opt"]))
        assert isinstance(s["n"], int) and 1e-4 <= s["lr"] <= 1e-2 and 0.25 <= s["p"] <= 0.5
        assert s["g"] == {"k": [1, 2], "m": 5, "e": {}} and s["plain"] == 7
    assert seen_n == {1, 2, 3}  # both ends included
    assert set(seen_opt) == {'"adam"', '"sgd"', '{"x": 1}'}
    assert hp.sample_hparams(SPACE, random.Random(5)) == hp.sample_hparams(SPACE, random.Random(5))
    assert hp.has_search_space(SPACE) and not hp.has_search_space({"a": {"type": "const", "val": 1}})


def test_space_problems_name_every_key():
    problems = hp.check_space(
        {
            "a": {"type": "int", "minval": 3, "maxval": 1},
            "g": {"b": {"type": "categorical", "vals": []}},
            "c": {"type": "log", "minval": 0, "maxval": 1},
            "d": {"type": "double", "minval": "x", "maxval": 1},
        }
    )
    assert len(problems) == 4
    keys = ("hyperparameters.a", "hyperparameters.g.b.vals", "hyperparameters.c.base", "hyperparameters.d")
    for key in keys:
        assert any(key in p for p in problems), (key, problems)
    with pytest.raises(ConfigError, match="count"):
        hp.grid_points({"a": {"type": "double", "minval": 0, "maxval": 1}})
    assert hp.check_space([1, 2]) == ["hyperparameters=[1, 2]: expected a mapping of names to values"]
    assert hp.check_space({"g": {"k": {"type": "const"}}}) == [
        "hyperparameters.g.k: type const needs 'val', e.g. {type: const, val: 0.1}"]


def test_sampling_a_bad_space_raises_every_problem_and_samples_nothing():
    with pytest.raises(ConfigError) as err:
        hp.sample_hparams({"a": {"type": "int", "minval": 3, "maxval": 1}, "b": {"type": "const"}},
                          random.Random(0))
    assert [p.split(":")[0] for p in err.value.problems] == ["hyperparameters.a", "hyperparameters.b"]


def test_grid_as_determined():
    points = hp.grid_points(
        {
            "i": {"type": "int", "minval": 1, "maxval": 8, "count": 3},
            "d": {"type": "double", "minval": 0, "maxval": 1, "count": 1},
            "g": {"c": {"type": "categorical", "vals": ["a", "b"]}, "z": {"type": "int", "minval": 1,
                                                                       "maxval": 2, "count": 9}},
            "l": {"type": "log", "base": 10, "minval": -2, "maxval": 0, "count": 2},
            "k": 4,
        }
    )
    assert len(points) == 1 * 2 * 3 * 2 * 2  # d, g.c, i, l, g.z (int count clamped to the range: 2)
    assert hp.grid_points({"n": {"type": "int", "minval": -3, "maxval": 0, "count": 3}}) == [
        {"n": -3}, {"n": -2}, {"n": 0}]  # -1.5 rounds to -2, away from zero, as Go's math.Round
    assert {p["i"] for p in points} == {1, 5, 8}  # round(1 + 3.5) = 5 (halves away from zero, as Go)
    assert {p["d"] for p in points} == {0.5} and {p["l"] for p in points} == {0.01, 1.0}
    assert {(p["g"]["c"], p["g"]["z"]) for p in points} == {("a", 1), ("a", 2), ("b", 1), ("b", 2)}
    assert all(p["k"] == 4 for p in points)


def test_load_config_keeps_search_spaces_and_checks_the_rest(tmp_path):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(
        "entrypoint: python3 x.py\nhyperparameters: {n: {type: int, minval: 1, maxval: 8}}\n"
        "searcher: {name: adaptive_asha, metric: x, max_trials: 4, time_metric: batches, max_time: 10}\n"
        "reproducibility: {experiment_seed: 3}\n"
    )
    config = hp.load_config(cfg)
    assert config["hyperparameters"]["n"]["type"] == "int" and config["searcher"]["max_trials"] == 4
    cfg.write_text("entrypoint: python3 x.py\nresources: {slots_per_trial: 0}\n"
                   "hyperparameters: {n: {type: int, minval: 2, maxval: 1}}\n")
    with pytest.raises(ConfigError) as err:
        hp.load_config(cfg)
    assert any("slots_per_trial" in p for p in err.value.problems)
    assert any("hyperparameters.n" in p for p in err.value.problems)
    cfg.write_text("hyperparameters: [1, 2]\n")   # no mapping: the experiment loader's message
    with pytest.raises(ConfigError, match=r"hyperparameters=\[1, 2\]: expected a mapping"):
        hp.load_config(cfg)
    cfg.write_text("entrypoint: [unclosed\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        hp.load_config(cfg)
    with pytest.raises(FileNotFoundError):
        hp.load_config(tmp_path / "missing.yaml")
