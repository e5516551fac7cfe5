"""The values toolkit.run records per output directory (toolkit.launch.trial_files) as every rank reads
them (det.get_cluster_info), and each rank as one container under toolkit.run. No process."""

import json
import random

import pytest

from helpers import resets
from toolkit.compat import determined as det
from toolkit.config import hyperparameters as hp
from toolkit.errors import ConfigError
from toolkit.launch.trial_files import TRIAL_FILE, record_hparams
from toolkit.launch.wrappers import CONTAINER_PER_RANK_ENV


@pytest.fixture
def env(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "TOOLKIT_TRIAL_HPARAMS",
                CONTAINER_PER_RANK_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TOOLKIT_OUTPUT_DIR", str(tmp_path / "out"))
    resets.forget_cluster_info()
    yield tmp_path
    resets.forget_cluster_info()


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
    values = record_hparams(out, config)
    assert values == hp.sample_hparams(config["hyperparameters"], random.Random(11))  # the experiment seed
    resets.forget_cluster_info()
    info = det.get_cluster_info()
    assert info.trial.hparams == values == {"c": 2, "n": values["n"]}
    trial_id = info.trial.trial_id
    assert record_hparams(out, config, seed=99) == values  # a rerun keeps them
    state = json.loads((out / TRIAL_FILE).read_text())
    assert state["hparams_seed"] == 11 and state["trial_id"] == trial_id
    monkeypatch.setenv("RANK", "1")
    resets.forget_cluster_info()
    assert det.get_cluster_info().trial.hparams == values  # another rank: the same values
    changed = dict(config, hyperparameters={"n": {"type": "int", "minval": 1, "maxval": 2}})
    with pytest.raises(ConfigError, match="another search space"):
        record_hparams(out, changed)
    other = env / "other"
    assert record_hparams(other, {"hyperparameters": {"a": 1}}) is None  # nothing to sample
    assert not other.exists()


def test_each_rank_is_one_container_under_toolkit_run(env, monkeypatch):
    cfg = env / "exp.yaml"
    cfg.write_text("entrypoint: python3 x.py\nresources: {slots_per_trial: 2}\n")
    monkeypatch.setenv("TOOLKIT_EXPERIMENT_CONFIG", str(cfg))
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", CONTAINER_PER_RANK_ENV: "1"}.items():
        monkeypatch.setenv(key, value)
    info = det.get_cluster_info()
    assert (info.slot_ids, info.container_rank, info.container_addrs) == ([1], 1, ["127.0.0.1"] * 2)
    monkeypatch.delenv(CONTAINER_PER_RANK_ENV)
    resets.forget_cluster_info()
    info = det.get_cluster_info()  # a worker under a launcher wrapper: the machine is the container
    assert (info.slot_ids, info.container_rank, info.container_addrs) == ([0, 1], 0, ["127.0.0.1"])
