"""Exact-resume data helpers: the resumed sampler continues the uninterrupted order exactly.

Pure logic, no processes: a DistributedSampler's order is a function of (seed, epoch, rank), so
each rank's stream is computed here for every rank of a simulated world. The oracle for the
uninterrupted run is upstream torch's DistributedSampler, batched the way a DataLoader batches.
"""

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from toolkit.data import (
    ResumableDistributedSampler,
    ResumePosition,
    batches_per_epoch,
    resume_position,
    seed_everything,
)
from toolkit.errors import ConfigError


def _chunks(indices, size, drop_last):
    batches = [indices[i:i + size] for i in range(0, len(indices), size)]
    if drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    return batches


def _uninterrupted(n, world, rank, *, seed, shuffle, sampler_drop_last, mb, loader_drop_last,
                   grad_acc, carry_over, epochs):
    """The micro-batches one rank consumes in an uninterrupted run, epoch after epoch."""
    stream = []
    sampler = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=sampler_drop_last)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = _chunks(list(sampler), mb, loader_drop_last)
        if not carry_over:  # each epoch ends with its last full optimizer step
            batches = batches[:len(batches) // grad_acc * grad_acc]
        stream.extend(batches)
    return stream


def _resumed(n, world, rank, steps, *, seed, shuffle, sampler_drop_last, mb, loader_drop_last,
             grad_acc, carry_over, epochs):
    """What a restarted run's loop yields, from the position the helpers compute, through real DataLoaders."""
    dataset = list(range(n))
    sampler = ResumableDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle,
                                          seed=seed, drop_last=sampler_drop_last)
    loader = DataLoader(dataset, batch_size=mb, sampler=sampler, drop_last=loader_drop_last,
                        generator=sampler.loader_generator)
    start = sampler.resume_position(steps, micro_batch_size=mb, gradient_accumulation_steps=grad_acc,
                                    drop_last=loader_drop_last, carry_over=carry_over)
    per_epoch = batches_per_epoch(sampler.num_samples, micro_batch_size=mb, drop_last=loader_drop_last)
    stream = []
    for epoch in range(start.epoch, epochs):
        skip = start.samples_to_skip if epoch == start.epoch else 0
        sampler.set_epoch(epoch, skip=skip)
        batches = [batch.tolist() for batch in loader]
        # len(loader) stays the epoch's, also in the resumed epoch (DeepSpeed-Chat reads it mid-run)
        assert len(loader) == per_epoch
        assert len(batches) == per_epoch - (start.batches_to_skip if epoch == start.epoch else 0)
        if not carry_over:
            keep = per_epoch // grad_acc * grad_acc - (start.batches_to_skip if epoch == start.epoch else 0)
            batches = batches[:keep]
        stream.extend(batches)
    return start, stream


_cases = st.fixed_dictionaries({
    "n": st.integers(1, 90),
    "world": st.integers(1, 4),
    "mb": st.integers(1, 7),
    "grad_acc": st.integers(1, 4),
    "seed": st.integers(0, 2**31),
    "shuffle": st.booleans(),
    "sampler_drop_last": st.booleans(),
    "loader_drop_last": st.booleans(),
    "carry_over": st.booleans(),
    "steps_fraction": st.floats(0, 1),
})


@settings(max_examples=150, deadline=None)
@given(_cases)
def test_resumed_sampler_yields_exactly_the_rest_of_the_uninterrupted_order(case):
    n, world, mb, grad_acc = case["n"], case["world"], case["mb"], case["grad_acc"]
    if case["sampler_drop_last"] and n < world:
        n = world  # a drop_last sampler needs one sample per rank
    common = dict(seed=case["seed"], shuffle=case["shuffle"], sampler_drop_last=case["sampler_drop_last"],
                  mb=mb, loader_drop_last=case["loader_drop_last"], grad_acc=grad_acc,
                  carry_over=case["carry_over"])
    per_rank = DistributedSampler(list(range(n)), num_replicas=world, rank=0,
                                  drop_last=case["sampler_drop_last"]).num_samples
    per_epoch = batches_per_epoch(per_rank, micro_batch_size=mb, drop_last=case["loader_drop_last"])
    steps_per_epoch = per_epoch / grad_acc if case["carry_over"] else per_epoch // grad_acc
    if steps_per_epoch == 0:
        with pytest.raises(ConfigError, match="no"):
            resume_position(0, samples_per_rank=per_rank, micro_batch_size=mb,
                            gradient_accumulation_steps=grad_acc, drop_last=case["loader_drop_last"],
                            carry_over=case["carry_over"])
        return
    epochs = 4
    # Any step of the first three epochs, so that the resumed run crosses at least one epoch boundary.
    steps = int(case["steps_fraction"] * 3 * steps_per_epoch)
    remaining_by_rank = []
    for rank in range(world):
        full = _uninterrupted(n, world, rank, epochs=epochs, **common)
        start, resumed = _resumed(n, world, rank, steps, epochs=epochs, **common)
        consumed = steps * grad_acc
        assert resumed == full[consumed:], (start, rank)
        assert len(resumed) > 0
        used_per_epoch = per_epoch if case["carry_over"] else per_epoch // grad_acc * grad_acc
        rest_of_epoch = resumed[:used_per_epoch - start.batches_to_skip]
        remaining_by_rank.append({i for batch in rest_of_epoch for i in batch})
    # Ranks stay disjoint in the resumed epoch whenever the sampler does not pad with repeats.
    if case["sampler_drop_last"] or n % world == 0:
        for a in range(world):
            for b in range(a + 1, world):
                assert not remaining_by_rank[a] & remaining_by_rank[b]


def test_resume_position_worked_examples():
    # 50 samples per rank, batches of 4: 12 full batches and one of 2 (13 batches per epoch).
    assert resume_position(0, samples_per_rank=50, micro_batch_size=4) == ResumePosition(0, 0, 0)
    assert resume_position(12, samples_per_rank=50, micro_batch_size=4) == ResumePosition(0, 12, 48)
    assert resume_position(13, samples_per_rank=50, micro_batch_size=4) == ResumePosition(1, 0, 0)
    # The partial batch dropped: 12 batches per epoch.
    assert resume_position(13, samples_per_rank=50, micro_batch_size=4,
                           drop_last=True) == ResumePosition(1, 1, 4)
    # Accumulation 5 over 13 batches: step 3 spans the boundary (batches 10-12 of epoch 0, 0-1 of epoch 1).
    assert resume_position(3, samples_per_rank=50, micro_batch_size=4,
                           gradient_accumulation_steps=5) == ResumePosition(1, 2, 8)
    # Without carry-over an epoch holds 2 steps of 5 and its last 3 batches are not used.
    assert resume_position(3, samples_per_rank=50, micro_batch_size=4, gradient_accumulation_steps=5,
                           carry_over=False) == ResumePosition(1, 5, 20)


def test_batches_per_epoch_counts_the_last_partial_batch_unless_dropped():
    assert batches_per_epoch(10, micro_batch_size=3) == 4
    assert batches_per_epoch(10, micro_batch_size=3, drop_last=True) == 3
    assert batches_per_epoch(9, micro_batch_size=3) == 3
    assert batches_per_epoch(9, micro_batch_size=3, drop_last=True) == 3
    assert batches_per_epoch(0, micro_batch_size=3) == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps_completed=-1), "steps_completed=-1"),
    (dict(steps_completed=True), "steps_completed=True"),
    (dict(micro_batch_size=0), "micro_batch_size=0"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps=0"),
    (dict(samples_per_rank=3, drop_last=True), "holds no batch"),
    (dict(samples_per_rank=8, gradient_accumulation_steps=3, carry_over=False), "carry_over=True"),
])
def test_resume_position_rejects_impossible_inputs(kwargs, match):
    args = dict(steps_completed=1, samples_per_rank=10, micro_batch_size=4) | kwargs
    with pytest.raises(ConfigError, match=match):
        resume_position(args.pop("steps_completed"), **args)


def test_set_epoch_skip_is_checked_and_reset_by_the_next_epoch():
    sampler = ResumableDistributedSampler(list(range(20)), num_replicas=2, rank=1, seed=3)
    with pytest.raises(ConfigError, match="skip=11.*only 10 samples"):
        sampler.set_epoch(0, skip=11)
    with pytest.raises(ConfigError, match="epoch=-1"):
        sampler.set_epoch(-1)
    sampler.set_epoch(2, skip=4)
    whole = DistributedSampler(list(range(20)), num_replicas=2, rank=1, seed=3)
    whole.set_epoch(2)
    assert list(sampler) == list(whole)[4:] and len(sampler) == 10  # the epoch's length, not the rest
    sampler.set_epoch(3)
    whole.set_epoch(3)
    assert sampler.skip == 0 and list(sampler) == list(whole) and len(sampler) == 10
    with pytest.raises(ConfigError, match="seed=-1"):
        ResumableDistributedSampler(list(range(4)), num_replicas=1, rank=0, seed=-1)


def test_loader_generator_keeps_iteration_off_the_global_rng():
    dataset = list(range(16))
    # The pitfall: a plain DataLoader draws from the global torch RNG at every iter(), even with
    # num_workers=0, so a run resumed mid-epoch would shift every later random number.
    plain = DataLoader(dataset, batch_size=4)
    state = torch.get_rng_state()
    iter(plain)
    assert not torch.equal(state, torch.get_rng_state())

    def base_seeds(resume_epoch):
        sampler = ResumableDistributedSampler(dataset, num_replicas=2, rank=0, seed=7)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, generator=sampler.loader_generator)
        seeds = []
        for epoch in range(resume_epoch, 3):
            sampler.set_epoch(epoch, skip=4 if epoch == resume_epoch else 0)
            before = torch.get_rng_state()
            it = iter(loader)
            assert torch.equal(before, torch.get_rng_state())
            seeds.append(it._base_seed)  # what DataLoader workers are seeded from
        return seeds

    # Same epoch, same worker seed, whether the run started at epoch 0 or resumed in epoch 2;
    # a new seed every epoch, as with a plain DataLoader.
    from_start = base_seeds(0)
    assert base_seeds(2) == from_start[2:]
    assert len(set(from_start)) == 3


def test_seed_everything_reproduces_python_numpy_and_torch_streams():
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    seed_everything(1234)
    first = draw()
    seed_everything(1234)
    assert draw() == first
    seed_everything(1235)
    assert draw() != first
    for bad in (-1, 2**32, 1.5, True, "1"):
        with pytest.raises(ConfigError, match="seed="):
            seed_everything(bad)


def test_seed_everything_deterministic_sets_the_gpu_switches_and_leaves_onednn_on():
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.mkldnn.enabled)
    try:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
        seed_everything(7)  # the default touches no switch
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
        seed_everything(7, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        # A user's op without a deterministic version warns, not fails.
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        # An exact CPU resume does not need oneDNN off (measured, see the docstring): keep its speed.
        assert torch.backends.mkldnn.enabled
        for bad in ("yes", 1, None):
            with pytest.raises(ConfigError, match="deterministic="):
                seed_everything(7, deterministic=bad)
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        torch.backends.mkldnn.enabled = saved[4]


@pytest.mark.parametrize("grad_acc", [1, 2])
def test_micro_batches_resume_mid_epoch_and_across_epochs(grad_acc):
    from toolkit import micro_batches
    data = list(range(21))

    def stream(steps_completed):
        sampler = ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=3, drop_last=True)
        loader = DataLoader(data, batch_size=2, sampler=sampler, drop_last=True,
                            generator=sampler.loader_generator)
        return micro_batches(loader, sampler, steps_completed=steps_completed,
                             gradient_accumulation_steps=grad_acc)

    whole = [next(batches).tolist() for batches in [stream(0)] for _ in range(30)]
    # 10 samples a rank, 5 micro-batches an epoch: 30 span six epochs, each in its own order.
    assert whole[:5] != whole[5:10]
    for steps in (1, 2, 3, 7):
        resumed = stream(steps)
        assert [next(resumed).tolist() for _ in range(10)] == whole[steps * grad_acc:steps * grad_acc + 10]


def test_micro_batches_wrong_arguments_are_explained():
    from toolkit import micro_batches
    data = list(range(8))
    with pytest.raises(TypeError, match="ResumableDistributedSampler"):
        plain = DistributedSampler(data, num_replicas=1, rank=0)  # type: ignore[arg-type]  # list is a Dataset
        next(micro_batches(DataLoader(data, batch_size=2), plain, steps_completed=0))  # type: ignore[arg-type]
    sampler = ResumableDistributedSampler(data, num_replicas=1, rank=0)
    with pytest.raises(TypeError, match="batch_size is None"):
        next(micro_batches(DataLoader(data, batch_size=None, sampler=sampler), sampler, steps_completed=0))
