"""Rebuild the hidden step state of DeepSpeed's CPU Adam kernels after a checkpoint load.

The kernels keep ``beta**step`` as running float32 products outside the checkpoint: without a
replay the first update after a resume is 1 ulp off and the weights drift. ``load_checkpoint``
calls :func:`replay_cpu_adam_state`; call it yourself only after ``engine.load_checkpoint``.
Why and how: docs/exact-resume.md (DeepSpeed's CPU Adam after a resume)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

__all__ = ["replay_cpu_adam_state"]

logger = logging.getLogger(__name__)


Group = dict[str, Any]


def _optimizers(engine_or_optimizer: Any) -> Iterator[tuple[Any, torch.optim.Optimizer]]:
    """``(holder, optimizer)`` for the optimizer and every optimizer it wraps (DeepSpeed's ZeRO,
    bf16 and fp16 wrappers keep the real one in ``.optimizer``), starting from an engine or an
    optimizer; ``holder`` is the object whose ``.optimizer`` it is (``None`` for the one given)."""
    seen: set[int] = set()
    holder, current = None, engine_or_optimizer
    if not isinstance(current, torch.optim.Optimizer):
        holder, current = current, getattr(current, "optimizer", None)
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.optim.Optimizer):
            yield holder, current
        holder, current = current, getattr(current, "optimizer", None)


def _step_of(state: Any) -> int | None:
    return int(state["step"]) if isinstance(state, dict) and "step" in state else None


def _schedule(holder: Any, optimizer: torch.optim.Optimizer) -> list[tuple[int, Group]]:
    """``(steps, group)`` per kernel call one step of the uninterrupted run made, in its order.

    ZeRO-3 hands its base optimizer the fp32 partitions only while it steps, one sub-group at a time,
    and keeps every ``param_groups[i]['params']`` empty otherwise: its sub-groups
    (``fp32_partitioned_groups_flat``, ``sub_group_to_group_id``) say which calls were made."""
    flats = getattr(holder, "fp32_partitioned_groups_flat", None)
    group_of = getattr(holder, "sub_group_to_group_id", None)
    schedule = []
    if flats is not None and group_of is not None:  # ZeRO stage 3: one kernel call per sub-group
        for sub_group, flat in enumerate(flats):
            # A sub-group stepped by another optimizer (partial offload's torch backup) has no state here.
            steps = _step_of(optimizer.state.get(flat))
            if steps:
                schedule.append((steps, optimizer.param_groups[group_of[sub_group]]))
        return schedule
    for group in optimizer.param_groups:
        stepped = [s for s in (_step_of(optimizer.state.get(p)) for p in group["params"]) if s]
        if stepped:
            schedule.append((max(stepped), group))
    return schedule


def _kernel_call(optimizer: torch.optim.Optimizer) -> Callable[[int, Group], None] | None:
    """One call of ``optimizer``'s CPU Adam kernel for a step and a group, on empty tensors (it
    updates the step state and touches no element), or ``None`` when it has no such kernel."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # deepspeed is loaded: an engine exists

    empty = torch.empty(0, dtype=torch.float32)
    if isinstance(optimizer, FusedAdam) and optimizer._dummy_overflow_buf.device.type == "cpu":
        # The CPU build keeps one kernel object per mode for the whole process. (The CUDA build
        # computes beta**step from the step each time: nothing hidden.)
        def call(step: int, group: Group) -> None:
            beta1, beta2 = group["betas"]
            optimizer.multi_tensor_adam(2048 * 32, optimizer._dummy_overflow_buf, [[empty]] * 4, group["lr"],
                                        beta1, beta2, group["eps"], step, optimizer.adam_w_mode,
                                        1 if group["bias_correction"] else 0, group["weight_decay"])
        return call
    if isinstance(optimizer, DeepSpeedCPUAdam):  # one kernel object per optimizer instance
        def call(step: int, group: Group) -> None:
            beta1, beta2 = group["betas"]
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                              group["weight_decay"], group["bias_correction"],
                                              empty, empty, empty, empty)
        return call
    return None


def replay_cpu_adam_state(engine_or_optimizer: Any) -> int:
    """Bring DeepSpeed's CPU Adam kernels to the state an uninterrupted run has. Call on all ranks.

    Each rank replays its own kernels (no collective), once, right after a checkpoint with optimizer
    states was loaded into a fresh engine and before the next ``engine.step()``: that run's calls, per
    parameter group at ZeRO 0-2, per sub-group at ZeRO 3 (pass the engine or its wrapper there, not
    the bare base optimizer). Other optimizers are left alone. Returns the steps replayed.

    Example (``torchrun --nproc_per_node 2 train.py``)::

        engine.load_checkpoint("checkpoints")
        toolkit.replay_cpu_adam_state(engine)
    """
    replayed = 0
    for holder, optimizer in _optimizers(engine_or_optimizer):
        call = _kernel_call(optimizer)
        schedule = _schedule(holder, optimizer) if call is not None else []
        if call is None or not schedule:
            if call is not None and any(_step_of(state) for state in optimizer.state.values()):
                logger.warning("%s has stepped states but none in its parameter groups (a ZeRO-3 base "
                               "optimizer?): pass the engine to replay_cpu_adam_state; nothing replayed",
                               type(optimizer).__name__)
            continue
        steps = max(s for s, _ in schedule)
        # The calls the uninterrupted run made: at each step 1..N, each stepped group (ZeRO-3: each
        # sub-group) in order. A group with other betas sends the kernel down its pow path, as it
        # did in that run; repeated calls with one step leave the state alone, as they did.
        for step in range(1, steps + 1):
            for group_steps, group in schedule:
                if step <= group_steps:
                    call(step, group)
        logger.debug("replayed %d steps of %s's CPU kernel state", steps, type(optimizer).__name__)
        replayed = max(replayed, steps)
    return replayed
