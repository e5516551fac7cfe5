"""Determined's hyperparameter semantics without processes: sampling per type, the grid, the YAML
loader that keeps search spaces, and the values toolkit.run records per output directory."""

import json
import random

import pytest

from toolkit.compat import determined as det
from toolkit.compat.determined import hparams as hp
from toolkit.compat.determined import info as info_mod
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
    cfg.write_text("entrypoint: [unclosed\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        hp.load_config(cfg)
    with pytest.raises(FileNotFoundError):
        hp.load_config(tmp_path / "missing.yaml")


@pytest.fixture
def env(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "TOOLKIT_TRIAL_HPARAMS",
                info_mod.CONTAINER_PER_RANK_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TOOLKIT_OUTPUT_DIR", str(tmp_path / "out"))
    info_mod.reset_for_tests()
    yield tmp_path
    info_mod.reset_for_tests()


def test_recorded_sample_is_what_every_rank_reads_and_is_kept(env, monkeypatch):
    cfg = env / "exp.yaml"
    cfg.write_text(
        "entrypoint: python3 x.py\nsearcher: {name: single, metric: x}\n"
        "reproducibility: {experiment_seed: 11}\n"
        "hyperparameters: {n: {type: int, minval: 1, maxval: 1000}, c: {type: const, val: 2}}\n"
    )
    monkeypatch.setenv("TOOLKIT_EXPERIMENT_CONFIG", str(cfg))
    with pytest.raises(ConfigError, match="hyperparameters.n"):  # nothing sampled: outside toolkit.run
        det.get_cluster_info()
    config, out = hp.load_config(cfg), env / "out"
    values = info_mod.record_hparams(out, config)
    assert values == hp.sample_hparams(config["hyperparameters"], random.Random(11))  # the experiment seed
    info_mod.reset_for_tests()
    info = det.get_cluster_info()
    assert info.trial.hparams == values == {"c": 2, "n": values["n"]}
    trial_id = info.trial.trial_id
    assert info_mod.record_hparams(out, config, seed=99) == values  # a rerun keeps them
    state = json.loads((out / info_mod.TRIAL_FILE).read_text())
    assert state["hparams_seed"] == 11 and state["trial_id"] == trial_id
    monkeypatch.setenv("RANK", "1")
    info_mod.reset_for_tests()
    assert det.get_cluster_info().trial.hparams == values  # another rank: the same values
    changed = dict(config, hyperparameters={"n": {"type": "int", "minval": 1, "maxval": 2}})
    with pytest.raises(ConfigError, match="another search space"):
        info_mod.record_hparams(out, changed)
    other = env / "other"
    assert info_mod.record_hparams(other, {"hyperparameters": {"a": 1}}) is None  # nothing to sample
    assert not other.exists()


def test_each_rank_is_one_container_under_toolkit_run(env, monkeypatch):
    cfg = env / "exp.yaml"
    cfg.write_text("entrypoint: python3 x.py\nresources: {slots_per_trial: 2}\n")
    monkeypatch.setenv("TOOLKIT_EXPERIMENT_CONFIG", str(cfg))
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", info_mod.CONTAINER_PER_RANK_ENV: "1"}.items():
        monkeypatch.setenv(key, value)
    info = det.get_cluster_info()
    assert (info.slot_ids, info.container_rank, info.container_addrs) == ([1], 1, ["127.0.0.1"] * 2)
    monkeypatch.delenv(info_mod.CONTAINER_PER_RANK_ENV)
    info_mod.reset_for_tests()
    info = det.get_cluster_info()  # a worker under a launcher wrapper: the machine is the container
    assert (info.slot_ids, info.container_rank, info.container_addrs) == ([0, 1], 0, ["127.0.0.1"])
