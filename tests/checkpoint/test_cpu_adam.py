"""toolkit.checkpoint.cpu_adam: DeepSpeed's CPU FusedAdam kernel, run for real in this process.

The kernel's step state is one C++ object per process, shared by every FusedAdam instance: an
optimizer reloaded in this process after another one ran further takes the same ``pow`` path as
one in a new process, so the defect and its repair show without launching processes. (The
2-rank, new-process version through toolkit.load_checkpoint, ZeRO 0-3 and pipeline, is
tests/checkpoint/test_exact_resume.py.)
"""

import copy
import logging
from types import SimpleNamespace

import numpy as np
import torch

from toolkit.checkpoint.cpu_adam import replay_cpu_adam_state

RESUME_AT, STEPS, SIZE = 20, 26, 4096


def _grad(step):
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(1000 + step))


def _run(optimizer, param, start, stop):
    for step in range(start, stop):
        param.grad = _grad(step)
        optimizer.step()


def test_the_kernel_products_and_pow_really_differ_where_the_test_resumes():
    # The premise, in plain float32 arithmetic: beta2**21 by running product is not pow(beta2, 21).
    beta = np.float32(0.999)
    product = np.float32(1)
    for _ in range(RESUME_AT + 1):
        product = np.float32(product * beta)
    assert product != np.float32(np.float64(beta) ** (RESUME_AT + 1))


def test_replay_makes_a_reloaded_fused_adam_continue_bitwise():
    from deepspeed.ops.adam import FusedAdam

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(SIZE))
    original = FusedAdam([param], lr=1e-3, betas=(0.9, 0.999))
    assert original._dummy_overflow_buf.device.type == "cpu"  # the CPU build, the one with the state
    _run(original, param, 0, RESUME_AT)
    saved_param, saved_state = param.detach().clone(), copy.deepcopy(original.state_dict())
    _run(original, param, RESUME_AT, STEPS)
    expected = param.detach().clone()

    def resumed(*, replay):
        again = torch.nn.Parameter(saved_param.clone())
        optimizer = FusedAdam([again], lr=1e-3, betas=(0.9, 0.999))
        optimizer.load_state_dict(copy.deepcopy(saved_state))
        if replay:  # through an engine-like chain of wrappers, as DeepSpeed's ZeRO optimizers hold it
            engine = SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))
            assert replay_cpu_adam_state(engine) == RESUME_AT
        _run(optimizer, again, RESUME_AT, STEPS)
        return again.detach()

    without = resumed(replay=False)
    assert (without != expected).sum() > 0, "the defect did not show: the test would prove nothing"
    assert torch.equal(resumed(replay=True), expected)


def test_other_optimizers_and_fresh_ones_are_left_alone():
    from deepspeed.ops.adam import FusedAdam

    param = torch.nn.Parameter(torch.zeros(4))
    torch_adam = torch.optim.Adam([param])
    param.grad = torch.ones(4)
    torch_adam.step()
    assert replay_cpu_adam_state(torch_adam) == 0  # torch computes beta**step from the step
    assert replay_cpu_adam_state(FusedAdam([param])) == 0  # no step taken yet
    assert replay_cpu_adam_state(SimpleNamespace(optimizer=None)) == 0  # an engine without optimizer


def _zero3_step(optimizer, flats, grads):
    """What DeepSpeed's ZeRO-3 does per optimizer step: one base-optimizer step per sub-group, with
    only that sub-group's flat fp32 partition in its group (stage3.py ``_optimizer_step``)."""
    group = optimizer.param_groups[0]
    for flat, grad in zip(flats, grads, strict=True):
        flat.grad = grad
        group["params"] = [flat]
        optimizer.step()
        group["params"] = []


def test_replay_follows_zero3_sub_groups_although_its_groups_look_empty(caplog):
    from deepspeed.ops.adam import FusedAdam

    torch.manual_seed(0)
    sizes = (1000, 3000)

    def grads(step):
        return [_grad(step)[:size].clone() for size in sizes]

    flats = [torch.nn.Parameter(torch.randn(size)) for size in sizes]
    original = FusedAdam(list(flats), lr=1e-3, betas=(0.9, 0.999))
    original.param_groups[0]["params"] = []
    for step in range(RESUME_AT):
        _zero3_step(original, flats, grads(step))
    saved = [f.detach().clone() for f in flats]
    saved_state = {i: copy.deepcopy(original.state[f]) for i, f in enumerate(flats)}
    for step in range(RESUME_AT, STEPS):
        _zero3_step(original, flats, grads(step))
    expected = [f.detach().clone() for f in flats]

    def resumed(*, replay):
        again = [torch.nn.Parameter(t.clone()) for t in saved]
        optimizer = FusedAdam(list(again), lr=1e-3, betas=(0.9, 0.999))
        optimizer.param_groups[0]["params"] = []  # as after ZeRO-3's load_state_dict
        for i, flat in enumerate(again):
            optimizer.state[flat] = copy.deepcopy(saved_state[i])
        holder = SimpleNamespace(optimizer=optimizer, fp32_partitioned_groups_flat=again,
                                 sub_group_to_group_id={0: 0, 1: 0})
        if replay:
            assert replay_cpu_adam_state(SimpleNamespace(optimizer=holder)) == RESUME_AT
        with caplog.at_level(logging.WARNING, logger="toolkit.checkpoint.cpu_adam"):
            assert replay_cpu_adam_state(optimizer) == 0  # the bare base optimizer: nothing to go by
        assert "pass the engine" in caplog.text
        for step in range(RESUME_AT, STEPS):
            _zero3_step(optimizer, again, grads(step))
        return [f.detach() for f in again]

    assert not all(torch.equal(a, b) for a, b in zip(resumed(replay=False), expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(resumed(replay=True), expected, strict=True))
