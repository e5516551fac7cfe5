"""Rebuild the hidden step state of DeepSpeed's CPU Adam kernels after a checkpoint load.

DeepSpeed's CPU Adam kernels (``FusedAdam`` on the CPU accelerator, which ``"optimizer": {"type":
"Adam"}`` selects there, and ``DeepSpeedCPUAdam``, which ZeRO-Offload selects on every accelerator)
keep the bias-correction terms ``beta1**step`` and ``beta2**step`` as *running float32 products*
inside a C++ object that lives for the whole process (``Adam_Optimizer::IncrementStep`` in
``deepspeed/ops/csrc/includes/cpu_adam.h``): a step that follows the previous one multiplies by
``beta``, any other step (the first one after a resume, in a new process) computes
``std::pow(beta, step)`` instead. The two round differently, so the first update after a resume
uses a bias correction 1 ulp off and the weights drift from the uninterrupted run's, although
the checkpoint restored every saved tensor exactly (for ``beta2=0.999`` the running product and
``pow`` differ at most steps, 19 to 36 among them). None of this is in DeepSpeed's checkpoint.

:func:`replay_cpu_adam_state` drives those kernels through steps ``1 .. step`` on empty tensors, the
same calls the uninterrupted run made, so their running products end bitwise where that run's did,
at a cost of microseconds per replayed step. :func:`toolkit.load_checkpoint` calls it; call it
yourself only after loading with ``engine.load_checkpoint`` directly. It assumes each parameter
group's betas did not change up to the checkpoint: with a momentum schedule (DeepSpeed's
``OneCycle`` with ``cycle_momentum``) the first steps after a resume may still round differently.
Other optimizers (``torch.optim``, CUDA ``FusedAdam``) compute ``beta**step`` from the step at every
call, and CPU Lion and Adagrad keep no such product: they need nothing.

Example::

    # torchrun --nproc_per_node 2 train.py
    engine.load_checkpoint("checkpoints")          # DeepSpeed directly, on all ranks
    toolkit.replay_cpu_adam_state(engine)          # then this, on all ranks
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

__all__ = ["replay_cpu_adam_state"]

logger = logging.getLogger(__name__)


def _optimizers(engine_or_optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The optimizer and every optimizer it wraps (DeepSpeed's ZeRO, bf16 and fp16 wrappers keep
    the real one in ``.optimizer``), starting from an engine or an optimizer."""
    seen: set[int] = set()
    current = getattr(engine_or_optimizer, "optimizer", None) if not isinstance(
        engine_or_optimizer, torch.optim.Optimizer) else engine_or_optimizer
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.optim.Optimizer):
            yield current
        current = getattr(current, "optimizer", None)


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """The step count the kernel last saw: the largest ``step`` of the restored states."""
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    steps += [int(group["step"]) for group in optimizer.param_groups if "step" in group]
    return max(steps, default=0)


def _stepped_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [group for group in optimizer.param_groups if any(p in optimizer.state for p in group["params"])]


def _kernel_call(optimizer: torch.optim.Optimizer) -> Callable[[int, dict[str, Any]], None] | None:
    """One call of ``optimizer``'s CPU Adam kernel for a step and a group, on empty tensors (it
    updates the step state and touches no element), or ``None`` when it has no such kernel."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # deepspeed is loaded: an engine exists

    empty = torch.empty(0, dtype=torch.float32)
    if isinstance(optimizer, FusedAdam) and optimizer._dummy_overflow_buf.device.type == "cpu":
        # The CPU build keeps one kernel object per mode for the whole process. (The CUDA build
        # computes beta**step from the step each time: nothing hidden.)
        def call(step: int, group: dict[str, Any]) -> None:
            beta1, beta2 = group["betas"]
            optimizer.multi_tensor_adam(2048 * 32, optimizer._dummy_overflow_buf, [[empty]] * 4, group["lr"],
                                        beta1, beta2, group["eps"], step, optimizer.adam_w_mode,
                                        1 if group["bias_correction"] else 0, group["weight_decay"])
        return call
    if isinstance(optimizer, DeepSpeedCPUAdam):  # one kernel object per optimizer instance
        def call(step: int, group: dict[str, Any]) -> None:
            beta1, beta2 = group["betas"]
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                              group["weight_decay"], group["bias_correction"],
                                              empty, empty, empty, empty)
        return call
    return None


def replay_cpu_adam_state(engine_or_optimizer: Any) -> int:
    """Bring DeepSpeed's CPU Adam kernels to the state an uninterrupted run has. Call on all ranks.

    Each rank replays its own kernels; there is no collective. Call it once, right after a
    checkpoint (with optimizer states) was loaded into a freshly created engine and before the
    next ``engine.step()``. Optimizers other than DeepSpeed's CPU Adam kernels are left alone.

    Args:
        engine_or_optimizer: the engine from ``deepspeed.initialize`` or an optimizer (DeepSpeed's
            wrappers are unwrapped through their ``.optimizer``).

    Returns:
        The number of optimizer steps replayed (0 when there was nothing to do).

    Example::

        # torchrun --nproc_per_node 2 train.py
        engine.load_checkpoint("checkpoints")
        toolkit.replay_cpu_adam_state(engine)
    """
    replayed = 0
    for optimizer in _optimizers(engine_or_optimizer):
        call = _kernel_call(optimizer)
        steps, groups = _steps_taken(optimizer), _stepped_groups(optimizer)
        if call is None or steps == 0 or not groups:
            continue
        # The calls the uninterrupted run made: steps 1..N, each stepped group in order (a group
        # with other betas sends the kernel down its pow path, as it did in that run).
        for step in range(1, steps + 1):
            for group in groups:
                call(step, group)
        logger.debug("replayed %d steps of %s's CPU kernel state", steps, type(optimizer).__name__)
        replayed = max(replayed, steps)
    return replayed
