"""toolkit.checkpoint.rng: states that cannot be restored as saved (wrong version, missing parts,
CUDA states without the devices, NumPy gone) and rank files that are not this rank's."""

import logging
import random

import pytest
import torch

from toolkit.checkpoint import rng
from toolkit.checkpoint.rng import capture_rng_state, read_rank_file, restore_rng_state, write_rank_file


@pytest.mark.parametrize("state, message", [
    ({"version": 2}, r"RNG state version 2: expected a dict from .*capture_rng_state\(\) with version 1"),
    ([1, 2], r"RNG state version 'list'"),
    ({"version": 1, "python": {}, "torch": None}, r"RNG state lacks numpy, cuda: expected a dict"),
])
def test_a_state_that_is_not_capture_rng_states_is_refused(state, message):
    with pytest.raises(ValueError, match=message):
        restore_rng_state(state)


def test_cuda_states_without_those_devices_are_skipped_with_a_warning_and_cpu_is_restored(caplog):
    state = capture_rng_state()
    expected = torch.rand(3)
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2  # saved on a node with two GPUs
    with caplog.at_level(logging.WARNING, logger=rng.__name__):
        restore_rng_state(state)
    assert torch.equal(torch.rand(3), expected)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert f"holds 2 CUDA generator(s) but {visible} device(s) are visible" in caplog.text


def test_a_numpy_state_without_numpy_is_skipped_with_a_warning(monkeypatch, caplog):
    state = capture_rng_state()
    expected = random.random()
    monkeypatch.setattr(rng, "np", None)  # NumPy absent (it is installed here, so its name is cleared)
    with caplog.at_level(logging.WARNING, logger=rng.__name__):
        restore_rng_state(state)
    assert random.random() == expected
    assert "holds a NumPy state but NumPy is not installed; skipped" in caplog.text


def test_a_rank_file_of_another_rank_or_unreadable_says_why(tmp_path):
    path = tmp_path / "rng_rank1.pt"
    write_rank_file(path, rank=1, world_size=2)
    state, problem = read_rank_file(path, rank=1, world_size=2)
    assert problem is None and state["version"] == rng.RNG_STATE_VERSION
    assert read_rank_file(path, rank=0, world_size=2) == (
        None, f"{path} holds rank 1 of 2, expected rank 0 of 2")
    assert read_rank_file(path, rank=1, world_size=4)[1] == f"{path} holds rank 1 of 2, expected rank 1 of 4"
    torch.save([1, 2], path)  # a torch file, but not a rank file
    state, problem = read_rank_file(path, rank=1, world_size=2)
    assert state is None and str(problem).startswith(f"cannot read this rank's RNG states {path}: ")
    state, problem = read_rank_file(tmp_path / "missing.pt", rank=0, world_size=1)
    assert state is None and "No such file" in str(problem)


@pytest.mark.parametrize("content", [b"", b"not a torch file"])
def test_an_empty_or_foreign_rank_file_is_a_problem_not_an_exception(tmp_path, content):
    path = tmp_path / "rng_rank0.pt"
    path.write_bytes(content)
    state, problem = read_rank_file(path, rank=0, world_size=1)
    assert state is None and str(problem).startswith(f"cannot read this rank's RNG states {path}: ")
