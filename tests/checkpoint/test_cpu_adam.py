"""toolkit.checkpoint.cpu_adam: DeepSpeed's CPU FusedAdam kernel, run for real in this process.

The kernel's step state is one C++ object per process, shared by every FusedAdam instance: an
optimizer reloaded in this process after another one ran further takes the same ``pow`` path as
one in a new process, so the defect and its repair show without launching processes. (The
2-rank, new-process version through toolkit.load_checkpoint is in tests/checkpoint/test_api.py.)
"""

import copy
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
